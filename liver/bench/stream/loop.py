"""The training-like loop, measured alone and with the next generation's worlds built beside it.

This is what the shadow-world overhead means: a worker prepares a handoff on background threads while
its training goes on, and the loop's step times (and its results, which must not change) say what that
preparation costs the training. Segments alone and beside a preparation alternate, so drift on a
shared machine favours neither.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
import torch

from liver.bench.stream.workload import JOB, checksum
from liver.reshard.plan import Plan
from liver.shared.layout import Device
from liver.worker_runtime.world import (
    GroupKind,
    StoreAddress,
    StreamGroup,
    World,
    WorldError,
    WorldSpec,
    allreduce,
    build_stream_group,
    build_world_async,
)

LOOP_DIM = 256  # the training-like loop: [LOOP_DIM x LOOP_DIM] weights, a batch of LOOP_DIM rows


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    """One segment of the training-like loop in one process."""

    step_seconds: list[float]
    cpu_seconds: float  # the process's CPU time over the segment, every thread (gloo's, the builders')
    digest: str  # of the loop's weights at the end: equal in every segment when nothing disturbs it
    world_built_after: float | None = None  # seconds from the segment's start; None: the loop ran alone
    prepared_after: float | None = None  # the shadow world and the stream group both built


def barrier(pg: Any) -> None:
    """Every process of ``pg`` here before any goes on: the start line of a timed region."""
    allreduce(pg, torch.zeros(1), torch.distributed.ReduceOp.SUM)


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
    barrier(pg)
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


def measure_loop(
    active: World,
    old: WorldSpec,
    plan: Plan,
    device: Device,
    address: StoreAddress,
    *,
    loop_steps: int,
    loop_repeats: int,
    timeout_s: float,
) -> tuple[list[Segment], list[Segment]]:
    """``loop_repeats`` pairs of ``loop_steps``-step segments, alone and with a shadow preparation into
    ``plan``'s new layout beside them (alternating which comes first); none when ``loop_steps`` is 0."""
    pg = active.group(GroupKind.WORLD)
    size, rank = active.size, active.rank
    timeout = timedelta(seconds=timeout_s)
    alone: list[Segment] = []
    beside: list[Segment] = []
    if not loop_steps:
        return alone, beside
    _loop_segment(pg, size, rank, max(1, loop_steps // 4))  # warm the allocator and the kernels
    for k in range(loop_repeats):
        for with_shadow in (False, True) if k % 2 == 0 else (True, False):
            if not with_shadow:
                steps, cpu, digest, _t0 = _loop_segment(pg, size, rank, loop_steps)
                alone.append(Segment(step_seconds=steps, cpu_seconds=cpu, digest=digest))
                continue
            new = WorldSpec(job=JOB, generation=k + 1, layout=plan.new.layout, placement=plan.new.placement)
            prep: list[_Preparation] = []

            def start(new: WorldSpec = new, prep: list[_Preparation] = prep) -> None:
                prep.append(_Preparation(old, new, device, address, timeout))

            steps, cpu, digest, t0 = _loop_segment(pg, size, rank, loop_steps, start)
            world_done, done = prep[0].finish(timeout_s)
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
