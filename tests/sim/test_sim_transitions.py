"""Transitions come from the real planners, are cached by the shape of the change, and their transfer
time follows the plan."""

from __future__ import annotations

import pytest

from liver.reshard.plan import WorldConfig
from liver.reshard.planner import build_plan, plan_stats
from liver.shared.layout import ParallelLayout, Placement, grid_devices
from liver.sim.calibration import Calibration, load_calibration, with_overrides
from liver.sim.models import GPT_14B
from liver.sim.transitions import TransitionPlanner, streaming_seconds, topology_chooser


@pytest.fixture(scope="module")
def calibration() -> Calibration:
    return load_calibration()


@pytest.fixture(scope="module")
def planner(calibration: Calibration) -> TransitionPlanner:
    return TransitionPlanner(GPT_14B, calibration)


def test_the_same_question_is_answered_once(planner: TransitionPlanner) -> None:
    start = planner.transition(None, 0, 0, 4)
    misses = planner.misses
    again = planner.transition(None, 0, 0, 4)
    assert again is start
    assert planner.misses == misses


def test_the_target_is_the_topology_planners_choice(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    start = planner.transition(None, 0, 0, 4)
    old = WorldConfig(start.new_layout, Placement(grid_devices(4, 8)[: start.new_devices]))  # type: ignore[arg-type]
    layout, _placement = topology_chooser(calibration)(GPT_14B, grid_devices(3, 8), old)
    assert planner.transition(start.new_layout, 4, 3, 0).new_layout == layout


def test_the_same_world_on_the_same_nodes_moves_nothing(planner: TransitionPlanner) -> None:
    start = planner.transition(None, 0, 0, 4)
    same = planner.transition(start.new_layout, 4, 4, 0)
    assert same.unchanged
    assert same.bytes_moved == 0 and same.transfer_s == 0


def test_a_scale_in_moves_bytes_and_takes_time(planner: TransitionPlanner) -> None:
    start = planner.transition(None, 0, 0, 4)
    tr = planner.transition(start.new_layout, 4, 3, 0)
    assert tr.bytes_moved > 0
    assert 0 < tr.transfer_s <= tr.transfer_barrier_s
    assert not tr.uses_fresh


def test_a_scale_out_uses_the_fresh_node(planner: TransitionPlanner) -> None:
    start = planner.transition(None, 0, 0, 3)
    tr = planner.transition(start.new_layout, 3, 3, 1)
    assert tr.uses_fresh
    assert tr.new_devices == 32


def test_moving_the_whole_training_state_moves_more(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    full = planner.rebind(with_overrides(calibration, transfer_optimizer_state=True))
    start = planner.transition(None, 0, 0, 4)
    params = planner.transition(start.new_layout, 4, 3, 0)
    everything = full.transition(start.new_layout, 4, 3, 0)
    assert everything.bytes_moved > 4 * params.bytes_moved
    assert everything.transfer_s > params.transfer_s


def test_rebinding_keeps_the_cache_when_transitions_do_not_change(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    planner.transition(None, 0, 0, 4)
    same = planner.rebind(with_overrides(calibration, checkpoint_interval_s=60.0))
    assert same.cache is planner.cache
    other = planner.rebind(with_overrides(calibration, round_latency_s=0.01))
    assert other.cache is not planner.cache


def test_transfer_time_is_bytes_over_bandwidth_for_one_message(calibration: Calibration) -> None:
    # TP2 -> TP1 on the same 2 devices of one node: rank 0 keeps its half and receives the other half.
    model = GPT_14B
    devices = grid_devices(1, 8)[:2]
    old = WorldConfig(ParallelLayout(2, 1, 1), Placement(devices))
    new = WorldConfig(ParallelLayout(1, 1, 2), Placement(devices))
    plan = build_plan(model, old, new, calibration.staging_bytes, optimizer=False)
    stats = plan_stats(plan)
    executor, barriers = streaming_seconds(plan, calibration)
    # Both devices receive over the node's links; with no round latency the busiest device's bytes
    # over the intra-node bandwidth bound the time from below, the sum of steps from above.
    assert executor == pytest.approx(barriers)
    assert executor >= stats.max_recv_bytes / calibration.hardware.intra_node_bandwidth - 1e-9
    assert executor == pytest.approx(
        stats.max_recv_bytes / calibration.hardware.intra_node_bandwidth, rel=0.05
    )
