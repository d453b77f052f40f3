"""The compact plan: one set of task templates per class of layers that move alike, each layer with its
own senders, expanded to the same tasks a layer-by-layer plan lists."""

from __future__ import annotations

from collections import defaultdict

import msgspec
import pytest

from liver.bench.plan import FULL
from liver.reshard.plan import Plan, TransferTask, WorldConfig, slice_bytes
from liver.reshard.planner import build_plan, plan_resize, plan_stats
from liver.reshard.verifier import verify_plan
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices, parse_devices
from liver.shared.model import PRESETS


@pytest.fixture(scope="module")
def scale_in() -> Plan:
    """The benchmark's scale-in: GPT-3 175B, 1,024 -> 960 devices, PP16 -> PP12."""
    s = next(s for s in FULL if s.name == "scale-in")
    old_layout, new_layout = ParallelLayout.parse(s.old), ParallelLayout.parse(s.new)
    old_devices = grid_devices(old_layout.world_size // s.per_node, s.per_node)
    old = WorldConfig(old_layout, Placement(old_devices))
    return plan_resize(PRESETS[s.model], old, new_layout, parse_devices(s.devices, old_devices)).plan


def _rebuilt(plan: Plan) -> Plan:
    """The same plan built again (its task list not yet expanded)."""
    return build_plan(plan.model, plan.old, plan.new, plan.budget_bytes)


def test_a_large_plan_keeps_a_few_classes_for_its_many_layers(scale_in: Plan) -> None:
    layers = {t.layer for t in scale_in.model.tensors()}
    assert len(layers) == 98
    assert len(scale_in.classes) <= 30
    assert sorted(layer for c in scale_in.classes for layer in c.layers) == sorted(layers)


def test_the_expanded_tasks_verify_sorted_and_counted_without_expanding(scale_in: Plan) -> None:
    fresh = _rebuilt(scale_in)
    assert fresh.task_count == len(fresh.tasks)
    keys = [(t.layer, t.round, t.src, t.dst) for t in fresh.tasks]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert verify_plan(fresh).ok


def test_a_workers_part_expanded_alone_is_its_share_of_every_task(scale_in: Plan) -> None:
    every = scale_in.tasks
    for src, dst in ((0, None), (None, 5), (957, 957)):
        alone = _rebuilt(scale_in).tasks_of(src, dst)  # from the classes
        assert alone == [t for t in every if src in (None, t.src) and dst in (None, t.dst)]
        assert alone


def test_statistics_from_the_classes_equal_a_count_over_every_task(scale_in: Plan) -> None:
    stats = plan_stats(_rebuilt(scale_in))
    sent: dict[int, int] = defaultdict(int)
    for t in scale_in.tasks:
        if not t.local:
            sent[t.src] += t.nbytes
    assert stats.tasks == len(scale_in.tasks)
    assert stats.slices == sum(len(t.slices) for t in scale_in.tasks)
    assert stats.bytes_moved == sum(sent.values())
    assert stats.max_send_bytes == max(sent.values())


def test_dp_replicas_take_turns_sending_the_layers_of_one_class() -> None:
    # Four decoder layers that move alike, two replicas that hold them on another node: both send some
    # of them, and their totals differ by no more than one layer's (the greedy balance, layer by layer).
    old = WorldConfig(ParallelLayout(1, 1, 2), Placement((Device("a", 0), Device("a", 1))))
    new = WorldConfig(ParallelLayout(1, 1, 1), Placement((Device("b", 0),)))
    plan = build_plan(PRESETS["tiny-gpt"], old, new)
    decoder = next(c for c in plan.classes if len(c.layers) == 4)
    layers: dict[int, set[int]] = defaultdict(set)
    sent: dict[int, int] = defaultdict(int)
    per_layer: dict[int, int] = defaultdict(int)
    for t in plan.tasks:
        sent[t.src] += t.nbytes
        per_layer[t.layer] += t.nbytes
        if t.layer in decoder.layers:
            layers[t.src].add(t.layer)
    assert sorted(layers) == [0, 1]
    assert abs(sent[0] - sent[1]) <= max(per_layer.values())


def test_a_plan_of_its_own_tasks_equals_the_compact_plan(scale_in: Plan) -> None:
    flat = scale_in.with_tasks(scale_in.tasks)
    assert len(flat.classes) == 98 and flat.classes != scale_in.classes
    assert flat == scale_in and hash(flat) == hash(scale_in)
    assert flat != scale_in.with_tasks(scale_in.tasks[1:])


def test_verification_refuses_two_messages_between_the_same_ranks_in_one_round() -> None:
    old = WorldConfig(ParallelLayout(1, 1, 1), Placement((Device("a", 0),)))
    new = WorldConfig(ParallelLayout(1, 1, 1), Placement((Device("b", 0),)))
    plan = build_plan(PRESETS["tiny-gpt"], old, new)
    first = plan.tasks[0]
    half = len(first.slices) // 2
    assert half > 0
    parts = [
        TransferTask(
            first.layer,
            first.round,
            first.src,
            first.dst,
            first.local,
            part,
            sum(slice_bytes(plan.tensors, s) for s in part),
        )
        for part in (first.slices[:half], first.slices[half:])
    ]
    report = verify_plan(plan.with_tasks((*parts, *plan.tasks[1:])))
    assert not report.ok and any("same ranks in the same round" in e for e in report.errors)


def _tiny(old: tuple[int, int, int], new: tuple[int, int, int]) -> Plan:
    """tiny-gpt (4 decoder layers) from node a to node b: every byte crosses the network."""
    o, n = ParallelLayout(*old), ParallelLayout(*new)
    return build_plan(
        PRESETS["tiny-gpt"],
        WorldConfig(o, Placement(tuple(Device("a", i) for i in range(o.world_size)))),
        WorldConfig(n, Placement(tuple(Device("b", i) for i in range(n.world_size)))),
    )


def _with_class(plan: Plan, k: int, **changes: object) -> Plan:
    classes = list(plan.classes)
    classes[k] = msgspec.structs.replace(classes[k], **changes)
    return msgspec.structs.replace(plan, classes=tuple(classes))


def _class_of(plan: Plan, layer: int) -> int:
    return next(k for k, c in enumerate(plan.classes) if layer in c.layers)


def test_a_compact_plan_is_verified_from_its_classes_without_listing_its_tasks() -> None:
    plan = _tiny((2, 1, 2), (1, 1, 1))
    assert any(len(c.layers) == 4 for c in plan.classes)
    report = verify_plan(plan)
    assert report.ok and "tasks" not in plan.__dict__
    assert report == verify_plan(plan, by_class=False)


def test_verification_refuses_a_class_whose_layers_go_to_different_stages() -> None:
    # PP1 -> PP2: layers 1-2 go to the first stage, 3-4 to the second; swap layers 2 and 3 between
    # the two classes, each with its own tensor base: the templates now send layer 3 to the first stage.
    plan = _tiny((1, 1, 1), (1, 2, 1))
    a, b = _class_of(plan, 1), _class_of(plan, 3)
    assert plan.classes[a].layers == (1, 2) and plan.classes[b].layers == (3, 4)
    bases_a, bases_b = plan.classes[a].bases, plan.classes[b].bases
    broken = _with_class(plan, a, layers=(1, 3), bases=(bases_a[0], bases_b[0]))
    broken = _with_class(broken, b, layers=(2, 4), bases=(bases_a[1], bases_b[1]))
    report = verify_plan(broken)
    assert not report.ok and any("does not need" in e for e in report.errors)


def test_verification_refuses_a_source_map_that_names_a_rank_without_the_layer() -> None:
    # PP2 x DP2 -> one rank: layer 4 lives on the old second stage; rank 1 is on the first.
    plan = _tiny((1, 2, 2), (1, 1, 1))
    k = _class_of(plan, 4)
    c = plan.classes[k]
    sources = tuple((1,) if layer == 4 else m for layer, m in zip(c.layers, c.sources, strict=True))
    report = verify_plan(_with_class(plan, k, sources=sources))
    assert not report.ok and any("old rank 1 does not hold" in e for e in report.errors)


def test_verification_refuses_a_source_map_that_sends_one_receiver_two_messages_in_a_round() -> None:
    # TP2 x DP2 -> TP1: each decoder layer takes one half from each old TP rank, in the same round.
    plan = _tiny((2, 1, 2), (1, 1, 1))
    k = _class_of(plan, 2)
    c = plan.classes[k]
    sources = tuple((m[0], m[0]) if layer == 2 else m for layer, m in zip(c.layers, c.sources, strict=True))
    report = verify_plan(_with_class(plan, k, sources=sources))
    assert not report.ok and any("same ranks in the same round" in e for e in report.errors)


def test_verification_refuses_a_layer_whose_turn_falls_to_a_lost_replica() -> None:
    plan = _tiny((2, 1, 2), (1, 1, 1))
    c = plan.classes[_class_of(plan, 1)]
    senders = {src for m in c.sources for src in m}
    assert len(senders) == 4  # both replicas take turns
    gone = plan.old.placement.devices[max(senders)]
    report = verify_plan(plan, lost=(gone,))
    assert not report.ok and any(f"on lost device {gone}" in e for e in report.errors)
