"""The generation coordinator's state machine: events in, actions out, no I/O and no clock.

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

Why it is built this way:

* **One outcome per generation.** Every step that others can observe is preceded by a compare-and-set
  on the job's record (:mod:`.record`): beginning ``g``, the switch intent, the commit, the abort.
  Commit and abort of ``g`` are both writes from the revision that holds ``g`` pending, so at most one
  lands; the published outcome is written into the record by the same write and re-published after a
  restart under the same message id. A coordinator whose write finds another's stands down.
* **The switch is the point of no return (I4).** Before the switch command goes out nothing of the
  active world has changed: any failure aborts and training continues on the old world, and anything
  that makes the target impossible (a node of the new world reclaimed, a worker lost) cancels and
  re-plans. After it, the old ranks start overwriting their state, so any failure that stops the
  handoff, including a lost old-world worker that had not finished sending, is a checkpoint fallback.
  A leaving worker that has acked its switch may go: its part is done.
* **Triggers, not messages, are queued.** An event that arrives during a handoff either is already
  served by the pending target (folded into it), or waits, or makes the target impossible. Waiting
  triggers are planned against the world that is live when the handoff ends, all of them in one
  handoff, and the ones that no longer change anything are settled as such.
* **Deadlines come from the triggers** (:mod:`.config`): the handoff must be done a margin before the
  earliest reclaim among its triggers, and everything before the switch must leave the switch the time
  the plan says it needs.
* **Writes are serialised.** While a write is in flight, a decision to stop the handoff is deferred to
  its result, so the record never has two writers inside one coordinator.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Final

from msgspec.structs import replace

from liver.reshard.plan import slice_participants
from liver.shared.errors import InputError, LiverError
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.messages import (
    Abort,
    AbortOutcome,
    GenerationAborted,
    GenerationCommitted,
    HandoffPhase,
    Heartbeat,
    Hello,
    JobMembership,
    PlanningStage,
    Prepare,
    ResizeRequested,
    Switch,
    TopologyPlanned,
    TransferPlanned,
    WorkerDevice,
    WorkerPhase,
    WorkerStatus,
)
from liver.shared.subjects import (
    KV_PLAN_SLICES,
    generation_msg_id,
    slice_keys_of_generation,
    validate_token,
)

from .actions import (
    Action,
    ExpectTransfer,
    Note,
    NoteLevel,
    ProbeWorkers,
    Publish,
    ReleasePlan,
    RequestTopology,
    SendCommand,
    Settle,
    SettleOutcome,
    TopologyRequest,
    WriteMembership,
    WriteRecord,
)
from .config import CoordinatorConfig, handoff_deadline, switch_estimate_s, trigger_deadline
from .events import (
    BusReconnected,
    Event,
    PlanningFailed,
    RecordConflict,
    RecordObserved,
    RecordWriteFailed,
    RecordWritten,
    Tick,
    WorkerLost,
    WorkersProbed,
    WorldStarted,
)
from .membership import HelloPending, Membership, MembershipError
from .record import (
    GenerationRecord,
    Participant,
    PendingHandoff,
    PendingPhase,
    SettledEvent,
    Trigger,
    TriggerSource,
    bus_event_ids,
)


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
"""Every allowed phase change; :meth:`Coordinator._move` refuses any other."""


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
    GenerationPhase.SWITCH: frozenset({Wait.SWITCHED, Wait.COMMIT_WRITE}),
    GenerationPhase.COMMITTED: frozenset({Wait.NOTHING}),
    GenerationPhase.CLEANUP: frozenset({Wait.NOTHING}),
    GenerationPhase.ABORTED: frozenset({Wait.ABORT_WRITE}),
    GenerationPhase.STANDBY: frozenset({Wait.NOTHING}),
}
"""What each phase may wait for between two inputs (``Coordinator.handle`` and ``restore`` return with
a pair from this table; COMMITTED, CLEANUP and ABORTED pass within one input). A prepare waits for its
begin write, then the topology plan, the transfer plan, workers on every participant's device (only
after a restart), and the prepared acks, in that order; the rest wait for one record write or none."""


class IllegalTransition(LiverError, RuntimeError):
    """A phase change the table does not allow: a bug in the machine, never a consequence of input."""


class CoordinatorError(InputError):
    """A call the coordinator cannot honour (``restore`` of a wrong record or at a wrong time)."""


_HANDOFF_PHASES: Final = frozenset({GenerationPhase.PREPARE, GenerationPhase.READY, GenerationPhase.SWITCH})
_ABORT_PHASE_NAME: Final = {
    GenerationPhase.PREPARE: "prepare",
    GenerationPhase.READY: "ready",
    GenerationPhase.SWITCH: "switch",
}
_HISTORY: Final = 200


@dataclass
class _Stop:
    """Why a handoff is being stopped and what follows."""

    reason: str
    replan: bool
    settle: SettleOutcome = SettleOutcome.ABORTED
    recover: bool = False
    """A member of the old world was lost during the switch, before anything committed: its survivors
    hold the cut's state, and the re-planned generation moves them live around the loss."""

    def merge(self, other: _Stop) -> _Stop:
        """The stronger decision wins: an abort without re-planning beats a cancel that re-plans, and
        a live recovery beats a plain re-plan (the old world is broken whichever came first)."""
        if self.replan and not other.replan:
            return other
        if self.replan and other.recover and not self.recover:
            return other
        return self


@dataclass
class _Handoff:
    """In-memory state of the pending handoff (the record holds what survives a restart)."""

    generation: int
    from_generation: int
    triggers: list[Trigger]
    began_at: datetime
    deadline: datetime
    layout: ParallelLayout | None = None
    placement: Placement | None = None
    topology: TopologyPlanned | None = None
    transfer: TransferPlanned | None = None
    bytes_planned: int | None = None
    participants: dict[str, Device] = field(default_factory=dict)
    prepared: set[str] = field(default_factory=set)
    switched: dict[str, WorkerStatus] = field(default_factory=dict)
    switch_sent: bool = False
    prepare: Prepare | None = None
    """The Prepare broadcast (sent again after the bus was away)."""
    stop: _Stop | None = None
    stopped_in: GenerationPhase | None = None
    resumed: bool = False
    """Taken over from the record after a restart: acks sent meanwhile are lost, so whether a
    participant committed is unknown (a loss then falls back rather than recover from the old world),
    until a participant says its old world broke (:attr:`old_world_broke`)."""
    old_world_broke: bool = False
    """A participant said (``peer_lost``, or a heartbeat marked ``broken``) that its world of the
    generation before this one lost a peer: it never committed, so no participant did (the commit is a
    collective of all of them) and the old world's survivors hold the cut's state."""
    outcome: GenerationAborted | None = None
    failure: str | None = None
    """A participant's failure past the switch, held while a probe finds out whether a member is gone
    (a joiner whose enter broke on a peer killed at the cut fails before the survivors' peer_lost
    arrives): a loss makes it a live recovery, none the checkpoint."""

    @property
    def event_id(self) -> str:
        return self.triggers[0].event_id

    @property
    def uncommitted(self) -> bool:
        """No participant acked its switch, and no ack was lost to a restart or a participant says its
        old world broke: the commit (a collective of every participant) has not happened, so the old
        world's survivors hold the cut's state (I4)."""
        return not self.switched and (not self.resumed or self.old_world_broke)

    @property
    def target(self) -> frozenset[Device] | None:
        return None if self.placement is None else frozenset(self.placement.devices)

    def worker_on(self, device: Device) -> str | None:
        for worker, d in self.participants.items():
            if d == device:
                return worker
        return None


class Coordinator:
    """The coordinator of one job. Feed it with :meth:`handle`; carry out what it returns, in order.

    ``instance_id`` names this coordinator process (a fresh one per start, such as a UUID): every record
    it writes carries it, which is how it tells its own writes from another coordinator's.
    """

    def __init__(self, job_id: str, *, instance_id: str, config: CoordinatorConfig | None = None) -> None:
        self.job_id = validate_token(job_id, "job_id")
        self.instance_id = validate_token(instance_id, "instance_id")
        self.config = config or CoordinatorConfig()
        self.membership = Membership(job_id, self.config.heartbeat_timeout_s)
        self.silent_workers = 0
        """Workers declared lost because their heartbeats stopped for the timeout (for the metrics)."""
        self._phase = GenerationPhase.DOWN
        self._wait = Wait.NOTHING
        self._record: GenerationRecord | None = None
        self._revision = 0
        self._inflight: GenerationRecord | None = None
        self._handoff: _Handoff | None = None
        self._deferred: _Stop | None = None
        self._early_world: WorldStarted | None = None
        self._queue: list[Trigger] = []
        self._departing: set[Device] = set()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._unrecorded: list[SettledEvent] = []
        self._no_change: tuple[list[Trigger], GenerationAborted] | None = None
        """Settlements the next record write carries (an event is acknowledged only after that)."""
        self._history: list[tuple[GenerationPhase, GenerationPhase, str]] = []
        self._out: list[Action] = []
        self._now: datetime | None = None
        self._restored_at: datetime | None = None
        self._world_members: JobMembership | None = None
        self._world_members_key: tuple[int, int] | None = None
        self._probing: tuple[int, datetime] | None = None
        """A probe of a world's members in flight: its number, and when to stop waiting for it. No
        handoff begins meanwhile, so that every member found gone is planned around at once."""
        self._probes = 0
        self._broken_heard: int | None = None  # a generation a heartbeat said broke, acted on once

    # -- what tests and the adapter may look at ---------------------------------------------------

    @property
    def phase(self) -> GenerationPhase:
        return self._phase

    @property
    def wait(self) -> Wait:
        return self._wait

    @property
    def record(self) -> GenerationRecord | None:
        """The record as this coordinator last wrote or adopted it."""
        return self._record

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def pending_generation(self) -> int | None:
        return None if self._handoff is None else self._handoff.generation

    @property
    def queued(self) -> tuple[str, ...]:
        """Event ids of the triggers waiting for the next handoff."""
        return tuple(t.event_id for t in self._queue)

    @property
    def open_events(self) -> frozenset[str]:
        """Ids of the bus events this coordinator will still settle: the pending handoff's triggers
        and the queued ones. The adapter holds their stream messages unacknowledged until a
        :class:`Settle` names them, and acknowledges a redelivered event that is not among them."""
        triggers = self._queue + (self._handoff.triggers if self._handoff is not None else [])
        return frozenset(bus_event_ids(triggers))

    @property
    def history(self) -> tuple[tuple[GenerationPhase, GenerationPhase, str], ...]:
        """The latest phase changes: (from, to, why)."""
        return tuple(self._history)

    def next_deadline(self) -> datetime | None:
        """The next moment a :class:`Tick` could change something: when the adapter should tick."""
        times = [t for t in (self.membership.next_deadline(),) if t is not None]
        if self._probing is not None:
            times.append(self._probing[1])
        h = self._handoff
        if h is not None and self._phase in (GenerationPhase.PREPARE, GenerationPhase.READY):
            times.append(self._prepare_deadline(h))
        elif h is not None and self._phase is GenerationPhase.SWITCH:
            times.append(h.deadline)
        return min(times, default=None)

    # -- entry points ---------------------------------------------------------------------------------

    def handle(self, event: Event, now: datetime) -> list[Action]:
        """Apply one event at time ``now``; return the actions to carry out, in order."""
        self._start(now)
        match event:
            case ResizeRequested():
                self._on_resize(event)
            case TopologyPlanned():
                self._on_topology(event)
            case TransferPlanned():
                self._on_transfer(event)
            case PlanningFailed():
                self._on_planning_failed(event)
            case WorkerStatus():
                self._on_status(event)
            case Hello() | Heartbeat():
                self._on_presence(event)
            case WorkerLost():
                self._on_worker_lost(event)
            case WorkersProbed():
                self._on_probed(event)
            case WorldStarted():
                self._on_world_started(event)
            case Tick():
                self._on_tick()
            case BusReconnected():
                self._on_reconnected()
            case RecordWritten():
                self._on_written(event.revision)
            case RecordConflict():
                self._on_conflict(event)
            case RecordWriteFailed():
                self._on_write_failed(event)
            case RecordObserved():
                self._on_observed(event)
            case _:
                raise TypeError(f"not a coordinator event: {type(event).__name__}")
        self._check_deadlines()
        return self._finish()

    def restore(self, record: GenerationRecord, revision: int, now: datetime) -> list[Action]:
        """Take the job over from its stored record (after a restart, or to end a standby).

        Re-publishes the last outcome (its message id makes the copy harmless). A handoff found before
        its switch intent is aborted, keeping the old world, and its triggers are re-planned as a new
        generation; one found after it is resumed: the switch command is sent again and the handoff
        then commits or falls back. Either way it ends exactly once, because that end is a
        compare-and-set from the revision read here.
        """
        if self._phase not in (GenerationPhase.DOWN, GenerationPhase.STANDBY) or self._inflight is not None:
            raise CoordinatorError(f"restore needs an idle coordinator, this one is in {self._phase.value}")
        if record.job_id != self.job_id:
            raise CoordinatorError(f"`job_id`: the record is for {record.job_id!r}, not {self.job_id!r}")
        if revision < 1:
            raise CoordinatorError(
                f"`revision`: a stored record has a revision of at least 1, got {revision}"
            )
        self._start(now)
        self._restored_at = now
        self._record, self._revision = record, revision
        self._handoff, self._deferred, self._wait = None, None, Wait.NOTHING
        self._unrecorded = []
        self._restore_settled(record.settled)
        last = record.last_outcome
        if last is not None:
            self._remember(last.event_id)
            self._publish(last)
            if isinstance(last, GenerationAborted):
                self._emit(
                    SendCommand(
                        command=Abort(job_id=self.job_id, generation=last.generation, reason=last.reason)
                    )
                )
        pending = record.pending
        self._note("info", "restored", generation=record.generation, revision=revision, live=record.live)
        if not record.live:
            self._move(GenerationPhase.DOWN, "restored: the job is restarting from its checkpoint")
        elif pending is None:
            self._expect_world()
            self._move(GenerationPhase.STABLE, "restored: no handoff was pending")
            self._begin()
        elif pending.phase == PendingPhase.PREPARE:
            self._expect_world()
            for t in pending.triggers:
                self._remember(t.event_id)
            self._handoff = _Handoff(
                generation=pending.generation,
                from_generation=record.generation,
                triggers=list(pending.triggers),
                began_at=pending.began_at,
                deadline=pending.deadline,
            )
            reason = "the coordinator restarted before the switch; re-planning as a new generation"
            self._stop_now(_Stop(reason, replan=True), GenerationPhase.PREPARE)
        else:
            self._resume_switch(record, pending)
        self._check_deadlines()
        return self._finish()

    # -- plumbing --------------------------------------------------------------------------------------

    def _start(self, now: datetime) -> None:
        if now.tzinfo is None:
            raise CoordinatorError("`now`: must be timezone-aware")
        self._now = now
        self._out = []

    def _finish(self) -> list[Action]:
        self._publish_membership()
        out, self._out = self._out, []
        return out

    def _publish_membership(self) -> None:
        """Emit the live world's workers when they changed (the ingester maps nodes with them)."""
        record = self._record
        if record is None or not record.live or self._phase is GenerationPhase.STANDBY:
            return
        key = (self._revision, self.membership.version)
        if key == self._world_members_key:
            return
        self._world_members_key = key
        workers = []
        for device in record.placement.devices:
            member = self.membership.on_device(device)
            if member is not None:
                workers.append(WorkerDevice(worker_id=member.worker_id, device=device))
        in_world = set(record.placement.devices)
        standbys = sorted(
            (
                WorkerDevice(worker_id=m.worker_id, device=m.device)
                for m in self.membership
                if m.device not in in_world and m.generation is None
            ),
            key=lambda w: w.device,
        )
        current = JobMembership(
            job_id=self.job_id,
            generation=record.generation,
            workers=tuple(workers),
            standbys=tuple(standbys),
        )
        if current != self._world_members:
            self._world_members = current
            self._emit(WriteMembership(record=current))

    @property
    def now(self) -> datetime:
        assert self._now is not None
        return self._now

    def _emit(self, action: Action) -> None:
        self._out.append(action)

    def _note(self, level: NoteLevel, event: str, **fields: object) -> None:
        fields.setdefault("job_id", self.job_id)
        if self._handoff is not None:
            fields.setdefault("generation", self._handoff.generation)
        self._emit(Note(level=level, event=event, fields=dict(fields)))

    def _move(self, to: GenerationPhase, why: str) -> None:
        if to is self._phase:
            return
        if to not in TRANSITIONS[self._phase]:
            raise IllegalTransition(f"{self._phase.value} -> {to.value} ({why})")
        self._history.append((self._phase, to, why))
        del self._history[:-_HISTORY]
        self._note("info", "phase_changed", phase_from=self._phase.value, phase_to=to.value, why=why)
        self._phase = to
        if to in (
            GenerationPhase.STABLE,
            GenerationPhase.DOWN,
            GenerationPhase.STANDBY,
            GenerationPhase.COMMITTED,
            GenerationPhase.CLEANUP,
        ):
            self._wait = Wait.NOTHING
        if to in (GenerationPhase.COMMITTED, GenerationPhase.DOWN, GenerationPhase.STANDBY):
            self.membership.clear_suspicion()  # a new world (or none): the broken one's loss is served

    def _restore_settled(self, settled: Iterable[SettledEvent]) -> None:
        """Know every event the record says is settled, and have the adapter acknowledge a redelivered
        copy of one at once, whichever coordinator settled it."""
        groups: dict[tuple[SettleOutcome, int | None], list[str]] = {}
        for entry in settled:
            self._remember(entry.event_id)
            groups.setdefault((entry.outcome, entry.generation), []).append(entry.event_id)
        for (outcome, generation), ids in groups.items():
            self._emit(Settle(event_ids=tuple(ids), outcome=outcome, generation=generation))

    def _remember(self, event_id: str) -> None:
        self._seen[event_id] = None
        self._seen.move_to_end(event_id)
        while len(self._seen) > self.config.max_remembered_events:
            self._seen.popitem(last=False)

    def _publish(
        self, message: GenerationCommitted | GenerationAborted, handoff: _Handoff | None = None
    ) -> None:
        self._emit(
            Publish(
                message=message,
                msg_id=generation_msg_id(self.job_id, message.generation),
                trigger=handoff.triggers[0].kind if handoff is not None else None,
                began_at=handoff.began_at if handoff is not None else None,
            )
        )

    def _settle(
        self,
        triggers: Iterable[Trigger],
        outcome: SettleOutcome,
        generation: int | None,
        *,
        recorded: bool = True,
    ) -> None:
        """Acknowledge the bus events among ``triggers`` (a lost worker is no bus event). An outcome's
        events were written to the record with it (:meth:`_record_settled`); others (``recorded``
        false: events that changed nothing) go with the next record write."""
        ids = bus_event_ids(triggers)
        if not ids:
            return
        if not recorded:
            self._unrecorded.extend(
                SettledEvent(event_id=i, outcome=outcome, generation=generation) for i in ids
            )
        self._emit(Settle(event_ids=ids, outcome=outcome, generation=generation))

    def _record_settled(self, triggers: Iterable[Trigger], outcome: SettleOutcome, generation: int) -> None:
        """Have the next record write (the one that records the outcome) carry these settlements."""
        self._unrecorded.extend(
            SettledEvent(event_id=i, outcome=outcome, generation=generation) for i in bus_event_ids(triggers)
        )

    def _wrong_job(self, job_id: str, what: str) -> bool:
        if job_id == self.job_id:
            return False
        self._note(
            "warning", "input_rejected", input=what, field="job_id", reason=f"{job_id!r} is another job"
        )
        return True

    # -- the record ------------------------------------------------------------------------------------

    def _write(self, record: GenerationRecord, wait: Wait) -> None:
        if self._unrecorded:
            keep = self.config.record_settled_events
            record = replace(record, settled=(record.settled + tuple(self._unrecorded))[-keep:])
            self._unrecorded = []
        record = replace(record, writer=self.instance_id)
        self._inflight = record
        self._wait = wait
        self._emit(WriteRecord(record=record, expected_revision=self._revision))

    def _on_written(self, revision: int) -> None:
        if self._inflight is None:
            self._note("warning", "unexpected_write_result", revision=revision)
            return
        self._record, self._revision, self._inflight = self._inflight, revision, None
        match self._wait:
            case Wait.WORLD_WRITE:
                self._world_recorded()
            case Wait.BEGIN_WRITE:
                self._begun()
            case Wait.SWITCH_WRITE:
                self._switch_recorded()
            case Wait.COMMIT_WRITE:
                self._committed()
            case Wait.ABORT_WRITE:
                self._abort_recorded()
            case Wait.NO_CHANGE_WRITE:
                self._no_change_recorded()
            case other:
                raise IllegalTransition(f"a write completed while waiting for {other.value}")

    def _on_conflict(self, event: RecordConflict) -> None:
        if self._inflight is None:
            self._note("warning", "unexpected_write_result", revision=event.revision)
            return
        if event.stored is not None and event.stored == self._inflight:
            self._note("info", "write_found_landed", revision=event.revision)
            self._on_written(event.revision)
            return
        self._stand_down(event.stored, event.revision, "the record changed under a compare-and-set")

    def _on_write_failed(self, event: RecordWriteFailed) -> None:
        if self._inflight is None:
            self._note("warning", "unexpected_write_result", error=event.error)
            return
        self._note("warning", "record_write_retried", error=event.error, wait=self._wait.value)
        self._emit(WriteRecord(record=self._inflight, expected_revision=self._revision))

    def _on_observed(self, event: RecordObserved) -> None:
        if event.record.job_id != self.job_id:
            self._note("warning", "input_rejected", input="record", field="job_id", reason="another job")
            return
        if event.revision <= self._revision:
            return
        if self._phase is GenerationPhase.STANDBY:
            self._record, self._revision = event.record, event.revision
            return
        if self._inflight is not None and event.record == self._inflight:
            return
        self._stand_down(event.record, event.revision, "another coordinator wrote the record")

    def _stand_down(self, stored: GenerationRecord | None, revision: int, why: str) -> None:
        """Someone else owns the job now: adopt what they stored and send nothing more."""
        dropped = self._handoff.generation if self._handoff is not None else None
        self._inflight, self._handoff, self._deferred, self._early_world = None, None, None, None
        if stored is not None:
            self._record, self._revision = stored, revision
        self._note(
            "warning",
            "stood_down",
            why=why,
            dropped_generation=dropped,
            stored_generation=None if stored is None else stored.generation,
            stored_pending=None if stored is None or stored.pending is None else stored.pending.generation,
            revision=revision,
        )
        self._move(GenerationPhase.STANDBY, why)

    # -- worlds -------------------------------------------------------------------------------------------

    def _on_world_started(self, event: WorldStarted) -> None:
        if self._wrong_job(event.job_id, "world_started"):
            return
        record = self._record
        if self._handoff is not None and self._phase is not GenerationPhase.DOWN:
            # The workers of a failed handoff restart from the checkpoint on their own and may report
            # their world before this coordinator has recorded the abort that sends it DOWN: keep the
            # newest such report for then instead of losing it (nothing would send it again).
            if self._early_world is None or event.generation > self._early_world.generation:
                self._early_world = event
            self._note("info", "world_started_deferred", generation=event.generation)
            return
        if self._phase is not GenerationPhase.DOWN or self._inflight is not None:
            self._note("warning", "world_started_ignored", reason=f"the coordinator is {self._phase.value}")
            return
        if record is not None and event.generation <= record.issued:
            self._note(
                "warning",
                "input_rejected",
                input="world_started",
                field="generation",
                reason=f"{event.generation} is not after the last issued generation {record.issued}",
            )
            return
        self._write(
            GenerationRecord(
                job_id=self.job_id,
                writer=self.instance_id,
                generation=event.generation,
                layout=event.layout,
                placement=event.placement,
                issued=event.generation,
                last_outcome=None if record is None else record.last_outcome,
                geometry=event.geometry or (None if record is None else record.geometry),
                peer_copies=event.peer_copies,
                settled=() if record is None else record.settled,
            ),
            Wait.WORLD_WRITE,
        )

    def _world_recorded(self) -> None:
        assert self._record is not None
        self._move(GenerationPhase.STABLE, f"world of generation {self._record.generation} is live")
        self._begin()

    def _expect_world(self) -> None:
        assert self._record is not None
        for device in self._record.placement.devices:
            self.membership.expect(device, self.now)

    def _world(self) -> frozenset[Device]:
        return frozenset() if self._record is None or not self._record.live else self._record.devices

    # -- triggers ------------------------------------------------------------------------------------------

    def _on_resize(self, event: ResizeRequested) -> None:
        if self._wrong_job(event.job_id, "resize_requested"):
            return
        if event.event_id in self._seen:
            self._note("info", "duplicate_event_ignored", event_id=event.event_id)
            return
        self._remember(event.event_id)
        trigger = Trigger.from_request(event, self.now)
        self._announce(trigger)
        live = None if self._record is None else self._record.generation
        self._note(
            "info",
            "resize_requested",
            event_id=event.event_id,
            trigger=event.trigger,
            remove=len(event.remove),
            add=len(event.add),
            target_devices=event.target_devices,
            request_generation=event.generation,
            live_generation=live,
        )
        if self._phase is GenerationPhase.STABLE:
            self._queue.append(trigger)
            self._begin()
        elif self._phase in _HANDOFF_PHASES and self._handoff is not None:
            self._during_handoff(trigger)
        else:
            self._queue.append(trigger)
            self._note("info", "trigger_queued", event_id=trigger.event_id, phase=self._phase.value)

    def _during_handoff(self, trigger: Trigger) -> None:
        h = self._handoff
        assert h is not None
        target = h.target
        if target is None:
            self._queue.append(trigger)
            self._note("info", "trigger_queued", event_id=trigger.event_id, why="target not planned yet")
            return
        clash = sorted(set(trigger.remove) & target)
        if clash and trigger.kind is TriggerSource.REBALANCE:
            self._queue.append(trigger)
            self._note(
                "info",
                "trigger_queued",
                event_id=trigger.event_id,
                why="a rebalance waits for the handoff in flight",
            )
        elif clash and h.switch_sent:
            self._queue.append(trigger)
            self._note("info", "trigger_queued", event_id=trigger.event_id, why="the switch is under way")
        elif clash:
            self._queue.append(trigger)
            devices = ", ".join(map(str, clash))
            reason = f"event {trigger.event_id} removes {devices} of the target world; re-planning"
            self._request_stop(_Stop(reason, replan=True))
        elif self._served_by(trigger, target):
            self._fold(h, trigger)
        else:
            self._queue.append(trigger)
            self._note("info", "trigger_queued", event_id=trigger.event_id, why="needs another handoff")

    def _announce(self, trigger: Trigger) -> None:
        """Remember what leaves and what is offered, the latest word winning: a device announced to
        leave is never planned back in by an older offer, even after the handoff that removed it."""
        self._departing.difference_update(trigger.add)
        self._departing.update(trigger.remove)

    @staticmethod
    def _served_by(trigger: Trigger, target: frozenset[Device]) -> bool:
        """Whether committing ``target`` already does what ``trigger`` asks."""
        if set(trigger.remove) & target or not set(trigger.add) <= target:
            return False
        return trigger.target_devices is None or trigger.target_devices == len(target)

    def _fold(self, h: _Handoff, trigger: Trigger) -> None:
        h.triggers.append(trigger)
        h.deadline = min(h.deadline, trigger_deadline(trigger, self.config))
        self._note("info", "trigger_folded", event_id=trigger.event_id, deadline=h.deadline)

    def _relevant(self, trigger: Trigger, world: frozenset[Device]) -> bool:
        """Whether ``trigger`` would change ``world`` at all."""
        if set(trigger.remove) & world:
            return True
        if set(trigger.add) - world - self._departing:
            return True
        return trigger.target_devices is not None and trigger.target_devices != len(world)

    @staticmethod
    def _removed(triggers: Iterable[Trigger]) -> set[Device]:
        return {d for t in triggers for d in t.remove}

    @staticmethod
    def _lost(triggers: Iterable[Trigger]) -> set[Device]:
        return {d for t in triggers if t.kind == TriggerSource.WORKER_LOST for d in t.remove}

    def _old_world_broken(self) -> bool:
        triggers = list(self._queue) + (self._handoff.triggers if self._handoff is not None else [])
        return bool(self._lost(triggers) & self._world())

    # -- starting a handoff --------------------------------------------------------------------------------

    def _begin(self) -> None:
        """Start a handoff for every waiting trigger that still changes the live world (not while a
        probe is finding out who else is gone: those are planned around in the same handoff)."""
        if self._phase is not GenerationPhase.STABLE or self._inflight is not None or not self._queue:
            return
        if self._probing is not None:
            return
        assert self._record is not None
        world = self._record.devices
        keep = [t for t in self._queue if self._relevant(t, world)]
        done = [t for t in self._queue if not self._relevant(t, world)]
        if done:
            self._queue = keep
            self._note("info", "triggers_need_no_change", event_ids=[t.event_id for t in done])
            self._answer_no_change(done)
            return
        self._queue = []
        if not keep:
            return
        record = self._record
        generation = record.issued + 1
        deadline = handoff_deadline(keep, self.config)
        self._handoff = _Handoff(
            generation=generation,
            from_generation=record.generation,
            triggers=keep,
            began_at=self.now,
            deadline=deadline,
        )
        pending = PendingHandoff(
            generation=generation,
            phase=PendingPhase.PREPARE,
            event_id=keep[0].event_id,
            triggers=tuple(keep),
            began_at=self.now,
            deadline=deadline,
        )
        self._move(
            GenerationPhase.PREPARE,
            f"{len(keep)} trigger(s) change the world; handoff to generation {generation}",
        )
        self._write(replace(record, issued=generation, pending=pending), Wait.BEGIN_WRITE)

    def _answer_no_change(self, done: list[Trigger]) -> None:
        """Give events that change nothing (any more) an outcome of their own: a generation id that
        never runs, aborted as keeping the live world, recorded with the events it settles. The queue's
        other triggers start their handoff once that write lands. Lost workers already gone need no
        answer: they are settled at once."""
        assert self._record is not None
        ids = bus_event_ids(done)
        if not ids:
            self._settle(done, SettleOutcome.NO_CHANGE, None)
            self._begin()
            return
        record = self._record
        generation = record.issued + 1
        reason = f"nothing to change: the live world (generation {record.generation}) already does what "
        reason += "the event asks" if len(ids) == 1 else f"the {len(ids)} events ask"
        answer = GenerationAborted(
            job_id=self.job_id,
            event_id=ids[0],
            event_ids=ids,
            generation=generation,
            active_generation=record.generation,
            phase=HandoffPhase.PREPARE,
            reason=reason,
            outcome=AbortOutcome.KEPT_OLD_WORLD,
            aborted_at=self.now,
        )
        self._no_change = (done, answer)
        self._record_settled(done, SettleOutcome.NO_CHANGE, generation)
        self._write(replace(record, issued=generation, last_outcome=answer), Wait.NO_CHANGE_WRITE)

    def _no_change_recorded(self) -> None:
        assert self._no_change is not None
        (done, answer), self._no_change = self._no_change, None
        self._wait = Wait.NOTHING
        self._publish(answer)
        self._settle(done, SettleOutcome.NO_CHANGE, answer.generation)
        self._begin()

    def _begun(self) -> None:
        h = self._handoff
        assert h is not None and self._record is not None
        self._wait = Wait.TOPOLOGY
        if self._run_deferred():
            return
        world = self._record.devices
        lost = self._lost(h.triggers) & world
        removed = self._removed(h.triggers)
        targets = [t.target_devices for t in h.triggers if t.target_devices is not None]
        request = TopologyRequest(
            job_id=self.job_id,
            event_id=h.event_id,
            event_ids=tuple(t.event_id for t in h.triggers),
            from_generation=self._record.generation,
            generation=h.generation,
            layout=self._record.layout,
            placement=self._record.placement,
            remove=tuple(sorted((removed & world) - lost)),
            lost=tuple(sorted(lost)),
            add=tuple(sorted({d for t in h.triggers for d in t.add} - world - removed - self._departing)),
            target_devices=targets[-1] if targets else None,
            deadline=h.deadline,
            geometry=self._record.geometry,
            peer_copies=self._record.peer_copies,
        )
        self._emit(RequestTopology(request=request))

    # -- planning --------------------------------------------------------------------------------------------

    def _is_current(self, event_id: str, generation: int, wait: Wait, what: str) -> bool:
        h = self._handoff
        if h is not None and h.generation == generation and h.event_id == event_id and self._wait is wait:
            return True
        self._note(
            "warning",
            "stale_plan_ignored",
            input=what,
            event_id=event_id,
            plan_generation=generation,
            waiting_for=self._wait.value,
        )
        return False

    def _planned_from_stale_world(self, what: str, from_generation: int) -> bool:
        """A plan made against another world than the live one cannot be used: stop the handoff."""
        assert self._record is not None
        if from_generation == self._record.generation:
            return False
        self._request_stop(
            _Stop(
                f"the {what} was planned from generation {from_generation}, "
                f"the live one is {self._record.generation}",
                replan=False,
            )
        )
        return True

    def _on_topology(self, event: TopologyPlanned) -> None:
        if self._wrong_job(event.job_id, "topology_planned"):
            return
        if not self._is_current(event.event_id, event.generation, Wait.TOPOLOGY, "topology_planned"):
            return
        h = self._handoff
        assert h is not None and self._record is not None
        if self._planned_from_stale_world("topology", event.from_generation):
            return
        target = frozenset(event.placement.devices)
        banned = sorted(self._removed(h.triggers) & target)
        if banned:
            devices = ", ".join(map(str, banned))
            self._request_stop(
                _Stop(f"the topology planner placed ranks on removed devices {devices}", replan=False)
            )
            return
        if event.layout == self._record.layout and event.placement == self._record.placement:
            self._request_stop(
                _Stop(
                    "the topology planner kept the live world: nothing to move",
                    replan=False,
                    settle=SettleOutcome.NO_CHANGE,
                )
            )
            return
        h.layout, h.placement, h.topology = event.layout, event.placement, event
        self._note(
            "info",
            "target_planned",
            layout=event.layout.describe(),
            devices=len(event.placement),
            explanation=event.explanation[:500],
        )
        waiting, self._queue = self._queue, []
        for i, trigger in enumerate(waiting):
            if h.stop is not None or self._deferred is not None:
                self._queue.extend(waiting[i:])
                break
            self._during_handoff(trigger)
        if h.stop is not None or self._deferred is not None:
            return
        self._wait = Wait.TRANSFER
        self._emit(ExpectTransfer(topology=event))

    def _on_transfer(self, event: TransferPlanned) -> None:
        if self._wrong_job(event.job_id, "transfer_planned"):
            return
        if not self._is_current(event.event_id, event.generation, Wait.TRANSFER, "transfer_planned"):
            return
        h = self._handoff
        assert h is not None and self._record is not None
        if self._planned_from_stale_world("transfer", event.from_generation):
            return
        if not event.summary.verified:
            self._request_stop(_Stop("the transfer plan did not pass verification", replan=False))
            return
        h.transfer, h.bytes_planned = event, event.summary.bytes_moved
        estimate = switch_estimate_s(event.summary, self.config)
        self._note("info", "plan_received", bytes_moved=event.summary.bytes_moved, switch_estimate_s=estimate)
        if self.now > self._prepare_deadline(h):
            left = (h.deadline - self.now).total_seconds()
            self._request_stop(
                _Stop(
                    f"the plan moves {event.summary.bytes_moved} bytes, about {estimate:.1f} s of switch, "
                    f"and only {left:.1f} s are left before the deadline",
                    replan=False,
                )
            )
            return
        self._send_prepares()

    def _on_planning_failed(self, event: PlanningFailed) -> None:
        if self._wrong_job(event.job_id, "planning_failed"):
            return
        wait = Wait.TOPOLOGY if event.stage == PlanningStage.TOPOLOGY else Wait.TRANSFER
        if self._is_current(event.event_id, event.generation, wait, "planning_failed"):
            self._request_stop(_Stop(f"{event.stage} planning failed: {event.reason}", replan=False))

    # -- preparing ------------------------------------------------------------------------------------------

    def _send_prepares(self) -> None:
        """Broadcast the Prepare once every participant's device has a known worker (the acks are
        counted against those workers)."""
        h = self._handoff
        assert h is not None and h.transfer is not None and h.placement is not None and h.layout is not None
        assert self._record is not None
        # The old-world devices whose worker is gone take no part; the workers apply the same rule
        # (``slice_participants``) to the Prepare's ``lost``.
        lost = (self._world() & self._lost(h.triggers)) - frozenset(h.placement.devices)
        devices = sorted(slice_participants(self._record.placement, h.placement, lost))
        participants: dict[str, Device] = {}
        missing: list[Device] = []
        for device in devices:
            member = self.membership.on_device(device)
            if member is None:
                missing.append(device)
            else:
                participants[member.worker_id] = device
        if self._restored_at is not None:
            for device in missing:
                self.membership.expect(device, self._restored_at)
        gone = [d for d in missing if not self.membership.is_expected(d, self.now)]
        if gone:
            for device in gone:
                if device not in self._lost(self._queue):
                    self._queue.append(Trigger.lost(device, self.now))
                    self._departing.add(device)
            names = ", ".join(map(str, gone))
            self._request_stop(_Stop(f"no live worker on {names}; re-planning without them", replan=True))
            return
        if missing:
            self._wait = Wait.WORKERS
            self._note("info", "waiting_for_workers", devices=[str(d) for d in missing])
            return
        h.participants = participants
        # One broadcast for the whole job: a Prepare per worker repeated the O(workers) placement to
        # every worker (29 MiB per handoff at 1,024 workers). Each worker decides from the two worlds
        # and ``lost`` whether it takes part, and finds its slice by its device's index.
        try:
            prepare = self._prepare(h, lost)
        except ValueError as exc:
            reason = f"the plan does not fit the worlds it was made for: {exc}"
            self._request_stop(_Stop(reason, replan=False))
            return
        self._emit(SendCommand(command=prepare))
        h.prepare = prepare
        self._wait = Wait.PREPARED
        self._note("info", "prepare_sent", participants=len(participants), deadline=prepare.deadline)

    def _prepare(self, h: _Handoff, lost: frozenset[Device]) -> Prepare:
        """The job-wide Prepare of ``h``; raises ``ValueError`` naming the field that does not fit."""
        assert h.transfer is not None and h.placement is not None and h.layout is not None
        assert self._record is not None
        # Every worker hosts a rendezvous store at the address it announced; the new world's rank 0
        # runs the new generation's (it is a participant, so its worker is known here).
        rank0 = self.membership.on_device(h.placement.devices[0])
        return Prepare(
            job_id=self.job_id,
            event_id=h.event_id,
            from_generation=h.from_generation,
            generation=h.generation,
            from_layout=self._record.layout,
            from_placement=self._record.placement,
            layout=h.layout,
            placement=h.placement,
            lost=tuple(sorted(lost)),
            plan=h.transfer.plan,
            slices=h.transfer.slices,
            staging_bytes=self.config.staging_bytes,
            deadline=self._prepare_deadline(h),
            store=None if rank0 is None else rank0.address,
        )

    def _on_status(self, event: WorkerStatus) -> None:
        if self._wrong_job(event.job_id, "worker_status"):
            return
        if event.phase == WorkerPhase.PEER_LOST:
            self._on_peer_lost(event)
            return
        h = self._handoff
        if h is None or event.generation != h.generation:
            self._note(
                "warning",
                "stale_ack_ignored",
                worker_id=event.worker_id,
                ack_generation=event.generation,
                ack_phase=event.phase,
                pending_generation=None if h is None else h.generation,
            )
            return
        device = h.participants.get(event.worker_id)
        if device is None:
            self._note(
                "warning", "ack_from_outsider_ignored", worker_id=event.worker_id, ack_phase=event.phase
            )
            return
        match event.phase:
            case "ready":
                if self._wait is Wait.PREPARED:
                    h.prepared.add(event.worker_id)
                    if len(h.prepared) == len(h.participants):
                        self._all_prepared()
                else:
                    self._note("debug", "ack_repeated", worker_id=event.worker_id, ack_phase=event.phase)
            case "switched":
                if not h.switch_sent:
                    self._note("warning", "switched_before_switch", worker_id=event.worker_id)
                elif self._wait is Wait.SWITCHED:
                    h.switched[event.worker_id] = event
                    if len(h.switched) == len(h.participants):
                        self._all_switched()
                else:
                    self._note("debug", "ack_repeated", worker_id=event.worker_id, ack_phase=event.phase)
            case "failed":
                why = f"worker {event.worker_id} on {device} failed: {event.error}"
                if self._may_be_a_loss(h, event):
                    self._hold_failure(h, why)
                else:
                    self._request_stop(_Stop(why, replan=False))
            case _:
                self._note("debug", "worker_progress", worker_id=event.worker_id, ack_phase=event.phase)

    def _may_be_a_loss(self, h: _Handoff, event: WorkerStatus) -> bool:
        """Whether a participant's failure may come from a member gone at the switch, before anything
        committed: the survivors then hold the cut's state (I4) and recover live, so the checkpoint
        waits for a probe. A process that says it falls back, or a switch taken over after a restart
        (its acks lost), falls back at once."""
        return self._phase is GenerationPhase.SWITCH and h.uncommitted and not event.falling_back

    def _hold_failure(self, h: _Handoff, why: str) -> None:
        if h.failure is None:
            h.failure = why
            self._note("warning", "participant_failed_probing", generation=h.generation, why=why)
            self._probe(set(self._world()) | set(h.target or ()))
        self._decide_failure()

    def _decide_failure(self) -> None:
        """The probe held for a participant's failure has answered (or was given up on): a member found
        gone has already turned the handoff into a live recovery; else the failure stops it."""
        h = self._handoff
        if h is None or h.failure is None or self._probing is not None:
            return
        why, h.failure = h.failure, None
        if self._deferred is None or not self._deferred.recover:  # a loss found: recovering already
            self._request_stop(_Stop(why, replan=False))

    def _all_prepared(self) -> None:
        h = self._handoff
        assert h is not None and self._record is not None
        self._move(GenerationPhase.READY, f"all {len(h.participants)} participants are ready")
        pending = PendingHandoff(
            generation=h.generation,
            phase=PendingPhase.SWITCH,
            event_id=h.event_id,
            triggers=tuple(h.triggers),
            began_at=h.began_at,
            deadline=h.deadline,
            layout=h.layout,
            placement=h.placement,
            participants=tuple(
                Participant(worker_id=w, device=d)
                for w, d in sorted(h.participants.items(), key=lambda i: i[1])
            ),
            bytes_planned=h.bytes_planned,
        )
        self._write(replace(self._record, pending=pending), Wait.SWITCH_WRITE)

    # -- switching -------------------------------------------------------------------------------------------

    def _switch_recorded(self) -> None:
        h = self._handoff
        assert h is not None
        if self._run_deferred():
            return
        if self.now > self._prepare_deadline(h):
            self._stop_now(_Stop("the switch intent was recorded too late to switch in time", replan=False))
            return
        self._send_switch(h)

    def _send_switch(self, h: _Handoff) -> None:
        self._emit(
            SendCommand(command=Switch(job_id=self.job_id, generation=h.generation, deadline=h.deadline))
        )
        h.switch_sent = True
        self._move(GenerationPhase.SWITCH, "switch sent: the old world starts handing over its state")
        self._wait = Wait.SWITCHED

    def _resume_switch(self, record: GenerationRecord, pending: PendingHandoff) -> None:
        for t in pending.triggers:
            self._remember(t.event_id)
        self._handoff = _Handoff(
            generation=pending.generation,
            from_generation=record.generation,
            triggers=list(pending.triggers),
            began_at=pending.began_at,
            deadline=pending.deadline,
            layout=pending.layout,
            placement=pending.placement,
            bytes_planned=pending.bytes_planned,
            participants={p.worker_id: p.device for p in pending.participants},
            resumed=True,
        )
        for p in pending.participants:
            self.membership.expect(p.device, self.now)
        self._send_switch(self._handoff)

    def _all_switched(self) -> None:
        h = self._handoff
        assert h is not None and self._record is not None and h.layout is not None and h.placement is not None
        acks = list(h.switched.values())
        cuts = sorted({a.iteration for a in acks if a.iteration is not None})
        if len(cuts) > 1:
            self._note("error", "switch_cut_disagrees", iterations=cuts)
        if cuts:
            iteration = cuts[-1]
        else:
            beats = [
                m.iteration
                for m in self.membership
                if m.worker_id in h.participants and m.iteration is not None
            ]
            iteration = max(beats, default=0)
            self._note("warning", "switch_without_iteration", using=iteration)
        received = [a.bytes_received for a in acks]
        if all(b is not None for b in received):
            bytes_moved = sum(b for b in received if b is not None)
        else:
            bytes_moved = h.bytes_planned if h.bytes_planned is not None else sum(b or 0 for b in received)
        committed = GenerationCommitted(
            job_id=self.job_id,
            event_id=h.event_id,
            event_ids=bus_event_ids(h.triggers),
            previous_generation=self._record.generation,
            generation=h.generation,
            layout=h.layout,
            placement=h.placement,
            started_at_iteration=iteration,
            downtime_s=max((a.pause_s for a in acks if a.pause_s is not None), default=0.0),
            bytes_moved=bytes_moved,
            committed_at=self.now,
        )
        record = replace(
            self._record,
            generation=h.generation,
            layout=h.layout,
            placement=h.placement,
            pending=None,
            last_outcome=committed,
            live=True,
        )
        self._deferred = None
        self._record_settled(h.triggers, SettleOutcome.COMMITTED, h.generation)
        self._write(record, Wait.COMMIT_WRITE)

    def _committed(self) -> None:
        h = self._handoff
        assert h is not None and self._record is not None and self._record.last_outcome is not None
        self._publish(self._record.last_outcome, h)
        self._move(GenerationPhase.COMMITTED, f"generation {h.generation} is live")
        self._settle(h.triggers, SettleOutcome.COMMITTED, h.generation)
        self._move(GenerationPhase.CLEANUP, "releasing the old generation's resources")
        self._release_plan(h)
        self._handoff, self._deferred, self._early_world = None, None, None
        self._move(GenerationPhase.STABLE, "cleanup done")
        self._begin()

    def _release_plan(self, h: _Handoff) -> None:
        """Have the handoff's plan objects deleted by name (no listing of the store)."""
        t = h.transfer
        if t is None:
            # Resumed after a restart: the names are lost, but the small slices (all but an oversized
            # few) share the generation's key prefix; the plan file and oversized slices expire.
            self._emit(
                ReleasePlan(
                    generation=h.generation,
                    kv_bucket=KV_PLAN_SLICES,
                    kv_keys=slice_keys_of_generation(self.job_id, h.generation),
                )
            )
            return
        names = (t.plan.name, *t.slices.object_names())
        pattern = t.slices.kv_keys_pattern()
        self._emit(
            ReleasePlan(
                generation=h.generation,
                bucket=t.slices.bucket,
                objects=names,
                kv_bucket=t.slices.kv_bucket or "",
                kv_keys=pattern or "",
            )
        )

    # -- stopping ------------------------------------------------------------------------------------------

    def _request_stop(self, stop: _Stop) -> None:
        h = self._handoff
        if h is None or self._phase not in _HANDOFF_PHASES or h.stop is not None:
            self._note("debug", "stop_not_applicable", reason=stop.reason, phase=self._phase.value)
            return
        if self._wait is Wait.COMMIT_WRITE:
            self._note("info", "stop_too_late", reason=stop.reason, why="every participant has switched")
            return
        if self._inflight is not None:
            self._deferred = stop if self._deferred is None else self._deferred.merge(stop)
            self._note("info", "stop_deferred", reason=stop.reason, until=self._wait.value)
            return
        self._stop_now(stop)

    def _run_deferred(self) -> bool:
        stop, self._deferred = self._deferred, None
        if stop is None:
            return False
        self._stop_now(stop)
        return True

    def _stop_now(self, stop: _Stop, phase: GenerationPhase | None = None) -> None:
        """Record the abort of the pending handoff; what follows happens once the record says so."""
        h = self._handoff
        assert h is not None and self._record is not None
        past_the_switch = h.switch_sent and not stop.recover  # a recovery re-plans from the old world
        if past_the_switch:
            stop = _Stop(stop.reason, replan=False)
        fallback = past_the_switch or (self._old_world_broken() and not stop.replan)
        stopped_in = phase or self._phase
        reason = (
            stop.reason if not stop.replan else f"{stop.reason} (cancelled; re-planned as a new generation)"
        )
        settles = not stop.replan or fallback
        ids = bus_event_ids(h.triggers)
        aborted = GenerationAborted(
            job_id=self.job_id,
            event_id=h.event_id,
            event_ids=ids if settles else (),
            replanned_event_ids=() if settles else ids,
            generation=h.generation,
            active_generation=self._record.generation,
            phase=_ABORT_PHASE_NAME[stopped_in],
            reason=reason[:2000],
            outcome=(
                AbortOutcome.CHECKPOINT_FALLBACK
                if fallback
                else AbortOutcome.LIVE_RECOVERY
                if stop.recover
                else AbortOutcome.KEPT_OLD_WORLD
            ),
            aborted_at=self.now,
        )
        h.stop, h.stopped_in, h.outcome = stop, stopped_in, aborted
        self._deferred = None
        self._move(GenerationPhase.ABORTED, stop.reason)
        if settles:
            outcome = SettleOutcome.CHECKPOINT_FALLBACK if fallback else stop.settle
            self._record_settled(h.triggers, outcome, h.generation)
        self._write(
            replace(self._record, pending=None, last_outcome=aborted, live=not fallback), Wait.ABORT_WRITE
        )

    def _abort_recorded(self) -> None:
        h = self._handoff
        assert h is not None and h.stop is not None and h.outcome is not None
        aborted, stop = h.outcome, h.stop
        self._emit(
            SendCommand(
                command=Abort(
                    job_id=self.job_id,
                    generation=h.generation,
                    reason=aborted.reason,
                    fallback=aborted.outcome == AbortOutcome.CHECKPOINT_FALLBACK,
                )
            )
        )
        self._publish(aborted, h)
        if h.transfer is not None or h.switch_sent:
            self._release_plan(h)
        self._handoff, self._deferred = None, None
        if aborted.outcome == AbortOutcome.CHECKPOINT_FALLBACK:
            self._note("error", "checkpoint_fallback", generation=aborted.generation, reason=aborted.reason)
            self._settle(h.triggers, SettleOutcome.CHECKPOINT_FALLBACK, aborted.generation)
            self._move(GenerationPhase.DOWN, "checkpoint fallback: the job restarts from its last checkpoint")
            early, self._early_world = self._early_world, None
            if early is not None:
                self._on_world_started(early)
            return
        self._early_world = None
        if stop.replan:
            self._queue = h.triggers + self._queue
        else:
            self._settle(h.triggers, stop.settle, aborted.generation)
        if aborted.outcome == AbortOutcome.LIVE_RECOVERY:
            self._move(GenerationPhase.STABLE, "the old world's survivors keep the cut's state to move live")
        else:
            self._move(GenerationPhase.STABLE, "kept the old world")
        self._begin()

    # -- deadlines and liveness ------------------------------------------------------------------------

    def _prepare_deadline(self, h: _Handoff) -> datetime:
        summary = None if h.transfer is None else h.transfer.summary
        return h.deadline - timedelta(seconds=switch_estimate_s(summary, self.config))

    def _check_deadlines(self) -> None:
        h = self._handoff
        if h is None or h.stop is not None or self._deferred is not None:
            return
        if self._phase in (
            GenerationPhase.PREPARE,
            GenerationPhase.READY,
        ) and self.now > self._prepare_deadline(h):
            deadline = self._prepare_deadline(h)
            self._request_stop(
                _Stop(
                    f"the {self._phase.value} phase missed its deadline {deadline.isoformat()} "
                    f"while waiting for {self._wait.value}",
                    replan=False,
                )
            )
        elif self._phase is GenerationPhase.SWITCH and self._wait is Wait.SWITCHED and self.now > h.deadline:
            self._request_stop(
                _Stop(
                    f"the switch missed its deadline {h.deadline.isoformat()}: "
                    f"{len(h.switched)} of {len(h.participants)} participants switched",
                    replan=False,
                )
            )

    def _on_tick(self) -> None:
        if self._probing is not None and self.now >= self._probing[1]:
            self._note("warning", "probe_unanswered", probe=self._probing[0])
            self._probing = None
            self._decide_failure()
            self._begin()
        expired = self.membership.expire(self.now)
        timeout = self.config.heartbeat_timeout_s
        self.silent_workers += len(expired.lost)
        for member in expired.lost:
            after = "" if member.suspect_s is None else " after its world lost a peer"
            self._on_lost(
                member.device,
                f"worker {member.worker_id} on {member.device} silent for {member.timeout(timeout)} s{after}",
                begin=False,
            )
        for device in expired.missing:
            self._on_lost(
                device,
                f"no worker on {device} reported since the restart (awaited {timeout} s, or the suspicion "
                "window once its world lost a peer)",
                begin=False,
            )
        if any(m.device in self._world() for m in expired.lost):
            self._probe(self._world())  # its node's other workers may be gone too: one loss, one plan
        self._begin()
        if self._wait is Wait.WORKERS and self._handoff is not None and self._handoff.stop is None:
            self._send_prepares()

    def _on_presence(self, event: Hello | Heartbeat) -> None:
        try:
            change = self.membership.observe(event, self.now)
        except HelloPending as exc:
            self._note("debug", "heartbeat_before_hello", worker_id=event.worker_id, reason=exc.reason)
            return
        except MembershipError as exc:
            self._note(
                "warning",
                "input_rejected",
                input=event.__class__.__name__,
                field=exc.field,
                reason=exc.reason,
            )
            return
        if change.previous is not None:
            previous = change.previous
            self._on_lost(
                previous.device,
                f"worker {previous.worker_id} on {previous.device} "
                + (
                    "restarted"
                    if change.kind == "restarted"
                    else f"was replaced by {change.member.worker_id}"
                ),
            )
        h = self._handoff
        if h is not None and change.kind == "joined":
            expected = h.worker_on(change.member.device)
            if expected is not None and expected != change.member.worker_id:
                self._on_lost(
                    change.member.device, f"participant {expected} was replaced by {change.member.worker_id}"
                )
        if self._wait is Wait.WORKERS and h is not None and h.stop is None and self._deferred is None:
            self._send_prepares()
        if isinstance(event, Heartbeat):
            self._switched_by_heartbeat(event)
            if event.broken:
                self._heard_broken(event)

    def _on_reconnected(self) -> None:
        """The bus was away: what this coordinator sent, and what workers acked, may be lost (worker
        traffic is not stored). Send the command of the phase again; workers answer a repeated command
        with their last ack without redoing it, and announce themselves again after their own
        reconnect, so the handoff carries on instead of waiting for its deadline."""
        h = self._handoff
        if h is None or h.stop is not None or self._deferred is not None:
            return
        if self._wait is Wait.PREPARED and h.prepare is not None:
            self._note(
                "info",
                "prepare_resent",
                generation=h.generation,
                waiting_for=len(h.participants) - len(h.prepared),
            )
            self._emit(SendCommand(command=h.prepare))
        elif self._wait is Wait.SWITCHED:
            self._note(
                "info",
                "switch_resent",
                generation=h.generation,
                waiting_for=len(h.participants) - len(h.switched),
            )
            self._emit(
                SendCommand(command=Switch(job_id=self.job_id, generation=h.generation, deadline=h.deadline))
            )

    def _switched_by_heartbeat(self, beat: Heartbeat) -> None:
        """A participant whose heartbeat speaks for the new world (or, leaving, for no world any more) has
        switched, whether or not its ack arrived: acks sent while the bus was away are lost, heartbeats
        keep coming."""
        h = self._handoff
        if h is None or not h.switch_sent or self._wait is not Wait.SWITCHED or h.stop is not None:
            return
        device = h.participants.get(beat.worker_id)
        if device is None or beat.worker_id in h.switched or h.placement is None:
            return
        stays = device in h.placement.devices
        if (stays and beat.generation == h.generation) or (not stays and beat.generation is None):
            self._note("info", "switch_seen_in_heartbeat", worker_id=beat.worker_id, generation=h.generation)
            self._on_status(
                WorkerStatus(
                    job_id=self.job_id,
                    worker_id=beat.worker_id,
                    generation=h.generation,
                    phase=WorkerPhase.SWITCHED,
                    iteration=beat.iteration,
                )
            )

    def _old_world_broke(self, worker_id: str, generation: int | None) -> None:
        """A participant of the switch in flight says its world of ``generation`` lost a peer: when that
        is the handoff's old world, nothing committed (see :attr:`_Handoff.old_world_broke`)."""
        h = self._handoff
        if (
            h is None
            or h.old_world_broke
            or self._phase is not GenerationPhase.SWITCH
            or generation != h.from_generation
            or worker_id not in h.participants
            or self._lost(h.triggers) & self._world()  # a recovery: its old world was broken already
        ):
            return
        h.old_world_broke = True
        self._note("info", "old_world_broke_before_the_commit", worker_id=worker_id, generation=generation)
        # Whoever broke it may be one this coordinator has not heard since its restart: ask them all now
        # instead of waiting out the restart's window for the silent ones.
        self._probe(set(h.participants.values()) | set(self._world()), generation=generation)

    def _on_peer_lost(self, event: WorkerStatus) -> None:
        self._peer_lost(event.worker_id, event.generation)

    def _heard_broken(self, beat: Heartbeat) -> None:
        """A heartbeat says its world lost a peer: the worker's ``peer_lost`` ack may have gone out while
        this coordinator was down (worker traffic is not stored), so the first such word of a generation
        that is acted on counts as that ack, unless a loss in it is known already."""
        if self._broken_heard == beat.generation or self._old_world_broken():
            self._old_world_broke(beat.worker_id, beat.generation)
            return
        if self._peer_lost(beat.worker_id, beat.generation):  # which tells _old_world_broke too
            self._broken_heard = beat.generation

    def _peer_lost(self, worker_id: str, generation: int | None) -> bool:
        """A worker says its world lost a peer (a collective failed outside a handoff). It cannot say
        which one; whoever it was stops beating, so every member of that world unheard for
        ``suspect_timeout_s`` is lost now instead of after the full heartbeat timeout (and a device not
        heard from since a restart is awaited no longer than that). Whether it was acted on."""
        self._old_world_broke(worker_id, generation)
        member = self.membership.get(worker_id)
        h = self._handoff
        target = None if h is None else h.target
        if h is not None and target and generation == h.generation and worker_id in h.switched:
            # The new world lost a peer right after its commit, before this coordinator recorded it.
            marked = self.membership.suspect(target, self.config.suspect_timeout_s)
            self._note("warning", "new_world_lost_a_peer", worker_id=worker_id, suspects=marked)
            self._probe(target, generation=h.generation)
            return True
        if self._record is None or not self._record.live or generation != self._record.generation:
            self._note("debug", "stale_peer_lost_ignored", worker_id=worker_id, generation=generation)
            return False
        joining = (
            h is not None and worker_id in h.participants and h.from_generation == generation
        )  # a joiner whose handoff broke on the loss
        if member is None or (member.device not in self._world() and not joining):
            self._note("warning", "peer_lost_from_outsider_ignored", worker_id=worker_id)
            return False
        marked = self.membership.suspect(self._world(), self.config.suspect_timeout_s)
        marked += self.membership.hurry(self._world(), self.now, self.config.suspect_timeout_s)
        self._note(
            "warning",
            "world_lost_a_peer",
            worker_id=worker_id,
            generation=generation,
            suspects=marked,
            within_s=self.config.suspect_timeout_s,
        )
        devices = set(self._world())
        if h is not None and h.target is not None:
            devices |= h.target  # a handoff in flight: its joiners may be the ones gone
        self._probe(devices)
        return True

    def _probe(self, devices: Iterable[Device], generation: int | None = None) -> None:
        """Ask the workers on ``devices`` whether they are still there (one probe at a time): a process
        that is gone is known within a round trip instead of after the suspicion window, and every
        member found gone at once is one loss, planned around in one handoff."""
        if self._probing is not None:
            return
        wanted = set(devices)
        members = {m.worker_id for m in self.membership if m.device in wanted}
        named = self._awaited_participants(wanted)
        workers = tuple(sorted(members | set(named)))
        nameless = tuple(
            sorted(
                d
                for d in wanted & set(self._world())  # not joiners: their absence breaks no world
                if self.membership.on_device(d) is None
                and self.membership.is_expected(d, self.now)
                and d not in named.values()
            )
        )
        if not workers and not nameless:
            return
        if generation is None:
            generation = self._record.generation if self._record is not None else 0
        give_up = self.now + timedelta(seconds=2 * self.config.probe_timeout_s + 1.0)
        self._probes += 1
        self._probing = (self._probes, give_up)
        self._emit(
            ProbeWorkers(
                probe=self._probes,
                generation=generation,
                worker_ids=workers,
                timeout_s=self.config.probe_timeout_s,
                devices=nameless,
            )
        )

    def _awaited_participants(self, devices: Collection[Device] | None = None) -> dict[str, Device]:
        """The handoff's participants (on ``devices``) not heard since this coordinator's restart and
        still awaited: the record names them, so a probe can ask for them by name."""
        h = self._handoff
        if h is None:
            return {}
        return {
            worker_id: device
            for worker_id, device in h.participants.items()
            if (devices is None or device in devices)
            and self.membership.get(worker_id) is None
            and self.membership.is_expected(device, self.now)
        }

    def _on_probed(self, event: WorkersProbed) -> None:
        """The members found gone are lost now, all of them before any handoff begins (an answer to a
        probe given up on still says who is gone)."""
        if self._probing is not None and self._probing[0] == event.probe:
            self._probing = None
        self._note(
            "info",
            "workers_probed",
            probed_generation=event.generation,
            gone=list(event.gone) + [str(d) for d in event.gone_devices],
            answered=len(event.answered),
            silent=list(event.silent),
        )
        awaited = self._awaited_participants()
        for worker_id in event.gone:
            member = self.membership.remove(worker_id)
            device = member.device if member is not None else awaited.get(worker_id)
            if device is None:
                continue  # already lost by its heartbeats
            self.membership.unexpect(device)
            self._on_lost(
                device,
                f"worker {worker_id} on {device} has no connection to the bus (its process is gone)",
                begin=False,
            )
        for device in event.gone_devices:
            if not self.membership.is_expected(device, self.now):
                continue  # its worker spoke up meanwhile, or it was lost already
            self.membership.unexpect(device)
            why = f"no worker on {device} has a connection to the bus (its process is gone)"
            self._on_lost(device, why, begin=False)
        self._decide_failure()
        self._begin()

    def _on_worker_lost(self, event: WorkerLost) -> None:
        member = self.membership.remove(event.worker_id)
        device = member.device if member is not None else None
        if device is None and self._handoff is not None:
            device = self._handoff.participants.get(event.worker_id)
        if device is None:
            self._note("debug", "unknown_worker_lost", worker_id=event.worker_id, reason=event.reason)
            return
        self._on_lost(device, f"worker {event.worker_id} on {device} lost: {event.reason}")

    def _on_lost(self, device: Device, why: str, *, begin: bool = True) -> None:
        """A device's worker is gone: what that means depends on the phase and the device's role.
        ``begin=False``: the caller begins the handoff once every loss it knows of is queued."""
        h = self._handoff
        in_world = device in self._world()
        in_target = h is not None and h.target is not None and device in h.target
        worker = None if h is None else h.worker_on(device)
        if self._phase in (GenerationPhase.DOWN, GenerationPhase.STANDBY) or not (
            in_world or in_target or worker
        ):
            self._note("debug", "idle_worker_lost", device=str(device), why=why)
            return
        known = self._queue + (h.triggers if h is not None else [])
        if device in self._lost(known):
            return
        self._note("warning", "worker_lost", device=str(device), why=why, phase=self._phase.value)
        trigger = Trigger.lost(device, self.now)
        self._announce(trigger)
        if self._phase is GenerationPhase.SWITCH and h is not None and self._wait is not Wait.COMMIT_WRITE:
            if not in_target and worker is not None and worker in h.switched:
                self._note("info", "leaving_worker_done", device=str(device))
                return
            self._queue.append(trigger)
            if h.switched and worker is not None:
                # A participant acked its switch: the commit, a collective of every participant, is done
                # (the lost one took part), so the new world is the job's and this is a loss in it. The
                # switch completes without the lost one's ack; the queued loss then plans the recovery
                # from the new world, whose survivors are already waiting for it.
                self._note("warning", "participant_lost_after_the_commit", device=str(device))
                if worker not in h.switched:
                    del h.participants[worker]
                if len(h.switched) == len(h.participants):
                    self._all_switched()
                return
            if in_world and h.uncommitted:
                # Nothing committed (every commit is acked): the old world's survivors still hold the
                # cut's state (I4), so the generation is planned again around the loss and moves live.
                self._request_stop(
                    _Stop(f"{why} during the switch; recovering live", replan=True, recover=True)
                )
            else:
                self._request_stop(_Stop(f"{why} after the switch began", replan=False))
        elif self._phase in (GenerationPhase.PREPARE, GenerationPhase.READY) and h is not None:
            self._queue.append(trigger)
            self._request_stop(_Stop(f"{why}; re-planning without it", replan=True))
        else:
            self._queue.append(trigger)
            if begin:
                self._begin()
