"""The fail-stop branch of invariant I4 inside a training process: agree that the job falls back, then
restart on the new layout from the last durable checkpoint.

A handoff whose old world cannot be restored (:class:`~.handoff.HandoffFailed`: one of its processes is
gone) has lost state that only the old world held. The processes of the *new* world are all alive (the
layout was chosen without the lost device), so they restart there: they build the new layout's groups
once more, under the next generation id (the failed generation's store keys are spent, and the
coordinator expects a restarted world to carry an id newer than every one it issued), and load the
checkpoint with reshape (:func:`liver.worker_runtime.megatron.checkpoint.restart_from_checkpoint`).

Who decides. Only old-world members can tell a failed handoff (old world lost) from an aborted one (old
world restored): a joiner sees the same broken stream either way. So every old-world process that ran
the handoff writes what it found into one key of the new generation's store (:func:`post_outcome`, a
compare-and-set: the first writer wins and every later one reads the winner), and every joiner whose
handoff broke after it entered the new world reads it (:func:`await_outcome`). The survivors of the old
world find the same thing (restoring the old world is a collective over all its members: either all
complete it or a lost member fails it for all), and the compare-and-set makes even a disagreement end
in one answer that every process follows. No member of the new world is left waiting in a collective
that the others skipped.

Why the store and not a collective: the new world's groups were shut down by the rollback (that is how
every peer learned of the failure at once), and the old world's are broken. The store is the one
thing every member of the new world can still reach: the new rank 0's process hosts it.
"""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum

import msgspec
import structlog
import torch.distributed as dist

from liver.worker_runtime.handoff import HandoffFailed, HandoffStage, Role
from liver.worker_runtime.world import StoreAddress, connect_store

__all__ = [
    "CheckpointOptions",
    "FallbackReport",
    "HandoffOutcome",
    "NoCheckpointConfigured",
    "OutcomeVerdict",
    "await_outcome",
    "outcome_key",
    "post_outcome",
]

log = structlog.get_logger(__name__)


class CheckpointOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the job's durable checkpoints live, and how often the runtime writes one.

    With these set the runtime saves at every ``every``-th iteration boundary (a collective over the
    world; None: the training loop saves on its own schedule) and, when a handoff fails because the old
    world is gone, falls back to the latest checkpoint under ``root``. ``root`` must be shared by every
    process of the job (a shared file system across nodes), as for any Megatron checkpoint.
    """

    root: str
    every: int | None = None
    keep_last: int = 2
    resume: bool = True
    """At the start of the first world, load the latest checkpoint under ``root`` when there is one (the
    job was restarted, as Megatron's ``--load``); False starts from scratch whatever is there."""

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("`checkpoint.root`: must not be empty")
        if self.every is not None and self.every < 1:
            raise ValueError(f"`checkpoint.every`: must be at least 1 or None, got {self.every}")
        if self.keep_last < 1:
            raise ValueError(f"`checkpoint.keep_last`: must be at least 1, got {self.keep_last}")


class OutcomeVerdict(StrEnum):
    KEPT = "kept"  # the old world was restored: it trains on; joiners keep waiting
    FALLBACK = "fallback"  # the old world is gone: the new world restarts from the checkpoint
    LOST = "lost"  # the old world is gone and there is no checkpoint: the job is down
    RECOVER = "recover"  # the old world is gone but its survivors hold the cut's state: they move live to
    # a world planned around the lost devices (the coordinator's next request); joiners keep waiting


class HandoffOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What became of a handoff that did not commit, as its old-world processes found it."""

    verdict: OutcomeVerdict
    reached_iteration: int | None  # the cut: the last step the old world completed
    reason: str


def outcome_key(job: str, generation: int) -> str:
    """The store key of ``generation``'s outcome (under that generation's namespace)."""
    return f"liver/{job}/gen{generation}/outcome"


def post_outcome(
    store: StoreAddress, job: str, generation: int, outcome: HandoffOutcome, timeout: timedelta
) -> HandoffOutcome:
    """Write ``outcome`` unless another process wrote first; the outcome every process will follow.

    Raises ``RuntimeError`` (torch's store errors) when the store cannot be reached within ``timeout``.
    """
    client = connect_store(store, timeout)
    stored = client.compare_set(outcome_key(job, generation), "", msgspec.json.encode(outcome))
    winner = msgspec.json.decode(stored, type=HandoffOutcome)
    if winner.verdict != outcome.verdict:
        log.warning(
            "fallback.outcome_overruled",
            job=job,
            generation=generation,
            found=str(outcome.verdict),
            agreed=str(winner.verdict),
            reason=winner.reason,
        )
    return winner


def await_outcome(
    store: StoreAddress, job: str, generation: int, timeout: timedelta
) -> HandoffOutcome | None:
    """The outcome the old world's processes wrote, waiting up to ``timeout``; None when none came (or
    the store is gone): nobody of the old world ran the handoff far enough to say, so nothing of the new
    world can be restarted either."""
    key = outcome_key(job, generation)
    try:
        client = connect_store(store, timeout)
        client.wait([key], timeout)
        return msgspec.json.decode(client.get(key), type=HandoffOutcome)
    except (dist.DistError, RuntimeError, msgspec.DecodeError, msgspec.ValidationError) as error:
        log.warning("fallback.no_outcome", job=job, generation=generation, error=repr(error)[:300])
        return None


class FallbackReport(msgspec.Struct, kw_only=True):
    """One process's fall back to the last checkpoint after a failed handoff.

    ``generation`` is the world the job restarted in (the failed one plus one); training resumes after
    ``iteration`` (the checkpoint's). ``seconds`` runs from the failure to the loaded trainer.
    """

    failed_generation: int
    generation: int
    role: Role
    rank: int | None  # this process's rank in the restarted world (None: it left)
    checkpoint: str | None  # None for a process that left
    iteration: int | None
    reached_iteration: int | None
    steps_lost: int | None
    reason: str
    seconds: float


class NoCheckpointConfigured(HandoffFailed):
    """A handoff failed with the old world gone, and the runtime has no checkpoint to fall back to."""

    def __init__(self, generation: int, stage: HandoffStage, reason: str, restore_error: str) -> None:
        super().__init__(generation, stage, reason, restore_error)
        self.args = (
            f"{self.args[0]}; no checkpoint was configured (RuntimeOptions.checkpoint), so the job cannot "
            "fall back to one and must be restarted",
        )
