"""The write cycle of the job's record: one compare-and-set in flight at a time, and what its result
means.

Every step of a handoff that others can observe is preceded by a compare-and-set on the job's record
(:mod:`.record`). Writes are serialised: while one is in flight, a decision to stop the handoff is
deferred to its result (:meth:`RecordWriter.defer`), so the record never has two writers inside one
coordinator. A write that finds a record this coordinator did not write, or a watch that shows one,
means another coordinator owns the job now: this one adopts what it stored and stands down.

:class:`RecordWriter` owns the record as last written or adopted, its revision, the write in flight,
the settlements the next write carries and the deferred stop. It reports a landed write and a stand-down
through the two callbacks it is given; what they mean for the phases is the core's business.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from msgspec.structs import replace

from .actions import SettleOutcome, WriteRecord
from .events import RecordConflict, RecordObserved
from .handoff import HandoffStop
from .outbox import Outbox
from .record import GenerationRecord, SettledEvent, Trigger, bus_event_ids

StandDownFn = Callable[[GenerationRecord | None, int, str], None]
"""``stood_down(stored, revision, why)``: another coordinator's record was found (``stored`` is None
when the key was deleted)."""


class RecordWriter:
    """The job's record as this coordinator knows it, and the compare-and-set that changes it."""

    def __init__(
        self,
        job_id: str,
        instance_id: str,
        keep_settled: int,
        outbox: Outbox,
        *,
        landed: Callable[[], None],
        stood_down: StandDownFn,
    ) -> None:
        self._job_id = job_id
        self._instance_id = instance_id
        self._keep_settled = keep_settled
        self._emit = outbox.emit
        self._note = outbox.note
        self._landed = landed
        self._stood_down = stood_down
        self._record: GenerationRecord | None = None
        self._revision = 0
        self._in_flight: GenerationRecord | None = None
        self._unwritten_settlements: list[SettledEvent] = []
        """Settlements the next record write carries (an event is acknowledged only after that)."""
        self._deferred_stop: HandoffStop | None = None

    @property
    def record(self) -> GenerationRecord | None:
        """The record as this coordinator last wrote or adopted it."""
        return self._record

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def busy(self) -> bool:
        """A write is in flight: its result comes before any other write."""
        return self._in_flight is not None

    def restore(self, record: GenerationRecord, revision: int) -> None:
        """Take ``record`` over as read at ``revision`` (no write may be in flight)."""
        assert self._in_flight is None
        self._record, self._revision = record, revision
        self._deferred_stop = None
        self._unwritten_settlements = []

    # -- writing ---------------------------------------------------------------------------------------

    def carry(self, triggers: Iterable[Trigger], outcome: SettleOutcome, generation: int) -> None:
        """Have the next write (the one that records the outcome) carry these settlements."""
        self._unwritten_settlements.extend(
            SettledEvent(event_id=i, outcome=outcome, generation=generation) for i in bus_event_ids(triggers)
        )

    def write(self, record: GenerationRecord) -> None:
        """Compare-and-set ``record`` from the current revision, with the settlements it carries."""
        if self._unwritten_settlements:
            settled = record.settled + tuple(self._unwritten_settlements)
            record = replace(record, settled=settled[-self._keep_settled :])
            self._unwritten_settlements = []
        record = replace(record, writer=self._instance_id)
        self._in_flight = record
        self._emit(WriteRecord(record=record, expected_revision=self._revision))

    def written(self, revision: int) -> None:
        """The write in flight landed at ``revision``."""
        if self._in_flight is None:
            self._note("warning", "unexpected_write_result", revision=revision)
            return
        self._record, self._revision, self._in_flight = self._in_flight, revision, None
        self._landed()

    def conflict(self, event: RecordConflict) -> None:
        """The key was at another revision: the write landed after all (its answer was lost), or
        another coordinator wrote."""
        if self._in_flight is None:
            self._note("warning", "unexpected_write_result", revision=event.revision)
            return
        if event.stored is not None and event.stored == self._in_flight:
            self._note("info", "write_found_landed", revision=event.revision)
            self.written(event.revision)
            return
        self.stand_down(event.stored, event.revision, "the record changed under a compare-and-set")

    def failed(self, error: str, waiting_for: str) -> None:
        """The write's outcome is unknown: send the same write again."""
        if self._in_flight is None:
            self._note("warning", "unexpected_write_result", error=error)
            return
        self._note("warning", "record_write_retried", error=error, wait=waiting_for)
        self._emit(WriteRecord(record=self._in_flight, expected_revision=self._revision))

    def observed(self, event: RecordObserved, *, standing_by: bool) -> None:
        """The key changed under a watch: ours, or another coordinator's (``standing_by``: follow it)."""
        if event.record.job_id != self._job_id:
            self._note("warning", "input_rejected", input="record", field="job_id", reason="another job")
            return
        if event.revision <= self._revision:
            return
        if standing_by:
            self._record, self._revision = event.record, event.revision
            return
        if self._in_flight is not None and event.record == self._in_flight:
            return
        self.stand_down(event.record, event.revision, "another coordinator wrote the record")

    def stand_down(self, stored: GenerationRecord | None, revision: int, why: str) -> None:
        """Someone else owns the job now: drop the write in flight and adopt what they stored."""
        self._in_flight, self._deferred_stop = None, None
        if stored is not None:
            self._record, self._revision = stored, revision
        self._stood_down(stored, revision, why)

    # -- stops that wait for the write -----------------------------------------------------------------

    @property
    def deferred_stop(self) -> HandoffStop | None:
        """A stop decided while a write was in flight, carried out on its result."""
        return self._deferred_stop

    def defer(self, stop: HandoffStop) -> None:
        """Keep ``stop`` for the write's result, merged with one kept already (the stronger wins)."""
        current = self._deferred_stop
        self._deferred_stop = stop if current is None else current.merge(stop)

    def take_deferred_stop(self) -> HandoffStop | None:
        stop, self._deferred_stop = self._deferred_stop, None
        return stop

    def drop_deferred_stop(self) -> None:
        self._deferred_stop = None
