"""The verifier's shortcut through a plan's classes (``verifier._prove_by_class``) must never accept a
plan that the task-by-task check refuses: planner-made plans of several layouts are corrupted class by
class (source maps, layers, bases, templates, slices, the budget) and verified, with and without lost
devices, both ways."""

from __future__ import annotations

import functools
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from liver.reshard.boxes import volume
from liver.reshard.plan import LayerClass, Plan, TaskTemplate, WorldConfig
from liver.reshard.planner import build_plan
from liver.reshard.verifier import verify_plan
from liver.shared.geometry import DdpSettings
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS

# (model, distributed optimizer, old layout, old devices, new layout, new devices, budget or None)
BASES = [
    # DP replicas take turns sending the four decoder layers: one class, source maps with two senders.
    ("tiny-gpt", False, "1,1,2", "a:0 a:1", "1,1,1", "b:0", None),
    # Scale-in with shared devices: local tasks, three distinct source maps.
    ("tiny-gpt", False, "1,1,4", "a:0 a:1 b:0 b:1", "1,1,2", "a:1 c:0", None),
    # PP1 -> PP2 on a shared device: two decoder classes that go to different stages.
    ("tiny-gpt", False, "1,1,1", "a:0", "1,2,1", "a:0 a:1", None),
    # TP2 -> TP1 and PP1 -> PP2 under a small budget: many rounds, many templates.
    ("tiny-gpt", False, "2,1,2", "a:0 a:1 a:2 a:3", "1,2,2", "a:2 a:3 b:0 b:1", 16 * 1024),
    (
        "tiny-llama",
        False,
        "2,2,2",
        "a:0 a:1 a:2 a:3 b:0 b:1 b:2 b:3",
        "4,1,2",
        "a:0 a:1 a:2 a:3 c:0 c:1 c:2 c:3",
        None,
    ),
    ("tiny-llama", False, "1,2,4", "a:0 a:1 a:2 a:3 b:0 b:1 b:2 b:3", "2,1,1", "b:0 c:0", 32 * 1024),
    # Experts move whole, EP2 -> EP4.
    ("tiny-moe", False, "1,1,4,EP2", "a:0 a:1 a:2 a:3", "1,1,4,EP4", "a:0 a:1 b:0 b:1", None),
    # The distributed optimizer: DP-sharded state, classes of one layer.
    ("tiny-moe", True, "1,1,4,EP2", "a:0 a:1 a:2 a:3", "1,1,2,EP2", "a:3 b:0", 16 * 1024),
    ("tiny-gpt", True, "1,1,2", "a:0 a:1", "1,2,2", "a:1 b:0 b:1 b:2", None),
]


def _devices(spec: str) -> tuple[Device, ...]:
    return tuple(Device(node, int(index)) for node, index in (d.split(":") for d in spec.split()))


@functools.cache
def _base(i: int) -> Plan:
    model, distributed, old, old_devices, new, new_devices, budget = BASES[i]
    geometry = PRESETS[model].geometry()
    if distributed:
        geometry = geometry.with_ddp(DdpSettings(distributed_optimizer=True))
    return build_plan(
        geometry,
        WorldConfig(ParallelLayout.parse(old), Placement(_devices(old_devices))),
        WorldConfig(ParallelLayout.parse(new), Placement(_devices(new_devices))),
        **({} if budget is None else {"budget_bytes": budget}),
    )


def _flat(i: int) -> Plan:
    """The same plan as a plan file reads back: one class per layer, base 0, slots that are ranks."""
    plan = _base(i)
    return plan.with_tasks(plan.tasks)


# -- corruptions ------------------------------------------------------------------------------------------
# Each takes a plan and hypothesis' data and returns another plan (or the same one where it does not
# apply). Some keep the plan valid (a split, a merge, a rebase), so that the corruptions after them hit
# plans the class proof still accepts.


class Draw:
    """What the corruptions draw their choices from (a strategy's ``draw``)."""

    def __init__(self, draw: Callable) -> None:
        self.draw = draw


class _Skip(Exception):
    """The corruption does not apply to this plan (nothing to pick from): it stays as it is."""


def _pick(data: Draw, n: int) -> int:
    if n <= 0:
        raise _Skip
    return data.draw(st.integers(0, n - 1))


def _with_classes(plan: Plan, classes: list[LayerClass]) -> Plan:
    return msgspec.structs.replace(plan, classes=tuple(classes))


def _with_class(plan: Plan, k: int, c: LayerClass) -> Plan:
    classes = list(plan.classes)
    classes[k] = c
    return _with_classes(plan, classes)


def _first_tensor(plan: Plan, layer: int) -> int:
    return next((ti for ti, t in enumerate(plan.tensors) if t.layer == layer), 0)


def _nbytes(plan: Plan, base: int, slices: tuple) -> int:
    n = 0
    for ti, box in slices:
        if 0 <= ti + base < len(plan.tensors):
            n += volume(box) * plan.tensors[ti + base].itemsize
    return n


def _class_with_layers(plan: Plan, data: Draw) -> int | None:
    ks = [k for k, c in enumerate(plan.classes) if c.layers]
    return data.draw(st.sampled_from(ks)) if ks else None


def source_entry(plan: Plan, data: Draw) -> Plan:
    """One entry of one layer's source map names another rank, in range or not."""
    ks = [k for k, c in enumerate(plan.classes) if any(c.sources)]
    if not ks:
        return plan
    k = data.draw(st.sampled_from(ks))
    c = plan.classes[k]
    i = data.draw(st.sampled_from([i for i, m in enumerate(c.sources) if m]))
    m = list(c.sources[i])
    m[_pick(data, len(m))] = data.draw(st.integers(-1, len(plan.old.placement.devices)))
    sources = (*c.sources[:i], tuple(m), *c.sources[i + 1 :])
    return _with_class(plan, k, msgspec.structs.replace(c, sources=sources))


def source_maps(plan: Plan, data: Draw) -> Plan:
    """Two layers swap source maps, or the maps lose or gain a map or an entry, or go (slots are ranks)."""
    k = _class_with_layers(plan, data)
    if k is None:
        return plan
    c = plan.classes[k]
    how = data.draw(st.sampled_from(["swap", "none", "drop map", "add map", "short map", "long map", "ids"]))
    sources = list(c.sources)
    if how == "swap" and len(sources) > 1:
        i, j = _pick(data, len(sources)), _pick(data, len(sources))
        sources[i], sources[j] = sources[j], sources[i]
    elif how == "none":
        sources = []
    elif how == "drop map" and sources:
        del sources[_pick(data, len(sources))]
    elif how == "add map" and sources:
        sources.append(sources[_pick(data, len(sources))])
    elif how == "short map" and sources:
        i = _pick(data, len(sources))
        sources[i] = sources[i][:-1]
    elif how == "long map" and sources:
        i = _pick(data, len(sources))
        sources[i] = (*sources[i], data.draw(st.integers(0, len(plan.old.placement.devices) - 1)))
    elif how == "ids":
        slots = max((t.src for t in c.tasks), default=0) + 1
        sources = [tuple(range(slots))] * len(c.layers)
    return _with_class(plan, k, msgspec.structs.replace(c, sources=tuple(sources)))


def _remove_layer(c: LayerClass, i: int) -> LayerClass:
    return msgspec.structs.replace(
        c,
        layers=c.layers[:i] + c.layers[i + 1 :],
        bases=c.bases[:i] + c.bases[i + 1 :],
        sources=c.sources[:i] + c.sources[i + 1 :] if c.sources else (),
    )


def move_layer(plan: Plan, data: Draw) -> Plan:
    """A layer leaves its class for another, with its own base, the base the other class's offsets
    give it, or a wrong one; its source map goes with it where it can."""
    if len(plan.classes) < 2:
        return plan
    a = _class_with_layers(plan, data)
    if a is None:
        return plan
    b = data.draw(st.sampled_from([k for k in range(len(plan.classes)) if k != a]))
    ca, cb = plan.classes[a], plan.classes[b]
    i = _pick(data, len(ca.layers))
    layer, base = ca.layers[i], ca.bases[i]
    how = data.draw(st.sampled_from(["own", "offset", "shifted"]))
    if how == "offset" and cb.layers:
        base = cb.bases[0] + _first_tensor(plan, layer) - _first_tensor(plan, cb.layers[0])
    elif how == "shifted":
        base += data.draw(st.integers(-2, 2))
    j = data.draw(st.integers(0, len(cb.layers)))
    sources = cb.sources
    if cb.sources:
        m = ca.sources[i] if ca.sources else cb.sources[0]
        sources = (*cb.sources[:j], m, *cb.sources[j:])
    cb = msgspec.structs.replace(
        cb,
        layers=(*cb.layers[:j], layer, *cb.layers[j:]),
        bases=(*cb.bases[:j], base, *cb.bases[j:]),
        sources=sources,
    )
    classes = list(plan.classes)
    classes[a], classes[b] = _remove_layer(ca, i), cb
    if not classes[a].layers and data.draw(st.booleans()):
        del classes[a]
    return _with_classes(plan, classes)


def swap_layers(plan: Plan, data: Draw) -> Plan:
    """Two layers of two classes (or of one) trade places, with or without their bases and maps."""
    a, b = _class_with_layers(plan, data), _class_with_layers(plan, data)
    if a is None or b is None:
        return plan
    i, j = _pick(data, len(plan.classes[a].layers)), _pick(data, len(plan.classes[b].layers))
    bases, maps = data.draw(st.booleans()), data.draw(st.booleans())
    classes = list(plan.classes)

    def put(k: int, at: int, layer: int, base: int, m: tuple[int, ...] | None) -> None:
        c = classes[k]
        changes: dict = {"layers": (*c.layers[:at], layer, *c.layers[at + 1 :])}
        if bases:
            changes["bases"] = (*c.bases[:at], base, *c.bases[at + 1 :])
        if maps and c.sources and m is not None:
            changes["sources"] = (*c.sources[:at], m, *c.sources[at + 1 :])
        classes[k] = msgspec.structs.replace(c, **changes)

    ca, cb = classes[a], classes[b]
    ma = ca.sources[i] if ca.sources else None
    mb = cb.sources[j] if cb.sources else None
    put(a, i, cb.layers[j], cb.bases[j], mb)
    put(b, j, ca.layers[i], ca.bases[i], ma)
    return _with_classes(plan, classes)


def substitute_layer(plan: Plan, data: Draw) -> Plan:
    """A layer of a class is replaced by another number (another class's layer, its own, one that does
    not exist), with a base that matches it or the old one."""
    k = _class_with_layers(plan, data)
    if k is None:
        return plan
    c = plan.classes[k]
    i = _pick(data, len(c.layers))
    layers = {t.layer for t in plan.tensors}
    layer = data.draw(st.integers(min(layers) - 1, max(layers) + 1))
    base = c.bases[i]
    if data.draw(st.booleans()):
        base = c.bases[0] + _first_tensor(plan, layer) - _first_tensor(plan, c.layers[0])
    c = msgspec.structs.replace(
        c,
        layers=(*c.layers[:i], layer, *c.layers[i + 1 :]),
        bases=(*c.bases[:i], base, *c.bases[i + 1 :]),
    )
    return _with_class(plan, k, c)


def change_base(plan: Plan, data: Draw) -> Plan:
    """One layer's base moves, or its list of bases gets shorter or longer."""
    k = _class_with_layers(plan, data)
    if k is None:
        return plan
    c = plan.classes[k]
    i = _pick(data, len(c.bases))
    how = data.draw(st.sampled_from(["shift", "zero", "drop", "add"]))
    bases = list(c.bases)
    if how == "shift":
        bases[i] += data.draw(st.sampled_from([-40, -7, -2, -1, 1, 2, 7, 40]))
    elif how == "zero":
        bases[i] = 0
    elif how == "drop":
        del bases[i]
    else:
        bases.append(bases[i])
    return _with_class(plan, k, msgspec.structs.replace(c, bases=tuple(bases)))


def rebase(plan: Plan, data: Draw) -> Plan:
    """Every base of a class moves by ``d`` and every template slice by ``-d``: the same plan."""
    k = _class_with_layers(plan, data)
    if k is None:
        return plan
    c = plan.classes[k]
    d = data.draw(st.integers(-abs(c.bases[0]), 5))
    tasks = tuple(
        msgspec.structs.replace(t, slices=tuple((ti - d, box) for ti, box in t.slices)) for t in c.tasks
    )
    return _with_class(plan, k, LayerClass(c.layers, tuple(b + d for b in c.bases), tasks, c.sources))


def split_class(plan: Plan, data: Draw) -> Plan:
    """A class of several layers becomes two classes with the same templates: the same plan."""
    ks = [k for k, c in enumerate(plan.classes) if len(c.layers) > 1]
    if not ks:
        return plan
    k = data.draw(st.sampled_from(ks))
    c = plan.classes[k]
    at = data.draw(st.integers(1, len(c.layers) - 1))
    head = LayerClass(c.layers[:at], c.bases[:at], c.tasks, c.sources[:at])
    tail = LayerClass(c.layers[at:], c.bases[at:], c.tasks, c.sources[at:])
    classes = list(plan.classes)
    classes[k : k + 1] = [head, tail]
    return _with_classes(plan, classes)


def merge_classes(plan: Plan, data: Draw) -> Plan:
    """Two classes become one with the first's templates (or both's): a valid plan only where they
    moved alike."""
    if len(plan.classes) < 2:
        return plan
    a = _pick(data, len(plan.classes))
    b = data.draw(st.sampled_from([k for k in range(len(plan.classes)) if k != a]))
    ca, cb = plan.classes[a], plan.classes[b]
    if bool(ca.sources) != bool(cb.sources):
        return plan
    tasks = ca.tasks
    if data.draw(st.booleans()):
        d = ca.bases[0] - cb.bases[0] if ca.bases and cb.bases else 0
        tasks += tuple(
            msgspec.structs.replace(t, slices=tuple((ti - d, box) for ti, box in t.slices)) for t in cb.tasks
        )
    merged = LayerClass(ca.layers + cb.layers, ca.bases + cb.bases, tasks, ca.sources + cb.sources)
    classes = [c for k, c in enumerate(plan.classes) if k not in (a, b)]
    classes.insert(min(a, b), merged)
    return _with_classes(plan, classes)


def _template(plan: Plan, data: Draw) -> tuple[int, int] | None:
    ks = [k for k, c in enumerate(plan.classes) if c.tasks]
    if not ks:
        return None
    k = data.draw(st.sampled_from(ks))
    return k, _pick(data, len(plan.classes[k].tasks))


def _with_template(plan: Plan, k: int, j: int, t: TaskTemplate | None, *extra: TaskTemplate) -> Plan:
    c = plan.classes[k]
    tasks = (*c.tasks[:j], *((t,) if t is not None else ()), *extra, *c.tasks[j + 1 :])
    return _with_class(plan, k, msgspec.structs.replace(c, tasks=tasks))


def drop_or_copy_template(plan: Plan, data: Draw) -> Plan:
    """A template goes, is there twice, or moves to another class (with its slices rebased or not)."""
    at = _template(plan, data)
    if at is None:
        return plan
    k, j = at
    t = plan.classes[k].tasks[j]
    how = data.draw(st.sampled_from(["drop", "copy", "move"]))
    if how == "drop":
        return _with_template(plan, k, j, None)
    if how == "copy" or len(plan.classes) < 2:
        return _with_template(plan, k, j, t, t)
    b = data.draw(st.sampled_from([b for b in range(len(plan.classes)) if b != k]))
    cb = plan.classes[b]
    if data.draw(st.booleans()) and cb.bases and plan.classes[k].bases:
        d = cb.bases[0] - plan.classes[k].bases[0]
        t = msgspec.structs.replace(t, slices=tuple((ti - d, box) for ti, box in t.slices))
    plan = _with_template(plan, k, j, None)
    return _with_class(plan, b, msgspec.structs.replace(cb, tasks=(*cb.tasks, t)))


def template_field(plan: Plan, data: Draw) -> Plan:
    """One field of one template changes: its destination (with ``local`` made to fit or not), round,
    ``local``, byte count or source slot."""
    at = _template(plan, data)
    if at is None:
        return plan
    k, j = at
    c, t = plan.classes[k], plan.classes[k].tasks[j]
    old_dev, new_dev = plan.old.placement.devices, plan.new.placement.devices
    field = data.draw(st.sampled_from(["dst", "dst+local", "round", "local", "nbytes", "src", "src+local"]))
    if field.startswith("dst"):
        t = msgspec.structs.replace(t, dst=data.draw(st.integers(-1, len(new_dev))))
    elif field == "round":
        t = msgspec.structs.replace(t, round=t.round + data.draw(st.sampled_from([-2, -1, 1, 2])))
    elif field == "local":
        t = msgspec.structs.replace(t, local=not t.local)
    elif field == "nbytes":
        t = msgspec.structs.replace(t, nbytes=t.nbytes + data.draw(st.sampled_from([-8, -4, -1, 1, 4])))
    else:
        t = msgspec.structs.replace(t, src=data.draw(st.integers(-1, max(len(old_dev), t.src + 1))))
    if field.endswith("+local") and 0 <= t.dst < len(new_dev):
        src = t.src
        if c.sources and c.sources[0] and 0 <= t.src < len(c.sources[0]):
            src = c.sources[0][t.src]
        if 0 <= src < len(old_dev):
            t = msgspec.structs.replace(t, local=old_dev[src] == new_dev[t.dst])
    return _with_template(plan, k, j, t)


def change_slice(plan: Plan, data: Draw) -> Plan:
    """One slice of a template goes, is there twice, names the next tensor, shifts or shrinks, or moves
    to another template; the byte count follows the slices or not."""
    at = _template(plan, data)
    if at is None:
        return plan
    k, j = at
    c, t = plan.classes[k], plan.classes[k].tasks[j]
    if not t.slices:
        return plan
    s = _pick(data, len(t.slices))
    ti, box = t.slices[s]
    how = data.draw(st.sampled_from(["drop", "copy", "tensor", "shift", "shrink", "grow", "move"]))
    slices = list(t.slices)
    other = None
    if how == "drop":
        del slices[s]
    elif how == "copy":
        slices.insert(s, (ti, box))
    elif how == "tensor":
        slices[s] = (ti + data.draw(st.sampled_from([-3, -2, -1, 1, 2, 3])), box)
    elif how in ("shift", "shrink", "grow") and box:
        dim = _pick(data, len(box))
        lo, hi = box[dim]
        d = data.draw(st.integers(1, 3))
        lo, hi = {
            "shift": (lo + d, hi + d),
            "shrink": (lo, max(lo, hi - d)),
            "grow": (max(0, lo - d), hi + d),
        }[how]
        slices[s] = (ti, (*box[:dim], (lo, hi), *box[dim + 1 :]))
    elif how == "move" and len(c.tasks) > 1:
        o = data.draw(st.sampled_from([o for o in range(len(c.tasks)) if o != j]))
        del slices[s]
        other = (o, msgspec.structs.replace(c.tasks[o], slices=(*c.tasks[o].slices, (ti, box))))
    fix = data.draw(st.booleans())
    base = c.bases[0] if c.bases else 0
    t = msgspec.structs.replace(t, slices=tuple(slices))
    if fix:
        t = msgspec.structs.replace(t, nbytes=_nbytes(plan, base, t.slices))
    tasks = list(c.tasks)
    tasks[j] = t
    if other is not None:
        o, u = other
        tasks[o] = msgspec.structs.replace(u, nbytes=_nbytes(plan, base, u.slices)) if fix else u
    return _with_class(plan, k, msgspec.structs.replace(c, tasks=tuple(tasks)))


def change_budget(plan: Plan, data: Draw) -> Plan:
    """The staging budget moves to just under, at or over a round's bytes, or to nothing."""
    sizes = sorted({t.nbytes for c in plan.classes for t in c.tasks if not t.local} | {0})
    budget = data.draw(st.sampled_from(sizes)) + data.draw(st.integers(-1, 1))
    return msgspec.structs.replace(plan, budget_bytes=budget)


def slots_to_ranks(plan: Plan, data: Draw) -> Plan:
    """A class whose layers share one source map stores ranks instead of slots: the same plan."""
    ks = [k for k, c in enumerate(plan.classes) if c.sources and len(set(c.sources)) == 1 and c.layers]
    if not ks:
        return plan
    k = data.draw(st.sampled_from(ks))
    c = plan.classes[k]
    m = c.sources[0]
    if any(not 0 <= t.src < len(m) for t in c.tasks):
        return plan
    tasks = tuple(msgspec.structs.replace(t, src=m[t.src]) for t in c.tasks)
    return _with_class(plan, k, LayerClass(c.layers, c.bases, tasks))


def swap_devices(plan: Plan, data: Draw) -> Plan:
    """Two ranks of the old or the new world trade devices, or one moves to a device of the other
    world (local tasks that no longer are, remote ones that now are)."""
    side = data.draw(st.sampled_from(["old", "new"]))
    world = getattr(plan, side)
    devices = list(world.placement.devices)
    i = _pick(data, len(devices))
    if data.draw(st.booleans()):
        j = _pick(data, len(devices))
        devices[i], devices[j] = devices[j], devices[i]
    else:
        other = getattr(plan, "new" if side == "old" else "old").placement.devices
        spare = [d for d in other if d not in devices]
        if not spare:
            return plan
        devices[i] = data.draw(st.sampled_from(spare))
    placement = Placement(tuple(devices))
    return msgspec.structs.replace(plan, **{side: WorldConfig(world.layout, placement)})


MUTATIONS: list[Callable[[Plan, Draw], Plan]] = [
    source_entry,
    source_maps,
    move_layer,
    swap_layers,
    substitute_layer,
    change_base,
    rebase,
    split_class,
    merge_classes,
    drop_or_copy_template,
    template_field,
    change_slice,
    change_budget,
    slots_to_ranks,
    swap_devices,
]


@st.composite
def mutants(draw: Callable, flat: bool = False) -> tuple[Plan, frozenset[Device], list[str]]:
    data = Draw(draw)
    i = draw(st.integers(0, len(BASES) - 1))
    plan = _flat(i) if flat else _base(i)
    done = []
    for _ in range(draw(st.integers(1, 4))):
        mutation = draw(st.sampled_from(MUTATIONS))
        try:
            plan = mutation(plan, data)
        except (_Skip, IndexError, ValueError):  # or a class that cannot be made (LayerClass refuses it)
            continue
        done.append(mutation.__name__)
    devices = sorted({*plan.old.placement.devices, *plan.new.placement.devices})
    lost = draw(st.one_of(st.just(frozenset()), st.frozensets(st.sampled_from(devices), max_size=2)))
    return plan, lost, done


def _verdict(plan: Plan, lost: frozenset[Device], by_class: bool) -> bool | str:
    """The report's ``ok``, or the name of the exception verification raised."""
    try:
        return verify_plan(plan, lost=lost, by_class=by_class).ok
    except Exception as exc:  # a crash is an outcome to compare
        return type(exc).__name__


def _fresh(plan: Plan) -> Plan:
    """The plan again without its expanded tasks (each verification expands them from the classes)."""
    return msgspec.structs.replace(plan, classes=plan.classes)


@pytest.mark.parametrize("i", range(len(BASES)))
def test_every_base_plan_is_valid_and_proved_from_its_classes(i: int) -> None:
    plan = _fresh(_base(i))
    proved = verify_plan(plan)
    assert proved.ok, proved.errors
    assert "tasks" not in plan.__dict__  # proved without expanding a task
    assert proved == verify_plan(_fresh(plan), by_class=False)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, len(BASES) - 1),
    st.lists(st.sampled_from([split_class, rebase, slots_to_ranks]), max_size=4),
    st.data(),
)
def test_a_plan_regrouped_into_other_valid_classes_is_still_proved_from_them(
    i: int, regroupings: list[Callable[[Plan, Draw], Plan]], data: st.DataObject
) -> None:
    plan = _base(i)
    for regroup in regroupings:
        plan = regroup(plan, Draw(data.draw))
    plan = _fresh(plan)
    assert verify_plan(plan).ok and "tasks" not in plan.__dict__
    assert sorted(plan.tasks) == sorted(_base(i).tasks)  # the same tasks


# A few thousand verifications of small plans: about 10 s on a busy two-core machine.
@settings(max_examples=600, deadline=None)
@given(mutants())
def test_the_class_proof_never_accepts_a_plan_the_task_by_task_check_refuses(
    case: tuple[Plan, frozenset[Device], list[str]],
) -> None:
    plan, lost, done = case
    by_class, by_task = _verdict(_fresh(plan), lost, True), _verdict(_fresh(plan), lost, False)
    event(f"class proof: {by_class}, task by task: {by_task}")
    if isinstance(by_class, bool) and isinstance(by_task, bool):
        assert by_class == by_task, (done, lost)


@settings(max_examples=250, deadline=None)
@given(mutants())
def test_both_checks_end_alike_even_where_verification_raises(
    case: tuple[Plan, frozenset[Device], list[str]],
) -> None:
    # The outcome compared includes an exception's type: the class proof must never vouch for a plan
    # that the task-by-task check cannot even get through (LayerClass refuses malformed classes).
    plan, lost, done = case
    assert _verdict(_fresh(plan), lost, True) == _verdict(_fresh(plan), lost, False), (done, lost)


@settings(max_examples=150, deadline=None)
@given(mutants(flat=True))
def test_a_plan_read_back_one_class_per_layer_gets_the_same_verdict_both_ways(
    case: tuple[Plan, frozenset[Device], list[str]],
) -> None:
    plan, lost, done = case
    assert _verdict(_fresh(plan), lost, True) == _verdict(_fresh(plan), lost, False), (done, lost)


def test_a_class_with_fewer_bases_or_source_maps_than_layers_cannot_be_made() -> None:
    c = next(c for c in _base(0).classes if len(c.layers) > 1)
    with pytest.raises(ValueError, match="bases"):
        msgspec.structs.replace(c, bases=c.bases[:-1])
    with pytest.raises(ValueError, match="sources"):
        msgspec.structs.replace(c, sources=c.sources[:-1])
    with pytest.raises(ValueError, match="sources"):
        msgspec.structs.replace(c, sources=((), *c.sources[1:]))
