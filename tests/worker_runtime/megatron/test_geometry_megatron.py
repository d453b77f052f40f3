"""A model's geometry comes from Megatron-core itself, for presets and for models no ModelSpec describes.

One spawned interpreter (the probes need ``torch.distributed`` to themselves) derives geometries from
``sharded_state_dict()`` on the meta device and checks real builds against them at layouts the probes
never saw, every rank emulated on the ``fake`` process group. The parent plans and verifies with the
derived geometries, torch-free, as the services do.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from megatron_user_models import DIVISIBLE_BY, KINDS, NUM_LAYERS, VOCAB_SIZE, UserModel
from mp_helpers import in_fresh_interpreter
from repo_paths import EXAMPLES

from liver.reshard.plan import WorldConfig
from liver.reshard.planner import build_plan
from liver.reshard.verifier import verify_plan
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement
from liver.shared.model import PRESETS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CHILD_S = 600.0

# Layouts the probes (TP1, TP2, PP3) never built; each is checked on every rank.
CHECKED = (
    ParallelLayout(tp=2, pp=2, dp=1),
    ParallelLayout(tp=4, pp=1, dp=1),
    ParallelLayout(tp=1, pp=4, dp=1),
    ParallelLayout(tp=2, pp=2, dp=1, stage_layers=(3, 1)),
    ParallelLayout(tp=1, pp=3, dp=1, stage_layers=(0, 2, 2)),
)


def _emulated_mismatches(
    provider: Any, geometry: ModelGeometry, layout: ParallelLayout
) -> dict[int, list[str]]:
    import torch

    from liver.worker_runtime.megatron.build import groups_from_parallel_state
    from liver.worker_runtime.megatron.geometry import _fake_world, model_geometry_mismatches

    out = {}
    for rank in range(layout.world_size):
        with _fake_world(layout, rank), torch.device("meta"):
            groups = groups_from_parallel_state(layout)
            model = provider(layout, groups.collection())
            metadata = {"dp_cp_group": groups.dp_cp}
            out[rank] = model_geometry_mismatches(model, geometry, layout, rank, metadata=metadata)
    return out


EXAMPLE_MOE = EXAMPLES / "your_own_moe.py"
EXAMPLE_JOB = EXAMPLES / "your_own_job.py"
VPP_LAYOUTS = ("TP2,PP2,VPP2,DP1", "TP1,PP2,DP1:Et|tt|t|L")
"""A user's own DeepSeek-shaped provider (MLA, a dense first layer, MoE with a shared expert, MTP)."""
MTP = PRESETS["tiny-deepseek"]
"""DeepSeek's shape, with a multi-token prediction layer (an MoE layer of its own on the last stage)."""

EXTRA = {  # a ModelSpec beyond the presets: aux-loss-free expert balancing (a persistent router buffer)
    "tiny-moe-bias": msgspec.structs.replace(
        PRESETS["tiny-moe"], name="tiny-moe-bias", moe_router_enable_expert_bias=True
    ),
    # shared experts with their gate, SwiGLU experts, bf16
    "tiny-moe-shared": msgspec.structs.replace(
        PRESETS["tiny-moe"],
        name="tiny-moe-shared",
        swiglu=True,
        params_dtype="bfloat16",
        moe_shared_expert_intermediate_size=64,
        moe_shared_expert_gate=True,
    ),
}


MOE_LAYOUTS = ("TP2,PP2,DP2,EP2,ETP1", "TP1,PP1,DP4,EP2,ETP2", "TP2,PP1,DP2,EP4,ETP1")
MTP_LAYOUTS = ("TP2,PP2,DP1,EP2,ETP1", "TP1,PP3,DP1:0/2/2", "TP1,PP2,DP2,EP2:1/3")

SHALLOW: dict[str, dict[str, Any]] = {
    "moe-200b": {"num_layers": 4},
    "deepseek-v3": {"num_layers": 4, "moe_layer_freq": (0, 0, 0, 1)},
}
"""Presets checked at fewer decoder layers, each kind of layer kept in its order (runs of alike layers,
so the depth changes nothing a probe reads): building 40 layers of 64 experts eight times takes half
a minute on this machine, DeepSeek-V3's 61 layers of 256 experts longer."""


def _as_checked(name: str) -> Any:
    spec = PRESETS[name]
    fields = SHALLOW.get(name)
    return spec if fields is None else msgspec.structs.replace(spec, **fields)


def child_main() -> dict[Any, Any]:
    import torch

    from liver.worker_runtime.megatron.build import SpecProvider
    from liver.worker_runtime.megatron.geometry import GeometryDerivationError, derive_geometry

    torch.set_num_threads(1)
    out: dict[str, Any] = {"presets": {}, "users": {}, "checked": {}, "wrong": None}
    for name, spec in {**{n: _as_checked(n) for n in PRESETS}, **EXTRA}.items():
        out["presets"][name] = derive_geometry(
            SpecProvider(spec),
            name=spec.name,
            num_layers=spec.num_layers,
            vocab_size=spec.vocab_size,
            make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
        )
    for kind in KINDS:
        provider = UserModel(kind)
        geometry = derive_geometry(
            provider,
            name=kind,
            num_layers=NUM_LAYERS,
            vocab_size=VOCAB_SIZE,
            make_vocab_size_divisible_by=DIVISIBLE_BY,
        )
        out["users"][kind] = geometry
        for layout in CHECKED:
            try:
                geometry.check_layout(layout)
            except LayoutError:
                continue
            out["checked"][(kind, layout.describe())] = _emulated_mismatches(provider, geometry, layout)
    gpu_style = UserModel("qk-layernorm", cpu_initialization=False)
    out["gpu_init"] = derive_geometry(
        gpu_style,
        name="qk-layernorm",
        num_layers=NUM_LAYERS,
        vocab_size=VOCAB_SIZE,
        make_vocab_size_divisible_by=DIVISIBLE_BY,
    )
    out["tp1"] = derive_geometry(
        UserModel("tp1-only"),
        name="tp1-only",
        num_layers=NUM_LAYERS,
        vocab_size=VOCAB_SIZE,
        make_vocab_size_divisible_by=DIVISIBLE_BY,
    )
    out["refusals"] = {}
    for case, kwargs in {
        "num_layers": {"provider": UserModel("qkv-bias"), "num_layers": NUM_LAYERS + 1},
        "vocab_size": {"provider": UserModel("qkv-bias"), "num_layers": NUM_LAYERS, "vocab_size": None},
        "provider": {"provider": UserModel("broken"), "num_layers": NUM_LAYERS},
    }.items():
        settings = {"name": case, "vocab_size": VOCAB_SIZE, "make_vocab_size_divisible_by": DIVISIBLE_BY}
        try:
            derive_geometry(**(settings | kwargs))
            out["refusals"][case] = None
        except GeometryDerivationError as exc:
            out["refusals"][case] = str(exc)
    # Experts: Megatron's own shards of every rank of expert-parallel layouts against the views.
    moe = EXTRA["tiny-moe-bias"]
    out["moe_checked"] = {
        text: _emulated_mismatches(SpecProvider(moe), moe.geometry(), ParallelLayout.parse(text))
        for text in MOE_LAYOUTS
    }
    from liver.worker_runtime.megatron.source import load_provider

    out["example_moe"] = derive_geometry(
        load_provider(f"{EXAMPLE_MOE}:model_provider"),
        name="tiny-deepseek",
        num_layers=4,
        vocab_size=1000,
        make_vocab_size_divisible_by=16,
    )
    out["mtp_checked"] = {
        text: _emulated_mismatches(SpecProvider(MTP), MTP.geometry(), ParallelLayout.parse(text))
        for text in MTP_LAYOUTS
    }
    # A plan made for another model: the tied GPT's geometry against the QK-norm model.
    layout = ParallelLayout(tp=2, pp=1, dp=1)
    out["wrong"] = _emulated_mismatches(UserModel("qk-layernorm"), out["users"]["qkv-bias"], layout)
    # What a handoff's preparation runs before the cut: the library's check of one new layout.
    from liver.worker_runtime.megatron.geometry import GeometryMismatch, check_layout_geometry

    check_layout_geometry(UserModel("qk-layernorm"), out["users"]["qk-layernorm"], ParallelLayout(2, 2, 2))
    differs = derive_geometry(
        UserModel("dp-differs"),
        name="dp-differs",
        num_layers=NUM_LAYERS,
        vocab_size=VOCAB_SIZE,
        make_vocab_size_divisible_by=DIVISIBLE_BY,
    )
    try:
        check_layout_geometry(UserModel("dp-differs"), differs, ParallelLayout(tp=1, pp=2, dp=2))
        out["layout_check"] = None
    except GeometryMismatch as exc:
        out["layout_check"] = str(exc)
    # Virtual pipeline chunks: the example's provider takes vp_stage; a provider without it is refused.
    from liver.shared.errors import InputError

    example = load_provider(f"{EXAMPLE_JOB}:model_provider")
    example_geometry = derive_geometry(
        example, name="your-job", num_layers=4, vocab_size=258, make_vocab_size_divisible_by=16
    )
    out["vpp_checked"] = []
    deepseek = PRESETS["tiny-deepseek"]
    for text in VPP_LAYOUTS:
        check_layout_geometry(example, example_geometry, ParallelLayout.parse(text))  # raises on a mismatch
        # A preset's provider builds one chunk per call too.
        check_layout_geometry(SpecProvider(deepseek), deepseek.geometry(), ParallelLayout.parse(text))
        out["vpp_checked"].append(text)
    try:
        qk = out["users"]["qk-layernorm"]
        check_layout_geometry(UserModel("qk-layernorm"), qk, ParallelLayout.parse("TP1,PP2,VPP2,DP1"))
        out["vpp_refusal"] = None
    except InputError as exc:
        out["vpp_refusal"] = str(exc)
    return out


@pytest.fixture(scope="module")
def found() -> dict[str, Any]:
    return in_fresh_interpreter(child_main, CHILD_S)


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_presets_geometry_is_exactly_what_megatron_says_of_the_model_it_describes(
    found: dict[str, Any], name: str
) -> None:
    assert found["presets"][name] == _as_checked(name).geometry()


def test_a_users_deepseek_shaped_provider_gets_the_geometry_of_the_preset_of_that_shape(
    found: dict[str, Any],
) -> None:
    assert found["example_moe"] == PRESETS["tiny-deepseek"].geometry()


@pytest.mark.parametrize("layout", MTP_LAYOUTS)
def test_every_ranks_multi_token_prediction_layer_is_where_the_view_function_puts_it(
    found: dict[str, Any], layout: str
) -> None:
    mismatches = found["mtp_checked"][layout]
    assert len(mismatches) == ParallelLayout.parse(layout).world_size
    assert all(problems == [] for problems in mismatches.values()), mismatches


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_every_ranks_experts_are_where_the_view_function_puts_them(
    found: dict[str, Any], layout: str
) -> None:
    mismatches = found["moe_checked"][layout]
    assert len(mismatches) == ParallelLayout.parse(layout).world_size
    assert all(problems == [] for problems in mismatches.values()), mismatches


def test_shared_experts_and_their_gate_are_derived_as_dense_tensors_after_the_experts(
    found: dict[str, Any],
) -> None:
    spec = EXTRA["tiny-moe-shared"]
    assert found["presets"]["tiny-moe-shared"] == spec.geometry()
    names = [t.name for t in spec.geometry().tensors(optimizer=False) if t.layer == 1]
    assert names[-3:] == [
        "decoder.layers.0.mlp.shared_experts.gate_weight",
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
        "decoder.layers.0.mlp.shared_experts.linear_fc2.weight",
    ]


def test_a_routers_expert_bias_is_derived_as_a_buffer_of_the_training_state(found: dict[str, Any]) -> None:
    spec = EXTRA["tiny-moe-bias"]
    geometry = found["presets"]["tiny-moe-bias"]
    assert geometry == spec.geometry()
    (bias,) = [p for p in geometry.parameters if p.buffer]
    assert bias.name == "decoder.layers.{layer}.mlp.router.expert_bias" and bias.dtype == "float32"


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_no_modelspec_describes_gets_its_geometry_from_megatron(
    found: dict[str, Any], kind: str
) -> None:
    geometry: ModelGeometry = found["users"][kind]
    names = {p.name for p in geometry.parameters}
    if kind == "heterogeneous":  # per-layer keys: runs of layers that differ, layer 1 without attention
        qkv = {
            layer: t.shape
            for t in geometry.tensors(optimizer=False)
            if t.name.endswith("self_attention.linear_qkv.weight")
            for layer in [t.layer]
        }
        assert qkv == {1: (128, 64), 3: (192, 64), 4: (128, 64)}
        assert ("num_query_groups", 2) in [(d.what, d.value) for d in geometry.tp_divisible]
        with pytest.raises(LayoutError, match="num_query_groups"):
            geometry.check_layout(ParallelLayout(tp=4, pp=1, dp=1))
        return
    extra = {
        "qk-layernorm": "decoder.layers.{layer}.self_attention.q_layernorm.weight",
        "qkv-bias": "decoder.layers.{layer}.self_attention.linear_qkv.bias",
        "value-head": "value_head.weight",
    }[kind]
    assert extra in names
    if kind == "qkv-bias":
        assert "decoder.layers.{layer}.self_attention.linear_proj.bias" not in names, "no other linear bias"
    if kind == "value-head":
        head = next(p for p in geometry.parameters if p.name == "value_head.weight")
        assert (head.rule, head.home, head.shape) == ("column", "last", (8, 64))


def test_a_model_that_initialises_its_weights_as_on_a_gpu_gets_the_same_geometry(
    found: dict[str, Any],
) -> None:
    # use_cpu_initialization=False forks Megatron's model-parallel RNG tracker while the probe builds;
    # the first GPU run found the probe had not seeded it.
    assert found["gpu_init"] == found["users"]["qk-layernorm"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_derived_geometry_holds_at_layouts_the_probes_never_built(
    found: dict[str, Any], kind: str
) -> None:
    checked = {layout: ranks for (k, layout), ranks in found["checked"].items() if k == kind}
    assert len(checked) >= 3
    problems = [
        f"{layout} rank {r}: {m}" for layout, ranks in checked.items() for r, ms in ranks.items() for m in ms
    ]
    assert not problems, "\n".join(problems)


def test_a_model_built_differently_from_the_plans_geometry_is_caught_by_name(found: dict[str, Any]) -> None:
    problems = " ".join(m for ms in found["wrong"].values() for m in ms)
    assert "q_layernorm" in problems or "linear_qkv.bias" in problems


@pytest.mark.parametrize("kind", KINDS)
def test_a_user_model_is_planned_and_verified_across_tp_pp_and_dp(found: dict[str, Any], kind: str) -> None:
    geometry: ModelGeometry = found["users"][kind]
    devices = tuple(Device("n0", i) for i in range(8))
    moves = [
        (ParallelLayout(tp=2, pp=2, dp=1), ParallelLayout(tp=1, pp=1, dp=4)),
        (ParallelLayout(tp=1, pp=4, dp=1), ParallelLayout(tp=2, pp=1, dp=2)),
        (ParallelLayout(tp=2, pp=1, dp=2), ParallelLayout(tp=2, pp=2, dp=1, stage_layers=(3, 1))),
    ]
    for old, new in moves:
        plan = build_plan(
            geometry,
            WorldConfig(old, Placement(devices[:4])),
            WorldConfig(new, Placement(devices[4:])),
        )
        assert verify_plan(plan).ok, (kind, old, new)
        assert plan.model == geometry


def test_a_model_that_cannot_be_built_at_tp2_gets_a_geometry_that_refuses_tp2(found: dict[str, Any]) -> None:
    tp1: ModelGeometry = found["tp1"]
    tp1.check_layout(ParallelLayout(tp=1, pp=2, dp=2))
    with pytest.raises(LayoutError, match="tp=2"):
        tp1.check_layout(ParallelLayout(tp=2, pp=1, dp=1))
    rules = {p.name: p.rule for p in tp1.parameters}
    assert rules["embedding.word_embeddings.weight"] == "vocab"
    assert rules["decoder.layers.{layer}.self_attention.linear_qkv.weight"] == "replicated"


@pytest.mark.parametrize(
    ("case", "named"),
    [("num_layers", "num_layers"), ("vocab_size", "--vocab-size"), ("provider", "the provider's own bug")],
)
def test_a_derivation_that_cannot_be_right_is_refused_naming_why(
    found: dict[str, Any], case: str, named: str
) -> None:
    reason = found["refusals"][case]
    assert reason is not None and named in reason


def test_a_new_layouts_model_that_differs_from_the_geometry_fails_the_check_naming_rank_and_tensor(
    found: dict[str, Any],
) -> None:
    # The probes (all DP 1) derived a geometry with the QKV bias; at DP 2 the provider drops it.
    problem = found["layout_check"]
    assert problem is not None
    assert "rank 0 at TP1,PP2,DP2" in problem and "linear_qkv.bias" in problem


def test_a_providers_model_chunks_match_the_geometry_at_vpp_layouts(found: dict[str, Any]) -> None:
    assert found["vpp_checked"] == list(VPP_LAYOUTS)


def test_a_provider_without_vp_stage_is_refused_at_a_vpp_layout_naming_what_it_needs(
    found: dict[str, Any],
) -> None:
    assert found["vpp_refusal"] is not None
    assert "must take vp_stage" in found["vpp_refusal"]
