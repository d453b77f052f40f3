"""The transfer planner: every plan verifies, moves only what is not already in place, and streams
within the staging budget."""

from __future__ import annotations

import dataclasses
import itertools

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from liver.reshard.boxes import intersect, volume
from liver.reshard.placement import DEFAULT_INTER_NODE_WEIGHT, bytes_moved, cost_matrix
from liver.reshard.plan import Plan, TransferTask, WorldConfig
from liver.reshard.planner import (
    NoSurvivingSource,
    build_plan,
    default_world,
    plan_resize,
    plan_stats,
)
from liver.reshard.verifier import verify_plan
from liver.reshard.views import view
from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement, default_devices
from liver.shared.model import PRESETS, ModelSpec


@dataclasses.dataclass(frozen=True)
class Scenario:
    model: ModelSpec
    old: WorldConfig
    new_layout: ParallelLayout
    new_devices: tuple[Device, ...]
    budget: int


def _layouts(draw, model: ModelSpec, max_world: int) -> ParallelLayout:
    tps = [t for t in (1, 2, 4) if model.query_groups % t == 0 and model.ffn_hidden_size % t == 0]
    tp = draw(st.sampled_from(tps))
    pp = draw(st.integers(1, min(model.num_layers, 3)))
    dp = draw(st.integers(1, max(1, max_world // (tp * pp))))
    stage_layers: tuple[int, ...] = ()
    if pp > 1 and (model.num_layers % pp or draw(st.booleans())):
        cuts = sorted(
            draw(
                st.lists(st.integers(1, model.num_layers - 1), min_size=pp - 1, max_size=pp - 1, unique=True)
            )
        )
        bounds = [0, *cuts, model.num_layers]
        stage_layers = tuple(b - a for a, b in itertools.pairwise(bounds))
    return ParallelLayout(tp, pp, dp, stage_layers)


@st.composite
def scenarios(draw) -> Scenario:
    heads = draw(st.sampled_from([4, 8]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0]))
    model = ModelSpec(
        num_layers=draw(st.integers(1, 5)),
        hidden_size=heads * draw(st.sampled_from([1, 2, 3])),
        ffn_hidden_size=draw(st.sampled_from([4, 8, 12])),
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=draw(st.integers(3, 70)),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 4, 8])),
        tied_embeddings=draw(st.booleans()),
        swiglu=draw(st.booleans()),
        bias=draw(st.booleans()),
        normalization=draw(st.sampled_from(["LayerNorm", "RMSNorm"])),
        position_embedding=draw(st.sampled_from(["learned_absolute", "rope"])),
        max_sequence_length=draw(st.integers(1, 8)),
        params_dtype=draw(st.sampled_from(["float32", "bfloat16"])),
    )
    old = _layouts(draw, model, 12)
    new = _layouts(draw, model, 12)
    per_node = draw(st.integers(1, 4))
    old_devices = default_devices(old.world_size, per_node)
    keep = (
        draw(st.lists(st.sampled_from(old_devices), unique=True, max_size=new.world_size))
        if old_devices
        else []
    )
    fresh = [Device(f"new{i // per_node}", i % per_node) for i in range(new.world_size - len(keep))]
    new_devices = tuple(draw(st.permutations(keep + fresh)))
    budget = draw(st.sampled_from([8, 64, 1000, 1 << 30]))
    return Scenario(model, WorldConfig(old, Placement(old_devices)), new, new_devices, budget)


def _bytes_already_in_place(plan: Plan) -> int:
    old_rank = plan.old.placement.rank_on()
    total = 0
    for j, dev in enumerate(plan.new.placement.devices):
        r = old_rank.get(dev)
        if r is None:
            continue
        for t in plan.tensors:
            new = view(t, plan.model, plan.new.layout, j)
            old = view(t, plan.model, plan.old.layout, r)
            if new is None or old is None or new.box is None or old.box is None:
                continue
            common = intersect(new.box, old.box)
            if common is not None:
                total += volume(common) * t.itemsize
    return total


def _bytes_of_new_state(plan: Plan) -> int:
    total = 0
    for j in range(plan.new.layout.world_size):
        for t in plan.tensors:
            s = view(t, plan.model, plan.new.layout, j)
            if s is not None and s.box is not None:
                total += volume(s.box) * t.itemsize
    return total


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(scenarios())
def test_every_plan_verifies(sc: Scenario):
    rp = plan_resize(sc.model, sc.old, sc.new_layout, sc.new_devices, budget_bytes=sc.budget)
    report = verify_plan(rp.plan)
    assert report.ok, report.errors


@PROPERTY
@given(scenarios())
def test_plan_moves_exactly_the_bytes_not_already_on_the_destination_device(sc: Scenario):
    plan = plan_resize(sc.model, sc.old, sc.new_layout, sc.new_devices, budget_bytes=sc.budget).plan
    stats = plan_stats(plan)
    assert stats.bytes_total == _bytes_of_new_state(plan)
    assert stats.bytes_local == _bytes_already_in_place(plan)
    assert stats.bytes_moved == stats.bytes_total - stats.bytes_local
    assert bytes_moved(sc.model, sc.old, plan.new) == stats.bytes_moved  # the no-plan shortcut agrees


@PROPERTY
@given(scenarios())
def test_no_rank_receives_more_than_the_budget_in_one_round(sc: Scenario):
    plan = plan_resize(sc.model, sc.old, sc.new_layout, sc.new_devices, budget_bytes=sc.budget).plan
    assert plan_stats(plan).max_round_recv_bytes <= sc.budget


@PROPERTY
@given(scenarios())
def test_on_one_node_the_optimised_placement_never_moves_more_than_rank_order(sc: Scenario):
    one_node = tuple(Device("n", i) for i in range(sc.new_layout.world_size))
    old_devs = tuple(Device("n", i) for i in range(sc.old.layout.world_size))
    old = WorldConfig(sc.old.layout, Placement(old_devs))
    rp = plan_resize(sc.model, old, sc.new_layout, one_node, budget_bytes=sc.budget)
    assert rp.stats.bytes_moved <= rp.rank_order_bytes_moved
    assert rp.lower_bound_bytes <= rp.stats.bytes_moved


def test_unchanged_layout_on_the_same_devices_moves_nothing():
    m = PRESETS["tiny-gpt"]
    old = default_world(ParallelLayout(2, 2, 1))
    rp = plan_resize(m, old, ParallelLayout(2, 2, 1), old.placement.devices)
    assert rp.stats.bytes_moved == 0
    assert all(t.local for t in rp.plan.tasks)


def test_tp_doubling_sends_each_old_shard_half_to_two_new_ranks():
    m = PRESETS["tiny-gpt"]
    old = default_world(ParallelLayout(2, 1, 1))
    new_devices = default_devices(4, 8)
    plan = build_plan(m, old, WorldConfig(ParallelLayout(4, 1, 1), Placement(new_devices)))
    qkv = next(
        i for i, t in enumerate(plan.tensors) if t.name == "decoder.layers.0.self_attention.linear_qkv.weight"
    )
    dsts = {t.dst for t in plan.tasks if t.src == 0 and any(s[0] == qkv for s in t.slices)}
    assert dsts == {0, 1}


def test_coalescing_sends_one_message_per_source_destination_and_layer():
    m = PRESETS["tiny-llama"]
    old = default_world(ParallelLayout(2, 2, 1))
    rp = plan_resize(m, old, ParallelLayout(1, 1, 2), default_devices(2, 8))
    keys = [(t.layer, t.round, t.src, t.dst) for t in rp.plan.tasks]
    assert len(keys) == len(set(keys))
    assert rp.stats.slices > rp.stats.tasks


def test_dp_replicas_share_the_sending_load():
    m = PRESETS["tiny-gpt"]
    old = default_world(ParallelLayout(1, 1, 4), devices_per_node=1)
    new_devices = tuple(Device(f"fresh{i}", 0) for i in range(4))
    rp = plan_resize(m, old, ParallelLayout(1, 1, 4), new_devices)
    sent = {t.src for t in rp.plan.tasks}
    assert sent == {0, 1, 2, 3}


def test_a_source_on_the_same_node_is_preferred():
    m = PRESETS["tiny-gpt"]
    old = WorldConfig(ParallelLayout(1, 1, 2), Placement((Device("a", 0), Device("b", 0))))
    new = WorldConfig(ParallelLayout(1, 1, 1), Placement((Device("b", 1),)))
    plan = build_plan(m, old, new)
    assert {t.src for t in plan.tasks} == {1}


def test_verification_catches_a_missing_slice():
    m = PRESETS["tiny-gpt"]
    old = default_world(ParallelLayout(2, 1, 1))
    plan = build_plan(m, old, WorldConfig(ParallelLayout(1, 1, 1), Placement(default_devices(1))))
    broken = Plan.of_tasks(
        model=plan.model,
        old=plan.old,
        new=plan.new,
        tensors=plan.tensors,
        budget_bytes=plan.budget_bytes,
        tasks=plan.tasks[1:],
    )
    assert not verify_plan(broken).ok


def test_verification_catches_a_source_that_does_not_hold_the_slice():
    m = PRESETS["tiny-gpt"]
    old = default_world(ParallelLayout(2, 1, 1))
    plan = build_plan(m, old, WorldConfig(ParallelLayout(1, 1, 1), Placement(default_devices(1))))
    remote = next(t for t in plan.tasks if t.src == 1 and len(t.slices) > 0)
    swapped = TransferTask(remote.layer, remote.round, 0, remote.dst, True, remote.slices, remote.nbytes)
    tasks = tuple(swapped if t is remote else t for t in plan.tasks)
    broken = Plan.of_tasks(
        model=plan.model,
        old=plan.old,
        new=plan.new,
        tensors=plan.tensors,
        budget_bytes=plan.budget_bytes,
        tasks=tasks,
    )
    report = verify_plan(broken)
    assert not report.ok and any("does not hold" in e for e in report.errors)


def test_verification_catches_a_round_over_budget():
    m = PRESETS["tiny-gpt"]
    old = default_world(ParallelLayout(2, 1, 1))
    plan = build_plan(
        m, old, WorldConfig(ParallelLayout(1, 1, 1), Placement(default_devices(1))), budget_bytes=4096
    )
    squeezed = Plan.of_tasks(
        model=plan.model,
        old=plan.old,
        new=plan.new,
        tensors=plan.tensors,
        budget_bytes=1024,
        tasks=plan.tasks,
    )
    report = verify_plan(squeezed)
    assert not report.ok and any("staging budget" in e for e in report.errors)


def test_a_budget_below_one_element_is_refused():
    m = PRESETS["tiny-gpt"]
    old = default_world(ParallelLayout(1, 1, 1))
    with pytest.raises(ValueError, match="budget"):
        build_plan(m, old, old, budget_bytes=2)


# -- lost devices: gone before the handoff, so they can neither send nor receive ---------------------------


@st.composite
def scenarios_with_losses(draw) -> tuple[Scenario, frozenset[Device]]:
    """A scenario and some of the old devices the new world does not use, lost."""
    sc = draw(scenarios())
    kept = set(sc.new_devices)
    gone = [d for d in sc.old.placement.devices if d not in kept]
    lost = draw(st.lists(st.sampled_from(gone), unique=True, min_size=1)) if gone else []
    return sc, frozenset(lost)


def _a_class_lost_every_replica(old: WorldConfig, lost: frozenset[Device]) -> bool:
    """Whether some (stage, TP rank) of the old world has no surviving DP replica."""
    lay = old.layout
    devices = old.placement.devices
    return any(
        all(devices[lay.rank_of(tp, dp, pp)] in lost for dp in range(lay.dp))
        for pp in range(lay.pp)
        for tp in range(lay.tp)
    )


@PROPERTY
@given(scenarios_with_losses())
def test_no_task_ever_has_a_lost_source(case: tuple[Scenario, frozenset[Device]]):
    sc, lost = case
    try:
        rp = plan_resize(sc.model, sc.old, sc.new_layout, sc.new_devices, budget_bytes=sc.budget, lost=lost)
    except NoSurvivingSource:
        return  # the next test says when that may happen
    old_dev = sc.old.placement.devices
    assert not [t for t in rp.plan.tasks if old_dev[t.src] in lost]
    report = verify_plan(rp.plan, lost=lost)
    assert report.ok, report.errors


@PROPERTY
@given(scenarios_with_losses())
def test_planning_fails_only_when_every_holder_of_some_state_is_lost(
    case: tuple[Scenario, frozenset[Device]],
):
    sc, lost = case
    try:
        plan_resize(sc.model, sc.old, sc.new_layout, sc.new_devices, budget_bytes=sc.budget, lost=lost)
    except NoSurvivingSource as exc:
        assert exc.holders and set(exc.holders) <= lost
        assert _a_class_lost_every_replica(sc.old, lost)
        assert exc.tensor in {t.name for t in sc.model.tensors()}


def _dp2_on_two_nodes() -> WorldConfig:
    """TP2 x DP2: replica 0 on node a (ranks 0, 1), replica 1 on node b (ranks 2, 3)."""
    devices = (Device("a", 0), Device("a", 1), Device("b", 0), Device("b", 1))
    return WorldConfig(ParallelLayout(2, 1, 2), Placement(devices))


def test_a_dp2_job_losing_a_device_sources_its_shard_from_the_surviving_replica():
    m = PRESETS["tiny-gpt"]
    old = _dp2_on_two_nodes()
    lost = {Device("a", 0)}  # rank 0: TP rank 0 of replica 0; its twin is rank 2 on node b
    # A fresh device on node a takes the lost one's place: the neighbour a lost device used to be.
    new = WorldConfig(
        ParallelLayout(2, 1, 2), Placement((Device("a", 2), Device("a", 1), *old.placement.devices[2:]))
    )
    plan = build_plan(m, old, new, lost=lost)
    qkv = next(
        i for i, t in enumerate(plan.tensors) if t.name == "decoder.layers.0.self_attention.linear_qkv.weight"
    )
    assert {t.src for t in plan.tasks if t.dst == 0 and any(ti == qkv for ti, _ in t.slices)} == {2}
    assert {t.src for t in plan.tasks if t.dst == 0} == {1, 2}  # replicated norms from the neighbour
    report = verify_plan(plan, lost=lost)
    assert report.ok, report.errors


def test_without_the_lost_set_the_same_plan_would_read_the_lost_device():
    m = PRESETS["tiny-gpt"]
    old = _dp2_on_two_nodes()
    new = WorldConfig(
        ParallelLayout(2, 1, 2), Placement((Device("a", 2), Device("a", 1), *old.placement.devices[2:]))
    )
    plan = build_plan(m, old, new)
    assert 0 in {t.src for t in plan.tasks}  # the same-node holder: why the planner must be told
    report = verify_plan(plan, lost={Device("a", 0)})
    assert not report.ok and any("lost device a:0" in e for e in report.errors)


def test_a_dp1_job_losing_a_device_cannot_be_planned_and_names_the_tensor_and_the_device():
    m = PRESETS["tiny-gpt"]
    old = default_world(ParallelLayout(2, 1, 1))  # node000:0 and node000:1, no replica
    new = WorldConfig(ParallelLayout(1, 1, 2), Placement((Device("node000", 0), Device("node001", 0))))
    with pytest.raises(NoSurvivingSource) as info:
        build_plan(m, old, new, lost={Device("node000", 1)})
    exc = info.value
    assert exc.holders == (Device("node000", 1),)
    assert exc.tensor in str(exc) and "node000:1" in str(exc)


def test_a_replicated_tensor_is_taken_from_another_tp_rank_so_the_tensor_named_is_truly_lost():
    m = PRESETS["tiny-gpt"]
    # TP2 x PP2: stage 1's TP rank 0 (rank 2) is lost; its layer norms survive on TP rank 1 (rank 3),
    # its column and row shards nowhere.
    old = default_world(ParallelLayout(2, 2, 1))
    lost = {old.placement.devices[2]}
    fresh = Device("node001", 0)
    new = WorldConfig(
        ParallelLayout(2, 2, 1), Placement((*old.placement.devices[:2], fresh, old.placement.devices[3]))
    )
    with pytest.raises(NoSurvivingSource) as info:
        build_plan(m, old, new, lost=lost)
    tensor = next(t for t in m.tensors() if t.name == info.value.tensor)
    assert tensor.rule != "replicated"
    assert info.value.holders == (old.placement.devices[2],)


def test_a_lost_device_cannot_hold_a_new_rank():
    m = PRESETS["tiny-gpt"]
    old = _dp2_on_two_nodes()
    with pytest.raises(LayoutError, match="lost: device a:0 is lost but the new placement uses it"):
        build_plan(m, old, old, lost={Device("a", 0)})
    report = verify_plan(build_plan(m, old, old), lost={Device("a", 0)})
    assert any("new rank 0 is placed on lost device a:0" in e for e in report.errors)


def test_a_lost_device_outside_the_old_world_is_refused():
    m = PRESETS["tiny-gpt"]
    old = _dp2_on_two_nodes()
    with pytest.raises(LayoutError, match="lost: device z:0 is not in the old world"):
        build_plan(m, old, old, lost={Device("z", 0)})


def test_a_lost_neighbour_makes_its_state_cost_as_much_as_state_from_another_node():
    m = msgspec.structs.replace(PRESETS["tiny-gpt"], tied_embeddings=False)
    # PP2 on node a: stage 1 (a:1) shares no state with stage 0 (a:0) once embeddings are untied.
    old = WorldConfig(ParallelLayout(1, 2, 1), Placement((Device("a", 0), Device("a", 1))))
    devices = (Device("a", 0), Device("a", 2))
    alive = cost_matrix(m, old, devices, old.layout)
    gone = cost_matrix(m, old, devices, old.layout, lost={Device("a", 1)})
    # New stage 1 on the fresh a:2: its state was next door on a:1, and now comes from another node,
    # all but the optimizer's step counter (8 bytes), which every stage holds, a:0 included.
    step = 8
    assert gone[1, 1] - step == DEFAULT_INTER_NODE_WEIGHT * (alive[1, 1] - step) > 0
    assert gone[0, 0] == alive[0, 0] == 0  # a:0 keeps its own stage either way


def test_the_optimised_placement_with_losses_still_moves_the_same_bytes_as_its_plan():
    m = PRESETS["tiny-gpt"]
    old = _dp2_on_two_nodes()
    lost = {Device("a", 0)}
    devices = (Device("a", 2), Device("a", 1), Device("b", 0), Device("b", 1))
    rp = plan_resize(m, old, ParallelLayout(1, 1, 4), devices, lost=lost)
    assert verify_plan(rp.plan, lost=lost).ok
    assert bytes_moved(m, old, rp.plan.new) == rp.stats.bytes_moved


@PROPERTY
@given(scenarios_with_losses())
def test_a_plan_proved_from_its_classes_gets_the_verdict_of_a_task_by_task_check(
    case: tuple[Scenario, frozenset[Device]],
):
    sc, lost = case
    plan = plan_resize(sc.model, sc.old, sc.new_layout, sc.new_devices, budget_bytes=sc.budget).plan
    # Without ``lost`` at planning, a plan may read a lost device: then both must refuse it.
    assert verify_plan(plan, lost=lost) == verify_plan(plan, lost=lost, by_class=False)
