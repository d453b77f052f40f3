"""A worker's part of a transfer plan: fetched from the object store, checked, turned into a ``Plan``.

The slice comes from another process through storage, and the executor trusts it: a task that names a
rank outside the world, a box outside its tensor or a byte count that disagrees with its boxes would make
the handoff send the wrong bytes or wait for bytes that never come. So the slice is decoded strictly and
checked against the ``Prepare`` that pointed to it and against this worker's device before anything is
built from it; every failure is a :class:`~liver.shared.codec.MessageError` whose path names the field.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
from typing import Final

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TYPE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
)

from liver.shared.codec import MessageError
from liver.shared.layout import Device, LayoutError
from liver.shared.messages import ObjectRef, Prepare
from liver.shared.plan import PLAN_SCHEMA_VERSION, Plan, PlanSlice

EXPECTED: Final = "PlanSlice"
_DECODER: Final = msgspec.json.Decoder(PlanSlice)
_AT = re.compile(r"^(?P<reason>.*) - at `(?P<path>\$[^`]*)`$", re.S)


class PlanFetchError(RuntimeError):
    """The slice could not be read (missing object, digest or size mismatch, bus failure or timeout)."""


class PlanFetcher:
    """Reads plan objects for one connection with single-message reads instead of the client's ``get``.

    The client's object-store ``get`` creates an ordered consumer per read. When a thousand workers read
    their slices at the same moment that is a thousand consumers created and deleted on the plan
    stream: the server refuses some ("maximum consumers limit reached") and the rest take seconds. A
    slice is one or a few chunks, so this reads the object's metadata and then each chunk by subject
    and sequence, one request each and no consumer; with the stream's direct get (object stores allow
    it) those requests bypass the JetStream API queue, which a thousand readers would otherwise fill.
    The digest is checked here, as ``get`` does.
    """

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._direct: dict[str, bool] = {}

    async def fetch(self, ref: ObjectRef, timeout_s: float) -> bytes:
        """The object's bytes, checked against the reference's size and digest and the stored digest."""
        try:
            return await asyncio.wait_for(self._fetch(ref), timeout_s)
        except TimeoutError:
            raise PlanFetchError(f"{ref.bucket}/{ref.name}: not read within {timeout_s:.3g} s") from None
        except nats.js.errors.NotFoundError:
            raise PlanFetchError(f"{ref.bucket}/{ref.name}: no such object") from None
        except nats.errors.Error as exc:
            raise PlanFetchError(f"{ref.bucket}/{ref.name}: {type(exc).__name__} {exc}".strip()) from None

    async def _fetch(self, ref: ObjectRef) -> bytes:
        where = f"{ref.bucket}/{ref.name}"
        stream = OBJ_STREAM_TEMPLATE.format(bucket=ref.bucket)
        direct = self._direct.get(ref.bucket)
        if direct is None:
            config = (await self._js.stream_info(stream)).config
            direct = self._direct[ref.bucket] = bool(config.allow_direct)
        key = base64.urlsafe_b64encode(ref.name.encode()).decode()
        meta = await self._js.get_msg(
            stream, subject=OBJ_META_PRE_TEMPLATE.format(bucket=ref.bucket, obj=key), direct=direct
        )
        try:
            info = api.ObjectInfo.from_response(json.loads(meta.data or b""))
        except (ValueError, TypeError, KeyError) as exc:
            raise PlanFetchError(f"{where}: unreadable object metadata ({exc})") from None
        if info.deleted:
            raise PlanFetchError(f"{where}: no such object (deleted)")
        if ref.digest is not None and info.digest != ref.digest:
            raise PlanFetchError(
                f"{where}: digest {info.digest} is not the {ref.digest} the Prepare names (the object was "
                "replaced)"
            )
        if info.is_link():
            raise PlanFetchError(f"{where}: is a link; plans are stored as plain objects")
        if (info.size or 0) != ref.size:
            raise PlanFetchError(f"{where}: {info.size or 0} bytes stored, the Prepare says {ref.size}")
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=ref.bucket, obj=info.nuid)
        parts: list[bytes] = []
        seq = 0
        for _ in range(info.chunks or 0):
            msg = await self._js.get_msg(stream, seq=seq + 1, subject=subject, next=True, direct=direct)
            parts.append(msg.data or b"")
            seq = msg.seq or seq + 1
        data = b"".join(parts)
        if len(data) != ref.size:
            raise PlanFetchError(f"{where}: read {len(data)} bytes, the Prepare says {ref.size}")
        digest = OBJ_DIGEST_TYPE + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
        if info.digest is not None and digest != info.digest:
            raise PlanFetchError(f"{where}: the bytes read hash to {digest}, the store says {info.digest}")
        return data


def decode_slice(data: bytes, prepare: Prepare, device: Device) -> Plan:
    """The plan ``device`` executes for ``prepare``, from the slice's bytes; raises :class:`MessageError`."""
    try:
        piece = _DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _translate(exc) from None
    check_slice(piece, prepare, device)
    return piece.to_plan()


def check_slice(piece: PlanSlice, prepare: Prepare, device: Device) -> None:
    """Refuse a slice that is not this device's part of the plan ``prepare`` describes."""
    if piece.schema_version != PLAN_SCHEMA_VERSION:
        _fail("$.schema_version", f"expected {PLAN_SCHEMA_VERSION}, got {piece.schema_version}")
    if piece.device != device:
        _fail("$.device", f"the slice is for {piece.device}, this worker runs on {device}")
    if piece.new.layout != prepare.layout:
        _fail(
            "$.new.layout",
            f"{piece.new.layout.describe()} is not the layout {prepare.layout.describe()} of the Prepare",
        )
    if piece.new.placement != prepare.placement:
        _fail("$.new.placement", "differs from the placement of the Prepare")
    old_devices, new_devices = piece.old.placement.devices, piece.new.placement.devices
    if device not in old_devices and device not in new_devices:
        _fail("$.device", f"{device} is in neither the old nor the new world")
    for world in ("old", "new"):
        try:
            piece.model.check_layout(getattr(piece, world).layout)
        except LayoutError as exc:
            _fail(f"$.{world}.layout", f"model {piece.model.name!r} cannot use it: {exc}")
    if piece.budget_bytes < 1:
        _fail("$.budget_bytes", f"must be >= 1, got {piece.budget_bytes}")
    tensors = piece.model.tensors(piece.optimizer)
    for i, task in enumerate(piece.tasks):
        at = f"$.tasks[{i}]"
        if not 0 <= task.src < len(old_devices):
            _fail(f"{at}.src", f"rank {task.src} is outside the old world of {len(old_devices)}")
        if not 0 <= task.dst < len(new_devices):
            _fail(f"{at}.dst", f"rank {task.dst} is outside the new world of {len(new_devices)}")
        src, dst = old_devices[task.src], new_devices[task.dst]
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
