"""Placing a candidate layout on devices with its TP groups kept inside nodes, and what it moves.

The transfer planner's :func:`optimized_placement` minimises bytes moved and knows nothing of TP
groups: on fresh nodes every device costs the same, so a TP group can land on two nodes and every
layer's all-reduces would cross the network (the cost model assumes they do not). When that happens
the groups are placed first: each TP group goes to a node (an assignment problem whose cost is, per
rank, the cheapest device of that node), then each node's ranks go to its devices (the exact
assignment on the node). Both steps use the transfer planner's cost matrix, so locality still drives
the choice.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from liver.reshard.placement import DEFAULT_INTER_NODE_WEIGHT, cost_matrix
from liver.reshard.plan import WorldConfig
from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement
from liver.shared.model import ModelSpec


def tp_groups_within_nodes(layout: ParallelLayout, placement: Placement) -> bool:
    """Whether every TP group (``tp`` consecutive ranks) runs on one node."""
    return blocks_within_nodes(placement, layout.tp)


def blocks_within_nodes(placement: Placement, size: int) -> bool:
    """Whether every block of ``size`` consecutive ranks runs on one node: the TP groups (``tp``), the
    expert groups (``etp * ep``: expert-TP x EP) or the context-parallel groups with TP (``tp * cp``)."""
    devs = placement.devices
    return all(len({d.node for d in devs[g : g + size]}) == 1 for g in range(0, len(devs), size))


def node_local_placement(
    model: ModelSpec,
    old: WorldConfig,
    devices: Sequence[Device],
    layout: ParallelLayout,
    inter_node_weight: float = DEFAULT_INTER_NODE_WEIGHT,
    *,
    lost: Collection[Device] = (),
) -> Placement:
    """A cheap placement of ``layout`` on ``devices`` under the transfer planner's cost matrix with
    every TP group on one node (see the module docstring). Each node must hold a multiple of
    ``layout.tp`` of the devices; ``lost`` devices of ``old`` send nothing."""
    tp = layout.tp
    if len(devices) != layout.world_size or len(set(devices)) != len(devices):
        raise LayoutError(
            f"{layout.describe()} needs {layout.world_size} distinct devices, got {len(devices)}"
        )
    nodes: dict[str, list[int]] = {}
    for i, d in enumerate(devices):
        nodes.setdefault(d.node, []).append(i)
    uneven = [n for n, idx in nodes.items() if len(idx) % tp]
    if uneven:
        raise LayoutError(
            f"{layout.describe()}: node {uneven[0]} has {len(nodes[uneven[0]])} devices, "
            f"not a multiple of tp={tp}"
        )
    cost = cost_matrix(model, old, devices, layout, True, inter_node_weight, lost=lost)
    rows, cols = linear_sum_assignment(cost)
    free = np.empty(layout.world_size, dtype=np.intp)
    free[rows] = cols
    if tp == 1 or _groups_local(free, devices, tp):
        return Placement(tuple(devices[d] for d in free))
    ranks = np.arange(layout.world_size)
    tries = [_by_node(cost, list(nodes.values()), tp), _by_slot(cost, old, devices, list(nodes.values()), tp)]
    best = min(tries, key=lambda a: cost[ranks, a].sum())
    return Placement(tuple(devices[d] for d in best))


def _groups_local(assign: np.ndarray, devices: Sequence[Device], tp: int) -> bool:
    return all(len({devices[d].node for d in assign[g : g + tp]}) == 1 for g in range(0, len(assign), tp))


def _by_node(cost: np.ndarray, node_devs: list[list[int]], tp: int) -> np.ndarray:
    """Groups to nodes, costing each rank at its node's cheapest device (blind to groups competing for
    the same device), then the exact assignment within each node."""
    world = cost.shape[0]
    order = np.concatenate([np.asarray(idx) for idx in node_devs])
    starts = np.cumsum([0] + [len(idx) for idx in node_devs[:-1]])
    cheapest = np.minimum.reduceat(cost[:, order], starts, axis=1)  # [rank, node]
    group_cost = cheapest.reshape(world // tp, tp, len(node_devs)).sum(axis=1)
    slot_node = np.repeat(np.arange(len(node_devs)), [len(idx) // tp for idx in node_devs])
    groups, slots = linear_sum_assignment(group_cost[:, slot_node])
    ranks_on: list[list[int]] = [[] for _ in node_devs]
    for g, s in zip(groups, slots):
        ranks_on[slot_node[s]].extend(range(g * tp, (g + 1) * tp))
    assign = np.empty(world, dtype=np.intp)
    for n, ranks in enumerate(ranks_on):
        if ranks:
            local = node_devs[n]
            r, c = linear_sum_assignment(cost[np.ix_(ranks, local)])
            assign[np.asarray(ranks)[r]] = np.asarray(local)[c]
    return assign


def _by_slot(
    cost: np.ndarray, old: WorldConfig, devices: Sequence[Device], node_devs: list[list[int]], tp: int
) -> np.ndarray:
    """Each node cut into slots of ``tp`` devices in old rank order (an old TP group, or neighbouring
    ones, stays one slot), then groups to slots with the exact cost of each pair. Groups of one stage
    and slots holding the same old classes cost alike, so each distinct pair is solved once."""
    world = cost.shape[0]
    old_rank = old.placement.rank_on()
    slots: list[np.ndarray] = []
    for idx in node_devs:
        ordered = sorted(idx, key=lambda i: (old_rank.get(devices[i], world + 1), devices[i].index))
        slots.extend(np.asarray(ordered[k : k + tp]) for k in range(0, len(ordered), tp))
    group_ranks = [np.arange(g * tp, (g + 1) * tp) for g in range(world // tp)]
    group_type: dict[bytes, int] = {}
    g_of = [group_type.setdefault(cost[r].tobytes(), len(group_type)) for r in group_ranks]
    reps = [group_ranks[g_of.index(t)] for t in range(len(group_type))]
    rep_rows = np.concatenate(reps)
    slot_type: dict[bytes, int] = {}
    s_of = [slot_type.setdefault(cost[np.ix_(rep_rows, s)].tobytes(), len(slot_type)) for s in slots]
    rep_slots = [slots[s_of.index(t)] for t in range(len(slot_type))]
    pair_cost = np.empty((len(reps), len(rep_slots)))
    pair_cols: dict[tuple[int, int], np.ndarray] = {}
    for gt, rows in enumerate(reps):
        for st, cols in enumerate(rep_slots):
            sub = cost[np.ix_(rows, cols)]
            r, c = linear_sum_assignment(sub)
            pair_cost[gt, st] = sub[r, c].sum()
            pair_cols[(gt, st)] = c[np.argsort(r)]
    groups, chosen = linear_sum_assignment(pair_cost[np.ix_(g_of, s_of)])
    assign = np.empty(world, dtype=np.intp)
    for g, s in zip(groups, chosen):
        assign[group_ranks[g]] = slots[s][pair_cols[(g_of[g], s_of[s])]]
    return assign
