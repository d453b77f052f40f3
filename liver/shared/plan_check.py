"""Independent verification of a transfer plan.

It recomputes every view from the model and layouts (it trusts nothing the planner computed) and proves:

1. every slice a task sends lies inside what its source rank holds under the old layout;
2. every slice lies inside what its destination holds under the new layout;
3. the slices a new rank receives for a tensor cover its box exactly once (no gap, no overlap);
4. a task is ``local`` exactly when source and destination run on the same device;
5. no new rank receives more than the staging budget over the network in one streaming round.

The worker runtime can run it on its own part of a plan before executing it.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable

import msgspec

from liver.shared.boxes import Box, contains, disjoint_cover, volume
from liver.shared.layout import ParallelLayout
from liver.shared.model import ModelSpec, TensorSpec
from liver.shared.plan import Plan
from liver.shared.views import Shard, holding_stages, tp_shard


class VerifyReport(msgspec.Struct, frozen=True):
    ok: bool
    errors: tuple[str, ...]
    shards_checked: int
    slices_checked: int


class _Views:
    """Memoised views: many tensors share a geometry, so each distinct one is computed once."""

    def __init__(self, model: ModelSpec, layout: ParallelLayout) -> None:
        self.model = model
        self.layout = layout
        self._shard = functools.lru_cache(maxsize=None)(self._shard_uncached)
        self._stages = functools.lru_cache(maxsize=None)(self._stages_uncached)

    def _shard_uncached(self, rule: str, shape: tuple[int, ...], tp_rank: int, t: TensorSpec) -> Shard:
        return tp_shard(t, self.model, self.layout.tp, tp_rank)

    def _stages_uncached(self, home: str, layer: int, t: TensorSpec) -> tuple[int, ...]:
        return holding_stages(t, self.model, self.layout)

    def of(self, t: TensorSpec, rank: int) -> Shard | None:
        tp, _dp, pp = self.layout.coords(rank)
        if pp not in self._stages(t.home, t.layer if t.home == "layer" else -1, t):
            return None
        return self._shard(t.rule, t.shape, tp, t)

    def holders(self, t: TensorSpec) -> list[int]:
        lay = self.layout
        stages = self._stages(t.home, t.layer if t.home == "layer" else -1, t)
        return [lay.rank_of(tp, dp, pp) for pp in stages for dp in range(lay.dp) for tp in range(lay.tp)]


class _Enough(Exception):
    """Raised once ``max_errors`` reasons are collected: more would only repeat them."""


def verify_plan(plan: Plan, max_errors: int = 20) -> VerifyReport:
    """Check ``plan`` against the views of its own model and layouts; see the module docstring."""
    errors: list[str] = []
    counts = [0, 0]  # shards, slices checked

    def fail(msg: str) -> None:
        errors.append(msg)
        if len(errors) >= max_errors:
            raise _Enough

    try:
        _check(plan, fail, counts)
    except _Enough:
        pass
    except ValueError as exc:  # the plan's own model and layouts disagree
        errors.append(str(exc))
    return VerifyReport(not errors, tuple(errors), counts[0], counts[1])


def _check(plan: Plan, fail: Callable[[str], None], counts: list[int]) -> None:
    model = plan.model
    model.check_layout(plan.old.layout)
    model.check_layout(plan.new.layout)
    if plan.tensors != model.tensors(optimizer=any(t.role != "param" for t in plan.tensors)):
        fail("the plan's tensor list does not match its model")
        return
    old_v, new_v = _Views(model, plan.old.layout), _Views(model, plan.new.layout)
    old_dev, new_dev = plan.old.placement.devices, plan.new.placement.devices
    tensors = plan.tensors
    received: dict[tuple[int, int], list[Box]] = defaultdict(list)
    round_bytes: dict[tuple[int, int, int], int] = defaultdict(int)
    for task in plan.tasks:
        where = f"task layer {task.layer} round {task.round} {task.src}->{task.dst}"
        if not (0 <= task.src < len(old_dev) and 0 <= task.dst < len(new_dev)):
            fail(f"{where}: rank outside the worlds")
            continue
        if task.local != (old_dev[task.src] == new_dev[task.dst]):
            fail(f"{where}: local={task.local} does not match the devices")
        nbytes = 0
        for ti, box in task.slices:
            counts[1] += 1
            if not 0 <= ti < len(tensors):
                fail(f"{where}: tensor index {ti} out of range")
                continue
            t = tensors[ti]
            if t.layer != task.layer:
                fail(f"{where}: {t.name} belongs to layer {t.layer}")
            src_shard = old_v.of(t, task.src)
            if src_shard is None or src_shard.box is None or not contains(src_shard.box, box):
                fail(f"{t.name}: old rank {task.src} does not hold {box}")
                continue
            dst_shard = new_v.of(t, task.dst)
            if dst_shard is None or dst_shard.box is None or not contains(dst_shard.box, box):
                fail(f"{t.name}: new rank {task.dst} does not need {box}")
                continue
            received[(task.dst, ti)].append(box)
            nbytes += volume(box) * t.itemsize
        if nbytes != task.nbytes:
            fail(f"{where}: nbytes is {task.nbytes} but the slices hold {nbytes}")
        if not task.local:
            round_bytes[(task.layer, task.round, task.dst)] += nbytes
    cover_cache: dict[tuple[Box, tuple[Box, ...]], str | None] = {}
    for ti, t in enumerate(tensors):
        for rank in new_v.holders(t):
            shard = new_v.of(t, rank)
            if shard is None or shard.box is None:
                continue
            counts[0] += 1
            key = (shard.box, tuple(received.get((rank, ti), ())))
            if key not in cover_cache:
                cover_cache[key] = disjoint_cover(*key)
            if cover_cache[key] is not None:
                fail(f"{t.name} on new rank {rank}: {cover_cache[key]}")
    for (layer, rnd, dst), nbytes in round_bytes.items():
        if nbytes > plan.budget_bytes:
            fail(
                f"new rank {dst} receives {nbytes} bytes in layer {layer} round {rnd}, "
                f"over the staging budget {plan.budget_bytes}"
            )
