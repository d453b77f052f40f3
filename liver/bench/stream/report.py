"""What ``liver bench stream --json`` prints, built from every process's results and judged.

Per repeat, each figure is the slowest process's: a reshard is done when its last process is, so that
is what throughput and the ratios are computed from. The structs here are the report's schema.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections import defaultdict
from collections.abc import Callable

import msgspec
import torch

from liver.bench.report import Check, musts_passed, size, utc_now
from liver.bench.stream.worker import ProcessResult
from liver.reshard.plan import Plan
from liver.shared.geometry import ModelGeometry
from liver.worker_runtime.stream.executor import LayerStats, StreamStats

AIM_FLOOR_RATIO = 0.9
AIM_SLOWDOWN = 0.01


class LayerRow(msgspec.Struct, frozen=True, kw_only=True):
    """One layer over all processes, in the fastest repeat of each stream mode."""

    layer: int
    rounds: int  # the most any process took
    seconds: float  # into preallocated shards: the slowest process
    wait_seconds: float  # of which that process was blocked on the network
    seconds_allocating: float  # into shards the executor allocated in preparation: the slowest process
    wait_seconds_allocating: float
    bytes_moved: int  # received over the network, all processes
    bytes_local: int  # copied within a process, all processes
    new_bytes: int  # the layer's new shards, all processes


class MemoryRow(msgspec.Struct, frozen=True, kw_only=True):
    """One process's extra memory over every stream repeat of both modes (the worst one)."""

    process: int
    old_rank: int | None
    new_rank: int | None
    budget_bytes: int  # B: the plan's budget for the executor's buffer, send copies included
    buffer_bytes: int  # the one buffer the executor allocated (<= B)
    staging_bytes: int  # the most one step staged in it
    peak_send_copy_bytes: int  # the most send copies alive in it at once
    largest_new_layer_bytes: int
    peak_extra_bytes: int  # the executor's ledger: the buffer + the layer under assembly
    bound_bytes: int  # B + largest new layer shard
    within_bound: bool
    rss_extra_bytes: int | None  # OS view: resident high-water during a stream - before - new state
    new_state_bytes: int  # this process's new shards


class StreamReport(msgspec.Struct, frozen=True, kw_only=True):
    """Per repeat, each figure is the slowest process's (from a common barrier to its return)."""

    bytes_moved: int  # over the network, all processes (the plan's bytes_moved)
    bytes_local: int
    raw_seconds: list[float]  # one tensor per pair, buffers in memory
    floor_seconds: list[float]  # the same exchange with each process's local copies done beside it
    into_seconds: list[float]  # the stream into preallocated new shards
    into_executor_seconds: list[float]  # of which StreamStats.seconds (the rest: schedule and checks)
    alloc_seconds: list[float]  # the stream into new shards the executor allocated during preparation
    alloc_executor_seconds: list[float]
    alloc_prepare_seconds: list[float]  # that allocation (off the clock: beside training in a handoff)
    raw_ceiling_bytes_per_s: float  # bytes_moved / the fastest raw repeat
    floor_bytes_per_s: float  # bytes_moved / the fastest floor repeat: the most any executor reaches here
    floor_ratio: float  # floor / raw ceiling
    throughput_bytes_per_s: float  # bytes_moved / the fastest stream into preallocated shards
    ratio: float  # throughput / raw ceiling
    median_ratio: float  # the same over the medians
    ratio_to_floor: float  # throughput / floor (best / best): the headline, the executor's own efficiency
    median_ratio_to_floor: float  # the same over the medians
    alloc_throughput_bytes_per_s: float  # bytes_moved / the fastest stream into executor-allocated shards
    alloc_ratio: float  # to the raw ceiling
    alloc_median_ratio: float
    alloc_ratio_to_floor: float
    alloc_median_ratio_to_floor: float
    bit_exact: bool  # every new shard of every repeat of both modes matched its expected checksum
    tensors_checked: int  # new shards checked per repeat and mode, all processes
    mismatched: list[str]  # "process P MODE repeat R: tensor", empty when bit-exact
    new_state_digests: list[str]  # per process: a digest of the expected new shards' checksums


class LoopReport(msgspec.Struct, frozen=True, kw_only=True):
    """The training-like loop alone and beside a shadow preparation; pairs of segments, alternating."""

    steps: int
    repeats: int
    alone_seconds: list[float]  # per pair: the slowest process's segment
    with_seconds: list[float]
    ratios: list[float]  # with / alone, per pair
    median_ratio: float
    ratio_quartiles: list[float]  # first and third: the spread other work on the machine leaves
    slowdown: float  # median_ratio - 1: the headline figure (the aim is judged on the upper quartile)
    extra_seconds: float  # median over pairs of with - alone: what one preparation costs the loop
    step_seconds_alone: float  # median segment / steps
    prepare_cpu_seconds: float  # median over pairs of the most CPU time a process spent beyond the loop's
    during_ratio: float  # steps that overlapped the preparation / the same steps alone (median)
    after_ratio: float | None  # steps after it, the shadow world standing idle (median); None: no such steps
    prepare_seconds: list[float]  # per pair: the slowest process's world + stream group build
    world_build_seconds: list[float]
    prepared_within_loop: bool  # every preparation finished before its loop segment ended
    results_unchanged: bool  # the loop's weights are bit-identical with and without the preparation


class StreamBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    quick: bool
    procs: int
    reshape: str
    old_layout: str
    new_layout: str
    model: ModelGeometry  # with the job's DDP settings: the distributed optimizer's shards DP
    state_bytes: int
    requested_bytes: int
    budget_bytes: int  # B: the plan's budget
    send_copy_budget_bytes: int  # the most send copies alive at once, inside the buffer
    message_bytes: int
    repeat: int
    loop_steps: int
    loop_repeats: int
    rounds: int
    backend: str


class StreamBenchReport(msgspec.Struct, frozen=True, kw_only=True):
    date: str
    machine: str
    load_average: list[float]  # 1-minute load average before and after the run: other work on the machine
    python: str
    torch: str
    config: StreamBenchConfig
    stream: StreamReport
    memory: list[MemoryRow]
    layers: list[LayerRow]
    loop: LoopReport | None
    checks: list[Check]
    ok: bool  # every must check passed


def build_report(
    config: StreamBenchConfig,
    plan: Plan,
    bytes_moved: int,
    bytes_local: int,
    results: list[ProcessResult],
    load: list[float],
) -> StreamBenchReport:
    """The run's report: every process's results, per repeat the slowest process's, and the checks."""
    n = config.repeat
    for mode in ("into", "alloc"):
        sent = {sum(getattr(p, mode).stats[r].bytes_sent for p in results) for r in range(n)}
        if sent != {bytes_moved}:
            raise AssertionError(
                f"{mode}: the processes sent {sorted(sent)} bytes, the plan moves {bytes_moved}"
            )

    def slowest(pick: Callable[[ProcessResult, int], float]) -> list[float]:
        return [max(pick(p, r) for p in results) for r in range(n)]

    raw = slowest(lambda p, r: p.raw_seconds[r])
    floor = slowest(lambda p, r: p.floor_seconds[r])
    into = slowest(lambda p, r: p.into.seconds[r])
    alloc = slowest(lambda p, r: p.alloc.seconds[r])
    mismatched = [
        f"process {p.rank} {mode} repeat {r}: {name}"
        for p in results
        for mode in ("into", "alloc")
        for r, names in enumerate(getattr(p, mode).mismatched)
        for name in names
    ]
    stream = StreamReport(
        bytes_moved=bytes_moved,
        bytes_local=bytes_local,
        raw_seconds=raw,
        floor_seconds=floor,
        into_seconds=into,
        into_executor_seconds=slowest(lambda p, r: p.into.stats[r].seconds),
        alloc_seconds=alloc,
        alloc_executor_seconds=slowest(lambda p, r: p.alloc.stats[r].seconds),
        alloc_prepare_seconds=slowest(lambda p, r: p.alloc.prepare_seconds[r]),
        raw_ceiling_bytes_per_s=bytes_moved / min(raw),
        floor_bytes_per_s=bytes_moved / min(floor),
        floor_ratio=min(raw) / min(floor),
        throughput_bytes_per_s=bytes_moved / min(into),
        ratio=min(raw) / min(into),
        median_ratio=statistics.median(raw) / statistics.median(into),
        ratio_to_floor=min(floor) / min(into),
        median_ratio_to_floor=statistics.median(floor) / statistics.median(into),
        alloc_throughput_bytes_per_s=bytes_moved / min(alloc),
        alloc_ratio=min(raw) / min(alloc),
        alloc_median_ratio=statistics.median(raw) / statistics.median(alloc),
        alloc_ratio_to_floor=min(floor) / min(alloc),
        alloc_median_ratio_to_floor=statistics.median(floor) / statistics.median(alloc),
        bit_exact=not mismatched,
        tensors_checked=sum(p.tensors_checked for p in results),
        mismatched=mismatched,
        new_state_digests=[p.new_state_digest for p in results],
    )
    best_into, best_alloc = into.index(min(into)), alloc.index(min(alloc))
    layers = _layer_rows(
        [p.into.stats[best_into] for p in results], [p.alloc.stats[best_alloc] for p in results]
    )
    memory = [_memory_row(p, config.budget_bytes) for p in results]
    loop = _loop_report(config, results) if config.loop_steps else None
    checks = _checks(stream, memory, loop)
    return StreamBenchReport(
        date=utc_now(),
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        load_average=load,
        python=platform.python_version(),
        torch=str(torch.__version__),
        config=config,
        stream=stream,
        memory=memory,
        layers=layers,
        loop=loop,
        checks=checks,
        ok=musts_passed(checks),
    )


def _memory_row(p: ProcessResult, budget: int) -> MemoryRow:
    stats = [*p.into.stats, *p.alloc.stats]
    largest = max(s.largest_new_layer_bytes for s in stats)
    bound = budget + largest
    rss = [x for x in (*p.into.rss_extra_bytes, *p.alloc.rss_extra_bytes) if x is not None]
    return MemoryRow(
        process=p.rank,
        old_rank=p.old_rank,
        new_rank=p.new_rank,
        budget_bytes=budget,
        buffer_bytes=max(s.buffer_bytes for s in stats),
        staging_bytes=max(s.staging_bytes for s in stats),
        peak_send_copy_bytes=max(s.peak_send_copy_bytes for s in stats),
        largest_new_layer_bytes=largest,
        peak_extra_bytes=max(s.peak_extra_bytes for s in stats),
        bound_bytes=bound,
        within_bound=all(s.peak_extra_bytes <= budget + s.largest_new_layer_bytes for s in stats),
        rss_extra_bytes=max(rss) if rss else None,
        new_state_bytes=p.new_state_bytes,
    )


def _layer_rows(into: list[StreamStats], alloc: list[StreamStats]) -> list[LayerRow]:
    def by_layer(stats: list[StreamStats]) -> dict[int, list[LayerStats]]:
        out: dict[int, list[LayerStats]] = defaultdict(list)
        for s in stats:
            for ls in s.layers:
                out[ls.layer].append(ls)
        return out

    a, b = by_layer(into), by_layer(alloc)
    return [
        LayerRow(
            layer=layer,
            rounds=max(x.rounds for x in rows),
            seconds=max(x.seconds for x in rows),
            wait_seconds=max(x.wait_seconds for x in rows),
            seconds_allocating=max(x.seconds for x in b[layer]),
            wait_seconds_allocating=max(x.wait_seconds for x in b[layer]),
            bytes_moved=sum(x.bytes_received for x in rows),
            bytes_local=sum(x.bytes_local for x in rows),
            new_bytes=sum(x.new_bytes for x in rows),
        )
        for layer, rows in sorted(a.items())
    ]


def _loop_report(config: StreamBenchConfig, results: list[ProcessResult]) -> LoopReport:
    n = config.loop_repeats
    alone = [max(sum(p.loop_alone[k].step_seconds) for p in results) for k in range(n)]
    beside = [max(sum(p.loop_with[k].step_seconds) for p in results) for k in range(n)]
    ratios = [w / a for w, a in zip(beside, alone)]
    during: list[float] = []
    after: list[float] = []
    for p in results:
        for a_seg, w_seg in zip(p.loop_alone, p.loop_with):
            assert w_seg.prepared_after is not None
            overlapped = _steps_started_before(w_seg.step_seconds, w_seg.prepared_after)
            during.append(sum(w_seg.step_seconds[:overlapped]) / sum(a_seg.step_seconds[:overlapped]))
            if overlapped < len(w_seg.step_seconds):
                after.append(sum(w_seg.step_seconds[overlapped:]) / sum(a_seg.step_seconds[overlapped:]))
    median = statistics.median(ratios)
    per_process = [{seg.digest for seg in (*p.loop_alone, *p.loop_with)} for p in results]
    return LoopReport(
        steps=config.loop_steps,
        repeats=n,
        alone_seconds=alone,
        with_seconds=beside,
        ratios=ratios,
        median_ratio=median,
        ratio_quartiles=_quartiles(ratios),
        slowdown=median - 1.0,
        extra_seconds=statistics.median(w - a for w, a in zip(beside, alone)),
        step_seconds_alone=statistics.median(alone) / config.loop_steps,
        prepare_cpu_seconds=statistics.median(
            max(p.loop_with[k].cpu_seconds - p.loop_alone[k].cpu_seconds for p in results) for k in range(n)
        ),
        during_ratio=statistics.median(during),
        after_ratio=statistics.median(after) if after else None,
        prepare_seconds=[max(p.loop_with[k].prepared_after or 0.0 for p in results) for k in range(n)],
        world_build_seconds=[max(p.loop_with[k].world_built_after or 0.0 for p in results) for k in range(n)],
        prepared_within_loop=all(
            (seg.prepared_after or 0.0) <= sum(seg.step_seconds) for p in results for seg in p.loop_with
        ),
        results_unchanged=all(len(d) == 1 for d in per_process),
    )


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def _steps_started_before(step_seconds: list[float], moment: float) -> int:
    """How many steps of a segment started before ``moment`` (seconds from the segment's start)."""
    elapsed = 0.0
    for i, s in enumerate(step_seconds):
        if elapsed >= moment:
            return i
        elapsed += s
    return len(step_seconds)


def rate(bps: float) -> str:
    """Bytes per second in GB/s (decimal: the unit network throughput is quoted in)."""
    return f"{bps / 1e9:,.2f} GB/s"


def _checks(stream: StreamReport, memory: list[MemoryRow], loop: LoopReport | None) -> list[Check]:
    worst = max(memory, key=lambda m: m.peak_extra_bytes / m.bound_bytes)
    ceiling = rate(stream.raw_ceiling_bytes_per_s)
    floor = rate(stream.floor_bytes_per_s)
    checks = [
        Check(
            level="must",
            what="bit-exact new shards",
            passed=stream.bit_exact,
            detail=f"{stream.tensors_checked} shard checksums per repeat and mode, "
            f"{len(stream.mismatched)} mismatches",
        ),
        Check(
            level="must",
            what="extra memory <= B + largest new layer shard",
            passed=all(m.within_bound for m in memory),
            detail=f"worst: process {worst.process} peak {size(worst.peak_extra_bytes, 2)} of "
            f"{size(worst.bound_bytes, 2)} (B {size(worst.budget_bytes, 2)} + layer "
            f"{size(worst.largest_new_layer_bytes, 2)})",
        ),
        Check(
            level="aim",
            what=f"stream into preallocated shards >= {AIM_FLOOR_RATIO:.0%} of the floor",
            passed=stream.ratio_to_floor >= AIM_FLOOR_RATIO,
            detail=f"{stream.ratio_to_floor:.1%} best/best, {stream.median_ratio_to_floor:.1%} median/median "
            f"of the raw exchange with the local copies beside it ({floor}); "
            f"{rate(stream.throughput_bytes_per_s)}, {stream.ratio:.1%} of the raw ceiling {ceiling} "
            f"(the floor itself reaches {stream.floor_ratio:.1%} of it)",
        ),
        Check(
            level="aim",
            what=f"stream into shards allocated during preparation >= {AIM_FLOOR_RATIO:.0%} of the floor",
            passed=stream.alloc_ratio_to_floor >= AIM_FLOOR_RATIO,
            detail=f"{stream.alloc_ratio_to_floor:.1%} best/best, "
            f"{stream.alloc_median_ratio_to_floor:.1%} median/median; "
            f"{rate(stream.alloc_throughput_bytes_per_s)}, {stream.alloc_ratio:.1%} of the raw ceiling; "
            f"the allocation beforehand took {min(stream.alloc_prepare_seconds):.3f} s",
        ),
    ]
    if loop is not None:
        checks.append(
            Check(
                level="must",
                what="shadow preparation leaves the loop's results unchanged",
                passed=loop.results_unchanged,
                detail="weights bit-identical alone and beside every preparation"
                if loop.results_unchanged
                else "the loop's weights differ",
            )
        )
        low, high = loop.ratio_quartiles
        checks.append(
            Check(
                level="aim",
                what=f"shadow preparation slows the loop by < {AIM_SLOWDOWN:.0%} (in 3 of 4 pairs)",
                passed=high < 1.0 + AIM_SLOWDOWN,
                detail=f"with/alone median {loop.median_ratio:.4f}, quartiles {low:.4f}-{high:.4f}, over "
                f"{loop.repeats} pairs of {loop.steps} steps ({loop.step_seconds_alone * 1000:.2f} ms/step "
                f"alone); one preparation: {statistics.median(loop.prepare_seconds) * 1000:.0f} ms, "
                f"{loop.prepare_cpu_seconds * 1000:+.1f} ms CPU per process, "
                f"{loop.extra_seconds * 1000:+.1f} ms of loop time",
            )
        )
    return checks
