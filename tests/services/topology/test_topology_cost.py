"""The topology planner's throughput model: each term moves the estimate the way it should."""

from __future__ import annotations

import msgspec
import pytest

from liver.services.topology.cost import bubble_fraction, ring_all_reduce_s, step_cost
from liver.services.topology.memory import H100_80GB, TrainingSetup
from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS

MODEL = PRESETS["llama3-8b"]


def _setup(global_batch: int = 64) -> TrainingSetup:
    return TrainingSetup(global_batch_size=global_batch, sequence_length=4096)


def _cost(layout: ParallelLayout, setup: TrainingSetup | None = None, **links: bool):
    kwargs = {"tp_within_node": True, "single_node": False, **links}
    return step_cost(MODEL, setup or _setup(), H100_80GB, layout, **kwargs)


def test_bubble_fraction_grows_with_stages_and_shrinks_with_micro_batches() -> None:
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(2, 8) < bubble_fraction(4, 8) < bubble_fraction(8, 8)
    assert bubble_fraction(4, 32) < bubble_fraction(4, 8) < bubble_fraction(4, 2)


def test_fewer_micro_batches_mean_more_bubble_and_fewer_tokens_per_second() -> None:
    layout = ParallelLayout(1, 4, 1)  # dp=1: no gradient all-reduce to blur the comparison
    many, few = _cost(layout, _setup(32)), _cost(layout, _setup(4))
    assert few.bubble_share > many.bubble_share
    assert few.tokens_per_s < many.tokens_per_s


def test_bubble_is_the_documented_share_of_the_step_without_data_parallelism() -> None:
    cost = _cost(ParallelLayout(2, 4, 1), _setup(8))
    assert cost.bubble_share == pytest.approx(bubble_fraction(4, 8))


def test_compute_is_six_flops_per_parameter_and_token_spread_over_devices() -> None:
    cost = _cost(ParallelLayout(1, 1, 8), _setup(64))
    rate = H100_80GB.peak_flops * H100_80GB.achievable_fraction
    expected = 6 * MODEL.parameter_count() * 64 * 4096 / 8 / rate
    assert cost.compute_s == pytest.approx(expected)


def test_an_uneven_pipeline_split_runs_at_the_pace_of_its_largest_stage() -> None:
    even = _cost(ParallelLayout(1, 4, 1))
    uneven = _cost(ParallelLayout(1, 4, 1, (5, 9, 9, 9)))
    assert uneven.compute_s == pytest.approx(even.compute_s * 9 / 8)


def test_tp_across_nodes_is_slower_than_tp_within_a_node() -> None:
    layout = ParallelLayout(8, 1, 8)
    inside, across = _cost(layout), _cost(layout, tp_within_node=False)
    assert across.tp_comm_s > inside.tp_comm_s
    assert across.tokens_per_s < inside.tokens_per_s


def test_tp1_has_no_tp_communication_and_dp1_no_gradient_all_reduce() -> None:
    cost = _cost(ParallelLayout(1, 2, 1))
    assert cost.tp_comm_s == 0 and cost.dp_comm_s == 0


def test_gradient_all_reduce_uses_node_links_only_for_a_single_node_job() -> None:
    layout = ParallelLayout(1, 1, 8)
    one_node, many_nodes = _cost(layout, single_node=True), _cost(layout, single_node=False)
    ratio = H100_80GB.intra_node_bandwidth / H100_80GB.inter_node_bandwidth
    assert many_nodes.dp_comm_s == pytest.approx(one_node.dp_comm_s * ratio)


def test_ring_all_reduce_sends_twice_the_data_asymptotically() -> None:
    assert ring_all_reduce_s(100.0, 1, 10.0) == 0
    assert ring_all_reduce_s(100.0, 2, 10.0) == pytest.approx(10.0)
    assert ring_all_reduce_s(100.0, 1000, 10.0) == pytest.approx(2 * 999 / 1000 * 10.0)


def test_full_recompute_costs_a_third_more_compute() -> None:
    setup = msgspec.structs.replace(_setup(), recompute="full")
    layout = ParallelLayout(2, 1, 4)
    assert _cost(layout, setup).compute_s == pytest.approx(_cost(layout).compute_s * 4 / 3)
