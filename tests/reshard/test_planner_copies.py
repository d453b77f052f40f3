"""Planning a recovery from peer copies: a lost rank's state that only its node held is sent by the
keeper of its copy (the rank "stands in", run on the keeper's device), verified exactly on metadata."""

from __future__ import annotations

import msgspec
import pytest

from liver.reshard.plan import WorldConfig
from liver.reshard.plan_file import decode_plan, encode_plan
from liver.reshard.planner import NoSurvivingSource, build_plan, plan_stats
from liver.reshard.redundancy import redundancy
from liver.reshard.verifier import verify_plan
from liver.shared.geometry import DdpSettings
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS

GPT = PRESETS["tiny-gpt"].geometry()
MOE = PRESETS["tiny-moe"].geometry()
DIST = DdpSettings(distributed_optimizer=True)
A = (Device("a", 0), Device("a", 1))
B = (Device("b", 0), Device("b", 1))


def L(text: str) -> ParallelLayout:
    return ParallelLayout.parse(text)


def old_world(text: str) -> WorldConfig:
    return WorldConfig(L(text), Placement(A + B))


def test_the_distributed_optimizer_cannot_lose_a_node_without_copies() -> None:
    old = old_world("TP2,PP1,DP2")  # DP across the nodes: each node owns half of the Adam moments
    with pytest.raises(NoSurvivingSource, match="exp_avg") as refused:
        build_plan(GPT.with_ddp(DIST), old, WorldConfig(L("TP2,PP1,DP1"), Placement(A)), lost=B)
    assert set(refused.value.holders) <= set(B)  # the owners lost, not the survivors that own other shares


@pytest.mark.parametrize(
    ("model", "old", "new"),
    [
        (GPT.with_ddp(DIST), "TP2,PP1,DP2", "TP2,PP1,DP1"),
        (GPT.with_ddp(DIST), "TP2,PP1,DP2", "TP1,PP2,DP1"),
        (GPT.with_ddp(DIST), "TP2,PP1,DP2", "TP1,PP1,DP2"),
        (GPT, "TP2,PP2,DP1", "TP2,PP1,DP1"),  # DP=1: node b held stage 1 alone
        (GPT, "TP2,PP2,DP1", "TP1,PP2,DP1"),
        (MOE.with_ddp(DIST), "TP1,PP1,DP4,EP2", "TP1,PP1,DP2,EP2"),
    ],
)
def test_a_node_loss_is_planned_from_the_copies_and_verifies(model, old: str, new: str) -> None:
    world = old_world(old)
    new_world = WorldConfig(L(new), Placement(A))
    plan = build_plan(model, world, new_world, budget_bytes=64 * 1024, lost=B, copies=True)
    red = redundancy(model, world.layout, world.placement)
    assert plan.stand_ins == tuple((r, red.keepers[r]) for r in (2, 3) if red.copied[r])
    report = verify_plan(plan, lost=B)
    assert report.ok, report.errors
    assert report == verify_plan(plan, lost=B, by_class=False)
    standing = dict(plan.stand_ins)
    sent = {t.src for t in plan.tasks}
    assert sent & set(standing)  # the lost ranks' copies are read
    for t in plan.tasks:
        if t.src in standing:
            assert {ti for ti, _ in t.slices} <= set(red.copied[t.src])
            assert t.local == (plan.src_device(t.src) == plan.new.placement.devices[t.dst])
    assert decode_plan(encode_plan(plan)) == plan


def test_a_copy_is_used_only_where_no_survivor_holds_the_state() -> None:
    # Plain Adam, DP across the nodes: replica A holds everything; the copies are not needed (none made).
    plan = build_plan(
        GPT, old_world("TP2,PP1,DP2"), WorldConfig(L("TP2,PP1,DP1"), Placement(A)), lost=B, copies=True
    )
    assert plan.stand_ins == () and verify_plan(plan, lost=B).ok


def test_a_keeper_lost_with_its_source_leaves_nothing_to_recover_from() -> None:
    old = WorldConfig(L("TP1,PP1,DP4"), Placement(A + B))  # keepers: 0<->2, 1<->3
    model = GPT.with_ddp(DIST)
    lost = (A[1], B[1])  # ranks 1 and 3: each the other's keeper
    with pytest.raises(NoSurvivingSource):
        build_plan(model, old, WorldConfig(L("TP1,PP1,DP2"), Placement((A[0], B[0]))), lost=lost, copies=True)


def test_every_byte_the_lost_node_sends_runs_on_a_survivor() -> None:
    world = old_world("TP2,PP1,DP2")
    plan = build_plan(
        GPT.with_ddp(DIST), world, WorldConfig(L("TP2,PP1,DP1"), Placement(A)), lost=B, copies=True
    )
    assert {plan.src_device(t.src) for t in plan.tasks} <= set(A)
    stats = plan_stats(plan)
    assert stats.bytes_inter_node == 0  # the copies of node b's shards are on node a already


def _plan_with_copies():
    world = old_world("TP2,PP1,DP2")
    return build_plan(
        GPT.with_ddp(DIST), world, WorldConfig(L("TP2,PP1,DP1"), Placement(A)), lost=B, copies=True
    )


def test_a_stand_in_for_a_rank_that_is_not_lost_is_refused() -> None:
    report = verify_plan(_plan_with_copies(), lost=())
    assert not report.ok and "is not lost" in report.errors[0]


def test_a_stand_in_run_by_another_rank_than_its_keeper_is_refused() -> None:
    plan = _plan_with_copies()
    wrong = msgspec.structs.replace(plan, stand_ins=((2, 1), (3, 0)))
    report = verify_plan(wrong, lost=B)
    assert not report.ok and any("keeps no copy of it" in e for e in report.errors)


def test_a_stand_in_that_sends_what_its_copy_does_not_hold_is_refused() -> None:
    plan = _plan_with_copies()
    red = redundancy(plan.model, plan.old.layout, plan.old.placement)
    task = next(t for t in plan.tasks if t.src == 2)
    outside = next(
        ti for ti, t in enumerate(plan.tensors) if t.layer == task.layer and ti not in red.copied[2]
    )
    box = tuple((0, n) for n in plan.tensors[outside].shape)
    tampered = msgspec.structs.replace(task, slices=((outside, box),))
    broken = plan.with_tasks([tampered if t == task else t for t in plan.tasks])
    report = verify_plan(broken, lost=B)
    assert not report.ok and any("does not hold every tensor" in e for e in report.errors)


def node_b_lost(peer_copies: bool = True):
    """The transfer service's input: a dist-opt TP2,DP2 world on nodes a and b, node b lost."""
    from liver.shared.messages import Candidate, TopologyPlanned

    world = old_world("TP2,PP1,DP2")
    new_layout = L("TP2,PP1,DP1")
    return TopologyPlanned(
        job_id="j",
        event_id="e",
        from_generation=1,
        generation=2,
        model=GPT.with_ddp(DIST),
        from_layout=world.layout,
        from_placement=world.placement,
        layout=new_layout,
        placement=Placement(A),
        candidates=(Candidate(layout=new_layout, score=1.0, fits=True),),
        explanation="a node lost",
        lost=B,
        peer_copies=peer_copies,
    )


def test_the_transfer_service_puts_a_lost_ranks_tasks_in_its_keepers_slice() -> None:
    from liver.services.transfer.core import plan_transfer

    out = plan_transfer(node_b_lost(), budget_bytes=64 * 1024)
    assert out.plan.stand_ins == ((2, 0), (3, 1))
    by_device = {s.device: s for s in out.slices}
    for lost_rank, keeper in out.plan.stand_ins:
        keeper_slice = by_device[A[keeper]]
        assert keeper_slice.stand_ins == out.plan.stand_ins
        assert any(t.src == lost_rank for t in keeper_slice.tasks)
        assert not by_device[B[lost_rank - 2]].tasks  # nothing runs on the lost devices


def test_the_transfer_service_plans_nothing_from_copies_a_job_does_not_keep() -> None:
    from liver.services.transfer.core import plan_transfer

    with pytest.raises(NoSurvivingSource, match="exp_avg"):
        plan_transfer(node_b_lost(peer_copies=False), budget_bytes=64 * 1024)
