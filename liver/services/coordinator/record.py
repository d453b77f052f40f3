"""The job's generation record: the value stored under the job id in the ``liver-generations`` bucket.

It is the single source of truth for which generation is live and which handoff is under way, and every
change to it is a compare-and-set on the key's revision. That is what makes the outcome of a handoff
unique: committing and aborting generation ``g`` are both writes from the same revision (the one that
holds ``g`` as pending), so however many coordinators race, and whatever crashes in between, at most
one of the two lands, once.

What is stored, and why:

* the live world (``generation``, ``layout``, ``placement``) and whether it is ``live`` at all (a
  checkpoint fallback takes the job off the live path until its restarted world reports);
* ``issued``, the highest generation id ever handed out, so a restarted coordinator never reuses one
  (an aborted attempt burns its id: acks that quote it stay recognisably stale);
* the ``pending`` handoff: its triggers (re-planned if a restart finds it before the switch), its
  deadline, and from the switch intent on its target world and participants (a restart resumes it);
* ``writer``, the coordinator instance that made the change, so that equal values from two
  coordinators are never mistaken for one another;
* ``last_outcome``, the exact ``generation.committed``/``generation.aborted`` message, written in the
  same compare-and-set as the outcome itself and re-published after a restart (JetStream drops the copy
  by its message id), so an outcome is never lost between the write and the publish.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Final

from msgspec import Meta

from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement, check_placement
from liver.shared.messages import (
    Bytes,
    Count,
    EventId,
    Generation,
    GenerationAborted,
    GenerationCommitted,
    JobId,
    Message,
    Part,
    ResizeRequested,
    Timestamp,
    Token,
    WorkerId,
    WorldStarted,
)


class TriggerSource(StrEnum):
    """Why the coordinator changes the world: a bus event (:class:`TriggerKind`) or a lost worker."""

    SPOT_WARNING = "spot_warning"
    SCALE_REQUEST = "scale_request"
    REBALANCE = "rebalance"
    WORKER_LOST = "worker_lost"


MAX_SETTLED_IN_RECORD: Final = 4096
"""The most settled events a record may hold (a coordinator keeps fewer: ``record_settled_events``)."""


class SettleOutcome(StrEnum):
    """How the trigger events of a settle ended (logged with the acknowledgement, kept in the record)."""

    COMMITTED = "committed"
    ABORTED = "aborted"
    CHECKPOINT_FALLBACK = "checkpoint_fallback"
    NO_CHANGE = "no_change"
    ENDED_BEFORE = "ended_before"
    """The event's handoff had already ended before this coordinator held the event."""


class SettledEvent(Part):
    """A published event the job is done with, and how: what a coordinator needs to recognise a
    redelivered copy (its acknowledgement may have been lost with the coordinator that settled it)."""

    event_id: EventId
    outcome: SettleOutcome
    generation: Generation | None = None
    """The generation whose outcome names the event (None: it changed nothing)."""


class PendingPhase(StrEnum):
    """``prepare``: nothing has touched the active world, a restart aborts (and re-plans) the handoff;
    ``switch``: the switch command may have gone out, a restart resumes it."""

    PREPARE = "prepare"
    SWITCH = "switch"


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def _invalid(field: str, reason: str) -> ValueError:
    """Same form as the bus messages' checks, so the codec names the field."""
    return ValueError(f"`{field}`: {reason}")


def lost_event_id(device: Device) -> str:
    """Event id of the internal trigger a lost device raises: token-safe, one per device."""
    return ("lost-" + _UNSAFE.sub("_", f"{device.node}-{device.index}"))[:128]


class Trigger(Part):
    """One reason to change the world, reduced to what the coordinator needs to plan and time it.

    ``remove`` devices leave (alive until ``deadline`` for a spot warning, already gone for
    ``worker_lost``), ``add`` devices are offered, ``target_devices`` asks for a size.
    """

    event_id: EventId
    kind: TriggerSource
    received_at: Timestamp
    remove: tuple[Device, ...] = ()
    add: tuple[Device, ...] = ()
    target_devices: Count | None = None
    deadline: Timestamp | None = None

    @classmethod
    def from_request(cls, request: ResizeRequested, now: datetime) -> Trigger:
        return cls(
            event_id=request.event_id,
            kind=TriggerSource(request.trigger),
            received_at=now,
            remove=request.remove,
            add=request.add,
            target_devices=request.target_devices,
            deadline=request.deadline,
        )

    @classmethod
    def lost(cls, device: Device, now: datetime) -> Trigger:
        return cls(
            event_id=lost_event_id(device), kind=TriggerSource.WORKER_LOST, received_at=now, remove=(device,)
        )


def bus_event_ids(triggers: Iterable[Trigger]) -> tuple[str, ...]:
    """The ids of the published events among ``triggers``, in order, once each (a lost worker is a
    trigger but no event anybody published)."""
    return tuple(dict.fromkeys(t.event_id for t in triggers if t.kind != TriggerSource.WORKER_LOST))


def removed_devices(triggers: Iterable[Trigger]) -> set[Device]:
    """Every device the triggers take out of the world (announced to leave or lost)."""
    return {d for t in triggers for d in t.remove}


def lost_devices(triggers: Iterable[Trigger]) -> set[Device]:
    """The devices whose worker the triggers report lost."""
    return {d for t in triggers if t.kind == TriggerSource.WORKER_LOST for d in t.remove}


class Participant(Part):
    """A worker that takes part in a handoff: a rank of the old world, the new world, or both."""

    worker_id: WorkerId
    device: Device


class PendingHandoff(Part):
    """The handoff under way, as much of it as a restarted coordinator needs."""

    generation: Generation
    phase: PendingPhase
    event_id: EventId
    """The first trigger's id: the one ``generation.committed``/``aborted`` quote."""
    triggers: Annotated[tuple[Trigger, ...], Meta(min_length=1)]
    began_at: Timestamp
    deadline: Timestamp
    """The hard deadline: every participant has switched by then, or the handoff falls back."""
    layout: ParallelLayout | None = None
    placement: Placement | None = None
    participants: tuple[Participant, ...] = ()
    bytes_planned: Bytes | None = None

    def __post_init__(self) -> None:
        if self.phase == PendingPhase.SWITCH:
            if self.layout is None or self.placement is None:
                raise _invalid("placement", "a handoff in its switch phase must name its target world")
            if not self.participants:
                raise _invalid("participants", "a handoff in its switch phase must name its participants")
        if (self.layout is None) != (self.placement is None):
            raise _invalid("placement", "layout and placement are given together or not at all")
        if self.layout is not None and self.placement is not None:
            try:
                check_placement(self.layout, self.placement)
            except LayoutError as exc:
                raise _invalid("placement", str(exc)) from None
        workers = [p.worker_id for p in self.participants]
        if len(set(workers)) != len(workers):
            raise _invalid("participants", "a worker is listed twice")
        devices = [p.device for p in self.participants]
        if len(set(devices)) != len(devices):
            raise _invalid("participants", "a device is listed twice")


class GenerationRecord(Message, kw_only=True, tag="generation_record"):
    """The value of the job's key in the generations bucket (encode/decode with ``shared.codec``)."""

    job_id: JobId
    writer: Token
    """The coordinator instance that wrote this value: two coordinators can compute the very same
    record, and a coordinator checking whether its own write landed must not take the other's for it."""
    generation: Generation
    layout: ParallelLayout
    placement: Placement
    issued: Generation
    live: bool = True
    pending: PendingHandoff | None = None
    last_outcome: GenerationCommitted | GenerationAborted | None = None
    geometry: ModelGeometry | None = None
    """The job's model geometry from its ``WorldStarted`` (kept across generations and fallbacks); every
    topology request carries it."""
    peer_copies: bool = True
    """Whether the job keeps peer copies, from its latest ``WorldStarted``; every topology request
    carries it."""
    settled: Annotated[tuple[SettledEvent, ...], Meta(max_length=MAX_SETTLED_IN_RECORD)] = ()
    """The latest events settled, oldest first: written in the same compare-and-set as the outcome that
    settles them, so that no coordinator, however many restarts later, runs an event twice."""

    def _validate(self) -> None:
        try:
            check_placement(self.layout, self.placement)
        except LayoutError as exc:
            raise _invalid("placement", str(exc)) from None
        if self.issued < self.generation:
            raise _invalid("issued", f"{self.issued} is below the live generation {self.generation}")
        if self.pending is not None:
            if self.pending.generation != self.issued:
                raise _invalid(
                    "pending.generation",
                    f"{self.pending.generation} is not the last issued generation {self.issued}",
                )
            if self.pending.generation <= self.generation:
                raise _invalid("pending.generation", f"must be after the live generation {self.generation}")
            if not self.live:
                raise _invalid("pending", "no handoff can be pending while the job is not live")
        if self.last_outcome is not None and self.last_outcome.job_id != self.job_id:
            raise _invalid("last_outcome.job_id", f"{self.last_outcome.job_id!r} is not {self.job_id!r}")

    @property
    def devices(self) -> frozenset[Device]:
        return frozenset(self.placement.devices)


def world_record(
    job_id: str, event: WorldStarted, previous: GenerationRecord | None, writer: str
) -> GenerationRecord:
    """The record of a world the launcher reports live: it starts at the world's generation and carries
    over what outlives a world (the last outcome, the model geometry when the report has none, the
    settled events)."""
    return GenerationRecord(
        job_id=job_id,
        writer=writer,
        generation=event.generation,
        layout=event.layout,
        placement=event.placement,
        issued=event.generation,
        last_outcome=None if previous is None else previous.last_outcome,
        geometry=event.geometry or (None if previous is None else previous.geometry),
        peer_copies=event.peer_copies,
        settled=() if previous is None else previous.settled,
    )
