"""Placement of new logical ranks on devices: ETC's cost matrix, solved as an assignment problem.

``cost[j, d]`` estimates what it costs to run new rank ``j`` on device ``d``: the bytes of ``j``'s new
state that ``d`` does not hold already, with bytes that must cross nodes weighted ``inter_node_weight``
times more than bytes a neighbour on the same node can provide (a lost neighbour provides nothing).
The exact bytes a placement moves are computed by the planner afterwards; the matrix is only the
objective.

Data-parallel replicas hold the same data, so overlap depends only on the *class* of the old rank on
``d`` and of ``j``: (stage, TP rank) and, for a model with experts, the expert shard (expert-TP rank
and EP rank, ``etp + ETP * ep``). It is computed once per pair of classes (a few hundred numbers for a
1,024-rank job) and expanded with numpy.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Collection, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from liver.reshard.plan import WorldConfig
from liver.reshard.views import expert_rank, holding_stages
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement

from .templates import overlap_bytes, shard_bytes

DEFAULT_INTER_NODE_WEIGHT = 4.0


def _expert_width(model: ModelGeometry, layout: ParallelLayout) -> int:
    """Expert shards of one stage's ranks (``ETP * EP``), or 1 for a dense model."""
    return layout.expert_tp * layout.ep if model.num_experts else 1


@functools.lru_cache(maxsize=256)
def rank_classes(model: ModelGeometry, layout: ParallelLayout) -> np.ndarray:
    """Each rank's class index ``(stage * TP + TP rank) * width + expert shard`` (module docstring;
    the expert shard ``etp + ETP * ep`` is the rank modulo ``ETP * EP`` in Megatron's order).
    Cached and read-only."""
    width = _expert_width(model, layout)
    ranks = np.arange(layout.world_size, dtype=np.intp)
    stage = ranks // (layout.world_size // layout.pp)
    out = (stage * layout.tp + ranks % layout.tp) * width + ranks % width
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=256)
def class_overlap(
    model: ModelGeometry, old: ParallelLayout, new: ParallelLayout, optimizer: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """``overlap[old class, new class]``: bytes already in place; ``need_cls[new class]``: bytes each
    new rank of a class holds (classes as :func:`rank_classes` numbers them)."""
    groups: dict[tuple, int] = defaultdict(int)
    rep = {}
    for t in model.tensors(optimizer):
        eps = (expert_rank(t, model, old), expert_rank(t, model, new)) if t.expert >= 0 else None
        key = (holding_stages(t, model, old), holding_stages(t, model, new), t.rule, t.shape, t.itemsize, eps)
        groups[key] += 1
        rep.setdefault(key, t)
    wo, wn = _expert_width(model, old), _expert_width(model, new)
    overlap = np.zeros((old.pp, old.tp, wo, new.pp, new.tp, wn))
    need_cls = np.zeros((new.pp, new.tp, wn))
    for key, count in groups.items():
        so, sn, eps = key[0], key[1], key[5]
        t = rep[key]
        if eps is None:  # dense: by TP rank, the same for every expert shard
            m = np.asarray(overlap_bytes(t, model, old.tp, new.tp), dtype=np.float64) * count
            need = np.array([shard_bytes(t, model, new.tp, q) for q in range(new.tp)], dtype=np.float64)
            for s2 in sn:
                need_cls[s2] += need[:, None] * count
                for s1 in so:
                    overlap[s1, :, :, s2, :, :] += m[:, None, :, None]
            continue
        # an expert's tensor: by expert-TP rank, only in its EP rank's shards, the same for every TP rank
        eo, en = old.expert_tp, new.expert_tp
        m = np.asarray(overlap_bytes(t, model, eo, en), dtype=np.float64) * count
        need = np.array([shard_bytes(t, model, en, q) for q in range(en)], dtype=np.float64) * count
        o_lo, n_lo = eps[0] * eo, eps[1] * en
        for s2 in sn:
            need_cls[s2, :, n_lo : n_lo + en] += need[None, :]
            for s1 in so:
                overlap[s1, :, o_lo : o_lo + eo, s2, :, n_lo : n_lo + en] += m[None, :, None, :]
    overlap = overlap.reshape(old.pp * old.tp * wo, new.pp * new.tp * wn)
    need_cls = need_cls.reshape(new.pp * new.tp * wn)
    overlap.setflags(write=False)  # cached and shared: callers only read
    need_cls.setflags(write=False)
    return overlap, need_cls


def rank_order_placement(old: WorldConfig, new_devices: Sequence[Device], new: ParallelLayout) -> Placement:
    """What a plain restart does: surviving devices keep their old order, added devices follow."""
    _check_devices(new_devices, new)
    keep = set(new_devices)
    ordered = [d for d in old.placement.devices if d in keep]
    seen = set(ordered)
    ordered += [d for d in new_devices if d not in seen]
    return Placement(tuple(ordered))


def optimized_placement(
    model: ModelGeometry,
    old: WorldConfig,
    new_devices: Sequence[Device],
    new: ParallelLayout,
    optimizer: bool = True,
    inter_node_weight: float = DEFAULT_INTER_NODE_WEIGHT,
    *,
    lost: Collection[Device] = (),
) -> Placement:
    """The placement minimising weighted bytes moved (exact for the cost matrix, via the Hungarian
    method in ``scipy.optimize.linear_sum_assignment``)."""
    _check_devices(new_devices, new)
    cost = cost_matrix(model, old, new_devices, new, optimizer, inter_node_weight, lost=lost)
    rows, cols = linear_sum_assignment(cost)
    devices = [None] * len(rows)
    for j, d in zip(rows, cols):
        devices[j] = new_devices[d]
    return Placement(tuple(devices))  # type: ignore[arg-type]


def cost_matrix(
    model: ModelGeometry,
    old: WorldConfig,
    new_devices: Sequence[Device],
    new: ParallelLayout,
    optimizer: bool = True,
    inter_node_weight: float = DEFAULT_INTER_NODE_WEIGHT,
    *,
    lost: Collection[Device] = (),
) -> np.ndarray:
    """``cost[new rank, device index in new_devices]`` (see the module docstring); old ranks on
    ``lost`` devices count as no neighbour's state, since the planner takes nothing from them."""
    ol = old.layout
    overlap, need = class_overlap(model, ol, new, optimizer)
    n_cls = need.shape[0]
    gone = frozenset(lost)
    old_rank = {d: r for d, r in old.placement.rank_on().items() if d not in gone}
    old_cls = rank_classes(model, ol)

    node_classes: dict[str, set[int]] = defaultdict(set)
    for d, r in old_rank.items():
        node_classes[d.node].add(int(old_cls[r]))
    # One row per node of what its old ranks cover, and a last row of zeros for a node (or, in
    # ``overlap_or_none``, a device) without any: every device's row is then an index, one numpy
    # expression for all of them (a Python loop over 1,000 devices cost more than the assignment).
    nodes = {node: i for i, node in enumerate(node_classes)}
    node_cover = np.zeros((len(nodes) + 1, n_cls))
    for node, cls in node_classes.items():
        node_cover[nodes[node]] = np.minimum(need, overlap[sorted(cls)].sum(axis=0))
    overlap_or_none = np.vstack([overlap, np.zeros((1, n_cls))])
    no_class = overlap.shape[0]
    local_row = np.fromiter(
        (int(old_cls[r]) if (r := old_rank.get(d)) is not None else no_class for d in new_devices),
        dtype=np.intp,
        count=len(new_devices),
    )
    node_row = np.fromiter(
        (nodes.get(d.node, len(nodes)) for d in new_devices), dtype=np.intp, count=len(new_devices)
    )
    local = overlap_or_none[local_row]
    node = np.maximum(node_cover[node_row], local)
    per_device = inter_node_weight * (need - node) + (node - local)
    return per_device[:, rank_classes(model, new)].T


def bytes_moved(model: ModelGeometry, old: WorldConfig, new: WorldConfig, optimizer: bool = True) -> int:
    """Exactly the bytes a plan for ``new`` sends between devices, without building the plan.

    The planner copies locally every piece the old rank on the same device holds, so what crosses
    devices is the whole new state less each new rank's overlap with its own device's old rank.
    """
    ol, nl = old.layout, new.layout
    overlap, need_cls = class_overlap(model, ol, nl, optimizer)
    old_cls, new_cls = rank_classes(model, ol), rank_classes(model, nl)
    old_rank = old.placement.rank_on()
    total = 0.0
    for j, dev in enumerate(new.placement.devices):
        total += need_cls[new_cls[j]]
        r = old_rank.get(dev)
        if r is not None:
            total -= overlap[old_cls[r], new_cls[j]]
    return round(total)


def local_lower_bound(
    model: ModelGeometry,
    old: WorldConfig,
    new_devices: Sequence[Device],
    new: ParallelLayout,
    optimizer: bool = True,
) -> int:
    """Bytes that must cross devices under any placement: all new state, less, for each surviving old
    device, the most any one new rank could find already there (each device hosts one new rank)."""
    ol = old.layout
    overlap, need_cls = class_overlap(model, ol, new, optimizer)
    per_class_best = overlap.max(axis=1)
    total_new = float(need_cls[rank_classes(model, new)].sum())
    old_cls = rank_classes(model, ol)
    keep = set(new_devices)
    reusable = 0.0
    for r, d in enumerate(old.placement.devices):
        if d in keep:
            reusable += per_class_best[old_cls[r]]
    return max(0, int(total_new - reusable))


def _check_devices(new_devices: Sequence[Device], new: ParallelLayout) -> None:
    if len(new_devices) != new.world_size:
        raise LayoutError(
            f"layout {new.describe()} needs {new.world_size} devices, {len(new_devices)} were given"
        )
    if len(set(new_devices)) != len(new_devices):
        raise LayoutError("the new device list names a device twice")
