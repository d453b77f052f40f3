"""The demo's result: one row per generation the job tried to reach, and the table that shows them.

A row joins three sources: what triggered it and when (the demo's own records of what it published),
what the control plane said (the topology planner's layout, the transfer plan's planning time, the
coordinator's ``generation.committed`` with the pause and the bytes), and what the workers measured
(the loss at the cut and after it, from their metrics files).
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec
from rich.console import Console
from rich.table import Table

from liver.demo.observer import Observer, PublishedTrigger
from liver.demo.runlog import RunLog, TracePoint
from liver.shared.messages import GenerationAborted, GenerationCommitted, TopologyPlanned

Outcome = Literal["committed", "aborted", "pending"]


class GenerationRow(msgspec.Struct, kw_only=True):
    generation: int
    trigger: str
    event_id: str
    outcome: Outcome
    layout_before: str
    layout_after: str
    devices_before: int
    devices_after: int
    cut_iteration: int | None = None
    downtime_s: float | None = None
    """The longest pause of any worker (the coordinator's ``downtime_s``)."""
    bytes_moved: int | None = None
    plan_s: float | None = None
    """The transfer planner's time for this plan."""
    handoff_s: float | None = None
    """From the event's publication to the commit: the job trained on the old world meanwhile."""
    loss_before: float | None = None
    """The loss of the last step on the old world (the cut)."""
    loss_after: float | None = None
    """The loss of the first step on the new world."""
    reason: str | None = None


class StepPoint(msgspec.Struct, kw_only=True, array_like=True):
    iteration: int
    loss: float
    generation: int
    t: float  # seconds since the run started


class DemoResult(msgspec.Struct, kw_only=True):
    ok: bool
    scenario: str
    out_dir: str
    mark: str
    """The value of ``LIVER_DEMO_RUN`` in every process the demo started."""
    pids: list[int]
    generations: list[GenerationRow]
    steps: list[StepPoint]
    timeline_png: str | None = None
    leftovers: list[int] = []
    wall_s: float = 0.0
    error: str | None = None
    interrupted: bool = False


def _loss_at(trace: list[TracePoint], iteration: int | None) -> float | None:
    if iteration is None:
        return None
    for point in trace:
        if point.iteration == iteration:
            return point.loss
    return None


def generation_rows(observer: Observer, runlog: RunLog) -> list[GenerationRow]:
    """A row for each trigger the demo published, matched to the generation that served it."""
    trace = runlog.trace()
    rows = []
    for trigger in observer.triggers:
        planned = _planned_for(observer, trigger)
        if planned is None:
            continue
        rows.append(_row(observer, trigger, planned, trace))
    return rows


def _planned_for(observer: Observer, trigger: PublishedTrigger) -> TopologyPlanned | None:
    """The generation that served ``trigger``: the last one planned for it (an earlier one may have been
    cancelled and re-planned)."""
    found = None
    for generation in sorted(observer.topology):
        planned: TopologyPlanned = observer.topology[generation].message
        if planned.event_id == trigger.event_id:
            found = planned
    return found


def _row(
    observer: Observer, trigger: PublishedTrigger, planned: TopologyPlanned, trace: list[TracePoint]
) -> GenerationRow:
    g = planned.generation
    outcome = observer.outcome(g)
    transfer = observer.transfer.get(g)
    row = GenerationRow(
        generation=g,
        trigger=trigger.label,
        event_id=trigger.event_id,
        outcome="pending",
        layout_before=planned.from_layout.describe(),
        layout_after=planned.layout.describe(),
        devices_before=len(planned.from_placement),
        devices_after=len(planned.placement),
        plan_s=None if transfer is None else transfer.message.summary.plan_seconds,
    )
    if isinstance(outcome, GenerationCommitted):
        committed_at = observer.committed[g].t
        cut = outcome.started_at_iteration
        row.outcome = "committed"
        row.cut_iteration = cut
        row.downtime_s = outcome.downtime_s
        row.bytes_moved = outcome.bytes_moved
        row.handoff_s = committed_at - trigger.published_at
        row.loss_before = _loss_at(trace, cut)
        row.loss_after = _loss_at(trace, cut + 1)
    elif isinstance(outcome, GenerationAborted):
        row.outcome = "aborted"
        row.reason = f"{outcome.phase}: {outcome.reason} ({outcome.outcome})"
    return row


def losses_finite(result: DemoResult) -> bool:
    return bool(result.steps) and all(math.isfinite(p.loss) for p in result.steps)


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render_table(result: DemoResult) -> Table:
    table = Table(title="LiveR demo: one row per generation", title_justify="left")
    for name, justify in (
        ("gen", "right"),
        ("trigger", "left"),
        ("layout (devices) before -> after", "left"),
        ("outcome", "left"),
        ("cut", "right"),
        ("downtime", "right"),
        ("moved", "right"),
        ("plan", "right"),
        ("handoff", "right"),
        ("loss before -> after", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in result.generations:
        table.add_row(
            str(row.generation),
            row.trigger,
            f"{row.layout_before} ({row.devices_before}) -> {row.layout_after} ({row.devices_after})",
            row.outcome if row.reason is None else f"{row.outcome}: {row.reason}",
            _num(row.cut_iteration, "d"),
            _num(row.downtime_s, ".2f") + (" s" if row.downtime_s is not None else ""),
            _size(row.bytes_moved),
            _num(None if row.plan_s is None else row.plan_s * 1000, ".1f")
            + (" ms" if row.plan_s is not None else ""),
            _num(row.handoff_s, ".1f") + (" s" if row.handoff_s is not None else ""),
            f"{_num(row.loss_before, '.3f')} -> {_num(row.loss_after, '.3f')}",
        )
    table.caption = (
        "downtime: the longest pause of any worker (training stood still); handoff: event to commit "
        "(training went on); plan: the transfer planner's time; loss: the last step before the cut and "
        "the first after it"
    )
    return table


def print_summary(result: DemoResult, console: Console) -> None:
    console.print(render_table(result))
    if result.steps:
        first, last = result.steps[0], result.steps[-1]
        console.print(
            f"{len(result.steps)} steps in {result.wall_s:.0f} s; loss {first.loss:.3f} "
            f"(step {first.iteration}) -> {last.loss:.3f} (step {last.iteration})"
        )
    if result.timeline_png:
        console.print(f"timeline: {result.timeline_png}")
    console.print(f"logs and metrics: {result.out_dir}")
    if result.error:
        console.print(f"[bold red]demo failed:[/] {result.error}")
    if result.leftovers:
        console.print(f"[bold red]processes left behind:[/] {result.leftovers}")
