"""Megatron's partial distributed optimizer (``num_distributed_optimizer_instances = k``): the state is
sharded over consecutive groups of ``dp * cp / k`` DP ranks and held once in each of the ``k`` groups.
The planners take a shard from any instance that survives, so a loss that another instance covers
needs neither a peer copy nor the checkpoint."""

from __future__ import annotations

import pytest

from liver.reshard.dist_opt import owned_ranges, shard_group
from liver.reshard.plan import WorldConfig
from liver.reshard.planner import NoSurvivingSource, build_plan
from liver.reshard.redundancy import NO_KEEPER, redundancy
from liver.reshard.verifier import verify_plan
from liver.shared.geometry import DdpSettings, GeometryError
from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement
from liver.shared.model import PRESETS

GPT = PRESETS["tiny-gpt"].geometry()
MOE = PRESETS["tiny-moe"].geometry()
TWO = DdpSettings(distributed_optimizer=True, num_distributed_optimizer_instances=2)
ONE = DdpSettings(distributed_optimizer=True)
DP4 = ParallelLayout(tp=1, pp=1, dp=4)
A = (Device("a", 0), Device("a", 1))
B = (Device("b", 0), Device("b", 1))


def test_each_share_is_owned_once_in_every_instance() -> None:
    model = GPT.with_ddp(TWO)
    assert shard_group(model, 4) == 2
    ranges = [owned_ranges(model, DP4, r) for r in range(4)]
    assert ranges[0] == ranges[2] and ranges[1] == ranges[3] and ranges[0] != ranges[1]


def test_two_instances_of_dp4_shard_as_one_instance_of_dp2() -> None:
    dp2 = ParallelLayout(tp=1, pp=1, dp=2)
    assert owned_ranges(GPT.with_ddp(TWO), DP4, 1) == owned_ranges(GPT.with_ddp(ONE), dp2, 1)


def test_a_layout_whose_dp_the_instances_do_not_divide_is_refused_naming_the_setting() -> None:
    with pytest.raises(LayoutError, match="num_distributed_optimizer_instances"):
        GPT.with_ddp(TWO).check_layout(ParallelLayout(tp=1, pp=1, dp=3))


def test_instances_need_at_least_one() -> None:
    with pytest.raises(GeometryError, match="num_distributed_optimizer_instances"):
        DdpSettings(distributed_optimizer=True, num_distributed_optimizer_instances=0)


def test_instances_mean_nothing_without_the_distributed_optimizer() -> None:
    plain = DdpSettings(num_distributed_optimizer_instances=2)
    assert plain.instances == 1 and plain.canonical() == DdpSettings()


def test_instances_on_different_nodes_survive_a_node_loss_without_copies() -> None:
    r = redundancy(GPT.with_ddp(TWO), DP4, Placement(A + B))  # instance 0 on a, instance 1 on b
    assert r.keepers == (NO_KEEPER,) * 4 and r.survives_node_loss and not any(r.kept_bytes)


def test_instances_on_one_node_each_share_still_needs_a_copy() -> None:
    placement = Placement((A[0], B[0], A[1], B[1]))  # shares 0 (ranks 0, 2) both on a
    r = redundancy(GPT.with_ddp(TWO), DP4, placement)
    assert r.copied[0] and r.copied[1] and not r.copied[2] and not r.copied[3]  # the lower holder copies
    assert r.survives_node_loss


@pytest.mark.parametrize("model", [GPT.with_ddp(TWO), MOE.with_ddp(TWO)], ids=["gpt", "moe"])
def test_a_lost_node_is_planned_from_the_other_instance_and_verifies(model) -> None:
    old = WorldConfig(DP4, Placement(A + B))
    plan = build_plan(model, old, WorldConfig(ParallelLayout(tp=1, pp=1, dp=2), Placement(A)), lost=B)
    assert plan.stand_ins == ()
    assert verify_plan(plan, lost=B).ok


def test_a_share_lost_in_every_instance_cannot_be_planned() -> None:
    model = GPT.with_ddp(TWO)
    old = WorldConfig(DP4, Placement(A + B))
    with pytest.raises(NoSurvivingSource, match="exp_avg"):
        new = WorldConfig(ParallelLayout(tp=1, pp=1, dp=2), Placement((A[0], B[0])))
        build_plan(model, old, new, lost=(A[1], B[1]))  # share 1's owners, in both instances


def test_a_reshard_with_two_owners_per_share_verifies() -> None:
    # The verifier proves each new rank receives each piece exactly once, though two old ranks own it.
    old = WorldConfig(DP4, Placement(A + B))
    new = WorldConfig(ParallelLayout(tp=2, pp=1, dp=2), Placement(A + B))
    for model in (GPT.with_ddp(TWO), MOE.with_ddp(TWO)):
        plan = build_plan(model, old, new)
        assert verify_plan(plan).ok


def test_the_world_builds_the_instance_groups_as_megatron_does() -> None:
    from liver.worker_runtime.world import GroupKind, group_members

    tp2 = ParallelLayout(tp=2, pp=1, dp=4)
    assert group_members(tp2, GroupKind.INTRA_DP_CP, 2) == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert group_members(tp2, GroupKind.INTER_DIST_OPT, 2) == ((0, 4), (2, 6), (1, 5), (3, 7))
    assert group_members(tp2, GroupKind.DIST_OPT_INSTANCE, 2) == ((0, 1, 2, 3), (4, 5, 6, 7))
    pp2 = ParallelLayout(tp=1, pp=2, dp=4)
    assert group_members(pp2, GroupKind.DIST_OPT_INSTANCE, 2) == ((0, 1, 4, 5), (2, 3, 6, 7))


def test_with_one_instance_the_instance_groups_are_the_plain_ones() -> None:
    from liver.worker_runtime.world import GroupKind, alias_of, group_members

    assert group_members(DP4, GroupKind.INTRA_DP_CP) == ()
    assert alias_of(DP4, GroupKind.INTRA_DP_CP) is GroupKind.DP
    assert alias_of(DP4, GroupKind.DIST_OPT_INSTANCE) is GroupKind.WORLD


def test_a_world_whose_dp_the_instances_do_not_divide_is_refused_naming_the_field() -> None:
    from liver.worker_runtime.world import WorldSpec

    devices = Placement((*A, B[0]))
    with pytest.raises(ValueError, match="`instances`"):
        WorldSpec(
            job="j", generation=0, layout=ParallelLayout(tp=1, pp=1, dp=3), placement=devices, instances=2
        )


def test_a_train_config_with_instances_needs_the_distributed_optimizer() -> None:
    from liver.worker_runtime.megatron.train_config import TrainConfig

    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        TrainConfig(num_distributed_optimizer_instances=2)
    assert (
        TrainConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=2).ddp.instances == 2
    )
