"""What every LiveR service process does around its own logic: connect, announce, consume, drain.

A service (:class:`Service`) only declares what it needs and handles messages. This module:

- connects to ``$NATS_URL`` with the credentials in the environment (:func:`connect_options`), or, when
  ``NATS_URL`` is unset, starts an embedded nats-server for the life of the process (:func:`serve`);
- registers a NATS micro service ``liver-<name>``: ``$SRV.PING|INFO|STATS`` answer while the process
  can serve, and STATS carries the service's own counters;
- with a metrics port, serves ``/metrics`` and ``/healthz`` there (:class:`ServiceHealth`: 200 while the
  service is started, connected, its server answering and its consumer running, which is what answering
  discovery meant; 503 otherwise), the container's probe;
- runs durable pull consumers (:class:`PullConsumer`) that hand each message to the service and turn
  anything the service raises into a delayed redelivery, so that no message can crash the process;
- on SIGTERM or SIGINT stops fetching, lets the message in hand finish, and drains the connection
  (which flushes every publish and acknowledgement still buffered) before exiting 0.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

import msgspec
import nats
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointStats
from nats.micro.service import Service as MicroService

from liver.services import bus as b
from liver.services.bus import ensure_consumer
from liver.services.metrics import METRICS_PORT_ENV, ServiceMetrics
from liver.services.pull import ContinuousPull
from liver.shared.codec import MessageError
from liver.shared.connection import connect_options
from liver.shared.errors import BusError, InputError
from liver.shared.logs import bind_message
from liver.shared.metrics_http import Health, MetricsServer
from liver.shared.nats_server import nats_url
from liver.shared.outage import is_outage
from liver.shared.subjects import validate_token

log = structlog.get_logger(__name__)


SERVICE_VERSION: Final = "0.1.0"

STOP_GRACE_S: Final = 15.0
"""How long a stopping service may take to settle the message in hand before it is cancelled.

With the drain's own bound (``DRAIN_TIMEOUT_S``) this keeps a shutdown inside a container's 30 s stop
grace period. A handler cut off here never acknowledged its message, so JetStream redelivers it after
the consumer's ack wait: nothing is lost, a stuck handler just cannot hold the process for ever.
"""


@dataclass(frozen=True)
class BusConnection:
    """The connection a service is started with."""

    nc: Client
    js: JetStreamContext
    replicas: int = 1
    """Replicas of every stream, bucket and object store a service declares (``$LIVER_JS_REPLICAS``)."""


class Service(Protocol):
    """One LiveR service: what :func:`hosted` needs from it.

    ``name`` is token-safe (it names the micro service ``liver-<name>``, the errors and dead-letter
    subjects and the durable consumers). ``start`` declares streams, consumers and buckets and starts
    consuming; ``stop`` stops taking messages and returns once the one in hand is settled.
    """

    name: str
    description: str

    async def start(self, bus: BusConnection) -> None: ...

    async def stop(self) -> None: ...

    def stats(self) -> Mapping[str, int | float | str]: ...

    def health_problem(self) -> str | None:
        """Why this started service cannot do its work (its consumer ended), or None: ``/healthz``."""
        ...


# -- connection ---------------------------------------------------------------------------------------


async def connect(
    url: str,
    environ: Mapping[str, str] | None = None,
    *,
    name: str,
    on_lost: Callable[[], None] | None = None,
    on_reconnected: Callable[[], Awaitable[None]] | None = None,
) -> Client:
    """Connect with :func:`connect_options`; connection events go to the log, not to stderr as text.

    ``on_lost`` is called when the connection is closed for good, by this process or not (the caller
    knows which): the client reconnects after an outage by itself, but a connection the server closed on
    a protocol error (a payload over ``max_payload``, for one) stays closed, and a service on it would be
    up but deaf. ``on_reconnected`` is awaited after each reconnect: what was published meanwhile
    without being stored is gone, and a service may have to say it again.
    """

    async def on_error(exc: Exception) -> None:
        log.error("nats_error", error=repr(exc))

    clients: list[Client] = []

    async def on_disconnected() -> None:
        if clients and (clients[0].is_closed or clients[0].is_draining):
            return  # our own shutdown, not an outage
        log.warning("nats_disconnected")

    async def reconnected() -> None:
        log.info("nats_reconnected")
        if on_reconnected is not None:
            await on_reconnected()

    async def on_closed() -> None:
        if on_lost is not None:
            on_lost()

    options = connect_options(url, environ, name=name)
    nc = await nats.connect(
        **options,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=reconnected,
        closed_cb=on_closed,
    )
    clients.append(nc)
    log.info("nats_connected", servers=options["servers"], client=name)
    return nc


# -- consuming ----------------------------------------------------------------------------------------

Handler = Callable[[Msg], Awaitable[None]]


class HasJobId(Protocol):
    @property
    def job_id(self) -> str: ...


DEFAULT_ACK_WAIT_S: Final = 5.0
"""How long the server waits for a service to settle a message before it redelivers it elsewhere. Short,
because every held message is reported in progress meanwhile (:class:`PullConsumer`): what it bounds is
the time a message stays with a process that died holding it."""


OUTAGE_S: Final = 60.0
"""How long a handler that fails only because the bus is unreachable is retried in place, holding its
message, before the failure counts as a delivery."""

OUTAGE_RETRY_CAP_S: Final = 2.0
"""The longest pause between two in-place retries during a bus outage."""


class PullConsumer:
    """One durable pull consumer feeding ``handler`` one message at a time, in stream order.

    The handler acknowledges or terminates the message itself. When it raises, the message is
    nak'ed with ``retry_delay_s`` (the last error is kept for the dead letter, see
    :meth:`last_error`), and after ``max_deliver`` attempts JetStream gives up on it. A failure that
    only says the bus is unreachable (:func:`is_outage`) is first retried in place, the message held
    and kept in progress, with a growing pause, for up to ``outage_s``: an outage costs time, never a
    delivery.

    Messages come from a :class:`~liver.services.pull.ContinuousPull`: each is handled as soon as it
    arrives. ``batch`` is the most messages this instance holds at once (in hand and prefetched), so
    ``batch=1`` leaves every other message to other instances on the same durable.
    ``fetch_timeout_s`` is how long one pull request lives on the server; an idle request shows it is
    alive every ``heartbeat_s``, and one silent for two heartbeats (lost in a server restart) is
    replaced, so a long expiry costs nothing in latency or recovery.

    Every message this instance holds (in hand and prefetched) is reported in progress every third of
    the consumer's ack wait, so that the ack wait can be short: a message is taken back from a process
    that died with it within seconds, never from one still working on it or about to.
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        stream: str,
        config: api.ConsumerConfig,
        handler: Handler,
        batch: int = 16,
        fetch_timeout_s: float = 30.0,
        retry_delay_s: float = 1.0,
        heartbeat_s: float = 1.0,
        outage_s: float = OUTAGE_S,
    ) -> None:
        if config.durable_name is None:
            raise ValueError("a PullConsumer needs a durable consumer")
        self._outage_s = outage_s
        self._js = js
        self.stream = stream
        self.durable: str = config.durable_name
        self._config = config
        self._handler = handler
        self._retry_delay_s = retry_delay_s
        # nats-py keeps a JetStreamContext's connection and API prefix (which carries the domain) private;
        # the pull request is sent on that connection to that prefix's MSG.NEXT subject.
        self._nc: Client = js._nc
        self._pull = ContinuousPull(
            js._nc,
            api_prefix=js._prefix,
            stream=stream,
            durable=self.durable,
            size=batch,
            expires_s=fetch_timeout_s,
            heartbeat_s=heartbeat_s,
            backoff_s=retry_delay_s,
        )
        self._task: asyncio.Task[None] | None = None
        self._keeping: asyncio.Task[None] | None = None
        self._in_hand: Msg | None = None
        ack_wait = config.ack_wait or DEFAULT_ACK_WAIT_S
        self._keep_alive_s = ack_wait / 3
        self._stopping = False
        self._idle = True
        self._errors: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.handled = 0
        self.failed = 0
        self.kept_alive = 0
        """Messages reported in progress so far (each held message, every third of the ack wait)."""
        self.outage_retries = 0
        """Handler calls repeated in place because the bus could not be reached."""

    async def start(self) -> None:
        await ensure_consumer(self._js, self.stream, self._config)
        await self._pull.start()
        self._task = asyncio.create_task(self._run(), name=f"consume-{self.stream}-{self.durable}")
        self._keeping = asyncio.create_task(
            self._keep_alive(), name=f"keep-alive-{self.stream}-{self.durable}"
        )

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self._keep_alive_s)
            held = ([self._in_hand] if self._in_hand is not None else []) + self._pull.waiting()
            for msg in held:
                with contextlib.suppress(nats.errors.Error):
                    await msg.in_progress()
                    self.kept_alive += 1

    async def stop(self) -> None:
        """Stop taking messages; a message being handled is finished first, prefetched ones nak'ed."""
        self._stopping = True
        keeping, self._keeping = self._keeping, None
        if keeping is not None:
            keeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeping
        task, self._task = self._task, None
        if task is not None:
            if self._idle:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for msg in await self._pull.close():
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()

    def last_error(self, sequence: int) -> str | None:
        """What the last failed attempt at stream ``sequence`` raised, if it failed here."""
        return self._errors.get(sequence)

    def problem(self) -> str | None:
        """Why this consumer no longer consumes although nobody stopped it (its task ended: cancelled,
        or a ``BaseException`` its catch-all lets through), or None. One never started, or stopped on
        purpose (a standby coordinator), has none."""
        if self._stopping:
            return None
        for task in (self._task, self._keeping):
            if task is not None and task.done():
                why = "cancelled" if task.cancelled() else repr(task.exception())
                return f"its consumer of {self.stream}/{self.durable} stopped ({task.get_name()}: {why})"
        return None

    async def _run(self) -> None:
        while not self._stopping:
            self._idle = True
            try:
                msg = await self._pull.next()
            except Exception as exc:
                # A consumer task that died would stop the service silently: log, wait, go on.
                log.exception("pull_failed", stream=self.stream, consumer=self.durable, error=repr(exc))
                await asyncio.sleep(self._retry_delay_s)
                continue
            finally:
                self._idle = False
            await self._one(msg)

    async def _handle_through_outages(self, msg: Msg) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._outage_s
        pause = self._retry_delay_s
        while True:
            reconnects = self._nc.stats["reconnects"]
            try:
                await self._handler(msg)
                return
            except Exception as exc:
                # A timeout is an outage only if the connection went down meanwhile (a request lost in
                # a server restart); on a connection that stayed up it is the handler's own failure.
                lost = not self._nc.is_connected or self._nc.stats["reconnects"] != reconnects
                if self._stopping or not is_outage(exc, timeouts=lost) or loop.time() >= give_up:
                    raise
                self.outage_retries += 1
                log.warning("bus_unreachable_retrying", error=repr(exc), retry_in_s=pause)
            await asyncio.sleep(pause)
            if self._stopping:
                raise BusError("stopped while the bus was unreachable; the message goes back")
            pause = min(max(2 * pause, 0.05), OUTAGE_RETRY_CAP_S)

    async def _one(self, msg: Msg) -> None:
        meta = msg.metadata
        seq = meta.sequence.stream
        with bind_message(subject=msg.subject, stream_sequence=seq, delivery=meta.num_delivered):
            self._in_hand = msg
            try:
                await self._handle_through_outages(msg)
            except Exception as exc:
                self.failed += 1
                self._errors[seq] = repr(exc)[:500]
                self._errors.move_to_end(seq)
                while len(self._errors) > 1000:
                    self._errors.popitem(last=False)
                log.exception("message_failed", retry_in_s=self._retry_delay_s)
                with contextlib.suppress(Exception):
                    await msg.nak(delay=self._retry_delay_s)
                return
            finally:
                self._in_hand = None
            self.handled += 1
            self._errors.pop(seq, None)


class DeadLetteringConsumer:
    """A durable :class:`PullConsumer` together with the watch that copies a message which ran out of
    deliveries to the dead letters (with the consumer's last error), so no service can forget one half.
    """

    def __init__(
        self,
        bus: BusConnection,
        *,
        source: str,
        stream: str,
        config: api.ConsumerConfig,
        handler: Handler,
        batch: int,
        retry_delay_s: float,
    ) -> None:
        self.consumer = PullConsumer(
            bus.js, stream=stream, config=config, handler=handler, batch=batch, retry_delay_s=retry_delay_s
        )
        self.watch = b.MaxDeliveriesWatch(
            bus.nc,
            bus.js,
            source=source,
            stream=stream,
            consumer=config.durable_name,
            last_error=self.consumer.last_error,
        )

    async def start(self, consume: bool = True) -> None:
        """Start the watch, and the consumer unless ``consume`` is false (a standby starts it later)."""
        await self.watch.start()
        if consume:
            await self.consumer.start()

    async def stop(self) -> None:
        await self.consumer.stop()
        await self.watch.stop()

    def stats(self) -> dict[str, int]:
        return {"failed_attempts": self.consumer.failed, "dead_lettered": self.watch.copied}

    def problem(self) -> str | None:
        return self.consumer.problem()


def job_of(subject: str) -> str:
    """The job token that ends a per-job subject (``liver.topology.request.<job>``)."""
    return subject.rsplit(".", 1)[-1]


class ConsumingService(abc.ABC):
    """What every service fed by one :class:`DeadLetteringConsumer` shares, written once: the consumer
    handing messages to :meth:`handle`, ``stop``, ``stats`` (``counts`` and the consumer's), and
    rejecting invalid input (an ``ErrorEvent``, a dead letter, ``term``; counted as ``rejected``).

    A subclass sets ``name``, assigns ``_js`` before consuming and calls :meth:`_consume` last in its
    ``start``; ``counts`` holds ``received``, the subclass's own counters and ``rejected``.
    """

    name: str

    def __init__(self, *counters: str) -> None:
        self._js: JetStreamContext | None = None
        self._consumer: DeadLetteringConsumer | None = None
        self.counts: dict[str, int] = dict.fromkeys(("received", *counters, "rejected"), 0)
        self.metrics = ServiceMetrics()

    @abc.abstractmethod
    async def handle(self, msg: Msg) -> None:
        """One message from the consumer: acknowledge, reject, or raise to have it retried."""

    async def _consume(
        self,
        bus: BusConnection,
        *,
        stream: str,
        config: api.ConsumerConfig,
        batch: int,
        retry_delay_s: float,
        consume: bool = True,
    ) -> None:
        """Start the consumer (and its dead-letter watch); ``consume=False`` starts only the watch."""
        self._consumer = DeadLetteringConsumer(
            bus,
            source=self.name,
            stream=stream,
            config=config,
            handler=self.handle,
            batch=batch,
            retry_delay_s=retry_delay_s,
        )
        await self._consumer.start(consume=consume)

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()

    async def queue_depth(self) -> tuple[int, int] | None:
        """Messages waiting for this service's durable consumer and delivered but unacknowledged (from
        JetStream's consumer info), or None before it consumes."""
        if self._consumer is None or self._js is None:
            return None
        consumer = self._consumer.consumer
        info = await self._js.consumer_info(consumer.stream, consumer.durable)
        return int(info.num_pending or 0), int(info.num_ack_pending or 0)

    def stats(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = dict(self.counts)
        if self._consumer is not None:
            out.update(self._consumer.stats())
        return out

    def health_problem(self) -> str | None:
        """Why this started service cannot do its work, or None (read by :class:`ServiceHealth`)."""
        if self._consumer is None:
            return f"{self.name} has no consumer"
        return self._consumer.problem()

    async def _reject(self, msg: Msg, error: MessageError) -> None:
        assert self._js is not None
        await b.reject(self._js, self.name, msg, error)
        self.counts["rejected"] += 1

    async def _reject_misaddressed(self, msg: Msg, message: HasJobId) -> bool:
        """Reject ``message`` when its job is not the one its subject names (a publisher's mistake that
        would otherwise act on another job); whether it was rejected."""
        subject_job = job_of(msg.subject)
        if message.job_id == subject_job:
            return False
        reason = f"{message.job_id!r} arrived on the subject of job {subject_job!r}"
        await self._reject(msg, MessageError(type(message).__name__, "$.job_id", reason))
        return True


@contextlib.asynccontextmanager
async def keep_in_progress(msg: Msg, every_s: float) -> AsyncIterator[None]:
    """Tell JetStream the message is still being worked on while a long computation runs, so that it is
    not redelivered to another instance in the middle."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(nats.errors.Error):
                await msg.in_progress()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# -- hosting ------------------------------------------------------------------------------------------


def micro_name(service_name: str) -> str:
    """The micro service name discovery reports (``$SRV.PING.liver-ingester``)."""
    return f"liver-{validate_token(service_name, 'service name')}"


def status_subject(service_name: str) -> str:
    """The service's own status endpoint (its counters as JSON)."""
    return f"liver.svc.{validate_token(service_name, 'service name')}.status"


@dataclass
class Hosted:
    """A started service and what it is connected with."""

    service: Service
    bus: BusConnection
    micro: MicroService
    metrics_port: int | None = None
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the connection closed without this process closing it: the service can no longer hear
    anything, so its host must end the process (non-zero) for a supervisor to restart it."""


HEALTH_TIMEOUT_S: Final = 3.0
"""How long ``/healthz`` waits for the service's event loop to read its state (and for the server's answer
to a ping, within that): a loop that does not answer is stuck, as the exec probe's discovery ping, which
waited as long, found. The manifests' probes wait longer (``timeoutSeconds``)."""


@dataclass(frozen=True)
class ServiceState:
    """What :func:`decide_health` needs, read in one go on the service's event loop."""

    started: bool
    """The service's ``start`` returned (streams, consumers declared; consuming) and it is announced."""
    stopping: bool
    lost: bool
    """The server closed the connection for good (the process is about to exit 1)."""
    connected: bool
    server_answered: bool
    """The server answered a ping just now (a connection can look up and be dead)."""
    problem: str | None = None
    """The service's own reason it cannot work (``health_problem()``: its consumer's task ended)."""


def decide_health(state: ServiceState) -> Health:
    """Healthy while the service is started, connected, its server answers and it has no problem: what
    the exec probe's discovery ping checked (a service answers it only then)."""
    if state.lost:
        return Health(False, "the server closed the connection for good; the process ends to be restarted")
    if state.stopping:
        return Health(False, "stopping")
    if not state.started:
        return Health(False, "starting: connecting to NATS, declaring its streams and consumers")
    if not state.connected:
        return Health(False, "disconnected from NATS, reconnecting")
    if not state.server_answered:
        return Health(False, "no answer from the NATS server to a ping")
    if state.problem is not None:
        return Health(False, state.problem)
    return Health(True, "ok")


class ServiceHealth:
    """The health check ``/healthz`` runs for one hosted service (:class:`MetricsServer`'s ``health``).

    Called on the HTTP server's thread; it reads the state on the service's event loop, within
    ``timeout_s``, so that a loop that no longer runs is unhealthy (the HTTP thread alone would answer
    for it). :meth:`started` and :meth:`stopping` are called by :func:`hosted`, on the loop.
    """

    def __init__(self, service: Service, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        self.service = service
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hosted: Hosted | None = None
        self._stopping = False

    def started(self, hosted: Hosted) -> None:
        self._loop = asyncio.get_running_loop()
        self._hosted = hosted

    def stopping(self) -> None:
        self._stopping = True

    async def state(self) -> ServiceState:
        """The state now (on the service's loop): one ping to the server when connected."""
        h = self._hosted
        if h is None:
            return self._unstarted()
        nc = h.bus.nc
        connected = bool(nc.is_connected)
        answered = False
        if connected:
            try:
                await nc.flush(timeout=0.8 * self.timeout_s)
                answered = True
            except (TimeoutError, nats.errors.Error):
                answered = False
        return ServiceState(
            started=True,
            stopping=self._stopping,
            lost=h.lost.is_set(),
            connected=connected,
            server_answered=answered,
            problem=self.service.health_problem(),
        )

    def _unstarted(self) -> ServiceState:
        return ServiceState(
            started=False, stopping=self._stopping, lost=False, connected=False, server_answered=False
        )

    def __call__(self) -> Health:
        loop = self._loop
        if loop is None:
            return decide_health(self._unstarted())
        reading = self.state()
        try:
            future = asyncio.run_coroutine_threadsafe(reading, loop)
        except RuntimeError:  # the loop is closed: the service is gone
            reading.close()
            return Health(False, "stopped")
        try:
            return decide_health(future.result(self.timeout_s))
        except TimeoutError:
            # Left to run when the loop comes back (cancelling it before it starts would leave the
            # coroutine never awaited): one ping more.
            return Health(False, f"the service's event loop did not answer within {self.timeout_s:g} s")


class ConnectionLost(BusError):
    """The server closed the service's connection for good; the process exits 1 to be restarted."""


@contextlib.asynccontextmanager
async def hosted(
    service: Service,
    url: str,
    environ: Mapping[str, str] | None = None,
    *,
    stop_grace_s: float = STOP_GRACE_S,
    metrics_port: int | None = None,
) -> AsyncIterator[Hosted]:
    """Connect, start ``service`` and announce it; on exit stop it (within ``stop_grace_s``, see
    :data:`STOP_GRACE_S`) and drain the connection. With ``metrics_port`` (0: a free one), the
    service's Prometheus metrics are served there for as long (``Hosted.metrics_port``)."""
    name = micro_name(service.name)
    if metrics_port is None:
        async with _hosted(service, url, environ, name, stop_grace_s) as h:
            yield h
        return
    metrics = getattr(service, "metrics", None)
    if not isinstance(metrics, ServiceMetrics):
        metrics = ServiceMetrics()
    metrics.watch_stats(service.name, service.stats)
    health = ServiceHealth(service)
    metrics_server = MetricsServer(metrics.registry, metrics_port, health=health)
    log.info("metrics_serving", service=service.name, port=metrics_server.port)
    try:
        async with _hosted(service, url, environ, name, stop_grace_s, health) as h:
            h.metrics_port = metrics_server.port
            refreshing = asyncio.create_task(_refresh_queue(service, metrics), name="metrics-queue")
            try:
                yield h
            finally:
                refreshing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await refreshing
    finally:
        metrics_server.close()


QUEUE_REFRESH_S: Final = 5.0


async def _refresh_queue(service: Service, metrics: ServiceMetrics, every_s: float = QUEUE_REFRESH_S) -> None:
    """Keep ``liver_queue_messages`` current: a failed read (the server away) leaves the last value."""
    depth_of = getattr(service, "queue_depth", None)
    if depth_of is None:
        return
    while True:
        try:
            depth = await depth_of()
        except (TimeoutError, nats.errors.Error) as exc:
            log.debug("queue_depth_unread", service=service.name, error=repr(exc))
        else:
            if depth is not None:
                metrics.queue.labels(service.name, "waiting").set(depth[0])
                metrics.queue.labels(service.name, "unacked").set(depth[1])
        await asyncio.sleep(every_s)


@contextlib.asynccontextmanager
async def _hosted(
    service: Service,
    url: str,
    environ: Mapping[str, str] | None,
    name: str,
    stop_grace_s: float,
    health: ServiceHealth | None = None,
) -> AsyncIterator[Hosted]:
    lost = asyncio.Event()
    closing = False

    def on_lost() -> None:
        if not closing:
            log.error("nats_connection_lost", service=service.name, error=repr(nc.last_error))
            lost.set()

    async def on_reconnected() -> None:
        again = getattr(service, "on_reconnected", None)
        if again is not None:
            await again()

    nc = await connect(url, environ, name=name, on_lost=on_lost, on_reconnected=on_reconnected)
    try:
        bus = BusConnection(
            nc=nc, js=nc.jetstream(), replicas=b.replicas_from(os.environ if environ is None else environ)
        )
        await service.start(bus)
        try:
            micro = await _announce(nc, service, name)
            log.info("service_started", service=service.name, micro_service=name, id=micro.id)
            h = Hosted(service=service, bus=bus, micro=micro, lost=lost)
            if health is not None:
                health.started(h)
            yield h
        finally:
            closing = True
            if health is not None:
                health.stopping()
            log.info("service_stopping", service=service.name)
            try:
                await asyncio.wait_for(service.stop(), stop_grace_s)
            except TimeoutError:
                log.error("service_stop_timed_out", service=service.name, grace_s=stop_grace_s)
            except nats.errors.Error as exc:
                if not lost.is_set():
                    raise
                log.warning("service_stopped_without_connection", service=service.name, error=repr(exc))
    finally:
        if not nc.is_closed:
            try:
                await nc.drain()
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("drain_failed", error=repr(exc))
                await nc.close()
        log.info("service_stopped", service=service.name)


async def _announce(nc: Client, service: Service, name: str) -> MicroService:
    """Register the micro service: discovery, and the service's counters in STATS and on ``status``."""

    def with_counters(_: EndpointStats) -> dict[str, int | float | str]:
        return dict(service.stats())

    async def status(request: Request) -> None:
        await request.respond(msgspec.json.encode(dict(service.stats())))

    micro = await add_service(
        nc,
        name=name,
        version=SERVICE_VERSION,
        description=service.description,
        metadata={"service": service.name},
        stats_handler=with_counters,
    )
    await micro.add_endpoint(name="status", subject=status_subject(service.name), handler=status)
    return micro


async def run_until_signalled(
    service: Service,
    url: str,
    environ: Mapping[str, str] | None = None,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
    metrics_port: int | None = None,
) -> None:
    """Host ``service`` until one of ``signals`` arrives, then shut down cleanly.

    The client retries an unreachable server for ever (a container may start before its NATS server);
    a signal that arrives while it is still connecting ends the process without waiting for it.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    started = asyncio.Event()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)

    async def host() -> None:
        async with hosted(service, url, environ, metrics_port=metrics_port) as h:
            started.set()
            waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(h.lost.wait())}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
            if h.lost.is_set():
                raise ConnectionLost(
                    f"{service.name}: the server closed the connection ({h.bus.nc.last_error!r})"
                )
            log.info("signal_received")

    hosting = asyncio.create_task(host())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({hosting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not hosting.done() and not started.is_set():
            log.info("signal_received_while_starting")
            hosting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hosting
            return
        await hosting
    finally:
        stopping.cancel()
        for sig in signals:
            loop.remove_signal_handler(sig)


def serve(service: Service, environ: Mapping[str, str] | None = None) -> int:
    """Run ``service`` in this process until SIGTERM/SIGINT; start an embedded server without NATS_URL.

    Returns the exit code (0 after a clean drain).
    """
    env = os.environ if environ is None else environ
    port = metrics_port(env)
    # The embedded server (if any) lives exactly as long as this block: it is stopped after the drain.
    with nats_url(env) as url:
        connect_options(url, env, name=micro_name(service.name))  # bad settings fail before anything starts
        b.replicas_from(env)
        asyncio.run(run_until_signalled(service, url, env, metrics_port=port))
    return 0


class MetricsPortError(InputError):
    """``$LIVER_METRICS_PORT`` is not a port number."""


def metrics_port(environ: Mapping[str, str]) -> int | None:
    """The port ``$LIVER_METRICS_PORT`` names (0: a free one), or None (no metrics served)."""
    text = environ.get(METRICS_PORT_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) > 65535:
        raise MetricsPortError(f"{METRICS_PORT_ENV}: {text!r} is not a port number (0-65535)")
    return int(text)
