"""The stop-and-restart measurement (``liver.bench.restart``): a real transition through a checkpoint,
with fresh interpreters, timed phase by phase. One process at (TP1) saves; two new ones at (TP2) load
with reshape. Only the bookkeeping is asserted, never how fast this machine is."""

from __future__ import annotations

import math

import pytest

from liver.bench.restart import PHASES, RestartBreakdown, measure_restart
from liver.shared.layout import ParallelLayout
from liver.shared.model import ModelSpec
from liver.worker_runtime.megatron.train_config import TrainConfig

SMALL = ModelSpec(
    name="restart-test",
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=200,
    make_vocab_size_divisible_by=16,
    max_sequence_length=16,
    params_dtype="float32",
)
CONFIG = TrainConfig(global_batch_size=2, micro_batch_size=1, seq_length=16, corpus_vocab_size=64)
OLD = ParallelLayout(tp=1, pp=1, dp=1)
NEW = ParallelLayout(tp=2, pp=1, dp=1)
WARMUP = 2


@pytest.fixture(scope="module")
def breakdown() -> RestartBreakdown:
    return measure_restart(SMALL, OLD, NEW, CONFIG, warmup_steps=WARMUP, timeout_s=300)


@pytest.mark.slow
def test_every_phase_of_the_restart_takes_some_time(breakdown: RestartBreakdown) -> None:
    assert list(breakdown.phases()) == list(PHASES)
    assert all(seconds > 0 for seconds in breakdown.phases().values()), breakdown.phases()


@pytest.mark.slow
def test_the_phases_add_up_to_the_time_from_the_cut_to_the_first_new_step(
    breakdown: RestartBreakdown,
) -> None:
    assert sum(breakdown.phases().values()) == pytest.approx(breakdown.total_s, rel=1e-9)


@pytest.mark.slow
def test_the_new_world_resumes_from_the_checkpoint_of_the_old_one(breakdown: RestartBreakdown) -> None:
    assert (breakdown.old_processes, breakdown.new_processes) == (1, 2)
    assert breakdown.iteration == WARMUP
    assert breakdown.checkpoint_bytes > 0
    assert math.isfinite(breakdown.first_loss)


def test_a_new_layout_the_model_cannot_take_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match=r"^new: .*num_attention_heads \(4\) is not divisible by tp=3"):
        measure_restart(SMALL, OLD, ParallelLayout(tp=3, pp=1, dp=1), CONFIG)


def test_a_global_batch_that_does_not_split_over_the_old_dp_is_refused_naming_the_world() -> None:
    with pytest.raises(ValueError, match=r"^old: global_batch_size \(2\)"):
        measure_restart(SMALL, ParallelLayout(tp=1, pp=1, dp=4), NEW, CONFIG)


def test_a_sequence_longer_than_the_model_allows_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"config\.seq_length"):
        measure_restart(SMALL, OLD, NEW, TrainConfig(global_batch_size=2, micro_batch_size=1, seq_length=32))


def test_a_restart_without_warmup_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        measure_restart(SMALL, OLD, NEW, CONFIG, warmup_steps=0)
