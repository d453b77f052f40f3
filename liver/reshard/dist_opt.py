"""Who owns what under Megatron's distributed optimizer, as data the planners can use.

With ``use_distributed_optimizer`` (ZeRO-1), DDP lays every stage's parameters out in flat buffers
(one per parameter dtype), cut into buckets; each bucket is split into DP-size equal ranges and DP rank
``d`` owns range ``d`` of every bucket: the fp32 master weights and Adam moments of exactly those
elements. So a rank's share of one parameter's optimizer state is a contiguous range of that
parameter's flattened local (TP-sharded) tensor, and a contiguous range of a row-major box is a union
of at most ``2 * ndim - 1`` boxes (:func:`flat_range_boxes`): ownership reduces to the planner's box
algebra and the plan checker proves it like any other shard.

The layout rules are Megatron-core 0.16.1's (``_ParamAndGradBuffer.__init__`` and
``DistributedOptimizer._build_model_gbuf_range``), restated here because the planner is torch-free:

* parameters that need a gradient, grouped by dtype (one buffer each, in order of first appearance),
  in *reverse* ``named_parameters()`` order;
* each parameter starts at a multiple of 64 elements;
* a bucket closes once it holds at least ``bucket_size`` elements (``overlap_grad_reduce`` only; never
  on pipeline stages after the first), and the tied embedding of a pipelined model (``shared_embedding``)
  gets a bucket of its own;
* with virtual pipeline parallelism each model chunk is a DDP of its own (Megatron-LM's ``get_model``):
  its own buffers, in chunk order, each sharded over DP on its own; only the first chunk's close
  buckets by size (the others have ``disable_bucketing``);
* every bucket ends padded to a multiple of ``lcm(dp, 128)`` (``lcm(dp, 128, 2**16)`` with
  ``pad_buckets_for_high_nccl_busbw``), where ``dp`` is the size of the group that shards the buffer:
  DP x CP for dense parameters, expert-DP for the expert buffers (experts with EP > 1 have buffers of
  their own, and a distributed optimizer of their own over expert-DP; at EP 1 they share the dense
  ones); with ``num_distributed_optimizer_instances = k`` that group is ``1/k`` of it (consecutive DP
  ranks), and the ``k`` groups hold the same shards (:func:`shard_group`).

A rule restated can drift, so tests compare :func:`owned_ranges` with the ranges Megatron's own
optimizer computes for presets and user models at many layouts, and every rank checks its real
optimizer against it when it builds one (``worker_runtime/megatron``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from liver.reshard.boxes import Box, intersect
from liver.reshard.views import grid_of, holding_stages, tp_shard
from liver.shared.geometry import DdpSettings, GeometryError, ModelGeometry, TensorSpec
from liver.shared.layout import LayoutError, ParallelLayout

__all__ = [
    "BufferLayout",
    "DdpSettings",
    "OwnedPiece",
    "ParamSlot",
    "buffer_layouts",
    "chunk_parameters",
    "flat_range_boxes",
    "owned_boxes",
    "owned_pieces",
    "owned_ranges",
    "shard_group",
    "stage_parameters",
]

PARAM_ALIGNMENT = 64
BUCKET_ALIGNMENT = 128
HIGH_BUSBW_ALIGNMENT = 2**16


class ParamSlot(NamedTuple):
    """One parameter in a buffer: its flat range ``[start, end)`` and its bucket."""

    name: str  # the parameter (TensorSpec.param)
    start: int
    end: int
    bucket: int


class BufferLayout(NamedTuple):
    """One DDP buffer of a stage: its dtype, its parameters in buffer order and its buckets."""

    dtype: str
    params: tuple[ParamSlot, ...]
    buckets: tuple[tuple[int, int], ...]
    expert: bool = False  # an expert buffer: sharded over expert-DP rather than DP x CP


def stage_parameters(geometry: ModelGeometry, layout: ParallelLayout, pp_rank: int) -> tuple[TensorSpec, ...]:
    """The parameters a rank of stage ``pp_rank`` holds: its model chunks' (:func:`chunk_parameters`),
    chunk after chunk."""
    return tuple(t for v in range(layout.vpp) for t in chunk_parameters(geometry, layout, pp_rank, v))


@functools.lru_cache(maxsize=256)
def _parameters_by_stage(
    geometry: ModelGeometry, layout: ParallelLayout
) -> tuple[tuple[TensorSpec, ...], ...]:
    """Each stage's parameters (those with a gradient, so in a DDP buffer) in the geometry's order:
    the stages of a tensor asked once per world, not once per chunk."""
    stages: list[list[TensorSpec]] = [[] for _ in range(layout.pp)]
    for t in geometry.tensors(optimizer=False):
        if t.role == "buffer":  # no gradient: in no DDP buffer
            continue
        for pp in holding_stages(t, geometry, layout):
            stages[pp].append(t)
    return tuple(tuple(ts) for ts in stages)


@functools.lru_cache(maxsize=4096)
def chunk_parameters(
    geometry: ModelGeometry, layout: ParallelLayout, pp_rank: int, vp_stage: int = 0
) -> tuple[TensorSpec, ...]:
    """The parameters of model chunk ``vp_stage`` of stage ``pp_rank`` (the stage's one model without
    virtual pipelining), in ``named_parameters()`` order: embeddings, the chunk's decoder layers, then
    the last chunk's own parameters and the tied embedding's replica (Megatron's ``output_layer.weight``
    on a last stage that is not also the first; with multi-token prediction the last chunk's own
    ``embedding``, which it builds first). What lives outside the layers is on the first chunk of the
    first stage or the last chunk of the last stage, as Megatron's ``pre_process``/``post_process``
    with ``vp_stage`` place it."""
    last = layout.pp - 1
    if not 0 <= pp_rank < layout.pp:
        raise LayoutError(f"pp_rank {pp_rank}: {layout.describe()} has {layout.pp} pipeline stage(s)")
    if not 0 <= vp_stage < layout.vpp:
        raise LayoutError(
            f"vp_stage {vp_stage}: {layout.describe()} has {layout.vpp} model chunk(s) per stage"
        )
    chunk_layers = layout.chunk_layers(geometry.num_layers, pp_rank)[vp_stage]
    first_chunk, last_chunk = vp_stage == 0, vp_stage == layout.vpp - 1
    first: list[TensorSpec] = []
    layers: list[TensorSpec] = []
    final: list[TensorSpec] = []
    replica: list[TensorSpec] = []
    for t in _parameters_by_stage(geometry, layout)[pp_rank]:
        if t.home == "all":
            raise GeometryError(
                f"{t.name}: a parameter on every pipeline stage has no place in Megatron's buffer order"
            )
        if t.home == "layer":
            if t.layer - 1 in chunk_layers:
                layers.append(t)
        elif t.home == "last_layer":  # with MTP the final norm stays with the last decoder layer
            if geometry.num_layers - 1 in chunk_layers:
                final.append(t)
        elif t.home == "last":
            if last_chunk:
                final.append(t)
        elif t.home == "first+last" and pp_rank == last and pp_rank != 0:
            if last_chunk:
                replica.append(t)
        elif first_chunk:
            first.append(t)
    if geometry.mtp_num_layers:  # the last stage builds the embedding for its MTP layers, first
        return (*replica, *first, *layers, *final)
    return (*first, *layers, *final, *replica)


def _pad(n: int, divisor: int) -> int:
    return math.ceil(n / divisor) * divisor


def buffer_layouts(
    geometry: ModelGeometry,
    layout: ParallelLayout,
    rank: int,
    ddp: DdpSettings | None = None,
) -> tuple[BufferLayout, ...]:
    """The DDP buffers of ``rank`` under ``layout`` (the same on every rank of its DP group), as
    Megatron lays them out with ``ddp`` (default: the geometry's own, whose canonical form drops the
    buckets of the plain optimizer's gradient buffers; module docstring): the dense buffers, then, with
    EP > 1, the expert buffers (Megatron's ``expert_parallel_buffers``, sharded over expert-DP)."""
    c = layout.coords(rank)
    return _buffer_layouts(geometry, layout, c.pp, c.tp, c.ep, c.etp, ddp or geometry.ddp)


def in_expert_buffer(t: TensorSpec, layout: ParallelLayout) -> bool:
    """Whether ``t``'s gradient lives in an expert buffer: an expert's tensor with EP > 1 (Megatron's
    ``allreduce = not (is_expert and ep > 1)``; at EP 1 experts share the dense buffers)."""
    return t.expert >= 0 and layout.ep > 1


@functools.lru_cache(maxsize=4096)
def _buffer_layouts(
    geometry: ModelGeometry,
    layout: ParallelLayout,
    pp_rank: int,
    tp_rank: int,
    ep_rank: int,
    etp_rank: int,
    ddp: DdpSettings,
) -> tuple[BufferLayout, ...]:
    out: list[BufferLayout] = []
    for vp_stage in range(layout.vpp):
        # Megatron-LM wraps each model chunk in a DDP of its own, bucketing only the first.
        bucket_size = ddp.effective_bucket_size(layout.dp, pp_rank) if vp_stage == 0 else None
        params = chunk_parameters(geometry, layout, pp_rank, vp_stage)
        out += _chunk_buffers(geometry, layout, params, tp_rank, ep_rank, etp_rank, ddp, bucket_size)
    return tuple(out)


def _chunk_buffers(
    geometry: ModelGeometry,
    layout: ParallelLayout,
    params: tuple[TensorSpec, ...],
    tp_rank: int,
    ep_rank: int,
    etp_rank: int,
    ddp: DdpSettings,
    bucket_size: int | None,
) -> list[BufferLayout]:
    shared = layout.pp > 1
    by_dtype: dict[tuple[bool, str], list[tuple[TensorSpec, int]]] = {}
    experts_per_rank = geometry.num_experts // layout.ep if geometry.num_experts else 0
    for t in params:
        expert = in_expert_buffer(t, layout)
        if expert:
            if t.expert // experts_per_rank != ep_rank:
                continue
            shard = tp_shard(t, geometry, layout.expert_tp, etp_rank)
        else:
            shard = tp_shard(t, geometry, layout.tp, tp_rank)
        by_dtype.setdefault((expert, t.dtype), []).append((t, math.prod(shard.local_shape)))
    out = []
    for expert in (False, True):
        group = layout.grid(expert).replicas // ddp.instances
        divisor = math.lcm(group, BUCKET_ALIGNMENT)
        if ddp.pad_buckets_for_high_nccl_busbw:
            divisor = math.lcm(divisor, HIGH_BUSBW_ALIGNMENT)
        for (kind, dtype), sized in by_dtype.items():
            if kind == expert:
                buffer = _one_buffer(dtype, sized, bucket_size, shared, ddp.distributed_optimizer, divisor)
                out.append(buffer._replace(expert=expert))
    return out


def _one_buffer(
    dtype: str,
    params: list[tuple[TensorSpec, int]],
    bucket_size: int | None,
    shared_embeddings: bool,
    distributed: bool,
    divisor: int,
) -> BufferLayout:
    slots: list[ParamSlot] = []
    buckets: list[tuple[int, int]] = []
    bucket_start = 0
    start = 0
    in_bucket = 0
    end = 0

    def close(param_end: int) -> int:
        nonlocal bucket_start, in_bucket
        bucket_end = _pad(param_end, divisor) if distributed else param_end
        buckets.append((bucket_start, bucket_end))
        bucket_start = bucket_end
        in_bucket = 0
        return bucket_end

    for t, numel in reversed(params):
        own_bucket = distributed and shared_embeddings and t.home == "first+last"
        if distributed:
            start = _pad(start, PARAM_ALIGNMENT)
        if own_bucket and in_bucket:
            start = close(start)
        end = start + numel
        slots.append(ParamSlot(t.param, start, end, len(buckets)))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    return BufferLayout(dtype, tuple(slots), tuple(buckets))


def shard_group(geometry: ModelGeometry, replicas: int) -> int:
    """How many ranks of ``replicas`` (DP x CP, or expert-DP) the distributed optimizer shards a buffer
    over: consecutive replica indices, ``replicas / k`` of them with ``k`` instances; replica ``r``
    owns what ``r`` modulo that size owns, ``k`` owners per piece."""
    return replicas // geometry.ddp.instances


def owned_ranges(geometry: ModelGeometry, layout: ParallelLayout, rank: int) -> dict[str, tuple[int, int]]:
    """The range of each parameter's flattened local tensor whose optimizer state ``rank`` owns, by
    parameter name; parameters of its stage that it owns nothing of are absent."""
    if not geometry.distributed:
        raise GeometryError("ddp.distributed_optimizer: ownership ranges exist only for it")
    out: dict[str, tuple[int, int]] = {}
    for buffer in buffer_layouts(geometry, layout, rank):
        group = shard_group(geometry, layout.grid(buffer.expert).replicas)
        share = layout.grid(buffer.expert).place(rank)[2] % group
        for slot in buffer.params:
            lo, hi = buffer.buckets[slot.bucket]
            size = (hi - lo) // group
            own_lo = lo + share * size
            a, b = max(slot.start, own_lo), min(slot.end, own_lo + size)
            if a < b:
                out[slot.name] = (a - slot.start, b - slot.start)
    return out


class OwnedPiece(NamedTuple):
    """One box of a rank's owned range of a parameter's optimizer state."""

    box: Box  # global logical indices (vocabulary padding rows left out)
    local_shape: tuple[int, ...]  # the piece in the rank's flat range, viewed as a box (padding included)
    offset: int  # where the piece starts in the rank's owned flat range


@functools.lru_cache(maxsize=8192)
def owned_pieces(
    geometry: ModelGeometry, layout: ParallelLayout, rank: int
) -> Mapping[str, tuple[OwnedPiece, ...]]:
    """What ``rank`` owns of each parameter's optimizer state (master weights, Adam moments), by
    parameter name: its owned flat range of the local tensor cut into boxes (:func:`flat_range_boxes`)
    and moved to the TP shard's place. Pieces wholly in vocabulary padding hold no state and are left
    out, so a parameter the rank owns only padding of is absent. Computed once per rank and layout
    (every holding of a rank asks for it) and read-only."""
    coords = layout.coords(rank)
    specs = {t.param: t for t in stage_parameters(geometry, layout, coords.pp)}
    out: dict[str, tuple[OwnedPiece, ...]] = {}
    for name, (lo, hi) in owned_ranges(geometry, layout, rank).items():
        t = specs[name]
        grid = grid_of(t, layout)
        shard = tp_shard(t, geometry, grid.tp, grid.place(rank)[0])
        if shard.box is None:
            continue
        pieces = []
        offset = 0
        for local in flat_range_boxes(shard.local_shape, lo, hi):
            placed = intersect(tuple((a + o, b + o) for (a, b), (o, _) in zip(local, shard.box)), shard.box)
            extent = tuple(b - a for a, b in local)
            if placed is not None:
                pieces.append(OwnedPiece(placed, extent, offset))
            offset += math.prod(extent)
        if pieces:
            out[name] = tuple(pieces)
    return MappingProxyType(out)


@functools.lru_cache(maxsize=8192)
def owned_boxes(geometry: ModelGeometry, layout: ParallelLayout, rank: int) -> Mapping[str, tuple[Box, ...]]:
    """The global boxes of :func:`owned_pieces`, by parameter name (read-only, computed once)."""
    return MappingProxyType(
        {name: tuple(p.box for p in pieces) for name, pieces in owned_pieces(geometry, layout, rank).items()}
    )


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> tuple[Box, ...]:
    """The boxes, in flat order, whose union is elements ``[lo, hi)`` of a row-major ``shape``: at most
    ``2 * ndim - 1`` of them, each contiguous in the flattening."""
    total = math.prod(shape)
    if not 0 <= lo <= hi <= total:
        raise ValueError(f"range [{lo}, {hi}) is not within the {total} elements of {shape}")
    if lo == hi:
        return ()
    if not shape:
        return ((),)
    return tuple(_boxes(shape, lo, hi))


def _boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Split ``[lo, hi)`` along the outermost dimension: a partial head row, whole rows, a partial tail."""
    if len(shape) == 1:
        return [((lo, hi),)]
    inner = math.prod(shape[1:])
    inner_full = tuple((0, n) for n in shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return [
            ((first, first + 1), *sub) for sub in _boxes(shape[1:], lo - first * inner, hi - first * inner)
        ]
    out: list[Box] = []
    head_lo = lo - first * inner
    if head_lo:
        out += [((first, first + 1), *sub) for sub in _boxes(shape[1:], head_lo, inner)]
        first += 1
    tail_hi = hi - last * inner
    whole_end = last + 1 if tail_hi == inner else last
    if whole_end > first:
        out.append(((first, whole_end), *inner_full))
    if tail_hi != inner:
        out += [((last, last + 1), *sub) for sub in _boxes(shape[1:], 0, tail_hi)]
    return out
