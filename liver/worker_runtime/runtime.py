"""The training-loop API: one call per iteration, and a live reshard whenever a resize is requested.

    runtime = LiveRuntime(MegatronJob(spec, config), job="gpt", device=device, store=store, initial=spec0)
    while (trainer := runtime.step()) is not None:      # None: this process left the job
        trainer.train_step()

:meth:`LiveRuntime.step` is the iteration boundary. The first call builds the initial world and its
trainer (or, in a process that is in no world yet, waits until a resize takes it in). Every later call
votes, with one tiny all-reduce over the active world, whether every rank is ready for the same new
generation (the consistent cut, I3), and either returns the same trainer or switches all ranks at this
boundary and returns the trainer of the new world. A process that the new world no longer includes gets
``None`` after it has streamed its state out.

:meth:`LiveRuntime.request_resize` (thread-safe: the bus companion calls it from its own thread) hands
in the target: generation, layout, placement, the transfer plan (made by the planner outside this
process; a :class:`~liver.shared.plan.PlanSlice` is enough), the store and a deadline. Preparation runs
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
The runtime never imports the services: plans come in from outside.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Generic, TypeVar

import msgspec
import structlog
import torch

from liver.shared.errors import HandoffError
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.plan import Plan, PlanSlice
from liver.worker_runtime.cut import NO_TARGET, CutVerdict, Readiness, vote
from liver.worker_runtime.fallback import (
    CheckpointingFactory,
    CheckpointOptions,
    FallbackReport,
    HandoffOutcome,
    NoCheckpointConfigured,
    OutcomeVerdict,
    await_outcome,
    post_outcome,
)
from liver.worker_runtime.handoff import (
    Handoff,
    HandoffAborted,
    HandoffFailed,
    HandoffStage,
    Role,
    SwitchReport,
    TrainerFactory,
    prebuild,
    switch,
)
from liver.worker_runtime.preparation import Preparation, ResizeRequest, check_request
from liver.worker_runtime.stream.executor import StreamOptions
from liver.worker_runtime.world import (
    Backend,
    StoreAddress,
    World,
    WorldError,
    WorldSpec,
    build_world,
)

__all__ = [
    "AbortReport",
    "CheckpointOptions",
    "FallbackReport",
    "LiveRuntime",
    "NoCheckpointConfigured",
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
    stream: StreamOptions = StreamOptions()
    checkpoint: CheckpointOptions | None = None
    """Periodic checkpoints, and the fallback to them when a handoff loses the old world (None: neither)."""

    def __post_init__(self) -> None:
        if self.vote_every < 1:
            raise ValueError(f"`vote_every`: must be at least 1, got {self.vote_every}")
        for field in ("control_timeout_s", "build_timeout_s", "enter_timeout_s"):
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


class AbortReport(msgspec.Struct, frozen=True, kw_only=True):
    """A handoff that did not happen, and why. ``iteration`` is the boundary it was given up at."""

    generation: int
    stage: HandoffStage  # prepare, cut, or the handoff stage that failed (enter, progress, build, ...)
    reason: str
    iteration: int | None
    pause_s: float = 0.0  # from the cut until training went on on the old world (a handoff's rollback)


class RuntimeEvent(msgspec.Struct, frozen=True, kw_only=True):
    """What :class:`LiveRuntime` tells its ``on_event`` listener (the bus companion's worker status)."""

    generation: int
    phase: ReshardPhase
    iteration: int | None = None
    report: SwitchReport | None = None
    abort: AbortReport | None = None
    fallback: FallbackReport | None = None


# -- the runtime --------------------------------------------------------------------------------------------


class LiveRuntime(Generic[T]):
    """One training process's side of live reconfiguration. See the module docstring for the loop.

    ``initial`` is the world the job starts with (None, or a world without this ``device``: the process
    starts outside every world and waits in its first :meth:`step` until a resize takes it in).
    ``store`` is where the initial world's store listens. ``on_event`` hears every phase change (from
    the thread that caused it: keep it short). ``on_stream_step(generation, layer, round)`` is called
    before each streaming step (progress reports; raising cancels the handoff, which then rolls back).
    ``options.checkpoint`` needs a factory that can checkpoint (:class:`~.fallback.CheckpointingFactory`).
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
        if options.checkpoint is not None and not all(
            callable(getattr(factory, name, None)) for name in ("save_checkpoint", "fall_back")
        ):
            raise ValueError(
                f"`options.checkpoint`: the factory {type(factory).__name__} cannot save or load "
                "checkpoints (it needs save_checkpoint and fall_back)"
            )
        self.factory = factory
        self.job = job
        self.device = device
        self.options = options
        self._initial = initial if initial is not None and initial.rank_of(device) is not None else None
        self._initial_store = store
        self._on_event = on_event
        self._on_stream_step = on_stream_step
        self._cond = threading.Condition(threading.RLock())
        self._world: World | None = None
        self._trainer: T | None = None
        self._pending: Preparation | None = None
        self._newest_generation = initial.generation if initial is not None else -1
        self._left = False
        self._closed = False
        self._handed_out_at: float | None = None
        self._saved_at: int | None = None  # the iteration of the last periodic checkpoint (or the loaded one)
        self.history: list[SwitchReport | AbortReport | FallbackReport] = []
        self._log = log.bind(job=job, device=str(device))

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
        with self._cond:
            return None if self._pending is None else self._pending.generation

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
    ) -> Role:
        """Prepare the move to ``generation`` (``layout`` on ``placement``) with ``plan``; thread-safe.

        Returns this process's role. Raises ``ValueError`` naming the field that does not fit, and
        :class:`ResizeRejected` while another generation is being prepared or after this process left.
        With ``switch_when_ready=False`` the ranks vote ready only after :meth:`allow_switch` (the
        coordinator's SWITCH command); otherwise they switch at the first boundary where all are ready.
        """
        if isinstance(plan, PlanSlice):
            if plan.device != self.device:
                raise ValueError(
                    f"`plan.device`: the slice is for {plan.device}, this process runs on {self.device}"
                )
            plan = plan.to_plan()
        if not isinstance(plan, Plan):
            raise ValueError(f"`plan`: expected a Plan or PlanSlice, got {type(plan).__name__}")
        if not isinstance(store, StoreAddress):
            raise ValueError(f"`store`: expected a StoreAddress, got {type(store).__name__}")
        if deadline is not None and deadline.tzinfo is None:
            raise ValueError("`deadline`: must carry a timezone")
        with self._cond:
            if self._left or self._closed:
                raise ResizeRejected(f"generation {generation}: this process has left the job")
            if self._pending is not None:
                raise ResizeRejected(
                    f"generation {generation}: generation {self._pending.generation} is being prepared"
                )
            request, role, old, new = check_request(
                job=self.job,
                device=self.device,
                model=self.factory.model,
                active=self._world.spec if self._world is not None else self._initial,
                newest_generation=self._newest_generation,
                generation=generation,
                layout=layout,
                placement=placement,
                plan=plan,
                store=store,
                deadline=deadline,
                from_generation=from_generation,
                switch_when_ready=switch_when_ready,
            )
            prep = Preparation(request, role, old, new)
            self._pending = prep
            self._newest_generation = generation
            if role is not Role.JOIN and self._world is not None:
                self._start_preparation(prep)
            self._cond.notify_all()
        self._log.info(
            "runtime.resize_requested", generation=generation, role=str(role), layout=layout.describe()
        )
        self._emit(RuntimeEvent(generation=generation, phase=ReshardPhase.PREPARING))
        return role

    def _start_preparation(self, prep: Preparation) -> None:
        """Start building the shadow world, the stream group and the schedule, and the layout check."""
        opts = self.options
        prep.start(self.device, opts.backend, opts.build_timeout_s, opts.stream, self._layout_check(prep))

    def _layout_check(self, prep: Preparation) -> Callable[[], None] | None:
        """The factory's check of the new layout's model (``check_layout``, optional), run once per
        handoff, by the process that will hold new rank 0, beside training."""
        check = getattr(self.factory, "check_layout", None)
        if check is None or prep.request.placement.devices[0] != self.device:
            return None
        layout = prep.request.layout
        return lambda: check(layout)

    def allow_switch(self, generation: int) -> None:
        """The coordinator's SWITCH: ``generation`` may be switched to once every rank is ready."""
        with self._cond:
            if self._pending is not None and self._pending.generation == generation:
                self._pending.allowed = True

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

    def abort(self, generation: int, reason: str) -> None:
        """Give ``generation`` up: the next vote aborts it on every rank. A no-op for other generations."""
        with self._cond:
            if self._pending is not None and self._pending.generation == generation:
                self._pending.abort_reason = f"aborted by request: {reason}"

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
        assert self._world is not None
        iteration = self.factory.iteration(self._trainer)
        self._save_if_due(iteration)
        if iteration % self.options.vote_every:
            return self._trainer
        with self._cond:
            prep = self._pending
            if prep is not None and not prep.started:
                self._start_preparation(prep)
        target = prep.generation if prep is not None else NO_TARGET
        readiness = prep.readiness() if prep is not None else Readiness.NONE
        failure = prep.failure() if prep is not None else None
        if prep is not None and prep.ready_at is not None and not prep.ready_announced:
            prep.ready_announced = True
            self._emit(
                RuntimeEvent(generation=prep.generation, phase=ReshardPhase.READY, iteration=iteration)
            )
        decision = vote(
            self._world,
            iteration=iteration,
            target=target,
            ready=readiness,
            failed=failure is not None,
            timeout=timedelta(seconds=self.options.control_timeout_s),
        )
        cut_at = time.perf_counter()
        if decision.verdict is CutVerdict.WAIT or prep is None:
            return self._trainer
        if decision.verdict is CutVerdict.BUILD:
            self._prebuild(prep, iteration)
            return self._trainer
        if decision.verdict is CutVerdict.ABORT:
            if prep.build_agreed:
                self._agree_on_default()
            self._give_up(prep, HandoffStage.CUT, failure or "another rank could not prepare it", iteration)
            return self._trainer
        return self._switch(prep, iteration, cut_at)

    def close(self) -> None:
        """Release everything this runtime holds (the end of training)."""
        with self._cond:
            self._closed = True
            prep, self._pending = self._pending, None
        if prep is not None:
            prep.discard()
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
        world.adopt_as_default(timedelta(seconds=self.options.control_timeout_s))
        trainer = self.factory.build(world)
        self._world, self._trainer = world, trainer
        self._log.info("runtime.started", generation=world.generation, rank=world.rank)
        return trainer

    def _prebuild(self, prep: Preparation, iteration: int | None) -> None:
        """The vote said BUILD: build the new trainer now, at this boundary (see :func:`.handoff.prebuild`).

        A failure is this process's vote from now on (the next boundary aborts the handoff everywhere);
        the groups are released at once, so that peers waiting in one of their collectives fail now
        instead of at the control timeout."""
        prep.build_agreed = True
        timeout = self.options.control_timeout_s if iteration is not None else self.options.enter_timeout_s
        try:
            assert prep.stream_build is not None
            prebuilt = prebuild(
                self.factory,
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
            prep.prebuild_error = text
            prep.discard()
            if iteration is None:  # a joiner: the caller gives the handoff up
                raise
            return
        prep.set_prebuilt(prebuilt, self.factory.dispose)
        prep.ready_announced = True
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
        self, prep: Preparation, new_world: World | None, iteration: int | None, join_timeout: float
    ) -> Handoff[T]:
        assert prep.stream_build is not None
        return Handoff(
            factory=self.factory,
            plan=prep.request.plan,
            device=self.device,
            stream=prep.stream_build.result(),
            old_world=self._world,
            new_world=new_world,
            old_trainer=self._trainer,
            iteration=iteration,
            from_generation=prep.request.from_generation,
            control_timeout=timedelta(seconds=self.options.control_timeout_s),
            join_timeout=timedelta(seconds=join_timeout),
            stream_options=self.options.stream,
            on_stream_step=self._on_stream_step,
            schedule=prep.schedule(),
            prebuilt=prep.prebuilt,
        )

    def _switch(self, prep: Preparation, iteration: int, cut_at: float) -> T | None:
        new_world = prep.world_build.result(timeout=0) if prep.world_build is not None else None
        handoff = self._handoff(prep, new_world, iteration, self.options.control_timeout_s)
        old_trainer = self._trainer
        self._trainer = None
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
        except HandoffFailed as error:
            # Fail-stop: the old world is gone (switch released it). Tell the joiners, and any other
            # survivor, what became of the handoff.
            failed = error
            verdict = OutcomeVerdict.LOST if self.options.checkpoint is None else OutcomeVerdict.FALLBACK
            self._post_outcome(
                prep, HandoffOutcome(verdict=verdict, reached_iteration=iteration, reason=str(failed))
            )
        except BaseException:
            self._drop(prep)
            self._world = None
            raise
        else:
            del old_trainer
            return self._committed(prep, report, new_world, new_trainer)
        # Nothing of the old world can train any more (releasing it twice is harmless).
        assert self._world is not None
        self._world.release()
        self._world = None
        del old_trainer
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
                outcome = self._joiners_outcome(prep, aborted)
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

    # -- checkpoints and the fail-stop fallback --------------------------------------------------------------
    def _save_if_due(self, iteration: int) -> None:
        """The periodic checkpoint: at every ``every``-th boundary, once (a collective over the world)."""
        checkpoint = self.options.checkpoint
        if checkpoint is None or checkpoint.every is None or iteration == 0 or iteration % checkpoint.every:
            return
        if self._saved_at == iteration:
            return
        assert self._trainer is not None
        factory: CheckpointingFactory[T] = self.factory  # type: ignore[assignment]
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

    def _joiners_outcome(self, prep: Preparation, aborted: HandoffAborted) -> HandoffOutcome | None:
        """What the old world found, for a joiner whose handoff broke. One that broke while entering
        never met the old world's processes past the cut: they gave the handoff up before it began."""
        if aborted.stage == HandoffStage.ENTER:
            return None
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
        self._drop(prep)
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
        )
        world = build_world(
            spec,
            self.device,
            prep.request.store,
            backend=self.options.backend,
            timeout=timedelta(seconds=self.options.build_timeout_s),
        )
        factory: CheckpointingFactory[T] = self.factory  # type: ignore[assignment]
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
        with self._cond:
            while self._pending is None or self._pending.started:
                if self._closed:
                    raise ResizeRejected("the runtime was closed while waiting to join")
                left = None if give_up_at is None else give_up_at - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"device {self.device} was not taken into any world within "
                        f"{self.options.join_timeout_s} s"
                    )
                self._cond.wait(left)
            return self._pending

    def _committed(
        self, prep: Preparation, report: SwitchReport, new_world: World | None, new_trainer: T | None
    ) -> T | None:
        report.prepare_s = None if prep.ready_at is None else prep.ready_at - prep.requested_at
        report.warmup_s = prep.warmup_s
        prep.take_prebuilt()
        self.history.append(report)
        with self._cond:
            self._pending = None
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
        return new_trainer

    def _give_up(
        self, prep: Preparation, stage: HandoffStage, reason: str, iteration: int | None, pause_s: float = 0.0
    ) -> None:
        self._drop(prep)
        abort = AbortReport(
            generation=prep.generation, stage=stage, reason=reason, iteration=iteration, pause_s=pause_s
        )
        self.history.append(abort)
        self._log.warning(
            "runtime.handoff_aborted",
            generation=prep.generation,
            stage=stage,
            reason=reason,
            iteration=iteration,
        )
        self._emit(
            RuntimeEvent(
                generation=prep.generation, phase=ReshardPhase.ABORTED, iteration=iteration, abort=abort
            )
        )

    def _drop(self, prep: Preparation) -> None:
        """Give ``prep``'s builds up and stop treating it as pending, so that a later request can come."""
        prep.discard()
        with self._cond:
            if self._pending is prep:
                self._pending = None

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
