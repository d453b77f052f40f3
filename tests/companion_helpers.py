"""Helpers for the worker companion's tests: a real plan's slices in the object store, commands, hooks."""

from __future__ import annotations

import functools
import threading
from datetime import UTC, datetime, timedelta

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.object_store import ObjectStore

from liver.reshard.plan import Plan, PlanSlice, WorldConfig
from liver.reshard.planner import build_plan
from liver.services.bus import ensure_kv
from liver.services.transfer.core import device_slices
from liver.services.transfer.store import PlanWriter
from liver.shared import subjects as s
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.messages import Abort, ObjectRef, Prepare, SliceIndex, Switch
from liver.shared.model import PRESETS

MODEL = PRESETS["tiny-gpt"]
OLD_LAYOUT = ParallelLayout(tp=2, pp=2, dp=1)
NEW_LAYOUT = ParallelLayout(tp=2, pp=1, dp=1)
DEVICES = grid_devices(1, 4)
"""The old world: four devices of node000. The new one keeps the first two (a scale-in)."""
OLD = WorldConfig(OLD_LAYOUT, Placement(DEVICES))
NEW = WorldConfig(NEW_LAYOUT, Placement(DEVICES[:2]))


@functools.cache
def plan() -> Plan:
    return build_plan(MODEL, OLD, NEW, 1 << 20, True)


@functools.cache
def slices() -> dict[Device, PlanSlice]:
    return {piece.device: piece for piece in device_slices(plan(), True)}


async def plans_store(js: JetStreamContext) -> ObjectStore:
    try:
        return await js.object_store(s.OBJECT_STORE_PLANS)
    except BucketNotFoundError:
        return await js.create_object_store(s.OBJECT_STORE_PLANS)


async def put_object(js: JetStreamContext, name: str, data: bytes) -> ObjectRef:
    store = await plans_store(js)
    info = await store.put(name, data)
    return ObjectRef(bucket=s.OBJECT_STORE_PLANS, name=name, size=len(data), digest=info.digest)


def slice_index(job: str, generation: int, tag: str = "s1") -> SliceIndex:
    """Where the transfer service would store :func:`plan`'s slices for ``generation``."""
    return SliceIndex(
        bucket=s.OBJECT_STORE_PLANS,
        prefix=s.plan_object_name(job, generation, tag) + "-",
        count=len(slices()),
    )


async def put_slices(js: JetStreamContext, job: str, generation: int, tag: str = "s1") -> SliceIndex:
    """Every device's slice of :func:`plan` stored as the transfer service stores them."""
    index = slice_index(job, generation, tag)
    for i, piece in enumerate(slices().values()):  # device_slices' order is slice_devices'
        await put_object(js, index.name(i), msgspec.json.encode(piece.stored(generation)))
    return index


async def put_slice_entries(js: JetStreamContext, job: str, generation: int, tag: str = "s1") -> SliceIndex:
    """Every device's slice of :func:`plan` stored as the transfer service stores them now: key-value
    entries (each fits a message), through the service's own writer."""
    objects = await plans_store(js)
    await ensure_kv(js, s.KV_PLAN_SLICES, description="plan slices", ttl_s=600.0)
    writer = PlanWriter(
        js, objects, object_bucket=s.OBJECT_STORE_PLANS, kv_bucket=s.KV_PLAN_SLICES, kv_max_bytes=1 << 19
    )
    files = [msgspec.json.encode(piece.stored(generation)) for piece in slices().values()]
    index, _ = await writer.put_slices(s.plan_object_name(job, generation, tag) + "-", files)
    return index


def prepare(
    job: str,
    generation: int,
    index: SliceIndex | None = None,
    *,
    deadline_s: float = 60.0,
    lost: tuple[Device, ...] = (),
) -> Prepare:
    """The job-wide Prepare of the scale-in from :data:`OLD` to :data:`NEW`."""
    return Prepare(
        job_id=job,
        event_id="evt-1",
        from_generation=generation - 1,
        generation=generation,
        from_layout=OLD_LAYOUT,
        from_placement=OLD.placement,
        layout=NEW_LAYOUT,
        placement=NEW.placement,
        lost=lost,
        plan=ObjectRef(bucket=s.OBJECT_STORE_PLANS, name=s.plan_object_name(job, generation), size=1),
        slices=index or slice_index(job, generation),
        staging_bytes=1 << 20,
        deadline=datetime.now(UTC) + timedelta(seconds=deadline_s),
    )


def switch(job: str, generation: int) -> Switch:
    return Switch(job_id=job, generation=generation, deadline=datetime.now(UTC) + timedelta(seconds=60))


def abort(job: str, generation: int, reason: str = "test") -> Abort:
    return Abort(job_id=job, generation=generation, reason=reason)


class RecordingHooks:
    """Runtime hooks that record each call (from the companion's thread) for the test to inspect."""

    def __init__(self, raise_in: str | None = None) -> None:
        self.calls: list[tuple[str, object]] = []
        self.threads: set[str] = set()
        self._raise_in = raise_in
        self._lock = threading.Lock()

    def _record(self, name: str, value: object) -> None:
        with self._lock:
            self.calls.append((name, value))
            self.threads.add(threading.current_thread().name)
        if name == self._raise_in:
            raise RuntimeError(f"{name} broke")

    def on_prepare(self, prepare: Prepare, plan: Plan) -> None:
        self._record("prepare", (prepare, plan))

    def on_switch(self, switch: Switch) -> None:
        self._record("switch", switch)

    def on_abort(self, abort: Abort) -> None:
        self._record("abort", abort)

    def named(self, name: str) -> list[object]:
        with self._lock:
            return [value for n, value in self.calls if n == name]
