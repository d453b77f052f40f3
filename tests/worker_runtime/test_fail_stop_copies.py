"""A lost process whose state no survivor holds is recovered live from its peer copy.

One real Megatron job of four processes on two nodes (p0, p1 on node a; p2, p3 on node b) keeps, after
every step, a copy of the state each process alone holds on the process at its place on the other node
(p3's on p1). Three jobs: tiny-gpt with the distributed optimizer at TP2,PP1,DP2 (each DP rank owns half
of the master weights and Adam moments), tiny-gpt with plain Adam at TP2,PP2,DP1 (no replica at all:
p3's whole shard lives only in its copy), and tiny-moe with the distributed optimizer at DP4,EP2 (dense
shards over DP4, expert shards over their expert-DP pair). p3 dies in its third step: as its optimizer
step begins, or in the forward of its second micro-batch (once its last refresh was sent whole). The survivors
are handed the recovery (TP1,PP1,DP3 on p0-p2, planned around the lost device with the copies: p3
"stands in", its sends run by p1 from the copy) and move to it without a checkpoint. The state right
after the recovery equals, bit for bit, the state at the end of step 2 gathered from all four processes
(p3's own saved before it died), and training goes on. In the "refresh" runs p3 dies instead as the
refresh of its copy after step 2 begins: p1 keeps p3's copy of step 1 while the survivors completed
step 2, so they agree to go back to step 1 (each from its own copy of that refresh: the job keeps them,
``CopyOptions.go_back``), and the state after
the recovery equals, bit for bit, the state at the end of step 1 of all four; step 2 is trained again.
In the "after-vote" runs p3 dies right after the commit vote of its third step, which the others passed
with it: they update, and the survivors end at different iterations. With plain Adam all three finish
step 3; with the distributed optimizer p1 is torn (its parameter all-gather with p3 fails after its
update began) while p0 and p2 finish step 3. They agree on step 2, each going back to (p1: mending its
state from) its own copy of it, and the state after the recovery equals step 2 of all four, bit for bit.

In another run a bit of p3's copy flips in p1's memory before the recovery reads it: the copy fails its
checksum, the recovery names the tensor and falls back to the durable checkpoint once (no second
attempt), and training goes on from there. In a last one p3 dies as its very first refresh begins: p1
has no copy of it at all, offers no iteration to resume from, and its peers fail with it at once (no
common iteration, not a timeout of their wait for its offer), falling back to the checkpoint once.
"""

from __future__ import annotations

import os
import pickle
import threading
from typing import Any, NamedTuple

import msgspec
import pytest
from live_chain import as_numpy, bit_identical, gather, next_trainer
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.reshard.plan import Plan, WorldConfig
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS, ModelSpec
from liver.worker_runtime.megatron.train_config import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DEVICES = (Device("a", 0), Device("a", 1), Device("b", 0), Device("b", 1))
DIST_OPT = TrainConfig(global_batch_size=6, micro_batch_size=1, seq_length=16, use_distributed_optimizer=True)
NEW = ParallelLayout(tp=1, pp=1, dp=3)
VICTIM = 3
KILLED_IN = 3
STEPS_AFTER = 2
JOB = "copies-fail-stop"


class Case(NamedTuple):
    model: ModelSpec
    config: TrainConfig
    old: ParallelLayout

    @property
    def geometry(self) -> ModelGeometry:
        return self.model.geometry().with_ddp(self.config.ddp)


CASES = {
    # Each DP rank's master weights and moments exist nowhere else.
    "dist-opt": Case(PRESETS["tiny-gpt"], DIST_OPT, ParallelLayout(tp=2, pp=1, dp=2)),
    # No replica at all: p3's whole shard (its half of stage 2, plain Adam) lives only in its copy.
    "dp1": Case(
        PRESETS["tiny-gpt"],
        msgspec.structs.replace(DIST_OPT, use_distributed_optimizer=False),
        ParallelLayout(tp=2, pp=2, dp=1),
    ),
    # Dense shards over DP4, the experts' shards over their expert-DP pair (p1, p3).
    "moe-dist-opt": Case(
        PRESETS["tiny-moe"],
        msgspec.structs.replace(DIST_OPT, global_batch_size=12),  # DP4, then DP3
        ParallelLayout(tp=1, pp=1, dp=4, ep=2),
    ),
}
RUNS = [
    ("dist-opt", "update"),
    ("dist-opt", "mid-step"),
    ("dist-opt", "refresh"),
    ("dist-opt", "after-vote"),
    ("dp1", "update"),
    ("dp1", "refresh"),
    ("dp1", "after-vote"),
    ("moe-dist-opt", "mid-step"),
]


def resumed(when: str) -> int:
    """The iteration the survivors resume from: the last completed, or the one before when p3 died
    in its copy's refresh (its copy a step behind theirs)."""
    return KILLED_IN - 2 if when == "refresh" else KILLED_IN - 1


def kept_at(case: Case, when: str, rank: int) -> int:
    """The iteration survivor ``rank`` completed when it found p3 lost. After p3's commit vote the
    others update: with plain Adam all of them finish step 3; with the distributed optimizer p1, which
    gathers parameters with p3, is torn inside step 3 (it reports 2, and mends its state from its own
    copy of it), while p0 and p2 finish it."""
    if when != "after-vote" or (rank == 1 and case.config.use_distributed_optimizer):
        return KILLED_IN - 1
    return KILLED_IN


def recovery_plan(case: Case) -> Plan:
    from liver.reshard.planner import plan_resize

    old = WorldConfig(case.old, Placement(DEVICES))
    return plan_resize(
        case.geometry, old, NEW, DEVICES[:3], budget_bytes=256 * 1024, lost=[DEVICES[VICTIM]], copies=True
    ).plan


CHECKPOINT_EVERY = 2
CORRUPT_AT = 100  # a byte of p3's copy (in its first copied tensor), flipped in p1's memory


def first_copied_tensor(case: Case) -> str:
    from liver.reshard.redundancy import copied_tensors

    geometry = case.geometry
    ti = copied_tensors(geometry, case.old, Placement(DEVICES), VICTIM)[0]
    return geometry.tensors(optimizer=True)[ti].name


def process(
    proc: Proc,
    case: Case,
    plan: Plan,
    when: str,
    saved: str,
    root: str | None = None,
    every: int = CHECKPOINT_EVERY,
) -> dict[str, Any]:
    from live_chain import _quiet

    _quiet()
    from liver.worker_runtime.copies.manager import CopyOptions
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.state import snapshot
    from liver.worker_runtime.peers import StepAbandoned
    from liver.worker_runtime.runtime import (
        CheckpointOptions,
        LiveRuntime,
        ReshardPhase,
        RuntimeEvent,
        RuntimeOptions,
    )
    from liver.worker_runtime.world import StoreAddress, WorldSpec

    address = StoreAddress("127.0.0.1", proc.store.port)
    factory = MegatronJob(case.model, case.config)
    if proc.rank == VICTIM and when == "first-refresh":  # before the sender exists: patch its class
        from liver.worker_runtime.copies.sender import CopySender

        _die_in_refresh(CopySender, 1)
    out: dict[str, Any] = {"trace": [], "snapshots": {}, "peer_lost": []}

    def on_event(event: RuntimeEvent) -> None:
        if event.phase is ReshardPhase.PEER_LOST:
            out["peer_lost"].append(event.iteration)
            if root is not None and when == "update" and proc.rank == 1:  # a bit of p3's copy flips in p1
                copy = runtime.peer_copies.keeper.latest(VICTIM)
                copy.data.obj[CORRUPT_AT] ^= 0x08
            runtime.request_resize(
                1,
                plan.new.layout,
                plan.new.placement,
                plan,
                address,
                lost=(DEVICES[VICTIM],),
                switch_when_ready=False,
            )
        if event.phase is ReshardPhase.READY and event.generation == 1:
            threading.Thread(target=runtime.allow_switch, args=(1,), daemon=True).start()

    runtime = LiveRuntime(
        factory,
        job=JOB,
        device=DEVICES[proc.rank],
        store=address,
        initial=WorldSpec(job=JOB, generation=0, layout=case.old, placement=Placement(DEVICES)),
        options=RuntimeOptions(
            copies=CopyOptions(go_back=True),  # a loss in a refresh goes back a step
            control_timeout_s=120,
            build_timeout_s=180,
            recover_timeout_s=200,
            checkpoint=None if root is None else CheckpointOptions(root=root, every=every),
        ),
        on_event=on_event,
    )
    trainer = runtime.step()
    while trainer is not None and trainer.iteration < KILLED_IN + STEPS_AFTER - 1:
        if (
            proc.rank == VICTIM
            and trainer.iteration == KILLED_IN - 1
            and when in ("update", "mid-step", "after-vote")
        ):
            _die_in_step(trainer, runtime, when)
        if proc.rank == VICTIM and trainer.iteration == KILLED_IN - 2 and when == "refresh":
            _die_in_refresh(runtime.peer_copies.sender, KILLED_IN - 1)
        try:
            result = trainer.train_step()
        except StepAbandoned:
            trainer = next_trainer(runtime, out)
            continue
        out["trace"].append((runtime.generation, result.iteration, result.loss))
        out["snapshots"][result.iteration] = as_numpy(snapshot(trainer))
        if proc.rank == VICTIM and result.iteration == resumed(when):
            with open(saved, "wb") as fh:  # what dies with p3, for the test to check the recovery against
                pickle.dump(out["snapshots"][result.iteration], fh)
        trainer = next_trainer(runtime, out)
    out["generation"] = runtime.generation
    out["left"] = runtime.left
    out["history"] = [type(h).__name__ for h in runtime.history]
    out["fallbacks"] = [(f.iteration, f.reached_iteration, f.reason) for f in runtime.fallbacks]
    runtime.close()
    return out


def _die_in_refresh(sender: Any, iteration: int) -> None:
    """Exit as the copy's refresh of ``iteration`` begins, after that iteration's update: its keeper
    keeps the copy of the iteration before, which the survivors have left behind."""
    send = sender._send
    bound = not isinstance(sender, type)

    def dying(*args: Any) -> Any:
        if args[0 if bound else 1] == iteration:
            os._exit(17)
        return send(*args)

    sender._send = dying


def _die_in_step(trainer: Any, runtime: Any, when: str) -> None:
    """Exit inside the next step: as its update begins (the last refresh was read before it), or in the
    forward of its second micro-batch once the last refresh was sent whole (a loss in the refresh
    itself leaves the copy a step behind: not this test's case)."""
    if when == "after-vote":  # the others passed the vote with it: they update, then need it again

        def gone(*_: Any) -> None:
            assert runtime.peer_copies.wait_sent(trainer.iteration, 60.0)
            os._exit(17)

        for inner in trainer._inner_optimizers():
            inner.register_step_pre_hook(gone)  # after the trainer's own hook, the commit vote
        return
    if when == "update":

        def dying(*args: Any, **kwargs: Any) -> Any:
            assert runtime.peer_copies.wait_sent(trainer.iteration, 60.0)  # read is not yet sent whole
            os._exit(17)

        trainer.optimizer.step = dying
        return
    original, calls = trainer.forward_step, [0]

    def dying_forward(data_iterator: Any, model: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            assert runtime.peer_copies.wait_sent(trainer.iteration, 60.0)
            os._exit(17)
        return original(data_iterator, model)

    trainer.forward_step = dying_forward


@pytest.fixture(scope="module", params=RUNS, ids=[f"{c}-{w}" for c, w in RUNS])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    name, when = request.param
    case = CASES[name]
    plan = recovery_plan(case)
    saved = str(tmp_path_factory.mktemp("victim") / "state.pkl")
    outcomes = run_world(process, 4, args=(case, plan, when, saved), timeout_s=400, group_timeout_s=120)
    victim = outcomes[VICTIM]
    survivors = {o.rank: o.unwrap() for o in outcomes if o.rank != VICTIM}
    with open(saved, "rb") as fh:
        lost_state = pickle.load(fh)
    states = {r: s["snapshots"][resumed(when)] for r, s in survivors.items()} | {VICTIM: lost_state}
    before = gather(states, case.old, case.geometry)
    new_rank = plan.new.placement.rank_on()
    after = gather({new_rank[DEVICES[p]]: s["after"] for p, s in survivors.items()}, NEW, case.geometry)
    return {
        "plan": plan,
        "victim": victim,
        "survivors": survivors,
        "before": before,
        "after": after,
        "resumed": resumed(when),
        "when": when,
        "case": case,
    }


def test_the_plan_reads_the_lost_processs_shard_from_its_copy(runs: dict) -> None:
    assert runs["plan"].stand_ins == ((VICTIM, 1),)


def test_the_survivors_recover_live_without_a_checkpoint(runs: dict) -> None:
    assert runs["victim"].status == "died" and runs["victim"].exitcode == 17
    for rank, s in runs["survivors"].items():
        assert s["peer_lost"] == [kept_at(runs["case"], runs["when"], rank)], (
            rank
        )  # the last step it completed
        assert s["history"] == ["SwitchReport"] and s["generation"] == 1, rank
        assert s["after_iteration"] == runs["resumed"]


def test_the_recovered_state_equals_the_last_completed_step_of_all_four_bit_for_bit(runs: dict) -> None:
    assert bit_identical(runs["before"], runs["after"])


def test_training_goes_on_on_the_new_world(runs: dict) -> None:
    trace = runs["survivors"][0]["trace"]
    after = [it for gen, it, _ in trace if gen == 1]
    assert after == list(range(runs["resumed"] + 1, KILLED_IN + STEPS_AFTER))


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    case = CASES["dist-opt"]
    saved = str(tmp_path_factory.mktemp("victim-corrupt") / "state.pkl")
    root = str(tmp_path_factory.mktemp("checkpoints"))
    args = (case, recovery_plan(case), "update", saved, root)
    outcomes = run_world(process, 4, args=args, timeout_s=400, group_timeout_s=120)
    assert outcomes[VICTIM].status == "died", outcomes[VICTIM]
    return {o.rank: o.unwrap() for o in outcomes if o.rank != VICTIM}


def test_a_copy_that_fails_its_checksum_is_named_and_the_job_falls_back_to_its_checkpoint_once(
    corrupted: dict,
) -> None:
    name = first_copied_tensor(CASES["dist-opt"])
    for rank, s in corrupted.items():
        assert s["history"] == ["FallbackReport"], (rank, s["history"])
        [(iteration, reached, _)] = s["fallbacks"]
        assert (iteration, reached) == (CHECKPOINT_EVERY, KILLED_IN - 1), rank
    keeper_reason = corrupted[1]["fallbacks"][0][2]
    assert f"{name} fails its checksum" in keeper_reason and f"rank {VICTIM}" in keeper_reason


def test_a_survivor_without_the_lost_copy_offers_nothing_and_its_peers_fail_with_it_at_once(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    case = CASES["dist-opt"]
    saved = str(tmp_path_factory.mktemp("victim-first") / "state.pkl")
    root = str(tmp_path_factory.mktemp("checkpoints-first"))
    args = (case, recovery_plan(case), "first-refresh", saved, root, 1)
    outcomes = run_world(process, 4, args=args, timeout_s=400, group_timeout_s=120)
    assert outcomes[VICTIM].status == "died", outcomes[VICTIM]
    survivors = {o.rank: o.unwrap() for o in outcomes if o.rank != VICTIM}
    for rank, s in survivors.items():
        assert s["history"] == ["FallbackReport"], (rank, s["history"])
        [(iteration, reached, reason)] = s["fallbacks"]
        assert (iteration, reached) == (1, 1), (rank, reason)
        if rank == 1:  # the keeper: the copy it should stand in with is missing
            assert f"no complete peer copy of old rank {VICTIM}" in reason, reason
        else:
            assert "no common iteration" in reason and "timed out" not in reason.lower(), (rank, reason)


def test_after_the_fallback_training_goes_on_from_the_checkpoint(corrupted: dict) -> None:
    trace = corrupted[0]["trace"]
    after = [it for gen, it, _ in trace if gen == corrupted[0]["generation"]]
    assert after[0] == CHECKPOINT_EVERY + 1 and after[-1] == KILLED_IN + STEPS_AFTER - 1
