"""Independent verification of a transfer plan.

It recomputes every view from the model and layouts (it trusts nothing the planner computed) and proves:

1. every slice a task sends lies inside what its source rank holds under the old layout;
2. every slice lies inside what its destination holds under the new layout;
3. the slices a new rank receives for a tensor cover its box exactly once (no gap, no overlap);
4. a task is ``local`` exactly when source and destination run on the same device;
5. no new rank receives more than the staging budget over the network in one streaming round;
6. given the devices that are lost (gone before the handoff), no task sends from one or delivers to
   one: a plan that reads a lost device's memory would hang or fail mid-transfer;
7. one task at most per (layer, round, source, destination): the executor pairs one message per
   source and destination in a round.

The worker runtime can run it on its own part of a plan before executing it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection

import msgspec

from liver.shared.boxes import Box, contains, disjoint_cover, volume
from liver.shared.geometry import ModelGeometry, TensorSpec
from liver.shared.holdings import Holding, holding, is_dp_sharded
from liver.shared.layout import Device, ParallelLayout
from liver.shared.plan import Plan, Slice, TransferTask
from liver.shared.views import expert_rank, grid_of, holding_stages, tp_shard


class VerifyReport(msgspec.Struct, frozen=True):
    ok: bool
    errors: tuple[str, ...]
    shards_checked: int
    slices_checked: int


class _Views:
    """Every tensor's holding on every rank, computed as needed: tensors that share a geometry share
    one computation (a replica per TP rank and stage, expert-TP rank for an expert's tensor), and only
    the distributed optimizer's DP-sharded state is per rank (:mod:`liver.shared.holdings`)."""

    def __init__(self, model: ModelGeometry, layout: ParallelLayout, tensors: tuple[TensorSpec, ...]) -> None:
        self.model = model
        self.layout = layout
        self.tensors = tensors
        self.place = {
            expert: [layout.grid(expert).place(r) for r in range(layout.world_size)]
            for expert in (False, True)
        }
        geometry: dict[tuple, list[Holding | None]] = {}
        self.stages: list[frozenset[int]] = []
        self.ep: list[int] = []
        self.shards: list[list[Holding | None] | None] = []
        # Tensor indices by (stage, EP rank or -1 for dense): a rank need only look at its own.
        self.by_home: dict[tuple[int, int], list[int]] = defaultdict(list)
        for ti, t in enumerate(tensors):
            self.stages.append(frozenset(holding_stages(t, model, layout)))
            self.ep.append(expert_rank(t, model, layout))
            for pp in self.stages[-1]:
                self.by_home[(pp, self.ep[-1] if t.expert >= 0 else -1)].append(ti)
            if is_dp_sharded(t, model):
                self.shards.append(None)
                continue
            tp = grid_of(t, layout).tp
            key = (t.rule, t.shape, tp)
            if key not in geometry:
                geometry[key] = [(tp_shard(t, model, tp, r),) for r in range(tp)]
            self.shards.append(geometry[key])
        self.owned: dict[tuple[int, int], Holding | None] = {}

    def of(self, ti: int, rank: int) -> Holding | None:
        tp, ep, _replica, pp = self.place[self.tensors[ti].expert >= 0][rank]
        if pp not in self.stages[ti] or ep != self.ep[ti]:
            return None
        per_tp = self.shards[ti]
        if per_tp is not None:
            return per_tp[tp]
        key = (ti, rank)
        if key not in self.owned:
            self.owned[key] = holding(self.tensors[ti], self.model, self.layout, rank)
        return self.owned[key]

    def candidates(self, rank: int) -> list[int]:
        """The indices of the tensors ``rank`` may hold (its stage's, its EP rank's experts), in order."""
        _etp, ep, _r, pp = self.place[True][rank]
        return sorted(self.by_home.get((pp, -1), []) + self.by_home.get((pp, ep), []))

    def class_of(self, rank: int) -> tuple[int, ...]:
        """Ranks with one class hold the same of every tensor: (TP rank, expert-TP and EP rank, stage),
        and the rank itself when DP ranks hold different pieces."""
        if self.model.distributed:
            return (rank,)
        tp, _ep, _r, pp = self.place[False][rank]
        etp, ep, _r, _pp = self.place[True][rank]
        return (tp, etp, ep, pp)


def _within(pieces: Holding | None, box: Box) -> bool:
    return pieces is not None and any(p.box is not None and contains(p.box, box) for p in pieces)


class _Enough(Exception):
    """Raised once ``max_errors`` reasons are collected: more would only repeat them."""


def verify_plan(plan: Plan, max_errors: int = 20, lost: Collection[Device] = ()) -> VerifyReport:
    """Check ``plan`` against the views of its own model and layouts, and against the ``lost`` devices;
    see the module docstring."""
    errors: list[str] = []
    counts = [0, 0]  # shards, slices checked

    def fail(msg: str) -> None:
        errors.append(msg)
        if len(errors) >= max_errors:
            raise _Enough

    try:
        _check(plan, fail, counts, frozenset(lost))
    except _Enough:
        pass
    except ValueError as exc:  # the plan's own model and layouts disagree
        errors.append(str(exc))
    return VerifyReport(not errors, tuple(errors), counts[0], counts[1])


def _check(plan: Plan, fail: Callable[[str], None], counts: list[int], lost: frozenset[Device]) -> None:
    model = plan.model
    model.check_layout(plan.old.layout)
    model.check_layout(plan.new.layout)
    if plan.tensors != model.tensors(optimizer=any(t.role == "step" for t in plan.tensors)):
        fail("the plan's tensor list does not match its model")
        return
    old_v = _Views(model, plan.old.layout, plan.tensors)
    new_v = _Views(model, plan.new.layout, plan.tensors)
    old_dev, new_dev = plan.old.placement.devices, plan.new.placement.devices
    # Plans share slice tuples between DP replicas and layers of the same shape; a check of the same
    # tuple between ranks of the same (TP rank, stage) classes gives the same answer, so it runs once.
    memo: dict[tuple[int, ...], int | None] = {}
    for rank, device in enumerate(new_dev):
        if device in lost:
            fail(f"new rank {rank} is placed on lost device {device}")
    incoming: dict[int, list[tuple[Slice, ...]]] = defaultdict(list)
    round_bytes: dict[tuple[int, int, int], int] = defaultdict(int)
    messages: set[tuple[int, int, int, int]] = set()
    for task in plan.tasks:
        where = f"task layer {task.layer} round {task.round} {task.src}->{task.dst}"
        if not (0 <= task.src < len(old_dev) and 0 <= task.dst < len(new_dev)):
            fail(f"{where}: rank outside the worlds")
            continue
        message = (task.layer, task.round, task.src, task.dst)
        if message in messages:
            fail(f"{where}: a second task between the same ranks in the same round (one message each)")
        messages.add(message)
        if task.local != (old_dev[task.src] == new_dev[task.dst]):
            fail(f"{where}: local={task.local} does not match the devices")
        if lost and old_dev[task.src] in lost:
            fail(f"{where}: source rank {task.src} is on lost device {old_dev[task.src]}")
        key = (id(task.slices), *old_v.class_of(task.src), -1, *new_v.class_of(task.dst))
        nbytes = memo.get(key, -1)
        if nbytes is None or nbytes < 0:
            nbytes = memo[key] = _check_slices(plan, task, old_v, new_v, where, fail)
        counts[1] += len(task.slices)
        if nbytes is None:
            continue
        if nbytes != task.nbytes:
            fail(f"{where}: nbytes is {task.nbytes} but the slices hold {nbytes}")
        incoming[task.dst].append(task.slices)
        if not task.local:
            round_bytes[(task.layer, task.round, task.dst)] += nbytes
    covered: dict[tuple, list[str]] = {}
    for rank in range(len(new_dev)):
        parts = incoming.get(rank, [])
        key = (*new_v.class_of(rank), tuple(sorted(map(id, parts))))
        if key not in covered:
            covered[key] = _check_cover(plan, new_v, rank, parts, counts)
        else:
            counts[0] += covered[key].count("")
        for reason in covered[key]:
            if reason:
                fail(f"new rank {rank}: {reason}")
    for (layer, rnd, dst), nbytes in round_bytes.items():
        if nbytes > plan.budget_bytes:
            fail(
                f"new rank {dst} receives {nbytes} bytes in layer {layer} round {rnd}, "
                f"over the staging budget {plan.budget_bytes}"
            )


def _check_slices(
    plan: Plan, task: TransferTask, old_v: _Views, new_v: _Views, where: str, fail: Callable[[str], None]
) -> int | None:
    """Bytes of ``task``'s slices when each is held by the source and needed by the destination."""
    tensors = plan.tensors
    nbytes = 0
    ok = True
    for ti, box in task.slices:
        if not 0 <= ti < len(tensors):
            fail(f"{where}: tensor index {ti} out of range")
            ok = False
            continue
        t = tensors[ti]
        if t.layer != task.layer:
            fail(f"{where}: {t.name} belongs to layer {t.layer}")
            ok = False
        if not _within(old_v.of(ti, task.src), box):
            fail(f"{t.name}: old rank {task.src} does not hold {box}")
            ok = False
            continue
        if not _within(new_v.of(ti, task.dst), box):
            fail(f"{t.name}: new rank {task.dst} does not need {box}")
            ok = False
            continue
        nbytes += volume(box) * t.itemsize
    return nbytes if ok else None


def _check_cover(
    plan: Plan, new_v: _Views, rank: int, parts: list[tuple[Slice, ...]], counts: list[int]
) -> list[str]:
    """One entry per shard of ``rank``: ``""`` when covered exactly once, else the reason."""
    received: dict[int, list[Box]] = defaultdict(list)
    for slices in parts:
        for ti, box in slices:
            received[ti].append(box)
    out = []
    for ti in new_v.candidates(rank):
        t = plan.tensors[ti]
        pieces = [p.box for p in new_v.of(ti, rank) or () if p.box is not None]
        if not pieces:
            continue
        counts[0] += 1
        got = received.get(ti, ())
        if len(pieces) == 1 and len(got) == 1 and got[0] == pieces[0]:
            out.append("")
            continue
        reason = _cover_pieces(pieces, got)
        out.append("" if reason is None else f"{t.name}: {reason}")
    return out


def _cover_pieces(pieces: list[Box], got: Collection[Box]) -> str | None:
    """Each piece covered exactly once by the boxes received inside it, and none received elsewhere."""
    inside = 0
    for piece in pieces:
        parts = [b for b in got if contains(piece, b)]
        inside += len(parts)
        reason = disjoint_cover(piece, parts)
        if reason is not None:
            return reason
    if inside != len(got):
        return f"{len(got) - inside} slice(s) lie outside every piece the rank owns"
    return None
