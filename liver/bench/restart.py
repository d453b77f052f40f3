"""Stop-and-restart: what a layout change costs when it goes through a checkpoint, the way users pay it.

The baseline ``liver bench reconfig`` compares LiveR's live reshard with. One call runs a whole
transition with real processes on this machine:

1. **old world** (not timed): ``old.world_size`` fresh Python processes start, initialise
   torch.distributed, build the model, DDP and optimizer at the old layout and train a few steps;
2. **save** (from the cut, a barrier every old rank passes, to the last rank's return):
   :func:`~liver.worker_runtime.megatron.checkpoint.save_checkpoint`, durable and committed;
3. **stop**: the launcher stops the old processes (SIGTERM, as torchrun's agent does) and waits until
   they are gone; the phase ends when the new processes are started. A graceful interpreter teardown
   (1-3 s here once Megatron is imported) is not counted: launchers do not wait for one;
4. **launch / import torch / import megatron**: ``new.world_size`` fresh interpreters (``python -m``
   this module) start and import torch, then Megatron-core and LiveR's Megatron adapter;
5. **init distributed**: ``init_process_group`` (rendezvous over a TCP store) and ``parallel_state``;
6. **build**: model, DDP wrapper, optimizer and LR schedule at the new layout;
7. **load**: :func:`~liver.worker_runtime.megatron.checkpoint.load_checkpoint`, with reshape;
8. **first step**: one training step on the new world;
9. **steady steps** (not part of the total): a few more steps, whose median is the new world's steady
   step. The pause (``pause_s``: training stood still, cut to the new world ready to step) is phases 2-7;
   the first step's excess over the steady step is what the restart still costs once it runs, and
   ``downtime_s`` is the two together: downtime as a user pays it.

Each process records wall-clock timestamps (``time.time()``: every process is on this machine, so they
share a clock) when it finishes each step. A phase ends when the *slowest* process has finished it, so
the phases are the increments of the critical path and add up to ``total_s``, the time from the cut to
the end of the first step of the new world. Nothing is preloaded or forked from a warm parent: a
restart pays every interpreter start and import, which is the point of the comparison.

Processes use gloo on loopback (the Megatron adapter trains on CPU); set ``threads`` to the cores each
rank may use. :func:`measure_restart` returns a :class:`RestartBreakdown`; ``python -m
liver.bench.restart --model tiny-gpt --old 2,1,1 --new 1,2,1`` prints one.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Literal

import msgspec

from liver.shared.errors import LiverError
from liver.shared.layout import ParallelLayout
from liver.shared.model import ModelRef, ModelSpec, load_model
from liver.worker_runtime.megatron.train_config import TrainConfig

__all__ = ["PHASES", "RestartBreakdown", "RestartError", "check_fits", "measure_restart", "steady_step"]

PHASES = (
    "save",
    "stop",
    "launch",
    "import_torch",
    "import_megatron",
    "init_distributed",
    "build",
    "load",
    "first_step",
)


class RestartError(LiverError, RuntimeError):
    """A process of the measured restart failed or hung; the message holds the tail of its log."""


class RestartBreakdown(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One stop-and-restart transition, phase by phase (seconds on the critical path, see the module
    docstring); the phases add up to ``total_s``."""

    model: str
    old_layout: str
    new_layout: str
    old_processes: int
    new_processes: int
    threads: int
    save_s: float
    stop_s: float
    launch_s: float  # interpreter start up to the worker's first statement
    import_torch_s: float
    import_megatron_s: float  # Megatron-core and LiveR's adapter
    init_distributed_s: float
    build_s: float
    load_s: float
    first_step_s: float
    total_s: float  # cut -> first step done on the new world
    pause_s: float  # cut -> the new world ready to step (total_s less first_step_s)
    steady_step_s: float  # the median of the steps after the first on the new world
    first_step_excess_s: float  # the first step's excess over the steady step (never below 0)
    downtime_s: float  # pause_s + first_step_excess_s
    iteration: int  # the iteration the checkpoint was taken at
    checkpoint_bytes: int
    first_loss: float  # the new world's first loss (same on every rank)

    def phases(self) -> dict[str, float]:
        """Phase name -> seconds, in order."""
        return {name: getattr(self, f"{name}_s") for name in PHASES}


# --------------------------------------------------------------------------- the worker processes


class _Task(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    role: Literal["old", "new"]
    rank: int
    model: ModelRef
    layout: ParallelLayout
    config: TrainConfig
    port: int
    root: str
    report: str
    warmup_steps: int
    threads: int
    timeout_s: float
    steady_steps: int = 3


class _Report(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Wall-clock timestamps (``time.time()``) at the end of each step a worker went through."""

    role: Literal["old", "new"]
    rank: int
    started: float
    torch_imported: float
    megatron_imported: float
    initialized: float
    built: float
    cut: float | None = None  # old world
    saved: float | None = None
    iteration: int | None = None
    loaded: float | None = None  # new world
    first_step: float | None = None
    loss: float | None = None
    step_ends: list[float] = []  # new world: the end of every step, the first included


def _worker(task_file: str) -> None:
    """One rank of the old or the new world (runs in a fresh interpreter: ``python -m`` this module)."""
    started = time.time()
    task = msgspec.json.decode(Path(task_file).read_bytes(), type=_Task)
    import torch
    import torch.distributed as dist

    torch_imported = time.time()
    torch.set_num_threads(task.threads)
    import megatron.core  # noqa: F401  (what a Megatron job imports before anything else)

    from liver.shared.logs import configure_logging
    from liver.worker_runtime.megatron.build import initialize_parallel_state
    from liver.worker_runtime.megatron.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from liver.worker_runtime.megatron.train import build_trainer

    megatron_imported = time.time()
    configure_logging(level="WARNING", stream=sys.stderr)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{task.port}",
        rank=task.rank,
        world_size=task.layout.world_size,
        timeout=timedelta(seconds=task.timeout_s),
    )
    initialize_parallel_state(task.layout)
    initialized = time.time()
    from liver.worker_runtime.megatron.source import source_of

    trainer = build_trainer(source_of(task.model), task.layout, task.config)
    built = time.time()
    times = dict(
        role=task.role,
        rank=task.rank,
        started=started,
        torch_imported=torch_imported,
        megatron_imported=megatron_imported,
        initialized=initialized,
        built=built,
    )
    if task.role == "old":
        for _ in range(task.warmup_steps):
            trainer.train_step()
        dist.barrier()
        cut = time.time()
        save_checkpoint(trainer, task.root, keep_last=1)
        report = _Report(**times, cut=cut, saved=time.time(), iteration=trainer.iteration)
    else:
        checkpoint = latest_checkpoint(task.root)
        if checkpoint is None:
            raise RuntimeError(f"{task.root}: the old world committed no checkpoint")
        load_checkpoint(trainer, checkpoint)
        loaded = time.time()
        result = trainer.train_step()
        ends = [time.time()]
        for _ in range(task.steady_steps):
            trainer.train_step()
            ends.append(time.time())
        report = _Report(**times, loaded=loaded, first_step=ends[0], loss=result.loss, step_ends=ends)
    partial = Path(task.report + ".partial")
    partial.write_bytes(msgspec.json.encode(report))
    partial.replace(task.report)  # the parent never reads half a report
    sys.stdout.flush()
    sys.stderr.flush()
    if task.role == "old":
        # The launcher stops the job now (SIGTERM, as torchrun's agent does); wait for it, but never
        # outlive the measurement.
        time.sleep(task.timeout_s)
    os._exit(0)


# --------------------------------------------------------------------------- the parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


class _World:
    """The processes of one world, each with its task, report and log file under ``workdir``."""

    def __init__(self, role: Literal["old", "new"], workdir: Path, tasks: list[_Task]) -> None:
        self.role = role
        self.logs = [workdir / f"{role}-{t.rank}.log" for t in tasks]
        self.reports = [Path(t.report) for t in tasks]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.spawned_at = time.time()
        env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        for task, log_path in zip(tasks, self.logs):
            task_file = workdir / f"{role}-{task.rank}.task.json"
            task_file.write_bytes(msgspec.json.encode(task))
            with open(log_path, "wb") as log_file:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "liver.bench.restart", "--worker", str(task_file)],
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )

    def wait_for_reports(self, deadline: float) -> None:
        """Wait until every process has written its report; raises naming one that failed or hung."""
        pending = set(range(len(self.procs)))
        while pending:
            for rank in sorted(pending):
                if self.reports[rank].exists():
                    pending.discard(rank)
                elif self.procs[rank].poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    code = self.procs[rank].returncode
                    what = "did not report in time" if code is None or code < 0 else f"exited with {code}"
                    raise RestartError(
                        f"{self.role} rank {rank} {what}; its log ends:\n{_tail(self.logs[rank])}"
                    )
            time.sleep(0.005)

    def stop(self) -> None:
        """Stop every process as a launcher stops a job (SIGTERM) and wait until all have exited."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            proc.wait()

    def read(self) -> list[_Report]:
        return [msgspec.json.decode(p.read_bytes(), type=_Report) for p in self.reports]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def check_fits(spec: ModelSpec | ModelRef, layout: ParallelLayout, config: TrainConfig, name: str) -> None:
    """Refuse a layout that ``spec`` or ``config``'s batch cannot be split by, naming it ``name``."""
    try:
        ModelRef.of(spec).model_geometry().check_layout(layout)
        config.micro_batches_per_rank(layout.dp)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _checked(spec: ModelRef, layout: ParallelLayout, config: TrainConfig, name: str) -> None:
    """Refuse in the parent what the workers would refuse after seconds of imports."""
    check_fits(spec, layout, config, name)
    if config.seq_length > spec.sequence_limit:
        raise ValueError(
            f"config.seq_length: {config.seq_length} exceeds the model's max_sequence_length "
            f"({spec.sequence_limit})"
        )


def measure_restart(
    model: ModelSpec | ModelRef,
    old: ParallelLayout,
    new: ParallelLayout,
    config: TrainConfig | None = None,
    *,
    warmup_steps: int = 2,
    steady_steps: int = 3,
    threads: int = 1,
    timeout_s: float = 600.0,
    workdir: str | os.PathLike[str] | None = None,
) -> RestartBreakdown:
    """Run one stop-and-restart transition ``old`` -> ``new`` of ``spec`` and time its phases.

    ``old.world_size`` processes train ``warmup_steps`` steps, then the restart runs as described in
    the module docstring with ``new.world_size`` new processes. Each run works in a fresh directory
    (the checkpoint, each process's task, log and report): under ``workdir``, where it is kept, or in
    the system's temporary directory, removed afterwards.
    """
    config = config or TrainConfig()
    spec = ModelRef.of(model)
    _checked(spec, old, config, "old")
    _checked(spec, new, config, "new")
    if warmup_steps < 1:
        raise ValueError(
            f"warmup_steps must be at least 1 (the checkpoint must hold Adam state), got {warmup_steps}"
        )
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if steady_steps < 1:
        raise ValueError(
            f"steady_steps must be at least 1 (the steady step is their median), got {steady_steps}"
        )
    owned = workdir is None
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="liver-restart-", dir=workdir))
    root = base / "checkpoints"
    deadline = time.monotonic() + timeout_s

    def tasks(role: Literal["old", "new"], layout: ParallelLayout) -> list[_Task]:
        port = _free_port()
        return [
            _Task(
                role=role,
                rank=rank,
                model=spec,
                layout=layout,
                config=config,
                port=port,
                root=str(root),
                report=str(base / f"{role}-{rank}.report.json"),
                warmup_steps=warmup_steps,
                threads=threads,
                timeout_s=timeout_s,
                steady_steps=steady_steps,
            )
            for rank in range(layout.world_size)
        ]

    old_world = new_world = None
    try:
        old_world = _World("old", base, tasks("old", old))
        old_world.wait_for_reports(deadline)
        old_world.stop()
        new_world = _World("new", base, tasks("new", new))
        new_world.wait_for_reports(deadline)
        new_world.stop()
        olds, news = old_world.read(), new_world.read()
        checkpoint_bytes = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    finally:
        for world in (old_world, new_world):
            if world is not None:
                world.kill()
        if owned:
            shutil.rmtree(base, ignore_errors=True)
    cut = max(r.cut for r in olds if r.cut is not None)
    bounds = [
        cut,
        max(r.saved for r in olds if r.saved is not None),
        new_world.spawned_at,  # the stop phase ends when the new processes are started
        max(r.started for r in news),
        max(r.torch_imported for r in news),
        max(r.megatron_imported for r in news),
        max(r.initialized for r in news),
        max(r.built for r in news),
        max(r.loaded for r in news if r.loaded is not None),
        max(r.first_step for r in news if r.first_step is not None),
    ]
    seconds = {name: bounds[i + 1] - bounds[i] for i, name in enumerate(PHASES)}
    steady = steady_step([r.step_ends for r in news])
    excess = max(seconds["first_step"] - steady, 0.0)
    pause = bounds[-2] - bounds[0]
    return RestartBreakdown(
        model=spec.name,
        old_layout=old.describe(),
        new_layout=new.describe(),
        old_processes=old.world_size,
        new_processes=new.world_size,
        threads=threads,
        **{f"{name}_s": value for name, value in seconds.items()},
        total_s=bounds[-1] - bounds[0],
        pause_s=pause,
        steady_step_s=steady,
        first_step_excess_s=excess,
        downtime_s=pause + excess,
        iteration=max(r.iteration for r in olds if r.iteration is not None),
        checkpoint_bytes=checkpoint_bytes,
        first_loss=news[0].loss if news[0].loss is not None else float("nan"),
    )


def steady_step(step_ends: Sequence[Sequence[float]]) -> float:
    """The job's steady step from every process's step end times (the first step's included): a step of
    the job ends when its last process ends it; the median of the steps after the first."""
    counts = {len(ends) for ends in step_ends}
    if len(counts) != 1 or min(counts) < 2:
        raise RestartError(
            f"every process must report the same number (>= 2) of step ends, got {sorted(counts)}"
        )
    job = [max(column) for column in zip(*step_ends)]
    return statistics.median(b - a for a, b in itertools.pairwise(job))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m liver.bench.restart``: one measured transition, printed as a table or JSON."""
    parser = argparse.ArgumentParser(
        prog="python -m liver.bench.restart", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="tiny-gpt", help="preset name or model .json (default tiny-gpt)")
    parser.add_argument("--old", default="2,1,1", help="old layout TP,PP,DP (default 2,1,1)")
    parser.add_argument("--new", default="1,2,1", help="new layout TP,PP,DP (default 1,2,1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    breakdown = measure_restart(
        load_model(args.model),
        ParallelLayout.parse(args.old),
        ParallelLayout.parse(args.new),
        TrainConfig(global_batch_size=8, micro_batch_size=1, seq_length=32),
        threads=args.threads,
    )
    if args.json:
        sys.stdout.write(msgspec.json.encode(breakdown).decode() + "\n")
        return 0
    print(f"stop-and-restart {breakdown.model}: {breakdown.old_layout} -> {breakdown.new_layout}")
    for name, value in breakdown.phases().items():
        print(f"  {name:<18}{value:9.3f} s")
    print(f"  {'total':<18}{breakdown.total_s:9.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
