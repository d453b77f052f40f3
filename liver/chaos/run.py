"""One chaos run: the processes, the seeded steps, the kills, and the outcomes read back for the checker.

The four services run as ``liver serve <name>`` processes around a nats-server with a store on disk (so
that a killed server comes back with its streams, as a pod with a volume does); the job is simulated,
one process per node (the code behind ``liver workers --simulate``). Each step publishes one event (or
two warnings at once) that keeps the job resizing, kills its target with SIGKILL inside the handoff,
starts it again after the drawn time, waits for the outcome, and waits for the job to be stable before
the next step. A service that exits on its own is started again too, as its supervisor would, and
counted. What was published, and which processes died, is all the run remembers: whether the events
ended well is read back from the bus (:mod:`.checker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

import msgspec
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from liver.bench.bus import rig
from liver.chaos.checker import Outcome, Violation, check
from liver.chaos.schedule import Kill, Loss, Schedule, Stage, Step, Target
from liver.services.coordinator.record import GenerationRecord
from liver.services.coordinator.service import CONFIG_ENV as COORDINATOR_CONFIG_ENV
from liver.services.coordinator.service import INSTANCE_ENV, JOB_ENV
from liver.services.host import status_subject
from liver.services.topology.settings import CONFIG_ENV as TOPOLOGY_CONFIG_ENV
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode
from liver.shared.errors import LiverError
from liver.shared.layout import ParallelLayout, Placement
from liver.shared.messages import (
    GenerationAborted,
    GenerationCommitted,
    Hello,
    JobMembership,
    NodeDevices,
    Prepare,
    ScaleRequest,
    SpotWarning,
    Switch,
    WorkerCommand,
    WorldStarted,
)
from liver.shared.model import PRESETS
from liver.shared.nats_server import NatsServer, free_port
from liver.worker_runtime.companion.simulated import SimSettings

log = structlog.get_logger(__name__)

JOB: Final = "chaos"
DEVICES_PER_NODE: Final = 2
FROZEN_ITERATION_S: Final = 1e6
"""Every node's process fixes a switch's cut at the iteration it has reached; processes counting on
their own would disagree (see ``liver bench bus``). Nothing here depends on the iteration."""
HEARTBEAT_S: Final = 0.5
HEARTBEAT_TIMEOUT_S: Final = 10.0
"""The coordinator's default. A server restart of the run (three seconds at most, then the reconnects)
stays well inside it; the processes of a node that left are stopped, and their workers are dropped
after it."""
READY_TIMEOUT_S: Final = 120.0
POLL_S: Final = 0.2
STAGE_WAIT_S: Final = 30.0
"""How long a kill waits for its stage before it strikes anyway."""
NOTICE_S: Final = 120.0


class ChaosError(LiverError, RuntimeError):
    """The run could not go on (a process that never came up, a job that never settled)."""


class EventKind(StrEnum):
    SHRINK = "spot_warning"
    GROW = "scale_request"


class ChaosConfig(msgspec.Struct, frozen=True, kw_only=True):
    nodes: int = 4
    """Nodes of two devices the job can use; the world starts on all but one, whose workers start when
    it first comes back."""
    outcome_timeout_s: float = 180.0
    """How long one step may take from its event to its outcome before the run gives up on it."""
    settle_timeout_s: float = 120.0


class StepRecord(msgspec.Struct, kw_only=True):
    index: int
    kind: EventKind
    event_ids: tuple[str, ...]
    nodes: tuple[str, ...]
    kill: Kill | None
    seconds: float | None = None
    """From the first publish to the last outcome naming one of the step's events."""
    generations: tuple[int, ...] = ()
    outcome: str = "timeout"
    loss: Loss | None = None
    """The loss without notice this step was (real training processes only); no event was published."""


class ChaosResult(msgspec.Struct, kw_only=True):
    seed: int
    steps: list[StepRecord]
    outcomes: int
    committed: int
    aborted: int
    replanned: int
    kills: dict[str, int]
    unplanned_exits: dict[str, int]
    dead_letters: int
    error_events: int
    violations: list[Violation]
    failure: str | None
    """Why the run stopped before its last step (a process that never came back, a job that never
    settled); the invariants are still checked on what happened until then."""
    seconds: float
    log_dir: str

    @property
    def passed(self) -> bool:
        return (
            self.failure is None
            and not self.violations
            and all(step.outcome != "timeout" for step in self.steps)
        )


def _status_seconds(records: list[StepRecord], killed: bool) -> list[float]:
    return [r.seconds for r in records if r.seconds is not None and (r.kill is not None) == killed]


def summary(result: ChaosResult) -> dict[str, Any]:
    """The figures a report quotes: handoff times without and with a kill, and their ratio."""
    calm, killed = _status_seconds(result.steps, False), _status_seconds(result.steps, True)
    out: dict[str, Any] = {
        "steps": len(result.steps),
        "committed": result.committed,
        "kills": sum(result.kills.values()),
        "server_kills": result.kills.get(Target.SERVER.value, 0),
        "violations": len(result.violations),
    }
    if calm:
        out["median_s_without_kill"] = statistics.median(calm)
    if killed:
        out["median_s_with_kill"] = statistics.median(killed)
        out["max_s_with_kill"] = max(killed)
    if calm and killed:
        out["median_ratio"] = statistics.median(killed) / statistics.median(calm)
    return out


class _Processes:
    """The run's children: the server, the services and the job's node processes, each restartable."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.port = free_port()
        self.store = log_dir / "jetstream"
        if self.store.exists():
            raise ChaosError(
                f"{log_dir} holds the store of an earlier run, whose events and outcomes would count in "
                "this one: give a new directory"
            )
        self.incarnations: Counter[str] = Counter()
        self.server = self.new_server()
        self.services: dict[Target, rig.Child] = {}
        self.nodes: dict[str, rig.Child] = {}
        self.unplanned_exits: Counter[str] = Counter()
        self.killing: set[Target] = set()
        self.topology_config = log_dir / "topology.json"
        self.coordinator_config = log_dir / "coordinator.json"

    def new_server(self) -> NatsServer:
        self.incarnations["nats-server"] += 1
        return NatsServer(
            store_dir=self.store,
            log_file=self.log_dir / f"nats-server-{self.incarnations['nats-server']}.log",
            extra_args=("-p", str(self.port)),
        )

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        return rig.child_environment(self.url)

    def start_service(self, target: Target) -> rig.Child:
        self.incarnations[target.value] += 1
        name = f"{target.value}-{self.incarnations[target.value]}"
        env = self.environment()
        if target == Target.TOPOLOGY:
            env[TOPOLOGY_CONFIG_ENV] = str(self.topology_config)
        if target == Target.COORDINATOR:
            env.update(
                {JOB_ENV: JOB, INSTANCE_ENV: name, COORDINATOR_CONFIG_ENV: str(self.coordinator_config)}
            )
        child = rig.spawn(name, rig.service_argv(target.value), env, self.log_dir)
        self.services[target] = child
        return child

    def start_node(self, node: str) -> SimSettings:
        self.incarnations[node] += 1
        settings = SimSettings(
            job_id=JOB,
            workers=DEVICES_PER_NODE,
            nodes=(node,),
            devices_per_node=DEVICES_PER_NODE,
            generation=None,
            worker_prefix=f"i{self.incarnations[node]}",
            iteration_s=FROZEN_ITERATION_S,
            heartbeat_s=HEARTBEAT_S,
        )
        argv = rig.workers_argv(msgspec.json.encode(settings))
        name = f"{node}-{self.incarnations[node]}"
        self.nodes[node] = rig.spawn(name, argv, self.environment(), self.log_dir)
        return settings

    def stop_node(self, node: str) -> None:
        child = self.nodes.pop(node, None)
        if child is not None:
            child.stop()

    def restart_exited_services(self) -> list[Target]:
        """Start again every service that exited without being killed by the run (a supervisor's job)."""
        restarted = []
        for target, child in list(self.services.items()):
            if target in self.killing or child.proc.poll() is None:
                continue
            self.unplanned_exits[target.value] += 1
            log.warning("service_exited", service=target.value, code=child.proc.returncode)
            self.start_service(target)
            restarted.append(target)
        return restarted

    def stop_all(self) -> None:
        for child in [*self.nodes.values(), *self.services.values()]:
            child.stop()
        self.server.stop()


class _StageWatch:
    """Sees each stage of the job's handoffs on the bus, so that a kill can land in the middle of one."""

    def __init__(self) -> None:
        self._seen: dict[Stage, asyncio.Event] = {stage: asyncio.Event() for stage in Stage}
        self.hellos: set[str] = set()
        """Every worker that said hello so far."""
        self.outcomes: list[Outcome] = []
        """Every outcome of the job as published, seen live: the stream drops a second publish of one
        generation (its message id), a subscriber does not, so only here would a second, different
        outcome of one generation show (the server's restarts make this list miss some)."""

    async def start(self, nc: Client) -> None:
        for subject, stage in (
            (s.resize_requested(JOB), Stage.RESIZE_REQUESTED),
            (s.topology_request(JOB), Stage.TOPOLOGY_REQUEST),
            (s.topology_planned(JOB), Stage.TOPOLOGY_PLANNED),
            (s.transfer_planned(JOB), Stage.TRANSFER_PLANNED),
        ):
            await nc.subscribe(subject, cb=self._marker(stage))
        await nc.subscribe(s.worker_commands(JOB), cb=self._on_command)
        await nc.subscribe(s.worker_hello(JOB), cb=self._on_hello)
        await nc.subscribe(s.GENERATION_COMMITTED, cb=self._on_outcome)
        await nc.subscribe(s.GENERATION_ABORTED, cb=self._on_outcome)
        await nc.flush()

    async def _on_outcome(self, msg: Msg) -> None:
        kind = GenerationCommitted if msg.subject == s.GENERATION_COMMITTED else GenerationAborted
        with contextlib.suppress(MessageError):
            outcome = decode(msg.data, kind)
            if outcome.job_id == JOB:
                self.outcomes.append(outcome)

    async def _on_hello(self, msg: Msg) -> None:
        with contextlib.suppress(MessageError):
            self.hellos.add(decode(msg.data, Hello).worker_id)

    def _marker(self, stage: Stage) -> Callable[[Msg], Awaitable[None]]:
        async def cb(_: Msg) -> None:
            self._seen[stage].set()

        return cb

    async def _on_command(self, msg: Msg) -> None:
        with contextlib.suppress(MessageError):
            command = decode(msg.data, WorkerCommand)
            if isinstance(command, Prepare):
                self._seen[Stage.PREPARE].set()
            elif isinstance(command, Switch):
                self._seen[Stage.SWITCH].set()

    def arm(self) -> None:
        """Forget what was seen: call right before a step publishes its event."""
        for event in self._seen.values():
            event.clear()

    async def seen(self, stage: Stage) -> None:
        await self._seen[stage].wait()


class ChaosRun:
    """One run of a :class:`Schedule` (see the module docstring)."""

    def __init__(
        self,
        schedule: Schedule,
        config: ChaosConfig,
        log_dir: Path,
        progress: Callable[[str], None] = lambda _: None,
    ) -> None:
        if config.nodes < 3:
            raise ChaosError(f"`nodes`: at least 3 (a world of two and one to come back), got {config.nodes}")
        self.schedule = schedule
        self.config = config
        self.procs = _Processes(log_dir)
        self.progress = progress
        self.all_nodes = tuple(f"node{i:03d}" for i in range(config.nodes))
        self.world: tuple[str, ...] = self.all_nodes[:-1]
        self.world_devices = len(self.world) * DEVICES_PER_NODE
        self.published: list[str] = []
        self.kills: Counter[str] = Counter()
        self.nc: Client | None = None
        self._outcomes: list[Outcome] = []
        self._next_seq = 1
        self.watch = _StageWatch()
        self._ended = asyncio.Event()
        """Set when the step's events have their outcomes (a kill waiting for a skipped stage stops)."""

    # -- setup --------------------------------------------------------------------------------------

    def _write_configs(self) -> None:
        sizes = [n * DEVICES_PER_NODE for n in range(2, self.config.nodes + 1)]
        profile = {
            "model": "tiny-gpt",
            "hardware": "cpu-small",
            "setup": {
                "global_batch_size": math.lcm(*sizes),
                "sequence_length": PRESETS["tiny-gpt"].max_sequence_length,
            },
        }
        self.procs.topology_config.write_bytes(msgspec.json.encode({"jobs": {JOB: profile}}))
        self.procs.coordinator_config.write_bytes(
            msgspec.json.encode({"core": {"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S}})
        )

    async def _connect(self) -> Client:
        async def quiet(exc: Exception) -> None:  # the server's restarts are the point of the run
            log.debug("chaos_client_error", error=repr(exc))

        return await nats.connect(
            self.procs.url,
            error_cb=quiet,
            name=f"{rig.BENCH_CLIENT_PREFIX}-chaos",
            connect_timeout=5,
            reconnect_time_wait=0.2,
            max_reconnect_attempts=-1,
        )

    async def start(self) -> None:
        self._write_configs()
        self.procs.server.start()
        self.nc = await self._connect()
        await self.watch.start(self.nc)
        for target in (Target.INGESTER, Target.TOPOLOGY, Target.TRANSFER, Target.COORDINATOR):
            child = self.procs.start_service(target)
            await rig.wait_ready(self.nc, child, target.value, READY_TIMEOUT_S)
        settings = [self.procs.start_node(node) for node in self.world]
        devices = [d for sim in settings for d in sim.devices()]
        await self._until(
            lambda status: status.get("workers") == len(devices), "the coordinator counts every worker"
        )
        world = WorldStarted(
            job_id=JOB,
            generation=0,
            layout=ParallelLayout(tp=1, pp=1, dp=len(devices)),
            placement=Placement(tuple(devices)),
        )
        await self._js_publish(s.world_started(JOB), encode(world), f"{JOB}-world-0")
        await self._membership(0, len(devices))

    # -- bus access that rides out the server's restarts ------------------------------------------------

    @property
    def js(self) -> Any:
        assert self.nc is not None
        return self.nc.jetstream(timeout=5)

    async def _js_publish(self, subject: str, data: bytes, msg_id: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                await self.js.publish(subject, data, headers={s.HEADER_MSG_ID: msg_id})
                return
            except (nats.errors.Error, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(POLL_S)

    async def _status(self) -> dict[str, Any]:
        assert self.nc is not None
        try:
            reply = await self.nc.request(status_subject(Target.COORDINATOR.value), b"", timeout=2.0)
            return msgspec.json.decode(reply.data)  # type: ignore[no-any-return]
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError):
            return {}

    async def _until(self, check: Callable[[dict[str, Any]], bool], what: str) -> None:
        deadline = time.monotonic() + self.config.settle_timeout_s
        while not check(await self._status()):
            self.procs.restart_exited_services()
            if time.monotonic() > deadline:
                raise ChaosError(f"not true after {self.config.settle_timeout_s} s: {what}")
            await asyncio.sleep(POLL_S)

    async def _membership(self, generation: int, count: int) -> None:
        deadline = time.monotonic() + self.config.settle_timeout_s
        while True:
            try:
                entry = await (await self.js.key_value(s.KV_MEMBERSHIP)).get(JOB)
                members = decode(entry.value or b"", JobMembership)
                if members.generation == generation and len(members.workers) == count:
                    return
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError, MessageError):
                pass
            if time.monotonic() > deadline:
                raise ChaosError(f"membership of generation {generation} ({count} workers) never published")
            await asyncio.sleep(POLL_S)

    async def outcomes(self) -> list[Outcome]:
        """Every outcome of the job so far, in the order the generations stream keeps them."""
        deadline = time.monotonic() + self.config.settle_timeout_s
        while True:
            try:
                last = (await self.js.stream_info(s.STREAM_GENERATIONS.name)).state.last_seq
                while self._next_seq <= last:
                    try:
                        msg = await self.js.get_msg(s.STREAM_GENERATIONS.name, self._next_seq)
                    except nats.js.errors.NotFoundError:
                        self._next_seq += 1  # no message there (none is deleted here; do not spin on it)
                        continue
                    self._next_seq += 1
                    kind = GenerationCommitted if msg.subject == s.GENERATION_COMMITTED else GenerationAborted
                    try:
                        outcome = decode(msg.data or b"", kind)
                    except MessageError:
                        continue  # anyone may publish on these public subjects (the fuzz run does)
                    if outcome.job_id == JOB:
                        self._outcomes.append(outcome)
                return list(self._outcomes)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise ChaosError(
                        f"the generations stream unreadable for {self.config.settle_timeout_s} s: {exc!r}"
                    ) from None
                await asyncio.sleep(POLL_S)

    async def stream_messages(self, stream: str) -> int:
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return int((await self.js.stream_info(stream)).state.messages)
        return -1

    async def record(self) -> GenerationRecord | None:
        for _ in range(50):
            try:
                entry = await (await self.js.key_value(s.KV_GENERATIONS)).get(JOB)
                return decode(entry.value or b"", GenerationRecord)
            except nats.js.errors.KeyNotFoundError:
                return None
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                await asyncio.sleep(POLL_S)
        raise ChaosError("the job's record could not be read")

    # -- one step -----------------------------------------------------------------------------------------

    def _choose(self, step: Step) -> tuple[EventKind, tuple[str, ...]]:
        free = [n for n in self.all_nodes if n not in self.world]
        can_shrink, can_grow = len(self.world) >= 3, bool(free)
        shrink = can_shrink and (not can_grow or step.draw < 0.5)
        pool = list(self.world) if shrink else free
        first = pool[min(int(step.draw * 2 % 1 * len(pool)), len(pool) - 1)]
        if shrink and step.burst and len(self.world) >= 4:
            second = pool[(pool.index(first) + 1) % len(pool)]
            return EventKind.SHRINK, (first, second)
        return (EventKind.SHRINK if shrink else EventKind.GROW), (first,)

    async def _node_returns(self, node: str) -> None:
        """Fresh processes on a node that comes back; the coordinator must count them before the request.

        Counting alone could be fooled by workers of an earlier incarnation that the coordinator has not
        dropped yet (their process was stopped; they go after the heartbeat timeout): so first only the
        world's workers are counted, then the new ones have said hello and are counted too.
        """
        world = self.world_devices
        await self._until(lambda status: status.get("workers") == world, f"only the world's {world} workers")
        self.procs.stop_node(node)
        settings = self.procs.start_node(node)
        hellos = {identity.worker_id for identity in settings.identities()}
        expected = world + DEVICES_PER_NODE
        await self._until(
            lambda status: hellos <= self.watch.hellos and status.get("workers") == expected,
            f"the new workers on {node} said hello and {expected} workers are counted",
        )

    async def _kill(self, kill: Kill) -> None:
        if kill.stage != Stage.PUBLISHED:
            # The stage, or the step's end when the handoff skipped it (an abort before the Prepare).
            waits = [
                asyncio.ensure_future(self.watch.seen(kill.stage)),
                asyncio.ensure_future(self._ended.wait()),
            ]
            try:
                await asyncio.wait(waits, timeout=STAGE_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiting in waits:
                    waiting.cancel()
        self.kills[kill.target.value] += 1
        self.progress(f"  kill -9 {kill.target.value} at {kill.stage.value}, back in {kill.down_s:.1f} s")
        if kill.target == Target.SERVER:
            await asyncio.to_thread(self.procs.server.kill)
            await asyncio.sleep(kill.down_s)
            self.procs.server = self.procs.new_server()
            await asyncio.to_thread(self.procs.server.start)
            return
        await self._restart_service(kill.target, kill.down_s)

    async def _restart_service(
        self, target: Target, down_s: float, while_down: Callable[[], None] | None = None
    ) -> None:
        """kill -9 one service, run ``while_down`` once it is gone, and start it again ``down_s`` later
        (as its supervisor would)."""
        self.procs.killing.add(target)
        try:
            child = self.procs.services[target]
            child.proc.kill()
            await asyncio.to_thread(child.proc.wait)
            if while_down is not None:
                while_down()
            await asyncio.sleep(down_s)
            self.procs.start_service(target)
        finally:
            self.procs.killing.discard(target)

    async def step(self, step: Step) -> StepRecord:
        kind, nodes = self._choose(step)
        if kind == EventKind.GROW:
            await self._node_returns(nodes[0])
        ids = tuple(f"{kind.value.replace('_', '-')}-{step.index:03d}-{node}" for node in nodes)
        record = StepRecord(index=step.index, kind=kind, event_ids=ids, nodes=nodes, kill=step.kill)
        before = len(await self.outcomes())
        self.watch.arm()
        self._ended.clear()
        started = time.monotonic()
        for event_id, node in zip(ids, nodes, strict=True):
            message: SpotWarning | ScaleRequest
            if kind == EventKind.SHRINK:
                message = SpotWarning(
                    job_id=JOB, event_id=event_id, node=node, provider="chaos", notice_s=NOTICE_S
                )
                subject = s.SPOT_WARNING
            else:
                back = NodeDevices(node=node, devices=tuple(range(DEVICES_PER_NODE)))
                message = ScaleRequest(job_id=JOB, event_id=event_id, reason="node back", add=(back,))
                subject = s.SCALE_REQUEST
            await self._js_publish(subject, encode(message), f"{JOB}-{event_id}")
            self.published.append(event_id)
        killing = asyncio.create_task(self._kill(step.kill)) if step.kill is not None else None
        deadline = started + self.config.outcome_timeout_s
        settled: list[Outcome] = []
        try:
            while True:
                self.procs.restart_exited_services()
                settled = [o for o in (await self.outcomes())[before:] if set(o.event_ids) & set(ids)]
                if {e for o in settled for e in o.event_ids} >= set(ids):
                    record.seconds = time.monotonic() - started
                    self._ended.set()
                    break
                if time.monotonic() > deadline:
                    return record
                await asyncio.sleep(POLL_S)
        finally:
            if killing is not None:
                await killing
        record.generations = tuple(o.generation for o in settled)
        commits = [o for o in settled if isinstance(o, GenerationCommitted)]
        record.outcome = "committed" if len(commits) == len(settled) else "aborted"
        if commits:
            last = commits[-1]
            self.world = tuple(dict.fromkeys(d.node for d in last.placement.devices))
            self.world_devices = len(last.placement)
            stable = {"phase": "stable", "generation": last.generation}
            await self._until(
                lambda status: {k: status.get(k) for k in stable} == stable,
                f"the coordinator stable at generation {last.generation}",
            )
            await self._membership(last.generation, self.world_devices)
        for node in [n for n in self.procs.nodes if n not in self.world]:
            self.procs.stop_node(node)  # left the world, or came back for a resize that did not commit
        return record

    # -- the whole run --------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop every process of the run (and the run's own connection)."""
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        await asyncio.to_thread(self.procs.stop_all)

    async def run(self) -> ChaosResult:
        started = time.monotonic()
        records: list[StepRecord] = []
        failure: str | None = None
        try:
            self.progress(f"starting a nats-server, four services and {len(self.all_nodes)} nodes")
            await self.start()
            for step in self.schedule.steps:
                try:
                    record = await self.step(step)
                except ChaosError as exc:
                    failure = f"step {step.index}: {exc}"
                    self.progress(failure)
                    break
                records.append(record)
                took = "no outcome"
                if record.seconds is not None:
                    took = f"{record.outcome} in {record.seconds:.1f} s"
                self.progress(
                    f"step {step.index + 1}/{len(self.schedule.steps)}: {record.kind.value} "
                    f"{','.join(record.nodes)} -> {took}"
                )
                if record.seconds is None:
                    break
            outcomes = await self.outcomes()
            violations = check(self.published, outcomes, await self.record(), self.watch.outcomes)
            dead = await self.stream_messages(s.STREAM_DEAD_LETTERS.name)
            errors = await self.stream_messages(s.STREAM_ERRORS.name)
        finally:
            await self.close()
        return ChaosResult(
            seed=self.schedule.seed,
            steps=records,
            outcomes=len(outcomes),
            committed=sum(isinstance(o, GenerationCommitted) for o in outcomes),
            aborted=sum(isinstance(o, GenerationAborted) and bool(o.event_ids) for o in outcomes),
            replanned=sum(isinstance(o, GenerationAborted) and bool(o.replanned_event_ids) for o in outcomes),
            kills=dict(self.kills),
            unplanned_exits=dict(self.procs.unplanned_exits),
            dead_letters=dead,
            error_events=errors,
            violations=violations,
            failure=failure,
            seconds=time.monotonic() - started,
            log_dir=str(self.procs.log_dir),
        )


def run_chaos(
    schedule: Schedule,
    config: ChaosConfig | None = None,
    log_dir: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> ChaosResult:
    with rig.log_directory(log_dir, "liver-chaos-") as where:
        return asyncio.run(ChaosRun(schedule, config or ChaosConfig(), where, progress).run())
