"""How a GPT job trains, apart from the model and the layout: batch sizes, optimizer, LR schedule, seeds.

A plain struct (no Megatron import) so that coordinators, CLIs and tests can validate it cheaply.
Batch sizes are in samples. The global batch size is the one number a reshard must keep: the
micro-batches each DP rank runs follow from it (:meth:`TrainConfig.micro_batches_per_rank`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from liver.shared.geometry import DdpSettings


class TrainConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything about training that is not the model or the layout. Batch sizes are in samples."""

    global_batch_size: int = 8
    micro_batch_size: int = 2
    seq_length: int = 32
    lr: float = 5e-3
    min_lr: float = 5e-4
    lr_warmup_iters: int = 1
    lr_decay_iters: int = 1000
    lr_decay_style: Literal["constant", "linear", "cosine"] = "cosine"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    corpus_seed: int = 2024
    corpus_vocab_size: int = 128  # tokens the synthetic corpus uses (at most the model's vocabulary)
    hidden_dropout: float = 0.0  # dropout makes a step depend on the RNG streams (see TrainingProgress)
    attention_dropout: float = 0.0
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False  # the distributed optimizer's all-gather behind the next forward
    bucket_size: int | None = None
    num_distributed_optimizer_instances: int = 1
    """Megatron's partial distributed optimizer: the state is sharded within each of this many groups of
    consecutive DP ranks and held once per group (DP x CP and expert-DP must divide by it)."""

    def __post_init__(self) -> None:
        for field in (
            "global_batch_size",
            "micro_batch_size",
            "seq_length",
            "lr_decay_iters",
            "corpus_vocab_size",
        ):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1, got {getattr(self, field)}")
        if self.lr_warmup_iters < 0 or self.lr_warmup_iters >= self.lr_decay_iters:
            raise ValueError(
                f"lr_warmup_iters must be in [0, lr_decay_iters={self.lr_decay_iters}), "
                f"got {self.lr_warmup_iters}"
            )
        if not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        for field in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ValueError(f"{field} must be in [0, 1), got {getattr(self, field)}")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be at least 1 when given, got {self.bucket_size}")
        k = self.num_distributed_optimizer_instances
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"num_distributed_optimizer_instances must be at least 1, got {k!r}")
        if k > 1 and not self.use_distributed_optimizer:
            raise ValueError(
                "num_distributed_optimizer_instances > 1 needs use_distributed_optimizer (as in Megatron)"
            )
        if self.overlap_param_gather and not (self.use_distributed_optimizer and self.overlap_grad_reduce):
            raise ValueError(
                "overlap_param_gather needs use_distributed_optimizer and overlap_grad_reduce "
                "(as in Megatron)"
            )

    @property
    def ddp(self) -> DdpSettings:
        """What of this config decides how the optimizer state is laid out and sharded."""
        return DdpSettings(
            distributed_optimizer=self.use_distributed_optimizer,
            overlap_grad_reduce=self.overlap_grad_reduce,
            bucket_size=self.bucket_size,
            num_distributed_optimizer_instances=self.num_distributed_optimizer_instances,
        ).canonical()

    def micro_batches_per_rank(self, dp: int) -> int:
        """Micro-batches each DP rank runs per step; raises when the global batch does not split."""
        per_rank, rest = divmod(self.global_batch_size, dp)
        if rest or per_rank % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size}) x dp ({dp})"
            )
        return per_rank // self.micro_batch_size
