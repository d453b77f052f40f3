"""A stand-in job with no training at all: N workers that speak the worker protocol for real.

Each simulated worker is a :class:`~.agent.WorkerAgent` (the same code a training process
runs) whose runtime hooks only answer: "ready" after a Prepare, "switched" after a Switch, each after
``ack_delay_s``. Everything on the bus is real (hellos, heartbeats, plan slices read from the
key-value bucket or the object store through the same fetcher and checked, acks with the cut
iteration, the bytes the slice says this device receives and the pause), so the control plane can be
tested, demonstrated and benchmarked end to end without a model.

All workers share one event loop and one connection: a thousand training processes would need a
thousand threads and sockets, and what is measured is the control plane, not the client. The job reads
the job-wide command subject once and hands each decoded command to every worker (the Prepare is one
O(devices) message: a copy per worker on one connection would cost the simulation O(devices^2)).

Faults are injected per worker and phase (``fail``: ack "failed"; ``hang``: never ack but keep beating;
``crash``: go silent, as a reclaimed node does). The job's iteration advances every ``iteration_s``;
the first worker to switch to a generation fixes the cut for all of them, as the cut's all-reduce does
in a real job. When ``generation.committed`` shows that a worker is no longer in the world after it
switched, that worker leaves, as a training process on a reclaimed node exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Final, Literal

import msgspec
import nats
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from liver.reshard.plan import Plan
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode, error_event
from liver.shared.connection import connect_options
from liver.shared.errors import BusError
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.messages import (
    Abort,
    GenerationCommitted,
    Prepare,
    Switch,
    WorkerPhase,
    WorldStarted,
)
from liver.worker_runtime.companion.agent import (
    SOURCE,
    AgentSettings,
    GenerationRank,
    Presence,
    Stage,
    WorkerAgent,
    WorkerIdentity,
    decode_command,
)
from liver.worker_runtime.companion.slices import PlanFetcher, fetch_context

log = structlog.get_logger(__name__)

FaultAction = Literal["fail", "hang", "crash"]
FaultPhase = Literal["prepare", "switch"]
FAULT_PHASES: Final = ("prepare", "switch")

_FAULT_SPEC = re.compile(r"^(?P<phase>[a-z]+)(?::(?P<worker>\*|[0-9]+)(?::(?P<generation>[0-9]+))?)?$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """Misbehave at ``phase``: every worker or the one with index ``worker``, at every generation or
    only at ``generation``."""

    action: FaultAction
    phase: FaultPhase
    worker: int | None = None
    generation: int | None = None

    @classmethod
    def parse(cls, action: FaultAction, text: str) -> Fault:
        """``PHASE[:WORKER[:GENERATION]]``, WORKER an index or ``*``: ``prepare``, ``switch:3``,
        ``prepare:*:2``."""
        match = _FAULT_SPEC.match(text.strip())
        if match is None or match["phase"] not in FAULT_PHASES:
            raise ValueError(
                f"--{action}-at {text!r}: expected PHASE[:WORKER[:GENERATION]] with PHASE one of "
                f"{', '.join(FAULT_PHASES)} and WORKER an index or '*' (e.g. switch:3)"
            )
        worker = match["worker"]
        generation = match["generation"]
        return cls(
            action=action,
            phase=match["phase"],  # type: ignore[arg-type]
            worker=None if worker in (None, "*") else int(worker),
            generation=None if generation is None else int(generation),
        )

    def hits(self, worker: int, phase: str, generation: int) -> bool:
        return (
            self.phase == phase
            and (self.worker is None or self.worker == worker)
            and (self.generation is None or self.generation == generation)
        )


class SimSettings(msgspec.Struct, frozen=True, kw_only=True):
    """A simulated job: its workers, where they run, which world they start in, how they answer."""

    job_id: str
    workers: int
    nodes: tuple[str, ...] = ()
    """Node names, filled ``devices_per_node`` at a time; empty: ``node000``, ``node001``, ..."""
    devices_per_node: int = 8
    generation: int | None = 0
    """The world the workers start in, worker ``i`` as rank ``i``; ``None``: spares that join later."""
    ack_delay_s: float = 0.0
    iteration_s: float = 0.1
    faults: tuple[Fault, ...] = ()
    heartbeat_s: float = 2.0
    fetch_timeout_s: float = 30.0
    memory_bytes: int | None = None
    worker_prefix: str = "sim"
    layout: ParallelLayout | None = None
    """The layout of the starting world: given, the job announces that world (``WorldStarted``) as a
    launcher does, so a coordinator learns the job's first generation from it."""

    def __post_init__(self) -> None:
        s.validate_token(self.job_id, "job_id")
        s.validate_token(self.worker_prefix, "worker_prefix")
        if self.workers < 1:
            raise ValueError(f"`workers`: must be >= 1, got {self.workers}")
        if self.devices_per_node < 1:
            raise ValueError(f"`devices_per_node`: must be >= 1, got {self.devices_per_node}")
        if self.nodes:
            if len(set(self.nodes)) != len(self.nodes):
                raise ValueError(f"`nodes`: names repeat: {list(self.nodes)}")
            if len(self.nodes) * self.devices_per_node < self.workers:
                raise ValueError(
                    f"`nodes`: {len(self.nodes)} nodes of {self.devices_per_node} devices hold "
                    f"{len(self.nodes) * self.devices_per_node} workers, not {self.workers}"
                )
        if self.generation is not None and self.generation < 0:
            raise ValueError(f"`generation`: must be >= 0, got {self.generation}")
        for name in ("ack_delay_s",):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}`: must be >= 0, got {getattr(self, name)}")
        for name in ("iteration_s", "heartbeat_s", "fetch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}`: must be > 0, got {getattr(self, name)}")
        if self.memory_bytes is not None and self.memory_bytes < 0:
            raise ValueError(f"`memory_bytes`: must be >= 0, got {self.memory_bytes}")
        if self.layout is not None:
            if self.generation is None:
                raise ValueError("`layout`: spares (no generation) are in no world to announce")
            if self.layout.world_size != self.workers:
                raise ValueError(
                    f"`layout`: {self.layout.describe()} has {self.layout.world_size} ranks, "
                    f"the job has {self.workers} workers"
                )
        for i, fault in enumerate(self.faults):
            if fault.worker is not None and not 0 <= fault.worker < self.workers:
                raise ValueError(
                    f"`faults[{i}].worker`: {fault.worker} is not a worker index below {self.workers}"
                )

    def devices(self) -> tuple[Device, ...]:
        if self.nodes:
            return tuple(Device(node, i) for node in self.nodes for i in range(self.devices_per_node))[
                : self.workers
            ]
        nodes = -(-self.workers // self.devices_per_node)
        return grid_devices(nodes, self.devices_per_node)[: self.workers]

    def identities(self) -> tuple[WorkerIdentity, ...]:
        """One identity per worker; ids name the device, so two simulated jobs on other nodes never clash."""
        out = []
        seen: set[str] = set()
        for device in self.devices():
            worker_id = f"{self.worker_prefix}-{_UNSAFE.sub('_', device.node)}-{device.index}"[:128]
            if worker_id in seen:
                raise ValueError(f"`nodes`: {device.node!r} gives the worker id {worker_id!r} twice")
            seen.add(worker_id)
            identity = WorkerIdentity(
                job_id=self.job_id,
                worker_id=worker_id,
                device=device,
                address=f"sim.{worker_id}:0"[:250],
                memory_bytes=self.memory_bytes,
            )
            identity.check()
            out.append(identity)
        return tuple(out)


class SimulatedWorker:
    """The runtime hooks of one simulated worker: acknowledge, after the configured delay."""

    def __init__(self, job: SimulatedJob, index: int, identity: WorkerIdentity) -> None:
        self.job = job
        self.index = index
        self.identity = identity
        self.agent: WorkerAgent | None = None
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self.crashed = False

    def on_prepare(self, prepare: Prepare, plan: Plan) -> None:
        if self._fault("prepare", prepare.generation):
            return
        self._later(prepare.generation, lambda: self._ack(WorkerPhase.READY, prepare.generation))

    def on_switch(self, switch: Switch) -> None:
        g = switch.generation
        if self._fault("switch", g):
            return
        started = time.perf_counter()
        cut = self.job.cut(g)
        agent = self.agent
        assert agent is not None
        h = agent.handoff(g)
        plan = h.plan if h is not None else None
        sent, received = _network_bytes(plan, self.identity.device) if plan is not None else (None, None)

        def switched() -> None:
            self._ack(
                WorkerPhase.SWITCHED,
                g,
                iteration=cut,
                pause_s=time.perf_counter() - started,
                bytes_sent=sent,
                bytes_received=received,
            )

        self._later(g, switched)

    def on_abort(self, abort: Abort) -> None:
        timer = self._timers.pop(abort.generation, None)
        if timer is not None:
            timer.cancel()
        self._ack(WorkerPhase.ABORTED, abort.generation)

    def _fault(self, phase: str, generation: int) -> bool:
        """Apply the first fault that hits; True when the normal answer must not be given."""
        for fault in self.job.settings.faults:
            if not fault.hits(self.index, phase, generation):
                continue
            log.warning(
                "simulated_fault",
                worker_id=self.identity.worker_id,
                action=fault.action,
                phase=phase,
                generation=generation,
            )
            if fault.action == "fail":
                error = f"simulated failure at {phase}"
                self._later(generation, lambda e=error: self._ack(WorkerPhase.FAILED, generation, error=e))
            elif fault.action == "crash":
                self.crashed = True
                self.job.leave(self, reason=f"simulated crash at {phase}")
            return True
        return False

    def _later(self, generation: int, action: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        delay = self.job.settings.ack_delay_s
        self._timers[generation] = loop.call_later(delay, self._fire, generation, action)

    def _fire(self, generation: int, action: Callable[[], None]) -> None:
        self._timers.pop(generation, None)
        action()

    def _ack(self, phase: WorkerPhase, generation: int, **fields: object) -> None:
        agent = self.agent
        if agent is None or self.crashed:
            return
        agent.report(agent.status(phase, generation=generation, **fields))  # type: ignore[arg-type]

    def cancel_timers(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


def _network_bytes(plan: Plan, device: Device) -> tuple[int, int]:
    """What this device sends and receives over the network in ``plan`` (local copies excluded)."""
    old, new = plan.old.placement.devices, plan.new.placement.devices
    sent = received = 0
    for task in plan.tasks:
        if task.local:
            continue
        if old[task.src] == device:
            sent += task.nbytes
        if new[task.dst] == device:
            received += task.nbytes
    return sent, received


class SimulatedJob:
    """N simulated workers on one connection (see the module docstring)."""

    def __init__(self, settings: SimSettings, nc: Client) -> None:
        self.settings = settings
        self.nc = nc
        self.iteration = 0
        self.workers: list[SimulatedWorker] = []
        self._cuts: dict[int, int] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._committed: Subscription | None = None
        self._broadcast: Subscription | None = None
        self._leaving: set[asyncio.Task[None]] = set()
        self._presences: list[Presence] = []

    def cut(self, generation: int) -> int:
        """The iteration every worker switches to ``generation`` after: fixed by the first to ask."""
        return self._cuts.setdefault(generation, self.iteration)

    @property
    def active(self) -> list[SimulatedWorker]:
        return [w for w in self.workers if w.agent is not None]

    async def start(self) -> None:
        settings = self.settings
        # Each read's request may wait as long as the whole read may: a thousand workers share this loop,
        # and a reply can sit behind their work for longer than the client's default 5 s.
        fetcher = PlanFetcher(fetch_context(self.nc))
        agent_settings = AgentSettings(
            heartbeat_s=settings.heartbeat_s, fetch_timeout_s=settings.fetch_timeout_s
        )
        for index, identity in enumerate(settings.identities()):
            world = None if settings.generation is None else GenerationRank(settings.generation, index)
            worker = SimulatedWorker(self, index, identity)
            presence = Presence(world=world, iteration=self.iteration)
            worker.agent = WorkerAgent(
                self.nc,
                identity,
                worker,
                presence=presence,
                settings=agent_settings,
                fetcher=fetcher,
                broadcast=False,
            )
            self.workers.append(worker)
            self._presences.append(presence)
        self._committed = await self.nc.subscribe(s.GENERATION_COMMITTED, cb=self._on_committed)
        self._broadcast = await self.nc.subscribe(s.worker_commands(settings.job_id), cb=self._on_broadcast)
        await asyncio.gather(*(w.agent.start() for w in self.workers if w.agent is not None))
        await self.nc.flush()
        if settings.layout is not None:
            await self._announce_world(settings.layout)
        self._ticker = asyncio.create_task(self._tick(), name="sim-iterations")
        log.info(
            "simulated_job_started",
            job_id=settings.job_id,
            workers=len(self.workers),
            generation=settings.generation,
            ack_delay_s=settings.ack_delay_s,
            faults=len(settings.faults),
        )

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for sub in (self._committed, self._broadcast):
            if sub is not None:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        for worker in self.workers:
            worker.cancel_timers()
        await asyncio.gather(*self._leaving, return_exceptions=True)
        await asyncio.gather(*(w.agent.stop() for w in self.workers if w.agent is not None))
        log.info("simulated_job_stopped", job_id=self.settings.job_id, iteration=self.iteration)

    async def _announce_world(self, layout: ParallelLayout) -> None:
        """Publish the starting world into the control stream, de-duplicated per generation (a restarted
        simulation of the same world is the same world)."""
        settings = self.settings
        assert settings.generation is not None
        world = WorldStarted(
            job_id=settings.job_id,
            generation=settings.generation,
            layout=layout,
            placement=Placement(tuple(w.identity.device for w in self.workers)),
        )
        msg_id = f"{settings.job_id}-world-{settings.generation}"
        try:
            await self.nc.jetstream().publish(
                s.world_started(settings.job_id), encode(world), headers={s.HEADER_MSG_ID: msg_id}
            )
        except nats.errors.Error as exc:
            # No control stream yet (no coordinator ever ran here): nobody would read it.
            log.warning("world_started_not_stored", error=repr(exc), generation=settings.generation)
            return
        log.info("world_started_published", generation=settings.generation, layout=layout.describe())

    async def reannounce(self) -> None:
        """Every worker still on the bus says hello again, with the ack of a handoff in flight: after a
        reconnect, what they published while the bus was away is gone."""
        await asyncio.gather(*(w.agent.announce() for w in self.active if w.agent is not None))

    def leave(self, worker: SimulatedWorker, reason: str) -> None:
        """Take a worker off the bus (it stops beating and reading commands)."""
        agent, worker.agent = worker.agent, None
        worker.cancel_timers()
        if agent is None:
            return
        log.info("simulated_worker_leaves", worker_id=worker.identity.worker_id, reason=reason)
        task = asyncio.get_running_loop().create_task(agent.stop())
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    async def departed(self) -> None:
        """Return once every worker that left has stopped beating and reading commands."""
        await asyncio.gather(*self._leaving, return_exceptions=True)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.settings.iteration_s)
            self.iteration += 1
            for presence in self._presences:
                presence.iteration = self.iteration

    async def _on_broadcast(self, msg: Msg) -> None:
        """A job-wide command: decoded once, then handed to every worker still on the bus."""
        try:
            command = decode_command(msg.data, self.settings.job_id)
        except MessageError as error:
            log.warning("command_rejected", field=error.path, reason=error.reason, subject=msg.subject)
            event = error_event(source=SOURCE, subject=msg.subject, data=msg.data, error=error)
            with contextlib.suppress(nats.errors.Error):
                await self.nc.publish(s.errors(SOURCE), encode(event))
            return
        for worker in self.active:
            assert worker.agent is not None
            worker.agent.counts.commands += 1
            worker.agent.handle_command(command)

    async def _on_committed(self, msg: Msg) -> None:
        try:
            committed = decode(msg.data, GenerationCommitted)
        except MessageError as error:
            # A public subject: anyone may publish there, and it is the coordinator's output, not ours.
            log.warning("committed_unreadable", field=error.path, reason=error.reason)
            return
        if committed.job_id != self.settings.job_id:
            return
        staying = set(committed.placement.devices)
        for worker in self.active:
            assert worker.agent is not None
            h = worker.agent.handoff(committed.generation)
            if h is not None and h.stage is Stage.SWITCHED and worker.identity.device not in staying:
                self.leave(worker, reason=f"not in the world of generation {committed.generation}")


class SimulationConnectionLost(BusError):
    """The server closed the simulated job's connection for good (the process exits 1)."""


@contextlib.asynccontextmanager
async def simulated_job(settings: SimSettings, nc: Client) -> AsyncIterator[SimulatedJob]:
    job = SimulatedJob(settings, nc)
    await job.start()
    try:
        yield job
    finally:
        await job.stop()


async def run_until_signalled(
    settings: SimSettings,
    url: str,
    environ: Mapping[str, str] | None = None,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
) -> None:
    """Run the simulated job until a signal, then stop its workers and drain the connection."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    options = connect_options(url, environ, name=f"liver-sim-{settings.job_id}")
    running: list[SimulatedJob] = []
    lost = asyncio.Event()

    async def on_reconnected() -> None:
        log.info("nats_reconnected", job_id=settings.job_id)
        if running:
            await running[0].reannounce()

    async def on_closed() -> None:
        if not stop.is_set():
            lost.set()

    try:
        nc = await nats.connect(**options, reconnected_cb=on_reconnected, closed_cb=on_closed)
        try:
            async with simulated_job(settings, nc) as job:
                running.append(job)
                waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait())}
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for wait in waits:
                        wait.cancel()
                if lost.is_set():
                    # A deaf simulation would look alive to its supervisor: exit 1 to be restarted.
                    raise SimulationConnectionLost(f"the server closed the connection ({nc.last_error!r})")
                log.info("signal_received")
        finally:
            with contextlib.suppress(TimeoutError, nats.errors.Error):
                await nc.drain()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
