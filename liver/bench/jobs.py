"""The jobs the Megatron benchmarks train (``liver bench reconfig`` and ``liver bench copies``): one
place, so that both measure the same model at the same sizes."""

from __future__ import annotations

from liver.shared.model import ModelSpec
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
