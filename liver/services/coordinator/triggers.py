"""The triggers waiting for a handoff, and the decisions about them.

Triggers, not messages, are queued. A trigger that arrives during a handoff is either already served by
the pending target (folded into it), or waits, or makes the target impossible (the core then cancels
and re-plans). Waiting triggers are planned against the world that is live when the handoff ends, all
of them in one handoff, and the ones that no longer change anything get an answer of their own: a
generation id that never runs, aborted as keeping the live world. A lost worker is a trigger too: what
it means depends on the phase and on the device's role (in the live world, in the target, a participant).

:class:`TriggerQueue` owns what that needs: the waiting triggers, the devices announced to leave, the
event ids already seen (for de-duplication) and the "nothing to change" answer in flight. It decides;
the core carries its decisions out (stops, record writes, settlements).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from datetime import datetime

from liver.shared.layout import Device
from liver.shared.messages import AbortOutcome, GenerationAborted, HandoffPhase, ResizeRequested

from .actions import Settle, SettleOutcome
from .config import CoordinatorConfig, trigger_deadline
from .handoff import Handoff, HandoffStop, WorldView
from .outbox import Outbox
from .phases import GenerationPhase, Wait
from .record import GenerationRecord, SettledEvent, Trigger, TriggerSource, bus_event_ids, lost_devices


class LossEffect(enum.StrEnum):
    """What a lost worker asks of the core besides a stop (:meth:`TriggerQueue.lose`)."""

    NOTHING = "nothing"
    """Not part of any world, known already, or a leaving worker whose part is done."""
    BEGIN = "begin"
    """Queued: a handoff plans around it when one can begin."""
    SWITCH_DONE = "switch_done"
    """A participant lost after the commit: every other one has switched, so the switch is done."""


def served_by(trigger: Trigger, target: frozenset[Device]) -> bool:
    """Whether committing ``target`` already does what ``trigger`` asks."""
    if set(trigger.remove) & target or not set(trigger.add) <= target:
        return False
    return trigger.target_devices is None or trigger.target_devices == len(target)


class TriggerQueue:
    """The triggers waiting for the next handoff, in arrival order, and what is known about them."""

    def __init__(self, config: CoordinatorConfig, outbox: Outbox) -> None:
        self._config = config
        self._out = outbox
        self._note = outbox.note
        self._waiting: list[Trigger] = []
        self._departing: set[Device] = set()
        """Devices announced to leave and not offered since: never planned back in by an older offer."""
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._no_change: tuple[list[Trigger], GenerationAborted] | None = None
        """The "nothing to change" answer whose record write is in flight, and the triggers it ends."""

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __iter__(self) -> Iterator[Trigger]:
        return iter(self._waiting)

    @property
    def departing(self) -> frozenset[Device]:
        return frozenset(self._departing)

    # -- arrival ---------------------------------------------------------------------------------------

    def remember(self, event_id: str) -> None:
        """Know ``event_id`` as handled: a later copy of it is a duplicate."""
        self._seen[event_id] = None
        self._seen.move_to_end(event_id)
        while len(self._seen) > self._config.max_remembered_events:
            self._seen.popitem(last=False)

    def restore_settled(self, settled: Iterable[SettledEvent]) -> None:
        """Know every event the record says is settled, and have the adapter acknowledge a redelivered
        copy of one at once, whichever coordinator settled it."""
        groups: dict[tuple[SettleOutcome, int | None], list[str]] = {}
        for entry in settled:
            self.remember(entry.event_id)
            groups.setdefault((entry.outcome, entry.generation), []).append(entry.event_id)
        for (outcome, generation), ids in groups.items():
            self._out.emit(Settle(event_ids=tuple(ids), outcome=outcome, generation=generation))

    def arrive(self, event: ResizeRequested, now: datetime, live_generation: int | None) -> Trigger | None:
        """The trigger of a resize request, or None for a copy of one already seen."""
        if event.event_id in self._seen:
            self._note("info", "duplicate_event_ignored", event_id=event.event_id)
            return None
        self.remember(event.event_id)
        trigger = Trigger.from_request(event, now)
        self.track_departures(trigger)
        self._note(
            "info",
            "resize_requested",
            event_id=event.event_id,
            trigger=event.trigger,
            remove=len(event.remove),
            add=len(event.add),
            target_devices=event.target_devices,
            request_generation=event.generation,
            live_generation=live_generation,
        )
        return trigger

    def track_departures(self, trigger: Trigger) -> None:
        """Remember what leaves and what is offered, the latest word winning: a device announced to
        leave is never planned back in by an older offer, even after the handoff that removed it."""
        self._departing.difference_update(trigger.add)
        self._departing.update(trigger.remove)

    def hold(self, trigger: Trigger, **why: object) -> None:
        """Keep ``trigger`` for the next handoff, saying why."""
        self._waiting.append(trigger)
        self._note("info", "trigger_queued", event_id=trigger.event_id, **why)

    def add(self, trigger: Trigger) -> None:
        """Keep ``trigger`` for the next handoff (the caller says why)."""
        self._waiting.append(trigger)

    def add_lost(self, devices: Iterable[Device], now: datetime) -> None:
        """Queue the loss of each device's worker, unless a queued trigger reports it already."""
        for device in devices:
            if device not in lost_devices(self._waiting):
                self._waiting.append(Trigger.lost(device, now))
                self._departing.add(device)

    def arrive_during_handoff(self, trigger: Trigger, handoff: Handoff) -> HandoffStop | None:
        """Place a trigger that arrived during ``handoff``: folded into it, or kept for the next one.
        Returns the cancel (re-planning) when the trigger makes the handoff's target impossible (the
        trigger then waits for the re-planned handoff)."""
        target = handoff.target
        if target is None:
            self.hold(trigger, why="target not planned yet")
            return None
        clash = sorted(set(trigger.remove) & target)
        if clash and trigger.kind is TriggerSource.REBALANCE:
            self.hold(trigger, why="a rebalance waits for the handoff in flight")
        elif clash and handoff.switch_sent:
            self.hold(trigger, why="the switch is under way")
        elif clash:
            self._waiting.append(trigger)
            devices = ", ".join(map(str, clash))
            reason = f"event {trigger.event_id} removes {devices} of the target world; re-planning"
            return HandoffStop(reason, replan=True)
        elif served_by(trigger, target):
            self._fold(handoff, trigger)
        else:
            self.hold(trigger, why="needs another handoff")
        return None

    def lose(self, device: Device, why: str, view: WorldView, now: datetime) -> LossEffect | HandoffStop:
        """Queue the loss of ``device``'s worker; what it means depends on the phase and the device's
        role. Returns the stop it makes of the handoff in flight, or what else it asks for."""
        h = view.handoff
        in_world = device in view.live
        in_target = h is not None and h.target is not None and device in h.target
        worker = None if h is None else h.worker_on(device)
        if view.phase in (GenerationPhase.DOWN, GenerationPhase.STANDBY) or not (
            in_world or in_target or worker
        ):
            self._note("debug", "idle_worker_lost", device=str(device), why=why)
            return LossEffect.NOTHING
        if device in lost_devices(self._waiting + (h.triggers if h is not None else [])):
            return LossEffect.NOTHING
        self._note("warning", "worker_lost", device=str(device), why=why, phase=view.phase.value)
        trigger = Trigger.lost(device, now)
        self.track_departures(trigger)
        if view.phase is GenerationPhase.SWITCH and h is not None and view.wait is not Wait.COMMIT_WRITE:
            if not in_target and worker is not None and worker in h.switched:
                self._note("info", "leaving_worker_done", device=str(device))
                return LossEffect.NOTHING
            self._waiting.append(trigger)
            if h.switched and worker is not None:
                # A participant acked its switch: the commit, a collective of every participant, is done
                # (the lost one took part), so the new world is the job's and this is a loss in it. The
                # switch completes without the lost one's ack; the queued loss then plans the recovery
                # from the new world, whose survivors are already waiting for it.
                self._note("warning", "participant_lost_after_the_commit", device=str(device))
                if worker not in h.switched:
                    del h.participants[worker]
                done = len(h.switched) == len(h.participants)
                return LossEffect.SWITCH_DONE if done else LossEffect.NOTHING
            if in_world and h.uncommitted:
                # Nothing committed (every commit is acked): the old world's survivors still hold the
                # cut's state (I4), so the generation is planned again around the loss and moves live.
                return HandoffStop(f"{why} during the switch; recovering live", replan=True, recover=True)
            return HandoffStop(f"{why} after the switch began", replan=False)
        self._waiting.append(trigger)
        if view.phase in (GenerationPhase.PREPARE, GenerationPhase.READY) and h is not None:
            return HandoffStop(f"{why}; re-planning without it", replan=True)
        return LossEffect.BEGIN

    def _fold(self, handoff: Handoff, trigger: Trigger) -> None:
        handoff.triggers.append(trigger)
        handoff.deadline = min(handoff.deadline, trigger_deadline(trigger, self._config))
        self._note("info", "trigger_folded", event_id=trigger.event_id, deadline=handoff.deadline)

    # -- leaving the queue -----------------------------------------------------------------------------

    def relevant(self, trigger: Trigger, world: frozenset[Device]) -> bool:
        """Whether ``trigger`` would change ``world`` at all."""
        if set(trigger.remove) & world:
            return True
        if set(trigger.add) - world - self._departing:
            return True
        return trigger.target_devices is not None and trigger.target_devices != len(world)

    def drop_irrelevant(self, world: frozenset[Device]) -> list[Trigger]:
        """Take out and return the waiting triggers that would not change ``world``."""
        keep = [t for t in self._waiting if self.relevant(t, world)]
        done = [t for t in self._waiting if not self.relevant(t, world)]
        if done:
            self._waiting = keep
            self._note("info", "triggers_need_no_change", event_ids=[t.event_id for t in done])
        return done

    def take_all(self) -> list[Trigger]:
        """Empty the queue, returning what waited, in order."""
        waiting, self._waiting = self._waiting, []
        return waiting

    def put_back(self, triggers: Iterable[Trigger], *, first: bool = False) -> None:
        """Queue ``triggers`` again: ``first``, ahead of the waiting ones (a re-planned handoff's)."""
        if first:
            self._waiting = list(triggers) + self._waiting
        else:
            self._waiting.extend(triggers)

    # -- "nothing to change" answers -------------------------------------------------------------------

    def answer_no_change(
        self, done: list[Trigger], record: GenerationRecord, job_id: str, now: datetime
    ) -> GenerationAborted:
        """The answer to events that change nothing (any more): generation ``issued + 1``, never run,
        aborted as keeping the live world. Held until :meth:`take_no_change` once its write lands."""
        ids = bus_event_ids(done)
        generation = record.issued + 1
        reason = f"nothing to change: the live world (generation {record.generation}) already does what "
        reason += "the event asks" if len(ids) == 1 else f"the {len(ids)} events ask"
        answer = GenerationAborted(
            job_id=job_id,
            event_id=ids[0],
            event_ids=ids,
            generation=generation,
            active_generation=record.generation,
            phase=HandoffPhase.PREPARE,
            reason=reason,
            outcome=AbortOutcome.KEPT_OLD_WORLD,
            aborted_at=now,
        )
        self._no_change = (done, answer)
        return answer

    def take_no_change(self) -> tuple[list[Trigger], GenerationAborted]:
        """The answer whose write landed, and the triggers it ends."""
        assert self._no_change is not None
        answered, self._no_change = self._no_change, None
        return answered
