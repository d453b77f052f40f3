"""Peer copies of a real Megatron job: after every step each process's keeper holds, bit for bit, the
state that dies with its source's node (the distributed optimizer's shard; with DP=1 the whole shard),
marked with the iteration, while training goes on.

Four processes on two nodes (p0, p1 on node a; p2, p3 on node b): TP2,PP1,DP2 with the distributed
optimizer (TP inside a node, DP across: each rank's Adam moments exist nowhere else), and TP2,PP2,DP1
with plain Adam (no replica at all)."""

from __future__ import annotations

from typing import Any

import pytest
from live_chain import as_numpy
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS
from liver.worker_runtime.megatron.train_config import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DEVICES = (Device("a", 0), Device("a", 1), Device("b", 0), Device("b", 1))
STEPS = 3
CASES = {
    "dist-opt": (ParallelLayout(tp=2, pp=1, dp=2), True),
    "dp1": (ParallelLayout(tp=2, pp=2, dp=1), False),
}


def copies_process(proc: Proc, layout: ParallelLayout, distributed: bool) -> dict[str, Any]:
    from live_chain import _quiet

    _quiet()
    from liver.worker_runtime.copies.peer import unpack
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.runtime import LiveRuntime, RuntimeOptions
    from liver.worker_runtime.world import StoreAddress, WorldSpec

    config = TrainConfig(
        global_batch_size=4, micro_batch_size=1, seq_length=16, use_distributed_optimizer=distributed
    )
    factory = MegatronJob(PRESETS["tiny-gpt"], config)
    address = StoreAddress("127.0.0.1", proc.store.port)
    spec = WorldSpec(job="copies", generation=0, layout=layout, placement=Placement(DEVICES))
    runtime = LiveRuntime(
        factory,
        job="copies",
        device=DEVICES[proc.rank],
        store=address,
        initial=spec,
        options=RuntimeOptions(control_timeout_s=120, build_timeout_s=120),
    )
    own: dict[int, dict[int, Any]] = {}
    kept: dict[int, dict[int, dict[int, Any]]] = {}
    trainer = runtime.step()
    copied: tuple[int, ...] = ()
    for _ in range(STEPS):
        result = trainer.train_step()
        state = factory.copy_state(trainer)
        trainer = runtime.step()
        copies = runtime.peer_copies
        assert copies is not None
        copied = copies.copied
        own[result.iteration] = as_numpy({ti: state[ti] for ti in copied})
        for source in copies.plan.sources(proc.rank):
            copy = copies.keeper.wait_for(source, result.iteration, 120)
            assert copy is not None and copy.iteration == result.iteration, (source, copy and copy.iteration)
            kept.setdefault(source, {})[result.iteration] = as_numpy(
                unpack(copy, factory.model, layout, spec.placement)
            )
    out = {"own": own, "kept": kept, "copied": copied, "plan": runtime.peer_copies.plan}
    # Closing cancels a refresh still in flight: every keeper has its last copy first.
    import torch.distributed as dist

    dist.barrier(group=proc.group)
    runtime.close()
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request: pytest.FixtureRequest) -> dict[str, Any]:
    layout, distributed = CASES[request.param]
    outcomes = run_world(copies_process, 4, args=(layout, distributed), timeout_s=400, group_timeout_s=120)
    return {"case": request.param, "ranks": [o.unwrap() for o in outcomes]}


def test_every_rank_copies_the_state_its_node_alone_holds(run: dict) -> None:
    plan = run["ranks"][0]["plan"]
    assert all(run["ranks"][r]["copied"] for r in range(4))
    assert plan.keepers == (2, 3, 0, 1) and plan.survives_node_loss


def pieces(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def test_each_keeper_holds_its_sources_state_bit_for_bit_after_every_step(run: dict) -> None:
    ranks = run["ranks"]
    for keeper, r in enumerate(ranks):
        for source, by_iteration in r["kept"].items():
            assert sorted(by_iteration) == list(range(1, STEPS + 1))
            for iteration, copy in by_iteration.items():
                mine = ranks[source]["own"][iteration]
                assert copy.keys() == mine.keys()
                for ti, value in mine.items():
                    ours, theirs = pieces(value), pieces(copy[ti])
                    assert [(a.dtype, a.shape) for a in ours] == [(b.dtype, b.shape) for b in theirs]
                    for a, b in zip(ours, theirs):
                        assert a.tobytes() == b.tobytes(), (run["case"], keeper, source, iteration, ti)


def test_the_copies_follow_the_state_from_step_to_step(run: dict) -> None:
    by_iteration = run["ranks"][2]["kept"][0]  # rank 0's copies, kept by rank 2
    first, last = by_iteration[1], by_iteration[STEPS]
    changed = [
        ti
        for ti in first
        if [a.tobytes() for a in pieces(first[ti])] != [b.tobytes() for b in pieces(last[ti])]
    ]
    assert changed
