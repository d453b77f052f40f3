"""Which workers a job has, where they run, and whether they are still alive.

Built only from what workers say about themselves (``Hello`` when a process starts or reconnects,
``Heartbeat`` every few seconds), so a restarted coordinator rebuilds it within one heartbeat period.
A worker is lost when it has not been heard for ``timeout_s``, or when its heartbeat sequence starts
over (the process restarted: whatever it held in memory is gone, so to a handoff it is as lost as a
dead one). One device runs one worker: a new process saying hello on an occupied device replaces the
old one, which is reported lost.

After a coordinator restart the core knows devices it expects to hear from before anyone has spoken:
:meth:`Membership.expect` records them, and one that stays silent past the timeout is reported
missing, like a worker whose heartbeats stopped.

The live world's workers are also published for the ingester, which maps nodes to workers with them:
:class:`PublishedMembership` makes that value, and says when it changed.

Pure bookkeeping: ``now`` is always passed in.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Literal

import msgspec

from liver.shared.errors import InputError
from liver.shared.layout import Device
from liver.shared.messages import Heartbeat, Hello, JobMembership, WorkerDevice

if TYPE_CHECKING:
    from .record import GenerationRecord

ChangeKind = Literal["joined", "updated", "restarted", "replaced"]


class MembershipError(InputError):
    """Presence that contradicts what is known; ``field`` names the message field at fault."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"`{field}`: {reason}")


class HelloPending(MembershipError):
    """A heartbeat from a worker not yet known, on a device another worker holds.

    Hello and heartbeat travel on two subjects that the coordinator reads through two subscriptions,
    so a fresh worker's first beat can be handled before its hello even though the worker sent the
    hello first. The beat is dropped without changing anything: the hello that follows replaces the
    holder, and the next beat counts. It is also what a process that was replaced but still beats sends,
    so the beat alone may never take a device.
    """


class Member(msgspec.Struct, kw_only=True):
    """What the coordinator knows of one live worker."""

    worker_id: str
    device: Device
    address: str
    generation: int | None
    rank: int | None
    joined_at: datetime
    last_seen: datetime
    seq: int | None = None
    """Last heartbeat sequence number; ``None`` until the first heartbeat."""
    iteration: int | None = None
    memory_bytes: int | None = None
    suspect_s: float | None = None
    """A shorter timeout while the member's world is known to have lost a peer
    (:meth:`Membership.suspect`)."""

    def timeout(self, timeout_s: float) -> float:
        return timeout_s if self.suspect_s is None else min(timeout_s, self.suspect_s)

    def deadline(self, timeout_s: float) -> datetime:
        return self.last_seen + timedelta(seconds=self.timeout(timeout_s))


class Change(msgspec.Struct, frozen=True, kw_only=True):
    """What one presence message changed.

    ``previous`` is the worker that is gone because of it: the same worker id before its restart, or
    the worker that held the device before it was replaced.
    """

    kind: ChangeKind
    member: Member
    previous: Member | None = None


class Expired(msgspec.Struct, frozen=True, kw_only=True):
    """What :meth:`Membership.expire` found: workers that went silent, expected devices never heard."""

    lost: tuple[Member, ...] = ()
    missing: tuple[Device, ...] = ()


class Membership:
    """The live workers of one job, indexed by worker id and by device."""

    def __init__(self, job_id: str, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"`timeout_s`: must be positive, got {timeout_s}")
        self.job_id = job_id
        self.timeout_s = timeout_s
        self._by_worker: dict[str, Member] = {}
        self._by_device: dict[Device, Member] = {}
        self._expected: dict[Device, datetime] = {}
        self._version = 0
        # (deadline, worker id), one entry per hello or heartbeat; an entry whose worker has since been
        # seen again (or dropped) is stale and is discarded when it reaches the top. The core asks for
        # the next deadline after every message, so this keeps that question O(log n), not O(workers).
        self._deadlines: list[tuple[datetime, str]] = []

    @property
    def version(self) -> int:
        """Changes whenever a worker joins or leaves (not on a plain heartbeat): lets a caller skip
        recomputing what depends only on who runs where."""
        return self._version

    def __len__(self) -> int:
        return len(self._by_worker)

    def __iter__(self) -> Iterator[Member]:
        return iter(list(self._by_worker.values()))

    def get(self, worker_id: str) -> Member | None:
        return self._by_worker.get(worker_id)

    def on_device(self, device: Device) -> Member | None:
        return self._by_device.get(device)

    def on_nodes(self, nodes: Iterable[str]) -> list[Member]:
        """The workers on these nodes (what the ingester resolves a spot warning's node to)."""
        wanted = set(nodes)
        return sorted(
            (m for m in self._by_worker.values() if m.device.node in wanted), key=lambda m: m.device
        )

    def is_expected(self, device: Device, now: datetime) -> bool:
        """Whether ``device`` is awaited after a restart and may still speak up at ``now``."""
        deadline = self._expected.get(device)
        return deadline is not None and now <= deadline

    def expect(self, device: Device, since: datetime) -> None:
        """Await a worker on ``device`` for one timeout from ``since`` (no-op while it has a worker or
        is already awaited)."""
        if device in self._by_device or device in self._expected:
            return
        self._expected[device] = since + timedelta(seconds=self.timeout_s)

    def unexpect(self, device: Device) -> None:
        """Stop awaiting ``device`` (its worker was found gone by other means)."""
        self._expected.pop(device, None)

    def observe(self, presence: Hello | Heartbeat, now: datetime) -> Change:
        """Fold one hello or heartbeat in; raises :class:`MembershipError` for a contradiction."""
        if presence.job_id != self.job_id:
            raise MembershipError(
                "job_id", f"{presence.job_id!r} is not this coordinator's job {self.job_id!r}"
            )
        known = self._by_worker.get(presence.worker_id)
        holder = self._by_device.get(presence.device)
        if known is not None and known.device != presence.device:
            raise MembershipError(
                "device",
                f"worker {presence.worker_id!r} runs on {known.device}, not on {presence.device}",
            )
        if known is None and holder is not None:
            if isinstance(presence, Heartbeat):
                raise HelloPending(
                    "device",
                    f"{presence.device} belongs to worker {holder.worker_id!r}; "
                    f"{presence.worker_id!r} must say hello before it can take the device",
                )
            self._drop(holder)
            return Change(kind="replaced", member=self._join(presence, now), previous=holder)
        if known is None:
            return Change(kind="joined", member=self._join(presence, now))
        if isinstance(presence, Heartbeat) and known.seq is not None and presence.seq < known.seq:
            previous = msgspec.structs.replace(known)
            self._drop(known)
            return Change(kind="restarted", member=self._join(presence, now), previous=previous)
        self._update(known, presence, now)
        self._track(known)
        return Change(kind="updated", member=known)

    def remove(self, worker_id: str) -> Member | None:
        """Forget a worker (it was reported lost by other means); returns it if it was known."""
        member = self._by_worker.get(worker_id)
        if member is not None:
            self._drop(member)
        return member

    def suspect(self, devices: Iterable[Device], within_s: float) -> int:
        """Some member of ``devices`` is gone (a survivor said its world lost a peer), but not which: every
        member there unheard for ``within_s`` is lost, instead of after the full timeout. Live members
        keep beating and stay; the suspicion holds until :meth:`clear_suspicion`. How many it covers."""
        if within_s <= 0:
            raise ValueError(f"`within_s`: must be positive, got {within_s}")
        wanted = set(devices)
        marked = 0
        for member in self._by_worker.values():
            if member.device in wanted:
                member.suspect_s = within_s
                self._track(member)
                marked += 1
        return marked

    def hurry(self, devices: Iterable[Device], now: datetime, within_s: float) -> int:
        """Some member of ``devices`` is gone: those of them still awaited after a restart are missing
        ``within_s`` from ``now`` (or sooner, as their window says). How many it covers."""
        cut = now + timedelta(seconds=within_s)
        hurried = 0
        for device in set(devices) & self._expected.keys():
            self._expected[device] = min(self._expected[device], cut)
            hurried += 1
        return hurried

    def clear_suspicion(self) -> None:
        """The loss was acted on (a recovery began): every member has the full timeout again."""
        for member in self._by_worker.values():
            if member.suspect_s is not None:
                member.suspect_s = None
                self._track(member)

    def expire(self, now: datetime) -> Expired:
        """Drop and return the workers whose heartbeat deadline passed, and the expected devices that
        stayed silent."""
        lost = [m for m in self._by_worker.values() if now > m.deadline(self.timeout_s)]
        for member in lost:
            self._drop(member)
        missing = [d for d, deadline in self._expected.items() if now > deadline]
        for device in missing:
            del self._expected[device]
        return Expired(lost=tuple(lost), missing=tuple(sorted(missing)))

    def next_deadline(self) -> datetime | None:
        """The earliest moment :meth:`expire` could find something: when to tick next."""
        heap = self._deadlines
        while heap:
            when, worker_id = heap[0]
            member = self._by_worker.get(worker_id)
            if member is not None and member.deadline(self.timeout_s) == when:
                break
            heapq.heappop(heap)
        times = [heap[0][0]] if heap else []
        times.extend(self._expected.values())
        return min(times, default=None)

    def _track(self, member: Member) -> None:
        heapq.heappush(self._deadlines, (member.deadline(self.timeout_s), member.worker_id))

    def _join(self, presence: Hello | Heartbeat, now: datetime) -> Member:
        member = Member(
            worker_id=presence.worker_id,
            device=presence.device,
            address=presence.address,
            generation=presence.generation,
            rank=presence.rank,
            joined_at=now,
            last_seen=now,
        )
        self._update(member, presence, now)
        self._by_worker[member.worker_id] = member
        self._track(member)
        self._by_device[member.device] = member
        self._expected.pop(member.device, None)
        self._version += 1
        return member

    @staticmethod
    def _update(member: Member, presence: Hello | Heartbeat, now: datetime) -> None:
        member.address = presence.address
        member.generation = presence.generation
        member.rank = presence.rank
        member.last_seen = max(member.last_seen, now)
        if isinstance(presence, Heartbeat):
            member.seq = presence.seq
            if presence.iteration is not None:
                member.iteration = presence.iteration
        elif presence.memory_bytes is not None:
            member.memory_bytes = presence.memory_bytes

    def _drop(self, member: Member) -> None:
        self._version += 1
        self._by_worker.pop(member.worker_id, None)
        if self._by_device.get(member.device) is member:
            del self._by_device[member.device]


class PublishedMembership:
    """The live world's workers as last published (``WriteMembership``): a new value only when the
    record or the membership changed, and then only when the value differs."""

    def __init__(self, job_id: str) -> None:
        self._job_id = job_id
        self._published: JobMembership | None = None
        self._seen: tuple[int, int] | None = None
        """The record's revision and the membership's version the last value was made from."""

    def update(self, record: GenerationRecord, revision: int, membership: Membership) -> JobMembership | None:
        """The value to publish for the live world of ``record``, or None when it is unchanged."""
        key = (revision, membership.version)
        if key == self._seen:
            return None
        self._seen = key
        workers = []
        for device in record.placement.devices:
            member = membership.on_device(device)
            if member is not None:
                workers.append(WorkerDevice(worker_id=member.worker_id, device=device))
        in_world = set(record.placement.devices)
        standbys = sorted(
            (
                WorkerDevice(worker_id=m.worker_id, device=m.device)
                for m in membership
                if m.device not in in_world and m.generation is None
            ),
            key=lambda w: w.device,
        )
        current = JobMembership(
            job_id=self._job_id,
            generation=record.generation,
            workers=tuple(workers),
            standbys=tuple(standbys),
        )
        if current == self._published:
            return None
        self._published = current
        return current
