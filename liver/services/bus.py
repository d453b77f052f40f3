"""JetStream declarations and the two ways a service gives up on a message, shared by every service.

Declarations are idempotent so that any number of service processes can start in any order, and they
all read one table (:data:`STREAM_LIMITS`): two services that declared the same stream with different
limits would otherwise undo each other's update on every start.

Giving up on a message never loses it:

- input that can never be valid (:func:`reject`): an ``ErrorEvent`` naming the field goes to
  ``liver.errors.<service>``, the raw message with its headers to ``liver.dlq.<service>``, and only
  then is the original terminated;
- core-NATS input (worker traffic, in no stream) that can never be valid (:func:`reject_unstored`):
  the same error event and dead-letter copy, deduplicated by a digest of the payload;
- a message that kept failing for another reason (a transient fault that did not clear) exhausts the
  consumer's ``max_deliver``; JetStream then announces it with an advisory, and
  :class:`MaxDeliveriesWatch` copies it from the stream to the dead letters.

Both publish with a ``Nats-Msg-Id`` derived from the original stream and sequence, so that a copy
retried after a crash, or made by two instances of a service at once, is stored once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Final

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from liver.shared import subjects as s
from liver.shared.codec import MessageError, encode, error_event
from liver.shared.errors import BusError, InputError
from liver.shared.logs import bind_message
from liver.shared.messages import ErrorEvent

log = structlog.get_logger(__name__)

DAY_S: Final = 24 * 3600.0

STREAM_LIMITS: Final[Mapping[str, float | None]] = {
    s.STREAM_INGEST.name: 7 * DAY_S,
    s.STREAM_CONTROL.name: 7 * DAY_S,
    s.STREAM_GENERATIONS.name: None,
    s.STREAM_ERRORS.name: 30 * DAY_S,
    s.STREAM_DEAD_LETTERS.name: None,
}
"""``max_age`` per stream, in seconds (``None``: kept until deleted). Events and plans are worth
little after a week; generation outcomes are what a restarted coordinator replays and dead letters are
what an operator replays, so neither expires on its own."""

DUPLICATE_WINDOW_S: Final = 120.0
"""JetStream's dedup window for every LiveR stream (the server's default). Beyond it the ingester's
seen-record catches a re-sent event; the coordinator's compare-and-set catches a re-sent commit."""

HEADER_ORIGINAL_MSG_ID: Final = "Liver-Original-Msg-Id"
"""A dead letter cannot keep its original ``Nats-Msg-Id`` (the dead-letter stream would dedup on it),
so the id moves to this header."""


class DeclareError(BusError):
    """A stream, consumer or bucket could not be declared (a name clash with a foreign config)."""


REPLICAS_ENV: Final = "LIVER_JS_REPLICAS"
"""How many servers of a JetStream cluster keep each of LiveR's streams, buckets and object stores: 1 for
a single server (the embedded default), 3 for the deployment's three-server cluster, so that losing one
server loses nothing and stops nothing."""
MAX_REPLICAS: Final = 5  # JetStream's own limit


class ReplicasError(InputError):
    """``$LIVER_JS_REPLICAS`` is not a replica count JetStream accepts."""


def replicas_from(environ: Mapping[str, str]) -> int:
    """The replica count ``$LIVER_JS_REPLICAS`` gives (default 1); a bad value is named."""
    text = environ.get(REPLICAS_ENV, "").strip()
    if not text:
        return 1
    if not text.isdigit() or not 1 <= int(text) <= MAX_REPLICAS:
        raise ReplicasError(f"{REPLICAS_ENV}: {text!r} is not a replica count (1 to {MAX_REPLICAS})")
    return int(text)


# -- declarations -------------------------------------------------------------------------------------


def stream_config(spec: s.StreamSpec, replicas: int = 1) -> api.StreamConfig:
    """The JetStream config LiveR wants for one of its streams."""
    if spec.name not in STREAM_LIMITS:
        raise DeclareError(f"stream {spec.name} has no entry in STREAM_LIMITS")
    return api.StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        description=spec.description,
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        max_age=STREAM_LIMITS[spec.name],
        duplicate_window=DUPLICATE_WINDOW_S,
        num_replicas=replicas,
    )


def _differs(have: api.StreamConfig, want: api.StreamConfig) -> list[str]:
    fields = (
        "subjects",
        "description",
        "max_age",
        "duplicate_window",
        "storage",
        "retention",
        "num_replicas",
    )
    out = []
    for field in fields:
        a, b = getattr(have, field), getattr(want, field)
        if field == "subjects":
            a, b = sorted(a or ()), sorted(b or ())
        if field == "max_age":
            a, b = a or 0, b or 0
        if field == "num_replicas":
            a, b = a or 1, b or 1
        if a != b:
            out.append(field)
    return out


async def ensure_stream(js: JetStreamContext, spec: s.StreamSpec, *, replicas: int = 1) -> api.StreamInfo:
    """Create the stream, or bring an existing one's subjects, limits and replicas to
    :func:`stream_config`."""
    want = stream_config(spec, replicas)
    for _attempt in range(3):
        try:
            info = await js.stream_info(spec.name)
        except nats.js.errors.NotFoundError:
            try:
                return await js.add_stream(want)
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code != 10058:  # created meanwhile by another process with other settings
                    raise
                continue
        changed = _differs(info.config, want)
        if not changed:
            return info
        log.info("stream_updated", stream=spec.name, fields=changed)
        return await js.update_stream(want)
    raise DeclareError(f"stream {spec.name} could not be declared")


async def ensure_streams(
    js: JetStreamContext, specs: tuple[s.StreamSpec, ...] = s.STREAMS, *, replicas: int = 1
) -> None:
    for spec in specs:
        await ensure_stream(js, spec, replicas=replicas)


def pull_consumer_config(
    durable: str,
    filter_subject: str | None,
    *,
    ack_wait_s: float,
    max_deliver: int,
    description: str,
) -> api.ConsumerConfig:
    """A durable, explicitly acknowledged pull consumer; ``max_deliver`` bounds retries of a message."""
    if max_deliver < 1:
        raise ValueError(f"max_deliver must be >= 1, got {max_deliver}")
    if ack_wait_s <= 0:
        raise ValueError(f"ack_wait_s must be > 0, got {ack_wait_s}")
    return api.ConsumerConfig(
        durable_name=s.validate_token(durable, "durable"),
        description=description,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
        filter_subject=filter_subject,
        max_ack_pending=1000,
    )


async def ensure_consumer(js: JetStreamContext, stream: str, config: api.ConsumerConfig) -> api.ConsumerInfo:
    """Create or update a durable consumer (the server updates a durable in place when it can)."""
    return await js.add_consumer(stream, config)


async def ensure_kv(
    js: JetStreamContext,
    bucket: str,
    *,
    description: str,
    ttl_s: float | None = None,
    history: int = 1,
    replicas: int = 1,
) -> KeyValue:
    """Open the bucket, creating it when missing (a bucket made by another process is used as it is)."""
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        pass
    try:
        return await js.create_key_value(
            bucket=bucket, description=description, ttl=ttl_s, history=history, replicas=replicas
        )
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != 10058:
            raise
        return await js.key_value(bucket)


async def ensure_object_store(
    js: JetStreamContext, bucket: str, *, description: str, ttl_s: float | None = None, replicas: int = 1
) -> ObjectStore:
    """Open the store, creating it when missing; objects older than ``ttl_s`` expire."""
    try:
        return await js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        pass
    try:
        return await js.create_object_store(bucket, description=description, ttl=ttl_s, replicas=replicas)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != 10058:
            raise
        return await js.object_store(bucket)


# -- giving up on a message ---------------------------------------------------------------------------


HEADER_ORIGINAL_HEADERS_DROPPED: Final = "Liver-Original-Headers-Dropped"
_ORIGINAL_HEADERS_MAX: Final = 16 * 1024


def _original_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The original message's headers for its dead letter (its msg id renamed); headers too large to
    travel beside the payload are replaced by their size."""
    out = dict(headers or {})
    if _header_bytes(out) > _ORIGINAL_HEADERS_MAX:
        return {HEADER_ORIGINAL_HEADERS_DROPPED: str(_header_bytes(out))}
    msg_id = out.pop(s.HEADER_MSG_ID, None)
    if msg_id is not None:
        out[HEADER_ORIGINAL_MSG_ID] = msg_id
    return out


HEADER_PAYLOAD_SIZE: Final = "Liver-Payload-Size"
HEADER_PAYLOAD_DIGEST: Final = "Liver-Payload-Digest"
HEADER_PAYLOAD_TRUNCATED: Final = "Liver-Payload-Truncated"
_HEADER_MARGIN: Final = 512
"""Room kept for the headers added below and for what the server counts beyond them."""


def _header_bytes(headers: Mapping[str, str]) -> int:
    """The size of the NATS header block these headers make (``NATS/1.0``, a line each, a blank line)."""
    return len(b"NATS/1.0\r\n") + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 2


def fit_to_payload(data: bytes, headers: dict[str, str], max_payload: int) -> bytes:
    """``data``, cut so that it and ``headers`` fit in ``max_payload``; a cut copy says so in its headers
    (the original size, a SHA-256 of the whole payload). The server counts headers and body together
    against ``max_payload`` and closes the connection of a client that goes over; a message just under
    the limit plus a dead letter's headers would otherwise cost the service its connection."""
    if len(data) + _header_bytes(headers) <= max_payload:
        return data
    headers[HEADER_PAYLOAD_SIZE] = str(len(data))
    headers[HEADER_PAYLOAD_DIGEST] = "SHA-256=" + hashlib.sha256(data).hexdigest()
    headers[HEADER_PAYLOAD_TRUNCATED] = "true"
    keep = max(0, max_payload - _header_bytes(headers) - _HEADER_MARGIN)
    return bytes(data[:keep])


def max_payload_of(js: JetStreamContext) -> int:
    """The connected server's ``max_payload`` (1 MiB, the server's default, before any INFO)."""
    nc = getattr(js, "_nc", None)
    return int(getattr(nc, "max_payload", 0) or 1024 * 1024)


async def dead_letter(
    js: JetStreamContext,
    source: str,
    *,
    subject: str,
    data: bytes,
    headers: Mapping[str, str] | None,
    stream: str,
    sequence: int,
    error: str,
) -> None:
    """Copy a raw message to ``liver.dlq.<source>`` with headers saying where it came from and why."""
    copy = _original_headers(headers)
    copy.update(
        {
            s.HEADER_ORIGINAL_SUBJECT: subject,
            s.HEADER_ORIGINAL_STREAM: stream,
            s.HEADER_ORIGINAL_SEQUENCE: str(sequence),
            # Headers are single lines: a multi-line reason would corrupt the header block.
            s.HEADER_ERROR: " ".join(error.split())[:1000],
            s.HEADER_MSG_ID: f"dlq-{stream}-{sequence}",
        }
    )
    body = fit_to_payload(data, copy, max_payload_of(js))
    await js.publish(s.dead_letters(source), body, headers=copy)


async def publish_error(js: JetStreamContext, event: ErrorEvent, *, stream: str, sequence: int) -> None:
    await js.publish(
        s.errors(event.source),
        encode(event),
        headers={s.HEADER_MSG_ID: f"error-{event.source}-{stream}-{sequence}"},
    )


async def reject(js: JetStreamContext, source: str, msg: Msg, error: MessageError) -> ErrorEvent:
    """Report ``msg`` as invalid input, keep it as a dead letter, then terminate it.

    Raises when either publish fails; the message is then neither terminated nor acknowledged, and the
    caller's retry (a ``nak``) tries again.
    """
    meta = msg.metadata
    event = error_event(
        source=source,
        subject=msg.subject,
        data=msg.data,
        error=error,
        stream_sequence=meta.sequence.stream,
    )
    await publish_error(js, event, stream=meta.stream, sequence=meta.sequence.stream)
    await dead_letter(
        js,
        source,
        subject=msg.subject,
        data=msg.data,
        headers=msg.headers,
        stream=meta.stream,
        sequence=meta.sequence.stream,
        error=f"{error.path}: {error.reason}",
    )
    await msg.term()
    # The ids are read from the payload (it may not decode), so they are bound here rather than by the
    # caller: an operator searching the log for their event id finds the rejection too.
    with bind_message(job_id=event.job_id, event_id=event.event_id, stream_sequence=meta.sequence.stream):
        log.warning("message_rejected", field=error.path, reason=error.reason)
    return event


async def reject_unstored(
    js: JetStreamContext, source: str, *, subject: str, data: bytes, error: MessageError
) -> ErrorEvent:
    """Report core-NATS input (a worker's hello, heartbeat or ack) that can never be valid.

    Such messages are in no stream, so nothing can be terminated or replayed from a sequence: the
    ``ErrorEvent`` and the dead-letter copy are the only record, and they make it durable. Both are
    named by a digest of subject and payload, so a worker repeating the same bad message every
    heartbeat is stored once per dedup window rather than flooding the streams.
    """
    digest = hashlib.blake2b(subject.encode() + b"\0" + bytes(data), digest_size=12).hexdigest()
    event = error_event(source=source, subject=subject, data=data, error=error)
    await js.publish(
        s.errors(source), encode(event), headers={s.HEADER_MSG_ID: f"error-{source}-core-{digest}"}
    )
    headers = {
        s.HEADER_ORIGINAL_SUBJECT: subject,
        s.HEADER_ERROR: " ".join(f"{error.path}: {error.reason}".split())[:1000],
        s.HEADER_MSG_ID: f"dlq-core-{digest}",
    }
    body = fit_to_payload(bytes(data), headers, max_payload_of(js))
    await js.publish(s.dead_letters(source), body, headers=headers)
    with bind_message(job_id=event.job_id, event_id=event.event_id):
        log.warning("message_rejected", subject=subject, field=error.path, reason=error.reason)
    return event


class _Advisory(msgspec.Struct):
    stream: str
    consumer: str
    stream_seq: int
    deliveries: int


_ADVISORY: Final = msgspec.json.Decoder(_Advisory)


class MaxDeliveriesWatch:
    """Copies every message that exhausted a consumer's ``max_deliver`` to the dead letters.

    ``last_error(sequence)`` tells what went wrong on the last attempt (the consumer keeps it), so the
    dead letter says more than "gave up".
    """

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        *,
        source: str,
        stream: str,
        consumer: str,
        last_error: Callable[[int], str | None],
    ) -> None:
        self._nc, self._js = nc, js
        self._source, self._stream, self._consumer = source, stream, consumer
        self._last_error = last_error
        self._sub: Subscription | None = None
        self.copied = 0

    async def start(self) -> None:
        subject = s.max_deliveries_advisory(self._stream, self._consumer)
        self._sub = await self._nc.subscribe(subject, cb=self._on_advisory)

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def _on_advisory(self, msg: Msg) -> None:
        try:
            advisory = _ADVISORY.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
            log.error("advisory_unreadable", subject=msg.subject, error=str(exc), data=msg.data[:500])
            return
        seq = advisory.stream_seq
        try:
            raw = await self._js.get_msg(self._stream, seq)
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.error("dead_letter_unreadable", stream=self._stream, stream_sequence=seq, error=repr(exc))
            return
        reason = self._last_error(seq) or "unknown (failed in another instance)"
        try:
            await dead_letter(
                self._js,
                self._source,
                subject=raw.subject or "",
                data=raw.data or b"",
                headers=raw.headers,
                stream=self._stream,
                sequence=seq,
                error=f"gave up after {advisory.deliveries} deliveries; last error: {reason}",
            )
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.error("dead_letter_failed", stream=self._stream, stream_sequence=seq, error=repr(exc))
            return
        self.copied += 1
        log.error(
            "message_dead_lettered",
            stream=self._stream,
            stream_sequence=seq,
            deliveries=advisory.deliveries,
            last_error=reason,
        )
