"""Per-geometry intersection templates shared by the planner and the placement optimiser.

Every decoder layer of a model has the same tensors, and every parameter's optimizer states share its
sharding, so a 175B model's ~4,600 tensors have only a handful of distinct geometries (rule, shape,
vocabulary padding). Intersections are computed once per geometry and (old TP rank, new TP rank); the
planner then stamps them onto layers and pipeline stages. Work grows with non-empty intersections, not
with old ranks times new ranks.
"""

from __future__ import annotations

import functools

from liver.reshard.boxes import Box, intersect, volume
from liver.reshard.views import tp_shard
from liver.shared.geometry import ModelGeometry, TensorSpec

ANY = -1
"""Candidate key of a piece that every old TP rank holds (a replicated tensor): any of them can send it."""


def new_shard_pieces(
    t: TensorSpec, model: ModelGeometry, tp_old: int, tp_new: int, tp_rank_new: int
) -> tuple[tuple[int, Box], ...]:
    """The pieces of new TP rank ``tp_rank_new``'s shard of ``t``, each with the old TP rank that holds
    it (or :data:`ANY` when every old TP rank holds it)."""
    return _pieces(t.rule, t.shape, model, tp_old, tp_new, tp_rank_new)


def _probe(rule: str, shape: tuple[int, ...]) -> TensorSpec:
    """A stand-in tensor with only the geometry the view rules read."""
    return TensorSpec("", 0, shape, "float32", "param", rule, "layer", "")  # type: ignore[arg-type]


@functools.lru_cache(maxsize=4096)
def _pieces(
    rule: str, shape: tuple[int, ...], model: ModelGeometry, tp_old: int, tp_new: int, tp_rank_new: int
) -> tuple[tuple[int, Box], ...]:
    t = _probe(rule, shape)
    new = tp_shard(t, model, tp_new, tp_rank_new).box
    if new is None:
        return ()
    if t.rule == "replicated" and tp_old > 1:
        return ((ANY, new),)
    out = []
    for r in range(tp_old):
        old = tp_shard(t, model, tp_old, r).box
        if old is None:
            continue
        common = intersect(old, new)
        if common is not None:
            out.append((r, common))
    return tuple(out)


def overlap_bytes(
    t: TensorSpec, model: ModelGeometry, tp_old: int, tp_new: int
) -> tuple[tuple[int, ...], ...]:
    """``[old tp rank][new tp rank]``: bytes of the new shard already held by the old shard."""
    return _overlap(t.rule, t.shape, t.itemsize, model, tp_old, tp_new)


@functools.lru_cache(maxsize=4096)
def _overlap(
    rule: str, shape: tuple[int, ...], itemsize: int, model: ModelGeometry, tp_old: int, tp_new: int
) -> tuple[tuple[int, ...], ...]:
    t = _probe(rule, shape)
    rows = []
    for r in range(tp_old):
        old = tp_shard(t, model, tp_old, r).box
        row = []
        for q in range(tp_new):
            new = tp_shard(t, model, tp_new, q).box
            common = None if old is None or new is None else intersect(old, new)
            row.append(0 if common is None else volume(common) * itemsize)
        rows.append(tuple(row))
    return tuple(rows)


def shard_bytes(t: TensorSpec, model: ModelGeometry, tp: int, tp_rank: int) -> int:
    return _shard_elems(t.rule, t.shape, model, tp, tp_rank) * t.itemsize


@functools.lru_cache(maxsize=4096)
def _shard_elems(rule: str, shape: tuple[int, ...], model: ModelGeometry, tp: int, tp_rank: int) -> int:
    box = tp_shard(_probe(rule, shape), model, tp, tp_rank).box
    return 0 if box is None else volume(box)
