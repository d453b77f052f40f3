"""Which groups a world has, and the rules for building and releasing generations (one process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement
from liver.shared.subjects import SubjectError
from liver.worker_runtime.world import (
    GroupKind,
    StoreAddress,
    WorldError,
    WorldSpec,
    alias_of,
    build_stream_group,
    build_world,
    build_world_async,
    group_members,
    host_store,
    live_generations,
    memberships,
    stream_devices,
)

LAYOUTS = [ParallelLayout(2, 2, 2), ParallelLayout(4, 1, 2), ParallelLayout(1, 3, 2), ParallelLayout(2, 4, 1)]
PARTITIONS = [GroupKind.WORLD, GroupKind.TP, GroupKind.PP, GroupKind.DP, GroupKind.MP, GroupKind.TP_DP]


# -- group membership -----------------------------------------------------------------------------------


def test_megatron_groups_of_tp2_pp2_dp2() -> None:
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    assert group_members(layout, GroupKind.TP) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert group_members(layout, GroupKind.DP) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert group_members(layout, GroupKind.PP) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert group_members(layout, GroupKind.MP) == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert group_members(layout, GroupKind.TP_DP) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert group_members(layout, GroupKind.EMBD) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert group_members(layout, GroupKind.POS_EMBD) == ((0,), (1,), (2,), (3,))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
@pytest.mark.parametrize("kind", PARTITIONS)
def test_every_rank_is_in_exactly_one_group_of_each_partitioning_kind(
    layout: ParallelLayout, kind: GroupKind
) -> None:
    members = [r for group in group_members(layout, kind) for r in group]
    assert sorted(members) == list(range(layout.world_size))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_group_members_share_exactly_the_coordinates_their_kind_keeps(layout: ParallelLayout) -> None:
    varies = {
        GroupKind.TP: {"tp"},
        GroupKind.PP: {"pp"},
        GroupKind.DP: {"dp"},
        GroupKind.MP: {"tp", "pp"},
        GroupKind.TP_DP: {"tp", "dp"},
    }
    for kind, free in varies.items():
        for group in group_members(layout, kind):
            coords = [layout.coords(r)._asdict() for r in group]
            for name in ("tp", "dp", "pp"):
                values = {c[name] for c in coords}
                expected = getattr(layout, name) if name in free else 1
                assert len(values) == expected, (kind, name, group)


def test_embedding_groups_join_the_first_and_last_stage_of_each_pipeline() -> None:
    layout = ParallelLayout(tp=1, pp=3, dp=2)
    assert group_members(layout, GroupKind.EMBD) == ((0, 4), (1, 5))
    assert group_members(layout, GroupKind.POS_EMBD) == ((0,), (1,))
    single_stage = ParallelLayout(tp=2, pp=1, dp=1)
    assert group_members(single_stage, GroupKind.EMBD) == ((0,), (1,))


def test_a_middle_stage_rank_has_no_embedding_group() -> None:
    layout = ParallelLayout(tp=1, pp=3, dp=1)
    kinds = [slot.kind for slot in memberships(layout, 1)]
    assert GroupKind.EMBD not in kinds and GroupKind.POS_EMBD not in kinds


def test_memberships_follow_the_global_build_order() -> None:
    slots = memberships(ParallelLayout(2, 2, 2), 1)  # first stage: in every kind a dense layout builds
    built = [k for k in GroupKind if alias_of(ParallelLayout(2, 2, 2), k) is None]
    assert [s.kind for s in slots] == built
    assert all(1 in s.ranks for s in slots)


def test_a_dense_layout_builds_no_expert_or_context_group_of_its_own() -> None:
    layout = ParallelLayout(2, 2, 2)
    for kind in (GroupKind.CP, GroupKind.DP_CP, GroupKind.EP, GroupKind.ETP, GroupKind.EDP, GroupKind.TP_EP):
        assert group_members(layout, kind) == () and alias_of(layout, kind) is not None


def test_expert_groups_are_megatrons_second_numbering() -> None:
    layout = ParallelLayout.parse("TP2,PP2,DP4,EP2,ETP1")  # 16 ranks: a stage's 8 are EP2 x expert-DP 4
    assert group_members(layout, GroupKind.EP)[:2] == ((0, 1), (2, 3))
    assert group_members(layout, GroupKind.EDP)[:2] == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert group_members(layout, GroupKind.ETP)[0] == (0,)
    assert group_members(layout, GroupKind.TP_EP_PP)[0] == (0, 1, 8, 9)
    cp = ParallelLayout.parse("TP2,PP1,DP2,CP2")
    assert group_members(cp, GroupKind.CP) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert group_members(cp, GroupKind.DP_CP)[0] == (0, 2, 4, 6)


# -- world specs ------------------------------------------------------------------------------------------

DEVICE = Device("local", 0)
ONE = ParallelLayout(1, 1, 1)


def _spec(job: str, generation: int) -> WorldSpec:
    return WorldSpec(job, generation, ONE, Placement((DEVICE,)))


def test_each_generation_has_its_own_store_namespace() -> None:
    assert _spec("job", 1).namespace == "liver/job/gen1"
    assert _spec("job", 1).namespace != _spec("job", 10).namespace


def test_a_job_id_that_could_escape_its_namespace_is_refused() -> None:
    with pytest.raises(SubjectError, match="job"):
        _spec("a/b", 0)


def test_a_negative_generation_is_refused() -> None:
    with pytest.raises(ValueError, match="generation"):
        _spec("job", -1)


def test_a_placement_that_does_not_fit_the_layout_is_refused() -> None:
    with pytest.raises(LayoutError, match="needs 2 devices"):
        WorldSpec("job", 0, ParallelLayout(2, 1, 1), Placement((DEVICE,)))


def test_a_store_address_needs_a_real_port() -> None:
    with pytest.raises(ValueError, match="port"):
        StoreAddress("127.0.0.1", 0)


def test_the_placement_says_which_rank_runs_on_a_device() -> None:
    spec = WorldSpec("job", 0, ParallelLayout(1, 1, 2), Placement((Device("b", 0), Device("a", 0))))
    assert spec.rank_of(Device("a", 0)) == 1
    assert spec.rank_of(Device("c", 0)) is None


def test_the_stream_group_puts_old_devices_first_then_new_only_devices_in_new_rank_order() -> None:
    a, b, c, d = (Device("n", i) for i in range(4))
    old = WorldSpec("job", 0, ParallelLayout(1, 1, 3), Placement((b, a, c)))  # c leaves
    new = WorldSpec("job", 1, ParallelLayout(1, 1, 3), Placement((d, a, b)))  # d joins
    assert stream_devices(old, new) == (b, a, c, d)


def test_the_stream_group_is_refused_for_a_device_in_neither_world() -> None:
    old, new = _spec("job", 0), _spec("job", 1)
    with pytest.raises(WorldError, match="in neither generation"):
        build_stream_group(old, new, Device("elsewhere", 0), StoreAddress("127.0.0.1", 1))


# -- generations in one process (one-rank worlds over a local store) ---------------------------------


@pytest.fixture
def store() -> Iterator[StoreAddress]:
    assert not dist.is_initialized(), "an earlier test left a default process group in this process"
    master = host_store()
    yield StoreAddress("127.0.0.1", master.port)
    del master


def test_a_device_outside_the_placement_builds_nothing(store: StoreAddress) -> None:
    with pytest.raises(WorldError, match="has no rank"):
        build_world(_spec("outside", 0), Device("elsewhere", 0), store)
    with pytest.raises(WorldError, match="has no rank"):
        build_world_async(_spec("outside", 0), Device("elsewhere", 0), store)
    assert live_generations("outside") == ()


def test_at_most_two_generations_exist_and_release_makes_room(store: StoreAddress) -> None:
    gen0 = build_world(_spec("rules", 0), DEVICE, store)
    gen1 = build_world_async(_spec("rules", 1), DEVICE, store).result(timeout=120)
    try:
        assert live_generations("rules") == (0, 1)
        with pytest.raises(WorldError, match="at most two"):
            build_world_async(_spec("rules", 2), DEVICE, store)
        gen0.release()
        assert live_generations("rules") == (1,)
        gen2 = build_world(_spec("rules", 2), DEVICE, store)
        gen2.release()
    finally:
        gen0.release()
        gen1.release()
    assert live_generations("rules") == ()


def test_a_generation_id_is_never_reused_or_older_than_a_live_one(store: StoreAddress) -> None:
    gen3 = build_world(_spec("ids", 3), DEVICE, store)
    try:
        with pytest.raises(WorldError, match="already exists"):
            build_world(_spec("ids", 3), DEVICE, store)
        with pytest.raises(WorldError, match="older than live generation 3"):
            build_world(_spec("ids", 2), DEVICE, store)
    finally:
        gen3.release()


def test_release_unregisters_every_group_and_forbids_further_use(store: StoreAddress) -> None:
    world = build_world(_spec("release", 0), DEVICE, store)
    names = {g.name for g in world.groups.values()}
    assert names <= set(c10d._world.pg_names.values())
    world.release()
    assert not names & set(c10d._world.pg_names.values())
    with pytest.raises(WorldError, match="released"):
        world.group(GroupKind.TP)
    world.release()  # twice is harmless


def test_groups_are_registered_as_new_group_registers_them_on_a_torch_without_the_helper(
    store: StoreAddress, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch before 2.13 (the first GPU image met 2.11) has no c10d._register_pg_in_world.
    with_helper = build_world(_spec("helper", 0), DEVICE, store)
    registered = {kind: _registration(g.pg) for kind, g in with_helper.groups.items()}
    with_helper.release()
    monkeypatch.delattr(c10d, "_register_pg_in_world")
    without = build_world(_spec("helper", 1), DEVICE, store)
    try:
        for kind, group in without.groups.items():
            assert _registration(group.pg) == registered[kind].replace("helper/gen0", "helper/gen1")
            assert dist.get_process_group_ranks(group.pg) == [0]
            assert c10d._resolve_process_group(group.name) is group.pg
    finally:
        without.release()


def _registration(pg: dist.ProcessGroup) -> str:
    world = c10d._world
    return repr(
        (world.pg_names[pg], world.pg_backend_config[pg], world.pg_group_ranks[pg], world.pg_to_tag[pg])
    )


def test_groups_made_while_a_world_is_the_default_go_with_it(store: StoreAddress) -> None:
    world = build_world(_spec("adopt", 0), DEVICE, store)
    world.adopt_as_default()
    assert dist.get_rank() == world.rank and dist.get_world_size() == world.size
    derived = dist.new_group([0])
    t = torch.ones(1)
    dist.all_reduce(t, group=derived)
    world.release()
    assert derived not in c10d._world.pg_map
    assert not dist.is_initialized()


def test_a_discarded_build_is_released(store: StoreAddress) -> None:
    build = build_world_async(_spec("discard", 0), DEVICE, store)
    assert build.wait(timeout=120)
    world = build.result()
    build.discard()
    assert world.released
    assert not build.ready
    assert live_generations("discard") == ()
    with pytest.raises(WorldError, match="discarded"):
        build.result()
