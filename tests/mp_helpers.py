"""Small gloo worlds on loopback for multi-process tests.

:func:`run_world` starts ``size`` processes, gives each a ``ProcessGroupGloo`` over a store the parent
hosts (so there is no port to race for), runs ``fn(world, *args)`` in each and collects what every
process returned or raised. Hard deadlines everywhere: a hung child is killed and reported as hung, so a
deadlock fails the test instead of hanging CI.

Children come from a fork server that has already imported torch and LiveR: each world then costs a
fork, not an interpreter start and a torch import (seconds on a busy 2-core machine), and no child
inherits the test runner's threads. ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import socket
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

PRELOAD = [
    "torch",
    "torch.distributed",
    "liver.worker_runtime.stream.executor",
    "liver.reshard.planner",
    # Megatron-core takes 7-25 s to import here; pay it once in the fork server, not per child.
    "megatron.core",
    "liver.worker_runtime.megatron.train",
    "liver.worker_runtime.megatron.job",
]

STORE_TIMEOUT_S = 120.0
"""How long a child's store operations (and its rendezvous) may wait: generous, since every rank of a
world on a busy two-core machine may be off the CPU for a while."""

_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(PRELOAD)


def start_fork_server() -> None:
    """Start the process's fork server now, with :data:`PRELOAD`.

    There is one fork server per process, and the first user's preload list is the one it keeps: a
    benchmark's ``run_procs`` (which preloads only torch) started first would leave every later world's
    children to import Megatron-core themselves, seconds of CPU per child, which made the multi-process
    tests two to four times slower in the full suite than alone."""
    import multiprocessing.forkserver

    _ctx.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (prefer :func:`run_world`, which needs none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class World:
    """What a child gets: its rank, the world size and a gloo group over loopback."""

    rank: int
    size: int
    group: dist.ProcessGroupGloo
    store: dist.Store


@dataclass(frozen=True)
class Outcome:
    rank: int
    status: Literal["ok", "raised", "died", "hung"]
    value: Any = None  # what fn returned ("ok")
    error: BaseException | None = None  # what fn raised ("raised"), when it could be pickled
    traceback: str = ""
    exitcode: int | None = None
    seconds: float = 0.0  # from start until the child reported (or was given up on)

    def unwrap(self) -> Any:
        if self.status != "ok":
            raise AssertionError(
                f"rank {self.rank} {self.status} (exit code {self.exitcode}):\n{self.traceback}"
            )
        return self.value


def _child(
    fn: Callable[..., Any],
    rank: int,
    size: int,
    port: int,
    prefix: str,
    args: tuple[Any, ...],
    conn: mpc.Connection,
    group_timeout_s: float,
) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)
        )
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=group_timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)
        value = fn(World(rank, size, group, store), *args)
        conn.send(("ok", value, ""))
    except BaseException as exc:
        tb = traceback.format_exc()
        try:
            conn.send(("raised", exc, tb))
        except Exception:
            conn.send(("raised", None, tb))
    conn.close()
    # Skip interpreter teardown: a group with abandoned operations can block in its destructor.
    os._exit(0)


def run_world(
    fn: Callable[..., Any],
    size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
    wait_for: Collection[int] | None = None,
    group_timeout_s: float = 120.0,
) -> list[Outcome]:
    """Run ``fn(world, *args)`` in ``size`` processes; one :class:`Outcome` per rank, in rank order.

    Returns when every rank in ``wait_for`` (default: all) has reported or exited, or when ``timeout_s``
    has passed since the children started; the children still running then are killed and reported as
    ``"hung"``. Starting them is not counted: the first world of a session waits for the fork server to
    import torch and Megatron, which takes seconds (more on a busy machine).
    """
    wait_for = set(range(size) if wait_for is None else wait_for)
    store = dist.TCPStore("127.0.0.1", 0, size + 1, is_master=True, wait_for_workers=False)
    prefix = f"world-{os.getpid()}-{time.monotonic_ns()}/"
    procs, conns = [], []
    t0 = time.monotonic()
    for rank in range(size):
        recv_end, send_end = _ctx.Pipe(duplex=False)
        p = _ctx.Process(
            target=_child,
            args=(fn, rank, size, store.port, prefix, tuple(args), send_end, group_timeout_s),
            daemon=True,
        )
        p.start()
        send_end.close()
        procs.append(p)
        conns.append(recv_end)
    outcomes: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout_s
    while not wait_for <= outcomes.keys():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        waiting = {r: c for r, c in enumerate(conns) if r not in outcomes}
        ready = mpc.wait(list(waiting.values()), timeout=left)
        for r, c in waiting.items():
            if c not in ready:
                continue
            try:
                status, payload, tb = c.recv()
            except EOFError:
                procs[r].join(5)
                outcomes[r] = Outcome(r, "died", exitcode=procs[r].exitcode, seconds=time.monotonic() - t0)
                continue
            if status == "ok":
                outcomes[r] = Outcome(r, "ok", value=payload, seconds=time.monotonic() - t0)
            else:
                outcomes[r] = Outcome(r, "raised", error=payload, traceback=tb, seconds=time.monotonic() - t0)
    for r, p in enumerate(procs):
        if r not in outcomes:
            p.kill()
            p.join(5)
            outcomes[r] = Outcome(r, "hung", exitcode=p.exitcode, seconds=time.monotonic() - t0)
        else:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    for c in conns:
        c.close()
    del store
    return [outcomes[r] for r in range(size)]


def _fresh_child(fn: Callable[[], Any], results: Any) -> None:
    try:
        results.put((fn(), None))
    except BaseException:
        results.put((None, traceback.format_exc()))


def in_fresh_interpreter(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` (module-level, picklable) in a spawned interpreter that has no ``torch.distributed``
    world of its own, as the geometry probes need: what it returned; the calling test fails with the
    child's traceback, or when it answers nothing within ``timeout_s``."""
    import queue

    import pytest

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_fresh_child, args=(fn, results), daemon=True)
    child.start()
    try:
        out, error = results.get(timeout=timeout_s)
    except queue.Empty:
        pytest.fail(f"the child found nothing in {timeout_s} s (exit code {child.exitcode})", pytrace=False)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if error:
        pytest.fail(error, pytrace=False)
    return out
