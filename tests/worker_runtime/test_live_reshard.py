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

import pytest
from live_chain import (
    CONTROL_TIMEOUT_S,
    DEVICES,
    Chain,
    Runs,
    Transition,
    bit_identical,
    live_trace,
    max_deviation,
    reports_of,
    run_chain,
)

from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS
from liver.worker_runtime.megatron.train_config import TrainConfig

# The processes' own limits (run_world's, 280 s and 240 s) end a stuck run; the test's limit is above them.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CONFIG = TrainConfig(
    global_batch_size=4,
    micro_batch_size=1,
    seq_length=16,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)
START_PROCESSES = (0, 1, 2, 3)
STEPS = 2
FAULT_PROCESS = 5
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
CHAIN = Chain(
    job="live-reshard",
    model=PRESETS["tiny-gpt"],
    config=CONFIG,
    start=ParallelLayout(tp=2, pp=2, dp=1),
    start_processes=START_PROCESSES,
    transitions=TRANSITIONS,
    steps=STEPS,
    fault_process=FAULT_PROCESS,
    fault_generation=FAULT_GENERATION,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return run_chain(CHAIN, str(tmp_path_factory.mktemp("checkpoints")))


# -- the tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generation", SWITCHED, ids=[TRANSITIONS[g].name for g in SWITCHED])
def test_every_process_of_both_worlds_switches_at_the_same_cut(runs: Runs, generation: int) -> None:
    plan = runs.plans[generation]
    everyone = set(plan.old.placement.devices) | set(plan.new.placement.devices)
    reports = reports_of(runs, generation)
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
    live = live_trace(runs, generation)
    assert len(live) >= STEPS
    assert live == runs.baseline[generation]


@pytest.mark.parametrize("generation", SWITCHED, ids=[TRANSITIONS[g].name for g in SWITCHED])
def test_the_trace_after_the_switch_equals_a_dist_checkpointing_save_and_load_at_the_new_layout(
    runs: Runs, generation: int
) -> None:
    assert live_trace(runs, generation) == runs.checkpoint[generation]


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
    trace = live_trace(runs, 4)
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
        traces = [live_trace(runs, generation, p) for p in processes]
        assert all(t == traces[0] for t in traces), generation


def test_training_makes_progress_across_all_the_reshards(runs: Runs) -> None:
    losses = [loss for _, _, loss, _ in runs.live[0]["trace"]]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize("generation", SWITCHED, ids=[TRANSITIONS[g].name for g in SWITCHED])
def test_the_pause_is_measured_with_its_breakdown(runs: Runs, generation: int) -> None:
    for p, report in reports_of(runs, generation).items():
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
