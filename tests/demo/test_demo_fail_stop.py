"""``liver demo --short --fail-stop`` end to end: a worker killed without notice, the job moves live.

Two training workers as DP2 and one standby. The demo SIGKILLs node001's worker mid-training; the
survivor's next collective fails, it reports ``peer_lost``, the coordinator asks the world's workers
whether they are still there and finds the killed one gone at once (no subscriber left on the bus, not
a heartbeat timeout) and plans around the lost device;
node000's worker, which kept the state of the last step it completed, moves to DP1 on its own (no
checkpoint, no restart); then the scale request brings node002 in, as in the spot story.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from demo_helpers import Run, run_demo

from liver.demo.procs import leftovers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_demo(tmp_path_factory.mktemp("demo-fail-stop"), "--short", "--fail-stop")


def test_the_demo_exits_0_with_a_successful_result(demo: Run) -> None:
    done, result, _ = demo
    assert done.returncode == 0, f"{result.error}\n{done.stderr[-4000:]}"
    assert result.ok and result.scenario == "short-fail-stop"


def test_the_killed_workers_replica_recovers_live_then_capacity_comes_back(demo: Run) -> None:
    _, result, _ = demo
    recovery, scale_out = result.generations
    assert (recovery.generation, scale_out.generation) == (1, 2)
    assert recovery.trigger == "fail-stop node001" and scale_out.trigger.startswith("scale request")
    assert recovery.outcome == scale_out.outcome == "committed"
    assert (recovery.layout_before, recovery.layout_after) == ("TP1,PP1,DP2", "TP1,PP1,DP1")
    assert recovery.layout_after == scale_out.layout_before


def test_training_goes_on_from_the_last_completed_step_without_a_checkpoint(demo: Run) -> None:
    _, result, _ = demo
    iterations = [p.iteration for p in result.steps]
    assert iterations == list(range(1, len(iterations) + 1))  # no step lost, none repeated
    assert {p.generation for p in result.steps} == {0, 1, 2}
    assert all(math.isfinite(p.loss) for p in result.steps)
    recovery = result.generations[0]
    assert recovery.cut_iteration == max(p.iteration for p in result.steps if p.generation == 0)


def test_the_coordinator_finds_the_lost_worker_from_the_survivors_report(demo: Run) -> None:
    _, result, _ = demo
    log = (Path(result.out_dir) / "logs" / "service-coordinator.log").read_text()
    assert '"event":"world_lost_a_peer"' in log
    assert "has no connection to the bus (its process is gone)" in log  # the probe, not a timeout


def test_the_table_names_the_fail_stop(demo: Run) -> None:
    done, _, _ = demo
    assert "fail-stop node001" in done.stderr


def test_no_process_the_demo_started_is_left_behind(demo: Run) -> None:
    _, result, mark = demo
    assert result.leftovers == [] and leftovers(mark) == []


# -- --distributed-optimizer: the lost worker's optimizer shard exists nowhere else but in its peer copy ----


@pytest.fixture(scope="module")
def demo_dist_opt(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_demo(
        tmp_path_factory.mktemp("demo-dist-opt"), "--short", "--fail-stop", "--distributed-optimizer"
    )


def test_with_the_distributed_optimizer_the_job_still_recovers_live_without_a_checkpoint(
    demo_dist_opt: Run,
) -> None:
    done, result, _ = demo_dist_opt
    assert done.returncode == 0, f"{result.error}\n{done.stderr[-4000:]}"
    assert result.scenario == "short-fail-stop-distributed-optimizer"
    recovery = result.generations[0]
    assert recovery.trigger == "fail-stop node001" and recovery.outcome == "committed"
    iterations = [p.iteration for p in result.steps]
    assert iterations == list(range(1, len(iterations) + 1))  # no step lost, none repeated
    assert recovery.cut_iteration == max(p.iteration for p in result.steps if p.generation == 0)


def test_with_the_distributed_optimizer_the_lost_shard_comes_from_the_survivors_peer_copy(
    demo_dist_opt: Run,
) -> None:
    _, result, _ = demo_dist_opt
    log = (Path(result.out_dir) / "logs" / "w-node000-0.log").read_text()
    cut = result.generations[0].cut_iteration
    assert f'"generation":0,"rank":1,"iteration":{cut},"event":"copies.stand_in"' in log
