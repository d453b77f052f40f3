"""The ingester's decisions, without I/O: what a payload is, whether it was seen, what it asks for.

Three steps, each a pure function the adapter calls in order:

1. :func:`parse`: the strict decode of a payload on ``spot.warning`` or ``scale.request``;
2. :func:`judge`: new, a duplicate (the same event again: drop it), or a conflict (the same event id
   with different content: a publisher bug that must be reported rather than silently dropped);
3. :func:`resolve`: the job's membership turns nodes into devices, giving the ``ResizeRequested``.

Every rejection is a :class:`~liver.shared.codec.MessageError` whose path names the field at fault
(``$.node``, ``$.remove[1]``, ``$.add[0].devices[2]``, ``$.job_id``), which the adapter publishes as an
``ErrorEvent``.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from enum import StrEnum
from typing import Final

import msgspec

from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode
from liver.shared.layout import Device
from liver.shared.messages import (
    JobMembership,
    ResizeRequested,
    ScaleRequest,
    SpotWarning,
    TriggerKind,
    WarningKind,
)

IngestEvent = SpotWarning | ScaleRequest

EXPECTED: Final[dict[str, type[SpotWarning] | type[ScaleRequest]]] = {
    s.SPOT_WARNING: SpotWarning,
    s.SCALE_REQUEST: ScaleRequest,
}
"""Each public subject carries exactly one kind of event."""


class Seen(msgspec.Struct, frozen=True, kw_only=True):
    """The ingester's record of an event it turned into a resize (value in ``liver-events-seen``)."""

    digest: str
    """SHA-256 of the event as decoded and re-encoded: formatting differences are the same event."""
    subject: str
    stream_sequence: int
    generation: int
    at: datetime


class Novelty(StrEnum):
    NEW = "new"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"


def parse(subject: str, data: bytes) -> IngestEvent:
    """The event on ``subject``; raises :class:`MessageError` naming the field."""
    kind = EXPECTED.get(subject)
    if kind is None:
        raise MessageError(
            "SpotWarning | ScaleRequest", "$", f"the ingester does not read subject {subject!r}"
        )
    return decode(data, kind)


def seen_key(event: IngestEvent) -> str:
    """Key of the event's seen-record: event ids are unique within a job, not across jobs."""
    return f"{event.job_id}.{event.event_id}"


def resize_msg_id(event: IngestEvent) -> str:
    """``Nats-Msg-Id`` of the resulting ``ResizeRequested``: a retry after a crash is stored once."""
    return f"resize-{event.job_id}-{event.event_id}"


def digest(event: IngestEvent) -> str:
    return hashlib.sha256(encode(event)).hexdigest()


def judge(previous: Seen | None, event_digest: str) -> Novelty:
    if previous is None:
        return Novelty.NEW
    return Novelty.DUPLICATE if previous.digest == event_digest else Novelty.CONFLICT


def conflict_error(event: IngestEvent, previous: Seen) -> MessageError:
    return MessageError(
        type(event).__name__,
        "$.event_id",
        f"event id {event.event_id!r} of job {event.job_id!r} was already used by a different event "
        f"(stream sequence {previous.stream_sequence} on {previous.subject})",
    )


def unknown_job(event: IngestEvent) -> MessageError:
    return MessageError(
        type(event).__name__,
        "$.job_id",
        f"unknown job {event.job_id!r}: the coordinator has no membership record for it",
    )


def resolve(event: IngestEvent, membership: JobMembership | None, published_at: datetime) -> ResizeRequested:
    """The resize ``event`` asks of the job's current world; ``published_at`` is the stream's time."""
    if membership is None:
        raise unknown_job(event)
    if isinstance(event, SpotWarning):
        return _spot(event, membership, published_at)
    return _scale(event, membership)


def _devices_on(membership: JobMembership, node: str) -> list[Device]:
    return [w.device for w in membership.workers if w.device.node == node]


def _spot(event: SpotWarning, membership: JobMembership, published_at: datetime) -> ResizeRequested:
    remove = _devices_on(membership, event.node)
    if not remove:
        raise _unknown_node(event, "$.node", event.node, membership)
    keep = tuple(w.device for w in membership.workers if w.device.node != event.node)
    rebalance = event.warning_kind is WarningKind.REBALANCE
    return _build(
        event,
        trigger=TriggerKind.REBALANCE if rebalance else TriggerKind.SPOT_WARNING,
        generation=membership.generation,
        reason=(
            f"{event.provider} recommends moving off node {event.node} (rebalance)"
            if rebalance
            else f"{event.provider} reclaims node {event.node}"
        ),
        keep=keep,
        remove=tuple(remove),
        deadline=event.effective_deadline(published_at),
    )


def _scale(event: ScaleRequest, membership: JobMembership) -> ResizeRequested:
    current = {w.device for w in membership.workers}
    remove: list[Device] = []
    for i, node in enumerate(event.remove):
        on_node = _devices_on(membership, node)
        if not on_node:
            raise _unknown_node(event, f"$.remove[{i}]", node, membership)
        remove.extend(on_node)
    add: list[Device] = []
    for i, entry in enumerate(event.add):
        for j, device in enumerate(entry.as_devices()):
            if device in current:
                raise MessageError(
                    "ScaleRequest",
                    f"$.add[{i}].devices[{j}]",
                    f"device {device} already runs a worker of job {event.job_id!r}",
                )
            add.append(device)
    if event.target_devices is not None and event.target_devices == len(current):
        raise MessageError(
            "ScaleRequest",
            "$.target_devices",
            f"job {event.job_id!r} already runs on {len(current)} devices",
        )
    gone = set(remove)
    return _build(
        event,
        trigger=TriggerKind.SCALE_REQUEST,
        generation=membership.generation,
        reason=event.reason,
        keep=tuple(w.device for w in membership.workers if w.device not in gone),
        remove=tuple(remove),
        add=tuple(add),
        target_devices=event.target_devices,
    )


def _unknown_node(event: IngestEvent, path: str, node: str, membership: JobMembership) -> MessageError:
    return MessageError(
        type(event).__name__,
        path,
        f"node {node!r} runs no worker of job {event.job_id!r} (generation {membership.generation})",
    )


def _build(event: IngestEvent, **fields: object) -> ResizeRequested:
    try:
        return ResizeRequested(job_id=event.job_id, event_id=event.event_id, **fields)  # type: ignore[arg-type]
    except ValueError as exc:
        # The message's own cross-field checks: with a consistent membership they cannot fail, so a
        # failure here says the event and the membership disagree in a way the checks above missed.
        raise MessageError(type(event).__name__, "$", f"cannot form a resize request: {exc}") from None
