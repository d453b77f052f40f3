"""The baseline for ``liver bench plan``: torch.distributed.checkpoint's load-time resharding.

A checkpoint-and-restart resize saves the old world with DCP and loads it into the new one. At load
time every new rank runs ``DefaultLoadPlanner.create_local_plan``, which (for a flat state dict) is
``create_default_local_load_plan``: for each of the rank's tensors, DCP's sweep-line
``create_read_items_for_chunk_list`` turns the saved chunks that overlap the rank's local chunk into
``ReadItem`` s. That overlap computation is what the LiveR planner replaces, so it is what we time.

The metadata is what a DCP save of the old world would have written, derived from LiveR's view
function on the same logical tensors the planner uses (SwiGLU's fc1 as ``[2, ffn, hidden]``, vocabulary
tensors without padding rows): one ``TensorStorageMetadata`` per tensor, one ``ChunkStorageMetadata``
per distinct old shard. Data-parallel replicas hold the same box, so they collapse to one chunk, as
DCP's save-plan dedup keeps one write item per (fqn, offset); the kept chunks appear in order of the
lowest old rank that holds them, as in DCP's global save plan.

Each new rank's state dict holds one stand-in per tensor it needs, answering what DCP asks a value
during load planning (``size()`` and ``__create_chunk_list__()``, the protocol DTensor implements), so
no 175B-parameter tensor is ever allocated. Everything is built before the clock starts; only DCP's own
function runs while it ticks. Read items are counted, and their bytes summed, outside the timed calls.

Data-parallel replicas of the new world run identical computations (same keys, same chunks). Ranks are
timed replica by replica (every (stage, TP rank) of replica 0, then of replica 1, ...); when a time
budget runs out after some complete replicas, the total is extrapolated linearly by
``dp / replicas timed``, which is exact in expectation because the remaining replicas repeat the work.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import msgspec
import torch
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from liver.reshard.boxes import Box
from liver.reshard.plan import WorldConfig
from liver.reshard.views import view
from liver.shared.model import ModelSpec, TensorSpec

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}


class LocalShards:
    """A state-dict value as DCP's load planner sees it: a global size and the local chunks."""

    __slots__ = ("_chunks", "_size")

    def __init__(self, size: torch.Size, chunks: list[ChunkStorageMetadata]) -> None:
        self._size = size
        self._chunks = chunks

    def size(self) -> torch.Size:
        return self._size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks


@dataclass(frozen=True)
class DcpWorkload:
    """The saved checkpoint's metadata and every new rank's state dict, built before timing."""

    metadata: Metadata
    state_dicts: tuple[dict[str, LocalShards], ...]  # by new rank; DP replicas share one dict
    itemsize: dict[str, int]  # fqn -> bytes per element, to size the read items afterwards
    saved_chunks: int
    local_chunks: int


class DcpResult(msgspec.Struct, frozen=True, kw_only=True):
    """What DCP's load planning computed for the whole new world, and how long it took."""

    seconds: float  # all new ranks, one after another (extrapolated when ``extrapolated``)
    busiest_rank_seconds: float  # the rank with the most work (median over its DP replicas, so that a
    # scheduler hiccup on a shared machine does not pose as work): DCP's wall time when ranks plan in parallel
    read_items: int  # ReadItems over all new ranks (each one non-empty overlap of saved and local chunk)
    read_bytes: int  # bytes those read items cover: the whole new state when the overlaps are right
    saved_chunks: int
    local_chunks: int
    ranks_total: int
    ranks_timed: int
    extrapolated: bool


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(
        offsets=torch.Size(lo for lo, _ in box), sizes=torch.Size(hi - lo for lo, hi in box)
    )


def saved_metadata(model: ModelSpec, tensors: tuple[TensorSpec, ...], old: WorldConfig) -> Metadata:
    """The metadata a deduplicated DCP save of the old world writes (see the module docstring)."""
    lay = old.layout
    ranks = list(lay.class_representatives().values())
    md: dict[str, TensorStorageMetadata] = {}
    for t in tensors:
        boxes: dict[Box, None] = {}
        for rank in ranks:
            shard = view(t, model, lay, rank)
            if shard is not None and shard.box is not None:
                boxes.setdefault(shard.box, None)
        md[t.name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=_TORCH_DTYPES[t.dtype]),
            size=torch.Size(t.shape),
            chunks=[_chunk(b) for b in boxes],
        )
    return Metadata(state_dict_metadata=md)


def build_workload(
    model: ModelSpec, tensors: tuple[TensorSpec, ...], old: WorldConfig, new: WorldConfig
) -> DcpWorkload:
    """Metadata of the old world's save and the state dict each new rank loads into."""
    metadata = saved_metadata(model, tensors, old)
    lay = new.layout
    per_class: dict[tuple[int, int, int, int], dict[str, LocalShards]] = {}
    for key, rank in lay.class_representatives().items():
        sd: dict[str, LocalShards] = {}
        for t in tensors:
            shard = view(t, model, lay, rank)
            if shard is not None and shard.box is not None:
                sd[t.name] = LocalShards(torch.Size(t.shape), [_chunk(shard.box)])
        per_class[key] = sd
    state_dicts = tuple(per_class[lay.shard_class(r)] for r in range(lay.world_size))
    saved = sum(len(m.chunks) for m in metadata.state_dict_metadata.values())
    local = sum(len(sd) for sd in state_dicts)
    itemsize = {t.name: t.itemsize for t in tensors}
    return DcpWorkload(metadata, state_dicts, itemsize, saved, local)


def time_load_planning(
    workload: DcpWorkload, new: WorldConfig, budget_seconds: float = math.inf
) -> DcpResult:
    """Run DCP's local load planning for every new rank (replica by replica, see the module docstring:
    a replica is the ranks of one DP x CP index).

    The workload holds every rank's state dict while a real rank holds one: callers timing a large world
    should ``gc.freeze()`` after building it, so that collections walk only what DCP allocates.
    """
    if not budget_seconds > 0:
        raise ValueError(f"budget_seconds must be positive, got {budget_seconds}")
    lay = new.layout
    md = workload.metadata
    dense = lay.grid(expert=False)
    by_replica: list[list[int]] = [[] for _ in range(dense.replicas)]
    for r in range(lay.world_size):
        by_replica[dense.place(r)[2]].append(r)
    elapsed = 0.0
    per_class: dict[tuple[int, int, int, int], list[float]] = {}
    items = 0
    nbytes = 0
    timed = 0
    replicas = 0
    for ranks in by_replica:
        for rank in ranks:
            sd = workload.state_dicts[rank]
            t0 = time.perf_counter()
            plan = create_default_local_load_plan(sd, md, True)
            dt = time.perf_counter() - t0
            elapsed += dt
            per_class.setdefault(lay.shard_class(rank), []).append(dt)
            timed += 1
            items += len(plan.items)
            nbytes += _read_bytes(plan.items, workload.itemsize)
        replicas += 1
        if elapsed > budget_seconds:
            break
    scale = dense.replicas / replicas
    return DcpResult(
        seconds=elapsed * scale,
        busiest_rank_seconds=max(statistics.median(ts) for ts in per_class.values()),
        read_items=round(items * scale),
        read_bytes=round(nbytes * scale),
        saved_chunks=workload.saved_chunks,
        local_chunks=workload.local_chunks,
        ranks_total=lay.world_size,
        ranks_timed=timed,
        extrapolated=replicas < dense.replicas,
    )


def _read_bytes(items: list[ReadItem], itemsize: dict[str, int]) -> int:
    return sum(math.prod(it.lengths) * itemsize[it.dest_index.fqn] for it in items)
