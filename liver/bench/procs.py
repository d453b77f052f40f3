"""Local worker processes for multi-process benchmarks: start N, collect each one's result, never hang.

Children come from a fork server that has already imported torch, so a run costs a fork per process
instead of an interpreter start and a torch import, and no child inherits the caller's threads. Each
child's standard output is pointed at its standard error before it runs anything: a benchmark's
``--json`` output is the parent's alone, whatever a child (or a library in it) prints. A child that
does not report before the deadline is killed, so a deadlock ends the benchmark with an error naming
the process instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal, NamedTuple

from liver.shared.errors import LiverError

PRELOAD = ["torch", "torch.distributed", "liver.worker_runtime.stream.executor", "liver.worker_runtime.world"]


class ProcsError(LiverError, RuntimeError):
    """A worker process raised, died or hung; the message names every such process."""


class Outcome(NamedTuple):
    rank: int
    status: Literal["ok", "raised", "died", "hung", "stopped"]
    value: Any
    traceback: str


def _child(
    fn: Callable[..., Any],
    rank: int,
    size: int,
    args: tuple[Any, ...],
    conn: mpc.Connection,
    threads: int,
) -> None:
    os.dup2(2, 1)
    import torch

    torch.set_num_threads(threads)
    try:
        conn.send(("ok", fn(rank, size, *args), ""))
    except BaseException:
        conn.send(("raised", None, traceback.format_exc()))
    conn.close()
    # Skip interpreter teardown: a process group with abandoned operations can block in its destructor.
    os._exit(0)


def run_procs(
    fn: Callable[..., Any],
    size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float,
    threads: int = 1,
    preload: Sequence[str] = (),
    may_die: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(rank, size, *args)`` in ``size`` processes; their return values in rank order.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). ``preload`` names modules
    the fork server imports once, besides torch and the worker runtime (the fn's module, typically); the
    fork server is shared by the whole process, so only its first user's list takes effect. Raises
    :class:`ProcsError` when any process raises, dies or has not reported after ``timeout_s`` seconds
    (the rest are then killed too); a rank in ``may_die`` may die (a fault the caller injects): its
    value is then None.
    """
    if size < 1:
        raise ValueError(f"`size`: at least one process, got {size}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *preload])
    procs, conns = [], []
    for rank in range(size):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn, rank, size, tuple(args), send_end, threads), daemon=True)
        p.start()
        send_end.close()
        procs.append(p)
        conns.append(recv_end)
    outcomes: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waiting = {r: c for r, c in enumerate(conns) if r not in outcomes}
            ready = mpc.wait(list(waiting.values()), timeout=left)
            for r, c in waiting.items():
                if c not in ready:
                    continue
                try:
                    status, value, tb = c.recv()
                except EOFError:
                    procs[r].join(5)
                    status = "ok" if r in may_die else "died"
                    outcomes[r] = Outcome(r, status, None, f"exit code {procs[r].exitcode}")
                    continue
                outcomes[r] = Outcome(r, status, value, tb)
            if any(o.status != "ok" for o in outcomes.values()):
                break  # the others would wait on the failed one until their own timeouts
    finally:
        failed_first = any(o.status != "ok" for o in outcomes.values())
        for r, p in enumerate(procs):
            if r not in outcomes:
                outcomes[r] = (
                    Outcome(r, "stopped", None, "killed after another process failed")
                    if failed_first
                    else Outcome(r, "hung", None, f"no report within {timeout_s:g} s")
                )
            p.join(1 if outcomes[r].status == "ok" else 0)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in conns:
            c.close()
    failed = [outcomes[r] for r in range(size) if outcomes[r].status not in ("ok", "stopped")]
    if failed:
        lines = [f"process {o.rank} {o.status}: {o.traceback.strip()}" for o in failed]
        raise ProcsError("\n".join(lines))
    return [outcomes[r].value for r in range(size)]
