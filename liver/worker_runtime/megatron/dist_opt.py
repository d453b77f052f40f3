"""What Megatron's distributed optimizer really owns on this rank, read from its own data structures.

:mod:`liver.reshard.dist_opt` restates Megatron's buffer layout for the torch-free planner; this module
reads the real one (``_ParamAndGradBuffer.param_index_map`` / ``bucket_indices`` and the optimizer's
``gbuf_ranges``), so tests can compare the two and every rank can check its optimizer against the
planner's prediction before it trusts a plan built on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from liver.reshard.dist_opt import BufferLayout, ParamSlot, buffer_layouts, owned_ranges
from liver.shared.errors import HandoffError
from liver.shared.geometry import DdpSettings
from liver.worker_runtime.megatron.state import named_parameters

if TYPE_CHECKING:
    from liver.worker_runtime.megatron.trainer import MegatronTrainer

__all__ = [
    "DistributedOptimizerMismatch",
    "check_owned_ranges",
    "ddp_settings",
    "megatron_buffer_layouts",
    "megatron_owned_ranges",
]

_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


class DistributedOptimizerMismatch(HandoffError):
    """Megatron's distributed optimizer owns other ranges than the planner predicts for this rank."""


def ddp_settings(trainer: MegatronTrainer) -> DdpSettings:
    """The settings that decided ``trainer``'s buffer layout, from its DDP config."""
    config = trainer.model.ddp_config
    return DdpSettings(
        distributed_optimizer=config.use_distributed_optimizer,
        overlap_grad_reduce=config.overlap_grad_reduce,
        bucket_size=trainer.config.bucket_size,
        pad_buckets_for_high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
        num_distributed_optimizer_instances=config.num_distributed_optimizer_instances,
    ).canonical()


def _names(trainer: MegatronTrainer) -> dict[int, str]:
    return {id(p): name for name, _, p in named_parameters(trainer)}


def megatron_buffer_layouts(trainer: MegatronTrainer) -> tuple[BufferLayout, ...]:
    """The DDP buffers of ``trainer`` as Megatron laid them out, model chunk after model chunk."""
    names = _names(trainer)
    out = []
    kinds = []
    for chunk in trainer.model_chunks:
        kinds += [(b, False) for b in chunk.buffers]
        kinds += [(b, True) for b in getattr(chunk, "expert_parallel_buffers", ())]
    for buffer, expert in kinds:
        slots = sorted(
            (
                ParamSlot(names[id(p)], start, end, bucket)
                for p, (start, end, bucket) in buffer.param_index_map.items()
            ),
            key=lambda s: s.start,
        )
        out.append(
            BufferLayout(
                _DTYPE_NAMES[str(buffer.param_dtype)],
                tuple(slots),
                tuple(map(tuple, buffer.bucket_indices)),
                expert,
            )
        )
    return tuple(out)


def megatron_owned_ranges(trainer: MegatronTrainer) -> dict[str, tuple[int, int]]:
    """The range of each parameter's flattened local tensor this rank's optimizer owns, by name."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    names = _names(trainer)
    out: dict[str, tuple[int, int]] = {}
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        for per_dtype in opt.gbuf_ranges:
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for param, ranges in bucket["param_map"].items():
                        owned = ranges["param"]
                        out[names[id(param)]] = (owned.start, owned.end)
    return out


def check_owned_ranges(trainer: MegatronTrainer) -> None:
    """Raise :class:`DistributedOptimizerMismatch` naming the first parameter whose owned range differs
    from :func:`liver.reshard.dist_opt.owned_ranges` (the planner's), so no plan moves the wrong bytes."""
    geometry = trainer.geometry
    if geometry.ddp != ddp_settings(trainer):
        raise DistributedOptimizerMismatch(
            f"the trainer's DDP is set {ddp_settings(trainer)}, its config says {geometry.ddp}"
        )
    rank = trainer.groups.rank
    predicted = owned_ranges(geometry, trainer.layout, rank)
    real = megatron_owned_ranges(trainer)
    for name in sorted(predicted.keys() | real.keys()):
        if predicted.get(name) != real.get(name):
            raise DistributedOptimizerMismatch(
                f"rank {rank} of {trainer.layout.describe()}: Megatron's distributed optimizer owns "
                f"{real.get(name)} of {name}, the planner predicts {predicted.get(name)}"
            )
    expected = buffer_layouts(geometry, trainer.layout, trainer.groups.rank)
    if megatron_buffer_layouts(trainer) != expected:
        raise DistributedOptimizerMismatch(
            f"rank {rank} of {trainer.layout.describe()}: Megatron's gradient buffers are laid out "
            "otherwise than the planner predicts (order, padding or buckets)"
        )
