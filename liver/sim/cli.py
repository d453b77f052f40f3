"""``liver sim``: simulate a training job under volatile capacity (``run``), reproduce the paper's
headline numbers (``paper``), or write a generated trace as CSV (``trace``).

Wire it into the console script with ``liver.sim.cli.add_parser(sub)``; every handler raises
``ValueError`` (trace, calibration and model errors are ``ValueError`` s) with a message that names the
bad flag, field or line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import msgspec

from .calibration import DEFAULT_PROFILE, Calibration, with_overrides
from .calibration import load_calibration as _load_calibration
from .engine import simulate
from .models import sim_model
from .policies import LABELS, POLICY_NAMES, make_policy
from .report import (
    PolicySummary,
    plot_efficiency,
    plot_event_downtime,
    plot_reconfiguration,
    plot_wasted,
    summarize,
    summary_table,
    table,
)
from .trace import REGIMES, Trace, generate, initial_nodes, read_csv, to_csv
from .transitions import TransitionPlanner


class RunOutput(msgspec.Struct, kw_only=True):
    """What ``liver sim run --json`` prints."""

    model: str
    calibration: str
    trace: str
    duration_s: float
    initial_devices: int
    events: int
    policies: list[PolicySummary]
    wall_seconds: float
    planning_seconds: float
    distinct_transitions: int
    plots: list[str]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``sim`` and its subcommands to the ``liver`` parser's subparsers."""
    p = sub.add_parser("sim", help="simulate a training job under volatile capacity (docs/simulator.md)")
    sim_sub = p.add_subparsers(dest="sim_command", required=True)

    run = sim_sub.add_parser("run", help="one trace, every policy: goodput, waste and downtime")
    _trace_arguments(run)
    run.add_argument("--trace", help="a CSV trace (time,node,kind,notice) instead of a generated regime")
    run.add_argument("--model", default="gpt-14b", help="gpt-14b, gpt-20b, a project preset or a .json file")
    run.add_argument("--calibration", default=DEFAULT_PROFILE, help="a bundled profile or a .json file")
    run.add_argument(
        "--policies", default=",".join(POLICY_NAMES), help="comma-separated: megatron, ucp, liver"
    )
    run.add_argument("--plots", metavar="DIR", help="write wasted.png and event-downtime.png here")
    run.add_argument("--events", action="store_true", help="also print every reconfiguration")
    run.add_argument("--save-trace", metavar="FILE", help="write the trace that was simulated as CSV")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.set_defaults(func=run_command)

    paper = sim_sub.add_parser("paper", help="reproduce figures 7, 8 and 11 beside the paper's numbers")
    paper.add_argument("--calibration", default=DEFAULT_PROFILE, help="a bundled profile or a .json file")
    paper.add_argument("--seeds", type=int, default=20, help="traces per regime for figure 7 (default 20)")
    paper.add_argument("--plots", metavar="DIR", help="write figure7.png, figure8.png, figure11.png here")
    paper.add_argument(
        "--fit", action="store_true", help="also re-fit the two fitted constants (about a minute)"
    )
    paper.add_argument("--json", action="store_true", help="print one JSON object")
    paper.set_defaults(func=paper_command)

    tr = sim_sub.add_parser("trace", help="write a generated volatility trace as CSV")
    _trace_arguments(tr)
    tr.add_argument("--out", help="file to write (default: standard output)")
    tr.set_defaults(func=trace_command)


def _trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--regime",
        choices=sorted(REGIMES),
        default="high",
        help="low / medium / high: an event every 60 / 30 / 10 min",
    )
    p.add_argument("--mean-interval", type=float, metavar="SECONDS", help="mean seconds between events")
    p.add_argument("--arrivals", choices=("poisson", "uniform"), default="poisson")
    p.add_argument("--nodes", type=int, default=4, help="nodes at the start (default 4)")
    p.add_argument("--min-nodes", type=int, help="fewest nodes a scale-in leaves (default nodes / 2)")
    p.add_argument("--max-nodes", type=int, help="most nodes a scale-out reaches (default nodes)")
    p.add_argument("--per-node", type=int, default=8, help="devices per node (default 8)")
    p.add_argument("--hours", type=float, default=8.0, help="simulated hours (default 8)")
    p.add_argument("--notice", type=float, default=120.0, help="seconds of warning before a removal")
    p.add_argument("--seed", type=int, default=0)


def _build_trace(args: argparse.Namespace) -> Trace:
    if args.nodes < 1:
        raise ValueError("--nodes must be at least 1")
    if args.per_node < 1:
        raise ValueError("--per-node must be at least 1")
    if not args.hours > 0:
        raise ValueError("--hours must be positive")
    duration = args.hours * 3600
    if getattr(args, "trace", None):
        return read_csv(
            args.trace,
            initial=initial_nodes(args.nodes),
            devices_per_node=args.per_node,
            duration_s=duration,
        )
    mean = args.mean_interval if args.mean_interval is not None else REGIMES[args.regime]
    if not mean > 0:
        raise ValueError("--mean-interval must be positive")
    min_nodes = args.min_nodes if args.min_nodes is not None else max(1, args.nodes // 2)
    max_nodes = args.max_nodes if args.max_nodes is not None else args.nodes
    label = f"{args.regime} volatility" if args.mean_interval is None else f"an event every {mean:g} s"
    return generate(
        mean_interval_s=mean,
        duration_s=duration,
        nodes=args.nodes,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        notice_s=args.notice,
        seed=args.seed,
        devices_per_node=args.per_node,
        arrivals=args.arrivals,
        name=f"{label}, {args.arrivals} arrivals, seed {args.seed}",
    )


def _calibration(args: argparse.Namespace) -> Calibration:
    cal = _load_calibration(args.calibration)
    per_node = getattr(args, "per_node", cal.devices_per_node)
    if per_node != cal.devices_per_node:
        cal = with_overrides(cal, devices_per_node=per_node)
    return cal


def run_command(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    cal = _calibration(args)
    model = sim_model(args.model)
    trace = _build_trace(args)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    if not names:
        raise ValueError("--policies: give at least one of " + ", ".join(POLICY_NAMES))
    policies = [make_policy(n, cal) for n in names]
    planner = TransitionPlanner(model, cal)
    results = [simulate(trace, p, planner) for p in policies]
    plots: list[str] = []
    if args.save_trace:
        Path(args.save_trace).write_text(to_csv(trace.events))
    if args.plots:
        title = f"{model.name}, {trace.name}"
        plots.append(str(plot_wasted(results, Path(args.plots) / "wasted.png", title)))
        plots.append(str(plot_event_downtime(results, Path(args.plots) / "event-downtime.png", title)))
    out = RunOutput(
        model=model.name,
        calibration=cal.name,
        trace=trace.name,
        duration_s=trace.duration_s,
        initial_devices=len(trace.initial_nodes) * trace.devices_per_node,
        events=len(trace.events),
        policies=[summarize(r) for r in results],
        wall_seconds=time.perf_counter() - started,
        planning_seconds=planner.planning_seconds,
        distinct_transitions=len(planner.cache),
        plots=plots,
    )
    if args.json:
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    print(
        f"{model.name} on {out.initial_devices} devices, {trace.name}: {len(trace.events)} events "
        f"in {trace.duration_s / 3600:g} h (calibration {cal.name})"
    )
    print(summary_table(results))
    if args.events:
        for r in results:
            print(f"\n{r.label}")
            print(_reconfiguration_table(r.reconfigurations))
    print(
        f"\n{out.wall_seconds:.2f} s wall, of which {out.planning_seconds:.2f} s in the planners "
        f"({out.distinct_transitions} distinct transitions)"
    )
    for path in plots:
        print(f"wrote {path}")
    return 0


def _reconfiguration_table(recs: list) -> str:  # type: ignore[type-arg]
    rows = [
        (
            r.index,
            r.kind,
            r.start,
            r.pause_s,
            r.lost_gpu_s / 3600,
            f"{r.layout_before or '-'} -> {r.layout_after or '-'}",
            r.status,
            ",".join(map(str, r.events)),
        )
        for r in recs
    ]
    return table(("#", "kind", "start s", "pause s", "lost GPU-h", "layouts", "status", "events"), rows)


def trace_command(args: argparse.Namespace) -> int:
    trace = _build_trace(args)
    text = to_csv(trace.events)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {len(trace.events)} events to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def paper_command(args: argparse.Namespace) -> int:
    from . import reproduce as rp

    if args.seeds < 1:
        raise ValueError("--seeds must be at least 1")
    started = time.perf_counter()
    cal = _load_calibration(args.calibration)
    fit = None
    if args.fit:
        aggregate = rp.fit_storage_aggregate(cal)
        interval, errors = rp.fit_checkpoint_interval(with_overrides(cal, storage_bw_aggregate=aggregate))
        fit = {
            "storage_bw_aggregate": aggregate,
            "checkpoint_interval_s": interval,
            "rms_by_interval": errors,
        }
    fig7 = rp.figure7(cal, seeds=range(args.seeds))
    fig8, fig8_results = rp.figure8(cal)
    fig11 = rp.figure11(cal)
    plots: list[str] = []
    if args.plots:
        d = Path(args.plots)
        plots.append(
            str(
                plot_efficiency(
                    [(r.regime, r.policy, r.world_efficiency, r.paper) for r in fig7],
                    d / "figure7.png",
                    f"GPT-14B, 32 GPUs, 8 h ({args.seeds} traces per regime): simulated vs paper (black)",
                )
            )
        )
        plots.append(str(plot_wasted(fig8_results, d / "figure8.png", "GPT-14B, 32 GPUs, 24 h, 47 events")))
        plots.append(
            str(
                plot_reconfiguration(
                    [(_fig11_label(r), r.phases, r.paper_s) for r in fig11],
                    d / "figure11.png",
                    "70B on 1,024 GPUs: one node reclaimed",
                )
            )
        )
    if args.json:
        out = {
            "calibration": cal.name,
            "figure7": fig7,
            "figure8": fig8,
            "figure11": fig11,
            "fit": fit,
            "plots": plots,
            "wall_seconds": time.perf_counter() - started,
        }
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
        return 0
    _print_paper(cal, args.seeds, fig7, fig8, fig11, fit)
    print(f"\n{time.perf_counter() - started:.1f} s wall")
    for path in plots:
        print(f"wrote {path}")
    return 0


def _fig11_label(r: object) -> str:
    name = LABELS[r.policy]  # type: ignore[attr-defined]
    if r.policy == "liver":  # type: ignore[attr-defined]
        name += f", {r.notice_s:g} s notice"  # type: ignore[attr-defined]
        if r.variant:  # type: ignore[attr-defined]
            name += f", {r.variant}"  # type: ignore[attr-defined]
    return name


def _short(layout: str) -> str:
    """A layout without its per-stage layer counts (they can run to dozens of numbers)."""
    return layout.split("[")[0] + ("[uneven]" if "[" in layout else "")


def _diff(sim: float, paper: float | None) -> float | None:
    return None if paper is None else sim - paper


def _print_paper(cal: Calibration, seeds: int, fig7: list, fig8: list, fig11: list, fit: dict | None) -> None:  # type: ignore[type-arg]
    print(
        f"calibration {cal.name}; fitted constants: checkpoint interval {cal.checkpoint_interval_s:g} s, "
        f"storage {cal.storage_bw_aggregate / 1e9:.1f} GB/s aggregate"
    )
    print(f"\nFigure 7: GPT-14B on 32 GPUs, 8 h, mean of {seeds} Poisson traces per regime (efficiency %)")
    print(
        table(
            ("regime", "policy", "events", "goodput", "+-", "world", "paper", "world - paper"),
            [
                (
                    r.regime,
                    LABELS[r.policy],
                    r.events,
                    r.efficiency,
                    r.efficiency_std,
                    r.world_efficiency,
                    r.paper,
                    r.difference,
                )
                for r in fig7
            ],
        )
    )
    print("\nFigure 8: GPT-14B on 32 GPUs, 24 h, 47 events")
    print(
        table(
            (
                "policy",
                "downtime min",
                "paper",
                "wasted GPU-h",
                "paper",
                "goodput %",
                "1-paused/24h %",
                "paper",
            ),
            [
                (
                    LABELS[r.policy],
                    r.downtime_min,
                    r.paper_downtime_min,
                    r.wasted_gpu_h,
                    r.paper_wasted_gpu_h,
                    r.efficiency,
                    r.time_efficiency,
                    r.paper_efficiency,
                )
                for r in fig8
            ],
        )
    )
    print("\nFigure 11: 70B on 1,024 GPUs, one node of 128 reclaimed (downtime of the reconfiguration)")
    print(
        table(
            (
                "policy",
                "kind",
                "downtime s",
                "paper s",
                "difference",
                "preparation s",
                "barriers s",
                "moved GB",
                "layouts",
            ),
            [
                (
                    _fig11_label(r),
                    r.kind,
                    r.downtime_s,
                    r.paper_s,
                    _diff(r.downtime_s, r.paper_s),
                    r.preparation_s or None,
                    r.transfer_barrier_s + cal.switch_s if r.transfer_barrier_s else None,
                    r.bytes_moved / 1e9 if r.bytes_moved else None,
                    f"{_short(r.layout_before)} -> {_short(r.layout_after)}",
                )
                for r in fig11
            ],
        )
    )
    if fit is not None:
        print("\nRe-fitted constants (compare with the calibration file):")
        print(f"  storage_bw_aggregate   {fit['storage_bw_aggregate']:,.0f} B/s")
        print(f"  checkpoint_interval_s  {fit['checkpoint_interval_s']:g} s")
        print(
            "  RMS error (pp) by interval: "
            + ", ".join(f"{k:g}: {v:.2f}" for k, v in fit["rms_by_interval"].items())
        )
