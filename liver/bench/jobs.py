"""The jobs the Megatron benchmarks train (``liver bench reconfig`` and ``liver bench copies``): one
place, so that both measure the same model at the same sizes."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import msgspec

from liver.bench.procs import run_procs
from liver.reshard.plan import Plan
from liver.shared.model import ModelRef, ModelSpec
from liver.worker_runtime.megatron.train_config import TrainConfig

MODEL_DEFAULT = "tiny-gpt"

LARGE_MODEL = ModelSpec(
    name="gpt-29m",
    num_layers=8,
    hidden_size=512,
    ffn_hidden_size=2048,
    num_attention_heads=8,
    vocab_size=8192,
    max_sequence_length=128,
    params_dtype="float32",
)
"""``--large``: about 29 M parameters (470 MB of training state with fp32 Adam), still CPU-sized."""

FULL_CONFIG = TrainConfig(global_batch_size=8, micro_batch_size=1, seq_length=32)
QUICK_CONFIG = TrainConfig(global_batch_size=2, micro_batch_size=1, seq_length=16)
LARGE_CONFIG = TrainConfig(global_batch_size=8, micro_batch_size=1, seq_length=128, corpus_vocab_size=1024)


class LiveSetup(msgspec.Struct, frozen=True, kw_only=True):
    """What every process of a live benchmark's job gets (with the port of the store the benchmark
    hosts): the job, the plan it moves by, how long it trains before and after, and (fail-stop in a
    stream) the handoff the lost process dies in."""

    model: ModelRef
    config: TrainConfig
    plan: Plan
    steps_before: int
    steady_steps: int
    timeout_s: float
    handoff: Plan | None = None


def run_live_job(
    worker: Callable[[int, int, LiveSetup, int], Any],
    size: int,
    setup: LiveSetup,
    *,
    threads: int,
    may_die: Collection[int] = (),
    read: Sequence[str] = (),
) -> tuple[list[Any], dict[str, bytes]]:
    """Run ``worker(rank, size, setup, store_port)`` in ``size`` processes around a store this process
    hosts; their results in rank order, and the store's values under ``read`` (taken before the store
    goes)."""
    from liver.worker_runtime.world import host_store

    store = host_store()
    try:
        results = run_procs(
            worker,
            size,
            (setup, store.port),
            timeout_s=setup.timeout_s,
            threads=threads,
            preload=["megatron.core", "liver.worker_runtime.megatron.job", worker.__module__],
            may_die=may_die,
        )
        values = {key: store.get(key) for key in read}
    finally:
        del store
    return results, values
