"""The simulator's accounting: every GPU-second lands in one bucket, every event gets an outcome, a free
reconfiguration costs nothing, and each policy pays what its phases say."""

from __future__ import annotations

import math

import msgspec
import pytest

from liver.reshard.plan import WorldConfig
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS, ModelSpec
from liver.sim.calibration import Calibration, load_calibration, with_overrides
from liver.sim.engine import SimResult, simulate
from liver.sim.models import GPT_14B
from liver.sim.policies import POLICY_NAMES, live_phases, live_preparation_s, make_policy, restart_phases
from liver.sim.trace import REGIMES, CapacityEvent, Trace, generate, initial_nodes
from liver.sim.transitions import TransitionPlanner

HOURS = 3600.0
FREE = 1e30  # bytes/s: transfers and loads that take no time


@pytest.fixture(scope="module")
def calibration() -> Calibration:
    return load_calibration()


@pytest.fixture(scope="module")
def planner(calibration: Calibration) -> TransitionPlanner:
    return TransitionPlanner(GPT_14B, calibration)


def _regime(seed: int, regime: str = "high", hours: float = 8.0) -> Trace:
    return generate(
        mean_interval_s=REGIMES[regime],
        duration_s=hours * HOURS,
        nodes=4,
        min_nodes=2,
        max_nodes=4,
        notice_s=120.0,
        seed=seed,
        devices_per_node=8,
    )


def _one_event(ev: CapacityEvent, nodes: int = 4, hours: float = 1.0) -> Trace:
    return Trace(
        name="one event",
        initial_nodes=initial_nodes(nodes),
        devices_per_node=8,
        duration_s=hours * HOURS,
        events=(ev,),
    )


def _held_integral(trace: Trace) -> float:
    """GPU-seconds of the nodes the trace gives the job, each from its start or addition to its removal."""
    start = dict.fromkeys(trace.initial_nodes, 0.0)
    total = 0.0
    for ev in sorted(trace.events, key=lambda e: e.effect_time):
        t = min(ev.effect_time, trace.duration_s)
        if ev.kind == "add":
            start[ev.node] = t
        else:
            total += t - start.pop(ev.node)
    total += sum(trace.duration_s - t for t in start.values())
    return total * trace.devices_per_node


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_time_is_conserved(policy: str, calibration: Calibration, planner: TransitionPlanner) -> None:
    for seed in range(3):
        r = simulate(_regime(seed), make_policy(policy, calibration), planner)
        buckets = r.useful_gpu_s + r.downtime_gpu_s + r.lost_gpu_s + r.idle_gpu_s
        assert buckets == pytest.approx(r.allocated_gpu_s, rel=1e-9)
        assert min(r.useful_gpu_s, r.downtime_gpu_s, r.lost_gpu_s, r.idle_gpu_s) >= -1e-6


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_job_holds_the_nodes_the_trace_gives_it_less_those_handed_back_early(
    policy: str, calibration: Calibration, planner: TransitionPlanner
) -> None:
    trace = _regime(1)
    r = simulate(trace, make_policy(policy, calibration), planner)
    removal = {e.node: e.effect_time for e in trace.events if e.kind == "remove"}
    early = sum(min(removal[n], trace.duration_s) - t for n, t in r.early_releases.items())
    assert r.allocated_gpu_s == pytest.approx(_held_integral(trace) - 8 * early, rel=1e-9)


def test_live_reconfiguration_hands_warned_nodes_back_after_switching_away(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    trace = _regime(1)
    r = simulate(trace, make_policy("liver", calibration), planner)
    switched = {
        trace.events[i].node: rec.end
        for rec in r.reconfigurations
        if rec.kind == "live"
        for i in rec.events
        if trace.events[i].kind == "remove"
    }
    assert switched
    removal = {e.node: e.effect_time for e in trace.events if e.kind == "remove"}
    for node, end in switched.items():
        # Gone when the switch completes: handed back then, or reclaimed right then (a late switch).
        assert r.early_releases.get(node, removal[node]) == pytest.approx(end)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_no_event_is_lost(policy: str, calibration: Calibration, planner: TransitionPlanner) -> None:
    trace = _regime(2)
    r = simulate(trace, make_policy(policy, calibration), planner)
    assert [e.index for e in r.events] == list(range(len(trace.events)))
    finished = [e for e in r.events if trace.events[e.index].effect_time < trace.duration_s - 600]
    assert all(e.outcome in ("served", "released", "unchanged") for e in finished)
    served = sorted(e.index for e in r.events if e.outcome == "served")
    listed = sorted(i for rec in r.reconfigurations for i in rec.events)
    assert served == listed
    for e in r.events:
        if e.outcome == "served":
            assert e.index in r.reconfigurations[e.reconfiguration].events  # type: ignore[index]


def _free(calibration: Calibration) -> Calibration:
    hardware = msgspec.structs.replace(
        calibration.hardware, intra_node_bandwidth=FREE, inter_node_bandwidth=FREE
    )
    return with_overrides(
        calibration,
        hardware=hardware,
        misc_s=0.0,
        storage_bw_per_device=FREE,
        storage_bw_aggregate=FREE,
        init_base_s=0.0,
        init_per_rank_s=0.0,
        checkpoint_interval_s=0.0,
        plan_s=0.0,
        switch_s=0.0,
    )


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_policy_with_zero_reconfiguration_cost_reaches_full_efficiency(
    policy: str, calibration: Calibration
) -> None:
    free = _free(calibration)
    r = simulate(_regime(0), make_policy(policy, free), TransitionPlanner(GPT_14B, free))
    assert len(r.reconfigurations) > 10
    assert r.efficiency == pytest.approx(1.0, abs=1e-9)


def test_the_same_seed_gives_the_same_results(calibration: Calibration, planner: TransitionPlanner) -> None:
    def run() -> list[SimResult]:
        return [simulate(_regime(4), make_policy(p, calibration), planner) for p in POLICY_NAMES]

    first = run()
    fresh = [
        simulate(_regime(4), make_policy(p, calibration), TransitionPlanner(GPT_14B, calibration))
        for p in POLICY_NAMES
    ]
    assert msgspec.json.encode(first) == msgspec.json.encode(run()) == msgspec.json.encode(fresh)


def test_a_restart_pays_its_phases_and_loses_the_work_since_the_last_checkpoint(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    # Warned at 600 s, gone at 720 s: 720 - 420 = 300 s of 32-GPU training since the last checkpoint.
    trace = _one_event(CapacityEvent(600.0, "node003", "remove", 120.0))
    r = simulate(trace, make_policy("megatron", calibration), planner)
    (rec,) = r.reconfigurations
    target = planner.transition(None, 0, 0, 3)
    assert rec.start == pytest.approx(720.0)
    assert rec.pause_s == pytest.approx(sum(restart_phases(calibration, target, 1.0).values()))
    assert rec.lost_gpu_s == pytest.approx(300.0 * 32)
    assert r.lost_gpu_s == pytest.approx(300.0 * 32)


def test_ucp_loads_faster_and_otherwise_restarts_alike(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    trace = _one_event(CapacityEvent(600.0, "node003", "remove", 120.0))
    mega = simulate(trace, make_policy("megatron", calibration), planner).reconfigurations[0]
    ucp = simulate(trace, make_policy("ucp", calibration), planner).reconfigurations[0]
    assert ucp.phases["checkpoint_load"] == pytest.approx(
        calibration.ucp_load_factor * mega.phases["checkpoint_load"]
    )
    assert ucp.phases["init_warmup"] == mega.phases["init_warmup"]
    assert ucp.lost_gpu_s == mega.lost_gpu_s


def test_live_reconfiguration_trains_through_the_warning_and_pauses_only_to_switch(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    trace = _one_event(CapacityEvent(600.0, "node003", "remove", 120.0))
    r = simulate(trace, make_policy("liver", calibration), planner)
    (rec,) = r.reconfigurations
    start = planner.transition(None, 0, 0, 4)
    tr = planner.transition(start.new_layout, 4, 3, 0)
    pause = sum(live_phases(calibration, tr).values())
    assert rec.kind == "live" and rec.status == "done"
    assert r.paused_s == pytest.approx(pause)
    assert r.lost_gpu_s == 0
    # The switch is as late as the deadline allows: the warned node trains until then.
    assert rec.end == pytest.approx(720.0)
    assert rec.preparation_s == pytest.approx(live_preparation_s(calibration, tr))


def test_a_warning_shorter_than_the_preparation_falls_back_to_a_restart(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    trace = _one_event(CapacityEvent(600.0, "node003", "remove", 10.0))
    r = simulate(trace, make_policy("liver", calibration), planner)
    (rec,) = r.reconfigurations
    assert rec.kind == "fallback"
    assert rec.start == pytest.approx(610.0)
    assert r.lost_gpu_s > 0


def test_an_unannounced_failure_falls_back_to_a_restart(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    trace = _one_event(CapacityEvent(600.0, "node001", "remove", 0.0))
    r = simulate(trace, make_policy("liver", calibration), planner)
    assert [rec.kind for rec in r.reconfigurations] == ["fallback"]
    assert r.fallbacks == 1


def test_a_granted_node_idles_while_its_processes_are_prepared(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    trace = _one_event(CapacityEvent(600.0, "node003", "add", 0.0), nodes=3)
    r = simulate(trace, make_policy("liver", calibration), planner)
    (rec,) = r.reconfigurations
    assert rec.kind == "live"
    assert rec.end - rec.start == pytest.approx(rec.preparation_s + rec.pause_s)
    assert r.idle_gpu_s == pytest.approx(8 * rec.preparation_s)


def test_a_warning_for_the_pending_target_cancels_the_handoff(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    # node003 is granted, and warned before its handoff switched: the job never needs to use it.
    trace = Trace(
        name="granted then reclaimed",
        initial_nodes=initial_nodes(3),
        devices_per_node=8,
        duration_s=HOURS,
        events=(
            CapacityEvent(600.0, "node003", "add", 0.0),
            CapacityEvent(620.0, "node003", "remove", 300.0),
        ),
    )
    r = simulate(trace, make_policy("liver", calibration), planner)
    assert r.cancelled_handoffs == 1
    assert r.reconfigurations == []
    assert [e.outcome for e in r.events] == ["unchanged", "released"]
    assert r.idle_gpu_s == pytest.approx(8 * 20.0)


def test_events_during_a_restart_start_it_over(calibration: Calibration, planner: TransitionPlanner) -> None:
    trace = Trace(
        name="two failures",
        initial_nodes=initial_nodes(4),
        devices_per_node=8,
        duration_s=HOURS,
        events=(
            CapacityEvent(600.0, "node003", "remove", 0.0),
            CapacityEvent(650.0, "node002", "remove", 0.0),
        ),
    )
    r = simulate(trace, make_policy("megatron", calibration), planner)
    (rec,) = r.reconfigurations
    assert rec.attempts == 2
    assert rec.events == [0, 1]
    target = planner.transition(None, 0, 0, 2)
    assert rec.end == pytest.approx(650.0 + sum(restart_phases(calibration, target, 1.0).values()))


def test_lost_work_never_exceeds_the_checkpoint_interval(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    r = simulate(_regime(3), make_policy("megatron", calibration), planner)
    for rec in r.reconfigurations:
        assert rec.lost_gpu_s <= calibration.checkpoint_interval_s * 32 + 1e-6
    assert not math.isnan(r.reconfigurations[-1].end)


def _data_parallel_planner(calibration: Calibration) -> TransitionPlanner:
    """Every device a DP replica of a small model: any one node's state lives on elsewhere."""

    def choose(model: ModelSpec, devices: tuple[Device, ...], current: WorldConfig | None):
        return ParallelLayout(1, 1, len(devices)), Placement(devices)

    return TransitionPlanner(PRESETS["tiny-gpt"], calibration, choose)


def test_a_warning_too_short_to_prepare_reshards_around_the_lost_node_when_replicas_hold_its_state(
    calibration: Calibration,
) -> None:
    planner = _data_parallel_planner(calibration)
    trace = _one_event(CapacityEvent(600.0, "node003", "remove", 10.0))
    r = simulate(trace, make_policy("liver", calibration), planner)
    (rec,) = r.reconfigurations
    assert rec.kind == "live" and rec.status == "done"
    assert rec.lost_nodes == ["node003"] and r.handoffs_around_loss == 1 and r.fallbacks == 0
    assert r.lost_gpu_s == 0
    # Trains until the node is gone at 610 s, then pauses until the new world is ready and switched.
    tr = planner.transition(ParallelLayout(1, 1, 32), 4, 3, 0, lost=1)
    assert rec.end == pytest.approx(
        600.0 + live_preparation_s(calibration, tr) + sum(live_phases(calibration, tr).values())
    )
    assert rec.pause_s == pytest.approx(rec.end - 610.0)
    assert r.paused_s == pytest.approx(rec.pause_s)


def test_an_unannounced_failure_reshards_around_the_lost_node_when_replicas_hold_its_state(
    calibration: Calibration,
) -> None:
    r = simulate(
        _one_event(CapacityEvent(600.0, "node001", "remove", 0.0)),
        make_policy("liver", calibration),
        _data_parallel_planner(calibration),
    )
    assert [(rec.kind, rec.lost_nodes) for rec in r.reconfigurations] == [("live", ["node001"])]
    assert r.lost_gpu_s == 0


def test_the_summary_counts_handoffs_around_a_loss_apart_from_fallbacks(calibration: Calibration) -> None:
    from liver.sim.report import summarize, summary_table

    r = simulate(
        _one_event(CapacityEvent(600.0, "node001", "remove", 0.0)),
        make_policy("liver", calibration),
        _data_parallel_planner(calibration),
    )
    s = summarize(r)
    assert (s.handoffs_around_loss, s.fallbacks) == (1, 0)
    assert "around loss" in summary_table([r]).splitlines()[0]


def test_a_lost_node_that_held_the_only_replica_of_a_stage_still_falls_back(
    calibration: Calibration, planner: TransitionPlanner
) -> None:
    # GPT-14B on 4 nodes is TP1 PP8 DP4 in rank order: each node holds every replica of two stages.
    r = simulate(
        _one_event(CapacityEvent(600.0, "node001", "remove", 0.0)), make_policy("liver", calibration), planner
    )
    assert [rec.kind for rec in r.reconfigurations] == ["fallback"]
    assert r.handoffs_around_loss == 0
