"""The transfer service against a real nats-server: planned topology in, stored verified plan out."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Collection, Iterator
from dataclasses import dataclass

import msgspec
import pytest
from bus_helpers import Collector, client, error_events, eventually, running, stored
from nats.aio.client import Client
from nats.js import JetStreamContext

from liver.reshard.plan import SLICE_SCHEMA_VERSION, Plan, SliceFile, WorldConfig, slice_devices
from liver.reshard.plan_file import decode_plan
from liver.reshard.planner import build_plan, plan_stats
from liver.reshard.verifier import verify_plan
from liver.services.transfer.service import BUDGET_ENV, TransferService, TransferSettings
from liver.shared import subjects as s
from liver.shared.codec import decode, encode
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.messages import Candidate, ObjectRef, PlanningFailed, TopologyPlanned, TransferPlanned
from liver.shared.model import PRESETS, ModelSpec
from liver.shared.nats_server import NatsServer

JOB = "job-t"
MODEL = PRESETS["tiny-gpt"]
OLD = ParallelLayout(tp=2, pp=2, dp=2)
OLD_DEVICES = grid_devices(2, 4)
FAST = TransferSettings(ack_wait_s=30.0, progress_every_s=1.0, retry_delay_s=0.1)
MAX_PAYLOAD = 1024 * 1024


def topology(layout: ParallelLayout, devices: tuple[Device, ...], **changes: object) -> TopologyPlanned:
    fields: dict[str, object] = {
        "job_id": JOB,
        "event_id": "evt-1",
        "from_generation": 4,
        "generation": 5,
        "model": MODEL.geometry(),
        "from_layout": OLD,
        "from_placement": Placement(OLD_DEVICES),
        "layout": layout,
        "placement": Placement(devices),
        "candidates": (Candidate(layout=layout, score=1.0, fits=True),),
        "explanation": "test",
    }
    fields.update(changes)
    return TopologyPlanned(**fields)  # type: ignore[arg-type]


# node001 is reclaimed: TP2 PP2 on the four devices of node000.
SCALE_IN = topology(ParallelLayout(tp=2, pp=2, dp=1), OLD_DEVICES[:4])


@pytest.fixture
def server() -> Iterator[NatsServer]:
    with NatsServer() as srv:
        yield srv


@dataclass
class Rig:
    nc: Client
    js: JetStreamContext
    service: TransferService
    planned: Collector
    errors: Collector

    async def publish(self, payload: bytes | TopologyPlanned) -> int:
        data = payload if isinstance(payload, bytes) else encode(payload)
        return (await self.js.publish(s.topology_planned(JOB), data)).seq

    async def fetch(self, ref: ObjectRef) -> bytes:
        """A plan object or a slice, from the store its reference names, checked against the reference."""
        if ref.bucket == s.KV_PLAN_SLICES:
            entry = await (await self.js.key_value(ref.bucket)).get(ref.name)
            assert entry.value is not None and len(entry.value) == ref.size
            return entry.value
        store = await self.js.object_store(ref.bucket)
        result = await store.get(ref.name)
        assert result.info.digest == ref.digest
        assert result.data is not None
        assert len(result.data) == ref.size
        return result.data

    async def settled(self) -> bool:
        info = await self.js.consumer_info(s.STREAM_CONTROL.name, FAST.durable)
        return info.num_pending == 0 and info.num_ack_pending == 0


@dataclass
class Conn:
    nc: Client
    js: JetStreamContext
    url: str


@pytest.fixture
async def conn(server: NatsServer) -> AsyncIterator[Conn]:
    async with client(server.url) as (nc, js):
        yield Conn(nc, js, server.url)


async def rig_for(c: Conn, service: TransferService) -> Rig:
    return Rig(
        nc=c.nc,
        js=c.js,
        service=service,
        planned=await Collector.on(c.nc, s.TRANSFER_PLANNED_ANY),
        errors=await Collector.on(c.nc, s.errors("transfer")),
    )


@pytest.fixture
async def rig(conn: Conn) -> AsyncIterator[Rig]:
    service = TransferService(FAST)
    async with running(service, conn.url):
        yield await rig_for(conn, service)


@pytest.mark.slow
async def test_a_planned_topology_yields_a_stored_verified_plan_and_a_reference_per_device(rig: Rig) -> None:
    await rig.publish(SCALE_IN)
    out = await rig.planned.one(TransferPlanned)
    assert rig.planned.messages[0].subject == s.transfer_planned(JOB)
    assert (out.event_id, out.from_generation, out.generation) == ("evt-1", 4, 5)
    plan = decode_plan(await rig.fetch(out.plan))
    assert verify_plan(plan).ok
    assert plan.new.placement == SCALE_IN.placement
    assert plan.old.placement == SCALE_IN.from_placement
    stats = plan_stats(plan)
    assert out.summary.verified
    assert out.summary.bytes_moved == stats.bytes_moved
    assert out.summary.bytes_local == stats.bytes_local
    assert out.summary.tasks_coalesced == stats.tasks == len(plan.tasks)
    assert out.summary.lower_bound_bytes <= out.summary.bytes_moved <= out.summary.bytes_rank_order
    assert [w.device for w in out.workers] == list(OLD_DEVICES)
    await eventually(rig.settled, what="the topology message is acknowledged")


@pytest.mark.slow
async def test_each_device_slice_holds_exactly_the_tasks_it_sends_or_receives(rig: Rig) -> None:
    await rig.publish(SCALE_IN)
    out = await rig.planned.one(TransferPlanned)
    plan = decode_plan(await rig.fetch(out.plan))
    old_rank, new_rank = plan.old.placement.rank_on(), plan.new.placement.rank_on()
    for worker in out.workers:
        piece = msgspec.json.decode(await rig.fetch(worker.ref), type=SliceFile)
        assert piece.device == worker.device and piece.generation == out.generation
        src, dst = old_rank.get(worker.device), new_rank.get(worker.device)
        expected = [t for t in plan.tasks if t.src == src or t.dst == dst]
        assert list(piece.tasks) == expected
        as_plan = piece.with_worlds(plan.old, plan.new).to_plan()
        assert as_plan.tensors == plan.tensors
        assert as_plan.tasks_of(rank_src=src) == plan.tasks_of(rank_src=src)
        if dst is not None:
            assert as_plan.tasks_of(rank_dst=dst) == plan.tasks_of(rank_dst=dst)


@pytest.mark.slow
async def test_every_slice_is_named_by_its_devices_index_in_both_worlds(rig: Rig) -> None:
    await rig.publish(SCALE_IN)
    out = await rig.planned.one(TransferPlanned)
    devices = slice_devices(SCALE_IN.from_placement, SCALE_IN.placement)
    assert out.slices.count == len(devices) == len(out.workers)
    assert (out.slices.bucket, out.slices.kv_bucket) == (s.OBJECT_STORE_PLANS, s.KV_PLAN_SLICES)
    for i, (device, worker) in enumerate(zip(devices, out.workers, strict=True)):
        where = out.slices.location(i)
        assert worker.device == device and (worker.ref.bucket, worker.ref.name) == (where.bucket, where.name)


@pytest.mark.slow
async def test_a_slice_repeats_no_world(rig: Rig) -> None:
    await rig.publish(SCALE_IN)
    out = await rig.planned.one(TransferPlanned)
    raw = msgspec.json.decode(await rig.fetch(out.workers[0].ref))
    assert {"old", "new"}.isdisjoint(raw) and raw["schema_version"] == SLICE_SCHEMA_VERSION


@pytest.mark.slow
async def test_a_plan_larger_than_a_message_is_stored_whole(conn: Conn) -> None:
    # A tiny staging budget cuts the transfer into thousands of rounds: a plan file of about 1.5 MB.
    service = TransferService(msgspec.structs.replace(FAST, budget_bytes=256))
    async with running(service, conn.url):
        rig = await rig_for(conn, service)
        assert rig.nc.max_payload <= MAX_PAYLOAD
        await rig.publish(topology(ParallelLayout(tp=1, pp=2, dp=4), OLD_DEVICES))
        out = await rig.planned.one(TransferPlanned)
        assert out.plan.size > rig.nc.max_payload
        plan = decode_plan(await rig.fetch(out.plan))
        assert plan.budget_bytes == 256
        assert len(plan.tasks) == out.summary.tasks_coalesced


class DropsATask:
    """A planner with a bug: it forgets the last task of every plan."""

    def __call__(
        self,
        model: ModelSpec,
        old: WorldConfig,
        new: WorldConfig,
        budget: int,
        opt: bool,
        *,
        lost: Collection[Device] = (),
        copies: bool = False,
    ) -> Plan:
        plan = build_plan(model, old, new, budget, opt, lost=lost)
        return plan.with_tasks(plan.tasks[:-1])


@pytest.mark.slow
async def test_a_plan_that_fails_verification_is_reported_and_never_published(conn: Conn) -> None:
    service = TransferService(FAST, planner=DropsATask())
    async with running(service, conn.url):
        rig = await rig_for(conn, service)
        seq = await rig.publish(SCALE_IN)
        (error,) = error_events(await _one(rig.errors))
        assert error.field == "$"
        assert "failed verification" in error.message
        assert error.stream_sequence == seq
        await eventually(rig.settled)
        assert await stored(rig.js, s.STREAM_CONTROL.name, s.transfer_planned(JOB)) == []
        assert rig.planned.messages == []
        dead = await stored(rig.js, s.STREAM_DEAD_LETTERS.name, s.dead_letters("transfer"))
        assert len(dead) == 1


async def _one(collector: Collector) -> Collector:
    await collector.wait_for(1)
    return collector


def _with(msg: TopologyPlanned, **changes: object) -> bytes:
    body = json.loads(encode(msg))
    body.update(changes)
    return json.dumps(body).encode()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("payload", "field"),
    [
        pytest.param(b"{", "$", id="malformed-json"),
        pytest.param(_with(SCALE_IN, generation=3), "$.generation", id="generation-not-after-the-current"),
        pytest.param(_with(SCALE_IN, job_id="somebody-else"), "$.job_id", id="another-jobs-subject"),
        pytest.param(_with(SCALE_IN, placement={"devices": []}), "$.placement", id="placement-too-small"),
        pytest.param(
            encode(topology(ParallelLayout(tp=3, pp=1, dp=1), OLD_DEVICES[:3])),
            "$.layout",
            id="layout-the-model-cannot-use",
        ),
    ],
)
async def test_bad_input_is_reported_by_field_and_yields_no_plan(
    rig: Rig, payload: bytes, field: str
) -> None:
    await rig.publish(payload)
    (error,) = error_events(await _one(rig.errors))
    assert error.field == field
    await eventually(rig.settled)
    assert rig.planned.messages == []
    assert rig.service.stats()["rejected"] == 1


@pytest.mark.slow
async def test_a_topology_handled_again_is_stored_and_published_once(conn: Conn) -> None:
    planned = await Collector.on(conn.nc, s.TRANSFER_PLANNED_ANY)
    async with running(TransferService(FAST), conn.url):
        await conn.js.publish(s.topology_planned(JOB), encode(SCALE_IN))
        await planned.wait_for(1)
    # As if every ack had been lost: a fresh consumer delivers the stream from its start again.
    await conn.js.delete_consumer(s.STREAM_CONTROL.name, FAST.durable)
    async with running(TransferService(FAST), conn.url):
        await planned.wait_for(2)
    first, second = (decode(m.data, TransferPlanned) for m in planned.messages)
    assert first.plan == second.plan  # same name, same digest: the objects were rewritten identically
    assert first.workers == second.workers
    assert len(await stored(conn.js, s.STREAM_CONTROL.name, s.transfer_planned(JOB))) == 1


def test_the_staging_budget_comes_from_the_environment() -> None:
    assert TransferSettings.from_env({BUDGET_ENV: "1048576"}).budget_bytes == 1048576


@pytest.mark.parametrize("value", ["lots", "4"])
def test_a_bad_budget_in_the_environment_is_named(value: str) -> None:
    with pytest.raises(ValueError, match=BUDGET_ENV):
        TransferSettings.from_env({BUDGET_ENV: value})


# -- lost devices: gone before the handoff, so no state may come from them ----------------------------

# Rank 4 (TP rank 0 of stage 1, replica 0) ran on node001:0; its replica, rank 6, on node001:2.
REPLICA_LOST = (OLD_DEVICES[4],)
BOTH_REPLICAS_LOST = (OLD_DEVICES[4], OLD_DEVICES[6])
# Rank 4 keeps its peer copy on rank 0 (node000:0): losing that too leaves its state nowhere.
COPY_LOST_TOO = (OLD_DEVICES[0], *BOTH_REPLICAS_LOST)
TWO_SURVIVORS = topology(ParallelLayout(tp=1, pp=2, dp=1), OLD_DEVICES[1:3])


@pytest.mark.slow
async def test_a_lost_devices_state_comes_from_its_surviving_replica(rig: Rig) -> None:
    await rig.publish(msgspec.structs.replace(SCALE_IN, lost=REPLICA_LOST))
    out = await rig.planned.one(TransferPlanned)
    plan = decode_plan(await rig.fetch(out.plan))
    assert verify_plan(plan, lost=REPLICA_LOST).ok
    sources = {plan.old.placement.devices[t.src] for t in plan.tasks}
    assert OLD_DEVICES[4] not in sources
    assert OLD_DEVICES[6] in sources


@pytest.mark.slow
async def test_state_held_only_by_lost_devices_comes_from_its_peer_copy(rig: Rig) -> None:
    await rig.publish(msgspec.structs.replace(SCALE_IN, lost=BOTH_REPLICAS_LOST))
    out = await rig.planned.one(TransferPlanned)
    plan = decode_plan(await rig.fetch(out.plan))
    assert plan.stand_ins == ((4, 0),)  # rank 4 (node001:0) stands in, its tasks run on node000:0
    assert verify_plan(plan, lost=BOTH_REPLICAS_LOST).ok


@pytest.mark.slow
async def test_state_whose_holders_and_copy_are_lost_is_a_transfer_planning_failure(conn: Conn) -> None:
    failures = await Collector.on(conn.nc, s.planning_failed(JOB))
    service = TransferService(FAST)
    async with running(service, conn.url):
        rig = await rig_for(conn, service)
        await rig.publish(msgspec.structs.replace(TWO_SURVIVORS, lost=COPY_LOST_TOO))
        failed = await failures.one(PlanningFailed)
        assert (failed.job_id, failed.event_id, failed.generation, failed.stage) == (
            JOB,
            "evt-1",
            5,
            "transfer",
        )
        assert "no surviving device holds part of decoder.layers." in failed.reason
        assert "node001:0" in failed.reason and "node001:2" in failed.reason
        await eventually(rig.settled, what="the topology message is acknowledged")
        assert service.stats()["failed"] == 1
        assert rig.planned.messages == [] and rig.errors.messages == []
        assert await stored(rig.js, s.STREAM_CONTROL.name, s.transfer_planned(JOB)) == []
