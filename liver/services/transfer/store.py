"""Where the transfer planner writes a plan: the plan file and oversized slices as objects, every other
slice as one key-value entry.

Writing a thousand-device job's slices dominated the transfer stage once planning got fast: an
object-store put is several round trips (a metadata lookup, the chunk, the metadata, with digests),
about 0.5 ms each even in flight together, while a key-value put is one publish. So a slice that fits
comfortably in one message (:func:`kv_limit`) is an entry of ``liver-slices``; only a bigger one is an
object of ``liver-plans``. The resulting :class:`~liver.shared.messages.SliceIndex` lists the few
slices stored as objects, so a worker reads its slice with one request wherever it is.

Entries are published pipelined (:meth:`JetStreamContext.publish_async`), their acknowledgements
awaited together, at most :data:`PUT_WINDOW` in flight: JetStream acknowledges each one once stored, so
the ``TransferPlanned`` that follows never names a slice that is not there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final

from nats.js import JetStreamContext, api
from nats.js.object_store import ObjectStore

from liver.shared.messages import ObjectRef, SliceIndex

KV_SLICE_MAX_BYTES: Final = 512 * 1024
"""The largest slice stored as a key-value entry, unless half the server's ``max_payload`` is smaller:
well under the 1 MiB default, so that an entry never meets the message limit."""

PUT_WINDOW: Final = 256
"""Key-value puts whose acknowledgement may be outstanding at once."""

OBJECT_CONCURRENCY: Final = 32
"""Object-store puts in flight at once (each is several requests)."""


def kv_limit(max_payload: int | None, configured: int = KV_SLICE_MAX_BYTES) -> int:
    """The largest slice to store as an entry: ``configured``, or half of ``max_payload`` when the
    connection reports a smaller one (``0`` or ``None``: not known, ``configured`` holds)."""
    if configured < 0:
        raise ValueError(f"`configured`: must be >= 0, got {configured}")
    if max_payload:
        return min(configured, max_payload // 2)
    return configured


class PlanWriter:
    """Stores one plan: its file as an object, its slices as entries or objects by size."""

    def __init__(
        self,
        js: JetStreamContext,
        objects: ObjectStore,
        *,
        object_bucket: str,
        kv_bucket: str,
        kv_max_bytes: int,
        timeout_s: float = 30.0,
    ) -> None:
        self._js = js
        self._objects = objects
        self._object_bucket = object_bucket
        self._kv_bucket = kv_bucket
        self._kv_stream = f"KV_{kv_bucket}"
        self._kv_max_bytes = kv_max_bytes
        self._timeout_s = timeout_s

    async def put_object(self, name: str, data: bytes) -> ObjectRef:
        info = await self._objects.put(name, data)
        return ObjectRef(bucket=self._object_bucket, name=name, size=len(data), digest=info.digest)

    async def put_slices(
        self, prefix: str, files: Sequence[bytes]
    ) -> tuple[SliceIndex, tuple[ObjectRef, ...]]:
        """Store slice ``i`` (``files[i]``) where the returned index says it is; a reference per slice
        (its location and size) in the same order."""
        large = tuple(i for i, data in enumerate(files) if len(data) > self._kv_max_bytes)
        index = SliceIndex(
            bucket=self._object_bucket,
            prefix=prefix,
            count=len(files),
            kv_bucket=self._kv_bucket,
            objects=large,
        )
        refs: list[ObjectRef | None] = [None] * len(files)
        await asyncio.gather(self._put_entries(index, files, refs), self._put_objects(index, files, refs))
        done = tuple(r for r in refs if r is not None)
        assert len(done) == len(files)
        return index, done

    async def _put_entries(
        self, index: SliceIndex, files: Sequence[bytes], refs: list[ObjectRef | None]
    ) -> None:
        window = asyncio.Semaphore(PUT_WINDOW)
        pending: list[tuple[str, asyncio.Future[api.PubAck]]] = []
        subject = f"$KV.{self._kv_bucket}."
        try:
            for i, data in enumerate(files):
                if index.in_objects(i):
                    continue
                key = index.key(i)
                await window.acquire()
                ack = await self._js.publish_async(subject + key, data)
                ack.add_done_callback(lambda _: window.release())
                pending.append((key, ack))
                refs[i] = ObjectRef(bucket=self._kv_bucket, name=key, size=len(data))
            acks = await asyncio.wait_for(asyncio.gather(*(a for _, a in pending)), self._timeout_s)
        except TimeoutError:
            waiting = [key for key, a in pending if not a.done()]
            raise TimeoutError(
                f"{len(waiting)} of {len(pending)} slice entries of {self._kv_bucket} not acknowledged "
                f"within {self._timeout_s:g} s (the first: {waiting[0] if waiting else '?'})"
            ) from None
        finally:
            for _, a in pending:
                a.cancel()  # a no-op for those acknowledged; frees the rest's place in the client
        for (key, _), ack in zip(pending, acks, strict=True):
            stream = ack.stream
            if stream != self._kv_stream:
                raise RuntimeError(f"slice entry {key} was stored in {stream!r}, not {self._kv_stream}")

    async def _put_objects(
        self, index: SliceIndex, files: Sequence[bytes], refs: list[ObjectRef | None]
    ) -> None:
        large = index.objects
        for start in range(0, len(large), OBJECT_CONCURRENCY):
            batch = large[start : start + OBJECT_CONCURRENCY]
            put = await asyncio.gather(*(self.put_object(index.name(i), files[i]) for i in batch))
            for i, ref in zip(batch, put, strict=True):
                refs[i] = ref
