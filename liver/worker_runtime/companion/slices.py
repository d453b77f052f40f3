"""A worker's part of a transfer plan: found from the job-wide ``Prepare``, fetched from the key-value
bucket or the object store, checked, turned into a ``Plan``.

The Prepare carries both worlds once for the whole job; :func:`view_of` derives from it, once per
message (a simulated job hands the same Prepare to a thousand workers), whether a device takes part and
the name of its slice. The slice (a :class:`~liver.reshard.plan.SliceFile`: tasks without the worlds)
comes from another process through storage, and the executor trusts it: a task that names a rank
outside the world, a box outside its tensor or a byte count that disagrees with its boxes would make
the handoff send the wrong bytes or wait for bytes that never come. So the slice is decoded strictly and
checked against the Prepare and against this worker's device before anything is built from it; every
failure is a :class:`~liver.shared.codec.MessageError` whose path names the field.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, NamedTuple

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TYPE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
)

from liver.reshard.plan import SLICE_SCHEMA_VERSION, Plan, SliceFile, WorldConfig, slice_participants
from liver.shared.codec import MessageError
from liver.shared.errors import BusError
from liver.shared.layout import Device, LayoutError
from liver.shared.messages import ObjectRef, Prepare, SliceLocation
from liver.shared.outage import is_outage

EXPECTED: Final = "SliceFile"
_DECODER: Final = msgspec.json.Decoder(SliceFile)
_VIEWS_KEPT: Final = 4
_AT = re.compile(r"^(?P<reason>.*) - at `(?P<path>\$[^`]*)`$", re.S)


KV_OPERATION: Final = "KV-Operation"
"""The header of a key-value delete or purge marker (``DEL`` / ``PURGE``): the key has no value."""

MISSING_RETRY_S: Final = (0.02, 0.05, 0.1, 0.2, 0.5)
"""Pauses between reads of a key-value entry that is not there yet (then the last one, repeatedly)."""

REQUEST_TIMEOUT_S: Final = 5.0
"""Each request of a read waits this long for its reply (the read as a whole waits its own
``fetch_timeout_s``): a request lost in a server restart is sent again instead of eating the whole
read's time."""

OUTAGE_RETRY_S: Final = (0.1, 0.2, 0.5, 1.0)
"""Pauses before a read is tried again after the bus could not be reached (then the last one)."""


def fetch_context(nc: Client) -> JetStreamContext:
    """The JetStream context a :class:`PlanFetcher` reads with (requests of ``REQUEST_TIMEOUT_S``)."""
    return nc.jetstream(timeout=REQUEST_TIMEOUT_S)


class PlanFetchError(BusError):
    """The slice could not be read (missing entry or object, digest or size mismatch, bus failure or
    timeout)."""


class _Progress:
    """Which request a read is waiting for, so that a timeout can say where it stopped."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.step = "the stream's configuration"
        self.misses = 0
        """Reads that found no entry yet."""
        self.outages = 0
        """Reads tried again because the bus could not be reached (a request lost, no responders)."""

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


class PlanFetcher:
    """Reads plan slices for one connection with single-message reads instead of the client's ``get``.

    A slice in the key-value bucket (:meth:`fetch_entry`, the common case) is one direct get of the
    key's last message. An entry that is not there is read again after a short pause until the read's
    time runs out (with direct gets a replica may answer before it has the entry), and the error then
    names the key; a delete marker (the plan was released) fails at once.

    The client's object-store ``get`` creates an ordered consumer per read. When a thousand workers read
    their slices at the same moment that is a thousand consumers created and deleted on the plan
    stream: the server refuses some ("maximum consumers limit reached") and the rest take seconds. A
    slice is one or a few chunks, so this reads the object's metadata and then each chunk by subject
    and sequence, one request each and no consumer; with the stream's direct get (object stores allow
    it) those requests bypass the JetStream API queue, which a thousand readers would otherwise fill.
    The digest is checked here, as ``get`` does.

    Two limits apply: the whole read's ``timeout_s``, and each request's own (the JetStream context's,
    5 s by default in nats-py); errors say which one ran out, at which step, after how long.
    """

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._direct: dict[str, bool] = {}

    async def fetch_slice(self, where: SliceLocation, timeout_s: float) -> bytes:
        """The slice's bytes from the store that holds it (``SliceIndex.location``)."""
        if where.store == "kv":
            return await self.fetch_entry(where.bucket, where.name, timeout_s)
        return await self.fetch_object(where.bucket, where.name, timeout_s)

    async def fetch_entry(self, bucket: str, key: str, timeout_s: float) -> bytes:
        """The value of ``key`` in key-value bucket ``bucket``, waiting up to ``timeout_s`` for it to
        appear."""
        where = f"key-value entry {bucket}/{key}"
        progress = _Progress()
        read = _through_outages(lambda: self._entry(bucket, key, progress), progress)
        return await _read(where, read, timeout_s, progress, "the bucket does not exist")

    async def _entry(self, bucket: str, key: str, progress: _Progress) -> bytes:
        stream = f"KV_{bucket}"
        direct = await self._allows_direct(stream)
        subject = f"$KV.{bucket}.{key}"
        while True:
            progress.step = "the entry" if not progress.misses else f"the entry (read {progress.misses + 1})"
            try:
                msg = await self._js.get_msg(stream, subject=subject, direct=direct)
            except nats.js.errors.NotFoundError:
                progress.misses += 1
                await asyncio.sleep(MISSING_RETRY_S[min(progress.misses, len(MISSING_RETRY_S)) - 1])
                continue
            operation = (msg.headers or {}).get(KV_OPERATION)
            if operation is not None:
                raise PlanFetchError(
                    f"key-value entry {bucket}/{key}: deleted ({operation}; the plan was released)"
                )
            if msg.subject is not None and msg.subject != subject:
                raise PlanFetchError(f"key-value entry {bucket}/{key}: the server returned {msg.subject}")
            return msg.data or b""

    async def _allows_direct(self, stream: str) -> bool:
        direct = self._direct.get(stream)
        if direct is None:
            config = (await self._js.stream_info(stream)).config
            direct = self._direct[stream] = bool(config.allow_direct)
        return direct

    async def fetch(self, ref: ObjectRef, timeout_s: float) -> bytes:
        """The object's bytes, checked against the reference's size and digest and the stored digest."""
        return await self.fetch_object(ref.bucket, ref.name, timeout_s, size=ref.size, digest=ref.digest)

    async def fetch_object(
        self,
        bucket: str,
        name: str,
        timeout_s: float,
        *,
        size: int | None = None,
        digest: str | None = None,
    ) -> bytes:
        """Object ``name`` of ``bucket``, checked against the stored digest (and ``size`` and ``digest``
        when the caller knows them)."""
        progress = _Progress()
        read = _through_outages(lambda: self._fetch(bucket, name, size, digest, progress), progress)
        return await _read(f"object {bucket}/{name}", read, timeout_s, progress, "no such object")

    async def _fetch(
        self, bucket: str, name: str, size: int | None, digest: str | None, progress: _Progress
    ) -> bytes:
        where = f"{bucket}/{name}"
        stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
        direct = await self._allows_direct(stream)
        key = base64.urlsafe_b64encode(name.encode()).decode()
        progress.step = "the object's metadata"
        meta = await self._js.get_msg(
            stream, subject=OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=key), direct=direct
        )
        try:
            info = api.ObjectInfo.from_response(json.loads(meta.data or b""))
        except (ValueError, TypeError, KeyError) as exc:
            raise PlanFetchError(f"{where}: unreadable object metadata ({exc})") from None
        if info.deleted:
            raise PlanFetchError(f"{where}: no such object (deleted)")
        if digest is not None and info.digest != digest:
            raise PlanFetchError(
                f"{where}: digest {info.digest} is not the {digest} the reference names (the object was "
                "replaced)"
            )
        if info.is_link():
            raise PlanFetchError(f"{where}: is a link; plans are stored as plain objects")
        if size is not None and (info.size or 0) != size:
            raise PlanFetchError(f"{where}: {info.size or 0} bytes stored, the reference says {size}")
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid)
        parts: list[bytes] = []
        seq = 0
        chunks = info.chunks or 0
        for k in range(chunks):
            progress.step = f"chunk {k + 1} of {chunks}"
            msg = await self._js.get_msg(stream, seq=seq + 1, subject=subject, next=True, direct=direct)
            parts.append(msg.data or b"")
            seq = msg.seq or seq + 1
        data = b"".join(parts)
        expected = info.size if size is None else size
        if expected is not None and len(data) != expected:
            raise PlanFetchError(f"{where}: read {len(data)} bytes, expected {expected}")
        actual = OBJ_DIGEST_TYPE + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
        if info.digest is not None and actual != info.digest:
            raise PlanFetchError(f"{where}: the bytes read hash to {actual}, the store says {info.digest}")
        return data


class PrepareView(NamedTuple):
    """What a worker derives from a job-wide Prepare (see :func:`view_of`)."""

    old: WorldConfig
    new: WorldConfig
    slice_of: dict[Device, int]
    """Each participant's slice index (devices in ``lost`` take no part and have none here)."""
    new_rank: dict[Device, int]

    def participates(self, device: Device) -> bool:
        return device in self.slice_of

    def slice_name(self, prepare: Prepare, device: Device) -> str:
        return prepare.slices.name(self.slice_of[device])

    def slice_location(self, prepare: Prepare, device: Device) -> SliceLocation:
        return prepare.slices.location(self.slice_of[device])


_views: OrderedDict[int, tuple[Prepare, PrepareView]] = OrderedDict()
_views_lock = threading.Lock()


def view_of(prepare: Prepare) -> PrepareView:
    """The two worlds, the participants' slice indices and the new ranks of ``prepare``.

    O(devices) to build, so it is built once per message object and shared: a simulated job hands one
    decoded Prepare to all of its workers, which would otherwise make a handoff O(devices^2).
    """
    key = id(prepare)
    with _views_lock:
        hit = _views.get(key)
        if hit is not None and hit[0] is prepare:
            return hit[1]
    old = WorldConfig(prepare.from_layout, prepare.from_placement)
    new = WorldConfig(prepare.layout, prepare.placement)
    slice_of = slice_participants(prepare.from_placement, prepare.placement, set(prepare.lost))
    view = PrepareView(old=old, new=new, slice_of=slice_of, new_rank=prepare.placement.rank_on())
    with _views_lock:
        _views[key] = (prepare, view)
        while len(_views) > _VIEWS_KEPT:
            _views.popitem(last=False)
    return view


def decode_slice(data: bytes, prepare: Prepare, device: Device) -> Plan:
    """The plan ``device`` executes for ``prepare``, from the slice's bytes; raises :class:`MessageError`."""
    try:
        piece = _DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _translate(exc) from None
    except RecursionError:
        raise MessageError("PlanSlice", "$", "malformed JSON: nested too deeply") from None
    check_slice(piece, prepare, device)
    view = view_of(prepare)
    return piece.with_worlds(view.old, view.new).to_plan()


def check_slice(piece: SliceFile, prepare: Prepare, device: Device) -> None:
    """Refuse a slice that is not this device's part of the plan ``prepare`` describes."""
    if piece.schema_version != SLICE_SCHEMA_VERSION:
        _fail("$.schema_version", f"expected {SLICE_SCHEMA_VERSION}, got {piece.schema_version}")
    if piece.generation != prepare.generation:
        _fail(
            "$.generation",
            f"the slice is for generation {piece.generation}, the Prepare for {prepare.generation}",
        )
    if piece.device != device:
        _fail("$.device", f"the slice is for {piece.device}, this worker runs on {device}")
    old_devices, new_devices = prepare.from_placement.devices, prepare.placement.devices
    if not view_of(prepare).participates(device):
        _fail("$.device", f"{device} takes no part in the handoff the Prepare describes")
    for layout in (prepare.from_layout, prepare.layout):
        try:
            piece.model.check_layout(layout)
        except LayoutError as exc:
            reason = f"model {piece.model.name!r} cannot use the Prepare's {layout.describe()}: {exc}"
            _fail("$.model", reason)
    if piece.budget_bytes < 1:
        _fail("$.budget_bytes", f"must be >= 1, got {piece.budget_bytes}")
    tensors = piece.model.tensors(piece.optimizer)
    lost = set(prepare.lost)
    keepers: dict[int, int] = {}
    for i, (rank, keeper) in enumerate(piece.stand_ins):
        at = f"$.stand_ins[{i}]"
        if not (0 <= rank < len(old_devices) and 0 <= keeper < len(old_devices)):
            _fail(at, f"ranks {rank}, {keeper} are not both in the old world of {len(old_devices)}")
        if old_devices[rank] not in lost or old_devices[keeper] in lost:
            _fail(at, f"old rank {rank} stands in on {keeper}: the first must be lost, the second not")
        keepers[rank] = keeper
    for i, task in enumerate(piece.tasks):
        at = f"$.tasks[{i}]"
        if not 0 <= task.src < len(old_devices):
            _fail(f"{at}.src", f"rank {task.src} is outside the old world of {len(old_devices)}")
        if not 0 <= task.dst < len(new_devices):
            _fail(f"{at}.dst", f"rank {task.dst} is outside the new world of {len(new_devices)}")
        # A lost rank that stands in sends from its keeper's device.
        src, dst = old_devices[keepers.get(task.src, task.src)], new_devices[task.dst]
        if device not in (src, dst):
            _fail(at, f"moves {src} -> {dst}; neither is this worker's device {device}")
        if task.local != (src == dst):
            _fail(f"{at}.local", f"is {task.local} for {src} -> {dst}")
        nbytes = 0
        for j, (index, box) in enumerate(task.slices):
            if not 0 <= index < len(tensors):
                _fail(f"{at}.slices[{j}]", f"tensor {index} is not one of the model's {len(tensors)}")
            shape = tensors[index].shape
            if len(box) != len(shape) or any(
                not 0 <= lo < hi <= n for (lo, hi), n in zip(box, shape, strict=True)
            ):
                _fail(f"{at}.slices[{j}]", f"box {list(box)} is not inside tensor shape {list(shape)}")
            elements = 1
            for lo, hi in box:
                elements *= hi - lo
            nbytes += elements * tensors[index].itemsize
        if task.nbytes != nbytes:
            _fail(f"{at}.nbytes", f"is {task.nbytes}, its slices hold {nbytes} bytes")


def _fail(path: str, reason: str) -> None:
    raise MessageError(EXPECTED, path, reason)


def _translate(exc: msgspec.MsgspecError) -> MessageError:
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return MessageError(EXPECTED, "$", f"malformed JSON: {text}")
    match = _AT.match(text)
    if match is None:
        return MessageError(EXPECTED, "$", text)
    return MessageError(EXPECTED, match["path"], match["reason"])


async def _through_outages(read: Callable[[], Awaitable[bytes]], progress: _Progress) -> bytes:
    """``read()``, started again after each failure that only says the bus could not be reached."""
    while True:
        try:
            return await read()
        except Exception as exc:
            if not is_outage(exc):
                raise
            progress.outages += 1
        await asyncio.sleep(OUTAGE_RETRY_S[min(progress.outages, len(OUTAGE_RETRY_S)) - 1])


async def _read(
    where: str, read: Coroutine[Any, Any, bytes], timeout_s: float, progress: _Progress, not_found: str
) -> bytes:
    """Run ``read`` within ``timeout_s``; every way it can fail becomes one :class:`PlanFetchError`
    that names ``where``, the step it was waiting for and which limit ran out."""
    try:
        return await asyncio.wait_for(read, timeout_s)
    except nats.errors.TimeoutError:
        # A subclass of TimeoutError: one request timed out, not the read as a whole.
        raise PlanFetchError(
            f"{where}: the request for {progress.step} got no reply within the client's request "
            f"timeout ({progress.elapsed_s:.3g} s into a read allowed {timeout_s:.3g} s)"
        ) from None
    except TimeoutError:
        if progress.misses:
            raise PlanFetchError(
                f"{where}: no such entry (read {progress.misses} times over {progress.elapsed_s:.3g} s; "
                f"the read was allowed {timeout_s:.3g} s)"
            ) from None
        lost = f"; {progress.outages} tries lost to bus outages" if progress.outages else ""
        raise PlanFetchError(
            f"{where}: not read within the {timeout_s:.3g} s allowed (gave up after "
            f"{progress.elapsed_s:.3g} s, waiting for {progress.step}{lost})"
        ) from None
    except nats.js.errors.NotFoundError:
        raise PlanFetchError(f"{where}: {not_found}") from None
    except nats.errors.Error as exc:
        raise PlanFetchError(
            f"{where}: {type(exc).__name__} {exc} while reading {progress.step}".strip()
        ) from None
