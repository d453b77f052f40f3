"""The generation coordinator's state machine: events in, actions out, no I/O and no clock.

The phases and the moves between them are drawn in :mod:`.phases`.

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
* **Triggers, not messages, are queued** (:mod:`.triggers`): one that arrives during a handoff is
  folded into it, waits, or makes its target impossible; the waiting ones are planned together against
  the world that is live when the handoff ends, and those that change nothing are answered as such.
* **Deadlines come from the triggers** (:mod:`.config`): the handoff must be done a margin before the
  earliest reclaim among its triggers, and everything before the switch must leave the switch the time
  the plan says it needs.
* **Writes are serialised** (:mod:`.writer`): while a write is in flight, a decision to stop the
  handoff is deferred to its result, so the record never has two writers inside one coordinator.

The machine is this module: it holds the phase, what the phase waits for and the handoff in flight,
and moves between phases. Its parts decide the rest, each with its own state: the phase tables
(:mod:`.phases`), the handoff and the messages made from it (:mod:`.handoff`), the trigger queue
(:mod:`.triggers`), the record's write cycle (:mod:`.writer`) and the workers' liveness and probes
(:mod:`.liveness`); all of them add their actions to one :mod:`.outbox` per input.
"""

from __future__ import annotations

from datetime import datetime

from msgspec.structs import replace

from liver.reshard.plan import slice_participants
from liver.shared.errors import InputError
from liver.shared.layout import Device
from liver.shared.messages import (
    Abort,
    AbortOutcome,
    GenerationAborted,
    Heartbeat,
    Hello,
    PlanningStage,
    ResizeRequested,
    TopologyPlanned,
    TransferPlanned,
    WorkerPhase,
    WorkerStatus,
)
from liver.shared.subjects import validate_token

from .actions import (
    Action,
    ExpectTransfer,
    RequestTopology,
    SendCommand,
    SettleOutcome,
    WriteMembership,
)
from .config import CoordinatorConfig
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
from .handoff import AckResult, Handoff, HandoffStop, WorldView
from .liveness import Liveness, presence_loss
from .membership import Membership, PublishedMembership
from .outbox import Outbox
from .phases import (
    HANDOFF_PHASES,
    TRANSITIONS,
    WAITS_FOR_NOTHING,
    GenerationPhase,
    IllegalTransition,
    Wait,
)
from .phases import WAITS as WAITS  # re-exported: it was defined here
from .record import (
    GenerationRecord,
    PendingHandoff,
    PendingPhase,
    Trigger,
    bus_event_ids,
    lost_devices,
    world_record,
)
from .triggers import LossEffect, TriggerQueue
from .writer import RecordWriter

HISTORY_LENGTH = 200
"""Phase changes kept in :attr:`Coordinator.history`."""


class CoordinatorError(InputError):
    """A call the coordinator cannot honour (``restore`` of a wrong record or at a wrong time)."""


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
        self._phase = GenerationPhase.DOWN
        self._wait = Wait.NOTHING
        self._history: list[tuple[GenerationPhase, GenerationPhase, str]] = []
        self._now: datetime | None = None
        self._handoff: Handoff | None = None
        self._out = Outbox(self.job_id, lambda: None if self._handoff is None else self._handoff.generation)
        self._writer = RecordWriter(
            self.job_id,
            self.instance_id,
            self.config.record_settled_events,
            self._out,
            landed=self._write_landed,
            stood_down=self._stood_down,
        )
        self._triggers = TriggerQueue(self.config, self._out)
        self._liveness = Liveness(self.membership, self.config, self._out)
        self._published = PublishedMembership(self.job_id)
        self._early_world: WorldStarted | None = None
        """A world reported by a failed handoff's workers before its abort was recorded."""
        self._restored_at: datetime | None = None

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
        return self._writer.record

    @property
    def revision(self) -> int:
        return self._writer.revision

    @property
    def silent_workers(self) -> int:
        """Workers declared lost because their heartbeats stopped for the timeout (for the metrics)."""
        return self._liveness.silent_workers

    @property
    def pending_generation(self) -> int | None:
        return None if self._handoff is None else self._handoff.generation

    @property
    def queued(self) -> tuple[str, ...]:
        """Event ids of the triggers waiting for the next handoff."""
        return tuple(t.event_id for t in self._triggers)

    @property
    def open_events(self) -> frozenset[str]:
        """Ids of the bus events this coordinator will still settle: the pending handoff's triggers
        and the queued ones. The adapter holds their stream messages unacknowledged until a
        :class:`Settle` names them, and acknowledges a redelivered event that is not among them."""
        triggers = list(self._triggers) + (self._handoff.triggers if self._handoff is not None else [])
        return frozenset(bus_event_ids(triggers))

    @property
    def history(self) -> tuple[tuple[GenerationPhase, GenerationPhase, str], ...]:
        """The latest phase changes: (from, to, why)."""
        return tuple(self._history)

    def next_deadline(self) -> datetime | None:
        """The next moment a :class:`Tick` could change something: when the adapter should tick."""
        times = [t for t in (self._liveness.next_deadline(),) if t is not None]
        h = self._handoff
        if h is not None and self._phase in (GenerationPhase.PREPARE, GenerationPhase.READY):
            times.append(h.prepare_deadline(self.config))
        elif h is not None and self._phase is GenerationPhase.SWITCH:
            times.append(h.deadline)
        return min(times, default=None)

    # -- entry points ---------------------------------------------------------------------------------

    def handle(self, event: Event, now: datetime) -> list[Action]:
        """Apply one event at time ``now``; return the actions to carry out, in order."""
        self._start_input(now)
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
                self._writer.written(event.revision)
            case RecordConflict():
                self._writer.conflict(event)
            case RecordWriteFailed():
                self._writer.failed(event.error, waiting_for=self._wait.value)
            case RecordObserved():
                self._writer.observed(event, standing_by=self._phase is GenerationPhase.STANDBY)
            case _:
                raise TypeError(f"not a coordinator event: {type(event).__name__}")
        self._check_deadlines()
        return self._end_input()

    def restore(self, record: GenerationRecord, revision: int, now: datetime) -> list[Action]:
        """Take the job over from its stored record (after a restart, or to end a standby).

        Re-publishes the last outcome (its message id makes the copy harmless). A handoff found before
        its switch intent is aborted, keeping the old world, and its triggers are re-planned as a new
        generation; one found after it is resumed: the record is claimed (a compare-and-set), then the
        switch command is sent again and the handoff commits or falls back. Either way it ends exactly
        once, because that end is a compare-and-set from the revision read here.
        """
        if self._phase not in (GenerationPhase.DOWN, GenerationPhase.STANDBY) or self._writer.busy:
            raise CoordinatorError(f"restore needs an idle coordinator, this one is in {self._phase.value}")
        if record.job_id != self.job_id:
            raise CoordinatorError(f"`job_id`: the record is for {record.job_id!r}, not {self.job_id!r}")
        if revision < 1:
            raise CoordinatorError(
                f"`revision`: a stored record has a revision of at least 1, got {revision}"
            )
        self._start_input(now)
        self._restored_at = now
        self._writer.restore(record, revision)
        self._handoff, self._wait = None, Wait.NOTHING
        self._triggers.restore_settled(record.settled)
        last = record.last_outcome
        if last is not None:
            self._triggers.remember(last.event_id)
            self._out.publish(last)
            if isinstance(last, GenerationAborted):
                abort = Abort(job_id=self.job_id, generation=last.generation, reason=last.reason)
                self._out.emit(SendCommand(command=abort))
        pending = record.pending
        self._out.note("info", "restored", generation=record.generation, revision=revision, live=record.live)
        if not record.live:
            self._move(GenerationPhase.DOWN, "restored: the job is restarting from its checkpoint")
        elif pending is None:
            self._expect_world()
            self._move(GenerationPhase.STABLE, "restored: no handoff was pending")
            self._begin_if_due()
        elif pending.phase == PendingPhase.PREPARE:
            self._expect_world()
            for t in pending.triggers:
                self._triggers.remember(t.event_id)
            self._handoff = Handoff.from_pending(pending, record.generation, resumed=False)
            reason = "the coordinator restarted before the switch; re-planning as a new generation"
            self._stop_now(HandoffStop(reason, replan=True), GenerationPhase.PREPARE)
        else:
            self._resume_switch(record, pending)
        self._check_deadlines()
        return self._end_input()

    # -- plumbing --------------------------------------------------------------------------------------

    def _start_input(self, now: datetime) -> None:
        if now.tzinfo is None:
            raise CoordinatorError("`now`: must be timezone-aware")
        self._now = now
        self._out.open()

    def _end_input(self) -> list[Action]:
        self._publish_membership()
        return self._out.close()

    def _publish_membership(self) -> None:
        """Emit the live world's workers when they changed (the ingester maps nodes with them)."""
        record = self._record
        if record is None or not record.live or self._phase is GenerationPhase.STANDBY:
            return
        current = self._published.update(record, self._writer.revision, self.membership)
        if current is not None:
            self._out.emit(WriteMembership(record=current))

    @property
    def now(self) -> datetime:
        assert self._now is not None
        return self._now

    @property
    def _record(self) -> GenerationRecord | None:
        return self._writer.record

    def _move(self, to: GenerationPhase, why: str) -> None:
        if to is self._phase:
            return
        if to not in TRANSITIONS[self._phase]:
            raise IllegalTransition(f"{self._phase.value} -> {to.value} ({why})")
        self._history.append((self._phase, to, why))
        del self._history[:-HISTORY_LENGTH]
        self._out.note("info", "phase_changed", phase_from=self._phase.value, phase_to=to.value, why=why)
        self._phase = to
        if to in WAITS_FOR_NOTHING:
            self._wait = Wait.NOTHING
        if to in (GenerationPhase.COMMITTED, GenerationPhase.DOWN, GenerationPhase.STANDBY):
            self.membership.clear_suspicion()  # a new world (or none): the broken one's loss is served

    def _wrong_job(self, job_id: str, what: str) -> bool:
        if job_id == self.job_id:
            return False
        self._out.note(
            "warning", "input_rejected", input=what, field="job_id", reason=f"{job_id!r} is another job"
        )
        return True

    # -- the record ------------------------------------------------------------------------------------

    def _write(self, record: GenerationRecord, wait: Wait) -> None:
        self._writer.write(record)
        self._wait = wait

    def _write_landed(self) -> None:
        match self._wait:
            case Wait.WORLD_WRITE:
                self._world_recorded()
            case Wait.BEGIN_WRITE:
                self._begin_recorded()
            case Wait.SWITCH_WRITE:
                self._switch_recorded()
            case Wait.RESUME_WRITE:
                self._resume_recorded()
            case Wait.COMMIT_WRITE:
                self._commit_recorded()
            case Wait.ABORT_WRITE:
                self._abort_recorded()
            case Wait.NO_CHANGE_WRITE:
                self._no_change_recorded()
            case other:
                raise IllegalTransition(f"a write completed while waiting for {other.value}")

    def _stood_down(self, stored: GenerationRecord | None, revision: int, why: str) -> None:
        """Someone else owns the job now (the writer adopted what they stored): send nothing more."""
        dropped = self._handoff.generation if self._handoff is not None else None
        self._handoff, self._early_world = None, None
        self._out.note(
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
            self._out.note("info", "world_started_deferred", generation=event.generation)
            return
        if self._phase is not GenerationPhase.DOWN or self._writer.busy:
            self._out.note(
                "warning", "world_started_ignored", reason=f"the coordinator is {self._phase.value}"
            )
            return
        if record is not None and event.generation <= record.issued:
            self._out.note(
                "warning",
                "input_rejected",
                input="world_started",
                field="generation",
                reason=f"{event.generation} is not after the last issued generation {record.issued}",
            )
            return
        self._write(world_record(self.job_id, event, record, self.instance_id), Wait.WORLD_WRITE)

    def _world_recorded(self) -> None:
        assert self._record is not None
        self._move(GenerationPhase.STABLE, f"world of generation {self._record.generation} is live")
        self._begin_if_due()

    def _expect_world(self) -> None:
        assert self._record is not None
        for device in self._record.placement.devices:
            self.membership.expect(device, self.now)

    def _live_devices(self) -> frozenset[Device]:
        """The live world's devices; none while the job is not live."""
        return frozenset() if self._record is None or not self._record.live else self._record.devices

    # -- triggers ------------------------------------------------------------------------------------------

    def _on_resize(self, event: ResizeRequested) -> None:
        if self._wrong_job(event.job_id, "resize_requested"):
            return
        live = None if self._record is None else self._record.generation
        trigger = self._triggers.arrive(event, self.now, live)
        if trigger is None:
            return
        if self._phase is GenerationPhase.STABLE:
            self._triggers.add(trigger)
            self._begin_if_due()
        elif self._phase in HANDOFF_PHASES and self._handoff is not None:
            self._arrived_during_handoff(trigger)
        else:
            self._triggers.hold(trigger, phase=self._phase.value)

    def _arrived_during_handoff(self, trigger: Trigger) -> None:
        assert self._handoff is not None
        stop = self._triggers.arrive_during_handoff(trigger, self._handoff)
        if stop is not None:
            self._request_stop(stop)

    def _live_world_lost_a_member(self) -> bool:
        """A trigger, queued or of the handoff, reports a worker of the live world lost."""
        triggers = list(self._triggers) + (self._handoff.triggers if self._handoff is not None else [])
        return bool(lost_devices(triggers) & self._live_devices())

    # -- starting a handoff --------------------------------------------------------------------------------

    def _begin_if_due(self) -> None:
        """Start a handoff for every waiting trigger that still changes the live world (not while a
        probe is finding out who else is gone: those are planned around in the same handoff)."""
        if self._phase is not GenerationPhase.STABLE or self._writer.busy or not self._triggers:
            return
        if self._liveness.probing:
            return
        record = self._record
        assert record is not None
        done = self._triggers.drop_irrelevant(record.devices)
        if done:
            self._answer_no_change(done)
            return
        triggers = self._triggers.take_all()
        h = self._handoff = Handoff.begin(record, triggers, self.now, self.config)
        pending = h.pending_prepare()
        why = f"{len(triggers)} trigger(s) change the world; handoff to generation {h.generation}"
        self._move(GenerationPhase.PREPARE, why)
        self._write(replace(record, issued=h.generation, pending=pending), Wait.BEGIN_WRITE)

    def _answer_no_change(self, done: list[Trigger]) -> None:
        """Give events that change nothing (any more) an outcome of their own, recorded with the events
        it settles; the queue's other triggers start their handoff once that write lands. Lost workers
        already gone need no answer."""
        assert self._record is not None
        if not bus_event_ids(done):
            self._begin_if_due()
            return
        answer = self._triggers.answer_no_change(done, self._record, self.job_id, self.now)
        self._writer.carry(done, SettleOutcome.NO_CHANGE, answer.generation)
        self._write(
            replace(self._record, issued=answer.generation, last_outcome=answer), Wait.NO_CHANGE_WRITE
        )

    def _no_change_recorded(self) -> None:
        done, answer = self._triggers.take_no_change()
        self._wait = Wait.NOTHING
        self._out.publish(answer)
        self._out.settle(done, SettleOutcome.NO_CHANGE, answer.generation)
        self._begin_if_due()

    def _begin_recorded(self) -> None:
        h = self._handoff
        assert h is not None and self._record is not None
        self._wait = Wait.TOPOLOGY
        if self._run_deferred_stop():
            return
        request = h.topology_request(self.job_id, self._record, self._triggers.departing)
        self._out.emit(RequestTopology(request=request))

    # -- planning --------------------------------------------------------------------------------------------

    def _is_current_plan(self, event_id: str, generation: int, wait: Wait, what: str) -> bool:
        """Whether a plan (or its failure) answers what the pending handoff waits for now."""
        h = self._handoff
        if h is not None and h.generation == generation and h.event_id == event_id and self._wait is wait:
            return True
        self._out.note(
            "warning",
            "stale_plan_ignored",
            input=what,
            event_id=event_id,
            plan_generation=generation,
            waiting_for=self._wait.value,
        )
        return False

    def _on_topology(self, event: TopologyPlanned) -> None:
        if self._wrong_job(event.job_id, "topology_planned"):
            return
        if not self._is_current_plan(event.event_id, event.generation, Wait.TOPOLOGY, "topology_planned"):
            return
        h = self._handoff
        assert h is not None and self._record is not None
        stop = h.take_topology(event, self._record, self._out.note)
        if stop is not None:
            self._request_stop(stop)
            return
        waiting = self._triggers.take_all()
        for i, trigger in enumerate(waiting):
            if h.stop is not None or self._writer.deferred_stop is not None:
                self._triggers.put_back(waiting[i:])
                break
            self._arrived_during_handoff(trigger)
        if h.stop is not None or self._writer.deferred_stop is not None:
            return
        self._wait = Wait.TRANSFER
        self._out.emit(ExpectTransfer(topology=event))

    def _on_transfer(self, event: TransferPlanned) -> None:
        if self._wrong_job(event.job_id, "transfer_planned"):
            return
        if not self._is_current_plan(event.event_id, event.generation, Wait.TRANSFER, "transfer_planned"):
            return
        h = self._handoff
        assert h is not None and self._record is not None
        stop = h.take_transfer(event, self._record, self.now, self.config, self._out.note)
        if stop is not None:
            self._request_stop(stop)
            return
        self._send_prepare()

    def _on_planning_failed(self, event: PlanningFailed) -> None:
        if self._wrong_job(event.job_id, "planning_failed"):
            return
        wait = Wait.TOPOLOGY if event.stage == PlanningStage.TOPOLOGY else Wait.TRANSFER
        if self._is_current_plan(event.event_id, event.generation, wait, "planning_failed"):
            self._request_stop(HandoffStop(f"{event.stage} planning failed: {event.reason}", replan=False))

    # -- preparing ------------------------------------------------------------------------------------------

    def _send_prepare(self) -> None:
        """Broadcast the Prepare once every participant's device has a known worker (the acks are
        counted against those workers)."""
        h = self._handoff
        assert h is not None and h.transfer is not None and h.placement is not None and h.layout is not None
        assert self._record is not None
        # The old-world devices whose worker is gone take no part; the workers apply the same rule
        # (``slice_participants``) to the Prepare's ``lost``.
        lost = (self._live_devices() & lost_devices(h.triggers)) - frozenset(h.placement.devices)
        devices = sorted(slice_participants(self._record.placement, h.placement, lost))
        participants, missing, gone = self._liveness.workers_on(
            devices, awaited_since=self._restored_at, now=self.now
        )
        if gone:
            self._triggers.add_lost(gone, self.now)
            names = ", ".join(map(str, gone))
            reason = f"no live worker on {names}; re-planning without them"
            self._request_stop(HandoffStop(reason, replan=True))
            return
        if missing:
            self._wait = Wait.WORKERS
            self._out.note("info", "waiting_for_workers", devices=[str(d) for d in missing])
            return
        h.participants = participants
        # One broadcast for the whole job: a Prepare per worker repeated the O(workers) placement to
        # every worker (29 MiB per handoff at 1,024 workers). Each worker decides from the two worlds
        # and ``lost`` whether it takes part, and finds its slice by its device's index.
        try:
            prepare = h.prepare_command(self.job_id, self._record, lost, self.config, self.membership)
        except ValueError as exc:
            reason = f"the plan does not fit the worlds it was made for: {exc}"
            self._request_stop(HandoffStop(reason, replan=False))
            return
        self._out.emit(SendCommand(command=prepare))
        h.prepare = prepare
        self._wait = Wait.PREPARED
        self._out.note("info", "prepare_sent", participants=len(participants), deadline=prepare.deadline)

    def _on_status(self, event: WorkerStatus) -> None:
        if self._wrong_job(event.job_id, "worker_status"):
            return
        if event.phase == WorkerPhase.PEER_LOST:
            self._liveness.peer_lost(event.worker_id, event.generation, self._view(), self.now)
            return
        h = self._handoff
        if h is None or event.generation != h.generation:
            self._out.note(
                "warning",
                "stale_ack_ignored",
                worker_id=event.worker_id,
                ack_generation=event.generation,
                ack_phase=event.phase,
                pending_generation=None if h is None else h.generation,
            )
            return
        match h.take_ack(event, self._wait, self._out.note):
            case AckResult.ALL_PREPARED:
                self._all_prepared()
            case AckResult.ALL_SWITCHED:
                self._all_switched()
            case AckResult.FAILED:
                why = f"worker {event.worker_id} on {h.participants[event.worker_id]} failed: {event.error}"
                if self._may_be_a_loss(h, event):
                    self._hold_failure(h, why)
                else:
                    self._request_stop(HandoffStop(why, replan=False))

    def _may_be_a_loss(self, h: Handoff, event: WorkerStatus) -> bool:
        """Whether a participant's failure may come from a member gone at the switch, before anything
        committed: the survivors then hold the cut's state (I4) and recover live, so the checkpoint
        waits for a probe. A process that says it falls back, or a switch taken over after a restart
        (its acks lost), falls back at once."""
        return self._phase is GenerationPhase.SWITCH and h.uncommitted and not event.falling_back

    def _hold_failure(self, h: Handoff, why: str) -> None:
        if h.held_failure is None:
            h.held_failure = why
            self._out.note("warning", "participant_failed_probing", generation=h.generation, why=why)
            devices = set(self._live_devices()) | set(h.target or ())
            self._liveness.probe(devices, self._view(), self.now)
        self._decide_failure()

    def _decide_failure(self) -> None:
        """The probe held for a participant's failure has answered (or was given up on): a member found
        gone has already turned the handoff into a live recovery; else the failure stops it."""
        h = self._handoff
        if h is None or h.held_failure is None or self._liveness.probing:
            return
        why, h.held_failure = h.held_failure, None
        deferred = self._writer.deferred_stop
        if deferred is None or not deferred.recover:  # a loss found: recovering already
            self._request_stop(HandoffStop(why, replan=False))

    def _all_prepared(self) -> None:
        h = self._handoff
        assert h is not None and self._record is not None
        self._move(GenerationPhase.READY, f"all {len(h.participants)} participants are ready")
        self._write(replace(self._record, pending=h.pending_switch()), Wait.SWITCH_WRITE)

    # -- switching -------------------------------------------------------------------------------------------

    def _switch_recorded(self) -> None:
        h = self._handoff
        assert h is not None
        if self._run_deferred_stop():
            return
        if self.now > h.prepare_deadline(self.config):
            reason = "the switch intent was recorded too late to switch in time"
            self._stop_now(HandoffStop(reason, replan=False))
            return
        self._send_switch(h)

    def _send_switch(self, h: Handoff) -> None:
        self._out.emit(SendCommand(command=h.switch_command(self.job_id)))
        h.switch_sent = True
        self._move(GenerationPhase.SWITCH, "switch sent: the old world starts handing over its state")
        self._wait = Wait.SWITCHED

    def _resume_switch(self, record: GenerationRecord, pending: PendingHandoff) -> None:
        """Take over a handoff found after its switch intent. The coordinator that wrote the intent may
        still run, its write's answer lost: it would then end the handoff as its own. So the record is
        claimed by a compare-and-set first, and the switch is sent again only once the claim landed;
        until then the switch counts as sent (the old coordinator may have sent it), so a stop falls
        back instead of keeping the old world."""
        for t in pending.triggers:
            self._triggers.remember(t.event_id)
        h = self._handoff = Handoff.from_pending(pending, record.generation, resumed=True)
        h.switch_sent = True
        for p in pending.participants:
            self.membership.expect(p.device, self.now)
        self._move(GenerationPhase.SWITCH, "restored after the switch intent: claiming the record")
        self._write(record, Wait.RESUME_WRITE)

    def _resume_recorded(self) -> None:
        h = self._handoff
        assert h is not None
        if self._run_deferred_stop():
            return
        self._send_switch(h)

    def _all_switched(self) -> None:
        h = self._handoff
        assert h is not None and self._record is not None and h.layout is not None and h.placement is not None
        iteration = h.cut_iteration(self.membership, self._out.note)
        record = h.committed_record(self.job_id, self._record, iteration, self.now)
        self._writer.drop_deferred_stop()
        self._writer.carry(h.triggers, SettleOutcome.COMMITTED, h.generation)
        self._write(record, Wait.COMMIT_WRITE)

    def _commit_recorded(self) -> None:
        h = self._handoff
        assert h is not None and self._record is not None and self._record.last_outcome is not None
        self._out.publish(self._record.last_outcome, h)
        self._move(GenerationPhase.COMMITTED, f"generation {h.generation} is live")
        self._out.settle(h.triggers, SettleOutcome.COMMITTED, h.generation)
        self._move(GenerationPhase.CLEANUP, "releasing the old generation's resources")
        self._out.emit(h.release_plan(self.job_id))
        self._handoff, self._early_world = None, None
        self._writer.drop_deferred_stop()
        self._move(GenerationPhase.STABLE, "cleanup done")
        self._begin_if_due()

    # -- stopping ------------------------------------------------------------------------------------------

    def _request_stop(self, stop: HandoffStop) -> None:
        h = self._handoff
        if h is None or self._phase not in HANDOFF_PHASES or h.stop is not None:
            self._out.note("debug", "stop_not_applicable", reason=stop.reason, phase=self._phase.value)
            return
        if self._wait is Wait.COMMIT_WRITE:
            self._out.note("info", "stop_too_late", reason=stop.reason, why="every participant has switched")
            return
        if self._writer.busy:
            self._writer.defer(stop)
            self._out.note("info", "stop_deferred", reason=stop.reason, until=self._wait.value)
            return
        self._stop_now(stop)

    def _run_deferred_stop(self) -> bool:
        stop = self._writer.take_deferred_stop()
        if stop is None:
            return False
        self._stop_now(stop)
        return True

    def _stop_now(self, stop: HandoffStop, phase: GenerationPhase | None = None) -> None:
        """Record the abort of the pending handoff; what follows happens once the record says so."""
        h = self._handoff
        assert h is not None and self._record is not None
        settled = h.stop_with(
            stop,
            phase or self._phase,
            live_loss_known=self._live_world_lost_a_member(),
            job_id=self.job_id,
            active_generation=self._record.generation,
            now=self.now,
        )
        assert h.stop is not None and h.aborted is not None
        self._writer.drop_deferred_stop()
        self._move(GenerationPhase.ABORTED, h.stop.reason)
        if settled is not None:
            self._writer.carry(h.triggers, settled, h.generation)
        fallback = h.aborted.outcome == AbortOutcome.CHECKPOINT_FALLBACK
        self._write(
            replace(self._record, pending=None, last_outcome=h.aborted, live=not fallback), Wait.ABORT_WRITE
        )

    def _abort_recorded(self) -> None:
        h = self._handoff
        assert h is not None and h.stop is not None and h.aborted is not None
        aborted, stop = h.aborted, h.stop
        self._out.emit(SendCommand(command=h.abort_command(self.job_id)))
        self._out.publish(aborted, h)
        if h.transfer is not None or h.switch_sent:
            self._out.emit(h.release_plan(self.job_id))
        self._handoff = None
        self._writer.drop_deferred_stop()
        if aborted.outcome == AbortOutcome.CHECKPOINT_FALLBACK:
            self._out.note(
                "error", "checkpoint_fallback", generation=aborted.generation, reason=aborted.reason
            )
            self._out.settle(h.triggers, SettleOutcome.CHECKPOINT_FALLBACK, aborted.generation)
            self._move(GenerationPhase.DOWN, "checkpoint fallback: the job restarts from its last checkpoint")
            early, self._early_world = self._early_world, None
            if early is not None:
                self._on_world_started(early)
            return
        self._early_world = None
        if stop.replan:
            self._triggers.put_back(h.triggers, first=True)
        else:
            self._out.settle(h.triggers, stop.settle, aborted.generation)
        if aborted.outcome == AbortOutcome.LIVE_RECOVERY:
            self._move(GenerationPhase.STABLE, "the old world's survivors keep the cut's state to move live")
        else:
            self._move(GenerationPhase.STABLE, "kept the old world")
        self._begin_if_due()

    # -- deadlines -------------------------------------------------------------------------------------

    def _check_deadlines(self) -> None:
        h = self._handoff
        if h is None or h.stop is not None or self._writer.deferred_stop is not None:
            return
        reason = h.missed_deadline(self._phase, self._wait, self.now, self.config)
        if reason is not None:
            self._request_stop(HandoffStop(reason, replan=False))

    # -- presence and liveness -------------------------------------------------------------------------

    def _view(self) -> WorldView:
        record = self._record
        return WorldView(
            phase=self._phase,
            wait=self._wait,
            live=self._live_devices(),
            record_generation=0 if record is None else record.generation,
            live_generation=None if record is None or not record.live else record.generation,
            handoff=self._handoff,
            live_loss_known=self._live_world_lost_a_member(),
        )

    def _on_tick(self) -> None:
        if self._liveness.give_up_probe(self.now):
            self._decide_failure()
            self._begin_if_due()
        silent, missing = self._liveness.expire(self.now)
        for device, why in silent + missing:
            self._device_lost(device, why, begin=False)
        if any(device in self._live_devices() for device, _ in silent):
            # Its node's other workers may be gone too: one loss, one plan.
            self._liveness.probe(self._live_devices(), self._view(), self.now)
        self._begin_if_due()
        if self._wait is Wait.WORKERS and self._handoff is not None and self._handoff.stop is None:
            self._send_prepare()

    def _on_presence(self, event: Hello | Heartbeat) -> None:
        change = self._liveness.observe(event, self.now)
        if change is None:
            return
        loss = presence_loss(change, self._handoff)
        if loss is not None:
            self._device_lost(*loss)
        h = self._handoff
        waiting = self._wait is Wait.WORKERS and h is not None and h.stop is None
        if waiting and self._writer.deferred_stop is None:
            self._send_prepare()
        if isinstance(event, Heartbeat):
            self._switched_by_heartbeat(event)
            if event.broken:
                self._liveness.broken_heartbeat(event, self._view(), self.now)

    def _on_reconnected(self) -> None:
        """The bus was away: what this coordinator sent, and what workers acked, may be lost (worker
        traffic is not stored). Send the command of the phase again; workers answer a repeated command
        with their last ack without redoing it, and announce themselves again after their own
        reconnect, so the handoff carries on instead of waiting for its deadline."""
        h = self._handoff
        if h is None or h.stop is not None or self._writer.deferred_stop is not None:
            return
        command = h.resend(self._wait, self.job_id, self._out.note)
        if command is not None:
            self._out.emit(SendCommand(command=command))

    def _switched_by_heartbeat(self, beat: Heartbeat) -> None:
        h = self._handoff
        ack = None if h is None else h.ack_in_heartbeat(beat, self._wait, self.job_id)
        if h is not None and ack is not None:
            self._out.note(
                "info", "switch_seen_in_heartbeat", worker_id=beat.worker_id, generation=h.generation
            )
            self._on_status(ack)

    def _on_probed(self, event: WorkersProbed) -> None:
        """The members found gone are lost now, all of them before any handoff begins."""
        self._liveness.probed(
            event, self._handoff, self.now, lambda device, why: self._device_lost(device, why, begin=False)
        )
        self._decide_failure()
        self._begin_if_due()

    def _on_worker_lost(self, event: WorkerLost) -> None:
        loss = self._liveness.worker_lost(event, self._handoff)
        if loss is not None:
            self._device_lost(*loss)

    def _device_lost(self, device: Device, why: str, *, begin: bool = True) -> None:
        """A device's worker is gone (:meth:`.triggers.TriggerQueue.lose` says what that means now).
        ``begin=False``: the caller begins the handoff once every loss it knows of is queued."""
        effect = self._triggers.lose(device, why, self._view(), self.now)
        if isinstance(effect, HandoffStop):
            self._request_stop(effect)
        elif effect is LossEffect.SWITCH_DONE:
            self._all_switched()
        elif effect is LossEffect.BEGIN and begin:
            self._begin_if_due()
