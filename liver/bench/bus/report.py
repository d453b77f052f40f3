"""What ``liver bench bus`` reports: the report's structure, its statistics, the checks against the
issue's aim, and the report as text.

Kept apart from the run (:mod:`.bench`) so that the numbers' definitions live in one place; the
definitions themselves are in :mod:`.bench`'s docstring and ``docs/benchmarks.md``.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from liver.bench.report import Check, check_line, size

AIM_BUS_OVERHEAD_P99_S: Final = 0.010
"""The issue's aim for the bus overhead's p99, on loopback."""
STAGE_GAPS: Final = (
    ("ingest", None, "resize_requested"),
    ("request", "resize_requested", "topology_request"),
    ("topology", "topology_request", "topology_planned"),
    ("transfer", "topology_planned", "transfer_planned"),
    ("prepare", "transfer_planned", "switch"),
    ("switch", "switch", "outcome"),
)
"""Each stage of a handoff: its name and the arrivals it lies between (``None``: the publication).
``prepare`` is the coordinator sending the Prepare, the workers reading their slices and
answering ready, and the switch intent recorded; ``switch`` is the switched acks and the commit."""


# -- the report's structure ---------------------------------------------------------------------------------


class Stat(msgspec.Struct, kw_only=True):
    """A distribution over the counted events (milliseconds unless the field says otherwise).

    Percentiles interpolate linearly between the closest ranks, so with fewer than 100 events the p99
    lies between the two largest values."""

    n: int
    p50: float
    p99: float
    mean: float
    max: float


class BusEventRecord(msgspec.Struct, kw_only=True):
    """One event, warm-up or counted; times in milliseconds after the event was published."""

    index: int
    event_id: str
    kind: str  # "scale_in" (spot warning) or "scale_out" (scale request)
    warmup: bool
    outcome: str  # "committed", "aborted" or "timeout"
    reason: str = ""
    devices_before: int
    devices_after: int | None = None
    generation: int | None = None
    layout_after: str | None = None
    switch_ms: float | None = None
    commit_ms: float | None = None
    arrivals_ms: dict[str, float] = {}
    topology_planning_ms: float | None = None
    transfer_plan_ms: float | None = None
    transfer_verify_ms: float | None = None
    transfer_encode_ms: float | None = None
    planning_ms: float | None = None
    worker_cpu_switch_ms: float | None = None
    worker_cpu_commit_ms: float | None = None
    worker_idle_cpu_ms_per_s: float | None = None
    idle_cpu_share: dict[str, float] = {}
    """Each process's CPU time per second of wall time in the idle half second before the event:
    heartbeats, consumers' idle fetches, timers."""
    bus_overhead_switch_ms: float | None = None
    bus_overhead_commit_ms: float | None = None
    process_cpu_ms: dict[str, float] = {}
    stage_cpu_ms: dict[str, dict[str, float]] = {}
    """CPU time of each process during each stage (the stages of ``STAGE_GAPS``)."""
    messages_in: int | None = None
    """Messages the services and workers published from the event's publication to its commit
    (heartbeats and the bench's own requests left out); ``messages_out`` those delivered to them."""
    messages_out: int | None = None
    bytes_in: int | None = None
    bytes_out: int | None = None
    messages_in_total: int | None = None
    """The same until the aftermath settled: the membership published, the coordinator's release of
    the plan's objects (it lists the whole plan store first), the leaving workers gone."""
    messages_out_total: int | None = None
    bytes_in_total: int | None = None
    bytes_out_total: int | None = None
    heartbeats: int = 0
    slice_bytes_total: int | None = None
    slice_bytes_max: int | None = None


class ContractReport(msgspec.Struct, kw_only=True):
    """What the handoff's Prepare and one plan slice cost at this size, timed on their own in the bench.

    The Prepare is one job-wide broadcast: the coordinator encodes and publishes it once, and the
    simulated job (one subscription for all its workers) decodes it once; a real worker decodes its
    own copy, in parallel with the others. Each participant decodes and checks its own slice.
    """

    participants: int
    prepare_bytes: int
    prepare_placement_bytes: int  # the old and the new placement, each carried once
    prepare_plan_ref_bytes: int  # how every worker finds its slice (``SliceIndex``)
    prepare_encode_ms: float
    prepare_decode_ms: float  # decoded as a worker does: WorkerCommand, every field checked
    prepare_bytes_per_event: int
    coordinator_encode_ms_per_event: float
    sim_prepare_decode_ms_per_event: float
    broadcast_prepare_bytes: int
    """What the coordinator publishes per handoff for the Prepare (one broadcast: ``prepare_bytes``);
    the per-worker contract it replaced published ``participants`` copies of an O(devices) message."""
    slice_bytes: int
    slice_world_bytes: int  # worlds repeated inside the slice: none since slice schema version 2
    slice_tasks: int
    slice_decode_ms: float  # decode_slice: decoded and checked against the Prepare and the device
    slice_bytes_per_event: int  # every device's slice, as stored in the object store
    sim_slice_decode_ms_per_event: float
    transfer_unreported_ms: float | None
    """What the transfer service computes for an event beyond the plan, verification and encoding it
    logs (the rank-order baseline, the lower bound, the statistics, the per-device slices): its
    ``plan_transfer`` re-run here on the last event's ``TopologyPlanned``, less the parts it times.
    Counted in the bus overhead, which makes that figure pessimistic by about this much."""


class SizeReport(msgspec.Struct, kw_only=True):
    workers: int
    devices_per_node: int
    worker_processes: int
    heartbeat_s: float
    job_id: str
    model: str
    hardware: str
    global_batch_size: int
    layouts: dict[str, str]  # the layout each kind of event ended in (last counted event)
    events: int  # counted (after the warm-up)
    warmup: int
    committed: int  # counted events that committed
    all_committed: bool  # every event, warm-up included, committed
    switch_ms: Stat | None
    commit_ms: Stat | None
    planning_ms: Stat | None
    topology_planning_ms: Stat | None
    transfer_planning_ms: Stat | None
    worker_cpu_switch_ms: Stat | None
    worker_cpu_commit_ms: Stat | None
    bus_overhead_switch_ms: Stat | None
    bus_overhead_commit_ms: Stat | None
    stages_ms: dict[str, Stat]
    stage_cpu_ms: dict[str, dict[str, float]]
    """Median CPU time of each process during each stage."""
    process_cpu_ms: dict[str, Stat]
    idle_cpu_share: dict[str, float]
    """Median over the counted events of each process's CPU share while the job was idle."""
    messages_in: Stat | None  # counts, not milliseconds
    messages_out: Stat | None
    bytes_in: Stat | None
    bytes_out: Stat | None
    messages_in_total: Stat | None
    messages_out_total: Stat | None
    contract: ContractReport | None
    records: list[BusEventRecord]


class BusBenchReport(msgspec.Struct, kw_only=True):
    """What ``liver bench bus --json`` prints."""

    quick: bool
    date: str
    python: str
    nats_server: str
    machine: str
    cpus: int
    load_average: tuple[float, float]  # 1-minute load before and after
    services: str
    sizes: list[SizeReport]
    checks: list[Check]
    ok: bool  # every event of every size committed


# -- statistics -------------------------------------------------------------------------------------------


def gap(record: BusEventRecord, name: str) -> float | None:
    """How long stage ``name`` of ``STAGE_GAPS`` took in one event (``None`` when not seen)."""
    for stage, start, end in STAGE_GAPS:
        if stage == name:
            a = 0.0 if start is None else record.arrivals_ms.get(start)
            b = record.arrivals_ms.get(end)
            return None if a is None or b is None else b - a
    raise KeyError(name)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolating linearly between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def stat(values: Any) -> Stat | None:
    data = [float(v) for v in values if v is not None]
    if not data:
        return None
    return Stat(
        n=len(data),
        p50=percentile(data, 50),
        p99=percentile(data, 99),
        mean=statistics.fmean(data),
        max=max(data),
    )


def checks_for(r: SizeReport) -> list[Check]:
    """The musts and the issue's aim, judged on this run's numbers."""
    out = [
        Check(
            workers=r.workers,
            level="must",
            what="every event committed",
            passed=r.all_committed,
            detail=f"{r.committed} of {r.events} counted events committed"
            + ("" if r.all_committed else "; " + _first_failure(r)),
        )
    ]
    aim_ms = AIM_BUS_OVERHEAD_P99_S * 1e3
    for label, st in (("switch", r.bus_overhead_switch_ms), ("commit", r.bus_overhead_commit_ms)):
        out.append(
            Check(
                workers=r.workers,
                level="aim",
                what=f"bus overhead to the {label} p99 < {aim_ms:g} ms",
                passed=st is not None and st.p99 < aim_ms,
                detail="not measured" if st is None else f"p99 {st.p99:,.1f} ms, p50 {st.p50:,.1f} ms",
            )
        )
    return out


def _first_failure(r: SizeReport) -> str:
    for record in r.records:
        if record.outcome != "committed":
            return f"event {record.event_id}: {record.outcome} ({record.reason})"
    return "fewer events ran than asked"


# -- printing -----------------------------------------------------------------------------------------------


def _ms(st: Stat | None) -> str:
    return "-" if st is None else f"{st.p50:,.1f} / {st.p99:,.1f}"


def print_report(report: BusBenchReport) -> None:
    out = sys.stdout
    title = "liver bench bus" + (" (quick)" if report.quick else "")
    print(f"{title}: {report.date}, nats-server {report.nats_server}, {report.services}", file=out)
    for r in report.sizes:
        print(
            f"\n{r.workers} workers ({r.workers // r.devices_per_node} nodes of {r.devices_per_node}), "
            f"{r.model} on {r.hardware}; {r.events} events counted after {r.warmup} warm-up, "
            f"{r.committed} committed; layouts {r.layouts}",
            file=out,
        )
        rows = [
            ("latency to the switch", r.switch_ms),
            ("latency to the commit", r.commit_ms),
            ("planning (topology + transfer)", r.planning_ms),
            ("  topology chooser", r.topology_planning_ms),
            ("  transfer plan + verify + encode", r.transfer_planning_ms),
            ("simulated workers' CPU, to the switch", r.worker_cpu_switch_ms),
            ("simulated workers' CPU, to the commit", r.worker_cpu_commit_ms),
            ("bus overhead to the switch", r.bus_overhead_switch_ms),
            ("bus overhead to the commit", r.bus_overhead_commit_ms),
        ]
        rows += [(f"CPU of {name}", st) for name, st in r.process_cpu_ms.items()]
        print(f"  {'(milliseconds)':<40} {'p50 / p99':>22}", file=out)
        for label, st in rows:
            print(f"  {label:<40} {_ms(st):>22}", file=out)
        if r.idle_cpu_share:
            shares = ", ".join(f"{p} {v:.0%}" for p, v in sorted(r.idle_cpu_share.items()) if v >= 0.005)
            print(f"  CPU share while idle (heartbeats every {r.heartbeat_s:g} s): {shares}", file=out)
        print("  stages (p50 / p99 wall; median CPU of the busiest processes in it):", file=out)
        for name, st in r.stages_ms.items():
            busiest = sorted(r.stage_cpu_ms.get(name, {}).items(), key=lambda kv: -kv[1])[:3]
            cpu = ", ".join(f"{p} {v:,.1f}" for p, v in busiest if v >= 0.05)
            print(f"    {name:<10} {_ms(st):>22}   {cpu}", file=out)
        if r.messages_in is not None and r.messages_out is not None:
            print(
                f"  messages per event (median): {r.messages_in.p50:,.0f} in, {r.messages_out.p50:,.0f} out; "
                f"payload {size(r.bytes_in.p50 if r.bytes_in else 0)} in, "
                f"{size(r.bytes_out.p50 if r.bytes_out else 0)} out"
                + (
                    f"; with the aftermath {r.messages_in_total.p50:,.0f} in, "
                    f"{r.messages_out_total.p50:,.0f} out"
                    if r.messages_in_total is not None and r.messages_out_total is not None
                    else ""
                ),
                file=out,
            )
        c = r.contract
        if c is not None:
            print(
                f"  Prepare: one broadcast of {size(c.prepare_bytes)} "
                f"({size(c.prepare_placement_bytes)} placements) for {c.participants} participants; "
                f"encode {c.prepare_encode_ms:.3f} ms, decode {c.prepare_decode_ms:.3f} ms",
                file=out,
            )
            print(
                f"  slice: {size(c.slice_bytes)} ({c.slice_tasks} tasks), decode and check "
                f"{c.slice_decode_ms:.3f} ms; {size(c.slice_bytes_per_event)} stored per event",
                file=out,
            )
            if c.transfer_unreported_ms is not None:
                print(
                    f"  transfer service's compute it does not log (in the bus overhead): "
                    f"{c.transfer_unreported_ms:,.1f} ms",
                    file=out,
                )
    print(
        "\nbus overhead = latency - planning - the simulated workers' CPU time (less their idle rate); "
        "p50 / p99 over the counted events.",
        file=out,
    )
    print(
        f"host: {report.cpus} CPUs, load average {report.load_average[0]:.1f} before, "
        f"{report.load_average[1]:.1f} after",
        file=out,
    )
    for c in report.checks:
        print(check_line(c), file=out)
