"""``liver bench stream``: the layer-streaming executor against the raw network, and shadow-world overhead.

Local processes (gloo on loopback) hold a synthetic training state (a GPT-like :class:`ModelSpec`
sized to ``--size-mib``: bf16 parameters, fp32 master weights and both Adam moments) sharded by the
old layout, and reshard it to the new one with :func:`stream_plan` over the handoff's stream group.

What is measured, all in the same run and the same processes:

* **Stream throughput**: bytes moved between processes / the stream's wall time (the slowest process,
  from a common barrier to its return), in two modes: into preallocated new shards (``into=``: the new
  model's storage, already in memory, as the raw exchange's buffers are) and allocating its new shards
  as the executor does by default (first-touch page faults on the clock, a real cost of that path).
* **Raw ceiling**: every pair of processes that exchanges bytes in the plan exchanges the same number of
  bytes as one tensor with one send/recv, all pairs at once, between buffers already in memory; best of
  ``--repeat``. One untimed exchange warms the connections first, and each repeat runs the raw exchange
  and both stream modes in a rotating order, so drift and warm-up favour none of them.
* **Raw + local copies**: the raw exchange again, with each process copying the slices it keeps from
  its old shards into its new ones (the executor's own local copies) on its main thread while the
  messages are in flight. No executor of this plan can do less data movement, so this is the most it
  can reach on the machine; the stream's ratio to it is the executor's own efficiency.
* **Memory**: the executor's own ledger of what it allocated beyond the state (its one buffer for
  staged pieces and send copies, the layer under assembly) against the bound ``B + largest new layer
  shard``, where ``B`` (``--budget-mib``) is the plan's budget, send copies included. As an OS-level
  cross-check, the process's resident-set high-water mark during the stream less the resident set
  before it and the new state.
* **Bit-exactness**: every element's value is a function of its tensor and global index, so each
  process computes the checksum its new shards must have without any other process's data, and
  compares it with the checksum of what it received, for every repeat.
* **Shadow-world overhead**: a training-like loop (matmuls and a gradient all-reduce on the active
  world, ``--loop-steps`` steps) runs alone and while the next generation's groups and the stream group
  are built beside it (``build_world_async`` on a background thread, then the stream group on another);
  segments alternate (alone first, then with first, ...) and the median of the per-pair ratios is
  reported. Mock warm-up is not part of it: only joiners (ranks new to the job) warm up, and a joiner is
  a process of its own that never trains in the active world, so on real machines it shares no core
  with the loop; here, with every process in the active world, there is no joiner to warm up.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import hashlib
import os
import platform
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
import torch

from liver.bench.procs import ProcsError, run_procs
from liver.services.transfer.planner import build_plan, plan_stats
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import ModelSpec, TensorSpec
from liver.shared.plan import Plan, WorldConfig
from liver.shared.views import Shard
from liver.worker_runtime.stream.executor import (
    TORCH_DTYPES,
    GroupRanks,
    LayerStats,
    StreamOptions,
    StreamStats,
    devices_in_stream_order,
    prepare_schedule,
    ranks_on_device,
    stream_plan,
)
from liver.worker_runtime.stream.schedule import Schedule
from liver.worker_runtime.world import (
    GroupKind,
    StoreAddress,
    StreamGroup,
    World,
    WorldError,
    WorldSpec,
    allreduce,
    build_stream_group,
    build_world,
    build_world_async,
    host_store,
)

MIB = 1 << 20
KIB = 1 << 10
JOB = "bench-stream"
LAYERS = 12  # divisible by every pipeline size the reshapes use (2, 3, 4)
HEADS = 12  # divisible by every tensor-parallel size (2, 3, 4)
HIDDEN_STEP = 48  # hidden sizes are multiples of it: 4 x hidden stays divisible by 2, 3 and 4
MAX_MESSAGE_BYTES = 32 * MIB
LOOP_DIM = 256  # the training-like loop: [LOOP_DIM x LOOP_DIM] weights, a batch of LOOP_DIM rows

AIM_CEILING_RATIO = 0.8
AIM_SLOWDOWN = 0.01

RESHAPES = ("tp-to-dp", "pp-to-tp")
FULL_DEFAULTS = {"size_mib": 1024.0, "budget_mib": 64.0, "repeat": 3, "loop_steps": 100, "loop_repeats": 10}
QUICK_DEFAULTS = {"size_mib": 16.0, "budget_mib": 0.25, "repeat": 2, "loop_steps": 20, "loop_repeats": 2}


# -- the synthetic model and reshape -------------------------------------------------------------------


def _spec(hidden: int, vocab: int) -> ModelSpec:
    return ModelSpec(
        name="synthetic",
        num_layers=LAYERS,
        hidden_size=hidden,
        ffn_hidden_size=4 * hidden,
        num_attention_heads=HEADS,
        vocab_size=vocab,
        max_sequence_length=1024,
    )


def state_bytes(model: ModelSpec) -> int:
    """The whole training state: parameters plus fp32 master weights, both Adam moments and the step."""
    return sum(t.nbytes for t in model.tensors(optimizer=True))


def synthetic_model(target_bytes: int) -> ModelSpec:
    """A GPT-like model whose training state is ``target_bytes`` to within one vocabulary row.

    The widest hidden size (a multiple of 48) whose layers fit under the target, then a vocabulary that
    fills the rest: the state is mostly decoder layers, as in a real model, and hits the size exactly.
    """
    smallest = state_bytes(_spec(HIDDEN_STEP, 1))
    if target_bytes < smallest:
        raise ValueError(
            f"--size-mib: {target_bytes / MIB:g} MiB is below the smallest synthetic model "
            f"({smallest / MIB:.2f} MiB)"
        )
    hidden = HIDDEN_STEP
    while state_bytes(_spec(hidden + HIDDEN_STEP, 1)) <= target_bytes:
        hidden += HIDDEN_STEP
    base = state_bytes(_spec(hidden, 1))
    per_row = state_bytes(_spec(hidden, 2)) - base
    return _spec(hidden, 1 + (target_bytes - base) // per_row)


def reshape_layouts(reshape: str, procs: int) -> tuple[ParallelLayout, ParallelLayout]:
    """``tp-to-dp``: TP n -> TP n/2 x DP 2 (n even); ``pp-to-tp``: PP n -> TP n; both on the same n
    processes in rank order."""
    if not 2 <= procs <= 4:
        raise ValueError(f"--procs: between 2 and 4 local processes, got {procs}")
    if reshape == "tp-to-dp":
        if procs % 2:
            raise ValueError(f"--procs: tp-to-dp needs an even number of processes, got {procs}")
        return ParallelLayout(tp=procs, pp=1, dp=1), ParallelLayout(tp=procs // 2, pp=1, dp=2)
    if reshape == "pp-to-tp":
        return ParallelLayout(tp=1, pp=procs, dp=1), ParallelLayout(tp=procs, pp=1, dp=1)
    raise ValueError(f"--reshape: one of {', '.join(RESHAPES)}, got {reshape!r}")


def local_devices(n: int) -> tuple[Device, ...]:
    return tuple(Device("node000", i) for i in range(n))


def message_split(budget_bytes: int) -> tuple[int, int]:
    """``B`` -> (send-copy budget, message bytes): pieces of an eighth of ``B``, two of them in flight.
    The executor keeps both inside its one buffer of at most ``B`` (the plan's budget)."""
    if budget_bytes < 64 * KIB:
        raise ValueError(f"--budget-mib: at least 64 KiB, got {budget_bytes / MIB:g} MiB")
    message = min(MAX_MESSAGE_BYTES, budget_bytes // 8) // 8 * 8
    return 2 * message, message


# -- synthetic content: every element is a function of (tensor, global index) ------------------------

_MIX = 0x9E3779B1  # odd: the map from index to value is a bijection before masking
_VALUE_BITS = {"float32": 24, "bfloat16": 8, "float16": 11, "int64": 62}  # integers the dtype holds exactly


def box_content(ti: int, spec: TensorSpec, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The values of ``spec``'s global ``box``: integers mixed from the global flat index, exact in the
    dtype, so a process can compute any other process's slice without its data."""
    extent = tuple(hi - lo for lo, hi in box)
    index = torch.zeros(extent, dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(box))):
        lo, hi = box[d]
        shape = [1] * len(box)
        shape[d] = hi - lo
        index += (torch.arange(lo, hi, dtype=torch.int64) * stride).view(shape)
        stride *= spec.shape[d]
    mixed = index.mul_(_MIX).add_((ti + 1) * 40503)
    mixed = mixed.bitwise_xor_(mixed >> 17).bitwise_and_((1 << _VALUE_BITS[spec.dtype]) - 1)
    return mixed.to(TORCH_DTYPES[spec.dtype])


def shard_content(plan: Plan, ti: int, shard: Shard) -> torch.Tensor:
    """A rank's whole local tensor: its box of the global tensor, zero padding after (vocabulary)."""
    spec = plan.tensors[ti]
    out = torch.zeros(shard.local_shape, dtype=TORCH_DTYPES[spec.dtype])
    if shard.box is not None:
        out[tuple(slice(0, hi - lo) for lo, hi in shard.box)] = box_content(ti, spec, shard.box)
    return out


def checksum(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().reshape(-1).view(torch.uint8).numpy(), digest_size=16).hexdigest()


def state_digest(sums: dict[int, str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for ti in sorted(sums):
        h.update(f"{ti}:{sums[ti]};".encode())
    return h.hexdigest()


# -- what every process gets and returns ------------------------------------------------------------


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


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    """One segment of the training-like loop in one process."""

    step_seconds: list[float]
    cpu_seconds: float  # the process's CPU time over the segment, every thread (gloo's, the builders')
    digest: str  # of the loop's weights at the end: equal in every segment when nothing disturbs it
    world_built_after: float | None = None  # seconds from the segment's start; None: the loop ran alone
    prepared_after: float | None = None  # the shadow world and the stream group both built


class StreamRuns(msgspec.Struct, kw_only=True):
    """One process's stream repeats in one mode."""

    seconds: list[float] = msgspec.field(default_factory=list)  # from the barrier to stream_plan's return
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
    into: StreamRuns  # streams into preallocated new shards
    alloc: StreamRuns  # streams that allocate their new shards
    tensors_checked: int  # per mode and repeat
    new_state_bytes: int
    new_state_digest: str


def _progress(text: str) -> None:
    print(f"[bench stream] {text}", file=sys.stderr, flush=True)


def _barrier(pg: Any) -> None:
    allreduce(pg, torch.zeros(1), torch.distributed.ReduceOp.SUM)


def _quiet_logs() -> None:
    from liver.shared.logs import configure_logging

    configure_logging(level="WARNING", stream=sys.stderr)


def _worker(rank: int, size: int, setup: Setup) -> ProcessResult:
    """One process: the loop measurements on the active world, then raw and stream repeats."""
    _quiet_logs()
    plan = setup.plan
    devices = devices_in_stream_order(plan)
    device = devices[rank]
    address = StoreAddress("127.0.0.1", setup.store_port)
    timeout = timedelta(seconds=setup.group_timeout_s)
    old_spec = WorldSpec(job=JOB, generation=0, layout=plan.old.layout, placement=plan.old.placement)
    say = _progress if rank == 0 else (lambda _text: None)
    say("process 0: building the active world")
    active = build_world(old_spec, device, address, timeout=timeout)
    say("process 0: training-like loop, alone and beside shadow preparations")
    loop_alone, loop_with = _measure_loop(active, old_spec, plan, device, address, setup)
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


# -- the training-like loop and the shadow world beside it ---------------------------------------------


def _loop_segment(
    pg: Any, size: int, rank: int, steps: int, on_start: Callable[[], None] | None = None
) -> tuple[list[float], float, str, float]:
    """``steps`` iterations of forward/backward matmuls and a gradient all-reduce, after a barrier.

    ``on_start`` runs on the first step, inside the timed region. Returns (each step's seconds, the
    process's CPU seconds, a digest of the weights, the moment the segment started).
    """
    g = torch.Generator().manual_seed(20240 + rank)
    x = torch.randn(LOOP_DIM, LOOP_DIM, generator=g)
    w = torch.randn(LOOP_DIM, LOOP_DIM, generator=torch.Generator().manual_seed(20240)) / LOOP_DIM**0.5
    _barrier(pg)
    cpu0 = time.process_time()
    t0 = last = time.perf_counter()
    if on_start is not None:
        on_start()
    step_seconds = []
    for _ in range(steps):
        h = torch.tanh(x @ w)
        grad = x.T @ h
        allreduce(pg, grad, torch.distributed.ReduceOp.SUM)
        w.sub_(grad, alpha=1e-4 / size)
        now = time.perf_counter()
        step_seconds.append(now - last)
        last = now
    cpu = time.process_time() - cpu0
    return step_seconds, cpu, checksum(w), t0


class _Preparation:
    """The next generation's groups on ``build_world_async``'s thread, then the stream group on a
    thread of its own once they stand, as a worker prepares a handoff while its training continues."""

    def __init__(
        self, old: WorldSpec, new: WorldSpec, device: Device, address: StoreAddress, timeout: timedelta
    ) -> None:
        self.build = build_world_async(new, device, address, timeout=timeout)
        self.world_done: float | None = None
        self.done: float | None = None
        self.stream: StreamGroup | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._stream_group, args=(old, new, device, address, timeout), daemon=True
        )
        self.thread.start()

    def _stream_group(
        self, old: WorldSpec, new: WorldSpec, device: Device, address: StoreAddress, timeout: timedelta
    ) -> None:
        try:
            self.build.wait()
            self.world_done = time.perf_counter()
            self.stream = build_stream_group(old, new, device, address, timeout=timeout)
            self.done = time.perf_counter()
        except BaseException as exc:  # re-raised on the training thread by finish()
            self.error = exc

    def finish(self, timeout_s: float) -> tuple[float, float]:
        """Wait for the preparation and release what it built; when the world and the stream group stood."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"shadow generation {self.build.spec.generation} not built in {timeout_s} s")
        world = self.build.result(timeout=0)  # raises the build's own error
        if self.error is not None or self.stream is None:
            world.release()
            raise WorldError(f"stream group into generation {world.generation} failed: {self.error!r}")
        assert self.world_done is not None and self.done is not None
        self.stream.release()
        world.release()
        return self.world_done, self.done


def _measure_loop(
    active: World, old: WorldSpec, plan: Plan, device: Device, address: StoreAddress, setup: Setup
) -> tuple[list[Segment], list[Segment]]:
    """Alternating loop segments alone and with a shadow preparation beside them (see module doc)."""
    pg = active.group(GroupKind.WORLD)
    size, rank = active.size, active.rank
    timeout = timedelta(seconds=setup.group_timeout_s)
    alone: list[Segment] = []
    beside: list[Segment] = []
    if not setup.loop_steps:
        return alone, beside
    _loop_segment(pg, size, rank, max(1, setup.loop_steps // 4))  # warm the allocator and the kernels
    for k in range(setup.loop_repeats):
        for with_shadow in (False, True) if k % 2 == 0 else (True, False):
            if not with_shadow:
                steps, cpu, digest, _t0 = _loop_segment(pg, size, rank, setup.loop_steps)
                alone.append(Segment(step_seconds=steps, cpu_seconds=cpu, digest=digest))
                continue
            new = WorldSpec(job=JOB, generation=k + 1, layout=plan.new.layout, placement=plan.new.placement)
            prep: list[_Preparation] = []

            def start(new: WorldSpec = new, prep: list[_Preparation] = prep) -> None:
                prep.append(_Preparation(old, new, device, address, timeout))

            steps, cpu, digest, t0 = _loop_segment(pg, size, rank, setup.loop_steps, start)
            world_done, done = prep[0].finish(setup.group_timeout_s)
            beside.append(
                Segment(
                    step_seconds=steps,
                    cpu_seconds=cpu,
                    digest=digest,
                    world_built_after=world_done - t0,
                    prepared_after=done - t0,
                )
            )
    return alone, beside


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
    _barrier(pg)
    t0 = time.perf_counter()
    works = [pg.recv([b], src, tag) for src, b in incoming]
    works += [pg.send([b], dst, tag) for dst, b in outgoing]
    if beside is not None:
        beside()
    for work in works:
        work.wait()
    return time.perf_counter() - t0


def _local_copier(
    schedule: Schedule, old_state: dict[int, torch.Tensor], into: dict[int, torch.Tensor]
) -> Callable[[], None]:
    """The slices that stay in this process, copied from its old shards into its new ones exactly as
    the executor copies them (the same regions, from the executor's own schedule), and nothing else."""
    pairs = [
        (into[c.tensor], _index(c.dst), old_state[c.tensor], _index(c.src))
        for step in schedule.steps()
        for c in step.copies
    ]

    def copy() -> None:
        for dst, dst_index, src, src_index in pairs:
            dst[dst_index].copy_(src[src_index])

    return copy


def _index(region: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in region)


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS, so the resident set before a stream is only what is live."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> int | None:
    """Reset the kernel's resident-set high-water mark; the resident set now (bytes), or None."""
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return None
    now = _status_kib("VmRSS")
    return None if now is None else now * KIB


STREAM_MODES = ("raw", "floor", "into", "alloc")
"""Per repeat, in rotating order: the raw exchange; the raw exchange with this process's local copies
done beside it (the floor: the data movement any executor of this plan must do, with none of its
logic); the stream into preallocated new shards (the new model's storage, in memory already, as the
raw exchange's buffers are); the stream allocating its new shards (first-touch page faults on the
clock)."""

_SENTINEL = -1  # no synthetic value is negative: a preallocated shard the stream missed cannot pass


def _measure_stream(
    pg: Any, rank: int, plan: Plan, setup: Setup, say: Callable[[str], None]
) -> dict[str, Any]:
    devices = devices_in_stream_order(plan)
    old_rank, new_rank = ranks_on_device(plan, devices[rank])
    # This process's shards and local copies, from the executor's own schedule. The timed streams
    # still build their own inside stream_plan: the stream's wall time counts it (the report's "rest").
    schedule = prepare_schedule(
        plan,
        old_rank=old_rank,
        new_rank=new_rank,
        group_ranks=GroupRanks.by_device(plan),
        group_rank=rank,
        group_size=len(devices),
        options=setup.options,
    ).schedule
    say("process 0: making the synthetic old state and the expected checksums")
    old_state = {ti: shard_content(plan, ti, s) for ti, s in schedule.old_shards.items()}
    new_shards = schedule.new_shards
    expected = {ti: checksum(shard_content(plan, ti, s)) for ti, s in new_shards.items()}
    into = {
        ti: torch.empty(s.local_shape, dtype=TORCH_DTYPES[plan.tensors[ti].dtype])
        for ti, s in new_shards.items()
    }
    new_bytes = sum(t.numel() * t.element_size() for t in into.values())
    say("process 0: warm-up exchange (untimed)")
    _raw_once(pg, rank, setup.pair_bytes, tag=999_999)
    local_copies = _local_copier(schedule, old_state, into)
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
            given = None
            if mode == "into":
                for t in into.values():
                    t.fill_(_SENTINEL)
                given = into
            base = _reset_peak_rss()
            _barrier(pg)
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
            )
            seconds = time.perf_counter() - t0
            peak = _status_kib("VmHWM")
            held = new_bytes if mode == "alloc" else 0
            runs: StreamRuns = out[mode]
            runs.seconds.append(seconds)
            runs.stats.append(result.stats)
            runs.rss_extra_bytes.append(None if base is None or peak is None else peak * KIB - base - held)
            got = {ti: checksum(t) for ti, t in result.new_state.items()}
            runs.mismatched.append(
                sorted(
                    plan.tensors[ti].name
                    for ti in expected.keys() | got.keys()
                    if got.get(ti) != expected.get(ti)
                )
            )
            del result, got
    return {
        "old_rank": old_rank,
        "new_rank": new_rank,
        **out,
        "tensors_checked": len(expected),
        "new_state_bytes": new_bytes,
        "new_state_digest": state_digest(expected),
    }


# -- the parent: set up, run, aggregate, judge, print ---------------------------------------------------


class LayerRow(msgspec.Struct, frozen=True, kw_only=True):
    """One layer over all processes, in the fastest repeat of each stream mode."""

    layer: int
    rounds: int  # the most any process took
    seconds: float  # into preallocated shards: the slowest process
    wait_seconds: float  # of which that process was blocked on the network
    seconds_allocating: float  # allocating its new shards: the slowest process
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
    alloc_seconds: list[float]  # the stream allocating its new shards
    alloc_executor_seconds: list[float]
    raw_ceiling_bytes_per_s: float  # bytes_moved / the fastest raw repeat
    floor_bytes_per_s: float  # bytes_moved / the fastest floor repeat: the most any executor reaches here
    floor_ratio: float  # floor / raw ceiling
    throughput_bytes_per_s: float  # bytes_moved / the fastest stream into preallocated shards
    ratio: float  # throughput / raw ceiling
    median_ratio: float  # the same over the medians
    ratio_to_floor: float  # throughput / floor (best / best): the executor's own efficiency
    alloc_throughput_bytes_per_s: float  # bytes_moved / the fastest stream allocating its shards
    alloc_ratio: float
    alloc_median_ratio: float
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


class Check(msgspec.Struct, frozen=True, kw_only=True):
    level: str  # "must" or "aim"
    what: str
    passed: bool
    detail: str


class Config(msgspec.Struct, frozen=True, kw_only=True):
    quick: bool
    procs: int
    reshape: str
    old_layout: str
    new_layout: str
    model: ModelSpec
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


class BenchReport(msgspec.Struct, frozen=True, kw_only=True):
    date: str
    machine: str
    load_average: list[float]  # 1-minute load average before and after the run: other work on the machine
    python: str
    torch: str
    config: Config
    stream: StreamReport
    memory: list[MemoryRow]
    layers: list[LayerRow]
    loop: LoopReport | None
    checks: list[Check]
    ok: bool  # every must check passed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``liver bench stream``; unset sizes take the full or the ``--quick`` defaults."""
    full, quick = FULL_DEFAULTS, QUICK_DEFAULTS
    parser.add_argument(
        "--size-mib",
        type=float,
        help=f"training state in total (default {full['size_mib']:g}, quick {quick['size_mib']:g})",
    )
    parser.add_argument("--procs", type=int, default=2, help="local processes, 2-4 (default 2)")
    parser.add_argument(
        "--reshape",
        choices=RESHAPES,
        default="tp-to-dp",
        help="tp-to-dp: TP n -> TP n/2 x DP 2; pp-to-tp: PP n -> TP n (default tp-to-dp)",
    )
    parser.add_argument(
        "--budget-mib",
        type=float,
        help=f"B, the executor's memory budget beyond the layer under assembly "
        f"(default {full['budget_mib']:g}, quick {quick['budget_mib']:g})",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        help=f"raw and stream repeats (default {full['repeat']}, quick {quick['repeat']})",
    )
    parser.add_argument(
        "--loop-steps",
        type=int,
        help=f"steps per training-loop segment, 0 to skip the loop "
        f"(default {full['loop_steps']}, quick {quick['loop_steps']})",
    )
    parser.add_argument(
        "--loop-repeats",
        type=int,
        help=f"pairs of loop segments, alone and with a shadow world "
        f"(default {full['loop_repeats']}, quick {quick['loop_repeats']})",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds before a process counts as hung (default 900)"
    )
    parser.add_argument("--quick", action="store_true", help="CI-sized: a small state, few repeats")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    v = {k: getattr(args, k) if getattr(args, k) is not None else d for k, d in defaults.items()}
    if not v["size_mib"] > 0:
        raise ValueError(f"--size-mib: must be positive, got {v['size_mib']:g}")
    if not v["budget_mib"] > 0:
        raise ValueError(f"--budget-mib: must be positive, got {v['budget_mib']:g}")
    if v["repeat"] < 1:
        raise ValueError(f"--repeat: at least 1, got {v['repeat']}")
    if v["loop_steps"] < 0:
        raise ValueError(f"--loop-steps: must not be negative, got {v['loop_steps']}")
    if v["loop_repeats"] < 1:
        raise ValueError(f"--loop-repeats: at least 1, got {v['loop_repeats']}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout: must be positive, got {args.timeout:g}")
    return v


def pair_bytes(plan: Plan) -> tuple[tuple[int, int, int], ...]:
    """Bytes the plan sends from each process to each other one (group ranks of the stream group)."""
    ranks = GroupRanks.by_device(plan)
    out: dict[tuple[int, int], int] = defaultdict(int)
    for task in plan.tasks:
        if not task.local:
            out[(ranks.old[task.src], ranks.new[task.dst])] += task.nbytes
    return tuple((s, d, n) for (s, d), n in sorted(out.items()))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every must check held (bit-exact shards, extra memory within its bound,
    the loop's results unchanged), 1 when one failed or a worker process failed."""
    v = _resolve(args)
    old_layout, new_layout = reshape_layouts(args.reshape, args.procs)
    budget = int(v["budget_mib"] * MIB)
    copies, message = message_split(budget)
    requested = int(v["size_mib"] * MIB)
    model = synthetic_model(requested)
    devices = local_devices(args.procs)
    plan = build_plan(
        model,
        WorldConfig(old_layout, Placement(devices)),
        WorldConfig(new_layout, Placement(devices)),
        budget_bytes=budget,
    )
    pstats = plan_stats(plan)
    group_timeout = min(args.timeout, 300.0)
    options = StreamOptions(timeout_s=group_timeout, message_bytes=message, send_copy_bytes=copies)
    config = Config(
        quick=args.quick,
        procs=args.procs,
        reshape=args.reshape,
        old_layout=old_layout.describe(),
        new_layout=new_layout.describe(),
        model=model,
        state_bytes=state_bytes(model),
        requested_bytes=requested,
        budget_bytes=budget,
        send_copy_budget_bytes=copies,
        message_bytes=message,
        repeat=v["repeat"],
        loop_steps=v["loop_steps"],
        loop_repeats=v["loop_repeats"],
        rounds=pstats.rounds,
        backend="gloo",
    )
    _progress(
        f"{config.state_bytes / MIB:,.1f} MiB of state, {config.old_layout} -> {config.new_layout} on "
        f"{args.procs} processes, {pstats.bytes_moved / MIB:,.1f} MiB to move, B = {budget / MIB:g} MiB"
    )
    load_before = _load()
    store = host_store()
    setup = Setup(
        plan=plan,
        store_port=store.port,
        options=options,
        pair_bytes=pair_bytes(plan),
        repeat=v["repeat"],
        loop_steps=v["loop_steps"],
        loop_repeats=v["loop_repeats"],
        group_timeout_s=group_timeout,
    )
    try:
        results: list[ProcessResult] = run_procs(
            _worker, args.procs, (setup,), timeout_s=args.timeout, preload=[__name__]
        )
    except ProcsError as exc:
        print(f"liver bench stream: a worker process failed\n{exc}", file=sys.stderr)
        return 1
    finally:
        del store
    report = _report(config, plan, pstats.bytes_moved, pstats.bytes_local, results, [load_before, _load()])
    if args.json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        _print_report(report)
    return 0 if report.ok else 1


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _report(
    config: Config,
    plan: Plan,
    bytes_moved: int,
    bytes_local: int,
    results: list[ProcessResult],
    load: list[float],
) -> BenchReport:
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
        raw_ceiling_bytes_per_s=bytes_moved / min(raw),
        floor_bytes_per_s=bytes_moved / min(floor),
        floor_ratio=min(raw) / min(floor),
        throughput_bytes_per_s=bytes_moved / min(into),
        ratio=min(raw) / min(into),
        median_ratio=statistics.median(raw) / statistics.median(into),
        ratio_to_floor=min(floor) / min(into),
        alloc_throughput_bytes_per_s=bytes_moved / min(alloc),
        alloc_ratio=min(raw) / min(alloc),
        alloc_median_ratio=statistics.median(raw) / statistics.median(alloc),
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
    return BenchReport(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
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
        ok=all(c.passed for c in checks if c.level == "must"),
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


def _loop_report(config: Config, results: list[ProcessResult]) -> LoopReport:
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


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _rate(bps: float) -> str:
    return f"{bps / 1e9:,.2f} GB/s"


def _checks(stream: StreamReport, memory: list[MemoryRow], loop: LoopReport | None) -> list[Check]:
    worst = max(memory, key=lambda m: m.peak_extra_bytes / m.bound_bytes)
    ceiling = _rate(stream.raw_ceiling_bytes_per_s)
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
            detail=f"worst: process {worst.process} peak {_size(worst.peak_extra_bytes)} of "
            f"{_size(worst.bound_bytes)} (B {_size(worst.budget_bytes)} + layer "
            f"{_size(worst.largest_new_layer_bytes)})",
        ),
        Check(
            level="aim",
            what=f"stream into preallocated shards >= {AIM_CEILING_RATIO:.0%} of the raw ceiling",
            passed=stream.ratio >= AIM_CEILING_RATIO,
            detail=f"{_rate(stream.throughput_bytes_per_s)} vs {ceiling} "
            f"({stream.ratio:.1%} best/best, {stream.median_ratio:.1%} median/median; the raw exchange "
            f"with the local copies beside it reaches {stream.floor_ratio:.1%}, the stream "
            f"{stream.ratio_to_floor:.1%} of that)",
        ),
        Check(
            level="aim",
            what=f"stream allocating its shards >= {AIM_CEILING_RATIO:.0%} of the raw ceiling",
            passed=stream.alloc_ratio >= AIM_CEILING_RATIO,
            detail=f"{_rate(stream.alloc_throughput_bytes_per_s)} vs {ceiling} "
            f"({stream.alloc_ratio:.1%} best/best, {stream.alloc_median_ratio:.1%} median/median)",
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


def _print_report(r: BenchReport) -> None:
    c, s = r.config, r.stream
    out = []
    out.append(f"liver bench stream{' (quick)' if c.quick else ''}: {r.date}, {r.machine}")
    out.append(f"load average (1 min) before / after: {r.load_average[0]:.2f} / {r.load_average[1]:.2f}")
    out.append(
        f"state {_size(c.state_bytes)} (hidden {c.model.hidden_size}, {c.model.num_layers} layers, vocab "
        f"{c.model.vocab_size}, bf16 + fp32 master + Adam), {c.old_layout} -> {c.new_layout} on "
        f"{c.procs} processes ({c.backend})"
    )
    out.append(
        f"B {_size(c.budget_bytes)}: one buffer for staged pieces and send copies (at most "
        f"{_size(c.send_copy_budget_bytes)} of copies, messages {_size(c.message_bytes)}); "
        f"{c.rounds} streaming rounds"
    )
    out.append("")
    out.append(f"moved over the network   {_size(s.bytes_moved)}   (copied locally {_size(s.bytes_local)})")

    def runs(seconds: list[float]) -> str:
        return ", ".join(f"{x:.3f}" for x in seconds)

    out.append(
        f"raw send/recv ceiling    {_rate(s.raw_ceiling_bytes_per_s):>10}   runs {runs(s.raw_seconds)} s"
    )
    out.append(
        f"raw + local copies       {_rate(s.floor_bytes_per_s):>10}   runs {runs(s.floor_seconds)} s "
        f"({s.floor_ratio:.1%} of the ceiling: the floor of any executor here)"
    )
    out.append(
        f"stream, preallocated     {_rate(s.throughput_bytes_per_s):>10}   runs {runs(s.into_seconds)} s "
        f"({s.ratio:.1%} of the ceiling best/best, {s.median_ratio:.1%} median/median, "
        f"{s.ratio_to_floor:.1%} of the floor)"
    )
    out.append(
        f"stream, allocating       {_rate(s.alloc_throughput_bytes_per_s):>10}   "
        f"runs {runs(s.alloc_seconds)} s "
        f"({s.alloc_ratio:.1%} best/best, {s.alloc_median_ratio:.1%} median/median)"
    )
    out.append(
        f"  of which the executor  preallocated {runs(s.into_executor_seconds)} s, "
        f"allocating {runs(s.alloc_executor_seconds)} s (the rest: its schedule and input checks)"
    )
    out.append(
        f"bit-exact                {'yes' if s.bit_exact else 'NO'} "
        f"({s.tensors_checked} shards per repeat and mode)"
    )
    out.append("")
    out.append(
        "extra memory per process: peak (buffer + layer under assembly) <= B + largest new layer shard"
    )
    out.append(
        f"{'process':>7}  {'old':>3}  {'new':>3}  {'buffer':>10}  ({'staged':>9} {'copies':>9})  "
        f"{'largest layer':>13}  {'peak extra':>10}  {'B + layer':>9}  {'RSS extra':>10}"
    )
    for m in r.memory:
        rss = _size(m.rss_extra_bytes) if m.rss_extra_bytes is not None else "n/a"
        out.append(
            f"{m.process:>7}  {_rank(m.old_rank):>3}  {_rank(m.new_rank):>3}  {_size(m.buffer_bytes):>10}  "
            f"({_size(m.staging_bytes):>9} {_size(m.peak_send_copy_bytes):>9})  "
            f"{_size(m.largest_new_layer_bytes):>13}  {_size(m.peak_extra_bytes):>10}  "
            f"{_size(m.bound_bytes):>9}  {rss:>10}"
        )
    out.append("")
    out.append("                      preallocated        allocating")
    out.append("layer  rounds   seconds  waiting   seconds  waiting       moved       local  throughput")
    for row in r.layers:
        rate = _rate(row.bytes_moved / row.seconds) if row.seconds > 0 and row.bytes_moved else "-"
        out.append(
            f"{row.layer:>5}  {row.rounds:>6}  {row.seconds:>8.4f}  {row.wait_seconds:>7.4f}  "
            f"{row.seconds_allocating:>8.4f}  {row.wait_seconds_allocating:>7.4f}  "
            f"{_size(row.bytes_moved):>10}  {_size(row.bytes_local):>10}  {rate:>10}"
        )
    if r.loop is not None:
        lp = r.loop
        out.append("")
        after = "n/a" if lp.after_ratio is None else f"{lp.after_ratio:.4f}"
        out.append(
            f"loop cost of one preparation {lp.extra_seconds * 1000:+.1f} ms (median), CPU time it takes "
            f"{lp.prepare_cpu_seconds * 1000:+.1f} ms per process; steps during it "
            f"{lp.during_ratio:.4f}x, after it (shadow world idle) {after}x"
        )
        out.append(
            f"training-like loop: {lp.steps} steps x {lp.repeats} pairs, "
            f"{lp.step_seconds_alone * 1000:.2f} ms/step alone; "
            f"with/alone {', '.join(f'{x:.4f}' for x in lp.ratios)} (median {lp.median_ratio:.4f}, "
            f"quartiles {lp.ratio_quartiles[0]:.4f}-{lp.ratio_quartiles[1]:.4f})"
        )
        out.append(
            f"shadow preparation (world, then stream group) done after "
            f"{', '.join(f'{x * 1000:.0f}' for x in lp.prepare_seconds)} ms; "
            f"{'all' if lp.prepared_within_loop else 'NOT all'} within their loop segment"
        )
    out.append("")
    for ch in r.checks:
        out.append(f"{ch.level.upper():<4} {'PASS' if ch.passed else 'FAIL'}  {ch.what}  ({ch.detail})")
    print("\n".join(out))


def _rank(r: int | None) -> str:
    return "-" if r is None else str(r)
