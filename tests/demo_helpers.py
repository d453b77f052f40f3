"""Running ``liver demo`` as a user does (a subprocess, no NATS installed), for the demo tests."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import msgspec

from liver.demo.procs import MARK_ENV
from liver.demo.summary import DemoResult

DEMO_LIMIT_S = 900
"""The demo's own limit (``--timeout``): past it, it stops everything and reports the failure. Generous:
on a busy two-core machine its processes take several times as long as on an idle one."""
DEMO_TIMEOUT_S = 1020
"""The subprocess's: a demo that does not end by itself is killed (its children die with it)."""

Run = tuple[subprocess.CompletedProcess[str], DemoResult, str]
"""The finished process, its decoded JSON result, and the mark its processes carried."""


def run_demo(out: Path, *flags: str) -> Run:
    """``liver demo --json --out OUT *flags``, its processes marked so that leftovers can be found."""
    mark = f"test-demo-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, MARK_ENV: mark}
    env.pop("NATS_URL", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "liver.cli.main",
            "demo",
            *flags,
            "--json",
            "--out",
            str(out),
            "--timeout",
            str(DEMO_LIMIT_S),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
    )
    assert done.stdout.strip(), f"no JSON on stdout; stderr:\n{done.stderr[-4000:]}"
    result = msgspec.json.decode(done.stdout.strip().splitlines()[-1], type=DemoResult)
    return done, result, mark
