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

from collections.abc import Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from liver.services.transfer.placement import DEFAULT_INTER_NODE_WEIGHT, class_overlap, cost_matrix
from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement
from liver.shared.model import ModelSpec
from liver.shared.plan import WorldConfig


def tp_groups_within_nodes(layout: ParallelLayout, placement: Placement) -> bool:
    """Whether every TP group (``tp`` consecutive ranks) runs on one node."""
    tp = layout.tp
    devs = placement.devices
    return all(len({d.node for d in devs[g : g + tp]}) == 1 for g in range(0, len(devs), tp))


def node_local_placement(
    model: ModelSpec,
    old: WorldConfig,
    devices: Sequence[Device],
    layout: ParallelLayout,
    inter_node_weight: float = DEFAULT_INTER_NODE_WEIGHT,
) -> Placement:
    """The cheapest placement of ``layout`` on ``devices`` under the transfer planner's cost matrix,
    with every TP group on one node (see the module docstring). Each node must hold a multiple of
    ``layout.tp`` of the devices."""
    tp = layout.tp
    nodes: dict[str, list[int]] = {}
    for i, d in enumerate(devices):
        nodes.setdefault(d.node, []).append(i)
    uneven = [n for n, idx in nodes.items() if len(idx) % tp]
    if uneven:
        raise LayoutError(
            f"{layout.describe()}: node {uneven[0]} has {len(nodes[uneven[0]])} devices, "
            f"not a multiple of tp={tp}"
        )
    cost = cost_matrix(model, old, devices, layout, True, inter_node_weight)
    rows, cols = linear_sum_assignment(cost)
    placed = [devices[0]] * layout.world_size
    for j, d in zip(rows, cols):
        placed[j] = devices[d]
    free = Placement(tuple(placed))
    if tp == 1 or tp_groups_within_nodes(layout, free):
        return free

    node_devs = list(nodes.values())
    order = np.concatenate([np.asarray(idx) for idx in node_devs])
    starts = np.cumsum([0] + [len(idx) for idx in node_devs[:-1]])
    cheapest = np.minimum.reduceat(cost[:, order], starts, axis=1)  # [rank, node]
    group_cost = cheapest.reshape(layout.world_size // tp, tp, len(node_devs)).sum(axis=1)
    slot_node = np.repeat(np.arange(len(node_devs)), [len(idx) // tp for idx in node_devs])
    groups, slots = linear_sum_assignment(group_cost[:, slot_node])
    ranks_on: list[list[int]] = [[] for _ in node_devs]
    for g, s in zip(groups, slots):
        ranks_on[slot_node[s]].extend(range(g * tp, (g + 1) * tp))
    for n, ranks in enumerate(ranks_on):
        if not ranks:
            continue
        local = node_devs[n]
        r, c = linear_sum_assignment(cost[np.ix_(ranks, local)])
        for a, b in zip(r, c):
            placed[ranks[a]] = devices[local[b]]
    return Placement(tuple(placed))


def bytes_moved(model: ModelSpec, old: WorldConfig, new: WorldConfig) -> int:
    """Bytes the transfer plan will send between devices: all new state less what each new rank finds
    in the old rank on its own device (the planner's only saving; exact, padding excluded)."""
    ol, nl = old.layout, new.layout
    overlap, need = class_overlap(model, ol, nl)
    old_rank = old.placement.rank_on()
    total = 0.0
    for j, device in enumerate(new.placement.devices):
        c = nl.coords(j)
        total += need[c.pp, c.tp]
        r = old_rank.get(device)
        if r is not None:
            o = ol.coords(r)
            total -= overlap[o.pp, o.tp, c.pp, c.tp]
    return round(total)
