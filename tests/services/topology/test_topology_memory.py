"""The topology planner's memory model: hand-computed numbers for a tiny model, and its documented
behaviour (1F1B in-flight micro-batches, margins, recomputation)."""

from __future__ import annotations

import math

import msgspec
import pytest

from liver.reshard.views import holding_stages
from liver.services.topology.memory import (
    CPU_SMALL,
    H100_80GB,
    GiB,
    HardwareProfile,
    SetupError,
    TrainingSetup,
    activation_bytes_per_token,
    in_flight_micro_batches,
    memory_estimate,
    stage_state_bytes,
)
from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS, ModelSpec

# 2 layers, h=8, 2 heads of 4, ffn 16, vocabulary 10 padded to 16 at TP2, no biases, untied output.
TINY = ModelSpec(
    num_layers=2,
    hidden_size=8,
    ffn_hidden_size=16,
    num_attention_heads=2,
    vocab_size=10,
    make_vocab_size_divisible_by=4,
    tied_embeddings=False,
    bias=False,
    normalization="RMSNorm",
    position_embedding="rope",
    max_sequence_length=4,
    params_dtype="bfloat16",
)
SETUP = TrainingSetup(global_batch_size=4, micro_batch_size=1, sequence_length=4)


def test_state_and_gradients_match_hand_computation_for_tp2_pp2() -> None:
    # Per layer at TP2 (elements): two norms 8 + 8 (replicated), QKV (2 + 2*2) * 4 rows / 2 * 8 = 96,
    # proj 8 * 8 / 2 = 32, fc1 16 / 2 * 8 = 64, fc2 8 * 16 / 2 = 64  -> 272.
    # Embedding / output layer shards: padded vocab 16 / 2 = 8 rows * 8 = 64 each; final norm 8.
    # bf16 Adam: 2 (param) + 4 (master) + 4 + 4 (moments) = 14 bytes/element; fp32 grads 4 bytes;
    # the int64 step counter (8 bytes) sits on every stage.
    est = memory_estimate(TINY, SETUP, CPU_SMALL, ParallelLayout(2, 2, 1))
    first, last = est.stages
    assert (first.state_bytes, first.grad_bytes) == ((272 + 64) * 14 + 8, (272 + 64) * 4)
    assert (last.state_bytes, last.grad_bytes) == ((272 + 8 + 64) * 14 + 8, (272 + 8 + 64) * 4)


def test_activations_match_hand_computation_for_tp2_pp2() -> None:
    # Per token per layer (elements, sequence parallel, selective): 4h/2 = 16 norm/matmul inputs,
    # QKV 24/2 = 12, attention output 8/2 = 4, fc1 out 16/2 = 8, fc2 in 16/2 = 8 -> 48 * 2 bytes = 96.
    assert activation_bytes_per_token(TINY, SETUP, 2) == 96
    est = memory_estimate(TINY, SETUP, CPU_SMALL, ParallelLayout(2, 2, 1))
    first, last = est.stages
    # 4 micro-batches of 4 tokens: the first stage keeps 2 in flight, the last 1 plus its logits:
    # 4 tokens * 8 vocabulary rows * (2 bytes bf16 + 4 bytes fp32 softmax).
    assert (first.in_flight, first.activation_bytes) == (2, 2 * 4 * 96)
    assert (last.in_flight, last.activation_bytes) == (1, 4 * 96 + 4 * 8 * 6)
    assert est.peak_bytes == first.total_bytes == 6824


def test_first_stage_keeps_pp_micro_batches_in_flight_when_there_are_enough() -> None:
    assert [in_flight_micro_batches(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight_micro_batches(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]


def test_full_recompute_keeps_less_than_selective_which_keeps_less_than_none() -> None:
    model = PRESETS["llama3-8b"]
    base = TrainingSetup(global_batch_size=64, sequence_length=8192)
    sizes = [
        activation_bytes_per_token(model, msgspec.structs.replace(base, recompute=r), 4)
        for r in ("full", "selective", "none")
    ]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3


def test_sequence_parallelism_shrinks_activations_under_tp() -> None:
    model = PRESETS["llama3-8b"]
    sp = TrainingSetup(global_batch_size=64, sequence_length=8192)
    no_sp = msgspec.structs.replace(sp, sequence_parallel=False)
    assert activation_bytes_per_token(model, sp, 8) < activation_bytes_per_token(model, no_sp, 8)


def test_fp32_parameters_carry_no_master_copy() -> None:
    fp32 = msgspec.structs.replace(TINY, params_dtype="float32")
    est = memory_estimate(fp32, SETUP, CPU_SMALL, ParallelLayout(2, 2, 1))
    # 4 (param) + 4 + 4 (moments) = 12 bytes/element, plus the step counter.
    assert est.stages[0].state_bytes == (272 + 64) * 12 + 8


def test_usable_memory_subtracts_margin_reserve_and_staging_buffer() -> None:
    assert H100_80GB.usable_bytes(512 * 1024**2) == int(80 * GiB * 0.9) - 2 * GiB - 512 * 1024**2


def test_gpt3_175b_does_not_fit_one_h100_but_fits_tp8_pp12() -> None:
    model = PRESETS["gpt3-175b"]
    setup = TrainingSetup(global_batch_size=1536, sequence_length=2048)
    assert not memory_estimate(model, setup, H100_80GB, ParallelLayout(1, 1, 1)).fits
    assert memory_estimate(model, setup, H100_80GB, ParallelLayout(8, 12, 10)).fits


def test_setup_rejects_a_global_batch_that_is_not_whole_micro_batches() -> None:
    with pytest.raises(SetupError, match="global_batch_size"):
        TrainingSetup(global_batch_size=6, micro_batch_size=4, sequence_length=4)


def test_setup_rejects_sequences_longer_than_learned_positions() -> None:
    setup = TrainingSetup(global_batch_size=4, sequence_length=128)
    with pytest.raises(SetupError, match="sequence_length"):
        setup.check_model(PRESETS["tiny-gpt"])


def test_hardware_profile_rejects_an_impossible_fraction() -> None:
    with pytest.raises(SetupError, match="achievable_fraction"):
        msgspec.structs.replace(CPU_SMALL, achievable_fraction=1.5)


def test_hardware_profile_decodes_from_json_with_field_checks() -> None:
    data = msgspec.json.encode(CPU_SMALL)
    assert msgspec.json.decode(data, type=HardwareProfile) == CPU_SMALL
    bad = data.replace(b'"memory_margin":0.1', b'"memory_margin":2.0')
    with pytest.raises(msgspec.ValidationError, match="memory_margin"):
        msgspec.json.decode(bad, type=HardwareProfile)


def test_under_the_distributed_optimizer_a_rank_keeps_its_dp_share_of_the_optimizer_state() -> None:
    from liver.reshard.dist_opt import buffer_layouts
    from liver.reshard.views import tp_shard
    from liver.shared.geometry import DdpSettings

    plain = PRESETS["tiny-llama"].geometry()
    sharded = plain.with_ddp(DdpSettings(distributed_optimizer=True))
    layout = ParallelLayout(tp=2, pp=2, dp=4)
    for stage, ((mine, grad), (theirs, grad_plain)) in enumerate(
        zip(stage_state_bytes(sharded, SETUP, layout), stage_state_bytes(plain, SETUP, layout))
    ):
        params = sum(
            t.itemsize * math.prod(tp_shard(t, plain, layout.tp, 0).local_shape)
            for t in plain.tensors(optimizer=False)
            if stage in holding_stages(t, plain, layout)
        )
        (buffer,) = buffer_layouts(sharded, layout, layout.rank_of(0, 0, stage))
        owned = buffer.buckets[-1][1] // layout.dp * 4 * 2  # fp32: two moments, the master is the param
        assert mine == params + owned + 8  # and the step
        assert grad == grad_plain and mine < theirs


def test_interleaving_keeps_more_activations_on_the_first_stage_and_shrinks_the_bubble() -> None:
    from liver.services.topology.cost import step_cost

    model = msgspec.structs.replace(PRESETS["llama3-8b"], num_layers=32)
    setup = TrainingSetup(global_batch_size=64, micro_batch_size=1, sequence_length=2048)
    plain, interleaved = ParallelLayout.parse("TP8,PP4,DP1"), ParallelLayout.parse("TP8,PP4,VPP2,DP1")
    first = [memory_estimate(model, setup, H100_80GB, layout).stages[0] for layout in (plain, interleaved)]
    # (pp - 1) * 2 + (vpp - 1) * pp + 1 = 11 chunks of half a stage against pp = 4 micro-batches
    assert first[1].activation_bytes * 4 == first[0].activation_bytes * 11 // 2
    kw = {"tp_within_node": True, "single_node": True}
    costs = [step_cost(model, setup, H100_80GB, layout, **kw) for layout in (plain, interleaved)]
    assert costs[1].bubble_s < costs[0].bubble_s
