"""A peer of the active world lost outside a handoff: which failures say so, and what a step that met
one leaves behind.

A process that dies (fail-stop: a reclaimed node, a failed GPU) takes its side of every connection
with it. Its peers notice in their next collective that talks to it: gloo fails at once with a reset
or closed connection; NCCL's watchdog aborts the communicator after its timeout. Peers that wait on a
*surviving* process instead (one that already failed its step elsewhere) notice when that survivor
destroys the world's groups (a gloo group closes its connections only then, see
:meth:`~.world.World.release`), so the failure spreads over the world in moments; the groups' own
timeout bounds the rest. No survivor hangs.

A failed collective says nothing about the state: the optimizer step is the commit point of an
iteration, and a step abandoned before it leaves every parameter and optimizer state as the last
completed iteration left it. :class:`StepAbandoned` says which iteration that is, and whether the state
is whole (``torn``: an update that began and could not finish, as the distributed optimizer's
all-gather after its local update; such a process cannot serve as a source of state).
"""

from __future__ import annotations

from typing import Final

import torch.distributed as dist

from liver.worker_runtime.world import WorldError

__all__ = ["PEER_FAILURE_MARKERS", "StepAbandoned", "is_peer_failure"]

PEER_FAILURE_MARKERS: Final = (
    "gloo/transport/",  # every gloo transport failure names its source file
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "timed out waiting",  # a gloo collective past its group's timeout
    "nccl communicator was aborted",
    "process group was destroyed",
    "was released",  # a group of a world this process released (WorldError)
)
"""Phrases of the errors torch raises when a collective's peer is gone (gloo and NCCL raise plain
``RuntimeError`` or ``DistBackendError`` with these; matched case-insensitively)."""


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) says a collective's peer is gone or silent.

    Such a failure says nothing about this process's own state or code: the step it broke can be
    abandoned and the state kept. Anything else (a shape error, a user's bug, out of memory) is not one
    and is raised as it is.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (dist.DistNetworkError, dist.DistBackendError, StepAbandoned)):
            return True
        if isinstance(current, RuntimeError):
            text = str(current).lower()
            if any(marker in text for marker in PEER_FAILURE_MARKERS):
                return True
        seen.add(id(current))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return False


class StepAbandoned(WorldError):
    """A training step met a lost peer and was given up; the trainer's state is the last completed one.

    ``iteration`` is the last iteration this process completed (its state is exactly that iteration's
    end, unless ``torn``). The world the step ran on is broken: the runtime recovers at its next
    :meth:`~.runtime.LiveRuntime.step` (live from surviving replicas, or from the checkpoint).
    """

    def __init__(self, iteration: int, reason: str, torn: bool = False) -> None:
        self.iteration = iteration
        self.reason = reason
        self.torn = torn
        state = "torn (an update began and could not finish)" if torn else "kept"
        super().__init__(
            f"step {iteration + 1} abandoned: a peer is lost ({reason}); "
            f"state of iteration {iteration} {state}"
        )

    def __reduce__(self) -> tuple[type, tuple[int, str, bool]]:
        return (type(self), (self.iteration, self.reason, self.torn))
