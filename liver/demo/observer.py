"""The demo's own NATS client: it publishes the two resize events and records what the system says.

It does what any user of LiveR does, through the public contract: publish ``spot.warning`` and
``scale.request`` into JetStream and read ``generation.committed`` / ``generation.aborted``. For the
table and the progress display it also listens to internal subjects (worker hellos, heartbeats and
acks, the planners' answers, the services' errors): read-only, it changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode
from liver.shared.errors import LiverError
from liver.shared.messages import (
    ErrorEvent,
    GenerationAborted,
    GenerationCommitted,
    Heartbeat,
    Hello,
    JobMembership,
    NodeDevices,
    ScaleRequest,
    SpotWarning,
    TopologyPlanned,
    TransferPlanned,
    WorkerStatus,
)

log = structlog.get_logger(__name__)

M = TypeVar("M")

TriggerKind = Literal["spot_warning", "scale_request", "fail_stop"]


class DemoTimeout(LiverError, TimeoutError):
    """Something the demo waits for did not happen in time; the message says what."""


@dataclass(frozen=True)
class Arrival:
    """A message and the wall-clock time it arrived."""

    t: float
    message: Any


@dataclass(frozen=True)
class PublishedTrigger:
    kind: TriggerKind
    event_id: str
    label: str  # short, for tables: "spot warning node001"
    description: str
    published_at: float


@dataclass
class Observer:
    nc: Client
    job_id: str
    hellos: dict[str, Arrival] = field(default_factory=dict)
    beats: dict[str, Arrival] = field(default_factory=dict)
    statuses: list[Arrival] = field(default_factory=list)
    topology: dict[int, Arrival] = field(default_factory=dict)
    transfer: dict[int, Arrival] = field(default_factory=dict)
    committed: dict[int, Arrival] = field(default_factory=dict)
    aborted: list[Arrival] = field(default_factory=list)
    errors: list[Arrival] = field(default_factory=list)
    triggers: list[PublishedTrigger] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        job = self.job_id
        routes: list[tuple[str, type, Callable[[Arrival], None]]] = [
            (s.worker_hello(job), Hello, lambda m: self.hellos.__setitem__(m.message.worker_id, m)),
            (s.worker_heartbeat(job), Heartbeat, lambda m: self.beats.__setitem__(m.message.worker_id, m)),
            (s.worker_status(job), WorkerStatus, self.statuses.append),
            (s.topology_planned(job), TopologyPlanned, lambda m: self._by_generation(self.topology, m)),
            (s.transfer_planned(job), TransferPlanned, lambda m: self._by_generation(self.transfer, m)),
            (s.GENERATION_COMMITTED, GenerationCommitted, lambda m: self._by_generation(self.committed, m)),
            (s.GENERATION_ABORTED, GenerationAborted, self.aborted.append),
            (s.ERRORS_ANY, ErrorEvent, self.errors.append),
        ]
        for subject, kind, sink in routes:
            await self.nc.subscribe(subject, cb=self._receiver(kind, sink))
        await self.nc.flush()

    def _receiver(self, kind: type, sink: Callable[[Arrival], None]) -> Callable[[Msg], Any]:
        async def cb(msg: Msg) -> None:
            try:
                message = decode(msg.data, kind)
            except MessageError as error:
                log.warning("demo.unreadable_message", subject=msg.subject, field=error.path)
                return
            if getattr(message, "job_id", self.job_id) not in (self.job_id, None):
                return
            sink(Arrival(time.time(), message))
            self._changed.set()

        return cb

    @staticmethod
    def _by_generation(book: dict[int, Arrival], seen: Arrival) -> None:
        book.setdefault(seen.message.generation, seen)

    # -- waiting ----------------------------------------------------------------------------------------

    async def until(self, what: str, check: Callable[[], bool], timeout_s: float) -> None:
        """Return once ``check()`` holds (re-checked on every message and every half second)."""
        deadline = time.monotonic() + timeout_s
        while not check():
            left = deadline - time.monotonic()
            if left <= 0:
                raise DemoTimeout(f"gave up after {timeout_s:.0f} s waiting for {what}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))

    def acks(self, generation: int, phase: str) -> set[str]:
        return {
            m.message.worker_id
            for m in self.statuses
            if m.message.generation == generation and m.message.phase == phase
        }

    def outcome(self, generation: int) -> GenerationCommitted | GenerationAborted | None:
        if generation in self.committed:
            return self.committed[generation].message
        for seen in self.aborted:
            if seen.message.generation == generation:
                return seen.message
        return None

    # -- reading the system's records -------------------------------------------------------------------

    async def membership(self) -> JobMembership | None:
        """The coordinator's record of the live world's workers (what the ingester maps nodes with)."""
        try:
            kv = await self.nc.jetstream().key_value(s.KV_MEMBERSHIP)
            entry = await kv.get(self.job_id)
        except (nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError):
            return None
        if entry.value is None:
            return None
        return decode(entry.value, JobMembership)

    async def services_answering(self, names: tuple[str, ...]) -> set[str]:
        """Which services answer their status request now."""
        answered = set()
        for name in names:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self.nc.request(f"liver.svc.{name}.status", b"", timeout=1.0)
                answered.add(name)
        return answered

    # -- the two events ---------------------------------------------------------------------------------

    async def spot_warning(self, node: str, notice_s: float) -> PublishedTrigger:
        event_id = f"{self.job_id}-spot-{node}-{int(time.time())}"
        warning = SpotWarning(
            job_id=self.job_id, event_id=event_id, node=node, provider="demo", notice_s=notice_s
        )
        return await self._publish(
            s.SPOT_WARNING,
            warning,
            "spot_warning",
            f"spot warning {node}",
            f"spot warning: {node} reclaimed in {notice_s:.0f} s",
        )

    async def scale_request(self, node: str, devices: tuple[int, ...]) -> PublishedTrigger:
        event_id = f"{self.job_id}-scale-{node}-{int(time.time())}"
        request = ScaleRequest(
            job_id=self.job_id,
            event_id=event_id,
            reason=f"capacity is back: {node}",
            add=(NodeDevices(node=node, devices=devices),),
        )
        return await self._publish(
            s.SCALE_REQUEST,
            request,
            "scale_request",
            f"scale request +{node}",
            f"scale request: add {node} ({len(devices)} devices)",
        )

    def killed(self, node: str, event_id: str, killed_at: float) -> PublishedTrigger:
        """Note a loss the demo caused (no bus event: the coordinator saw missed heartbeats and made
        ``event_id`` for it), so that it is read like the events the demo published."""
        trigger = PublishedTrigger(
            "fail_stop",
            event_id,
            f"fail-stop {node}",
            f"fail-stop: {node}'s workers killed without notice",
            killed_at,
        )
        self.triggers.append(trigger)
        return trigger

    async def _publish(
        self, subject: str, message: msgspec.Struct, kind: TriggerKind, label: str, description: str
    ) -> PublishedTrigger:
        event_id = message.event_id  # type: ignore[attr-defined]
        await self.nc.jetstream().publish(subject, encode(message), headers={s.HEADER_MSG_ID: event_id})
        trigger = PublishedTrigger(kind, event_id, label, description, time.time())
        self.triggers.append(trigger)
        log.info("demo.event_published", subject=subject, event_id=event_id)
        return trigger
