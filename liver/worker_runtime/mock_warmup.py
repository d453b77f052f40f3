"""Mock warm-up: a new rank pays its cold start under a fake world before it joins real groups.

A scale-out rank must build its model, allocate its buffers and compile its kernels before it can train.
If it did that inside the real shadow world, every collective of construction (Megatron all-reduces
during initialisation, the first forward's TP collectives) would make the warm ranks wait on the cold one.
Under torch's ``fake`` backend every collective completes locally at once (results are garbage, which is
fine: the model is thrown away), so all of that cost is paid alone. Afterwards the fake world is torn
down completely and the rank joins the shadow world with warm allocator, caches and compiled kernels.

Teardown touches only what the warm-up created: c10d groups registered during it (the fake default world
and every ``new_group`` made on it, e.g. by ``parallel_state``), and c10d's group-name counter, which is
put back so that later ``new_group`` names agree with the other processes' (see ``World.adopt_as_default``).
Groups that exist already (a shadow world being built) are left alone.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import msgspec
import structlog
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from liver.shared.errors import HandoffError
from liver.worker_runtime.world import is_world_group

log = structlog.get_logger(__name__)

M = TypeVar("M")


class MockWarmupError(HandoffError):
    """The warm-up cannot run here, or its step failed."""


class WarmupReport(msgspec.Struct, frozen=True):
    """What one warm-up cost, so the companion can report when the rank became warm."""

    rank: int
    world_size: int
    build_seconds: float
    step_seconds: tuple[float, ...]
    fake_groups: int  # c10d groups the warm-up created and tore down (the fake world included)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Make a fake default world in which this process is ``rank`` of ``world_size``.

    Refused when a default world exists: replacing it would cut a training rank off its real world.
    """
    if world_size < 1:
        raise ValueError(f"`world_size`: must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"`rank`: {rank} is outside a world of {world_size}")
    if dist.is_initialized():
        raise MockWarmupError(
            "a default process group exists; mock warm-up is for processes that have not joined a world"
        )
    before = set(c10d._world.pg_names)
    count = c10d._world.group_count
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        _tear_down(before, count)


def _tear_down(before: set[dist.ProcessGroup], group_count: int) -> int:
    """Destroy the groups made since ``before`` one by one (never c10d's destroy-everything path), except
    those of a World that a background thread built meanwhile."""
    created = [pg for pg in list(c10d._world.pg_names) if pg not in before and not is_world_group(pg)]
    c10d._update_default_pg(None)
    for pg in created:
        if pg in c10d._world.pg_map:
            dist.destroy_process_group(pg)
    c10d._world.group_count = group_count
    return len(created)


def mock_warmup(
    build: Callable[[], M],
    step: Callable[[M], object],
    *,
    rank: int,
    world_size: int,
    steps: int = 1,
    teardown: Callable[[M], None] | None = None,
) -> WarmupReport:
    """Build a model with ``build()`` and run ``step(model)`` ``steps`` times under a fake world.

    ``rank`` and ``world_size`` are this process's place in the world it will join, so the model built
    here has the shapes (shards, pipeline stage) it will train with. ``teardown(model)`` undoes module
    state the build set up (``parallel_state.destroy_model_parallel()`` for Megatron); the model itself
    is dropped. Nothing of the warm-up survives except what warms the process: allocator pools, loaded
    libraries, compiled kernels.
    """
    if steps < 1:
        raise ValueError(f"`steps`: must be at least 1, got {steps}")
    bound = log.bind(rank=rank, world_size=world_size)
    before = set(c10d._world.pg_names)
    with fake_world(rank, world_size):
        started = time.perf_counter()
        model = build()
        build_seconds = time.perf_counter() - started
        step_seconds = []
        try:
            for _ in range(steps):
                started = time.perf_counter()
                step(model)
                step_seconds.append(time.perf_counter() - started)
        except Exception as error:
            raise MockWarmupError(f"warm-up step {len(step_seconds)} failed: {error!r}") from error
        finally:
            if teardown is not None:
                teardown(model)
            del model
        created = sum(1 for pg in list(c10d._world.pg_names) if pg not in before and not is_world_group(pg))
    gc.collect()
    report = WarmupReport(rank, world_size, build_seconds, tuple(step_seconds), created)
    bound.info(
        "mock_warmup.done",
        build_seconds=round(build_seconds, 4),
        step_seconds=[round(s, 4) for s in step_seconds],
        fake_groups=created,
    )
    return report
