"""Whether the training state outlives a loss of devices: the transfer planner's rule, without a plan.

Data parallelism replicates: every rank of a tensor's pipeline stages with the same TP rank holds the
same shard, whatever its DP index, and a tensor replicated over TP is held by every rank of its stages.
The transfer planner (:func:`liver.services.transfer.planner.plan_resize`) never reads from a lost
device, so a live handoff around a loss exists exactly when every shard keeps a holder outside the lost
devices; otherwise it raises ``NoSurvivingSource`` and the job must fall back to its checkpoint. In
practice (every stage holds decoder layers, split over all TP ranks) the rule is: each ``(pp, tp)`` pair
keeps one DP replica. The simulator asks this before it models a handoff around a lost node, at the
cost of a scan of the tensors instead of a 1,024-device plan.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence

from liver.shared.layout import Device, LayoutError, ParallelLayout
from liver.shared.model import ModelSpec
from liver.shared.views import holding_stages, tp_shard

REPLICATED = -1
"""The TP rank of a requirement that any TP rank of its stages can meet."""


@functools.lru_cache(maxsize=64)
def shard_holders(model: ModelSpec, layout: ParallelLayout) -> tuple[tuple[tuple[int, ...], int], ...]:
    """Every distinct shard of the state as ``(stages, tp rank)``: held by each rank of those stages with
    that TP rank (``REPLICATED``: with any TP rank), whatever its DP index."""
    out: set[tuple[tuple[int, ...], int]] = set()
    for t in model.tensors(optimizer=False):  # optimizer states sit beside their parameters
        stages = holding_stages(t, model, layout)
        if not stages:
            continue
        if t.rule == "replicated":
            out.add((stages, REPLICATED))
            continue
        for tp in range(layout.tp):
            if tp_shard(t, model, layout.tp, tp).box is not None:
                out.add((stages, tp))
    return tuple(sorted(out))


def orphaned_shards(
    model: ModelSpec, layout: ParallelLayout, devices: Sequence[Device], lost: Collection[Device]
) -> list[tuple[tuple[int, ...], int]]:
    """The shards (see :func:`shard_holders`) of ``layout`` placed on ``devices`` (one per rank) whose
    every holder is ``lost``; empty when the whole state survives."""
    if len(devices) != layout.world_size:
        raise LayoutError(
            f"devices: layout {layout.describe()} needs {layout.world_size} devices, {len(devices)} given"
        )
    gone = frozenset(lost)
    if not gone:
        return []
    tps = range(layout.tp)
    return [
        (stages, tp)
        for stages, tp in shard_holders(model, layout)
        if all(
            devices[layout.rank_of(t, dp, pp)] in gone
            for pp in stages
            for t in (tps if tp == REPLICATED else (tp,))
            for dp in range(layout.dp)
        )
    ]


def state_survives(
    model: ModelSpec, layout: ParallelLayout, devices: Sequence[Device], lost: Collection[Device]
) -> bool:
    """Whether every shard keeps a holder outside ``lost``: whether the transfer planner can plan a
    handoff from this world without them (see the module docstring)."""
    return not orphaned_shards(model, layout, devices, lost)


__all__ = ["REPLICATED", "orphaned_shards", "shard_holders", "state_survives"]
