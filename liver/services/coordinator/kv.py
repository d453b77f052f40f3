"""The job's generation record in the ``liver-generations`` bucket: read, compare-and-set, watch.

Every outcome the core can be told about a write is decided here, from what JetStream answered:

* the write landed: :class:`RecordWritten` with the key's new revision;
* the key was at another revision (or, for a create, existed): :class:`RecordConflict` with what the
  key holds now, read right after the failed write, so the core can tell its own write that landed
  unseen (same value, same writer) from another coordinator's;
* anything else (a timeout, a lost connection): :class:`RecordWriteFailed`, because the write may or
  may not have landed; the core retries the same compare-and-set, which then lands or conflicts.

Revisions are the bucket stream's sequence numbers: they only grow, which is all the core assumes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final, NamedTuple

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from liver.services import bus as b
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode
from liver.shared.errors import BusError

from .actions import WriteRecord
from .events import RecordConflict, RecordObserved, RecordWriteFailed, RecordWritten
from .record import GenerationRecord

log = structlog.get_logger(__name__)

HISTORY: Final = 5
"""Revisions kept per key: the last few records help an operator reconstruct a handoff."""

BUS_FAILURES: Final = (TimeoutError, nats.errors.Error, nats.js.errors.Error)


class RecordUnreadable(BusError):
    """The stored record does not decode: no coordinator may guess what it said."""


class Stored(NamedTuple):
    record: GenerationRecord
    revision: int


class RecordStore:
    """One job's key in the generations bucket."""

    def __init__(self, kv: KeyValue, job_id: str) -> None:
        self.kv = kv
        self.job_id = s.validate_token(job_id, "job_id")

    @classmethod
    async def open(cls, js: JetStreamContext, job_id: str, *, replicas: int = 1) -> RecordStore:
        kv = await b.ensure_kv(
            js,
            s.KV_GENERATIONS,
            description="Each job's generation record, by job id; commit is a compare-and-set on it.",
            history=HISTORY,
            replicas=replicas,
        )
        return cls(kv, job_id)

    def _decode(self, data: bytes | None, revision: int | None) -> GenerationRecord:
        try:
            record = decode(data or b"", GenerationRecord)
        except MessageError as exc:
            raise RecordUnreadable(f"record of job {self.job_id!r} at revision {revision}: {exc}") from None
        if record.job_id != self.job_id:
            raise RecordUnreadable(f"the record under key {self.job_id!r} is for job {record.job_id!r}")
        return record

    async def read(self) -> Stored | None:
        """The record and its revision; ``None`` when the job has none (or it was deleted)."""
        try:
            entry = await self.kv.get(self.job_id)
        except nats.js.errors.KeyNotFoundError:
            return None
        assert entry.revision is not None
        return Stored(self._decode(entry.value, entry.revision), entry.revision)

    async def write(self, action: WriteRecord) -> RecordWritten | RecordConflict | RecordWriteFailed:
        """Carry out one compare-and-set (``expected_revision`` 0: create) and say how it ended."""
        data = encode(action.record)
        try:
            if action.expected_revision == 0:
                revision = await self.kv.create(self.job_id, data)
            else:
                revision = await self.kv.update(self.job_id, data, last=action.expected_revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return await self._conflict(action.expected_revision)
        except BUS_FAILURES as exc:
            return RecordWriteFailed(error=repr(exc)[:500])
        return RecordWritten(revision=revision)

    async def _conflict(self, expected: int) -> RecordConflict | RecordWriteFailed:
        try:
            entry = await self.kv.get(self.job_id)
        except nats.js.errors.KeyNotFoundError as exc:
            deleted = getattr(exc, "entry", None)
            revision = getattr(deleted, "revision", None) or 0
            return RecordConflict(stored=None, revision=revision)
        except BUS_FAILURES as exc:
            return RecordWriteFailed(error=f"conflict at revision {expected}, then the read failed: {exc!r}")
        assert entry.revision is not None
        try:
            stored = self._decode(entry.value, entry.revision)
        except RecordUnreadable as exc:
            log.error("record_unreadable", error=str(exc), revision=entry.revision)
            return RecordConflict(stored=None, revision=entry.revision)
        return RecordConflict(stored=stored, revision=entry.revision)

    async def watch(self) -> AsyncIterator[RecordObserved]:
        """Every later value of the key (the current one first), as the core's ``RecordObserved``.

        Deletions and values that do not decode are logged and skipped: neither tells the core who
        owns the job.
        """
        watcher = await self.kv.watch(self.job_id)
        try:
            async for entry in watcher:
                if entry is None:
                    continue  # "caught up" marker
                if entry.operation in (KV_DEL, KV_PURGE):
                    log.warning("record_deleted", revision=entry.revision)
                    continue
                try:
                    record = self._decode(entry.value, entry.revision)
                except RecordUnreadable as exc:
                    log.error("record_unreadable", error=str(exc), revision=entry.revision)
                    continue
                assert entry.revision is not None
                yield RecordObserved(record=record, revision=entry.revision)
        finally:
            await watcher.stop()
