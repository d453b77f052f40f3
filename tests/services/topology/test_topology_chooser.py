"""The topology planner's choice: each rule of validity, scale-in and scale-out, device counts no
layout can use, and the preference for moving fewer bytes among near-equal layouts."""

from __future__ import annotations

import msgspec
import pytest

from liver.reshard.plan import WorldConfig
from liver.reshard.planner import build_plan, default_world
from liver.reshard.verifier import verify_plan
from liver.services.topology.chooser import (
    TopologyDecision,
    TopologyError,
    assess_layout,
    balanced_split,
    choose_topology,
)
from liver.services.topology.memory import CPU_SMALL, H100_80GB, TrainingSetup, memory_estimate
from liver.services.topology.placement import tp_groups_within_nodes
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.messages import TopologyPlanned
from liver.shared.model import PRESETS

LLAMA = PRESETS["tiny-llama"]  # 8 heads, 4 query groups, ffn 192, 4 layers
GPT = PRESETS["tiny-gpt"]  # 4 heads, ffn 256, 4 layers
SETUP = TrainingSetup(global_batch_size=16, sequence_length=64)
# Links so fast that communication vanishes: layouts without a pipeline then tie exactly.
FAST_LINKS = msgspec.structs.replace(CPU_SMALL, intra_node_bandwidth=1e18, inter_node_bandwidth=1e18)


def _world(layout: ParallelLayout, per_node: int = 4) -> WorldConfig:
    return default_world(layout, per_node)


def test_tp_must_divide_the_query_groups() -> None:
    score = assess_layout(
        LLAMA,
        SETUP,
        CPU_SMALL,
        _world(ParallelLayout(1, 1, 8), 8),
        grid_devices(1, 8),
        ParallelLayout(8, 1, 1),
    )
    assert score.rule == "tp_divisibility"
    assert "num_query_groups (4)" in score.reason


def test_tp_groups_may_not_span_nodes_unless_allowed() -> None:
    devices = grid_devices(4, 2)
    current = _world(ParallelLayout(1, 1, 8), 2)
    layout = ParallelLayout(4, 1, 2)
    refused = assess_layout(GPT, SETUP, CPU_SMALL, current, devices, layout)
    assert refused.rule == "tp_across_nodes"
    allowed = assess_layout(GPT, SETUP, CPU_SMALL, current, devices, layout, tp_across_nodes=True)
    assert allowed.feasible and not allowed.tp_within_node


def test_tp_across_nodes_is_scored_slower_than_the_same_layout_within_nodes() -> None:
    layout = ParallelLayout(4, 1, 2)
    across = assess_layout(
        GPT, SETUP, CPU_SMALL, _world(layout, 2), grid_devices(4, 2), layout, tp_across_nodes=True
    )
    within = assess_layout(GPT, SETUP, CPU_SMALL, _world(layout, 4), grid_devices(2, 4), layout)
    assert across.cost is not None and within.cost is not None
    assert across.cost.tp_comm_s > within.cost.tp_comm_s


def test_more_stages_than_layers_are_refused() -> None:
    score = assess_layout(
        GPT, SETUP, CPU_SMALL, _world(ParallelLayout(1, 1, 8)), grid_devices(2, 4), ParallelLayout(1, 8, 1)
    )
    assert score.rule == "pp_layers"


def test_the_global_batch_must_split_into_whole_micro_batches_per_replica() -> None:
    score = assess_layout(
        GPT, SETUP, CPU_SMALL, _world(ParallelLayout(1, 1, 3)), grid_devices(1, 3), ParallelLayout(1, 1, 3)
    )
    assert score.rule == "batch"
    assert "16" in score.reason


def test_the_interleaved_schedule_needs_each_ranks_micro_batches_in_groups_of_pp() -> None:
    setup = TrainingSetup(global_batch_size=6, sequence_length=64)  # 3 micro-batches per rank at DP2
    layout = ParallelLayout.parse("TP1,PP2,VPP2,DP2")
    score = assess_layout(GPT, setup, CPU_SMALL, _world(ParallelLayout(1, 1, 4)), grid_devices(1, 4), layout)
    assert score.rule == "batch"
    assert "multiple of pp=2" in score.reason
    even = assess_layout(GPT, SETUP, CPU_SMALL, _world(ParallelLayout(1, 1, 4)), grid_devices(1, 4), layout)
    assert even.feasible


def test_with_few_micro_batches_the_interleaved_schedule_is_chosen_for_its_smaller_bubble() -> None:
    # 70B on 8 nodes with a global batch of 128: memory forces a deep pipeline, whose 1F1B bubble
    # interleaving shrinks vpp-fold.
    setup = TrainingSetup(global_batch_size=128, sequence_length=2048)
    model = PRESETS["llama2-70b"]
    decision = choose_topology(
        model, setup, H100_80GB, default_world(ParallelLayout(8, 4, 2)), grid_devices(8, 8)
    )
    assert decision.layout.vpp > 1
    model.check_layout(decision.layout)
    plain = msgspec.structs.replace(decision.layout, vpp=1)
    slower = assess_layout(
        model, setup, H100_80GB, default_world(ParallelLayout(8, 4, 2)), grid_devices(8, 8), plain
    )
    assert slower.tokens_per_s < decision.tokens_per_s


def test_a_layout_over_device_memory_is_refused_and_a_smaller_shard_accepted() -> None:
    current = _world(ParallelLayout(1, 1, 2))
    devices = grid_devices(1, 2)
    tp1, tp2 = ParallelLayout(1, 1, 2), ParallelLayout(2, 1, 1)
    peak1 = memory_estimate(GPT, SETUP, CPU_SMALL, tp1).peak_bytes
    peak2 = memory_estimate(GPT, SETUP, CPU_SMALL, tp2).peak_bytes
    assert peak2 < peak1
    tight = msgspec.structs.replace(
        CPU_SMALL, memory_bytes=(peak1 + peak2) // 2, memory_margin=0.0, reserved_bytes=0
    )
    refused = assess_layout(GPT, SETUP, tight, current, devices, tp1, staging_bytes=0)
    assert refused.rule == "memory" and "usable" in refused.reason
    assert assess_layout(GPT, SETUP, tight, current, devices, tp2, staging_bytes=0).feasible
    decision = choose_topology(GPT, SETUP, tight, current, devices, staging_bytes=0)
    assert decision.layout == tp2
    assert decision.memory_peak_bytes <= decision.memory_usable_bytes


def test_nothing_fitting_raises_an_error_that_names_memory() -> None:
    tiny_memory = msgspec.structs.replace(CPU_SMALL, memory_bytes=1024**2, reserved_bytes=0)
    with pytest.raises(TopologyError, match="out of memory") as info:
        choose_topology(
            GPT, SETUP, tiny_memory, _world(ParallelLayout(1, 1, 4)), grid_devices(1, 4), staging_bytes=0
        )
    assert info.value.candidates and all(not c.feasible for c in info.value.candidates)


def test_uneven_layer_counts_get_a_balanced_split_that_spares_the_first_stage() -> None:
    assert balanced_split(96, 8) == ()
    assert balanced_split(4, 3) == (1, 2, 1)
    assert balanced_split(96, 20) == (4, *[5] * 16, 4, 4, 4)
    assert balanced_split(7, 2) == (3, 4)


def test_scale_in_picks_a_valid_fitting_layout_on_the_surviving_devices() -> None:
    current = _world(ParallelLayout(2, 2, 2))  # node000 and node001
    survivors = grid_devices(1, 4)
    decision = choose_topology(LLAMA, SETUP, CPU_SMALL, current, survivors)
    LLAMA.check_layout(decision.layout)
    assert decision.layout.world_size == 4
    assert set(decision.placement.devices) == set(survivors)
    assert tp_groups_within_nodes(decision.layout, decision.placement)
    plan = build_plan(LLAMA, current, decision.world)
    assert verify_plan(plan).ok


def test_scale_out_uses_the_added_nodes() -> None:
    current = _world(ParallelLayout(2, 1, 2))
    devices = grid_devices(3, 4)
    decision = choose_topology(LLAMA, SETUP, CPU_SMALL, current, devices)
    assert decision.layout.world_size == 12 and not decision.devices_idle
    assert tp_groups_within_nodes(decision.layout, decision.placement)


def test_a_prime_device_count_uses_fewer_devices_leaves_a_new_one_idle_and_says_so() -> None:
    current = _world(ParallelLayout(1, 1, 4))  # node000:0-3
    devices = (*grid_devices(1, 4), Device("node001", 0), Device("node001", 1), Device("node001", 2))
    decision = choose_topology(LLAMA, SETUP, CPU_SMALL, current, devices)
    assert decision.layout.world_size == 6
    assert len(decision.devices_idle) == 1 and decision.devices_idle[0].node == "node001"
    assert "No layout uses all 7 devices" in decision.explanation


def test_within_tolerance_the_layout_that_moves_fewer_bytes_beats_the_fastest() -> None:
    current = _world(ParallelLayout(2, 1, 4))  # node000 and node001; node001 is reclaimed
    survivors = grid_devices(1, 4)
    strict = choose_topology(LLAMA, SETUP, CPU_SMALL, current, survivors, tolerance=0.0)
    lenient = choose_topology(LLAMA, SETUP, CPU_SMALL, current, survivors, tolerance=0.02)
    assert lenient.tokens_per_s < strict.tokens_per_s
    assert lenient.tokens_per_s >= strict.tokens_per_s * 0.98
    assert lenient.bytes_moved < strict.bytes_moved
    assert lenient.layout == ParallelLayout(2, 1, 2) and lenient.bytes_moved == 0
    assert "prefers moving fewer bytes" in lenient.explanation


def test_the_current_layout_is_kept_when_nothing_changes_and_layouts_tie() -> None:
    for layout in (ParallelLayout(2, 1, 4), ParallelLayout(4, 1, 2), ParallelLayout(1, 1, 8)):
        current = _world(layout)
        decision = choose_topology(LLAMA, SETUP, FAST_LINKS, current, current.placement.devices)
        assert decision.layout == layout
        assert decision.bytes_moved == 0
        assert "(the current layout)" in decision.explanation


def test_replanning_the_chosen_world_on_the_same_devices_keeps_it() -> None:
    first = choose_topology(LLAMA, SETUP, CPU_SMALL, _world(ParallelLayout(2, 2, 2)), grid_devices(3, 4))
    again = choose_topology(LLAMA, SETUP, CPU_SMALL, first.world, grid_devices(3, 4))
    assert again.layout == first.layout and again.bytes_moved == 0


def test_candidates_are_ranked_and_convert_to_the_planned_message() -> None:
    current = _world(ParallelLayout(2, 2, 2))
    decision = choose_topology(LLAMA, SETUP, CPU_SMALL, current, grid_devices(3, 4))
    feasible = [c for c in decision.candidates if c.feasible]
    assert [c.tokens_per_s for c in feasible] == sorted((c.tokens_per_s for c in feasible), reverse=True)
    assert all(c.bytes_moved is not None and c.memory_peak_bytes for c in feasible)
    assert any(c.layout == decision.layout for c in feasible)
    message = TopologyPlanned(
        job_id="job1",
        event_id="ev1",
        from_generation=0,
        generation=1,
        model=LLAMA.geometry(),
        from_layout=current.layout,
        from_placement=current.placement,
        layout=decision.layout,
        placement=decision.placement,
        candidates=decision.message_candidates(),
        explanation=decision.explanation,
    )
    assert message.candidates[0].fits and message.candidates[0].score > 0


def test_duplicate_devices_are_refused_naming_the_field() -> None:
    devices = (*grid_devices(1, 4), Device("node000", 0))
    with pytest.raises(TopologyError, match="devices: device node000:0 appears twice"):
        choose_topology(LLAMA, SETUP, CPU_SMALL, _world(ParallelLayout(1, 1, 4)), devices)


def test_a_current_layout_the_model_cannot_have_is_refused_naming_the_field() -> None:
    current = WorldConfig(ParallelLayout(8, 1, 1), Placement(grid_devices(1, 8)))
    with pytest.raises(TopologyError, match=r"current\.layout"):
        choose_topology(LLAMA, SETUP, CPU_SMALL, current, grid_devices(1, 8))


def test_gpt3_175b_on_960_h100s_returns_a_fitting_node_local_layout() -> None:
    model = PRESETS["gpt3-175b"]
    setup = TrainingSetup(global_batch_size=1536, sequence_length=2048)
    current = default_world(ParallelLayout(8, 8, 16))  # 1,024 devices on 128 nodes
    survivors = grid_devices(128, 8)[64:]  # 8 nodes reclaimed
    decision = choose_topology(model, setup, H100_80GB, current, survivors)
    model.check_layout(decision.layout)
    assert decision.layout.world_size == 960
    assert decision.memory_peak_bytes <= decision.memory_usable_bytes
    assert tp_groups_within_nodes(decision.layout, decision.placement)


def test_a_decision_round_trips_through_json() -> None:
    decision = choose_topology(LLAMA, SETUP, CPU_SMALL, _world(ParallelLayout(2, 2, 2)), grid_devices(3, 4))
    data = msgspec.json.encode(decision)
    assert msgspec.json.decode(data, type=TopologyDecision) == decision


def test_a_lost_device_offered_as_a_target_is_refused() -> None:
    current = _world(ParallelLayout(1, 1, 4), 4)
    lost = current.placement.devices[3]
    with pytest.raises(TopologyError, match=f"devices: device {lost} is lost"):
        choose_topology(GPT, SETUP, CPU_SMALL, current, current.placement.devices, lost=(lost,))


# -- redundancy: a layout whose state survives a node lost without notice ------------------------------------

CHAOS_SETUP = TrainingSetup(global_batch_size=12, micro_batch_size=1, sequence_length=16)
SIX = grid_devices(3, 2)
"""node000:0,1 node001:0,1 node002:0,1."""


def _shrink_to_two_nodes(redundancy: str) -> tuple[ParallelLayout, Placement]:
    from liver.services.topology.chooser import choose_topology

    current = WorldConfig(ParallelLayout(tp=2, pp=1, dp=3), Placement(SIX))
    decision = choose_topology(
        PRESETS["tiny-gpt"],
        CHAOS_SETUP,
        CPU_SMALL,
        current,
        SIX[:4],
        redundancy=redundancy,  # type: ignore[arg-type]
    )
    return decision.layout, decision.placement


def test_without_redundancy_a_shrink_may_keep_no_replica_on_another_node() -> None:
    from liver.reshard.planner import orphaned_shards

    layout, placement = _shrink_to_two_nodes("none")
    world = WorldConfig(layout, placement)
    node001 = tuple(d for d in placement.devices if d.node == "node001")
    assert orphaned_shards(PRESETS["tiny-gpt"].geometry(), world, node001)  # TP2,PP2: pipeline halves


def test_with_node_redundancy_the_state_survives_the_loss_of_either_node() -> None:
    from liver.reshard.planner import orphaned_shards

    layout, placement = _shrink_to_two_nodes("node")
    world = WorldConfig(layout, placement)
    assert layout.dp >= 2
    for node in ("node000", "node001"):
        lost = tuple(d for d in placement.devices if d.node == node)
        assert not orphaned_shards(PRESETS["tiny-gpt"].geometry(), world, lost), node


def test_node_redundancy_asks_for_nothing_on_a_single_node() -> None:
    from liver.services.topology.chooser import choose_topology

    current = WorldConfig(ParallelLayout(tp=2, pp=1, dp=1), Placement(SIX[:2]))
    decision = choose_topology(
        PRESETS["tiny-gpt"], CHAOS_SETUP, CPU_SMALL, current, SIX[:2], redundancy="node"
    )
    assert decision.placement.devices and {d.node for d in decision.placement.devices} == {"node000"}


# -- how the chosen world comes through a node lost without notice ------------------------------------------


def test_a_world_whose_replicas_span_nodes_survives_a_node_loss_from_them_at_no_memory_cost() -> None:
    from liver.services.topology.chooser import NodeLoss

    current = WorldConfig(ParallelLayout(tp=2, pp=1, dp=3), Placement(SIX))
    decision = choose_topology(GPT, CHAOS_SETUP, CPU_SMALL, current, SIX[:4], redundancy="node")
    assert decision.layout.dp == 2 and decision.node_loss is NodeLoss.REPLICAS
    assert decision.copies_host_bytes == 0
    assert "recovered live from the replicas" in decision.explanation


def test_with_the_distributed_optimizer_a_node_loss_is_survived_from_peer_copies_whose_memory_is_said() -> (
    None
):
    from liver.reshard.redundancy import redundancy
    from liver.services.topology.chooser import NodeLoss
    from liver.shared.geometry import DdpSettings

    geometry = GPT.geometry().with_ddp(DdpSettings(distributed_optimizer=True))
    current = WorldConfig(ParallelLayout(tp=2, pp=1, dp=3), Placement(SIX))
    decision = choose_topology(GPT, CHAOS_SETUP, CPU_SMALL, current, SIX[:4], geometry=geometry)
    assert decision.node_loss is NodeLoss.COPIES
    kept = redundancy(geometry, decision.layout, decision.placement).kept_bytes
    assert decision.copies_host_bytes == max(kept) > 0
    assert "peer copies" in decision.explanation and "host memory" in decision.explanation


def test_a_job_without_peer_copies_survives_a_node_loss_only_from_replicas_or_the_checkpoint() -> None:
    from liver.services.topology.chooser import NodeLoss
    from liver.shared.geometry import DdpSettings

    geometry = GPT.geometry().with_ddp(DdpSettings(distributed_optimizer=True))
    current = WorldConfig(ParallelLayout(tp=2, pp=1, dp=3), Placement(SIX))
    decision = choose_topology(GPT, CHAOS_SETUP, CPU_SMALL, current, SIX[:4], geometry=geometry, copies=False)
    assert decision.node_loss is NodeLoss.CHECKPOINT and decision.copies_host_bytes == 0
    assert "keeps no peer copies" in decision.explanation


def test_peer_copies_beyond_the_profiles_host_memory_budget_leave_only_the_checkpoint() -> None:
    from liver.services.topology.chooser import NodeLoss
    from liver.shared.geometry import DdpSettings

    geometry = GPT.geometry().with_ddp(DdpSettings(distributed_optimizer=True))
    current = WorldConfig(ParallelLayout(tp=2, pp=1, dp=3), Placement(SIX))
    roomy = choose_topology(GPT, CHAOS_SETUP, CPU_SMALL, current, SIX[:4], geometry=geometry)
    needed = roomy.copies_host_bytes
    fits = msgspec.structs.replace(CPU_SMALL, copies_budget_bytes=needed)
    assert (
        choose_topology(GPT, CHAOS_SETUP, fits, current, SIX[:4], geometry=geometry).node_loss
        is NodeLoss.COPIES
    )
    tight = msgspec.structs.replace(CPU_SMALL, copies_budget_bytes=needed - 1)
    decision = choose_topology(GPT, CHAOS_SETUP, tight, current, SIX[:4], geometry=geometry)
    assert decision.node_loss is NodeLoss.CHECKPOINT and decision.copies_host_bytes == needed
    assert "more than the" in decision.explanation and "cpu-small profile allows" in decision.explanation


def test_a_world_on_one_node_survives_a_node_loss_only_from_the_checkpoint() -> None:
    from liver.services.topology.chooser import NodeLoss

    current = WorldConfig(ParallelLayout(tp=2, pp=1, dp=1), Placement(SIX[:2]))
    decision = choose_topology(GPT, CHAOS_SETUP, CPU_SMALL, current, SIX[:2])
    assert decision.node_loss is NodeLoss.CHECKPOINT
    assert "leaves only the checkpoint" in decision.explanation


def test_within_tolerance_a_world_that_survives_a_node_loss_beats_one_that_moves_fewer_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from liver.services.topology import chooser as chooser_module
    from liver.services.topology.chooser import NodeLoss

    current = _world(ParallelLayout(2, 1, 4))
    plain = choose_topology(LLAMA, SETUP, FAST_LINKS, current, current.placement.devices)
    assert plain.layout == current.layout and plain.bytes_moved == 0
    original = chooser_module._Chooser.on_one_node

    def the_current_world_dies_with_a_node(placement: Placement) -> bool:
        return placement == current.placement or original(placement)

    monkeypatch.setattr(
        chooser_module._Chooser, "on_one_node", staticmethod(the_current_world_dies_with_a_node)
    )
    decision = choose_topology(LLAMA, SETUP, FAST_LINKS, current, current.placement.devices)
    assert decision.layout != current.layout and decision.node_loss is not NodeLoss.CHECKPOINT
    assert decision.tokens_per_s >= plain.tokens_per_s * 0.98
