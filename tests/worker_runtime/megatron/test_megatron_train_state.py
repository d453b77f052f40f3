"""The parts of the Megatron adapter that need no Megatron: the local-state check against the views, the
non-tensor training state, the training config and the synthetic corpus (and its data position)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS
from liver.worker_runtime.megatron.data import CorpusSpec, SyntheticCorpus
from liver.worker_runtime.megatron.state import (
    RngState,
    SchedulerState,
    StateMismatch,
    TrainingProgress,
    check_local_state,
    expected_shards,
)
from liver.worker_runtime.megatron.train_config import TrainConfig

LLAMA = PRESETS["tiny-llama"]
TP2 = ParallelLayout(tp=2, pp=1, dp=1)
DTYPES = {"float32": torch.float32, "int64": torch.int64}


def _state_from_views(rank: int = 1) -> dict[int, torch.Tensor]:
    tensors = LLAMA.tensors()
    return {
        i: torch.zeros(shape, dtype=DTYPES[tensors[i].dtype])
        for i, (shape,) in expected_shards(LLAMA, TP2, rank).items()
    }


def _index(name: str) -> int:
    return next(i for i, t in enumerate(LLAMA.tensors()) if t.name == name)


def test_a_state_shaped_by_the_views_passes_the_check() -> None:
    check_local_state(_state_from_views(), LLAMA, TP2, rank=1)


def test_the_views_give_swiglu_fc1_its_folded_shape_and_vocabulary_shards_their_padding() -> None:
    shapes = expected_shards(LLAMA, TP2, rank=1)
    assert shapes[_index("decoder.layers.2.mlp.linear_fc1.weight")] == ((2, 96, 64),)
    assert shapes[_index("optimizer.state.exp_avg.output_layer.weight")] == ((512, 64),)  # 1024 padded / 2


def test_a_wrong_shape_is_refused_naming_the_tensor() -> None:
    state = _state_from_views()
    state[_index("decoder.layers.3.mlp.linear_fc1.weight")] = torch.zeros(192, 64)  # unfolded
    with pytest.raises(StateMismatch, match=r"decoder\.layers\.3\.mlp\.linear_fc1\.weight.*\(2, 96, 64\)"):
        check_local_state(state, LLAMA, TP2, rank=1)


def test_a_missing_tensor_is_refused_naming_it() -> None:
    state = _state_from_views()
    del state[_index("optimizer.state.exp_avg_sq.decoder.final_layernorm.weight")]
    with pytest.raises(StateMismatch, match=r"optimizer\.state\.exp_avg_sq\.decoder\.final_layernorm"):
        check_local_state(state, LLAMA, TP2, rank=1)


def test_a_partial_state_passes_when_completeness_is_not_required() -> None:
    state = _state_from_views()
    del state[_index("optimizer.state.step")]
    check_local_state(state, LLAMA, TP2, rank=1, complete=False)


def test_a_tensor_the_rank_does_not_hold_is_refused() -> None:
    pp2 = ParallelLayout(tp=1, pp=2, dp=1)
    shapes = expected_shards(LLAMA, pp2, rank=0)
    state = {i: torch.zeros(s, dtype=DTYPES[LLAMA.tensors()[i].dtype]) for i, (s,) in shapes.items()}
    state[_index("output_layer.weight")] = torch.zeros(1008, 64)
    with pytest.raises(StateMismatch, match=r"output_layer\.weight.*holds no shard"):
        check_local_state(state, LLAMA, pp2, rank=0)


def test_a_wrong_dtype_is_refused_naming_the_tensor() -> None:
    state = _state_from_views()
    state[_index("optimizer.state.step")] = torch.tensor(3.0)
    with pytest.raises(StateMismatch, match=r"optimizer\.state\.step.*dtype"):
        check_local_state(state, LLAMA, TP2, rank=1)


def _progress(**changes: object) -> TrainingProgress:
    fields = dict(
        iteration=7,
        consumed_samples=56,
        global_batch_size=8,
        scheduler=SchedulerState(
            max_lr=5e-3,
            min_lr=5e-4,
            lr_warmup_steps=8,
            lr_decay_steps=8000,
            lr_decay_style="cosine",
            num_steps=56,
            start_wd=0.01,
            end_wd=0.01,
            wd_incr_steps=8000,
            wd_incr_style="constant",
        ),
        rng=RngState(
            torch_cpu=b"\x01\x02", tracker={"model-parallel-rng": b"\x03"}, python=(3, (1, 2), None)
        ),
    )
    fields.update(changes)
    return TrainingProgress(**fields)  # type: ignore[arg-type]


def test_training_progress_survives_a_json_round_trip() -> None:
    progress = _progress()
    assert msgspec.json.decode(msgspec.json.encode(progress), type=TrainingProgress) == progress


def test_training_progress_refuses_a_negative_data_position_naming_the_field() -> None:
    with pytest.raises(ValueError, match="consumed_samples"):
        _progress(consumed_samples=-8)


def test_micro_batches_per_rank_keep_the_global_batch_constant_across_dp() -> None:
    config = TrainConfig(global_batch_size=8, micro_batch_size=2)
    assert [config.micro_batches_per_rank(dp) for dp in (1, 2, 4)] == [4, 2, 1]


def test_a_global_batch_that_does_not_split_over_dp_is_refused_naming_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"global_batch_size \(8\).*micro_batch_size \(2\) x dp \(3\)"):
        TrainConfig(global_batch_size=8, micro_batch_size=2).micro_batches_per_rank(3)


def test_train_config_refuses_warmup_past_the_decay_naming_the_field() -> None:
    with pytest.raises(ValueError, match="lr_warmup_iters"):
        TrainConfig(lr_warmup_iters=10, lr_decay_iters=10)


CORPUS = SyntheticCorpus(CorpusSpec(vocab_size=64), seq_length=16)


def test_a_global_batch_holds_the_same_samples_whatever_the_dp_split() -> None:
    def rows(dp: int) -> torch.Tensor:
        return torch.cat([b.tokens for rank in range(dp) for b in CORPUS.micro_batches(24, 8, 2, rank, dp)])

    assert torch.equal(rows(1), rows(2)) and torch.equal(rows(1), rows(4))


def test_samples_are_a_pure_function_of_their_index() -> None:
    other = SyntheticCorpus(CorpusSpec(vocab_size=64), seq_length=16)
    assert torch.equal(CORPUS.sample(1234), other.sample(1234))
    assert not torch.equal(CORPUS.sample(1234), CORPUS.sample(1235))


def test_labels_are_the_next_tokens_and_stay_inside_the_corpus_vocabulary() -> None:
    batch = CORPUS.batch(0, 3)
    assert torch.equal(batch.tokens[:, 1:], batch.labels[:, :-1])
    assert int(batch.labels.max()) < 64 and int(batch.tokens.min()) >= 0


def test_corpus_spec_refuses_a_branching_wider_than_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="branching"):
        CorpusSpec(vocab_size=4, branching=5)
