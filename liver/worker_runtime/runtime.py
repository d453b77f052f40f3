"""The training-loop API: one call per iteration, and a live reshard whenever a resize is requested.

    runtime = LiveRuntime(MegatronJob(spec, config), job="gpt", device=device, store=store, initial=spec0)
    while (trainer := runtime.step()) is not None:      # None: this process left the job
        try:
            trainer.train_step()
        except StepAbandoned:                             # a peer is lost: the next step() recovers
            pass

:meth:`LiveRuntime.step` is the iteration boundary. The first call builds the initial world and its
trainer (or, in a process that is in no world yet, waits until a resize takes it in). Every later call
votes, with one tiny all-reduce over the active world, whether every rank is ready for the same new
generation (the consistent cut, I3), and either returns the same trainer or switches all ranks at this
boundary and returns the trainer of the new world. A process that the new world no longer includes gets
``None`` after it has streamed its state out.

:meth:`LiveRuntime.request_resize` (thread-safe: the bus companion calls it from its own thread) hands
in the target: generation, layout, placement, the transfer plan (made by the planner outside this
process; a :class:`~liver.reshard.plan.PlanSlice` is enough), the store and a deadline. Preparation runs
in the background while training continues (I1): the shadow world's groups and the stream group are
built on their own threads. Once every rank has them, one vote agrees on a boundary where every process
of both worlds builds the new trainer and warms the new communicators (``BUILD``,
:func:`.handoff.prebuild`): training stands still for that build, which needs Megatron's
process-global state, but the cut comes at a later boundary and its pause only streams. A process that
joins (a scale-out) first warms up alone under a mock world, then builds its groups, so that no rank of
the active world ever waits for a cold one, builds its trainer with the others, and waits in
``enter_world`` for the cut. The switch itself is :func:`.handoff.switch`.

Failure (I4): a preparation that fails or misses its deadline, or an :meth:`LiveRuntime.abort`, makes
the next vote abort on every rank; a handoff that fails before its commit is rolled back everywhere.
Either way training continues on the old world, and :attr:`LiveRuntime.history` records why.
If the old world cannot be restored (one of its processes is gone: fail-stop) and the runtime has a
checkpoint configured (``RuntimeOptions.checkpoint``, which also makes it save one every ``every``
iterations), the processes of the new world agree on it through the new generation's store and restart
on the new layout, as generation ``failed + 1``, from the last durable checkpoint (:mod:`.fallback`):
``step`` returns that trainer, at the checkpoint's iteration. Processes of the old world only leave.
Without a checkpoint the failure is raised (:class:`~.fallback.NoCheckpointConfigured`).

A peer lost outside a handoff (fail-stop in a training step, the vote or a checkpoint save): the
trainer gives the step up with its state at the last completed iteration
(:class:`~.peers.StepAbandoned`, which the training loop catches before calling ``step`` again); the
runtime destroys the broken world's groups (so every peer waiting in one fails at once), then waits for
a request that names the lost devices (``request_resize(..., lost=)``, the coordinator's recovery plan)
and moves to it live, without the old world: the stream group and the new world are built without the
lost devices, every survivor enters with the iteration it completed, and the state streams from the
surviving replicas (:meth:`LiveRuntime._recover`). When that fails, or no request comes within
``recover_timeout_s``, the job falls back to its checkpoint as above (or the error is raised).
The runtime never imports the services: plans come in from outside.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Final, Generic, TypeVar

import msgspec
import structlog
import torch

from liver.reshard.plan import Plan, PlanSlice
from liver.shared.errors import HandoffError
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.worker_runtime.contract import Checkpoints, JobAbilities, KeptState, TrainerFactory
from liver.worker_runtime.copies.keeper import KeptCopy
from liver.worker_runtime.copies.manager import IN_REFRESH, CopyManager, CopyOptions
from liver.worker_runtime.copies.peer import PeerCopies
from liver.worker_runtime.copies.wire import CopyError
from liver.worker_runtime.cut import NO_TARGET, CutVerdict, Readiness, vote
from liver.worker_runtime.fallback import (
    CheckpointOptions,
    FallbackReport,
    HandoffOutcome,
    NoCheckpointConfigured,
    OutcomeVerdict,
    await_outcome,
    post_outcome,
)
from liver.worker_runtime.generations import ENDED, HandoffState
from liver.worker_runtime.handoff import (
    Handoff,
    HandoffAborted,
    HandoffFailed,
    HandoffStage,
    Role,
    SwitchReport,
    prebuild,
    switch,
)
from liver.worker_runtime.peers import StepAbandoned, is_peer_failure
from liver.worker_runtime.preparation import Preparation, ResizeRequest, check_request
from liver.worker_runtime.stream.executor import StreamOptions
from liver.worker_runtime.world import (
    Backend,
    StoreAddress,
    World,
    WorldError,
    WorldSpec,
    build_world,
    connect_store,
)

__all__ = [
    "AbortReport",
    "CheckpointOptions",
    "FallbackReport",
    "LiveRuntime",
    "NoCheckpointConfigured",
    "NoLiveRecovery",
    "ReshardPhase",
    "ResizeRejected",
    "ResizeRequest",
    "Role",
    "RuntimeEvent",
    "RuntimeOptions",
    "SwitchReport",
    "TrainerFactory",
]

log = structlog.get_logger(__name__)

T = TypeVar("T")

_OUTCOME_POST_TIMEOUT_S = 5.0
"""Longest wait to reach the new generation's store to write a handoff's outcome (it answered moments
before, unless the process hosting it is the one that failed)."""


class ResizeRejected(HandoffError):
    """A resize request this runtime cannot take now (one is being prepared, or it left the job)."""


class NoLiveRecovery(HandoffError):
    """The world lost a peer and no live recovery will come (the state survives on no replica, say): the
    coordinator falls back to the job's checkpoint, which this process's launcher restarts it from."""

    def __init__(self, iteration: int, reason: str) -> None:
        self.iteration = iteration
        self.reason = reason
        super().__init__(
            f"no live recovery after iteration {iteration}: {reason}; restart from the checkpoint"
        )

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        return (type(self), (self.iteration, self.reason))


JOINERS_TOLD_S: Final = 10.0
"""How long a joiner whose entry broke waits to hear that the old world lost a peer before the cut
(and recovers live), and how long an old-world process tries to say so."""


class RuntimeOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How the runtime waits and streams. The same on every process of a job (``vote_every`` and
    ``stream.message_bytes`` must be)."""

    backend: Backend = "gloo"
    vote_every: int = 1
    """Vote at iterations divisible by this (the others cost nothing); a switch waits for the next vote."""
    control_timeout_s: float = 60.0
    """Longest wait of one control collective (vote, enter, adopt, progress, commit)."""
    build_timeout_s: float = 120.0
    """Longest wait for the members of a shadow world or stream group to arrive (capped by the deadline)."""
    enter_timeout_s: float = 600.0
    """How long a joiner waits in ``enter_world`` for the cut when its request has no deadline."""
    join_timeout_s: float | None = None
    """How long a process outside every world waits for a request that takes it in (None: forever)."""
    recover_timeout_s: float = 600.0
    """How long a process whose world lost a peer waits for the request that recovers it (a resize that
    names the lost devices) before it gives up (:class:`~.peers.StepAbandoned` is raised)."""
    stream: StreamOptions = StreamOptions()
    checkpoint: CheckpointOptions | None = None
    """Periodic checkpoints, and the fallback to them when a handoff loses the old world (None: neither)."""
    copies: CopyOptions | None = CopyOptions()
    """Peer copies of the state a node would take with it (``docs/architecture.md``, "Peer
    redundancy"): refreshed after every step, off the critical path (None: none are kept)."""

    def __post_init__(self) -> None:
        if self.vote_every < 1:
            raise ValueError(f"`vote_every`: must be at least 1, got {self.vote_every}")
        for field in ("control_timeout_s", "build_timeout_s", "enter_timeout_s", "recover_timeout_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"`{field}`: must be positive, got {getattr(self, field)}")
        if self.join_timeout_s is not None and not self.join_timeout_s > 0:
            raise ValueError(f"`join_timeout_s`: must be positive or None, got {self.join_timeout_s}")


class ReshardPhase(StrEnum):
    PREPARING = "preparing"  # a request was accepted; its groups are being built
    READY = "ready"  # this process could switch now
    SWITCHED = "switched"  # committed: training continues on the new world
    ABORTED = "aborted"  # given up; training continues on the old world (or a joiner keeps waiting)
    LEFT = "left"  # committed, and this process is in the new world no more
    FALLING_BACK = "falling_back"  # the handoff failed and the old world is gone: restarting from the
    # checkpoint (the event's generation is the failed one; a leaver stops here)
    FELL_BACK = "fell_back"  # restarted from the checkpoint as generation failed + 1: training goes on
    PEER_LOST = "peer_lost"  # a step or vote met a lost peer: the world is broken, the state of the event's
    # iteration kept; waiting for a resize that names the lost devices (a live recovery)


class AbortReport(msgspec.Struct, frozen=True, kw_only=True):
    """A handoff that did not happen, and why. ``iteration`` is the boundary it was given up at."""

    generation: int
    stage: HandoffStage  # prepare, cut, or the handoff stage that failed (enter, progress, build, ...)
    reason: str
    iteration: int | None
    pause_s: float = 0.0  # from the cut until training went on on the old world (a handoff's rollback)
    by_request: bool = False
    """Given up at the coordinator's word (an Abort, or a newer request): acked ``aborted``, not
    ``failed``."""


class RuntimeEvent(msgspec.Struct, frozen=True, kw_only=True):
    """What :class:`LiveRuntime` tells its ``on_event`` listener (the bus companion's worker status)."""

    generation: int
    phase: ReshardPhase
    iteration: int | None = None
    report: SwitchReport | None = None
    abort: AbortReport | None = None
    fallback: FallbackReport | None = None


@dataclass
class _Recovery(Generic[T]):
    """A live recovery between its attempts (:meth:`LiveRuntime._recover`): what it recovers from, the
    iteration it resumes from (agreeing on the cut may take it back one) and how its latest attempt
    went, which the except clause that catches a failed attempt reads."""

    abandoned: StepAbandoned  # the step given up when the peer was lost
    broken: WorldSpec  # the world that lost it
    kept: KeptState | None  # the trainer's state, kept apart from its groups (None: the factory keeps none)
    lost_at: float  # when this process met the loss (perf_counter): the recovery's pause starts there
    at: int  # the iteration of the state this process holds
    handoff: Handoff[T] | None = None  # the latest attempt's
    entered: bool = False  # the latest attempt reached its switch
    switched: tuple[T | None, SwitchReport] | None = None  # the new trainer and its report, once committed
    failure: tuple[HandoffStage, str] | None = None  # where and why the last attempt failed for good


# -- the runtime --------------------------------------------------------------------------------------------


class LiveRuntime(Generic[T]):
    """One training process's side of live reconfiguration. See the module docstring for the loop.

    ``initial`` is the world the job starts with (None, or a world without this ``device``: the process
    starts outside every world and waits in its first :meth:`step` until a resize takes it in).
    ``store`` is where the initial world's store listens. ``on_event`` hears every phase change (from
    the thread that caused it: keep it short). ``on_stream_step(generation, layer, round)`` is called
    before each streaming step (progress reports; raising cancels the handoff, which then rolls back).
    ``on_cut(generation, trainer)`` is the user's hook at the cut: called on every process of the old
    world with its trainer at the agreed iteration, before anything moves and while the old world is
    still torch's default (so it may save, log, check or run collectives on it; its time is part of the
    pause; raising gives the handoff up: the others notice at their next collective and the old world
    trains on). It is not called on a joiner, nor when the old world lost a process (a recovery).
    ``on_switch(generation, trainer)`` is called with the new world's trainer once the switch has
    committed, before its first step, on every process of the new world (in the thread that stepped).
    ``options.checkpoint`` needs a factory that can checkpoint (:class:`~.contract.Checkpoints`). What
    else the factory can do is found once, here (:class:`~.contract.JobAbilities`).
    """

    def __init__(
        self,
        factory: TrainerFactory[T],
        *,
        job: str,
        device: Device,
        store: StoreAddress | None = None,
        initial: WorldSpec | None = None,
        options: RuntimeOptions | None = None,
        on_event: Callable[[RuntimeEvent], None] | None = None,
        on_stream_step: Callable[[int, int, int], None] | None = None,
        on_cut: Callable[[int, T], None] | None = None,
        on_switch: Callable[[int, T], None] | None = None,
    ) -> None:
        if initial is not None:
            if initial.job != job:
                raise ValueError(f"`initial.job`: {initial.job!r} is not the runtime's job {job!r}")
            if initial.rank_of(device) is not None and store is None:
                raise ValueError("`store`: needed to build the initial world this device is in")
        options = options or RuntimeOptions()
        if options.backend == "nccl":
            # Megatron allocates on torch.cuda.current_device(): bind the process to its GPU before any
            # model is built, or every process of a node would build on cuda:0.
            if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
                raise ValueError(
                    f"`device`: {device} has no CUDA device {device.index} here "
                    f"({torch.cuda.device_count()} visible) for the NCCL backend"
                )
            torch.cuda.set_device(device.index)
        abilities = JobAbilities.of(factory)
        if options.checkpoint is not None and abilities.checkpointing is None:
            raise ValueError(
                f"`options.checkpoint`: the factory {type(factory).__name__} cannot save or load "
                "checkpoints (it needs save_checkpoint, fall_back and resume_latest)"
            )
        self.factory = factory
        self.abilities = abilities
        self.job = job
        self.device = device
        self.options = options
        if initial is not None:  # the world builds its distributed optimizer's instance groups too
            model = factory.model
            instances = model.ddp.instances if isinstance(model, ModelGeometry) else 1
            try:
                initial = msgspec.structs.replace(initial, instances=instances)
            except ValueError as error:
                raise ValueError(f"`initial.layout`: {str(error).partition(': ')[2]}") from None
        self._initial = initial if initial is not None and initial.rank_of(device) is not None else None
        self._initial_store = store
        self._on_event = on_event
        self._on_stream_step = on_stream_step
        self._on_cut = on_cut
        self._on_switch = on_switch
        self._cond = threading.Condition(threading.RLock())
        self._world: World | None = None
        self._trainer: T | None = None
        self._pending: Preparation | None = None  # the handoff being prepared, switched or released
        self._queued: Preparation | None = None  # a newer request, QUEUED until _pending is released
        self._newest_generation = initial.generation if initial is not None else -1
        self._left = False
        self._closed = False
        self._handed_out_at: float | None = None
        self._saved_at: int | None = None  # the iteration of the last periodic checkpoint (or the loaded one)
        self._broken: WorldSpec | None = None  # the world this process trained in until it lost a peer
        self._copies = (
            CopyManager(options.copies, factory.model, build_timeout_s=options.build_timeout_s)
            if options.copies is not None
            else None
        )
        self._no_recovery: tuple[int, str] | None = None
        """The coordinator's word that no live recovery will come: the generation it gave up for a
        checkpoint fallback, and why. It answers for a world older than that generation, whether this
        process had noticed the loss yet or not."""
        self.history: list[SwitchReport | AbortReport | FallbackReport] = []
        self._log = log.bind(job=job, device=str(device))
        self._log.debug("runtime.job_abilities", factory=type(factory).__name__, abilities=abilities.names())

    # -- what the runtime is ------------------------------------------------------------------------------
    @property
    def world(self) -> World | None:
        """The world this process trains in (None before it has one, and after it left)."""
        return self._world

    @property
    def generation(self) -> int | None:
        return None if self._world is None else self._world.generation

    @property
    def trainer(self) -> T | None:
        return self._trainer

    @property
    def left(self) -> bool:
        return self._left

    @property
    def peer_copies(self) -> PeerCopies | None:
        """This process's peer copies in its latest world (its keeper holds its sources' last complete
        copies; None before the world's first boundary, or without ``options.copies``)."""
        return None if self._copies is None else self._copies.copies

    @property
    def reports(self) -> list[SwitchReport]:
        return [r for r in self.history if isinstance(r, SwitchReport)]

    @property
    def aborts(self) -> list[AbortReport]:
        return [r for r in self.history if isinstance(r, AbortReport)]

    @property
    def fallbacks(self) -> list[FallbackReport]:
        return [r for r in self.history if isinstance(r, FallbackReport)]

    @property
    def last_switch(self) -> SwitchReport | None:
        reports = self.reports
        return reports[-1] if reports else None

    @property
    def pending_generation(self) -> int | None:
        """The newest generation requested and not yet switched to or let go of."""
        with self._cond:
            prep = self._queued or self._pending
            return None if prep is None else prep.generation

    @property
    def handoff_state(self) -> HandoffState | None:
        """The state of the pending handoff (:mod:`.generations`); None when there is none."""
        with self._cond:
            return None if self._pending is None else self._pending.state

    # -- requests (any thread) ------------------------------------------------------------------------------
    def request_resize(
        self,
        generation: int,
        layout: ParallelLayout,
        placement: Placement,
        plan: Plan | PlanSlice,
        store: StoreAddress,
        deadline: datetime | None = None,
        *,
        from_generation: int | None = None,
        switch_when_ready: bool = True,
        lost: Collection[Device] = (),
    ) -> Role:
        """Prepare the move to ``generation`` (``layout`` on ``placement``) with ``plan``; thread-safe.

        Returns this process's role. Raises ``ValueError`` naming the field that does not fit, and
        :class:`ResizeRejected` while another generation is being prepared or after this process left.
        With ``switch_when_ready=False`` the ranks vote ready only after :meth:`allow_switch` (the
        coordinator's SWITCH command); otherwise they switch at the first boundary where all are ready.
        ``lost`` names old-world devices whose processes are gone (the plan reads nothing from them): the
        groups are built without them, and a process whose world lost a peer recovers with this request.
        """
        plan = self._whole_plan(plan)
        _check_store_and_deadline(store, deadline)
        with self._cond:
            current = self._admissible(generation, lost)
            request, role, old, new = check_request(
                job=self.job,
                device=self.device,
                model=self.factory.model,
                active=self._active_spec(),
                newest_generation=self._newest_generation,
                generation=generation,
                layout=layout,
                placement=placement,
                plan=plan,
                store=store,
                deadline=deadline,
                from_generation=from_generation,
                switch_when_ready=switch_when_ready,
                lost=lost,
            )
            prep = Preparation(request, role, old, new, queued=current is not None)
            self._newest_generation = generation
            superseded = self._accept(prep, current, generation)
            self._cond.notify_all()
        self._log.info(
            "runtime.resize_requested",
            generation=generation,
            role=str(role),
            layout=layout.describe(),
            queued_behind=None if current is None else current.generation,
        )
        if superseded is not None:
            self._ended(superseded, HandoffStage.PREPARE, None)
        self._emit(RuntimeEvent(generation=generation, phase=ReshardPhase.PREPARING))
        return role

    def _whole_plan(self, plan: Plan | PlanSlice) -> Plan:
        """The plan a request hands in, whole: a slice must be this process's own."""
        if isinstance(plan, PlanSlice):
            if plan.device != self.device:
                raise ValueError(
                    f"`plan.device`: the slice is for {plan.device}, this process runs on {self.device}"
                )
            plan = plan.to_plan()
        if not isinstance(plan, Plan):
            raise ValueError(f"`plan`: expected a Plan or PlanSlice, got {type(plan).__name__}")
        return plan

    def _admissible(self, generation: int, lost: Collection[Device]) -> Preparation | None:
        """Whether a request for ``generation`` may come now (the caller holds the lock): the pending
        handoff it would supersede, if any; :class:`ResizeRejected` when it may not."""
        if self._left or self._closed:
            raise ResizeRejected(f"generation {generation}: this process has left the job")
        current = self._pending
        if current is not None and not current.supersedable:
            raise ResizeRejected(
                f"generation {generation}: generation {current.generation} has the coordinator's "
                f"Switch ({current.state.value}); only an abort can end it now"
            )
        if self._broken is not None and not lost:
            raise ResizeRejected(
                f"generation {generation}: this process's world (generation {self._broken.generation}) "
                "lost a peer; only a recovery that names the lost devices can follow"
            )
        return current

    def _accept(self, prep: Preparation, current: Preparation | None, generation: int) -> Preparation | None:
        """Make ``prep`` the pending handoff, or queue it behind ``current`` (the caller holds the lock);
        returns the request it pushed out of the queue, for the caller to report once the lock is let go."""
        if current is None:
            self._pending = prep
            if prep.role is not Role.JOIN and (self._world is not None or self._broken is not None):
                self._start_preparation(prep)
            return None
        # A newer request supersedes the pending one: it is given up at the next boundary (by the
        # vote, where every rank built it) and this one starts then. Never two shadow worlds.
        current.request_abort(f"superseded by generation {generation}")
        superseded, self._queued = self._queued, prep
        if superseded is not None:  # queued and never started: nothing to let go of
            why = f"superseded by generation {generation}"
            superseded.request_abort(why)
            superseded.release(f"aborted by request: {why}", by_request=True)
        return superseded

    def _active_spec(self) -> WorldSpec | None:
        """The world this process is in, for a request's check: the one it trains in, the one it lost a
        peer of (its state is still that world's), or the one it starts in."""
        if self._world is not None:
            return self._world.spec
        return self._broken if self._broken is not None else self._initial

    def _start_preparation(self, prep: Preparation) -> None:
        """Start building the shadow world, the stream group and the schedule, and the layout check."""
        opts = self.options
        prep.start(self.device, opts.backend, opts.build_timeout_s, opts.stream, self._layout_check(prep))

    def _layout_check(self, prep: Preparation) -> Callable[[], None] | None:
        """The factory's check of the new layout's model (``check_layout``, optional), run once per
        handoff, by the process that will hold new rank 0, beside training."""
        checks = self.abilities.layout_checks
        if checks is None or prep.request.placement.devices[0] != self.device:
            return None
        layout = prep.request.layout
        return lambda: checks.check_layout(layout)

    def allow_switch(self, generation: int) -> None:
        """The coordinator's SWITCH: ``generation`` may be switched to once every rank is ready."""
        with self._cond:
            for prep in (self._pending, self._queued):
                if prep is not None and prep.generation == generation:
                    prep.request_switch()
                    self._cond.notify_all()

    def wait_prepared(self, timeout_s: float) -> bool:
        """Block until the pending generation's groups are built (True) or have failed or ``timeout_s``
        passed (False). For a loop that would rather pause at this boundary than switch at a later one
        (benchmarks, tests); it is a local wait, no collective, so every rank may call it or not."""
        with self._cond:
            prep = self._pending
        if prep is None or not prep.started:
            return False
        try:
            prep.wait_built(timeout_s)
        except (TimeoutError, WorldError):
            return False
        return True

    def abort(self, generation: int, reason: str, *, fallback: bool = False) -> None:
        """Give ``generation`` up (thread-safe): it is let go of at this process's next boundary (by the
        vote there when every rank built it), and a newer request goes ahead then. A no-op for other
        generations, but for a process whose world lost a peer and that waits for its recovery:
        ``fallback`` (the coordinator restarts the job from its checkpoint instead) ends that wait with
        :class:`NoLiveRecovery`, whichever generation it names."""
        dropped: Preparation | None = None
        with self._cond:
            if self._pending is not None and self._pending.generation == generation:
                self._pending.request_abort(reason)
            elif self._queued is not None and self._queued.generation == generation:
                dropped, self._queued = self._queued, None  # queued: never started, nothing to let go of
                dropped.request_abort(reason)
                dropped.release(f"aborted by request: {reason}", by_request=True)
            if fallback and (self._no_recovery is None or generation > self._no_recovery[0]):
                self._no_recovery = (generation, f"generation {generation} aborted: {reason}")
            self._cond.notify_all()
        if dropped is not None:
            self._ended(dropped, HandoffStage.PREPARE, None)

    # -- the training loop's call -------------------------------------------------------------------------
    def step(self) -> T | None:
        """The iteration boundary: the trainer for the next iteration, or None once this process left.

        Call it after the previous iteration's work has drained (its optimizer step is done), with the
        same sequence of iterations on every rank.
        """
        now = time.perf_counter()
        self._note_first_step(now)
        if self._left or self._closed:
            return None
        if self._trainer is None:
            return self._start()
        abandoned = self._abandoned_step()
        if abandoned is not None:
            return self._recover(abandoned)
        assert self._world is not None
        iteration = self.factory.iteration(self._trainer)
        lost: StepAbandoned | None = None
        try:
            self._save_if_due(iteration)
        except Exception as error:
            if not is_peer_failure(error):
                raise
            lost = StepAbandoned(iteration, _first_line(error))
        if lost is not None:  # recovered outside the except block: see _recover
            return self._recover(lost)
        if self._copies is not None:
            feeds = self.abilities.peer_copies
            self._copies.at_boundary(
                self._world,
                self._trainer,
                iteration,
                self.factory.local_state if feeds is None else feeds.copy_state,
                None if feeds is None else feeds.gate_updates,
                self.factory.progress,
            )
        if iteration % self.options.vote_every:
            return self._trainer
        prep = self._settle(iteration)
        with self._cond:
            if prep is not None and not prep.started:
                self._start_preparation(prep)
            target = prep.generation if prep is not None else NO_TARGET
            readiness = prep.readiness() if prep is not None else Readiness.NONE
            failure = prep.failure() if prep is not None else None
        try:
            decision = vote(
                self._world,
                iteration=iteration,
                target=target,
                ready=readiness,
                failed=failure is not None,
                timeout=timedelta(seconds=self.options.control_timeout_s),
            )
        except Exception as error:
            if not is_peer_failure(error):
                raise
            lost = StepAbandoned(iteration, _first_line(error))
        if lost is not None:
            return self._recover(lost)
        cut_at = time.perf_counter()
        if prep is None or decision.verdict is CutVerdict.WAIT:
            return self._trainer
        if decision.verdict is CutVerdict.BUILD:
            self._prebuild(prep, iteration)
            return self._trainer
        if decision.verdict is CutVerdict.ABORT:
            if not decision.aborts(prep.generation):
                return self._trainer  # another rank failed an older generation this one already let go of
            if prep.agreed_build:
                self._agree_on_default()
            why = failure or f"generation {decision.failed} failed on another rank"
            self._give_up(prep, HandoffStage.CUT, why, iteration)
            return self._trainer
        if self._copies is not None:
            self._copies.settle()  # nothing reads the old trainer's tensors once the handoff may free them
        return self._switch(prep, iteration, cut_at)

    def _settle(self, iteration: int | None) -> Preparation | None:
        """At a boundary, before the vote: apply what the coordinator sent since the last one (an abort,
        a newer request, a Switch) and what failed here; let go of a handoff given up at the
        coordinator's word that no vote agreed to build (no collective to undo, and every rank gets the
        same Abort), which starts the request queued behind it. The pending handoff afterwards."""
        with self._cond:
            prep = self._pending
            if prep is None:
                return None
            prep.settle()
            local = prep.state is HandoffState.RELEASING and prep.released_by_request
            if not local or prep.agreed_build:
                return prep
        self._give_up(prep, HandoffStage.PREPARE, prep.release_reason or "aborted by request", iteration)
        with self._cond:
            prep = self._pending
            if prep is not None:
                prep.settle()
            return prep

    def close(self) -> None:
        """Release everything this runtime holds (the end of training)."""
        with self._cond:
            self._closed = True
            prep, self._pending, self._queued = self._pending, None, None
            self._cond.notify_all()  # a process waiting to join (or to recover) stops waiting
        if prep is not None:
            prep.discard()
        if self._copies is not None:
            self._copies.close()
        self._trainer = None
        if self._world is not None:
            self._world.release()
            self._world = None

    def __enter__(self) -> LiveRuntime[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------------
    def _start(self) -> T:
        """The first boundary: build the initial world, or wait to be taken into one."""
        if self._initial is None:
            return self._join()
        assert self._initial_store is not None
        timeout = timedelta(seconds=self.options.build_timeout_s)
        world = build_world(
            self._initial, self.device, self._initial_store, backend=self.options.backend, timeout=timeout
        )
        try:
            world.adopt_as_default(timedelta(seconds=self.options.control_timeout_s))
            trainer = self._resumed(world) or self.factory.build(world)
        except BaseException:
            world.release()
            raise
        self._world, self._trainer = world, trainer
        self._log.info(
            "runtime.started",
            generation=world.generation,
            rank=world.rank,
            iteration=self.factory.iteration(trainer),
        )
        return trainer

    def _resumed(self, world: World) -> T | None:
        """The first world's trainer from the latest checkpoint, when checkpoints are configured with
        ``resume`` and one exists: a restarted job goes on from there instead of starting over."""
        checkpoint = self.options.checkpoint
        if checkpoint is None or not checkpoint.resume:
            return None
        factory = self._checkpoints()
        resumed = factory.resume_latest(world, checkpoint.root)
        if resumed is None:
            return None
        trainer, path = resumed
        self._saved_at = self.factory.iteration(trainer)
        self._log.warning(
            "runtime.resumed_from_checkpoint", checkpoint=path, iteration=self._saved_at, rank=world.rank
        )
        return trainer

    def _prebuild(self, prep: Preparation, iteration: int | None) -> None:
        """The vote said BUILD: build the new trainer now, at this boundary (see :func:`.handoff.prebuild`).

        A failure is this process's vote from now on (the next boundary aborts the handoff everywhere);
        the groups are released at once, so that peers waiting in one of their collectives fail now
        instead of at the control timeout."""
        if iteration is not None:
            prep.agreed_build = True
        timeout = self.options.control_timeout_s if iteration is not None else self.options.enter_timeout_s
        try:
            assert prep.stream_build is not None
            prebuilt = prebuild(
                self.factory,
                builds_for_stream=self.abilities.stream_builds,
                new_world=prep.world_build.result(timeout=0) if prep.world_build is not None else None,
                old_world=self._world,
                stream=prep.stream_build.result(),
                iteration=iteration,
                timeout=timedelta(seconds=prep.seconds_left(timeout)),
                schedule=prep.schedule(),
            )
        except Exception as error:
            text = str(error).splitlines()[0][:500] if str(error) else repr(error)
            self._log.warning("runtime.prebuild_failed", generation=prep.generation, error=text)
            with self._cond:
                prep.build_failed(text)
            prep.discard()
            if iteration is None:  # a joiner: the caller gives the handoff up
                raise
            return
        with self._cond:
            prep.built(prebuilt, self.factory.dispose)
        self._emit(RuntimeEvent(generation=prep.generation, phase=ReshardPhase.READY, iteration=iteration))

    def _agree_on_default(self) -> None:
        """After a handoff given up past its build, agree again on the old world as the default (the
        build moved this process's group-name counter; see :meth:`World.restore_default`). A collective
        over the old world, reached by every rank at the same vote; a world that cannot agree any more
        fails its next step as it would have anyway."""
        assert self._world is not None
        try:
            self._world.adopt_as_default(timedelta(seconds=self.options.control_timeout_s))
        except Exception as error:
            self._log.warning("runtime.default_not_agreed", error=repr(error)[:300])

    def _handoff(
        self,
        prep: Preparation,
        new_world: World | None,
        iteration: int | None,
        join_timeout: float,
        *,
        broken: bool = False,
        kept: KeptState | None = None,
    ) -> Handoff[T]:
        assert prep.stream_build is not None
        return Handoff(
            factory=self.factory,
            plan=prep.request.plan,
            device=self.device,
            stream=prep.stream_build.result(),
            old_world=self._world,
            new_world=new_world,
            old_trainer=None if kept is not None else self._trainer,
            iteration=iteration,
            from_generation=prep.request.from_generation,
            control_timeout=timedelta(seconds=self.options.control_timeout_s),
            join_timeout=timedelta(seconds=join_timeout),
            stream_options=self.options.stream,
            on_stream_step=self._on_stream_step,
            on_cut=self._on_cut,
            schedule=prep.schedule(),
            prebuilt=prep.prebuilt,
            lost=prep.request.lost,
            broken=broken or kept is not None,
            kept=kept,
        )

    def _switch(self, prep: Preparation, iteration: int, cut_at: float) -> T | None:
        new_world = prep.world_build.result(timeout=0) if prep.world_build is not None else None
        handoff = self._handoff(prep, new_world, iteration, self.options.control_timeout_s)
        old_trainer = self._trainer
        self._trainer = None
        recovery: StepAbandoned | None = None
        try:
            new_trainer, report = switch(handoff, cut_at)
        except HandoffAborted as aborted:
            kept = HandoffOutcome(
                verdict=OutcomeVerdict.KEPT, reached_iteration=iteration, reason=aborted.reason
            )
            agreed = self._post_outcome(prep, kept)
            if agreed.verdict is OutcomeVerdict.KEPT:
                self._trainer = old_trainer
                self._give_up(prep, aborted.stage, aborted.reason, iteration, time.perf_counter() - cut_at)
                return self._trainer
            # Another survivor found the old world gone: it can no longer be trusted here either.
            failed = HandoffFailed(prep.generation, aborted.stage, aborted.reason, agreed.reason)
            if agreed.verdict is OutcomeVerdict.RECOVER:
                recovery = self._recoverable(old_trainer, iteration, failed)
        except HandoffFailed as error:
            # Fail-stop: the old world is gone (switch released it). Tell the joiners, and any other
            # survivor, what became of the handoff: a live recovery when this process's state of the cut
            # survives whole (I4: nothing of the handoff touched it), else the checkpoint.
            failed = error
            recovery = self._recoverable(old_trainer, iteration, failed)
            if recovery is not None:
                verdict = OutcomeVerdict.RECOVER
            elif self.options.checkpoint is None:
                verdict = OutcomeVerdict.LOST
            else:
                verdict = OutcomeVerdict.FALLBACK
            agreed = self._post_outcome(
                prep, HandoffOutcome(verdict=verdict, reached_iteration=iteration, reason=str(failed))
            )
            if agreed.verdict is not OutcomeVerdict.RECOVER:
                recovery = None
        except BaseException:
            self._forget(prep, "the switch raised")
            self._world = None
            raise
        else:
            del old_trainer
            return self._committed(prep, report, new_world, new_trainer)
        # Only the failure's words go on: its traceback (the restore's all-reduce frames) and the handoff
        # hold the old world's groups, and the peers still waiting in its collectives fail only once
        # they go.
        failed.__traceback__ = failed.__cause__ = failed.__context__ = None
        del handoff
        if recovery is not None:
            # Outside the except block (see _recover). The handoff ends here without an abort of its
            # own: the coordinator learns of the loss from PEER_LOST and plans the recovery around it.
            self._forget(prep, "the old world lost a peer during the switch")
            self._trainer = old_trainer
            del old_trainer
            self._log.warning(
                "runtime.handoff_lost_a_peer",
                generation=prep.generation,
                iteration=iteration,
                error=str(failed),
            )
            return self._recover(recovery)
        # Nothing of the old world can train any more (releasing it twice is harmless).
        assert self._world is not None
        self._world.release()
        self._world = None
        del old_trainer
        gc.collect()  # Megatron's modules hold the groups in reference cycles
        return self._fail_stop(prep, failed, iteration, cut_at)

    def _join(self) -> T:
        """Wait outside every world until a request takes this process in, then join at its cut."""
        limit = self.options.join_timeout_s
        give_up_at = None if limit is None else time.monotonic() + limit
        while True:
            prep = self._wait_for_request(give_up_at)
            new_rank = prep.request.placement.devices.index(self.device)
            try:
                started = time.perf_counter()
                self.factory.warm_up(prep.request.layout, new_rank)
                prep.warmup_s = time.perf_counter() - started
                self._start_preparation(prep)
                prep.wait_built(prep.seconds_left(self.options.build_timeout_s))
                self._prebuild(prep, None)  # with the old world's ranks, at the boundary they agree on
                assert prep.world_build is not None
                handoff = self._handoff(
                    prep,
                    prep.world_build.result(timeout=0),
                    None,
                    prep.seconds_left(self.options.enter_timeout_s),
                )
                new_trainer, report = switch(handoff, None)
            except HandoffAborted as aborted:
                failed_at = time.perf_counter()
                if prep.abort_requested is not None:  # the coordinator gave it up: nothing to learn
                    self._give_up(prep, aborted.stage, aborted.reason, None)
                    continue
                outcome = self._joiners_outcome(prep, aborted)
                if outcome is not None and outcome.verdict is OutcomeVerdict.RECOVER:
                    # The old world lost a peer and recovers live: say so (the coordinator finds the
                    # lost one sooner) and wait for the next request, which may take this process in.
                    self._forget(prep, "the old world lost a peer")
                    self._log.warning("runtime.join_lost_a_peer", generation=prep.generation)
                    self._emit(
                        RuntimeEvent(
                            generation=prep.request.from_generation,
                            phase=ReshardPhase.PEER_LOST,
                            iteration=outcome.reached_iteration,
                        )
                    )
                    continue
                if outcome is not None and outcome.verdict is OutcomeVerdict.FALLBACK:
                    failed = HandoffFailed(prep.generation, aborted.stage, aborted.reason, outcome.reason)
                    trainer = self._fail_stop(prep, failed, outcome.reached_iteration, failed_at)
                    assert trainer is not None
                    return trainer
                self._give_up(prep, aborted.stage, aborted.reason, None)
                continue
            except (WorldError, TimeoutError, RuntimeError) as error:
                self._give_up(
                    prep,
                    HandoffStage.PREPARE,
                    str(error).splitlines()[0] if str(error) else repr(error),
                    None,
                )
                continue
            assert new_trainer is not None
            trainer = self._committed(prep, report, handoff.new_world, new_trainer)
            assert trainer is not None
            return trainer

    # -- a peer lost outside a handoff: live recovery ------------------------------------------------------
    def _recoverable(self, trainer: T | None, iteration: int, failed: HandoffFailed) -> StepAbandoned | None:
        """After a handoff that lost an old-world peer: the trainer marked broken at the cut, when the
        factory can keep its state, that state is whole and the old layout keeps a copy of everything
        on a second process (the factory's ``survives_one_loss``); else None: the checkpoint, as
        before. Which peer is gone is the coordinator's to find; a loss the replicas do not cover after
        all ends the recovery's wait with its ``Abort(fallback=True)``."""
        recovery = self.abilities.live_recovery
        if trainer is None or recovery is None or self._world is None:
            return None
        if not recovery.survives_one_loss(self._world.layout):
            return None
        abandoned = recovery.abandon(trainer, iteration, f"generation {failed.generation}: {failed}")
        return None if abandoned.torn else abandoned

    def _checkpoints(self) -> Checkpoints[T]:
        """The factory as it checkpoints (only called with ``options.checkpoint``, which the constructor
        refuses for a factory that cannot)."""
        checkpoints = self.abilities.checkpointing
        assert checkpoints is not None
        return checkpoints

    def _abandoned_step(self) -> StepAbandoned | None:
        """The trainer's abandoned step, when its last step met a lost peer (the factory's optional
        ``abandoned(trainer)``; ``MegatronJob`` has it)."""
        recovery = self.abilities.live_recovery
        return recovery.abandoned(self._trainer) if recovery is not None else None

    def _recover(self, abandoned: StepAbandoned) -> T | None:
        """The active world lost a peer outside a handoff: keep the state of the last completed iteration
        and move to the world the recovery request names, streaming from the surviving replicas.

        The broken world's groups are destroyed first, so that every peer still waiting in one of its
        collectives fails now instead of at its timeout. Then this process waits, as a joiner does, for
        the request that names the lost devices (the coordinator sends it when it learns of the loss),
        builds the new world and the stream group without them, and runs the switch with its kept
        trainer as the source and the iteration it completed as its side of the cut (the new world's
        members agree on it in ``enter_world``; survivors that disagree cannot recover live). Whatever
        fails on the way falls back to the checkpoint (or raises, without one): there is no old world
        to return to.
        """
        assert self._world is not None and self._trainer is not None
        lost_at = time.perf_counter()
        broken = self._world.spec
        abandoned = self._leave_broken_world(abandoned, broken)
        self._drop_stale_handoff(broken, abandoned.iteration)
        kept = self._keep_state(abandoned)
        self._emit(
            RuntimeEvent(
                generation=broken.generation, phase=ReshardPhase.PEER_LOST, iteration=abandoned.iteration
            )
        )
        if abandoned.torn and kept is None:
            raise abandoned
        rec: _Recovery[T] = _Recovery(abandoned, broken, kept, lost_at, at=abandoned.iteration)
        prep = self._recovery_attempts(rec)
        if rec.failure is not None:
            return self._recovery_failed(rec, prep, rec.failure)
        assert rec.handoff is not None and rec.switched is not None
        self._broken = None
        new_trainer, report = rec.switched
        return self._committed(prep, report, rec.handoff.new_world, new_trainer)

    def _leave_broken_world(self, abandoned: StepAbandoned, broken: WorldSpec) -> StepAbandoned:
        """Mark the trainer's step abandoned (when the vote or a checkpoint found the loss, not the step)
        and release the broken world, so that its peers waiting in a collective fail now."""
        assert self._world is not None and self._trainer is not None
        recovery = self.abilities.live_recovery
        if recovery is not None and self._abandoned_step() is None:  # the vote or a checkpoint found it
            abandoned = recovery.abandon(self._trainer, abandoned.iteration, abandoned.reason)
        self._log.warning(
            "runtime.peer_lost",
            generation=broken.generation,
            iteration=abandoned.iteration,
            torn=abandoned.torn,
            error=abandoned.reason,
        )
        self._world.release()
        self._world = None
        return abandoned

    def _drop_stale_handoff(self, broken: WorldSpec, iteration: int) -> None:
        """Record the broken world, and drop a handoff prepared before the loss: it cannot happen any more.

        It ends here without an abort of its own (an abort would read as this worker failing it): the
        coordinator, told of the loss by PEER_LOST, plans it again around the lost devices. Its groups
        and prebuilt trainer go with the collection in :meth:`_keep_state`, so that its joiners, waiting
        to enter its world, fail at once."""
        with self._cond:
            self._broken = broken
            stale = self._pending if self._pending is not None and not self._pending.request.lost else None
        if stale is None:
            return
        self._tell_joiners(stale, broken, iteration)
        self._forget(stale, "the world lost a peer")
        self._log.warning("runtime.handoff_dropped", generation=stale.generation, why="the world lost a peer")

    def _keep_state(self, abandoned: StepAbandoned) -> KeptState | None:
        """The trainer's state to recover from, or None when it is torn and no copy mends it.

        Keep only the state: the trainer's objects hold the broken world's groups, whose connections
        close (and wake the peers waiting in them) only once nothing refers to them. For the same reason
        this runs outside any except block: a caught failure's frames hold them too."""
        recovery = self.abilities.live_recovery
        kept: KeptState | None = None
        # A torn state (a loss after the update began) is whole again from this process's own copy of
        # the iteration it completed, where the copies keep one (CopyOptions.go_back).
        mend = abandoned.torn and self._copies is not None and self._copies.can_go_back(abandoned.iteration)
        if recovery is not None and (mend or not abandoned.torn):
            kept = recovery.keep_state(self._trainer)
        else:
            gc.collect()
        if self._copies is not None:
            # The sender may still be reading the last refresh from the kept tensors, which the
            # recovery frees once it commits (a send to a lost keeper fails at once).
            self._copies.settle()
        return kept

    def _recovery_attempts(self, rec: _Recovery[T]) -> Preparation:
        """Try recovery requests until one switches or fails for good (``rec.switched`` or
        ``rec.failure``); returns the last one. A request the coordinator gives up before its switch
        touched nothing of the kept state: the next one is waited for."""
        give_up_at = time.monotonic() + self.options.recover_timeout_s
        while True:
            prep = self._wait_for_recovery(rec.abandoned, give_up_at)
            if not prep.started:
                self._start_preparation(prep)
            rec.handoff, rec.entered = None, False
            try:
                rec.switched = self._recovery_attempt(prep, rec)
            except (HandoffAborted, WorldError, TimeoutError, RuntimeError) as error:
                stage = error.stage if isinstance(error, HandoffAborted) else HandoffStage.PREPARE
                reason = error.reason if isinstance(error, HandoffAborted) else _first_line(error)
                if not rec.entered and prep.abort_requested is not None and self._no_recovery_for() is None:
                    # The coordinator gave this recovery up before its switch (it found another member
                    # of the world lost, say): nothing touched the kept state; wait for the next one.
                    rec.handoff = None
                    self._give_up(prep, stage, reason, None)
                    continue
                rec.failure = (stage, reason)
            else:
                rec.failure = None
            return prep

    def _recovery_attempt(self, prep: Preparation, rec: _Recovery[T]) -> tuple[T | None, SwitchReport]:
        """One recovery request, from its groups to its switch's commit; raises where it fails."""
        prep.wait_built(prep.seconds_left(self.options.build_timeout_s))
        self._prebuild(prep, None)
        self._settle_recovery_cut(prep, rec)
        self._await_allowed(prep)
        new_world = prep.world_build.result(timeout=0) if prep.world_build is not None else None
        rec.handoff = self._handoff(prep, new_world, rec.at, self.options.control_timeout_s, kept=rec.kept)
        rec.entered = True
        return switch(rec.handoff, rec.lost_at)

    def _settle_recovery_cut(self, prep: Preparation, rec: _Recovery[T]) -> None:
        """With peer copies, agree with the other survivors on the iteration to resume from (``rec.at``)
        and take the kept state to it; a copy that cannot be used fails in the switch, not here."""
        if self._copies is None:
            return
        kept = rec.kept
        if kept is None:  # nothing to go back with or send from
            try:
                self._agree_on_cut(prep, rec.broken, {rec.at})
            except CopyError as error:
                raise WorldError(str(error)) from None
            return
        kept.stand_ins, kept.copy_failure = {}, None  # this attempt's plan decides
        try:
            rec.at = self._recover_copies(prep, rec.broken, rec.at, kept, torn=rec.abandoned.torn)
        except CopyError as error:
            # Failed in the switch, where the peers fail with it at once (not here, where
            # they would wait for this process's sends until their timeout).
            kept.copy_failure = str(error)
            self._log.error("runtime.copy_unusable", reason=kept.copy_failure)

    def _recovery_failed(
        self, rec: _Recovery[T], prep: Preparation, failure: tuple[HandoffStage, str]
    ) -> T | None:
        """A recovery that failed for good: say so through the recovery's store, let the kept state go
        and fall back to the checkpoint (or raise, without one)."""
        stage, reason = failure
        lost_peer = f"generation {rec.broken.generation} lost a peer ({rec.abandoned.reason})"
        failed = HandoffFailed(prep.generation, stage, reason, lost_peer)
        verdict = OutcomeVerdict.LOST if self.options.checkpoint is None else OutcomeVerdict.FALLBACK
        self._post_outcome(
            prep,
            HandoffOutcome(verdict=verdict, reached_iteration=rec.abandoned.iteration, reason=str(failed)),
        )
        old_trainer, self._trainer, self._broken = self._trainer, None, None
        rec.handoff = None
        if rec.kept is not None:
            rec.kept.dispose()
        elif old_trainer is not None:
            self.factory.dispose(old_trainer)
        del old_trainer
        return self._fail_stop(prep, failed, rec.abandoned.iteration, time.perf_counter())

    def _recover_copies(
        self, prep: Preparation, broken: WorldSpec, at: int, kept: KeptState, *, torn: bool = False
    ) -> int:
        """The iteration this recovery resumes from (:meth:`_agree_on_cut`), with ``kept`` taken back to
        it from this process's own copy when that is the one before, or when ``kept`` is ``torn`` (an
        update began: its own copy of ``at`` is the state whole), and the peer copies it stands in
        with unpacked. :class:`~.copies.wire.CopyError` when a copy is missing, behind for good or bad;
        the offer is made either way, so that no peer waits for it."""
        assert self._copies is not None
        offer = {at, at - 1} if self._copies.can_go_back(at - 1) else {at}
        old_rank = broken.placement.rank_on().get(self.device)
        missing: CopyError | None = None
        copies: dict[int, KeptCopy] = {}
        try:
            copies = self._copies.stand_in_copies(prep.request.plan, broken, old_rank)
        except CopyError as error:
            missing, offer = error, set()
        behind = [r for r, copy in copies.items() if copy.iteration == at - 1]
        for copy in copies.values():
            offer &= {copy.iteration}
        if missing is not None:
            with contextlib.suppress(CopyError):  # it offered nothing: its peers fail with it
                self._agree_on_cut(prep, broken, offer)
            raise missing
        why = f"the peer copy of old rank {behind[0]} is a step behind ({IN_REFRESH}) and " if behind else ""
        cut = self._agree_on_cut(prep, broken, offer, why)
        if cut != at or torn:
            kept.go_back(*self._copies.own_state(cut, list(kept.state)))
            self._log.warning("runtime.went_back", generation=broken.generation, iteration=cut, torn=torn)
        kept.stand_ins = self._copies.stand_ins(copies, broken.generation, cut)
        return cut

    def _agree_on_cut(
        self,
        prep: Preparation,
        broken: WorldSpec,
        offer: set[int],
        why: str = "",
    ) -> int:
        """The iteration every survivor resumes from: the latest all of them offer in the recovery's
        store (each its own, and the one before when it still has its own copy of it; a keeper whose
        copy of a lost peer is a step behind, the loss having hit its refresh, only that one). None in
        common: :class:`~.copies.wire.CopyError`, after ``why``."""
        old_rank = broken.placement.rank_on().get(self.device)
        lost = set(prep.request.lost)
        survivors = [r for r, d in enumerate(broken.placement.devices) if d not in lost]
        key = f"{self.job}/g{prep.generation}/recovery/cut"
        try:
            store = connect_store(prep.request.store, timedelta(seconds=self.options.control_timeout_s))
            store.set(f"{key}/{old_rank}", ",".join(str(i) for i in sorted(offer)))
            store.wait([f"{key}/{r}" for r in survivors])
            offers = {r: store.get(f"{key}/{r}").decode() for r in survivors}
        except (RuntimeError, OSError, TimeoutError) as error:  # the store refused or timed out
            raise CopyError(f"the survivors' offers of an iteration to resume from: {error}") from None
        common = set(offer)
        for text in offers.values():
            common &= {int(i) for i in text.split(",") if i}
        if not common:
            raise CopyError(
                f"{why}the survivors can resume from no common iteration (offers by old rank: {offers})"
            )
        return max(common)

    def _no_recovery_for(self) -> str | None:
        """Why no live recovery will come for the broken world (the caller holds the lock), or None."""
        broken, word = self._broken, self._no_recovery
        if broken is None or word is None or word[0] <= broken.generation:
            return None
        return word[1]

    def _await_allowed(self, prep: Preparation) -> None:
        """Wait for the coordinator's SWITCH (a request that switches when ready has it already): the
        recovery's point of no return is the coordinator's, as a handoff's is. An abort, or the deadline,
        raises."""
        end = time.monotonic() + prep.seconds_left(self.options.control_timeout_s)
        with self._cond:
            while not prep.allowed:
                problem = prep.failure()
                if problem is not None:
                    raise WorldError(problem)
                left = end - time.monotonic()
                if left <= 0:
                    raise WorldError(f"no switch for generation {prep.generation} in time")
                self._cond.wait(left)
            if prep.state is HandoffState.READY:  # built before the Switch came (the coordinator's order)
                prep.move(HandoffState.SWITCHING, "the coordinator's Switch")

    def _wait_for_recovery(self, abandoned: StepAbandoned, give_up_at: float) -> Preparation:
        """The pending request that names lost devices (started or not), once it comes. A resize planned
        before the loss, or a recovery given up before it started, is let go of here."""
        while True:
            released: Preparation | None = None
            with self._cond:
                prep = self._pending
                if prep is not None:
                    prep.settle()
                    if prep.state is not HandoffState.RELEASING and prep.request.lost:
                        return prep
                    released = prep
                else:
                    if self._closed:
                        raise ResizeRejected("the runtime was closed while waiting for a recovery")
                    no_recovery = self._no_recovery_for()
                    if no_recovery is not None:
                        self._log.error("runtime.no_live_recovery", reason=no_recovery)
                        raise NoLiveRecovery(abandoned.iteration, no_recovery)
                    left = give_up_at - time.monotonic()
                    if left <= 0:
                        self._log.error("runtime.not_recovered", timeout_s=self.options.recover_timeout_s)
                        raise abandoned
                    self._cond.wait(left)
                    continue
            why = released.release_reason
            if why is None:  # a resize planned before the loss: it cannot happen now
                why = "the world lost a peer; only a recovery that names the lost devices can follow"
            self._give_up(released, HandoffStage.PREPARE, why, None)

    # -- checkpoints and the fail-stop fallback --------------------------------------------------------------
    def _save_if_due(self, iteration: int) -> None:
        """The periodic checkpoint: at every ``every``-th boundary, once (a collective over the world)."""
        checkpoint = self.options.checkpoint
        if checkpoint is None or checkpoint.every is None or iteration == 0 or iteration % checkpoint.every:
            return
        if self._saved_at == iteration:
            return
        assert self._trainer is not None
        factory = self._checkpoints()
        started = time.perf_counter()
        path = factory.save_checkpoint(self._trainer, checkpoint.root, checkpoint.keep_last)
        self._saved_at = iteration
        self._log.info(
            "runtime.checkpoint_saved",
            iteration=iteration,
            checkpoint=path,
            seconds=round(time.perf_counter() - started, 4),
        )

    def _post_outcome(self, prep: Preparation, outcome: HandoffOutcome) -> HandoffOutcome:
        """Tell the joiners (and any other survivor) what this old-world process found; the outcome
        every process follows. Where the store cannot be reached, this process's own finding stands."""
        try:
            return post_outcome(
                prep.request.store,
                self.job,
                prep.generation,
                outcome,
                timedelta(seconds=min(self.options.control_timeout_s, _OUTCOME_POST_TIMEOUT_S)),
            )
        except RuntimeError as error:
            self._log.warning(
                "runtime.outcome_not_posted", generation=prep.generation, error=repr(error)[:300]
            )
            return outcome

    @property
    def _joiners_told(self) -> timedelta:
        """How long the word of an old world that lost a peer before the cut may take (both ways)."""
        return timedelta(seconds=min(self.options.control_timeout_s, JOINERS_TOLD_S))

    def _tell_joiners(self, stale: Preparation, broken: WorldSpec, iteration: int) -> None:
        """The world lost a peer while a handoff with joiners was prepared (its SWITCH may be out): say
        in its store that the old world recovers live, so that its joiners, whose entry now breaks,
        report the loss (and wait to be taken in by the recovery) instead of failing the handoff, which
        the coordinator could not tell from a failure past the cut. In the background: the store's host
        may be the lost process, and the recovery must not wait for it."""
        if not set(stale.request.placement.devices) - set(broken.placement.devices):
            return
        outcome = HandoffOutcome(
            verdict=OutcomeVerdict.RECOVER,
            reached_iteration=iteration,
            reason=f"generation {broken.generation} lost a peer before the cut",
        )

        def post() -> None:
            try:
                post_outcome(
                    stale.request.store,
                    self.job,
                    stale.generation,
                    outcome,
                    self._joiners_told,
                )
            except (RuntimeError, OSError) as error:  # a store that is gone: the joiners fail the entry
                self._log.warning("runtime.joiners_not_told", generation=stale.generation, error=str(error))

        threading.Thread(target=post, name="liver-tell-joiners", daemon=True).start()

    def _joiners_outcome(self, prep: Preparation, aborted: HandoffAborted) -> HandoffOutcome | None:
        """What the old world found, for a joiner whose handoff broke. One that broke while entering
        never met the old world's processes past the cut: they gave the handoff up before it began, and
        only one that lost a peer says so (:meth:`_tell_joiners`: this waits a moment for that); a
        recovery (a request naming lost devices) has no old world to go back to, whatever the stage."""
        if aborted.stage == HandoffStage.ENTER and not prep.request.lost:
            told = await_outcome(prep.request.store, self.job, prep.generation, self._joiners_told)
            return told if told is not None and told.verdict is OutcomeVerdict.RECOVER else None
        return await_outcome(
            prep.request.store,
            self.job,
            prep.generation,
            timedelta(seconds=self.options.control_timeout_s),
        )

    def _fail_stop(
        self, prep: Preparation, failed: HandoffFailed, reached: int | None, failed_at: float
    ) -> T | None:
        """The handoff to ``prep`` failed and the old world is gone (what became of it is already agreed
        through the store): fall back, or say why not."""
        self._forget(prep, f"failed past the cut at {failed.stage}; the old world is gone")
        checkpoint = self.options.checkpoint
        if checkpoint is None:
            self._log.error("runtime.handoff_failed", generation=prep.generation, error=str(failed))
            raise NoCheckpointConfigured(
                failed.generation, failed.stage, failed.reason, failed.restore_error
            ) from failed
        abort = AbortReport(
            generation=prep.generation,
            stage=failed.stage,
            reason=str(failed),
            iteration=reached,
            pause_s=time.perf_counter() - failed_at,
        )
        self._log.error(
            "runtime.falling_back", generation=prep.generation, role=str(prep.role), error=str(failed)
        )
        self._emit(
            RuntimeEvent(
                generation=prep.generation, phase=ReshardPhase.FALLING_BACK, iteration=reached, abort=abort
            )
        )
        if prep.role is Role.LEAVE:
            self.history.append(
                FallbackReport(
                    failed_generation=prep.generation,
                    generation=prep.generation + 1,
                    role=prep.role,
                    rank=None,
                    checkpoint=None,
                    iteration=None,
                    reached_iteration=reached,
                    steps_lost=None,
                    reason=str(failed),
                    seconds=time.perf_counter() - failed_at,
                )
            )
            self._world, self._trainer, self._left = None, None, True
            self._log.info("runtime.left", generation=prep.generation, why="fallback")
            return None
        return self._fall_back(prep, checkpoint, str(failed), reached, failed_at)

    def _fall_back(
        self,
        prep: Preparation,
        checkpoint: CheckpointOptions,
        reason: str,
        reached: int | None,
        failed_at: float,
    ) -> T:
        """Restart on the failed generation's layout and placement, as the next generation, from the
        latest checkpoint (every process of the new world does, at once)."""
        generation = prep.generation + 1
        with self._cond:
            self._newest_generation = max(self._newest_generation, generation)
        spec = WorldSpec(
            job=self.job,
            generation=generation,
            layout=prep.request.layout,
            placement=prep.request.placement,
            instances=prep.new.instances,
        )
        world = build_world(
            spec,
            self.device,
            prep.request.store,
            backend=self.options.backend,
            timeout=timedelta(seconds=self.options.build_timeout_s),
        )
        factory = self._checkpoints()
        try:
            world.adopt_as_default(timedelta(seconds=self.options.control_timeout_s))
            trainer, path = factory.fall_back(world, checkpoint.root, reached)
        except BaseException:
            world.release()
            raise
        iteration = self.factory.iteration(trainer)
        self._world, self._trainer, self._saved_at = world, trainer, iteration
        report = FallbackReport(
            failed_generation=prep.generation,
            generation=generation,
            role=prep.role,
            rank=world.rank,
            checkpoint=path,
            iteration=iteration,
            reached_iteration=reached,
            steps_lost=None if reached is None else reached - iteration,
            reason=reason,
            seconds=time.perf_counter() - failed_at,
        )
        self.history.append(report)
        self._log.warning(
            "runtime.fell_back",
            generation=generation,
            rank=world.rank,
            checkpoint=path,
            iteration=iteration,
            steps_lost=report.steps_lost,
            seconds=round(report.seconds, 4),
        )
        self._emit(
            RuntimeEvent(
                generation=generation, phase=ReshardPhase.FELL_BACK, iteration=iteration, fallback=report
            )
        )
        return trainer

    def _wait_for_request(self, give_up_at: float | None) -> Preparation:
        """The pending request, once one comes (a request given up before it started is let go of here)."""
        while True:
            released: Preparation | None = None
            with self._cond:
                prep = self._pending
                if prep is not None:
                    prep.settle()
                    if prep.state is HandoffState.RELEASING:
                        released = prep
                    elif not prep.started:
                        return prep
                if released is None:
                    if self._closed:
                        raise ResizeRejected("the runtime was closed while waiting to join")
                    left = None if give_up_at is None else give_up_at - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"device {self.device} was not taken into any world within "
                            f"{self.options.join_timeout_s} s"
                        )
                    self._cond.wait(left)
                    continue
            self._give_up(released, HandoffStage.PREPARE, released.release_reason or "given up", None)

    def _committed(
        self, prep: Preparation, report: SwitchReport, new_world: World | None, new_trainer: T | None
    ) -> T | None:
        report.prepare_s = None if prep.ready_at is None else prep.ready_at - prep.requested_at
        report.warmup_s = prep.warmup_s
        prep.take_prebuilt()
        self.history.append(report)
        with self._cond:
            left = HandoffState.LEFT if prep.role is Role.LEAVE else HandoffState.SWITCHED
            prep.move(left, "committed")
            self._pending = None
            self._promote()
        if prep.role is Role.LEAVE:
            self._world, self._trainer, self._left = None, None, True
            self._log.info("runtime.left", generation=report.generation, iteration=report.iteration)
            self._emit(
                RuntimeEvent(
                    generation=report.generation,
                    phase=ReshardPhase.LEFT,
                    iteration=report.iteration,
                    report=report,
                )
            )
            return None
        self._world, self._trainer = new_world, new_trainer
        self._handed_out_at = time.perf_counter()
        self._emit(
            RuntimeEvent(
                generation=report.generation,
                phase=ReshardPhase.SWITCHED,
                iteration=report.iteration,
                report=report,
            )
        )
        if self._on_switch is not None and new_trainer is not None:
            self._on_switch(report.generation, new_trainer)  # committed: a raise is the user's to handle
        return new_trainer

    def _give_up(
        self, prep: Preparation, stage: HandoffStage, reason: str, iteration: int | None, pause_s: float = 0.0
    ) -> None:
        """Let go of ``prep`` (its builds discarded; the old world trains on) and say why; the request
        queued behind it, if any, becomes the pending one."""
        with self._cond:
            if prep.state is not HandoffState.RELEASING:
                by_request = prep.abort_requested is not None
                prep.release(reason, by_request=by_request)
            prebuilt = prep.prebuilt is not None and prep.prebuilt.trainer is not None
        self._drop(prep)
        if prebuilt:
            # The new trainer's modules hold the new world's groups in reference cycles (Megatron's do):
            # only a collection closes their connections, and until then a joiner waiting in the new
            # world's first collective waits there for its enter timeout (found by the real chaos run).
            gc.collect()
        self._ended(prep, stage, iteration, pause_s, reason)

    def _ended(
        self,
        prep: Preparation,
        stage: HandoffStage,
        iteration: int | None,
        pause_s: float = 0.0,
        reason: str | None = None,
    ) -> None:
        """A RELEASING handoff is let go of: ABORTED (at the coordinator's word) or FAILED, recorded and
        told to the listener (its ack)."""
        reason = reason or prep.release_reason or "given up"
        by_request = prep.released_by_request
        with self._cond:
            prep.move(HandoffState.ABORTED if by_request else HandoffState.FAILED, reason)
        abort = AbortReport(
            generation=prep.generation,
            stage=stage,
            reason=reason,
            iteration=iteration,
            pause_s=pause_s,
            by_request=by_request,
        )
        self.history.append(abort)
        self._log.warning(
            "runtime.handoff_aborted",
            generation=prep.generation,
            stage=stage,
            reason=reason,
            iteration=iteration,
            by_request=by_request,
        )
        self._emit(
            RuntimeEvent(
                generation=prep.generation, phase=ReshardPhase.ABORTED, iteration=iteration, abort=abort
            )
        )

    def _forget(self, prep: Preparation, why: str) -> None:
        """Let go of ``prep`` without an abort of its own (FAILED): the old world lost a peer and the
        coordinator, told by ``peer_lost``, plans around the loss; or it failed past the cut."""
        with self._cond:
            if prep.state not in ENDED:
                prep.move(HandoffState.FAILED, why)
        self._drop(prep)

    def _drop(self, prep: Preparation) -> None:
        """Give ``prep``'s builds up and stop treating it as pending; the queued request goes ahead."""
        prep.discard()
        with self._cond:
            if self._pending is prep:
                self._pending = None
            self._promote()

    def _promote(self) -> None:
        """With nothing pending, the queued request becomes pending (started at the next boundary, or by
        the join or the recovery waiting for it). The caller holds the lock."""
        if self._pending is not None or self._queued is None:
            return
        prep, self._queued = self._queued, None
        prep.move(HandoffState.PREPARING, "the handoff before it was let go of")
        self._pending = prep
        self._log.info("runtime.queued_request_goes_ahead", generation=prep.generation)
        self._cond.notify_all()

    def _note_first_step(self, now: float) -> None:
        """At the boundary after the first step on a new world: time that step."""
        if self._handed_out_at is None:  # every boundary but one: nothing to look up
            return
        handed_out_at, self._handed_out_at = self._handed_out_at, None
        last = self.last_switch
        if last is not None and last.first_step_s is None:
            last.first_step_s = now - handed_out_at

    def _emit(self, event: RuntimeEvent) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception as error:  # a listener must never break training
            self._log.warning("runtime.listener_failed", phase=str(event.phase), error=repr(error))


def _check_store_and_deadline(store: StoreAddress, deadline: datetime | None) -> None:
    """A request's store must be an address and its deadline a moment: a naive time means a different
    moment on every host."""
    if not isinstance(store, StoreAddress):
        raise ValueError(f"`store`: expected a StoreAddress, got {type(store).__name__}")
    if deadline is not None and deadline.tzinfo is None:
        raise ValueError("`deadline`: must carry a timezone")


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0][:500] if text else repr(error)
