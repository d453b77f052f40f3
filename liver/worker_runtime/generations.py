"""A worker's side of a handoff as one state machine: the states one generation's handoff goes through
in a training process, and the only moves between them.

Two parties keep a record of each handoff inside one process and both move it through this table:
the bus companion's agent (:mod:`.companion.agent`, on the companion's thread: what the coordinator
asked and what was acked) and the runtime (:class:`~.preparation.Preparation`, moved by the companion's
calls into :class:`~.runtime.LiveRuntime` and by the training thread at iteration boundaries). The
states that end a handoff are named as the ack the coordinator gets for them (``ready``,
``switched``, ``aborted``, ``failed``: :class:`~liver.shared.messages.WorkerPhase`), so the bus and the
runtime speak of a handoff in one vocabulary.

Why a table rather than flags: the races a real coordinator restart caused (a newer Prepare refused
while an aborted one was still being released; two shadow worlds at once) lived between loose flags
written from several threads. Here every move is checked (:func:`check_move` raises
:class:`IllegalHandoffMove` on any other), and the properties the coordinator relies on follow from the
table and from :class:`~.runtime.LiveRuntime`'s use of it:

* an abort of generation N releases N before a later Prepare is judged (a Prepare N+1 that arrives
  while N is being released is QUEUED behind it, never refused);
* a Prepare N+1 supersedes an N that is not SWITCHING (N moves to RELEASING);
* at most one shadow world beside the active one: only the handoff that is not QUEUED builds anything.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from liver.shared.errors import LiverError


class HandoffState(StrEnum):
    """Where one generation's handoff stands in this process."""

    FETCHING = "fetching"
    """The agent reads the plan slice; the runtime does not know of the handoff yet."""
    QUEUED = "queued"
    """Accepted while an older handoff is being released; it starts once that one is."""
    PREPARING = "preparing"
    """Shadow world, stream group, schedule and layout check being built beside training."""
    READY = "ready"
    """The new trainer is built (at a boundary every rank agreed on); the coordinator's Switch is awaited."""
    SWITCHING = "switching"
    """Built and allowed (the Switch came, or the request needs none): the ranks switch at the next
    boundary they all reach so; no newer Prepare supersedes it any more."""
    RELEASING = "releasing"
    """Given up (aborted, superseded, or failed here or on another rank) but not yet let go of: at the
    next boundary, by the vote when every rank built it (their release is a collective)."""
    SWITCHED = "switched"
    """Committed: training goes on in the new world."""
    LEFT = "left"
    """Committed, and this process is in the new world no more."""
    ABORTED = "aborted"
    """Let go of at the coordinator's word (an Abort, or a newer Prepare): the old world trains on."""
    FAILED = "failed"
    """Let go of because it failed (here or on another rank): the old world trains on, or, past the
    cut with the old world gone, the job recovers live or falls back to its checkpoint."""


S = HandoffState

TRANSITIONS: Final[dict[HandoffState, frozenset[HandoffState]]] = {
    S.FETCHING: frozenset(
        {
            S.PREPARING,  # the plan slice is read and the runtime accepted it
            S.ABORTED,  # an Abort, or a newer Prepare, before the slice was read
            S.FAILED,  # the slice could not be read or does not check, or the runtime refused it
        }
    ),
    S.QUEUED: frozenset(
        {
            S.PREPARING,  # the handoff it waited behind was let go of
            S.RELEASING,  # aborted or superseded before it started (let go of at once: nothing built)
        }
    ),
    S.PREPARING: frozenset(
        {
            S.READY,  # built at the agreed boundary (a joiner or a recovery: once its groups are)
            S.SWITCHING,  # built while already allowed (a request that switches when ready)
            S.RELEASING,  # an Abort, a newer Prepare, a failure here, or the vote's ABORT
            S.FAILED,  # the agent: the runtime refused it or a hook raised
            S.ABORTED,  # the agent: an Abort or a newer Prepare (the runtime releases its own record)
            S.SWITCHED,  # the agent: the runtime switched before its ready ack was read (acks cross)
        }
    ),
    S.READY: frozenset(
        {
            S.SWITCHING,  # the coordinator's Switch
            S.RELEASING,  # an Abort, a newer Prepare, a failure here, or the vote's ABORT
            S.SWITCHED,  # the agent: the runtime switched (a Switch re-sent after a restart is answered)
            S.FAILED,  # the agent: the runtime gave it up on its own
            S.ABORTED,  # the agent: an Abort or a newer Prepare
        }
    ),
    S.SWITCHING: frozenset(
        {
            S.SWITCHED,  # committed
            S.LEFT,  # committed, and this process left
            S.RELEASING,  # an Abort before the cut (the coordinator gave it up at its deadline)
            S.FAILED,  # rolled back past the cut, or the old world is gone
            S.ABORTED,  # the agent: an Abort after the Switch
        }
    ),
    S.RELEASING: frozenset(
        {
            S.ABORTED,  # released; it was given up at the coordinator's word
            S.FAILED,  # released; it failed here or on another rank
        }
    ),
    S.SWITCHED: frozenset(),
    S.LEFT: frozenset(),
    S.ABORTED: frozenset(),
    S.FAILED: frozenset(),
}
"""Every allowed move; :func:`check_move` refuses any other (each edge says what causes it)."""

ENDED: Final = frozenset({S.SWITCHED, S.LEFT, S.ABORTED, S.FAILED})
"""States a handoff never leaves."""
SUPERSEDABLE: Final = frozenset({S.FETCHING, S.QUEUED, S.PREPARING, S.READY})
"""States a newer Prepare ends: before the Switch, the coordinator has not passed its point of no return."""


class IllegalHandoffMove(LiverError, RuntimeError):
    """A move the table does not allow: a bug in the worker, never a consequence of input."""


def check_move(generation: int, frm: HandoffState, to: HandoffState, why: str) -> HandoffState:
    """``to`` when the table allows ``frm -> to``; :class:`IllegalHandoffMove` naming both otherwise."""
    if to not in TRANSITIONS[frm]:
        raise IllegalHandoffMove(f"generation {generation}: {frm.value} -> {to.value} is not allowed ({why})")
    return to


def can_move(frm: HandoffState, to: HandoffState) -> bool:
    return to in TRANSITIONS[frm]


__all__ = [
    "ENDED",
    "SUPERSEDABLE",
    "TRANSITIONS",
    "HandoffState",
    "IllegalHandoffMove",
    "can_move",
    "check_move",
]
