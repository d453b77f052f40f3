"""``liver bench reconfig --fail-stop``: a process lost mid-step (or in a handoff's stream), recovered
live, against a checkpoint restart of the same job in the same run.

**Live** (:func:`measure_fail_stop`): ``old.world_size`` warm worker processes train through
:class:`~liver.worker_runtime.runtime.LiveRuntime`. In step ``steps_before + 1`` the last process
exits (``os._exit`` inside its first micro-batch's forward, after writing the moment into the job's
store): no notice, no checkpoint. The survivors' step fails, each keeps the state of the last
completed step (:class:`~liver.worker_runtime.peers.StepAbandoned`), hands in the recovery plan made
around the lost device (what the coordinator's ``Prepare`` carries; made once here by the planner) and
moves to ``new`` on the first ``new.world_size`` survivors. Downtime, as a user pays it: from the kill
to the new world ready to step (the latest survivor's hand-out), plus the first step's excess over the
new world's steady step. Without the bus, finding *which* process died costs nothing here; with it,
the coordinator needs up to its ``suspect_timeout_s`` (5 s by default) after the survivors' report.
With ``at=LossMoment.STREAM`` the job is instead handing its state over to the same layout on its
devices in reverse order (every byte moves) when the last process dies at its first streaming step:
the handoff can neither commit nor go back (the old world lost a member), and the survivors recover
from the cut to ``new`` as the next generation but one. ``noticed`` then runs to the last survivor's
``peer_lost`` (its handoff rolled back, its state kept).

**Checkpoint restart** (:func:`~liver.bench.restart.measure_restart`, the same model, layouts, config
and iteration): what a job without live recovery pays after a fail-stop, less the checkpoint save,
which happened before the failure (periodic): stop the survivors, start fresh interpreters, import,
initialise, build, load with reshape, first step. The steps since that checkpoint are lost on top
(not counted here: it depends on the checkpoint interval).
"""

from __future__ import annotations

import enum
import os
import sys
import time
from typing import Any

import msgspec

from liver.bench.jobs import LiveSetup, run_live_job
from liver.bench.restart import steady_step
from liver.reshard.plan import Plan, WorldConfig
from liver.reshard.redundancy import redundancy
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.model import ModelRef, ModelSpec
from liver.worker_runtime.megatron.train_config import TrainConfig

__all__ = ["FailStopLive", "LossMoment", "measure_fail_stop"]

JOB = "bench-fail-stop"
KILLED_AT_KEY = "bench/fail-stop/killed_at"


class LossMoment(enum.StrEnum):
    """When the last process dies."""

    MID_STEP = "mid-step"  # in its first micro-batch's forward of step ``steps_before + 1``
    STREAM = "stream"  # at its first streaming step of a handoff whose cut is ``steps_before``


class FailStopLive(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The live recovery's downtime (seconds, see the module docstring) and what it did."""

    downtime_s: float  # pause_s + first_step_excess_s
    pause_s: float  # the kill -> the new world ready to step (latest survivor)
    noticed_s: float  # the kill -> the last survivor's step gave up
    first_step_excess_s: float
    steady_step_s: float
    build_s: float  # the new world's trainer built and its groups warmed (critical survivor)
    transfer_s: float  # the stream from the surviving replicas
    other_s: float  # the rest of the pause: keeping the state, the groups' rendezvous, enter, commit
    iteration: int  # the last completed iteration, which the new world resumes after
    survivors: int
    processes: int
    bytes_moved: int
    first_loss: float
    from_copies: int  # lost ranks whose state a survivor sent from its peer copy (their own reports)
    kept_bytes_per_process: int  # host memory of the peer copies a process keeps (the largest)


class _Result(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    noticed: float
    handed_out: float | None  # None: this survivor left (not in the new world)
    first_step_end: float | None
    first_loss: float | None
    iteration: int
    prebuild_s: float
    transfer_s: float
    bytes_sent: int
    step_ends: list[float]
    stood_in: tuple[int, ...] = ()  # lost ranks this survivor sent from its peer copies


def _die_in_next_forward(trainer: Any, store: Any, runtime: Any) -> None:
    """Exit in the next forward, once the last refresh of this process's peer copy was sent whole (a
    loss in the refresh itself leaves its copy a step behind the survivors: not what this measures)."""

    def dying(data_iterator: Any, model: Any) -> Any:
        copies = runtime.peer_copies
        if copies is not None and not copies.wait_sent(trainer.iteration, 60.0):
            raise RuntimeError(f"the copy of iteration {trainer.iteration} was not sent within 60 s")
        store.set(KILLED_AT_KEY, repr(time.time()))
        os._exit(17)

    trainer.forward_step = dying


def _worker(rank: int, size: int, setup: LiveSetup, store_port: int) -> _Result | None:
    """One process of the job: train; the last one dies in step ``steps_before + 1``; the others recover."""
    from datetime import timedelta

    from liver.shared.logs import configure_logging
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.source import source_of
    from liver.worker_runtime.peers import StepAbandoned
    from liver.worker_runtime.runtime import LiveRuntime, ReshardPhase, RuntimeEvent, RuntimeOptions
    from liver.worker_runtime.world import StoreAddress, WorldSpec, connect_store

    configure_logging(level="ERROR", stream=sys.stderr)
    plan, handoff = setup.plan, setup.handoff
    devices = plan.old.placement.devices
    device, victim = devices[rank], devices[-1]
    address = StoreAddress("127.0.0.1", store_port)
    store = connect_store(address, timedelta(seconds=setup.timeout_s))
    recovery = 1 if handoff is None else 2  # the generation the survivors recover to
    lost_at: list[float] = []

    def on_event(event: RuntimeEvent) -> None:
        if event.phase is ReshardPhase.PEER_LOST and not lost_at:  # the handoff lost its peer
            lost_at.append(time.time())
            runtime.request_resize(
                recovery, plan.new.layout, plan.new.placement, plan, address, lost=(victim,)
            )

    def die_streaming(generation: int, layer: int, rnd: int) -> None:
        store.set(KILLED_AT_KEY, repr(time.time()))
        os._exit(17)

    runtime = LiveRuntime(
        MegatronJob(source_of(setup.model), setup.config),
        job=JOB,
        device=device,
        store=address,
        initial=WorldSpec(job=JOB, generation=0, layout=plan.old.layout, placement=plan.old.placement),
        options=RuntimeOptions(
            control_timeout_s=setup.timeout_s,
            build_timeout_s=setup.timeout_s,
            recover_timeout_s=setup.timeout_s,
        ),
        on_event=on_event if handoff is not None else None,
        on_stream_step=die_streaming if handoff is not None and device == victim else None,
    )
    trainer = runtime.step()
    noticed: float | None = None
    handed_out = first_end = first_loss = None
    while trainer is not None and first_end is None:
        if handoff is None and device == victim and trainer.iteration == setup.steps_before:
            _die_in_next_forward(trainer, store, runtime)
        if handoff is not None and trainer.iteration == setup.steps_before - 2:
            # Built now: the next boundary's vote builds the new trainer, the cut is steps_before.
            runtime.request_resize(1, handoff.new.layout, handoff.new.placement, handoff, address)
            if not runtime.wait_prepared(setup.timeout_s):
                raise RuntimeError("the handoff's groups were not built")
        try:
            result = trainer.train_step()
        except StepAbandoned:
            noticed = time.time()
            runtime.request_resize(1, plan.new.layout, plan.new.placement, plan, address, lost=(victim,))
            trainer = runtime.step()
            handed_out = time.time() if trainer is not None else None
            continue
        if runtime.generation == recovery:
            first_end, first_loss = time.time(), result.loss
            break
        generation = runtime.generation
        trainer = runtime.step()
        if lost_at and generation != runtime.generation:  # the handoff lost its peer: recovered
            noticed, handed_out = lost_at[0], time.time() if trainer is not None else None
    if noticed is None:
        raise RuntimeError("the process never met the lost peer")
    step_ends: list[float] = []
    if first_end is not None:
        step_ends.append(first_end)
        for _ in range(setup.steady_steps):
            trainer = runtime.step()
            assert trainer is not None
            trainer.train_step()
            step_ends.append(time.time())
    report = runtime.last_switch
    if report is None:
        raise RuntimeError(f"no recovery: {runtime.history}")
    runtime.close()
    return _Result(
        rank=rank,
        noticed=noticed,
        handed_out=handed_out,
        first_step_end=first_end,
        first_loss=first_loss,
        iteration=report.iteration,
        prebuild_s=report.prebuild_s or 0.0,
        transfer_s=report.transfer_s,
        bytes_sent=report.bytes_sent,
        step_ends=step_ends,
        stood_in=report.stood_in,
    )


def devices_of(layout: ParallelLayout) -> tuple[Device, ...]:
    """One process per node, as a node's loss takes a process with it; state that no process on
    another node holds (the distributed optimizer's shard, all of a DP=1 job's) has a peer copy there."""
    return grid_devices(layout.world_size, 1)


def recovery_plan(model: ModelRef, old: ParallelLayout, new: ParallelLayout, config: TrainConfig) -> Plan:
    """The plan the transfer service would make: ``old`` on ``old.world_size`` devices, the last one
    lost, ``new`` on the first survivors, the lost state no survivor holds read from its peer copy."""
    from liver.reshard.planner import plan_resize

    if new.world_size > old.world_size - 1:
        raise ValueError(
            f"--to: {new.describe()} needs {new.world_size} devices, {old.world_size - 1} survive the loss"
        )
    devices = devices_of(old)
    return plan_resize(
        model.model_geometry().with_ddp(config.ddp),
        WorldConfig(old, Placement(devices)),
        new,
        devices[: new.world_size],
        lost=[devices[-1]],
        copies=True,
    ).plan


def reversal_plan(model: ModelRef, old: ParallelLayout, config: TrainConfig) -> Plan:
    """A handoff that moves every byte: ``old`` on the same devices in reverse order."""
    from liver.reshard.planner import DEFAULT_BUDGET_BYTES, build_plan

    devices = devices_of(old)
    return build_plan(
        model.model_geometry().with_ddp(config.ddp),
        WorldConfig(old, Placement(devices)),
        WorldConfig(old, Placement(devices[::-1])),
        DEFAULT_BUDGET_BYTES,
    )


def measure_fail_stop(
    model: ModelSpec | ModelRef,
    old: ParallelLayout,
    new: ParallelLayout,
    config: TrainConfig,
    *,
    steps_before: int = 2,
    steady_steps: int = 3,
    threads: int = 1,
    timeout_s: float = 600.0,
    at: LossMoment = LossMoment.MID_STEP,
) -> FailStopLive:
    """Run the job at ``old``, kill its last process mid-step (or in a handoff's stream), recover live
    to ``new``, and time it. Raises the planner's ``NoSurvivingSource`` when the lost process held
    state that neither a survivor nor a peer copy has, and ``ValueError`` for a loss in a stream with
    fewer than 2 steps before."""
    spec = ModelRef.of(model)
    plan = recovery_plan(spec, old, new, config)
    handoff = None
    if at is LossMoment.STREAM:
        if steps_before < 2:
            raise ValueError("--steps-before: a loss in a handoff's stream needs at least 2 (build, cut)")
        handoff = reversal_plan(spec, old, config)
    size = old.world_size
    setup = LiveSetup(
        model=spec,
        config=config,
        plan=plan,
        steps_before=steps_before,
        steady_steps=steady_steps,
        timeout_s=timeout_s,
        handoff=handoff,
    )
    outcomes, values = run_live_job(
        _worker, size, setup, threads=threads, may_die=(size - 1,), read=(KILLED_AT_KEY,)
    )
    killed_at = float(values[KILLED_AT_KEY].decode())
    results: list[_Result] = [r for r in outcomes if r is not None]
    new_world = [r for r in results if r.first_step_end is not None and r.handed_out is not None]
    if not new_world:
        raise RuntimeError("no survivor reported a first step on the new world")
    critical = max(new_world, key=lambda r: r.first_step_end or 0.0)
    assert critical.first_step_end is not None and critical.first_loss is not None
    ready = max(r.handed_out for r in new_world if r.handed_out is not None)
    steady = steady_step([r.step_ends for r in new_world])
    excess = max(critical.first_step_end - ready - steady, 0.0)
    noticed = max(r.noticed for r in results) - killed_at
    pause = ready - killed_at
    return FailStopLive(
        downtime_s=pause + excess,
        pause_s=pause,
        noticed_s=noticed,
        first_step_excess_s=excess,
        steady_step_s=steady,
        build_s=critical.prebuild_s,
        transfer_s=critical.transfer_s,
        other_s=max(pause - noticed - critical.prebuild_s - critical.transfer_s, 0.0),
        iteration=critical.iteration,
        survivors=len(results),
        processes=size,
        bytes_moved=sum(r.bytes_sent for r in results),
        first_loss=critical.first_loss,
        from_copies=len({rank for r in results for rank in r.stood_in}),
        kept_bytes_per_process=max(redundancy(plan.model, old, plan.old.placement).kept_bytes),
    )
