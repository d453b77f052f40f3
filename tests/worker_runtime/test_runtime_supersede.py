"""A coordinator that restarts mid-handoff aborts generation N and prepares N + 1 at once; the ranks hear
the two commands at different boundaries. Specification: N is let go of on every rank (by the vote
where every rank built it), N + 1 is never refused and commits, a newer request supersedes one that was
never aborted, and no process ever holds more than the active world and one shadow world.

Two processes train the toy job of ``test_runtime`` (no Megatron: seconds, not minutes).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from mp_helpers import World as Proc
from mp_helpers import run_world
from test_runtime import DEVICES, DP2, JOB, PP2, TP2, ToyFactory, plan_between, world_config

from liver.reshard.plan import Plan
from liver.worker_runtime.runtime import ReshardPhase, RuntimeEvent, RuntimeOptions
from liver.worker_runtime.world import StoreAddress, WorldSpec

PEER_TIMEOUT_S = 120.0
MAX_ITERATIONS = 20_000

BUILT_THEN_RESTARTED, RE_PLANNED, NEVER_ABORTED, SUPERSEDING, LATE_ABORT = 1, 2, 3, 4, 5


def _process(proc: Proc, plans: dict[int, Plan]) -> dict[str, Any]:
    """Rank 0 hears every command at once; rank 1 a few boundaries later (or, for NEVER_ABORTED, only
    the newer Prepare that supersedes it)."""
    from liver.shared.logs import configure_logging
    from liver.worker_runtime.runtime import LiveRuntime
    from liver.worker_runtime.world import live_generations

    configure_logging(level="ERROR")
    address = StoreAddress("127.0.0.1", proc.store.port)
    events: list[RuntimeEvent] = []
    runtime = LiveRuntime(
        ToyFactory(),
        job=JOB,
        device=DEVICES[proc.rank],
        store=address,
        initial=WorldSpec(job=JOB, generation=0, layout=DP2, placement=world_config(DP2, 0, 1).placement),
        options=RuntimeOptions(control_timeout_s=PEER_TIMEOUT_S, build_timeout_s=PEER_TIMEOUT_S),
        on_event=events.append,
    )
    late = 0 if proc.rank == 0 else 4  # boundaries rank 1 hears later than rank 0

    def request(g: int) -> None:
        plan = plans[g]
        runtime.request_resize(g, plan.new.layout, plan.new.placement, plan, address, switch_when_ready=False)

    def heard(g: int, phase: ReshardPhase) -> bool:
        return any(e.generation == g and e.phase is phase for e in events)

    todo: dict[int, list[Any]] = {}  # iteration -> actions due then

    def at(iteration: int, action: Any) -> None:
        if iteration <= trainer.iteration:
            action()
        else:
            todo.setdefault(iteration, []).append(action)

    out: dict[str, Any] = {"max_live": 0, "switched_at": {}, "stages": []}
    began = time.monotonic()
    trainer = runtime.step()
    assert trainer is not None
    request(BUILT_THEN_RESTARTED)
    stage = "wait-built"
    end_at = MAX_ITERATIONS
    while trainer is not None and trainer.iteration < MAX_ITERATIONS:
        it = trainer.iteration
        for action in todo.pop(it, []):
            action()
        if stage == "wait-built" and heard(BUILT_THEN_RESTARTED, ReshardPhase.READY):
            # The restarted coordinator: Abort 1, then Prepare 2, planned from the world still training.
            at(it + late, lambda: runtime.abort(BUILT_THEN_RESTARTED, "restarted before the switch"))
            at(it + late + 1, lambda: request(RE_PLANNED))
            stage = "wait-2"
        elif stage == "wait-2" and heard(RE_PLANNED, ReshardPhase.READY):
            runtime.allow_switch(RE_PLANNED)
            stage = "switching-2"
        elif stage == "switching-2" and runtime.generation == RE_PLANNED:
            request(NEVER_ABORTED)
            # Rank 0 hears a newer Prepare at once; rank 1 only later, and never an Abort of 3.
            at(it + late, lambda: request(SUPERSEDING))
            stage = "wait-4"
        elif stage == "wait-4" and heard(SUPERSEDING, ReshardPhase.READY):
            runtime.allow_switch(SUPERSEDING)
            stage = "switching-4"
        elif stage == "switching-4" and runtime.generation == SUPERSEDING:
            request(LATE_ABORT)  # given up before it is built: rank 1 at once, rank 0 later
            at(it + (4 if proc.rank == 0 else 0), lambda: runtime.abort(LATE_ABORT, "operator"))
            end_at = it + 12  # the same iteration on both ranks: they stop together
            stage = "wait-5-gone"
        elif stage == "wait-5-gone" and it >= end_at:
            break
        if not out["stages"] or out["stages"][-1][0] != stage:
            out["stages"].append((stage, it, round(time.monotonic() - began, 2)))
        trainer.train_step()
        time.sleep(0.002)
        generation = runtime.generation
        trainer = runtime.step()
        out["max_live"] = max(out["max_live"], len(live_generations(JOB)))
        if runtime.generation != generation and trainer is not None:
            out["switched_at"][runtime.generation] = trainer.iteration
    out["generation"] = runtime.generation
    out["aborts"] = [msgspec.to_builtins(a) for a in runtime.aborts]
    out["errors"] = [e.abort.reason for e in events if e.phase is ReshardPhase.ABORTED and e.abort]
    runtime.close()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    start = world_config(DP2, 0, 1)
    tp2, pp2, dp2 = world_config(TP2, 1, 0), world_config(PP2, 0, 1), world_config(DP2, 1, 0)
    plans = {
        BUILT_THEN_RESTARTED: plan_between(start, tp2),
        RE_PLANNED: plan_between(start, pp2),
        NEVER_ABORTED: plan_between(pp2, tp2),
        SUPERSEDING: plan_between(pp2, dp2),
        LATE_ABORT: plan_between(dp2, tp2),
    }
    return [o.unwrap() for o in run_world(_process, 2, args=(plans,), timeout_s=240)]


def _aborted(run: dict[str, Any]) -> dict[int, bool]:
    return {a["generation"]: a["by_request"] for a in run["aborts"]}


@pytest.mark.slow
def test_a_prepare_after_an_abort_of_a_built_generation_commits_on_every_rank(runs: list) -> None:
    assert [r["switched_at"][RE_PLANNED] for r in runs] == [runs[0]["switched_at"][RE_PLANNED]] * 2
    # Rank 0 heard the Abort; rank 1 let go of generation 1 at the vote rank 0 failed it in.
    assert [BUILT_THEN_RESTARTED in _aborted(r) for r in runs] == [True, True]
    assert _aborted(runs[0])[BUILT_THEN_RESTARTED]


@pytest.mark.slow
def test_a_newer_prepare_supersedes_a_generation_never_aborted_and_commits(runs: list) -> None:
    assert [r["generation"] for r in runs] == [SUPERSEDING, SUPERSEDING]
    assert all(_aborted(r)[NEVER_ABORTED] for r in runs)
    assert all("superseded by generation 4" in " ".join(r["errors"]) for r in runs)


@pytest.mark.slow
def test_an_abort_heard_at_different_boundaries_lets_go_of_the_generation_everywhere(runs: list) -> None:
    assert all(_aborted(r).get(LATE_ABORT) is True for r in runs)
    assert all(LATE_ABORT not in r["switched_at"] for r in runs)


@pytest.mark.slow
def test_no_process_ever_holds_more_than_the_active_and_one_shadow_world(runs: list) -> None:
    assert [r["max_live"] <= 2 for r in runs] == [True, True]
