"""The topology planner with experts and context parallelism: a rank holds 1/EP of the experts, the
cost model counts EP's all-to-alls and CP's ring attention, and the chooser tries expert-parallel
layouts for a mixture of experts (and keeps a job's context parallelism)."""

from __future__ import annotations

import msgspec
import pytest

from liver.reshard.planner import default_world
from liver.services.topology.chooser import choose_topology
from liver.services.topology.cost import step_cost
from liver.services.topology.memory import H100_80GB, TrainingSetup, stage_state_bytes
from liver.shared.geometry import DdpSettings
from liver.shared.layout import ParallelLayout, grid_devices
from liver.shared.model import PRESETS

MOE = PRESETS["moe-200b"]
SETUP = TrainingSetup(global_batch_size=1024, sequence_length=4096)
L = ParallelLayout.parse


def test_a_rank_holds_its_ep_share_of_the_experts_state() -> None:
    geometry = MOE.geometry()
    experts = sum(t.nbytes for t in geometry.tensors() if t.expert >= 0) / MOE.num_layers  # per layer
    ep8 = stage_state_bytes(MOE, SETUP, L("TP2,PP4,DP128,EP8"))[1][0]
    ep16 = stage_state_bytes(MOE, SETUP, L("TP2,PP4,DP128,EP16"))[1][0]
    layers = MOE.num_layers // 4
    # Expert-TP is TP (2): the experts a rank holds are 1/(2 EP) of each layer's.
    assert ep8 - ep16 == round(layers * experts / 2 * (1 / 8 - 1 / 16))


def test_the_expert_buffers_optimizer_state_is_sharded_over_expert_dp() -> None:
    dist = MOE.geometry().with_ddp(DdpSettings(distributed_optimizer=True))
    plain = stage_state_bytes(MOE.geometry(), SETUP, L("TP2,PP4,DP128,EP8"))[1][0]
    sharded = stage_state_bytes(dist, SETUP, L("TP2,PP4,DP128,EP8"))[1][0]
    assert sharded < plain / 4


def test_expert_parallelism_costs_all_to_alls_and_context_parallelism_ring_attention() -> None:
    kw = {"tp_within_node": True, "single_node": False}
    dense = step_cost(MOE, SETUP, H100_80GB, L("TP1,PP4,DP256"), **kw)
    ep = step_cost(MOE, SETUP, H100_80GB, L("TP1,PP4,DP256,EP8"), **kw)
    near = step_cost(MOE, SETUP, H100_80GB, L("TP1,PP4,DP256,EP8"), **kw, ep_within_node=True)
    assert dense.ep_comm_s == 0 < near.ep_comm_s < ep.ep_comm_s
    cut = step_cost(MOE, SETUP, H100_80GB, L("TP2,PP4,DP128,EP8"), **kw)
    whole = step_cost(MOE, SETUP, H100_80GB, L("TP2,PP4,DP128,EP8,ETP1"), **kw)
    assert cut.ep_comm_s > whole.ep_comm_s, "expert-TP gathers and reduce-scatters the routed tokens"
    cp = step_cost(MOE, SETUP, H100_80GB, L("TP1,PP4,DP128,CP2,EP8"), **kw)
    assert cp.cp_comm_s > 0 and dense.cp_comm_s == 0


def test_the_chooser_picks_an_expert_parallel_layout_for_a_mixture_of_experts() -> None:
    current = default_world(L("TP2,PP4,DP128,EP8"), 8)
    devices = grid_devices(120, 8)
    decision = choose_topology(MOE, SETUP, H100_80GB, current, devices)
    chosen = decision.layout
    assert chosen.world_size <= 960 and chosen.ep > 1
    assert MOE.num_experts % chosen.ep == 0


def test_a_sequence_that_does_not_split_into_two_chunks_per_cp_rank_is_refused() -> None:
    from liver.services.topology.chooser import assess_layout

    setup = TrainingSetup(global_batch_size=1024, sequence_length=4098)  # 4098 = 2 * 2049
    current = default_world(L("TP2,PP4,DP64,CP2,EP8"), 8)
    score = assess_layout(
        MOE, setup, H100_80GB, current, current.placement.devices, L("TP2,PP4,DP64,CP2,EP8")
    )
    assert score.rule == "sequence" and "2 * cp = 4" in score.reason


def test_a_dense_first_layer_keeps_a_dense_layers_activations_and_costs_no_all_to_all() -> None:
    from liver.services.topology.memory import activation_bytes_per_token, memory_estimate

    model = PRESETS["tiny-deepseek"]
    setup = TrainingSetup(global_batch_size=8, sequence_length=32)
    layout = L("TP1,PP2,DP2,EP2:1/3")  # stage 0: the dense layer; stage 1: three MoE layers
    stages = memory_estimate(model, setup, H100_80GB, layout).stages
    dense = activation_bytes_per_token(model, setup, 1, 1, moe=False)
    moe = activation_bytes_per_token(model, setup, 1, 1, moe=True)
    assert dense != moe
    assert stages[0].activation_bytes == stages[0].in_flight * dense * 32
    # Three layers on the first stage: two MoE layers after the dense one against three.
    all_moe = msgspec.structs.replace(model, moe_layer_freq=1)
    front = L("TP1,PP2,DP2,EP2:3/1")
    kw = {"tp_within_node": True, "single_node": True}
    mixed = step_cost(model, setup, H100_80GB, front, **kw).ep_comm_s
    assert mixed == pytest.approx(step_cost(all_moe, setup, H100_80GB, front, **kw).ep_comm_s * 2 / 3)


def test_a_multi_token_prediction_layer_weighs_on_the_last_stage_only() -> None:
    from liver.services.topology.cost import stage_imbalance
    from liver.services.topology.memory import memory_estimate

    mtp = PRESETS["tiny-deepseek"]
    plain = msgspec.structs.replace(mtp, mtp_num_layers=0)
    setup = TrainingSetup(global_batch_size=8, sequence_length=32)
    layout = L("TP1,PP2,DP2,EP2")
    without, with_mtp = (memory_estimate(m, setup, H100_80GB, layout).stages for m in (plain, mtp))
    assert with_mtp[0] == without[0]
    assert with_mtp[1].state_bytes > without[1].state_bytes  # the MTP layer and the embedding replica
    assert with_mtp[1].activation_bytes > without[1].activation_bytes
    assert stage_imbalance(mtp, layout) > stage_imbalance(plain, layout)


def test_with_vpp_a_stage_counts_the_layers_of_its_chunks_not_a_contiguous_run() -> None:
    from liver.services.topology.memory import stage_layer_kinds

    model = msgspec.structs.replace(PRESETS["tiny-deepseek"], moe_layer_freq=(0, 0, 1, 1))
    assert stage_layer_kinds(model, L("TP1,PP2,DP1")) == [(2, 0), (0, 2)]
    # chunks of one layer: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3
    assert stage_layer_kinds(model, L("TP1,PP2,VPP2,DP1")) == [(1, 1), (1, 1)]
    interleaved = stage_state_bytes(model.geometry(), SETUP, L("TP1,PP2,VPP2,DP1"))
    assert interleaved[0][0] != stage_state_bytes(model.geometry(), SETUP, L("TP1,PP2,DP1"))[0][0]
