"""``liver bench copies``: the quick variant runs the job with and without peer copies for real and
reports self-consistent numbers (no wall-clock assertion: the 2% aim depends on the machine)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from typing import Any

import pytest

from liver.bench import copies as copies_bench


def _run(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    copies_bench.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = copies_bench.run(parser.parse_args(list(argv)))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    rc, out, _ = _run("--quick", "--json")
    assert rc == 0
    (line,) = out.splitlines()
    return json.loads(line)


@pytest.mark.slow
def test_both_sides_ran_the_same_job_and_only_one_made_copies(report: dict[str, Any]) -> None:
    assert report["distributed_optimizer"] and report["layout"] == "TP1,PP1,DP2"
    assert len(report["runs_with"]) == len(report["runs_without"]) == 1
    assert report["step_s_with"] > 0 and report["step_s_without"] > 0


@pytest.mark.slow
def test_the_overhead_is_the_ratio_of_the_steady_steps(report: dict[str, Any]) -> None:
    assert report["overhead"] == pytest.approx(report["step_s_with"] / report["step_s_without"] - 1)


@pytest.mark.slow
def test_each_process_sends_its_optimizer_shard_and_keeps_two_buffers_of_its_peers(report: dict) -> None:
    # tiny-gpt, fp32, DP2: each rank owns half of the two Adam moments (8 bytes per parameter).
    assert report["copy_bytes_per_process"] > 0
    assert report["kept_bytes_per_process"] == 2 * report["copy_bytes_per_process"]
    assert report["own_bytes_per_process"] == 0  # without --go-back, nothing of its own is kept


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--steps", "0"), "--steps"),
        (("--warmup", "9", "--steps", "8"), "--warmup"),
        (("--layout", "2x2"), "--layout"),
    ],
)
def test_a_bad_option_is_refused_before_any_process_starts_naming_the_flag(
    argv: tuple[str, ...], flag: str
) -> None:
    rc, out, err = _run(*argv)
    assert rc == 2 and out == ""
    assert f"liver bench copies: {flag}" in err
