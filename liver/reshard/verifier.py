"""Independent verification of a transfer plan.

It recomputes every view from the model and layouts (it trusts nothing the planner computed) and proves:

1. every slice a task sends lies inside what its source rank holds under the old layout;
2. every slice lies inside what its destination holds under the new layout;
3. the slices a new rank receives for a tensor cover its box exactly once (no gap, no overlap);
4. a task is ``local`` exactly when source and destination run on the same device;
5. no new rank receives more than the staging budget over the network in one streaming round;
6. given the devices that are lost (gone before the handoff), no task sends from one or delivers to
   one: a plan that reads a lost device's memory would hang or fail mid-transfer; a lost rank's tasks
   run on the keeper of its peer copy (:attr:`~liver.reshard.plan.Plan.stand_ins`) only where that
   keeper is the one :mod:`liver.reshard.redundancy` names, survives, and its copy holds every tensor
   the tasks send;
7. one task at most per (layer, round, source, destination): the executor pairs one message per
   source and destination in a round.

A plan stores one set of task templates per class of layers that move alike
(:class:`~liver.reshard.plan.LayerClass`). The check first tries to prove the plan class by class
(:func:`_prove_by_class`: it proves that the layers of a class are interchangeable for every view, then
checks each template once per sender it has and each receiver's cover once per class), which costs the
classes rather than the ~40,000 tasks of a 1,024-device plan; when that proof does not go through,
every task is checked on its own, which decides and names what is wrong.

The worker runtime can run it on its own part of a plan before executing it.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Collection

import msgspec

from liver.reshard.boxes import Box, contains, disjoint_cover, volume
from liver.reshard.holdings import Holding, holding, is_dp_sharded
from liver.reshard.plan import LayerClass, Plan, Slice, TransferTask
from liver.reshard.redundancy import copied_set, redundancy
from liver.reshard.views import expert_rank, holding_stages, world_shards
from liver.shared.geometry import ModelGeometry, TensorSpec
from liver.shared.layout import Device, ParallelLayout


class VerifyReport(msgspec.Struct, frozen=True):
    ok: bool
    errors: tuple[str, ...]
    shards_checked: int
    slices_checked: int


class _Views:
    """Every tensor's holding on every rank: the view function for the whole world
    (:func:`~liver.reshard.views.world_shards`, one computation per shard class), and, per rank, the
    distributed optimizer's DP-sharded pieces (:mod:`liver.reshard.holdings`)."""

    def __init__(self, model: ModelGeometry, layout: ParallelLayout, tensors: tuple[TensorSpec, ...]) -> None:
        self.model = model
        self.layout = layout
        self.tensors = tensors
        self.held = world_shards(tensors, model, layout)
        self.stages = [frozenset(holding_stages(t, model, layout)) for t in tensors]
        self.ep = [expert_rank(t, model, layout) for t in tensors]
        self.sharded = [is_dp_sharded(t, model) for t in tensors]
        self._owned: dict[tuple[int, int], Holding | None] = {}

    def of(self, ti: int, rank: int) -> Holding | None:
        shard = self.held[rank].get(ti)
        if shard is None:
            return None
        if not self.sharded[ti]:
            return (shard,)
        key = (ti, rank)
        if key not in self._owned:
            self._owned[key] = holding(self.tensors[ti], self.model, self.layout, rank)
        return self._owned[key]

    def boxes(self, ti: int, rank: int) -> list[Box]:
        """The boxes ``rank`` holds of tensor ``ti`` (none for padding only)."""
        return [p.box for p in self.of(ti, rank) or () if p.box is not None]

    def candidates(self, rank: int) -> list[int]:
        """The indices of the tensors ``rank`` holds a shard of (its stage's, its EP rank's experts), in
        order."""
        return list(self.held[rank])

    def class_of(self, rank: int) -> tuple[int, ...]:
        """Ranks with one class hold the same of every tensor: the layout's shard class, and the rank
        itself when DP ranks hold different pieces."""
        if self.model.distributed:
            return (rank,)
        return self.layout.shard_class(rank)


def _within(pieces: Holding | None, box: Box) -> bool:
    return pieces is not None and any(p.box is not None and contains(p.box, box) for p in pieces)


class _Enough(Exception):
    """Raised once ``max_errors`` reasons are collected: more would only repeat them."""


def verify_plan(
    plan: Plan, max_errors: int = 20, lost: Collection[Device] = (), *, by_class: bool = True
) -> VerifyReport:
    """Check ``plan`` against the views of its own model and layouts, and against the ``lost`` devices;
    see the module docstring. ``by_class=False`` checks every task on its own even when the plan's
    classes could prove it (the verdict the shortcut must agree with)."""
    errors: list[str] = []
    counts = [0, 0]  # shards, slices checked

    def fail(msg: str) -> None:
        errors.append(msg)
        if len(errors) >= max_errors:
            raise _Enough

    try:
        _check(plan, fail, counts, frozenset(lost), by_class)
    except _Enough:
        pass
    except ValueError as exc:  # the plan's own model and layouts disagree
        errors.append(str(exc))
    return VerifyReport(not errors, tuple(errors), counts[0], counts[1])


def _check(
    plan: Plan, fail: Callable[[str], None], counts: list[int], lost: frozenset[Device], by_class: bool
) -> None:
    model = plan.model
    model.check_layout(plan.old.layout)
    model.check_layout(plan.new.layout)
    if plan.tensors != model.tensors(optimizer=any(t.role == "step" for t in plan.tensors)):
        fail("the plan's tensor list does not match its model")
        return
    old_v = _Views(model, plan.old.layout, plan.tensors)
    new_v = _Views(model, plan.new.layout, plan.tensors)
    new_dev = plan.new.placement.devices
    if not _stand_ins_valid(plan, lost, fail):
        return
    if any(device in lost for device in new_dev):
        for rank, device in enumerate(new_dev):
            if device in lost:
                fail(f"new rank {rank} is placed on lost device {device}")
    elif by_class:
        proved = _prove_by_class(plan, old_v, new_v, lost)
        if proved is not None:
            counts[:] = proved
            return
    _check_tasks(plan, fail, counts, lost, old_v, new_v)


def _stand_ins_valid(plan: Plan, lost: frozenset[Device], fail: Callable[[str], None]) -> bool:
    """Each stand-in is a lost rank with a copy, run by the surviving keeper the model and world name."""
    if not plan.stand_ins:
        return True
    old_dev = plan.old.placement.devices
    n = len(old_dev)
    red = redundancy(plan.model, plan.old.layout, plan.old.placement)
    ok = True
    seen: set[int] = set()
    for rank, keeper in plan.stand_ins:
        where = f"stand-in for old rank {rank}"
        if not (0 <= rank < n and 0 <= keeper < n) or rank in seen:
            fail(f"{where}: rank or keeper {keeper} outside the old world, or listed twice")
            ok = False
            continue
        seen.add(rank)
        if old_dev[rank] not in lost:
            fail(f"{where}: its device {old_dev[rank]} is not lost (it sends for itself)")
            ok = False
        if old_dev[keeper] in lost:
            fail(f"{where}: its keeper {keeper} is on lost device {old_dev[keeper]}")
            ok = False
        if red.keepers[rank] != keeper or not red.copied[rank]:
            fail(f"{where}: old rank {keeper} keeps no copy of it (its keeper is {red.keepers[rank]})")
            ok = False
    return ok


def _copy_holds(plan: Plan, src: int, slices: tuple[Slice, ...]) -> bool:
    """Whether a stand-in ``src``'s peer copy holds every tensor of ``slices``."""
    copied = copied_set(plan.model, plan.old.layout, plan.old.placement, src)
    return all(ti in copied for ti, _box in slices)


def _source_ok(plan: Plan, src: int, lost: frozenset[Device]) -> bool:
    """Whether old rank ``src`` may send: its device survives, or it stands in (checked before)."""
    return not lost or plan.old.placement.devices[src] not in lost or plan.keeper_of(src) is not None


def _check_tasks(
    plan: Plan,
    fail: Callable[[str], None],
    counts: list[int],
    lost: frozenset[Device],
    old_v: _Views,
    new_v: _Views,
) -> None:
    """Every task on its own (with a memo for slice tuples that repeat): exact and complete, and the
    path that names what is wrong."""
    old_dev, new_dev = plan.old.placement.devices, plan.new.placement.devices
    # Plans share slice tuples between DP replicas and layers of the same shape; a check of the same
    # tuple between ranks of the same (TP rank, stage) classes gives the same answer, so it runs once.
    memo: dict[tuple[int, ...], int | None] = {}
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
        if task.local != (plan.src_device(task.src) == new_dev[task.dst]):
            fail(f"{where}: local={task.local} does not match the devices")
        if not _source_ok(plan, task.src, lost):
            fail(f"{where}: source rank {task.src} is on lost device {old_dev[task.src]}")
        elif plan.keeper_of(task.src) is not None and not _copy_holds(plan, task.src, task.slices):
            fail(f"{where}: the peer copy of old rank {task.src} does not hold every tensor it sends")
        key = (task.layer, id(task.slices), *old_v.class_of(task.src), -1, *new_v.class_of(task.dst))
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
    received = _boxes_by_tensor(parts)
    out = []
    for ti in new_v.candidates(rank):
        pieces = new_v.boxes(ti, rank)
        if not pieces:
            continue
        counts[0] += 1
        reason = _cover_pieces(pieces, received.get(ti, []))
        out.append("" if reason is None else f"{plan.tensors[ti].name}: {reason}")
    return out


def _boxes_by_tensor(parts: list[tuple[Slice, ...]]) -> dict[int, list[Box]]:
    received: dict[int, list[Box]] = defaultdict(list)
    for slices in parts:
        for ti, box in slices:
            received[ti].append(box)
    return received


def _cover_pieces(pieces: list[Box], got: list[Box]) -> str | None:
    """Each piece covered exactly once by the boxes received inside it, and none received elsewhere."""
    if len(pieces) == 1 and got == pieces:  # the whole shard in one slice: the common case
        return None
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


class _Unproved(Exception):
    """The shortcut through the classes cannot vouch for the plan: the per-task check decides."""


def _refuse(_reason: str) -> None:
    raise _Unproved


def _prove_by_class(plan: Plan, old_v: _Views, new_v: _Views, lost: frozenset[Device]) -> list[int] | None:
    """``[shards, slices]`` checked when the plan passes every check, proved from each class's templates
    rather than from every layer's tasks; ``None`` when a check fails or the shortcut does not apply,
    and then :func:`_check_tasks` decides and names what is wrong.

    Why it is exact: it first proves, from the model and layouts, that the layers of a class are
    interchangeable (their tensors agree in everything a view depends on, at the same offsets from the
    class's bases, and the same stages and EP ranks hold them in both worlds); a slice check or a cover
    check of the class's first layer then answers for every layer of it. What depends on which old rank
    sends (ranks in range, ``local``, lost sources, the slices held) is checked once per template and
    sender that some layer's source map gives it, one message per pair once per distinct map. A
    1,024-device plan has a few dozen classes and ~40,000 tasks: the verification costs the classes, not
    the tasks."""
    try:
        return _proof(plan, old_v, new_v, lost)
    except _Unproved:
        return None


def _layer_spans(tensors: tuple[TensorSpec, ...]) -> dict[int, tuple[int, int]]:
    """``layer -> (first tensor index, tensor count)``; a layer's tensors must be consecutive."""
    spans: dict[int, tuple[int, int]] = {}
    for ti, t in enumerate(tensors):
        span = spans.get(t.layer)
        if span is None:
            spans[t.layer] = (ti, 1)
        elif span[0] + span[1] != ti:
            raise _Unproved
        else:
            spans[t.layer] = (span[0], span[1] + 1)
    return spans


def _check_alike(
    layers: tuple[int, ...],
    bases: tuple[int, ...],
    spans: dict[int, tuple[int, int]],
    tensors: tuple[TensorSpec, ...],
    views: tuple[_Views, _Views],
) -> None:
    """Every layer of a class is its first layer again for every view: same tensors at the same offsets
    from its base (all but name and layer equal), held by the same stages and EP ranks in both worlds,
    and none of them sharded over DP (whose pieces differ per layer)."""
    first0, count0 = spans[layers[0]]
    offset = bases[0] - first0
    for layer, base in zip(layers, bases, strict=True):
        first, count = spans[layer]
        if count != count0 or base - first != offset:
            raise _Unproved
        for j in range(count):
            ia, ib = first0 + j, first + j
            if _signature(tensors[ia]) != _signature(tensors[ib]):
                raise _Unproved
            for v in views:
                if v.sharded[ia] or v.stages[ia] != v.stages[ib] or v.ep[ia] != v.ep[ib]:
                    raise _Unproved


def _signature(t: TensorSpec) -> tuple:
    """What a view of ``t`` depends on, besides its layer's stage (its name and ``param`` do not)."""
    return (t.shape, t.dtype, t.role, t.rule, t.home, t.expert)


def _proof(plan: Plan, old_v: _Views, new_v: _Views, lost: frozenset[Device]) -> list[int]:
    tensors = plan.tensors
    old_dev, new_dev = plan.old.placement.devices, plan.new.placement.devices
    spans = _layer_spans(tensors)
    # Ranks of one class_of hold the same of every tensor: a small number per rank, for memo keys.
    old_ids = _class_ids(old_v, len(old_dev))
    new_ids = _class_ids(new_v, len(new_dev))
    layer_class: dict[int, int] = {}
    received: list[dict[int, list[tuple[Slice, ...]]]] = []  # per class: new rank -> first layer's slices
    slices_checked = 0
    for k, c in enumerate(plan.classes):
        count = len(c.layers)
        if count == 0:  # LayerClass itself refuses bases or source maps that do not fit its layers
            raise _Unproved
        for layer in c.layers:
            if layer in layer_class or layer not in spans:
                raise _Unproved
            layer_class[layer] = k
        if count > 1:  # a class of one layer (all DP-sharded state is) needs no stand-in
            _check_alike(c.layers, c.bases, spans, tensors, (old_v, new_v))
        base = c.bases[0]
        mine: dict[int, list[tuple[Slice, ...]]] = defaultdict(list)
        absolute: dict[int, tuple[Slice, ...]] = {}  # id(template slices) -> the first layer's
        for t in c.tasks:
            if not 0 <= t.dst < len(new_dev):
                raise _Unproved
            slices = absolute.get(id(t.slices))
            if slices is None:
                slices = absolute[id(t.slices)] = tuple([(ti + base, box) for ti, box in t.slices])
            mine[t.dst].append(slices)
            slices_checked += count * len(t.slices)
        received.append(mine)
        _prove_sources(plan, c, (old_v, new_v), absolute, (old_ids, new_ids), lost)
    return [_prove_cover(plan, new_v, layer_class, received), slices_checked]


def _class_ids(views: _Views, ranks: int) -> list[int]:
    ids: dict[tuple[int, ...], int] = {}
    return [ids.setdefault(views.class_of(r), len(ids)) for r in range(ranks)]


def _prove_sources(
    plan: Plan,
    c: LayerClass,
    views: tuple[_Views, _Views],
    absolute: dict[int, tuple[Slice, ...]],
    class_ids: tuple[list[int], list[int]],
    lost: frozenset[Device],
) -> None:
    """The checks that depend on which old rank sends, for every layer of ``c`` through its source map.

    Each (template, old rank) pair that some layer uses is checked once: ranks in range, ``local``
    matching the devices, no lost source, slices held by the sender and needed by the receiver (once per
    class of each). Since ``local`` is then the template's own for every layer, a round's bytes per
    receiver are the class's, whatever the map. One message per pair: templates are unique per (round,
    slot, destination), and two slots that reach one destination in one round never map to one rank."""
    old_v, new_v = views
    old_dev, new_dev = plan.old.placement.devices, plan.new.placement.devices
    old_ids, new_ids = class_ids
    maps = tuple(dict.fromkeys(c.sources))  # LayerClass: each map names a rank for every slot
    senders = {slot: {m[slot] for m in maps} if maps else {slot} for slot in {t.src for t in c.tasks}}
    checked: dict[tuple[int, int, int], int | None] = {}
    round_bytes: dict[tuple[int, int], int] = defaultdict(int)
    together: dict[tuple[int, int], list[int]] = defaultdict(list)  # (round, dst) -> slots
    for t in c.tasks:
        together[(t.round, t.dst)].append(t.src)
        if not t.local:
            round_bytes[(t.round, t.dst)] += t.nbytes
        for src in senders[t.src]:
            if not 0 <= src < len(old_dev):
                raise _Unproved
            if t.local != (plan.src_device(src) == new_dev[t.dst]) or not _source_ok(plan, src, lost):
                raise _Unproved
            if plan.keeper_of(src) is not None and not _copy_holds(plan, src, absolute[id(t.slices)]):
                raise _Unproved
            key = (id(t.slices), old_ids[src], new_ids[t.dst])
            if key not in checked:
                task = TransferTask(
                    c.layers[0], t.round, src, t.dst, t.local, absolute[id(t.slices)], t.nbytes
                )
                checked[key] = _check_slices(plan, task, old_v, new_v, "", _refuse)
            if checked[key] != t.nbytes:
                raise _Unproved
    if any(nbytes > plan.budget_bytes for nbytes in round_bytes.values()):
        raise _Unproved
    pairs: set[tuple[int, int]] = set()
    for group in together.values():
        if len(set(group)) != len(group):
            raise _Unproved  # two templates from one slot to one destination in one round
        pairs.update(itertools.combinations(group, 2))
    for m in maps:
        if any(m[a] == m[b] for a, b in pairs):
            raise _Unproved


def _prove_cover(
    plan: Plan,
    new_v: _Views,
    layer_class: dict[int, int],
    received: list[dict[int, list[tuple[Slice, ...]]]],
) -> int:
    """The shards of every new rank, each proved covered exactly once (by its class's first layer)."""
    held: dict[tuple[int, ...], dict[int, dict[int, list[Box]]]] = {}  # rank class -> layer -> pieces
    proved: set[tuple] = set()
    shards = 0
    for rank in range(len(plan.new.placement.devices)):
        rank_class = new_v.class_of(rank)
        mine = held.get(rank_class)
        if mine is None:
            mine = held[rank_class] = defaultdict(dict)
            for ti in new_v.candidates(rank):
                pieces = new_v.boxes(ti, rank)
                if pieces:
                    mine[plan.tensors[ti].layer][ti] = pieces
        shards += sum(map(len, mine.values()))
        for layer in mine:
            k = layer_class.get(layer)
            if k is None:
                raise _Unproved
            parts = received[k].get(rank, [])
            key = (k, rank_class, tuple(sorted(map(id, parts))))
            if key not in proved:
                # The class's first layer answers for this one (_check_alike): the rank holds it too.
                first = mine.get(plan.classes[k].layers[0])
                if first is None:
                    raise _Unproved
                _cover_layer(first, parts)
                proved.add(key)
    return shards


def _cover_layer(pieces: dict[int, list[Box]], parts: list[tuple[Slice, ...]]) -> None:
    """Each tensor's pieces (by index) covered exactly once by the boxes received, none received beside."""
    got = _boxes_by_tensor(parts)
    if not got.keys() <= pieces.keys():
        raise _Unproved
    for ti, mine in pieces.items():
        if _cover_pieces(mine, got.get(ti, [])) is not None:
            raise _Unproved
