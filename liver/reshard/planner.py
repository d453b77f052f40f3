"""The transfer planner: old world + new world -> a verified, coalesced, layer-streamed plan.

Pure computation on metadata (no I/O). Layers that move alike (the same tensors by shape and sharding,
held by the same stages and EP ranks in both worlds: a 96-layer model cut into 16 and then 12 stages has
26 such classes) are planned once per class (:class:`~liver.reshard.plan.LayerClass`). The steps:

1. For each class and each group of its tensors held by the same pipeline stages, and for each new TP
   rank, the pieces of the new shard with the old TP rank that holds each (``geometry``: once per
   distinct geometry, not per tensor).
2. For each new rank that holds the group, the candidate senders of each piece: the old rank on the same
   device if it holds the piece (locality, a copy instead of a send), else the holders on the same node,
   else every holder. Holders on ``lost`` devices (gone before the handoff: fail-stop, or a warning that
   came too late) are never candidates; when a shard's every holder is lost (:func:`orphaned_shards`,
   checked before step 1) the state cannot be rebuilt and planning fails (:class:`NoSurvivingSource`).
3. Coalescing into source slots: pieces with the same candidates share one, a replicated piece rides
   with a sharded one of its group, and slots whose candidates overlap merge to the common ones. Then,
   layer by layer, each slot takes the candidate that has sent the fewest bytes so far (balance across
   DP replicas): one message per source, destination and layer.
4. Streaming: per layer, a destination receives at most ``budget_bytes`` over the network per round;
   bigger layers take several rounds, and a slice bigger than the budget is cut into boxes.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Collection, Sequence
from itertools import chain
from typing import NamedTuple

import msgspec

from liver.reshard.boxes import Box, intersect, split, volume
from liver.reshard.dist_opt import owned_boxes, shard_group
from liver.reshard.holdings import holding, is_dp_sharded
from liver.reshard.plan import LayerClass, Plan, Slice, TaskTemplate, WorldConfig
from liver.reshard.redundancy import NO_KEEPER, alike_holders, copied_set, redundancy
from liver.reshard.views import (
    expert_rank,
    grid_of,
    holder_ranks,
    holding_stages,
    home_stages,
    stage_of_layers,
    tp_shard,
)
from liver.shared.collector import collector_paused
from liver.shared.errors import PlanningError
from liver.shared.geometry import ModelGeometry, TensorSpec
from liver.shared.layout import Device, Grid, LayoutError, ParallelLayout, Placement
from liver.shared.model import ModelSpec, as_geometry

from .placement import (
    DEFAULT_INTER_NODE_WEIGHT,
    bytes_moved,
    local_lower_bound,
    optimized_placement,
    rank_order_placement,
)
from .templates import ANY, new_shard_pieces

DEFAULT_BUDGET_BYTES = 512 * 1024 * 1024
LOST_DEVICES_NAMED = 8
"""How many lost devices a :class:`NoSurvivingSource` message lists before it only counts the rest."""


class NoSurvivingSource(PlanningError):
    """Part of the training state was held only by lost devices, so no transfer plan can rebuild it.

    Not a bug in the plan's inputs: the job cannot continue live and must fall back to its checkpoint
    (the transfer service reports it as a ``PlanningFailed``, which the coordinator turns into that).
    """

    def __init__(self, tensor: str, holders: Sequence[Device], lost: Sequence[Device]) -> None:
        self.tensor = tensor
        self.holders = tuple(holders)
        self.lost = tuple(sorted(lost))
        named = ", ".join(map(str, self.lost[:LOST_DEVICES_NAMED]))
        more = len(self.lost) - LOST_DEVICES_NAMED
        super().__init__(
            f"no surviving device holds part of {tensor}: its holders "
            f"{', '.join(map(str, self.holders))} are all lost "
            f"(lost devices: {named}{f' and {more} more' if more > 0 else ''})"
        )


class PlanStats(msgspec.Struct, frozen=True, kw_only=True):
    """Numbers that describe a plan (all bytes exclude vocabulary padding)."""

    tensors: int
    slices: int  # non-empty (tensor, source, destination) intersections: tasks before coalescing
    tasks: int  # coalesced tasks, local ones included
    messages: int  # coalesced tasks that cross devices
    rounds: int  # streaming steps (layer, round)
    bytes_total: int  # the whole new state
    bytes_local: int  # copied on the same device
    bytes_moved: int  # sent between devices
    bytes_inter_node: int  # of which between nodes
    max_recv_bytes: int  # the most one new rank receives over the whole plan
    max_round_recv_bytes: int  # the most one new rank receives in one round (<= budget)
    max_send_bytes: int  # the most one old rank sends


def build_plan(
    model: ModelSpec | ModelGeometry,
    old: WorldConfig,
    new: WorldConfig,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    optimizer: bool = True,
    *,
    lost: Collection[Device] = (),
    copies: bool = False,
) -> Plan:
    """The plan that moves the training state of ``model`` from ``old`` to ``new``, taking nothing from
    the ``lost`` devices of ``old``; raises :class:`NoSurvivingSource` when some state survives nowhere.
    With ``copies`` (the job keeps peer copies, :mod:`liver.reshard.redundancy`) a lost rank's copied
    state is taken from its keeper's copy: the rank stands in the plan as the source, run by its keeper
    (:attr:`Plan.stand_ins`).

    Python's garbage collector waits meanwhile (:func:`~liver.shared.collector.collector_paused`): a
    large plan is hundreds of thousands of small objects, none in a cycle."""
    with collector_paused():
        return _build_plan(model, old, new, budget_bytes, optimizer, lost, copies)


def _build_plan(
    model: ModelSpec | ModelGeometry,
    old: WorldConfig,
    new: WorldConfig,
    budget_bytes: int,
    optimizer: bool,
    lost: Collection[Device],
    copies: bool,
) -> Plan:
    model = as_geometry(model)
    model.check_layout(old.layout)
    model.check_layout(new.layout)
    tensors = model.tensors(optimizer)
    if budget_bytes < max(t.itemsize for t in tensors):
        raise ValueError(f"budget_bytes ({budget_bytes}) is smaller than one element")
    lost = _check_lost(lost, old, new)
    stand = stand_ins(model, old, lost) if copies else _NO_STAND_INS
    orphans = orphaned_shards(model, old, lost, stand)
    if orphans:
        # A class of the distributed optimizer's state spans every DP replica, of which only the lost
        # ones owned the piece that is gone: name those.
        holders = [old.placement.devices[r] for r in class_holders(old.layout, orphans[0])]
        raise NoSurvivingSource(orphans[0].tensor, [d for d in holders if d in lost], lost)
    streamer = _Streamer(tensors, budget_bytes)
    classes = tuple(
        LayerClass(c.layers, c.bases, streamer.stream(c.pairs, c.local, c.bases[0]), c.sources)
        for c in _choose_sources(model, tensors, optimizer, old, new, lost, stand)
    )
    return Plan(
        model=model,
        old=old,
        new=new,
        tensors=tensors,
        budget_bytes=budget_bytes,
        classes=classes,
        stand_ins=tuple(sorted(stand.keepers.items())),
    )


class StandIns(NamedTuple):
    """The lost ranks whose copied state their keepers send (:func:`stand_ins`)."""

    keepers: dict[int, int]  # lost old rank -> the old rank that keeps its copy
    copied: dict[int, frozenset[int]]  # lost old rank -> the tensor indices its copy holds

    def has(self, rank: int, tensor: int) -> bool:
        """Whether ``rank``'s piece of tensor ``tensor`` survives in a copy its keeper holds."""
        held = self.copied.get(rank)
        return held is not None and tensor in held


_NO_STAND_INS = StandIns({}, {})


def stand_ins(model: ModelGeometry, old: WorldConfig, lost: Collection[Device]) -> StandIns:
    """Each lost old rank with a peer copy whose keeper survives, and what its copy holds."""
    gone = frozenset(lost)
    if not gone:
        return _NO_STAND_INS
    devices = old.placement.devices
    red = redundancy(model, old.layout, old.placement)
    keepers = {
        r: k
        for r, k in enumerate(red.keepers)
        if devices[r] in gone and k != NO_KEEPER and devices[k] not in gone and red.copied[r]
    }
    return StandIns(keepers, {r: copied_set(model, old.layout, old.placement, r) for r in keepers})


def _check_lost(lost: Collection[Device], old: WorldConfig, new: WorldConfig) -> frozenset[Device]:
    """``lost`` as a set, refused when it names a device outside the old world or one the new world
    uses (a lost device can neither send nor receive)."""
    out = frozenset(lost)
    if not out:
        return out
    unknown = sorted(out - set(old.placement.devices))
    if unknown:
        raise LayoutError(f"lost: device {unknown[0]} is not in the old world")
    used = sorted(out & set(new.placement.devices))
    if used:
        raise LayoutError(f"lost: device {used[0]} is lost but the new placement uses it")
    return out


class ShardClass(NamedTuple):
    """One distinct shard of the state: held by every rank of ``stages`` with TP rank ``tp`` of the
    tensor's grid (:data:`ANY`: any TP rank) and, for an expert's tensor, EP rank ``ep`` (``-1``: a
    dense tensor), whatever its replica index; ``tensor`` names the first tensor that has it."""

    stages: tuple[int, ...]
    ep: int
    tp: int
    tensor: str


@functools.lru_cache(maxsize=64)
def shard_classes(model: ModelGeometry, layout: ParallelLayout) -> tuple[ShardClass, ...]:
    """Every distinct shard of the state (:class:`ShardClass`). Optimizer states sit beside their
    parameters, so parameters alone decide."""
    out: dict[tuple[tuple[int, ...], int, int], str] = {}
    for t in model.tensors(optimizer=False):
        stages = holding_stages(t, model, layout)
        if not stages:
            continue
        ep = expert_rank(t, model, layout) if t.expert >= 0 else -1
        if t.rule == "replicated":
            out.setdefault((stages, ep, ANY), t.name)
            continue
        tp = grid_of(t, layout).tp
        for r in range(tp):
            if tp_shard(t, model, tp, r).box is not None:
                out.setdefault((stages, ep, r), t.name)
    return tuple(ShardClass(stages, ep, tp, name) for (stages, ep, tp), name in sorted(out.items()))


def class_holders(layout: ParallelLayout, shard: ShardClass) -> list[int]:
    """The ranks of ``layout`` that hold ``shard``."""
    grid = layout.grid(expert=shard.ep >= 0)
    tps = range(grid.tp) if shard.tp == ANY else (shard.tp,)
    ep = max(shard.ep, 0)
    return [grid.rank(tp, ep, r, pp) for pp in shard.stages for tp in tps for r in range(grid.replicas)]


def orphaned_shards(
    model: ModelGeometry, old: WorldConfig, lost: Collection[Device], stand: StandIns | None = None
) -> list[ShardClass]:
    """The shards of :func:`shard_classes` whose every holder in ``old`` is ``lost`` (and, with
    ``stand``, of which no lost holder left a peer copy): empty exactly when a plan from ``old`` without
    the ``lost`` devices exists (the simulator asks this without planning)."""
    gone = frozenset(lost)
    if not gone:
        return []
    stand = stand or _NO_STAND_INS
    devices = old.placement.devices
    index = _tensor_index(model)
    orphans = []
    for shard in shard_classes(model, old.layout):
        holders = class_holders(old.layout, shard)
        if all(devices[r] in gone for r in holders) and not any(
            stand.has(r, index[shard.tensor]) for r in holders
        ):
            orphans.append(shard)
    if isinstance(model, ModelGeometry) and model.distributed:  # a ModelSpec is the plain optimizer's
        orphans += _lost_owners(model, old, gone, stand)
    return orphans


@functools.lru_cache(maxsize=16)
def _tensor_index(model: ModelGeometry) -> dict[str, int]:
    return {t.name: i for i, t in enumerate(model.tensors(optimizer=True))}


def _lost_owners(
    model: ModelGeometry, old: WorldConfig, lost: frozenset[Device], stand: StandIns
) -> list[ShardClass]:
    """Under the distributed optimizer each piece of the optimizer state has one owner per instance of
    the optimizer (its DP rank, or expert-DP rank for an expert's): the state of a lost owner is lost,
    unless another instance's owner survives, or it is TP-replicated or a tied embedding, whose
    replicas own alike and one of which survives."""
    layout, devices = old.layout, old.placement.devices
    out = []
    for rank, device in enumerate(devices):
        if device not in lost:
            continue
        for ti, t in enumerate(model.tensors(optimizer=True)):
            if not is_dp_sharded(t, model) or not holding(t, model, layout, rank):
                continue
            owners = alike_holders(t, model, layout, rank)
            if all(devices[r] in lost for r in owners) and not any(stand.has(r, ti) for r in owners):
                tp, ep, _replica, _pp = grid_of(t, layout).place(rank)
                stages = holding_stages(t, model, layout)
                out.append(ShardClass(stages, ep if t.expert >= 0 else -1, tp, t.name))
                break
    return out


class _Sources:
    """Source choice for pieces of one new rank's shard (step 2 of the module docstring)."""

    def __init__(self, old: WorldConfig, lost: frozenset[Device], stand: StandIns = _NO_STAND_INS) -> None:
        self.stand = stand
        self.layout = old.layout
        n = old.layout.world_size
        self.place = {e: [old.layout.grid(e).place(r) for r in range(n)] for e in (False, True)}
        self.alive = [d not in lost for d in old.placement.devices]
        self.rank_on = {d: r for d, r in old.placement.rank_on().items() if d not in lost}
        self.on_node: dict[str, list[int]] = defaultdict(list)
        for r, d in enumerate(old.placement.devices):
            if d not in lost:
                self.on_node[d.node].append(r)
        self.sent = [0] * n
        # Candidate lists, by what decides them (the same few recur for every layer of a model).
        self._on_node: dict[tuple[str, bool, int, int, tuple[int, ...]], tuple[int, ...]] = {}
        self._anywhere: dict[tuple[bool, int, tuple[int, ...], tuple[int, ...]], tuple[int, ...]] = {}

    def candidates(
        self,
        expert: bool,
        ep: int,
        key: int,
        stages: tuple[int, ...],
        dev: Device,
        fallback_tp: int,
        probe: int = -1,
    ) -> tuple[int, ...]:
        """The ranks that may send ``dev`` a piece held by old TP rank ``key`` (or any) of the ``expert``
        grid, EP rank ``ep``, on ``stages``: the rank on ``dev`` itself when it holds it (a copy), else
        the holders on its node, else all holders; when every holder is lost, the lost holders whose
        peer copy holds it (tensor ``probe``, which stands for the piece's tensors: they share their
        holders), run by their keepers. One exists (:func:`build_plan` refused orphaned state before)."""
        place = self.place[expert]
        r = self.rank_on.get(dev)
        if r is not None:
            tp, e, _replica, pp = place[r]
            if pp in stages and e == ep and (key == ANY or tp == key):
                return (r,)
        near_key = (dev.node, expert, ep, key, stages)
        near = self._on_node.get(near_key)
        if near is None:
            near = self._on_node[near_key] = tuple(
                r
                for r in self.on_node.get(dev.node, ())
                if (p := place[r])[3] in stages and p[1] == ep and (key == ANY or p[0] == key)
            )
        if near:
            return near
        far = self._holders(expert, ep, (fallback_tp if key == ANY else key,), stages)
        if not far and key == ANY:
            # A replicated piece whose usual TP rank is lost: every TP rank of the stages holds it.
            far = self._holders(expert, ep, tuple(range(self.layout.grid(expert).tp)), stages)
        if not far and self.stand.keepers:
            tps = tuple(range(self.layout.grid(expert).tp)) if key == ANY else (key,)
            grid = self.layout.grid(expert)
            far = tuple(
                r
                for tp in tps
                for pp in stages
                for replica in range(grid.replicas)
                if self.stand.has(r := grid.rank(tp, ep, replica, pp), probe)
            )
        if not far:
            raise PlanningError(f"no surviving holder of a piece on stages {stages}")  # refused before
        return far

    def _holders(
        self, expert: bool, ep: int, tps: tuple[int, ...], stages: tuple[int, ...]
    ) -> tuple[int, ...]:
        """The surviving ranks with TP rank in ``tps`` on ``stages``, in (TP, stage, replica) order."""
        found = self._anywhere.get((expert, ep, tps, stages))
        if found is None:
            grid, alive = self.layout.grid(expert), self.alive
            found = self._anywhere[(expert, ep, tps, stages)] = tuple(
                r
                for tp in tps
                for pp in stages
                for replica in range(grid.replicas)
                if alive[r := grid.rank(tp, ep, replica, pp)]
            )
        return found


class _Chunk(NamedTuple):
    """Slices of one new shard that come from one old TP rank (or any), shared by every DP replica and
    stage that needs them, so the planner never copies or re-measures them."""

    slices: tuple[Slice, ...]
    sizes: tuple[int, ...]
    nbytes: int


def _relative_templates(
    model: ModelGeometry, tensors: tuple[TensorSpec, ...], idxs: list[int], tp_old: int, tp_new: int
) -> list[list[tuple[int, list[tuple[int, Box]], tuple[int, ...]]]]:
    """Per new TP rank: ``(piece key, [(tensor offset in group, box)], sizes)``, independent of which
    layer the group is, so every decoder layer reuses the first one's."""
    out = []
    for q in range(tp_new):
        parts: dict[int, tuple[list[tuple[int, Box]], list[int]]] = {}
        for off, ti in enumerate(idxs):
            t = tensors[ti]
            for key, box in new_shard_pieces(t, model, tp_old, tp_new, q):
                slices, sizes = parts.setdefault(key, ([], []))
                slices.append((off, box))
                sizes.append(volume(box) * t.itemsize)
        out.append([(key, sl, tuple(sz)) for key, (sl, sz) in parts.items()])
    return out


class _ClassWork(NamedTuple):
    """A class of layers being planned. ``pairs`` maps ``(slot, dst)`` to the chunks a source slot sends
    (tensor indices relative to each layer's base); ``sources[i][slot]`` is the slot's old rank in the
    class's ``i``-th layer; ``local`` slots are copies on the destination's device."""

    layers: tuple[int, ...]
    bases: tuple[int, ...]
    pairs: dict[tuple[int, int], list[_Chunk]]
    local: frozenset[int]
    sources: tuple[tuple[int, ...], ...]


class _Group(NamedTuple):
    """Tensors of one layer held alike (same home, and for experts the same EP ranks in both worlds),
    as every layer of its class has them. The experts one EP rank holds in both worlds form one group:
    they have the same senders, so planning them one by one would only repeat the work."""

    expert: bool  # an expert's state (the expert grid)
    offsets: tuple[int, ...]  # from the layer's base
    signature: tuple  # (expert or not, (rule, shape, itemsize) per tensor): what the intersections need
    stages_old: tuple[int, ...]
    stages_new: tuple[int, ...]
    ep_old: int
    ep_new: int


class _Kind(NamedTuple):
    """A streaming layer's tensors as every layer of its kind has them, whatever the layouts: the
    replicated state by (home, expert) with offsets from the layer's first tensor, and the offsets of
    the state the distributed optimizer shards over DP."""

    homes: tuple[tuple[str, int, tuple[int, ...], tuple], ...]  # (home, expert, offsets, per-tensor key)
    owned: tuple[int, ...]


@functools.lru_cache(maxsize=16)
def _layer_kinds(
    model: ModelGeometry, optimizer: bool
) -> tuple[tuple[tuple[int, int, int], ...], tuple[_Kind, ...]]:
    """``((layer, first tensor index, kind), ...)`` and the kinds: a model's layers walked tensor by
    tensor once (a 61-layer model of 256 experts has 120,000 tensors), so that each resize plans from
    the few kinds instead."""
    tensors = model.tensors(optimizer)
    spans: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        spans.setdefault(t.layer, []).append(i)
    ids: dict[_Kind, int] = {}
    layers = []
    for layer, idxs in spans.items():
        first = idxs[0]
        owned: list[int] = []
        homes: dict[tuple[str, int], tuple[list[int], list[tuple]]] = {}
        for i in idxs:
            t = tensors[i]
            if is_dp_sharded(t, model):
                owned.append(i - first)
                continue
            offs, keys = homes.setdefault((t.home, t.expert), ([], []))
            offs.append(i - first)
            keys.append((t.rule, t.shape, t.itemsize))
        kind = _Kind(
            tuple((home, expert, tuple(offs), tuple(keys)) for (home, expert), (offs, keys) in homes.items()),
            tuple(owned),
        )
        layers.append((layer, first, ids.setdefault(kind, len(ids))))
    return tuple(layers), tuple(ids)


def _layer_classes(
    model: ModelGeometry, optimizer: bool, old: ParallelLayout, new: ParallelLayout
) -> list[tuple[list[int], list[int], tuple[_Group, ...], list[int]]]:
    """Layers grouped into classes that move alike: ``(layers, bases, groups, owned)`` where ``groups``
    describe the state replicated over DP and ``owned`` lists the DP-sharded tensors' absolute indices.

    Layers move alike when they are of one kind (:func:`_layer_kinds`) and held by the same stages in
    both layouts (EP ranks follow from the expert's index, which a kind fixes). A layer with
    distributed-optimizer state is a class of its own (its owned pieces depend on where its buckets
    fall) with base 0."""
    layers, kinds = _layer_kinds(model, optimizer)
    stage_old = stage_of_layers(old, model.num_layers)
    stage_new = stage_of_layers(new, model.num_layers)
    per_ep_old = model.num_experts // old.ep if model.num_experts else 1
    per_ep_new = model.num_experts // new.ep if model.num_experts else 1
    classes: dict[tuple, tuple[list[int], list[int], tuple[_Group, ...], list[int]]] = {}
    for layer, first, k in layers:
        kind = kinds[k]
        decoder = 1 <= layer <= model.num_layers
        stages = (stage_old[layer - 1], stage_new[layer - 1]) if decoder else None
        key: tuple = ("layer", layer) if kind.owned else (k, stages)
        found = classes.get(key)
        if found is not None:
            found[0].append(layer)
            found[1].append(first)
            continue
        base = 0 if kind.owned else first
        shift = first - base
        merged: dict[tuple, tuple[list[int], list[tuple]]] = {}
        for home, expert, offs, keys in kind.homes:
            ep = (expert // per_ep_old, expert // per_ep_new) if expert >= 0 else (0, 0)
            got_offs, got_keys = merged.setdefault((home, expert >= 0, ep), ([], []))
            got_offs.extend(o + shift for o in offs)
            got_keys.extend(keys)
        groups = []
        for (home, is_expert, (ep_old, ep_new)), (offs, keys) in merged.items():
            if home == "layer":
                assert stages is not None
                held_old, held_new = (stages[0],), (stages[1],)
            else:
                held_old = home_stages(home, model.num_layers, old)
                held_new = home_stages(home, model.num_layers, new)
            groups.append(
                _Group(is_expert, tuple(offs), (is_expert, *keys), held_old, held_new, ep_old, ep_new)
            )
        owned = [first + o for o in kind.owned]
        classes[key] = ([layer], [base], tuple(groups), owned)
    return list(classes.values())


def _copies(cands: tuple[int, ...], old_dev: Sequence[Device], dev: Device) -> bool:
    """Whether a piece with these candidate senders is copied on ``dev`` (its one sender is there)."""
    return len(cands) == 1 and old_dev[cands[0]] == dev


def _choose_sources(
    model: ModelGeometry,
    tensors: tuple[TensorSpec, ...],
    optimizer: bool,
    old: WorldConfig,
    new: WorldConfig,
    lost: frozenset[Device],
    stand: StandIns = _NO_STAND_INS,
) -> list[_ClassWork]:
    """Steps 1-3 of the module docstring, once per class of layers (:func:`_layer_classes`).

    The pieces a new rank needs are gathered into source slots once per class: pieces with the same
    candidate senders (:meth:`_Sources.candidates`) share one, a replicated piece rides along with a
    sharded one of its group (any holder of the stage has it), and slots whose candidates overlap are
    merged to the common ones, so one source never sends one destination two messages. Only then, layer
    by layer, each slot takes the candidate that has sent the fewest bytes so far: DP replicas still take
    turns across the layers of a class."""
    sources = _Sources(old, lost, stand)
    # Where each old rank's sends run: a lost rank that stands in sends from its keeper's device.
    old_dev = list(old.placement.devices)
    for r, keeper in stand.keepers.items():
        old_dev[r] = old_dev[keeper]
    wants = _Wants(model, tensors, old.layout, new, sources, old_dev)
    out = []
    for layers, bases, groups, owned in _layer_classes(model, optimizer, old.layout, new.layout):
        wanted: dict[int, dict[tuple[int, ...], list[_Chunk]]] = {}  # dst -> candidates -> chunks
        for g in groups:
            wants.gather(wanted, g, bases[0])
        if owned:
            for (src, dst), chunk in _owned_chunks(model, tensors, owned, old, new, lost, stand).items():
                wanted.setdefault(dst, {}).setdefault((src,), []).append(chunk)
        pairs, specs, local = _slots(wanted, old_dev, new.placement.devices)
        table = _senders(len(layers), specs, sources.sent)
        out.append(_ClassWork(tuple(layers), tuple(bases), pairs, frozenset(local), table))
    return out


class _Wants:
    """Steps 1-2 for the state replicated over DP: the chunks each new rank needs of a group, by their
    candidate senders. The pieces' templates and chunks are kept across classes, by what decides them:
    every class with the same tensors at the same offsets reuses the same objects."""

    def __init__(
        self,
        model: ModelGeometry,
        tensors: tuple[TensorSpec, ...],
        old_layout: ParallelLayout,
        new: WorldConfig,
        sources: _Sources,
        old_dev: Sequence[Device],
    ) -> None:
        self.model = model
        self.tensors = tensors
        self.ol, self.nl = old_layout, new.layout
        self.new_dev = new.placement.devices
        self.sources = sources
        self.old_dev = old_dev
        self.templates: dict[tuple, list] = {}
        self.chunk_cache: dict[tuple, list[tuple[int, _Chunk]]] = {}

    def gather(self, wanted: dict[int, dict[tuple[int, ...], list[_Chunk]]], g: _Group, base: int) -> None:
        """Add to ``wanted`` (destination -> candidates -> chunks) the chunks every new rank that
        holds group ``g`` needs, in a class whose first layer's tensors start at ``base``."""
        expert = g.expert
        og, ng = self.ol.grid(expert), self.nl.grid(expert)
        offs = g.offsets
        rel = self.templates.get(g.signature)
        if rel is None:
            idxs = [base + o for o in offs]
            rel = self.templates[g.signature] = _relative_templates(
                self.model, self.tensors, idxs, og.tp, ng.tp
            )
        new_dev, old_dev, sources = self.new_dev, self.old_dev, self.sources
        for q in range(ng.tp):
            # Chunks name tensors relative to the layer's base: the same objects serve every class
            # with these tensors at these offsets, so the streaming step's caches see them again.
            ckey = (g.signature, offs, q)
            chunks = self.chunk_cache.get(ckey)
            if chunks is None:
                chunks = self.chunk_cache[ckey] = [
                    (key, _Chunk(tuple((offs[off], box) for off, box in sl), sizes, sum(sizes)))
                    for key, sl, sizes in rel[q]
                ]
            fallback_tp = q % og.tp
            for sp in g.stages_new:
                for replica in range(ng.replicas):
                    dst = ng.rank(q, g.ep_new, replica, sp)
                    dev = new_dev[dst]
                    mine = wanted.setdefault(dst, {})
                    first: tuple[int, ...] | None = None  # this group's first sent (not copied) slot
                    riders: list[_Chunk] = []
                    for key, chunk in chunks:
                        probe = base + chunk.slices[0][0]
                        cands = sources.candidates(
                            expert, g.ep_old, key, g.stages_old, dev, fallback_tp, probe
                        )
                        copied = _copies(cands, old_dev, dev)
                        if key == ANY and not copied:
                            riders.append(chunk)
                            rider_cands = cands
                            continue
                        if first is None and not copied:
                            first = cands
                        mine.setdefault(cands, []).append(chunk)
                    if riders:
                        mine.setdefault(rider_cands if first is None else first, []).extend(riders)


def _slots(
    wanted: dict[int, dict[tuple[int, ...], list[_Chunk]]],
    old_dev: Sequence[Device],
    new_dev: Sequence[Device],
) -> tuple[dict[tuple[int, int], list[_Chunk]], list[tuple[tuple[int, ...], int, bool]], set[int]]:
    """Step 3's source slots of one class: ``(slot, dst) -> chunks``, per slot its candidates, bytes
    and whether it is sent (not copied), and the copied slots. Overlapping candidates are merged first
    (:func:`_disjoint`), so no two slots of a destination can pick the same sender."""
    pairs: dict[tuple[int, int], list[_Chunk]] = {}
    specs: list[tuple[tuple[int, ...], int, bool]] = []  # per slot: candidates, bytes, sent or copied
    local: set[int] = set()
    for dst, by_cands in wanted.items():
        for cands, chunks in _disjoint(by_cands):
            slot = len(specs)
            copied = _copies(cands, old_dev, new_dev[dst])
            if copied:
                local.add(slot)
            pairs[(slot, dst)] = chunks
            specs.append((cands, sum(c.nbytes for c in chunks), not copied))
    return pairs, specs, local


def _senders(
    layers: int, specs: list[tuple[tuple[int, ...], int, bool]], sent: list[int]
) -> tuple[tuple[int, ...], ...]:
    """Per layer of a class of ``layers``, the old rank each slot of ``specs`` takes: its candidate
    that has sent the fewest bytes so far (``sent``, by old rank, counts the slot's bytes when sent),
    so DP replicas take turns across the layers."""
    table = []
    by_sent = sent.__getitem__
    for _ in range(layers):
        row = []
        for cands, nbytes, remote in specs:
            src = cands[0] if len(cands) == 1 else min(cands, key=by_sent)
            if remote:
                sent[src] += nbytes
            row.append(src)
        table.append(tuple(row))
    return tuple(table)


def _disjoint(
    by_cands: dict[tuple[int, ...], list[_Chunk]],
) -> list[tuple[tuple[int, ...], list[_Chunk]]]:
    """Slots whose candidate senders overlap merged to the common ones (which hold the pieces of both):
    afterwards no two slots of a destination can pick the same sender."""
    merged: list[tuple[tuple[int, ...], list[_Chunk], set[int]]] = []
    for cands, chunks in by_cands.items():
        here = set(cands)
        for k, (other, theirs, their_set) in enumerate(merged):
            if not here.isdisjoint(their_set):
                common = their_set & here
                merged[k] = (tuple(r for r in other if r in common), theirs + chunks, common)
                break
        else:
            merged.append((cands, list(chunks), here))
    return [(cands, chunks) for cands, chunks, _ in merged]


def _owner_ranks(
    grid: Grid,
    ep: int,
    stages: tuple[int, ...],
    replicated: bool,
    first: tuple[int, int],
    alive: Sequence[bool],
    group: int,
    near: int | None,
) -> list[int]:
    """One owner per share (a replica index, DP or expert-DP on the expert ``grid``, of the first
    ``group``: with several instances of the distributed optimizer each share is owned once in each)
    and per TP rank, unless the tensor is TP-replicated: from the replica ``first`` (stage, TP rank)
    names and the instance of replica ``near`` when they survive, else from the first surviving one."""
    stage_order = [first[0], *(pp for pp in stages if pp != first[0])]
    out = []
    for share in range(group):
        replicas = list(range(share, grid.replicas, group))
        if near is not None:
            mine = share + (near // group) * group
            replicas.sort(key=lambda r: r != mine)
        if replicated:
            tp_order = [first[1], *(tp for tp in range(grid.tp) if tp != first[1])]
            ranks = [grid.rank(tp, ep, r, pp) for r in replicas for pp in stage_order for tp in tp_order]
            out += [x for x in ranks if alive[x]][:1]
            continue
        for tp in range(grid.tp):
            ranks = [grid.rank(tp, ep, r, pp) for r in replicas for pp in stage_order]
            out += [x for x in ranks if alive[x]][:1]
    return out


def _owned_chunks(
    model: ModelGeometry,
    tensors: tuple[TensorSpec, ...],
    idxs: list[int],
    old: WorldConfig,
    new: WorldConfig,
    lost: frozenset[Device],
    stand: StandIns = _NO_STAND_INS,
) -> dict[tuple[int, int], _Chunk]:
    """``(src, dst) -> chunk`` for optimizer state the distributed optimizer shards over DP: each piece
    a new rank owns comes from an old rank that owns it, piece by piece.

    Replicas own alike: every old TP rank of a TP-replicated tensor, and the first and last stage of a
    tied embedding (Megatron gives it a bucket of its own on both). For each DP index one surviving
    replica's owner sends: the destination's device's own if it has one, else the first in order;
    :func:`build_plan` refused state whose every replica is lost before."""
    ol, nl = old.layout, new.layout
    old_rank_on = old.placement.rank_on()
    alive = [d not in lost for d in old.placement.devices]
    slices: dict[tuple[int, int], list[Slice]] = defaultdict(list)
    sizes: dict[tuple[int, int], list[int]] = defaultdict(list)
    for ti in idxs:
        t = tensors[ti]
        alive_t = alive
        copied = [r for r in stand.keepers if stand.has(r, ti)]
        if copied:  # the lost owners whose copies hold this tensor's pieces own them still
            alive_t = list(alive)
            for r in copied:
                alive_t[r] = True
        og, ng = grid_of(t, ol), grid_of(t, nl)
        ep_old = expert_rank(t, model, ol)
        s_old = holding_stages(t, model, ol)
        replicated = t.rule == "replicated"
        for dst in holder_ranks(t, model, nl, range(ng.tp)):
            here = old_rank_on.get(new.placement.devices[dst])
            place = og.place(here) if here is not None else None
            if place is not None and place[3] in s_old and place[1] == ep_old:
                first = (place[3], place[0])
            else:
                first = (s_old[0], ng.place(dst)[0] % og.tp)
            near = place[2] if place is not None else None
            group = shard_group(model, og.replicas)
            sources = _owner_ranks(og, ep_old, s_old, replicated, first, alive_t, group, near)
            for piece in owned_boxes(model, nl, dst).get(t.param, ()):
                for src in sources:
                    for box in owned_boxes(model, ol, src).get(t.param, ()):
                        common = intersect(box, piece)
                        if common is not None:
                            slices[(src, dst)].append((ti, common))
                            sizes[(src, dst)].append(volume(common) * t.itemsize)
    return {key: _Chunk(tuple(sl), tuple(sizes[key]), sum(sizes[key])) for key, sl in slices.items()}


def _nbytes(chunks: list[_Chunk]) -> int:
    return chunks[0].nbytes if len(chunks) == 1 else sum(c.nbytes for c in chunks)


def _flatten(chunks: list[_Chunk]) -> tuple[Slice, ...]:
    return chunks[0].slices if len(chunks) == 1 else tuple(chain.from_iterable(c.slices for c in chunks))


Segment = tuple[int, int, int, int]
"""``(chunk, first slice, end slice, -1)`` for whole slices, or ``(chunk, slice, first piece, end piece)``
for pieces of a slice bigger than the budget."""


def _split_pattern(
    entries: list[list[_Chunk]], budget: int, tensors: tuple[TensorSpec, ...]
) -> list[list[list[Segment]]]:
    """For one destination and layer: ``[round][entry] -> segments``, at most ``budget`` bytes a round.

    The pattern depends only on the slices' sizes and shapes, which every decoder layer of the same
    shape shares, so it is computed once per distinct layer shape and stamped onto the others.
    """
    rounds: list[list[list[Segment]]] = [[[] for _ in entries]]
    room = budget
    for e, chunks in enumerate(entries):
        for c, chunk in enumerate(chunks):
            if chunk.nbytes <= room:
                rounds[-1][e].append((c, 0, len(chunk.sizes), -1))
                room -= chunk.nbytes
                continue
            for i, size in enumerate(chunk.sizes):
                if size <= budget:
                    if size > room:
                        rounds.append([[] for _ in entries])
                        room = budget
                    segs = rounds[-1][e]
                    if segs and segs[-1][0] == c and segs[-1][3] == -1 and segs[-1][2] == i:
                        segs[-1] = (c, segs[-1][1], i + 1, -1)
                    else:
                        segs.append((c, i, i + 1, -1))
                    room -= size
                    continue
                ti, box = chunk.slices[i]
                for k, psize in enumerate(_piece_sizes(box, tensors[ti].itemsize, budget)):
                    if psize > room:
                        rounds.append([[] for _ in entries])
                        room = budget
                    segs = rounds[-1][e]
                    if segs and segs[-1][:2] == (c, i) and segs[-1][3] == k:
                        segs[-1] = (c, i, segs[-1][2], k + 1)
                    else:
                        segs.append((c, i, k, k + 1))
                    room -= psize
    return rounds


@functools.lru_cache(maxsize=4096)
def _pieces(box: Box, itemsize: int, budget: int) -> tuple[Box, ...]:
    return tuple(split(box, budget // itemsize))


def _piece_sizes(box: Box, itemsize: int, budget: int) -> list[int]:
    return [volume(p) * itemsize for p in _pieces(box, itemsize, budget)]


def _materialise(
    pattern: list[list[list[Segment]]],
    entries: list[list[_Chunk]],
    tensors: tuple[TensorSpec, ...],
    budget: int,
) -> list[list[tuple[tuple[Slice, ...], int]]]:
    """Turn a split pattern into ``[round][entry] -> (slices, bytes)`` for these chunks."""
    out = []
    for per_entry in pattern:
        row = []
        for e, segs in enumerate(per_entry):
            slices: list[Slice] = []
            nbytes = 0
            for c, a, b, k in segs:
                chunk = entries[e][c]
                if k == -1:
                    slices.extend(chunk.slices[a:b])
                    nbytes += sum(chunk.sizes[a:b])
                else:
                    ti, box = chunk.slices[a]
                    item = tensors[ti].itemsize
                    pieces = _pieces(box, item, budget)[b:k]
                    slices.extend((ti, p) for p in pieces)
                    nbytes += sum(volume(p) for p in pieces) * item
            row.append((tuple(slices), nbytes))
        out.append(row)
    return out


class _Streamer:
    """Step 4: split each class's layer into rounds so no destination receives more than the budget per
    round, as :class:`~liver.reshard.plan.TaskTemplate` s.

    Destinations whose incoming chunks are the same objects in the same order (DP replicas of one new
    stage, and the same stage's place in other classes) share one split; layers of the same shape share
    one split pattern."""

    def __init__(self, tensors: tuple[TensorSpec, ...], budget: int) -> None:
        self.tensors, self.budget = tensors, budget
        self.patterns: dict[tuple, list[list[list[Segment]]]] = {}
        self.splits: dict[tuple, list[list[tuple[tuple[Slice, ...], int]]]] = {}

    def stream(
        self, pairs: dict[tuple[int, int], list[_Chunk]], local: frozenset[int], base: int
    ) -> tuple[TaskTemplate, ...]:
        """The class's templates from its ``(slot, dst)`` pairs; ``local`` slots are copies, ``base``
        is its first layer's (slices are relative to it)."""
        budget = self.budget
        # Relative indices: the class's tensors from its first layer's base on (the same item sizes at
        # the same offsets in each of its layers, and in any class whose chunks are the same objects).
        tensors = self.tensors[base:] if base else self.tensors
        keys = sorted(pairs)  # (slot, dst): walked in this order, templates come out sorted
        remote: dict[int, list[tuple[int, list[_Chunk]]]] = defaultdict(list)
        for key in keys:
            src, dst = key
            if src not in local:
                remote[dst].append((src, pairs[key]))  # in slot order
        # (src, dst) -> [(slices, bytes)] per round, in the order of ``remote``'s entries
        rounds_of: dict[tuple[int, int], list[tuple[tuple[Slice, ...], int]]] = {}
        for dst, entries in remote.items():
            sizes = [_nbytes(ch) for _src, ch in entries]
            if sum(sizes) <= budget:
                for (src, ch), nbytes in zip(entries, sizes):
                    rounds_of[(src, dst)] = [(_flatten(ch), nbytes)]
                continue
            chunk_lists = [ch for _src, ch in entries]
            key = tuple(tuple(map(id, ch)) for ch in chunk_lists)
            rounds = self.splits.get(key)
            if rounds is None:
                # Chunks of equal shape share their sizes tuple (from the layer-independent template).
                shape_key = tuple(tuple(id(c.sizes) for c in ch) for ch in chunk_lists)
                pattern = self.patterns.get(shape_key)
                if pattern is None:
                    pattern = self.patterns[shape_key] = _split_pattern(chunk_lists, budget, tensors)
                rounds = self.splits[key] = _materialise(pattern, chunk_lists, tensors, budget)
            for e, (src, _ch) in enumerate(entries):
                rounds_of[(src, dst)] = [per_entry[e] for per_entry in rounds]
        # Templates order by (round, slot, dst): one list per round, each filled in (slot, dst) order.
        by_round: list[list[TaskTemplate]] = []
        for key in keys:
            src, dst = key
            split = rounds_of.get(key)
            if split is None:
                chunks = pairs[key]
                split = [(_flatten(chunks), _nbytes(chunks))]
                is_local = True
            else:
                is_local = False
            for r, (sl, nb) in enumerate(split):
                if not sl:
                    continue
                while len(by_round) <= r:
                    by_round.append([])
                by_round[r].append(TaskTemplate(r, src, dst, is_local, sl, nb))
        return tuple(chain.from_iterable(by_round))


def plan_stats(plan: Plan) -> PlanStats:
    """Summary numbers of ``plan``, from its classes: a template counts once per layer of its class, with
    that layer's source."""
    old_dev, new_dev = plan.old.placement.devices, plan.new.placement.devices
    old_node = [plan.src_device(r).node for r in range(len(old_dev))]  # where each one's sends run
    new_node = [d.node for d in new_dev]
    recv: dict[int, int] = defaultdict(int)
    sent = [0] * len(old_dev)
    round_recv: dict[tuple[int, int, int], int] = defaultdict(int)
    local = moved = inter = slices = messages = tasks = rounds = 0
    for k, c in enumerate(plan.classes):
        n = len(c.layers)
        tasks += n * len(c.tasks)
        rounds += n * len({t.round for t in c.tasks})
        rows = c.sources or [range(len(old_dev))] * n
        for t in c.tasks:
            slices += n * len(t.slices)
            nbytes = t.nbytes
            if t.local:
                local += n * nbytes
                continue
            messages += n
            moved += n * nbytes
            recv[t.dst] += n * nbytes
            round_recv[(k, t.round, t.dst)] += nbytes  # the same in each of the class's layers
            node = new_node[t.dst]
            for row in rows:
                src = row[t.src]
                sent[src] += nbytes
                if old_node[src] != node:
                    inter += nbytes
    return PlanStats(
        tensors=len(plan.tensors),
        slices=slices,
        tasks=tasks,
        messages=messages,
        rounds=rounds,
        bytes_total=local + moved,
        bytes_local=local,
        bytes_moved=moved,
        bytes_inter_node=inter,
        max_recv_bytes=max(recv.values(), default=0),
        max_round_recv_bytes=max(round_recv.values(), default=0),
        max_send_bytes=max(sent, default=0),
    )


class ResizePlan(msgspec.Struct, frozen=True, kw_only=True):
    """A plan with its placement chosen, and what the rank-order placement would have moved."""

    plan: Plan
    stats: PlanStats
    rank_order_bytes_moved: int
    lower_bound_bytes: int
    plan_seconds: float
    placement_seconds: float


def plan_resize(
    model: ModelGeometry,
    old: WorldConfig,
    new_layout: ParallelLayout,
    new_devices: Sequence[Device],
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    optimizer: bool = True,
    optimize: bool = True,
    inter_node_weight: float = DEFAULT_INTER_NODE_WEIGHT,
    compare_rank_order: bool = True,
    *,
    lost: Collection[Device] = (),
    copies: bool = False,
) -> ResizePlan:
    """Place ``new_layout`` on ``new_devices`` and plan the transfer (the transfer service's core), with
    no state taken from the ``lost`` devices of ``old`` (but from their peer copies, with ``copies``)."""
    model.check_layout(new_layout)
    if len(new_devices) != new_layout.world_size:
        raise LayoutError(
            f"layout {new_layout.describe()} needs {new_layout.world_size} devices, {len(new_devices)} given"
        )
    with collector_paused():
        t0 = time.perf_counter()
        if optimize:
            placement = optimized_placement(
                model, old, new_devices, new_layout, optimizer, inter_node_weight, lost=lost
            )
        else:
            placement = rank_order_placement(old, new_devices, new_layout)
        t1 = time.perf_counter()
        plan = build_plan(
            model, old, WorldConfig(new_layout, placement), budget_bytes, optimizer, lost=lost, copies=copies
        )
        t2 = time.perf_counter()
    stats = plan_stats(plan)
    rank_order_bytes = stats.bytes_moved
    distributed = as_geometry(model).distributed
    if optimize and compare_rank_order:
        rank_order_bytes, baseline_plan = rank_order_bytes_moved(
            model, old, new_layout, new_devices, budget_bytes, optimizer, lost=lost, copies=copies
        )
        if baseline_plan is not None and rank_order_bytes < stats.bytes_moved:
            plan, stats = baseline_plan, plan_stats(baseline_plan)  # the placement's estimate misjudged
    # Under the distributed optimizer only the parameters' bound is certain (the class overlap takes
    # DP-sharded optimizer state for replicas): a lower, still valid, bound.
    bound_optimizer = optimizer and not distributed
    return ResizePlan(
        plan=plan,
        stats=stats,
        rank_order_bytes_moved=rank_order_bytes,
        lower_bound_bytes=local_lower_bound(model, old, new_devices, new_layout, bound_optimizer),
        plan_seconds=t2 - t0,
        placement_seconds=t1 - t0,
    )


def rank_order_bytes_moved(
    model: ModelSpec | ModelGeometry,
    old: WorldConfig,
    new_layout: ParallelLayout,
    new_devices: Sequence[Device],
    budget_bytes: int,
    optimizer: bool,
    *,
    lost: Collection[Device] = (),
    copies: bool = False,
) -> tuple[int, Plan | None]:
    """The bytes a rank-order placement of the new world would move (what the optimised placement is
    compared with), and its plan when one had to be made: the class overlap counts replicated state
    exactly and at a fraction of a plan's cost, but takes the distributed optimizer's DP-sharded state
    for replicas, so such a job's count comes from a real plan. Which surviving replica sends a byte
    does not change how many bytes cross devices: ``lost`` enters only that plan."""
    baseline = WorldConfig(new_layout, rank_order_placement(old, new_devices, new_layout))
    if as_geometry(model).distributed or copies:
        plan = build_plan(model, old, baseline, budget_bytes, optimizer, lost=lost, copies=copies)
        return plan_stats(plan).bytes_moved, plan
    return bytes_moved(model, old, baseline, optimizer), None


def default_world(layout: ParallelLayout, devices_per_node: int = 8) -> WorldConfig:
    """A world in rank order on ``ceil(world / devices_per_node)`` nodes named ``node000``..."""
    from liver.shared.layout import grid_devices

    nodes = -(-layout.world_size // devices_per_node)
    return WorldConfig(layout, Placement(grid_devices(nodes, devices_per_node)[: layout.world_size]))
