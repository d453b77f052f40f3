"""A Megatron-core GPT trainer on one world: one step over a global batch, and the loss it computes.

:class:`MegatronTrainer` holds what :func:`~.train.build_trainer` assembled (the DDP-wrapped GPTModel,
Megatron's optimizer, the LR/WD schedule) and runs Megatron's own schedule in
:meth:`MegatronTrainer.train_step`. It is apart from the build so that the state mapping
(:mod:`.state`), which reads a trainer, and the build, which checks a new trainer against that mapping,
each import it without importing each other. Why the loss is computed here and how vocabulary padding
is kept out of the state: see :mod:`.train`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, NamedTuple

import structlog
import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

from liver.shared.geometry import ModelGeometry
from liver.shared.layout import ParallelLayout
from liver.worker_runtime.megatron.build import ParallelGroups, ensure_global_memory_buffer
from liver.worker_runtime.megatron.data import Batch, Corpus
from liver.worker_runtime.megatron.source import ModelSource
from liver.worker_runtime.megatron.train_config import TrainConfig

__all__ = ["MegatronTrainer", "StepResult", "vocab_parallel_cross_entropy"]

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


class MegatronTrainer:
    """A GPT training job on one world. Build it with :func:`build_trainer`.

    ``model`` is the DDP-wrapped model (``model.module`` the GPTModel), ``optimizer`` Megatron's
    (chained) optimizer, ``scheduler`` the LR/WD schedule. ``iteration`` counts completed steps and
    ``consumed_samples`` is the data position (``iteration * global_batch_size`` unless restored).
    """

    def __init__(
        self,
        source: ModelSource,
        layout: ParallelLayout,
        config: TrainConfig,
        groups: ParallelGroups,
        model: DistributedDataParallel,
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
        corpus: Corpus,
    ) -> None:
        self.source = source
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

    @property
    def geometry(self) -> ModelGeometry:
        """What the plans move: every tensor of this trainer's state is one of its tensors."""
        return self.source.geometry

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
        per_token = vocab_parallel_cross_entropy(output, batch.labels, self.groups.tp, self.source.vocab_size)
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
