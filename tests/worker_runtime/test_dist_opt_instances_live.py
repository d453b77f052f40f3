"""A real Megatron job with two instances of its distributed optimizer (Megatron's
``num_distributed_optimizer_instances = 2``) loses a node and recovers live from the other instance.

Four processes on two nodes train tiny-gpt at TP1,PP1,DP4: the optimizer state is sharded over DP
ranks {0, 1} (instance 0, node a) and again over {2, 3} (instance 1, node b); and tiny-moe at DP4,EP2,
whose experts' state is sharded over expert-DP (one rank per instance). Every rank's optimizer is
checked against LiveR's ownership as it is built. Node b dies in the update of step 3 (both processes,
once their state of step 2 is saved for the test): the state nobody else held under one instance has a
holder on node a, so no peer copy is kept or read, and the survivors move live to TP1,PP1,DP2 on node a
(still two instances, of one rank each). The state right after the recovery equals, bit for bit, the
state at the end of step 2 gathered from all four (both instances' shards agree), and training goes on.
"""

from __future__ import annotations

import os
import pickle
import threading
from typing import Any

import pytest
from live_chain import as_numpy, bit_identical, gather, next_trainer
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.reshard.plan import Plan, WorldConfig
from liver.reshard.redundancy import NO_KEEPER, redundancy
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS
from liver.worker_runtime.megatron.train_config import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

A = (Device("a", 0), Device("a", 1))
B = (Device("b", 0), Device("b", 1))
DEVICES = A + B
MODEL = PRESETS["tiny-gpt"]
CONFIG = TrainConfig(
    global_batch_size=8,
    micro_batch_size=1,
    seq_length=16,
    use_distributed_optimizer=True,
    num_distributed_optimizer_instances=2,
)
GEOMETRY = MODEL.geometry().with_ddp(CONFIG.ddp)
OLD = ParallelLayout(tp=1, pp=1, dp=4)
NEW = ParallelLayout(tp=1, pp=1, dp=2)
KILLED_IN = 3
STEPS_AFTER = 2
JOB = "instances-fail-stop"
CASES = {
    "gpt": (MODEL, OLD),
    # Experts over EP2: their state sharded over expert-DP (2, one rank per instance), then EP1 at DP2.
    "moe": (PRESETS["tiny-moe"], ParallelLayout(tp=1, pp=1, dp=4, ep=2)),
}


def recovery_plan(case: str) -> Plan:
    from liver.reshard.planner import plan_resize

    model, layout = CASES[case]
    old = WorldConfig(layout, Placement(DEVICES))
    geometry = model.geometry().with_ddp(CONFIG.ddp)
    return plan_resize(geometry, old, NEW, A, budget_bytes=256 * 1024, lost=B, copies=True).plan


def process(proc: Proc, plan: Plan, saved: str, case: str = "gpt") -> dict[str, Any]:
    from live_chain import _quiet

    _quiet()
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.state import snapshot
    from liver.worker_runtime.peers import StepAbandoned
    from liver.worker_runtime.runtime import LiveRuntime, ReshardPhase, RuntimeEvent, RuntimeOptions
    from liver.worker_runtime.world import StoreAddress, WorldSpec

    address = StoreAddress("127.0.0.1", proc.store.port)
    out: dict[str, Any] = {"trace": [], "snapshots": {}, "peer_lost": []}

    def on_event(event: RuntimeEvent) -> None:
        if event.phase is ReshardPhase.PEER_LOST:
            out["peer_lost"].append(event.iteration)
            runtime.request_resize(
                1, plan.new.layout, plan.new.placement, plan, address, lost=B, switch_when_ready=False
            )
        if event.phase is ReshardPhase.READY and event.generation == 1:
            threading.Thread(target=runtime.allow_switch, args=(1,), daemon=True).start()

    model, layout = CASES[case]
    runtime = LiveRuntime(
        MegatronJob(model, CONFIG),
        job=JOB,
        device=DEVICES[proc.rank],
        store=address,
        initial=WorldSpec(job=JOB, generation=0, layout=layout, placement=Placement(DEVICES)),
        options=RuntimeOptions(control_timeout_s=120, build_timeout_s=180, recover_timeout_s=200),
        on_event=on_event,
    )
    trainer = runtime.step()
    out["kept_copies"] = None
    while trainer is not None and trainer.iteration < KILLED_IN + STEPS_AFTER - 1:
        if proc.rank >= 2 and trainer.iteration == KILLED_IN - 1:
            trainer.optimizer.step = lambda *a, **k: os._exit(17)  # node b goes as step 3 updates
        try:
            result = trainer.train_step()
        except StepAbandoned:
            trainer = next_trainer(runtime, out)
            continue
        out["trace"].append((runtime.generation, result.iteration, result.loss))
        out["snapshots"][result.iteration] = as_numpy(snapshot(trainer))
        if out["kept_copies"] is None and runtime.peer_copies is not None:
            copies = runtime.peer_copies
            out["kept_copies"] = (copies.keeper is not None, copies.sender is not None)
        if proc.rank >= 2 and result.iteration == KILLED_IN - 1:
            with open(f"{saved}.{proc.rank}", "wb") as fh:  # what dies with node b, to check against
                pickle.dump(out["snapshots"][result.iteration], fh)
        trainer = next_trainer(runtime, out)
    out["generation"] = runtime.generation
    out["history"] = [type(h).__name__ for h in runtime.history]
    runtime.close()
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    case = request.param
    model, layout = CASES[case]
    geometry = model.geometry().with_ddp(CONFIG.ddp)
    plan = recovery_plan(case)
    saved = str(tmp_path_factory.mktemp("node-b") / "state")
    outcomes = run_world(process, 4, args=(plan, saved, case), timeout_s=400, group_timeout_s=120)
    survivors = {o.rank: o.unwrap() for o in outcomes if o.rank < 2}
    lost = {}
    for rank in (2, 3):
        assert outcomes[rank].status == "died" and outcomes[rank].exitcode == 17, outcomes[rank]
        with open(f"{saved}.{rank}", "rb") as fh:
            lost[rank] = pickle.load(fh)
    states = {r: s["snapshots"][KILLED_IN - 1] for r, s in survivors.items()} | lost
    new_rank = plan.new.placement.rank_on()
    after = {new_rank[DEVICES[p]]: s["after"] for p, s in survivors.items()}
    return {
        "plan": plan,
        "survivors": survivors,
        "before": gather(states, layout, geometry),
        "after": gather(after, NEW, geometry),
        "redundancy": redundancy(geometry, layout, Placement(DEVICES)),
    }


def test_the_other_instance_holds_what_a_node_takes_with_it_so_no_copy_is_kept(run: dict) -> None:
    r = run["redundancy"]
    assert r.keepers == (NO_KEEPER,) * 4 and r.survives_node_loss


def test_the_recovery_plan_reads_nothing_from_copies(run: dict) -> None:
    assert run["plan"].stand_ins == ()
    for rank, s in run["survivors"].items():
        assert s["kept_copies"] == (False, False), rank


def test_the_survivors_recover_live_without_a_checkpoint(run: dict) -> None:
    for rank, s in run["survivors"].items():
        assert s["peer_lost"] == [KILLED_IN - 1], rank
        assert s["history"] == ["SwitchReport"] and s["generation"] == 1, rank
        assert s["after_iteration"] == KILLED_IN - 1


def test_the_recovered_state_equals_the_last_completed_step_of_both_instances_bit_for_bit(run: dict) -> None:
    assert bit_identical(run["before"], run["after"])


def test_training_goes_on_with_two_instances_of_one_rank(run: dict) -> None:
    trace = run["survivors"][0]["trace"]
    assert [it for gen, it, _ in trace if gen == 1] == list(range(KILLED_IN, KILLED_IN + STEPS_AFTER))


# -- a checkpoint of two instances ---------------------------------------------------------------------


SAVED_AT = 2


def saved_then_resumed(proc: Proc, root: str) -> dict[str, Any]:
    """Train DP4 (two instances) to a checkpoint at step 2, then resume it on node a alone at DP2."""
    from live_chain import _quiet

    _quiet()
    from liver.worker_runtime.fallback import CheckpointOptions
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.state import snapshot
    from liver.worker_runtime.runtime import LiveRuntime, RuntimeOptions
    from liver.worker_runtime.world import StoreAddress, WorldSpec

    address = StoreAddress("127.0.0.1", proc.store.port)
    options = RuntimeOptions(checkpoint=CheckpointOptions(root=root, every=SAVED_AT), copies=None)
    out: dict[str, Any] = {}

    def runtime_in(generation: int, layout: ParallelLayout, devices: tuple[Device, ...]) -> LiveRuntime:
        return LiveRuntime(
            MegatronJob(MODEL, CONFIG),
            job=JOB,
            device=DEVICES[proc.rank],
            store=address,
            initial=WorldSpec(job=JOB, generation=generation, layout=layout, placement=Placement(devices)),
            options=options,
        )

    runtime = runtime_in(0, OLD, DEVICES)
    trainer = runtime.step()
    while trainer.iteration < SAVED_AT:
        trainer.train_step()
        trainer = runtime.step()  # saves at the boundary of step 2
    out["saved"] = as_numpy(snapshot(trainer))
    from liver.worker_runtime.megatron.checkpoint import _owned_sharded_state

    out["main_replicas"] = sorted(
        (key, sh.global_offset)
        for key, shards in _owned_sharded_state(trainer).items()
        for sh in shards
        if not any(sh.replica_id)
    )
    runtime.close()
    proc.group.barrier()  # every rank's part is written before anyone resumes
    if proc.rank < 2:
        resumed = runtime_in(1, NEW, A)  # resumes from the checkpoint it finds
        trainer = resumed.step()
        out["resumed"], out["resumed_iteration"] = as_numpy(snapshot(trainer)), trainer.iteration
        resumed.close()
    return out


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("instances-checkpoints"))
    return {o.rank: o.unwrap() for o in run_world(saved_then_resumed, 4, args=(root,), timeout_s=400)}


def test_a_checkpoint_of_two_instances_resumes_at_another_dp_bit_for_bit(checkpointed: dict) -> None:
    saved = gather({r: o["saved"] for r, o in checkpointed.items()}, OLD, GEOMETRY)
    resumed = gather({r: checkpointed[r]["resumed"] for r in (0, 1)}, NEW, GEOMETRY)
    assert checkpointed[0]["resumed_iteration"] == SAVED_AT
    assert bit_identical(saved, resumed)


def test_each_piece_of_two_instances_is_saved_by_one_rank_only(checkpointed: dict) -> None:
    mains = [piece for o in checkpointed.values() for piece in o["main_replicas"]]
    assert mains and len(mains) == len(set(mains))
    assert not checkpointed[2]["main_replicas"] and not checkpointed[3]["main_replicas"]  # instance 1
