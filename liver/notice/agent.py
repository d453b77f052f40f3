"""The notice agent: poll a source, publish each new notice once, carry on through every failure.

A notice is published as a ``spot.warning`` whose event id comes from the notice (see
:meth:`~liver.notice.model.Notice.event_id`), so it is the same event however often it is read. The
agent remembers the ids it published and does not send them again; when it restarts it forgets them,
and a re-sent notice is stored once by JetStream (``Nats-Msg-Id``) within its window and recognised by
the ingester's record of events seen after that. A source that cannot be read, or a bus that cannot
take the event, is logged and retried at the next poll: the agent never exits on a failure, because
the notice it would miss is the one thing it exists for.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Protocol

import nats.errors
import structlog

from liver.notice.model import Notice, NoticeSourceError
from liver.notice.publish import checked
from liver.services.ingester.core import IngestEvent
from liver.shared.errors import BusError
from liver.shared.messages import GenerationCommitted

log = structlog.get_logger(__name__)


class NoticeSource(Protocol):
    provider: str
    long_poll: bool
    """``poll`` itself waits for a change (up to its own bound): the agent polls again at once."""

    def poll(self) -> Notice | None: ...


class PollOutcome(StrEnum):
    NONE = "none"  # nothing announced
    PUBLISHED = "published"
    SHOWN = "shown"  # a dry run: handed to ``publish``, which only shows it
    ALREADY_PUBLISHED = "already_published"
    SOURCE_FAILED = "source_failed"
    PUBLISH_FAILED = "publish_failed"


Publish = Callable[[IngestEvent], Awaitable[object]]


class NoticeAgent:
    """Turns ``source``'s notices about ``node`` into events for ``job_id``, handed to ``publish``."""

    def __init__(
        self, source: NoticeSource, *, job_id: str, node: str, publish: Publish, dry_run: bool = False
    ) -> None:
        self.source = source
        self.job_id = job_id
        self.node = node
        self.publish = publish
        self.dry_run = dry_run  # ``publish`` only shows the event (--dry-run): logged as notice.dry_run
        self.published: dict[str, Notice] = {}  # event id -> the notice it was made from
        self.acknowledged: set[str] = set()
        self.log = log.bind(job_id=job_id, node=node, provider=source.provider)

    def event_of(self, notice: Notice) -> IngestEvent:
        """The checked ``spot.warning`` for ``notice``; a
        :class:`~liver.shared.codec.MessageError` names a field the ingester would refuse."""
        return checked(notice.warning(self.job_id, self.node))

    async def poll_once(self) -> PollOutcome:
        try:
            notice = await asyncio.to_thread(self.source.poll)
        except NoticeSourceError as exc:
            self.log.warning("notice.source_failed", error=str(exc))
            return PollOutcome.SOURCE_FAILED
        if notice is None:
            return PollOutcome.NONE
        event = self.event_of(notice)
        if event.event_id in self.published:
            return PollOutcome.ALREADY_PUBLISHED
        try:
            await self.publish(event)
        except (BusError, TimeoutError, nats.errors.Error) as exc:
            self.log.warning("notice.publish_failed", event_id=event.event_id, error=str(exc))
            return PollOutcome.PUBLISH_FAILED
        self.published[event.event_id] = notice
        fields = {"event_id": event.event_id, "kind": notice.kind.value, "deadline": str(notice.deadline)}
        if self.dry_run:
            self.log.info("notice.dry_run", published=False, **fields)
            return PollOutcome.SHOWN
        self.log.info("notice.published", **fields)
        return PollOutcome.PUBLISHED

    async def on_committed(self, committed: GenerationCommitted) -> int:
        """Acknowledge this node's published notices to a source that takes acknowledgements, once a
        generation of the job without this node has committed; returns how many were acknowledged.

        Until then the job may still need the node (the handoff can abort and keep the old world), so a
        platform that would act at once on an acknowledgement must not get one.
        """
        acknowledge = getattr(self.source, "acknowledge", None)
        if acknowledge is None or committed.job_id != self.job_id:
            return 0
        if any(d.node == self.node for d in committed.placement.devices):
            return 0
        done = 0
        for event_id, notice in self.published.items():
            if event_id in self.acknowledged:
                continue
            try:
                await asyncio.to_thread(acknowledge, notice)
            except NoticeSourceError as exc:
                self.log.warning("notice.acknowledge_failed", event_id=event_id, error=str(exc))
                continue
            self.acknowledged.add(event_id)
            self.log.info("notice.acknowledged", event_id=event_id, generation=committed.generation)
            done += 1
        return done

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        """Poll every ``interval_s`` (a long-polling source: back to back, pausing only after a failure)
        until ``stop`` is set."""
        while not stop.is_set():
            outcome = await self.poll_once()
            failed = outcome in (PollOutcome.SOURCE_FAILED, PollOutcome.PUBLISH_FAILED)
            if self.source.long_poll and not failed:
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
