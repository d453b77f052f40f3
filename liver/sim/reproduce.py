"""The paper's headline results, re-run on the simulator with the paper's constants, side by side.

* Figure 7 (section 6.4): training efficiency of GPT-14B on the 32-GPU testbed over 8 hours in three
  volatility regimes (an event every 60, 30 or 10 minutes), mean over several generated traces.
* Figure 8 (section 6.5): one 24-hour trace with 47 events: cumulative downtime, wasted GPU-hours and
  efficiency.
* Figure 11 (section 6.7.2): one reconfiguration of a 70B model on 1,024 GPUs (one node of 128 reclaimed):
  restart against live downtime.

Two of the calibration's constants are fitted here, and only here: the checkpoint interval (the paper
does not state it; :func:`fit_checkpoint_interval` minimises the squared error over the five baseline
numbers of figure 7) and the shared storage's aggregate bandwidth (:func:`fit_storage_aggregate`, so that
figure 11's restart is 565 s). Every other number in the comparison is a prediction.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import msgspec

from liver.shared.model import ModelSpec

from .calibration import Calibration, with_overrides
from .engine import SimResult, simulate
from .models import GPT_14B, sim_model
from .policies import POLICY_NAMES, live_preparation_s, make_policy, restart_phases
from .trace import REGIMES, Arrivals, CapacityEvent, Trace, generate, initial_nodes
from .transitions import TransitionPlanner

HOURS = 3600.0

PAPER_FIG7: dict[str, dict[str, float | None]] = {
    "low": {"megatron": 95.2, "ucp": None, "liver": None},
    "medium": {"megatron": 79.8, "ucp": 85.6, "liver": None},
    "high": {"megatron": 58.2, "ucp": 61.3, "liver": 99.1},
}
"""Figure 7 as the text of section 6.4 states it (``None``: the text gives no number)."""

PAPER_FIG8: dict[str, dict[str, float | None]] = {
    "megatron": {"downtime_min": 130.0, "wasted_gpu_h": 80.0, "efficiency": 91.0},
    "ucp": {"downtime_min": 100.0, "wasted_gpu_h": None, "efficiency": 93.0},
    "liver": {"downtime_min": 7.0, "wasted_gpu_h": 4.1, "efficiency": 99.5},
}
"""Section 6.5: '130+' and '100+' minutes, '80+' GPU-hours are lower bounds in the paper."""

PAPER_FIG11 = {"restart_s": 565.0, "live_s": 11.0}

FIG7_NODES, FIG7_MIN, FIG7_MAX = 4, 2, 4
"""The testbed has 4 nodes: the job starts on all of them and scales between 2 and 4."""
FIG11_NODES = 128
FIG11_MODEL = "llama2-70b"
NOTICE_S = 120.0


class Fig7Row(msgspec.Struct, frozen=True, kw_only=True):
    regime: str
    policy: str
    efficiency: float
    """Mean goodput over the traces, in percent (useful / allocated GPU-seconds)."""
    efficiency_std: float
    world_efficiency: float
    """Mean of useful / (useful + downtime + lost): the devices in the training world only, in percent
    (what the paper's accounting appears to count; differs only where devices idle)."""
    events: float
    paper: float | None
    difference: float | None
    """``world_efficiency - paper`` in percentage points."""


class Fig8Row(msgspec.Struct, frozen=True, kw_only=True):
    policy: str
    events: int
    downtime_min: float
    wasted_gpu_h: float
    efficiency: float
    world_efficiency: float
    time_efficiency: float
    """``100 * (1 - paused / duration)``: the share of wall time not paused, lost work not counted."""
    paper_downtime_min: float | None
    paper_wasted_gpu_h: float | None
    paper_efficiency: float | None


class Fig11Row(msgspec.Struct, frozen=True, kw_only=True):
    policy: str
    variant: str
    """For LiveR: what the handoff moves (the paper's parameters only, or the whole training state)."""
    notice_s: float
    downtime_s: float
    phases: dict[str, float]
    kind: str
    layout_before: str
    layout_after: str
    bytes_moved: int
    transfer_barrier_s: float
    """The transfer with a barrier after every streaming step (the paper's Algorithm 1)."""
    preparation_s: float
    """Live: what must fit into the notice (a fallback restart follows when it does not)."""
    paper_s: float | None


def _planner_for(
    planner: TransitionPlanner | None, model: ModelSpec, calibration: Calibration
) -> TransitionPlanner:
    if planner is None:
        return TransitionPlanner(model, calibration)
    if planner.model != model:
        raise ValueError(f"planner is for {planner.model.name}, not {model.name}")
    return planner if planner.calibration == calibration else planner.rebind(calibration)


def world_efficiency(r: SimResult) -> float:
    busy = r.useful_gpu_s + r.downtime_gpu_s + r.lost_gpu_s
    return r.useful_gpu_s / busy if busy else 1.0


def regime_trace(regime: str, seed: int, arrivals: Arrivals, hours: float = 8.0) -> Trace:
    return generate(
        mean_interval_s=REGIMES[regime],
        duration_s=hours * HOURS,
        nodes=FIG7_NODES,
        min_nodes=FIG7_MIN,
        max_nodes=FIG7_MAX,
        notice_s=NOTICE_S,
        seed=seed,
        devices_per_node=8,
        arrivals=arrivals,
        name=f"{regime} volatility, seed {seed}",
    )


def figure7(
    calibration: Calibration,
    seeds: Sequence[int] = range(20),
    arrivals: Arrivals = "poisson",
    planner: TransitionPlanner | None = None,
    policies: Sequence[str] = POLICY_NAMES,
) -> list[Fig7Row]:
    planner = _planner_for(planner, GPT_14B, calibration)
    rows = []
    for regime in REGIMES:
        traces = [regime_trace(regime, s, arrivals) for s in seeds]
        for name in policies:
            policy = make_policy(name, calibration)
            results = [simulate(t, policy, planner) for t in traces]
            eff = [100 * r.efficiency for r in results]
            world = statistics.mean(100 * world_efficiency(r) for r in results)
            paper = PAPER_FIG7[regime][name]
            rows.append(
                Fig7Row(
                    regime=regime,
                    policy=name,
                    efficiency=statistics.mean(eff),
                    efficiency_std=statistics.pstdev(eff),
                    world_efficiency=world,
                    events=statistics.mean(len(t.events) for t in traces),
                    paper=paper,
                    difference=None if paper is None else world - paper,
                )
            )
    return rows


def fig8_trace() -> Trace:
    """The first generated 24-hour trace (events 30 minutes apart on average, Poisson) with exactly 47."""
    for seed in range(1000):
        trace = generate(
            mean_interval_s=24 * HOURS / 48,
            duration_s=24 * HOURS,
            nodes=FIG7_NODES,
            min_nodes=FIG7_MIN,
            max_nodes=FIG7_MAX,
            notice_s=NOTICE_S,
            seed=seed,
            devices_per_node=8,
            arrivals="poisson",
            name=f"24 hours, 47 events (seed {seed})",
        )
        if len(trace.events) == 47:
            return trace
    raise RuntimeError("no seed below 1000 gives 47 events")  # pragma: no cover - the first few do


def figure8(
    calibration: Calibration, planner: TransitionPlanner | None = None
) -> tuple[list[Fig8Row], list[SimResult]]:
    planner = _planner_for(planner, GPT_14B, calibration)
    trace = fig8_trace()
    rows, results = [], []
    for name in POLICY_NAMES:
        r = simulate(trace, make_policy(name, calibration), planner)
        results.append(r)
        paper = PAPER_FIG8[name]
        rows.append(
            Fig8Row(
                policy=name,
                events=len(trace.events),
                downtime_min=r.paused_s / 60,
                wasted_gpu_h=r.wasted_gpu_hours,
                efficiency=100 * r.efficiency,
                world_efficiency=100 * world_efficiency(r),
                time_efficiency=100 * (1 - r.paused_s / r.duration_s),
                paper_downtime_min=paper["downtime_min"],
                paper_wasted_gpu_h=paper["wasted_gpu_h"],
                paper_efficiency=paper["efficiency"],
            )
        )
    return rows, results


def fig11_trace(notice_s: float) -> Trace:
    """128 nodes of 8 GPUs; at t=10 min the last node is reclaimed with ``notice_s`` of warning."""
    nodes = initial_nodes(FIG11_NODES)
    return Trace(
        name=f"1,024 GPUs, one node reclaimed with {notice_s:g} s notice",
        initial_nodes=nodes,
        devices_per_node=8,
        duration_s=2 * HOURS,
        events=(CapacityEvent(600.0, nodes[-1], "remove", notice_s),),
    )


def figure11(
    calibration: Calibration,
    notices: Sequence[float] = (NOTICE_S,),
    planner: TransitionPlanner | None = None,
    full_state: bool = True,
) -> list[Fig11Row]:
    """Megatron-LM and UCP restarts, then LiveR for each notice in ``notices`` (by default the 2-minute
    spot warning), and with ``full_state`` LiveR moving the whole training state too (last notice)."""
    planner = _planner_for(planner, sim_model(FIG11_MODEL), calibration)
    runs: list[tuple[str, str, float, TransitionPlanner]] = [
        ("megatron", "", notices[0], planner),
        ("ucp", "", notices[0], planner),
    ]
    runs += [
        ("liver", "parameters" if not calibration.transfer_optimizer_state else "", n, planner)
        for n in notices
    ]
    if full_state and not calibration.transfer_optimizer_state:
        full = planner.rebind(with_overrides(calibration, transfer_optimizer_state=True))
        runs.append(("liver", "whole training state", notices[-1], full))
    rows = []
    for name, variant, notice, pl in runs:
        r = simulate(fig11_trace(notice), make_policy(name, pl.calibration), pl)
        rec = r.reconfigurations[-1]
        before = r.reconfigurations[0]
        start = pl.transition(None, 0, 0, FIG11_NODES)
        tr = pl.transition(start.new_layout, len(start.used_nodes), FIG11_NODES - 1, 0)
        paper = {"megatron": PAPER_FIG11["restart_s"], "liver": PAPER_FIG11["live_s"]}.get(name)
        rows.append(
            Fig11Row(
                policy=name,
                variant=variant,
                notice_s=notice,
                downtime_s=r.paused_s,
                phases=rec.phases,
                kind=rec.kind,
                layout_before=before.layout_before,
                layout_after=rec.layout_after,
                bytes_moved=tr.bytes_moved if rec.kind == "live" else 0,
                transfer_barrier_s=tr.transfer_barrier_s if rec.kind == "live" else 0.0,
                preparation_s=live_preparation_s(pl.calibration, tr) if name == "liver" else 0.0,
                paper_s=paper,
            )
        )
    return rows


def fit_storage_aggregate(calibration: Calibration, planner: TransitionPlanner | None = None) -> float:
    """The aggregate storage bandwidth (bytes/s) that makes figure 11's Megatron-LM restart 565 s."""
    planner = _planner_for(planner, sim_model(FIG11_MODEL), calibration)
    tr = planner.transition(None, 0, 0, FIG11_NODES - 1)  # a restart's target depends on the devices only
    assert tr.new_layout is not None
    fixed = calibration.misc_s + calibration.init_s(tr.new_devices)
    load = PAPER_FIG11["restart_s"] - fixed
    per_device = tr.load_max_rank_bytes / calibration.storage_bw_per_device
    if load <= per_device:
        raise ValueError(
            f"figure 11's restart is already {fixed + per_device:.0f} s without an aggregate limit"
        )
    fitted = tr.load_total_bytes / load
    check = restart_phases(with_overrides(calibration, storage_bw_aggregate=fitted), tr, 1.0)
    assert math.isclose(sum(check.values()), PAPER_FIG11["restart_s"], rel_tol=1e-9)
    return fitted


def fit_checkpoint_interval(
    calibration: Calibration,
    grid: Sequence[float] = tuple(range(60, 1201, 60)),
    seeds: Sequence[int] = range(20),
    arrivals: Arrivals = "poisson",
) -> tuple[float, dict[float, float]]:
    """The interval (seconds) whose figure-7 baselines are closest to the paper's (least squares over
    Megatron-LM low/medium/high and UCP medium/high); returns it with the RMS error of each tried."""
    planner = TransitionPlanner(GPT_14B, calibration)
    errors: dict[float, float] = {}
    for interval in grid:
        cal = with_overrides(calibration, checkpoint_interval_s=float(interval))
        planner = planner.rebind(cal)
        rows = figure7(cal, seeds, arrivals, planner, policies=("megatron", "ucp"))
        diffs = [r.difference for r in rows if r.difference is not None]
        errors[float(interval)] = math.sqrt(sum(d * d for d in diffs) / len(diffs))
    best = min(errors, key=lambda k: (errors[k], k))
    return best, errors
