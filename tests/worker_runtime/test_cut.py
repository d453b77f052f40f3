"""The consistent cut: every rank of the active world switches at the same iteration, or none does."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.shared.layout import Device, ParallelLayout, Placement
from liver.worker_runtime.cut import NO_TARGET, CutError, CutVerdict, Readiness, SwitchGate, decide, vote
from liver.worker_runtime.world import GroupKind, StoreAddress, WorldSpec, build_world, build_world_async

JOB = "cuttest"
DEVICES = tuple(Device("n0", i) for i in range(3))
ACTIVE = WorldSpec(JOB, 0, ParallelLayout(tp=1, pp=1, dp=3), Placement(DEVICES))
SHADOW = WorldSpec(JOB, 1, ParallelLayout(tp=3, pp=1, dp=1), Placement(DEVICES[::-1]))
READY_FROM = {0: 3, 1: 11, 2: 7}  # each rank declares itself ready from this iteration on
TIMEOUT = timedelta(seconds=120)
"""For every rendezvous and vote that must succeed: a busy machine may keep a rank off the CPU a while."""


def _vote_vector(ready: int, failed: int, target: int, iteration: int) -> list[int]:
    return [ready, -failed, target, -target, iteration, -iteration]


# -- reading the reduced vote -------------------------------------------------------------------------


def test_all_ready_for_one_target_switches() -> None:
    assert decide(_vote_vector(Readiness.READY, 0, 4, 9)).verdict is CutVerdict.SWITCH
    assert decide(_vote_vector(Readiness.READY, 0, 4, 9)).target == 4


def test_one_rank_not_ready_waits() -> None:
    assert decide(_vote_vector(Readiness.NONE, 0, 4, 9)).verdict is CutVerdict.WAIT


def test_all_prepared_for_one_target_build_the_new_trainer_before_any_cut() -> None:
    assert decide(_vote_vector(Readiness.PREPARED, 0, 4, 9)).verdict is CutVerdict.BUILD


def test_built_ranks_wait_for_the_switch_to_be_allowed() -> None:
    assert decide(_vote_vector(Readiness.BUILT, 0, 4, 9)).verdict is CutVerdict.WAIT


def test_ranks_naming_different_targets_wait() -> None:
    # MIN over target is 3 and over -target is -4: some rank prepares 3, another 4.
    for readiness in (Readiness.PREPARED, Readiness.READY):
        decision = decide([readiness, 0, 3, -4, 9, -9])
        assert decision.verdict is CutVerdict.WAIT
        assert decision.target == NO_TARGET


def test_a_rank_without_a_target_cannot_switch() -> None:
    assert decide(_vote_vector(Readiness.READY, 0, NO_TARGET, 9)).verdict is CutVerdict.WAIT


def test_a_failed_rank_aborts_even_when_the_others_are_ready() -> None:
    assert decide([0, -1, 4, -4, 9, -9]).verdict is CutVerdict.ABORT


def test_votes_from_different_iterations_are_an_error() -> None:
    with pytest.raises(CutError, match="different iterations"):
        decide([1, 0, 4, -4, 9, -10])


# -- the cut in three processes -------------------------------------------------------------------


def _run_until_switch(gate: SwitchGate, rank: int, limit: int = 100) -> list[tuple[int, str]]:
    decisions = []
    for i in range(limit):
        decision = gate.at_boundary(i, also_ready=i >= READY_FROM[rank])
        decisions.append((i, str(decision.verdict)))
        if decision.verdict is CutVerdict.SWITCH:
            break
    return decisions


def cut_scenario(proc: Proc) -> dict[str, Any]:
    index, address = proc.rank, _quiet_child(proc)
    device = DEVICES[index]
    active = build_world(ACTIVE, device, address, timeout=TIMEOUT)
    out: dict[str, Any] = {}

    build = build_world_async(SHADOW, device, address, timeout=TIMEOUT)
    build.result(timeout=TIMEOUT.total_seconds())  # built first, so readiness depends on READY_FROM alone

    gate = SwitchGate(active, timeout=TIMEOUT)
    gate.prepare(build)
    out["every_iteration"] = _run_until_switch(gate, active.rank)
    sparse = SwitchGate(active, every=4, timeout=TIMEOUT)
    sparse.prepare(build)
    out["every_fourth"] = _run_until_switch(sparse, active.rank)
    out["shadow_rank"] = gate.shadow().rank

    rank = active.rank
    out["different_targets"] = str(vote(active, iteration=0, target=1 + (rank == 2), ready=True).verdict)
    out["one_failed"] = str(vote(active, iteration=0, target=1, ready=rank != 1, failed=rank == 1).verdict)
    try:
        vote(active, iteration=5 + (rank == 1), target=1, ready=True)
        out["iteration_mismatch"] = "no error"
    except CutError as error:
        out["iteration_mismatch"] = str(error)
    t = torch.ones(1)
    dist.all_reduce(t, group=active.group(GroupKind.WORLD))
    out["world_usable_after_error"] = float(t.item())
    gate.shadow().release()

    # A rank whose shadow cannot be built (its peers never come: a 0.3 s rendezvous times out).
    failing = None
    if rank == 1:
        lonely = WorldSpec(JOB, 2, ParallelLayout(tp=1, pp=1, dp=3), Placement(DEVICES))
        failing = build_world_async(lonely, device, address, timeout=timedelta(seconds=0.3))
        assert failing.wait(timeout=TIMEOUT.total_seconds())
        out["build_error"] = repr(failing.error)
    aborting = SwitchGate(active, timeout=TIMEOUT)
    if failing is not None:
        aborting.prepare(failing)
    decision = aborting.at_boundary(0)
    out["failed_build_verdict"] = str(decision.verdict)
    out["pending_after_abort"] = aborting.pending is not None
    active.release()
    return out


def _quiet_child(proc: Proc) -> StoreAddress:
    """In a child: log warnings only, and return the address of the store the test process hosts."""
    from liver.shared.logs import configure_logging

    configure_logging(level="WARNING")
    return StoreAddress("127.0.0.1", proc.store.port)


def _run(scenario: Any, size: int, timeout_s: float) -> list[Any]:
    return [outcome.unwrap() for outcome in run_world(scenario, size, timeout_s=timeout_s)]


@pytest.fixture(scope="module")
def cut() -> list[dict[str, Any]]:
    return _run(cut_scenario, 3, timeout_s=240.0)


@pytest.mark.slow
def test_ranks_ready_at_different_iterations_all_switch_at_the_same_one(cut: list[dict]) -> None:
    last_ready = max(READY_FROM.values())
    for rank in cut:
        assert rank["every_iteration"][-1] == (last_ready, "switch")
        assert {v for _, v in rank["every_iteration"][:-1]} == {"wait"}


@pytest.mark.slow
def test_sparse_votes_switch_at_the_first_voting_boundary_after_all_are_ready(cut: list[dict]) -> None:
    for rank in cut:
        assert rank["every_fourth"][-1] == (12, "switch")


@pytest.mark.slow
def test_the_gate_hands_over_this_ranks_shadow_world(cut: list[dict]) -> None:
    assert [r["shadow_rank"] for r in cut] == [2, 1, 0]


@pytest.mark.slow
def test_ranks_preparing_different_generations_do_not_switch(cut: list[dict]) -> None:
    assert {r["different_targets"] for r in cut} == {"wait"}


@pytest.mark.slow
def test_one_failed_rank_makes_every_rank_abort(cut: list[dict]) -> None:
    assert {r["one_failed"] for r in cut} == {"abort"}


@pytest.mark.slow
def test_votes_at_different_iterations_raise_on_every_rank(cut: list[dict]) -> None:
    for rank in cut:
        assert "different iterations" in rank["iteration_mismatch"]
        assert rank["world_usable_after_error"] == 3.0


@pytest.mark.slow
def test_a_failed_shadow_build_aborts_the_handoff_everywhere_and_is_dropped(cut: list[dict]) -> None:
    assert "timed out" in cut[1]["build_error"].lower() or "timeout" in cut[1]["build_error"].lower()
    assert {r["failed_build_verdict"] for r in cut} == {"abort"}
    assert not any(r["pending_after_abort"] for r in cut)
