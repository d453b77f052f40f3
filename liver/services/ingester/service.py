"""The ingester on the bus: resize events in from ``spot.warning``/``scale.request``, resize requests out.

Per message, in this order (the order is what makes a crash at any point harmless):

1. decode strictly (bad input: ``ErrorEvent`` + dead letter + ``term``, see :func:`bus.reject`);
2. look the event up in ``liver-events-seen``: a duplicate is acknowledged and dropped;
3. read the job's membership from ``liver-membership`` and resolve nodes to devices;
4. publish ``ResizeRequested`` with a ``Nats-Msg-Id`` derived from the event id;
5. record the event as seen, then acknowledge.

A crash after 4 redelivers the event; step 4 publishes the same id again and JetStream drops the copy.
A crash after 5 redelivers it too, and step 2 drops it. Anything that fails for a reason other than the
input (a membership record the ingester cannot read, a publish that times out) raises: the message is
retried, and after ``max_deliver`` attempts it is copied to the dead letters by the advisory watch.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Final

import msgspec
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from liver.services import bus as b
from liver.services.host import DEFAULT_ACK_WAIT_S, BusConnection, ConsumingService
from liver.services.ingester import core
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode
from liver.shared.errors import BusError
from liver.shared.logs import bind_message
from liver.shared.messages import JobMembership

log = structlog.get_logger(__name__)

SOURCE: Final = "ingester"

_SEEN: Final = msgspec.json.Decoder(core.Seen)


class IngesterSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How the ingester consumes; the defaults suit production, tests shorten the delays."""

    durable: str = "ingester"
    max_deliver: int = 5
    """Attempts at a message that keeps failing for reasons other than its content."""
    ack_wait_s: float = DEFAULT_ACK_WAIT_S
    """Short: held messages are reported in progress; a message held by a dead ingester comes back in it."""
    retry_delay_s: float = 2.0
    seen_ttl_s: float = 7 * b.DAY_S
    """How long an event id is remembered: past this a re-sent event would resize again."""
    batch: int = 16

    def __post_init__(self) -> None:
        s.validate_token(self.durable, "durable")
        for field in ("max_deliver", "batch"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        for field in ("ack_wait_s", "retry_delay_s", "seen_ttl_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")


class MembershipUnreadable(BusError):
    """The coordinator's membership record for a job does not decode: not the event's fault, so the
    event is retried rather than rejected."""


class Ingester(ConsumingService):
    """The ingester service (see the module docstring); host it with :mod:`liver.services.host`."""

    name = SOURCE
    description = "Validates and de-duplicates spot warnings and scale requests into resize requests."

    def __init__(self, settings: IngesterSettings | None = None) -> None:
        super().__init__("resized", "duplicates")
        self.settings = settings or IngesterSettings()
        self._seen: KeyValue | None = None
        self._members: KeyValue | None = None

    async def start(self, bus: BusConnection) -> None:
        js = self._js = bus.js
        await b.ensure_streams(
            js,
            (s.STREAM_INGEST, s.STREAM_CONTROL, s.STREAM_ERRORS, s.STREAM_DEAD_LETTERS),
            replicas=bus.replicas,
        )
        self._seen = await b.ensure_kv(
            js,
            s.KV_EVENTS_SEEN,
            ttl_s=self.settings.seen_ttl_s,
            description="Events the ingester turned into resize requests, by job and event id.",
            replicas=bus.replicas,
        )
        self._members = await b.ensure_kv(
            js,
            s.KV_MEMBERSHIP,
            description="Each job's current workers and devices, by job id.",
            replicas=bus.replicas,
        )
        config = b.pull_consumer_config(
            self.settings.durable,
            None,  # the whole ingest stream: spot.warning and scale.request
            ack_wait_s=self.settings.ack_wait_s,
            max_deliver=self.settings.max_deliver,
            description="The ingester: resize events in stream order.",
        )
        await self._consume(
            bus,
            stream=s.STREAM_INGEST.name,
            config=config,
            batch=self.settings.batch,
            retry_delay_s=self.settings.retry_delay_s,
        )

    async def handle(self, msg: Msg) -> None:
        """One message from the ingest stream; see the module docstring for the steps."""
        assert self._js is not None and self._seen is not None
        self.counts["received"] += 1
        try:
            event = core.parse(msg.subject, msg.data)
        except MessageError as error:
            await self._reject(msg, error)
            return
        with bind_message(event):
            key = core.seen_key(event)
            event_digest = core.digest(event)
            previous = await self._read_seen(key)
            verdict = core.judge(previous, event_digest)
            if verdict is core.Novelty.DUPLICATE:
                assert previous is not None
                self.counts["duplicates"] += 1
                await msg.ack()
                log.info("duplicate_event_dropped", first_sequence=previous.stream_sequence)
                return
            if verdict is core.Novelty.CONFLICT:
                assert previous is not None
                await self._reject(msg, core.conflict_error(event, previous))
                return
            membership = await self._membership(event.job_id)
            try:
                resize = core.resolve(event, membership, msg.metadata.timestamp)
            except MessageError as error:
                await self._reject(msg, error)
                return
            with bind_message(resize):
                ack = await self._js.publish(
                    s.resize_requested(resize.job_id),
                    encode(resize),
                    headers={s.HEADER_MSG_ID: core.resize_msg_id(event)},
                )
                record = core.Seen(
                    digest=event_digest,
                    subject=msg.subject,
                    stream_sequence=msg.metadata.sequence.stream,
                    generation=resize.generation,
                    at=datetime.now(UTC),
                )
                try:
                    await self._seen.create(key, msgspec.json.encode(record))
                except nats.js.errors.KeyWrongLastSequenceError:
                    log.info("seen_record_exists")  # another instance handled the same event first
                await msg.ack()
                self.counts["resized"] += 1
                log.info(
                    "resize_requested",
                    keep=len(resize.keep),
                    remove=[str(d) for d in resize.remove],
                    add=[str(d) for d in resize.add],
                    target_devices=resize.target_devices,
                    deadline=resize.deadline,
                    republished=bool(ack.duplicate),
                )

    async def _read_seen(self, key: str) -> core.Seen | None:
        assert self._seen is not None
        try:
            entry = await self._seen.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        # A record this ingester wrote; if it no longer decodes, retrying (and dead-lettering) is safer
        # than guessing whether the event was handled.
        return _SEEN.decode(entry.value or b"")

    async def _membership(self, job_id: str) -> JobMembership | None:
        assert self._members is not None
        try:
            entry = await self._members.get(job_id)
        except nats.js.errors.KeyNotFoundError:
            return None
        try:
            membership = decode(entry.value or b"", JobMembership)
        except MessageError as exc:
            log.error("membership_unreadable", field=exc.path, reason=exc.reason, revision=entry.revision)
            raise MembershipUnreadable(f"membership of job {job_id!r}: {exc}") from None
        if membership.job_id != job_id:
            raise MembershipUnreadable(f"membership under key {job_id!r} is for job {membership.job_id!r}")
        return membership


def create_service(environ: Mapping[str, str]) -> Ingester:
    """What ``liver serve ingester`` runs (the ingester reads no settings from the environment)."""
    del environ
    return Ingester()
