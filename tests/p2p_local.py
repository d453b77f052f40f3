"""An in-process stand-in for the point-to-point group the stream executor needs (``P2PGroup``).

The executor asks four things of a group: its rank and size, and tagged ``send``/``recv`` that return a
``Work`` to ``wait`` on. :func:`run_ranks` runs one function per rank on threads of this process over
:class:`LocalGroup`\\ s that share a mailbox: what a rank sends is copied when it is sent (as gloo
reads the tensor before ``send`` returns its work, so the sender may reuse its buffer once that work
completes) and delivered, per (source, destination, tag), in the order it was sent (as gloo matches
them). It tests the executor's scheduling and bit-exactness without processes; what only real
processes show (a peer that dies or hangs, sockets, memory of a process) stays with the gloo tests.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

_Key = tuple[int, int, int]  # (source, destination, tag)


class _Done:
    def wait(self, timeout: timedelta = timedelta(seconds=0)) -> bool:
        return True


class _Receive:
    def __init__(self, mailbox: _Mailbox, key: _Key, into: torch.Tensor) -> None:
        self._mailbox, self._key, self._into = mailbox, key, into

    def wait(self, timeout: timedelta = timedelta(seconds=300)) -> bool:
        message = self._mailbox.take(self._key, timeout.total_seconds())
        if message is None:
            return False
        if message.shape != self._into.shape or message.dtype != self._into.dtype:
            raise RuntimeError(
                f"message {self._key} is {message.dtype}{list(message.shape)}, the receive wants "
                f"{self._into.dtype}{list(self._into.shape)}"
            )
        self._into.copy_(message)
        return True


class _Mailbox:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: dict[_Key, deque[torch.Tensor]] = defaultdict(deque)

    def put(self, key: _Key, message: torch.Tensor) -> None:
        with self._cond:
            self._queues[key].append(message)
            self._cond.notify_all()

    def take(self, key: _Key, timeout_s: float) -> torch.Tensor | None:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._queues[key]), timeout_s):
                return None
            return self._queues[key].popleft()


class LocalGroup:
    """Rank ``rank`` of ``size`` over a mailbox the group's ranks share (a ``P2PGroup``)."""

    def __init__(self, mailbox: _Mailbox, rank: int, size: int) -> None:
        self._mailbox, self._rank, self._size = mailbox, rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> _Done:
        (tensor,) = tensors
        self._mailbox.put((self._rank, dstRank, tag), tensor.detach().clone())
        return _Done()

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> _Receive:
        (tensor,) = tensors
        return _Receive(self._mailbox, (srcRank, self._rank, tag), tensor)


def run_ranks(fn: Callable[[int, LocalGroup], Any], size: int, timeout_s: float = 120.0) -> list[Any]:
    """``fn(rank, group)`` for every rank on a thread of its own; the results in rank order. The first
    rank that raises is re-raised here; a rank still running after ``timeout_s`` is an error."""
    mailbox = _Mailbox()
    results: list[Any] = [None] * size
    errors: list[tuple[int, BaseException]] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, LocalGroup(mailbox, rank, size))
        except BaseException as error:  # reported below, by rank
            errors.append((rank, error))

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}", daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    hung = [r for r, thread in enumerate(threads) if thread.is_alive()]
    if errors:
        rank, error = min(errors, key=lambda e: e[0])
        raise AssertionError(f"rank {rank} raised: {error!r}") from error
    if hung:
        raise AssertionError(f"ranks {hung} still running after {timeout_s} s")
    return results
