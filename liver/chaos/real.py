"""``liver chaos --workers real``: the chaos run with real training processes instead of the stand-in job.

Every device of the job is one ``liver worker`` process (a tiny Megatron-core GPT on CPU, a preset or
the user's job from ``--job-factory``), forked from one fork server that imported torch and Megatron
once (:class:`~liver.demo.procs.ProcessBook`), two devices per node, each node on a loopback address of
its own (``127.0.0.<n+1>``). The first world is TP2 x DP2 on node000 and node001, started by its own
workers (rank 0 announces it); the other nodes' processes start as standbys when a scale request is
about to bring the node back. Besides the stand-in run's steps (a spot warning or a scale request, and
a kill of a service or the server inside the handoff), a step can be a loss (:class:`Loss`): kill -9 of
one training process of the world, or of every process of one of its nodes, outside any handoff; and a
handoff can have a training process of the staying world killed in its middle (:attr:`Target.WORKER`).

The checker adds what only real processes can break (:func:`check_real`): every spot warning ends in a
commit that leaves the warned node, every loss ends in a live recovery (a commit without the lost
devices, never a checkpoint fallback) within :data:`RECOVERY_LIMIT_S`, iterations never go back in any
worker's metrics (but for the one step a recovery from a copy a step behind trains again), and no
worker exits non-zero unless the run killed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import msgspec
import structlog

from liver.chaos.checker import Invariant, Outcome, Violation, check
from liver.chaos.run import (
    JOB,
    ChaosConfig,
    ChaosError,
    ChaosRun,
    EventKind,
    StepRecord,
)
from liver.chaos.schedule import Kill, Loss, Schedule, Step, Target
from liver.reshard.plan import WorldConfig
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.messages import AbortOutcome, GenerationAborted, GenerationCommitted
from liver.shared.model import PRESETS
from liver.shared.nats_server import free_port

log = structlog.get_logger(__name__)

DEVICES_PER_NODE: Final = 2
GLOBAL_BATCH: Final = 12
"""Splits into micro-batches for every data-parallel size the job can take on 2-6 devices."""
SEQUENCE: Final = 16
HEARTBEAT_S: Final = 1.0
RECOVERY_LIMIT_S: Final = 15.0
"""A loss with a replica must be training again (a step on the recovered world) within this."""
FIRST_WORLD: Final = ParallelLayout(tp=2, pp=1, dp=2)
WORKER_START_S: Final = 240.0
FALLBACK: Final = AbortOutcome.CHECKPOINT_FALLBACK


class LossRecord(msgspec.Struct, kw_only=True):
    step: int
    kind: Loss
    devices: tuple[Device, ...]
    killed_at: float
    """Wall-clock time (time.time) of the kill."""
    generation: int | None = None
    """The generation that recovered (committed without the lost devices)."""
    committed_s: float | None = None
    training_s: float | None = None
    """From the kill to the first step on the recovered world (any worker's metrics)."""


class RealResult(msgspec.Struct, kw_only=True):
    seed: int
    steps: list[StepRecord]
    losses: list[LossRecord]
    outcomes: int
    committed: int
    kills: dict[str, int]
    worker_exits: dict[str, int]
    """Exit code per worker process the run did not kill (0 expected)."""
    violations: list[Violation]
    failure: str | None
    seconds: float
    log_dir: str

    @property
    def passed(self) -> bool:
        return (
            self.failure is None
            and not self.violations
            and all(step.outcome != "timeout" for step in self.steps)
        )


def real_summary(result: RealResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "steps": len(result.steps),
        "committed": result.committed,
        "kills": sum(result.kills.values()),
        "losses": len(result.losses),
        "violations": len(result.violations),
    }
    training = [loss.training_s for loss in result.losses if loss.training_s is not None]
    if training:
        out["recovery_training_s_median"] = statistics.median(training)
        out["recovery_training_s_max"] = max(training)
    calm = [s.seconds for s in result.steps if s.seconds is not None and s.kill is None and s.loss is None]
    if calm:
        out["handoff_s_median"] = statistics.median(calm)
    return out


class RealChaosRun(ChaosRun):
    """A :class:`ChaosRun` whose job is real training processes (see the module docstring)."""

    def __init__(
        self,
        schedule: Schedule,
        config: ChaosConfig,
        log_dir: Path,
        progress: Callable[[str], None] = lambda _: None,
        *,
        job_factory: str | None = None,
        job_args: dict[str, str] | None = None,
        first: ParallelLayout = FIRST_WORLD,
    ) -> None:
        """``first``: the first world's layout, on as many nodes as its ranks fill."""
        super().__init__(schedule, config, log_dir, progress)
        from liver.demo.procs import MARK_ENV, ProcessBook

        self.job_factory = job_factory
        self.job_args = dict(job_args or {})
        if first.world_size % DEVICES_PER_NODE or not 0 < first.world_size <= config.nodes * DEVICES_PER_NODE:
            raise ChaosError(f"`first`: {first.describe()} does not fill whole nodes of {DEVICES_PER_NODE}")
        self.first = first
        self.world = self.all_nodes[: first.world_size // DEVICES_PER_NODE]
        self.world_devices = first.world_size
        self.metrics_dir = log_dir / "metrics"
        self.metrics_dir.mkdir(parents=True, exist_ok=True)
        self.stop_file = log_dir / "stop"
        environ = {**self.procs.environment(), MARK_ENV: f"chaos-{os.getpid()}"}
        self.book = ProcessBook(log_dir / "workers", environ)
        self.workers: dict[Device, Any] = {}
        """The live (or last) worker process per device."""
        self.killed: set[int] = set()
        """Pids the run killed (their exit code is the kill's)."""
        self.losses: list[LossRecord] = []
        self._incarnation: Counter[Device] = Counter()
        self._step_index = 0
        self._leaving: str | None = None
        self.keep_fork_server = False
        self.current = WorldConfig(first, Placement(tuple(d for n in self.world for d in self._devices(n))))
        """The world that trains now (the last commit's)."""
        self.geometry: ModelGeometry = PRESETS["tiny-gpt"].geometry()
        """What the job's plans move (the user's job's own with --job-factory)."""

    # -- the job's processes ---------------------------------------------------------------------------

    def _host(self, node: str) -> str:
        return f"127.0.0.{self.all_nodes.index(node) + 1}"

    def _settings(self, device: Device, initial: Any = None, port: int = 0) -> bytes:
        from liver.worker_runtime.megatron.train_config import TrainConfig
        from liver.worker_runtime.worker_main import WorkerSettings

        self._incarnation[device] += 1
        name = f"w-{device.node}-{device.index}-{self._incarnation[device]}"
        settings = WorkerSettings(
            job_id=JOB,
            node=device.node,
            device=device.index,
            worker_id=name,  # a process started again is a new worker, not the old one restarted
            job_factory=self.job_factory,
            job_args=self.job_args,
            train=TrainConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=1, seq_length=SEQUENCE),
            host=self._host(device.node),
            port=port,
            initial=initial,
            metrics=str(self.metrics_dir / f"{name}.jsonl"),
            stop_file=str(self.stop_file),
            heartbeat_s=HEARTBEAT_S,
        )
        return msgspec.json.encode(settings)

    def _start_worker(self, device: Device, initial: Any = None, port: int = 0) -> None:
        settings = self._settings(device, initial, port)
        name = f"w-{device.node}-{device.index}-{self._incarnation[device]}"
        self.workers[device] = self.book.start_worker(name, settings, self.procs.url)

    def _devices(self, node: str) -> tuple[Device, ...]:
        return tuple(Device(node, i) for i in range(DEVICES_PER_NODE))

    def _kill_devices(self, devices: tuple[Device, ...]) -> None:
        for device in devices:
            proc = self.workers.get(device)
            if proc is not None and proc.alive():
                self.killed.add(proc.pid)
                proc.signal_group(signal.SIGKILL)
        for device in devices:
            proc = self.workers.get(device)
            if proc is not None:
                proc.wait(10.0)

    # -- setup ----------------------------------------------------------------------------------------

    def _write_configs(self) -> None:
        setup = {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 1, "sequence_length": SEQUENCE}
        if self.job_factory is not None:  # the topology service plans for the user's training setup
            from liver.worker_runtime.megatron.job import load_job

            job = load_job(self.job_factory, self.job_args)
            self.geometry, train = job.model, job.config
            setup = {
                "global_batch_size": train.global_batch_size,
                "micro_batch_size": train.micro_batch_size,
                "sequence_length": train.seq_length,
            }
        profile = {"model": "tiny-gpt", "hardware": "cpu-small", "setup": setup}
        # Layouts whose state survives a node's loss, where one exists: the losses here must be ones a
        # replica covers (the others fall back to the checkpoint, which this run counts as a failure).
        config = {"jobs": {JOB: profile}, "redundancy": "node"}
        self.procs.topology_config.write_bytes(msgspec.json.encode(config))
        core = {"heartbeat_timeout_s": 10.0, "suspect_timeout_s": 5.0}
        self.procs.coordinator_config.write_bytes(msgspec.json.encode({"core": core}))

    async def start(self) -> None:
        from liver.bench.bus import rig
        from liver.worker_runtime.worker_main import InitialWorld

        self._write_configs()
        self.procs.server.start()
        self.nc = await self._connect()
        await self.watch.start(self.nc)
        for target in (Target.INGESTER, Target.TOPOLOGY, Target.TRANSFER, Target.COORDINATOR):
            child = self.procs.start_service(target)
            await rig.wait_ready(self.nc, child, target.value, 120.0)
        devices = tuple(d for node in self.world for d in self._devices(node))
        placement = Placement(devices)
        port = free_port()
        for rank, device in enumerate(devices):
            initial = InitialWorld(
                layout=self.first,
                placement=placement,
                store=None if rank == 0 else f"{self._host(devices[0].node)}:{port}",
            )
            self._start_worker(device, initial, port if rank == 0 else 0)
        await self._membership_within(0, len(devices), WORKER_START_S)

    async def _membership_within(self, generation: int, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_workers_alive()
            # One poll of up to 5 s between checks that the workers live: a poll that times out (the
            # workers still starting on a busy machine) is not a failure, only the deadline is.
            with contextlib.suppress(ChaosError, TimeoutError):
                await asyncio.wait_for(self._membership(generation, count), 5.0)
                return
            if time.monotonic() > deadline:
                raise ChaosError(f"generation {generation} with {count} workers never formed")

    def _check_workers_alive(self) -> None:
        """A worker that exited on its own (not left, not killed) fails the run at once."""
        for device, proc in self.workers.items():
            code = proc.exitcode
            if code not in (None, 0) and proc.pid not in self.killed:
                raise ChaosError(f"worker on {device} exited with {code} (log {proc.log_path})")

    # -- steps ----------------------------------------------------------------------------------------

    async def _node_returns(self, node: str) -> None:
        """Standby processes on a node that comes back, counted by the coordinator before the request."""
        for device in self._devices(node):
            proc = self.workers.get(device)
            if proc is not None and proc.alive():
                self.killed.add(proc.pid)
                proc.signal_group(signal.SIGKILL)
                proc.wait(10.0)
            self._start_worker(device)
        names = {f"w-{d.node}-{d.index}-{self._incarnation[d]}" for d in self._devices(node)}
        expected = self.world_devices + DEVICES_PER_NODE
        deadline = time.monotonic() + WORKER_START_S
        await self._until_within(
            lambda status: names <= self.watch.hellos and status.get("workers") == expected,
            f"the standbys on {node} said hello and are counted ({expected} workers)",
            deadline,
        )

    async def _until_within(
        self, check_: Callable[[dict[str, Any]], bool], what: str, deadline: float
    ) -> None:
        while not check_(await self._status()):
            self.procs.restart_exited_services()
            self._check_workers_alive()
            if time.monotonic() > deadline:
                raise ChaosError(f"not true in time: {what}")
            await asyncio.sleep(0.2)

    async def _kill(self, kill: Kill) -> None:
        if kill.target not in (Target.WORKER, Target.WORKER_IN_RESTART):
            await super()._kill(kill)
            return
        waits = [
            asyncio.ensure_future(self.watch.seen(kill.stage)),
            asyncio.ensure_future(self._ended.wait()),
        ]
        try:
            await asyncio.wait(waits, timeout=30.0, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        staying = [d for d in self.current.placement.devices if d.node != self._leaving]
        survivable = [d for d in staying if self._survives((d,))]
        if not survivable:  # no replica of its state: not a live-recovery case
            self.progress(f"  (no worker kill: no staying worker of {self.world} has its state replicated)")
            return
        victim = survivable[-1]

        def kill_victim() -> None:
            self.kills[kill.target.value] += 1
            self._kill_devices((victim,))
            self.losses.append(
                LossRecord(step=self._step_index, kind=Loss.WORKER, devices=(victim,), killed_at=time.time())
            )

        if kill.target == Target.WORKER:
            self.progress(f"  kill -9 the worker on {victim} at {kill.stage.value}")
            kill_victim()
            return
        self.progress(
            f"  kill -9 the coordinator at {kill.stage.value}, then the worker on {victim} while it is "
            f"down; the coordinator back in {kill.down_s:.1f} s"
        )
        await self._restart_service(Target.COORDINATOR, kill.down_s, kill_victim)

    async def step(self, step: Step) -> StepRecord:
        self._step_index = step.index
        self._leaving: str | None = None
        if step.loss is not None and len(self.world) >= 2:
            return await self._loss_step(step)
        kind, nodes = self._choose(step)
        if kind == EventKind.SHRINK:
            self._leaving = nodes[0]
        record = await super().step(step)
        commits = [o for o in await self.outcomes() if isinstance(o, GenerationCommitted)]
        if commits:
            self.current = WorldConfig(commits[-1].layout, commits[-1].placement)
        for loss in self.losses:
            if loss.step == step.index and loss.generation is None:
                await self._recovered(loss, record)
        return record

    def _choose(self, step: Step) -> tuple[EventKind, tuple[str, ...]]:
        """As the stand-in run chooses, but never two warnings at once (the world here has two nodes)
        and never the last node of the world."""
        free = [n for n in self.all_nodes if n not in self.world]
        can_shrink, can_grow = len(self.world) >= 2, bool(free)
        shrink = can_shrink and (not can_grow or step.draw < 0.5)
        pool = list(self.world) if shrink else free
        first = pool[min(int(step.draw * 2 % 1 * len(pool)), len(pool) - 1)]
        return (EventKind.SHRINK if shrink else EventKind.GROW), (first,)

    def _survives(self, lost: tuple[Device, ...]) -> bool:
        """Whether a replica outside ``lost`` holds every piece of the current world's state (the
        transfer planner's own rule): only such a loss can be recovered live."""
        from liver.reshard.planner import orphaned_shards

        return not orphaned_shards(self.geometry, self.current, lost)

    def _loss_candidates(self, loss: Loss) -> list[tuple[Device, ...]]:
        devices = self.current.placement.devices
        if loss == Loss.WORKER:
            groups = [(d,) for d in devices]
        else:
            nodes = list(dict.fromkeys(d.node for d in devices))
            groups = [tuple(d for d in devices if d.node == n) for n in nodes] if len(nodes) > 1 else []
        return [g for g in groups if self._survives(g)]

    async def _loss_step(self, step: Step) -> StepRecord:
        assert step.loss is not None
        candidates = self._loss_candidates(step.loss)
        record = StepRecord(index=step.index, kind=EventKind.SHRINK, event_ids=(), nodes=(), kill=None)
        record.loss = step.loss
        if not candidates:
            self.progress(f"  (no {step.loss.value} loss: no replica would hold the state of {self.world})")
            record.seconds, record.outcome = 0.0, "skipped"
            return record
        devices = candidates[min(int(step.draw * len(candidates)), len(candidates) - 1)]
        record.nodes = tuple(dict.fromkeys(d.node for d in devices))
        before = len(await self.outcomes())
        self.progress(f"  kill -9 {step.loss.value} {', '.join(map(str, devices))}")
        loss = LossRecord(step=step.index, kind=step.loss, devices=devices, killed_at=time.time())
        started = time.monotonic()
        self._kill_devices(devices)
        self.losses.append(loss)
        deadline = started + self.config.outcome_timeout_s
        while True:
            self.procs.restart_exited_services()
            fresh = (await self.outcomes())[before:]
            done = [o for o in fresh if isinstance(o, GenerationCommitted) and _without(o, devices)]
            fell = [o for o in fresh if isinstance(o, GenerationAborted) and o.outcome == FALLBACK]
            if done or fell:
                record.seconds = time.monotonic() - started
                break
            if time.monotonic() > deadline:
                return record
            await asyncio.sleep(0.1)
        if fell:
            record.outcome = "aborted"
            return record
        commit = done[0]
        record.generations = (commit.generation,)
        record.outcome = "committed"
        await self._recovered(loss, record, commit)
        await self._settle_on(commit)
        return record

    async def _recovered(self, loss: LossRecord, record: StepRecord, commit: Any = None) -> None:
        """Note the loss's recovery: the first commit after the kill without the lost devices."""
        if commit is None:
            commits = [o for o in await self.outcomes() if isinstance(o, GenerationCommitted)]
            fitting = [
                c
                for c in commits
                if c.committed_at.timestamp() >= loss.killed_at and _without(c, loss.devices)
            ]
            if not fitting:
                return
            commit = fitting[0]
        loss.generation = commit.generation
        loss.committed_s = commit.committed_at.timestamp() - loss.killed_at
        loss.training_s = await self._first_step_after(commit.generation, loss.killed_at)

    async def _first_step_after(self, generation: int, since: float, timeout_s: float = 30.0) -> float | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            times = [r["t"] for r in _steps(self.metrics_dir) if r.get("generation") == generation]
            first = min((t for t in times if t >= since), default=None)
            if first is not None:
                return first - since
            await asyncio.sleep(0.2)
        return None

    async def _settle_on(self, commit: GenerationCommitted) -> None:
        self.current = WorldConfig(commit.layout, commit.placement)
        self.world = tuple(dict.fromkeys(d.node for d in commit.placement.devices))
        self.world_devices = len(commit.placement)
        stable = {"phase": "stable", "generation": commit.generation}
        deadline = time.monotonic() + self.config.settle_timeout_s
        await self._until_within(
            lambda status: {k: status.get(k) for k in stable} == stable,
            f"the coordinator stable at generation {commit.generation}",
            deadline,
        )
        await self._membership(commit.generation, self.world_devices)

    # -- the whole run --------------------------------------------------------------------------------

    async def _stop_workers(self) -> dict[str, int]:
        """Stop every worker at one iteration (the stop file), and collect the exit codes of those the
        run did not kill."""
        furthest = max((r["iteration"] for r in _steps(self.metrics_dir)), default=0)
        self.stop_file.write_text(str(furthest + 8))
        in_world = {self.workers[d].pid for d in self.current.placement.devices if d in self.workers}
        deadline = time.monotonic() + 120.0
        while time.monotonic() < deadline and any(
            p.alive() for p in self.workers.values() if p.pid in in_world
        ):
            await asyncio.sleep(0.2)
        for proc in self.workers.values():  # standbys train no iteration: SIGTERM ends them (exit 0)
            if proc.alive() and proc.pid not in in_world:
                proc.signal_group(signal.SIGTERM)
        for proc in self.workers.values():
            proc.wait(30.0)
        exits = {}
        for proc in self.book.workers():
            if proc.pid in self.killed:
                continue
            if proc.alive():
                proc.signal_group(signal.SIGKILL)
                proc.wait(10.0)
                exits[proc.name] = -9
            else:
                exits[proc.name] = int(proc.exitcode or 0)
        return exits

    async def run_real(self) -> RealResult:
        started = time.monotonic()
        records: list[StepRecord] = []
        failure: str | None = None
        exits: dict[str, int] = {}
        outcomes: list[Outcome] = []
        violations: list[Violation] = []
        try:
            self.progress(
                f"starting a nats-server, four services and {self.world_devices} training processes"
            )
            await self.start()
            for step in self.schedule.steps:
                try:
                    record = await self.step(step)
                except ChaosError as exc:
                    failure = f"step {step.index}: {exc}"
                    self.progress(failure)
                    break
                records.append(record)
                what = record.loss.value if record.loss is not None else record.kind.value
                took = "no outcome"
                if record.seconds is not None:
                    took = f"{record.outcome} in {record.seconds:.1f} s"
                where = ",".join(record.nodes)
                self.progress(f"step {step.index + 1}/{len(self.schedule.steps)}: {what} {where} -> {took}")
                if record.seconds is None:
                    break
                if record.loss is not None and record.outcome == "aborted":
                    # The job fell back to its checkpoint (it has none here): nothing trains any more.
                    failure = f"step {step.index}: the {record.loss.value} loss fell back to the checkpoint"
                    self.progress(failure)
                    break
            exits = await self._stop_workers()
            outcomes = await self.outcomes()
            violations = check(self.published, outcomes, await self.record(), self.watch.outcomes)
            violations += check_real(records, outcomes, self.losses, self.metrics_dir, exits)
        finally:
            await self.close()
            self.book.stop_all(grace_s=5.0, fork_server=not self.keep_fork_server)
        return RealResult(
            seed=self.schedule.seed,
            steps=records,
            losses=self.losses,
            outcomes=len(outcomes),
            committed=sum(isinstance(o, GenerationCommitted) for o in outcomes),
            kills=dict(self.kills),
            worker_exits=exits,
            violations=violations,
            failure=failure,
            seconds=time.monotonic() - started,
            log_dir=str(self.procs.log_dir),
        )


class UnreplicatedLoss(msgspec.Struct, kw_only=True):
    """A loss no replica covers (:func:`run_unreplicated_loss`): the survivor recovers from the peer
    copy of the lost process's shard it keeps."""

    seconds: float
    """From the kill to the commit of the recovery (or to giving up on it)."""
    recovered_live: bool
    """A generation without the lost device committed after the kill."""
    training_s: float | None
    """From the kill to the first step on that generation (None: none within the wait)."""
    survivor_alive: bool
    fallbacks: int
    """Checkpoint-fallback aborts the coordinator published (0 expected)."""
    log_dir: str
    in_refresh: int = 0
    """Earlier attempts whose kill landed in the victim's copy refresh and whose survivors could not go
    back to the iteration of its copy (which they do when each still has its own copy of it), each run
    again from the start."""

    @property
    def passed(self) -> bool:
        return (
            self.recovered_live
            and self.survivor_alive
            and self.fallbacks == 0
            and self.training_s is not None
            and self.training_s < UNREPLICATED_LIMIT_S
        )


UNREPLICATED: Final = ParallelLayout(tp=2, pp=1, dp=1)
UNREPLICATED_LIMIT_S: Final = 60.0
"""From the kill to training again: the probe of the world, planning, and the move from the copy."""
ATTEMPTS: Final = 3
"""Runs of :func:`run_unreplicated_loss` at most: an attempt whose kill lands in the victim's copy
refresh and whose survivors cannot go back a step is run again, and counted."""
STEPS_BEFORE_LOSS: Final = 2
"""Steps the job trains before the kill: its processes' first peer copies exist after the first."""


async def _lose_unreplicated(run: RealChaosRun) -> UnreplicatedLoss:
    await run.start()
    survivor, victim = run.workers[Device(run.world[0], 0)], Device(run.world[0], 1)
    deadline = time.monotonic() + WORKER_START_S
    while len(_steps(run.metrics_dir)) < 2 * STEPS_BEFORE_LOSS and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    run.progress(f"kill -9 {victim} of a {UNREPLICATED.describe()} world (no replica; peer copies)")
    killed_at, killed_wall = time.monotonic(), time.time()
    run._kill_devices((victim,))
    commit: GenerationCommitted | None = None
    fallbacks = 0
    while commit is None and time.monotonic() - killed_at < UNREPLICATED_LIMIT_S:
        outcomes = await run.outcomes()
        fallbacks = sum(isinstance(o, GenerationAborted) and o.outcome == FALLBACK for o in outcomes)
        fitting = [
            o
            for o in outcomes
            if isinstance(o, GenerationCommitted)
            and o.committed_at.timestamp() >= killed_wall
            and _without(o, (victim,))
        ]
        commit = fitting[0] if fitting else None
        if commit is None and not fallbacks:
            await asyncio.sleep(0.2)
        elif fallbacks:
            break
    seconds = time.monotonic() - killed_at
    training_s = None if commit is None else await run._first_step_after(commit.generation, killed_wall)
    return UnreplicatedLoss(
        seconds=seconds,
        recovered_live=commit is not None,
        training_s=training_s,
        survivor_alive=survivor.alive(),
        fallbacks=fallbacks,
        log_dir=str(run.procs.log_dir),
    )


def run_unreplicated_loss(
    config: ChaosConfig | None = None,
    log_dir: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
    *,
    keep_fork_server: bool = False,
) -> UnreplicatedLoss:
    """A TP2 job on one node (DP=1, no checkpoint) loses one of its two processes after a few steps: no
    replica holds the lost shard, but the survivor keeps its peer copy, so the job moves live to TP1 on
    the survivor (before peer copies, the coordinator decided the checkpoint fallback here)."""
    from liver.bench.bus import rig
    from liver.worker_runtime.copies.manager import IN_REFRESH

    config = config or ChaosConfig(nodes=3)
    with rig.log_directory(log_dir, "liver-chaos-dp1-") as where:
        for attempt in range(ATTEMPTS):
            here = where / f"attempt-{attempt + 1}"
            here.mkdir(exist_ok=True)
            run = RealChaosRun(Schedule(seed=0, steps=()), config, here, progress, first=UNREPLICATED)
            last = attempt == ATTEMPTS - 1

            async def scenario(run: RealChaosRun = run, last: bool = last) -> UnreplicatedLoss:
                try:
                    return await _lose_unreplicated(run)
                finally:
                    await run.close()
                    run.book.stop_all(grace_s=5.0, fork_server=last and not keep_fork_server)

            result = asyncio.run(scenario())
            if result.recovered_live or not _lost_in_refresh(here):
                return msgspec.structs.replace(result, in_refresh=attempt, log_dir=str(where))
            progress(f"the kill landed in the victim's copy refresh ({IN_REFRESH}) for good; again")
        return msgspec.structs.replace(result, in_refresh=ATTEMPTS, log_dir=str(where))


def _lost_in_refresh(log_dir: Path) -> bool:
    """Whether a survivor's recovery failed because the lost rank's copy was a step behind."""
    from liver.worker_runtime.copies.manager import IN_REFRESH

    return any(IN_REFRESH in path.read_text(errors="replace") for path in (log_dir / "workers").glob("*.log"))


def _without(commit: GenerationCommitted, devices: tuple[Device, ...]) -> bool:
    return not set(devices) & set(commit.placement.devices)


def _steps(metrics_dir: Path) -> list[dict[str, Any]]:
    """Every step record of every worker's metrics file."""
    return [r for path in sorted(metrics_dir.glob("*.jsonl")) for r in _steps_of(path)]


def check_real(
    steps: list[StepRecord],
    outcomes: list[Outcome],
    losses: list[LossRecord],
    metrics_dir: Path,
    exits: dict[str, int],
) -> list[Violation]:
    """What a run with real training processes must also show (see the module docstring)."""
    out: list[Violation] = []
    commits = [o for o in outcomes if isinstance(o, GenerationCommitted)]
    for step in steps:
        if step.kind != EventKind.SHRINK or step.loss is not None:
            continue
        for event_id, node in zip(step.event_ids, step.nodes, strict=True):
            settled = [c for c in commits if event_id in c.event_ids]
            if not settled or any(d.node == node for d in settled[0].placement.devices):
                out.append(
                    Violation(
                        invariant=Invariant.LEAVES_WARNED_NODE,
                        detail=f"the warning {event_id} for {node} did not end in a commit without it",
                    )
                )
    for loss in losses:
        if loss.generation is None or loss.training_s is None or loss.training_s > RECOVERY_LIMIT_S:
            out.append(
                Violation(
                    invariant=Invariant.LIVE_RECOVERY,
                    detail=(
                        f"the {loss.kind.value} loss of {', '.join(map(str, loss.devices))} in step "
                        f"{loss.step}: recovered in generation {loss.generation}, training again after "
                        f"{loss.training_s} s"
                    ),
                )
            )
    for path in sorted(metrics_dir.glob("*.jsonl")):
        steps = _steps_of(path)
        iterations = [r["iteration"] for r in steps]
        # A recovery whose lost rank died in its copy's refresh goes back one step: the new generation
        # trains the last step of the old one again. Nothing else repeats or goes back.
        if any(
            b["iteration"] < a["iteration"]
            or (b["iteration"] == a["iteration"] and b.get("generation") == a.get("generation"))
            for a, b in itertools.pairwise(steps)
        ):
            out.append(
                Violation(
                    invariant=Invariant.ITERATIONS,
                    detail=f"{path.name}: iterations went back ({iterations[:3]}...{iterations[-3:]})",
                )
            )
    for name, code in sorted(exits.items()):
        if code != 0:
            out.append(
                Violation(
                    invariant=Invariant.EXITS,
                    detail=f"worker process {name} exited with {code}",
                )
            )
    return out


def _steps_of(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("kind") == "step":
                out.append(record)
    return out


def run_real_chaos(
    schedule: Schedule,
    config: ChaosConfig | None = None,
    log_dir: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
    *,
    job_factory: str | None = None,
    job_args: dict[str, str] | None = None,
    keep_fork_server: bool = False,
) -> RealResult:
    """One run; ``keep_fork_server`` leaves the workers' fork server up for a caller that forks more
    (a test session)."""
    from liver.bench.bus import rig

    config = config or ChaosConfig(nodes=3)
    with rig.log_directory(log_dir, "liver-chaos-real-") as where:
        run = RealChaosRun(schedule, config, where, progress, job_factory=job_factory, job_args=job_args)
        run.keep_fork_server = keep_fork_server
        return asyncio.run(run.run_real())
