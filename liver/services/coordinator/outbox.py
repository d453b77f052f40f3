"""What one input produces: the actions, in the order the parts of the core decided them.

The core reads no clock and does no I/O: each input (an event, or ``restore``) yields one list of actions
that the adapter carries out in order. Every part of the core (the machine, the trigger queue, the record
writer, liveness) adds to that list through one :class:`Outbox`, so its order is the order of the
decisions, and every note names the job and, during a handoff, its generation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from liver.shared.messages import GenerationAborted, GenerationCommitted
from liver.shared.subjects import generation_msg_id

from .actions import Action, Note, NoteLevel, Publish, Settle, SettleOutcome
from .record import Trigger, bus_event_ids

if TYPE_CHECKING:
    from .handoff import Handoff


class Outbox:
    """The actions of the input being handled."""

    def __init__(self, job_id: str, generation: Callable[[], int | None]) -> None:
        """``generation``: the pending handoff's generation, if any (notes carry it)."""
        self._job_id = job_id
        self._generation = generation
        self._actions: list[Action] = []

    def open(self) -> None:
        """Start the actions of a new input (whatever an input that raised left is dropped)."""
        self._actions = []

    def close(self) -> list[Action]:
        """The input's actions, in order; the outbox is empty after."""
        actions, self._actions = self._actions, []
        return actions

    def emit(self, action: Action) -> None:
        self._actions.append(action)

    def note(self, level: NoteLevel, event: str, **fields: object) -> None:
        """Log ``event`` (a structlog event name) with ``fields``, the job's id and the handoff's
        generation."""
        fields.setdefault("job_id", self._job_id)
        generation = self._generation()
        if generation is not None:
            fields.setdefault("generation", generation)
        self.emit(Note(level=level, event=event, fields=dict(fields)))

    def publish(
        self, message: GenerationCommitted | GenerationAborted, handoff: Handoff | None = None
    ) -> None:
        """Publish an outcome under its generation's message id (a copy sent again is dropped);
        ``handoff``: the one it ends, for the metrics."""
        self.emit(
            Publish(
                message=message,
                msg_id=generation_msg_id(self._job_id, message.generation),
                trigger=handoff.triggers[0].kind if handoff is not None else None,
                began_at=handoff.began_at if handoff is not None else None,
            )
        )

    def settle(self, triggers: Iterable[Trigger], outcome: SettleOutcome, generation: int | None) -> None:
        """Acknowledge the bus events among ``triggers`` (a lost worker is no bus event); the record
        holds their settlement already (:meth:`.writer.RecordWriter.carry`)."""
        ids = bus_event_ids(triggers)
        if ids:
            self.emit(Settle(event_ids=ids, outcome=outcome, generation=generation))
