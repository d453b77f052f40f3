"""Peer redundancy decided from the model and the world: exactly the state one node would take with it
is copied, once, to a process on another node, spread so that no process keeps more than one copy."""

from __future__ import annotations

import math

import pytest

from liver.reshard.holdings import holding
from liver.reshard.plan import WorldConfig
from liver.reshard.planner import orphaned_shards
from liver.reshard.redundancy import NO_KEEPER, alike_holders, own_copy_bytes, redundancy
from liver.shared.geometry import DdpSettings
from liver.shared.layout import ParallelLayout, Placement, grid_devices
from liver.shared.model import PRESETS

GPT = PRESETS["tiny-gpt"].geometry()
MOE = PRESETS["tiny-moe"].geometry()
DIST = DdpSettings(distributed_optimizer=True)

CASES = [
    (GPT, "TP2,PP1,DP2", 2, 2),
    (GPT.with_ddp(DIST), "TP2,PP1,DP2", 2, 2),
    (GPT, "TP2,PP2,DP1", 2, 2),
    (GPT.with_ddp(DIST), "TP1,PP2,DP2", 2, 2),
    (GPT.with_ddp(DIST), "TP1,PP1,DP4", 2, 2),
    (GPT, "TP1,PP1,DP4", 4, 1),
    (GPT.with_ddp(DIST), "TP2,PP2,DP2", 2, 4),
    (MOE, "TP1,PP1,DP4,EP2", 2, 2),
    (MOE.with_ddp(DIST), "TP1,PP1,DP4,EP2", 2, 2),
    (MOE.with_ddp(DIST), "TP1,PP2,DP2,EP2", 4, 1),
    (GPT.with_ddp(DIST), "TP1,PP2,VPP2,DP2", 2, 2),
    (GPT, "TP2,PP2,VPP2,DP1", 4, 1),
]


def world(text: str, nodes: int, per_node: int) -> tuple[ParallelLayout, Placement]:
    return ParallelLayout.parse(text), Placement(grid_devices(nodes, per_node))


@pytest.mark.parametrize(("model", "text", "nodes", "per_node"), CASES)
def test_what_dies_with_a_node_is_copied_once_to_another_node(model, text, nodes, per_node) -> None:
    layout, placement = world(text, nodes, per_node)
    r = redundancy(model, layout, placement)
    node = [d.node for d in placement.devices]
    tensors = model.tensors(optimizer=True)
    copiers: dict[tuple[int, int], int] = {}
    for rank in range(layout.world_size):
        for ti, t in enumerate(tensors):
            if holding(t, model, layout, rank) is None:
                continue
            alike = alike_holders(t, model, layout, rank)
            if all(node[a] == node[rank] for a in alike):
                copiers[(ti, min(alike))] = min(alike)
    expected = [sorted(ti for (ti, c) in copiers if c == rank) for rank in range(layout.world_size)]
    assert [list(c) for c in r.copied] == expected
    for rank, keeper in enumerate(r.keepers):
        assert (keeper == NO_KEEPER) == (not r.copied[rank])
        if keeper != NO_KEEPER:
            assert node[keeper] != node[rank]
    assert r.survives_node_loss


@pytest.mark.parametrize(("model", "text", "nodes", "per_node"), CASES)
def test_every_shard_a_node_loss_orphans_is_among_that_nodes_copies(model, text, nodes, per_node) -> None:
    layout, placement = world(text, nodes, per_node)
    r = redundancy(model, layout, placement)
    tensors = model.tensors(optimizer=True)
    index = {t.name: ti for ti, t in enumerate(tensors)}
    for n in {d.node for d in placement.devices}:
        lost = [d for d in placement.devices if d.node == n]
        on_node = [rank for rank, d in enumerate(placement.devices) if d.node == n]
        copied = {tensors[ti].param for rank in on_node for ti in r.copied[rank]}
        for shard in orphaned_shards(model, WorldConfig(layout, placement), lost):
            assert tensors[index[shard.tensor]].param in copied, (n, shard)


def test_the_distributed_optimizer_copies_its_shards_and_nothing_a_replica_holds() -> None:
    layout, placement = world("TP2,PP1,DP2", 2, 2)  # TP inside a node, DP across nodes
    r = redundancy(GPT.with_ddp(DIST), layout, placement)
    roles = {GPT.tensors(optimizer=True)[ti].role for c in r.copied for ti in c}
    assert roles == {"exp_avg", "exp_avg_sq"}  # fp32 parameters: no separate master weights
    assert r.keepers == (2, 3, 0, 1)
    assert all(b > 0 for b in r.copy_bytes)
    assert r.kept_bytes == tuple(2 * r.copy_bytes[k] for k in (2, 3, 0, 1))


def test_replicas_on_other_nodes_need_no_copies() -> None:
    r = redundancy(GPT, *world("TP2,PP1,DP2", 2, 2))
    assert r.copied == ((),) * 4 and r.keepers == (NO_KEEPER,) * 4 and r.survives_node_loss


def test_replicas_on_one_node_are_copied_once_by_their_lowest_rank() -> None:
    layout = ParallelLayout.parse("TP1,PP2,DP2")  # stage 0 on node000, stage 1 on node001
    r = redundancy(GPT, layout, Placement(grid_devices(2, 2)))
    assert r.copied[0] and not r.copied[1] and r.copied[2] and not r.copied[3]
    assert r.keepers[0] in (2, 3) and r.keepers[2] in (0, 1)


def test_no_process_keeps_more_than_one_copy_on_nodes_of_equal_size() -> None:
    layout, placement = world("TP2,PP2,DP2", 2, 4)
    r = redundancy(GPT.with_ddp(DIST), layout, placement)
    kept = [k for k in r.keepers if k != NO_KEEPER]
    assert len(kept) == len(set(kept)) == 8


def test_one_node_keeps_copies_of_what_no_other_process_holds_on_the_next_process() -> None:
    layout, placement = world("TP1,PP1,DP2", 1, 2)
    r = redundancy(GPT.with_ddp(DIST), layout, placement)
    assert r.keepers == (1, 0) and all(r.copied) and not r.survives_node_loss
    plain = redundancy(GPT, *world("TP1,PP1,DP2", 1, 2))
    assert plain.copied == ((), ()) and not plain.survives_node_loss


@pytest.mark.parametrize(("model", "text", "nodes", "per_node"), CASES)
def test_a_rank_that_sends_a_copy_keeps_its_whole_state_of_the_last_two_refreshes(
    model, text, nodes, per_node
) -> None:
    layout, placement = world(text, nodes, per_node)
    r = redundancy(model, layout, placement)
    own = own_copy_bytes(model, layout, placement)
    for rank in range(layout.world_size):
        held = sum(
            math.prod(p.local_shape) * t.itemsize
            for t in model.tensors(optimizer=True)
            for p in holding(t, model, layout, rank) or ()
        )
        assert own[rank] == (0 if r.keepers[rank] == NO_KEEPER else 2 * held), rank
