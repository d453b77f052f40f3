"""Placement of a candidate layout with TP groups inside nodes, and the bytes it moves."""

from __future__ import annotations

import pytest

from liver.reshard.placement import bytes_moved, local_lower_bound, optimized_placement
from liver.reshard.plan import WorldConfig
from liver.reshard.planner import build_plan, default_world, plan_stats
from liver.reshard.verifier import verify_plan
from liver.services.topology.placement import node_local_placement, tp_groups_within_nodes
from liver.shared.layout import LayoutError, ParallelLayout, grid_devices
from liver.shared.model import PRESETS

MODEL = PRESETS["tiny-llama"]


def test_tp_groups_stay_on_one_node_where_the_bytes_only_placement_splits_them() -> None:
    old = default_world(ParallelLayout(1, 1, 1), 4)
    devices = grid_devices(2, 4)
    new = ParallelLayout(4, 1, 2)
    assert not tp_groups_within_nodes(new, optimized_placement(MODEL, old, devices, new))
    assert tp_groups_within_nodes(new, node_local_placement(MODEL, old, devices, new))


def test_the_bytes_only_placement_is_kept_when_its_groups_are_already_local() -> None:
    old = default_world(ParallelLayout(2, 2, 2), 4)
    devices = grid_devices(1, 4)
    new = ParallelLayout(2, 1, 2)
    expected = optimized_placement(MODEL, old, devices, new)
    assert tp_groups_within_nodes(new, expected)
    assert node_local_placement(MODEL, old, devices, new) == expected


@pytest.mark.parametrize(
    ("old", "nodes", "new"),
    [
        (ParallelLayout(2, 2, 2), 1, ParallelLayout(2, 1, 2)),
        (ParallelLayout(1, 1, 1), 2, ParallelLayout(4, 1, 2)),
        (ParallelLayout(4, 1, 2), 3, ParallelLayout(2, 2, 3)),
        (ParallelLayout(1, 4, 1), 2, ParallelLayout(2, 2, 2)),
    ],
)
def test_bytes_moved_equals_what_the_transfer_planner_sends(
    old: ParallelLayout, nodes: int, new: ParallelLayout
) -> None:
    old_world = default_world(old, 4)
    devices = grid_devices(nodes, 4)
    world = WorldConfig(new, node_local_placement(MODEL, old_world, devices, new))
    plan = build_plan(MODEL, old_world, world)
    assert verify_plan(plan).ok
    assert bytes_moved(MODEL, old_world, world) == plan_stats(plan).bytes_moved


def test_the_lower_bound_never_exceeds_a_placement() -> None:
    old = default_world(ParallelLayout(2, 2, 2), 4)
    devices = grid_devices(3, 4)
    new = ParallelLayout(2, 2, 3)
    bound = local_lower_bound(MODEL, old, devices, new)
    world = WorldConfig(new, node_local_placement(MODEL, old, devices, new))
    assert bound <= bytes_moved(MODEL, old, world)


def test_a_node_that_cannot_hold_whole_tp_groups_is_refused() -> None:
    old = default_world(ParallelLayout(1, 1, 1), 4)
    devices = grid_devices(1, 4) + grid_devices(3, 2)[2:]  # node000: 4 devices, node001 and 002: 2
    with pytest.raises(LayoutError, match="node001 has 2 devices"):
        node_local_placement(MODEL, old, devices, ParallelLayout(4, 1, 2))
