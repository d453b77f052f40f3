"""A process lost outside any handoff: the survivors keep their state and move live.

One real Megatron job of four processes trains tiny-gpt at TP2,PP1,DP2 (replica A on p0,p1, replica B
on p2,p3). p3 dies (``os._exit``), in one run inside its third step (in its second micro-batch's
forward, while its TP peer waits on it in a collective), in another as that step's optimizer step
begins (after every collective with replica A: only the trainer's commit vote keeps replica A from
updating while replica B cannot), in another right after its second step, before the boundary's vote
(the cut), in another at that moment while a handoff to TP1,PP1,DP3 on p1-p3 is prepared (its new
trainer built, its switch not yet allowed: generation 1, dropped), and in the last while it streams its
state in a handoff whose cut is the end of step 2 (generation 1: TP2,PP1,DP2 on p1-p4, p0 leaving and a
fifth process p4 joining; it never commits), and in the last right after its second step while that
same handoff's switch is allowed and its joiner waits to enter (the cut would be the boundary's vote:
the joiner's entry breaks, and it must not read as a failure of the handoff). The survivors:

- notice within moments (in a collective with p3, or when a peer that noticed lets go of the world's
  groups) and give the step (or the vote, or the handoff) up with their state as the end of step 2
  left it;
- are handed the recovery request (what the coordinator sends: a plan made around the lost device,
  here TP1,PP1,DP3 on p0-p2, or on p1, p2 and the joiner p4 after the lost handoff; replica B's half on
  p3 is gone, replica A has everything) and move to it without the old world's groups, streaming from
  the survivors (the joiner of the lost handoff hears that the old world recovers live and waits for
  the recovery, which takes it in);
- train on from iteration 2 with the same global batch and data position.

The state right after the recovery equals, bit for bit, the state at the end of step 2 (gathered from
replica A before the kill); the loss trace afterwards equals a fresh TP1,PP1,DP3 job that loads that
state, and one that loads a ``dist_checkpointing`` checkpoint of it.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any

import pytest
from live_chain import (
    DEVICES,
    Chain,
    Reload,
    as_numpy,
    baseline_process,
    bit_identical,
    gather,
    next_trainer,
)
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.reshard.plan import Plan, WorldConfig
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS
from liver.worker_runtime.megatron.train_config import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CONFIG = TrainConfig(global_batch_size=6, micro_batch_size=1, seq_length=16)
OLD = ParallelLayout(tp=2, pp=1, dp=2)
NEW = ParallelLayout(tp=1, pp=1, dp=3)
PROCESSES = 4
VICTIM = 3
KILLED_IN = 3  # the step the victim dies in
STEPS_AFTER = 2  # steps on the new world
CHAIN = Chain(
    job="fail-stop",
    model=PRESETS["tiny-gpt"],
    config=CONFIG,
    start=OLD,
    start_processes=(0, 1, 2, 3),
    transitions={},
)


RECOVERY = {"mid-step": 1, "update": 1, "vote": 1, "prepared": 2, "stream": 2, "switched": 2}
WITH_JOINER = ("stream", "switched")
"""The recovery's generation: after a lost handoff, the one after the handoff's."""
JOINER = PROCESSES  # p4: in no world until the stream run's handoff, then in its recovery


def recovery_plan(when: str) -> Plan:
    from liver.reshard.planner import plan_resize

    old = WorldConfig(OLD, Placement(DEVICES[:PROCESSES]))
    survivors = [d for i, d in enumerate(DEVICES[:PROCESSES]) if i != VICTIM]
    if when in WITH_JOINER:  # p0 leaves, the lost handoff's joiner comes in
        survivors = [DEVICES[1], DEVICES[2], DEVICES[JOINER]]
    return plan_resize(
        CHAIN.geometry, old, NEW, survivors, budget_bytes=256 * 1024, lost=[DEVICES[VICTIM]]
    ).plan


def handoff_plan(when: str) -> Plan:
    """The handoff p3 dies in (stream run: TP2,PP1,DP2 on p1-p4, p0 leaving, p4 joining), or dies before
    (prepared run: TP1,PP1,DP3 on p1-p3, p0 leaving, its new trainer built, its switch not allowed)."""
    from liver.reshard.planner import plan_resize

    old = WorldConfig(OLD, Placement(DEVICES[:PROCESSES]))
    if when == "prepared":
        return plan_resize(CHAIN.geometry, old, NEW, DEVICES[1:PROCESSES], budget_bytes=256 * 1024).plan
    return plan_resize(CHAIN.geometry, old, OLD, DEVICES[1 : JOINER + 1], budget_bytes=256 * 1024).plan


def _die_in_second_micro_batch(trainer: Any) -> None:
    """Make this process exit inside its next step, in the forward of its second micro-batch (after
    the first micro-batch's collectives, while its TP peer waits on it)."""
    original = trainer.forward_step
    calls = 0

    def dying(data_iterator: Any, model: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            os._exit(17)
        return original(data_iterator, model)

    trainer.forward_step = dying


def _die_at_the_update(trainer: Any) -> None:
    """Make this process exit as its next step's ``optimizer.step()`` begins: after the step's loss and
    gradient collectives, before the grad norm its TP peer then waits for. Its peer's replica has no
    collective with it left but the commit vote."""

    def dying(*args: Any, **kwargs: Any) -> Any:
        os._exit(17)

    trainer.optimizer.step = dying


def fail_stop_process(
    proc: Proc, plan: Plan, lost: Device, when: str, handoff: Plan | None
) -> dict[str, Any]:
    from live_chain import _quiet

    _quiet()
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.state import snapshot
    from liver.worker_runtime.peers import StepAbandoned
    from liver.worker_runtime.runtime import (
        LiveRuntime,
        ReshardPhase,
        ResizeRejected,
        RuntimeEvent,
        RuntimeOptions,
    )
    from liver.worker_runtime.world import StoreAddress, WorldSpec, live_generations

    device = DEVICES[proc.rank]
    address = StoreAddress("127.0.0.1", proc.store.port)
    factory = MegatronJob(CHAIN.model, CHAIN.config)
    out: dict[str, Any] = {"trace": [], "snapshots": {}, "progress": {}, "abandoned": None, "peer_lost": []}
    requested: list[int] = []
    generation = RECOVERY[when]

    def on_event(event: RuntimeEvent) -> None:
        if event.phase is ReshardPhase.PEER_LOST:
            out["peer_lost"].append(event.iteration)
            out["peer_lost_at"] = time.time()  # one clock: the processes share the machine
            if not requested:  # what the coordinator would send once it learns of the loss
                requested.append(1)
                try:  # a resize planned with every old device first: it cannot happen any more
                    if proc.rank != JOINER:  # (to a process in no world, it would be a join)
                        runtime.request_resize(generation, plan.new.layout, plan.new.placement, plan, address)
                except ResizeRejected as refused:
                    out["plain_request_refused"] = str(refused)
                # As the coordinator does: the Switch only once this process reported READY.
                runtime.request_resize(
                    generation,
                    plan.new.layout,
                    plan.new.placement,
                    plan,
                    address,
                    lost=(lost,),
                    switch_when_ready=False,
                )
        if event.phase is ReshardPhase.READY and event.generation == generation:
            threading.Thread(target=runtime.allow_switch, args=(generation,), daemon=True).start()

    def die_streaming(generation: int, layer: int, rnd: int) -> None:
        os._exit(17)

    runtime = LiveRuntime(
        factory,
        job=CHAIN.job,
        device=device,
        store=address,
        initial=WorldSpec(job=CHAIN.job, generation=0, layout=OLD, placement=Placement(DEVICES[:PROCESSES])),
        options=RuntimeOptions(control_timeout_s=120, build_timeout_s=180, recover_timeout_s=200),
        on_event=on_event,
        on_stream_step=die_streaming if proc.rank == VICTIM and when == "stream" else None,
    )
    if handoff is not None and proc.rank == JOINER:  # before it waits to be taken in
        runtime.request_resize(1, handoff.new.layout, handoff.new.placement, handoff, address)
    trainer = runtime.step()
    if trainer is not None and runtime.generation:  # the joiner, taken in by the recovery
        out["after"], out["after_iteration"] = as_numpy(snapshot(trainer)), trainer.iteration
    if handoff is not None and proc.rank != JOINER:
        # Built now; the vote after step 1 builds the new trainer, the cut is the end of step 2 (in the
        # prepared run never: the coordinator's SWITCH does not come before the loss).
        gated = when == "prepared"
        runtime.request_resize(
            1, handoff.new.layout, handoff.new.placement, handoff, address, switch_when_ready=not gated
        )
        assert runtime.wait_prepared(120), "the handoff's groups were not built"
    while trainer is not None and trainer.iteration < KILLED_IN + STEPS_AFTER - 1:
        if proc.rank == VICTIM and trainer.iteration == KILLED_IN - 1 and when == "mid-step":
            _die_in_second_micro_batch(trainer)
        if proc.rank == VICTIM and trainer.iteration == KILLED_IN - 1 and when == "update":
            _die_at_the_update(trainer)
        started = time.perf_counter()
        try:
            result = trainer.train_step()
        except StepAbandoned as abandoned:
            out["abandoned"] = {
                "iteration": abandoned.iteration,
                "torn": abandoned.torn,
                "reason": abandoned.reason,
                "noticed_s": time.perf_counter() - started,
                "again": _raises_again(trainer),
            }
            trainer = next_trainer(runtime, out)
            continue
        out["trace"].append((runtime.generation, result.iteration, result.loss, result.grad_norm))
        out["snapshots"][result.iteration] = as_numpy(snapshot(trainer))
        out["progress"][result.iteration] = factory.progress(trainer)
        if (
            proc.rank == VICTIM
            and result.iteration == KILLED_IN - 1
            and when in ("vote", "prepared", "switched")
        ):
            os._exit(17)  # after its step, before the boundary's vote
        trainer = next_trainer(runtime, out)
    out["history"] = [type(h).__name__ for h in runtime.history]
    out["generation"] = runtime.generation
    out["left"] = runtime.left
    out["live_generations"] = live_generations(CHAIN.job)
    report = runtime.last_switch
    out["report"] = None if report is None else {"pause_s": report.pause_s, "iteration": report.iteration}
    runtime.close()
    return out


def _raises_again(trainer: Any) -> bool:
    from liver.worker_runtime.peers import StepAbandoned

    try:
        trainer.train_step()
    except StepAbandoned:
        return True
    return False


_BASELINES: dict[str, dict[str, dict[int, list]]] = {}
"""Baseline traces by the state and progress they start from. Every run's survivors keep the end of the
same step of the same deterministic job, so the runs share one baseline job instead of starting six;
a run whose state differs in any bit gets its own."""


def _baseline(reload: Reload, checkpoints: str) -> dict[str, dict[int, list]]:
    digest = hashlib.sha256(reload.progress)
    for index in sorted(reload.state):
        digest.update(index.to_bytes(4, "little") + reload.state[index].tobytes())
    key = digest.hexdigest()
    if key not in _BASELINES:
        args = ([reload], checkpoints, CHAIN)
        outcomes = run_world(baseline_process, PROCESSES, args=args, timeout_s=240, group_timeout_s=90)
        _BASELINES[key] = outcomes[0].unwrap()
    return _BASELINES[key]


@pytest.fixture(scope="module", params=["mid-step", "update", "vote", "prepared", "stream", "switched"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    plan = recovery_plan(request.param)
    handoff = handoff_plan(request.param) if request.param in ("prepared", *WITH_JOINER) else None
    outcomes = run_world(
        fail_stop_process,
        PROCESSES + (request.param in WITH_JOINER),
        args=(plan, DEVICES[VICTIM], request.param, handoff),
        timeout_s=300,
        group_timeout_s=120,
    )
    victim = outcomes[VICTIM]
    survivors = {o.rank: o.unwrap() for o in outcomes if o.rank != VICTIM}
    before = gather({r: survivors[r]["snapshots"][KILLED_IN - 1] for r in (0, 1)}, OLD, CHAIN.geometry)
    new_rank = plan.new.placement.rank_on()
    after = gather(
        {new_rank[DEVICES[p]]: s["after"] for p, s in survivors.items() if DEVICES[p] in new_rank},
        NEW,
        CHAIN.geometry,
    )
    reload = Reload(1, OLD, NEW, before, survivors[0]["progress"][KILLED_IN - 1], STEPS_AFTER)
    traces = _baseline(reload, str(tmp_path_factory.mktemp("checkpoints")))
    return {
        "when": request.param,
        "plan": plan,
        "victim": victim,
        "survivors": survivors,
        "before": before,
        "after": after,
        "reload": traces["reload"][1],
        "checkpoint": traces["checkpoint"][1],
    }


def test_the_lost_process_is_gone_and_every_survivor_keeps_the_last_completed_iteration(runs: dict) -> None:
    assert runs["victim"].status == "died" and runs["victim"].exitcode == 17
    for rank, s in runs["survivors"].items():
        assert s["peer_lost"] == [KILLED_IN - 1], f"p{rank}: {s['peer_lost']}"


def test_a_broken_world_takes_only_a_recovery_that_names_the_lost_devices(runs: dict) -> None:
    for rank, s in runs["survivors"].items():
        if rank != JOINER:
            assert "only a recovery that names the lost devices" in s["plain_request_refused"]


def test_a_step_that_meets_the_loss_is_abandoned_with_its_state_kept(runs: dict) -> None:
    for s in runs["survivors"].values():
        if runs["when"] in ("vote", "prepared", *WITH_JOINER):  # no step met it: the vote or handoff did
            assert s["abandoned"] is None
            continue
        assert s["abandoned"]["iteration"] == KILLED_IN - 1
        assert not s["abandoned"]["torn"]


def test_a_broken_trainer_refuses_every_later_step(runs: dict) -> None:
    if runs["when"] in ("vote", "prepared", *WITH_JOINER):
        pytest.skip("no step met the loss")
    assert all(s["abandoned"]["again"] for s in runs["survivors"].values())


def test_survivors_notice_the_loss_within_moments_not_at_a_timeout(runs: dict) -> None:
    if runs["when"] != "mid-step":
        pytest.skip("timed in the mid-step run")
    # The groups' timeout is 120 s here; noticing takes a failed connection, or a peer letting go of the
    # world's groups (a survivor that kept its trainer alive would leave the others waiting for 120 s).
    slowest = max(s["abandoned"]["noticed_s"] for s in runs["survivors"].values())
    assert slowest < 60, slowest


def test_every_survivor_learns_of_the_loss_within_moments_of_the_first(runs: dict) -> None:
    # The groups' timeout is 120 s: a survivor that kept a reference to the broken world's groups (a
    # failure's traceback, the trainer) would leave its peers waiting in them that long.
    heard = [s["peer_lost_at"] for s in runs["survivors"].values()]
    assert max(heard) - min(heard) < 60, heard


def test_the_survivors_move_live_to_the_recovery_layout_without_a_checkpoint(runs: dict) -> None:
    generation = RECOVERY[runs["when"]]
    placed = runs["plan"].new.placement.devices
    for rank, s in runs["survivors"].items():
        stays = DEVICES[rank] in placed
        assert s["left"] == (not stays), rank
        assert s["generation"] == (generation if stays else None), rank
        # A handoff that lost its peer ends in the recovery: no abort, no fallback of its own.
        assert s["history"] == ["SwitchReport"], (rank, s["history"])
        assert s["live_generations"] == ((generation,) if stays else ()), rank
        assert s["report"]["iteration"] == KILLED_IN - 1


def test_a_handoff_prepared_before_the_loss_is_dropped_without_an_abort(runs: dict) -> None:
    if runs["when"] != "prepared":
        pytest.skip("no handoff was prepared")
    # An abort would be acked as this worker failing the handoff (the coordinator would then give it
    # up, or fall back once its switch was sent); the loss the coordinator learns instead re-plans it.
    for rank, s in runs["survivors"].items():
        assert s["history"] == ["SwitchReport"] and s["generation"] in (None, 2), rank


def test_the_state_after_the_recovery_equals_the_last_completed_step_bit_for_bit(runs: dict) -> None:
    assert bit_identical(runs["before"], runs["after"])
    placed = runs["plan"].new.placement.devices
    for rank, s in runs["survivors"].items():
        if DEVICES[rank] in placed:
            assert s["after_iteration"] == KILLED_IN - 1


def _recovered_trace(runs: dict) -> list[tuple[int, float, float]]:
    generation = RECOVERY[runs["when"]]
    first = DEVICES.index(runs["plan"].new.placement.devices[0])  # the new world's rank 0
    trace = runs["survivors"][first]["trace"]
    return [(it, loss, norm) for gen, it, loss, norm in trace if gen == generation]


def test_the_trace_after_the_recovery_equals_a_reload_of_that_state_at_the_new_layout(runs: dict) -> None:
    live = _recovered_trace(runs)
    assert [it for it, _, _ in live] == [KILLED_IN + i for i in range(STEPS_AFTER)]
    assert live == runs["reload"]


def test_the_trace_after_the_recovery_equals_a_checkpoint_of_that_state_loaded_at_the_new_layout(
    runs: dict,
) -> None:
    assert _recovered_trace(runs) == runs["checkpoint"]


# -- a DP=1 job: the lost process's state survives nowhere -----------------------------------------------

SOLO = ParallelLayout(tp=2, pp=1, dp=1)


def solo_process(proc: Proc) -> dict[str, Any]:
    """TP2,DP1 on two processes; p1 dies in its third step. p0 plays the coordinator: planning around
    the lost device fails (no replica holds p1's shard), so it aborts with a checkpoint fallback."""
    from live_chain import _quiet

    _quiet()
    from liver.reshard.planner import NoSurvivingSource, plan_resize
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.peers import StepAbandoned
    from liver.worker_runtime.runtime import (
        LiveRuntime,
        NoLiveRecovery,
        ReshardPhase,
        RuntimeEvent,
        RuntimeOptions,
    )
    from liver.worker_runtime.world import StoreAddress, WorldSpec

    placement = Placement(DEVICES[:2])
    out: dict[str, Any] = {"planning": None, "raised": None}

    def on_event(event: RuntimeEvent) -> None:
        if event.phase is not ReshardPhase.PEER_LOST:
            return
        old = WorldConfig(SOLO, placement)
        try:
            plan_resize(CHAIN.geometry, old, ParallelLayout(1, 1, 1), [DEVICES[0]], lost=[DEVICES[1]])
        except NoSurvivingSource as error:
            out["planning"] = str(error)
            runtime.abort(1, str(error), fallback=True)

    runtime = LiveRuntime(
        MegatronJob(CHAIN.model, CHAIN.config),
        job="fail-stop-solo",
        device=DEVICES[proc.rank],
        store=StoreAddress("127.0.0.1", proc.store.port),
        initial=WorldSpec(job="fail-stop-solo", generation=0, layout=SOLO, placement=placement),
        options=RuntimeOptions(control_timeout_s=120, build_timeout_s=180, recover_timeout_s=200),
        on_event=on_event,
    )
    trainer = runtime.step()
    started = time.perf_counter()
    try:
        while trainer is not None:
            if proc.rank == 1 and trainer.iteration == KILLED_IN - 1:
                _die_in_second_micro_batch(trainer)
            try:
                trainer.train_step()
            except StepAbandoned:
                started = time.perf_counter()
            trainer = runtime.step()
    except NoLiveRecovery as error:
        out["raised"] = {"iteration": error.iteration, "message": str(error)}
    out["seconds"] = time.perf_counter() - started
    return out


def test_a_loss_no_replica_covers_ends_the_wait_at_the_coordinators_fallback_with_the_reason() -> None:
    outcomes = run_world(solo_process, 2, timeout_s=240, group_timeout_s=120)
    assert outcomes[1].status == "died"
    survivor = outcomes[0].unwrap()
    assert survivor["planning"] is not None and "lost" in survivor["planning"]
    raised = survivor["raised"]
    assert raised is not None and raised["iteration"] == KILLED_IN - 1
    assert survivor["planning"] in raised["message"] and "checkpoint" in raised["message"]
    assert survivor["seconds"] < 60  # at the coordinator's word, not at recover_timeout_s (200 s)
