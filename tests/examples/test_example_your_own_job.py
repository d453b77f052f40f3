"""`examples/your_own_job.py`: a Megatron-core user's own script (their model provider, optimizer config,
LR schedule and Megatron's indexed datasets) trains under torchrun and reshards live, with LiveR added
in at most ten marked statements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

ROOT = REPO
EXAMPLE = ROOT / "examples" / "your_own_job.py"
CORPUS_TEXT = ROOT / "examples" / "data" / "corpus.txt"


@pytest.mark.slow
@pytest.mark.timeout(900)  # above the subprocess's own limit (600 s), which ends a stuck run
def test_the_users_own_job_trains_on_megatron_datasets_and_reshards_live(tmp_path: Path) -> None:
    prefix = tmp_path / "corpus"
    prepare = [sys.executable, "-m", "liver.cli.main", "data", "prepare"]
    done = subprocess.run(
        [*prepare, "--input", str(CORPUS_TEXT), "--output-prefix", str(prefix)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"),
        *(str(EXAMPLE), "--data", str(prefix), "--tp", "2", "--pp", "2", "--steps", "6"),
        *("--reshard-at", "3", "--reshard-to", "2,1,1", "--json"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    layouts = [(s["iteration"], s["layout"]) for s in steps]
    # Six steps at least, and on past them until the move (its new layout is checked beside training
    # first) has happened and a step ran on the new world.
    assert [i for i, _ in layouts] == list(range(1, len(layouts) + 1)) and len(layouts) >= 6
    cut = max(i for i, layout in layouts if layout == "TP2,PP2,DP1")
    assert 3 <= cut < len(layouts)
    assert all(layout == ("TP2,PP2,DP1" if i <= cut else "TP2,PP1,DP1") for i, layout in layouts)
    assert steps[-1]["loss"] < steps[0]["loss"]
    # The user's hooks: the old trainer at the cut, the new one after the switch, each once (rank 0).
    hooks = [line for line in done.stdout.splitlines() if line.startswith(("cut:", "switched:"))]
    assert hooks == [
        f"cut: generation 1 at iteration {cut} on TP2,PP2,DP1",
        f"switched: generation 1 at iteration {cut} on TP2,PP1,DP1",
    ]


def test_liver_takes_at_most_ten_marked_statements_of_the_users_script() -> None:
    source = EXAMPLE.read_text()
    marked = [line for line in source.splitlines() if "# LiveR" in line]
    assert 0 < len(marked) <= 10, marked
    imports = [
        line.strip()
        for line in source.splitlines()
        if line.strip().startswith(("from liver", "import liver"))
    ]
    assert imports and all(line.startswith("from liver import") for line in imports), imports
