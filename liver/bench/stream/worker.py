"""One worker process of ``liver bench stream``: the loop on the active world, then raw and stream repeats.

Every measurement runs in the same processes, on the same plan, in rotating order, so the ratios the
report draws between them are not skewed by which ran first or on which process (the module docstring
of :mod:`liver.bench.stream.bench` says what each one is).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import msgspec
import torch

from liver.bench.report import progress
from liver.bench.stream.loop import Segment, barrier, measure_loop
from liver.bench.stream.rss import reset_peak_rss, status_kib
from liver.bench.stream.workload import (
    JOB,
    KIB,
    checksum,
    empty_holding,
    holding_content,
    state_digest,
)
from liver.reshard.holdings import pieces_of
from liver.reshard.plan import Plan
from liver.worker_runtime.stream.executor import (
    TORCH_DTYPES,
    GroupRanks,
    LocalTensor,
    StreamOptions,
    StreamStats,
    allocate_new_state,
    devices_in_stream_order,
    prepare_schedule,
    ranks_on_device,
    staging_bytes,
    stream_plan,
)
from liver.worker_runtime.stream.schedule import Schedule
from liver.worker_runtime.world import (
    StoreAddress,
    WorldSpec,
    build_stream_group,
    build_world,
)


class Setup(msgspec.Struct, frozen=True, kw_only=True):
    """What the parent hands every worker: one plan and one set of options, so all measure the same."""

    plan: Plan
    store_port: int
    options: StreamOptions
    pair_bytes: tuple[tuple[int, int, int], ...]  # (sending group rank, receiving group rank, bytes)
    repeat: int
    loop_steps: int
    loop_repeats: int
    group_timeout_s: float


class StreamRuns(msgspec.Struct, kw_only=True):
    """One process's stream repeats in one mode."""

    seconds: list[float] = msgspec.field(default_factory=list)  # from the barrier to stream_plan's return
    prepare_seconds: list[float] = msgspec.field(default_factory=list)  # allocating: the new state, untimed
    stats: list[StreamStats] = msgspec.field(default_factory=list)
    mismatched: list[list[str]] = msgspec.field(default_factory=list)  # tensors whose checksum differs
    rss_extra_bytes: list[int | None] = msgspec.field(default_factory=list)


class ProcessResult(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    old_rank: int | None
    new_rank: int | None
    loop_alone: list[Segment]  # one per loop repeat
    loop_with: list[Segment]  # with a shadow preparation started on the first step
    raw_seconds: list[float]  # one per stream repeat
    floor_seconds: list[float]  # the raw exchange with the local copies beside it, one per repeat
    into: StreamRuns  # streams into preallocated new shards (the new model's storage)
    alloc: StreamRuns  # streams into new shards the executor allocated during preparation
    tensors_checked: int  # per mode and repeat
    new_state_bytes: int
    new_state_digest: str


def _quiet_logs() -> None:
    from liver.shared.logs import configure_logging

    configure_logging(level="WARNING", stream=sys.stderr)


def measure_process(rank: int, size: int, setup: Setup) -> ProcessResult:
    """One process (``run_procs``' ``fn``): the loop measurements on the active world, then raw and
    stream repeats."""
    _quiet_logs()
    plan = setup.plan
    devices = devices_in_stream_order(plan)
    device = devices[rank]
    address = StoreAddress("127.0.0.1", setup.store_port)
    timeout = timedelta(seconds=setup.group_timeout_s)
    old_spec = WorldSpec(job=JOB, generation=0, layout=plan.old.layout, placement=plan.old.placement)
    say: Callable[[str], None] = partial(progress, "stream") if rank == 0 else (lambda _text: None)
    say("process 0: building the active world")
    active = build_world(old_spec, device, address, timeout=timeout)
    say("process 0: training-like loop, alone and beside shadow preparations")
    loop_alone, loop_with = measure_loop(
        active,
        old_spec,
        plan,
        device,
        address,
        loop_steps=setup.loop_steps,
        loop_repeats=setup.loop_repeats,
        timeout_s=setup.group_timeout_s,
    )
    final = WorldSpec(
        job=JOB, generation=setup.loop_repeats + 1, layout=plan.new.layout, placement=plan.new.placement
    )
    stream = build_stream_group(old_spec, final, device, address, timeout=timeout)
    if stream.devices != devices or stream.rank != rank:
        raise AssertionError(f"stream group numbers {stream.devices} differently from the plan's {devices}")
    try:
        measured = _measure_stream(stream.group(), rank, plan, setup, say)
    finally:
        stream.release()
        active.release()
    return ProcessResult(rank=rank, loop_alone=loop_alone, loop_with=loop_with, **measured)


# -- raw ceiling and the stream ------------------------------------------------------------------------


def _raw_once(
    pg: Any,
    rank: int,
    pairs: tuple[tuple[int, int, int], ...],
    tag: int,
    beside: Callable[[], None] | None = None,
) -> float:
    """Every pair's bytes as one tensor, all pairs at once, between buffers already in memory (touched
    before the clock starts); this process's seconds from the barrier to its last completion.
    ``beside`` runs on this thread while the messages are in flight."""
    outgoing = [(dst, torch.empty(n, dtype=torch.uint8).fill_(1)) for src, dst, n in pairs if src == rank]
    incoming = [(src, torch.empty(n, dtype=torch.uint8).fill_(0)) for src, dst, n in pairs if dst == rank]
    barrier(pg)
    t0 = time.perf_counter()
    works = [pg.recv([b], src, tag) for src, b in incoming]
    works += [pg.send([b], dst, tag) for dst, b in outgoing]
    if beside is not None:
        beside()
    for work in works:
        work.wait()
    return time.perf_counter() - t0


def _local_copier(
    schedule: Schedule, plan: Plan, old_state: dict[int, LocalTensor], into: dict[int, LocalTensor]
) -> Callable[[], None]:
    """Every byte this process must move within its memory, from the executor's own schedule: the
    slices that stay (old shard -> new shard), each staged receive copied out into its strided region
    of the new shard, and each non-contiguous send packed into a contiguous piece. Point-to-point
    transports (gloo, NCCL) send and receive only contiguous buffers, so no executor of this plan can
    skip the last two either; the scratch they go through is made and touched here, off the clock."""
    pairs: list[tuple[torch.Tensor, tuple[slice, ...] | None, torch.Tensor, tuple[slice, ...] | None]] = []
    largest = max(
        (m.nbytes for step in schedule.steps() for m in (*step.recvs, *step.sends)),
        default=0,
    )
    scratch = torch.ones(largest, dtype=torch.uint8)

    def contiguous(msg_tensor: int, region: tuple[tuple[int, int], ...], nbytes: int) -> torch.Tensor:
        dtype = TORCH_DTYPES[plan.tensors[msg_tensor].dtype]
        return scratch[:nbytes].view(dtype).view(tuple(hi - lo for lo, hi in region))

    for step in schedule.steps():
        for c in step.copies:
            pairs.append(
                (
                    pieces_of(into[c.tensor])[c.dst_piece],
                    _index(c.dst),
                    pieces_of(old_state[c.tensor])[c.src_piece],
                    _index(c.src),
                )
            )
        for m in step.recvs:
            if m.staging_offset >= 0:
                src = contiguous(m.tensor, m.region, m.nbytes)
                pairs.append((pieces_of(into[m.tensor])[m.piece], _index(m.region), src, None))
        for m in step.sends:
            if m.copy:
                dst = contiguous(m.tensor, m.region, m.nbytes)
                pairs.append((dst, None, pieces_of(old_state[m.tensor])[m.piece], _index(m.region)))

    def copy() -> None:
        for dst, dst_index, src, src_index in pairs:
            d = dst if dst_index is None else dst[dst_index]
            d.copy_(src if src_index is None else src[src_index])

    return copy


def _index(region: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in region)


STREAM_MODES = ("raw", "floor", "into", "alloc")
"""Per repeat, in rotating order: the raw exchange; the raw exchange with this process's local data
movement done beside it (the floor: slices that stay, staged receives copied into place,
non-contiguous sends packed; what any executor of this plan must do, with none of its logic); the
stream into preallocated new shards (the new model's storage, in memory already, as the raw
exchange's buffers are); the stream into new shards the executor allocated, fresh for the repeat,
during preparation (``allocate_new_state``: a caller with no storage of its own; the first-touch page
faults are paid there, off the clock, and reported as its preparation time)."""

_SENTINEL = -1  # no synthetic value is negative: a preallocated shard the stream missed cannot pass


def _measure_stream(
    pg: Any, rank: int, plan: Plan, setup: Setup, say: Callable[[str], None]
) -> dict[str, Any]:
    devices = devices_in_stream_order(plan)
    old_rank, new_rank = ranks_on_device(plan, devices[rank])
    # This process's shards and local copies, from the executor's own schedule. Both stream modes run
    # as the runtime does, with the schedule and the staging buffer made (and touched) before the cut.
    prepared = prepare_schedule(
        plan,
        old_rank=old_rank,
        new_rank=new_rank,
        group_ranks=GroupRanks.by_device(plan),
        group_rank=rank,
        group_size=len(devices),
        options=setup.options,
    )
    schedule = prepared.schedule
    staging = torch.zeros(staging_bytes(prepared, preallocated=True), dtype=torch.uint8)
    say("process 0: making the synthetic old state and the expected checksums")
    old_state = {ti: holding_content(plan, ti, s) for ti, s in schedule.old_shards.items()}
    new_shards = schedule.new_shards
    expected = {ti: checksum(holding_content(plan, ti, s)) for ti, s in new_shards.items()}
    into = {ti: empty_holding(plan, ti, s) for ti, s in new_shards.items()}
    for v in into.values():  # touched, as a built model's storage is, before the first floor repeat
        for t in pieces_of(v):
            t.fill_(_SENTINEL)
    new_bytes = sum(t.numel() * t.element_size() for v in into.values() for t in pieces_of(v))
    say("process 0: warm-up exchange (untimed)")
    _raw_once(pg, rank, setup.pair_bytes, tag=999_999)
    local_copies = _local_copier(schedule, plan, old_state, into)
    out: dict[str, Any] = {
        "raw_seconds": [],
        "floor_seconds": [],
        "into": StreamRuns(),
        "alloc": StreamRuns(),
    }
    for r in range(setup.repeat):
        for k in range(len(STREAM_MODES)):
            mode = STREAM_MODES[(k + r) % len(STREAM_MODES)]
            say(f"process 0: repeat {r + 1} of {setup.repeat}: {mode}")
            if mode == "raw":
                out["raw_seconds"].append(_raw_once(pg, rank, setup.pair_bytes, tag=1_000_000 + r))
                continue
            if mode == "floor":
                seconds = _raw_once(pg, rank, setup.pair_bytes, tag=2_000_000 + r, beside=local_copies)
                out["floor_seconds"].append(seconds)
                continue
            runs: StreamRuns = out[mode]
            if mode == "into":
                given = into
            else:
                t0 = time.perf_counter()
                given = allocate_new_state(prepared)
                runs.prepare_seconds.append(time.perf_counter() - t0)
            for v in given.values():
                for t in pieces_of(v):
                    t.fill_(_SENTINEL)
            base = reset_peak_rss()
            barrier(pg)
            t0 = time.perf_counter()
            result = stream_plan(
                plan,
                old_rank=old_rank,
                new_rank=new_rank,
                group=pg,
                group_ranks=GroupRanks.by_device(plan),
                old_state=old_state,
                into=given,
                options=setup.options,
                schedule=prepared,
                staging=staging,
            )
            seconds = time.perf_counter() - t0
            peak = status_kib("VmHWM")
            runs.seconds.append(seconds)
            runs.stats.append(result.stats)
            runs.rss_extra_bytes.append(None if base is None or peak is None else peak * KIB - base)
            got = {ti: checksum(t) for ti, t in result.new_state.items()}
            runs.mismatched.append(
                sorted(
                    plan.tensors[ti].name
                    for ti in expected.keys() | got.keys()
                    if got.get(ti) != expected.get(ti)
                )
            )
            del result, got, given
    return {
        "old_rank": old_rank,
        "new_rank": new_rank,
        **out,
        "tensors_checked": len(expected),
        "new_state_bytes": new_bytes,
        "new_state_digest": state_digest(expected),
    }
