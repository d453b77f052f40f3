"""The simulator's survival rule agrees with the transfer planner: a handoff around lost devices is
planned exactly when every shard keeps a DP replica elsewhere, and refused (``NoSurvivingSource``)
exactly when some shard was held only by lost devices."""

from __future__ import annotations

import pytest

from liver.reshard.plan import WorldConfig
from liver.reshard.planner import NoSurvivingSource, plan_resize
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.model import PRESETS, ModelSpec
from liver.sim.survival import REPLICATED, orphaned_shards, state_survives

PER_NODE = 4


def _planner_survives(
    model: ModelSpec, old: ParallelLayout, new: ParallelLayout, lost_nodes: set[str]
) -> bool:
    devices = grid_devices(-(-old.world_size // PER_NODE), PER_NODE)[: old.world_size]
    world = WorldConfig(old, Placement(devices))
    lost = [d for d in devices if d.node in lost_nodes]
    left = [d for d in devices if d.node not in lost_nodes][: new.world_size]
    try:
        plan_resize(model, world, new, left, optimizer=False, compare_rank_order=False, lost=lost)
    except NoSurvivingSource:
        return False
    return True


def _rule(model: ModelSpec, old: ParallelLayout, lost_nodes: set[str]) -> bool:
    devices = grid_devices(-(-old.world_size // PER_NODE), PER_NODE)[: old.world_size]
    return state_survives(model, old, devices, [d for d in devices if d.node in lost_nodes])


CASES = [
    # (model, old layout, new layout, lost nodes of 4 devices, survives)
    ("tiny-gpt", "TP2,PP1,DP4", "TP2,PP1,DP2", {"node000"}, True),  # node000 holds DP replicas 0 and 1
    ("tiny-gpt", "TP2,PP2,DP2", "TP2,PP1,DP2", {"node000"}, False),  # stage 0's only two replicas
    ("tiny-gpt", "TP1,PP2,DP4", "TP2,PP1,DP2", {"node001"}, False),  # stage 1 lives on node001 alone
    ("tiny-llama", "TP1,PP2,DP4", "TP1,PP2,DP2", {"node001"}, False),
    ("tiny-llama", "TP2,PP2,DP4", "TP2,PP2,DP3", {"node001"}, True),  # stage 0 keeps replicas 2, 3
    ("tiny-llama", "TP2,PP2,DP4", "TP2,PP1,DP2", {"node000", "node001"}, False),
    ("tiny-llama", "TP4,PP1,DP2", "TP2,PP1,DP2", {"node001"}, True),
    ("tiny-llama", "TP2,PP2,DP4", "TP2,PP2,DP2", {"node000", "node002"}, True),  # one per stage
]


@pytest.mark.parametrize(("model", "old", "new", "lost", "survives"), CASES)
def test_the_rule_answers_as_the_transfer_planner_does(
    model: str, old: str, new: str, lost: set[str], survives: bool
) -> None:
    spec = PRESETS[model]
    old_layout, new_layout = ParallelLayout.parse(old), ParallelLayout.parse(new)
    assert _planner_survives(spec, old_layout, new_layout, lost) is survives
    assert _rule(spec, old_layout, lost) is survives


def test_orphaned_shards_names_the_stages_and_tensor_ranks_gone() -> None:
    layout = ParallelLayout.parse("TP2,PP2,DP2")
    devices = grid_devices(2, PER_NODE)
    orphans = orphaned_shards(PRESETS["tiny-gpt"], layout, devices, devices[:PER_NODE])
    # Stage 0's sharded tensors on both TP ranks and its norms; the tied embedding lives on in stage 1.
    assert orphans == [((0,), -1, REPLICATED), ((0,), -1, 0), ((0,), -1, 1)]


def test_no_loss_orphans_nothing() -> None:
    layout = ParallelLayout.parse("TP1,PP2,DP1")
    assert state_survives(PRESETS["tiny-gpt"], layout, grid_devices(1, 2), ())


def test_a_device_list_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="devices"):
        state_survives(PRESETS["tiny-gpt"], ParallelLayout.parse("TP1,PP2,DP1"), [Device("n", 0)], ())
