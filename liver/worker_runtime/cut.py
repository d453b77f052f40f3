"""The consistent cut (invariant I3): every rank of the active world switches at the same iteration.

Ranks learn about a handoff at different moments (the bus delivers to each on its own time) and finish
building the shadow world at different iterations. If each rank switched when *it* was ready, some would
wait in a new-world collective while others waited in an old-world one: a deadlock. So at every iteration
boundary the active world runs one tiny all-reduce (MIN over a few integers) that answers, identically on
every rank, whether all of them are ready for the same target generation. Either all switch at this
boundary or none does.

The same vote agrees on one earlier boundary: the one where every rank has the target's groups and the
new trainer is built (``BUILD``, see :class:`Readiness`), so that the switch itself only streams.

Joiners (ranks only in the new world) take no part in the cut; they wait in :func:`enter_world`, which
the switching ranks call right after the cut, and learn from it the iteration training resumes after.
"""

from __future__ import annotations

from datetime import timedelta
from enum import IntEnum, StrEnum

import msgspec
import structlog
import torch
import torch.distributed as dist

from liver.shared.errors import HandoffError
from liver.worker_runtime.world import GroupKind, World, WorldBuild, WorldError, allreduce

log = structlog.get_logger(__name__)

NO_TARGET = -1
_FAR = 1 << 62  # stands for "no iteration" in the MAX reductions of enter_world


class CutError(HandoffError):
    """The ranks broke the cut's contract (asked at different iterations): no rank may switch."""


class CutVerdict(StrEnum):
    WAIT = "wait"  # keep training on the active world; ask again at the next boundary
    BUILD = "build"  # every rank has the target's groups: build the new trainer now, switch later
    SWITCH = "switch"  # every rank is ready for the same target: switch after this iteration
    ABORT = "abort"  # some rank failed to prepare the target: give the handoff up (I4)


class Readiness(IntEnum):
    """How far one rank's preparation of the target has come: its vote (the MIN over ranks decides).

    The new trainer is built at an agreed boundary before the cut (``BUILD``): Megatron's build runs
    collectives over the new world's default group, so every member of the new world must build at the
    same moment, and it uses process-global state the training step also uses, so it runs on the
    training thread between two steps, never beside one.
    """

    NONE = 0  # nothing the switch needs is ready yet
    PREPARED = 1  # shadow world, stream group, schedule and layout check: the new trainer can be built
    BUILT = 2  # the new trainer is built and its communicators warm; the coordinator's SWITCH is awaited
    READY = 3  # built and allowed: the switch can happen at this boundary


class CutDecision(msgspec.Struct, frozen=True):
    """The answer every rank of the active world got at one iteration boundary."""

    iteration: int
    verdict: CutVerdict
    target: int  # the generation agreed on, NO_TARGET unless every rank named the same one
    failed: int = 0
    """With ABORT: the newest generation some rank failed. A rank whose own target is newer keeps it:
    it was given up locally at the coordinator's word and a newer one is being prepared, while a rank
    that had not heard yet failed the old one."""

    def aborts(self, generation: int) -> bool:
        """Whether this decision gives ``generation`` (this rank's target) up."""
        return self.verdict is CutVerdict.ABORT and generation <= self.failed


def decide(reduced: torch.Tensor | list[int]) -> CutDecision:
    """Read the MIN-reduced vote ``[ready, -failed, target, -target, iteration, -iteration]``, where
    ``failed`` is the generation a rank failed (0: none).

    Pure, so every rank derives the same decision from the same reduced values.
    """
    ready, not_failed, target_lo, neg_target_hi, it_lo, neg_it_hi = (int(v) for v in reduced)
    if it_lo != -neg_it_hi:
        raise CutError(f"ranks voted at different iterations ({it_lo} to {-neg_it_hi}); the cut is unsafe")
    same_target = target_lo == -neg_target_hi and target_lo != NO_TARGET
    target = target_lo if same_target else NO_TARGET
    if not_failed < 0:
        return CutDecision(it_lo, CutVerdict.ABORT, target, failed=-not_failed)
    if ready == Readiness.READY and same_target:
        return CutDecision(it_lo, CutVerdict.SWITCH, target)
    if ready == Readiness.PREPARED and same_target:
        return CutDecision(it_lo, CutVerdict.BUILD, target)
    return CutDecision(it_lo, CutVerdict.WAIT, target)


def vote(
    active: World,
    *,
    iteration: int,
    target: int = NO_TARGET,
    ready: bool | Readiness = False,
    failed: bool = False,
    timeout: timedelta | None = None,
) -> CutDecision:
    """One rank's part of the cut at the boundary after ``iteration``: a collective over ``active``.

    ``target`` is the generation this rank prepares (NO_TARGET when it knows of none), ``ready`` how far
    that preparation has come (:class:`Readiness`; True stands for READY, for a caller with no trainer
    to build first), ``failed`` whether preparing it failed here.
    """
    if iteration < 0:
        raise ValueError(f"`iteration`: must not be negative, got {iteration}")
    if target < NO_TARGET:
        raise ValueError(f"`target`: a generation id or NO_TARGET, got {target}")
    readiness = Readiness.NONE if failed else Readiness.READY if ready is True else Readiness(ready)
    failed_generation = max(target, 1) if failed else 0
    votes = torch.tensor(
        [int(readiness), -failed_generation, target, -target, iteration, -iteration], dtype=torch.int64
    )
    allreduce(active.group(GroupKind.WORLD), votes, dist.ReduceOp.MIN, timeout)
    return decide(votes)


class SwitchGate:
    """The training loop's one call per iteration: ``gate.at_boundary(iteration)``.

    Holds the shadow world this rank is preparing (if any) and votes with its state. ``every`` spaces the
    votes out (only iterations divisible by it vote; the rest answer WAIT without communicating); it must
    be the same on every rank, as must the iteration numbers.
    """

    def __init__(self, active: World, *, every: int = 1, timeout: timedelta | None = None) -> None:
        if every < 1:
            raise ValueError(f"`every`: must be at least 1, got {every}")
        self.active = active
        self.every = every
        self.timeout = timeout
        self._build: WorldBuild | None = None
        self._log = log.bind(job=active.spec.job, generation=active.generation, rank=active.rank)

    @property
    def pending(self) -> WorldBuild | None:
        return self._build

    def prepare(self, build: WorldBuild) -> None:
        """Vote for ``build``'s generation from now on (ready once it is built)."""
        if build.spec.job != self.active.spec.job:
            raise WorldError(f"shadow job {build.spec.job} is not the active job {self.active.spec.job}")
        if build.spec.generation <= self.active.generation:
            raise WorldError(
                f"shadow generation {build.spec.generation} is not newer than active {self.active.generation}"
            )
        if self._build is not None:
            raise WorldError(f"generation {self._build.spec.generation} is already being prepared")
        self._build = build

    def at_boundary(self, iteration: int, *, also_ready: bool = True) -> CutDecision:
        """Vote at the end of ``iteration``, once its work has drained (the optimizer step is done and no
        collective of it is in flight). ``also_ready`` adds this rank's other conditions (its part of the
        plan arrived, ...) to the world being built.

        On ABORT the shadow world is discarded here; on SWITCH the caller moves to :meth:`shadow`.
        """
        if iteration % self.every:
            return CutDecision(iteration, CutVerdict.WAIT, NO_TARGET)
        build = self._build
        target = build.spec.generation if build is not None else NO_TARGET
        ready = build is not None and build.ready and also_ready
        failed = build is not None and build.done() and build.error is not None
        decision = vote(
            self.active, iteration=iteration, target=target, ready=ready, failed=failed, timeout=self.timeout
        )
        if decision.verdict is CutVerdict.ABORT and build is not None:
            build.discard()
            self._build = None
            self._log.warning("cut.aborted", iteration=iteration, target=target)
        elif decision.verdict is CutVerdict.SWITCH:
            self._log.info("cut.switch", iteration=iteration, target=decision.target)
        return decision

    def shadow(self) -> World:
        """The world to switch to after a SWITCH decision."""
        if self._build is None:
            raise WorldError("no shadow world is being prepared")
        return self._build.result(timeout=0)


def enter_world(world: World, iteration: int | None, *, timeout: timedelta | None = None) -> int:
    """First collective of a new world, called by all its members right after the switch.

    Ranks that came from the active world pass the cut's iteration; joiners pass None and wait here
    until the others arrive (``timeout`` bounds that wait). Everyone gets the cut's iteration back.
    """
    if iteration is not None and iteration < 0:
        raise ValueError(f"`iteration`: must not be negative, got {iteration}")
    lo, hi = (iteration, -iteration) if iteration is not None else (-_FAR, -_FAR)
    values = torch.tensor([lo, hi], dtype=torch.int64)
    allreduce(world.group(GroupKind.WORLD), values, dist.ReduceOp.MAX, timeout)
    top, neg_bottom = (int(v) for v in values)
    if top == -_FAR:
        raise CutError(f"no member of generation {world.generation} came from the active world")
    if top != -neg_bottom:
        raise CutError(
            f"members entered generation {world.generation} from iterations {-neg_bottom} to {top}"
        )
    log.info("cut.entered", job=world.spec.job, generation=world.generation, rank=world.rank, iteration=top)
    return top
