"""The view function: which part of a logical tensor a rank holds, following Megatron-core exactly.

* pipeline: a stage holds whole decoder layers; the embeddings sit on the first stage, the final norm
  and the output layer on the last; with tied embeddings the last stage holds a replica of the word
  embeddings (Megatron's ``output_layer`` shares it and checkpoints it under the embedding's key).
* tensor parallelism: column-parallel weights (QKV, fc1) split dimension 0, row-parallel weights (proj,
  fc2) dimension 1, SwiGLU's fc1 dimension 1 of its ``[2, ffn, ...]`` view, vocabulary tensors split the
  padded vocabulary into equal row ranges (rows past the real vocabulary are padding and hold no state);
  norms and the biases of row-parallel layers are replicated.
* data parallelism replicates (context parallelism too: it splits activations, not parameters).
* experts: each expert's tensors live whole on one EP rank (experts are dealt out in order, ``E / EP``
  to a rank), are cut by expert-TP with the same rules as above and replicated over expert-DP; the
  router is an ordinary replicated tensor.

A rank's local tensor stores its box starting at local index 0 in every dimension; ``local_shape`` can
be larger than the box (vocabulary padding) and the box can be empty (a rank holding only padding).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from liver.reshard.boxes import Box
from liver.shared.geometry import Home, ModelGeometry, TensorSpec
from liver.shared.layout import Grid, LayoutError, ParallelLayout


class Shard(NamedTuple):
    """What a rank holds of one tensor: its box of global indices (``None``: padding only)."""

    box: Box | None
    local_shape: tuple[int, ...]


def tp_shard(tensor: TensorSpec, model: ModelGeometry, tp: int, tp_rank: int) -> Shard:
    """The shard of ``tensor`` held by TP rank ``tp_rank`` of ``tp`` (any stage, any DP replica)."""
    shape = tensor.shape
    rule = tensor.rule
    if rule == "replicated" or (tp == 1 and rule != "vocab"):
        return Shard(tuple((0, n) for n in shape), shape)
    if rule == "vocab":
        per = model.padded_vocab(tp) // tp
        lo = tp_rank * per
        hi = min(lo + per, shape[0])
        local = (per, *shape[1:])
        if lo >= hi:
            return Shard(None, local)
        return Shard(((lo, hi), *((0, n) for n in shape[1:])), local)
    dim = 0 if rule == "column" else 1
    size = shape[dim] // tp
    box = tuple((tp_rank * size, (tp_rank + 1) * size) if d == dim else (0, n) for d, n in enumerate(shape))
    return Shard(box, tuple(hi - lo for lo, hi in box))


@functools.lru_cache(maxsize=256)
def stage_of_layers(layout: ParallelLayout, num_layers: int) -> tuple[int, ...]:
    """The stage of each decoder layer (0-based) under ``layout``, computed once per layout."""
    return layout.stage_of_layers(num_layers)


def holding_stages(tensor: TensorSpec, model: ModelGeometry, layout: ParallelLayout) -> tuple[int, ...]:
    """The pipeline stages whose ranks hold ``tensor``."""
    if tensor.home == "layer":
        return (stage_of_layers(layout, model.num_layers)[tensor.layer - 1],)
    return home_stages(tensor.home, model.num_layers, layout)


def home_stages(home: Home, num_layers: int, layout: ParallelLayout) -> tuple[int, ...]:
    """The pipeline stages that keep what lives outside the decoder layers at ``home``."""
    if home == "layer":
        raise ValueError("a decoder layer's tensor: its stage depends on its layer (holding_stages)")
    last = layout.pp - 1
    if home == "first":
        return (0,)
    if home == "last":
        return (last,)
    if home == "last_layer":
        return (stage_of_layers(layout, num_layers)[-1],)
    if home == "first+last":
        return (0,) if last == 0 else (0, last)
    return tuple(range(layout.pp))


def grid_of(tensor: TensorSpec, layout: ParallelLayout) -> Grid:
    """How ``layout``'s ranks are numbered for ``tensor``: the expert grid for an expert's tensor."""
    return layout.grid(expert=tensor.expert >= 0)


def expert_rank(tensor: TensorSpec, model: ModelGeometry, layout: ParallelLayout) -> int:
    """The EP rank that holds ``tensor`` (0 for a dense tensor)."""
    if tensor.expert < 0:
        return 0
    return tensor.expert // (model.num_experts // layout.ep)


def holder_ranks(
    tensor: TensorSpec, model: ModelGeometry, layout: ParallelLayout, tp_ranks: range | tuple[int, ...]
) -> list[int]:
    """Every rank that holds ``tensor`` with one of ``tp_ranks`` (TP ranks of its grid: expert-TP for
    an expert's tensor), stage by stage, each TP rank's replicas in order."""
    grid = grid_of(tensor, layout)
    ep = expert_rank(tensor, model, layout)
    return [
        grid.rank(tp, ep, replica, pp)
        for pp in holding_stages(tensor, model, layout)
        for tp in tp_ranks
        for replica in range(grid.replicas)
    ]


def view(tensor: TensorSpec, model: ModelGeometry, layout: ParallelLayout, rank: int) -> Shard | None:
    """The shard ``rank`` holds of ``tensor`` under ``layout``, or ``None`` when its stage holds none
    (or, for an expert's tensor, when the expert lives on another EP rank)."""
    if not 0 <= rank < layout.world_size:
        raise LayoutError(f"rank {rank} outside a world of {layout.world_size}")
    grid = grid_of(tensor, layout)
    tp, ep, _replica, pp = grid.place(rank)
    if pp not in holding_stages(tensor, model, layout):
        return None
    if ep != expert_rank(tensor, model, layout):
        return None
    return tp_shard(tensor, model, grid.tp, tp)


def world_shards(
    tensors: tuple[TensorSpec, ...], model: ModelGeometry, layout: ParallelLayout
) -> list[dict[int, Shard]]:
    """Every rank's shards by tensor index, in tensor order: :func:`view` for the whole world.

    Ranks of one :meth:`~liver.shared.layout.ParallelLayout.shard_class` share one dict, and a class
    looks only at the tensors its stage and EP rank hold: a 1,024-rank world of a model with 20,000
    tensors costs a few classes' worth of shards, not 20 million calls of :func:`view`."""
    dense, expert = layout.grid(expert=False), layout.grid(expert=True)
    homes: dict[tuple[int, int], list[int]] = {}
    by_tp: list[list[Shard]] = []  # each tensor's shard per TP rank of its grid (shared by equal geometries)
    geometries: dict[tuple, list[Shard]] = {}
    for ti, t in enumerate(tensors):
        ep = expert_rank(t, model, layout) if t.expert >= 0 else -1
        for pp in holding_stages(t, model, layout):
            homes.setdefault((pp, ep), []).append(ti)
        tp = (expert if t.expert >= 0 else dense).tp
        key = (t.rule, t.shape, tp)
        if key not in geometries:
            geometries[key] = [tp_shard(t, model, tp, r) for r in range(tp)]
        by_tp.append(geometries[key])
    by_class: dict[tuple[int, int, int, int], dict[int, Shard]] = {}
    out = []
    for rank in range(layout.world_size):
        key = layout.shard_class(rank)
        held = by_class.get(key)
        if held is None:
            tp, _ep, _replica, pp = dense.place(rank)
            etp, eep, _replica, _pp = expert.place(rank)
            mine = sorted(homes.get((pp, -1), []) + homes.get((pp, eep), []))
            held = by_class[key] = {ti: by_tp[ti][etp if tensors[ti].expert >= 0 else tp] for ti in mine}
        out.append(held)
    return out
