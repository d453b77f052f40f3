"""``liver bench reconfig``: the quick variant runs both sides for real and reports self-consistent numbers.

No wall-clock assertions (the 25x aim depends on the machine): only that every phase was measured,
that each breakdown adds up to its total, and that both sides moved the same model at the same cut.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from typing import Any

import pytest
from repo_paths import EXAMPLES

from liver.bench import reconfig as reconfig_bench
from liver.bench.restart import PHASES

LIVE_PARTS = ("cut_skew_s", "switch_s", "transfer_s", "rebuild_s", "first_step_s")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    reconfig_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = reconfig_bench.run(_args(*argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def quick_run() -> tuple[int, str]:
    """One quick run (tiny-gpt, TP2 -> TP1 x PP2 on two processes) shared by the tests below."""
    rc, out, _ = _run("--quick", "--json")
    return rc, out


@pytest.fixture(scope="module")
def report(quick_run: tuple[int, str]) -> dict[str, Any]:
    return json.loads(quick_run[1])


@pytest.mark.slow
def test_the_quick_run_succeeds_and_prints_exactly_one_json_object(quick_run: tuple[int, str]) -> None:
    rc, out = quick_run
    assert rc == 0
    assert len(out.strip().splitlines()) == 1
    assert isinstance(json.loads(out), dict)


@pytest.mark.slow
def test_both_sides_move_the_same_model_between_the_same_layouts(report: dict[str, Any]) -> None:
    assert report["model"] == report["restart"]["model"] == "tiny-gpt"
    assert report["old_layout"] == report["restart"]["old_layout"] == "TP2,PP1,DP1"
    assert report["new_layout"] == report["restart"]["new_layout"] == "TP1,PP2,DP1"
    assert report["live"]["cut_iteration"] == report["restart"]["iteration"] >= report["steps_before"]


@pytest.mark.slow
def test_the_live_downtime_is_the_pause_plus_the_first_steps_excess_over_the_steady_step(
    report: dict[str, Any],
) -> None:
    live = report["live"]
    assert live["pause_s"] > 0 and live["steady_step_s"] > 0 and live["first_step_excess_s"] >= 0
    assert live["downtime_s"] == pytest.approx(live["pause_s"] + live["first_step_excess_s"], abs=1e-9)
    assert live["pause_s"] < live["cut_to_first_step_s"]


@pytest.mark.slow
def test_the_new_trainer_was_built_before_the_cut_and_that_stall_is_reported(report: dict[str, Any]) -> None:
    assert report["live"]["prebuild_s"] > 0
    with_stall = report["restart"]["downtime_s"] / (
        report["live"]["downtime_s"] + report["live"]["prebuild_s"]
    )
    assert report["ratio_with_prebuild"] == pytest.approx(with_stall)


@pytest.mark.slow
def test_the_earlier_definition_cut_to_first_step_is_kept_and_its_breakdown_adds_up_to_it(
    report: dict[str, Any],
) -> None:
    live = report["live"]
    for part in ("switch_s", "transfer_s", "rebuild_s", "first_step_s"):
        assert live[part] > 0, part
    assert live["cut_skew_s"] >= 0
    assert sum(live[p] for p in LIVE_PARTS) == pytest.approx(live["cut_to_first_step_s"], rel=1e-6, abs=1e-6)
    assert live["bytes_moved"] > 0 and live["processes"] == 2


@pytest.mark.slow
def test_the_restart_breakdown_is_positive_and_adds_up_to_its_total(report: dict[str, Any]) -> None:
    restart = report["restart"]
    for phase in PHASES:
        assert restart[f"{phase}_s"] > 0, phase
    total = sum(restart[f"{phase}_s"] for phase in PHASES)
    assert total == pytest.approx(restart["total_s"], rel=1e-6, abs=1e-6)
    assert restart["checkpoint_bytes"] > 0


@pytest.mark.slow
def test_the_restarts_downtime_is_its_pause_plus_the_first_steps_excess(report: dict[str, Any]) -> None:
    restart = report["restart"]
    assert restart["pause_s"] + restart["first_step_s"] == pytest.approx(restart["total_s"], abs=1e-9)
    assert restart["steady_step_s"] > 0 and restart["first_step_excess_s"] >= 0
    assert restart["downtime_s"] == pytest.approx(
        restart["pause_s"] + restart["first_step_excess_s"], abs=1e-9
    )


@pytest.mark.slow
def test_the_ratio_is_restart_over_live_and_the_aim_is_judged_on_it(report: dict[str, Any]) -> None:
    expected = report["restart"]["downtime_s"] / report["live"]["downtime_s"]
    assert report["ratio"] == pytest.approx(expected)
    earlier = report["restart"]["total_s"] / report["live"]["cut_to_first_step_s"]
    assert report["ratio_cut_to_first_step"] == pytest.approx(earlier)
    warm = report["restart_warm_s"]
    assert 0 < warm < report["restart"]["downtime_s"]
    assert report["ratio_warm"] == pytest.approx(warm / report["live"]["downtime_s"])
    (check,) = report["checks"]
    assert check["level"] == "aim"
    assert check["passed"] is (report["ratio"] >= reconfig_bench.AIM_RATIO)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--from", "2,x,1"), "--from"),
        (("--to", "2,1,1"), "--to"),
        (("--to", "1,1,8"), "--from/--to"),
        (("--model", "no-such-model"), "--model"),
        (("--large", "--model", "tiny-gpt"), "--large"),
        (("--steps-before", "0"), "--steps-before"),
        (("--threads", "0"), "--threads"),
        (("--steady-steps", "0"), "--steady-steps"),
        (("--provider", "examples/your_own_job.py:model_provider", "--max-seq", "64"), "--num-layers"),
        (("--provider", "no_such_module:fn", "--num-layers", "4", "--max-seq", "64"), "provider"),
        (("--provider", "m:f", "--model", "tiny-gpt"), "--large"),
    ],
)
def test_a_bad_option_is_refused_before_any_process_starts_naming_the_flag(
    argv: tuple[str, ...], flag: str
) -> None:
    rc, out, err = _run(*argv)
    assert rc == 2
    assert out == ""
    assert f"liver bench reconfig: {flag}" in err


@pytest.mark.slow
def test_a_users_own_model_is_measured_the_same_way() -> None:
    """The user's provider (examples/your_own_job.py, a QK-layernorm GPT) on both sides."""
    example = EXAMPLES / "your_own_job.py"
    rc, out, err = _run(
        *("--provider", f"{example}:model_provider", "--num-layers", "4", "--vocab-size", "258"),
        *("--divisible-by", "16", "--max-seq", "64", "--quick", "--json"),
    )
    assert rc == 0, err[-3000:]
    report = json.loads(out)
    assert report["model"] == "model_provider" and report["parameters"] > 0
    assert report["live"]["bytes_moved"] > 0 and report["restart"]["total_s"] > 0
    assert report["ratio"] == pytest.approx(report["restart"]["downtime_s"] / report["live"]["downtime_s"])


@pytest.mark.slow
def test_a_job_with_the_distributed_optimizer_is_measured_the_same_way() -> None:
    """DP2 -> TP2: the old DP ranks each own half of the optimizer state; live it moves piece by piece,
    the restart saves and loads it through the checkpoint."""
    rc, out, err = _run("--quick", "--json", "--distributed-optimizer", "--from", "1,1,2", "--to", "2,1,1")
    assert rc == 0, err[-3000:]
    report = json.loads(out)
    assert report["config"]["use_distributed_optimizer"] is True
    assert report["live"]["bytes_moved"] > 0 and report["restart"]["load_s"] > 0


# -- --fail-stop: a process lost mid-step, recovered live, against a checkpoint restart ------------------


@pytest.fixture(scope="module")
def fail_stop() -> dict[str, Any]:
    rc, out, err = _run("--fail-stop", "--quick", "--json")
    assert rc == 0, err[-3000:]
    return json.loads(out)


@pytest.mark.slow
def test_fail_stop_survivors_resume_after_the_last_completed_step_without_a_checkpoint(
    fail_stop: dict[str, Any],
) -> None:
    live = fail_stop["live"]
    assert fail_stop["old_layout"] == "TP2,PP1,DP2" and fail_stop["new_layout"] == "TP1,PP2,DP1"
    assert live["iteration"] == fail_stop["steps_before"] == fail_stop["restart"]["iteration"]
    assert (live["processes"], live["survivors"]) == (4, 3)
    assert all(c["passed"] for c in fail_stop["checks"] if c["level"] == "must")


@pytest.mark.slow
def test_fail_stop_downtime_is_the_pause_from_the_kill_plus_the_first_steps_excess(
    fail_stop: dict[str, Any],
) -> None:
    live = fail_stop["live"]
    assert 0 < live["noticed_s"] < live["pause_s"]
    parts = live["noticed_s"] + live["build_s"] + live["transfer_s"] + live["other_s"]
    assert parts == pytest.approx(live["pause_s"], abs=1e-6) or live["other_s"] == 0
    assert live["downtime_s"] == pytest.approx(live["pause_s"] + live["first_step_excess_s"])


@pytest.mark.slow
def test_fail_stop_compares_with_a_restart_that_does_not_count_the_earlier_checkpoint_save(
    fail_stop: dict[str, Any],
) -> None:
    restart = fail_stop["restart"]
    assert fail_stop["restart_downtime_s"] == pytest.approx(restart["downtime_s"] - restart["save_s"])
    ratio = fail_stop["restart_downtime_s"] / fail_stop["live"]["downtime_s"]
    assert fail_stop["ratio"] == pytest.approx(ratio)


def test_fail_stop_to_more_devices_than_survive_is_refused_naming_the_flag() -> None:
    rc, _, err = _run("--fail-stop", "--quick", "--from", "1,1,2", "--to", "2,1,1")
    assert rc == 2 and "--to" in err and "survive" in err


@pytest.fixture(scope="module")
def fail_stop_dist_opt() -> dict[str, Any]:
    rc, out, err = _run("--fail-stop", "--distributed-optimizer", "--quick", "--json")
    assert rc == 0, err[-3000:]
    return json.loads(out)


@pytest.mark.slow
def test_fail_stop_with_the_distributed_optimizer_recovers_the_lost_shard_from_its_peer_copy(
    fail_stop_dist_opt: dict[str, Any],
) -> None:
    report, live = fail_stop_dist_opt, fail_stop_dist_opt["live"]
    assert report["config"]["use_distributed_optimizer"] is True
    assert live["iteration"] == report["steps_before"] and live["from_copies"] == 1
    assert all(c["passed"] for c in report["checks"] if c["level"] == "must")


@pytest.mark.slow
def test_fail_stop_with_copies_reports_their_steady_cost_and_host_memory_in_the_same_run(
    fail_stop_dist_opt: dict[str, Any],
) -> None:
    copies, live = fail_stop_dist_opt["copies"], fail_stop_dist_opt["live"]
    assert copies["overhead"] == pytest.approx(copies["step_s_with"] / copies["step_s_without"] - 1)
    assert copies["kept_bytes_per_process"] == live["kept_bytes_per_process"] > 0


@pytest.mark.slow
def test_fail_stop_without_state_to_copy_measures_no_copies(fail_stop: dict[str, Any]) -> None:
    assert fail_stop["copies"] is None and fail_stop["live"]["from_copies"] == 0


# -- --fail-stop-at stream: the process lost in a handoff's stream ------------------------------------------


@pytest.fixture(scope="module")
def fail_stop_in_stream() -> dict[str, Any]:
    rc, out, err = _run("--fail-stop", "--fail-stop-at", "stream", "--quick", "--steps-before", "2", "--json")
    assert rc == 0, err[-3000:]
    return json.loads(out)


@pytest.mark.slow
def test_fail_stop_in_a_handoffs_stream_recovers_live_from_its_cut(
    fail_stop_in_stream: dict[str, Any],
) -> None:
    report, live = fail_stop_in_stream, fail_stop_in_stream["live"]
    assert report["at"] == "stream" and live["iteration"] == report["steps_before"] == 2
    assert (live["processes"], live["survivors"]) == (4, 3)
    assert 0 < live["noticed_s"] < live["pause_s"] <= live["downtime_s"]
    assert all(c["passed"] for c in report["checks"] if c["level"] == "must")


def test_fail_stop_in_a_stream_needs_two_steps_before_naming_the_flag() -> None:
    rc, _, err = _run("--fail-stop", "--fail-stop-at", "stream", "--quick", "--steps-before", "1")
    assert rc == 2 and "--steps-before" in err
