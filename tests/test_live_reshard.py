"""A real Megatron GPT job reshards live, and continues exactly as a reload of its state would.

One job of six processes runs a chain of live reshards through :class:`LiveRuntime` (each process with a
companion thread that hands in the requests, as the bus companion will):

    gen 0  TP2,PP2,DP1 on p0-p3                          the start
    gen 1  TP1,PP2,DP2 on p0-p3   TP and DP change
    gen 2  TP4,PP1,DP1 on p0-p3   PP change (and TP, DP)
    gen 3  TP2,PP1,DP1 on p0,p1   scale-in: p2 and p3 stream their state out and exit (TP change)
    gen 4  TP2,PP1,DP2 on p0,p1,p4,p5  scale-out: p4 and p5 warm up, join at the cut (DP change)
    gen 5  TP4,PP1,DP1 on the same four, with p5's stream cancelled: rolled back, training goes on

Placements come from the planner (``plan_resize``, optimised), so ranks move between processes. p0
plays the coordinator: two steps after each cut it publishes the next request through the store.
Every process snapshots its local state after each step; the snapshot before a switch is the state at
the cut. A second, separate job of four processes is the checkpoint-equivalent baseline: for each
generation it builds fresh trainers at the new layout, loads the global state gathered at the cut
(sliced with the view function) and trains as many steps as the live job did there.

Dropout is on (0.1): the comparison covers the random streams too (every switch reseeds them from the
seed, the cut's iteration and the new coordinates, as a reload does; a rolled-back handoff restores
the streams it found). The tests read what the two jobs reported.
"""

from __future__ import annotations

import math
import threading
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pytest
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS
from liver.shared.plan import Plan, WorldConfig
from liver.shared.views import view
from liver.worker_runtime.megatron.train_config import TrainConfig

# The processes' own limits (run_world's, 280 s and 240 s) end a stuck run; the test's limit is above them.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SPEC = PRESETS["tiny-gpt"]
CONFIG = TrainConfig(
    global_batch_size=4,
    micro_batch_size=1,
    seq_length=16,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)
JOB = "live-reshard"
DEVICES = tuple(Device("n0", i) for i in range(6))
START = ParallelLayout(tp=2, pp=2, dp=1)
START_PROCESSES = (0, 1, 2, 3)
STEPS = 2  # steps on the start world, and on each new world before the next request
BUDGET = 256 * 1024  # staging budget: several rounds per layer
FAULT_PROCESS = 5
ITERATION_CAP = 60  # a safety stop: no scenario here comes near it
CONTROL_TIMEOUT_S = 120.0
"""Generous: six Megatron processes share a (possibly busy) two-core machine, and a rank may wait that
long for its peers' votes. A failed stream must abort far sooner (see the fault test)."""


class Transition(NamedTuple):
    name: str
    layout: ParallelLayout
    processes: tuple[int, ...]


TRANSITIONS = {
    1: Transition("TP and DP change", ParallelLayout(tp=1, pp=2, dp=2), (0, 1, 2, 3)),
    2: Transition("PP change", ParallelLayout(tp=4, pp=1, dp=1), (0, 1, 2, 3)),
    3: Transition("scale-in", ParallelLayout(tp=2, pp=1, dp=1), (0, 1)),
    4: Transition("scale-out", ParallelLayout(tp=2, pp=1, dp=2), (0, 1, 4, 5)),
    5: Transition("cancelled stream", ParallelLayout(tp=4, pp=1, dp=1), (0, 1, 4, 5)),
}
SWITCHED = (1, 2, 3, 4)
FAULT_GENERATION = 5
LEAVERS = (2, 3)
JOINERS = (4, 5)


def make_plans() -> dict[int, Plan]:
    """The planner's plans for the chain, as the transfer service would make them."""
    from liver.services.transfer.planner import plan_resize

    old = WorldConfig(START, Placement(tuple(DEVICES[p] for p in START_PROCESSES)))
    plans = {}
    for generation, t in TRANSITIONS.items():
        devices = [DEVICES[p] for p in t.processes]
        plans[generation] = plan_resize(SPEC, old, t.layout, devices, budget_bytes=BUDGET).plan
        old = plans[generation].new
    return plans


# -- state helpers (numpy, so that results cross process boundaries as plain arrays) ---------------------


def as_numpy(state: dict[int, Any]) -> dict[int, np.ndarray]:
    return {index: tensor.detach().cpu().numpy().copy() for index, tensor in state.items()}


def gather(states: dict[int, dict[int, np.ndarray]], layout: ParallelLayout) -> dict[int, np.ndarray]:
    """The global tensors, assembled from every rank's local state through the view function's boxes.

    Every element must be covered, and every replica of an element (DP replicas, the tied embedding's
    copy on the last stage) must hold the same bits.
    """
    tensors = SPEC.tensors()
    full: dict[int, np.ndarray] = {}
    seen: dict[int, np.ndarray] = {}
    for rank, state in sorted(states.items()):
        for index, local in state.items():
            spec = tensors[index]
            shard = view(spec, SPEC, layout, rank)
            assert shard is not None, f"rank {rank} holds {spec.name}, which its view does not give it"
            if shard.box is None:
                continue
            target = full.setdefault(index, np.zeros(spec.shape, dtype=local.dtype))
            covered = seen.setdefault(index, np.zeros(spec.shape, dtype=bool))
            box = tuple(slice(lo, hi) for lo, hi in shard.box)
            piece = local[tuple(slice(0, hi - lo) for lo, hi in shard.box)]
            overlap = covered[box]
            if overlap.any():
                assert np.array_equal(target[box][overlap], piece[overlap]), (
                    f"{spec.name}: rank {rank}'s replica disagrees with another rank's"
                )
            target[box] = piece
            covered[box] = True
    for index, spec in enumerate(tensors):
        assert index in seen and seen[index].all(), f"{spec.name} is not fully covered"
    return full


def local_slice(full: dict[int, np.ndarray], layout: ParallelLayout, rank: int) -> dict[int, np.ndarray]:
    """``rank``'s local state of ``layout`` cut out of the global tensors (vocabulary padding zero)."""
    out = {}
    for index, spec in enumerate(SPEC.tensors()):
        shard = view(spec, SPEC, layout, rank)
        if shard is None:
            continue
        local = np.zeros(shard.local_shape, dtype=full[index].dtype)
        if shard.box is not None:
            local[tuple(slice(0, hi - lo) for lo, hi in shard.box)] = full[index][
                tuple(slice(lo, hi) for lo, hi in shard.box)
            ]
        out[index] = local
    return out


def max_deviation(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(
        float(np.max(np.abs(a[i].astype(np.float64) - b[i].astype(np.float64)), initial=0.0)) for i in a
    )


def bit_identical(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[i].dtype == b[i].dtype and a[i].tobytes() == b[i].tobytes() for i in a
    )


# -- the live job ------------------------------------------------------------------------------------------


def _quiet() -> None:
    import torch

    from liver.shared.logs import configure_logging

    configure_logging(level="WARNING")
    torch.set_num_threads(1)


def _companion(runtime: Any, address: Any, plans: dict[int, Plan], device: Device) -> None:
    """What the bus companion will do: wait for each request that concerns this device, hand it in."""
    from liver.worker_runtime.world import connect_store

    store = connect_store(address, timedelta(seconds=240))
    for generation, plan in sorted(plans.items()):
        if device not in plan.old.placement.devices and device not in plan.new.placement.devices:
            continue
        store.wait([f"go/{generation}"], timedelta(seconds=240))
        runtime.request_resize(
            generation,
            plan.new.layout,
            plan.new.placement,
            plan,
            address,
            deadline=datetime.now(UTC) + timedelta(seconds=120),
        )


def _storage_left(trainer: Any) -> int:
    """Bytes still allocated to a trainer's parameters, Adam moments and gradient buffers."""
    tensors = list(trainer.gpt.parameters())
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for state in opt.optimizer.state.values():
            tensors += [state["exp_avg"], state["exp_avg_sq"]]
    tensors += [buffer.grad_data for buffer in trainer.model.buffers]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def live_process(proc: Proc, plans: dict[int, Plan]) -> dict[str, Any]:
    _quiet()
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.state import snapshot
    from liver.worker_runtime.runtime import LiveRuntime, RuntimeOptions
    from liver.worker_runtime.world import StoreAddress, WorldSpec, live_generations

    device = DEVICES[proc.rank]
    address = StoreAddress("127.0.0.1", proc.store.port)
    factory = MegatronJob(SPEC, CONFIG)

    def cancel_stream(generation: int, layer: int, rnd: int) -> None:
        if proc.rank == FAULT_PROCESS and generation == FAULT_GENERATION:
            raise RuntimeError(f"injected fault in layer {layer} round {rnd}")

    runtime = LiveRuntime(
        factory,
        job=JOB,
        device=device,
        store=address,
        initial=WorldSpec(
            job=JOB,
            generation=0,
            layout=START,
            placement=Placement(tuple(DEVICES[p] for p in START_PROCESSES)),
        ),
        options=RuntimeOptions(control_timeout_s=CONTROL_TIMEOUT_S, build_timeout_s=180, join_timeout_s=200),
        on_stream_step=cancel_stream,
    )
    threading.Thread(target=_companion, args=(runtime, address, plans, device), daemon=True).start()

    out: dict[str, Any] = {
        "trace": [],
        "step_seconds": [],
        "switches": {},
        "progress": {},
        "old_storage_left": [],
    }
    published: set[int] = set()
    last: tuple[int, dict[int, np.ndarray], bytes] | None = None  # (iteration, state, progress)
    generation = None
    trainer = runtime.step()
    while trainer is not None:
        if runtime.generation != generation and runtime.last_switch is not None:
            # a switch committed (or, in a joiner, the join)
            entry = {"after": as_numpy(snapshot(trainer))}
            if last is not None:
                entry["before"], entry["before_iteration"] = last[1], last[0]
                out["progress"][runtime.generation] = last[2]
            out["switches"][runtime.generation] = entry
        generation = runtime.generation
        iteration = trainer.iteration
        aborts = runtime.aborts
        if (aborts and iteration >= aborts[-1].iteration + STEPS) or iteration >= ITERATION_CAP:
            break
        if proc.rank == 0:  # the coordinator: the next request, STEPS steps after the last cut
            cut = runtime.last_switch.iteration if runtime.last_switch is not None else 0
            nxt = (runtime.generation or 0) + 1
            if nxt in TRANSITIONS and nxt not in published and iteration >= cut + STEPS:
                published.add(nxt)
                proc.store.set(f"go/{nxt}", "1")
        result = trainer.train_step()
        out["trace"].append((runtime.generation, result.iteration, result.loss, result.grad_norm))
        out["step_seconds"].append(result.seconds)
        last = (trainer.iteration, as_numpy(snapshot(trainer)), factory.progress(trainer))
        previous, trainer = trainer, runtime.step()
        if trainer is not previous:  # switched (or left): the old trainer's memory is already free
            out["old_storage_left"].append(_storage_left(previous))
        del previous

    out["left"] = runtime.left
    if runtime.left:
        assert last is not None and runtime.last_switch is not None
        out["switches"][runtime.last_switch.generation] = {"before": last[1], "before_iteration": last[0]}
    for report in runtime.reports:  # taken at the end: first_step_s is filled in after the switch
        out["switches"][report.generation]["report"] = msgspec.to_builtins(report)
    out["history"] = [msgspec.to_builtins(h) | {"type": type(h).__name__} for h in runtime.history]
    out["generation"] = runtime.generation
    out["live_generations"] = live_generations(JOB)
    runtime.close()
    return out


# -- the baseline job: fresh trainers at each new layout, loaded with the gathered state -------------------


class Reload(NamedTuple):
    generation: int
    old_layout: ParallelLayout
    layout: ParallelLayout
    state: dict[int, np.ndarray]  # the global tensors at the cut
    progress: bytes
    steps: int


def _fresh_world(proc: Proc, generation: int, layout: ParallelLayout) -> Any:
    from liver.worker_runtime.world import StoreAddress, WorldSpec, build_world

    size = layout.world_size
    spec = WorldSpec(
        job="baseline", generation=generation, layout=layout, placement=Placement(DEVICES[:size])
    )
    address = StoreAddress("127.0.0.1", proc.store.port)
    world = build_world(spec, DEVICES[proc.rank], address, timeout=timedelta(seconds=120))
    world.adopt_as_default()
    return world


def _loaded(reload: Reload, layout: ParallelLayout, rank: int) -> dict[int, Any]:
    import torch

    return {i: torch.from_numpy(a) for i, a in local_slice(reload.state, layout, rank).items()}


def baseline_process(proc: Proc, reloads: list[Reload], checkpoints: str) -> dict[str, dict[int, list]]:
    """For each generation: (1) fresh trainers at the new layout load the gathered cut state directly;
    (2) trainers at the old layout holding that state save a ``dist_checkpointing`` checkpoint, and fresh
    trainers at the new layout load it (reshape on load). Both then train as many steps as the live job."""
    _quiet()
    from pathlib import Path

    from liver.worker_runtime.megatron.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.streams import reseed

    factory = MegatronJob(SPEC, CONFIG)
    traces: dict[str, dict[int, list]] = {"reload": {}, "checkpoint": {}}
    for reload in reloads:
        root = Path(checkpoints) / f"gen{reload.generation}"
        if proc.rank < reload.old_layout.world_size:
            world = _fresh_world(proc, 2 * reload.generation, reload.old_layout)
            trainer = factory.build(world)
            factory.resume(trainer, _loaded(reload, reload.old_layout, world.rank), reload.progress)
            save_checkpoint(trainer, root)
            del trainer
            world.release()
        if proc.rank >= reload.layout.world_size:
            continue
        # Every member of the new world arrives only after its save: the checkpoint is complete here.
        world = _fresh_world(proc, 2 * reload.generation + 1, reload.layout)
        trainer = factory.build(world)
        factory.resume(trainer, _loaded(reload, reload.layout, world.rank), reload.progress)
        steps = [trainer.train_step() for _ in range(reload.steps)]
        traces["reload"][reload.generation] = [(r.iteration, r.loss, r.grad_norm) for r in steps]
        del trainer
        trainer = factory.build(world)
        checkpoint = latest_checkpoint(root)
        assert checkpoint is not None
        manifest = load_checkpoint(trainer, checkpoint)
        reseed(CONFIG, manifest.iteration, reload.layout, world.rank)  # the live path's rule
        steps = [trainer.train_step() for _ in range(reload.steps)]
        traces["checkpoint"][reload.generation] = [(r.iteration, r.loss, r.grad_norm) for r in steps]
        del trainer
        world.release()
    return traces


# -- running both ------------------------------------------------------------------------------------------


class Runs(NamedTuple):
    live: list[dict[str, Any]]
    baseline: dict[int, list[tuple[int, float, float]]]  # direct reload of the gathered state
    checkpoint: dict[int, list[tuple[int, float, float]]]  # save at the old layout, load at the new
    plans: dict[int, Plan]
    before: dict[int, dict[int, np.ndarray]]
    after: dict[int, dict[int, np.ndarray]]
    cuts: dict[int, int]


def _old_layout(plans: dict[int, Plan], generation: int) -> ParallelLayout:
    return plans[generation].old.layout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    plans = make_plans()
    live = [o.unwrap() for o in run_world(live_process, 6, args=(plans,), timeout_s=280, group_timeout_s=120)]
    before, after, cuts, reloads = {}, {}, {}, []
    for generation in SWITCHED:
        plan = plans[generation]
        old_rank = plan.old.placement.rank_on()
        new_rank = plan.new.placement.rank_on()
        olds = {
            old_rank[DEVICES[p]]: r["switches"][generation]["before"]
            for p, r in enumerate(live)
            if DEVICES[p] in old_rank
        }
        news = {
            new_rank[DEVICES[p]]: r["switches"][generation]["after"]
            for p, r in enumerate(live)
            if DEVICES[p] in new_rank
        }
        before[generation] = gather(olds, plan.old.layout)
        after[generation] = gather(news, plan.new.layout)
        cuts[generation] = live[0]["switches"][generation]["report"]["iteration"]
    end = live[0]["trace"][-1][1]
    for generation in SWITCHED:
        until = cuts.get(generation + 1, end)
        plan = plans[generation]
        reloads.append(
            Reload(
                generation,
                plan.old.layout,
                plan.new.layout,
                before[generation],
                live[0]["progress"][generation],
                until - cuts[generation],
            )
        )
    checkpoints = str(tmp_path_factory.mktemp("checkpoints"))
    outcomes = run_world(baseline_process, 4, args=(reloads, checkpoints), timeout_s=240, group_timeout_s=90)
    baseline = outcomes[0].unwrap()
    return Runs(live, baseline["reload"], baseline["checkpoint"], plans, before, after, cuts)


def _reports(runs: Runs, generation: int) -> dict[int, dict[str, Any]]:
    """Process index -> its switch report for ``generation`` (every process of either world)."""
    return {
        p: r["switches"][generation]["report"] for p, r in enumerate(runs.live) if generation in r["switches"]
    }


def _live_trace(runs: Runs, generation: int, process: int = 0) -> list[tuple[int, float, float]]:
    return [(it, loss, norm) for gen, it, loss, norm in runs.live[process]["trace"] if gen == generation]


# -- the tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generation", SWITCHED, ids=[TRANSITIONS[g].name for g in SWITCHED])
def test_every_process_of_both_worlds_switches_at_the_same_cut(runs: Runs, generation: int) -> None:
    plan = runs.plans[generation]
    everyone = set(plan.old.placement.devices) | set(plan.new.placement.devices)
    reports = _reports(runs, generation)
    assert {DEVICES[p] for p in reports} == everyone
    assert {r["iteration"] for r in reports.values()} == {runs.cuts[generation]}
    for p, found in enumerate(runs.live):
        entry = found["switches"].get(generation, {})
        if "before" in entry:  # the snapshot before the switch is the state at the cut
            assert entry["before_iteration"] == runs.cuts[generation], f"process {p}"


@pytest.mark.parametrize("generation", SWITCHED, ids=[TRANSITIONS[g].name for g in SWITCHED])
def test_the_global_state_right_after_the_switch_equals_the_state_right_before_it(
    runs: Runs, generation: int
) -> None:
    before, after = runs.before[generation], runs.after[generation]
    assert max_deviation(before, after) == 0.0
    assert bit_identical(before, after)


@pytest.mark.parametrize("generation", SWITCHED, ids=[TRANSITIONS[g].name for g in SWITCHED])
def test_the_trace_after_the_switch_equals_a_reload_of_the_cut_state_at_the_new_layout(
    runs: Runs, generation: int
) -> None:
    live = _live_trace(runs, generation)
    assert len(live) >= STEPS
    assert live == runs.baseline[generation]


@pytest.mark.parametrize("generation", SWITCHED, ids=[TRANSITIONS[g].name for g in SWITCHED])
def test_the_trace_after_the_switch_equals_a_dist_checkpointing_save_and_load_at_the_new_layout(
    runs: Runs, generation: int
) -> None:
    assert _live_trace(runs, generation) == runs.checkpoint[generation]


def test_a_failed_stream_is_rolled_back_and_training_continues_on_the_old_world_unchanged(runs: Runs) -> None:
    plan = runs.plans[FAULT_GENERATION]
    for p, found in enumerate(runs.live):
        if DEVICES[p] not in plan.new.placement.devices:
            continue
        (abort,) = [h for h in found["history"] if h["type"] == "AbortReport"]
        assert abort["generation"] == FAULT_GENERATION
        assert abort["stage"] in ("stream", "commit")
        assert found["generation"] == 4
        assert found["live_generations"] == (4,)
    (fault,) = [h for h in runs.live[FAULT_PROCESS]["history"] if h["type"] == "AbortReport"]
    assert "injected fault" in fault["reason"]
    # The failing process destroys its groups, so its peers fail at once instead of at a timeout.
    for p in TRANSITIONS[FAULT_GENERATION].processes:
        (abort,) = [h for h in runs.live[p]["history"] if h["type"] == "AbortReport"]
        assert 0 < abort["pause_s"] < CONTROL_TIMEOUT_S / 3, p
    # The trace across the aborted handoff is the trace of a job that never tried it.
    trace = _live_trace(runs, 4)
    assert trace[-1][0] > fault["iteration"] + 1
    assert trace == runs.baseline[4] == runs.checkpoint[4]


def test_leaving_processes_stream_their_state_out_and_then_exit(runs: Runs) -> None:
    for p in LEAVERS:
        found = runs.live[p]
        assert found["left"] is True
        assert found["generation"] is None
        assert found["live_generations"] == ()
        report = found["switches"][3]["report"]
        assert report["role"] == "leave" and report["new_rank"] is None
        assert report["bytes_sent"] > 0


def test_joining_processes_warm_up_alone_then_enter_at_the_cut(runs: Runs) -> None:
    for p in JOINERS:
        found = runs.live[p]
        report = found["switches"][4]["report"]
        assert report["role"] == "join" and report["old_rank"] is None
        assert report["warmup_s"] > 0
        assert report["iteration"] == runs.cuts[4]
        assert report["bytes_received"] > 0
        assert found["trace"][0][1] == runs.cuts[4] + 1


def test_every_rank_of_a_world_reports_the_same_loss_and_grad_norm(runs: Runs) -> None:
    for generation in (0, *SWITCHED):
        processes = TRANSITIONS[generation].processes if generation else START_PROCESSES
        traces = [_live_trace(runs, generation, p) for p in processes]
        assert all(t == traces[0] for t in traces), generation


def test_training_makes_progress_across_all_the_reshards(runs: Runs) -> None:
    losses = [loss for _, _, loss, _ in runs.live[0]["trace"]]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize("generation", SWITCHED, ids=[TRANSITIONS[g].name for g in SWITCHED])
def test_the_pause_is_measured_with_its_breakdown(runs: Runs, generation: int) -> None:
    for p, report in _reports(runs, generation).items():
        parts = report["switch_s"] + report["transfer_s"] + report["rebuild_s"]
        assert report["transfer_s"] > 0 and report["switch_s"] > 0 and report["rebuild_s"] >= 0, p
        assert parts <= report["pause_s"] + 1e-6, p
        assert report["pause_s"] - parts < 0.05 * report["pause_s"] + 0.01, p
        assert report["prepare_s"] is not None and report["prepare_s"] >= 0, p
        if report["role"] != "leave":  # filled in at the boundary after the first step on the new world
            assert report["first_step_s"] is not None and report["first_step_s"] > 0, p


def test_the_old_world_is_released_after_every_switch(runs: Runs) -> None:
    for p in (0, 1, *JOINERS):
        assert runs.live[p]["live_generations"] == (4,), p


def test_the_old_trainers_memory_is_freed_at_the_switch_not_left_to_the_garbage_collector(
    runs: Runs,
) -> None:
    for p in (0, 1, *LEAVERS):
        switches = [g for g in SWITCHED if "before" in runs.live[p]["switches"].get(g, {})]
        assert len(runs.live[p]["old_storage_left"]) == len(switches) > 0, p
        assert runs.live[p]["old_storage_left"] == [0] * len(switches), p
