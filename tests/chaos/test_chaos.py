"""The chaos run: its seeded schedule, the checker of exactly-once, and one CI-sized run with kills.

The checker is specified on hand-made outcomes (each invariant broken once); the run kills every
service and the nats-server once in the middle of handoffs and must end with every invariant held.
The fuzz run sends hostile messages on every subject LiveR reads, each of which must be answered. The
long forms (``liver chaos --steps 60 --kills 24 --server-kills 4``, ``liver chaos --fuzz 10000``) are
reported in docs/benchmarks.md.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest

from liver.chaos.checker import Invariant, check
from liver.chaos.fuzz import SEMANTIC, Category, HostileMaker, channels, run_fuzz
from liver.chaos.run import ChaosConfig, ChaosError, ChaosRun, run_chaos, summary
from liver.chaos.schedule import SERVICES, ScheduleError, Stage, Target, make_schedule
from liver.services.coordinator.record import GenerationRecord
from liver.shared.layout import ParallelLayout, Placement, grid_devices
from liver.shared.messages import AbortOutcome, GenerationAborted, GenerationCommitted, HandoffPhase

NOW = datetime.datetime(2026, 12, 5, tzinfo=datetime.UTC)
JOB = "chaos"


def commit(
    generation: int, *event_ids: str, previous: int | None = None, nodes: int = 2
) -> GenerationCommitted:
    devices = grid_devices(nodes, 2)
    return GenerationCommitted(
        job_id=JOB,
        event_id=event_ids[0] if event_ids else "lost-worker",
        previous_generation=generation - 1 if previous is None else previous,
        generation=generation,
        layout=ParallelLayout(1, 1, len(devices)),
        placement=Placement(devices),
        started_at_iteration=0,
        downtime_s=0.1,
        bytes_moved=0,
        committed_at=NOW,
        event_ids=event_ids,
    )


def abort(generation: int, *event_ids: str, replanned: tuple[str, ...] = ()) -> GenerationAborted:
    return GenerationAborted(
        job_id=JOB,
        event_id=(event_ids or replanned)[0],
        generation=generation,
        active_generation=generation - 1,
        phase=HandoffPhase.PREPARE,
        reason="a newer event",
        outcome=AbortOutcome.KEPT_OLD_WORLD,
        aborted_at=NOW,
        event_ids=event_ids,
        replanned_event_ids=replanned,
    )


def record_of(last: GenerationCommitted) -> GenerationRecord:
    return GenerationRecord(
        job_id=JOB,
        writer="c1",
        generation=last.generation,
        layout=last.layout,
        placement=last.placement,
        issued=last.generation,
    )


# -- the schedule -------------------------------------------------------------------------------------


def test_one_seed_always_gives_the_same_schedule() -> None:
    assert make_schedule(7, steps=20, kills=9, server_kills=2) == make_schedule(
        7, steps=20, kills=9, server_kills=2
    )


def test_every_service_and_the_server_are_killed_as_often_as_asked() -> None:
    schedule = make_schedule(3, steps=12, kills=7, server_kills=2)
    targets = [kill.target for kill in schedule.kills]
    assert len(targets) == 7
    assert targets.count(Target.SERVER) == 2
    assert set(SERVICES) <= set(targets)


def test_a_restart_loss_is_a_kill_of_its_own_at_a_stage_the_coordinator_holds() -> None:
    schedule = make_schedule(5, steps=8, kills=6, server_kills=1, worker_kills=1, restart_losses=2)
    restarts = [kill for kill in schedule.kills if kill.target == Target.WORKER_IN_RESTART]
    assert len(restarts) == 2 and all(k.stage in (Stage.PREPARE, Stage.SWITCH) for k in restarts)
    assert [k.target for k in schedule.kills].count(Target.WORKER) == 1


@pytest.mark.parametrize(
    ("numbers", "field"),
    [
        ({"steps": 0, "kills": 0, "server_kills": 0}, "steps"),
        ({"steps": 3, "kills": 4, "server_kills": 0}, "kills"),
        ({"steps": 3, "kills": 2, "server_kills": 3}, "server_kills"),
        ({"steps": 3, "kills": 2, "server_kills": 1, "restart_losses": 2}, "restart_losses"),
        ({"steps": 3, "kills": 2, "server_kills": 0, "restart_losses": -1}, "restart_losses"),
    ],
)
def test_a_schedule_that_cannot_be_made_names_the_field(numbers: dict[str, int], field: str) -> None:
    with pytest.raises(ScheduleError, match=f"`{field}`"):
        make_schedule(1, **numbers)


# -- the checker --------------------------------------------------------------------------------------


def test_a_clean_run_violates_nothing() -> None:
    outcomes = [commit(1, "w-1"), abort(2, replanned=("g-2",)), commit(3, "g-2", previous=1)]
    assert check(["w-1", "g-2"], outcomes, record_of(outcomes[-1])) == []


def test_an_event_without_an_outcome_is_lost() -> None:
    outcomes = [commit(1, "w-1")]
    (violation,) = check(["w-1", "g-2"], outcomes, record_of(outcomes[-1]))
    assert violation.invariant == Invariant.ONE_OUTCOME and "'g-2' ended in 0" in violation.detail


def test_an_event_named_by_two_outcomes_ran_twice() -> None:
    outcomes = [commit(1, "g-1"), commit(2, "g-1")]
    (violation,) = check(["g-1"], outcomes, record_of(outcomes[-1]))
    assert violation.invariant == Invariant.ONE_OUTCOME and "generations [1, 2]" in violation.detail


def test_a_generation_committed_twice_is_a_violation() -> None:
    outcomes = [commit(1, "w-1"), commit(1, "w-2", previous=0)]
    found = {v.invariant for v in check(["w-1", "w-2"], outcomes, record_of(outcomes[-1]))}
    assert Invariant.COMMITTED_ONCE in found


def test_a_commit_that_does_not_follow_the_one_before_is_a_violation() -> None:
    outcomes = [commit(2, "w-1"), commit(3, "w-2", previous=0)]
    (violation,) = check(["w-1", "w-2"], outcomes, record_of(outcomes[-1]))
    assert violation.invariant == Invariant.INCREASING


def test_a_record_behind_the_last_commit_is_a_violation() -> None:
    outcomes = [commit(1, "w-1"), commit(2, "w-2", nodes=1)]
    (violation,) = check(["w-1", "w-2"], outcomes, record_of(outcomes[0]))
    assert violation.invariant == Invariant.RECORD and "generation 1" in violation.detail


def test_an_aborted_event_is_a_violation_but_a_replanned_one_is_not() -> None:
    outcomes = [commit(1, "w-1"), abort(2, "w-2"), abort(3, replanned=("w-3",)), commit(4, "w-3", previous=1)]
    (violation,) = check(["w-1", "w-2", "w-3"], outcomes, record_of(outcomes[-1]))
    assert violation.invariant == Invariant.NO_ABORT and "generation 2" in violation.detail


# -- a run --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kills_of_every_service_and_the_server_mid_handoff_leave_every_invariant_intact() -> None:
    schedule = make_schedule(1, steps=6, kills=5, server_kills=1)
    result = run_chaos(schedule, ChaosConfig(outcome_timeout_s=240.0))
    assert result.violations == []
    assert [step.outcome for step in result.steps] == ["committed"] * 6
    assert set(result.kills) == {target.value for target in (*SERVICES, Target.SERVER)}
    assert (result.dead_letters, result.error_events) == (0, 0)
    assert summary(result)["committed"] >= 6


@pytest.mark.slow
def test_the_command_names_a_bad_number_before_starting_anything() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "liver.cli.main", "chaos", "--steps", "2", "--kills", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--kills" in done.stderr


@pytest.mark.slow
def test_the_command_refuses_a_real_workers_flag_without_real_workers() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "liver.cli.main", "chaos", "--unreplicated-loss"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--workers real" in done.stderr


# -- the fuzz run -------------------------------------------------------------------------------------


def test_every_hostile_message_is_refused_by_the_codec_unless_only_the_ingester_can_judge_it() -> None:
    maker = HostileMaker(5)
    made = [maker.make(channel, i) for i in range(40) for channel in channels()]
    assert all(h is not None for h in made)
    by_subject = {channel.subject: channel for channel in channels()}
    for hostile in made:
        assert hostile is not None
        channel = by_subject[hostile.subject]
        assert (hostile.category in SEMANTIC) == channel.decodes(hostile.data), hostile


def test_the_hostile_messages_cover_every_category_and_subject() -> None:
    maker = HostileMaker(1)
    chans = channels()
    made = [maker.make(chans[i % len(chans)], i) for i in range(400)]
    assert {h.category for h in made if h is not None} == set(Category)
    assert {h.subject for h in made if h is not None} == {c.subject for c in chans}


def test_semantic_categories_go_to_the_public_subjects_only() -> None:
    maker = HostileMaker(2)
    for channel in channels():
        if not channel.public:
            assert all(maker.make(channel, i).category not in SEMANTIC for i in range(60))  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_hostile_message_is_answered_and_every_service_keeps_serving() -> None:
    result = run_fuzz(1, 240, answer_timeout_s=240.0)
    assert result.unanswered == []
    assert result.sent >= 230
    assert result.answered == result.expected_answers
    assert result.dead_lettered == result.expected_dead_letters
    assert result.unplanned_exits == {}
    assert sorted(result.services_answering) == sorted(t.value for t in SERVICES)
    assert result.resized_after and result.conflict_refused


def test_one_generation_published_with_two_different_outcomes_is_a_violation() -> None:
    """The stream keeps one outcome per generation (its message id), so only a live subscriber sees a
    second, different one."""
    outcomes = [commit(1, "w-1")]
    live = [commit(1, "w-1"), commit(1, "w-2")]
    found = check(["w-1"], outcomes, record_of(outcomes[-1]), live)
    assert [v.invariant for v in found] == [Invariant.COMMITTED_ONCE]


def test_a_log_directory_holding_an_earlier_runs_store_is_refused(tmp_path: Path) -> None:
    (tmp_path / "jetstream").mkdir()
    with pytest.raises(ChaosError, match="earlier run"):
        ChaosRun(make_schedule(1, steps=1, kills=0, server_kills=0), ChaosConfig(), tmp_path)
