"""What the coordinator's core asks its adapter to do, in the order the list gives.

The core never touches the bus or the clock; every effect is one of these. The adapter carries them out
in order and reports back the ones that have a result (a key-value write answers with
``RecordWritten``, ``RecordConflict`` or ``RecordWriteFailed``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, Protocol

import msgspec

from liver.shared.layout import Device
from liver.shared.messages import (
    Abort,
    Generation,
    GenerationAborted,
    GenerationCommitted,
    JobMembership,
    Prepare,
    Switch,
    TopologyPlanned,
    TopologyRequest,
)

from .record import GenerationRecord, SettleOutcome, TriggerSource


class Action(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every action."""


class WriteRecord(Action):
    """Compare-and-set the job's record: ``expected_revision`` 0 means "create, the key must not exist"."""

    record: GenerationRecord
    expected_revision: int


class RequestTopology(Action):
    request: TopologyRequest


class ExpectTransfer(Action):
    """The core now waits for the transfer plan of this topology. Nothing needs sending: the transfer
    planner reads planned topologies from their stream itself, and the core ignores any plan whose
    target it dropped. An adapter without such a planner would plan it here."""

    topology: TopologyPlanned


class SendCommand(Action):
    """A command to one worker (``worker_id``) or to every worker of the job (``None``)."""

    command: Prepare | Switch | Abort
    worker_id: str | None = None


class Publish(Action):
    """Publish an outcome on its public subject with ``Nats-Msg-Id`` = ``msg_id`` (retries are dropped)."""

    message: GenerationCommitted | GenerationAborted
    msg_id: str
    trigger: TriggerSource | None = None
    """The first trigger's kind, for the metrics; None for a restored outcome."""
    began_at: datetime | None = None
    """When the handoff began, for the metrics; None for a restored outcome."""


class ProbeWorkers(Action):
    """Ask each worker directly whether its process is still there (a survivor said its world lost a
    peer, or a member went silent): the adapter answers with :class:`~.events.WorkersProbed`."""

    probe: int
    """Names the probe: its answer carries it back."""
    generation: Generation
    worker_ids: tuple[str, ...]
    timeout_s: float
    devices: tuple[Device, ...] = ()
    """Devices to ask by place, not by name: awaited since a restart, their worker named nowhere."""


class WriteMembership(Action):
    """Put the job's membership record (who runs the live world, on which device) for the ingester.

    Only the coordinator in charge emits it, and each value is complete, so a plain put will do."""

    record: JobMembership


class ReleasePlan(Action):
    """The plan of ``generation`` is no longer needed: delete ``objects`` (the plan file and the slices
    stored as objects, named by ``TransferPlanned``) from ``bucket``, and the entries of ``kv_bucket``
    whose keys match ``kv_keys`` (the plan's other slices: one pattern, see
    ``SliceIndex.kv_keys_pattern``). For a handoff resumed after a restart the names are not known:
    ``objects`` is empty (they expire with the store's TTL) and ``kv_keys`` covers the generation's
    whole key prefix (``subjects.slice_keys_of_generation``)."""

    generation: Generation
    bucket: str = ""
    objects: tuple[str, ...] = ()
    kv_bucket: str = ""
    kv_keys: str = ""


class Settle(Action):
    """These trigger events are done with: acknowledge them on their stream.

    An event is settled only once the record says how it ended, so a restarted coordinator gets every
    unsettled event again from its durable consumer.
    """

    event_ids: tuple[str, ...]
    outcome: SettleOutcome
    generation: Generation | None = None


NoteLevel = Literal["debug", "info", "warning", "error"]


class Note(Action):
    """Log this (``event`` is the structlog event name): transitions, ignored input and why."""

    level: NoteLevel
    event: str
    fields: dict[str, Any] = {}


class NoteFn(Protocol):
    """How the core's parts log: ``note(level, event, **fields)`` adds a :class:`Note` to the actions."""

    def __call__(self, level: NoteLevel, event: str, /, **fields: object) -> None: ...
