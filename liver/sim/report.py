"""Results for people: summary numbers per policy, text tables, and PNG plots in the spirit of the
paper's figures 7 (efficiency per regime), 8 (cumulative wasted GPU-hours) and 11 (one reconfiguration's
downtime by phase). Plots use matplotlib's Agg backend, so they work without a display."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from .engine import EventRecord, Reconfiguration, SimResult
from .policies import LABELS

COLORS = {"megatron": "#c0504d", "ucp": "#f3a53b", "liver": "#4f81bd"}


class PolicySummary(msgspec.Struct, frozen=True, kw_only=True):
    """What ``liver sim run --json`` prints per policy."""

    policy: str
    label: str
    efficiency: float
    """Goodput: useful GPU-seconds over allocated GPU-seconds (0..1)."""
    world_efficiency: float
    """Useful over useful + downtime + lost: the training world's devices only (0..1)."""
    allocated_gpu_hours: float
    useful_gpu_hours: float
    downtime_gpu_hours: float
    lost_gpu_hours: float
    idle_gpu_hours: float
    wasted_gpu_hours: float
    downtime_minutes: float
    """Cumulative wall-clock time the job was paused."""
    tokens: float
    reconfigurations: int
    fallbacks: int
    handoffs_around_loss: int
    """Live handoffs that planned around a node already lost (its state read from DP replicas)."""
    cancelled_handoffs: int
    events: int
    event_outcomes: dict[str, int]
    reconfiguration_log: list[Reconfiguration]
    event_log: list[EventRecord]


def summarize(r: SimResult) -> PolicySummary:
    busy = r.useful_gpu_s + r.downtime_gpu_s + r.lost_gpu_s
    outcomes: dict[str, int] = {}
    for e in r.events:
        outcomes[e.outcome] = outcomes.get(e.outcome, 0) + 1
    return PolicySummary(
        policy=r.policy,
        label=r.label,
        efficiency=r.efficiency,
        world_efficiency=r.useful_gpu_s / busy if busy else 1.0,
        allocated_gpu_hours=r.allocated_gpu_s / 3600,
        useful_gpu_hours=r.useful_gpu_s / 3600,
        downtime_gpu_hours=r.downtime_gpu_s / 3600,
        lost_gpu_hours=r.lost_gpu_s / 3600,
        idle_gpu_hours=r.idle_gpu_s / 3600,
        wasted_gpu_hours=r.wasted_gpu_hours,
        downtime_minutes=r.paused_s / 60,
        tokens=r.tokens,
        reconfigurations=len(r.reconfigurations),
        fallbacks=r.fallbacks,
        handoffs_around_loss=r.handoffs_around_loss,
        cancelled_handoffs=r.cancelled_handoffs,
        events=len(r.events),
        event_outcomes=outcomes,
        reconfiguration_log=r.reconfigurations,
        event_log=r.events,
    )


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table (numbers right-aligned)."""
    cells = [[str(h) for h in header]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for k, row in enumerate(cells):
        parts = []
        for i, c in enumerate(row):
            numeric = k > 0 and _is_number(rows[k - 1][i])
            parts.append(c.rjust(widths[i]) if numeric else c.ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:,.2f}"
    return str(v)


def summary_table(results: Sequence[SimResult]) -> str:
    rows = []
    for r in results:
        s = summarize(r)
        rows.append(
            (
                s.label,
                100 * s.efficiency,
                100 * s.world_efficiency,
                s.downtime_minutes,
                s.wasted_gpu_hours,
                s.downtime_gpu_hours,
                s.lost_gpu_hours,
                s.idle_gpu_hours,
                s.reconfigurations,
                s.handoffs_around_loss,
                s.fallbacks,
            )
        )
    return table(
        (
            "policy",
            "goodput %",
            "world %",
            "downtime min",
            "wasted GPU-h",
            "paused GPU-h",
            "lost GPU-h",
            "idle GPU-h",
            "reconfigs",
            "around loss",
            "fallbacks",
        ),
        rows,
    )


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_wasted(results: Sequence[SimResult], path: str | Path, title: str = "") -> Path:
    """Figure 8's view: cumulative wasted GPU-hours (and cumulative downtime) over the run."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        t = [p[0] / 3600 for p in r.series]
        ax1.step(t, [p[1] / 3600 for p in r.series], where="post", color=COLORS.get(r.policy), label=r.label)
        ax2.step(t, [p[2] / 60 for p in r.series], where="post", color=COLORS.get(r.policy), label=r.label)
        for ax, last in ((ax1, r.wasted_gpu_hours), (ax2, r.paused_s / 60)):
            ax.annotate(f"{last:,.1f}", (t[-1], last), textcoords="offset points", xytext=(3, 0), fontsize=8)
    ax1.set(xlabel="hours", ylabel="wasted GPU-hours (paused + lost + idle)", title="Cumulative waste")
    ax2.set(xlabel="hours", ylabel="minutes paused", title="Cumulative downtime")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_event_downtime(results: Sequence[SimResult], path: str | Path, title: str = "") -> Path:
    """Each event's share of the pause it caused, in event order, per policy (log scale)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.2))
    n = len(results)
    width = 0.8 / max(n, 1)
    for k, r in enumerate(results):
        xs = [e.index + (k - (n - 1) / 2) * width for e in r.events]
        ys = [max(e.downtime_s, 1e-2) for e in r.events]
        ax.bar(xs, ys, width=width, color=COLORS.get(r.policy), label=r.label)
    ax.set_yscale("log")
    ax.set(xlabel="event", ylabel="downtime per event (s)", title=title or "Downtime per event")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=n)
    fig.tight_layout()
    return _save(fig, path)


def plot_efficiency(
    rows: Sequence[tuple[str, str, float, float | None]], path: str | Path, title: str = ""
) -> Path:
    """Figure 7's view: ``(regime, policy, simulated %, paper % or None)`` as grouped bars, the paper's
    numbers as black markers."""
    plt = _pyplot()
    regimes = list(dict.fromkeys(r[0] for r in rows))
    policies = list(dict.fromkeys(r[1] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(policies)
    for k, pol in enumerate(policies):
        for i, reg in enumerate(regimes):
            match = [r for r in rows if r[0] == reg and r[1] == pol]
            if not match:
                continue
            _, _, sim, paper = match[0]
            x = i + (k - (len(policies) - 1) / 2) * width
            ax.bar(x, sim, width=width, color=COLORS.get(pol), label=LABELS.get(pol, pol) if i == 0 else None)
            ax.annotate(
                f"{sim:.1f}", (x, sim), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7
            )
            if paper is not None:
                ax.plot([x], [paper], "k_", markersize=14, mew=2, label="paper" if (k, i) == (0, 0) else None)
    ax.set_xticks(range(len(regimes)), [f"{r} volatility" for r in regimes])
    ax.set(ylabel="training efficiency (%)", ylim=(0, 105), title=title or "Training efficiency by regime")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return _save(fig, path)


def plot_reconfiguration(
    bars: Sequence[tuple[str, dict[str, float], float | None]], path: str | Path, title: str = ""
) -> Path:
    """Figure 11's view: one reconfiguration's downtime by phase, ``(label, phases, paper seconds)``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.6 * len(bars)))
    phase_colors = {
        "misc": "#9e9e9e",
        "checkpoint_load": "#c0504d",
        "init_warmup": "#f3a53b",
        "switch": "#8064a2",
        "transfer": "#4f81bd",
    }
    seen: set[str] = set()
    for y, (_label, phases, paper) in enumerate(bars):
        left = 0.0
        for phase, seconds in phases.items():
            ax.barh(
                y,
                seconds,
                left=left,
                color=phase_colors.get(phase),
                label=phase if phase not in seen else None,
            )
            seen.add(phase)
            left += seconds
        text = f"{left:,.1f} s" + (f" (paper {paper:g} s)" if paper is not None else "")
        ax.annotate(text, (left, y), textcoords="offset points", xytext=(4, -3), fontsize=8)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.set_xlim(0, 1.25 * max(sum(b[1].values()) for b in bars))
    ax.set(xlabel="downtime (s)", title=title or "One reconfiguration")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(seen))
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:  # type: ignore[no-untyped-def]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    _pyplot().close(fig)
    return out
