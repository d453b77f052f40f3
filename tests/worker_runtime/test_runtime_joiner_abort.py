"""A joiner waits to enter a shadow world every process built when the coordinator gives that generation
up (a restarted coordinator does, before its switch). Specification: the old world lets go of it at its
next vote, and the joiner, blocked in the new world's first collective, is set free at once (not at its
enter timeout, ten minutes by default) and goes on with the next request, which commits.

Found by ``liver chaos --workers real``: the trainers' modules hold the shadow world's groups in reference
cycles (Megatron's do), so letting go of the groups did not close their connections and the standby sat
in ``enter_world`` until the coordinator gave the next generation up too. The toy trainer here holds its
groups the same way.

Processes 0 and 1 train DP2; process 2 is a standby. Generation 1 (TP2 on processes 1 and 2: 0 leaves, 2
joins) is built everywhere, then aborted; generation 2 (the same move) switches when ready.
"""

from __future__ import annotations

import gc
import threading
from datetime import timedelta
from typing import Any

import msgspec
import pytest
import torch.distributed as dist
from mp_helpers import World as Proc
from mp_helpers import run_world
from test_runtime import DEVICES, DP2, JOB, TP2, ToyFactory, ToyTrainer, plan_between, world_config

from liver.reshard.plan import Plan
from liver.worker_runtime.runtime import ReshardPhase, RuntimeEvent, RuntimeOptions
from liver.worker_runtime.world import GroupKind, StoreAddress, World, WorldSpec

BUILT, NEXT = 1, 2
SIGNAL_TIMEOUT = timedelta(seconds=90)
MAX_ITERATIONS = 20_000


class CyclicToyFactory(ToyFactory):
    """The toy trainer, holding its world's group in a reference cycle as Megatron's modules do: only a
    collection frees the group (and closes its connections)."""

    def build(self, world: World) -> ToyTrainer:
        trainer = super().build(world)
        trainer.held = {"group": world.group(GroupKind.WORLD), "trainer": trainer}  # type: ignore[attr-defined]
        return trainer


def _process(proc: Proc, plans: dict[int, Plan]) -> dict[str, Any]:
    """Every process hears the coordinator on a thread of its own (as the companion does): Prepare 1;
    once process 0 has seen generation 1 built, Abort 1 and Prepare 2."""
    from liver.shared.logs import configure_logging
    from liver.worker_runtime.runtime import LiveRuntime

    configure_logging(level="ERROR")
    gc.disable()  # as Megatron-LM's --manual-gc does: nothing but an explicit collection frees a cycle
    address = StoreAddress("127.0.0.1", proc.store.port)
    events: list[RuntimeEvent] = []
    standby = proc.rank == 2
    initial = WorldSpec(job=JOB, generation=0, layout=DP2, placement=world_config(DP2, 0, 1).placement)
    runtime = LiveRuntime(
        CyclicToyFactory(),
        job=JOB,
        device=DEVICES[proc.rank],
        store=address,
        initial=None if standby else initial,
        options=RuntimeOptions(control_timeout_s=60.0, build_timeout_s=120.0),
        on_event=events.append,
    )

    def request(g: int, *, switch_when_ready: bool) -> None:
        plan = plans[g]
        runtime.request_resize(
            g, plan.new.layout, plan.new.placement, plan, address, switch_when_ready=switch_when_ready
        )

    def coordinator() -> None:
        request(BUILT, switch_when_ready=False)
        own = dist.TCPStore("127.0.0.1", proc.store.port, is_master=False, timeout=SIGNAL_TIMEOUT)
        own.wait(["built"])  # a client of its own: a waiting client blocks every other call on it
        runtime.abort(BUILT, "the coordinator restarted before the switch")
        request(NEXT, switch_when_ready=True)

    hears = threading.Thread(target=coordinator, daemon=True)
    hears.start()
    trainer = runtime.step()
    signalled = False
    while trainer is not None and trainer.iteration < MAX_ITERATIONS and runtime.generation != NEXT:
        if (
            proc.rank == 0
            and not signalled
            and any(e.generation == BUILT and e.phase is ReshardPhase.READY for e in events)
        ):
            proc.store.set("built", "1")
            signalled = True
        trainer.train_step()
        trainer = runtime.step()
    hears.join(timeout=SIGNAL_TIMEOUT.total_seconds())
    out = {
        "generation": runtime.generation,
        "aborts": [msgspec.to_builtins(a) for a in runtime.aborts],
        "left": trainer is None,
    }
    runtime.close()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    start, moved = world_config(DP2, 0, 1), world_config(TP2, 1, 2)
    plans = {BUILT: plan_between(start, moved), NEXT: plan_between(start, moved)}
    # Without the collection the standby sits in generation 1's enter for its enter timeout (600 s) and
    # the world is killed as hung here.
    return [o.unwrap() for o in run_world(_process, 3, args=(plans,), timeout_s=150)]


@pytest.mark.slow
def test_a_joiner_of_a_built_generation_given_up_goes_on_with_the_next_request(runs: list) -> None:
    assert [r["generation"] for r in runs] == [None, NEXT, NEXT]
    assert runs[0]["left"]
    assert all(any(a["generation"] == BUILT and a["by_request"] for a in r["aborts"]) for r in runs[:2])
    assert any(a["generation"] == BUILT for a in runs[2]["aborts"])
