"""Who is still there: presence, silence, peer losses and probes, turned into losses the core acts on.

A worker is lost when its heartbeats stop, when its process restarts or is replaced, when the adapter
says so, or when a probe finds it gone. A survivor that says its world lost a peer (a ``peer_lost`` ack,
or a heartbeat marked ``broken``) cannot say which one: every member of that world is then suspected
(lost after the short suspicion window instead of the full heartbeat timeout) and asked directly, so a
process that is gone is known within a round trip, and every member found gone at once is one loss,
planned around in one handoff. One probe is in flight at a time, and no handoff begins meanwhile.

:class:`Liveness` owns the probe in flight, the count of silent workers and which broken generation it
has heard of, and works on the job's :class:`~.membership.Membership` (which the core shares, read-only,
with its adapter). It reports each loss as a device and why; what a loss means for the handoff in
flight is the trigger queue's to say (:meth:`.triggers.TriggerQueue.lose`). What it needs to know of
the core's state comes in a :class:`~.handoff.WorldView` per call.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from datetime import datetime, timedelta

from liver.shared.layout import Device
from liver.shared.messages import Heartbeat, Hello

from .actions import ProbeWorkers
from .config import CoordinatorConfig
from .events import WorkerLost, WorkersProbed
from .handoff import Handoff, WorldView
from .membership import Change, HelloPending, Membership, MembershipError
from .outbox import Outbox
from .phases import GenerationPhase
from .record import lost_devices

Loss = tuple[Device, str]
"""A device whose worker is gone, and why."""

LostFn = Callable[[Device, str], None]
"""``lost(device, why)``: the core acts on one loss (called as each is found)."""


def presence_loss(change: Change, handoff: Handoff | None) -> Loss | None:
    """The loss a presence change reveals, if any (never more than one): a worker restarted or replaced
    on its device, or a participant's device taken by a worker that just joined."""
    previous = change.previous
    if previous is not None:
        how = "restarted" if change.kind == "restarted" else f"was replaced by {change.member.worker_id}"
        return previous.device, f"worker {previous.worker_id} on {previous.device} {how}"
    if handoff is not None and change.kind == "joined":
        expected = handoff.worker_on(change.member.device)
        if expected is not None and expected != change.member.worker_id:
            return change.member.device, f"participant {expected} was replaced by {change.member.worker_id}"
    return None


class Liveness:
    """The job's workers' liveness: what presence changed, who went silent or is suspected, and the probe
    in flight."""

    def __init__(self, membership: Membership, config: CoordinatorConfig, outbox: Outbox) -> None:
        self._membership = membership
        self._config = config
        self._emit = outbox.emit
        self._note = outbox.note
        self.silent_workers = 0
        """Workers declared lost because their heartbeats stopped for the timeout (for the metrics)."""
        self._probing: tuple[int, datetime] | None = None
        """A probe of a world's members in flight: its number, and when to stop waiting for it."""
        self._probes = 0
        self._broken_generation_heard: int | None = None
        """A generation a heartbeat said broke, acted on once."""

    @property
    def probing(self) -> bool:
        """A probe is in flight: no handoff begins, so that every member found gone is planned around
        at once."""
        return self._probing is not None

    def next_deadline(self) -> datetime | None:
        """When a member times out or the probe in flight is given up on, whichever comes first."""
        times = [t for t in (self._membership.next_deadline(),) if t is not None]
        if self._probing is not None:
            times.append(self._probing[1])
        return min(times, default=None)

    # -- presence and silence --------------------------------------------------------------------------

    def observe(self, event: Hello | Heartbeat, now: datetime) -> Change | None:
        """What a hello or heartbeat changed; None (noted) when it is dropped or rejected."""
        try:
            return self._membership.observe(event, now)
        except HelloPending as exc:
            self._note("debug", "heartbeat_before_hello", worker_id=event.worker_id, reason=exc.reason)
        except MembershipError as exc:
            self._note(
                "warning",
                "input_rejected",
                input=event.__class__.__name__,
                field=exc.field,
                reason=exc.reason,
            )
        return None

    def expire(self, now: datetime) -> tuple[list[Loss], list[Loss]]:
        """The members silent for their timeout (counted in :attr:`silent_workers`), and the devices
        awaited since a restart that nobody reported from, both dropped."""
        expired = self._membership.expire(now)
        timeout = self._config.heartbeat_timeout_s
        self.silent_workers += len(expired.lost)
        silent = []
        for member in expired.lost:
            after = "" if member.suspect_s is None else " after its world lost a peer"
            silence = f"silent for {member.timeout(timeout)} s{after}"
            silent.append((member.device, f"worker {member.worker_id} on {member.device} {silence}"))
        missing = [
            (
                device,
                f"no worker on {device} reported since the restart (awaited {timeout} s, or the suspicion "
                "window once its world lost a peer)",
            )
            for device in expired.missing
        ]
        return silent, missing

    def worker_lost(self, event: WorkerLost, handoff: Handoff | None) -> Loss | None:
        """Forget a worker the adapter reports lost; its device (or a participant's by the record)."""
        member = self._membership.remove(event.worker_id)
        device = member.device if member is not None else None
        if device is None and handoff is not None:
            device = handoff.participants.get(event.worker_id)
        if device is None:
            self._note("debug", "unknown_worker_lost", worker_id=event.worker_id, reason=event.reason)
            return None
        return device, f"worker {event.worker_id} on {device} lost: {event.reason}"

    def workers_on(
        self, devices: Iterable[Device], *, awaited_since: datetime | None, now: datetime
    ) -> tuple[dict[str, Device], list[Device], list[Device]]:
        """The known workers on ``devices`` (worker id -> device), the devices without one, and of those
        the ones no longer awaited (gone). ``awaited_since``: a restart, from which a device without a
        known worker is awaited (its worker may not have spoken yet)."""
        workers: dict[str, Device] = {}
        missing: list[Device] = []
        for device in devices:
            member = self._membership.on_device(device)
            if member is None:
                missing.append(device)
            else:
                workers[member.worker_id] = device
        if awaited_since is not None:
            for device in missing:
                self._membership.expect(device, awaited_since)
        gone = [d for d in missing if not self._membership.is_expected(d, now)]
        return workers, missing, gone

    # -- a world that lost a peer ----------------------------------------------------------------------

    def peer_lost(self, worker_id: str, generation: int | None, view: WorldView, now: datetime) -> bool:
        """A worker says its world lost a peer (a collective failed outside a handoff). It cannot say
        which one; whoever it was stops beating, so every member of that world unheard for
        ``suspect_timeout_s`` is lost now instead of after the full heartbeat timeout (and a device not
        heard from since a restart is awaited no longer than that). Whether it was acted on."""
        self._old_world_broke(worker_id, generation, view, now)
        member = self._membership.get(worker_id)
        h = view.handoff
        target = None if h is None else h.target
        within_s = self._config.suspect_timeout_s
        if h is not None and target and generation == h.generation and worker_id in h.switched:
            # The new world lost a peer right after its commit, before this coordinator recorded it.
            marked = self._membership.suspect(target, within_s)
            self._note("warning", "new_world_lost_a_peer", worker_id=worker_id, suspects=marked)
            self.probe(target, view, now, generation=h.generation)
            return True
        if view.live_generation is None or generation != view.live_generation:
            self._note("debug", "stale_peer_lost_ignored", worker_id=worker_id, generation=generation)
            return False
        joining = (
            h is not None and worker_id in h.participants and h.from_generation == generation
        )  # a joiner whose handoff broke on the loss
        if member is None or (member.device not in view.live and not joining):
            self._note("warning", "peer_lost_from_outsider_ignored", worker_id=worker_id)
            return False
        marked = self._membership.suspect(view.live, within_s)
        marked += self._membership.hurry(view.live, now, within_s)
        self._note(
            "warning",
            "world_lost_a_peer",
            worker_id=worker_id,
            generation=generation,
            suspects=marked,
            within_s=within_s,
        )
        devices = set(view.live)
        if h is not None and h.target is not None:
            devices |= h.target  # a handoff in flight: its joiners may be the ones gone
        self.probe(devices, view, now)
        return True

    def broken_heartbeat(self, beat: Heartbeat, view: WorldView, now: datetime) -> None:
        """A heartbeat says its world lost a peer: the worker's ``peer_lost`` ack may have gone out while
        this coordinator was down (worker traffic is not stored), so the first such word of a generation
        that is acted on counts as that ack, unless a loss in it is known already."""
        if self._broken_generation_heard == beat.generation or view.live_loss_known:
            self._old_world_broke(beat.worker_id, beat.generation, view, now)
            return
        if self.peer_lost(beat.worker_id, beat.generation, view, now):  # which tells _old_world_broke too
            self._broken_generation_heard = beat.generation

    def _old_world_broke(
        self, worker_id: str, generation: int | None, view: WorldView, now: datetime
    ) -> None:
        """A participant of the switch in flight says its world of ``generation`` lost a peer: when that
        is the handoff's old world, nothing committed (see :attr:`.handoff.Handoff.old_world_broke`)."""
        h = view.handoff
        if (
            h is None
            or h.old_world_broke
            or view.phase is not GenerationPhase.SWITCH
            or generation != h.from_generation
            or worker_id not in h.participants
            or lost_devices(h.triggers) & view.live  # a recovery: its old world was broken already
        ):
            return
        h.old_world_broke = True
        self._note("info", "old_world_broke_before_the_commit", worker_id=worker_id, generation=generation)
        # Whoever broke it may be one this coordinator has not heard since its restart: ask them all now
        # instead of waiting out the restart's window for the silent ones.
        self.probe(set(h.participants.values()) | set(view.live), view, now, generation=generation)

    # -- probes ----------------------------------------------------------------------------------------

    def probe(
        self, devices: Iterable[Device], view: WorldView, now: datetime, generation: int | None = None
    ) -> None:
        """Ask the workers on ``devices`` whether they are still there, unless a probe is in flight: the
        members there by name, the handoff's participants awaited since a restart by name too (the
        record names them), and the live world's devices awaited without a name by place."""
        if self._probing is not None:
            return
        wanted = set(devices)
        members = {m.worker_id for m in self._membership if m.device in wanted}
        named = self._awaited(view.handoff, now, wanted)
        workers = tuple(sorted(members | set(named)))
        nameless = tuple(
            sorted(
                d
                for d in wanted & set(view.live)  # not joiners: their absence breaks no world
                if self._membership.on_device(d) is None
                and self._membership.is_expected(d, now)
                and d not in named.values()
            )
        )
        if not workers and not nameless:
            return
        if generation is None:
            generation = view.record_generation
        give_up = now + timedelta(seconds=2 * self._config.probe_timeout_s + 1.0)
        self._probes += 1
        self._probing = (self._probes, give_up)
        self._emit(
            ProbeWorkers(
                probe=self._probes,
                generation=generation,
                worker_ids=workers,
                timeout_s=self._config.probe_timeout_s,
                devices=nameless,
            )
        )

    def give_up_probe(self, now: datetime) -> bool:
        """Stop waiting for a probe past its time (its late answer still counts); whether one was."""
        if self._probing is None or now < self._probing[1]:
            return False
        self._note("warning", "probe_unanswered", probe=self._probing[0])
        self._probing = None
        return True

    def probed(self, event: WorkersProbed, handoff: Handoff | None, now: datetime, lost: LostFn) -> None:
        """Drop the members a probe found gone and call ``lost`` for each, one after the other (an answer
        to a probe given up on still says who is gone)."""
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
        awaited = self._awaited(handoff, now)
        for worker_id in event.gone:
            member = self._membership.remove(worker_id)
            device = member.device if member is not None else awaited.get(worker_id)
            if device is None:
                continue  # already lost by its heartbeats
            self._membership.unexpect(device)
            lost(device, f"worker {worker_id} on {device} has no connection to the bus (its process is gone)")
        for device in event.gone_devices:
            if not self._membership.is_expected(device, now):
                continue  # its worker spoke up meanwhile, or it was lost already
            self._membership.unexpect(device)
            lost(device, f"no worker on {device} has a connection to the bus (its process is gone)")

    def _awaited(
        self, handoff: Handoff | None, now: datetime, devices: Collection[Device] | None = None
    ) -> dict[str, Device]:
        return {} if handoff is None else handoff.awaited_participants(self._membership, now, devices)
