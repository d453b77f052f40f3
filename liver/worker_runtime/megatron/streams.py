"""Random streams across a move. A rank's streams (torch's generator, the model-parallel tracker,
Python's ``random``) belong to its place in the layout: which TP slice of a dropout mask it draws, which
stage it is. After a layout change those places are different, and no old stream has a meaning in the
new layout (Megatron's own checkpoints drop RNG state when TP or PP change). One rule,
:func:`resume_streams`, decides for every path that resumes a trainer from a state it did not train to
itself: a job that *moved* (a live switch, or the checkpoint fallback after a failed one) reseeds every
rank of the new world from ``(config.seed, the iteration, its new coordinates)`` (:func:`reseed`),
whatever the layout, even an unchanged one on other devices (a device that replaced another never held
its streams); only a plain restart of a job that did not move (a load at the saved layout, same ranks)
continues the saved streams. So a live switch and a fallback into the same layout from the same
iteration continue bit for bit, with dropout too, and a restart in place continues as if it had not
stopped. Between switches the streams run on unchanged; a handoff that is rolled back restores the
streams it found at the cut.

The rule lives apart from :mod:`.job` because the checkpoint load (:mod:`.checkpoint`) follows it too,
and the job in turn saves and loads checkpoints.
"""

from __future__ import annotations

import random

import torch

from liver.shared.layout import ParallelLayout
from liver.worker_runtime.megatron.state import RngState, restore_rng_state
from liver.worker_runtime.megatron.train_config import TrainConfig

__all__ = ["reseed", "resume_streams"]

_ITERATION_STRIDE = 1_000_003  # a prime, so seeds of nearby iterations and stages never coincide
_SEED_MODULUS = 2**31 - 1


def reseed(config: TrainConfig, iteration: int, layout: ParallelLayout, rank: int) -> int:
    """Seed this process's random streams for ``rank`` of ``layout`` resuming after ``iteration``.

    Follows Megatron's build-time rule (``seed + 100 * pp_rank``; the tracker's TP streams derive from
    it and the TP rank) with the seed moved on by the iteration. Returns the stage seed.
    """
    from megatron.core import tensor_parallel

    if iteration < 0:
        raise ValueError(f"`iteration`: must not be negative, got {iteration}")
    coords = layout.coords(rank)
    seed = (config.seed + _ITERATION_STRIDE * iteration) % _SEED_MODULUS + 100 * coords.pp
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, tp_rank=coords.tp, ep_rank=coords.ep, etp_rank=coords.etp
    )
    random.seed(seed)
    return seed


def resume_streams(
    config: TrainConfig,
    iteration: int,
    layout: ParallelLayout,
    rank: int,
    continued: RngState | None = None,
) -> None:
    """Set this process's random streams for ``rank`` of ``layout`` resuming after ``iteration``.

    The one rule (see the module docstring): ``continued``, the streams this very rank of this very
    layout had at ``iteration``, are put back; without them (every move) the rank is reseeded.
    """
    if continued is not None:
        restore_rng_state(continued)
    else:
        reseed(config, iteration, layout, rank)
