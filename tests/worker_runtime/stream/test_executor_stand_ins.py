"""The executor runs a lost rank's sends from the peer copy its keeper holds: the survivors of a lost
node rebuild the whole state, bit for bit, with the lost ranks' shards read from the copies (real gloo
processes on loopback, synthetic state)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mp_helpers import World, run_world

from liver.reshard.holdings import holding, is_dp_sharded
from liver.reshard.plan import Plan, WorldConfig
from liver.reshard.planner import build_plan
from liver.reshard.redundancy import redundancy
from liver.shared.geometry import DdpSettings
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS
from liver.worker_runtime.stream.executor import StreamOptions, stream_plan
from liver.worker_runtime.stream.schedule import GroupRanks, PlanMismatch, ranks_on_device

pytestmark = pytest.mark.slow

A = (Device("a", 0), Device("a", 1))
B = (Device("b", 0), Device("b", 1))
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}
OPTIONS = StreamOptions(timeout_s=120.0, message_bytes=8 * 1024)


def global_tensor(plan: Plan, ti: int) -> torch.Tensor:
    t = plan.tensors[ti]
    g = torch.Generator().manual_seed(7919 * ti + 17)
    if t.dtype == "int64":
        return torch.randint(0, 1 << 40, t.shape, generator=g, dtype=torch.int64)
    return torch.randn(t.shape, generator=g).to(DTYPES[t.dtype])


def local_state(plan: Plan, rank: int, old: bool, only: set[int] | None = None) -> dict[int, Any]:
    """Each tensor ``rank`` holds (of ``only``), as its pieces cut from the global tensors."""
    layout = plan.old.layout if old else plan.new.layout
    out: dict[int, Any] = {}
    for ti, t in enumerate(plan.tensors):
        if only is not None and ti not in only:
            continue
        pieces = holding(t, plan.model, layout, rank)
        if pieces is None:
            continue
        made = []
        for p in pieces:
            local = torch.zeros(p.local_shape, dtype=DTYPES[t.dtype])
            if p.box is not None:
                part = global_tensor(plan, ti)[tuple(slice(lo, hi) for lo, hi in p.box)]
                local[tuple(slice(0, hi - lo) for lo, hi in p.box)] = part
            made.append(local)
        out[ti] = tuple(made) if is_dp_sharded(t, plan.model) else made[0]
    return out


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def recover(w: World, plan: Plan, lost: tuple[Device, ...]) -> list[str]:
    device = A[w.rank]
    old_rank, new_rank = ranks_on_device(plan, device)
    red = redundancy(plan.model, plan.old.layout, plan.old.placement)
    standing = {
        r: local_state(plan, r, old=True, only=set(red.copied[r])) for r, k in plan.stand_ins if k == old_rank
    }
    result = stream_plan(
        plan,
        old_rank=old_rank,
        new_rank=new_rank,
        group=w.group,
        group_ranks=GroupRanks.by_device(plan, lost),
        old_state=local_state(plan, old_rank, old=True),
        options=OPTIONS,
        stand_in_state=standing,
    )
    want = local_state(plan, new_rank, old=False)
    wrong = [plan.tensors[ti].name for ti in want if ti not in result.new_state]
    for ti, value in want.items():
        got = result.new_state.get(ti)
        pieces = value if isinstance(value, tuple) else (value,)
        gots = got if isinstance(got, tuple) else (got,)
        if got is None or [bits(a) for a in pieces] != [bits(b) for b in gots]:
            wrong.append(plan.tensors[ti].name)
    return wrong


CASES = {
    "distributed optimizer, TP2,DP2 -> TP2,DP1": (
        PRESETS["tiny-gpt"].geometry().with_ddp(DdpSettings(distributed_optimizer=True)),
        "TP2,PP1,DP2",
        "TP2,PP1,DP1",
    ),
    "distributed optimizer, TP2,DP2 -> TP1,PP2": (
        PRESETS["tiny-gpt"].geometry().with_ddp(DdpSettings(distributed_optimizer=True)),
        "TP2,PP1,DP2",
        "TP1,PP2,DP1",
    ),
    "DP=1, TP2,PP2 -> TP2,PP1": (PRESETS["tiny-gpt"].geometry(), "TP2,PP2,DP1", "TP2,PP1,DP1"),
}


def recovery_plan(case: str) -> Plan:
    """Node b lost: the case's old world on a and b moves to its new one on a, from the copies."""
    model, old, new = CASES[case]
    return build_plan(
        model,
        WorldConfig(ParallelLayout.parse(old), Placement(A + B)),
        WorldConfig(ParallelLayout.parse(new), Placement(A)),
        budget_bytes=64 * 1024,
        lost=B,
        copies=True,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_survivors_of_a_lost_node_rebuild_every_shard_from_their_state_and_the_copies(case: str) -> None:
    plan = recovery_plan(case)
    assert plan.stand_ins
    outcomes = run_world(recover, 2, args=(plan, B), timeout_s=240)
    assert [o.unwrap() for o in outcomes] == [[], []]


def test_a_keeper_without_the_copy_it_stands_in_with_is_refused_before_any_message() -> None:
    plan = recovery_plan("distributed optimizer, TP2,DP2 -> TP2,DP1")

    class NoGroup:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 2

    with pytest.raises(PlanMismatch, match="stand in for"):
        stream_plan(
            plan,
            old_rank=0,
            new_rank=0,
            group=NoGroup(),  # type: ignore[arg-type]
            group_ranks=GroupRanks.by_device(plan, B),
            old_state=local_state(plan, 0, old=True),
            options=OPTIONS,
        )
