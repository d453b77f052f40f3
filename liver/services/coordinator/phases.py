"""The coordinator's phases, the moves between them, and what each phase may wait for.

::

      restore() or WorldStarted            a trigger: resize request, lost worker
    DOWN ───────────────────────► STABLE ─────────────────────────────┐
     ▲                             ▲  ▲                               ▼  CAS: begin g (issued = g)
     │                             │  │                            PREPARE   plan topology, plan transfer,
     │                             │  │                               │      Prepare -> the job (broadcast)
     │                             │  │                               ▼  all "ready"; CAS: switch intent
     │                             │  │                             READY
     │                             │  │                               │  Switch -> every worker
     │                             │  │                               ▼
     │                             │  │                             SWITCH    collect "switched"
     │                             │  │                               │  all switched; CAS: commit g
     │                             │  │                               ▼
     │                             │  └─── CLEANUP ◄────────────── COMMITTED  publish generation.committed
     │                             │
     │                             └── kept the old world (a cancel re-plans from STABLE as g+1)
     │  checkpoint fallback               │
     └────────────────────────────── ABORTED ◄── PREPARE | READY | SWITCH: missed deadline, failed or
                                     CAS: abort g   lost worker, impossible target; then publish
                                                    generation.aborted

    any phase ──► STANDBY when a compare-and-set finds a record this coordinator did not write

Two tables make the state machine of :mod:`.core` checkable from the outside: :data:`TRANSITIONS` lists
every allowed phase change (anything else is a bug, :class:`IllegalTransition`), and :data:`WAITS` lists
what each phase may be waiting for between two inputs. Keeping them apart from the code that moves
through them lets the tests, the docs and the core read the same definition.
"""

from __future__ import annotations

import enum
from typing import Final

from liver.shared.errors import LiverError


class GenerationPhase(enum.StrEnum):
    DOWN = "down"
    """No live world known: before the job's first world reports, or after a checkpoint fallback."""
    STABLE = "stable"
    PREPARE = "prepare"
    READY = "ready"
    SWITCH = "switch"
    COMMITTED = "committed"
    CLEANUP = "cleanup"
    ABORTED = "aborted"
    STANDBY = "standby"
    """Another coordinator wrote the record: this one does nothing until ``restore`` is called."""


TRANSITIONS: Final[dict[GenerationPhase, frozenset[GenerationPhase]]] = {
    GenerationPhase.DOWN: frozenset(
        {GenerationPhase.STABLE, GenerationPhase.SWITCH, GenerationPhase.ABORTED, GenerationPhase.STANDBY}
    ),
    GenerationPhase.STABLE: frozenset({GenerationPhase.PREPARE, GenerationPhase.STANDBY}),
    GenerationPhase.PREPARE: frozenset(
        {GenerationPhase.READY, GenerationPhase.ABORTED, GenerationPhase.STANDBY}
    ),
    GenerationPhase.READY: frozenset(
        {GenerationPhase.SWITCH, GenerationPhase.ABORTED, GenerationPhase.STANDBY}
    ),
    GenerationPhase.SWITCH: frozenset(
        {GenerationPhase.COMMITTED, GenerationPhase.ABORTED, GenerationPhase.STANDBY}
    ),
    GenerationPhase.COMMITTED: frozenset({GenerationPhase.CLEANUP}),
    GenerationPhase.CLEANUP: frozenset({GenerationPhase.STABLE}),
    GenerationPhase.ABORTED: frozenset(
        {GenerationPhase.STABLE, GenerationPhase.DOWN, GenerationPhase.STANDBY}
    ),
    GenerationPhase.STANDBY: frozenset(
        {GenerationPhase.DOWN, GenerationPhase.STABLE, GenerationPhase.SWITCH, GenerationPhase.ABORTED}
    ),
}
"""Every allowed phase change; :meth:`.core.Coordinator._move` refuses any other."""


class Wait(enum.StrEnum):
    """What the current phase is waiting for."""

    NOTHING = "nothing"
    WORLD_WRITE = "world_write"
    BEGIN_WRITE = "begin_write"
    TOPOLOGY = "topology"
    TRANSFER = "transfer"
    WORKERS = "workers"
    """Some participant's device has no known worker yet (just after a restart)."""
    PREPARED = "prepared"
    SWITCH_WRITE = "switch_write"
    RESUME_WRITE = "resume_write"
    """A restored coordinator claims a handoff found after its switch intent before sending the switch
    again: a coordinator whose own write's answer was lost then stands down instead of ending it too."""
    SWITCHED = "switched"
    COMMIT_WRITE = "commit_write"
    ABORT_WRITE = "abort_write"
    NO_CHANGE_WRITE = "no_change_write"


WAITS: Final[dict[GenerationPhase, frozenset[Wait]]] = {
    GenerationPhase.DOWN: frozenset({Wait.NOTHING, Wait.WORLD_WRITE}),
    GenerationPhase.STABLE: frozenset({Wait.NOTHING, Wait.NO_CHANGE_WRITE}),
    GenerationPhase.PREPARE: frozenset(
        {Wait.BEGIN_WRITE, Wait.TOPOLOGY, Wait.TRANSFER, Wait.WORKERS, Wait.PREPARED}
    ),
    GenerationPhase.READY: frozenset({Wait.SWITCH_WRITE}),
    GenerationPhase.SWITCH: frozenset({Wait.RESUME_WRITE, Wait.SWITCHED, Wait.COMMIT_WRITE}),
    GenerationPhase.COMMITTED: frozenset({Wait.NOTHING}),
    GenerationPhase.CLEANUP: frozenset({Wait.NOTHING}),
    GenerationPhase.ABORTED: frozenset({Wait.ABORT_WRITE}),
    GenerationPhase.STANDBY: frozenset({Wait.NOTHING}),
}
"""What each phase may wait for between two inputs (``Coordinator.handle`` and ``restore`` return with
a pair from this table; COMMITTED, CLEANUP and ABORTED pass within one input). A prepare waits for its
begin write, then the topology plan, the transfer plan, workers on every participant's device (only
after a restart), and the prepared acks, in that order; a switch resumed by a restored coordinator waits
for its claim on the record first; the rest wait for one record write or none."""

WAITS_FOR_NOTHING: Final = frozenset(
    {
        GenerationPhase.STABLE,
        GenerationPhase.DOWN,
        GenerationPhase.STANDBY,
        GenerationPhase.COMMITTED,
        GenerationPhase.CLEANUP,
    }
)
"""Phases entered waiting for nothing (one may then start a write)."""

HANDOFF_PHASES: Final = frozenset({GenerationPhase.PREPARE, GenerationPhase.READY, GenerationPhase.SWITCH})
"""The phases of a handoff under way: the ones a stop applies to."""

ABORTED_IN: Final = {
    GenerationPhase.PREPARE: "prepare",
    GenerationPhase.READY: "ready",
    GenerationPhase.SWITCH: "switch",
}
"""The ``phase`` a ``generation.aborted`` names for a handoff stopped in each handoff phase."""


class IllegalTransition(LiverError, RuntimeError):
    """A phase change the table does not allow: a bug in the machine, never a consequence of input."""
