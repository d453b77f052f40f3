"""One Megatron-core training job on one world: GPT model, DDP, optimizer, LR schedule and a step.

:func:`build_trainer` assembles what Megatron-LM's ``pretrain`` would, from Megatron-core parts only:
the GPTModel of :mod:`.build`, Megatron's ``DistributedDataParallel``, ``get_megatron_optimizer``
(Adam) and ``OptimizerParamScheduler``, all on the explicit process groups of one world. Each
:meth:`MegatronTrainer.train_step` runs Megatron's own schedule (``get_forward_backward_func``: 1F1B
when PP > 1) over the micro-batches of one global batch and returns the loss and the grad norm.

Two deliberate differences from Megatron-LM's ``pretrain_gpt``:

* The loss is computed here (the GPT model returns logits): Megatron's unfused vocab-parallel cross
  entropy reads the TP group from ``parallel_state``, which may describe another world while a second
  one is built. The arithmetic is Megatron's own (its ``VocabParallelCrossEntropy`` steps), over the
  explicit TP group.
* Vocabulary padding carries no state. Megatron pads the vocabulary to a multiple of
  ``make_vocab_size_divisible_by * tp``, so the number of padding rows changes with TP; if they took part
  in the softmax, their weights and Adam moments would be training state that no other layout could
  hold. Here padding rows start at zero and their logits are ``-inf`` in the loss, so their gradients
  are exactly zero and they stay zero forever (AdamW moves a zero weight with zero moments by exactly
  zero). LiveR's logical tensors exclude padding (:mod:`liver.shared.model`); this makes that exact.

The global batch size is fixed by :class:`TrainConfig`; the micro-batches per rank follow from the
layout's DP (``global / (micro * dp)``), so changing DP changes how a batch is split (and the order in
which gradients are summed), never which samples form it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, NamedTuple

import structlog
import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

from liver.shared.layout import ParallelLayout
from liver.shared.model import ModelSpec
from liver.worker_runtime.megatron.build import (
    ParallelGroups,
    build_gpt_model,
    ensure_global_memory_buffer,
    groups_from_parallel_state,
)
from liver.worker_runtime.megatron.data import Batch, CorpusSpec, SyntheticCorpus
from liver.worker_runtime.megatron.train_config import TrainConfig

__all__ = [
    "MegatronTrainer",
    "StepResult",
    "TrainConfig",
    "build_trainer",
    "vocab_parallel_cross_entropy",
    "zero_vocab_padding",
]

log = structlog.get_logger(__name__)


class StepResult(NamedTuple):
    """One training step as every rank of the world sees it (loss and norm agree on all ranks)."""

    iteration: int  # the step just completed (1 after the first step)
    loss: float  # mean token loss of the global batch
    grad_norm: float  # before clipping
    lr: float
    skipped: bool  # the optimizer refused the step (fp16 overflow)
    seconds: float


# --------------------------------------------------------------------------- loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross entropy over an explicit TP group, padding columns masked."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup,
        vocab_size: int,
    ) -> torch.Tensor:
        steps = VocabParallelCrossEntropy
        logits = logits.float()
        per_rank = logits.size(-1)
        start = group.rank() * per_rank
        padding_from = vocab_size - start
        if padding_from < per_rank:
            logits[..., max(padding_from, 0) :] = float("-inf")
        logits_max = torch.max(logits, dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = steps.calculate_predicted_logits(
            logits, target, logits_max, start, start + per_rank
        )
        dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        softmax, loss = steps.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        steps = VocabParallelCrossEntropy
        grad_2d, arange_1d, softmax_update, grad_input = steps.prepare_gradient_calculation_operands(
            softmax, target_mask
        )
        grad = steps.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output
        )
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp_group: dist.ProcessGroup, vocab_size: int
) -> torch.Tensor:
    """Per-token loss for logits split over ``tp_group`` along the (padded) vocabulary; columns at or
    past ``vocab_size`` are padding and get probability exactly zero."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, vocab_size)


def _loss_func(loss_mask: torch.Tensor, per_token: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Megatron's three-value loss contract: summed loss, token count, and what to report."""
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(per_token.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


# --------------------------------------------------------------------------- building


def _optimizer_config(spec: ModelSpec, config: TrainConfig) -> OptimizerConfig:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        spec.params_dtype
    ]
    return OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        min_lr=config.min_lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        clip_grad=config.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=config.use_distributed_optimizer,
    )


def zero_vocab_padding(model: GPTModel, spec: ModelSpec, groups: ParallelGroups) -> None:
    """Zero the rows of the vocabulary tensors that lie past the real vocabulary (see the docstring)."""
    per_rank = spec.padded_vocab(groups.layout.tp) // groups.layout.tp
    first_padding = spec.vocab_size - groups.tp.rank() * per_rank
    if first_padding >= per_rank:
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                param[max(first_padding, 0) :].zero_()


class MegatronTrainer:
    """A GPT training job on one world. Build it with :func:`build_trainer`.

    ``model`` is the DDP-wrapped model (``model.module`` the GPTModel), ``optimizer`` Megatron's
    (chained) optimizer, ``scheduler`` the LR/WD schedule. ``iteration`` counts completed steps and
    ``consumed_samples`` is the data position (``iteration * global_batch_size`` unless restored).
    """

    def __init__(
        self,
        spec: ModelSpec,
        layout: ParallelLayout,
        config: TrainConfig,
        groups: ParallelGroups,
        model: DistributedDataParallel,
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
        corpus: SyntheticCorpus,
    ) -> None:
        self.spec = spec
        self.layout = layout
        self.config = config
        self.groups = groups
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.corpus = corpus
        self.iteration = 0
        self.consumed_samples = 0
        self.num_microbatches = config.micro_batches_per_rank(layout.dp)
        self._collection = groups.collection()
        self._forward_backward = get_forward_backward_func(pp_size=layout.pp, vp_size=None)
        self._p2p = P2PCommunicator(pp_group=groups.pp, config=model.config) if layout.pp > 1 else None
        self._log = log.bind(layout=layout.describe(), rank=groups.rank)

    @property
    def gpt(self) -> GPTModel:
        return self.model.module

    def data_iterator(self) -> Iterator[Batch]:
        """This rank's micro-batches of the next global batch."""
        return self.corpus.micro_batches(
            self.consumed_samples,
            self.config.global_batch_size,
            self.config.micro_batch_size,
            self.groups.dp.rank(),
            self.layout.dp,
        )

    def _forward_step(
        self, data_iterator: Iterator[Batch], model: DistributedDataParallel
    ) -> tuple[torch.Tensor, Callable[..., Any]]:
        batch = next(data_iterator)
        output = model(batch.tokens, batch.position_ids, None)
        if not self.groups.is_last_stage:
            return output, _loss_func  # never called: only the last stage computes the loss
        per_token = vocab_parallel_cross_entropy(output, batch.labels, self.groups.tp, self.spec.vocab_size)
        return per_token, partial(_loss_func, batch.loss_mask)

    def train_step(self) -> StepResult:
        """One iteration over the next global batch: forward/backward, grad sync, optimizer, LR."""
        start = time.perf_counter()
        ensure_global_memory_buffer()
        config = self.config
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=self.data_iterator(),
            model=[self.model],
            num_microbatches=self.num_microbatches,
            seq_length=config.seq_length,
            micro_batch_size=config.micro_batch_size,
            forward_only=False,
            p2p_communicator=self._p2p,
            pg_collection=self._collection,
        )
        succeeded, grad_norm, _ = self.optimizer.step()
        if succeeded:
            self.scheduler.step(increment=config.global_batch_size)
        self.iteration += 1
        self.consumed_samples += config.global_batch_size
        loss = self._global_loss(reports)
        lr = float(self.optimizer.param_groups[0]["lr"])
        result = StepResult(
            iteration=self.iteration,
            loss=loss,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=lr,
            skipped=not succeeded,
            seconds=time.perf_counter() - start,
        )
        self._log.debug("megatron_train.step", **result._asdict())
        return result

    def _global_loss(self, reports: list[dict[str, torch.Tensor]]) -> float:
        """Mean token loss of the global batch: summed over micro-batches and DP replicas on the last
        stage, then shared along the pipeline (other stages add zeros, which keeps the value exact)."""
        total = torch.zeros(2, dtype=torch.float32)
        if self.groups.is_last_stage:
            for report in reports:
                total += report["lm loss"]
            dist.all_reduce(total, group=self.groups.dp)
        if self.layout.pp > 1:
            dist.all_reduce(total, group=self.groups.pp)
        return float(total[0] / total[1])


def build_trainer(
    spec: ModelSpec,
    layout: ParallelLayout,
    config: TrainConfig,
    *,
    groups: ParallelGroups | None = None,
    corpus: SyntheticCorpus | None = None,
) -> MegatronTrainer:
    """Build model, DDP, optimizer and schedule for this rank of ``layout``, and check that its state
    agrees with the view function (not for the distributed optimizer, whose state LiveR cannot map).

    ``groups`` default to ``parallel_state``'s (which must then be initialised for ``layout``); the
    world they belong to must be torch.distributed's default world (see :mod:`.build`).
    The model is initialised from ``config.seed`` exactly as Megatron does, so two builds at the same
    layout start from the same weights.
    """
    if groups is None:
        groups = groups_from_parallel_state(layout)
    config.micro_batches_per_rank(layout.dp)
    if config.seq_length > spec.max_sequence_length:
        raise ValueError(
            f"seq_length ({config.seq_length}) exceeds the model's max_sequence_length "
            f"({spec.max_sequence_length})"
        )
    gpt = build_gpt_model(
        spec,
        layout,
        groups=groups,
        seed=config.seed,
        config_overrides={
            "hidden_dropout": config.hidden_dropout,
            "attention_dropout": config.attention_dropout,
        },
    )
    zero_vocab_padding(gpt, spec, groups)
    collection = groups.collection()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=config.overlap_grad_reduce,
        use_distributed_optimizer=config.use_distributed_optimizer,
        bucket_size=config.bucket_size,
    )
    model = DistributedDataParallel(
        config=gpt.config, ddp_config=ddp_config, module=gpt, pg_collection=collection
    )
    optimizer = get_megatron_optimizer(
        _optimizer_config(spec, config), [model], use_gloo_process_groups=False, pg_collection=collection
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_iters * config.global_batch_size,
        lr_decay_steps=config.lr_decay_iters * config.global_batch_size,
        lr_decay_style=config.lr_decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=config.lr_decay_iters * config.global_batch_size,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
    )
    tconfig = gpt.config
    tconfig.grad_scale_func = optimizer.scale_loss
    tconfig.no_sync_func = model.no_sync
    tconfig.finalize_model_grads_func = finalize_model_grads
    if config.overlap_grad_reduce:
        tconfig.grad_sync_func = model.start_grad_sync
    if corpus is None:
        vocab = min(config.corpus_vocab_size, spec.vocab_size)
        corpus = SyntheticCorpus(CorpusSpec(vocab_size=vocab, seed=config.corpus_seed), config.seq_length)
    elif corpus.spec.vocab_size > spec.vocab_size or corpus.seq_length != config.seq_length:
        raise ValueError(
            f"corpus: vocabulary {corpus.spec.vocab_size} / seq_length {corpus.seq_length} do not fit "
            f"the model ({spec.vocab_size}) and the config ({config.seq_length})"
        )
    trainer = MegatronTrainer(spec, layout, config, groups, model, optimizer, scheduler, corpus)
    if not config.use_distributed_optimizer:
        # Start-up check: every parameter and Adam state maps to the logical tensor the views give this
        # rank, with the view's local shape (raises StateMismatch naming the first that does not).
        from liver.worker_runtime.megatron.state import local_state

        local_state(trainer)
    return trainer
