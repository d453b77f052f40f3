"""The worker companion: the bus side of one training process, on a thread with its own event loop.

Training must never wait for the bus (I1): a heartbeat, a plan fetch or a reconnect that stalls must
not stall an iteration. So everything that touches NATS runs on a daemon thread with its own asyncio
loop and its own connection (:class:`Companion`), and the training thread only

* reads what the companion handed it (commands arrive through :class:`~.agent.RuntimeHooks`,
  called on the companion's thread; :class:`CommandBox` is a ready-made one the training loop polls),
* writes what heartbeats should say (:meth:`Companion.set_iteration`, :meth:`Companion.set_world`:
  plain attribute writes), and
* hands over acks (:meth:`Companion.report`), which builds the message on the caller's thread (so a
  malformed ack raises where it was made) and passes it with ``loop.call_soon_threadsafe``: a few
  microseconds, whatever the state of the connection.

The protocol itself (what a repeated Switch or an unknown Abort means) is :mod:`.agent`'s.

Usage inside a training process::

    box = CommandBox()
    with Companion(identity, box, url=os.environ["NATS_URL"], world=GenerationRank(0, rank)) as companion:
        for iteration in itertools.count():
            companion.set_iteration(iteration)
            for command in box.take():
                ...  # build the shadow world, switch, drop it; then companion.report("ready"), ...
            train_step()
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Final, NamedTuple, Unpack

import nats
import nats.errors
import structlog
from nats.aio.client import Client

from liver.reshard.plan import Plan
from liver.shared.connection import connect_options
from liver.shared.errors import BusError
from liver.shared.messages import Abort, AckDetails, Prepare, Switch, WorkerPhase, WorkerStatus
from liver.shared.metrics_http import MetricsServer
from liver.worker_runtime.companion.agent import (
    AgentSettings,
    GenerationRank,
    Presence,
    RuntimeHooks,
    WorkerAgent,
    WorkerIdentity,
)
from liver.worker_runtime.companion.metrics import CompanionCollector, companion_registry

log = structlog.get_logger(__name__)

START_TIMEOUT_S: Final = 30.0
CLOSE_TIMEOUT_S: Final = 15.0
"""Longer than the connection's drain timeout (10 s), so a drain that hangs is cut by nats-py first."""


class CompanionError(BusError):
    """The companion could not connect, or was used after it closed."""


class Prepared(NamedTuple):
    """A Prepare, with this worker's part of the plan already fetched and checked."""

    prepare: Prepare
    plan: Plan


Command = Prepared | Switch | Abort


class CommandBox:
    """Runtime hooks that queue each command for the training thread to take at an iteration boundary.

    ``deque`` appends and pops are atomic, so neither side takes a lock; ``pending`` is a plain read the
    training loop can afford every iteration.
    """

    def __init__(self) -> None:
        self._queue: deque[Command] = deque()

    def on_prepare(self, prepare: Prepare, plan: Plan) -> None:
        self._queue.append(Prepared(prepare, plan))

    def on_switch(self, switch: Switch) -> None:
        self._queue.append(switch)

    def on_abort(self, abort: Abort) -> None:
        self._queue.append(abort)

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def take(self) -> list[Command]:
        """Every command that arrived since the last call, oldest first."""
        out: list[Command] = []
        while True:
            try:
                out.append(self._queue.popleft())
            except IndexError:
                return out


class Companion:
    """One worker's bus connection on a thread of its own (see the module docstring).

    ``world`` is the generation and rank the process starts in (``None`` for a new worker that joins at
    the next handoff). ``environ`` supplies credentials (``NATS_USER``/``NATS_PASSWORD``, ``NATS_TOKEN``
    or ``NATS_CREDS``); it defaults to the process environment. With ``metrics_port`` (0: a free one)
    the companion serves its Prometheus metrics there (:mod:`.metrics`) from :meth:`start` to
    :meth:`close`.
    """

    def __init__(
        self,
        identity: WorkerIdentity,
        hooks: RuntimeHooks,
        *,
        url: str,
        world: GenerationRank | None = None,
        environ: Mapping[str, str] | None = None,
        settings: AgentSettings | None = None,
        reconnect_time_wait_s: float = 1.0,
        metrics_port: int | None = None,
    ) -> None:
        identity.check()
        self._metrics_port = metrics_port
        self._metrics: MetricsServer | None = None
        self.identity = identity
        self._hooks = hooks
        self._settings = settings or AgentSettings()
        self._options = connect_options(
            url,
            environ,
            name=f"liver-worker-{identity.worker_id}",
            reconnect_time_wait_s=reconnect_time_wait_s,
        )
        self._presence = Presence(world=world)
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"liver-companion-{identity.worker_id}", daemon=True
        )
        self._agent: WorkerAgent | None = None
        self.reconnections = 0
        """Connections renewed after the server closed one for good."""
        self._nc: Client | None = None
        self._failure: BaseException | None = None
        self._closed = False

    # -- lifecycle (training thread) ------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Companion:
        """Start the thread; return once connected, subscribed and hello'd; raise after ``timeout_s``."""
        if self._thread.is_alive() or self._closed:
            raise CompanionError("a companion starts once")
        if self._metrics_port is not None:
            collector = CompanionCollector(
                self.identity, self._presence, lambda: self._agent, lambda: self.connected
            )
            self._metrics = MetricsServer(companion_registry(collector), self._metrics_port)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._agent is None:
            failure = self._failure
            self.close()
            if failure is not None:
                raise CompanionError(f"the companion did not start: {failure!r}") from failure
            raise CompanionError(f"not connected to {self._options['servers']} after {timeout_s} s")
        return self

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop reading commands, publish what was handed over, drain the connection, end the thread."""
        if self._closed:
            return
        self._closed = True
        if self._metrics is not None:
            self._metrics.close()
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("companion_thread_stuck", worker_id=self.identity.worker_id, after_s=timeout_s)
                return
        if not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> Companion:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- what the training thread calls ---------------------------------------------------------------

    @property
    def metrics_port(self) -> int | None:
        """The port ``/metrics`` is served on (given ``metrics_port``; 0 picks a free one)."""
        return self._metrics.port if self._metrics is not None else None

    @property
    def connected(self) -> bool:
        nc = self._nc
        return nc is not None and nc.is_connected

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def report(self, phase: WorkerPhase, **details: Unpack[AckDetails]) -> None:
        """Ack a phase of a handoff (``generation`` defaults to the newest prepared); never blocks.

        Raises ``ValueError`` for an ack that is not a valid message (a "failed" without an error); an
        ack after :meth:`close` is dropped with a warning, since the coordinator will treat this worker
        as lost anyway.
        """
        agent = self._agent
        if agent is None:
            raise CompanionError("the companion is not started")
        status = agent.status(phase, **details)
        try:
            self._loop.call_soon_threadsafe(self._deliver, status)
        except RuntimeError:
            log.warning("ack_after_close", worker_id=self.identity.worker_id, phase=phase)

    def set_iteration(self, iteration: int) -> None:
        """The iteration the next heartbeat reports (a plain write: call it every iteration)."""
        self._presence.iteration = iteration

    def set_world(self, world: GenerationRank | None) -> None:
        """The generation and rank heartbeats report; a switched ack sets it already."""
        self._presence.world = world

    # -- the companion's thread ------------------------------------------------------------------------

    def _deliver(self, status: WorkerStatus) -> None:
        if self._agent is not None:
            self._agent.report(status)
        else:
            log.warning("ack_dropped", worker_id=self.identity.worker_id, phase=status.phase)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:
            self._failure = exc
            log.exception("companion_failed", worker_id=self.identity.worker_id)
        finally:
            self._ready.set()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())

    async def _main(self) -> None:
        stopping = asyncio.create_task(self._stop.wait())
        lost = asyncio.Event()
        nc = await self._connect_unless_stopped(stopping, lost)
        if nc is None:
            return
        try:
            agent = WorkerAgent(
                nc, self.identity, self._hooks, presence=self._presence, settings=self._settings
            )
            await agent.start()
            self._agent = agent
            self._ready.set()
            while True:
                losing = asyncio.create_task(lost.wait())
                await asyncio.wait({stopping, losing}, return_when=asyncio.FIRST_COMPLETED)
                losing.cancel()
                if stopping.done():
                    await agent.stop()
                    return
                # The server closed the connection for good: a new one, the same agent (and handoffs).
                log.error(
                    "nats_connection_lost", worker_id=self.identity.worker_id, error=repr(nc.last_error)
                )
                lost = asyncio.Event()
                renewed = await self._connect_unless_stopped(stopping, lost)
                if renewed is None:
                    await agent.stop()
                    return
                nc = renewed
                await agent.rebind(nc)
                self.reconnections += 1
                log.info("nats_connection_renewed", worker_id=self.identity.worker_id)
        finally:
            stopping.cancel()
            await self._drain(nc)

    async def _connect_unless_stopped(
        self, stopping: asyncio.Task[Any], lost: asyncio.Event
    ) -> Client | None:
        """A new connection (``lost`` set when it closes unasked), or None when the companion is told to
        stop first."""
        connecting = asyncio.create_task(self._connect(lost))
        await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connecting
            return None
        nc = self._nc = connecting.result()
        return nc

    async def _connect(self, lost: asyncio.Event) -> Client:
        async def on_error(exc: Exception) -> None:
            log.error("nats_error", worker_id=self.identity.worker_id, error=repr(exc))

        async def on_disconnected() -> None:
            if not self._stop.is_set():
                log.warning("nats_disconnected", worker_id=self.identity.worker_id)

        async def on_reconnected() -> None:
            log.info("nats_reconnected", worker_id=self.identity.worker_id)
            if self._agent is not None:
                await self._agent.announce()

        async def on_closed() -> None:
            if not self._stop.is_set():
                lost.set()

        return await nats.connect(
            **self._options,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            closed_cb=on_closed,
        )

    async def _drain(self, nc: Client) -> None:
        if nc.is_closed:
            return
        try:
            await nc.drain()
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("drain_failed", worker_id=self.identity.worker_id, error=repr(exc))
            await nc.close()
