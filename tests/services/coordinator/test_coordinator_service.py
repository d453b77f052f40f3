"""The coordinator service against a real nats-server, with the real topology and transfer services and
a small fake of the job's workers (they say hello, beat, and answer commands unless a test holds them).

Each test runs its own job on a server shared by the module; LiveR's real stream names are used.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import pytest
from bus_helpers import WAIT_S, Collector, client, error_events, eventually, running, scrape, stored
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from liver.services.coordinator import (
    Coordinator,
    CoordinatorConfig,
    GenerationPhase,
    GenerationRecord,
    WriteRecord,
)
from liver.services.coordinator.events import RecordConflict, RecordWritten
from liver.services.coordinator.held import with_device_memory
from liver.services.coordinator.kv import RecordStore
from liver.services.coordinator.record import Participant, PendingHandoff, Trigger
from liver.services.coordinator.service import (
    CONFIG_ENV,
    INSTANCE_ENV,
    JOB_ENV,
    CoordinatorService,
    CoordinatorSettings,
    create_service,
)
from liver.services.host import Hosted, status_subject
from liver.services.ingester.service import Ingester, IngesterSettings
from liver.services.topology.memory import CPU_SMALL, TrainingSetup
from liver.services.topology.service import TopologyService
from liver.services.topology.settings import JobProfile, TopologySettings
from liver.services.transfer.service import TransferService, TransferSettings
from liver.shared import subjects as s
from liver.shared.codec import decode, encode
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.messages import (
    Abort,
    GenerationAborted,
    GenerationCommitted,
    Heartbeat,
    Hello,
    JobMembership,
    Message,
    NodeDevices,
    Prepare,
    ResizeRequested,
    ScaleRequest,
    SpotWarning,
    Switch,
    TopologyRequest,
    TransferPlanned,
    WorkerCommand,
    WorkerStatus,
    WorldStarted,
)
from liver.shared.model import PRESETS
from liver.shared.nats_server import URL_ENV, NatsServer

WORLD = grid_devices(2, 2)
"""node000:0-1 and node001:0-1 run generation 0 as TP2 x DP2."""
LAYOUT = ParallelLayout(tp=2, pp=1, dp=2)
SPARES = grid_devices(3, 2)[4:]
"""node002:0-1: workers that belong to no world yet."""
CORE = CoordinatorConfig(heartbeat_timeout_s=30.0, margin_s=0.5, min_switch_s=0.5, switch_overhead_s=0.1)
"""No test here is about a lost worker: the fake workers beat every BEAT_S, and a generous heartbeat timeout
keeps a busy machine's stall from losing one."""
TOPOLOGY = TopologySettings(
    default=JobProfile(
        model=PRESETS["tiny-gpt"],
        setup=TrainingSetup(global_batch_size=12, sequence_length=64),
        hardware=CPU_SMALL,
    ),
    staging_bytes=1 << 20,
    ack_wait_s=30.0,
    progress_every_s=1.0,
    retry_delay_s=0.1,
)
TRANSFER = TransferSettings(ack_wait_s=30.0, progress_every_s=1.0, retry_delay_s=0.1, kv_slice_max_bytes=4096)
"""The scale-in's slices are about 2.9 KB (the staying devices) and 5.7 KB (the leaving ones; each
repeats the model's 2.4 KB geometry): a 4 KB limit stores some as entries and some as objects, so that
a release meets both."""
INGESTER = IngesterSettings(ack_wait_s=30.0, retry_delay_s=0.1)
BEAT_S = 0.2


def worker_id(device: Device) -> str:
    return f"w-{device.node}-{device.index}"


def settings(job: str, **fields: Any) -> CoordinatorSettings:
    base: dict[str, Any] = {
        "job_id": job,
        "ack_wait_s": 2.0,
        "progress_every_s": 0.5,
        "retry_delay_s": 0.1,
        "core": CORE,
    }
    base.update(fields)
    return CoordinatorSettings(**base)


NOTICE_S = 300.0
"""A spot warning's notice where the test is not about the deadline: a whole handoff through every service
must fit in it on a busy machine."""


def resize(
    job: str, event_id: str = "evt-1", node: str = "node001", notice_s: float = NOTICE_S
) -> ResizeRequested:
    return ResizeRequested(
        job_id=job,
        event_id=event_id,
        trigger="spot_warning",
        generation=0,
        reason=f"{node} reclaimed",
        keep=tuple(d for d in WORLD if d.node != node),
        remove=tuple(d for d in WORLD if d.node == node),
        deadline=datetime.now(UTC) + timedelta(seconds=notice_s),
    )


# -- the fake workers -------------------------------------------------------------------------------------


@dataclass
class FakeWorkers:
    """One job's workers: hello, a heartbeat every BEAT_S, and an answer to every command.

    ``ready`` and ``switched`` hold the answers to Prepare and Switch while cleared. A Switch (or
    Abort) is answered by every worker that was prepared for its generation, again on every copy, as
    a real worker answers a coordinator that re-sends after a restart.
    """

    nc: Client
    job: str
    world: tuple[Device, ...] = WORLD
    spares: tuple[Device, ...] = ()
    memory_bytes: int | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    switched: asyncio.Event = field(default_factory=asyncio.Event)
    received: list[tuple[str, Message]] = field(default_factory=list)
    prepared: dict[int, set[str]] = field(default_factory=dict)
    subscriptions: list[Subscription] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.ready.set()
        self.switched.set()
        self.devices = {worker_id(d): d for d in (*self.world, *self.spares)}
        self.ranks = {d: r for r, d in enumerate(self.world)}

    async def start(self) -> None:
        self.subscriptions.append(await self.nc.subscribe(s.worker_commands(self.job), cb=self._on_broadcast))
        for worker in self.devices:
            self.subscriptions.append(
                await self.nc.subscribe(s.worker_command(self.job, worker), cb=self._on_direct)
            )
        await self.say_hello()
        self._spawn(self._beat())
        await self.nc.flush()

    async def say_hello(self) -> None:
        """What a worker's companion sends when it starts or reconnects."""
        for worker, device in self.devices.items():
            rank = self.ranks.get(device)
            hello = Hello(
                job_id=self.job,
                worker_id=worker,
                device=device,
                address=f"{device.node}:{29500 + device.index}",
                generation=None if rank is None else 0,
                rank=rank,
                memory_bytes=self.memory_bytes,
            )
            await self.nc.publish(s.worker_hello(self.job), encode(hello))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def commands(self, kind: type, generation: int | None = None) -> list[tuple[str, Any]]:
        return [
            (w, c)
            for w, c in self.received
            if isinstance(c, kind) and (generation is None or c.generation == generation)
        ]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _beat(self) -> None:
        seq = 0
        while True:
            seq += 1
            for worker, device in self.devices.items():
                beat = Heartbeat(
                    job_id=self.job,
                    worker_id=worker,
                    device=device,
                    address=f"{device.node}:{29500 + device.index}",
                    seq=seq,
                    iteration=100 + seq,
                )
                await self.nc.publish(s.worker_heartbeat(self.job), encode(beat))
            await asyncio.sleep(BEAT_S)

    async def _on_direct(self, msg: Msg) -> None:
        worker = msg.subject.rsplit(".", 1)[-1]
        self.received.append((worker, decode(msg.data, WorkerCommand)))

    async def _on_broadcast(self, msg: Msg) -> None:
        command = decode(msg.data, WorkerCommand)
        if isinstance(command, Prepare):
            # One Prepare for the job: the workers on a device of either world that is not lost act.
            takers = set(command.from_placement.devices) | set(command.placement.devices)
            takers -= set(command.lost)
            for worker, device in sorted(self.devices.items()):
                if device in takers:
                    self.received.append((worker, command))
                    self.prepared.setdefault(command.generation, set()).add(worker)
                    self._spawn(self._answer(worker, command.generation, "ready", self.ready))
            return
        for worker in sorted(self.prepared.get(command.generation, ())):
            self.received.append((worker, command))
            if isinstance(command, Switch):
                self._spawn(self._answer(worker, command.generation, "switched", self.switched))
            elif isinstance(command, Abort):
                self._spawn(self._answer(worker, command.generation, "aborted", None))

    async def _answer(self, worker: str, generation: int, phase: str, gate: asyncio.Event | None) -> None:
        if gate is not None:
            await gate.wait()
        extra: dict[str, Any] = {}
        if phase == "switched":
            extra = {"iteration": 200, "bytes_received": 1000, "pause_s": 0.01}
        status = WorkerStatus(job_id=self.job, worker_id=worker, generation=generation, phase=phase, **extra)
        await self.nc.publish(s.worker_status(self.job), encode(status))


# -- the rig ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[NatsServer]:
    with NatsServer() as srv:
        yield srv


@pytest.fixture
def job(request: pytest.FixtureRequest) -> str:
    """A job of the test's own: its subjects, durable consumer and keys are the test's alone."""
    return request.node.name.replace("_", "-")[:100]


@dataclass
class Rig:
    nc: Client
    js: JetStreamContext
    url: str
    job: str
    workers: FakeWorkers
    committed: Collector
    aborted: Collector
    errors: Collector

    async def publish(self, subject: str, message: Message | bytes, msg_id: str | None = None) -> int:
        data = message if isinstance(message, bytes) else encode(message)
        headers = {s.HEADER_MSG_ID: msg_id} if msg_id else None
        return (await self.js.publish(subject, data, headers=headers)).seq

    async def start_world(self) -> None:
        world = WorldStarted(job_id=self.job, generation=0, layout=LAYOUT, placement=Placement(WORLD))
        await self.publish(s.world_started(self.job), world)

    async def membership(self) -> JobMembership | None:
        try:
            kv = await self.js.key_value(s.KV_MEMBERSHIP)
            entry = await kv.get(self.job)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError):
            return None  # no coordinator has published it yet
        return decode(entry.value or b"", JobMembership)

    async def live(self, generation: int = 0, workers: int = len(WORLD), timeout_s: float = WAIT_S) -> None:
        """Wait until the coordinator published the membership of ``generation`` with its workers."""

        async def check() -> bool:
            m = await self.membership()
            return m is not None and m.generation == generation and len(m.workers) == workers

        await eventually(
            check, timeout_s, what=f"membership of generation {generation} with {workers} workers"
        )

    async def record(self) -> GenerationRecord:
        stored_record = await RecordStore(await self.js.key_value(s.KV_GENERATIONS), self.job).read()
        assert stored_record is not None
        return stored_record.record

    def collectors(self) -> list[Subscription]:
        return [c.subscription for c in (self.committed, self.aborted, self.errors) if c.subscription]

    def outcomes(self, collector: Collector, kind: type) -> list[Any]:
        out = [decode(m.data, kind) for m in collector.messages]
        return [o for o in out if o.job_id == self.job]

    async def stored_outcomes(self) -> list[Message]:
        found: list[Message] = []
        for subject, kind in (
            (s.GENERATION_COMMITTED, GenerationCommitted),
            (s.GENERATION_ABORTED, GenerationAborted),
        ):
            for raw in await stored(self.js, s.STREAM_GENERATIONS.name, subject):
                message = decode(raw.data or b"", kind)
                if message.job_id == self.job:
                    found.append(message)
        return found

    async def consumer_settled(self, durable: str | None = None) -> bool:
        info = await self.js.consumer_info(s.STREAM_CONTROL.name, durable or f"coordinator-{self.job}")
        return info.num_pending == 0 and info.num_ack_pending == 0


@pytest.fixture
async def rig(server: NatsServer, job: str) -> AsyncIterator[Rig]:
    """The planners running, the job's workers up, nothing coordinating the job yet."""
    async with (
        client(server.url) as (nc, js),
        running(TopologyService(TOPOLOGY), server.url),
        running(TransferService(TRANSFER), server.url),
    ):
        workers = FakeWorkers(nc, job, spares=SPARES)
        rig = Rig(
            nc=nc,
            js=js,
            url=server.url,
            job=job,
            workers=workers,
            committed=await Collector.on(nc, s.GENERATION_COMMITTED),
            aborted=await Collector.on(nc, s.GENERATION_ABORTED),
            errors=await Collector.on(nc, s.errors("coordinator")),
        )
        await workers.start()
        try:
            yield rig
        finally:
            await workers.stop()


async def delivered(rig: Rig, *hosts: Hosted) -> None:
    """Return once everything the hosted services published so far has reached the rig's callbacks.

    A round trip on each service's connection (the server has what it sent), then one on the rig's (what
    the server routed to it is in its subscriptions' queues), then those queues drained: each callback
    here records its message before its first ``await``.
    """
    for h in hosts:
        await h.bus.nc.flush()
    await rig.nc.flush()
    subscriptions = [*rig.workers.subscriptions, *rig.collectors()]
    await until(lambda: all(sub.pending_msgs == 0 for sub in subscriptions), what="the rig's queues drained")


async def until(predicate: Callable[[], bool], what: str) -> None:
    async def check() -> bool:
        return predicate()

    await eventually(check, what=what)


async def committed(rig: Rig, count: int = 1) -> list[GenerationCommitted]:
    async def check() -> bool:
        return len(rig.outcomes(rig.committed, GenerationCommitted)) >= count

    await eventually(check, what=f"{count} generation.committed for {rig.job}")
    return rig.outcomes(rig.committed, GenerationCommitted)


async def aborted(rig: Rig, count: int = 1) -> list[GenerationAborted]:
    async def check() -> bool:
        return len(rig.outcomes(rig.aborted, GenerationAborted)) >= count

    await eventually(check, what=f"{count} generation.aborted for {rig.job}")
    return rig.outcomes(rig.aborted, GenerationAborted)


# -- pieces without a running coordinator -------------------------------------------------------------------


def test_settings_come_from_the_environment_and_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.json"
    path.write_text(json.dumps({"ack_wait_s": 9.0, "progress_every_s": 3.0, "core": {"margin_s": 1.5}}))
    out = CoordinatorSettings.from_env({JOB_ENV: "job-9", INSTANCE_ENV: "coord-a", CONFIG_ENV: str(path)})
    assert (out.job_id, out.instance_id, out.durable_name) == ("job-9", "coord-a", "coordinator-job-9")
    assert (out.ack_wait_s, out.core.margin_s, out.core.heartbeat_timeout_s) == (9.0, 1.5, 10.0)


def test_each_coordinator_gets_its_own_instance_id_by_default() -> None:
    assert (
        create_service({JOB_ENV: "job-9"}).settings.instance_id
        != create_service({JOB_ENV: "job-9"}).settings.instance_id
    )


def test_a_coordinator_without_a_job_refuses_to_start() -> None:
    with pytest.raises(ValueError, match=f"^{JOB_ENV}: the job this coordinator runs is required"):
        CoordinatorSettings.from_env({})


def test_a_bad_core_setting_is_named_by_its_path(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.json"
    path.write_text(json.dumps({"core": {"margin_s": -1}}))
    with pytest.raises(ValueError, match=r"margin_s.*\$\.core"):
        CoordinatorSettings.from_env({JOB_ENV: "job-9", CONFIG_ENV: str(path)})


def test_the_topology_request_carries_the_smallest_memory_the_remaining_workers_reported() -> None:
    core = Coordinator("job-m", instance_id="c-1", config=CORE)
    now = datetime.now(UTC)
    for i, device in enumerate(WORLD):
        memory = [8 << 30, 6 << 30, 1 << 30, 1 << 30][i]  # node001 (the small ones) is leaving
        hello = Hello(
            job_id="job-m", worker_id=worker_id(device), device=device, address="h:1", memory_bytes=memory
        )
        core.handle(hello, now)
    request = TopologyRequest(
        job_id="job-m",
        event_id="e",
        event_ids=("e",),
        from_generation=0,
        generation=1,
        layout=LAYOUT,
        placement=Placement(WORLD),
        remove=WORLD[2:],
        deadline=now,
    )
    assert with_device_memory(request, core.membership).device_memory_bytes == 6 << 30
    silent = msgspec.structs.replace(request, remove=(), add=SPARES)
    assert with_device_memory(silent, Coordinator("job-m", instance_id="c-2").membership) == silent


@pytest.mark.slow
async def test_a_record_write_lands_once_and_a_stale_one_conflicts_with_what_is_stored(
    server: NatsServer, job: str
) -> None:
    async with client(server.url) as (_, js):
        store = await RecordStore.open(js, job)
        record = GenerationRecord(
            job_id=job, writer="c-1", generation=0, layout=LAYOUT, placement=Placement(WORLD), issued=0
        )
        first = await store.write(WriteRecord(record=record, expected_revision=0))
        assert isinstance(first, RecordWritten)
        again = await store.write(WriteRecord(record=record, expected_revision=0))
        assert again == RecordConflict(stored=record, revision=first.revision)
        moved = msgspec.structs.replace(record, writer="c-2", issued=1)
        second = await store.write(WriteRecord(record=moved, expected_revision=first.revision))
        assert isinstance(second, RecordWritten) and second.revision > first.revision
        stale = await store.write(WriteRecord(record=record, expected_revision=first.revision))
        assert stale == RecordConflict(stored=moved, revision=second.revision)
        assert await store.read() == (moved, second.revision)


# -- the coordinator on the bus -----------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_started_world_is_recorded_and_its_workers_published_for_the_ingester(rig: Rig) -> None:
    async with running(CoordinatorService(settings(rig.job)), rig.url) as hosted:
        await rig.start_world()
        await rig.live()
        service = hosted.service
        assert isinstance(service, CoordinatorService)
        assert service.core.phase is GenerationPhase.STABLE
    record = await rig.record()
    assert (record.generation, record.layout, record.pending) == (0, LAYOUT, None)
    membership = await rig.membership()
    assert membership is not None
    assert {w.worker_id: w.device for w in membership.workers} == {worker_id(d): d for d in WORLD}


@pytest.mark.slow
async def test_a_spot_warning_runs_through_every_service_to_a_committed_scale_in(rig: Rig) -> None:
    async with (
        running(CoordinatorService(settings(rig.job)), rig.url),
        running(Ingester(INGESTER), rig.url),
    ):
        await rig.start_world()
        await rig.live()
        warning = SpotWarning(
            job_id=rig.job, event_id="spot-1", node="node001", provider="aws", notice_s=NOTICE_S
        )
        await rig.publish(s.SPOT_WARNING, warning)
        (out,) = await committed(rig)
        assert (out.event_id, out.previous_generation, out.generation) == ("spot-1", 0, 1)
        assert {d.node for d in out.placement.devices} == {"node000"}
        assert out.started_at_iteration == 200
        await rig.live(generation=1, workers=len(out.placement))
        await eventually(rig.consumer_settled, what="the resize request is acknowledged")
    record = await rig.record()
    assert (record.generation, record.pending, record.last_outcome) == (1, None, out)
    participants = {w for w, _ in rig.workers.commands(Prepare, 1)}
    assert participants == {worker_id(d) for d in WORLD}, "the leaving node sends its state too"
    assert not rig.outcomes(rig.aborted, GenerationAborted)


@pytest.mark.slow
async def test_the_metrics_move_as_a_handoff_commits(rig: Rig) -> None:
    async with (
        running(CoordinatorService(settings(rig.job)), rig.url, metrics_port=0) as coordinator,
        running(Ingester(INGESTER), rig.url, metrics_port=0) as ingester,
    ):
        assert coordinator.metrics_port and ingester.metrics_port
        await rig.start_world()
        await rig.live()
        before = await asyncio.to_thread(scrape, coordinator.metrics_port)
        job = (("job", rig.job),)
        handoff = (
            "liver_handoffs_total",
            (("job", rig.job), ("outcome", "committed"), ("trigger", "spot_warning")),
        )
        assert before.get(handoff, 0) == 0
        warning = SpotWarning(
            job_id=rig.job, event_id="spot-m", node="node001", provider="aws", notice_s=NOTICE_S
        )
        await rig.publish(s.SPOT_WARNING, warning)
        (out,) = await committed(rig)
        after = await asyncio.to_thread(scrape, coordinator.metrics_port)
        ingested = await asyncio.to_thread(scrape, ingester.metrics_port)
    assert after[handoff] == 1
    assert after[("liver_generation", job)] == 1
    assert after[("liver_handoff_downtime_seconds_count", job)] == 1
    assert after[("liver_handoff_downtime_seconds_sum", job)] == pytest.approx(out.downtime_s)
    assert after[("liver_bytes_moved_total", job)] == out.bytes_moved
    assert after[("liver_handoff_duration_seconds_count", (*job, ("outcome", "committed")))] == 1
    published = ("liver_service_stat", (("service", "coordinator"), ("stat", "published")))
    assert after[published] > before.get(published, 0)
    assert ingested[("liver_service_stat", (("service", "ingester"), ("stat", "resized")))] == 1


@pytest.mark.slow
async def test_the_committed_generations_plan_objects_and_slice_entries_are_deleted(rig: Rig) -> None:
    planned = await Collector.on(rig.nc, s.transfer_planned(rig.job))
    async with (
        running(CoordinatorService(settings(rig.job)), rig.url),
        running(Ingester(INGESTER), rig.url),
    ):
        await rig.start_world()
        await rig.live()
        warning = SpotWarning(
            job_id=rig.job, event_id="spot-1", node="node001", provider="aws", notice_s=NOTICE_S
        )
        await rig.publish(s.SPOT_WARNING, warning)
        await committed(rig)
        plan = await planned.one(TransferPlanned)
        index = plan.slices
        assert 0 < len(index.objects) < index.count, "both kinds of slice are stored (TRANSFER's limit)"
        store = await rig.js.object_store(s.OBJECT_STORE_PLANS)
        entries = await rig.js.key_value(s.KV_PLAN_SLICES)

        async def released() -> bool:
            try:
                infos = await store.list(ignore_deletes=True)
            except nats.js.errors.NotFoundError:  # nothing left in the store at all
                return True
            return not [i for i in infos if (i.name or "").startswith(f"{rig.job}/1/")]

        async def entry_missing(key: str) -> bool:
            try:
                await entries.get(key)
            except nats.js.errors.KeyNotFoundError:
                return True
            return False

        async def entries_released() -> bool:
            keys = [index.key(i) for i in range(index.count) if not index.in_objects(i)]
            return all([await entry_missing(k) for k in keys])

        await eventually(released, what="generation 1's plan file and slice objects deleted")
        await eventually(entries_released, what="generation 1's slice entries deleted")


@pytest.mark.slow
async def test_a_scale_request_adds_the_offered_node_to_the_world(rig: Rig) -> None:
    requests = await Collector.on(rig.nc, s.topology_request(rig.job))
    service = CoordinatorService(settings(rig.job))
    async with (
        running(service, rig.url),
        running(Ingester(INGESTER), rig.url),
    ):
        await rig.start_world()
        await rig.live()
        rig.workers.memory_bytes = 3 << 30
        await rig.workers.say_hello()

        def told(device: Device) -> bool:
            member = service.core.membership.on_device(device)
            return member is not None and member.memory_bytes == 3 << 30

        # The hellos and the request reach the coordinator by different paths: hellos first.
        await until(lambda: all(told(d) for d in (*WORLD, *SPARES)), what="the workers' memory recorded")
        request = ScaleRequest(
            job_id=rig.job,
            event_id="grow-1",
            reason="more capacity",
            add=(NodeDevices(node="node002", devices=(0, 1)),),
        )
        await rig.publish(s.SCALE_REQUEST, request)
        (out,) = await committed(rig)
    assert out.generation == 1
    assert set(out.placement.devices) == set(WORLD) | set(SPARES)
    asked = await requests.one(TopologyRequest)
    assert (asked.add, asked.device_memory_bytes) == (SPARES, 3 << 30), (
        "the workers' memory goes to the planner"
    )


@pytest.mark.slow
async def test_a_stale_ack_from_an_old_generation_does_not_advance_the_handoff(rig: Rig) -> None:
    rig.workers.ready.clear()
    service = CoordinatorService(settings(rig.job))
    async with running(service, rig.url) as hosted:
        await rig.start_world()
        await rig.live()
        await rig.publish(s.resize_requested(rig.job), resize(rig.job))
        await until(lambda: len(rig.workers.commands(Prepare, 1)) == len(WORLD), what="prepares")
        for device in WORLD:
            for phase, extra in (("ready", {}), ("switched", {"iteration": 1})):
                stale = WorkerStatus(
                    job_id=rig.job, worker_id=worker_id(device), generation=0, phase=phase, **extra
                )
                await rig.nc.publish(s.worker_status(rig.job), encode(stale))
        # Acks are read in order through one subscription: once the coordinator has rejected this one,
        # it has handled every stale ack before it.
        await rig.nc.publish(s.worker_status(rig.job), b"not json: a marker after the stale acks")
        await until(lambda: service.counts["worker_rejected"] == 1, what="the stale acks handled")
        await delivered(rig, hosted)
        assert not rig.workers.commands(Switch), "acks of generation 0 moved the handoff of generation 1"
        rig.workers.ready.set()
        (out,) = await committed(rig)
    assert out.generation == 1


@pytest.mark.slow
async def test_a_resize_request_stays_unacknowledged_until_its_handoff_ends(rig: Rig) -> None:
    rig.workers.ready.clear()
    async with running(CoordinatorService(settings(rig.job)), rig.url) as hosted:
        await rig.start_world()
        await rig.live()
        await rig.publish(s.resize_requested(rig.job), resize(rig.job))
        await until(lambda: len(rig.workers.commands(Prepare, 1)) == len(WORLD), what="prepares")
        info = await rig.js.consumer_info(s.STREAM_CONTROL.name, f"coordinator-{rig.job}")
        assert (info.num_ack_pending, hosted.service.stats()["held"]) == (1, 1)
        rig.workers.ready.set()
        await committed(rig)
        await eventually(rig.consumer_settled, what="the request is acknowledged once committed")
        assert hosted.service.stats()["held"] == 0


@pytest.mark.slow
async def test_a_coordinator_that_sees_another_write_the_record_stands_by(rig: Rig) -> None:
    requests = await Collector.on(rig.nc, s.topology_request(rig.job))
    service = CoordinatorService(settings(rig.job))
    async with running(service, rig.url) as hosted:
        await rig.start_world()
        await rig.live()
        store = await RecordStore.open(rig.js, rig.job)
        current = await store.read()
        assert current is not None
        usurped = msgspec.structs.replace(current.record, writer="usurper")
        write = await store.write(WriteRecord(record=usurped, expected_revision=current.revision))
        assert isinstance(write, RecordWritten)
        await until(lambda: service.core.phase is GenerationPhase.STANDBY, what="the coordinator stands by")
        await rig.publish(s.resize_requested(rig.job), resize(rig.job))
        # A window in which a coordinator that did not stand by would take the request; proving that
        # one never will is not possible, and a correct one passes however long the window lasts.
        await asyncio.sleep(0.5)
        await delivered(rig, hosted)
        info = await rig.js.consumer_info(s.STREAM_CONTROL.name, f"coordinator-{rig.job}")
    assert not requests.messages, "a coordinator standing by planned a handoff"
    assert info.num_pending + info.num_ack_pending == 1, (
        "the request is left unacknowledged for the one in charge"
    )
    assert service.core.record == usurped


@pytest.mark.slow
async def test_a_handoff_that_cannot_finish_in_time_aborts_on_its_own_and_says_why(rig: Rig) -> None:
    rig.workers.ready.clear()
    async with running(CoordinatorService(settings(rig.job)), rig.url):
        await rig.start_world()
        await rig.live()
        # Short enough to wait out, long enough for both planners to answer before the prepare deadline
        # (about 4.5 s from now) on a busy machine: the abort must come in the prepare phase.
        await rig.publish(s.resize_requested(rig.job), resize(rig.job, notice_s=6.0))
        (out,) = await aborted(rig)
        await eventually(rig.consumer_settled, what="the aborted request is acknowledged")
    assert (out.generation, out.active_generation, out.phase, out.outcome) == (
        1,
        0,
        "prepare",
        "kept_old_world",
    )
    assert "missed its deadline" in out.reason
    assert [c.generation for _, c in rig.workers.commands(Abort)] == [1] * len(WORLD)
    assert not rig.outcomes(rig.committed, GenerationCommitted)
    assert (await rig.record()).generation == 0


@pytest.mark.slow
async def test_the_same_event_twice_makes_one_handoff_and_both_copies_are_acknowledged(rig: Rig) -> None:
    async with running(CoordinatorService(settings(rig.job)), rig.url) as hosted:
        await rig.start_world()
        await rig.live()
        event = resize(rig.job)
        await rig.publish(s.resize_requested(rig.job), event)
        await rig.publish(s.resize_requested(rig.job), event)
        await committed(rig)
        await eventually(rig.consumer_settled, what="both copies acknowledged")
        await delivered(rig, hosted)
    assert len(rig.outcomes(rig.committed, GenerationCommitted)) == 1
    assert (await rig.record()).issued == 1


@pytest.mark.slow
async def test_a_copy_of_an_event_settled_by_a_predecessor_is_acknowledged_without_running_it(
    rig: Rig,
) -> None:
    # Issue 16, finding 1: the successor did not know an event its predecessor had settled.
    first = resize(rig.job)
    grow = msgspec.structs.replace(
        resize(rig.job, "evt-2"),
        trigger="scale_request",
        generation=1,
        keep=(),
        remove=(),
        add=SPARES,
        deadline=None,
    )
    async with running(CoordinatorService(settings(rig.job, instance_id="coord-a")), rig.url) as hosted:
        await rig.start_world()
        await rig.live()
        await rig.publish(s.resize_requested(rig.job), first)
        await committed(rig, 1)
        await rig.publish(s.resize_requested(rig.job), grow)
        await committed(rig, 2)
        await eventually(rig.consumer_settled, what="both events acknowledged")
        await delivered(rig, hosted)
    assert [e.event_id for e in (await rig.record()).settled] == ["evt-1", "evt-2"]
    async with running(CoordinatorService(settings(rig.job, instance_id="coord-b")), rig.url) as hosted:
        await rig.publish(s.resize_requested(rig.job), first)  # as the stream redelivers it
        await eventually(rig.consumer_settled, what="the copy acknowledged")
        await delivered(rig, hosted)
        assert hosted.service.core.phase is GenerationPhase.STABLE
    record = await rig.record()
    assert (record.generation, record.issued) == (2, 2)
    assert [type(m).__name__ for m in await rig.stored_outcomes()].count("GenerationAborted") == 0


@pytest.mark.slow
async def test_bad_input_is_reported_and_the_coordinator_carries_on(rig: Rig) -> None:
    async with running(CoordinatorService(settings(rig.job)), rig.url) as hosted:
        await rig.start_world()
        await rig.live()
        bad = json.loads(encode(resize(rig.job)))
        bad["remove"] = [{"node": "node001", "index": -1}]
        seq = await rig.publish(s.resize_requested(rig.job), json.dumps(bad).encode())
        other = await rig.publish(s.resize_requested(rig.job), resize("someone-else"))
        await rig.nc.publish(
            s.worker_heartbeat(rig.job), b'{"schema_version": 1, "kind": "worker_heartbeat"}'
        )
        await rig.nc.publish(s.worker_status(rig.job), b"not json")
        await rig.publish(s.resize_requested(rig.job), resize(rig.job))
        (out,) = await committed(rig)
        service = hosted.service
        assert isinstance(service, CoordinatorService)
        await until(lambda: service.counts["worker_rejected"] == 2, what="worker input rejected")
    assert out.generation == 1
    errors = {e.stream_sequence: e for e in error_events(rig.errors) if e.stream_sequence in (seq, other)}
    assert errors[seq].field == "$.remove[0].index"
    assert errors[other].field == "$.job_id"
    dead = await stored(rig.js, s.STREAM_DEAD_LETTERS.name, s.dead_letters("coordinator"))
    kept = {
        int(d.headers[s.HEADER_ORIGINAL_SEQUENCE])
        for d in dead
        if d.headers and s.HEADER_ORIGINAL_SEQUENCE in d.headers
    }
    assert {seq, other} <= kept


@pytest.mark.slow
async def test_bad_worker_input_becomes_an_error_event_and_a_dead_letter(rig: Rig) -> None:
    beat = b'{"schema_version": 1, "kind": "worker_heartbeat"}'
    async with running(CoordinatorService(settings(rig.job)), rig.url) as hosted:
        await rig.start_world()
        await rig.live()
        await rig.nc.publish(s.worker_heartbeat(rig.job), beat)
        await rig.nc.publish(s.worker_status(rig.job), b"not json")
        service = hosted.service
        assert isinstance(service, CoordinatorService)
        await until(lambda: service.counts["worker_rejected"] == 2, what="worker input rejected")
        await until(
            lambda: len([e for e in error_events(rig.errors) if e.stream_sequence is None]) == 2,
            what="error events for the worker input",
        )
    errors = {e.subject: e for e in error_events(rig.errors) if e.stream_sequence is None}
    assert errors[s.worker_heartbeat(rig.job)].field.startswith("$")
    assert errors[s.worker_status(rig.job)].payload == "not json"
    dead = await stored(rig.js, s.STREAM_DEAD_LETTERS.name, s.dead_letters("coordinator"))
    kept = {(d.headers or {}).get(s.HEADER_ORIGINAL_SUBJECT): d.data for d in dead}
    assert kept[s.worker_heartbeat(rig.job)] == beat
    assert kept[s.worker_status(rig.job)] == b"not json"


@pytest.mark.slow
async def test_two_coordinators_racing_to_commit_let_exactly_one_win(rig: Rig) -> None:
    """Both find the same handoff in its switch phase, re-send the switch, and get every ack."""
    store = await RecordStore.open(rig.js, rig.job)
    target = Placement(WORLD[:2])
    now = datetime.now(UTC)
    pending = PendingHandoff(
        generation=1,
        phase="switch",
        event_id="evt-1",
        triggers=(Trigger(event_id="evt-1", kind="spot_warning", received_at=now, remove=WORLD[2:]),),
        began_at=now,
        deadline=now + timedelta(seconds=30),
        layout=ParallelLayout(tp=2, pp=1, dp=1),
        placement=target,
        participants=tuple(Participant(worker_id=worker_id(d), device=d) for d in WORLD),
    )
    record = GenerationRecord(
        job_id=rig.job,
        writer="gone",
        generation=0,
        layout=LAYOUT,
        placement=Placement(WORLD),
        issued=1,
        pending=pending,
    )
    assert isinstance(await store.write(WriteRecord(record=record, expected_revision=0)), RecordWritten)
    for device in WORLD:
        rig.workers.prepared.setdefault(1, set()).add(worker_id(device))
    rig.workers.switched.clear()
    first = CoordinatorService(settings(rig.job, instance_id="coord-a", durable="coord-a"))
    second = CoordinatorService(settings(rig.job, instance_id="coord-b", durable="coord-b"))
    async with running(first, rig.url) as one, running(second, rig.url) as two:
        await until(
            lambda: len(rig.workers.commands(Switch, 1)) == 2 * len(WORLD), what="both sent the switch"
        )
        rig.workers.switched.set()
        await committed(rig)
        await until(
            lambda: GenerationPhase.STANDBY in (first.core.phase, second.core.phase),
            what="the loser stands by",
        )
        await delivered(rig, one, two)
    winner, loser = (first, second) if first.core.phase is GenerationPhase.STABLE else (second, first)
    assert (winner.core.phase, loser.core.phase) == (GenerationPhase.STABLE, GenerationPhase.STANDBY)
    assert (winner.counts["published"], loser.counts["published"]) == (1, 0)
    assert len(rig.outcomes(rig.committed, GenerationCommitted)) == 1
    assert not rig.outcomes(rig.aborted, GenerationAborted)
    stored_record = await rig.record()
    assert (stored_record.generation, stored_record.writer) == (1, winner.settings.instance_id)


# -- killed mid-handoff ------------------------------------------------------------------------------------


@contextlib.contextmanager
def coordinator_process(rig: Rig, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``liver serve coordinator`` for the rig's job, as its own process (killed at the end if alive)."""
    config = tmp_path / "coordinator.json"
    config.write_text(
        json.dumps(
            {
                "ack_wait_s": 2.0,
                "progress_every_s": 0.5,
                "retry_delay_s": 0.1,
                "core": msgspec.to_builtins(CORE),
            }
        )
    )
    env = {
        **os.environ,
        URL_ENV: rig.url,
        JOB_ENV: rig.job,
        INSTANCE_ENV: "coord-killed",
        CONFIG_ENV: str(config),
        "LIVER_LOG_FORMAT": "json",
    }
    with open(tmp_path / "coordinator.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "liver.cli.serve_cmd", "coordinator"], env=env, stdout=out, stderr=out
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


PROCESS_START_S = 180.0
"""A new interpreter importing LiveR and connecting, on a busy machine."""


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL


@pytest.mark.slow
async def test_a_coordinator_killed_while_preparing_is_succeeded_by_one_that_aborts_and_replans(
    rig: Rig, tmp_path: Path
) -> None:
    rig.workers.ready.clear()
    with coordinator_process(rig, tmp_path) as proc:
        await rig.start_world()
        await rig.live(timeout_s=PROCESS_START_S)
        await rig.publish(s.resize_requested(rig.job), resize(rig.job))
        await until(lambda: len(rig.workers.commands(Prepare, 1)) == len(WORLD), what="prepares sent")
        kill(proc)
    async with running(CoordinatorService(settings(rig.job, instance_id="coord-next")), rig.url) as hosted:
        (gone,) = await aborted(rig)
        rig.workers.ready.set()
        (out,) = await committed(rig)
        await eventually(
            rig.consumer_settled, what="the request, redelivered after the kill, is acknowledged"
        )
        await delivered(rig, hosted)
    assert (gone.generation, gone.outcome, gone.phase) == (1, "kept_old_world", "prepare")
    assert "restarted before the switch" in gone.reason
    assert (out.generation, out.previous_generation, out.event_id) == (2, 0, "evt-1")
    assert [(type(m).__name__, m.generation) for m in await rig.stored_outcomes()] == [
        ("GenerationCommitted", 2),
        ("GenerationAborted", 1),
    ]
    assert len(rig.outcomes(rig.aborted, GenerationAborted)) == 1
    assert len(rig.outcomes(rig.committed, GenerationCommitted)) == 1
    assert {w for w, _ in rig.workers.commands(Abort, 1)} == {worker_id(d) for d in WORLD}


@pytest.mark.slow
async def test_a_coordinator_killed_after_the_switch_is_succeeded_by_one_that_completes_it(
    rig: Rig, tmp_path: Path
) -> None:
    rig.workers.switched.clear()
    with coordinator_process(rig, tmp_path) as proc:
        await rig.start_world()
        await rig.live(timeout_s=PROCESS_START_S)
        await rig.publish(s.resize_requested(rig.job), resize(rig.job))
        await until(lambda: len(rig.workers.commands(Switch, 1)) == len(WORLD), what="switch sent")
        kill(proc)
    record = await rig.record()
    assert record.pending is not None and record.pending.phase == "switch"
    async with running(CoordinatorService(settings(rig.job, instance_id="coord-next")), rig.url) as hosted:
        await until(lambda: len(rig.workers.commands(Switch, 1)) == 2 * len(WORLD), what="switch again")
        rig.workers.switched.set()
        (out,) = await committed(rig)
        await eventually(
            rig.consumer_settled, what="the request, redelivered after the kill, is acknowledged"
        )
        await delivered(rig, hosted)
    assert (out.generation, out.event_id) == (1, "evt-1")
    assert [(type(m).__name__, m.generation) for m in await rig.stored_outcomes()] == [
        ("GenerationCommitted", 1)
    ]
    assert len(rig.outcomes(rig.committed, GenerationCommitted)) == 1
    assert not rig.outcomes(rig.aborted, GenerationAborted)


@pytest.mark.slow
async def test_the_status_endpoint_reports_the_jobs_phase_and_generation(rig: Rig) -> None:
    async with running(CoordinatorService(settings(rig.job)), rig.url):
        await rig.start_world()
        await rig.live()
        reply = await rig.nc.request(status_subject("coordinator"), b"", timeout=WAIT_S)
    status = json.loads(reply.data)
    assert (status["job_id"], status["phase"], status["generation"], status["workers"]) == (
        rig.job,
        "stable",
        0,
        len(WORLD) + len(SPARES),
    )
