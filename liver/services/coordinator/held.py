"""The parts of the coordinator's adapter that hold no connection: the book of resize requests taken but
not yet settled, and what the adapter adds to the core's requests.

**Held events.** A resize request is acknowledged on its stream only when a :class:`Settle` names it,
that is once the record says how its handoff ended; until then the stream message is held, and
JetStream is told every few seconds that it is still in progress. If the coordinator dies, every held
request is redelivered to its successor, which finds the handoff in the record (the core treats the
copy as a duplicate and settles it with its handoff) or never heard of it (and plans it). Settled ids
are remembered, so a copy that arrives after its settlement (the successor settled a restored handoff
before the stream redelivered its trigger) is acknowledged at once.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterable

import nats.errors
import structlog
from msgspec.structs import replace
from nats.aio.msg import Msg

from liver.shared.messages import TopologyRequest

from .actions import SettleOutcome
from .membership import Membership

log = structlog.get_logger(__name__)


class HeldEvents:
    """Stream messages of resize requests the core has yet to settle, by event id."""

    def __init__(self, remember: int) -> None:
        if remember < 1:
            raise ValueError(f"`remember`: must be positive, got {remember}")
        self._held: dict[str, Msg] = {}
        self._settled: OrderedDict[str, str] = OrderedDict()
        self._remember = remember

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._held

    def settled_as(self, event_id: str) -> SettleOutcome | None:
        """How the event was settled, if it was (within the last ``remember`` settlements)."""
        return self._settled.get(event_id)

    def hold(self, event_id: str, msg: Msg) -> None:
        """Keep ``msg`` until its event is settled; a redelivery replaces the earlier delivery, whose
        acknowledgement the server no longer expects."""
        self._held[event_id] = msg

    async def settle(self, event_ids: Iterable[str], outcome: SettleOutcome) -> list[str]:
        """Acknowledge the held messages of ``event_ids`` and remember them; returns the ids acked."""
        acked = []
        for event_id in event_ids:
            self._settled[event_id] = outcome
            self._settled.move_to_end(event_id)
            msg = self._held.pop(event_id, None)
            if msg is not None:
                await _ack(msg)
                acked.append(event_id)
        while len(self._settled) > self._remember:
            self._settled.popitem(last=False)
        return acked

    async def keep_alive(self) -> None:
        """Tell JetStream every held message is still being worked on (resets its ack timer)."""
        for msg in list(self._held.values()):
            with contextlib.suppress(nats.errors.Error):
                await msg.in_progress()

    async def give_back(self) -> int:
        """Hand every held message back for redelivery now (this coordinator stops serving the job)."""
        held, self._held = list(self._held.values()), {}
        for msg in held:
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()
        return len(held)


async def _ack(msg: Msg) -> None:
    try:
        await msg.ack()
    except nats.errors.Error as exc:
        # The event is remembered as settled: when the stream redelivers it, it is acked then.
        log.warning("settle_ack_failed", error=repr(exc))


def with_device_memory(request: TopologyRequest, membership: Membership) -> TopologyRequest:
    """``request`` with the smallest device memory the workers on its usable devices reported in their
    hello (the planner's memory model must fit the smallest device), when any reported one."""
    gone = set(request.remove) | set(request.lost)
    devices = [d for d in request.placement.devices if d not in gone] + list(request.add)
    reported = []
    for device in devices:
        member = membership.on_device(device)
        if member is not None and member.memory_bytes:
            reported.append(member.memory_bytes)
    if not reported:
        return request
    return replace(request, device_memory_bytes=min(reported))
