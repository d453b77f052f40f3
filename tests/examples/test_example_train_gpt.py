"""The README's runnable example, `examples/train_gpt.py`, trains and reshards live under torchrun using
only the names `liver` exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from repo_paths import EXAMPLES

EXAMPLE = EXAMPLES / "train_gpt.py"


@pytest.mark.slow
@pytest.mark.timeout(900)  # above the subprocess's own limit (600 s), which ends a stuck run
def test_the_example_trains_reshards_live_and_keeps_training() -> None:
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"),
        *(
            str(EXAMPLE),
            "--tp",
            "2",
            "--pp",
            "2",
            "--steps",
            "6",
            "--reshard-at",
            "3",
            "--reshard-to",
            "2,1,1",
        ),
        *("--log-every", "1", "--json"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    steps = [(line["iteration"], line["layout"]) for line in lines if "iteration" in line]
    switches = [line["switch"] for line in lines if "switch" in line]
    assert len(switches) == 1 and switches[0]["bytes_received"] > 0
    cut = switches[0]["iteration"]  # the boundary all ranks agreed on, at or after the request
    assert 3 <= cut < 6
    assert steps == [(i, "TP2,PP2,DP1" if i <= cut else "TP2,PP1,DP1") for i in range(1, 7)]


def test_the_example_imports_only_from_the_package_face() -> None:
    source = EXAMPLE.read_text()
    imports = [
        line.strip()
        for line in source.splitlines()
        if line.strip().startswith(("from liver", "import liver"))
    ]
    assert imports and all(line.startswith("from liver import") for line in imports), imports
