"""What must hold after any run, whatever was killed: the invariants of exactly-once handoffs.

The checker reads only what a user can read after the fact (the outcomes kept in the generations
stream, in their order, and the job's record in the generations bucket), so a run that passes it
passed for the reasons a user cares about and not because of something the run itself remembered.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from enum import StrEnum

import msgspec

from liver.services.coordinator.record import GenerationRecord
from liver.shared.messages import AbortOutcome, GenerationAborted, GenerationCommitted

Outcome = GenerationCommitted | GenerationAborted


class Invariant(StrEnum):
    ONE_OUTCOME = "one_outcome"
    """Every published event ends in exactly one outcome that names it."""
    COMMITTED_ONCE = "committed_once"
    """No generation is committed twice."""
    INCREASING = "increasing"
    """Committed generations increase in the order they were published, each from the one before."""
    RECORD = "record"
    """The job's record holds the last committed world."""
    NO_ABORT = "no_abort"
    """No event is aborted: every event of the run is feasible and no worker fails, so an abort (or a
    fallback to the checkpoint) could only be caused by the kills, which must cost time and nothing else."""
    # With real training processes (liver.chaos.real):
    LEAVES_WARNED_NODE = "leaves_warned_node"
    """Every spot warning ends in a commit whose world no longer uses the warned node."""
    LIVE_RECOVERY = "live_recovery"
    """A lost worker or node whose state a replica holds is recovered live, training again in time."""
    ITERATIONS = "iterations"
    """No worker's iterations ever go back, but for one step trained again by the first step of a new
    generation (a recovery whose lost worker died in its copy's refresh goes back a step)."""
    EXITS = "exits"
    """No worker exits non-zero unless the run killed it."""


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    invariant: Invariant
    detail: str


def settled_by(outcome: Outcome) -> tuple[str, ...]:
    """The events an outcome settles (an abort that re-plans settles none of its re-planned ones)."""
    return outcome.event_ids


def check(
    published: Sequence[str],
    outcomes: Sequence[Outcome],
    record: GenerationRecord | None,
    seen_live: Sequence[Outcome] = (),
) -> list[Violation]:
    """Every violated invariant, with what violates it; empty when the run was clean.

    ``outcomes`` are the ones the generations stream kept, in its order; ``seen_live`` the ones a
    subscriber saw as they were published (the stream keeps one per generation and drops a second
    publish under the same message id, which a subscriber still sees).
    """
    out: list[Violation] = []
    versions: dict[int, set[tuple[str, tuple[str, ...]]]] = {}
    for outcome in seen_live:
        versions.setdefault(outcome.generation, set()).add((type(outcome).__name__, outcome.event_ids))
    for generation, seen in sorted(versions.items()):
        if len(seen) > 1:
            out.append(
                Violation(
                    invariant=Invariant.COMMITTED_ONCE,
                    detail=(
                        f"generation {generation} was published with {len(seen)} different outcomes: "
                        f"{sorted(seen)}"
                    ),
                )
            )
    counts = Counter(event_id for outcome in outcomes for event_id in settled_by(outcome))
    for event_id in published:
        if counts[event_id] != 1:
            named = [o.generation for o in outcomes if event_id in settled_by(o)]
            out.append(
                Violation(
                    invariant=Invariant.ONE_OUTCOME,
                    detail=f"event {event_id!r} ended in {counts[event_id]} outcomes (generations {named})",
                )
            )
    commits = [o for o in outcomes if isinstance(o, GenerationCommitted)]
    for generation, times in Counter(c.generation for c in commits).items():
        if times > 1:
            out.append(
                Violation(
                    invariant=Invariant.COMMITTED_ONCE,
                    detail=f"generation {generation} committed {times} times",
                )
            )
    for before, after in itertools.pairwise(commits):
        if after.generation <= before.generation or after.previous_generation != before.generation:
            out.append(
                Violation(
                    invariant=Invariant.INCREASING,
                    detail=(
                        f"generation {after.generation} (from {after.previous_generation}) committed "
                        f"after generation {before.generation}"
                    ),
                )
            )
    for outcome in outcomes:
        if isinstance(outcome, GenerationAborted) and (
            outcome.event_ids or outcome.outcome == AbortOutcome.CHECKPOINT_FALLBACK
        ):
            out.append(
                Violation(
                    invariant=Invariant.NO_ABORT,
                    detail=(
                        f"generation {outcome.generation} aborted ({outcome.outcome.value}) in "
                        f"{outcome.phase.value}: {outcome.reason}"
                    ),
                )
            )
    if commits:
        last = commits[-1]
        if record is None:
            out.append(Violation(invariant=Invariant.RECORD, detail="the job has no record"))
        elif (record.generation, record.layout, record.placement) != (
            last.generation,
            last.layout,
            last.placement,
        ):
            out.append(
                Violation(
                    invariant=Invariant.RECORD,
                    detail=(
                        f"the record holds generation {record.generation} ({record.layout.describe()}), "
                        f"the last commit generation {last.generation} ({last.layout.describe()})"
                    ),
                )
            )
    return out
