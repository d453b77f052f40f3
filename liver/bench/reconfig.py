"""``liver bench reconfig``: one layout change of one model, done live and by stop-and-restart, in one run.

**Live** (:func:`measure_live`): ``max(old, new)`` worker processes (forked from a server that has
already imported torch and Megatron-core: a live job's processes are warm) run a Megatron GPT job
through :class:`~liver.worker_runtime.runtime.LiveRuntime`. After ``steps_before`` steps every process
hands in the planner's plan (``plan_resize``, made once by this process, as the transfer service
would); the shadow world is prepared in the background while training goes on, and the job switches
at the first iteration boundary where every rank is ready. Downtime, as a user pays it, on both sides:

    the pause: from the cut (the moment the vote that agreed the switch returned, on the earliest
    process) to the new world ready to step (the new trainer handed out, on the latest process),
    plus the first step's excess over the new world's steady step (the median of the next
    ``--steady-steps`` steps; an excess below zero counts as zero).

The earlier definition, cut to the end of the first step on the new world (on the latest process), is
reported beside it (``cut_to_first_step_s``) with its breakdown on the critical process (the one whose
first step ended last): ``cut_skew`` (its cut after the earliest one), ``switch`` (enter and adopt the
new world, share the progress, commit vote), ``transfer`` (the executor's stream), ``rebuild`` (the
rest of the pause: load the streamed state, release the old world, and the build when none was made
before the cut) and ``first_step``; they add up to it. Each process's cut is its hand-out moment less its
``SwitchReport.pause_s``. Before the cut, at the boundary the vote agreed on, every process stood still
while the new trainer was built (``prebuild_s``, the longest): reported, and counted in the second ratio.
The preparation (``prepare_s``: groups built on background threads) overlaps training and is reported,
not counted.

**Stop-and-restart** (:func:`~liver.bench.restart.measure_restart`): the same model, layouts, training
config and cut iteration: save a ``dist_checkpointing`` checkpoint, stop the processes, start fresh
interpreters, import torch and Megatron, initialise, build, load with reshape, first step, steady
steps. Its pause is everything up to the first step (see :mod:`liver.bench.restart`).

The ratio is restart downtime / live downtime; the issue's aim is at least 25x. Both sides use gloo on
loopback with ``--threads`` torch threads per process.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

import msgspec

from liver.bench.copies import CopyCost, cost_checks, cost_lines, measure_copies
from liver.bench.fail_stop import FailStopLive, LossMoment, devices_of, measure_fail_stop
from liver.bench.jobs import (
    FULL_CONFIG,
    LARGE_CONFIG,
    LARGE_MODEL,
    MODEL_DEFAULT,
    QUICK_CONFIG,
    LiveSetup,
    run_live_job,
)
from liver.bench.procs import ProcsError
from liver.bench.report import Check, check_line, emit, load_average, progress, utc_now
from liver.bench.restart import RestartBreakdown, RestartError, check_fits, measure_restart, steady_step
from liver.reshard.plan import WorldConfig
from liver.reshard.redundancy import redundancy
from liver.shared.layout import LayoutError, ParallelLayout, Placement, grid_devices
from liver.shared.model import ModelError, ModelRef, ModelSpec, load_model
from liver.worker_runtime.megatron.train_config import TrainConfig

__all__ = [
    "AIM_RATIO",
    "LARGE_MODEL",
    "LiveDowntime",
    "ReconfigReport",
    "add_arguments",
    "measure_live",
    "run",
]

AIM_RATIO = 25.0
COPY_STEPS, COPY_STEPS_QUICK, COPY_WARMUP = 8, 4, 3
"""``--fail-stop`` with copies: each run of the copies' cost (as ``liver bench copies``)."""
JOB = "bench-reconfig"
MAX_PROCESSES = 4


# -- reports ---------------------------------------------------------------------------------------------


class LiveDowntime(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The live switch's downtime and its breakdown (seconds; see the module docstring).

    ``downtime_s`` is what a user pays: the pause (cut to the new world ready to step, on the latest
    process) plus the first step's excess over the new world's steady step. ``cut_to_first_step_s`` is
    the earlier definition (cut to the end of the first step), and the parts from ``cut_skew_s`` to
    ``first_step_s`` add up to it. ``prebuild_s`` happened before the cut: at an earlier boundary every
    process stood still while the new trainer was built (the longest such stall)."""

    downtime_s: float
    pause_s: float
    first_step_excess_s: float
    steady_step_s: float
    prebuild_s: float
    cut_to_first_step_s: float
    cut_skew_s: float
    switch_s: float
    transfer_s: float
    rebuild_s: float
    first_step_s: float
    critical_process: int
    max_pause_s: float  # the longest pause_s (cut -> new trainer handed out) over all processes
    prepare_s: float  # the slowest background preparation (request -> ready), not downtime
    cut_iteration: int
    processes: int
    bytes_moved: int  # sent between processes, all processes together
    first_loss: float  # the new world's first loss


class ReconfigReport(msgspec.Struct, frozen=True, kw_only=True):
    quick: bool
    date: str
    model: str
    parameters: int
    old_layout: str
    new_layout: str
    config: TrainConfig
    steps_before: int
    threads: int
    backend: str
    live: LiveDowntime
    restart: RestartBreakdown
    ratio: float  # restart downtime / live downtime (pause + first-step excess on both sides)
    ratio_with_prebuild: float  # the same with the live side's pre-cut build stall added to it
    ratio_cut_to_first_step: float  # the earlier definition: restart total / live cut -> first step end
    restart_warm_s: float  # the restart's downtime less interpreter start and imports (launch, import_*)
    ratio_warm: float  # restart_warm_s / live downtime: what is left if imports cost nothing
    checks: list[Check]
    cpus: int
    load_average: tuple[float, float]  # 1-minute, before and after
    host: str


# -- the live side: worker processes --------------------------------------------------------------------


class _LiveResult(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    in_new_world: bool
    cut: float  # wall clock (time.time()): hand-out less pause_s
    handed_out: float
    first_step_end: float | None
    first_loss: float | None
    iteration: int
    pause_s: float
    switch_s: float
    transfer_s: float
    rebuild_s: float
    prepare_s: float
    prebuild_s: float
    bytes_sent: int
    step_ends: list[float]  # the end of each step on the new world (wall clock), the first included


def _live_worker(rank: int, size: int, setup: LiveSetup, store_port: int) -> _LiveResult:
    """One process of the live job: train, hand in the resize, switch, one step on the new world."""
    from liver.shared.logs import configure_logging
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.source import source_of
    from liver.worker_runtime.runtime import LiveRuntime, RuntimeOptions
    from liver.worker_runtime.world import StoreAddress, WorldSpec

    configure_logging(level="WARNING", stream=sys.stderr)
    plan = setup.plan
    device = grid_devices(1, size)[rank]
    address = StoreAddress("127.0.0.1", store_port)
    initial = WorldSpec(job=JOB, generation=0, layout=plan.old.layout, placement=plan.old.placement)
    runtime = LiveRuntime(
        MegatronJob(source_of(setup.model), setup.config),
        job=JOB,
        device=device,
        store=address,
        initial=initial,
        options=RuntimeOptions(
            control_timeout_s=setup.timeout_s,
            build_timeout_s=setup.timeout_s,
            join_timeout_s=setup.timeout_s,
        ),
    )
    requested = device not in plan.old.placement.devices
    if requested:  # a joiner: waiting outside the job, it takes the request at once
        runtime.request_resize(1, plan.new.layout, plan.new.placement, plan, address)
    give_up_at = time.monotonic() + setup.timeout_s
    handed_out = first_end = first_loss = None
    trainer = runtime.step()
    if runtime.generation == 1:
        handed_out = time.time()
    while trainer is not None and first_end is None:
        if runtime.aborts:
            abort = runtime.aborts[-1]
            raise RuntimeError(f"the live switch was aborted at {abort.stage}: {abort.reason}")
        if time.monotonic() > give_up_at:
            raise TimeoutError(f"no switch within {setup.timeout_s:g} s")
        if not requested and trainer.iteration >= setup.steps_before:
            requested = True
            runtime.request_resize(1, plan.new.layout, plan.new.placement, plan, address)
        result = trainer.train_step()
        if runtime.generation == 1:
            first_end, first_loss = time.time(), result.loss
            break
        trainer = runtime.step()
        if runtime.generation == 1 or runtime.left:
            handed_out = time.time()
    step_ends: list[float] = []
    if first_end is not None:
        step_ends.append(first_end)
        for _ in range(setup.steady_steps):  # the new world's steady step, boundaries included
            trainer = runtime.step()  # the first of them fills the report's first_step_s
            assert trainer is not None
            trainer.train_step()
            step_ends.append(time.time())
        runtime.step()
    report = runtime.last_switch
    if report is None or handed_out is None:
        raise RuntimeError("the process ended without a switch report")
    runtime.close()
    return _LiveResult(
        rank=rank,
        in_new_world=first_end is not None,
        cut=handed_out - report.pause_s,
        handed_out=handed_out,
        first_step_end=first_end,
        first_loss=first_loss,
        iteration=report.iteration,
        pause_s=report.pause_s,
        switch_s=report.switch_s,
        transfer_s=report.transfer_s,
        rebuild_s=report.rebuild_s,
        prepare_s=report.prepare_s or 0.0,
        prebuild_s=report.prebuild_s or 0.0,
        bytes_sent=report.bytes_sent,
        step_ends=step_ends,
    )


def _downtime(results: list[_LiveResult]) -> LiveDowntime:
    """The job's downtime from every process's timestamps, broken down on the critical process."""
    new = [r for r in results if r.in_new_world and r.first_step_end is not None]
    if not new:
        raise RuntimeError("no process reported a first step on the new world")
    critical = max(new, key=lambda r: r.first_step_end or 0.0)
    assert critical.first_step_end is not None and critical.first_loss is not None
    earliest_cut = min(r.cut for r in results)
    ready = max(r.handed_out for r in new)
    steady = steady_step([r.step_ends for r in new])
    excess = max(critical.first_step_end - ready - steady, 0.0)
    return LiveDowntime(
        downtime_s=ready - earliest_cut + excess,
        pause_s=ready - earliest_cut,
        first_step_excess_s=excess,
        steady_step_s=steady,
        prebuild_s=max(r.prebuild_s for r in results),
        cut_to_first_step_s=critical.first_step_end - earliest_cut,
        cut_skew_s=critical.cut - earliest_cut,
        switch_s=critical.switch_s,
        transfer_s=critical.transfer_s,
        rebuild_s=critical.rebuild_s,
        first_step_s=critical.first_step_end - critical.handed_out,
        critical_process=critical.rank,
        max_pause_s=max(r.pause_s for r in results),
        prepare_s=max(r.prepare_s for r in results),
        cut_iteration=critical.iteration,
        processes=len(results),
        bytes_moved=sum(r.bytes_sent for r in results),
        first_loss=critical.first_loss,
    )


def measure_live(
    model: ModelSpec | ModelRef,
    old: ParallelLayout,
    new: ParallelLayout,
    config: TrainConfig,
    *,
    steps_before: int = 2,
    steady_steps: int = 3,
    threads: int = 1,
    timeout_s: float = 600.0,
) -> LiveDowntime:
    """Run the live transition ``old`` -> ``new`` in ``max(old, new)`` local processes and time it."""
    from liver.reshard.planner import plan_resize

    spec = ModelRef.of(model)
    size = max(old.world_size, new.world_size)
    devices = grid_devices(1, size)
    plan = plan_resize(
        spec.model_geometry().with_ddp(config.ddp),
        WorldConfig(old, Placement(devices[: old.world_size])),
        new,
        devices[: new.world_size],
    ).plan
    setup = LiveSetup(
        model=spec,
        config=config,
        plan=plan,
        steps_before=steps_before,
        steady_steps=steady_steps,
        timeout_s=timeout_s,
    )
    results, _ = run_live_job(_live_worker, size, setup, threads=threads)
    return _downtime(results)


# -- the command -------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``liver bench reconfig``."""
    parser.add_argument("--model", default=None, help=f"a preset or a model .json (default {MODEL_DEFAULT})")
    parser.add_argument(
        "--large", action="store_true", help=f"the larger built-in model ({LARGE_MODEL.name}, seq 128)"
    )
    parser.add_argument(
        "--provider",
        default=None,
        metavar="MODULE:FUNCTION",
        help="your own model: its provider (layout, pg_collection) -> GPTModel, FILE.py:FUNCTION too",
    )
    parser.add_argument("--num-layers", type=int, default=None, help="with --provider: decoder layers")
    parser.add_argument("--vocab-size", type=int, default=None, help="with --provider: the real vocabulary")
    parser.add_argument(
        "--make-vocab-size-divisible-by",
        "--divisible-by",  # the earlier spelling, still read
        dest="make_vocab_size_divisible_by",
        type=int,
        default=128,
        help="with --provider: Megatron pads the vocabulary to a multiple of this times TP",
    )
    parser.add_argument("--max-seq", type=int, default=None, help="with --provider: max_sequence_length")
    parser.add_argument(
        "--from",
        dest="from_layout",
        default=None,
        help="old layout TP,PP,DP (default 2,1,1; with --fail-stop 2,1,2)",
    )
    parser.add_argument("--to", dest="to_layout", default="1,2,1", help="new layout TP,PP,DP (default 1,2,1)")
    parser.add_argument(
        "--fail-stop",
        action="store_true",
        help="no planned change: the last process dies mid-step and the survivors recover live to --to; "
        "against a checkpoint restart of the same job",
    )
    parser.add_argument(
        "--fail-stop-at",
        type=LossMoment,
        choices=list(LossMoment),
        default=LossMoment.MID_STEP,
        help="with --fail-stop: when the last process dies (default mid-step; stream: in the stream of a "
        "handoff to the same layout on the devices in reverse order, whose cut is --steps-before)",
    )
    parser.add_argument(
        "--steps-before", type=int, default=None, help="training steps before the cut (default 2, quick 1)"
    )
    parser.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="train with Megatron's distributed optimizer (master weights and Adam moments sharded over DP)",
    )
    parser.add_argument(
        "--steady-steps",
        type=int,
        default=None,
        help="steps after the first on the new world; their median is the steady step (default 3, quick 2)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds before a side counts as hung (default 900)"
    )
    parser.add_argument("--quick", action="store_true", help="CI-sized: smaller batches, one step before")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _layout(text: str, flag: str) -> ParallelLayout:
    try:
        return ParallelLayout.parse(text)
    except (LayoutError, ValueError) as exc:
        raise ValueError(f"{flag}: {exc}") from None


def _user_model(args: argparse.Namespace) -> ModelRef:
    """The user's own model from ``--provider``: its geometry derived here, once, from Megatron."""
    from liver.shared.logs import configure_logging
    from liver.worker_runtime.megatron.geometry import derive_geometry
    from liver.worker_runtime.megatron.source import load_provider

    configure_logging(level="WARNING")  # to stderr: stdout is the report's
    for flag, value in (("--num-layers", args.num_layers), ("--max-seq", args.max_seq)):
        if value is None:
            raise ValueError(f"{flag}: required with --provider")
    geometry = derive_geometry(
        load_provider(args.provider),
        name=args.provider.rpartition(":")[2],
        num_layers=args.num_layers,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )
    return ModelRef(provider=args.provider, geometry=geometry, max_sequence_length=args.max_seq)


def _steady_steps(args: argparse.Namespace) -> int:
    steady = args.steady_steps if args.steady_steps is not None else 2 if args.quick else 3
    if steady < 1:
        raise ValueError(f"--steady-steps: at least 1 (the steady step is their median), got {steady}")
    return steady


def _resolve(args: argparse.Namespace) -> tuple[ModelRef, ParallelLayout, ParallelLayout, TrainConfig, int]:
    if sum((args.large, args.model is not None, args.provider is not None)) > 1:
        raise ValueError("--large: choose one of --large, --model and --provider")
    try:
        if args.provider is not None:
            spec = _user_model(args)
        else:
            spec = ModelRef(spec=LARGE_MODEL if args.large else load_model(args.model or MODEL_DEFAULT))
    except ModelError as exc:
        raise ValueError(f"--model: {exc}") from None
    default_from = "2,1,2" if args.fail_stop else "2,1,1"
    old = _layout(args.from_layout or default_from, "--from")
    new = _layout(args.to_layout, "--to")
    if old == new:
        raise ValueError(f"--to: the same layout as --from ({old.describe()}): nothing to reconfigure")
    size = max(old.world_size, new.world_size)
    if not 2 <= size <= MAX_PROCESSES:
        raise ValueError(
            f"--from/--to: need 2-{MAX_PROCESSES} processes, "
            f"{old.describe()} -> {new.describe()} needs {size}"
        )
    config = LARGE_CONFIG if args.large else QUICK_CONFIG if args.quick else FULL_CONFIG
    if args.distributed_optimizer:
        config = msgspec.structs.replace(config, use_distributed_optimizer=True)
    for layout, flag in ((old, "--from"), (new, "--to")):
        check_fits(spec, layout, config, flag)
    steps_before = args.steps_before if args.steps_before is not None else 1 if args.quick else 2
    if steps_before < 1:
        raise ValueError(
            f"--steps-before: at least 1 (the checkpoint must hold Adam state), got {steps_before}"
        )
    if args.threads < 1:
        raise ValueError(f"--threads: at least 1, got {args.threads}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout: must be positive, got {args.timeout:g}")
    return spec, old, new, config, steps_before


def run(args: argparse.Namespace) -> int:
    """Run both sides; 0 when both completed (the 25x aim is reported, not enforced), 1 when one failed,
    2 on a bad option."""
    try:
        spec, old, new, config, steps_before = _resolve(args)
        steady = _steady_steps(args)
    except ValueError as exc:
        print(f"liver bench reconfig: {exc}", file=sys.stderr)
        return 2
    if args.fail_stop:
        return _run_fail_stop(args, spec, old, new, config, steps_before, steady)
    load_before = load_average()
    progress(
        "reconfig",
        f"{spec.name} ({spec.model_geometry().parameter_count():,} parameters): {old.describe()} -> "
        f"{new.describe()}, "
        f"{steps_before} step(s) before the cut",
    )
    try:
        progress("reconfig", "live: a warm job reshards live")
        live = measure_live(
            spec,
            old,
            new,
            config,
            steps_before=steps_before,
            steady_steps=steady,
            threads=args.threads,
            timeout_s=args.timeout,
        )
        progress("reconfig", f"live: downtime {live.downtime_s:.3f} s; stop-and-restart: fresh processes")
        # The restart saves at the iteration the live job was cut at (its background preparation may
        # have taken a few steps past ``steps_before``), so both sides move the same state.
        restart = measure_restart(
            spec,
            old,
            new,
            config,
            warmup_steps=live.cut_iteration,
            steady_steps=steady,
            threads=args.threads,
            timeout_s=args.timeout,
        )
    except (ProcsError, RestartError, RuntimeError) as exc:
        print(f"liver bench reconfig: a measurement failed\n{exc}", file=sys.stderr)
        return 1
    ratio = restart.downtime_s / live.downtime_s
    warm = restart.downtime_s - restart.launch_s - restart.import_torch_s - restart.import_megatron_s
    checks = [
        Check(
            level="aim",
            what=f"live downtime (pause + first-step excess) >= {AIM_RATIO:g}x shorter than stop-and-restart",
            passed=ratio >= AIM_RATIO,
            detail=f"{ratio:,.1f}x ({restart.downtime_s:.3f} s / {live.downtime_s:.3f} s)",
        )
    ]
    report = ReconfigReport(
        quick=args.quick,
        date=utc_now(),
        model=spec.name,
        parameters=spec.model_geometry().parameter_count(),
        old_layout=old.describe(),
        new_layout=new.describe(),
        config=config,
        steps_before=steps_before,
        threads=args.threads,
        backend="gloo",
        live=live,
        restart=restart,
        ratio=ratio,
        ratio_with_prebuild=restart.downtime_s / (live.downtime_s + live.prebuild_s),
        ratio_cut_to_first_step=restart.total_s / live.cut_to_first_step_s,
        restart_warm_s=warm,
        ratio_warm=warm / live.downtime_s,
        checks=checks,
        cpus=os.cpu_count() or 0,
        load_average=(load_before, load_average()),
        host=f"{platform.machine()}, Python {platform.python_version()}",
    )
    emit(report, args.json, _print_report)
    return 0


class FailStopReport(msgspec.Struct, frozen=True, kw_only=True):
    quick: bool
    date: str
    model: str
    parameters: int
    old_layout: str
    new_layout: str
    config: TrainConfig
    steps_before: int
    at: LossMoment
    threads: int
    backend: str
    live: FailStopLive
    restart: RestartBreakdown
    restart_downtime_s: float  # the restart's downtime less its checkpoint save (taken before the failure)
    ratio: float  # restart_downtime_s / live downtime
    copies: CopyCost | None  # what the peer copies cost the job's steady state (None: it keeps none)
    checks: list[Check]
    cpus: int
    load_average: tuple[float, float]
    host: str


def _run_fail_stop(
    args: argparse.Namespace,
    spec: ModelRef,
    old: ParallelLayout,
    new: ParallelLayout,
    config: TrainConfig,
    steps_before: int,
    steady: int,
) -> int:
    """``--fail-stop``: the live recovery, then a checkpoint restart of the same job (same run)."""
    from liver.reshard.planner import NoSurvivingSource

    load_before = load_average()
    at: LossMoment = args.fail_stop_at
    progress("reconfig", f"{spec.name}: {old.describe()}, the last process dies {_moment(at, steps_before)}")
    try:
        live = measure_fail_stop(
            spec,
            old,
            new,
            config,
            steps_before=steps_before,
            steady_steps=steady,
            threads=args.threads,
            timeout_s=args.timeout,
            at=at,
        )
        progress("reconfig", f"live: downtime {live.downtime_s:.3f} s; checkpoint restart: fresh processes")
        restart = measure_restart(
            spec,
            old,
            new,
            config,
            warmup_steps=live.iteration,
            steady_steps=steady,
            threads=args.threads,
            timeout_s=args.timeout,
        )
        copies = None
        if max(
            redundancy(spec.model_geometry().with_ddp(config.ddp), old, Placement(devices_of(old))).copy_bytes
        ):
            progress("reconfig", "the peer copies' steady-state cost: the job with and without them")
            copies = measure_copies(
                spec,
                old,
                config,
                steps=COPY_STEPS_QUICK if args.quick else COPY_STEPS,
                warmup=COPY_WARMUP,
                rounds=1 if args.quick else 2,
                threads=args.threads,
                timeout_s=args.timeout,
            )
    except (NoSurvivingSource, ValueError) as exc:
        print(f"liver bench reconfig: --fail-stop: {exc}", file=sys.stderr)
        return 2
    except (ProcsError, RestartError, RuntimeError) as exc:
        print(f"liver bench reconfig: a measurement failed\n{exc}", file=sys.stderr)
        return 1
    restart_downtime = restart.downtime_s - restart.save_s
    checks = [
        Check(
            level="must",
            what="the survivors recover live, from the last completed step",
            passed=live.iteration == steps_before,
            detail=f"resumed after iteration {live.iteration}; the victim died " + _moment(at, steps_before),
        )
    ]
    if copies is not None:
        checks.append(
            Check(
                level="must",
                what="the state no survivor held was read from peer copies",
                passed=live.from_copies > 0,
                detail=f"{live.from_copies} lost rank(s) stood in by their keeper",
            )
        )
        checks.extend(cost_checks(copies))
    ratio = restart_downtime / live.downtime_s
    report = FailStopReport(
        quick=args.quick,
        date=utc_now(),
        model=spec.name,
        parameters=spec.model_geometry().parameter_count(),
        old_layout=old.describe(),
        new_layout=new.describe(),
        config=config,
        steps_before=steps_before,
        at=at,
        threads=args.threads,
        backend="gloo",
        live=live,
        restart=restart,
        restart_downtime_s=restart_downtime,
        ratio=ratio,
        copies=copies,
        checks=checks,
        cpus=os.cpu_count() or 0,
        load_average=(load_before, load_average()),
        host=f"{platform.machine()}, Python {platform.python_version()}",
    )
    emit(report, args.json, _print_fail_stop)
    return 0 if all(c.passed for c in report.checks if c.level == "must") else 1


def _copies_lines(r: FailStopReport) -> list[str]:
    if r.copies is None:
        return ["(no peer copies: a survivor on another node holds every piece of the lost state)"]
    return [
        "",
        f"peer copies ({r.live.from_copies} lost rank(s) read from one; the job with and without them, "
        f"{r.live.processes} processes on as many nodes, in the same run)",
        *cost_lines(r.copies),
    ]


def _moment(at: LossMoment, steps_before: int) -> str:
    if at is LossMoment.STREAM:
        return f"in the stream of a handoff cut after step {steps_before}"
    return f"in step {steps_before + 1}"


def _print_fail_stop(r: FailStopReport) -> None:
    live, restart = r.live, r.restart
    stream = r.at is LossMoment.STREAM
    out = [
        f"liver bench reconfig --fail-stop{' (quick)' if r.quick else ''}: {r.model} "
        f"({r.parameters:,} parameters), {r.old_layout}: the last of {live.processes} processes dies "
        f"{_moment(r.at, r.steps_before)}; {live.survivors} survivors -> {r.new_layout}",
        "",
        "live recovery (warm survivors; the kill -> the new world ready to step)",
        f"  {'noticed':<22}{live.noticed_s:9.3f} s   (the kill -> the last survivor "
        + ("rolled its handoff back, state kept)" if stream else "gave its step up)"),
        f"  {'new trainer':<22}{live.build_s:9.3f} s   (built, its groups warmed)",
        f"  {'transfer':<22}{live.transfer_s:9.3f} s   ({live.bytes_moved / 1e6:.2f} MB moved)",
        f"  {'other':<22}{live.other_s:9.3f} s   ("
        + ("" if stream else "state kept, ")
        + "groups' rendezvous, enter, commit)",
        f"  {'pause':<22}{live.pause_s:9.3f} s",
        f"  {'first-step excess':<22}{live.first_step_excess_s:9.3f} s   "
        f"(over the steady step, {live.steady_step_s:.3f} s)",
        f"  {'downtime':<22}{live.downtime_s:9.3f} s   "
        f"(resumed after iteration {live.iteration}: no step lost)",
        "  (over the bus the coordinator needs up to its suspect timeout, 5 s by default, to name the lost "
        "process after the survivors' report)",
        "",
        f"checkpoint restart ({restart.new_processes} fresh processes; the checkpoint was saved before "
        "the failure, its save is not counted)",
    ]
    out += [f"  {name:<22}{value:9.3f} s" for name, value in restart.phases().items() if name != "save"]
    out += [
        f"  {'downtime':<22}{r.restart_downtime_s:9.3f} s   (plus the steps since that checkpoint, lost)",
        "",
        f"checkpoint restart / live recovery downtime: {r.ratio:,.1f}x",
        *_copies_lines(r),
        f"host: {r.cpus} CPUs ({r.host}), load average {r.load_average[0]:.1f} before, "
        f"{r.load_average[1]:.1f} after; gloo, {r.threads} thread(s) per process",
    ]
    out.extend(check_line(c) for c in r.checks)
    print("\n".join(out))


def _print_report(r: ReconfigReport) -> None:
    live, restart = r.live, r.restart
    out: list[str] = [
        f"liver bench reconfig{' (quick)' if r.quick else ''}: {r.model} ({r.parameters:,} parameters), "
        f"{r.old_layout} -> {r.new_layout}, cut after iteration {live.cut_iteration}, "
        f"{'distributed' if r.config.use_distributed_optimizer else 'plain'} optimizer",
        "",
        f"live reshard ({live.processes} warm processes; cut -> first step on the new world done)",
    ]
    rows: list[tuple[str, Any]] = [
        ("cut skew", live.cut_skew_s),
        ("switch", live.switch_s),
        ("transfer", live.transfer_s),
        ("rebuild", live.rebuild_s),
        ("first step", live.first_step_s),
    ]
    out += [f"  {name:<22}{value:9.3f} s" for name, value in rows]
    out += [
        f"  {'cut -> first step done':<22}{live.cut_to_first_step_s:9.3f} s",
        f"  {'pause':<22}{live.pause_s:9.3f} s   (cut -> the new world ready to step)",
        f"  {'first-step excess':<22}{live.first_step_excess_s:9.3f} s   "
        f"(over the steady step, {live.steady_step_s:.3f} s)",
        f"  {'downtime':<22}{live.downtime_s:9.3f} s   (pause + first-step excess)",
        f"  (before the cut: training stood still {live.prebuild_s:.3f} s at one boundary while the new "
        f"trainer was built; not counted: background preparation {live.prepare_s:.3f} s while training "
        f"went on; {live.bytes_moved / 1e6:.2f} MB moved)",
        "",
        f"stop-and-restart ({restart.old_processes} -> {restart.new_processes} fresh processes; "
        f"checkpoint {restart.checkpoint_bytes / 1e6:.2f} MB)",
    ]
    out += [f"  {name:<22}{value:9.3f} s" for name, value in restart.phases().items()]
    out += [
        f"  {'total':<22}{restart.total_s:9.3f} s",
        f"  {'pause':<22}{restart.pause_s:9.3f} s   (save to load: every phase but the first step)",
        f"  {'first-step excess':<22}{restart.first_step_excess_s:9.3f} s   "
        f"(over the steady step, {restart.steady_step_s:.3f} s)",
        f"  {'downtime':<22}{restart.downtime_s:9.3f} s",
        "",
        f"restart / live downtime: {r.ratio:,.1f}x; with the pre-cut build stall counted as live downtime: "
        f"{r.ratio_with_prebuild:,.1f}x; without the restart's interpreter start and imports "
        f"({r.restart_warm_s:.3f} s): {r.ratio_warm:,.1f}x; cut -> first step done (the earlier "
        f"definition): {r.ratio_cut_to_first_step:,.1f}x",
        f"host: {r.cpus} CPUs ({r.host}), load average {r.load_average[0]:.1f} before, "
        f"{r.load_average[1]:.1f} after; gloo, {r.threads} thread(s) per process",
    ]
    out.extend(check_line(c) for c in r.checks)
    print("\n".join(out))
