"""Whether the training state outlives a loss of devices: the transfer planner's rule, without a plan.

Data parallelism replicates: every rank of a tensor's pipeline stages with the same TP rank holds the
same shard, whatever its DP index, and a tensor replicated over TP is held by every rank of its stages.
The transfer planner (:func:`liver.reshard.planner.build_plan`) never reads from a lost
device, so a live handoff around a loss exists exactly when every shard keeps a holder outside the lost
devices; otherwise it raises ``NoSurvivingSource`` and the job must fall back to its checkpoint. In
practice (every stage holds decoder layers, split over all TP ranks) the rule is: each ``(pp, tp)`` pair
keeps one DP replica (and each expert's ``(pp, ep, etp)`` one expert-DP replica). The simulator asks
the planner's own check
(:func:`~liver.reshard.planner.orphaned_shards`) before it models a handoff around a lost
node, at the cost of a scan of the tensors instead of a 1,024-device plan.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from liver.reshard.plan import WorldConfig
from liver.reshard.planner import orphaned_shards as _orphaned
from liver.reshard.templates import ANY
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import ModelSpec

REPLICATED = ANY
"""The TP rank of a shard that any TP rank of its stages holds."""


def orphaned_shards(
    model: ModelSpec, layout: ParallelLayout, devices: Sequence[Device], lost: Collection[Device]
) -> list[tuple[tuple[int, ...], int, int]]:
    """The shards ``(stages, EP rank, TP rank)`` of ``layout`` placed on ``devices`` (one per rank)
    whose every holder is ``lost`` (EP rank -1 for dense tensors; an expert's TP rank is its
    expert-TP rank); empty when the whole state survives."""
    world = WorldConfig(layout, Placement(tuple(devices)))
    return [(c.stages, c.ep, c.tp) for c in _orphaned(model.geometry(), world, lost)]


def state_survives(
    model: ModelSpec, layout: ParallelLayout, devices: Sequence[Device], lost: Collection[Device]
) -> bool:
    """Whether every shard keeps a holder outside ``lost``: whether the transfer planner can plan a
    handoff from this world without them (see the module docstring)."""
    return not orphaned_shards(model, layout, devices, lost)


__all__ = ["REPLICATED", "orphaned_shards", "state_survives"]
