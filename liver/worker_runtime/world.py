"""Worlds: one generation of a job's process groups, built beside the one that trains.

A world is a generation id, a layout, a placement and every process group that layout needs. Each
generation lives under its own store namespace (``liver/{job}/gen{N}/...``), so building generation
N+1 can never read or overwrite a key of generation N: the two exist side by side while N trains (I1).

Why groups are built by hand instead of with ``torch.distributed.new_group``: ``new_group`` is a
collective over the *default* world, so every rank of the old world would have to stop and call it, and
a process that is not in the old world (a scale-out joiner) could not take part at all. Here each group
is created only by its members, over its own store prefix, so old ranks build it on a background thread
while they keep training and joiners build it without ever having joined the old world.

Deadlock freedom: a group's construction blocks until all its members arrive. Every process builds its
groups in one global order (kind, then index), so the smallest unfinished group always has all of its
members waiting on it and completes.

Ranks: a process is identified by its :class:`~liver.shared.layout.Device`; the placement says which
logical rank of the world runs there. Groups are registered with c10d with their members' ranks *in this
world*, so c10d rank translation is right for this world once it is the default one
(:meth:`World.adopt_as_default`); before that, use ``group.rank()`` and group-relative peers.

At most two generations of a job exist in a process (I2): the one training and the one being prepared.
The handoff itself runs over a third, short-lived group (:func:`build_stream_group`) that spans the
processes of both worlds, since leaving ranks are only in the old world and joiners only in the new one.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from datetime import timedelta
from enum import StrEnum
from typing import Annotated, Final, Literal, NamedTuple

import msgspec
import structlog
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from liver.shared.errors import HandoffError
from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement, check_placement
from liver.shared.subjects import validate_token

log = structlog.get_logger(__name__)

Backend = Literal["gloo", "nccl"]
DEFAULT_TIMEOUT = timedelta(seconds=60)
NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_CLEAN_UP_ONLY = "2"
"""NCCL's watchdog on a collective past its timeout (a lost peer): abort the communicator and raise
in the waiting thread, instead of torch's default of ending the process (3), so that a survivor keeps
its state and recovers (``peers.is_peer_failure`` reads the raised ``DistBackendError``)."""


class WorldError(HandoffError):
    """A world that cannot be built, used or released as asked."""


class StoreAddress(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the job's TCPStore listens. One process hosts it (:func:`host_store`); all others connect."""

    host: Annotated[str, msgspec.Meta(min_length=1)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("`host`: must not be empty")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"`port`: {self.port} is not a TCP port")


def host_store(host: str = "127.0.0.1", port: int = 0, timeout: timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """Host the job's store in this process; ``port=0`` lets the OS pick a free port (read ``.port``).

    Keep the returned object alive for as long as any world of the job may still be built.
    """
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)


def connect_store(address: StoreAddress, timeout: timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """A fresh client connection, so that one build's blocking waits never queue behind another's."""
    return dist.TCPStore(address.host, address.port, is_master=False, wait_for_workers=False, timeout=timeout)


class WorldSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What every member of a generation agrees on before building it.

    A generation id names one store namespace and is used once per job: the store keeps the keys of a
    build that failed, so a retry must take the next id (the coordinator's ids are monotonic anyway).
    """

    job: str
    generation: int
    layout: ParallelLayout
    placement: Placement
    instances: int = 1
    """The instances of the job's distributed optimizer (Megatron's
    ``num_distributed_optimizer_instances``): with more than one the world also builds the groups that
    shard its state within an instance and reduce across them (:data:`INSTANCE_KINDS`)."""

    def __post_init__(self) -> None:
        validate_token(self.job, "job")
        if self.generation < 0:
            raise ValueError(f"`generation`: must not be negative, got {self.generation}")
        check_placement(self.layout, self.placement)
        check_instances(self.layout, self.instances)

    @property
    def namespace(self) -> str:
        return f"liver/{self.job}/gen{self.generation}"

    def rank_of(self, device: Device) -> int | None:
        """The logical rank that runs on ``device`` in this world, or None when it has no place here."""
        return self.placement.rank_on().get(device)


class GroupKind(StrEnum):
    """The groups a Megatron-core layout needs.

    ``MP`` is Megatron's model-parallel group (TP x PP of one replica), ``TP_DP`` its TP x CP x DP group
    of one stage, ``EMBD`` the first and last stage of one pipeline (tied embeddings), ``POS_EMBD`` the
    first stage, ``SELF`` a group of one. ``CP``, ``DP_CP`` and ``TP_CP`` are the context-parallel
    groups; ``EP``, ``ETP``, ``EDP``, ``TP_EP`` (expert-TP x EP) and ``TP_EP_PP`` the expert groups of
    Megatron's second numbering (:mod:`liver.shared.layout`). A layout whose groups of some kind are
    those of another (every expert group of a dense layout, every context group without CP) builds no
    groups of that kind: :func:`alias_of` names the kind that stands in. The declaration order is the
    global build order.
    """

    WORLD = "world"
    TP = "tp"
    PP = "pp"
    DP = "dp"
    MP = "mp"
    TP_DP = "tp_dp"
    EMBD = "embd"
    POS_EMBD = "pos_embd"
    SELF = "self"
    CP = "cp"
    DP_CP = "dp_cp"
    TP_CP = "tp_cp"
    EP = "ep"
    ETP = "etp"
    EDP = "edp"
    TP_EP = "tp_ep"
    TP_EP_PP = "tp_ep_pp"
    INTRA_DP_CP = "intra_dp_cp"
    INTRA_EDP = "intra_edp"
    INTER_DIST_OPT = "inter_dist_opt"
    DIST_OPT_INSTANCE = "dist_opt_instance"


INSTANCE_KINDS: Final = {
    GroupKind.INTRA_DP_CP: GroupKind.DP_CP,
    GroupKind.INTRA_EDP: GroupKind.EDP,
    GroupKind.INTER_DIST_OPT: GroupKind.SELF,
    GroupKind.DIST_OPT_INSTANCE: GroupKind.WORLD,
}
"""The groups of a distributed optimizer with several instances (Megatron's partial distributed
optimizer), and the kind that stands in for each with one: ``INTRA_DP_CP`` and ``INTRA_EDP`` shard the
state (consecutive ``1/k`` of a DP x CP or expert-DP group), ``INTER_DIST_OPT`` reduces gradients across
the instances (the same place in each expert-DP group's ``k`` blocks; Megatron uses the expert one for
dense parameters too), ``DIST_OPT_INSTANCE`` is every rank of one instance (its grad norm)."""


def check_instances(layout: ParallelLayout, instances: int) -> None:
    """Raise ``ValueError`` naming ``instances`` when the layout cannot take that many instances of a
    distributed optimizer (:meth:`ParallelLayout.check_instances`)."""
    if not isinstance(instances, int) or instances < 1:
        raise ValueError(f"`instances`: must be at least 1, got {instances!r}")
    try:
        layout.check_instances(instances)
    except LayoutError as error:
        raise ValueError(f"`instances`: {error}") from None


_DENSE_AXES: dict[GroupKind, tuple[str, ...]] = {
    GroupKind.TP: ("tp",),
    GroupKind.PP: ("pp",),
    GroupKind.DP: ("dp",),
    GroupKind.MP: ("tp", "pp"),
    GroupKind.TP_DP: ("tp", "cp", "dp"),
    GroupKind.CP: ("cp",),
    GroupKind.DP_CP: ("cp", "dp"),
    GroupKind.TP_CP: ("tp", "cp"),
}
_EXPERT_AXES: dict[GroupKind, tuple[str, ...]] = {
    GroupKind.EP: ("ep",),
    GroupKind.ETP: ("etp",),
    GroupKind.EDP: ("edp",),
    GroupKind.TP_EP: ("etp", "ep"),
    GroupKind.TP_EP_PP: ("etp", "ep", "pp"),
}


def alias_of(layout: ParallelLayout, kind: GroupKind, instances: int = 1) -> GroupKind | None:
    """The kind whose groups are exactly ``kind``'s in ``layout`` (with ``instances`` of the distributed
    optimizer), when ``kind`` need not be built."""
    if kind in INSTANCE_KINDS and instances == 1:
        target = INSTANCE_KINDS[kind]
        return alias_of(layout, target) or target
    same_tp = layout.expert_tp == layout.tp
    dense_experts = layout.ep == 1 and same_tp  # the expert numbering is the dense one
    no_cp = layout.cp == 1
    aliases = {
        GroupKind.CP: GroupKind.SELF if no_cp else None,
        GroupKind.DP_CP: GroupKind.DP if no_cp else None,
        GroupKind.TP_CP: GroupKind.TP if no_cp else None,
        GroupKind.EP: GroupKind.SELF if layout.ep == 1 else None,
        GroupKind.ETP: GroupKind.TP if same_tp else None,
        GroupKind.EDP: GroupKind.DP_CP if dense_experts else None,
        GroupKind.TP_EP: GroupKind.TP if dense_experts else None,
        GroupKind.TP_EP_PP: GroupKind.MP if dense_experts else None,
    }
    target = aliases.get(kind)
    if target is None:
        return None
    return alias_of(layout, target) or target


def _axis_groups(layout: ParallelLayout, varying: tuple[str, ...], expert: bool) -> list[list[int]]:
    """Ranks grouped by every coordinate not in ``varying`` (of the dense or expert numbering)."""
    names = ("etp", "ep", "edp", "pp") if expert else ("tp", "cp", "dp", "pp")
    fixed = [n for n in names if n not in varying]
    out: dict[tuple[int, ...], list[int]] = {}
    for r in range(layout.world_size):
        c = layout.coords(r)._asdict()
        out.setdefault(tuple(c[n] for n in fixed), []).append(r)
    return sorted(out.values(), key=min)


def group_members(layout: ParallelLayout, kind: GroupKind, instances: int = 1) -> tuple[tuple[int, ...], ...]:
    """Every group of ``kind`` in ``layout`` (with ``instances`` of the distributed optimizer), each as
    its ranks in ascending order (Megatron's order); none for a kind another stands in for
    (:func:`alias_of`).

    Groups are listed in a fixed order; a group's position in the list is its index in store keys.
    """
    if alias_of(layout, kind, instances) is not None:
        return ()
    last = layout.pp - 1
    if kind in INSTANCE_KINDS:
        groups = _instance_groups(layout, kind, instances)
    elif kind is GroupKind.WORLD:
        groups: list[list[int]] = [list(range(layout.world_size))]
    elif kind in _DENSE_AXES:
        groups = _axis_groups(layout, _DENSE_AXES[kind], expert=False)
    elif kind in _EXPERT_AXES:
        groups = _axis_groups(layout, _EXPERT_AXES[kind], expert=True)
    elif kind is GroupKind.EMBD:
        groups = [sorted({r, r + last * (layout.world_size // layout.pp)}) for r in _first_stage(layout)]
    elif kind is GroupKind.POS_EMBD:
        groups = [[r] for r in _first_stage(layout)]
    elif kind is GroupKind.SELF:
        groups = [[r] for r in range(layout.world_size)]
    else:  # pragma: no cover - exhaustive over GroupKind
        raise AssertionError(kind)
    return tuple(tuple(sorted(g)) for g in groups)


def _instance_groups(layout: ParallelLayout, kind: GroupKind, k: int) -> list[list[int]]:
    """:data:`INSTANCE_KINDS` groups as Megatron's ``initialize_model_parallel`` makes them."""
    dense = _axis_groups(layout, _DENSE_AXES[GroupKind.DP_CP], expert=False)
    expert = _axis_groups(layout, _EXPERT_AXES[GroupKind.EDP], expert=True)
    block = layout.edp // k
    if kind is GroupKind.INTRA_DP_CP:
        size = layout.dp * layout.cp // k
        return [g[i : i + size] for g in dense for i in range(0, len(g), size)]
    if kind is GroupKind.INTRA_EDP:
        return [g[i : i + block] for g in expert for i in range(0, len(g), block)]
    if kind is GroupKind.INTER_DIST_OPT:
        return [g[j::block] for g in expert for j in range(block)]
    by_instance: dict[int, list[int]] = {}
    for r in range(layout.world_size):
        by_instance.setdefault(layout.coords(r).edp // block, []).append(r)
    return [by_instance[i] for i in sorted(by_instance)]


def _first_stage(layout: ParallelLayout) -> range:
    return range(layout.world_size // layout.pp)


class GroupSlot(NamedTuple):
    """Which group of a kind a rank belongs to: its index among the kind's groups and its members."""

    kind: GroupKind
    index: int
    ranks: tuple[int, ...]


def memberships(layout: ParallelLayout, rank: int, instances: int = 1) -> list[GroupSlot]:
    """The groups ``rank`` belongs to, in the global build order."""
    layout.coords(rank)  # validates the rank
    slots = []
    for kind in GroupKind:
        for index, ranks in enumerate(group_members(layout, kind, instances)):
            if rank in ranks:
                slots.append(GroupSlot(kind, index, ranks))
    return slots


class WorldGroup(NamedTuple):
    """One built group: where it sits in the layout, its c10d name, and the process group itself."""

    slot: GroupSlot
    name: str
    pg: dist.ProcessGroup


# -- process-wide bookkeeping -------------------------------------------------------------------------
# c10d's registry is process-global, so the rule "at most two generations" is process-global too.

_LOCK = threading.RLock()
_LIVE: dict[str, dict[int, World | None]] = {}  # job -> generation -> world (None while building)
_OWNED: set[str] = set()  # c10d names of groups that some live World built
_WITHERING: dict[str, set[int]] = {}
"""job -> generations given up while still building: their thread may wait at the rendezvous until its
timeout, for peers that will never come, and releases what it built when it ends. They do not count
toward the two live generations: a handoff given up must not block the one that replaces it."""


def live_generations(job: str) -> tuple[int, ...]:
    """Generations of ``job`` this process holds or is building, oldest first."""
    with _LOCK:
        return tuple(sorted(_LIVE.get(job, {})))


def is_world_group(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg`` belongs to a live World (code that cleans up c10d groups must leave it alone)."""
    with _LOCK:
        return c10d._world.pg_names.get(pg) in _OWNED


def _reserve(spec: WorldSpec) -> None:
    with _LOCK:
        live = _LIVE.setdefault(spec.job, {})
        if spec.generation in live or spec.generation in _WITHERING.get(spec.job, ()):
            raise WorldError(f"job {spec.job}: generation {spec.generation} already exists here")
        if live and spec.generation < max(live):
            raise WorldError(
                f"job {spec.job}: generation {spec.generation} is older than live generation {max(live)}"
            )
        if len(live) >= 2:
            raise WorldError(
                f"job {spec.job}: generations {sorted(live)} are alive; release one before building "
                f"generation {spec.generation} (at most two generations may exist)"
            )
        live[spec.generation] = None


def _unreserve(spec: WorldSpec) -> None:
    with _LOCK:
        live = _LIVE.get(spec.job, {})
        live.pop(spec.generation, None)
        if not live:
            _LIVE.pop(spec.job, None)
        withering = _WITHERING.get(spec.job)
        if withering is not None:
            withering.discard(spec.generation)
            if not withering:
                _WITHERING.pop(spec.job, None)


def _wither(spec: WorldSpec) -> None:
    """A build in progress was given up: its slot no longer counts (see ``_WITHERING``)."""
    with _LOCK:
        live = _LIVE.get(spec.job, {})
        if live.get(spec.generation, 0) is None:  # still building
            del live[spec.generation]
            if not live:
                _LIVE.pop(spec.job, None)
            _WITHERING.setdefault(spec.job, set()).add(spec.generation)


def _destroy(pg: dist.ProcessGroup) -> None:
    """Unregister one group from c10d and shut it down, never touching the default world's others."""
    with _LOCK:
        if pg not in c10d._world.pg_map:
            return
        if c10d._world.default_pg is pg:
            c10d._update_default_pg(None)
        dist.destroy_process_group(pg)


def _new_pg(
    store: dist.Store, rank: int, size: int, backend: Backend, device: Device, timeout: timedelta
) -> dist.ProcessGroup:
    """A process group over ``store`` with this process as ``rank`` of ``size``: gloo for CPU tensors,
    plus NCCL for CUDA tensors when ``backend`` is ``"nccl"``."""
    pg = dist.ProcessGroup(store, rank, size)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, size, timeout)
    gloo._set_sequence_number_for_group()
    if backend == "gloo":
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        return pg
    # NCCL: the communicator is connected now (eagerly), on this background thread, instead of lazily
    # inside the first collective, which would put its setup back on the training path.
    cuda = torch.device("cuda", device.index)
    keep_process_on_nccl_errors()
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("cuda", store), rank, size, options)
    nccl._set_sequence_number_for_group()
    pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
    pg.bound_device_id = cuda
    nccl.eager_connect_single_device(cuda)
    return pg


def keep_process_on_nccl_errors() -> None:
    """Have NCCL groups made from now on raise on a lost peer rather than end this process (see
    :data:`NCCL_CLEAN_UP_ONLY`); a value the user set in the environment is kept. Read by each
    ``ProcessGroupNCCL`` when it is made, Megatron's own ``new_group`` calls included."""
    os.environ.setdefault(NCCL_ERROR_HANDLING_ENV, NCCL_CLEAN_UP_ONLY)


def _register_in_world(
    pg: dist.ProcessGroup, backend: Backend, store: dist.Store, name: str, rank_mapping: dict[int, int]
) -> None:
    """Make c10d know ``pg`` as it knows the groups ``new_group`` makes (by name, ranks and tag), so
    that Megatron's and torch's own lookups find it.

    torch 2.13 has one helper for it; before, ``new_group`` updated the same tables inline, so on an
    older torch (a GPU image's: the first GPU run met torch 2.11) the same updates are made here."""
    register = getattr(c10d, "_register_pg_in_world", None)
    if register is not None:
        register(
            pg,
            backend_name=backend,
            store=store,
            group_name=name,
            backend_config=_backend_config(backend),
            rank_mapping=rank_mapping,
        )
        return
    world = c10d._world
    world.pg_map[pg] = (backend, store)
    world.pg_names[pg] = name
    world.pg_backend_config[pg] = _backend_config(backend)
    c10d._register_process_group(name, pg)
    world.pg_group_ranks[pg] = rank_mapping
    tag = f"ptd:{name}"
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.pg_to_tag[pg] = tag


def _backend_config(backend: Backend) -> str:
    return "cpu:gloo" if backend == "gloo" else "cpu:gloo,cuda:nccl"


class World:
    """One generation's groups as seen by one of its members. Built by :func:`build_world`."""

    def __init__(
        self,
        spec: WorldSpec,
        device: Device,
        rank: int,
        backend: Backend,
        groups: Mapping[GroupKind, WorldGroup],
        client: dist.TCPStore,
        build_seconds: float,
    ) -> None:
        self.spec = spec
        self.device = device
        self.rank = rank
        self.backend = backend
        self.build_seconds = build_seconds
        self._groups = dict(groups)
        self._client = client  # the connection this generation's groups were built over
        self._released = False
        self._names_before_adoption: set[str] | None = None
        self._derived: list[dist.ProcessGroup] = []
        self._log = log.bind(job=spec.job, generation=spec.generation, rank=rank)

    # -- what the world is ---------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self.spec.generation

    @property
    def layout(self) -> ParallelLayout:
        return self.spec.layout

    @property
    def store(self) -> dist.TCPStore:
        """The job store connection this generation was built over (its keys live under
        ``spec.namespace``)."""
        return self._client

    @property
    def placement(self) -> Placement:
        return self.spec.placement

    @property
    def size(self) -> int:
        return self.spec.layout.world_size

    @property
    def released(self) -> bool:
        return self._released

    @property
    def groups(self) -> Mapping[GroupKind, WorldGroup]:
        return dict(self._groups)

    def member_of(self, kind: GroupKind) -> bool:
        return (alias_of(self.layout, kind, self.spec.instances) or kind) in self._groups

    def group(self, kind: GroupKind) -> dist.ProcessGroup:
        """This process's group of ``kind`` (or of the kind that stands in for it, :func:`alias_of`);
        raises when released or when this rank has none."""
        if self._released:
            raise WorldError(f"generation {self.generation} was released; its groups are gone")
        found = self._groups.get(alias_of(self.layout, kind, self.spec.instances) or kind)
        if found is None:
            raise WorldError(f"rank {self.rank} of generation {self.generation} is in no {kind} group")
        return found.pg

    def ranks(self, kind: GroupKind) -> tuple[int, ...]:
        """The world ranks of this process's group of ``kind`` (group rank i is ``ranks[i]``)."""
        found = self._groups.get(alias_of(self.layout, kind, self.spec.instances) or kind)
        if found is None:
            raise WorldError(f"rank {self.rank} of generation {self.generation} is in no {kind} group")
        return found.slot.ranks

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return (
            f"World(job={self.spec.job}, gen={self.generation}, {self.layout.describe()}, "
            f"rank={self.rank}, {state})"
        )

    # -- becoming the default world ---------------------------------------------------------------------
    def adopt_as_default(self, timeout: timedelta | None = None) -> None:
        """Make this world c10d's default, for code that only knows the default world (``parallel_state``,
        ``dist.get_rank()``, ``new_group``).

        A collective over this world: every member must call it. ``new_group`` names groups from a
        per-process counter, and processes that lived through different earlier worlds hold different
        counts, so their ``new_group`` calls would wait on differently named keys forever. The members
        agree on the largest count first; a name from that count on is unused in every one of them.
        Groups created through ``new_group`` while this world is the default are released with it.
        """
        pg = self.group(GroupKind.WORLD)
        count = torch.tensor([c10d._world.group_count], dtype=torch.int64)
        allreduce(pg, count, dist.ReduceOp.MAX, timeout)
        with _LOCK:
            previous = c10d._world.default_pg
            if previous is pg:
                return
            for world in _live_worlds():
                if world is not self and world._names_before_adoption is not None:
                    world._close_adoption_window()
            c10d._update_default_pg(pg)
            c10d._world.group_count = int(count.item())
            self._names_before_adoption = set(c10d._world.pg_names.values())
        self._log.info("world.adopted_as_default", group_count=int(count.item()))

    def restore_default(self) -> None:
        """Make this world c10d's default again after another was adopted for a moment (the new trainer
        built before the cut): locally, no collective, so the other members need not take part.

        The group-name counter keeps the value the other world agreed on; members that did not take
        part keep theirs, so before this world's members make groups with ``new_group`` again they must
        agree once more (:meth:`adopt_as_default`, which a handoff given up after its build does)."""
        with _LOCK:
            pg = self.group(GroupKind.WORLD)
            if c10d._world.default_pg is pg:
                return
            for world in _live_worlds():
                if world is not self and world._names_before_adoption is not None:
                    world._close_adoption_window()
            c10d._update_default_pg(pg)
            self._names_before_adoption = set(c10d._world.pg_names.values())
        self._log.debug("world.default_restored")

    def warm(self, timeout: timedelta | None = None) -> int:
        """One all-reduce on each of this process's groups, so that no first collective of the new world
        pays a communicator's lazy set-up on the paused path; returns how many groups it touched.

        A collective over every group: every member calls it, at the same point. The groups are taken in
        :class:`GroupKind` order in every process, so no two processes wait on each other in different
        groups (a process reaches a kind's group only after all its members finished the earlier kinds).
        """
        touched = 0
        for kind in GroupKind:
            found = self._groups.get(kind)
            if found is None:
                continue
            warm_group(found.pg, self.backend, self.device, timeout)
            touched += 1
        self._log.debug("world.warmed", groups=touched)
        return touched

    def _close_adoption_window(self) -> None:
        """Remember the groups ``new_group`` made while this world was the default: they are its own."""
        before = self._names_before_adoption or set()
        for group, name in list(c10d._world.pg_names.items()):
            if name not in before and name not in _OWNED:
                self._derived.append(group)
        self._names_before_adoption = None

    # -- release ------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Destroy this generation's groups (and those made on it while it was the default) and forget it.

        Call it once no collective of this world is in flight: after the switch, every member releases
        the old world. Releasing twice is harmless.
        """
        with _LOCK:
            if self._released:
                return
            if self._names_before_adoption is not None:
                self._close_adoption_window()
                if c10d._world.default_pg is self._groups[GroupKind.WORLD].pg:
                    c10d._update_default_pg(None)
            derived, self._derived = self._derived, []
            for group in derived:
                _destroy(group)
            for built in reversed(list(self._groups.values())):
                _destroy(built.pg)
                _OWNED.discard(built.name)
            # Drop the group objects too: a gloo group closes its connections only when it is destroyed
            # (shutdown() leaves them open), and peers blocked in one of its collectives fail only then.
            self._groups = {}
            self._released = True
            _unreserve(self.spec)
        self._log.info("world.released", derived_groups=len(derived))


def _live_worlds() -> Iterator[World]:
    for generations in _LIVE.values():
        for world in generations.values():
            if world is not None:
                yield world


def allreduce(
    pg: dist.ProcessGroup, tensor: torch.Tensor, op: dist.ReduceOp, timeout: timedelta | None = None
) -> None:
    """A blocking all-reduce on ``pg`` with a per-call timeout (``dist.all_reduce`` takes none), for
    control votes whose wait has its own deadline."""
    options = dist.AllreduceOptions()
    options.reduceOp = op
    if timeout is not None:
        options.timeout = timeout
    pg.allreduce([tensor], options).wait()


def warm_group(pg: dist.ProcessGroup, backend: Backend, device: Device, timeout: timedelta | None) -> None:
    """One small all-reduce on ``pg`` on the device its traffic uses (the GPU's for NCCL)."""
    where = torch.device("cuda", device.index) if backend == "nccl" else torch.device("cpu")
    allreduce(pg, torch.zeros(1, device=where), dist.ReduceOp.SUM, timeout)


def build_world(
    spec: WorldSpec,
    device: Device,
    store: StoreAddress,
    *,
    backend: Backend = "gloo",
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> World:
    """Build this process's groups of ``spec`` (blocks until the members of each group have arrived).

    ``device`` must be in ``spec.placement``; a process that has no place in the world builds nothing.
    ``timeout`` bounds the rendezvous of each group and is the groups' default collective timeout.
    """
    rank = _check_build(spec, device, backend)
    _reserve(spec)
    return _build_reserved(spec, device, rank, store, backend, timeout)


def _check_build(spec: WorldSpec, device: Device, backend: str) -> int:
    rank = spec.rank_of(device)
    if rank is None:
        raise WorldError(f"device {device} has no rank in generation {spec.generation} of job {spec.job}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"`backend`: {backend!r} is neither 'gloo' nor 'nccl'")
    return rank


def _build_reserved(
    spec: WorldSpec, device: Device, rank: int, store: StoreAddress, backend: Backend, timeout: timedelta
) -> World:
    """Build the groups of a generation whose slot this process already holds (released on failure)."""
    bound = log.bind(job=spec.job, generation=spec.generation, rank=rank)
    started = time.perf_counter()
    built: list[WorldGroup] = []
    try:
        client = connect_store(store, timeout)
        namespace = dist.PrefixStore(spec.namespace, client)
        for slot in memberships(spec.layout, rank, spec.instances):
            name = f"{spec.namespace}/{slot.kind}/{slot.index}"
            group_store = dist.PrefixStore(f"groups/{slot.kind}/{slot.index}", namespace)
            pg = _new_pg(group_store, slot.ranks.index(rank), len(slot.ranks), backend, device, timeout)
            pg._set_group_name(name)
            pg._set_group_desc(f"liver {slot.kind} group {slot.index}")
            with _LOCK:
                _register_in_world(pg, backend, group_store, name, {r: i for i, r in enumerate(slot.ranks)})
                _OWNED.add(name)
            built.append(WorldGroup(slot, name, pg))
        # new_group on an adopted world keys its groups under this prefix (see adopt_as_default).
        with _LOCK:
            c10d._world.pg_map[built[0].pg] = (backend, dist.PrefixStore("c10d", namespace))
    except BaseException:
        with _LOCK:
            for group in reversed(built):
                _destroy(group.pg)
                _OWNED.discard(group.name)
            _unreserve(spec)
        raise
    seconds = time.perf_counter() - started
    world = World(
        spec,
        device,
        rank,
        backend,
        {g.slot.kind: g for g in built},
        client,
        seconds,
    )
    with _LOCK:
        if spec.generation not in _WITHERING.get(spec.job, ()):
            _LIVE[spec.job][spec.generation] = world
    bound.info("world.built", layout=spec.layout.describe(), groups=len(built), seconds=round(seconds, 4))
    return world


class WorldBuild:
    """A world being built on a background thread while the caller keeps training on its active world.

    The thread only waits on the network; it never touches the active world, so the training thread's
    collectives are unaffected. Poll :meth:`done` at iteration boundaries (the cut decides when to use
    it), or :meth:`result` to block.
    """

    def __init__(
        self,
        spec: WorldSpec,
        device: Device,
        rank: int,
        store: StoreAddress,
        backend: Backend,
        timeout: timedelta,
    ) -> None:
        self.spec = spec
        self.started_at = time.monotonic()
        self.finished_at: float | None = None
        self._world: World | None = None
        self._error: BaseException | None = None
        self._discarded = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run,
            args=(device, rank, store, backend, timeout),
            name=f"liver-world-{spec.job}-gen{spec.generation}",
            daemon=True,
        )

    def _start(self) -> None:
        self._thread.start()

    def _run(
        self, device: Device, rank: int, store: StoreAddress, backend: Backend, timeout: timedelta
    ) -> None:
        try:
            world = _build_reserved(self.spec, device, rank, store, backend, timeout)
        except BaseException as error:  # reported to the caller through result() / error
            log.warning(
                "world.build_failed",
                job=self.spec.job,
                generation=self.spec.generation,
                error=repr(error),
            )
            with self._lock:
                self._error = error
                self.finished_at = time.monotonic()
            return
        with self._lock:
            self._world = world
            self.finished_at = time.monotonic()
            discard = self._discarded
        if discard:
            world.release()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the build ends (built or failed) or ``timeout`` passes; whether it ended."""
        self._thread.join(timeout)
        return self.done()

    @property
    def ready(self) -> bool:
        """Built without error (and not discarded): this rank can switch to it."""
        with self._lock:
            return self._world is not None and not self._discarded

    @property
    def error(self) -> BaseException | None:
        with self._lock:
            return self._error

    def result(self, timeout: float | None = None) -> World:
        """The built world; raises the build's error, or :class:`TimeoutError` if still building."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"generation {self.spec.generation} still building after {timeout} s")
        with self._lock:
            if self._error is not None:
                raise WorldError(f"building generation {self.spec.generation} failed: {self._error!r}") from (
                    self._error
                )
            if self._discarded or self._world is None:
                raise WorldError(f"generation {self.spec.generation} was discarded")
            return self._world

    def discard(self) -> None:
        """Give the world up (an aborted handoff): released now if built, else as soon as it is (and
        until then it does not count as a live generation: see ``_WITHERING``)."""
        with self._lock:
            self._discarded = True
            world = self._world
            if world is None and self._error is None:
                _wither(self.spec)
        if world is not None:
            world.release()


def build_world_async(
    spec: WorldSpec,
    device: Device,
    store: StoreAddress,
    *,
    backend: Backend = "gloo",
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> WorldBuild:
    """Start building ``spec`` on a background thread; returns at once.

    The generation rules are checked here, on the caller's thread, so a third generation or a stale id
    fails immediately rather than inside the thread.
    """
    rank = _check_build(spec, device, backend)
    _reserve(spec)
    build = WorldBuild(spec, device, rank, store, backend, timeout)
    build._start()
    return build


# -- the stream group: old and new world together, for the handoff --------------------------------------


def stream_devices(old: WorldSpec, new: WorldSpec, lost: Collection[Device] = ()) -> tuple[Device, ...]:
    """Every device of either world once, but the ``lost`` ones (their processes are gone): the old
    world's in old rank order, then the devices only the new world uses, in new rank order. Group rank i
    of the stream group runs on ``stream_devices[i]`` (the numbering ``stream.schedule.GroupRanks.by_device``
    assumes)."""
    order = dict.fromkeys(d for d in old.placement.devices if d not in lost)
    for device in new.placement.devices:
        if device in lost:
            raise WorldError(f"device {device} is lost, but generation {new.generation} runs on it")
        order.setdefault(device)
    return tuple(order)


class StreamGroup:
    """One group over the processes of both worlds, which carries the transfer plan between them.

    Neither world can: a leaving rank is only in the old one and a joiner only in the new one. It lives
    under the new generation's namespace and only for the handoff; it is not registered with c10d (the
    executor uses its group-local send/recv).
    """

    def __init__(
        self,
        old: WorldSpec,
        new: WorldSpec,
        devices: tuple[Device, ...],
        pg: dist.ProcessGroup,
        *,
        device: Device | None = None,
        backend: Backend = "gloo",
    ):
        self.old = old
        self.new = new
        self.devices = devices
        self.device = device  # this process's (None: unknown, the group is then warmed on the CPU)
        self.backend = backend
        self.pg: dist.ProcessGroup | None = pg

    @property
    def rank(self) -> int:
        return self.group().rank()

    def group(self) -> dist.ProcessGroup:
        if self.pg is None:
            raise WorldError(f"the stream group into generation {self.new.generation} was released")
        return self.pg

    def warm(self, timeout: timedelta | None = None) -> None:
        """One all-reduce over the group (every process of both worlds calls it): see :meth:`World.warm`."""
        if self.device is None or self.backend == "gloo":
            allreduce(self.group(), torch.zeros(1), dist.ReduceOp.SUM, timeout)
        else:
            warm_group(self.group(), self.backend, self.device, timeout)

    def release(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            pg.shutdown()


def build_stream_group(
    old: WorldSpec,
    new: WorldSpec,
    device: Device,
    store: StoreAddress,
    *,
    backend: Backend = "gloo",
    timeout: timedelta = DEFAULT_TIMEOUT,
    lost: Collection[Device] = (),
) -> StreamGroup:
    """Build this process's stream group for the handoff ``old`` -> ``new`` (blocks until all arrive).

    Every process of either world calls it, but those on ``lost`` devices (gone: the group is made
    without them); build it on the same thread as the shadow world (before or after it, the same way in
    every process) or on a thread of its own.
    """
    if old.job != new.job:
        raise WorldError(f"the stream group joins worlds of one job, not {old.job} and {new.job}")
    if new.generation <= old.generation:
        raise WorldError(f"generation {new.generation} does not follow generation {old.generation}")
    devices = stream_devices(old, new, lost)
    if device not in devices:
        raise WorldError(
            f"device {device} is in neither generation {old.generation} nor {new.generation}, or lost"
        )
    client = connect_store(store, timeout)
    prefix = dist.PrefixStore(f"{new.namespace}/stream", client)
    pg = _new_pg(prefix, devices.index(device), len(devices), backend, device, timeout)
    return StreamGroup(old, new, devices, pg, device=device, backend=backend)
