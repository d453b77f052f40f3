"""The view function, one Megatron-core sharding rule at a time."""

import pytest

from liver.reshard.views import holding_stages, view, world_shards
from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS, ModelSpec

GPT = ModelSpec(
    num_layers=4,
    hidden_size=16,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=100,
    make_vocab_size_divisible_by=8,
    max_sequence_length=32,
)
LLAMA = PRESETS["tiny-llama"]


def tensor(model, name):
    return next(t for t in model.tensors(optimizer=False) if t.name == name)


def test_column_parallel_qkv_splits_rows_by_tp_rank():
    t = tensor(GPT, "decoder.layers.0.self_attention.linear_qkv.weight")
    assert t.shape == (48, 16)
    assert view(t, GPT, ParallelLayout(2, 1, 1), 1).box == ((24, 48), (0, 16))


def test_gqa_qkv_rows_count_query_and_key_value_groups():
    t = tensor(LLAMA, "decoder.layers.0.self_attention.linear_qkv.weight")
    heads, groups, hd = 8, 4, 8
    assert t.shape == ((heads + 2 * groups) * hd, 64)


def test_row_parallel_proj_splits_columns():
    t = tensor(GPT, "decoder.layers.0.self_attention.linear_proj.weight")
    assert view(t, GPT, ParallelLayout(4, 1, 1), 2).box == ((0, 16), (8, 12))


def test_bias_of_row_parallel_layer_is_replicated():
    t = tensor(GPT, "decoder.layers.0.mlp.linear_fc2.bias")
    assert view(t, GPT, ParallelLayout(4, 1, 1), 3).box == ((0, 16),)


def test_bias_of_column_parallel_layer_is_split():
    t = tensor(GPT, "decoder.layers.0.mlp.linear_fc1.bias")
    assert view(t, GPT, ParallelLayout(4, 1, 1), 3).box == ((48, 64),)


def test_swiglu_fc1_holds_matching_gate_and_up_rows():
    t = tensor(LLAMA, "decoder.layers.0.mlp.linear_fc1.weight")
    assert t.shape == (2, 192, 64)
    shard = view(t, LLAMA, ParallelLayout(2, 1, 1), 1)
    assert shard.box == ((0, 2), (96, 192), (0, 64))
    assert shard.local_shape == (2, 96, 64)


def test_norms_are_replicated():
    t = tensor(GPT, "decoder.layers.2.input_layernorm.weight")
    assert view(t, GPT, ParallelLayout(2, 1, 1), 0).box == view(t, GPT, ParallelLayout(2, 1, 1), 1).box


def test_vocab_padding_rows_are_not_state():
    t = tensor(GPT, "embedding.word_embeddings.weight")
    lay = ParallelLayout(2, 1, 1)
    assert GPT.padded_vocab(2) == 112
    assert view(t, GPT, lay, 0).box == ((0, 56), (0, 16))
    last = view(t, GPT, lay, 1)
    assert last.box == ((56, 100), (0, 16))
    assert last.local_shape == (56, 16)


def test_a_rank_can_hold_only_vocab_padding():
    model = ModelSpec(
        num_layers=2,
        hidden_size=8,
        ffn_hidden_size=8,
        num_attention_heads=4,
        vocab_size=10,
        make_vocab_size_divisible_by=8,
    )
    t = tensor(model, "embedding.word_embeddings.weight")
    assert model.padded_vocab(4) == 32
    shard = view(t, model, ParallelLayout(4, 1, 1), 2)
    assert shard.box is None and shard.local_shape == (8, 8)


def test_pipeline_stage_owns_whole_layers():
    lay = ParallelLayout(1, 2, 1)
    t0 = tensor(GPT, "decoder.layers.1.mlp.linear_fc2.weight")
    t1 = tensor(GPT, "decoder.layers.2.mlp.linear_fc2.weight")
    assert view(t0, GPT, lay, 0) is not None and view(t0, GPT, lay, 1) is None
    assert view(t1, GPT, lay, 1) is not None and view(t1, GPT, lay, 0) is None


def test_tied_embedding_has_a_replica_on_the_last_stage():
    t = tensor(GPT, "embedding.word_embeddings.weight")
    assert holding_stages(t, GPT, ParallelLayout(1, 4, 1)) == (0, 3)


def test_untied_output_layer_lives_on_the_last_stage_only():
    t = tensor(LLAMA, "output_layer.weight")
    assert holding_stages(t, LLAMA, ParallelLayout(1, 2, 1)) == (1,)
    e = tensor(LLAMA, "embedding.word_embeddings.weight")
    assert holding_stages(e, LLAMA, ParallelLayout(1, 2, 1)) == (0,)


def test_dp_replicas_hold_the_same_box():
    t = tensor(GPT, "decoder.layers.0.self_attention.linear_qkv.weight")
    lay = ParallelLayout(2, 1, 2)
    assert view(t, GPT, lay, 1).box == view(t, GPT, lay, 3).box


def test_optimizer_state_follows_its_parameter():
    tensors = GPT.tensors(optimizer=True)
    exp_avg = next(
        t for t in tensors if t.name == "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight"
    )
    param = tensor(GPT, "decoder.layers.0.mlp.linear_fc1.weight")
    lay = ParallelLayout(2, 1, 1)
    assert exp_avg.dtype == "float32"
    assert view(exp_avg, GPT, lay, 1).box == view(param, GPT, lay, 1).box


def test_step_counter_is_a_scalar_on_every_rank():
    step = next(t for t in GPT.tensors(optimizer=True) if t.role == "step")
    lay = ParallelLayout(1, 4, 1)
    assert all(view(step, GPT, lay, r).box == () for r in range(4))


def test_bf16_model_has_fp32_master_weights():
    roles = {t.role for t in PRESETS["gpt3-175b"].tensors()}
    assert roles == {"param", "fp32_param", "exp_avg", "exp_avg_sq", "step"}


def test_preset_parameter_counts_match_the_published_sizes():
    assert round(PRESETS["gpt3-175b"].parameter_count() / 1e9) == 175
    assert round(PRESETS["llama3-8b"].parameter_count() / 1e9) == 8


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("tiny-gpt", "2,4,2"),
        ("tiny-llama", "4,1,3"),
        ("tiny-gpt", "1,3,2:1/2/1"),  # an uneven pipeline
        ("tiny-moe", "1,2,4,EP2"),  # experts beside dense tensors on each stage
        ("tiny-moe", "2,1,4,EP4,ETP1"),
    ],
)
def test_the_whole_worlds_shards_are_the_view_of_every_rank(model: str, layout: str) -> None:
    geometry = PRESETS[model].geometry()
    parsed = ParallelLayout.parse(layout)
    tensors = geometry.tensors(optimizer=True)
    shards = world_shards(tensors, geometry, parsed)
    assert len(shards) == parsed.world_size
    for rank, held in enumerate(shards):
        expected = [
            (ti, v) for ti, t in enumerate(tensors) if (v := view(t, geometry, parsed, rank)) is not None
        ]
        assert list(held.items()) == expected
