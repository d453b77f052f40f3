"""What a rank holds of each logical tensor, as pieces: the view's one shard, or, for optimizer state
under Megatron's distributed optimizer, the boxes of the range its DP rank owns.

Every consumer of a plan (the planner, the plan checker, the executor's schedule, a worker's state)
asks here, so the plain and the distributed optimizer are one code path: a holding is a tuple of
:class:`~liver.reshard.views.Shard` s, each with a local tensor of its own (``local_shape``, the box at
local index 0). Plain tensors have one piece; a distributed optimizer state has up to
``2 * ndim - 1`` per rank, and DP ranks hold disjoint pieces instead of replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from liver.reshard.dist_opt import owned_pieces
from liver.reshard.views import Shard, view
from liver.shared.geometry import ModelGeometry, TensorSpec
from liver.shared.layout import ParallelLayout

__all__ = ["SHARDED_ROLES", "Holding", "holding", "is_dp_sharded", "packed", "pieces_of"]

T = TypeVar("T")

Holding = tuple[Shard, ...]

SHARDED_ROLES = frozenset({"fp32_param", "exp_avg", "exp_avg_sq"})
"""The roles the distributed optimizer shards over DP (its master weights and Adam moments); the
parameters themselves stay whole on every DP rank (DDP's parameter buffer) and so does the step."""


def is_dp_sharded(tensor: TensorSpec, model: ModelGeometry) -> bool:
    """Whether DP ranks hold disjoint pieces of ``tensor`` rather than replicas of one shard."""
    return isinstance(model, ModelGeometry) and model.distributed and tensor.role in SHARDED_ROLES


def holding(tensor: TensorSpec, model: ModelGeometry, layout: ParallelLayout, rank: int) -> Holding | None:
    """The pieces of ``tensor`` that ``rank`` holds under ``layout``; ``None`` when it holds none."""
    shard = view(tensor, model, layout, rank)
    if shard is None or not is_dp_sharded(tensor, model):
        return None if shard is None else (shard,)
    pieces = owned_pieces(model, layout, rank).get(tensor.param)
    if not pieces:
        return None
    return tuple(Shard(p.box, p.local_shape) for p in pieces)


def packed(tensor: TensorSpec, model: ModelGeometry, made: Sequence[T]) -> T | tuple[T, ...]:
    """One local state entry from its pieces' local tensors: a tuple for DP-sharded state (however
    many pieces), the one tensor otherwise."""
    return tuple(made) if is_dp_sharded(tensor, model) else made[0]


def pieces_of(value: T | tuple[T, ...]) -> tuple[T, ...]:
    """The local tensors of one local state entry (a plain tensor is its only piece)."""
    return value if isinstance(value, tuple) else (value,)
