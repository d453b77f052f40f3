"""One handoff in memory: what it has been told, what follows from that alone, and what it sends.

The record (:mod:`.record`) keeps what a restarted coordinator needs of the pending handoff;
:class:`Handoff` keeps the rest: the plans, the participants and the acks counted so far, why it is being
stopped. What depends on that state alone is decided here (whether a plan can be used, what an ack
completes, whether the handoff is late, how a stop ends it), and the messages it sends are built here
(its topology request, Prepare, Switch and Abort, its outcome, the release of its plan): the core decides
*when*, from its phase and what it waits for; this module *what*. :class:`WorldView` is how the core
tells its other parts about its state, the handoff in flight among it.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from msgspec.structs import replace

from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.messages import (
    Abort,
    AbortOutcome,
    GenerationAborted,
    GenerationCommitted,
    Heartbeat,
    Prepare,
    Switch,
    TopologyPlanned,
    TopologyRequest,
    TransferPlanned,
    WorkerPhase,
    WorkerStatus,
)
from liver.shared.subjects import KV_PLAN_SLICES, slice_keys_of_generation

from .actions import NoteFn, ReleasePlan, SettleOutcome
from .config import CoordinatorConfig, handoff_deadline, switch_estimate_s
from .membership import Membership
from .phases import ABORTED_IN, GenerationPhase, Wait
from .record import (
    GenerationRecord,
    Participant,
    PendingHandoff,
    PendingPhase,
    Trigger,
    bus_event_ids,
    lost_devices,
    removed_devices,
)


@dataclass
class HandoffStop:
    """Why a handoff is being stopped and what follows."""

    reason: str
    replan: bool
    settle: SettleOutcome = SettleOutcome.ABORTED
    recover: bool = False
    """A member of the old world was lost during the switch, before anything committed: its survivors
    hold the cut's state, and the re-planned generation moves them live around the loss."""

    def merge(self, other: HandoffStop) -> HandoffStop:
        """The stronger decision wins: an abort without re-planning beats a cancel that re-plans, and
        a live recovery beats a plain re-plan (the old world is broken whichever came first)."""
        if self.replan and not other.replan:
            return other
        if self.replan and other.recover and not self.recover:
            return other
        return self


@dataclass(frozen=True)
class WorldView:
    """What the core's parts need to know of its state at one moment (the phase, what it waits for, the
    live world, the handoff in flight): built per call, never kept."""

    phase: GenerationPhase
    wait: Wait
    live: frozenset[Device]
    """The live world's devices (none while the job is not live)."""
    record_generation: int
    """The generation of the record (0 before there is one)."""
    live_generation: int | None
    """The live world's generation; None while the job is not live."""
    handoff: Handoff | None
    live_loss_known: bool
    """A trigger (queued, or of the handoff) already reports a worker of the live world lost."""


class AckResult(enum.StrEnum):
    """What a participant's ack completed (:meth:`Handoff.take_ack`)."""

    NOTHING = "nothing"
    ALL_PREPARED = "all_prepared"
    ALL_SWITCHED = "all_switched"
    FAILED = "failed"


def stale_world_stop(what: str, from_generation: int, live_generation: int) -> HandoffStop | None:
    """A plan made against another world than the live one cannot be used: the stop that says so."""
    if from_generation == live_generation:
        return None
    reason = f"the {what} was planned from generation {from_generation}, the live one is {live_generation}"
    return HandoffStop(reason, replan=False)


@dataclass
class Handoff:
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
    stop: HandoffStop | None = None
    stopped_in: GenerationPhase | None = None
    resumed: bool = False
    """Taken over from the record after a restart: acks sent meanwhile are lost, so whether a
    participant committed is unknown (a loss then falls back rather than recover from the old world),
    until a participant says its old world broke (:attr:`old_world_broke`)."""
    old_world_broke: bool = False
    """A participant said (``peer_lost``, or a heartbeat marked ``broken``) that its world of the
    generation before this one lost a peer: it never committed, so no participant did (the commit is a
    collective of all of them) and the old world's survivors hold the cut's state."""
    aborted: GenerationAborted | None = None
    """The outcome of a stop, from its decision until its record write lands."""
    held_failure: str | None = None
    """A participant's failure past the switch, held while a probe finds out whether a member is gone
    (a joiner whose enter broke on a peer killed at the cut fails before the survivors' peer_lost
    arrives): a loss makes it a live recovery, none the checkpoint."""

    @classmethod
    def begin(
        cls, record: GenerationRecord, triggers: list[Trigger], now: datetime, config: CoordinatorConfig
    ) -> Handoff:
        """A handoff from the live world of ``record`` for ``triggers``, as generation ``issued + 1``."""
        return cls(
            generation=record.issued + 1,
            from_generation=record.generation,
            triggers=triggers,
            began_at=now,
            deadline=handoff_deadline(triggers, config),
        )

    @classmethod
    def from_pending(cls, pending: PendingHandoff, from_generation: int, *, resumed: bool) -> Handoff:
        """The handoff a restarted coordinator finds in the record: ``resumed`` (found after its switch
        intent) takes over the target world and the participants too."""
        handoff = cls(
            generation=pending.generation,
            from_generation=from_generation,
            triggers=list(pending.triggers),
            began_at=pending.began_at,
            deadline=pending.deadline,
        )
        if resumed:
            handoff.layout, handoff.placement = pending.layout, pending.placement
            handoff.bytes_planned = pending.bytes_planned
            handoff.participants = {p.worker_id: p.device for p in pending.participants}
            handoff.resumed = True
        return handoff

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

    def prepare_deadline(self, config: CoordinatorConfig) -> datetime:
        """When everything before the switch must be done: the hard deadline less the switch's time."""
        summary = None if self.transfer is None else self.transfer.summary
        return self.deadline - timedelta(seconds=switch_estimate_s(summary, config))

    def awaited_participants(
        self, membership: Membership, now: datetime, devices: Collection[Device] | None = None
    ) -> dict[str, Device]:
        """The participants (on ``devices``) not heard since a restart and still awaited: the record
        names them, so a probe can ask for them by name."""
        return {
            worker_id: device
            for worker_id, device in self.participants.items()
            if (devices is None or device in devices)
            and membership.get(worker_id) is None
            and membership.is_expected(device, now)
        }

    # -- what it is told -------------------------------------------------------------------------------

    def take_topology(
        self, event: TopologyPlanned, record: GenerationRecord, note: NoteFn
    ) -> HandoffStop | None:
        """Adopt the planned target world, or say why it cannot be used: planned from another world than
        the live one, ranks on removed devices, or the live world kept (nothing to move)."""
        stop = stale_world_stop("topology", event.from_generation, record.generation)
        if stop is not None:
            return stop
        banned = sorted(removed_devices(self.triggers) & frozenset(event.placement.devices))
        if banned:
            devices = ", ".join(map(str, banned))
            return HandoffStop(
                f"the topology planner placed ranks on removed devices {devices}", replan=False
            )
        if event.layout == record.layout and event.placement == record.placement:
            reason = "the topology planner kept the live world: nothing to move"
            return HandoffStop(reason, replan=False, settle=SettleOutcome.NO_CHANGE)
        self.layout, self.placement, self.topology = event.layout, event.placement, event
        note(
            "info",
            "target_planned",
            layout=event.layout.describe(),
            devices=len(event.placement),
            explanation=event.explanation[:500],
        )
        return None

    def take_transfer(
        self,
        event: TransferPlanned,
        record: GenerationRecord,
        now: datetime,
        config: CoordinatorConfig,
        note: NoteFn,
    ) -> HandoffStop | None:
        """Adopt the transfer plan, or say why it cannot be used: planned from another world than the
        live one, not verified, or too big to move before the deadline."""
        stop = stale_world_stop("transfer", event.from_generation, record.generation)
        if stop is not None:
            return stop
        if not event.summary.verified:
            return HandoffStop("the transfer plan did not pass verification", replan=False)
        self.transfer, self.bytes_planned = event, event.summary.bytes_moved
        estimate = switch_estimate_s(event.summary, config)
        note("info", "plan_received", bytes_moved=event.summary.bytes_moved, switch_estimate_s=estimate)
        if now <= self.prepare_deadline(config):
            return None
        left = (self.deadline - now).total_seconds()
        return HandoffStop(
            f"the plan moves {event.summary.bytes_moved} bytes, about {estimate:.1f} s of switch, "
            f"and only {left:.1f} s are left before the deadline",
            replan=False,
        )

    def take_ack(self, event: WorkerStatus, waiting_for: Wait, note: NoteFn) -> AckResult:
        """Count an ack of this handoff's generation (a repeated, early or outsider's ack is noted and
        changes nothing)."""
        if event.worker_id not in self.participants:
            note("warning", "ack_from_outsider_ignored", worker_id=event.worker_id, ack_phase=event.phase)
            return AckResult.NOTHING
        match event.phase:
            case "ready":
                if waiting_for is Wait.PREPARED:
                    self.prepared.add(event.worker_id)
                    done = len(self.prepared) == len(self.participants)
                    return AckResult.ALL_PREPARED if done else AckResult.NOTHING
                note("debug", "ack_repeated", worker_id=event.worker_id, ack_phase=event.phase)
            case "switched":
                if not self.switch_sent:
                    note("warning", "switched_before_switch", worker_id=event.worker_id)
                elif waiting_for is Wait.SWITCHED:
                    self.switched[event.worker_id] = event
                    done = len(self.switched) == len(self.participants)
                    return AckResult.ALL_SWITCHED if done else AckResult.NOTHING
                else:
                    note("debug", "ack_repeated", worker_id=event.worker_id, ack_phase=event.phase)
            case "failed":
                return AckResult.FAILED
            case _:
                note("debug", "worker_progress", worker_id=event.worker_id, ack_phase=event.phase)
        return AckResult.NOTHING

    def ack_in_heartbeat(self, beat: Heartbeat, waiting_for: Wait, job_id: str) -> WorkerStatus | None:
        """The switched ack a participant's heartbeat stands for while the switch waits for acks: it
        speaks for the new world (or, leaving, for no world any more) though its ack is missing (acks
        sent while the bus was away are lost, heartbeats keep coming)."""
        if not self.switch_sent or waiting_for is not Wait.SWITCHED or self.stop is not None:
            return None
        device = self.participants.get(beat.worker_id)
        if device is None or beat.worker_id in self.switched or self.placement is None:
            return None
        stays = device in self.placement.devices
        if (stays and beat.generation == self.generation) or (not stays and beat.generation is None):
            return WorkerStatus(
                job_id=job_id,
                worker_id=beat.worker_id,
                generation=self.generation,
                phase=WorkerPhase.SWITCHED,
                iteration=beat.iteration,
            )
        return None

    def missed_deadline(
        self, phase: GenerationPhase, waiting_for: Wait, now: datetime, config: CoordinatorConfig
    ) -> str | None:
        """Why the handoff is late at ``now``, if it is: before the switch it must leave the switch its
        time; the switch must be done by the hard deadline."""
        deadline = self.prepare_deadline(config)
        if phase in (GenerationPhase.PREPARE, GenerationPhase.READY) and now > deadline:
            return (
                f"the {phase.value} phase missed its deadline {deadline.isoformat()} "
                f"while waiting for {waiting_for.value}"
            )
        if phase is GenerationPhase.SWITCH and waiting_for is Wait.SWITCHED and now > self.deadline:
            return (
                f"the switch missed its deadline {self.deadline.isoformat()}: "
                f"{len(self.switched)} of {len(self.participants)} participants switched"
            )
        return None

    def cut_iteration(self, membership: Membership, note: NoteFn) -> int:
        """The iteration the new world starts at: the cut the switched acks name (the latest, should
        they disagree), else the participants' latest heartbeat iteration."""
        cuts = sorted({a.iteration for a in self.switched.values() if a.iteration is not None})
        if len(cuts) > 1:
            note("error", "switch_cut_disagrees", iterations=cuts)
        if cuts:
            return cuts[-1]
        beats = [
            m.iteration for m in membership if m.worker_id in self.participants and m.iteration is not None
        ]
        iteration = max(beats, default=0)
        note("warning", "switch_without_iteration", using=iteration)
        return iteration

    def stop_with(
        self,
        stop: HandoffStop,
        stopped_in: GenerationPhase,
        *,
        live_loss_known: bool,
        job_id: str,
        active_generation: int,
        now: datetime,
    ) -> SettleOutcome | None:
        """Decide how the handoff ends (:attr:`stop`, :attr:`aborted`): past the switch nothing re-plans
        and the job falls back to its checkpoint, as it does when the live world lost a member
        (``live_loss_known``) and the handoff is not re-planned around it. Returns how the handoff's
        events settle with the abort, or None when they are re-planned."""
        past_the_switch = self.switch_sent and not stop.recover  # a recovery re-plans from the old world
        if past_the_switch:
            stop = HandoffStop(stop.reason, replan=False)
        fallback = past_the_switch or (live_loss_known and not stop.replan)
        reason = (
            stop.reason if not stop.replan else f"{stop.reason} (cancelled; re-planned as a new generation)"
        )
        if fallback:
            outcome = AbortOutcome.CHECKPOINT_FALLBACK
        else:
            outcome = AbortOutcome.LIVE_RECOVERY if stop.recover else AbortOutcome.KEPT_OLD_WORLD
        settles = not stop.replan or fallback
        self.stop, self.stopped_in = stop, stopped_in
        self.aborted = self._aborted_as(
            job_id, active_generation, stopped_in, reason, outcome, settles=settles, now=now
        )
        if not settles:
            return None
        return SettleOutcome.CHECKPOINT_FALLBACK if fallback else stop.settle

    # -- what it records and sends ---------------------------------------------------------------------

    def pending_prepare(self) -> PendingHandoff:
        """The record's entry while preparing: a restart re-plans the triggers."""
        return PendingHandoff(
            generation=self.generation,
            phase=PendingPhase.PREPARE,
            event_id=self.event_id,
            triggers=tuple(self.triggers),
            began_at=self.began_at,
            deadline=self.deadline,
        )

    def pending_switch(self) -> PendingHandoff:
        """The record's entry from the switch intent on: a restart resumes the switch."""
        return PendingHandoff(
            generation=self.generation,
            phase=PendingPhase.SWITCH,
            event_id=self.event_id,
            triggers=tuple(self.triggers),
            began_at=self.began_at,
            deadline=self.deadline,
            layout=self.layout,
            placement=self.placement,
            participants=tuple(
                Participant(worker_id=w, device=d)
                for w, d in sorted(self.participants.items(), key=lambda i: i[1])
            ),
            bytes_planned=self.bytes_planned,
        )

    def topology_request(
        self, job_id: str, record: GenerationRecord, departing: Collection[Device]
    ) -> TopologyRequest:
        """What the topology planner is asked: the live world less what leaves, plus what is offered
        and not announced to leave."""
        world = record.devices
        lost = lost_devices(self.triggers) & world
        removed = removed_devices(self.triggers)
        targets = [t.target_devices for t in self.triggers if t.target_devices is not None]
        return TopologyRequest(
            job_id=job_id,
            event_id=self.event_id,
            event_ids=tuple(t.event_id for t in self.triggers),
            from_generation=record.generation,
            generation=self.generation,
            layout=record.layout,
            placement=record.placement,
            remove=tuple(sorted((removed & world) - lost)),
            lost=tuple(sorted(lost)),
            add=tuple(sorted({d for t in self.triggers for d in t.add} - world - removed - set(departing))),
            target_devices=targets[-1] if targets else None,
            deadline=self.deadline,
            geometry=record.geometry,
            peer_copies=record.peer_copies,
        )

    def prepare_command(
        self,
        job_id: str,
        record: GenerationRecord,
        lost: frozenset[Device],
        config: CoordinatorConfig,
        membership: Membership,
    ) -> Prepare:
        """The job-wide Prepare; raises ``ValueError`` naming the field that does not fit."""
        assert self.transfer is not None and self.placement is not None and self.layout is not None
        # Every worker hosts a rendezvous store at the address it announced; the new world's rank 0
        # runs the new generation's (it is a participant, so its worker is known here).
        rank0 = membership.on_device(self.placement.devices[0])
        return Prepare(
            job_id=job_id,
            event_id=self.event_id,
            from_generation=self.from_generation,
            generation=self.generation,
            from_layout=record.layout,
            from_placement=record.placement,
            layout=self.layout,
            placement=self.placement,
            lost=tuple(sorted(lost)),
            plan=self.transfer.plan,
            slices=self.transfer.slices,
            staging_bytes=config.staging_bytes,
            deadline=self.prepare_deadline(config),
            store=None if rank0 is None else rank0.address,
        )

    def committed_record(
        self, job_id: str, record: GenerationRecord, iteration: int, now: datetime
    ) -> GenerationRecord:
        """``record`` with this handoff committed: its target world live from ``iteration`` on, the
        commit as the last outcome."""
        assert self.layout is not None and self.placement is not None
        acks = list(self.switched.values())
        received = [a.bytes_received for a in acks]
        if all(b is not None for b in received):
            bytes_moved = sum(b for b in received if b is not None)
        else:
            planned = self.bytes_planned
            bytes_moved = planned if planned is not None else sum(b or 0 for b in received)
        committed = GenerationCommitted(
            job_id=job_id,
            event_id=self.event_id,
            event_ids=bus_event_ids(self.triggers),
            previous_generation=record.generation,
            generation=self.generation,
            layout=self.layout,
            placement=self.placement,
            started_at_iteration=iteration,
            downtime_s=max((a.pause_s for a in acks if a.pause_s is not None), default=0.0),
            bytes_moved=bytes_moved,
            committed_at=now,
        )
        return replace(
            record,
            generation=self.generation,
            layout=self.layout,
            placement=self.placement,
            pending=None,
            last_outcome=committed,
            live=True,
        )

    def _aborted_as(
        self,
        job_id: str,
        active_generation: int,
        stopped_in: GenerationPhase,
        reason: str,
        outcome: AbortOutcome,
        *,
        settles: bool,
        now: datetime,
    ) -> GenerationAborted:
        """The abort; ``settles``: it ends its events (else the next handoff re-plans them)."""
        ids = bus_event_ids(self.triggers)
        return GenerationAborted(
            job_id=job_id,
            event_id=self.event_id,
            event_ids=ids if settles else (),
            replanned_event_ids=() if settles else ids,
            generation=self.generation,
            active_generation=active_generation,
            phase=ABORTED_IN[stopped_in],
            reason=reason[:2000],
            outcome=outcome,
            aborted_at=now,
        )

    def resend(self, waiting_for: Wait, job_id: str, note: NoteFn) -> Prepare | Switch | None:
        """The command to send again after the bus was away, if the handoff waits for its acks."""
        if waiting_for is Wait.PREPARED and self.prepare is not None:
            missing = len(self.participants) - len(self.prepared)
            note("info", "prepare_resent", generation=self.generation, waiting_for=missing)
            return self.prepare
        if waiting_for is Wait.SWITCHED:
            missing = len(self.participants) - len(self.switched)
            note("info", "switch_resent", generation=self.generation, waiting_for=missing)
            return self.switch_command(job_id)
        return None

    def switch_command(self, job_id: str) -> Switch:
        return Switch(job_id=job_id, generation=self.generation, deadline=self.deadline)

    def abort_command(self, job_id: str) -> Abort:
        """The Abort of a stopped handoff (:attr:`aborted`): a checkpoint fallback tells the workers so."""
        assert self.aborted is not None
        return Abort(
            job_id=job_id,
            generation=self.generation,
            reason=self.aborted.reason,
            fallback=self.aborted.outcome == AbortOutcome.CHECKPOINT_FALLBACK,
        )

    def release_plan(self, job_id: str) -> ReleasePlan:
        """Have the plan objects deleted by name (no listing of the store)."""
        t = self.transfer
        if t is None:
            # Resumed after a restart: the names are lost, but the small slices (all but an oversized
            # few) share the generation's key prefix; the plan file and oversized slices expire.
            return ReleasePlan(
                generation=self.generation,
                kv_bucket=KV_PLAN_SLICES,
                kv_keys=slice_keys_of_generation(job_id, self.generation),
            )
        pattern = t.slices.kv_keys_pattern()
        return ReleasePlan(
            generation=self.generation,
            bucket=t.slices.bucket,
            objects=(t.plan.name, *t.slices.object_names()),
            kv_bucket=t.slices.kv_bucket or "",
            kv_keys=pattern or "",
        )
