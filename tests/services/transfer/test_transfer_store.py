"""Where a plan's slices are stored: one key-value entry each when it fits a message, an object when not,
and a worker reads each back, byte for byte, with the same fetcher."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import nats.js.errors
import pytest
from bus_helpers import WAIT_S, client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from liver.services import bus as b
from liver.services.transfer.store import KV_SLICE_MAX_BYTES, PlanWriter, kv_limit
from liver.shared import subjects as s
from liver.shared.nats_server import NatsServer
from liver.worker_runtime.companion.slices import PlanFetcher

PREFIX = "job-s/3/s7-"


@pytest.fixture
def server() -> Iterator[NatsServer]:
    with NatsServer() as srv:
        yield srv


@dataclass
class Stores:
    js: JetStreamContext
    objects: ObjectStore
    kv: KeyValue
    max_payload: int

    def writer(self, kv_max_bytes: int) -> PlanWriter:
        return PlanWriter(
            self.js,
            self.objects,
            object_bucket=s.OBJECT_STORE_PLANS,
            kv_bucket=s.KV_PLAN_SLICES,
            kv_max_bytes=kv_max_bytes,
        )


@pytest.fixture
async def stores(server: NatsServer) -> AsyncIterator[Stores]:
    async with client(server.url) as (nc, js):
        objects = await b.ensure_object_store(js, s.OBJECT_STORE_PLANS, description="test", ttl_s=60.0)
        kv = await b.ensure_kv(js, s.KV_PLAN_SLICES, description="test", ttl_s=60.0)
        yield Stores(js, objects, kv, nc.max_payload)


async def has_object(store: ObjectStore, name: str) -> bool:
    try:
        await store.get_info(name)
    except nats.js.errors.NotFoundError:
        return False
    return True


async def has_entry(kv: KeyValue, key: str) -> bool:
    try:
        await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return False
    return True


def test_the_entry_limit_stays_at_half_the_servers_message_limit_or_below() -> None:
    assert kv_limit(1024 * 1024) == KV_SLICE_MAX_BYTES == 512 * 1024
    assert kv_limit(256 * 1024) == 128 * 1024
    assert kv_limit(None) == KV_SLICE_MAX_BYTES
    assert kv_limit(8 * 1024 * 1024, configured=1000) == 1000


@pytest.mark.slow
async def test_a_slice_that_fits_a_message_is_one_key_value_entry_and_reads_back(stores: Stores) -> None:
    data = b'{"slice": "small"}'
    index, (ref,) = await stores.writer(kv_max_bytes=1000).put_slices(PREFIX, [data])
    assert index.objects == () and index.kv_bucket == s.KV_PLAN_SLICES
    assert (ref.bucket, ref.name, ref.size) == (s.KV_PLAN_SLICES, "job-s.3.s7.00000", len(data))
    assert (await stores.kv.get(index.key(0))).value == data
    assert not await has_object(stores.objects, index.name(0))
    assert await PlanFetcher(stores.js).fetch_slice(index.location(0), WAIT_S) == data


@pytest.mark.slow
async def test_a_slice_over_the_limit_is_an_object_and_reads_back_identically(stores: Stores) -> None:
    small, big = b"s" * 100, os.urandom(3000)
    index, refs = await stores.writer(kv_max_bytes=1000).put_slices(PREFIX, [small, big, small])
    assert index.objects == (1,)
    assert [r.bucket for r in refs] == [s.KV_PLAN_SLICES, s.OBJECT_STORE_PLANS, s.KV_PLAN_SLICES]
    assert refs[1].name == index.name(1) and refs[1].digest is not None
    assert not await has_entry(stores.kv, index.key(1))
    fetcher = PlanFetcher(stores.js)
    assert [await fetcher.fetch_slice(index.location(i), WAIT_S) for i in range(3)] == [small, big, small]


@pytest.mark.slow
async def test_a_slice_larger_than_a_message_goes_through_the_object_store(stores: Stores) -> None:
    huge = os.urandom(stores.max_payload + 4096)  # more than one message, more than one chunk
    limit = kv_limit(stores.max_payload)
    index, (ref,) = await stores.writer(kv_max_bytes=limit).put_slices(PREFIX, [huge])
    assert index.objects == (0,) and ref.size == len(huge)
    assert await PlanFetcher(stores.js).fetch_slice(index.location(0), WAIT_S) == huge
