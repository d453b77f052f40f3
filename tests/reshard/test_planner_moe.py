"""Expert-parallel and context-parallel layouts: the rank order, the views of experts, and plans that
move experts whole, re-cut them by expert-TP and re-shard optimizer state over DP x CP and expert-DP,
verified exactly on metadata (from CI-sized models to a 200B-parameter MoE on 1,024 devices)."""

from __future__ import annotations

import pytest
from megatron.core.parallel_state import RankGenerator

from liver.reshard.dist_opt import buffer_layouts, owned_ranges
from liver.reshard.placement import bytes_moved
from liver.reshard.plan import WorldConfig
from liver.reshard.plan_file import decode_plan, encode_plan
from liver.reshard.planner import (
    NoSurvivingSource,
    build_plan,
    default_world,
    plan_resize,
    plan_stats,
)
from liver.reshard.verifier import verify_plan
from liver.reshard.views import view
from liver.shared.geometry import DdpSettings, GeometryError, ModelGeometry, ParamGeometry
from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement, grid_devices
from liver.shared.model import PRESETS, ModelError, ModelSpec

MOE = PRESETS["tiny-moe"]  # 4 layers, 4 experts, hidden 64, expert FFN 96
SWIGLU_MOE = ModelSpec(
    name="tiny-moe-swiglu",
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=500,
    make_vocab_size_divisible_by=16,
    tied_embeddings=True,
    swiglu=True,
    bias=False,
    normalization="RMSNorm",
    position_embedding="rope",
    max_sequence_length=64,
    params_dtype="bfloat16",
    num_experts=8,
    moe_ffn_hidden_size=32,
)
DIST = DdpSettings(distributed_optimizer=True)


def L(text: str) -> ParallelLayout:
    return ParallelLayout.parse(text)


def world(layout: ParallelLayout, per_node: int = 4) -> WorldConfig:
    return default_world(layout, per_node)


# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    "text",
    [
        "TP2,PP2,DP4,EP2",
        "TP2,PP2,DP2,EP4,ETP1",
        "TP1,PP2,DP4,EP2,ETP2",
        "TP2,PP1,DP2,CP2,EP2",
        "TP4,PP2,DP2,CP2,EP4,ETP2",
    ],
)
def test_both_numberings_are_megatrons_rank_generators(text: str) -> None:
    layout = L(text)
    dense = RankGenerator(
        tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp"
    )
    expert = RankGenerator(
        tp=layout.expert_tp, ep=layout.ep, dp=layout.edp, pp=layout.pp, cp=1, order="tp-cp-ep-dp-pp"
    )
    for token, field, gen in (
        ("tp", "tp", dense),
        ("cp", "cp", dense),
        ("dp", "dp", dense),
        ("pp", "pp", dense),
        ("ep", "ep", expert),
        ("tp", "etp", expert),
        ("dp", "edp", expert),
    ):
        for group in gen.get_ranks(token):
            assert [getattr(layout.coords(r), field) for r in group] == list(range(len(group))), (
                token,
                group,
            )
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert layout.rank_of(c.tp, c.dp, c.pp, c.cp) == r
        assert layout.grid(expert=True).rank(c.etp, c.ep, c.edp, c.pp) == r


def test_a_layout_reads_and_describes_its_new_dimensions() -> None:
    layout = L("2,2,4,EP4,ETP1,CP2:1/3")
    assert (layout.cp, layout.ep, layout.expert_tp, layout.stage_layers) == (2, 4, 1, (1, 3))
    assert layout.world_size == 2 * 2 * 4 * 2 and layout.edp == 4
    assert L(layout.describe()) == layout
    assert L("TP2,PP1,DP2,ETP2") == L("2,1,2"), "expert-TP equal to TP is the default"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("TP2,PP1,DP2,EP3", "must divide"),
        ("TP2,PP1,DP2,ETP1", "wrong group"),  # EP 1 with expert-TP != TP: Megatron steps it, wrongly
        ("TP1,PP1,DP2,EP2,EP2", "each once"),
        ("TP1,PP1,DP2,XP2", "CPn, EPn, ETPn"),
        ("TP1,PP1,DP2,CP0", "at least 1"),
    ],
)
def test_an_impossible_layout_is_refused_naming_why(text: str, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        L(text)


def test_expert_parallelism_must_divide_the_experts_and_expert_tp_their_ffn() -> None:
    with pytest.raises(LayoutError, match="num_experts"):
        MOE.geometry().check_layout(L("TP1,PP1,DP8,EP8"))
    with pytest.raises(LayoutError, match="etp=64"):
        MOE.geometry().check_layout(L("TP1,PP1,DP128,EP2,ETP64"))
    with pytest.raises(LayoutError, match="expert parallelism needs a model with experts"):
        PRESETS["tiny-gpt"].geometry().check_layout(L("TP1,PP1,DP2,EP2"))


def test_a_moe_model_description_is_validated() -> None:
    with pytest.raises(ModelError, match="moe_router_topk"):
        ModelSpec(
            num_layers=1,
            hidden_size=8,
            ffn_hidden_size=8,
            num_attention_heads=1,
            vocab_size=8,
            num_experts=2,
            moe_router_topk=3,
        )
    with pytest.raises(GeometryError, match="num_experts"):
        ModelGeometry(
            name="x",
            num_layers=1,
            parameters=(
                ParamGeometry(
                    name="decoder.layers.{layer}.e.{expert}.w",
                    shape=(2,),
                    dtype="float32",
                    rule="column",
                    home="layer",
                    layers=(0, 1),
                    expert=True,
                ),
            ),
        )


# --------------------------------------------------------------------------- views


def test_an_expert_lives_whole_on_one_ep_rank_cut_by_expert_tp_and_replicated_over_expert_dp() -> None:
    layout = L("TP2,PP1,DP2,EP2,ETP1")  # 4 ranks: EP groups (0,1), (2,3); expert-DP (0,2), (1,3)
    g = MOE.geometry()
    fc1 = {t.expert: t for t in g.tensors(False) if t.name.endswith("linear_fc1.weight") and t.layer == 1}
    holders = {e: [r for r in range(4) if view(t, g, layout, r)] for e, t in fc1.items()}
    assert holders == {0: [0, 2], 1: [0, 2], 2: [1, 3], 3: [1, 3]}
    assert view(fc1[2], g, layout, 1).box == ((0, 96), (0, 64))  # whole: expert-TP 1
    qkv = next(t for t in g.tensors(False) if t.name == "decoder.layers.0.self_attention.linear_qkv.weight")
    assert view(qkv, g, layout, 1).box == ((96, 192), (0, 64))  # dense TP 2 on the same rank
    cut = L("TP1,PP1,DP4,EP2,ETP2")  # expert-TP 2: ranks 0/1 hold the halves of experts 0 and 1
    assert view(fc1[1], g, cut, 1).box == ((48, 96), (0, 64))
    assert view(fc1[1], g, cut, 2) is None


def test_a_rank_outside_the_world_is_refused_by_the_view() -> None:
    g = MOE.geometry()
    fc1 = next(t for t in g.tensors(False) if t.expert == 3)
    for rank in (-1, 4):
        with pytest.raises(LayoutError, match="outside"):
            view(fc1, g, L("TP1,PP1,DP4,EP2"), rank)


def test_tensors_of_experts_are_listed_expert_by_expert_as_megatron_names_them() -> None:
    names = [t.name for t in MOE.tensors(False) if t.layer == 1]
    experts = [n.split("mlp.")[1] for n in names if "local_experts" in n]
    assert experts[:4] == [
        "experts.local_experts.0.linear_fc1.weight",
        "experts.local_experts.0.linear_fc2.weight",
        "experts.local_experts.1.linear_fc1.weight",
        "experts.local_experts.1.linear_fc2.weight",
    ]
    assert names.index("decoder.layers.0.mlp.router.weight") < names.index(
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    )


# --------------------------------------------------------------------------- plans

MOVES = [
    ("TP1,PP1,DP4,EP2", "TP1,PP1,DP4,EP4"),  # experts move whole
    ("TP1,PP1,DP4,EP4", "TP1,PP1,DP2,EP2"),  # scale-in
    ("TP1,PP1,DP2,EP2", "TP2,PP1,DP4,EP4"),  # scale-out with TP
    ("TP2,PP1,DP2,EP2", "TP2,PP2,DP2,EP2,ETP1"),  # EP with PP, expert-TP 2 -> 1
    ("TP1,PP2,DP4,EP2,ETP2", "TP2,PP2,DP2,EP4,ETP1"),  # expert-TP > 1 to EP x TP
    ("TP1,PP1,DP8,EP2", "TP1,PP1,DP8,EP4"),  # expert-DP 4 -> 2
    ("TP1,PP2,DP2,EP2:1/3", "TP1,PP3,DP2,EP2:2/1/1"),  # uneven pipelines of MoE layers
    ("TP1,PP1,DP2,CP2,EP2", "TP1,PP1,DP4,EP4"),  # CP 2 -> 1
    ("TP2,PP1,DP1,CP2,EP2", "TP1,PP1,DP2,CP2,EP4"),  # CP kept, TP halves
]


@pytest.mark.parametrize("model", [MOE, SWIGLU_MOE], ids=lambda m: m.name)
@pytest.mark.parametrize("ddp", [DdpSettings(), DIST], ids=["adam", "dist-opt"])
@pytest.mark.parametrize(("old", "new"), MOVES)
def test_every_move_of_a_moe_model_plans_and_verifies(
    model: ModelSpec, ddp: DdpSettings, old: str, new: str
) -> None:
    g = model.geometry().with_ddp(ddp)
    ol, nl = L(old), L(new)
    if g.num_experts % nl.ep or g.num_experts % ol.ep:
        pytest.skip("experts not divisible")
    plan = build_plan(g, world(ol), world(nl, 4), budget_bytes=16 * 1024)
    report = verify_plan(plan)
    assert report.ok, report.errors
    assert report == verify_plan(plan, by_class=False)  # proved from the classes, as task by task
    assert decode_plan(encode_plan(plan)) == plan


def test_experts_that_stay_on_their_device_are_copied_and_the_others_move_whole() -> None:
    g = MOE.geometry()
    old = world(L("TP1,PP1,DP4,EP2"))  # ranks 0,2 hold experts 0-1; 1,3 hold 2-3
    plan = build_plan(g, old, WorldConfig(L("TP1,PP1,DP4,EP4"), old.placement))  # each rank one expert
    assert verify_plan(plan).ok
    expert_of = {i: t.expert for i, t in enumerate(plan.tensors)}
    moved = {expert_of[ti] for t in plan.tasks if not t.local for ti, _box in t.slices}
    # New rank 1 holds expert 1, which old rank 1 (EP rank 1) lacks; new rank 2 holds expert 2, which old
    # rank 2 lacks: they are sent, experts 0 and 3 stay where they are, and no dense tensor moves.
    assert moved == {1, 2}
    assert plan_stats(plan).bytes_moved == bytes_moved(g, old, plan.new)


def test_a_context_parallel_change_at_the_same_devices_moves_no_optimizer_state() -> None:
    # The distributed optimizer shards dense buffers over DP x CP: DP4 and DP2 x CP2 number it alike.
    g = MOE.geometry().with_ddp(DIST)
    old = world(L("TP1,PP1,DP4,EP2"))
    plan = build_plan(g, old, WorldConfig(L("TP1,PP1,DP2,CP2,EP2"), old.placement))
    assert verify_plan(plan).ok and plan_stats(plan).bytes_moved == 0


def test_the_distributed_optimizer_shards_experts_over_expert_dp_and_dense_over_dp_times_cp() -> None:
    g = MOE.geometry().with_ddp(DIST)
    layout = L("TP1,PP1,DP2,CP2,EP2")  # dense group DP x CP = 4; expert-DP = 2
    dense, expert = buffer_layouts(g, layout, 0)
    assert not dense.expert and expert.expert
    assert {s.name.split(".local_experts.")[1].split(".")[0] for s in expert.params} == {"0", "1"}
    assert dense.buckets[-1][1] % 128 == 0 and expert.buckets[-1][1] % 128 == 0
    fc1 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    shares = [owned_ranges(g, layout, r).get(fc1) for r in (0, 2)]  # the two expert-DP ranks of EP rank 0
    assert (shares[0] is not None and shares[1] is not None and shares[0][1] == shares[1][0]) or shares[
        0
    ] != shares[1]
    assert owned_ranges(g, layout, 1).get(fc1) is None  # EP rank 1 does not hold expert 0


def test_at_ep_1_experts_share_the_dense_buffers_as_in_megatron() -> None:
    g = MOE.geometry().with_ddp(DIST)
    (dense,) = buffer_layouts(g, L("TP1,PP1,DP2"), 0)
    assert any("local_experts" in s.name for s in dense.params)


def test_an_expert_whose_every_holder_is_lost_cannot_be_planned_around() -> None:
    g = MOE.geometry()
    old = world(L("TP1,PP1,DP4,EP2"), per_node=2)  # node000: ranks 0,1 (both EP ranks, replica 0)
    lost = [Device("node000", 0), Device("node000", 1), Device("node001", 1)]  # all holders of EP rank 1
    keep = [Device("node001", 0)]
    with pytest.raises(NoSurvivingSource, match=r"local_experts\.2"):
        build_plan(g, old, WorldConfig(L("TP1,PP1,DP1"), Placement(tuple(keep))), lost=lost)


def test_losing_one_expert_dp_replica_is_planned_around() -> None:
    g = MOE.geometry()
    old = world(L("TP1,PP1,DP4,EP2"), per_node=2)
    lost = [Device("node000", 0), Device("node000", 1)]
    new = WorldConfig(L("TP1,PP1,DP2,EP2"), Placement(tuple(grid_devices(2, 2)[2:])))
    plan = build_plan(g, old, new, lost=lost)
    assert verify_plan(plan, lost=lost).ok


def test_a_moe_plan_at_scale_verifies_ep8_to_ep16_with_a_scale_in() -> None:
    g = PRESETS["moe-200b"].geometry()
    old = default_world(L("TP2,PP4,DP128,EP8"), 8)  # 1,024 devices
    devices = old.placement.devices[:960]
    rp = plan_resize(g, old, L("TP2,PP4,DP120,EP16,ETP1"), devices, compare_rank_order=False)
    report = verify_plan(rp.plan)
    assert report.ok, report.errors
    assert rp.stats.bytes_moved > 0


def test_a_routers_expert_bias_moves_as_state_without_optimizer_state_or_a_ddp_slot() -> None:
    import msgspec

    from liver.reshard.dist_opt import stage_parameters

    spec = msgspec.structs.replace(MOE, name="tiny-moe-bias", moe_router_enable_expert_bias=True)
    g = spec.geometry().with_ddp(DIST)
    biases = [t for t in g.tensors() if t.role == "buffer"]
    assert len(biases) == MOE.num_layers and all(t.dtype == "float32" and t.shape == (4,) for t in biases)
    assert not any(t.param == biases[0].name and t.role != "buffer" for t in g.tensors())
    assert all(t.role != "buffer" for t in stage_parameters(g, L("TP1,PP1,DP2,EP2"), 0))
    plan = build_plan(g, world(L("TP1,PP1,DP2,EP2")), world(L("TP1,PP2,DP2,EP2")))
    assert verify_plan(plan).ok
    assert {ti for t in plan.tasks for ti, _ in t.slices} >= {plan.tensors.index(b) for b in biases}


def test_a_buffer_is_moved_whole() -> None:
    with pytest.raises(GeometryError, match="buffer"):
        ModelGeometry(
            name="x",
            num_layers=1,
            parameters=(
                ParamGeometry(
                    name="decoder.layers.{layer}.b",
                    shape=(4,),
                    dtype="float32",
                    rule="column",
                    home="layer",
                    layers=(0, 1),
                    buffer=True,
                ),
            ),
        )


def test_a_context_parallel_change_at_scale_plans_and_verifies() -> None:
    # llama3-8b from CP4 on 1,024 devices to CP2 on 960 (8 nodes gone): parameters and Adam state are
    # replicated over CP x DP, so every new rank finds a source among four times as many replicas.
    # (The distributed optimizer's CP moves, which shard over DP x CP, are checked at CI size above.)
    g = PRESETS["llama3-8b"].geometry()
    old = default_world(L("TP2,PP2,DP64,CP4"), 8)
    rp = plan_resize(g, old, L("TP2,PP2,DP120,CP2"), old.placement.devices[:960], compare_rank_order=False)
    report = verify_plan(rp.plan)
    assert report.ok, report.errors
    assert rp.plan.new.layout.cp == 2 and rp.stats.bytes_moved > 0
