"""One Megatron-core training job on one world: GPT model, DDP, optimizer, LR schedule and a step.

:func:`build_trainer` assembles what Megatron-LM's ``pretrain`` would, from Megatron-core parts only:
the GPTModel of :mod:`.build` (or the user's provider's), Megatron's ``DistributedDataParallel``,
``get_megatron_optimizer`` (Adam) and ``OptimizerParamScheduler``, all on the explicit process groups of
one world, with ``parallel_state`` answering for that world while they are built. Each
:meth:`MegatronTrainer.train_step` runs Megatron's own schedule (``get_forward_backward_func``: 1F1B
when PP > 1) with Megatron's GPT forward step or the user's over the micro-batches of one global batch
and returns the loss and the grad norm.

One deliberate difference from Megatron-LM's ``pretrain_gpt``: vocabulary padding carries no state.
Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``, so the number of
padding rows changes with TP; if they took part in the softmax, their weights and Adam moments would be
training state that no other layout could hold. Here padding rows start at zero and a forward hook on
the output layer sets their logits to ``-inf`` (:func:`mask_vocab_padding`), whatever loss the forward
step computes from them, so their gradients are exactly zero and they stay zero forever (AdamW moves a
zero weight with zero moments by exactly zero). LiveR's logical tensors exclude padding
(:mod:`liver.shared.model`); this makes that exact. (A loss with label smoothing over a padded
vocabulary would average ``log 0``; keep the vocabulary a multiple of the padding or smoothing off.)

The global batch size is fixed by :class:`TrainConfig`; the micro-batches per rank follow from the
layout's DP (``global / (micro * dp)``), so changing DP changes how a batch is split (and the order in
which gradients are summed), never which samples form it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from liver.shared.geometry import ModelGeometry
from liver.shared.layout import ParallelLayout
from liver.shared.model import ModelSpec
from liver.worker_runtime.megatron.build import MegatronBuildError, ParallelGroups, groups_from_parallel_state
from liver.worker_runtime.megatron.data import Corpus, CorpusSpec, SyntheticCorpus
from liver.worker_runtime.megatron.dist_opt import check_owned_ranges
from liver.worker_runtime.megatron.pinned_state import parallel_state_of
from liver.worker_runtime.megatron.source import ModelSource, as_source
from liver.worker_runtime.megatron.state import local_state, logical_name
from liver.worker_runtime.megatron.train_config import TrainConfig
from liver.worker_runtime.megatron.trainer import ForwardStep, MegatronTrainer, gpt_forward_step

__all__ = ["TrainerHooks", "build_trainer", "mask_vocab_padding", "zero_vocab_padding"]

log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------- building


@dataclass(frozen=True)
class TrainerHooks:
    """The user's own pieces of a Megatron training script, used for every world the job trains in.

    ``optimizer_config``: Megatron's ``OptimizerConfig`` as the user passes it to
    ``get_megatron_optimizer`` (otherwise Adam from the :class:`TrainConfig`); its precision must be
    the model's. ``scheduler``: ``(optimizer) -> OptimizerParamScheduler``, the user's own schedule
    (otherwise the :class:`TrainConfig`'s); it is rebuilt for each world and its state carried across
    the switch, so it must be the same function every time. ``forward_step``: the user's
    ``forward_step_func`` (:data:`~.trainer.ForwardStep`; otherwise Megatron's GPT forward step), run
    with ``parallel_state`` describing the world it trains in; its ``loss_func`` reports the loss under
    ``loss_key``. ``at_cut(generation, trainer)``: the user's hook at a live switch's cut, with the old
    world's trainer, on its every process, before anything moves (the old world is still the default
    one: save, log, check); ``after_switch(generation, trainer)``: with the new world's trainer once
    the switch committed, before its first step (``LiveRuntime``'s ``on_cut``/``on_switch``, which
    ``liver worker`` wires to these).
    """

    optimizer_config: OptimizerConfig | None = None
    scheduler: Callable[[Any], OptimizerParamScheduler] | None = None
    forward_step: ForwardStep | None = None
    loss_key: str = "lm loss"
    at_cut: Callable[[int, Any], None] | None = None
    after_switch: Callable[[int, Any], None] | None = None

    def __post_init__(self) -> None:
        if self.forward_step is not None and not callable(self.forward_step):
            raise ValueError(f"hooks.forward_step: expected a function, got {type(self.forward_step)}")
        for field in ("scheduler", "at_cut", "after_switch"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise ValueError(f"hooks.{field}: expected a function, got {type(value)}")
        if not isinstance(self.loss_key, str) or not self.loss_key:
            raise ValueError(f"hooks.loss_key: expected the loss report's key, got {self.loss_key!r}")
        opt = self.optimizer_config
        if opt is not None and opt.optimizer != "adam":
            raise ValueError(
                f"hooks.optimizer_config.optimizer: {opt.optimizer!r}; LiveR moves Adam's state (two "
                "moments and a step per parameter), so only 'adam' reshards live"
            )


def _no_init(tensor: torch.Tensor) -> torch.Tensor:
    """An init method that leaves the tensor as allocated (see ``build_trainer(initialize=False)``)."""
    return tensor


def _optimizer_config(model: torch.nn.Module, config: TrainConfig) -> OptimizerConfig:
    """Adam in the model's own precision (its ``TransformerConfig``'s bf16/fp16 decide the master copy)."""
    tconfig = model.config
    dtype = torch.bfloat16 if tconfig.bf16 else torch.float16 if tconfig.fp16 else torch.float32
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


def zero_vocab_padding(model: GPTModel, geometry: ModelGeometry, groups: ParallelGroups) -> None:
    """Zero the rows of the vocabulary tensors that lie past the real vocabulary (see the docstring)."""
    if geometry.vocab_size is None:
        return
    per_rank = geometry.padded_vocab(groups.layout.tp) // groups.layout.tp
    first_padding = geometry.vocab_size - groups.tp.rank() * per_rank
    if first_padding >= per_rank:
        return
    vocab = {t.name for t in geometry.tensors(optimizer=False) if t.rule == "vocab"}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if logical_name(model, name) in vocab:
                param[max(first_padding, 0) :].zero_()


def mask_vocab_padding(model: torch.nn.Module, geometry: ModelGeometry, groups: ParallelGroups) -> None:
    """Make the output layer's logits of padding columns ``-inf`` (see the module docstring).

    Out of place, so autograd gives those columns exactly zero gradient; the layer's output may be
    vocab-parallel (this TP rank's columns) or gathered (all of them)."""
    output_layer = getattr(model, "output_layer", None)
    if geometry.vocab_size is None or output_layer is None or not groups.is_last_stage:
        return
    tp = groups.layout.tp
    padded = geometry.padded_vocab(tp)
    if padded == geometry.vocab_size:
        return
    per_rank = padded // tp
    vocab_size = geometry.vocab_size

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
        logits, *rest = output if isinstance(output, tuple) else (output,)
        width = logits.size(-1)
        first = groups.tp.rank() * per_rank if width == per_rank else 0
        if width not in (per_rank, padded) or first + width <= vocab_size:
            return None
        column = torch.arange(first, first + width, device=logits.device)
        masked = logits.masked_fill(column >= vocab_size, float("-inf"))
        return (masked, *rest) if isinstance(output, tuple) else masked

    output_layer.register_forward_hook(hook)


def build_trainer(
    model_source: ModelSpec | ModelSource,
    layout: ParallelLayout,
    config: TrainConfig,
    *,
    groups: ParallelGroups | None = None,
    corpus: Corpus | None = None,
    hooks: TrainerHooks | None = None,
    initialize: bool = True,
) -> MegatronTrainer:
    """Build model, DDP, optimizer and schedule for this rank of ``layout``, and check that its state
    agrees with the view function (for the distributed optimizer: that it owns the ranges the planner
    predicts, :mod:`liver.reshard.dist_opt`).

    ``initialize=False`` leaves a preset's weights uninitialised: for a trainer whose every value is about
    to be overwritten (a live switch streams into it). Megatron's ``perform_initialization=False`` would
    also skip marking the weights tensor-parallel (on CPU and GPU alike), which the gradient norm and
    checkpoints read, so the init methods are replaced by ones that draw nothing instead.

    ``groups`` default to ``parallel_state``'s (which must then be initialised for ``layout``); the
    world they belong to must be torch.distributed's default world (see :mod:`.build`).
    The model is initialised from ``config.seed`` exactly as Megatron does, so two builds at the same
    layout start from the same weights.
    """
    source = as_source(model_source)
    if groups is None:
        groups = groups_from_parallel_state(layout)
    with parallel_state_of(groups):
        return _build_trainer(source, layout, config, groups, corpus, hooks or TrainerHooks(), initialize)


def _build_trainer(
    source: ModelSource,
    layout: ParallelLayout,
    config: TrainConfig,
    groups: ParallelGroups,
    corpus: Corpus | None,
    hooks: TrainerHooks,
    initialize: bool = True,
) -> MegatronTrainer:
    """:func:`build_trainer` with ``parallel_state`` answering for ``groups``: model chunks, DDP,
    optimizer, schedule, the schedule's hooks on the model's config, the corpus, then the start-up
    check of the state against the views."""
    chunks = _build_chunks(source, layout, config, groups, initialize)
    gpt = chunks[0]
    collection = groups.collection()
    models = _wrap_in_ddp(chunks, config, collection)
    opt_config = hooks.optimizer_config or _optimizer_config(gpt, config)
    _check_optimizer_config(opt_config, gpt, config)
    optimizer = get_megatron_optimizer(
        opt_config, models, use_gloo_process_groups=False, pg_collection=collection
    )
    scheduler = hooks.scheduler(optimizer) if hooks.scheduler is not None else _scheduler(optimizer, config)
    _wire_schedule(gpt.config, layout, config, models, optimizer)
    trainer = MegatronTrainer(
        source,
        layout,
        config,
        groups,
        models,
        optimizer,
        scheduler,
        _corpus(corpus, source, config),
        forward_step=hooks.forward_step or gpt_forward_step,
        loss_key=hooks.loss_key,
    )
    trainer.filled_by_stream = not initialize
    if config.use_distributed_optimizer:
        # Start-up check: the optimizer owns exactly the ranges the planner predicts for this rank.
        check_owned_ranges(trainer)
    else:
        # Start-up check: every parameter and Adam state maps to the logical tensor the views give this
        # rank, with the view's local shape (raises StateMismatch naming the first that does not).
        local_state(trainer)
    return trainer


def _build_chunks(
    source: ModelSource, layout: ParallelLayout, config: TrainConfig, groups: ParallelGroups, initialize: bool
) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage), built from ``config.seed`` once the layout and
    sequence suit the config, their vocabulary padding zeroed and masked (see the module docstring)."""
    layout.check_micro_batches(config.micro_batches_per_rank(layout.dp))
    if config.seq_length > source.max_sequence_length:
        raise ValueError(
            f"seq_length ({config.seq_length}) exceeds the model's max_sequence_length "
            f"({source.max_sequence_length})"
        )
    chunks = source.build(
        layout,
        groups,
        seed=config.seed,
        config_overrides={
            "hidden_dropout": config.hidden_dropout,
            "attention_dropout": config.attention_dropout,
            **({} if initialize else {"init_method": _no_init, "output_layer_init_method": _no_init}),
        },
    )
    for gpt in chunks:
        zero_vocab_padding(gpt, source.geometry, groups)
        mask_vocab_padding(gpt, source.geometry, groups)
    return chunks


def _wrap_in_ddp(
    chunks: list[torch.nn.Module], config: TrainConfig, collection: Any
) -> list[DistributedDataParallel]:
    """As Megatron-LM's ``get_model``: a DDP per model chunk, the buckets of the first chunk's only."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=config.overlap_grad_reduce,
        use_distributed_optimizer=config.use_distributed_optimizer,
        overlap_param_gather=config.overlap_param_gather,
        bucket_size=config.bucket_size,
        num_distributed_optimizer_instances=config.num_distributed_optimizer_instances,
    )
    return [
        DistributedDataParallel(
            config=chunk.config,
            ddp_config=ddp_config,
            module=chunk,
            pg_collection=collection,
            disable_bucketing=v > 0,
        )
        for v, chunk in enumerate(chunks)
    ]


def _check_optimizer_config(opt_config: OptimizerConfig, gpt: torch.nn.Module, config: TrainConfig) -> None:
    """Refuse an optimizer config (the user's) that disagrees with the gradient buffers' layout or the
    model's precision."""
    if opt_config.use_distributed_optimizer != config.use_distributed_optimizer:
        raise ValueError(
            "optimizer_config.use_distributed_optimizer must match the TrainConfig's (the gradient "
            "buffers are laid out for one or the other)"
        )
    if (opt_config.bf16, opt_config.fp16) != (gpt.config.bf16, gpt.config.fp16):
        raise ValueError(
            f"optimizer_config: bf16={opt_config.bf16}, fp16={opt_config.fp16}, but the model is built "
            f"with bf16={gpt.config.bf16}, fp16={gpt.config.fp16}"
        )


def _scheduler(optimizer: Any, config: TrainConfig) -> OptimizerParamScheduler:
    """The :class:`TrainConfig`'s learning-rate and weight-decay schedule, counted in samples."""
    return OptimizerParamScheduler(
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


def _wire_schedule(
    tconfig: Any,
    layout: ParallelLayout,
    config: TrainConfig,
    models: list[DistributedDataParallel],
    optimizer: Any,
) -> None:
    """Set on the model's ``TransformerConfig`` what Megatron's schedule reads from it: the loss scale,
    the p2p mode, DDP's no-sync and grad-sync functions and the grads' finalisation."""
    if layout.vpp > 1 and tconfig.virtual_pipeline_model_parallel_size != layout.vpp:
        raise MegatronBuildError(
            f"{layout.describe()}: the model's TransformerConfig has virtual_pipeline_model_parallel_size="
            f"{tconfig.virtual_pipeline_model_parallel_size}; the interleaved schedule reads it (set it to "
            "layout.vpp in the provider)"
        )
    tconfig.grad_scale_func = optimizer.scale_loss
    chunked = len(models) > 1  # the interleaved schedule takes one function per chunk
    if chunked and layout.pp == 2:
        # Interleaved over two stages, a rank's previous and next stage are the same peer; batched
        # send/recv would match an activation with a gradient (Megatron-LM allows PP2 with VPP only
        # with overlapped p2p, which sends one direction over the default group).
        tconfig.overlap_p2p_comm = True
        tconfig.batch_p2p_comm = False
    tconfig.no_sync_func = [m.no_sync for m in models] if chunked else models[0].no_sync
    tconfig.finalize_model_grads_func = finalize_model_grads
    if config.overlap_grad_reduce:
        tconfig.grad_sync_func = [m.start_grad_sync for m in models] if chunked else models[0].start_grad_sync


def _corpus(corpus: Corpus | None, source: ModelSource, config: TrainConfig) -> Corpus:
    """The user's corpus once it fits the model's vocabulary and the config's sequence, else the
    synthetic one of the config."""
    if corpus is None:
        vocab = min(config.corpus_vocab_size, source.vocab_size)
        return SyntheticCorpus(CorpusSpec(vocab_size=vocab, seed=config.corpus_seed), config.seq_length)
    if corpus.vocab_size > source.vocab_size or corpus.seq_length != config.seq_length:
        raise ValueError(
            f"corpus: vocabulary {corpus.vocab_size} / seq_length {corpus.seq_length} do not fit "
            f"the model ({source.vocab_size}) and the config ({config.seq_length})"
        )
    return corpus
