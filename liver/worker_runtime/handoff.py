"""The switch sequence: what every process of both worlds does between an agreed cut and the first step
on the new world.

Three kinds of process take part (:class:`Role`): those in both worlds (``STAY``), those only in the old
one (``LEAVE``, a scale-in or a reclaimed node) and those only in the new one (``JOIN``, a scale-out).
The sequence, in every process that has the step::

    0. prebuild  before the cut, at the boundary the vote agreed on (:func:`prebuild`): new-world
                 members build the new trainer (the new world adopted as torch.distributed's default for
                 the build only, since Megatron builds on the default world); everyone warms the new
                 world's and the stream group's communicators; the new storage is touched beside training
    1. enter     new-world members: ``enter_world`` (joiners wait here for the cut), then adopt the
                 new world as torch.distributed's default
    2. progress  all: the training progress goes from stream rank 0 (old rank 0's process) to everyone
                 over the stream group, so a joiner learns the iteration, data position and LR schedule
    3. build     new-world members: the trainer built in step 0 (built here only when none was, as for
                 a caller of :func:`switch` without one); its live tensors are the ``into=`` storage
    4. stream    all: the executor streams parameters, master weights, Adam moments and step from the
                 old trainers' live storage straight into the new trainers' storage
    5. load      new-world members: write the step, restore the progress, reseed (the factory's rule)
    6. commit    all: one MIN all-reduce of "everything above succeeded" over the stream group
    7. release   old-world members: free the old trainer's memory and release the old world; leavers
                 are done

Invariant I4. Nothing before the commit writes the old trainer: the executor only reads it, the new
trainer has storage of its own, and the one process-global thing the build touches (the random
streams: Megatron seeds its build) is captured at the cut and put back on abort. A process that fails
anywhere before the commit shuts its stream group and its new world down, so that every peer, whatever
collective it waits in, fails within moments instead of at a timeout; every process that does not see
the commit succeed rolls back: the new world is released and the old world becomes the default again
(a collective over the old world, so every old member takes part). Training then continues on the old
world as if no handoff had been tried. If the old world itself cannot be restored (one of its processes
is gone: fail-stop), :class:`HandoffFailed` says so, after releasing the old world, and the job falls
back to its checkpoint (:mod:`.fallback`).

Where the pause goes (:class:`SwitchReport`): ``switch`` is steps 1, 2 and 6 (agreement), ``transfer``
step 4, ``rebuild`` steps 3, 5 and 7; step 0 is ``prebuild_s``, before the cut. Step 4's schedule (what
to send and receive, derived from the plan alone) is made before the cut when the preparation hands it
in (``Handoff.schedule``), so ``transfer`` is the stream itself. The pause runs from the moment this
process learned the cut (the vote's answer; a joiner: ``enter_world``'s) to the moment the new trainer
is handed back."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any, Generic, TypeVar

import msgspec
import structlog
import torch
import torch.distributed as dist

from liver.reshard.holdings import pieces_of
from liver.reshard.plan import Plan
from liver.shared.collector import collector_paused
from liver.shared.errors import HandoffError
from liver.shared.geometry import ModelGeometry
from liver.worker_runtime.contract import BuildsForStream, KeptState, TrainerFactory
from liver.worker_runtime.cut import enter_world
from liver.worker_runtime.stream.executor import (
    GroupRanks,
    LocalTensor,
    PreparedSchedule,
    StreamOptions,
    StreamResult,
    devices_in_stream_order,
    prepare_schedule,
    ranks_on_device,
    staging_bytes,
    stream_device,
    stream_plan,
)
from liver.worker_runtime.world import StreamGroup, World, allreduce

log = structlog.get_logger(__name__)

T = TypeVar("T")


class Role(StrEnum):
    STAY = "stay"  # in the old and the new world
    LEAVE = "leave"  # only in the old world
    JOIN = "join"  # only in the new world


class HandoffStage(StrEnum):
    """Where a handoff stood when it was given up: before the cut, or the switch step that failed."""

    PREPARE = "prepare"  # building the shadow world before any cut
    PREBUILD = "prebuild"  # building the new trainer at the agreed boundary before the cut
    CUT = "cut"  # the vote at an iteration boundary
    ENTER = "enter"
    PROGRESS = "progress"
    BUILD = "build"
    STREAM = "stream"
    CHECK = "check"  # a recovery's state, before anything is built on it (checksums, finite values)
    LOAD = "load"
    COMMIT = "commit"


class RecoveredStateInvalid(HandoffError):
    """A recovery's state failed its check before the first step on the new world (the message names
    the tensor): the recovery falls back to the durable checkpoint rather than train on it."""


class HandoffAborted(HandoffError):
    """The handoff did not commit; this process rolled back and the old world (if it had one) trains."""

    def __init__(self, generation: int, stage: HandoffStage, reason: str) -> None:
        self.generation = generation
        self.stage = stage
        self.reason = reason
        super().__init__(f"handoff to generation {generation} aborted at {stage}: {reason}")


class HandoffFailed(HandoffError):
    """The handoff failed and the old world could not be restored (a process of it is gone): the job must
    fall back to its last checkpoint (I4's fail-stop branch; :class:`~.runtime.LiveRuntime` does when it
    has a checkpoint configured). ``stage`` and ``reason`` are the handoff's failure."""

    def __init__(self, generation: int, stage: HandoffStage, reason: str, restore_error: str) -> None:
        self.generation = generation
        self.stage = stage
        self.reason = reason
        self.restore_error = restore_error
        super().__init__(
            f"handoff to generation {generation} failed at {stage} ({reason}) and the old world cannot be "
            f"restored ({restore_error})"
        )

    def __reduce__(self) -> tuple[type, tuple[int, HandoffStage, str, str]]:
        return type(self), (self.generation, self.stage, self.reason, self.restore_error)


class SwitchReport(msgspec.Struct, kw_only=True):
    """One process's switch to a new generation: the pause and where it went (seconds), and the bytes.

    ``pause_s`` runs from this process learning the cut to the new trainer being handed back;
    ``switch_s + transfer_s + rebuild_s`` accounts for all of it but bookkeeping. The job's pause is
    the largest over its processes. ``first_step_s`` (the first step on the new world) is filled in
    when the training loop asks for its next iteration.
    """

    generation: int
    from_generation: int
    role: Role
    iteration: int  # the cut: steps completed before the switch (training resumes with the next)
    old_rank: int | None
    new_rank: int | None
    pause_s: float
    switch_s: float  # enter the new world, adopt it, share the progress, commit vote
    transfer_s: float  # the executor's stream
    rebuild_s: float  # build the new trainer, load it, release the old world
    commit_s: float  # the commit vote alone (part of switch_s)
    build_s: float  # building the new trainer (part of rebuild_s)
    load_s: float  # loading the streamed state and the progress into it (part of rebuild_s)
    prepare_s: float | None = None  # request -> ready, in the background while training went on
    warmup_s: float | None = None  # a joiner's mock warm-up (before it joined any group)
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    staging_bytes: int = 0
    peak_extra_bytes: int = 0
    first_step_s: float | None = None
    schedule_s: float = 0.0  # building the transfer schedule in the pause (part of transfer_s); 0: prepared
    prebuild_s: float | None = None  # the new trainer's build before the cut (training stood still)
    prebuild_iteration: int | None = None  # the boundary it was built at (None: a joiner, not training)
    stood_in: tuple[int, ...] = ()  # lost old ranks whose state this process sent from its peer copies


@dataclass
class Prebuilt(Generic[T]):
    """The new trainer built before the cut (:func:`prebuild`): what the switch streams into.

    ``trainer`` and ``into`` are None in a process that leaves. ``touching`` zeroes the new trainer's
    storage beside training (its first touch, so the pause pays no page fault); the switch waits for it
    before it streams, and the values it leaves are what the stream does not overwrite (vocabulary
    padding, which must be zero)."""

    trainer: T | None
    into: dict[int, LocalTensor] | None
    build_s: float  # adopt the new world, build, read the new trainer's views (on the training thread)
    warm_s: float  # the first collective on every group of the new world and on the stream group
    iteration: int | None  # the boundary it was built at; None for a joiner
    touching: threading.Thread | None = None
    staging: torch.Tensor | None = None  # the executor's staging buffer, made and touched beside training

    @property
    def seconds(self) -> float:
        """How long training stood still for it."""
        return self.build_s + self.warm_s

    def wait_touched(self) -> None:
        if self.touching is not None:
            self.touching.join()
            self.touching = None


@dataclass
class Handoff(Generic[T]):
    """Everything one process needs to run the switch sequence for one generation."""

    factory: TrainerFactory[T]
    plan: Plan
    device: Any  # liver.shared.layout.Device
    stream: StreamGroup
    old_world: World | None
    new_world: World | None
    old_trainer: T | None
    iteration: int | None  # the cut's iteration; None for a joiner, which learns it in enter_world
    from_generation: int
    control_timeout: timedelta
    join_timeout: timedelta
    stream_options: StreamOptions
    on_stream_step: Callable[[int, int, int], None] | None = None
    on_cut: Callable[[int, Any], None] | None = None  # the user's hook: (generation, old trainer)
    schedule: PreparedSchedule | None = (
        None  # made in preparation (:func:`handoff_schedule`); else built here
    )
    prebuilt: Prebuilt[T] | None = None  # built before the cut (:func:`prebuild`); else built here
    lost: tuple[Any, ...] = ()  # old-world devices whose processes are gone (in no group, sending nothing)
    broken: bool = False  # the old world was lost before the handoff (a recovery): its members hold
    # their state (``kept``, or ``old_trainer``) but no old-world group; the cut is the last iteration
    # they completed
    kept: KeptState | None = None

    @property
    def generation(self) -> int:
        return self.stream.new.generation

    @property
    def role(self) -> Role:
        held = self.old_trainer is not None or self.kept is not None
        in_old = self.old_world is not None or (self.broken and held)
        if in_old and self.new_world is not None:
            return Role.STAY
        return Role.LEAVE if in_old else Role.JOIN


def switch(handoff: Handoff[T], cut_at: float | None = None) -> tuple[T | None, SwitchReport]:
    """Run the switch sequence (see the module docstring) for this process.

    ``cut_at`` is when this process learned the cut (``time.perf_counter()``); a joiner passes None and
    its pause starts when ``enter_world`` returns. Returns the new trainer (None for a leaver) and the
    report; raises :class:`HandoffAborted` after rolling back, or :class:`HandoffFailed`.

    Python's automatic garbage collection is off meanwhile: building a model allocates enough objects
    to set off a full collection, which on a large heap costs more than the rest of the pause (0.4-1.7 s
    here). The old trainer's tensors are freed at the commit (``factory.dispose``), so its memory does
    not wait for a collection either; its remaining Python objects go with the next automatic one.
    """
    with collector_paused():
        return _switch(handoff, cut_at)


class _Mark(StrEnum):
    """The points in time of one switch that its report's spans run between."""

    CUT = "cut"  # this process learned the cut (a joiner: enter_world returned)
    ENTERED = "entered"  # in the new world, the progress shared
    BUILT = "built"  # the new trainer is there
    STREAMED = "streamed"  # the state is in it
    LOADED = "loaded"  # step, progress and random streams too
    COMMITTED = "committed"  # every process said it succeeded
    DONE = "done"  # the old world released


class _PhaseTimer:
    """Named marks on ``time.perf_counter()``: a span of the report is the difference of two marks,
    not of hand-kept variables that are easy to mix up."""

    def __init__(self, cut_at: float | None) -> None:
        self._at: dict[_Mark, float] = {}
        if cut_at is not None:
            self._at[_Mark.CUT] = cut_at

    def mark(self, name: _Mark) -> None:
        self._at[name] = time.perf_counter()

    def has(self, name: _Mark) -> bool:
        return name in self._at

    def span(self, start: _Mark, end: _Mark) -> float:
        return self._at[end] - self._at[start]


class _SwitchRun(Generic[T]):
    """One process's switch up to its commit: the step it is at (what a failure is reported at), the
    marks of its pause and what the steps made so far (the new trainer, the stream's result)."""

    def __init__(
        self, h: Handoff[T], role: Role, old_rank: int | None, new_rank: int | None, cut_at: float | None
    ) -> None:
        self.h = h
        self.role = role
        self.old_rank = old_rank
        self.new_rank = new_rank
        self.clock = _PhaseTimer(cut_at)
        self.stage = HandoffStage.ENTER
        self.iteration: int | None = None
        self.new_trainer: T | None = None
        self.into: dict[int, LocalTensor] | None = None
        self.result: StreamResult | None = None
        self.stood_in: tuple[int, ...] = ()

    def to_commit(self) -> None:
        """Steps 1 to 6 of the module docstring; raises at the first that fails (``stage`` names it)."""
        self.iteration = self.h.iteration
        self._at_cut()
        progress = self._enter()
        self._build()
        self._stream_state()
        self._load(progress)
        self.stage = HandoffStage.COMMIT
        _commit(self.h.stream, self.h.control_timeout)
        self.clock.mark(_Mark.COMMITTED)

    def _at_cut(self) -> None:
        h = self.h
        if h.on_cut is not None and h.old_trainer is not None and not h.broken:
            # The user's hook at the cut: the old world is still the default one, nothing has moved.
            self.stage = HandoffStage.CUT
            h.on_cut(h.generation, h.old_trainer)
            self.stage = HandoffStage.ENTER

    def _enter(self) -> bytes:
        """Enter and adopt the new world, then share the training progress; returns it."""
        h = self.h
        if h.new_world is not None:
            timeout = h.join_timeout if self.role is Role.JOIN else h.control_timeout
            self.iteration = enter_world(h.new_world, h.iteration, timeout=timeout)
            if not self.clock.has(_Mark.CUT):
                self.clock.mark(_Mark.CUT)
            h.new_world.adopt_as_default(h.control_timeout)
        assert self.clock.has(_Mark.CUT) and self.iteration is not None
        self.stage = HandoffStage.PROGRESS
        mine = h.factory.progress(h.old_trainer) if h.old_trainer is not None else None
        if h.kept is not None:
            mine = h.kept.progress
        progress = _broadcast_bytes(h.stream, mine, h.control_timeout)
        self.clock.mark(_Mark.ENTERED)
        return progress

    def _build(self) -> None:
        h = self.h
        self.stage = HandoffStage.BUILD
        if h.prebuilt is not None:
            h.prebuilt.wait_touched()
            self.new_trainer, self.into = h.prebuilt.trainer, h.prebuilt.into
        elif h.new_world is not None:
            self.new_trainer = h.factory.build(h.new_world)
            self.into = h.factory.local_state(self.new_trainer)
        self.clock.mark(_Mark.BUILT)

    def _stream_state(self) -> None:
        h = self.h
        self.stage = HandoffStage.STREAM
        if h.kept is not None and h.kept.copy_failure is not None:
            raise RecoveredStateInvalid(h.kept.copy_failure)
        self.stood_in = tuple(sorted(h.kept.stand_ins)) if h.kept is not None else ()
        self.result = _stream(h, self.old_rank, self.new_rank, self.into)
        self.clock.mark(_Mark.STREAMED)
        if h.broken or h.lost:
            self.stage = HandoffStage.CHECK
            check_finite(h.plan.model, self.result.new_state)

    def _load(self, progress: bytes) -> None:
        assert self.result is not None
        self.stage = HandoffStage.LOAD
        if self.new_trainer is not None:
            self.h.factory.resume(self.new_trainer, self.result.new_state, progress)
        self.clock.mark(_Mark.LOADED)


def _switch(handoff: Handoff[T], cut_at: float | None) -> tuple[T | None, SwitchReport]:
    h = handoff
    role = h.role
    old_rank, new_rank = ranks_on_device(h.plan, h.device)
    bound = log.bind(generation=h.generation, role=str(role), old_rank=old_rank, new_rank=new_rank)
    captured_rng = h.factory.capture_rng() if h.old_world is not None else None
    run = _SwitchRun(h, role, old_rank, new_rank, cut_at)
    failure: str | None = None
    try:
        run.to_commit()
    except Exception as error:
        bound.warning("handoff.failed", stage=run.stage, error=repr(error))
        failure = _first_line(error)
    if failure is not None:
        # Outside the except block, so that the traceback (whose frames hold the stream group) is gone:
        # the groups must really be destroyed for the peers to notice.
        run.new_trainer = run.into = None
        _roll_back(h, captured_rng, run.stage, failure)
        raise HandoffAborted(h.generation, run.stage, failure)

    # Committed: from here on the new world is the job's. Release the old one.
    _release_old(h)
    run.clock.mark(_Mark.DONE)
    report = _report(run)
    bound.info(
        "handoff.committed",
        iteration=report.iteration,
        pause_s=round(report.pause_s, 4),
        switch_s=round(report.switch_s, 4),
        transfer_s=round(report.transfer_s, 4),
        rebuild_s=round(report.rebuild_s, 4),
    )
    return run.new_trainer, report


def _release_old(h: Handoff[T]) -> None:
    """After the commit: free the old trainer (or the kept state), the old world and the stream group."""
    old_trainer, h.old_trainer = h.old_trainer, None
    if old_trainer is not None:
        h.factory.dispose(old_trainer)
        del old_trainer
    if h.kept is not None:
        h.kept.dispose()
        h.kept = None
    if h.old_world is not None:
        h.old_world.release()
    h.stream.release()


def _report(run: _SwitchRun[T]) -> SwitchReport:
    """The committed switch's report: where its pause went (module docstring) and the stream's bytes."""
    h, span = run.h, run.clock.span
    assert run.result is not None and run.iteration is not None
    stats = run.result.stats
    enter = span(_Mark.CUT, _Mark.ENTERED)
    build = span(_Mark.ENTERED, _Mark.BUILT)
    transfer = span(_Mark.BUILT, _Mark.STREAMED)
    load = span(_Mark.STREAMED, _Mark.LOADED)
    commit = span(_Mark.LOADED, _Mark.COMMITTED)
    release = span(_Mark.COMMITTED, _Mark.DONE)
    return SwitchReport(
        generation=h.generation,
        from_generation=h.from_generation,
        role=run.role,
        iteration=int(run.iteration),
        old_rank=run.old_rank,
        new_rank=run.new_rank,
        pause_s=span(_Mark.CUT, _Mark.DONE),
        switch_s=enter + commit,
        transfer_s=transfer,
        rebuild_s=build + load + release,
        commit_s=commit,
        build_s=build,
        load_s=load,
        bytes_sent=stats.bytes_sent,
        bytes_received=stats.bytes_received,
        bytes_local=stats.bytes_local,
        staging_bytes=stats.staging_bytes,
        peak_extra_bytes=stats.peak_extra_bytes,
        schedule_s=stats.schedule_seconds,
        prebuild_s=None if h.prebuilt is None else h.prebuilt.seconds,
        prebuild_iteration=None if h.prebuilt is None else h.prebuilt.iteration,
        stood_in=run.stood_in,
    )


def check_finite(model: ModelGeometry, state: Mapping[int, LocalTensor]) -> None:
    """:class:`RecoveredStateInvalid` naming the first tensor of ``state`` with a value that is not
    finite. A recovery checks what it received before the first step: a NaN that a lost process left in
    its shard (or a copy of it) would otherwise be trained on, and saved, and restarted from."""
    tensors = model.tensors(optimizer=True)
    for ti, value in state.items():
        for piece in pieces_of(value):
            if piece.is_floating_point() and not bool(torch.isfinite(piece).all()):
                name = tensors[ti].name
                raise RecoveredStateInvalid(f"the recovered {name} holds values that are not finite")


def _stream(
    h: Handoff[T], old_rank: int | None, new_rank: int | None, into: dict[int, LocalTensor] | None
) -> StreamResult:
    old_state = h.factory.local_state(h.old_trainer) if h.old_trainer is not None else {}
    if h.kept is not None:
        old_state = h.kept.state
    on_step = None
    hook, generation = h.on_stream_step, h.generation
    if hook is not None:

        def on_step(layer: int, rnd: int) -> None:
            hook(generation, layer, rnd)

    staging = h.prebuilt.staging if h.prebuilt is not None else None
    if staging is not None and staging.device != stream_device(None, old_state, into):
        staging = None
    return stream_plan(
        h.plan,
        old_rank=old_rank,
        new_rank=new_rank,
        group=h.stream.group(),
        group_ranks=GroupRanks.by_device(h.plan, h.lost),
        old_state=old_state,
        into=into,
        options=h.stream_options,
        on_step=on_step,
        schedule=h.schedule,
        staging=staging,
        stand_in_state=h.kept.stand_ins if h.kept is not None else None,
    )


def prebuild(
    factory: TrainerFactory[T],
    *,
    builds_for_stream: BuildsForStream[T] | None = None,
    new_world: World | None,
    old_world: World | None,
    stream: StreamGroup,
    iteration: int | None,
    timeout: timedelta,
    schedule: PreparedSchedule | None = None,
) -> Prebuilt[T]:
    """Step 3 of the switch moved before the cut: build the new trainer and warm every communicator of
    the new world and of the stream group, at the boundary the vote agreed (``BUILD``).

    Every process of both worlds calls it at that boundary (a joiner as soon as its groups are built):
    Megatron's build makes collectives over the new world's default group, and the warm-up is a
    collective over each group. In a process of the old world it runs on the training thread between two
    steps: the build needs the new world as torch's default world and Megatron's ``parallel_state``
    describing it, and it seeds the random streams, all process-global state the training step reads, so
    it cannot run beside a step. Afterwards the old world is the default again and the random streams
    are as they were (invariant I4: training on the old world goes on exactly as if nothing was built).
    The new trainer's storage is then touched beside training (:attr:`Prebuilt.touching`). Given this
    process's transfer ``schedule``, one tiny message each way with every peer of the stream warms the
    point-to-point paths too (NCCL connects each pair on its first send). ``builds_for_stream`` is the
    factory again where it implements :class:`~.contract.BuildsForStream` (the runtime's
    ``JobAbilities``): the build skips initialising values and every tensor it allocated is touched.
    """
    started = time.perf_counter()
    captured = factory.capture_rng() if old_world is not None else None
    trainer: T | None = None
    into: dict[int, LocalTensor] | None = None
    with collector_paused():
        try:
            if new_world is not None:
                new_world.adopt_as_default(timeout)
                build = factory.build if builds_for_stream is None else builds_for_stream.build_for_stream
                trainer = build(new_world)
                into = factory.local_state(trainer)
            built = time.perf_counter()
            if new_world is not None:
                new_world.warm(timeout)
            stream.warm(timeout)
            if schedule is not None:
                warm_peers(stream, schedule, timeout)
        except BaseException:
            if trainer is not None:
                factory.dispose(trainer)
            trainer = into = None
            raise
        finally:
            if old_world is not None and not old_world.released:
                old_world.restore_default()
            if captured is not None:
                factory.restore_rng(captured)
    done = time.perf_counter()
    prebuilt = Prebuilt(trainer, into, built - started, done - built, iteration)
    touch = _storage_of(builds_for_stream, trainer, into) if trainer is not None else []
    if schedule is not None:
        size = staging_bytes(schedule, preallocated=trainer is not None)
        if size:
            prebuilt.staging = torch.empty(size, dtype=torch.uint8, device=_staging_device(stream, into))
            touch.append(prebuilt.staging)
    if touch:
        prebuilt.touching = _touch(touch)
    log.info(
        "handoff.prebuilt",
        generation=stream.new.generation,
        iteration=iteration,
        build_s=round(prebuilt.build_s, 4),
        warm_s=round(prebuilt.warm_s, 4),
    )
    return prebuilt


WARM_TAG = 2_147_483_646
"""The warm-up messages' tag: they complete before the stream's first message, whatever its tag."""


def warm_peers(stream: StreamGroup, schedule: PreparedSchedule, timeout: timedelta) -> int:
    """One one-element message to every process this one sends to in ``schedule`` and from every one it
    receives from; returns how many. Every process of the stream group calls it at the same point, with
    its own schedule of the same plan, so each send here is matched by a receive there."""
    to: set[int] = set()
    frm: set[int] = set()
    for step in schedule.schedule.steps():
        to.update(m.peer for m in step.sends)
        frm.update(m.peer for m in step.recvs)
    pg = stream.group()
    where = torch.device("cuda", stream.device.index) if stream.backend == "nccl" and stream.device else None
    inbox = {peer: torch.zeros(1, device=where) for peer in sorted(frm)}
    works = [pg.recv([t], peer, WARM_TAG) for peer, t in inbox.items()]
    works += [pg.send([torch.zeros(1, device=where)], peer, WARM_TAG) for peer in sorted(to)]
    for work in works:
        if work.wait(timeout) is False:
            raise TimeoutError(f"a warm-up message of the stream group did not complete within {timeout}")
    return len(works)


def _staging_device(stream: StreamGroup, into: dict[int, LocalTensor] | None) -> torch.device:
    """Where the executor will stage: the new shards' device, else (a process that leaves) the GPU of
    an NCCL stream group, else the CPU; :func:`_stream` hands the buffer in only when it matches."""
    if into:
        return stream_device(None, {}, into)
    if stream.backend == "nccl" and stream.device is not None:
        return torch.device("cuda", stream.device.index)
    return torch.device("cpu")


def _storage_of(
    builds_for_stream: BuildsForStream[T] | None, trainer: T, into: dict[int, LocalTensor] | None
) -> list[torch.Tensor]:
    if builds_for_stream is not None:
        return list(builds_for_stream.storage(trainer))
    return [piece for value in (into or {}).values() for piece in pieces_of(value)]


def _touch(tensors: list[torch.Tensor]) -> threading.Thread:
    """Zero ``tensors`` on a thread of their own: their pages are faulted in now, beside training."""

    def run() -> None:
        with torch.no_grad():
            for tensor in tensors:
                tensor.zero_()

    thread = threading.Thread(target=run, name="liver-first-touch", daemon=True)
    thread.start()
    return thread


def handoff_schedule(
    plan: Plan, device: Any, options: StreamOptions, lost: Collection[Any] = ()
) -> PreparedSchedule:
    """The executor's schedule of the process on ``device`` for the handoff streaming ``plan``.

    Pure work on the plan (no tensor, no group), so the preparation runs it off the training thread and
    the paused switch only checks it: the stream group numbers processes by device the way
    :meth:`GroupRanks.by_device` does. Raises ``PlanMismatch`` when the plan does not fit the device.
    """
    old_rank, new_rank = ranks_on_device(plan, device)
    order = devices_in_stream_order(plan, lost)
    if device not in order:
        why = "is lost" if device in lost else "is in neither world of the plan"
        raise ValueError(f"`device`: {device} {why}")
    return prepare_schedule(
        plan,
        old_rank=old_rank,
        new_rank=new_rank,
        group_ranks=GroupRanks.by_device(plan, lost),
        group_rank=order.index(device),
        group_size=len(order),
        options=options,
    )


def _broadcast_bytes(stream: StreamGroup, payload: bytes | None, timeout: timedelta) -> bytes:
    """``payload`` of stream rank 0, delivered to every process of the stream group."""
    pg = stream.group()
    if pg.rank() == 0 and payload is None:
        raise RuntimeError("stream rank 0 has no training progress to share (it holds no old trainer)")
    size = torch.tensor([len(payload) if pg.rank() == 0 and payload is not None else 0], dtype=torch.int64)
    _broadcast(pg, size, timeout)
    data = torch.zeros(int(size.item()), dtype=torch.uint8)
    if pg.rank() == 0 and payload is not None:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    _broadcast(pg, data, timeout)
    return bytes(data.numpy().tobytes())


def _broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor, timeout: timedelta) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    options.timeout = timeout
    pg.broadcast([tensor], options).wait()


def _commit(stream: StreamGroup, timeout: timedelta) -> None:
    """Every process of both worlds says it succeeded; an all-reduce completes only if all of them did."""
    flag = torch.ones(1, dtype=torch.int64)
    allreduce(stream.group(), flag, dist.ReduceOp.MIN, timeout)
    if int(flag.item()) != 1:
        raise RuntimeError("a process of the handoff reported a failure")


def _roll_back(h: Handoff[T], captured_rng: object, stage: HandoffStage, failure: str) -> None:
    """Undo everything this process did for the handoff, and make its peers notice at once.

    When the old world cannot be restored it is released too: its other survivors, waiting in the same
    restoring collective, then fail at once instead of at the control timeout."""
    h.stream.release()
    if h.new_world is not None:
        h.new_world.release()
    gc.collect()  # the new trainer's modules hold the new world's groups in reference cycles
    if h.old_world is None:
        return
    try:
        h.old_world.adopt_as_default(h.control_timeout)
    except Exception as error:
        restore_error = f"{h.old_world!r}: {_first_line(error)}"
        h.old_world.release()
        gc.collect()
        raise HandoffFailed(h.generation, stage, failure, restore_error) from error
    h.factory.restore_rng(captured_rng)


def _first_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text.splitlines()[0][:500]
