"""The generation coordinator's state machine, driven event by event with a fake clock and a fake KV.

The driver below stands in for the adapter: it applies compare-and-set writes to an in-memory bucket,
answers planning requests with simple stub planners, and acks commands as the workers of the job would
(only when told to, so that each test stops exactly where its behaviour happens).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from msgspec.structs import replace

from liver.reshard.plan import slice_devices
from liver.services.coordinator import (
    TRANSITIONS,
    WAITS,
    Action,
    BusReconnected,
    Coordinator,
    CoordinatorConfig,
    CoordinatorError,
    ExpectTransfer,
    GenerationPhase,
    GenerationRecord,
    IllegalTransition,
    Note,
    PlanningFailed,
    ProbeWorkers,
    Publish,
    RecordConflict,
    RecordObserved,
    RecordWriteFailed,
    RecordWritten,
    ReleasePlan,
    RequestTopology,
    SendCommand,
    Settle,
    Tick,
    TopologyRequest,
    Wait,
    WorkerLost,
    WorkersProbed,
    WorldStarted,
    WriteMembership,
    WriteRecord,
)
from liver.shared.codec import MessageError, decode, encode
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.messages import (
    Abort,
    Candidate,
    GenerationAborted,
    GenerationCommitted,
    Heartbeat,
    Hello,
    ObjectRef,
    PlanSummary,
    Prepare,
    ResizeRequested,
    SliceIndex,
    Switch,
    TopologyPlanned,
    TransferPlanned,
    WorkerPlanRef,
    WorkerStatus,
)
from liver.shared.model import PRESETS
from liver.shared.subjects import plan_object_name

NOW = datetime(2026, 1, 2, 12, 0, tzinfo=UTC)
JOB = "job-1"
MODEL = PRESETS["llama3-8b"]
CONFIG = CoordinatorConfig(heartbeat_timeout_s=30.0)
WORLD = grid_devices(2, 2)
"""node000:0, node000:1, node001:0, node001:1: generation 0 runs TP2 x DP2 on them."""
LAYOUT = ParallelLayout(tp=2, pp=1, dp=2)
SPARES = grid_devices(3, 2)[4:]
"""node002:0, node002:1: alive, in no world, offered by scale-outs."""
MiB = 1 << 20

A = TypeVar("A", bound=Action)


def worker(device: Device) -> str:
    return f"w-{device.node}-{device.index}"


def on_node(node: str, devices: tuple[Device, ...] = WORLD + SPARES) -> tuple[Device, ...]:
    return tuple(d for d in devices if d.node == node)


# -- stub planners --------------------------------------------------------------------------------------


def plan_topology(request: TopologyRequest) -> TopologyPlanned | PlanningFailed:
    """Keeps every surviving device and takes every offered one, one DP replica each."""
    gone = set(request.remove) | set(request.lost)
    devices = sorted([d for d in request.placement.devices if d not in gone] + list(request.add))
    if request.target_devices is not None:
        devices = devices[: request.target_devices]
    if not devices:
        return PlanningFailed(
            job_id=request.job_id,
            event_id=request.event_id,
            generation=request.generation,
            stage="topology",
            reason="no device left",
        )
    layout = ParallelLayout(tp=1, pp=1, dp=len(devices))
    return TopologyPlanned(
        job_id=request.job_id,
        event_id=request.event_id,
        from_generation=request.from_generation,
        generation=request.generation,
        model=MODEL.geometry(),
        from_layout=request.layout,
        from_placement=request.placement,
        layout=layout,
        placement=Placement(tuple(devices)),
        candidates=(Candidate(layout=layout, score=1.0, fits=True),),
        explanation="stub: every surviving and offered device, one replica each",
        deadline=request.deadline,
    )


def plan_transfer(
    topology: TopologyPlanned,
    max_receive_bytes: int = MiB,
    verified: bool = True,
    slices: SliceIndex | None = None,
) -> TransferPlanned:
    devices = slice_devices(topology.from_placement, topology.placement)
    g = topology.generation
    return TransferPlanned(
        job_id=topology.job_id,
        event_id=topology.event_id,
        from_generation=topology.from_generation,
        generation=g,
        plan=ObjectRef(bucket="liver-plans", name=plan_object_name(JOB, g), size=4096),
        workers=tuple(
            WorkerPlanRef(
                device=d,
                ref=ObjectRef(bucket="liver-plans", name=plan_object_name(JOB, g, worker(d)), size=64),
            )
            for d in devices
        ),
        slices=slices
        or SliceIndex(bucket="liver-plans", prefix=plan_object_name(JOB, g, "s1") + "-", count=len(devices)),
        summary=PlanSummary(
            tasks=8,
            tasks_coalesced=4,
            rounds=1,
            bytes_moved=4 * max_receive_bytes,
            bytes_local=0,
            bytes_rank_order=8 * max_receive_bytes,
            lower_bound_bytes=4 * max_receive_bytes,
            max_receive_bytes=max_receive_bytes,
            verified=verified,
            plan_seconds=0.01,
        ),
    )


# -- the adapter stand-in ----------------------------------------------------------------------------------


class FakeKV:
    """One key of a JetStream KV bucket: compare-and-set on the revision, 0 = create."""

    def __init__(self) -> None:
        self.record: GenerationRecord | None = None
        self.revision = 0
        self.history: list[GenerationRecord] = []

    def cas(self, write: WriteRecord) -> RecordWritten | RecordConflict:
        if write.expected_revision != self.revision:
            return RecordConflict(stored=self.record, revision=self.revision)
        self.record, self.revision = write.record, self.revision + 1
        self.history.append(write.record)
        return RecordWritten(revision=self.revision)


class Driver:
    """Feeds one coordinator and keeps what it asked for until a test (or :meth:`run`) answers it."""

    def __init__(
        self, kv: FakeKV | None = None, config: CoordinatorConfig = CONFIG, now: datetime = NOW
    ) -> None:
        self.kv = kv or FakeKV()
        self.config = config
        self.instances = 1
        self.core = Coordinator(JOB, instance_id=self._instance(), config=config)
        self.now = now
        self.pending: list[Action] = []
        self.log: list[Action] = []
        self.seq: dict[str, int] = {}

    def _instance(self) -> str:
        return f"coordinator-{id(self) % 100_000}-{self.instances}"

    # feeding

    def feed(self, event: Any, after_s: float = 0.0) -> list[Action]:
        self.now += timedelta(seconds=after_s)
        return self._keep(self.core.handle(event, self.now))

    def _keep(self, out: list[Action]) -> list[Action]:
        # Every test of this file checks the phase -> wait table after every input it feeds.
        assert self.core.wait in WAITS[self.core.phase], f"{self.core.phase} waiting for {self.core.wait}"
        self.log.extend(out)
        self.pending.extend(
            a
            for a in out
            if isinstance(a, WriteRecord | RequestTopology | ExpectTransfer | SendCommand | ProbeWorkers)
        )
        return out

    def restart(self) -> list[Action]:
        """A new coordinator process: what was in flight is lost, the bucket is what it is."""
        assert self.kv.record is not None
        self.instances += 1
        self.core = Coordinator(JOB, instance_id=self._instance(), config=self.config)
        self.pending = []
        return self._keep(self.core.restore(self.kv.record, self.kv.revision, self.now))

    def take_over(self) -> list[Action]:
        """This (standing-by) coordinator takes the job over from the stored record."""
        assert self.kv.record is not None
        self.pending = []
        return self._keep(self.core.restore(self.kv.record, self.kv.revision, self.now))

    def rival_writes(self) -> None:
        """Another coordinator writes the record (the same value under its own name)."""
        assert self.kv.record is not None
        self.kv.cas(
            WriteRecord(record=replace(self.kv.record, writer="rival"), expected_revision=self.kv.revision)
        )

    def tick(self, after_s: float = 0.0) -> list[Action]:
        return self.feed(Tick(), after_s)

    def wait(self, seconds: float) -> list[Action]:
        """Time passes with every known worker beating just before the tick."""
        self.now += timedelta(seconds=seconds)
        for member in list(self.core.membership):
            self.beat(member.device)
        return self.tick()

    # inputs

    def hello(self, device: Device, generation: int | None = None, rank: int | None = None) -> list[Action]:
        return self.feed(
            Hello(
                job_id=JOB,
                worker_id=worker(device),
                device=device,
                address=f"{device.node}:{29500 + device.index}",
                generation=generation,
                rank=rank,
            )
        )

    def beat(
        self,
        device: Device,
        seq: int | None = None,
        iteration: int | None = None,
        generation: int | None = None,
        rank: int | None = None,
        broken: bool = False,
    ) -> list[Action]:
        w = worker(device)
        self.seq[w] = self.seq.get(w, 0) + 1 if seq is None else seq
        return self.feed(
            Heartbeat(
                job_id=JOB,
                worker_id=w,
                device=device,
                address=f"{device.node}:{29500 + device.index}",
                seq=self.seq[w],
                iteration=iteration,
                generation=generation,
                rank=rank,
                broken=broken,
            )
        )

    def warn(self, event_id: str, node: str, notice_s: float = 120.0, after_s: float = 0.0) -> list[Action]:
        self.now += timedelta(seconds=after_s)
        return self.feed(
            ResizeRequested(
                job_id=JOB,
                event_id=event_id,
                trigger="spot_warning",
                generation=0,
                reason=f"{node} reclaimed",
                remove=on_node(node),
                deadline=self.now + timedelta(seconds=notice_s),
            )
        )

    def rebalance(self, event_id: str, node: str) -> list[Action]:
        """A spot warning of kind rebalance, as the ingester resolves it: no deadline."""
        return self.feed(
            ResizeRequested(
                job_id=JOB,
                event_id=event_id,
                trigger="rebalance",
                generation=0,
                reason=f"aws recommends moving off node {node} (rebalance)",
                remove=on_node(node),
            )
        )

    def scale(self, event_id: str, add: tuple[Device, ...] = (), target: int | None = None) -> list[Action]:
        return self.feed(
            ResizeRequested(
                job_id=JOB,
                event_id=event_id,
                trigger="scale_request",
                generation=0,
                reason="planned",
                add=add,
                target_devices=target,
            )
        )

    def status(
        self, device_or_worker: Device | str, generation: int, phase: str, **fields: Any
    ) -> list[Action]:
        w = worker(device_or_worker) if isinstance(device_or_worker, Device) else device_or_worker
        return self.feed(WorkerStatus(job_id=JOB, worker_id=w, generation=generation, phase=phase, **fields))

    # answering what the core asked for

    def pop(self, kind: type[A], where: Callable[[A], bool] = lambda _: True) -> A:
        for i, action in enumerate(self.pending):
            if isinstance(action, kind) and where(action):
                return self.pending.pop(i)  # type: ignore[return-value]
        raise AssertionError(
            f"nothing pending of {kind.__name__}; pending: {[type(a).__name__ for a in self.pending]}"
        )

    def has(self, kind: type[Action]) -> bool:
        return any(isinstance(a, kind) for a in self.pending)

    def write(self) -> list[Action]:
        return self.feed(self.kv.cas(self.pop(WriteRecord)))

    def topology(self, planner: Callable[[TopologyRequest], Any] = plan_topology) -> list[Action]:
        return self.feed(planner(self.pop(RequestTopology).request))

    def transfer(self, **fields: Any) -> list[Action]:
        return self.feed(plan_transfer(self.pop(ExpectTransfer).topology, **fields))

    def commands(self, kind: type) -> list[SendCommand]:
        found = [a for a in self.pending if isinstance(a, SendCommand) and isinstance(a.command, kind)]
        self.pending = [a for a in self.pending if a not in found]
        return found

    def probe(self, gone: tuple[Device, ...] = (), silent: tuple[Device, ...] = ()) -> list[Action]:
        """Answer the pending probe: the workers on ``gone`` have no subscriber, those on ``silent``
        do not answer in time, the others answer."""
        probes = [a for a in self.pending if isinstance(a, ProbeWorkers)]
        assert probes, "no probe pending"
        action = probes[-1]  # the latest: the core waits for no other
        self.pending = [a for a in self.pending if not isinstance(a, ProbeWorkers)]
        gone_ids, silent_ids = {worker(d) for d in gone}, {worker(d) for d in silent}
        return self.feed(
            WorkersProbed(
                probe=action.probe,
                generation=action.generation,
                gone=tuple(w for w in action.worker_ids if w in gone_ids),
                silent=tuple(w for w in action.worker_ids if w in silent_ids),
                answered=tuple(w for w in action.worker_ids if w not in gone_ids | silent_ids),
                gone_devices=tuple(d for d in action.devices if d in gone),
            )
        )

    def ready(self, skip: tuple[str, ...] = ()) -> None:
        for cmd in self.commands(Prepare):
            for w in self.takers(cmd):
                if w not in skip:
                    self.status(w, cmd.command.generation, "ready")

    def takers(self, cmd: SendCommand) -> list[str]:
        """The workers that act on a broadcast Prepare: those on a device of either world, not lost."""
        assert cmd.worker_id is None and isinstance(cmd.command, Prepare)
        p = cmd.command
        out = []
        for device in slice_devices(p.from_placement, p.placement):
            member = self.core.membership.on_device(device)
            if device not in p.lost and member is not None:
                out.append(member.worker_id)
        return out

    def participants(self) -> list[str]:
        assert self.kv.record is not None and self.kv.record.pending is not None
        return [p.worker_id for p in self.kv.record.pending.participants]

    def switched(self, skip: tuple[str, ...] = (), iteration: int = 100, **fields: Any) -> None:
        (cmd,) = self.commands(Switch)
        for w in self.participants():
            if w not in skip:
                self.status(w, cmd.command.generation, "switched", iteration=iteration, **fields)

    def answer_next(self) -> bool:
        """Answer the first thing waiting, as a healthy system would; ``False`` when nothing waits."""
        if self.has(ProbeWorkers):
            self.probe()
        elif self.has(WriteRecord):
            self.write()
        elif self.has(RequestTopology):
            self.topology()
        elif self.has(ExpectTransfer):
            self.transfer()
        elif any(isinstance(a, SendCommand) and isinstance(a.command, Prepare) for a in self.pending):
            self.ready()
        elif any(isinstance(a, SendCommand) and isinstance(a.command, Switch) for a in self.pending):
            self.switched()
        elif self.pending:
            self.pending.clear()
        else:
            return False
        return True

    def run(self) -> None:
        """Answer everything, as a healthy system would, until nothing is left to answer."""
        for _ in range(1000):
            if not self.answer_next():
                return
        raise AssertionError("the coordinator never settled")

    # reading what happened

    def published(self, kind: type | None = None) -> list[Any]:
        return [
            a.message
            for a in self.log
            if isinstance(a, Publish) and (kind is None or isinstance(a.message, kind))
        ]

    def notes(self, event: str) -> list[Note]:
        return [a for a in self.log if isinstance(a, Note) and a.event == event]

    def sent(self, kind: type, since: int = 0) -> list[SendCommand]:
        return [a for a in self.log[since:] if isinstance(a, SendCommand) and isinstance(a.command, kind)]

    def settled(self) -> list[Settle]:
        return [a for a in self.log if isinstance(a, Settle)]

    def phases(self) -> list[tuple[str, str]]:
        return [(a.value, b.value) for a, b, _ in self.core.history]


def started(config: CoordinatorConfig = CONFIG, kv: FakeKV | None = None) -> Driver:
    """A job whose generation 0 is live on WORLD, with the spare node's workers registered too."""
    d = Driver(kv=kv, config=config)
    for rank, device in enumerate(WORLD):
        d.hello(device, generation=0, rank=rank)
    for device in SPARES:
        d.hello(device)
    d.feed(WorldStarted(job_id=JOB, generation=0, layout=LAYOUT, placement=Placement(WORLD)))
    d.write()
    return d


def one_outcome_per_generation(messages: list[Any]) -> dict[int, Any]:
    """Every generation has at most one outcome; a re-publication is the very same message."""
    outcomes: dict[int, Any] = {}
    for message in messages:
        first = outcomes.setdefault(message.generation, message)
        assert first == message, f"generation {message.generation}: {first} and then {message}"
    return outcomes


# -- the world --------------------------------------------------------------------------------------------


def test_first_world_is_recorded_before_the_coordinator_is_stable() -> None:
    d = Driver()
    d.feed(WorldStarted(job_id=JOB, generation=0, layout=LAYOUT, placement=Placement(WORLD)))
    assert d.core.phase is GenerationPhase.DOWN and d.core.wait is Wait.WORLD_WRITE
    write = d.pending[0]
    assert isinstance(write, WriteRecord) and write.expected_revision == 0
    d.write()
    assert d.core.phase is GenerationPhase.STABLE
    assert d.kv.record is not None and (d.kv.record.generation, d.kv.record.issued) == (0, 0)


def test_world_started_while_a_world_is_live_is_ignored() -> None:
    d = started()
    d.feed(WorldStarted(job_id=JOB, generation=5, layout=LAYOUT, placement=Placement(WORLD)))
    assert not d.has(WriteRecord) and d.notes("world_started_ignored")


def test_every_phase_table_entry_names_only_phases() -> None:
    assert set(TRANSITIONS) == set(GenerationPhase)
    assert all(targets <= set(GenerationPhase) for targets in TRANSITIONS.values())


def test_undeclared_transition_is_refused() -> None:
    core = Coordinator(JOB, instance_id="solo", config=CONFIG)
    core.handle(Tick(), NOW)
    with pytest.raises(IllegalTransition):
        core._move(GenerationPhase.COMMITTED, "skipping the handoff")


# -- the happy path, transition by transition -----------------------------------------------------------


def test_spot_warning_walks_every_phase_from_stable_to_committed_and_back() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.run()
    assert d.phases() == [
        ("down", "stable"),
        ("stable", "prepare"),
        ("prepare", "ready"),
        ("ready", "switch"),
        ("switch", "committed"),
        ("committed", "cleanup"),
        ("cleanup", "stable"),
    ]
    (committed,) = d.published(GenerationCommitted)
    assert (committed.generation, committed.previous_generation, committed.event_id) == (1, 0, "evt-1")
    assert set(committed.placement.devices) == set(on_node("node000"))
    assert d.kv.record is not None and d.kv.record.generation == 1 and d.kv.record.pending is None
    assert [(s.event_ids, s.outcome, s.generation) for s in d.settled()] == [(("evt-1",), "committed", 1)]


def test_handoff_begins_with_a_recorded_generation_before_any_request() -> None:
    d = started()
    out = d.warn("evt-1", "node001")
    assert [type(a) for a in out if not isinstance(a, Note)] == [WriteRecord]
    write = d.pending[0]
    assert isinstance(write, WriteRecord)
    assert write.record.issued == 1 and write.record.pending is not None
    assert (write.record.pending.generation, write.record.pending.phase) == (1, "prepare")
    assert (d.core.phase, d.core.wait) == (GenerationPhase.PREPARE, Wait.BEGIN_WRITE)
    d.write()
    request = d.pop(RequestTopology).request
    assert set(request.remove) == set(on_node("node001")) and request.lost == ()
    assert request.generation == 1 and request.from_generation == 0


def test_one_prepare_is_broadcast_with_both_worlds_and_where_the_slices_are() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.write()
    d.topology()
    d.transfer()
    (cmd,) = d.commands(Prepare)
    p = cmd.command
    assert cmd.worker_id is None  # the job-wide subject
    assert isinstance(p, Prepare)
    assert (p.generation, p.from_generation) == (1, 0)
    assert p.from_placement == Placement(tuple(WORLD)) and p.lost == ()
    assert p.slices == SliceIndex(
        bucket="liver-plans", prefix=plan_object_name(JOB, 1, "s1") + "-", count=len(WORLD)
    )
    assert p.deadline <= d.now + timedelta(seconds=120 - CONFIG.margin_s)
    assert sorted(d.takers(cmd)) == sorted(worker(dev) for dev in WORLD)


def test_a_lost_worker_of_the_old_world_is_named_in_the_prepare_and_takes_no_part() -> None:
    d = started()
    d.feed(WorkerLost(worker_id=worker(WORLD[3]), reason="node terminated"))
    d.write()
    d.topology()
    d.transfer()
    (cmd,) = d.commands(Prepare)
    p = cmd.command
    assert isinstance(p, Prepare)
    assert WORLD[3] in p.from_placement.devices and p.lost == (WORLD[3],)
    assert worker(WORLD[3]) not in d.takers(cmd)


def test_prepare_names_the_store_of_the_worker_that_runs_the_new_rank_0() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.write()
    d.topology()
    d.transfer()
    (cmd,) = d.commands(Prepare)
    rank0 = cmd.command.placement.devices[0]
    assert cmd.command.store == f"{rank0.node}:{29500 + rank0.index}"


def test_switch_is_sent_only_after_the_switch_intent_is_recorded() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.write()
    d.topology()
    d.transfer()
    d.ready()
    assert (d.core.phase, d.core.wait) == (GenerationPhase.READY, Wait.SWITCH_WRITE)
    assert not d.sent(Switch)
    intent = d.pending[-1]
    assert isinstance(intent, WriteRecord) and intent.record.pending is not None
    assert intent.record.pending.phase == "switch" and len(intent.record.pending.participants) == 4
    d.write()
    assert d.core.phase is GenerationPhase.SWITCH and len(d.sent(Switch)) == 1


def test_commit_is_published_only_after_its_compare_and_set_succeeds() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.write()
    d.topology()
    d.transfer()
    d.ready()
    d.write()
    d.switched()
    assert d.core.wait is Wait.COMMIT_WRITE and not d.published()
    d.write()
    assert len(d.published(GenerationCommitted)) == 1


def test_commit_reports_the_cut_the_pause_and_the_bytes_received() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.write()
    d.topology()
    d.transfer()
    d.ready()
    d.write()
    assert len(d.commands(Switch)) == 1
    for i, w in enumerate(d.participants()):
        d.status(w, 1, "switched", iteration=500, pause_s=0.5 + i, bytes_received=1000 * i)
    d.write()
    (committed,) = d.published(GenerationCommitted)
    assert committed.started_at_iteration == 500
    assert committed.downtime_s == 3.5
    assert committed.bytes_moved == 1000 * (0 + 1 + 2 + 3)


def test_switch_acks_that_disagree_on_the_cut_are_reported() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.write()
    d.topology()
    d.transfer()
    d.ready()
    d.write()
    d.commands(Switch)
    for i, w in enumerate(d.participants()):
        d.status(w, 1, "switched", iteration=500 + (i == 0))
    assert d.notes("switch_cut_disagrees")


def test_scale_out_brings_the_offered_devices_into_the_new_world() -> None:
    d = started()
    d.scale("evt-1", add=SPARES)
    d.run()
    (committed,) = d.published(GenerationCommitted)
    assert set(committed.placement.devices) == set(WORLD + SPARES)
    assert committed.layout.world_size == 6


def test_cleanup_releases_the_committed_generations_plan_objects_by_name() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.run()
    (release,) = [a for a in d.log if isinstance(a, ReleasePlan)]
    assert release.generation == 1 and release.bucket == "liver-plans"
    prefix = plan_object_name(JOB, 1, "s1") + "-"
    slices = [f"{prefix}{i:05d}" for i in range(len(WORLD))]
    assert release.objects == (plan_object_name(JOB, 1), *slices)  # by name: no listing of the store


def test_cleanup_releases_slice_entries_by_their_key_pattern_and_slice_objects_by_name() -> None:
    d = started()
    d.warn("evt-1", "node001")
    index = SliceIndex(
        bucket="liver-plans",
        prefix=plan_object_name(JOB, 1, "s1") + "-",
        count=len(WORLD),
        kv_bucket="liver-slices",
        objects=(1,),
    )
    while not d.has(ExpectTransfer):
        d.write() if d.has(WriteRecord) else d.topology()
    d.transfer(slices=index)
    d.run()
    (release,) = [a for a in d.log if isinstance(a, ReleasePlan)]
    assert release.objects == (plan_object_name(JOB, 1), index.name(1))
    assert (release.kv_bucket, release.kv_keys) == ("liver-slices", f"{JOB}.1.s1.*")


# -- aborts -----------------------------------------------------------------------------------------------


def handoff_prepared(d: Driver, event: str = "evt-1", node: str = "node001", notice_s: float = 120.0) -> None:
    """Run a warning up to the point where every participant has its Prepare."""
    d.warn(event, node, notice_s=notice_s)
    d.write()
    d.topology()
    d.transfer()


def test_worker_failing_to_prepare_aborts_and_keeps_the_old_world() -> None:
    d = started()
    handoff_prepared(d)
    d.status(WORLD[0], 1, "failed", error="out of memory building the shadow world")
    assert d.core.phase is GenerationPhase.ABORTED and not d.published()
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "kept_old_world" and aborted.phase == "prepare"
    assert "out of memory" in aborted.reason and aborted.active_generation == 0
    assert [(c.command.generation, c.command.fallback) for c in d.sent(Abort)] == [(1, False)]
    assert d.core.phase is GenerationPhase.STABLE
    assert d.kv.record is not None and d.kv.record.generation == 0 and d.kv.record.live
    assert [(s.outcome, s.generation) for s in d.settled()] == [("aborted", 1)]


def test_missed_prepare_deadline_aborts_and_says_why() -> None:
    d = started()
    handoff_prepared(d, notice_s=20.0)
    d.ready(skip=(worker(WORLD[3]),))
    d.tick(after_s=12.0)
    assert d.core.phase is GenerationPhase.PREPARE
    d.tick(after_s=1.5)
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert "missed its deadline" in aborted.reason and aborted.outcome == "kept_old_world"
    assert not d.sent(Switch)


def test_notice_too_short_for_any_switch_aborts_at_once() -> None:
    d = started()
    d.warn("evt-1", "node001", notice_s=CONFIG.margin_s + 1.0)
    d.write()
    assert d.core.phase is GenerationPhase.ABORTED
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert "deadline" in aborted.reason
    assert not d.has(RequestTopology)


def test_plan_too_big_for_the_time_left_aborts_before_any_prepare() -> None:
    d = started()
    d.warn("evt-1", "node001", notice_s=60.0)
    d.write()
    d.topology()
    d.transfer(max_receive_bytes=int(100 * CONFIG.bandwidth_bytes_per_s))
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert "s are left before the deadline" in aborted.reason
    assert not d.sent(Prepare)


def test_switch_deadline_missed_falls_back_to_the_checkpoint() -> None:
    d = started()
    handoff_prepared(d, notice_s=40.0)
    d.ready()
    d.write()
    d.switched(skip=(worker(WORLD[2]),))
    d.wait(36.0)
    assert d.core.phase is GenerationPhase.ABORTED
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "checkpoint_fallback" and aborted.phase == "switch"
    assert "3 of 4 participants switched" in aborted.reason
    assert d.core.phase is GenerationPhase.DOWN
    assert d.kv.record is not None and not d.kv.record.live and d.kv.record.generation == 0


def test_worker_failing_during_the_switch_falls_back_to_the_checkpoint() -> None:
    d = started()
    handoff_prepared(d)
    d.ready()
    d.write()
    d.commands(Switch)
    d.status(WORLD[1], 1, "failed", error="NCCL timeout")
    assert d.core.phase is GenerationPhase.SWITCH  # first: is a member gone?
    d.probe()  # every member answers
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "checkpoint_fallback" and "NCCL timeout" in aborted.reason
    assert [(s.outcome, s.generation) for s in d.settled()] == [("checkpoint_fallback", 1)]
    # Workers waiting for a live recovery hear that none comes.
    assert [(c.command.generation, c.command.fallback) for c in d.sent(Abort)] == [(1, True)]


def test_a_fallback_world_reported_before_the_abort_is_recorded_is_adopted_after_it() -> None:
    d = started()
    handoff_prepared(d)
    d.ready()
    d.write()
    d.commands(Switch)
    d.status(
        WORLD[1], 1, "failed", error="old rank gone; falling back to the last checkpoint", falling_back=True
    )
    assert d.core.phase is GenerationPhase.ABORTED
    d.feed(WorldStarted(job_id=JOB, generation=2, layout=LAYOUT, placement=Placement(WORLD)))
    assert d.notes("world_started_deferred") and not d.notes("world_started_ignored")
    d.write()  # the abort lands: DOWN, then the deferred world is recorded
    d.write()
    assert d.core.phase is GenerationPhase.STABLE
    assert d.kv.record is not None and d.kv.record.live and d.kv.record.generation == 2


def test_a_world_reported_during_a_handoff_that_keeps_the_old_world_is_dropped() -> None:
    d = started()
    handoff_prepared(d)
    d.feed(WorldStarted(job_id=JOB, generation=2, layout=LAYOUT, placement=Placement(WORLD)))
    d.status(WORLD[0], 1, "failed", error="out of memory building the shadow world")
    d.write()
    assert d.core.phase is GenerationPhase.STABLE
    assert d.kv.record is not None and d.kv.record.generation == 0 and not d.has(WriteRecord)


def test_topology_planning_failure_aborts_keeping_the_old_world() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.write()
    request = d.pop(RequestTopology).request
    d.feed(
        PlanningFailed(job_id=JOB, event_id="evt-1", generation=1, stage="topology", reason="no layout fits")
    )
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "kept_old_world" and "no layout fits" in aborted.reason
    assert request.generation == aborted.generation


def test_lost_world_worker_starts_a_handoff_that_falls_back_when_it_cannot_be_planned() -> None:
    d = started()
    d.feed(WorkerLost(worker_id=worker(WORLD[3]), reason="node terminated"))
    assert d.core.phase is GenerationPhase.PREPARE
    d.write()
    request = d.pop(RequestTopology).request
    assert request.lost == (WORLD[3],)
    d.feed(plan_topology(request))
    d.pop(ExpectTransfer)
    d.feed(
        PlanningFailed(
            job_id=JOB, event_id=request.event_id, generation=1, stage="transfer", reason="no source"
        )
    )
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "checkpoint_fallback"
    assert d.core.phase is GenerationPhase.DOWN


def test_unverified_plan_aborts() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.write()
    d.topology()
    d.transfer(verified=False)
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert "verification" in aborted.reason


def test_planner_that_keeps_the_live_world_settles_the_trigger_as_no_change() -> None:
    d = started()
    d.scale("evt-1", target=3)
    d.write()

    def unchanged(request: TopologyRequest) -> TopologyPlanned:
        planned = plan_topology(request)
        assert isinstance(planned, TopologyPlanned)
        return replace(planned, layout=request.layout, placement=request.placement)

    d.topology(unchanged)
    d.write()
    assert [s.outcome for s in d.settled()] == ["no_change"]
    assert d.core.phase is GenerationPhase.STABLE


def test_planner_placing_ranks_on_removed_devices_aborts_without_replanning() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.write()

    def careless(request: TopologyRequest) -> TopologyPlanned | PlanningFailed:
        return plan_topology(replace(request, remove=()))

    d.topology(careless)
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert "removed devices" in aborted.reason
    assert d.core.phase is GenerationPhase.STABLE and not d.has(WriteRecord)


# -- queued events ------------------------------------------------------------------------------------------


def test_scale_out_during_a_handoff_waits_and_runs_next() -> None:
    d = started()
    handoff_prepared(d)
    d.scale("evt-2", add=SPARES)
    assert d.core.queued == ("evt-2",) and d.core.pending_generation == 1
    d.run()
    committed = d.published(GenerationCommitted)
    assert [c.generation for c in committed] == [1, 2]
    assert set(committed[1].placement.devices) == set(on_node("node000") + SPARES)
    assert committed[1].previous_generation == 1


def test_event_arriving_before_the_target_is_known_is_queued_then_checked() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.scale("evt-2", add=SPARES)
    assert d.core.queued == ("evt-2",)
    d.run()
    assert [c.generation for c in d.published(GenerationCommitted)] == [1, 2]


def test_event_already_served_by_the_pending_target_is_folded_into_it() -> None:
    d = started()
    handoff_prepared(d)
    d.warn("evt-2", "node001")
    assert d.core.queued == ()
    d.run()
    assert [c.generation for c in d.published(GenerationCommitted)] == [1]
    assert [s.event_ids for s in d.settled()] == [("evt-1", "evt-2")]


def test_folded_warning_with_an_earlier_deadline_tightens_the_handoff() -> None:
    d = started()
    handoff_prepared(d, notice_s=120.0)
    d.warn("evt-2", "node001", notice_s=20.0)
    d.tick(after_s=14.0)
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert "missed its deadline" in aborted.reason


def test_queued_trigger_that_no_longer_changes_anything_is_settled_as_such() -> None:
    d = started()
    handoff_prepared(d)
    d.scale("evt-2", add=SPARES)
    d.warn("evt-3", "node002")
    assert d.core.queued == ("evt-2",)
    d.run()
    assert [c.generation for c in d.published(GenerationCommitted)] == [1]
    assert [(s.event_ids, s.outcome) for s in d.settled()] == [
        (("evt-1", "evt-3"), "committed"),
        (("evt-2",), "no_change"),
    ]


def test_offer_made_after_a_warning_brings_the_node_back() -> None:
    d = started()
    d.warn("evt-1", "node002")
    d.scale("evt-2", add=SPARES)
    d.run()
    (committed,) = d.published(GenerationCommitted)
    assert set(committed.placement.devices) == set(WORLD + SPARES)


# -- cancel and re-plan ------------------------------------------------------------------------------------


def test_warning_for_a_node_of_the_target_cancels_and_replans() -> None:
    d = started()
    d.scale("evt-1", add=SPARES)
    d.write()
    d.topology()
    d.transfer()
    d.warn("evt-2", "node000")
    assert d.core.phase is GenerationPhase.ABORTED
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.generation == 1 and aborted.outcome == "kept_old_world"
    assert "cancelled" in aborted.reason and "node000" in aborted.reason
    assert d.core.phase is GenerationPhase.PREPARE and d.core.pending_generation == 2
    d.run()
    (committed,) = d.published(GenerationCommitted)
    assert committed.generation == 2 and committed.previous_generation == 0
    assert set(committed.placement.devices) == set(on_node("node001") + SPARES)
    assert [(s.event_ids, s.outcome) for s in d.settled()] == [(("evt-1", "evt-2"), "committed")]


def test_a_rebalance_for_a_node_of_the_target_waits_for_the_handoff_in_flight() -> None:
    d = started()
    d.scale("evt-1", add=SPARES)
    d.write()
    d.topology()
    d.transfer()
    d.rebalance("evt-2", "node000")
    assert d.core.phase is GenerationPhase.PREPARE and d.core.queued == ("evt-2",)
    assert d.published(GenerationAborted) == [], "a recommendation does not cancel work under way"
    d.run()
    first, second = d.published(GenerationCommitted)
    assert (first.generation, first.event_id) == (1, "evt-1")
    assert set(first.placement.devices) == set(WORLD + SPARES)
    assert (second.generation, second.event_id) == (2, "evt-2")
    assert not {d.node for d in second.placement.devices} & {"node000"}


def test_a_rebalance_alone_moves_the_job_off_the_node_with_the_budget_of_an_undated_trigger() -> None:
    d = started()
    d.rebalance("evt-1", "node001")
    assert d.core.phase is GenerationPhase.PREPARE
    d.write()
    assert d.kv.record is not None and d.kv.record.pending is not None
    budget = timedelta(seconds=d.core.config.default_handoff_s)
    assert d.kv.record.pending.deadline == d.now + budget
    d.run()
    (committed,) = d.published(GenerationCommitted)
    assert {d.node for d in committed.placement.devices} == {"node000"}


def test_warning_for_the_offered_node_cancels_the_offer_and_leaves_nothing_to_do() -> None:
    d = started()
    d.scale("evt-1", add=SPARES)
    d.write()
    d.topology()
    d.transfer()
    d.warn("evt-2", "node002")
    d.run()
    cancelled, answered = d.published()
    assert (type(cancelled).__name__, cancelled.replanned_event_ids) == ("GenerationAborted", ("evt-1",))
    assert (type(answered).__name__, answered.event_ids) == ("GenerationAborted", ("evt-1", "evt-2"))
    assert answered.outcome == "kept_old_world" and "nothing to change" in answered.reason
    assert [(s.event_ids, s.outcome) for s in d.settled()] == [(("evt-1", "evt-2"), "no_change")]
    assert d.core.phase is GenerationPhase.STABLE and d.kv.record is not None and d.kv.record.generation == 0


def test_losing_a_target_worker_before_the_switch_cancels_and_replans_without_it() -> None:
    d = started()
    d.scale("evt-1", add=SPARES)
    d.write()
    d.topology()
    d.transfer()
    d.ready(skip=(worker(SPARES[1]),))
    d.feed(WorkerLost(worker_id=worker(SPARES[1]), reason="instance terminated"))
    d.run()
    assert [(m.generation, type(m).__name__) for m in d.published()] == [
        (1, "GenerationAborted"),
        (2, "GenerationCommitted"),
    ]
    (committed,) = d.published(GenerationCommitted)
    assert SPARES[1] not in committed.placement.devices and SPARES[0] in committed.placement.devices


def test_losing_an_old_world_worker_before_the_switch_replans_from_the_survivors() -> None:
    d = started()
    handoff_prepared(d)
    d.feed(WorkerLost(worker_id=worker(WORLD[0]), reason="kernel panic"))
    d.write()
    d.write()
    request = d.pop(RequestTopology).request
    assert request.generation == 2 and request.lost == (WORLD[0],)


def spares_ready(d: Driver) -> None:
    """Run a scale-out onto both spares up to the point where every participant is ready."""
    d.scale("evt-1", add=SPARES)
    d.write()
    d.topology()
    d.transfer()
    d.ready()


def test_impossible_target_during_the_switch_intent_write_aborts_without_switching() -> None:
    d = started()
    spares_ready(d)
    assert d.core.wait is Wait.SWITCH_WRITE
    d.warn("evt-2", "node000")
    assert d.core.phase is GenerationPhase.READY and d.notes("stop_deferred")
    d.write()
    assert not d.sent(Switch) and d.core.phase is GenerationPhase.ABORTED
    d.run()
    assert [(m.generation, type(m).__name__) for m in d.published()] == [
        (1, "GenerationAborted"),
        (2, "GenerationCommitted"),
    ]
    assert d.published(GenerationAborted)[0].outcome == "kept_old_world"


def test_missing_worker_for_a_planned_device_cancels_and_replans() -> None:
    d = started()
    d.scale("evt-1", add=(*SPARES, Device("node009", 0)))
    d.run()
    (committed,) = d.published(GenerationCommitted)
    assert Device("node009", 0) not in committed.placement.devices
    assert [m.generation for m in d.published(GenerationAborted)] == [1]


# -- after the switch ---------------------------------------------------------------------------------------


def switching(d: Driver, event: str = "evt-1", node: str = "node001") -> None:
    handoff_prepared(d, event, node)
    d.ready()
    d.write()


def test_losing_an_old_world_worker_during_the_switch_recovers_live_around_it() -> None:
    d = started()
    switching(d)
    d.feed(WorkerLost(worker_id=worker(WORLD[3]), reason="node reclaimed early"))
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "live_recovery" and aborted.phase == "switch"
    assert aborted.event_ids == () and aborted.replanned_event_ids == ("evt-1",)
    assert [(c.command.generation, c.command.fallback) for c in d.sent(Abort)] == [(1, False)]
    # The survivors hold the cut's state: the same event is planned again from the old world, without
    # the lost device, as the next generation.
    assert d.core.phase is GenerationPhase.PREPARE and d.core.pending_generation == 2
    d.write()
    request = d.pop(RequestTopology).request
    assert (request.from_generation, request.lost) == (0, (WORLD[3],))
    assert "evt-1" in request.event_ids
    assert d.kv.record is not None and d.kv.record.live and d.kv.record.generation == 0


def test_a_participant_lost_after_another_acked_its_switch_commits_then_recovers_live() -> None:
    d = started()
    switching(d)
    (prepare,) = d.sent(Prepare)
    lost = prepare.command.placement.devices[-1]  # a member of the new world
    # Every other participant acked: the commit, a collective of all of them, is done.
    d.switched(skip=(worker(lost),))
    assert d.core.phase is GenerationPhase.SWITCH
    d.feed(WorkerLost(worker_id=worker(lost), reason="died in its first step on the new world"))
    d.write()
    (committed,) = d.published(GenerationCommitted)
    assert committed.generation == 1 and lost in committed.placement.devices
    assert not d.published(GenerationAborted)
    # The loss is one in the new world: its survivors move live around it.
    d.write()
    request = d.pop(RequestTopology).request
    assert (request.from_generation, request.generation, request.lost) == (1, 2, (lost,))


def test_a_leaver_lost_after_a_participant_acked_its_switch_changes_nothing() -> None:
    d = started()
    switching(d)
    d.status(WORLD[0], 1, "switched", iteration=100)  # the commit happened: WORLD[3] took part
    d.feed(WorkerLost(worker_id=worker(WORLD[3]), reason="node reclaimed early"))
    d.switched(skip=(worker(WORLD[0]), worker(WORLD[3])))
    d.write()
    (committed,) = d.published(GenerationCommitted)
    assert committed.generation == 1 and not d.published(GenerationAborted)


def test_a_new_world_that_lost_a_peer_before_its_commit_was_recorded_finds_it_sooner() -> None:
    d = started()
    switching(d)
    (prepare,) = d.sent(Prepare)
    target = prepare.command.placement.devices
    lost = target[-1]
    d.switched(skip=(worker(lost),))
    d.status(target[0], 1, "peer_lost")  # its first step on the new world failed
    d.probe(silent=(lost,))
    d.now += timedelta(seconds=CONFIG.suspect_timeout_s + 0.5)
    for dev in WORLD + SPARES:
        if dev != lost:
            d.beat(dev)
    d.tick()
    if d.has(ProbeWorkers):
        d.probe()
    d.write()
    (committed,) = d.published(GenerationCommitted)
    assert committed.generation == 1
    d.write()
    assert d.pop(RequestTopology).request.lost == (lost,)


def test_a_joiner_whose_handoff_broke_on_the_loss_has_the_old_worlds_silent_worker_found_sooner() -> None:
    d = started()
    spares_ready(d)
    d.write()
    assert d.core.phase is GenerationPhase.SWITCH and worker(SPARES[0]) in d.participants()
    d.status(SPARES[0], 0, "peer_lost")  # its handoff's old world (generation 0) lost a member
    d.now += timedelta(seconds=CONFIG.suspect_timeout_s + 0.5)
    for dev in WORLD[:3] + SPARES:
        d.beat(dev)
    d.tick()
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "live_recovery" and str(WORLD[3]) in aborted.reason


def test_leaving_worker_gone_after_acking_its_switch_is_harmless() -> None:
    d = started()
    switching(d)
    assert len(d.commands(Switch)) == 1
    leaving = worker(WORLD[3])
    d.status(leaving, 1, "switched", iteration=10)
    d.feed(WorkerLost(worker_id=leaving, reason="node reclaimed"))
    for w in d.participants():
        if w != leaving:
            d.status(w, 1, "switched", iteration=10)
    d.write()
    assert [c.generation for c in d.published(GenerationCommitted)] == [1]


def test_target_clash_during_the_switch_waits_for_the_commit() -> None:
    d = started()
    switching(d)
    d.warn("evt-2", "node000")
    assert d.core.phase is GenerationPhase.SWITCH and d.core.queued == ("evt-2",)
    d.run()
    assert [c.generation for c in d.published(GenerationCommitted)] == [1]
    assert [a.generation for a in d.published(GenerationAborted)] == [2]


# -- the bus restarting mid-handoff (issue 16, finding 3) -------------------------------------------------


def test_a_reconnect_while_waiting_for_ready_sends_the_same_prepare_again() -> None:
    d = started()
    handoff_prepared(d)
    (first,) = d.commands(Prepare)
    d.feed(BusReconnected())
    (again,) = d.commands(Prepare)
    assert again.command == first.command
    d.pending.append(again)
    d.run()
    assert [c.generation for c in d.published(GenerationCommitted)] == [1]
    assert not d.published(GenerationAborted)


def test_a_reconnect_during_the_switch_sends_the_switch_again() -> None:
    d = started()
    switching(d)
    (first,) = d.commands(Switch)
    d.feed(BusReconnected())
    (again,) = d.commands(Switch)
    assert again.command == first.command
    d.pending.append(again)
    d.run()
    assert [c.generation for c in d.published(GenerationCommitted)] == [1]


def test_a_reconnect_with_no_handoff_sends_nothing() -> None:
    d = started()
    assert not [a for a in d.feed(BusReconnected()) if isinstance(a, SendCommand)]


def test_heartbeats_from_the_new_world_complete_a_switch_whose_acks_were_lost() -> None:
    d = started()
    switching(d)
    d.commands(Switch)  # delivered, but every ack is lost with the bus
    pending = d.kv.record.pending if d.kv.record is not None else None
    assert pending is not None and pending.placement is not None
    new_rank = {device: rank for rank, device in enumerate(pending.placement.devices)}
    for p in pending.participants:
        if p.device in new_rank:
            d.beat(p.device, iteration=100, generation=1, rank=new_rank[p.device])
        else:
            d.beat(p.device, iteration=100)  # left: in no world any more
    d.write()
    (committed,) = d.published(GenerationCommitted)
    assert (committed.generation, committed.started_at_iteration) == (1, 100)
    assert not d.published(GenerationAborted)


def test_a_heartbeat_still_in_the_old_world_is_not_taken_for_a_switch() -> None:
    d = started()
    switching(d)
    d.commands(Switch)
    for rank, device in enumerate(WORLD):
        d.beat(device, iteration=99, generation=0, rank=rank)
    assert d.core.phase is GenerationPhase.SWITCH and not d.published()


def test_loss_once_everyone_switched_does_not_stop_the_commit() -> None:
    d = started()
    switching(d)
    d.switched()
    d.feed(WorkerLost(worker_id=worker(WORLD[0]), reason="died right after"))
    d.write()
    assert [c.generation for c in d.published(GenerationCommitted)] == [1]
    assert d.core.pending_generation == 2


# -- stale and duplicate input --------------------------------------------------------------------------


def test_stale_ack_from_a_cancelled_generation_is_ignored_and_reported() -> None:
    d = started()
    d.scale("evt-1", add=SPARES)
    d.write()
    d.topology()
    d.transfer()
    d.commands(Prepare)
    d.warn("evt-2", "node000")
    d.write()
    d.write()
    d.topology()
    d.transfer()
    (cmd,) = d.commands(Prepare)
    for dev in WORLD:
        d.status(dev, 1, "ready")
    assert len(d.notes("stale_ack_ignored")) == 4 and d.core.wait is Wait.PREPARED
    for w in d.takers(cmd):
        d.status(w, 2, "ready")
    assert d.core.phase is GenerationPhase.READY


def test_ack_from_a_worker_outside_the_handoff_is_ignored() -> None:
    d = started()
    handoff_prepared(d)
    d.status(SPARES[0], 1, "ready")
    assert d.notes("ack_from_outsider_ignored")
    d.ready()
    assert d.core.phase is GenerationPhase.READY


def test_repeated_ready_ack_counts_once() -> None:
    d = started()
    handoff_prepared(d)
    (cmd,) = d.commands(Prepare)
    takers = d.takers(cmd)
    for _ in range(len(takers)):
        d.status(takers[0], 1, "ready")
    assert d.core.wait is Wait.PREPARED


def test_duplicate_event_starts_no_second_handoff() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.warn("evt-1", "node001")
    d.run()
    d.warn("evt-1", "node001")
    assert [c.generation for c in d.published(GenerationCommitted)] == [1]
    assert len(d.notes("duplicate_event_ignored")) == 2
    assert d.core.phase is GenerationPhase.STABLE and d.kv.record is not None and d.kv.record.issued == 1


def test_stale_plan_for_another_generation_is_ignored() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.write()
    request = d.pop(RequestTopology).request
    d.feed(plan_topology(replace(request, generation=7)))
    assert d.notes("stale_plan_ignored") and d.core.wait is Wait.TOPOLOGY


def test_switched_ack_before_any_switch_is_reported() -> None:
    d = started()
    handoff_prepared(d)
    d.status(WORLD[0], 1, "switched", iteration=3)
    assert d.notes("switched_before_switch") and d.core.phase is GenerationPhase.PREPARE


def test_input_for_another_job_is_rejected_naming_the_field() -> None:
    d = started()
    d.feed(
        ResizeRequested(
            job_id="job-2",
            event_id="evt-x",
            trigger="scale_request",
            generation=0,
            reason="r",
            target_devices=2,
        )
    )
    (note,) = d.notes("input_rejected")
    assert note.fields["field"] == "job_id" and d.core.phase is GenerationPhase.STABLE


def test_presence_contradicting_membership_is_rejected_naming_the_field() -> None:
    d = started()
    d.feed(Hello(job_id=JOB, worker_id=worker(WORLD[0]), device=WORLD[1], address="x:1"))
    (note,) = d.notes("input_rejected")
    assert note.fields["field"] == "device"


def test_a_heartbeat_that_overtakes_its_hello_changes_nothing_and_warns_nothing() -> None:
    d = started()
    holder = worker(WORLD[0])
    d.feed(Heartbeat(job_id=JOB, worker_id="fresh", device=WORLD[0], address="x:1", seq=0))
    assert d.core.membership.on_device(WORLD[0]).worker_id == holder  # type: ignore[union-attr]
    assert not d.notes("input_rejected") and d.notes("heartbeat_before_hello")
    d.feed(Hello(job_id=JOB, worker_id="fresh", device=WORLD[0], address="x:1"))
    d.feed(Heartbeat(job_id=JOB, worker_id="fresh", device=WORLD[0], address="x:1", seq=1))
    assert d.core.membership.on_device(WORLD[0]).worker_id == "fresh"  # type: ignore[union-attr]
    assert not d.notes("input_rejected")


# -- compare-and-set --------------------------------------------------------------------------------------


def test_losing_the_begin_write_stands_down_and_sends_nothing() -> None:
    d = started()
    d.warn("evt-1", "node001")
    rival = d.kv.record
    assert rival is not None
    d.kv.cas(WriteRecord(record=rival, expected_revision=d.kv.revision))
    mark = len(d.log)
    d.write()
    assert d.core.phase is GenerationPhase.STANDBY
    assert not [
        a for a in d.log[mark:] if isinstance(a, SendCommand | Publish | RequestTopology | WriteRecord)
    ]
    assert d.core.revision == d.kv.revision


def test_losing_the_commit_write_stands_down_without_publishing() -> None:
    d = started()
    switching(d)
    d.switched()
    assert d.kv.record is not None
    d.kv.cas(WriteRecord(record=d.kv.record, expected_revision=d.kv.revision))
    d.write()
    assert d.core.phase is GenerationPhase.STANDBY and not d.published()


def test_two_coordinators_racing_commit_the_generation_exactly_once() -> None:
    kv = FakeKV()
    a = started(kv=kv)
    b = Driver(kv=kv)
    for rank, device in enumerate(WORLD):
        b.hello(device, generation=0, rank=rank)
    b.restart()
    a.warn("evt-1", "node001")
    b.warn("evt-1", "node001")
    for _ in range(20):
        a.run()
        b.run()
    outcomes = one_outcome_per_generation(a.published() + b.published())
    assert {g: type(m).__name__ for g, m in outcomes.items()} == {1: "GenerationCommitted"}
    assert sorted([a.core.phase, b.core.phase], key=lambda p: p.value) == [
        GenerationPhase.STABLE,
        GenerationPhase.STANDBY,
    ]


def test_write_with_an_unknown_result_is_retried_and_recognised_when_it_had_landed() -> None:
    d = started()
    d.warn("evt-1", "node001")
    first = d.pop(WriteRecord)
    d.kv.cas(first)
    d.feed(RecordWriteFailed(error="timeout"))
    retry = d.pending[-1]
    assert retry == first
    d.write()
    assert d.notes("write_found_landed") and d.core.wait is Wait.TOPOLOGY


def test_record_written_by_another_coordinator_makes_this_one_stand_down() -> None:
    d = started()
    handoff_prepared(d)
    assert d.kv.record is not None
    other = d.kv.record
    d.feed(RecordObserved(record=other, revision=d.kv.revision + 1))
    assert d.core.phase is GenerationPhase.STANDBY
    d.ready()
    assert not d.has(WriteRecord) and not d.sent(Switch)


def test_own_write_seen_by_the_watch_is_not_mistaken_for_a_rival() -> None:
    d = started()
    d.warn("evt-1", "node001")
    write = d.pending[0]
    assert isinstance(write, WriteRecord)
    d.feed(RecordObserved(record=write.record, revision=d.kv.revision + 1))
    assert d.core.phase is GenerationPhase.PREPARE
    d.write()
    d.feed(RecordObserved(record=write.record, revision=d.kv.revision))
    assert d.core.phase is GenerationPhase.PREPARE


# -- restart and restore ----------------------------------------------------------------------------------


def test_restore_with_nothing_pending_is_stable_and_republishes_the_last_outcome() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.run()
    d.restart()
    assert d.core.phase is GenerationPhase.STABLE
    assert len(d.published(GenerationCommitted)) == 2
    one_outcome_per_generation(d.published())


def test_restore_before_the_switch_aborts_once_and_replans_the_same_triggers() -> None:
    d = started()
    handoff_prepared(d)
    d.restart()
    assert [c.command.generation for c in d.sent(Abort)] == []
    d.write()
    assert [c.command.generation for c in d.sent(Abort)] == [1]
    for device in WORLD:
        d.beat(device)
    d.run()
    assert [(m.generation, type(m).__name__) for m in d.published()] == [
        (1, "GenerationAborted"),
        (2, "GenerationCommitted"),
    ]
    assert d.published(GenerationCommitted)[0].event_id == "evt-1"
    d.warn("evt-1", "node001")
    assert d.notes("duplicate_event_ignored")


def test_after_a_restart_a_broken_world_awaits_its_silent_member_only_the_suspicion_window() -> None:
    """The survivors' ``peer_lost`` went out while the coordinator was down: their heartbeats still say
    their world broke, and a device not heard from since the restart is lost ``suspect_timeout_s`` later,
    not at the end of the restart's full heartbeat window."""
    d = started()
    handoff_prepared(d)
    d.restart()
    d.write()
    for rank, dev in enumerate(WORLD[:3]):
        d.beat(dev, generation=0, rank=rank, broken=True)
    assert len(d.notes("world_lost_a_peer")) == 1  # the first broken word of the generation, once
    d.probe(silent=(WORLD[3],))  # the three that beat answer; nothing is heard of WORLD[3]
    d.now += timedelta(seconds=CONFIG.suspect_timeout_s + 0.5)
    for rank, dev in enumerate(WORLD[:3]):
        d.beat(dev, generation=0, rank=rank, broken=True)
    d.tick()
    assert CONFIG.suspect_timeout_s + 0.5 < CONFIG.heartbeat_timeout_s
    (lost,) = d.notes("worker_lost")
    assert lost.fields["device"] == str(WORLD[3]), lost


def test_after_a_restart_before_the_switch_a_device_no_record_names_is_asked_by_its_place() -> None:
    """No record names the worker of a device of the world before the switch: the probe asks the device
    itself, and one with no worker on the bus is lost in a round trip."""
    d = started()
    handoff_prepared(d)
    d.restart()
    d.write()
    for rank, dev in enumerate(WORLD[:3]):
        d.beat(dev, generation=0, rank=rank)
    d.beat(WORLD[0], generation=0, rank=0, broken=True)
    (probe,) = [a for a in d.pending if isinstance(a, ProbeWorkers)]
    assert probe.devices == (WORLD[3],) and worker(WORLD[3]) not in probe.worker_ids
    d.probe(gone=(WORLD[3],))
    (lost,) = d.notes("worker_lost")
    assert lost.fields["device"] == str(WORLD[3]) and "no worker on" in lost.fields["why"], lost


def test_a_broken_heartbeat_heard_before_the_record_is_restored_does_not_use_up_the_word() -> None:
    """The adapter subscribes before it reads the record: a broken heartbeat can reach a core with no
    record yet. It is dropped as stale, and the next one, after the restore, is acted on."""
    d = started()
    handoff_prepared(d)
    assert d.kv.record is not None
    d.instances += 1
    d.core = Coordinator(JOB, instance_id=d._instance(), config=d.config)
    d.pending = []
    d.beat(WORLD[0], generation=0, rank=0, broken=True)
    assert not d.notes("world_lost_a_peer")
    d._keep(d.core.restore(d.kv.record, d.kv.revision, d.now))
    d.write()
    d.beat(WORLD[0], generation=0, rank=0, broken=True)
    assert len(d.notes("world_lost_a_peer")) == 1


def test_a_broken_heartbeat_of_a_world_whose_loss_is_known_asks_nothing_more() -> None:
    d = started()
    d.status(WORLD[0], 0, "peer_lost")
    d.probe(gone=(WORLD[3],))
    d.write()
    d.beat(WORLD[1], generation=0, rank=1, broken=True)
    assert len(d.notes("world_lost_a_peer")) == 1 and not d.has(ProbeWorkers)


def test_restore_after_the_switch_intent_resumes_and_commits_once() -> None:
    d = started()
    switching(d)
    d.restart()
    d.write()  # the claim on the record lands: only then is the switch sent again
    assert d.core.phase is GenerationPhase.SWITCH and len(d.sent(Switch)) == 2
    for dev in WORLD:
        d.beat(dev)
    d.commands(Switch)
    d.pending.append(SendCommand(command=Switch(job_id=JOB, generation=1, deadline=d.now)))
    d.switched()
    d.write()
    assert [(m.generation, type(m).__name__) for m in d.published()] == [(1, "GenerationCommitted")]


def _switch_intent_landed_unheard(kv: FakeKV) -> Driver:
    """A coordinator whose switch intent reached the bucket while it heard only a timeout: it retries."""
    d = started(kv=kv)
    handoff_prepared(d)
    d.ready()
    kv.cas(d.pop(WriteRecord))
    d.feed(RecordWriteFailed(error="timeout"))
    assert d.has(WriteRecord) and not d.sent(Switch)
    return d


def test_a_coordinator_restored_after_the_switch_intent_claims_the_record_before_it_switches() -> None:
    kv = FakeKV()
    _switch_intent_landed_unheard(kv)
    restored = Driver(kv=kv)
    restored.restart()
    assert restored.core.phase is GenerationPhase.SWITCH and restored.core.wait is Wait.RESUME_WRITE
    assert restored.has(WriteRecord) and not restored.sent(Switch)
    restored.write()
    assert [c.command.generation for c in restored.sent(Switch)] == [1]


@pytest.mark.parametrize("first", ["restored", "unheard"])
def test_no_abort_keeps_the_old_world_of_a_switch_that_a_restored_coordinator_sent(first: str) -> None:
    """Two coordinators both think they own a handoff past its switch intent, and the first one gets a
    stop (a warning about a target device). Whichever next write lands first owns the job; the other
    stands down, so a generation whose switch went out is never aborted as keeping the old world."""
    kv = FakeKV()
    unheard = _switch_intent_landed_unheard(kv)
    restored = Driver(kv=kv)
    restored.restart()
    unheard.warn("evt-2", "node000")  # removes a target device: the stop waits for the switch write
    if first == "restored":
        restored.write()
        unheard.write()  # its retry meets the restored coordinator's claim
        assert unheard.core.phase is GenerationPhase.STANDBY and not unheard.published(GenerationAborted)
        assert [c.command.generation for c in restored.sent(Switch)] == [1]
    else:
        unheard.write()  # its intent found landed; the deferred stop writes the abort
        unheard.write()
        (aborted,) = unheard.published(GenerationAborted)
        assert aborted.generation == 1 and aborted.outcome == "kept_old_world"
        restored.write()  # the claim meets the abort
        assert restored.core.phase is GenerationPhase.STANDBY and not restored.sent(Switch)
    assert not unheard.sent(Switch)


def test_a_commit_resumed_after_a_restart_purges_the_generations_slice_entries_by_prefix() -> None:
    d = started()
    switching(d)
    d.restart()
    d.write()  # the claim on the record lands: only then is the switch sent again
    for dev in WORLD:
        d.beat(dev)
    d.commands(Switch)
    d.pending.append(SendCommand(command=Switch(job_id=JOB, generation=1, deadline=d.now)))
    d.switched()
    d.write()
    (release,) = [a for a in d.log if isinstance(a, ReleasePlan)]
    assert (release.generation, release.objects) == (1, ())
    assert (release.kv_bucket, release.kv_keys) == ("liver-slices", f"{JOB}.1.>")


def test_restore_after_the_switch_with_a_silent_participant_falls_back() -> None:
    d = started()
    switching(d)
    d.restart()
    d.write()  # the claim on the record lands: only then is the switch sent again
    d.now += timedelta(seconds=CONFIG.heartbeat_timeout_s + 1)
    for rank, dev in enumerate(WORLD[:3]):
        d.beat(dev, generation=0, rank=rank)  # nobody is known to have switched: no commit is certain
    d.tick()
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "checkpoint_fallback" and "restart" in aborted.reason


def test_restore_after_a_fallback_waits_for_a_newer_world() -> None:
    d = started()
    switching(d)
    d.status(WORLD[0], 1, "failed", error="boom", falling_back=True)
    d.write()
    d.restart()
    assert d.core.phase is GenerationPhase.DOWN
    d.feed(WorldStarted(job_id=JOB, generation=1, layout=LAYOUT, placement=Placement(WORLD)))
    assert not d.has(WriteRecord) and d.notes("input_rejected")
    d.feed(WorldStarted(job_id=JOB, generation=2, layout=LAYOUT, placement=Placement(WORLD)))
    d.write()
    assert d.core.phase is GenerationPhase.STABLE and d.kv.record is not None and d.kv.record.generation == 2


def test_restore_refuses_a_record_of_another_job() -> None:
    d = started()
    assert d.kv.record is not None
    other = GenerationRecord(
        job_id="job-2", writer="elsewhere", generation=0, layout=LAYOUT, placement=Placement(WORLD), issued=0
    )
    with pytest.raises(CoordinatorError, match="job_id"):
        Coordinator(JOB, instance_id="solo", config=CONFIG).restore(other, 1, NOW)


def test_restore_refuses_a_running_coordinator() -> None:
    d = started()
    assert d.kv.record is not None
    with pytest.raises(CoordinatorError):
        d.core.restore(d.kv.record, d.kv.revision, d.now)


@pytest.mark.parametrize("write_landed", [False, True], ids=["write-lost", "write-landed"])
@pytest.mark.parametrize("crash_after", range(10))
def test_restart_at_any_step_ends_each_generation_exactly_once(crash_after: int, write_landed: bool) -> None:
    d = started()
    d.warn("evt-1", "node001")
    steps = 0
    while steps < crash_after and (d.pending or d.core.phase is not GenerationPhase.STABLE):
        d.answer_next()
        steps += 1
    if write_landed and d.has(WriteRecord):
        d.kv.cas(d.pop(WriteRecord))
    d.restart()
    for dev in WORLD:
        d.beat(dev)
    if not any("evt-1" in s.event_ids for s in d.settled()):
        d.warn("evt-1", "node001")
    d.run()
    outcomes = one_outcome_per_generation(d.published())
    assert [type(outcomes[g]).__name__ for g in sorted(outcomes)][-1] == "GenerationCommitted"
    assert d.kv.record is not None and d.kv.record.pending is None
    assert set(d.kv.record.placement.devices) == set(on_node("node000"))


def test_a_request_redelivered_long_after_its_commit_is_not_run_again_by_a_restarted_coordinator() -> None:
    # Issue 16, finding 1: a restarted coordinator knew only the last outcome's event, took a redelivered
    # older request for a new one, and ran it a second time.
    d = started()
    d.warn("evt-1", "node001")
    d.run()
    d.scale("evt-2", add=on_node("node001"))
    d.run()
    assert [c.generation for c in d.published(GenerationCommitted)] == [1, 2]
    d.restart()
    d.run()
    d.warn("evt-1", "node001")  # the stream redelivers evt-1: its acknowledgement was lost
    d.run()
    assert d.core.phase is GenerationPhase.STABLE
    assert [c.generation for c in d.published(GenerationCommitted)] == [1, 2, 2], "only the re-publication"
    assert d.kv.record is not None and d.kv.record.generation == 2
    assert set(on_node("node001")) <= set(d.kv.record.placement.devices)
    assert ("evt-1", "committed", 1) in [
        (i, s.outcome, s.generation) for s in d.settled() for i in s.event_ids
    ]


def test_the_record_keeps_the_latest_settled_events_and_no_more() -> None:
    config = replace(CONFIG, record_settled_events=2)
    d = started(config)
    for i, node in enumerate(("node001", "node000")):
        d.warn(f"evt-{i}", node) if i == 0 else d.scale(f"evt-{i}", add=SPARES)
        d.run()
    d.scale("evt-9", add=SPARES)  # changes nothing now: settled with the next record write
    d.run()
    d.warn("evt-3", "node002")
    d.run()
    assert d.kv.record is not None
    assert [(e.event_id, e.outcome) for e in d.kv.record.settled] == [
        ("evt-9", "no_change"),
        ("evt-3", "committed"),
    ]


def test_a_commit_names_every_event_merged_into_it() -> None:
    # Issue 16, finding 2: only the first trigger's id was in the outcome.
    d = started()
    d.scale("evt-1", add=SPARES)
    d.write()
    d.topology()
    d.transfer()
    d.warn("evt-2", "node000")
    d.run()
    (aborted,) = d.published(GenerationAborted)
    assert (aborted.event_ids, aborted.replanned_event_ids) == ((), ("evt-1",))
    (committed,) = d.published(GenerationCommitted)
    assert committed.event_ids == ("evt-1", "evt-2") and committed.event_id == "evt-1"


def test_an_event_that_changes_nothing_gets_an_outcome_of_its_own_that_names_it() -> None:
    d = started()
    d.scale("evt-1", add=on_node("node000"))  # already the job's devices
    d.run()
    (answer,) = d.published()
    assert isinstance(answer, GenerationAborted)
    assert (answer.event_ids, answer.generation, answer.active_generation) == (("evt-1",), 1, 0)
    assert d.kv.record is not None and (d.kv.record.generation, d.kv.record.issued) == (0, 1)
    assert [(e.event_id, e.outcome, e.generation) for e in d.kv.record.settled] == [("evt-1", "no_change", 1)]


def test_an_abort_that_settles_its_events_names_them_all() -> None:
    d = started()
    switching(d)
    d.commands(Switch)
    d.status(WORLD[0], 1, "failed", error="died in the switch", falling_back=True)
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "checkpoint_fallback"
    assert aborted.event_ids == ("evt-1",) and aborted.replanned_event_ids == ()


def test_a_participant_failing_in_the_switch_because_a_member_died_turns_into_a_live_recovery() -> None:
    d = started()
    switching(d)
    d.commands(Switch)
    # A joiner's enter broke on the member killed at the cut, before the survivors said peer_lost.
    d.status(WORLD[0], 1, "failed", error="enter: Connection closed by peer")
    (probe,) = [a for a in d.pending if isinstance(a, ProbeWorkers)]
    assert worker(WORLD[1]) in probe.worker_ids
    d.probe(gone=(WORLD[1],))
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "live_recovery"
    assert aborted.event_ids == () and aborted.replanned_event_ids == ("evt-1",)
    assert [c.command.fallback for c in d.sent(Abort)] == [False]
    assert d.core.phase is GenerationPhase.PREPARE  # re-planned around the loss
    d.write()
    assert d.pop(RequestTopology).request.lost == (WORLD[1],)


def test_a_participant_failing_in_the_switch_waits_for_a_probe_already_asking() -> None:
    d = started()
    switching(d)
    d.commands(Switch)
    d.status(WORLD[2], 0, "peer_lost")  # the survivors' step broke: a probe is asking
    d.status(WORLD[0], 1, "failed", error="enter: Connection closed by peer")
    assert len([a for a in d.pending if isinstance(a, ProbeWorkers)]) == 1
    assert d.core.phase is GenerationPhase.SWITCH
    d.probe(gone=(WORLD[1],))
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "live_recovery"


def test_a_participant_failing_in_the_switch_falls_back_when_the_probe_goes_unanswered() -> None:
    d = started()
    switching(d)
    d.commands(Switch)
    d.status(WORLD[0], 1, "failed", error="enter: timed out")
    d.now += timedelta(seconds=2 * CONFIG.probe_timeout_s + 2)
    for dev in WORLD + SPARES:
        d.beat(dev)
    d.tick()
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "checkpoint_fallback" and "enter: timed out" in aborted.reason


# -- liveness through the machine ---------------------------------------------------------------------


def test_world_worker_gone_silent_starts_a_handoff_without_it() -> None:
    d = started()
    d.now += timedelta(seconds=CONFIG.heartbeat_timeout_s + 1)
    for dev in WORLD[:3] + SPARES:
        d.beat(dev)
    d.tick()
    d.probe()  # its node's other workers are asked first: they answer
    assert d.core.phase is GenerationPhase.PREPARE
    d.write()
    assert d.pop(RequestTopology).request.lost == (WORLD[3],)


def test_a_world_that_reports_a_lost_peer_has_its_silent_worker_found_within_the_suspect_timeout() -> None:
    d = started()
    assert CONFIG.suspect_timeout_s < CONFIG.heartbeat_timeout_s
    d.status(WORLD[0], 0, "peer_lost")  # a survivor's collective failed: some peer is gone
    d.probe(silent=(WORLD[3],))  # the lost one's connection lingers: the probe cannot tell
    d.now += timedelta(seconds=CONFIG.suspect_timeout_s + 0.5)
    for dev in WORLD[:3] + SPARES:
        d.beat(dev)
    d.tick()
    d.probe(silent=(WORLD[3],))
    assert d.core.phase is GenerationPhase.PREPARE
    d.write()
    assert d.pop(RequestTopology).request.lost == (WORLD[3],)


def test_a_lost_peer_report_asks_the_worlds_members_whether_they_are_there() -> None:
    d = started()
    d.status(WORLD[0], 0, "peer_lost")
    (probe,) = [a for a in d.pending if isinstance(a, ProbeWorkers)]
    assert set(probe.worker_ids) == {worker(dev) for dev in WORLD}
    assert probe.timeout_s == CONFIG.probe_timeout_s


def test_a_member_whose_process_is_gone_is_lost_at_the_probes_answer_not_after_the_suspect_timeout() -> None:
    d = started()
    d.status(WORLD[0], 0, "peer_lost")
    d.probe(gone=(WORLD[3],))
    assert d.core.phase is GenerationPhase.PREPARE  # no time passed
    d.write()
    assert d.pop(RequestTopology).request.lost == (WORLD[3],)


def test_a_whole_node_found_gone_is_one_loss_planned_in_one_handoff() -> None:
    d = started()
    d.status(WORLD[0], 0, "peer_lost")
    d.probe(gone=on_node("node001", WORLD))
    d.write()
    (asked,) = [a for a in d.pending if isinstance(a, RequestTopology)]
    assert asked.request.lost == on_node("node001", WORLD)
    d.run()
    (committed,) = d.published(GenerationCommitted)
    assert committed.generation == 1 and not d.published(GenerationAborted)


def test_a_member_silent_to_the_probe_is_left_to_its_heartbeats() -> None:
    d = started()
    d.status(WORLD[0], 0, "peer_lost")
    d.probe(silent=(WORLD[3],))
    assert d.core.phase is GenerationPhase.STABLE and d.core.membership.on_device(WORLD[3]) is not None


def test_a_silent_member_found_by_its_heartbeats_has_its_node_mates_asked_before_planning() -> None:
    d = started()
    d.now += timedelta(seconds=CONFIG.heartbeat_timeout_s + 1)
    for dev in WORLD[:2] + SPARES:  # both workers of node001 stopped, one beat apart
        d.beat(dev)
    d.beat(WORLD[2])
    d.tick()
    assert d.core.phase is GenerationPhase.STABLE and d.has(ProbeWorkers)
    d.probe(gone=(WORLD[2],))
    d.write()
    assert d.pop(RequestTopology).request.lost == on_node("node001", WORLD)


def test_an_event_that_comes_while_a_probe_is_out_is_planned_with_the_loss_it_finds() -> None:
    d = started()
    d.status(WORLD[0], 0, "peer_lost")
    d.scale("evt-grow", add=SPARES)
    assert d.core.phase is GenerationPhase.STABLE
    d.probe(gone=(WORLD[3],))
    d.write()
    request = d.pop(RequestTopology).request
    assert request.lost == (WORLD[3],) and request.add == SPARES


def test_an_unanswered_probe_is_given_up_at_its_deadline_and_planning_goes_on() -> None:
    d = started()
    d.status(WORLD[0], 0, "peer_lost")
    d.scale("evt-grow", add=SPARES)
    d.wait(2 * CONFIG.probe_timeout_s + 1.5)
    assert d.core.phase is GenerationPhase.PREPARE and d.notes("probe_unanswered")


def test_the_answer_of_a_probe_given_up_still_names_who_is_gone() -> None:
    d = started()
    d.status(WORLD[0], 0, "peer_lost")
    (stale,) = [a for a in d.pending if isinstance(a, ProbeWorkers)]
    d.wait(2 * CONFIG.probe_timeout_s + 1.5)
    d.feed(WorkersProbed(probe=stale.probe, generation=0, gone=(worker(WORLD[3]),)))
    assert d.core.phase is GenerationPhase.PREPARE
    d.write()
    assert d.pop(RequestTopology).request.lost == (WORLD[3],)


def test_a_lost_peer_report_leaves_every_worker_that_keeps_beating_in_the_world() -> None:
    d = started()
    d.status(WORLD[0], 0, "peer_lost")
    for _ in range(4):
        d.wait(CONFIG.suspect_timeout_s / 2)
    assert d.core.phase is GenerationPhase.STABLE and len(d.core.membership) == len(WORLD + SPARES)


def test_a_lost_peer_report_of_an_older_generation_changes_nothing() -> None:
    d = started()
    d.status(WORLD[0], 7, "peer_lost")
    d.now += timedelta(seconds=CONFIG.suspect_timeout_s + 0.5)
    for dev in WORLD[:3] + SPARES:
        d.beat(dev)
    d.tick()
    assert d.core.phase is GenerationPhase.STABLE
    assert d.notes("stale_peer_lost_ignored")


def test_a_worker_gone_silent_is_counted_as_heartbeats_missed() -> None:
    d = started()
    assert d.core.silent_workers == 0
    d.now += timedelta(seconds=CONFIG.heartbeat_timeout_s + 1)
    for dev in WORLD[:3] + SPARES:
        d.beat(dev)
    d.tick()
    assert d.core.silent_workers == 1


def test_world_worker_restarting_counts_as_lost() -> None:
    d = started()
    d.beat(WORLD[1], seq=9)
    d.beat(WORLD[1], seq=0)
    d.write()
    assert d.pop(RequestTopology).request.lost == (WORLD[1],)


def test_idle_spare_lost_changes_nothing() -> None:
    d = started()
    d.feed(WorkerLost(worker_id=worker(SPARES[0]), reason="gone"))
    assert d.core.phase is GenerationPhase.STABLE and not d.has(WriteRecord)


def test_prepare_waits_for_workers_not_yet_heard_after_a_restart() -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.run()
    d.restart()
    d.scale("evt-2", add=SPARES)
    d.write()
    d.topology()
    for dev in on_node("node000"):
        d.beat(dev)
    d.transfer()
    assert d.core.wait is Wait.WORKERS and not d.sent(Prepare, since=len(d.log) - 5)
    for dev in SPARES:
        d.hello(dev)
    assert d.core.wait is Wait.PREPARED


def test_next_deadline_tells_the_adapter_when_to_tick() -> None:
    d = started()
    handoff_prepared(d, notice_s=60.0)
    deadline = d.core.next_deadline()
    assert deadline is not None and deadline <= d.now + timedelta(seconds=60 - CONFIG.margin_s)


def test_now_without_a_timezone_is_refused() -> None:
    core = Coordinator(JOB, instance_id="solo", config=CONFIG)
    with pytest.raises(CoordinatorError, match="now"):
        core.handle(Tick(), datetime(2026, 1, 1))


@pytest.mark.parametrize("stage", ["topology", "transfer"])
def test_plan_made_from_a_world_that_is_no_longer_live_aborts(stage: str) -> None:
    d = started()
    d.warn("evt-1", "node001")
    d.run()
    d.scale("evt-2", add=SPARES)
    d.write()
    request = d.pop(RequestTopology).request
    assert (request.from_generation, request.generation) == (1, 2)
    old_world = replace(request, from_generation=0, layout=LAYOUT, placement=Placement(WORLD))
    planned = plan_topology(old_world)
    assert isinstance(planned, TopologyPlanned)
    if stage == "topology":
        d.feed(planned)
    else:
        d.feed(plan_topology(request))
        d.pop(ExpectTransfer)
        d.feed(plan_transfer(planned))
    d.write()
    aborted = d.published(GenerationAborted)[-1]
    assert aborted.generation == 2 and "planned from generation 0, the live one is 1" in aborted.reason
    assert not d.sent(Prepare, since=len(d.log) - 20)


def test_switch_intent_recorded_after_the_deadline_aborts_without_switching() -> None:
    d = started()
    handoff_prepared(d, notice_s=30.0)
    d.ready()
    assert d.core.wait is Wait.SWITCH_WRITE
    d.now += timedelta(seconds=24.0)
    d.write()
    assert d.core.phase is GenerationPhase.ABORTED and not d.sent(Switch)
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "kept_old_world" and aborted.phase == "ready"


def test_losing_the_switch_intent_write_stands_down_without_switching() -> None:
    d = started()
    handoff_prepared(d)
    d.ready()
    d.rival_writes()
    d.write()
    assert d.core.phase is GenerationPhase.STANDBY and not d.sent(Switch)


def test_losing_the_abort_write_stands_down_without_publishing() -> None:
    d = started()
    handoff_prepared(d)
    d.status(WORLD[0], 1, "failed", error="boom")
    d.rival_writes()
    d.write()
    assert d.core.phase is GenerationPhase.STANDBY and not d.published() and not d.sent(Abort)


def test_standby_coordinator_ignores_events_until_restored_then_takes_over() -> None:
    d = started()
    assert d.kv.record is not None
    d.feed(RecordObserved(record=replace(d.kv.record, writer="rival"), revision=d.kv.revision + 1))
    assert d.core.phase is GenerationPhase.STANDBY
    d.warn("evt-1", "node001")
    assert not d.has(WriteRecord) and d.core.queued == ("evt-1",)
    d.take_over()
    assert d.core.phase is GenerationPhase.PREPARE and d.core.pending_generation == 1
    d.run()
    assert [c.generation for c in d.published(GenerationCommitted)] == [1]


def test_fresh_coordinator_seeing_a_record_it_did_not_write_stands_down() -> None:
    d = started()
    assert d.kv.record is not None
    fresh = Coordinator(JOB, instance_id="late", config=CONFIG)
    fresh.handle(RecordObserved(record=d.kv.record, revision=d.kv.revision), d.now)
    assert fresh.phase is GenerationPhase.STANDBY and fresh.record == d.kv.record


def test_every_declared_transition_is_reachable() -> None:
    seen: set[tuple[str, str]] = set()

    def keep(d: Driver) -> None:
        seen.update(d.phases())

    d = started()
    d.warn("evt-1", "node001")
    d.run()
    keep(d)
    d = started()
    handoff_prepared(d)
    d.status(WORLD[0], 1, "failed", error="boom")
    d.write()
    keep(d)
    for lose_at in ("begin", "switch_intent", "commit", "abort"):
        d = started()
        d.warn("evt-1", "node001")
        if lose_at != "begin":
            d.write()
            d.topology()
            d.transfer()
            if lose_at == "abort":
                d.status(WORLD[0], 1, "failed", error="boom")
            else:
                d.ready()
                if lose_at == "commit":
                    d.write()
                    d.switched()
        d.rival_writes()
        d.write()
        keep(d)
    d = started()
    assert d.kv.record is not None
    d.feed(RecordObserved(record=replace(d.kv.record, writer="rival"), revision=d.kv.revision + 1))
    keep(d)
    fresh = Driver(kv=d.kv)
    fresh.feed(RecordObserved(record=d.kv.record, revision=d.kv.revision))
    keep(fresh)
    for restart_in in ("prepare", "switch", "stable", "down"):
        d = started()
        if restart_in != "stable":
            handoff_prepared(d)
        if restart_in in ("switch", "down"):
            d.ready()
            d.write()
        if restart_in == "down":
            d.status(WORLD[0], 1, "failed", error="boom", falling_back=True)
            d.write()
        d.restart()
        keep(d)
        d.rival_writes()
        assert d.kv.record is not None
        d.feed(RecordObserved(record=d.kv.record, revision=d.kv.revision))
        d.take_over()
        keep(d)
    d = started()
    switching(d)
    d.status(WORLD[0], 1, "failed", error="boom", falling_back=True)
    d.write()
    keep(d)
    d = started()
    handoff_prepared(d)
    d.ready()
    d.warn("evt-2", "node000")
    d.write()
    keep(d)
    declared = {(a.value, b.value) for a, targets in TRANSITIONS.items() for b in targets}
    assert declared - seen == set()


def test_record_with_a_handoff_in_its_switch_phase_survives_the_codec() -> None:
    d = started()
    switching(d)
    record = d.kv.record
    assert record is not None and record.pending is not None and record.pending.phase == "switch"
    assert decode(encode(record), GenerationRecord) == record


def test_record_whose_pending_generation_was_never_issued_is_refused_naming_the_field() -> None:
    d = started()
    handoff_prepared(d)
    record = d.kv.record
    assert record is not None
    data = encode(record).replace(b'"issued":1', b'"issued":2')
    with pytest.raises(MessageError) as err:
        decode(data, GenerationRecord)
    assert err.value.path == "$.pending.generation"


def test_membership_record_follows_the_live_world_for_the_ingester() -> None:
    d = started()
    first = [a.record for a in d.log if isinstance(a, WriteMembership)][-1]
    assert first.generation == 0
    assert {(w.worker_id, w.device) for w in first.workers} == {(worker(dev), dev) for dev in WORLD}
    mark = len(d.log)
    d.beat(WORLD[0])
    assert not [a for a in d.log[mark:] if isinstance(a, WriteMembership)]
    d.warn("evt-1", "node001")
    d.run()
    last = [a.record for a in d.log if isinstance(a, WriteMembership)][-1]
    assert last.generation == 1
    assert {w.device for w in last.workers} == set(on_node("node000"))


# -- random event sequences --------------------------------------------------------------------------------

NODES = ("node000", "node001", "node002")


class RandomEvents(RuleBasedStateMachine):
    """Two coordinators on one bucket, fed random interleavings of everything that can happen.

    Whatever the order, no generation is committed twice or both committed and aborted, the record's
    generations never go back, every generation a coordinator begins is newer than the last, workers
    hear only of recorded generations, and an abort that kept the old world never followed a switch.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kv = FakeKV()
        self.drivers = [started(kv=self.kv), Driver(kv=self.kv)]
        self.drivers[1].restart()
        self.alive = set(WORLD + SPARES)
        self.events = 0

    def _broadcast(self, make: Callable[[Driver], Any]) -> None:
        for d in self.drivers:
            make(d)

    @rule(node=st.sampled_from(NODES), notice=st.floats(3.0, 200.0))
    def spot_warning(self, node: str, notice: float) -> None:
        self.events += 1
        self._broadcast(lambda d: d.warn(f"evt-{self.events}", node, notice_s=notice))

    @rule()
    def duplicate_warning(self) -> None:
        if self.events:
            self._broadcast(lambda d: d.warn(f"evt-{self.events}", "node001"))

    @rule(size=st.integers(1, 6))
    def scale_request(self, size: int) -> None:
        self.events += 1
        self._broadcast(lambda d: d.scale(f"evt-{self.events}", add=SPARES, target=size))

    @rule(i=st.integers(0, 1), steps=st.integers(1, 10), data=st.data())
    def progress(self, i: int, steps: int, data: st.DataObject) -> None:
        """What one coordinator waits for happens, mostly as it should, sometimes with a failure."""
        for _ in range(steps):
            if not self.drivers[i].pending:
                return
            self._step(self.drivers[i], data)

    def _step(self, d: Driver, data: st.DataObject) -> None:
        if d.has(WriteRecord):
            d.write()
        elif d.has(RequestTopology):
            if data.draw(st.sampled_from([True] * 5 + [False])):
                d.topology()
            else:
                request = d.pop(RequestTopology).request
                failed = PlanningFailed(
                    job_id=JOB,
                    event_id=request.event_id,
                    generation=request.generation,
                    stage="topology",
                    reason="random failure",
                )
                d.feed(failed)
        elif d.has(ExpectTransfer):
            d.transfer()
        elif prepares := d.commands(Prepare):
            takers = [(w, c.command.generation) for c in prepares for w in d.takers(c)]
            failing = data.draw(st.sampled_from([None] * 5 + [w for w, _ in takers]))
            for w, generation in takers:
                phase, error = ("failed", "random") if w == failing else ("ready", None)
                for other in self.drivers:
                    other.status(w, generation, phase, error=error)
        elif switches := d.commands(Switch):
            generation = switches[-1].command.generation
            record = self.kv.record
            if record is None or record.pending is None or record.pending.generation != generation:
                return
            workers = [p.worker_id for p in record.pending.participants]
            silent = data.draw(st.sampled_from([None] * 4 + workers))
            for w in workers:
                if w != silent:
                    self._broadcast(lambda o, w=w: o.status(w, generation, "switched", iteration=7))
        else:
            d.pending.clear()

    @rule(i=st.integers(0, 1))
    def write_outcome_unknown(self, i: int) -> None:
        d = self.drivers[i]
        if d.has(WriteRecord):
            write = d.pop(WriteRecord)
            self.kv.cas(write)
            d.feed(RecordWriteFailed(error="timeout"))

    @rule(
        device=st.sampled_from(WORLD + SPARES),
        generation=st.integers(0, 4),
        phase=st.sampled_from(["ready"] * 3 + ["switched"] * 3 + ["failed"]),
    )
    def stray_ack(self, device: Device, generation: int, phase: str) -> None:
        error = "stray" if phase == "failed" else None
        self._broadcast(lambda d: d.status(device, generation, phase, error=error))

    @rule(device=st.sampled_from(WORLD + SPARES))
    def worker_lost(self, device: Device) -> None:
        self.alive.discard(device)
        self._broadcast(lambda d: d.feed(WorkerLost(worker_id=worker(device), reason="random")))

    @rule(seconds=st.floats(0.0, 20.0))
    def time_passes(self, seconds: float) -> None:
        for d in self.drivers:
            d.now += timedelta(seconds=seconds)
            for device in sorted(self.alive):
                d.beat(device)
            d.tick()

    @precondition(lambda self: self.kv.record is not None)
    @rule(i=st.integers(0, 1), crash=st.sampled_from([False] * 3 + [True]))
    def crash_and_restore(self, i: int, crash: bool) -> None:
        if crash:
            self.drivers[i].restart()

    @precondition(lambda self: self.kv.record is not None and not self.kv.record.live)
    @rule()
    def restarted_from_checkpoint(self) -> None:
        record = self.kv.record
        assert record is not None
        world = WorldStarted(
            job_id=JOB, generation=record.issued + 1, layout=LAYOUT, placement=Placement(WORLD)
        )
        self._broadcast(lambda d: d.feed(world))

    @invariant()
    def every_coordinator_waits_only_for_what_its_phase_allows(self) -> None:
        for d in self.drivers:
            assert d.core.wait in WAITS[d.core.phase], (d.core.phase, d.core.wait)

    @invariant()
    def one_outcome_per_generation(self) -> None:
        one_outcome_per_generation([m for d in self.drivers for m in d.published()])

    @invariant()
    def generations_only_move_forward(self) -> None:
        generations = [r.generation for r in self.kv.history]
        issued = [r.issued for r in self.kv.history]
        assert generations == sorted(generations) and issued == sorted(issued)
        begun = [
            r.pending.generation
            for r in self.kv.history
            if r.pending is not None and r.pending.phase == "prepare"
        ]
        assert begun == sorted(set(begun)), f"a generation id was begun twice or out of order: {begun}"

    @invariant()
    def commands_follow_the_record(self) -> None:
        """Workers hear of a generation only once the record holds it, and of its switch only once the
        switch intent is recorded."""
        pending = {(r.pending.generation, r.pending.phase) for r in self.kv.history if r.pending is not None}
        for d in self.drivers:
            for cmd in d.sent(Prepare):
                assert (cmd.command.generation, "prepare") in pending
            for cmd in d.sent(Switch):
                assert (cmd.command.generation, "switch") in pending

    @invariant()
    def kept_old_world_means_no_switch_was_sent(self) -> None:
        switched = {c.command.generation for d in self.drivers for c in d.sent(Switch)}
        for d in self.drivers:
            for aborted in d.published(GenerationAborted):
                assert aborted.outcome in ("checkpoint_fallback", "live_recovery") or (
                    aborted.generation not in switched
                )

    @invariant()
    def committed_generations_are_recorded(self) -> None:
        for message in (m for d in self.drivers for m in d.published(GenerationCommitted)):
            assert any(r.generation == message.generation for r in self.kv.history)


RandomEvents.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_random_event_sequences_keep_generations_unique_and_monotonic = RandomEvents.TestCase


# -- the job's own model geometry -------------------------------------------------------------------------


def started_with(geometry: ModelGeometry | None, peer_copies: bool = True) -> Driver:
    """A job whose generation 0 announced ``geometry`` with its world, and whether it keeps copies."""
    d = Driver()
    for rank, device in enumerate(WORLD):
        d.hello(device, generation=0, rank=rank)
    d.feed(
        WorldStarted(
            job_id=JOB,
            generation=0,
            layout=LAYOUT,
            placement=Placement(WORLD),
            geometry=geometry,
            peer_copies=peer_copies,
        )
    )
    d.write()
    return d


def test_the_geometry_the_first_world_announces_goes_with_every_topology_request() -> None:
    own = MODEL.geometry()
    d = started_with(own)
    assert d.kv.record is not None and d.kv.record.geometry == own
    d.warn("evt-1", "node001")
    d.write()
    assert d.pop(RequestTopology).request.geometry == own


def test_a_job_that_keeps_no_peer_copies_says_so_in_every_topology_request() -> None:
    d = started_with(None, peer_copies=False)
    assert d.kv.record is not None and not d.kv.record.peer_copies
    d.warn("evt-1", "node001")
    d.write()
    assert not d.pop(RequestTopology).request.peer_copies


def test_a_job_keeps_peer_copies_unless_its_world_says_otherwise() -> None:
    d = started_with(MODEL.geometry())
    d.warn("evt-1", "node001")
    d.write()
    assert d.pop(RequestTopology).request.peer_copies


def test_a_world_restarted_without_a_geometry_keeps_the_recorded_one() -> None:
    own = MODEL.geometry()
    d = started_with(own)
    handoff_prepared(d)
    d.ready()
    d.write()
    d.commands(Switch)
    d.status(
        WORLD[1], 1, "failed", error="old rank gone; falling back to the last checkpoint", falling_back=True
    )
    d.feed(WorldStarted(job_id=JOB, generation=2, layout=LAYOUT, placement=Placement(WORLD)))
    d.write()
    d.write()
    assert d.kv.record is not None and d.kv.record.generation == 2 and d.kv.record.geometry == own


def test_the_planners_answer_is_for_the_geometry_the_job_announced() -> None:
    # Without a geometry from the job, the record holds none and the planner's configured model decides.
    d = started()
    assert d.kv.record is not None and d.kv.record.geometry is None
    d.warn("evt-1", "node001")
    d.write()
    assert d.pop(RequestTopology).request.geometry is None


def test_restore_after_the_switch_recovers_live_when_the_survivors_say_their_old_world_broke() -> None:
    d = started()
    switching(d)
    d.restart()
    d.write()  # the claim on the record lands: only then is the switch sent again
    d.now += timedelta(seconds=CONFIG.heartbeat_timeout_s + 1)
    for rank, dev in enumerate(WORLD[:3]):
        d.beat(dev, generation=0, rank=rank, broken=True)  # they never committed: nobody did
    d.tick()
    d.probe(silent=(WORLD[3],))  # asked at the first broken word; the restart's window ran out first
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "live_recovery", aborted
    d.write()
    assert d.pop(RequestTopology).request.lost == (WORLD[3],)


def test_restore_after_the_switch_finds_the_silent_participant_gone_at_the_first_broken_word() -> None:
    """The survivors' word that their old world broke has the restarted coordinator ask every participant
    at once, the one it has not heard since its restart included: a loss known in a round trip, not
    after the restart's heartbeat window."""
    d = started()
    switching(d)
    d.restart()
    d.write()  # the claim on the record lands: only then is the switch sent again
    d.beat(WORLD[0], generation=0, rank=0, broken=True)
    (probe,) = [a for a in d.pending if isinstance(a, ProbeWorkers)]
    assert worker(WORLD[3]) in probe.worker_ids
    d.probe(gone=(WORLD[3],))
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "live_recovery" and "no connection to the bus" in aborted.reason, aborted
    d.write()
    assert d.pop(RequestTopology).request.lost == (WORLD[3],)


def test_restore_after_the_switch_takes_a_peer_lost_from_the_old_world_as_no_commit() -> None:
    d = started()
    switching(d)
    d.restart()
    d.write()  # the claim on the record lands: only then is the switch sent again
    d.status(WORLD[0], 0, "peer_lost")
    d.now += timedelta(seconds=CONFIG.heartbeat_timeout_s + 1)
    for rank, dev in enumerate(WORLD[:3]):
        d.beat(dev, generation=0, rank=rank)
    d.tick()
    if d.has(ProbeWorkers):
        d.probe(gone=(WORLD[3],))
    d.write()
    (aborted,) = d.published(GenerationAborted)
    assert aborted.outcome == "live_recovery", aborted
