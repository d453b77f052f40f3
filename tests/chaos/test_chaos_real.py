"""``liver chaos --workers real``, CI-sized: real training processes (the tiny Megatron GPT on CPU, one
``liver worker`` per device, two per node on three loopback nodes) under a coordinator killed in the
middle of a handoff, a training process killed without notice (once at a switch, once outside any
handoff, once at a switch while the coordinator is down), and a whole node killed without notice.

Specification, read back from the bus and the workers' own metrics: every event ends in exactly one
outcome, every spot warning in a commit that leaves the warned node, every loss in a live recovery
training again within the run's limit, iterations never go back (a recovery from a copy a step behind
trains that step again, once), and no worker exits non-zero unless
the run killed it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from liver.chaos.real import (
    RECOVERY_LIMIT_S,
    UNREPLICATED_LIMIT_S,
    RealResult,
    UnreplicatedLoss,
    run_real_chaos,
    run_unreplicated_loss,
)
from liver.chaos.run import ChaosConfig
from liver.chaos.schedule import Kill, Loss, Schedule, Stage, Step, Target

pytestmark = pytest.mark.slow

RESTART_AT_PREPARE = Kill(target=Target.COORDINATOR, stage=Stage.PREPARE, down_s=0.5)
KILL_AT_SWITCH = Kill(target=Target.WORKER, stage=Stage.SWITCH, down_s=0.5)
LOSS_IN_RESTART = Kill(target=Target.WORKER_IN_RESTART, stage=Stage.SWITCH, down_s=1.0)
SCHEDULE = Schedule(
    seed=0,
    steps=(
        # A spot warning for a node of the two-node world; the coordinator is killed as the Prepare goes
        # out and started again (it aborts that generation and prepares the next at once).
        Step(index=0, draw=0.2, burst=False, kill=RESTART_AT_PREPARE),
        Step(index=1, draw=0.9, burst=False),  # a scale request onto a node's standbys
        Step(index=2, draw=0.7, burst=False, loss=Loss.WORKER),  # kill -9 of one training process
        # The third node comes back; a training process of the staying world is killed as the Switch
        # goes out (the joiners' enter breaks on it: the survivors recover live around it).
        Step(index=3, draw=0.9, burst=False, kill=KILL_AT_SWITCH),
        Step(index=4, draw=0.7, burst=False, loss=Loss.NODE),  # kill -9 of every process of a node
        Step(index=5, draw=0.9, burst=False),  # a node comes back: the world has a replica again
        # The third node comes back; as the Switch goes out the coordinator is killed, and a training
        # process of the staying world while it is down: the restarted one learns of the loss from the
        # survivors (their heartbeats say their world broke; it asks every participant at once).
        Step(index=6, draw=0.9, burst=False, kill=LOSS_IN_RESTART),
    ),
)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> RealResult:
    log_dir = tmp_path_factory.mktemp("chaos-real")
    return run_real_chaos(
        SCHEDULE,
        ChaosConfig(nodes=3, outcome_timeout_s=120.0, settle_timeout_s=120.0),
        Path(log_dir),
        print,
        keep_fork_server=True,
    )


def test_every_step_ends_and_every_invariant_holds(result: RealResult) -> None:
    assert result.failure is None, result.failure
    assert [v.detail for v in result.violations] == []
    assert result.passed


def test_the_coordinator_killed_mid_handoff_costs_no_event(result: RealResult) -> None:
    first = result.steps[0]
    assert first.kill is not None and first.outcome == "committed"
    assert result.kills.get(Target.COORDINATOR.value) == 1


def test_every_loss_is_recovered_live_within_the_limit(result: RealResult) -> None:
    assert [loss.kind for loss in result.losses] == [Loss.WORKER, Loss.WORKER, Loss.NODE, Loss.WORKER]
    assert result.kills.get(Target.WORKER.value) == 1  # the one at the switch
    assert result.kills.get(Target.WORKER_IN_RESTART.value) == 1  # the one while the coordinator is down
    for loss in result.losses:
        assert loss.generation is not None and loss.training_s is not None
        assert loss.training_s < RECOVERY_LIMIT_S


def test_no_worker_exits_non_zero_unless_killed(result: RealResult) -> None:
    assert result.worker_exits and set(result.worker_exits.values()) == {0}


# -- a loss no replica covers: the survivor ends at once, it does not wait for nothing ---------------------


@pytest.fixture(scope="module")
def dp1_loss(tmp_path_factory: pytest.TempPathFactory) -> UnreplicatedLoss:
    """A TP2 job on one node (DP=1, no checkpoint): one of its two processes is killed after two steps."""
    log_dir = Path(tmp_path_factory.mktemp("chaos-real-dp1"))
    return run_unreplicated_loss(ChaosConfig(nodes=3), log_dir, print, keep_fork_server=True)


def test_a_loss_no_replica_covers_is_recovered_live_from_the_survivors_peer_copy(
    dp1_loss: UnreplicatedLoss,
) -> None:
    assert dp1_loss.recovered_live and dp1_loss.survivor_alive, dp1_loss
    assert dp1_loss.training_s is not None and dp1_loss.training_s < UNREPLICATED_LIMIT_S, dp1_loss


def test_no_checkpoint_fallback_is_decided_for_that_loss(dp1_loss: UnreplicatedLoss) -> None:
    assert dp1_loss.fallbacks == 0


def test_only_a_kill_inside_the_victims_copy_refresh_is_run_again(dp1_loss: UnreplicatedLoss) -> None:
    # The known gap (the copy a step behind the survivors): a new attempt, never a pass without recovery.
    from liver.chaos.real import ATTEMPTS

    assert dp1_loss.in_refresh < ATTEMPTS
    assert len(list(Path(dp1_loss.log_dir).glob("attempt-*"))) == dp1_loss.in_refresh + 1
