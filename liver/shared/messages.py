"""Every message on LiveR's bus, as msgspec Structs encoded as JSON.

Each message names who publishes it and who consumes it. All of them carry ``kind`` (the tag that lets
one subject carry several kinds and makes a captured message self-describing), ``schema_version``
(:data:`SCHEMA_VERSION`; a decoder refuses any other), the ``job_id``, and the event id of the trigger
and/or a generation id.

Field types carry their constraints (msgspec ``Meta``), so decoding with :func:`liver.shared.codec.decode`
checks ids, counts and durations; checks that involve several fields run in ``_validate`` and raise
``ValueError("`field`: reason")`` so that the codec can name the field. Constructing a message in Python
runs only the cross-field checks; the per-field constraints are enforced where input crosses a trust
boundary, which is the decoder.

Generations are integers: 0 is the world the job started with and every commit adds one, so "newer"
is a comparison and a stale ack is recognisable at a glance.
"""

from __future__ import annotations

import bisect
import re
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Final, Literal, NamedTuple, TypedDict

import msgspec
from msgspec import Meta

from liver.shared.geometry import ModelGeometry
from liver.shared.layout import (
    MAX_WORLD_SIZE,
    Device,
    LayoutError,
    ParallelLayout,
    Placement,
    check_placement,
)
from liver.shared.subjects import TOKEN_PATTERN, kv_key_prefix

SCHEMA_VERSION: Final = 3
"""The bus contract's version. Bump it on any incompatible change to any message. Version 2 added
context parallelism, expert parallelism and expert-TP to layouts and experts to model geometries;
version 3 added a spot warning's ``warning_kind`` (and the ``rebalance`` trigger), the ids of every
event an outcome settles (``event_ids``, ``replanned_event_ids``) and the settled events of the job's
record. An older message means the same under version 3 (it is read and treated as version 3), while
an older reader refuses version 3."""

READ_SCHEMA_VERSIONS: Final = frozenset({1, 2, SCHEMA_VERSION})
"""The versions this build decodes."""

NODE_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_.:/@-]{0,252}\Z"
"""Node ids only travel in bodies, never in subjects, so they may be DNS names or provider ids
(``ip-10-0-1-7.ec2.internal``, ``aws:///us-east-1a/i-0abc``)."""

_NODE = re.compile(NODE_PATTERN)
_KV_KEY_TOKEN = re.compile(r"^[A-Za-z0-9_=-]+\Z")
"""One token of a key-value key (NATS also allows ``/``, which slice keys replace by ``.``)."""

JobId = Annotated[str, Meta(pattern=TOKEN_PATTERN, description="token-safe job id")]
EventId = Annotated[str, Meta(pattern=TOKEN_PATTERN, description="token-safe id of the triggering event")]
WorkerId = Annotated[str, Meta(pattern=TOKEN_PATTERN, description="token-safe id of a worker process")]
Token = Annotated[str, Meta(pattern=TOKEN_PATTERN)]
NodeId = Annotated[str, Meta(pattern=NODE_PATTERN, description="provider's node id")]
# Every number has the bounds its meaning allows: a value outside them is refused at its field, never
# planned with (a device index of 2^64 once became a world) or computed with (a notice of 1e308 s
# overflowed the deadline).
MAX_COUNT: Final = 2**53
"""Counters, generations, iterations: the largest integer every JSON reader keeps exactly."""
MAX_DEVICE_INDEX: Final = 65_535
"""A device's index on its node (accelerators, or CPU worker slots)."""
MAX_DEVICES: Final = MAX_WORLD_SIZE
"""Devices of one job."""
MAX_BYTES: Final = 2**62
MAX_SECONDS: Final = 366 * 24 * 3600.0
"""Durations and notices: a year (a notice, a downtime, a plan time beyond it is an error)."""

Generation = Annotated[int, Meta(ge=0, le=MAX_COUNT, description="0 = the initial world; +1 per commit")]
DeviceIndex = Annotated[int, Meta(ge=0, le=MAX_DEVICE_INDEX)]
Count = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
DeviceCount = Annotated[int, Meta(ge=1, le=MAX_DEVICES)]
NonNegative = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Bytes = Annotated[int, Meta(ge=0, le=MAX_BYTES)]
PositiveBytes = Annotated[int, Meta(ge=1, le=MAX_BYTES)]
Iteration = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, Meta(ge=0, le=MAX_SECONDS)]
Timestamp = Annotated[datetime, Meta(tz=True, description="RFC 3339 with a timezone")]
Reason = Annotated[str, Meta(min_length=1, max_length=2000)]
Explanation = Annotated[str, Meta(min_length=1, max_length=20000)]
Provider = Annotated[str, Meta(pattern=r"^[a-z0-9_-]{1,64}\Z", description="aws, gcp, azure, manual, ...")]
Address = Annotated[str, Meta(pattern=r"^\S{1,250}:[0-9]{1,5}\Z", description="host:port")]
ObjectName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_=/.-]{1,255}\Z")]


class TriggerKind(StrEnum):
    """What asked for a resize: the event's subject, and for a spot warning how urgent it is."""

    SPOT_WARNING = "spot_warning"
    SCALE_REQUEST = "scale_request"
    REBALANCE = "rebalance"
    """A spot warning of kind ``rebalance``: the node is at elevated risk, no reclaim is scheduled."""


class WarningKind(StrEnum):
    """What a spot warning announces.

    ``interruption``: the node is reclaimed at a stated time (a notice or a deadline is required).
    ``rebalance``: the platform recommends moving off the node before an interruption comes (EC2's
    rebalance recommendation); no reclaim is scheduled, so it needs no deadline and it is the lower
    priority: it never disturbs a handoff already under way, and waits for the next one.
    """

    INTERRUPTION = "interruption"
    REBALANCE = "rebalance"


class WorkerPhase(StrEnum):
    """Where one worker stands in a generation's handoff, as its acks and heartbeats say."""

    PREPARING = "preparing"
    READY = "ready"
    SWITCHED = "switched"
    ABORTED = "aborted"
    FAILED = "failed"
    PEER_LOST = "peer_lost"  # the worker's world (the ack's generation) lost a peer outside a handoff:
    # its state is kept, and it waits for a recovery that names the lost device


class HandoffPhase(StrEnum):
    """The coordinator's step of a handoff that an abort or a command refers to."""

    PREPARE = "prepare"
    READY = "ready"
    SWITCH = "switch"


class AbortOutcome(StrEnum):
    """Where a job stands after an aborted handoff."""

    KEPT_OLD_WORLD = "kept_old_world"
    CHECKPOINT_FALLBACK = "checkpoint_fallback"
    LIVE_RECOVERY = "live_recovery"


class PlanningStage(StrEnum):
    """Which planner answered (or failed)."""

    TOPOLOGY = "topology"
    TRANSFER = "transfer"


def _invalid(field: str, reason: str) -> ValueError:
    """The error cross-field checks raise; the codec turns the backquoted field into a path."""
    return ValueError(f"`{field}`: {reason}")


def _check_devices(devices: tuple[Device, ...], field: str) -> None:
    """Layout's Device is a plain contract type; bus input must also have sane node ids and indices."""
    seen: set[Device] = set()
    for i, device in enumerate(devices):
        if not isinstance(device.index, int) or not 0 <= device.index <= MAX_DEVICE_INDEX:
            raise _invalid(f"{field}[{i}].index", f"must be 0..{MAX_DEVICE_INDEX}, got {device.index}")
        if not isinstance(device.node, str) or _NODE.match(device.node) is None:
            raise _invalid(f"{field}[{i}].node", f"{str(device.node)[:100]!r} is not a valid node id")
        if device in seen:
            raise _invalid(f"{field}[{i}]", f"device {device} appears twice")
        seen.add(device)


def _check_unique(ids: tuple[str, ...], field: str) -> None:
    if len(set(ids)) != len(ids):
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        raise _invalid(field, f"event ids repeat: {repeated}")


def _check_world(layout: ParallelLayout, placement: Placement, field: str) -> None:
    _check_devices(placement.devices, f"{field}.devices")
    try:
        check_placement(layout, placement)
    except LayoutError as exc:
        raise _invalid(field, str(exc)) from None


def _check_resize(
    m: TopologyPlanned | Prepare, old_world: str = "the old world"
) -> tuple[set[Device], set[Device]]:
    """Both worlds valid, the new generation after the old, and every ``lost`` device one of the old
    world's (``old_world`` in the message) that the new one does not use; the old and the new world's
    devices."""
    if m.generation <= m.from_generation:
        raise _invalid("generation", f"{m.generation} must be after {m.from_generation}")
    _check_world(m.from_layout, m.from_placement, "from_placement")
    _check_world(m.layout, m.placement, "placement")
    _check_devices(m.lost, "lost")
    old, new = set(m.from_placement.devices), set(m.placement.devices)
    for i, device in enumerate(m.lost):
        if device not in old:
            raise _invalid(f"lost[{i}]", f"device {device} is not in {old_world}")
        if device in new:
            raise _invalid(f"lost[{i}]", f"device {device} is lost but the new placement uses it")
    return old, new


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    """Base of every bus message: the schema version check and the cross-field validation hook."""

    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema_version not in READ_SCHEMA_VERSIONS:
            raise _invalid("schema_version", f"expected {SCHEMA_VERSION}, got {self.schema_version}")
        msgspec.structs.force_setattr(self, "schema_version", SCHEMA_VERSION)
        self._validate()

    def _validate(self) -> None:
        """Cross-field checks; raise :func:`_invalid` naming the field."""


class Part(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A value nested inside messages (no tag, no version of its own)."""


# -- public: resize events from outside -----------------------------------------------------------


class SpotWarning(Message, kw_only=True, tag="spot_warning"):
    """A node of the job will be reclaimed.

    Published on ``spot.warning`` by a cloud-provider bridge (or an operator, or a test); consumed by
    the ingester. ``notice_s`` counts from publication (the stream's timestamp); give ``deadline``
    instead (or as well) when the provider states an absolute time: the earlier of the two counts.
    ``warning_kind`` (default ``interruption``) says whether a reclaim is scheduled or only recommended to be
    avoided (:class:`WarningKind`).
    """

    job_id: JobId
    event_id: EventId
    node: NodeId
    provider: Provider
    notice_s: Seconds | None = None
    deadline: Timestamp | None = None
    warning_kind: WarningKind = WarningKind.INTERRUPTION

    def _validate(self) -> None:
        if self.warning_kind is WarningKind.INTERRUPTION and self.notice_s is None and self.deadline is None:
            raise _invalid("notice_s", "give notice_s or deadline (or both) for an interruption")

    def effective_deadline(self, published_at: datetime) -> datetime | None:
        """The moment the node is gone, given when the warning was published (None: a rebalance
        recommendation that names no time)."""
        candidates = [d for d in (self.deadline,) if d is not None]
        if self.notice_s is not None:
            candidates.append(published_at + timedelta(seconds=self.notice_s))
        return min(candidates, default=None)


class NodeDevices(Part):
    """A node and the device indices on it that the job may use."""

    node: NodeId
    devices: Annotated[tuple[DeviceIndex, ...], Meta(min_length=1)]

    def __post_init__(self) -> None:
        if len(set(self.devices)) != len(self.devices):
            raise _invalid("devices", f"indices repeat: {list(self.devices)}")

    def as_devices(self) -> tuple[Device, ...]:
        return tuple(Device(self.node, i) for i in self.devices)


class ScaleRequest(Message, kw_only=True, tag="scale_request"):
    """A planned change: nodes to add and/or remove, or a target device count (not both).

    Published on ``scale.request`` by an operator or autoscaler; consumed by the ingester. Removal is
    per node because capacity is returned per machine; additions name the usable devices because a
    node may come with a device held back.
    """

    job_id: JobId
    event_id: EventId
    reason: Reason
    add: tuple[NodeDevices, ...] = ()
    remove: tuple[NodeId, ...] = ()
    target_devices: DeviceCount | None = None

    def _validate(self) -> None:
        by_nodes = bool(self.add or self.remove)
        if by_nodes == (self.target_devices is not None):
            raise _invalid(
                "target_devices", "give either nodes to add/remove or target_devices, exactly one of them"
            )
        added: set[str] = set()
        for i, entry in enumerate(self.add):
            if entry.node in added:
                raise _invalid(f"add[{i}].node", f"node {entry.node!r} listed twice")
            added.add(entry.node)
        removed: set[str] = set()
        for i, node in enumerate(self.remove):
            if node in removed:
                raise _invalid(f"remove[{i}]", f"node {node!r} listed twice")
            if node in added:
                raise _invalid(f"remove[{i}]", f"node {node!r} is both added and removed")
            removed.add(node)


# -- internal: control-plane pipeline ---------------------------------------------------------------


class ResizeRequested(Message, kw_only=True, tag="resize_requested"):
    """A validated, de-duplicated resize of one job, resolved to devices.

    Published on ``liver.resize.requested.<job>`` by the ingester (after mapping nodes to the job's
    workers through the coordinator's membership); consumed by the coordinator only, which queues or
    merges it with other triggers and then asks the topology planner with a :class:`TopologyRequest`.
    ``keep`` are the current world's devices that stay, ``remove`` those that go, ``add`` new ones;
    with ``target_devices`` the planner chooses.
    """

    job_id: JobId
    event_id: EventId
    trigger: TriggerKind
    generation: Generation
    reason: Reason
    keep: tuple[Device, ...] = ()
    remove: tuple[Device, ...] = ()
    add: tuple[Device, ...] = ()
    target_devices: DeviceCount | None = None
    deadline: Timestamp | None = None

    def _validate(self) -> None:
        for field in ("keep", "remove", "add"):
            _check_devices(getattr(self, field), field)
        if not (self.remove or self.add or self.target_devices is not None):
            raise _invalid("remove", "nothing to change: no device removed or added and no target")
        owner: dict[Device, str] = {}
        for field in ("keep", "remove", "add"):
            for i, device in enumerate(getattr(self, field)):
                if device in owner:
                    raise _invalid(f"{field}[{i}]", f"device {device} is also in {owner[device]}")
                owner[device] = field


class TopologyRequest(Message, kw_only=True, tag="topology_request"):
    """Choose the target world of ``generation`` from the live world, given what leaves and what joins.

    Published on ``liver.topology.request.<job>`` by the coordinator; consumed by the topology planner,
    which answers with :class:`TopologyPlanned` or :class:`PlanningFailed`. The coordinator asks (not
    the ingester) because only it knows the world a queued request will apply to and which generation
    id it gets; several triggers may be merged into one request (``event_ids``; ``event_id`` is the
    first, the one every answer quotes). ``remove`` devices leave but are still alive (they can be
    sources); ``lost`` ones are already gone (no state can come from them); ``add`` devices are
    offered. ``target_devices`` asks for a size.
    """

    job_id: JobId
    event_id: EventId
    event_ids: Annotated[tuple[EventId, ...], Meta(min_length=1)]
    from_generation: Generation
    generation: Generation
    layout: ParallelLayout
    placement: Placement
    remove: tuple[Device, ...] = ()
    lost: tuple[Device, ...] = ()
    add: tuple[Device, ...] = ()
    target_devices: DeviceCount | None = None
    deadline: Timestamp
    device_memory_bytes: PositiveBytes | None = None
    """The smallest device memory the workers of the offered devices reported in their ``Hello``;
    ``None`` when none did, and the planner's hardware profile decides."""
    geometry: ModelGeometry | None = None
    """The job's own model geometry, as its world announced it (:class:`WorldStarted`): the chosen
    layout must suit it and the plan moves it. ``None``: the planner's configured model."""
    peer_copies: bool = True
    """Whether the job keeps peer copies, as its world announced it (:class:`WorldStarted`)."""

    def _validate(self) -> None:
        if self.generation <= self.from_generation:
            raise _invalid("generation", f"{self.generation} must be after {self.from_generation}")
        if self.event_id not in self.event_ids:
            raise _invalid("event_ids", f"must include event_id {self.event_id!r}")
        _check_world(self.layout, self.placement, "placement")
        world = set(self.placement.devices)
        for field in ("remove", "lost"):
            devices = getattr(self, field)
            _check_devices(devices, field)
            for i, device in enumerate(devices):
                if device not in world:
                    raise _invalid(f"{field}[{i}]", f"device {device} is not in the live world")
        _check_devices(self.add, "add")
        for i, device in enumerate(self.add):
            if device in world:
                raise _invalid(f"add[{i}]", f"device {device} is already in the live world")
        for i, device in enumerate(self.lost):
            if device in self.remove:
                raise _invalid(f"lost[{i}]", f"device {device} is also in remove")


class Candidate(Part):
    """One layout the topology planner considered, with its score under the planner's cost model."""

    layout: ParallelLayout
    score: Annotated[float, Meta(ge=0, le=1e300)]
    """Estimated throughput (higher is better); 0 for a layout that does not fit."""
    fits: bool
    bytes_moved: Bytes | None = None
    memory_bytes: Bytes | None = None
    """Estimated peak memory per device."""
    note: Annotated[str, Meta(max_length=500)] = ""


class TopologyPlanned(Message, kw_only=True, tag="topology_planned"):
    """The target world of a resize: layout, placement of ranks on devices, and why.

    Published on ``liver.topology.planned.<job>`` by the topology planner; consumed by the transfer
    planner and the coordinator. It carries the model and the current world too, so the transfer
    planner can plan from this message alone (and a replay of the stream can re-plan). ``lost`` are
    devices of the current world that are already gone (the request's ``lost``): the new world does not
    use them and the transfer planner takes no state from them.
    """

    job_id: JobId
    event_id: EventId
    from_generation: Generation
    generation: Generation
    model: ModelGeometry
    from_layout: ParallelLayout
    from_placement: Placement
    layout: ParallelLayout
    placement: Placement
    candidates: Annotated[tuple[Candidate, ...], Meta(min_length=1)]
    explanation: Explanation
    deadline: Timestamp | None = None
    lost: tuple[Device, ...] = ()
    peer_copies: bool = True
    """Whether the current world keeps peer copies (:class:`WorldStarted`): the transfer planner reads
    a ``lost`` device's state from its copy only then."""

    def _validate(self) -> None:
        _check_resize(self, "the current world")


class ObjectRef(Part):
    """Where a payload too large for a message lives in the JetStream object store."""

    bucket: Token
    name: ObjectName
    size: Bytes
    digest: Annotated[str, Meta(min_length=1, max_length=200)] | None = None
    """The object store's digest (``SHA-256=...``), checked by the reader."""


class WorkerPlanRef(Part):
    """One device's part of a plan (what it sends as an old rank, what it receives as a new rank)."""

    device: Device
    ref: ObjectRef


class SliceLocation(NamedTuple):
    """Where one slice is stored: an entry of a key-value bucket or an object of an object store."""

    store: Literal["kv", "object"]
    bucket: str
    name: str
    """The entry's key or the object's name."""

    def __str__(self) -> str:
        kind = "key-value entry" if self.store == "kv" else "object"
        return f"{kind} {self.bucket}/{self.name}"


class SliceIndex(Part):
    """Where every device finds its plan slice, without one reference per device on the bus.

    Device ``d``'s slice has index ``i``, ``d``'s position in :func:`liver.reshard.plan.slice_devices`
    of the old and the new placement; ``count`` is the number of slices (every device of either world
    has one, empty or not). Slice ``i`` is the entry :meth:`key` ``(i)`` of the key-value bucket
    ``kv_bucket``, unless ``i`` is listed in ``objects`` (a slice too large for one message): that one,
    like every slice when ``kv_bucket`` is ``None``, is the object :meth:`name` ``(i)`` of the object
    store ``bucket``. A reader thus makes one read in the store that holds its slice, and the
    coordinator can delete them all by name (:meth:`location`, ``docs/plan-format.md``).
    """

    bucket: Token
    prefix: ObjectName
    count: Count
    kv_bucket: Token | None = None
    objects: tuple[NonNegative, ...] = ()
    """The slices stored as objects although ``kv_bucket`` is set, in increasing order."""

    def __post_init__(self) -> None:
        if self.kv_bucket is None:
            if self.objects:
                raise _invalid("objects", "lists slices stored as objects, but without `kv_bucket` all are")
            return
        tokens = self.kv_prefix[:-1].split(".")
        bad = next((t for t in tokens if _KV_KEY_TOKEN.match(t) is None), None)
        if bad is not None:
            raise _invalid(
                "prefix",
                f"{self.prefix!r} makes the key prefix {self.kv_prefix!r}, whose part {bad!r} is not "
                "1+ ASCII letters, digits, '_', '=' or '-'",
            )
        for k, i in enumerate(self.objects):
            if i >= self.count:
                raise _invalid(f"objects[{k}]", f"{i} is not a slice index below {self.count}")
            if k and i <= self.objects[k - 1]:
                raise _invalid(f"objects[{k}]", f"{i} does not follow {self.objects[k - 1]} (in order)")

    def name(self, index: int) -> str:
        """Object name of slice ``index`` (``<prefix><index:05d>``)."""
        self._check(index)
        return f"{self.prefix}{index:05d}"

    def names(self) -> tuple[str, ...]:
        return tuple(self.name(i) for i in range(self.count))

    @property
    def kv_prefix(self) -> str:
        """``prefix`` as the keys' first tokens: ``/`` become ``.`` and a final ``-`` becomes ``.``
        (``job-1/3/s7-`` gives ``job-1.3.s7.``), so that a plan's keys share a subject prefix
        (:func:`liver.shared.subjects.kv_key_prefix`, which the purge of a generation also uses)."""
        return kv_key_prefix(self.prefix)

    def key(self, index: int) -> str:
        """Key-value key of slice ``index`` (``<kv_prefix><index:05d>``, e.g. ``job-1.3.s7.00042``)."""
        self._check(index)
        return f"{self.kv_prefix}{index:05d}"

    def in_objects(self, index: int) -> bool:
        """Whether slice ``index`` is an object of ``bucket`` (rather than an entry of ``kv_bucket``)."""
        self._check(index)
        if self.kv_bucket is None:
            return True
        k = bisect.bisect_left(self.objects, index)
        return k < len(self.objects) and self.objects[k] == index

    def location(self, index: int) -> SliceLocation:
        if self.in_objects(index):
            return SliceLocation("object", self.bucket, self.name(index))
        assert self.kv_bucket is not None
        return SliceLocation("kv", self.kv_bucket, self.key(index))

    def object_names(self) -> tuple[str, ...]:
        """The names of the slices stored as objects (all of them without ``kv_bucket``)."""
        if self.kv_bucket is None:
            return self.names()
        return tuple(self.name(i) for i in self.objects)

    def kv_keys_pattern(self) -> str | None:
        """A subject pattern matching every key of this index and no other (``job-1.3.s7.*``); ``None``
        without ``kv_bucket``."""
        return None if self.kv_bucket is None else f"{self.kv_prefix}*"

    def _check(self, index: int) -> None:
        if not 0 <= index < self.count:
            raise ValueError(f"`index`: {index} is not a slice index below {self.count}")


class PlanSummary(Part):
    """The numbers that say what a plan costs, for logs, the coordinator's deadline check and benches."""

    tasks: NonNegative
    tasks_coalesced: NonNegative
    rounds: NonNegative
    bytes_moved: Bytes
    bytes_local: Bytes
    bytes_rank_order: Bytes
    """What a plain rank-order placement would have moved: the placement optimisation's baseline."""
    lower_bound_bytes: Bytes
    max_receive_bytes: Bytes
    verified: bool
    plan_seconds: Seconds


class TransferPlanned(Message, kw_only=True, tag="transfer_planned"):
    """A verified transfer plan is stored; here is where each device finds its part.

    Published on ``liver.transfer.planned.<job>`` by the transfer planner; consumed by the coordinator,
    which passes :attr:`slices` on to every worker in one :class:`Prepare`.
    """

    job_id: JobId
    event_id: EventId
    from_generation: Generation
    generation: Generation
    plan: ObjectRef
    workers: tuple[WorkerPlanRef, ...]
    """Each device's slice with its size (and, for an object, its digest), in :attr:`slices` order:
    ``ref.bucket`` and ``ref.name`` are the slice's :meth:`SliceIndex.location` (for audits and
    benches; workers find their slice through :attr:`slices`)."""
    slices: SliceIndex
    summary: PlanSummary
    deadline: Timestamp | None = None

    def _validate(self) -> None:
        if self.generation <= self.from_generation:
            raise _invalid("generation", f"{self.generation} must be after {self.from_generation}")
        _check_devices(tuple(w.device for w in self.workers), "workers")
        if self.workers and len(self.workers) != self.slices.count:
            raise _invalid(
                "slices.count", f"{self.slices.count} slices, but {len(self.workers)} devices have one"
            )


class PlanningFailed(Message, kw_only=True, tag="planning_failed"):
    """A planner could not produce a target (no layout fits) or a plan (some state has no source).

    Published on ``liver.planning.failed.<job>`` by the topology or transfer planner; consumed by the
    coordinator, which aborts the handoff: with the old world intact it keeps training there, with
    ranks already lost it falls back to the checkpoint.
    """

    job_id: JobId
    event_id: EventId
    generation: Generation
    stage: PlanningStage
    reason: Reason


class WorldStarted(Message, kw_only=True, tag="world_started"):
    """A world started outside the live path: the job's first one, or a restart from a checkpoint.

    Published on ``liver.world.started.<job>`` by whatever launched it; consumed by the coordinator,
    which records it as the live generation. After a checkpoint fallback its generation must be newer
    than every id issued so far (the aborted generation plus one is).
    """

    job_id: JobId
    generation: Generation
    layout: ParallelLayout
    placement: Placement
    geometry: ModelGeometry | None = None
    """The job's model as the planners see it (``docs/geometry.md``), derived from the job's own model:
    every later plan moves exactly these tensors. ``None``: the planners use the model the topology
    planner is configured with for the job (a preset); a world started after a fallback may leave it
    out and the one recorded stays."""
    peer_copies: bool = True
    """Whether the job's processes keep peer copies of the state a node would take with it
    (``RuntimeOptions.copies``): only then may a recovery read a lost process's state from its copy;
    a job without them whose loss no replica covers is answered at planning that it falls back."""

    def _validate(self) -> None:
        _check_world(self.layout, self.placement, "placement")
        if self.geometry is not None:
            try:
                self.geometry.check_layout(self.layout)
            except LayoutError as exc:
                raise _invalid("geometry", f"the model cannot use the world's layout: {exc}") from None


# -- internal: workers ------------------------------------------------------------------------------


class WorkerPresence(Message, kw_only=True):
    """Fields shared by Hello and Heartbeat: enough for a restarted coordinator to rebuild membership."""

    job_id: JobId
    worker_id: WorkerId
    device: Device
    address: Address
    """Where the worker's data plane listens (``host:port``)."""
    generation: Generation | None = None
    """The generation whose world the worker is in; ``None`` for a new worker not yet in any world."""
    rank: NonNegative | None = None
    """The worker's rank in that generation's world."""

    def _validate(self) -> None:
        _check_devices((self.device,), "device")
        if (self.generation is None) != (self.rank is None):
            raise _invalid("rank", "rank and generation are given together or not at all")


class Hello(WorkerPresence, kw_only=True, tag="worker_hello"):
    """A worker process started (or reconnected) and can be given work.

    Published on ``liver.worker.hello.<job>`` by the worker companion; consumed by the coordinator
    (membership) and, through it, the ingester (node -> workers).
    """

    memory_bytes: Bytes | None = None
    """Device memory the worker may use; the topology planner's memory model needs it."""


class Heartbeat(WorkerPresence, kw_only=True, tag="worker_heartbeat"):
    """The worker is alive; where it is in training.

    Published on ``liver.worker.heartbeat.<job>`` by the worker companion every few seconds; consumed by
    the coordinator. ``seq`` restarts at 0 with the process, which tells a restart from a lost beat.
    """

    seq: NonNegative
    iteration: Iteration | None = None
    broken: bool = False
    """The world of ``generation`` lost a peer: this process keeps the state of its last completed
    iteration and waits for a recovery (it said ``peer_lost``). A coordinator that restarted during a
    switch, its acks lost, learns from it that the old world broke before anything committed."""


class Prepare(Message, kw_only=True, tag="prepare"):
    """Build the shadow world of ``generation`` and fetch your part of the plan; then report ready.

    Published once per handoff on ``liver.worker.cmd.<job>`` (every worker of the job receives it) by
    the coordinator; consumed by the worker companion. It carries what every participant needs once:
    both worlds, the devices that take no part, the deadline, the store, and where the slices are.

    The participants are the devices of either world except ``lost`` (old-world devices whose worker
    is gone): an old rank that leaves the job sends its state, a new one receives. A worker on any
    other device ignores the message. A participant reads its slice at ``slices.location(i)``, ``i``
    its device's index in :func:`liver.reshard.plan.slice_devices` ``(from_placement, placement)``.
    Nothing of the active world may change (I4).
    """

    job_id: JobId
    event_id: EventId
    from_generation: Generation
    generation: Generation
    from_layout: ParallelLayout
    from_placement: Placement
    layout: ParallelLayout
    placement: Placement
    lost: tuple[Device, ...] = ()
    plan: ObjectRef
    """The whole plan file (for audits; a worker reads only its slice)."""
    slices: SliceIndex
    staging_bytes: PositiveBytes
    deadline: Timestamp
    store: Address | None = None
    """Where the rendezvous store of the new generation listens (``host:port``): the ``address`` the
    worker that runs the new world's rank 0 announced in its ``Hello`` (every worker hosts one there).
    All processes of both worlds build the shadow world and the stream group on it. ``None`` from a
    coordinator that does not know that worker's address; a worker then cannot prepare and fails."""

    def _validate(self) -> None:
        old, new = _check_resize(self)
        if self.slices.count != len(old | new):
            raise _invalid(
                "slices.count",
                f"{self.slices.count} slices for the {len(old | new)} devices of the two worlds",
            )


class Switch(Message, kw_only=True, tag="switch"):
    """Every worker is ready: at the next agreed iteration boundary, move the state and switch.

    Published on ``liver.worker.cmd.<job>`` (all workers at once) by the coordinator; consumed by the
    worker companion.
    """

    job_id: JobId
    generation: Generation
    deadline: Timestamp


class Abort(Message, kw_only=True, tag="abort"):
    """Drop the shadow world of ``generation`` and keep training on the active one.

    Published on ``liver.worker.cmd.<job>`` or a worker's own command subject by the coordinator;
    consumed by the worker companion. Aborting a generation the worker never prepared is a no-op, but
    for a worker whose world lost a peer and which waits for a live recovery: ``fallback`` (the abort's
    outcome is ``checkpoint_fallback``) tells it that none will come.
    """

    job_id: JobId
    generation: Generation
    reason: Reason
    fallback: bool = False


WorkerCommand = Prepare | Switch | Abort
"""What may arrive on a worker's command subjects; decode with ``decode(data, WorkerCommand)``."""


class WorkerStatus(Message, kw_only=True, tag="worker_status"):
    """A worker's ack of a command: which generation, which phase it reached, or what failed.

    Published on ``liver.worker.status.<job>`` by the worker companion; consumed by the coordinator,
    which ignores acks of any generation but the pending one (a stale ack cannot advance a handoff).
    ``iteration`` is the cut the switch happened at; the byte and pause figures feed
    ``GenerationCommitted``.
    """

    job_id: JobId
    worker_id: WorkerId
    generation: Generation
    phase: WorkerPhase
    error: Reason | None = None
    iteration: Iteration | None = None
    bytes_sent: Bytes | None = None
    bytes_received: Bytes | None = None
    pause_s: Seconds | None = None
    falling_back: bool = False
    """With ``failed``: this process's old world is gone and it restarts from its checkpoint (the
    handoff's processes agreed on it). A ``failed`` without it kept what it held (its old world, the
    state a live recovery moves, or nothing: a joiner), so a coordinator past the switch first asks
    whether a member is gone, whose loss the survivors recover from live."""

    def _validate(self) -> None:
        if self.phase == WorkerPhase.FAILED and self.error is None:
            raise _invalid("error", "a failed phase must say what failed")
        if self.falling_back and self.phase != WorkerPhase.FAILED:
            raise _invalid("falling_back", f"phase {self.phase!r} is not a failure")
        if self.error is not None and self.phase not in ("failed", "aborted"):
            raise _invalid("error", f"phase {self.phase!r} cannot carry an error")


# -- public: outcomes -------------------------------------------------------------------------------


class AckDetails(TypedDict, total=False):
    """What an ack may say besides its phase (the optional fields of ``WorkerStatus``): one definition
    for every layer that passes an ack on (``Companion.report``, the agent's ``status``, the runtime
    bridge's ``Reporter``)."""

    generation: int | None
    error: str | None
    iteration: int | None
    bytes_sent: int | None
    bytes_received: int | None
    pause_s: float | None
    falling_back: bool


class GenerationCommitted(Message, kw_only=True, tag="generation_committed"):
    """A new generation is live.

    Published on ``generation.committed`` by the coordinator after its compare-and-set on the job's
    generation record won (with ``Nats-Msg-Id`` = job and generation, so a retry is harmless); consumed
    by users, dashboards, the workers (leaving workers exit) and the benchmarks.
    ``placement.devices[r]`` is the device of rank ``r``.
    """

    job_id: JobId
    event_id: EventId
    """The event that triggered this handoff (the first, when several were merged into it)."""
    previous_generation: Generation
    generation: Generation
    layout: ParallelLayout
    placement: Placement
    started_at_iteration: Iteration
    downtime_s: Seconds
    bytes_moved: Bytes
    committed_at: Timestamp
    event_ids: tuple[EventId, ...] = ()
    """Every published event (``spot.warning``, ``scale.request``) this commit settles: each ends here
    and in no other outcome. Empty for a handoff that only a lost worker triggered."""

    def _validate(self) -> None:
        if self.generation <= self.previous_generation:
            raise _invalid("generation", f"{self.generation} must be after {self.previous_generation}")
        _check_world(self.layout, self.placement, "placement")
        _check_unique(self.event_ids, "event_ids")

    def rank_to_device(self) -> dict[int, Device]:
        return dict(enumerate(self.placement.devices))


class GenerationAborted(Message, kw_only=True, tag="generation_aborted"):
    """A handoff did not commit: why, in which phase, and what the job does instead.

    Published on ``generation.aborted`` by the coordinator; consumed by users, dashboards and the
    benchmarks. With ``kept_old_world`` training continues on ``active_generation`` untouched (I4);
    with ``checkpoint_fallback`` ranks of the old world were lost and the job restarts from
    ``checkpoint``; with ``live_recovery`` a process of the old world was lost during the switch, before
    anything committed: the survivors hold the state of the cut and the job moves live to a later
    generation planned around the lost devices (the events are re-planned, not settled here).
    """

    job_id: JobId
    event_id: EventId
    generation: Generation
    """The generation that did not commit."""
    active_generation: Generation
    phase: HandoffPhase
    reason: Reason
    outcome: AbortOutcome
    aborted_at: Timestamp
    checkpoint: Annotated[str, Meta(min_length=1, max_length=1000)] | None = None
    event_ids: tuple[EventId, ...] = ()
    """The published events this abort settles: each ends here and in no other outcome."""
    replanned_event_ids: tuple[EventId, ...] = ()
    """Events of the cancelled handoff that are planned again as a new generation: their outcome is a
    later one."""

    def _validate(self) -> None:
        _check_unique(self.event_ids + self.replanned_event_ids, "event_ids")
        if self.outcome in (AbortOutcome.KEPT_OLD_WORLD, AbortOutcome.LIVE_RECOVERY):
            if self.active_generation >= self.generation:
                raise _invalid(
                    "active_generation",
                    f"the kept world {self.active_generation} must be older than {self.generation}",
                )
            if self.checkpoint is not None:
                raise _invalid("checkpoint", "only a checkpoint fallback names a checkpoint")


# -- internal: membership record -----------------------------------------------------------------


class WorkerDevice(Part):
    """One worker of a job's current world and the device it runs on."""

    worker_id: WorkerId
    device: Device


class JobMembership(Message, kw_only=True, tag="job_membership"):
    """Which workers (and devices) make up a job's current world, in the coordinator's view.

    Written by the coordinator as the value of key ``<job>`` in the ``liver-membership`` key-value
    bucket (a record, not a message on a subject, so it is not part of :data:`BusMessage`); read by
    the ingester to map a node in a warning or request to the job's devices.
    """

    job_id: JobId
    generation: Generation
    workers: tuple[WorkerDevice, ...]
    standbys: tuple[WorkerDevice, ...] = ()
    """Live workers in no generation of the job yet (started with ``--standby``): what a scale-out
    can take in."""

    def _validate(self) -> None:
        _check_devices(tuple(w.device for w in self.workers), "workers")
        _check_devices(tuple(w.device for w in (*self.workers, *self.standbys)), "standbys")
        seen: set[str] = set()
        for field, group in (("workers", self.workers), ("standbys", self.standbys)):
            for i, worker in enumerate(group):
                if worker.worker_id in seen:
                    raise _invalid(f"{field}[{i}].worker_id", f"worker {worker.worker_id!r} appears twice")
                seen.add(worker.worker_id)


# -- internal: errors --------------------------------------------------------------------------------

PayloadEncoding = Literal["utf-8", "base64"]


class ErrorEvent(Message, kw_only=True, tag="error"):
    """A service rejected a message: where, which field, why, and the payload as received.

    Published on ``liver.errors.<service>`` by any service that rejects input (the raw message also
    goes to ``liver.dlq.<service>``); consumed by operators and tests. ``job_id`` and ``event_id`` are
    filled when they could be read from the payload. The payload is kept as text when it is UTF-8,
    otherwise base64, cut to a bounded size (the dead-letter copy is complete).
    """

    source: Token
    subject: Annotated[str, Meta(min_length=1, max_length=1000)]
    field: Annotated[str, Meta(min_length=1, max_length=1000)]
    """``$`` for the whole message, ``$.add[0].node`` for a nested field."""
    message: Reason
    payload: str
    payload_encoding: PayloadEncoding
    payload_size: Bytes
    payload_truncated: bool
    at: Timestamp
    job_id: JobId | None = None
    event_id: EventId | None = None
    stream_sequence: Count | None = None


BusMessage = (
    SpotWarning
    | ScaleRequest
    | ResizeRequested
    | TopologyRequest
    | TopologyPlanned
    | TransferPlanned
    | PlanningFailed
    | WorldStarted
    | Hello
    | Heartbeat
    | Prepare
    | Switch
    | Abort
    | WorkerStatus
    | GenerationCommitted
    | GenerationAborted
    | ErrorEvent
)
"""Any message, told apart by ``kind``: for tools that read several subjects."""

MESSAGE_TYPES: Final = BusMessage.__args__
