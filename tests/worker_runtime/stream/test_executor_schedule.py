"""The executor's pure parts and its input checks: no process group is ever used here."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from liver.reshard.plan import Plan, WorldConfig
from liver.reshard.planner import build_plan, default_world
from liver.reshard.views import view
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS
from liver.worker_runtime.stream import executor
from liver.worker_runtime.stream.executor import (
    GroupRanks,
    PlanMismatch,
    PreparedSchedule,
    StreamError,
    StreamOptions,
    StreamResult,
    devices_in_stream_order,
    prepare_schedule,
    ranks_on_device,
    stream_plan,
)
from liver.worker_runtime.stream.schedule import (
    LOST_RANK,
    Schedule,
    StreamStep,
    align,
    buffer_bytes,
    build_schedule,
    region_is_contiguous,
    view_key,
)


class NoNetwork:
    """A group that refuses to move data: input checks must fail before any message."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> None:
        raise AssertionError("sent a message")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> None:
        raise AssertionError("posted a receive")


def stream_alone(
    plan: Plan, rank: int = 0, old_state: dict[int, torch.Tensor] | None = None, **kwargs: Any
) -> StreamResult:
    """Stream as the process of group rank ``rank`` running old and new rank ``rank``, over a group
    that refuses every message (so whatever is checked must be checked before the first one)."""
    return stream_plan(
        plan,
        old_rank=rank,
        new_rank=rank,
        group=NoNetwork(rank, len(devices_in_stream_order(plan))),
        group_ranks=GroupRanks.by_device(plan),
        old_state={} if old_state is None else old_state,
        **kwargs,
    )


def tp2_to_dp2() -> Plan:
    return build_plan(
        PRESETS["tiny-gpt"], default_world(ParallelLayout(2, 1, 1)), default_world(ParallelLayout(1, 1, 2))
    )


@st.composite
def shapes_and_regions(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=4)))
    region = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        region.append((lo, draw(st.integers(lo + 1, n))))
    return shape, tuple(region)


@given(shapes_and_regions())
def test_region_contiguity_agrees_with_torch(
    case: tuple[tuple[int, ...], tuple[tuple[int, int], ...]],
) -> None:
    shape, region = case
    t = torch.empty(shape)
    assert region_is_contiguous(region, shape) == t[tuple(slice(lo, hi) for lo, hi in region)].is_contiguous()


def test_group_ranks_by_device_numbers_old_devices_first_then_new_only_ones() -> None:
    devs = [Device("n", i) for i in range(4)]
    plan = build_plan(
        PRESETS["tiny-gpt"],
        WorldConfig(ParallelLayout(2, 1, 1), Placement((devs[2], devs[0]))),
        WorldConfig(ParallelLayout(1, 1, 3), Placement((devs[1], devs[0], devs[3]))),
    )
    assert devices_in_stream_order(plan) == (devs[2], devs[0], devs[1], devs[3])
    assert GroupRanks.by_device(plan) == GroupRanks(old=(0, 1), new=(2, 1, 3))
    assert ranks_on_device(plan, devs[0]) == (1, 1)
    assert ranks_on_device(plan, devs[3]) == (None, 2)


def test_a_process_in_neither_world_is_refused() -> None:
    plan = tp2_to_dp2()
    with pytest.raises(PlanMismatch, match="both None"):
        build_schedule(plan, None, None, GroupRanks.by_device(plan), 0, 2, 1024)


def test_ranks_that_group_ranks_put_in_another_process_are_refused() -> None:
    plan = tp2_to_dp2()
    with pytest.raises(PlanMismatch, match="new_rank is 1"):
        build_schedule(plan, 0, 1, GroupRanks.by_device(plan), 0, 2, 1024)


def test_group_ranks_that_disagree_with_local_tasks_are_refused() -> None:
    plan = tp2_to_dp2()  # old rank r and new rank r share device r: their tasks are local
    crossed = GroupRanks(old=(0, 1), new=(1, 0))
    with pytest.raises(PlanMismatch, match="local=True"):
        build_schedule(plan, 0, 1, crossed, 0, 2, 1024)


def test_group_ranks_outside_the_group_are_refused() -> None:
    plan = tp2_to_dp2()
    with pytest.raises(PlanMismatch, match=r"group_ranks.new names group ranks \[5\]"):
        build_schedule(plan, 0, 0, GroupRanks(old=(0, 1), new=(0, 5)), 0, 2, 1024)


def tp2_to_tp4(budget: int) -> Plan:
    """Row-parallel slices leave their TP2 shards non-contiguous: sent from copies."""
    return build_plan(
        PRESETS["tiny-gpt"],
        default_world(ParallelLayout(2, 1, 1)),
        default_world(ParallelLayout(4, 1, 1)),
        budget_bytes=budget,
    )


def schedules(plan: Plan, message_bytes: int, copy_budget: int | None = None) -> list[Schedule]:
    ranks = GroupRanks.by_device(plan)
    n = max(max(ranks.old), max(ranks.new)) + 1
    out = []
    for g in range(n):
        old_rank = ranks.old.index(g) if g in ranks.old else None
        new_rank = ranks.new.index(g) if g in ranks.new else None
        out.append(
            build_schedule(plan, old_rank, new_rank, ranks, g, n, message_bytes, copy_budget=copy_budget)
        )
    return out


@pytest.mark.parametrize("budget", [4096, 64 * 1024, 1 << 20])
def test_staged_pieces_and_send_copies_share_one_buffer_within_the_budget(budget: int) -> None:
    plan = tp2_to_tp4(budget)
    copying = 0
    for sched in schedules(plan, message_bytes=8 * 1024):
        assert sched.buffer_bytes <= plan.budget_bytes
        for step in sched.steps():
            assert step.staging_bytes <= sched.buffer_bytes
            if step.copy_bytes:
                copying += 1
                assert align(step.staging_bytes) + step.largest_copy <= sched.buffer_bytes
    assert copying > 0, "the scenario should send from copies"


def test_pieces_are_at_most_half_the_budget_whatever_message_bytes_says() -> None:
    plan = tp2_to_tp4(4096)
    sends = [m for sched in schedules(plan, message_bytes=1 << 30) for st in sched.steps() for m in st.sends]
    assert any(m.copy for m in sends)
    assert all(m.nbytes <= 2048 for m in sends if m.copy)


def test_a_step_that_leaves_no_room_for_one_send_copy_is_refused_naming_it() -> None:
    crowded = StreamStep(
        layer=3,
        round=1,
        tag=0,
        recvs=(),
        sends=(),
        copies=(),
        staging_bytes=60_000,
        release_after=(),
        copy_bytes=16_384,
        largest_copy=8192,
    )
    with pytest.raises(PlanMismatch, match=r"layer 3 round 1: new rank 2 stages 60000 bytes.*65536"):
        buffer_bytes([crowded], 65_536, 16_384, old_rank=1, new_rank=2)


def test_the_buffer_holds_the_largest_step_and_its_copies_up_to_their_budget() -> None:
    staged = StreamStep(3, 0, 0, (), (), (), 1000, (), 0, 0)
    copying = StreamStep(3, 1, 0, (), (), (), 100, (), 40_000, 8192)
    # 100 staged bytes, aligned to 104, then two pieces' worth (the copy budget) above them.
    assert buffer_bytes([staged, copying], 1 << 20, 16_384, 0, 0) == 104 + 16_384
    assert buffer_bytes([staged, copying], 10_000, 16_384, 0, 0) == 10_000


def test_old_state_of_the_wrong_shape_is_refused_naming_the_tensor() -> None:
    plan = tp2_to_dp2()
    sched = build_schedule(plan, 0, 0, GroupRanks.by_device(plan), 0, 2, 1024)
    state = {ti: torch.zeros(s[0].local_shape) for ti, s in sched.old_shards.items()}
    state[0] = torch.zeros((), dtype=torch.int64)  # the step counter
    qkv = next(
        ti for ti, t in enumerate(plan.tensors) if t.name.endswith("0.self_attention.linear_qkv.weight")
    )
    state[qkv] = torch.zeros(3, 3)
    with pytest.raises(
        ValueError, match=r"old_state\[\d+\] \(decoder.layers.0.self_attention.linear_qkv.weight\)"
    ):
        stream_alone(plan, old_state=state)


def test_missing_old_state_is_refused_before_any_message() -> None:
    plan = tp2_to_dp2()
    with pytest.raises(ValueError, match=r"old_state\[0\] \(optimizer.state.step\) is missing"):
        stream_alone(plan)


# -- a schedule prepared before the stream (while training still runs) ----------------------------------


def on_one_device() -> Plan:
    """A plan whose every slice stays on one device: it streams in one process without a network."""
    one = default_world(ParallelLayout(1, 1, 1))
    return build_plan(PRESETS["tiny-gpt"], one, one)


def prepared_for(plan: Plan, group_rank: int, options: StreamOptions | None = None) -> PreparedSchedule:
    old_rank, new_rank = ranks_on_device(plan, devices_in_stream_order(plan)[group_rank])
    return prepare_schedule(
        plan,
        old_rank=old_rank,
        new_rank=new_rank,
        group_ranks=GroupRanks.by_device(plan),
        group_rank=group_rank,
        group_size=len(devices_in_stream_order(plan)),
        options=options,
    )


def random_old_state(plan: Plan) -> dict[int, torch.Tensor]:
    """Random values in every shard's box, zeros in its padding (what a stream writes there)."""
    sched = build_schedule(plan, 0, 0, GroupRanks.by_device(plan), 0, 1, 1024)
    g = torch.Generator().manual_seed(7)
    out = {}
    for ti, (s,) in sched.old_shards.items():
        dtype = torch.int64 if plan.tensors[ti].dtype == "int64" else torch.float32
        t = torch.zeros(s.local_shape, dtype=dtype)
        if s.box is not None:
            inside = tuple(slice(0, hi - lo) for lo, hi in s.box)
            t[inside] = torch.randint(1, 1 << 20, t[inside].shape, generator=g).to(dtype)
        out[ti] = t
    return out


def test_a_prepared_schedule_is_streamed_without_building_another(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = on_one_device()
    prepared = prepared_for(plan, 0)
    old_state = random_old_state(plan)

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("the stream built a schedule although one was prepared")

    monkeypatch.setattr(executor, "build_schedule", no_build)
    result = stream_alone(plan, old_state=dict(old_state), schedule=prepared)
    assert result.stats.schedule_seconds == 0.0
    assert sorted(result.new_state) == sorted(old_state)
    for ti, t in old_state.items():
        assert torch.equal(result.new_state[ti], t), plan.tensors[ti].name


def test_a_stream_without_a_prepared_schedule_builds_and_times_its_own() -> None:
    plan = on_one_device()
    result = stream_alone(plan, old_state=random_old_state(plan))
    assert result.stats.schedule_seconds > 0.0


def test_a_schedule_prepared_for_another_rank_is_refused_before_any_message() -> None:
    plan = tp2_to_dp2()
    with pytest.raises(PlanMismatch, match=r"schedule: prepared for old_rank 0, but this stream has 1"):
        stream_alone(plan, rank=1, schedule=prepared_for(plan, 0))


def test_a_schedule_prepared_for_another_plan_is_refused_naming_both() -> None:
    plan = tp2_to_dp2()
    other = build_plan(
        PRESETS["tiny-gpt"], default_world(ParallelLayout(2, 1, 1)), default_world(ParallelLayout(1, 2, 1))
    )
    with pytest.raises(PlanMismatch, match=r"schedule: prepared for another plan .*TP1,PP2,DP1"):
        stream_alone(plan, schedule=prepared_for(other, 0))


def test_a_schedule_prepared_with_other_message_bytes_is_refused_naming_the_option() -> None:
    plan = tp2_to_dp2()
    with pytest.raises(PlanMismatch, match=r"schedule: prepared for options.message_bytes 1024"):
        stream_alone(
            plan,
            options=StreamOptions(message_bytes=2048),
            schedule=prepared_for(plan, 0, StreamOptions(message_bytes=1024)),
        )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("timeout_s", 0.0, "timeout_s must be positive"),
        ("max_bytes_per_s", -1.0, "max_bytes_per_s must be positive"),
        ("message_bytes", 4, "message_bytes must be at least 8"),
        ("send_copy_bytes", 100, r"send_copy_bytes \(100\) must hold one piece"),
    ],
)
def test_stream_options_name_the_bad_field(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StreamOptions(**{field: value})


def test_stream_error_survives_a_process_boundary() -> None:
    err = StreamError(
        layer=3,
        round=1,
        peer=2,
        peer_rank=5,
        peer_world="old",
        direction="recv",
        reason="reset",
        old_state_intact=True,
    )
    back = pickle.loads(pickle.dumps(err))
    assert (back.layer, back.round, back.peer, back.peer_rank, back.old_state_intact) == (3, 1, 2, 5, True)
    assert str(back) == str(err)
    assert "layer 3 round 1 receiving from process 2 (old rank 5)" in str(err)


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama", "llama3-8b"])
def test_tensors_that_share_a_view_key_have_one_view_in_every_layout(model: str) -> None:
    """What lets the schedule derive shards once per parameter: nothing else of a tensor moves its view."""
    spec = PRESETS[model]
    tensors = spec.tensors(optimizer=True)
    groups: dict[tuple[object, ...], list[int]] = {}
    for ti, t in enumerate(tensors):
        groups.setdefault(view_key(t), []).append(ti)
    assert any(len(g) >= 4 for g in groups.values()), "a parameter and its optimizer states share a key"
    for tp, pp, dp in ((1, 1, 1), (2, 1, 1), (4, 2, 1), (2, 4, 2), (8, 1, 1)):
        layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
        for rank in range(layout.world_size):
            for members in groups.values():
                views = {view(tensors[ti], spec, layout, rank) for ti in members}
                assert len(views) == 1, (tensors[members[0]].name, layout.describe(), rank)


def lost_tp2_dp2_to_dp3() -> tuple[Plan, list[Device]]:
    devs = [Device("n", i) for i in range(4)]
    plan = build_plan(
        PRESETS["tiny-gpt"],
        WorldConfig(ParallelLayout(2, 1, 2), Placement(tuple(devs))),
        WorldConfig(ParallelLayout(1, 1, 3), Placement(tuple(devs[:3]))),
        lost=[devs[3]],
    )
    return plan, devs


def test_a_lost_device_has_no_process_in_the_stream_numbering() -> None:
    plan, devs = lost_tp2_dp2_to_dp3()
    assert devices_in_stream_order(plan, [devs[3]]) == tuple(devs[:3])
    assert GroupRanks.by_device(plan, [devs[3]]) == GroupRanks(old=(0, 1, 2, LOST_RANK), new=(0, 1, 2))


def test_a_plan_made_around_a_lost_device_schedules_no_message_with_it() -> None:
    plan, devs = lost_tp2_dp2_to_dp3()
    ranks = GroupRanks.by_device(plan, [devs[3]])
    for rank in range(3):
        sched = build_schedule(plan, rank, rank, ranks, rank, 3, 1024)
        peers = {m.peer for step in sched.steps() for m in (*step.sends, *step.recvs)}
        assert peers <= {0, 1, 2}


def test_a_plan_that_reads_from_a_lost_device_is_refused() -> None:
    devs = [Device("n", i) for i in range(4)]
    plan = build_plan(  # planned without knowing that n3 is lost: some slices come from it
        PRESETS["tiny-gpt"],
        WorldConfig(ParallelLayout(2, 1, 2), Placement(tuple(devs))),
        WorldConfig(ParallelLayout(1, 1, 3), Placement(tuple(devs[:3]))),
    )
    ranks = GroupRanks.by_device(plan, [devs[3]])
    with pytest.raises(PlanMismatch, match="lost old rank"):
        for rank in range(3):
            build_schedule(plan, rank, rank, ranks, rank, 3, 1024)


def test_a_lost_device_that_the_new_world_runs_on_is_refused() -> None:
    plan, devs = lost_tp2_dp2_to_dp3()
    with pytest.raises(PlanMismatch, match="is lost, but the plan's new world runs on it"):
        devices_in_stream_order(plan, [devs[0]])
