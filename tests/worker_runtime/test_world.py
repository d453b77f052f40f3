"""Two generations in four processes: a handoff from DP2 on two devices to TP2xPP2 on four.

Processes 0 and 1 train on generation 0 and build generation 1 in the background; processes 2 and 3
are scale-out joiners that only ever join generation 1. Generation 1's placement renumbers the old
processes (device 0 becomes rank 2, device 1 rank 0). Every test below reads one aspect of that run.
"""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.shared.layout import Device, ParallelLayout, Placement
from liver.worker_runtime.cut import CutVerdict, SwitchGate, enter_world
from liver.worker_runtime.world import (
    GroupKind,
    StoreAddress,
    World,
    WorldError,
    WorldSpec,
    build_stream_group,
    build_world,
    build_world_async,
    group_members,
    live_generations,
)

JOB = "worldtest"
DEVICES = tuple(Device("n0", i) for i in range(4))
GEN0 = dict(layout=ParallelLayout(tp=1, pp=1, dp=2), placement=Placement(DEVICES[:2]))
GEN1 = dict(
    layout=ParallelLayout(tp=2, pp=2, dp=1),
    placement=Placement((DEVICES[1], DEVICES[2], DEVICES[0], DEVICES[3])),
)
BUILD_STARTS_AT = {0: 0, 1: 5}  # the iteration at which each old process starts building generation 1
TIMEOUT = timedelta(seconds=120)
"""For every rendezvous and vote (all must succeed): a busy machine may keep a rank off the CPU a while."""

pytestmark = pytest.mark.slow
MAX_ITERATIONS = 20_000


def _spec(generation: int, **world: Any) -> WorldSpec:
    return WorldSpec(job=JOB, generation=generation, **world)


def train(world: World, gate: SwitchGate, on_boundary: Any, iterations: int = MAX_ITERATIONS) -> list[str]:
    """A training-like loop: compute, all-reduce on the active world, vote at the boundary.

    Returns a digest of the state after each iteration; stops early when ``on_boundary`` says so.
    """
    x = torch.randn(512, generator=torch.Generator().manual_seed(1234 + world.rank), dtype=torch.float64)
    digests = []
    for i in range(iterations):
        y = torch.tanh(x) * 1.5 + 0.01 * i
        dist.all_reduce(y, group=world.group(GroupKind.WORLD))
        x = y / world.size
        digests.append(hashlib.sha256(x.numpy().tobytes()).hexdigest())
        if on_boundary(i, gate.at_boundary(i)):
            break
    return digests


def group_report(world: World) -> dict[str, Any]:
    """For every group: the sum of its members' world ranks as the group computes it, and its numbering."""
    out = {}
    for kind, built in world.groups.items():
        t = torch.tensor([world.rank], dtype=torch.int64)
        dist.all_reduce(t, group=built.pg)
        out[str(kind)] = {
            "sum": int(t.item()),
            "ranks": list(built.slot.ranks),
            "group_rank": built.pg.rank(),
            "group_size": built.pg.size(),
            "name": built.name,
        }
    return out


def old_process(index: int, address: StoreAddress) -> dict[str, Any]:
    device = DEVICES[index]
    gen0 = build_world(_spec(0, **GEN0), device, address, timeout=TIMEOUT)
    gen0.adopt_as_default()
    for _ in range(2):  # like parallel_state would: moves this process's group-name counter on
        dist.new_group([0, 1])
    out: dict[str, Any] = {"rank0": gen0.rank, "counter_before": dist.distributed_c10d._world.group_count}

    state: dict[str, Any] = {"build": None, "done_at": None, "switch_at": None, "verdicts": set()}

    def with_background_build(i: int, decision: Any) -> bool:
        if i == BUILD_STARTS_AT[index]:
            state["build"] = build_world_async(_spec(1, **GEN1), device, address, timeout=TIMEOUT)
            gate.prepare(state["build"])
        if state["build"] is not None and state["done_at"] is None and state["build"].done():
            state["done_at"] = i
        if decision.verdict is CutVerdict.SWITCH:
            state["switch_at"] = i
            return True
        return False

    gate = SwitchGate(gen0, timeout=TIMEOUT)
    started = time.perf_counter()
    out["digests_with_build"] = train(gen0, gate, with_background_build)
    out["seconds_with_build"] = time.perf_counter() - started
    out["switch_at"] = state["switch_at"]
    out["build_done_at"] = state["done_at"]
    out["build_started_at"] = BUILD_STARTS_AT[index]
    gen1 = gate.shadow()

    quiet = SwitchGate(gen0, timeout=TIMEOUT)
    verdicts: set[str] = set()

    def alone(i: int, decision: Any) -> bool:
        verdicts.add(str(decision.verdict))
        return False

    started = time.perf_counter()
    out["digests_alone"] = train(gen0, quiet, alone, iterations=len(out["digests_with_build"]))
    out["seconds_alone"] = time.perf_counter() - started
    out["build_seconds"] = gen1.build_seconds
    out["verdicts_alone"] = sorted(verdicts)

    out["live_while_both"] = live_generations(JOB)
    try:
        build_world_async(_spec(2, **GEN0), device, address, timeout=TIMEOUT)
        out["third_generation"] = "built"
    except WorldError as error:
        out["third_generation"] = str(error)

    out["stream"] = stream_check(device, address)
    out["entered_at"] = enter_world(gen1, state["switch_at"], timeout=TIMEOUT)
    out.update(shared_checks(gen1))
    t0 = torch.tensor([1.0 + index])
    dist.all_reduce(t0, group=gen0.group(GroupKind.WORLD))
    out["gen0_sum_after_switch"] = float(t0.item())
    gen0_names = [g.name for g in gen0.groups.values()]
    gen0.release()
    out["live_after_release"] = live_generations(JOB)
    registered = set(dist.distributed_c10d._world.pg_names.values())
    out["gen0_names_left"] = [n for n in gen0_names if n in registered]
    out["derived_left"] = [n for n in ("0", "1") if n in registered]
    gen1.release()
    return out


def joiner_process(index: int, address: StoreAddress) -> dict[str, Any]:
    gen1 = build_world(_spec(1, **GEN1), DEVICES[index], address, timeout=TIMEOUT)
    out: dict[str, Any] = {
        "live_before_switch": live_generations(JOB),
        "default_world_before_switch": dist.is_initialized(),
        "counter_before": dist.distributed_c10d._world.group_count,
    }
    out["stream"] = stream_check(DEVICES[index], address)
    out["entered_at"] = enter_world(gen1, None, timeout=TIMEOUT)
    out.update(shared_checks(gen1))
    gen1.release()
    return out


def stream_check(device: Device, address: StoreAddress) -> dict[str, Any]:
    """Every process of both worlds joins the stream group; each sends its rank to the next one."""
    stream = build_stream_group(_spec(0, **GEN0), _spec(1, **GEN1), device, address, timeout=TIMEOUT)
    pg = stream.group()
    rank, size = pg.rank(), pg.size()
    got = torch.zeros(1, dtype=torch.int64)
    send = pg.send([torch.tensor([rank])], (rank + 1) % size, 0)
    pg.recv([got], (rank - 1) % size, 0).wait()
    send.wait()
    stream.release()
    return {"rank": rank, "size": size, "from_previous": int(got.item())}


def shared_checks(gen1: World) -> dict[str, Any]:
    out: dict[str, Any] = {"rank1": gen1.rank, "groups1": group_report(gen1)}
    gen1.adopt_as_default()
    group = dist.new_group([0, 1, 2, 3])  # hangs unless every process names it alike
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    out["new_group_sum"] = float(t.item())
    out["default_rank"] = dist.get_rank()
    return out


def scenario(proc: Proc) -> dict[str, Any]:
    index, address = proc.rank, _quiet_child(proc)
    return old_process(index, address) if index < 2 else joiner_process(index, address)


def _quiet_child(proc: Proc) -> StoreAddress:
    """In a child: log warnings only, and return the address of the store the test process hosts."""
    from liver.shared.logs import configure_logging

    configure_logging(level="WARNING")
    return StoreAddress("127.0.0.1", proc.store.port)


def _run(scenario: Any, size: int, timeout_s: float) -> list[Any]:
    return [outcome.unwrap() for outcome in run_world(scenario, size, timeout_s=timeout_s)]


@pytest.fixture(scope="module")
def run() -> list[dict[str, Any]]:
    return _run(scenario, 4, timeout_s=240.0)


def test_background_construction_leaves_the_training_loop_bit_for_bit_unchanged(run: list[dict]) -> None:
    for old in run[:2]:
        assert old["switch_at"] is not None, "the switch was never agreed"
        assert old["digests_with_build"] == old["digests_alone"]
    assert run[0]["digests_with_build"] == run[1]["digests_with_build"]  # data parallel: same state


def test_training_continued_while_the_shadow_world_was_built(run: list[dict]) -> None:
    # Process 0 cannot finish before process 1 starts building, five iterations later.
    assert run[0]["build_done_at"] >= BUILD_STARTS_AT[1]
    for old in run[:2]:
        assert old["build_started_at"] < old["build_done_at"] <= old["switch_at"]


def test_the_loop_alone_never_votes_to_switch(run: list[dict]) -> None:
    for old in run[:2]:
        assert old["verdicts_alone"] == ["wait"]


def test_every_process_enters_the_new_world_at_the_cut_iteration(run: list[dict]) -> None:
    assert run[0]["switch_at"] == run[1]["switch_at"]
    assert {p["entered_at"] for p in run} == {run[0]["switch_at"]}


def test_joiners_are_only_in_the_shadow_world_until_the_switch(run: list[dict]) -> None:
    for joiner in run[2:]:
        assert joiner["live_before_switch"] == (1,)
        assert joiner["default_world_before_switch"] is False


def test_the_placement_gives_each_device_its_rank(run: list[dict]) -> None:
    assert [p["rank1"] for p in run] == [2, 0, 1, 3]
    assert [run[0]["rank0"], run[1]["rank0"]] == [0, 1]


def test_every_group_of_the_new_world_connects_exactly_the_layout_members(run: list[dict]) -> None:
    layout = GEN1["layout"]
    for process in run:
        rank = process["rank1"]
        member_of = {str(k) for k in GroupKind if any(rank in g for g in group_members(layout, k))}
        assert set(process["groups1"]) == member_of
        for kind, got in process["groups1"].items():
            expected = next(g for g in group_members(layout, GroupKind(kind)) if rank in g)
            assert got["ranks"] == list(expected)
            assert got["sum"] == sum(expected)
            assert got["group_size"] == len(expected)
            assert got["group_rank"] == expected.index(rank)


def test_two_generations_coexist_without_colliding(run: list[dict]) -> None:
    for old in run[:2]:
        assert old["live_while_both"] == (0, 1)
        assert old["gen0_sum_after_switch"] == 3.0  # generation 0 still works beside generation 1
    names1 = {g["name"] for p in run for g in p["groups1"].values()}
    assert all(n.startswith(f"liver/{JOB}/gen1/") for n in names1)


def test_a_third_generation_is_refused_while_two_are_alive(run: list[dict]) -> None:
    for old in run[:2]:
        assert "at most two generations" in old["third_generation"]


def test_release_leaves_one_generation_and_unregisters_its_groups(run: list[dict]) -> None:
    for old in run[:2]:
        assert old["live_after_release"] == (1,)
        assert old["gen0_names_left"] == []
        assert old["derived_left"] == []  # the new_group groups made while generation 0 was the default


def test_the_stream_group_numbers_old_devices_first_then_joiners(run: list[dict]) -> None:
    # Old world: devices 0, 1; new-only devices in new rank order: device 2 (rank 1), device 3 (rank 3).
    assert [p["stream"]["rank"] for p in run] == [0, 1, 2, 3]
    for p in run:
        assert p["stream"]["size"] == 4
        assert p["stream"]["from_previous"] == (p["stream"]["rank"] - 1) % 4


def test_adopting_the_new_world_aligns_group_names_across_old_and_new_processes(run: list[dict]) -> None:
    assert {p["counter_before"] for p in run} == {2, 0}  # the old processes made two groups, joiners none
    for process in run:
        assert process["new_group_sum"] == 4.0
        assert process["default_rank"] == process["rank1"]
