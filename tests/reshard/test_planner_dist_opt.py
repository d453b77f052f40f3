"""Plans for jobs with Megatron's distributed optimizer: its optimizer state is sharded over DP, so each
piece has one owner in the old world and one in the new, and the plan moves it between exactly those.
The same checker proves these plans as any other (``verify_plan``)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_planner import PROPERTY, Scenario, scenarios

from liver.reshard.boxes import volume
from liver.reshard.holdings import holding, is_dp_sharded
from liver.reshard.plan import Plan, WorldConfig
from liver.reshard.planner import NoSurvivingSource, build_plan, plan_resize
from liver.reshard.verifier import verify_plan
from liver.shared.geometry import DdpSettings
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.model import PRESETS

DIST = DdpSettings(distributed_optimizer=True)


def _world(layout: ParallelLayout, nodes: str = "n") -> WorldConfig:
    return WorldConfig(layout, Placement(grid_devices(1, layout.world_size, prefix=nodes)))


def _sharded_bytes_received(plan: Plan) -> dict[int, int]:
    out: dict[int, int] = {}
    for task in plan.tasks:
        for ti, box in task.slices:
            if is_dp_sharded(plan.tensors[ti], plan.model):
                out[task.dst] = out.get(task.dst, 0) + volume(box) * plan.tensors[ti].itemsize
    return out


def _owned_bytes(plan: Plan, rank: int) -> int:
    return sum(
        volume(p.box) * t.itemsize
        for t in plan.tensors
        if is_dp_sharded(t, plan.model)
        for p in holding(t, plan.model, plan.new.layout, rank) or ()
    )


@PROPERTY
@given(scenarios(), st.sampled_from([None, 40, 300]))
def test_every_distributed_optimizer_plan_verifies(sc: Scenario, bucket_size: int | None) -> None:
    ddp = DdpSettings(
        distributed_optimizer=True, overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size
    )
    model = sc.model.geometry().with_ddp(ddp)
    rp = plan_resize(model, sc.old, sc.new_layout, sc.new_devices, budget_bytes=sc.budget)
    report = verify_plan(rp.plan)
    assert report.ok, report.errors
    assert report == verify_plan(rp.plan, by_class=False)
    received = _sharded_bytes_received(rp.plan)
    for rank in range(sc.new_layout.world_size):
        assert received.get(rank, 0) == _owned_bytes(rp.plan, rank)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("TP2,PP1,DP2", "TP1,PP1,DP4"),  # TP and DP change
        ("TP1,PP2,DP2", "TP1,PP1,DP2"),  # PP change and scale-in
        ("TP2,PP2,DP1", "TP2,PP1,DP3"),  # scale-out, DP 1 -> 3
        ("TP1,PP1,DP4", "TP1,PP1,DP3"),  # DP change only: every bucket re-cut
    ],
)
def test_a_dp_sharded_piece_comes_from_its_owner_the_only_one_unless_replicated(old: str, new: str) -> None:
    model = PRESETS["tiny-llama"].geometry().with_ddp(DIST)
    plan = build_plan(model, _world(ParallelLayout.parse(old)), _world(ParallelLayout.parse(new), "m"))
    assert verify_plan(plan).ok
    for task in plan.tasks:
        for ti, box in task.slices:
            t = plan.tensors[ti]
            if not is_dp_sharded(t, model):
                continue
            owners = [
                r
                for r in range(plan.old.layout.world_size)
                for p in holding(t, model, plan.old.layout, r) or ()
                if p.box is not None and all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(box, p.box))
            ]
            assert task.src in owners
            if t.rule != "replicated" and t.home != "first+last":  # not owned alike by replicas
                assert owners == [task.src]


def test_the_checker_notices_a_missing_piece_of_sharded_state() -> None:
    model = PRESETS["tiny-gpt"].geometry().with_ddp(DIST)
    plan = build_plan(model, _world(ParallelLayout(1, 1, 2)), _world(ParallelLayout(1, 1, 3), "m"))
    victim = next(
        i
        for i, task in enumerate(plan.tasks)
        if any(is_dp_sharded(plan.tensors[ti], model) for ti, _ in task.slices)
    )
    broken = plan.with_tasks(plan.tasks[:victim] + plan.tasks[victim + 1 :])
    report = verify_plan(broken)
    assert not report.ok
    assert any("optimizer.state" in e for e in report.errors), report.errors


def test_the_checker_notices_sharded_state_sent_by_a_rank_that_does_not_own_it() -> None:
    model = PRESETS["tiny-gpt"].geometry().with_ddp(DIST)
    plan = build_plan(model, _world(ParallelLayout(1, 1, 2)), _world(ParallelLayout(1, 1, 2), "m"))
    victim = next(
        i
        for i, task in enumerate(plan.tasks)
        if any(is_dp_sharded(plan.tensors[ti], model) for ti, _ in task.slices) and not task.local
    )
    task = plan.tasks[victim]  # its parameters are held by the other DP replica too; its moments not
    moved = msgspec.structs.replace(task, src=1 - task.src)
    broken = plan.with_tasks((*plan.tasks[:victim], moved, *plan.tasks[victim + 1 :]))
    report = verify_plan(broken)
    wrong = [e for e in report.errors if "does not hold" in e]
    assert wrong and all("optimizer.state" in e for e in wrong), report.errors


def test_a_lost_owner_takes_its_optimizer_state_along() -> None:
    model = PRESETS["tiny-gpt"].geometry()
    old = _world(ParallelLayout(1, 1, 2))
    lost = [old.placement.devices[1]]
    new = WorldConfig(ParallelLayout(1, 1, 1), Placement((old.placement.devices[0],)))
    assert verify_plan(build_plan(model, old, new, lost=lost), lost=lost).ok  # plain: a replica survives
    with pytest.raises(NoSurvivingSource, match=r"optimizer\.state"):
        build_plan(model.with_ddp(DIST), old, new, lost=lost)


def test_the_same_world_moves_nothing_across_devices() -> None:
    model = PRESETS["tiny-llama"].geometry().with_ddp(DIST)
    world = _world(ParallelLayout(2, 1, 2))
    plan = build_plan(model, world, world)
    assert verify_plan(plan).ok
    assert plan.tasks and all(t.local and t.src == t.dst for t in plan.tasks)


def test_device_names_do_not_matter_to_ownership() -> None:
    # Ownership follows ranks, not devices: the same layouts on other devices give the same pieces.
    model = PRESETS["tiny-gpt"].geometry().with_ddp(DIST)
    a = build_plan(model, _world(ParallelLayout(1, 1, 2)), _world(ParallelLayout(1, 1, 4), "m"))
    b = build_plan(
        model,
        WorldConfig(ParallelLayout(1, 1, 2), Placement((Device("x", 0), Device("x", 1)))),
        _world(ParallelLayout(1, 1, 4), "m"),
    )
    assert [(t.src, t.dst, t.slices) for t in a.tasks] == [(t.src, t.dst, t.slices) for t in b.tasks]


@pytest.mark.parametrize(("old", "new"), [("TP4,PP4,DP4", "TP4,PP2,DP6"), ("TP2,PP2,DP4", "TP4,PP2,DP2")])
def test_the_chosen_placement_never_moves_more_than_rank_order_and_the_bound_holds(
    old: str, new: str
) -> None:
    from liver.shared.layout import default_devices

    model = PRESETS["llama3-8b"].geometry().with_ddp(DIST)
    before = ParallelLayout.parse(old)
    devices = default_devices(before.world_size, 8)
    after = ParallelLayout.parse(new)
    rp = plan_resize(model, WorldConfig(before, Placement(devices)), after, devices[: after.world_size])
    assert rp.stats.bytes_moved <= rp.rank_order_bytes_moved
    assert rp.lower_bound_bytes <= rp.stats.bytes_moved
