"""Peer redundancy: which state of a world dies with one node, and which process keeps a copy of it.

A loss without notice is recovered live only from state that survives it. State that a replica on
another node holds (DP, CP, expert-DP replicas of a shard) survives; what does not is what only one
node has: under Megatron's distributed optimizer each DP rank owns a shard of the master weights and
Adam moments that no other process holds, and a DP=1 job's every shard is held once. For that state a
process keeps a copy of a peer's in host memory (``docs/architecture.md``, "Peer redundancy"); this
module decides, from the model and the world alone (no torch), what needs one and who keeps it, so the
workers, the transfer planner and the topology planner agree without a message.

* :func:`copied_tensors`: the tensors a rank must have copied: those of which every holder of its piece
  (its replicas, and for the distributed optimizer the ranks that own alike: the TP ranks of a
  TP-replicated tensor, both stages of a tied embedding) runs on its node. Of several such holders on
  one node only the lowest rank's piece is copied: one copy per piece.
* :func:`copy_keepers`: for each rank with something to copy, the rank that keeps the copy: the one at
  the same position on the next node (nodes in the placement's order of first appearance, cyclic), so
  that a node's copies are spread over another node and every process keeps at most one copy when the
  nodes are of equal size. A world on one node keeps copies on the next process of the node: they
  survive the loss of a process, not of the node.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from liver.reshard.dist_opt import owned_pieces, shard_group
from liver.reshard.holdings import holding, is_dp_sharded
from liver.reshard.views import grid_of, holding_stages, view
from liver.shared.geometry import ModelGeometry, TensorSpec
from liver.shared.layout import ParallelLayout, Placement

NO_KEEPER = -1
"""In :attr:`Redundancy.keepers`: the rank has nothing to copy (every piece it holds survives elsewhere)."""


class Redundancy(NamedTuple):
    """Who copies what to whom in one world (see the module docstring)."""

    copied: tuple[tuple[int, ...], ...]
    """Per rank, the indices (into ``model.tensors(optimizer=True)``) of the tensors whose pieces it has
    copied to its keeper, in tensor order."""
    keepers: tuple[int, ...]
    """Per rank, the rank that keeps its copy (:data:`NO_KEEPER`: none needed)."""
    copy_bytes: tuple[int, ...]
    """Per rank, the bytes of its own copied pieces (what it sends at every refresh)."""
    kept_bytes: tuple[int, ...]
    """Per rank, the host memory the copies it keeps take (one complete copy and one being refreshed)."""
    survives_node_loss: bool
    """Whether the copies and the replicas together survive the loss of any one node (``False`` on a
    one-node world: its copies survive the loss of a process only)."""

    def sources(self, rank: int) -> tuple[int, ...]:
        """The ranks whose copies ``rank`` keeps."""
        return tuple(r for r, keeper in enumerate(self.keepers) if keeper == rank)


def alike_holders(tensor: TensorSpec, model: ModelGeometry, layout: ParallelLayout, rank: int) -> list[int]:
    """The ranks that hold the same piece of ``tensor`` as ``rank`` (``rank`` included): its replicas
    for replicated state; for state the distributed optimizer shards over DP the ranks that own alike
    (the same share: the TP ranks of a TP-replicated tensor, every stage of a tied embedding, and the
    rank at the same place in each other instance of the optimizer)."""
    return _alike(_kind(tensor, model, layout), rank)


def _kind(tensor: TensorSpec, model: ModelGeometry, layout: ParallelLayout) -> tuple:
    """What the ranks that hold alike depend on: the grid, TP-replicated or not, the group the
    distributed optimizer shards it over (0: not DP-sharded), and the stages."""
    grid = grid_of(tensor, layout)
    return (
        grid,
        tensor.rule == "replicated",
        shard_group(model, grid.replicas) if is_dp_sharded(tensor, model) else 0,
        holding_stages(tensor, model, layout),
    )


def _nodes(placement: Placement) -> list[str]:
    return [d.node for d in placement.devices]


def copied_tensors(
    model: ModelGeometry, layout: ParallelLayout, placement: Placement, rank: int
) -> tuple[int, ...]:
    """The tensors whose pieces ``rank`` copies to its keeper (see the module docstring)."""
    return _copied(model, layout, placement)[rank]


@functools.lru_cache(maxsize=256)
def copied_set(
    model: ModelGeometry, layout: ParallelLayout, placement: Placement, rank: int
) -> frozenset[int]:
    """:func:`copied_tensors` as a set: what the planner and the checker ask of every slice."""
    return frozenset(_copied(model, layout, placement)[rank])


@functools.lru_cache(maxsize=32)
def _copied(
    model: ModelGeometry, layout: ParallelLayout, placement: Placement
) -> tuple[tuple[int, ...], ...]:
    node = _nodes(placement)
    single = len(set(node)) == 1
    tensors = model.tensors(optimizer=True)
    # Which ranks hold alike depends on a tensor only through its grid, whether it is TP-replicated or
    # DP-sharded, and its stages: the verdict is asked once per such kind and rank, not per tensor
    # (a 1,024-rank world of a large model holds half a million rank-tensor pairs).
    kinds: dict[tuple, int] = {}
    kind_of: list[int] = []
    shapes: list[tuple] = []
    for t in tensors:
        shape = _kind(t, model, layout)
        kind_of.append(kinds.setdefault(shape, len(kinds)))
        if len(shapes) < len(kinds):
            shapes.append(shape)
    on_stage: list[list[int]] = [[] for _ in range(layout.pp)]
    for ti, kind in enumerate(kind_of):
        for pp in shapes[kind][3]:
            on_stage[pp].append(ti)
    dense = layout.grid(expert=False)
    out: list[list[int]] = [[] for _ in range(layout.world_size)]
    verdicts: dict[tuple[int, int, int, int], tuple[int, int, bool]] = {}
    # Ranks of one shard class view the same tensors, grouped by kind once per class; of the state the
    # distributed optimizer shards, each DP rank holds the tensors its own range of the buffers covers.
    viewed: dict[tuple[int, int, int, int], dict[int, list[int]]] = {}
    for rank in range(layout.world_size):
        key = layout.shard_class(rank)
        mine = viewed.get(key)
        if mine is None:
            mine = viewed[key] = {}
            for ti in on_stage[dense.place(rank)[3]]:
                if view(tensors[ti], model, layout, rank) is not None:
                    mine.setdefault(kind_of[ti], []).append(ti)
        if model.distributed:
            owned = owned_pieces(model, layout, rank)
            mine = {
                kind: [ti for ti in tis if owned.get(tensors[ti].param)] if shapes[kind][2] else tis
                for kind, tis in mine.items()
            }
        for kind, tis in mine.items():
            grid, replicated, sharded_over, _stages = shapes[kind]
            tp, ep, replica, _pp = grid.place(rank)
            # The ranks that share these coordinates share one set of alike holders.
            group = (kind, -1 if replicated else tp, ep, replica % sharded_over if sharded_over else -1)
            verdict = verdicts.get(group)
            if verdict is None:
                alike = _alike(shapes[kind], rank)
                verdict = verdicts[group] = (len(alike), min(alike), len({node[r] for r in alike}) == 1)
            count, lowest, one_node = verdict
            if single:  # only a process's loss can be survived: copy what no other process holds
                copy = count == 1
            else:  # dies with this node; its lowest holder copies it
                copy = lowest == rank and one_node
            if copy:
                out[rank].extend(tis)
    return tuple(tuple(sorted(ts)) for ts in out)


def _alike(shape: tuple, rank: int) -> list[int]:
    """:func:`alike_holders` of every tensor of one kind (grid, replicated, shard group, stages)."""
    grid, replicated, group, stages = shape
    tp, ep, replica, _pp = grid.place(rank)
    tps = range(grid.tp) if replicated else (tp,)
    # DP-sharded: the ranks that own the same share, one per instance of the distributed optimizer.
    replicas = range(replica % group, grid.replicas, group) if group else range(grid.replicas)
    return [grid.rank(q, ep, r, pp) for pp in stages for q in tps for r in replicas]


def copy_keepers(placement: Placement, needs: tuple[bool, ...]) -> tuple[int, ...]:
    """For each rank that ``needs`` a copy kept, the rank at its position on the next node (cyclic, the
    position taken modulo that node's size); one node: the next rank of the node. :data:`NO_KEEPER`
    for the others, and for a world of one process (nobody can keep its copy)."""
    node = _nodes(placement)
    order = list(dict.fromkeys(node))
    ranks_on: dict[str, list[int]] = {n: [] for n in order}
    for r, n in enumerate(node):
        ranks_on[n].append(r)
    out = []
    for r, n in enumerate(node):
        if not needs[r] or len(node) == 1:
            out.append(NO_KEEPER)
            continue
        if len(order) == 1:
            out.append((r + 1) % len(node))
            continue
        position = ranks_on[n].index(r)
        target = ranks_on[order[(order.index(n) + 1) % len(order)]]
        out.append(target[position % len(target)])
    return tuple(out)


def _piece_bytes(tensor: TensorSpec, model: ModelGeometry, layout: ParallelLayout, rank: int) -> int:
    pieces = holding(tensor, model, layout, rank) or ()
    return sum(math.prod(p.local_shape) * tensor.itemsize for p in pieces)


@functools.lru_cache(maxsize=32)
def redundancy(model: ModelGeometry, layout: ParallelLayout, placement: Placement) -> Redundancy:
    """What every rank of the world copies, to whom, and what that costs in host memory."""
    copied = _copied(model, layout, placement)
    keepers = copy_keepers(placement, tuple(bool(c) for c in copied))
    tensors = model.tensors(optimizer=True)
    copy_bytes = tuple(
        sum(_piece_bytes(tensors[ti], model, layout, r) for ti in ts) for r, ts in enumerate(copied)
    )
    kept = [0] * layout.world_size
    for r, keeper in enumerate(keepers):
        if keeper != NO_KEEPER:
            kept[keeper] += 2 * copy_bytes[r]  # double-buffered: the last complete copy and the next
    nodes = _nodes(placement)
    single = len(set(nodes)) == 1
    covered = all(k != NO_KEEPER for k, c in zip(keepers, copied) if c)
    return Redundancy(copied, keepers, copy_bytes, tuple(kept), covered and not single)


def own_copy_bytes(model: ModelGeometry, layout: ParallelLayout, placement: Placement) -> tuple[int, ...]:
    """Per rank, the host memory of its own copies when copies go back a step (``CopyOptions.go_back``):
    a rank that sends a copy keeps its whole state as its last two refreshes read it; 0 for the others."""
    keepers = redundancy(model, layout, placement).keepers
    if all(keeper == NO_KEEPER for keeper in keepers):
        return (0,) * layout.world_size
    return tuple(0 if k == NO_KEEPER else 2 * held for k, held in zip(keepers, _held_bytes(model, layout)))


def _held_bytes(model: ModelGeometry, layout: ParallelLayout) -> list[int]:
    """Per rank, the bytes of all the state it holds: what it replicates per shard class, and of the
    state the distributed optimizer shards, what its own range of the buffers covers."""
    tensors = model.tensors(optimizer=True)
    on_stage: list[list[TensorSpec]] = [[] for _ in range(layout.pp)]
    sharded_itemsize: dict[str, int] = {}  # a parameter's DP-sharded state: bytes per element
    for t in tensors:
        if is_dp_sharded(t, model):
            sharded_itemsize[t.param] = sharded_itemsize.get(t.param, 0) + t.itemsize
            continue
        for pp in holding_stages(t, model, layout):
            on_stage[pp].append(t)
    dense = layout.grid(expert=False)
    per_class: dict[tuple[int, int, int, int], int] = {}
    out = []
    for rank in range(layout.world_size):
        key = layout.shard_class(rank)
        if key not in per_class:
            per_class[key] = sum(_piece_bytes(t, model, layout, rank) for t in on_stage[dense.place(rank)[3]])
        held = per_class[key]
        if model.distributed:
            for param, pieces in owned_pieces(model, layout, rank).items():
                held += sum(math.prod(p.local_shape) for p in pieces) * sharded_itemsize.get(param, 0)
        out.append(held)
    return out
