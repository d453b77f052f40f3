"""The shard geometry as data: what the planners consume, for a preset and for a user's own model alike."""

from __future__ import annotations

import json

import msgspec
import pytest
from repo_paths import TEST_DATA

from liver.reshard.plan import PLAN_SCHEMA_VERSION, WorldConfig
from liver.reshard.plan_file import PlanFileError, decode_plan, encode_plan
from liver.reshard.planner import build_plan, plan_stats
from liver.reshard.verifier import verify_plan
from liver.reshard.views import view
from liver.shared.geometry import (
    GEOMETRY_SCHEMA_VERSION,
    MAX_EXPERTS,
    DdpSettings,
    GeometryError,
    ModelGeometry,
    ParamGeometry,
    TpDivisor,
)
from liver.shared.layout import MAX_LAYERS, Device, LayoutError, ParallelLayout, Placement
from liver.shared.model import PRESETS, ModelError, ModelSpec

TINY = PRESETS["tiny-gpt"]


def world(layout: ParallelLayout, first: int = 0) -> WorldConfig:
    return WorldConfig(
        layout, Placement(tuple(Device("n0", i) for i in range(first, first + layout.world_size)))
    )


def param(
    name: str, shape: tuple[int, ...], rule: str = "replicated", home: str = "first", **kw: object
) -> ParamGeometry:
    return ParamGeometry(name=name, shape=shape, dtype="float32", rule=rule, home=home, **kw)  # type: ignore[arg-type]


# A model no ModelSpec describes: its first layer has a QK norm the second lacks, and it has an extra
# head on the last stage.
ODD = ModelGeometry(
    name="odd",
    num_layers=3,
    vocab_size=100,
    make_vocab_size_divisible_by=8,
    tp_divisible=(TpDivisor("num_attention_heads", 4),),
    parameters=(
        param("embedding.word_embeddings.weight", (100, 16), "vocab", "first+last"),
        param(
            "decoder.layers.{layer}.self_attention.linear_qkv.weight",
            (48, 16),
            "column",
            "layer",
            layers=(0, 3),
        ),
        param(
            "decoder.layers.{layer}.self_attention.q_layernorm.weight",
            (4,),
            "replicated",
            "layer",
            layers=(0, 1),
        ),
        param("decoder.layers.{layer}.mlp.linear_fc2.weight", (16, 32), "row", "layer", layers=(0, 3)),
        param("value_head.weight", (8, 16), "column", "last"),
    ),
)


def test_every_preset_lists_the_same_tensors_as_its_geometry() -> None:
    for spec in PRESETS.values():
        assert spec.tensors() == spec.geometry().tensors()
        assert spec.tensors(optimizer=False) == spec.geometry().tensors(optimizer=False)
        assert spec.parameter_count() == spec.geometry().parameter_count()


def test_a_geometry_round_trips_through_json_unchanged() -> None:
    for g in (TINY.geometry(), PRESETS["llama3-8b"].geometry(), ODD):
        assert msgspec.json.decode(msgspec.json.encode(g), type=ModelGeometry) == g


def test_a_96_layer_model_is_described_in_a_few_entries() -> None:
    g = PRESETS["gpt3-175b"].geometry()
    assert len(g.parameters) < 20
    assert len(msgspec.json.encode(g)) < 4096


def test_runs_of_layers_expand_in_order_within_each_layer() -> None:
    names = [t.name for t in ODD.tensors(optimizer=False)]
    assert names == [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.1.mlp.linear_fc2.weight",
        "decoder.layers.2.self_attention.linear_qkv.weight",
        "decoder.layers.2.mlp.linear_fc2.weight",
        "value_head.weight",
    ]
    assert [t.layer for t in ODD.tensors(optimizer=False)] == [0, 1, 1, 1, 2, 2, 3, 3, 4]


def test_sixteen_bit_parameters_carry_an_fp32_master_and_fp32_ones_do_not() -> None:
    half = msgspec.structs.replace(ODD.parameters[4], dtype="bfloat16")
    g = msgspec.structs.replace(ODD, parameters=(*ODD.parameters[:4], half))
    roles = {t.role for t in g.tensors() if t.param == "value_head.weight"}
    assert roles == {"param", "fp32_param", "exp_avg", "exp_avg_sq"}
    assert {t.role for t in g.tensors() if t.param == "embedding.word_embeddings.weight"} == {
        "param",
        "exp_avg",
        "exp_avg_sq",
    }


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"schema_version": GEOMETRY_SCHEMA_VERSION + 1}, "schema_version"),
        ({"parameters": (param("decoder.layers.{layer}.w", (4,), home="layer", layers=(0, 4)),)}, "layers"),
        ({"parameters": (param("decoder.layers.{layer}.w", (4,), home="layer"),)}, "name"),
        ({"parameters": (param("w", (4,), home="layer", layers=(0, 1)),)}, "name"),
        ({"parameters": (param("w", (4,)), param("w", (4,)))}, "name"),
        ({"parameters": (param("w", (4,), "row"),)}, "shape"),
        ({"parameters": (param("w", (3, 4), "swiglu"),)}, "shape"),
        ({"parameters": (param("w", (99, 4), "vocab"),)}, "shape"),
        ({"vocab_size": None}, "rule"),
        ({"num_layers": 4}, "num_layers"),
    ],
)
def test_a_geometry_no_model_could_have_is_refused_naming_the_field(change: dict, field: str) -> None:
    data = msgspec.to_builtins(ODD) | msgspec.to_builtins(change)
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert(data, ModelGeometry)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_layers": 2**64}, "num_layers"),
        ({"num_layers": MAX_LAYERS + 1}, "num_layers"),
        ({"num_experts": 2**40}, "num_experts"),
        ({"vocab_size": 10**23}, "vocab_size"),
    ],
)
def test_an_absurd_count_is_refused_at_its_field_before_anything_is_built_per_layer(
    change: dict, field: str
) -> None:
    """A geometry on the bus with 2^64 layers once had a service build a set of every layer index: one
    message took 24 GiB and minutes (found by the fuzz run)."""
    data = msgspec.to_builtins(ODD) | change
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert(data, ModelGeometry)


def test_runs_of_layers_and_experts_that_expand_past_the_bound_are_refused() -> None:
    layers = (0, MAX_LAYERS)
    expert = param("decoder.layers.{layer}.experts.{expert}.w", (4,), home="layer", layers=layers)
    expert = msgspec.structs.replace(expert, expert=True)
    with pytest.raises(GeometryError, match="parameters: stand for"):
        ModelGeometry(name="x", num_layers=MAX_LAYERS, parameters=(expert,), num_experts=MAX_EXPERTS)


def test_the_error_is_an_input_error_when_built_in_code() -> None:
    with pytest.raises(GeometryError, match=r"parameters\[1\]\.name"):
        ModelGeometry(name="x", num_layers=1, parameters=(param("w", (1,)), param("w", (1,))))


def test_a_layout_the_model_cannot_use_is_refused_naming_the_reason() -> None:
    with pytest.raises(LayoutError, match="num_attention_heads"):
        ODD.check_layout(ParallelLayout(tp=3, pp=1, dp=1))
    with pytest.raises(LayoutError, match=r"dimension 0 of decoder\.layers"):
        msgspec.structs.replace(ODD, tp_divisible=()).check_layout(ParallelLayout(tp=64, pp=1, dp=1))
    with pytest.raises(LayoutError, match="exceeds the 3 layers"):
        ODD.check_layout(ParallelLayout(tp=1, pp=4, dp=1))
    ODD.check_layout(ParallelLayout(tp=2, pp=3, dp=1))


def test_the_views_follow_each_parameters_home_and_rule() -> None:
    layout = ParallelLayout(tp=2, pp=3, dp=1)
    tensors = {t.name: t for t in ODD.tensors(optimizer=False)}
    head = tensors["value_head.weight"]
    assert view(head, ODD, layout, layout.rank_of(1, 0, 2)).box == ((4, 8), (0, 16))
    assert view(head, ODD, layout, layout.rank_of(1, 0, 0)) is None
    norm = tensors["decoder.layers.0.self_attention.q_layernorm.weight"]
    assert view(norm, ODD, layout, layout.rank_of(1, 0, 0)).box == ((0, 4),)
    words = tensors["embedding.word_embeddings.weight"]
    assert view(words, ODD, layout, layout.rank_of(1, 0, 2)).box == ((56, 100), (0, 16))


def test_a_model_no_modelspec_describes_is_planned_and_verified() -> None:
    plan = build_plan(
        ODD, world(ParallelLayout(tp=2, pp=3, dp=1)), world(ParallelLayout(tp=1, pp=1, dp=2), 6)
    )
    assert plan.model == ODD
    assert verify_plan(plan).ok
    assert decode_plan(encode_plan(plan)) == plan


def test_a_version_2_plan_file_written_before_experts_is_still_read_and_planned_alike_again() -> None:
    # Written by `liver plan --model tiny-llama --from 2,2,2 --to 1,2,4 --per-node 4
    # --distributed-optimizer --budget-mib 0.05 --out` at 689f531 (schema 2, before experts and CP).
    data = (TEST_DATA / "plan-v2-tiny-llama-dist-opt.json").read_bytes()
    assert msgspec.json.decode(data)["schema_version"] == 2
    plan = decode_plan(data)
    assert plan.schema_version == PLAN_SCHEMA_VERSION and plan.model.distributed
    assert verify_plan(plan).ok
    again = build_plan(plan.model, plan.old, plan.new, plan.budget_bytes)
    # The planner has changed since (sources chosen per class of layers, fewer messages): what it moves,
    # and from where to where, has not.
    before, now = plan_stats(plan), plan_stats(again)
    assert (now.bytes_local, now.bytes_moved, now.bytes_inter_node) == (
        before.bytes_local,
        before.bytes_moved,
        before.bytes_inter_node,
    )
    assert verify_plan(again).ok


def test_a_version_1_plan_file_written_before_the_geometry_is_still_read_and_moves_the_same_bytes() -> None:
    # Written by `liver plan --model tiny-gpt --from 2,1,1 --to 1,2,1 --per-node 2 --budget-mib 0.05 --out`
    # at c928365: a ModelSpec as the model, tensors in the order of that time (linear_qkv first).
    data = (TEST_DATA / "plan-v1-tiny-gpt.json").read_bytes()
    old = msgspec.json.decode(data)
    plan = decode_plan(data)
    assert plan.schema_version == PLAN_SCHEMA_VERSION and plan.model == TINY.geometry()
    assert verify_plan(plan).ok
    assert [t.name for t in plan.tensors] != [t["name"] for t in old["tensors"]], "the order did change"
    moved_before = {
        (t[0], t[1], t[2], t[3], old["tensors"][ti]["name"], json.dumps(box))
        for t in old["tasks"]
        for ti, box in t[5]
    }
    moved_now = {
        (t.layer, t.round, t.src, t.dst, plan.tensors[ti].name, json.dumps([list(b) for b in box]))
        for t in plan.tasks
        for ti, box in t.slices
    }
    assert moved_now == moved_before
    assert decode_plan(encode_plan(plan)) == plan


def test_a_plan_file_of_an_unknown_version_is_refused() -> None:
    plan = build_plan(
        TINY, world(ParallelLayout(tp=1, pp=1, dp=1)), world(ParallelLayout(tp=1, pp=1, dp=2), 1)
    )
    data = msgspec.json.decode(encode_plan(plan))
    data["schema_version"] = 9
    with pytest.raises(PlanFileError, match="schema_version 9"):
        decode_plan(msgspec.json.encode(data))


def test_the_digest_tells_two_geometries_apart_and_two_copies_alike() -> None:
    g = TINY.geometry()
    assert g.digest() == msgspec.json.decode(msgspec.json.encode(g), type=ModelGeometry).digest()
    assert g.digest() != PRESETS["tiny-llama"].geometry().digest()
    assert g.digest() != msgspec.structs.replace(g, make_vocab_size_divisible_by=32).digest()


def test_ddp_settings_compare_in_the_form_that_decides_the_state() -> None:
    from liver.shared.geometry import DdpSettings

    # The plain optimizer's state does not depend on buckets; without overlap there are no buckets.
    assert DdpSettings(overlap_grad_reduce=True, bucket_size=5).canonical() == DdpSettings()
    dist = DdpSettings(distributed_optimizer=True, bucket_size=5)
    assert dist.canonical() == DdpSettings(distributed_optimizer=True)
    geometry = PRESETS["tiny-gpt"].geometry()
    assert geometry.with_ddp(DdpSettings(overlap_grad_reduce=True, bucket_size=5)) == geometry
    sharded = geometry.with_ddp(dist)
    assert sharded.distributed and sharded.ddp.bucket_size is None
    decoded = msgspec.json.decode(msgspec.json.encode(sharded), type=type(geometry))
    assert decoded == sharded


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_older_geometry_is_read_as_version_4_with_the_plain_optimizer_no_experts_and_no_mtp(
    version: int,
) -> None:
    geometry = PRESETS["tiny-gpt"].geometry()
    fields = msgspec.to_builtins(geometry)
    fields["schema_version"] = version
    del fields["mtp_num_layers"]
    if version < 3:
        del fields["num_experts"]
    if version == 1:
        del fields["ddp"]
    old = msgspec.convert(fields, type=type(geometry))
    assert old == geometry and old.schema_version == 4 and not old.distributed and old.num_experts == 0
    assert old.mtp_num_layers == 0


def test_names_that_expand_past_the_character_bound_are_refused() -> None:
    long_name = "decoder.layers.{layer}.experts.{expert}." + "w" * 440
    expert = param(long_name, (4,), home="layer", layers=(0, MAX_LAYERS))
    expert = msgspec.structs.replace(expert, expert=True)
    with pytest.raises(GeometryError, match="their names come to"):
        ModelGeometry(name="x", num_layers=MAX_LAYERS, parameters=(expert,), num_experts=16)


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_query_groups", -1), ("num_query_groups", 0), ("kv_channels", 2**200), ("num_layers", 2**64)],
)
def test_a_model_description_with_an_impossible_size_is_refused_naming_it(field: str, value: int) -> None:
    spec = msgspec.structs.asdict(PRESETS["tiny-gpt"]) | {field: value}
    with pytest.raises(ModelError, match=field):
        ModelSpec(**spec)


# -- layers that differ: a dense first layer, then MoE layers -------------------------------------------

DENSE_FIRST = PRESETS["tiny-deepseek"]


def test_a_dense_first_moe_model_lists_one_run_per_kind_of_layer() -> None:
    runs = {p.layers for p in DENSE_FIRST.geometry().parameters if p.layers is not None}
    assert runs == {(0, 1), (1, 4)}
    dense = {p.name for p in DENSE_FIRST.geometry().parameters if p.layers == (0, 1)}
    assert "decoder.layers.{layer}.mlp.linear_fc1.weight" in dense
    assert not any("router" in n or "experts" in n for n in dense)


def test_each_layer_lists_its_own_parameters_in_megatrons_module_order() -> None:
    names = [t.name for t in DENSE_FIRST.tensors(optimizer=False) if t.layer in (1, 2)]
    layer0 = [n for n in names if n.startswith("decoder.layers.0.")]
    layer1 = [n for n in names if n.startswith("decoder.layers.1.")]
    assert layer0[-3:] == [
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
    ]
    assert layer1[layer1.index("decoder.layers.1.pre_mlp_layernorm.weight") + 1 :][:4] == [
        "decoder.layers.1.mlp.router.weight",
        "decoder.layers.1.mlp.router.expert_bias",
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight",
    ]


def test_a_kind_of_layer_that_comes_back_after_another_is_a_run_of_its_own() -> None:
    spec = msgspec.structs.replace(DENSE_FIRST, num_layers=5, moe_layer_freq=2)  # MoE at 0, 2, 4
    assert spec.moe_layers == (True, False, True, False, True)
    runs = sorted({p.layers for p in spec.geometry().parameters if p.layers is not None})
    assert runs == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]


def test_a_dense_first_moe_model_is_planned_and_verified_across_an_uneven_pipeline_and_ep() -> None:
    old = world(ParallelLayout.parse("TP2,PP1,DP2,EP2,ETP1"))
    new = world(ParallelLayout.parse("TP1,PP2,DP2,EP2:1/3"), first=2)
    for ddp in (DdpSettings(), DdpSettings(distributed_optimizer=True)):
        plan = build_plan(DENSE_FIRST.geometry().with_ddp(ddp), old, new, 64 * 1024)
        assert verify_plan(plan).ok
        assert plan_stats(plan).bytes_moved > 0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"moe_layer_freq": (0, 1, 1)}, "moe_layer_freq: 3 entries for 4 layers"),
        ({"moe_layer_freq": (0, 2, 1, 1)}, "moe_layer_freq[1]"),
        ({"moe_layer_freq": (0, 0, 0, 0)}, "no decoder layer is an MoE layer"),
        ({"moe_layer_freq": 0}, "moe_layer_freq must be between 1"),
        ({"num_experts": 0, "moe_shared_expert_intermediate_size": None}, "a dense model"),
    ],
)
def test_a_moe_layer_pattern_megatron_could_not_build_is_refused_naming_it(change: dict, field: str) -> None:
    fields = msgspec.structs.asdict(DENSE_FIRST) | change
    if change.get("num_experts") == 0:
        fields |= {"moe_router_enable_expert_bias": False, "moe_token_dispatcher": "allgather"}
    with pytest.raises(ModelError, match=field.replace("[", r"\[").replace("]", r"\]")):
        ModelSpec(**fields)


def test_a_moe_layer_pattern_reads_from_json_as_megatron_writes_it() -> None:
    text = msgspec.json.encode(DENSE_FIRST)
    assert b'"moe_layer_freq":[0,1,1,1]' in text
    assert msgspec.json.decode(text, type=ModelSpec) == DENSE_FIRST


# -- multi-latent attention ------------------------------------------------------------------------------


def test_latent_attention_lists_megatrons_projections_and_latent_norms_in_module_order() -> None:
    names = [
        p.name.removeprefix("decoder.layers.{layer}.self_attention.")
        for p in DENSE_FIRST.geometry().parameters
        if p.layers == (0, 1) and ".self_attention." in p.name
    ]
    assert names == [
        "linear_proj.weight",
        "linear_q_down_proj.weight",
        "linear_q_up_proj.weight",
        "linear_kv_down_proj.weight",
        "linear_kv_up_proj.weight",
        "q_layernorm.weight",
        "kv_layernorm.weight",
    ]


def test_latent_attention_without_a_query_latent_has_one_query_projection_and_no_query_norm() -> None:
    spec = msgspec.structs.replace(DENSE_FIRST, q_lora_rank=None)
    names = {p.name for p in spec.geometry().parameters}
    assert "decoder.layers.{layer}.self_attention.linear_q_proj.weight" in names
    assert not any("q_down_proj" in n or "q_layernorm" in n for n in names)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"bias": True, "moe_shared_expert_intermediate_size": None}, "MLA projections have no bias"),
        ({"position_embedding": "learned_absolute"}, "use rope"),
        ({"num_query_groups": 2}, "num_query_groups: does not apply"),
        ({"kv_lora_rank": 0}, "kv_lora_rank must be between 1"),
        ({"multi_latent_attention": False}, "q_lora_rank: only multi-latent attention"),
    ],
)
def test_a_latent_attention_megatron_could_not_build_is_refused_naming_it(change: dict, field: str) -> None:
    with pytest.raises(ModelError, match=field):
        ModelSpec(**(msgspec.structs.asdict(DENSE_FIRST) | change))


def test_latent_attention_is_split_over_heads_and_refuses_a_tp_its_latent_cannot_take() -> None:
    DENSE_FIRST.check_layout(ParallelLayout.parse("TP4,PP1,DP1"))
    with pytest.raises(LayoutError, match="linear_q_down_proj"):
        msgspec.structs.replace(DENSE_FIRST, q_lora_rank=30).check_layout(ParallelLayout.parse("TP4,PP1,DP1"))


# -- multi-token prediction ------------------------------------------------------------------------------

WITH_MTP = DENSE_FIRST  # tiny-deepseek has DeepSeek's multi-token prediction layer


def test_a_multi_token_prediction_layer_lives_on_the_last_stage_with_a_replica_of_the_embedding() -> None:
    geometry = WITH_MTP.geometry()
    homes = {p.name: p.home for p in geometry.parameters}
    assert homes["embedding.word_embeddings.weight"] == "first+last"
    mtp = [p for p in geometry.parameters if p.name.startswith("mtp.layers.0.")]
    assert mtp and {p.home for p in mtp} == {"last"} and all(p.layers is None for p in mtp)
    experts = [p.name for p in mtp if p.expert]
    assert experts == [
        "mtp.layers.0.transformer_layer.mlp.experts.local_experts.{expert}.linear_fc1.weight",
        "mtp.layers.0.transformer_layer.mlp.experts.local_experts.{expert}.linear_fc2.weight",
    ]
    last = {t.name for t in geometry.tensors(optimizer=False) if t.layer == WITH_MTP.num_layers + 1}
    assert "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight" in last


def test_a_multi_token_prediction_model_is_planned_and_verified_across_pp_and_ep_changes() -> None:
    old = world(ParallelLayout.parse("TP2,PP2,DP1,EP2,ETP1"))
    new = world(ParallelLayout.parse("TP1,PP3,DP1:0/2/2"), first=4)
    for ddp in (DdpSettings(), DdpSettings(distributed_optimizer=True)):
        plan = build_plan(WITH_MTP.geometry().with_ddp(ddp), old, new, 64 * 1024)
        assert verify_plan(plan).ok
        assert decode_plan(encode_plan(plan)) == plan


def test_an_expert_entry_outside_the_decoder_layers_must_live_on_the_last_stage() -> None:
    expert = param("mtp.layers.0.experts.{expert}.weight", (4, 4), "column", "first", expert=True)
    with pytest.raises(GeometryError, match=r"parameters\[1\]\.home: an expert parameter outside"):
        ModelGeometry(
            name="x",
            num_layers=3,
            parameters=(*ODD.parameters[:1], expert, *ODD.parameters[1:]),
            vocab_size=100,
            make_vocab_size_divisible_by=8,
            num_experts=2,
        )


def test_with_mtp_the_final_norm_stays_with_the_last_decoder_layer_even_off_the_last_stage() -> None:
    from liver.reshard.views import holding_stages

    geometry = WITH_MTP.geometry()
    norm = next(t for t in geometry.tensors() if t.name == "decoder.final_layernorm.weight")
    head = next(t for t in geometry.tensors() if t.name == "output_layer.weight")
    apart = ParallelLayout.parse("TP1,PP2,DP1:4/0")  # the last stage: the MTP layer and the head only
    assert norm.home == "last_layer"
    assert holding_stages(norm, geometry, apart) == (0,) and holding_stages(head, geometry, apart) == (1,)
    assert holding_stages(norm, geometry, ParallelLayout.parse("TP1,PP2,DP1:1/3")) == (1,)
    plan = build_plan(geometry, world(ParallelLayout.parse("TP1,PP2,DP2,EP2")), world(apart, first=4))
    assert verify_plan(plan).ok


# -- virtual pipeline parallelism ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("TP1,PP4,VPP2,DP2", "TP1,PP2,VPP2,DP2"),  # fewer stages, still interleaved
        ("TP1,PP2,VPP2,DP2", "TP2,PP2,DP1"),  # to no VPP (chunks become contiguous stages)
        ("TP2,PP2,DP2", "TP1,PP2,VPP4,DP2"),  # from no VPP
    ],
)
def test_changes_of_vpp_are_planned_and_verified(old: str, new: str) -> None:
    model = msgspec.structs.replace(TINY, num_layers=8)
    plan = build_plan(model, world(ParallelLayout.parse(old)), world(ParallelLayout.parse(new), first=8))
    assert verify_plan(plan).ok
    assert plan_stats(plan).bytes_moved > 0


def test_the_distributed_optimizers_shards_with_vpp_are_planned_and_verified() -> None:
    geometry = TINY.geometry().with_ddp(DdpSettings(distributed_optimizer=True))
    old, new = world(ParallelLayout.parse("TP1,PP2,DP2")), world(ParallelLayout.parse("TP1,PP2,VPP2,DP2"), 4)
    plan = build_plan(geometry, old, new)
    assert verify_plan(plan).ok
    assert plan_stats(plan).bytes_moved > 0
