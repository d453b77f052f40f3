"""One resize request inside one training process: checked, then prepared in the background.

:func:`check_request` turns what the bus companion hands in (generation, layout, placement, plan, store,
deadline) into a :class:`ResizeRequest` and this process's :class:`~.handoff.Role`, or raises
``ValueError`` naming the field that does not fit. :class:`Preparation` then builds, off the training
thread, what the switch will need: the shadow world (unless this process leaves) and the stream group
over both worlds (:class:`StreamBuild`, the stream group's counterpart of ``WorldBuild``), and, given the
stream options, this process's transfer schedule (:class:`ScheduleBuild`), so that none of it falls in
the pause. The training
thread only polls it at iteration boundaries: :meth:`Preparation.ready` and :meth:`Preparation.failure`
are what this process puts into the cut's vote.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar

import msgspec

from liver.reshard.plan import Plan
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, ParallelLayout, Placement, check_placement
from liver.shared.model import ModelSpec, as_geometry
from liver.worker_runtime.cut import Readiness
from liver.worker_runtime.generations import ENDED, HandoffState, check_move
from liver.worker_runtime.handoff import Prebuilt, Role, handoff_schedule
from liver.worker_runtime.stream.executor import PreparedSchedule, StreamOptions
from liver.worker_runtime.world import (
    Backend,
    StoreAddress,
    StreamGroup,
    WorldBuild,
    WorldError,
    WorldSpec,
    build_stream_group,
    build_world_async,
)

R = TypeVar("R")

_POLL_S = 0.05
"""How often a blocked wait for the builds looks for an abort."""


class ResizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A checked resize target (see :func:`check_request`)."""

    generation: int
    from_generation: int
    layout: ParallelLayout
    placement: Placement
    plan: Plan
    store: StoreAddress
    deadline: datetime | None
    switch_when_ready: bool
    lost: tuple[Device, ...] = ()
    """Old-world devices whose processes are gone: no stream group or message includes them."""


def check_request(
    *,
    job: str,
    device: Device,
    model: ModelSpec | ModelGeometry,
    active: WorldSpec | None,
    newest_generation: int,
    generation: int,
    layout: ParallelLayout,
    placement: Placement,
    plan: Plan,
    store: StoreAddress,
    deadline: datetime | None,
    from_generation: int | None,
    switch_when_ready: bool,
    lost: Collection[Device] = (),
) -> tuple[ResizeRequest, Role, WorldSpec, WorldSpec]:
    """The request, this process's role, and the old and new world specs; ``ValueError`` names the field.

    ``active`` is the world this process is in (or starts in); None for a process in no world, which
    can only join. ``from_generation`` defaults to the active generation, or ``generation - 1`` for a
    joiner (it only names the stream group's old side).
    """
    if generation <= newest_generation:
        raise ValueError(f"`generation`: {generation} is not newer than generation {newest_generation}")
    check_placement(layout, placement)
    model.check_layout(layout)
    job_model = as_geometry(model)
    _check_plan_target(model, job_model, plan, layout, placement)
    from_generation = _from_generation(active, plan, generation, from_generation)
    role = _role(device, active, plan, placement, generation)
    lost_devices = _lost_devices(lost, device, plan, placement)
    k = job_model.ddp.instances  # the groups of a distributed optimizer's instances are the world's
    old = WorldSpec(
        job=job, generation=from_generation, layout=plan.old.layout, placement=plan.old.placement, instances=k
    )
    new = WorldSpec(job=job, generation=generation, layout=layout, placement=placement, instances=k)
    request = ResizeRequest(
        generation=generation,
        from_generation=from_generation,
        layout=layout,
        placement=placement,
        plan=plan,
        store=store,
        deadline=deadline,
        switch_when_ready=switch_when_ready,
        lost=lost_devices,
    )
    return request, role, old, new


def _check_plan_target(
    model: ModelSpec | ModelGeometry,
    job_model: ModelGeometry,
    plan: Plan,
    layout: ParallelLayout,
    placement: Placement,
) -> None:
    """The plan moves this job's whole training state, with its optimizer sharding, to the requested
    layout and placement: a plan made for anything else would stream the wrong bytes."""
    if plan.model != job_model:
        if plan.model.with_ddp(job_model.ddp) == job_model:
            raise ValueError(
                f"`plan.model.ddp`: the plan shards the optimizer state as {plan.model.ddp}, this job as "
                f"{job_model.ddp}; plan with the job's geometry (MegatronJob.model)"
            )
        raise ValueError(
            f"`plan.model`: the plan is for {plan.model.name} ({plan.model.digest()}), this job trains "
            f"{model.name} ({job_model.digest()})"
        )
    if plan.tensors != model.tensors(optimizer=True):
        raise ValueError("`plan.tensors`: the plan must move the whole training state (optimizer included)")
    if plan.new.layout != layout or plan.new.placement != placement:
        raise ValueError(
            f"`plan.new`: the plan moves to {plan.new.layout.describe()} on its own placement, the request "
            f"to {layout.describe()} on another"
        )


def _from_generation(
    active: WorldSpec | None, plan: Plan, generation: int, from_generation: int | None
) -> int:
    """The generation the move starts from: the active world's, which the plan must start from too (a
    process in no world only names the stream group's old side: ``generation - 1`` unless given)."""
    if active is not None:
        if from_generation is not None and from_generation != active.generation:
            raise ValueError(
                f"`from_generation`: {from_generation}, but this process is in generation {active.generation}"
            )
        if plan.old.layout != active.layout or plan.old.placement != active.placement:
            raise ValueError(
                f"`plan.old`: the plan starts from {plan.old.layout.describe()} on its own placement, this "
                f"process's world is {active.layout.describe()} on another"
            )
        from_generation = active.generation
    elif from_generation is None:
        from_generation = generation - 1
    if not 0 <= from_generation < generation:
        raise ValueError(f"`from_generation`: {from_generation} is not a generation before {generation}")
    return from_generation


def _role(
    device: Device, active: WorldSpec | None, plan: Plan, placement: Placement, generation: int
) -> Role:
    """This process's part in the move. A process in no world can only join: the new world must take
    it in, and the plan's old world must not count on it."""
    in_old = active is not None
    in_new = device in placement.devices
    if not in_old and not in_new:
        raise ValueError(f"`placement`: device {device} has no place in generation {generation}")
    if not in_old and device in plan.old.placement.devices:
        raise ValueError(f"`plan.old`: device {device} is in the old world, but this process is in no world")
    return Role.STAY if in_old and in_new else Role.LEAVE if in_old else Role.JOIN


def _lost_devices(
    lost: Collection[Device], device: Device, plan: Plan, placement: Placement
) -> tuple[Device, ...]:
    """``lost`` once each, in order: old-world devices the new world does not run on, and never this
    process's own (it is here to ask)."""
    lost_devices = tuple(dict.fromkeys(lost))
    for gone in lost_devices:
        if gone not in plan.old.placement.devices:
            raise ValueError(f"`lost`: device {gone} is not in the old world")
        if gone in placement.devices:
            raise ValueError(f"`lost`: device {gone} is lost, but the new world runs on it")
    if device in lost_devices:
        raise ValueError(f"`lost`: names this process's own device {device}")
    return lost_devices


class _Background(Generic[R]):
    """One piece of the preparation made on a thread of its own (the contract of :class:`WorldBuild`):
    polled at boundaries, waited for, and given up with ``discard``, which ``release`` s the piece once
    it is made (at once if it already is)."""

    def __init__(self, make: Callable[[], R], name: str, release: Callable[[R], None] | None = None) -> None:
        self._result: R | None = None
        self._error: BaseException | None = None
        self._discarded = False
        self._release = release
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(make,), name=name, daemon=True)
        self._thread.start()

    def _run(self, make: Callable[[], R]) -> None:
        try:
            result = make()
        except BaseException as error:  # reported through .error
            with self._lock:
                self._error = error
            return
        with self._lock:
            self._result = result
            discard = self._discarded
        if discard and self._release is not None:
            self._release(result)

    def wait(self, timeout: float | None) -> bool:
        """Block until the build ends or ``timeout`` passes; whether it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._result is not None and not self._discarded

    @property
    def error(self) -> BaseException | None:
        with self._lock:
            return self._error

    def _made(self) -> R | None:
        with self._lock:
            return None if self._discarded else self._result

    def discard(self) -> None:
        """Give the piece up: released now if made, else as soon as it is."""
        with self._lock:
            self._discarded = True
            result = self._result
        if result is not None and self._release is not None:
            self._release(result)


class StreamBuild(_Background[StreamGroup]):
    """The stream group, built on a thread of its own."""

    def __init__(
        self,
        old: WorldSpec,
        new: WorldSpec,
        device: Device,
        store: StoreAddress,
        backend: Backend,
        timeout: timedelta,
        lost: Collection[Device] = (),
    ) -> None:
        super().__init__(
            lambda: build_stream_group(old, new, device, store, backend=backend, timeout=timeout, lost=lost),
            name=f"liver-stream-{new.job}-gen{new.generation}",
            release=StreamGroup.release,
        )

    def result(self) -> StreamGroup:
        group = self._made()
        if group is None:
            raise WorldError(f"the stream group is not ready (error: {self.error!r})")
        return group


class ScheduleBuild(_Background[PreparedSchedule]):
    """This process's transfer schedule, derived from the plan on a thread of its own.

    It depends on no tensor and no group, so it can be made while training runs; the handoff then only
    checks it. A plan that does not fit this process fails here, before the cut, instead of in the pause.
    """

    def __init__(
        self, plan: Plan, device: Device, options: StreamOptions, lost: Collection[Device] = ()
    ) -> None:
        super().__init__(lambda: handoff_schedule(plan, device, options, lost), name="liver-schedule")

    def result(self) -> PreparedSchedule | None:
        """The schedule, or None while it is not built (the handoff then builds it itself)."""
        return self._made()


class LayoutCheck(_Background[bool]):
    """The new layout's model checked against the plan's geometry on a thread of its own (the factory
    may run the check in another interpreter), so a model that disagrees fails the vote before the cut
    instead of the rebuild after it."""

    def __init__(self, check: Callable[[], None]) -> None:
        def run() -> bool:
            check()
            return True

        super().__init__(run, name="liver-layout-check")


class Preparation:
    """One request in this process: its role, its background builds, and its state in the handoff's
    machine (:mod:`.generations`).

    Other threads (the bus companion's) never move the state of a handoff that can have started: they
    file requests (:meth:`request_abort`, :meth:`request_switch`), and the thread that runs the
    iteration boundaries applies them there (:meth:`settle`), before it votes, so that every move the
    vote depends on happens at a boundary, the same one on every rank where it matters.
    """

    def __init__(
        self, request: ResizeRequest, role: Role, old: WorldSpec, new: WorldSpec, *, queued: bool = False
    ) -> None:
        self.request = request
        self.role = role
        self.old = old
        self.new = new
        self.state = HandoffState.QUEUED if queued else HandoffState.PREPARING
        self.requested_at = time.perf_counter()
        self.ready_at: float | None = None
        self.warmup_s: float | None = None
        self.allowed = request.switch_when_ready
        """The coordinator's Switch came (or the request needs none)."""
        self.abort_requested: str | None = None
        """Why the coordinator gave it up (an Abort, or a newer Prepare), until :meth:`settle` applies it."""
        self.release_reason: str | None = None
        """Why it is RELEASING (or was let go of)."""
        self.released_by_request = False
        """Whether it was given up at the coordinator's word (acked ``aborted``) or failed (``failed``)."""
        self.world_build: WorldBuild | None = None
        self.stream_build: StreamBuild | None = None
        self.schedule_build: ScheduleBuild | None = None
        self.layout_check: LayoutCheck | None = None
        self.agreed_build = False
        """The vote said BUILD: every old-world rank built at the same boundary, so letting go of it is a
        collective too (the vote's ABORT, where every rank agrees on the old world as default again)."""
        self.prebuilt: Prebuilt[Any] | None = None
        self._dispose: Callable[[Any], None] | None = None

    def move(self, to: HandoffState, why: str) -> None:
        """Move through the table (:func:`~.generations.check_move` raises on a move it does not allow)."""
        self.state = check_move(self.generation, self.state, to, why)

    def request_abort(self, reason: str) -> None:
        """The coordinator gives it up (any thread): applied at the next boundary."""
        if self.abort_requested is None:
            self.abort_requested = reason

    def request_switch(self) -> None:
        """The coordinator's Switch (any thread): applied at the next boundary."""
        self.allowed = True

    @property
    def supersedable(self) -> bool:
        """Whether a newer Prepare may end it: not once the Switch came (the coordinator's point of no
        return), unless it is being given up anyway."""
        if self.state in ENDED:
            return False
        if self.abort_requested is not None or self.state is HandoffState.RELEASING:
            return True
        return not (self.allowed and not self.request.switch_when_ready)

    def settle(self) -> None:
        """Apply what came in since the last boundary (the caller holds the runtime's lock): an abort, or
        a failure of this process's preparation, makes it RELEASING; a Switch for a built one makes it
        SWITCHING."""
        if self.state in ENDED or self.state is HandoffState.RELEASING:
            return
        if self.abort_requested is not None:
            self.release(f"aborted by request: {self.abort_requested}", by_request=True)
            return
        problem = self._problem()
        if problem is not None:
            self.release(problem, by_request=False)
            return
        if self.state is HandoffState.READY and self.allowed:
            self.move(HandoffState.SWITCHING, "the coordinator's Switch")

    def release(self, reason: str, *, by_request: bool) -> None:
        """Give it up (RELEASING): let go of at this boundary, or by the vote once every rank built it."""
        self.move(HandoffState.RELEASING, reason)
        self.release_reason = reason
        self.released_by_request = by_request

    def built(self, prebuilt: Prebuilt[Any], dispose: Callable[[Any], None]) -> None:
        """The new trainer is built (``dispose`` frees it if the handoff is given up): READY, or SWITCHING
        when already allowed. Notes the time."""
        self.prebuilt, self._dispose = prebuilt, dispose
        if self.ready_at is None:
            self.ready_at = time.perf_counter()
        self.move(HandoffState.SWITCHING if self.allowed else HandoffState.READY, "the new trainer is built")

    def build_failed(self, error: str) -> None:
        """Building the new trainer failed: this process's vote is "failed" from now on."""
        if self.state is not HandoffState.RELEASING:
            self.release(f"building the new trainer before the cut failed: {error}", by_request=False)

    @property
    def generation(self) -> int:
        return self.request.generation

    @property
    def started(self) -> bool:
        return self.stream_build is not None

    def seconds_left(self, cap: float) -> float:
        """``cap`` seconds, or fewer if the request's deadline comes first (never below a millisecond)."""
        deadline = self.request.deadline
        if deadline is None:
            return cap
        return max(min(cap, (deadline - datetime.now(UTC)).total_seconds()), 0.001)

    def start(
        self,
        device: Device,
        backend: Backend,
        build_timeout_s: float,
        stream_options: StreamOptions | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Start building the shadow world (unless this process leaves), the stream group and, given the
        options the handoff will stream with, the transfer schedule; and ``check`` the new layout's
        model when given one."""
        timeout = timedelta(seconds=self.seconds_left(build_timeout_s))
        store = self.request.store
        if check is not None:
            self.layout_check = LayoutCheck(check)
        if stream_options is not None:
            self.schedule_build = ScheduleBuild(self.request.plan, device, stream_options, self.request.lost)
        if self.role is not Role.LEAVE:
            self.world_build = build_world_async(self.new, device, store, backend=backend, timeout=timeout)
        lost = self.request.lost
        self.stream_build = StreamBuild(self.old, self.new, device, store, backend, timeout, lost)

    def schedule(self) -> PreparedSchedule | None:
        """The prepared transfer schedule, or None when none was (or is yet) made."""
        return self.schedule_build.result() if self.schedule_build is not None else None

    def prepared(self) -> bool:
        """Whether the background builds are done: the new trainer can be built (:func:`prebuild`)."""
        built = self.stream_build is not None and self.stream_build.ready
        built = built and (self.world_build is None or self.world_build.ready)
        built = built and (self.schedule_build is None or self.schedule_build.ready)
        return built and (self.layout_check is None or self.layout_check.ready)

    def readiness(self) -> Readiness:
        """This process's vote (:class:`~.cut.Readiness`); a failed preparation votes NONE (and failed)."""
        if self.failure() is not None:
            return Readiness.NONE
        if self.prebuilt is not None:
            return Readiness.READY if self.state is HandoffState.SWITCHING else Readiness.BUILT
        return Readiness.PREPARED if self.prepared() else Readiness.NONE

    def ready(self) -> bool:
        """Whether this process can switch now (new trainer built, allowed, not failed)."""
        return self.readiness() is Readiness.READY

    def take_prebuilt(self) -> None:
        """The switch committed: the new trainer is the job's now, never to be disposed with this."""
        self.prebuilt = self._dispose = None

    def failure(self) -> str | None:
        """Why this preparation cannot succeed any more, or None (what this process votes ``failed`` on)."""
        if self.release_reason is not None:
            return self.release_reason
        if self.abort_requested is not None:
            return f"aborted by request: {self.abort_requested}"
        return self._problem()

    def _problem(self) -> str | None:
        """A background build that failed, or the deadline passed."""
        builds: tuple[tuple[str, WorldBuild | _Background[Any] | None], ...] = (
            ("building the shadow world", self.world_build),
            ("building the stream group", self.stream_build),
            ("building the transfer schedule", self.schedule_build),
            ("checking the new layout's model against the plan's geometry", self.layout_check),
        )
        for what, build in builds:
            error = build.error if build is not None else None
            if error is not None:
                text = str(error).splitlines()[0] if str(error) else repr(error)
                return f"{what} failed: {text}"
        deadline = self.request.deadline
        if deadline is not None and datetime.now(UTC) >= deadline:
            return f"the deadline {deadline.isoformat()} passed before the switch"
        return None

    def wait_built(self, timeout_s: float) -> None:
        """Block until the builds end (a joiner has nothing else to do); raise when one failed, or as soon
        as the handoff is given up (an Abort must not wait for a rendezvous that will never complete)."""
        end = time.monotonic() + timeout_s
        for build in (self.world_build, self.stream_build, self.schedule_build, self.layout_check):
            while build is not None and not build.wait(min(_POLL_S, max(end - time.monotonic(), 0.0))):
                problem = self.failure()
                if problem is not None:
                    raise WorldError(problem)
                if time.monotonic() >= end:
                    raise TimeoutError(
                        f"generation {self.generation}: groups not built within {timeout_s:.0f} s"
                    )
        problem = self.failure()
        if problem is not None:
            raise WorldError(problem)

    def discard(self) -> None:
        """Give everything up: the new trainer (if built) is freed, the groups released."""
        prebuilt, dispose = self.prebuilt, self._dispose
        self.prebuilt = self._dispose = None
        if prebuilt is not None:
            prebuilt.wait_touched()
            if prebuilt.trainer is not None and dispose is not None:
                dispose(prebuilt.trainer)
        if self.world_build is not None:
            self.world_build.discard()
        if self.stream_build is not None:
            self.stream_build.discard()
