"""``liver bench copies``: what peer copies cost a training job in its steady state.

The same job (real Megatron processes, the distributed optimizer by default, one process per node so
that every rank's optimizer shard is copied to another node) trains with peer copies and without them,
in alternating runs (off, on, on, off, ...: drift on a noisy machine falls on both sides alike). Each
run's steady step is the median time from one boundary to the next after its first steps (the copies'
sockets and the first refresh are set up there). Reported: the ratio of the steady steps with and
without copies, the bytes each process sends per step and keeps in host memory, and how long updates
waited for the sender (the gate).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import msgspec

from liver.bench.jobs import LARGE_CONFIG, LARGE_MODEL, QUICK_CONFIG
from liver.bench.procs import run_procs
from liver.bench.report import Check, check_line, emit, load_average, machine, musts_passed, progress, size
from liver.reshard.redundancy import own_copy_bytes
from liver.shared.layout import ParallelLayout, Placement, grid_devices
from liver.shared.model import ModelRef, load_model
from liver.worker_runtime.megatron.train_config import TrainConfig

JOB = "bench-copies"
AIM_OVERHEAD = 0.02
"""The issue's aim: copies cost under 2% of the step at the 29M model."""


class _Setup(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelRef
    config: TrainConfig
    layout: ParallelLayout
    copies: bool
    go_back: bool
    steps: int
    warmup: int
    store_port: int
    timeout_s: float


class _Run(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    step_s: list[float]  # boundary to boundary, every step
    cpu_s: list[float]  # CPU time of the whole process (every thread) over the same steps
    gate_s: float  # mean time an update waited for the sender, over the measured steps
    copy_bytes: int
    kept_bytes: int
    own_bytes: int


class CopyCost(msgspec.Struct, frozen=True, kw_only=True):
    """What peer copies cost one job's steady state, measured with against without in one run."""

    step_s_without: float  # median over runs of each run's median steady step (slowest rank)
    step_s_with: float
    overhead: float  # step_s_with / step_s_without - 1
    cpu_s_without: float  # CPU time per steady step of a process (all its threads; the busiest rank)
    cpu_s_with: float
    cpu_overhead: float  # cpu_s_with / cpu_s_without - 1: what the copies cost where cores are spare too
    runs_without: list[float]
    runs_with: list[float]
    gate_s_per_step: float  # mean wait of an update for the sender (slowest rank)
    copy_bytes_per_process: int  # sent each step (the largest)
    kept_bytes_per_process: int  # host memory of the copies a process keeps (the largest)
    own_bytes_per_process: int  # host memory of a process's own copies, to go back a step (the largest)


class CopiesReport(CopyCost, frozen=True, kw_only=True):
    model: str
    layout: str
    distributed_optimizer: bool
    processes: int
    steps: int
    rounds: int
    checks: list[Check]
    cpus: int
    load_average: tuple[float, float]
    host: str


def _worker(rank: int, size: int, setup: _Setup) -> _Run:
    from liver.shared.logs import configure_logging
    from liver.worker_runtime.copies.manager import CopyOptions
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.source import source_of
    from liver.worker_runtime.runtime import LiveRuntime, RuntimeOptions
    from liver.worker_runtime.world import StoreAddress, WorldSpec

    configure_logging(level="WARNING", stream=sys.stderr)
    devices = grid_devices(size, 1)  # one process per node: each one's unique state leaves its node
    spec = WorldSpec(job=JOB, generation=0, layout=setup.layout, placement=Placement(devices))
    factory = MegatronJob(source_of(setup.model), setup.config)
    options = RuntimeOptions(control_timeout_s=setup.timeout_s, build_timeout_s=setup.timeout_s)
    if not setup.copies:
        options = msgspec.structs.replace(options, copies=None)
    elif setup.go_back:
        options = msgspec.structs.replace(options, copies=CopyOptions(go_back=True))
    runtime = LiveRuntime(
        factory,
        job=JOB,
        device=devices[rank],
        store=StoreAddress("127.0.0.1", setup.store_port),
        initial=spec,
        options=options,
    )
    trainer = runtime.step()
    waits: list[float] = []
    step_s: list[float] = []
    cpu_s: list[float] = []
    last, last_cpu = time.perf_counter(), time.process_time()
    for _ in range(setup.steps):
        trainer.train_step()
        trainer = runtime.step()
        now, now_cpu = time.perf_counter(), time.process_time()
        step_s.append(now - last)
        cpu_s.append(now_cpu - last_cpu)
        last, last_cpu = now, now_cpu
        if trainer.before_update and not isinstance(trainer.before_update[-1], _Timed):
            trainer.before_update[-1] = _Timed(trainer.before_update[-1], waits)
    copies = runtime.peer_copies
    copy_bytes = kept_bytes = own_bytes = 0
    if copies is not None:
        copy_bytes, kept_bytes = copies.plan.copy_bytes[rank], copies.plan.kept_bytes[rank]
        if setup.go_back:
            own_bytes = own_copy_bytes(copies.model, copies.layout, copies.placement)[rank]
    runtime.close()
    measured = waits[-(setup.steps - setup.warmup) :] if setup.steps > setup.warmup else []
    return _Run(
        rank=rank,
        step_s=step_s,
        cpu_s=cpu_s,
        gate_s=statistics.mean(measured) if measured else 0.0,
        copy_bytes=copy_bytes,
        kept_bytes=kept_bytes,
        own_bytes=own_bytes,
    )


class _Timed:
    """A gate that records how long each update waited in it."""

    def __init__(self, gate: object, waits: list[float]) -> None:
        self.gate, self.waits = gate, waits

    def __call__(self) -> object:
        t0 = time.perf_counter()
        try:
            return self.gate()  # type: ignore[operator]
        finally:
            self.waits.append(time.perf_counter() - t0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a preset or a model .json (default tiny-gpt)")
    parser.add_argument(
        "--large", action="store_true", help=f"the larger built-in model ({LARGE_MODEL.name})"
    )
    parser.add_argument("--layout", default="TP1,PP1,DP2", help="the job's layout (default TP1,PP1,DP2)")
    parser.add_argument(
        "--plain", action="store_true", help="plain Adam instead of the distributed optimizer"
    )
    parser.add_argument(
        "--go-back",
        action="store_true",
        help="copies that can go back a step (each process keeps its own state of the last two refreshes)",
    )
    parser.add_argument("--steps", type=int, default=8, help="steps per run (default 8, quick 4)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of a run left out (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs without and with (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a run counts as hung")
    parser.add_argument("--quick", action="store_true", help="CI-sized: tiny model, fewer steps, one round")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    for flag in ("steps", "rounds", "threads"):
        if getattr(args, flag) < 1:
            print(f"liver bench copies: --{flag} must be at least 1", file=sys.stderr)
            return 2
    if args.warmup < 1 or args.warmup >= (4 if args.quick else args.steps):
        print("liver bench copies: --warmup must be at least 1 and below --steps", file=sys.stderr)
        return 2
    try:
        layout = ParallelLayout.parse(args.layout)
    except ValueError as exc:
        print(f"liver bench copies: --layout: {exc}", file=sys.stderr)
        return 2
    model = ModelRef(spec=LARGE_MODEL if args.large else load_model(args.model or "tiny-gpt"))
    base = LARGE_CONFIG if args.large else QUICK_CONFIG
    config = msgspec.structs.replace(base, use_distributed_optimizer=not args.plain)
    steps = 4 if args.quick else args.steps
    rounds = 1 if args.quick else args.rounds
    warmup = min(args.warmup, steps - 1)
    before = load_average()
    cost = measure_copies(
        model,
        layout,
        config,
        go_back=args.go_back,
        steps=steps,
        warmup=warmup,
        rounds=rounds,
        threads=args.threads,
        timeout_s=args.timeout,
    )
    checks = cost_checks(cost)
    report = CopiesReport(
        **msgspec.structs.asdict(cost),
        model=model.name,
        layout=layout.describe(),
        distributed_optimizer=not args.plain,
        processes=layout.world_size,
        steps=steps,
        rounds=rounds,
        checks=checks,
        cpus=os.cpu_count() or 1,
        load_average=(before, load_average()),
        host=machine(),
    )
    emit(report, args.json, _print)
    return 0 if musts_passed(checks) else 1


def cost_checks(cost: CopyCost) -> list[Check]:
    """That copies were made (a must), and the issue's aim for their cost."""
    copy_bytes, kept_bytes = cost.copy_bytes_per_process, cost.kept_bytes_per_process
    return [
        Check(
            level="must",
            what="copies were made (a process copies its shard to another node)",
            passed=copy_bytes > 0 and kept_bytes > 0,
            detail=f"{size(copy_bytes)} sent per step, {size(kept_bytes)} kept per process",
        ),
        Check(
            level="aim",
            what=f"steady step with copies < {AIM_OVERHEAD:.0%} slower",
            passed=cost.overhead < AIM_OVERHEAD,
            detail=f"{cost.overhead:+.1%} ({cost.step_s_with * 1e3:.0f} ms against "
            f"{cost.step_s_without * 1e3:.0f} ms)",
        ),
    ]


def measure_copies(
    model: ModelRef,
    layout: ParallelLayout,
    config: TrainConfig,
    *,
    steps: int,
    warmup: int,
    rounds: int,
    threads: int = 1,
    timeout_s: float = 900.0,
    go_back: bool = False,
) -> CopyCost:
    """Run the job ``2 * rounds`` times, alternately without and with copies (off, on, on, off, ...),
    one process per node, and compare their steady steps (after ``warmup`` steps of each run)."""
    with_runs: list[float] = []
    without_runs: list[float] = []
    cpu: dict[bool, list[float]] = {True: [], False: []}
    gates: list[float] = []
    copy_bytes = kept_bytes = own_bytes = 0
    order = [False, True, True, False] * rounds
    for k, copies in enumerate(order[: 2 * rounds]):
        progress("copies", f"run {k + 1}/{2 * rounds}: {'with' if copies else 'without'} copies")
        setup = _Setup(
            model=model,
            config=config,
            layout=layout,
            copies=copies,
            go_back=go_back,
            steps=steps,
            warmup=warmup,
            store_port=0,
            timeout_s=timeout_s,
        )
        results = _launch(setup, layout.world_size, threads, timeout_s)
        steady = max(statistics.median(r.step_s[warmup:]) for r in results)
        (with_runs if copies else without_runs).append(steady)
        cpu[copies].append(max(statistics.median(r.cpu_s[warmup:]) for r in results))
        if copies:
            gates.append(max(r.gate_s for r in results))
            copy_bytes = max(r.copy_bytes for r in results)
            kept_bytes = max(r.kept_bytes for r in results)
            own_bytes = max(r.own_bytes for r in results)
    step_without, step_with = statistics.median(without_runs), statistics.median(with_runs)
    cpu_without, cpu_with = statistics.median(cpu[False]), statistics.median(cpu[True])
    return CopyCost(
        step_s_without=step_without,
        step_s_with=step_with,
        overhead=step_with / step_without - 1,
        cpu_s_without=cpu_without,
        cpu_s_with=cpu_with,
        cpu_overhead=cpu_with / cpu_without - 1,
        runs_without=without_runs,
        runs_with=with_runs,
        gate_s_per_step=statistics.mean(gates) if gates else 0.0,
        copy_bytes_per_process=copy_bytes,
        kept_bytes_per_process=kept_bytes,
        own_bytes_per_process=own_bytes,
    )


def _launch(setup: _Setup, n: int, threads: int, timeout_s: float) -> list[_Run]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, n + 1, is_master=True, wait_for_workers=False)
    try:
        setup = msgspec.structs.replace(setup, store_port=store.port)
        return run_procs(
            _worker, n, (setup,), timeout_s=timeout_s, threads=threads, preload=["liver.bench.copies"]
        )
    finally:
        del store


def cost_lines(c: CopyCost) -> list[str]:
    """The cost of copies as the report prints it (also under ``liver bench reconfig --fail-stop``)."""
    return [
        f"  steady step without copies   {c.step_s_without * 1e3:9.1f} ms  (runs: {_ms(c.runs_without)})",
        f"  steady step with copies      {c.step_s_with * 1e3:9.1f} ms  (runs: {_ms(c.runs_with)})",
        f"  with / without               {c.step_s_with / c.step_s_without:9.3f}x  ({c.overhead:+.1%})",
        f"  CPU per step, without / with {c.cpu_s_without * 1e3:6.0f} / {c.cpu_s_with * 1e3:.0f} ms"
        f"  ({c.cpu_overhead:+.1%}: every thread of a process)",
        f"  updates waited for the sender {c.gate_s_per_step * 1e3:8.1f} ms per step",
        f"  sent per step per process    {size(c.copy_bytes_per_process):>9}",
        f"  kept per process (host)      {size(c.kept_bytes_per_process):>9}  (two buffers per source)",
        f"  own copies per process (host){size(c.own_bytes_per_process):>9}  (with --go-back: its whole "
        "state, last two refreshes)",
    ]


def _print(r: CopiesReport) -> None:
    opt = "distributed optimizer" if r.distributed_optimizer else "plain Adam"
    print(f"peer copies: {r.model} at {r.layout} ({opt}), {r.processes} processes on {r.processes} nodes")
    print("\n".join(cost_lines(r)))
    print(f"host: {r.cpus} CPUs, load average {r.load_average[0]:.1f} before, {r.load_average[1]:.1f} after")
    for c in r.checks:
        print(check_line(c))


def _ms(values: list[float]) -> str:
    return ", ".join(f"{v * 1e3:.0f}" for v in values)
