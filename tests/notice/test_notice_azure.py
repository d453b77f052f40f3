"""The Azure notice source, against a local server that speaks Scheduled Events, and its
acknowledgement once a generation without the node has committed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from bus_helpers import WAIT_S, client, eventually
from local_http import LocalHttp, QuietHandler, serving

from liver.cli.notice_cmd import _acknowledge_on_commit
from liver.notice.agent import NoticeAgent, PollOutcome
from liver.notice.azure import EVENTS_PATH, NAME_PATH, AzureScheduledEvents
from liver.notice.model import NoticeKind, NoticeSourceError
from liver.shared import subjects as s
from liver.shared.codec import encode
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.messages import GenerationCommitted, SpotWarning
from liver.shared.nats_server import NatsServer

VM = "vm-7"


def event(kind: str = "Preempt", resources: tuple[str, ...] = (VM,), not_before: str = "") -> dict[str, Any]:
    return {
        "EventId": f"{kind.lower()}-0001",
        "EventType": kind,
        "ResourceType": "VirtualMachine",
        "Resources": list(resources),
        "EventStatus": "Scheduled",
        "NotBefore": not_before,
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }


class FakeScheduledEvents:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.started: list[str] = []
        self.incarnation = 1
        self.raw: bytes | None = None  # served instead of the document when set
        fake = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                if self.headers.get("Metadata") != "true":
                    self.answer(400, b'{"error": "Bad request. Required metadata header not specified"}')
                elif self.path == EVENTS_PATH:
                    doc = {"DocumentIncarnation": fake.incarnation, "Events": fake.events}
                    self.answer(200, fake.raw if fake.raw is not None else json.dumps(doc).encode())
                elif self.path == NAME_PATH:
                    self.answer(200, VM.encode())
                else:
                    self.answer(404, b"")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.headers.get("Metadata") != "true" or self.path != EVENTS_PATH:
                    self.answer(400, b"")
                    return
                ids = [r["EventId"] for r in body.get("StartRequests", [])]
                if not ids or any(i not in {e["EventId"] for e in fake.events} for i in ids):
                    self.answer(400, b"")
                    return
                fake.started += ids
                self.answer(200, b"")

        self.http = LocalHttp(Handler)
        self.endpoint = self.http.endpoint


@pytest.fixture
def azure() -> Iterator[FakeScheduledEvents]:
    fake = FakeScheduledEvents()
    with serving(fake.http):
        yield fake


def test_no_scheduled_event_is_no_notice(azure: FakeScheduledEvents) -> None:
    assert AzureScheduledEvents(azure.endpoint).poll() is None


def test_a_spot_eviction_for_this_vm_is_a_notice_at_its_not_before(azure: FakeScheduledEvents) -> None:
    azure.events = [event(not_before="Fri, 04 Dec 2026 16:02:00 GMT")]
    notice = AzureScheduledEvents(azure.endpoint).poll()
    assert notice is not None
    assert (notice.provider, notice.kind, notice.key) == ("azure", NoticeKind.TERMINATION, "preempt-0001")
    assert notice.deadline == datetime(2026, 12, 4, 16, 2, tzinfo=UTC)


def test_events_for_other_vms_and_events_that_keep_the_vm_are_ignored(azure: FakeScheduledEvents) -> None:
    azure.events = [event(resources=("vm-other",)), event("Reboot"), event("Freeze")]
    assert AzureScheduledEvents(azure.endpoint).poll() is None
    azure.events.append(event("Terminate", not_before="Fri, 04 Dec 2026 16:10:00 GMT"))
    notice = AzureScheduledEvents(azure.endpoint).poll()
    assert notice is not None and notice.key == "terminate-0001"


def test_a_started_eviction_without_a_time_is_a_notice_of_the_shortest_warning(
    azure: FakeScheduledEvents,
) -> None:
    azure.events = [event()]
    notice = AzureScheduledEvents(azure.endpoint).poll()
    assert notice is not None and notice.deadline > datetime.now(UTC)


@pytest.mark.parametrize("body", [b"{}", b"not json", b'{"DocumentIncarnation": 1, "Events": [{}]}'])
def test_a_document_that_is_not_scheduled_events_is_a_source_error(
    azure: FakeScheduledEvents, body: bytes
) -> None:
    azure.raw = body
    with pytest.raises(NoticeSourceError, match="not a scheduled events document"):
        AzureScheduledEvents(azure.endpoint).poll()


def test_a_bad_not_before_is_a_source_error(azure: FakeScheduledEvents) -> None:
    azure.events = [event(not_before="soon")]
    with pytest.raises(NoticeSourceError, match="RFC 1123"):
        AzureScheduledEvents(azure.endpoint).poll()


def committed(nodes: tuple[str, ...], generation: int = 1) -> GenerationCommitted:
    return GenerationCommitted(
        job_id="job-az",
        event_id="preempt-0001",
        previous_generation=generation - 1,
        generation=generation,
        layout=ParallelLayout(tp=1, pp=1, dp=len(nodes)),
        placement=Placement(tuple(Device(n, 0) for n in nodes)),
        started_at_iteration=5,
        downtime_s=0.1,
        bytes_moved=1,
        committed_at=datetime.now(UTC),
    )


async def published_agent(azure: FakeScheduledEvents) -> NoticeAgent:
    azure.events = [event(not_before="Fri, 04 Dec 2026 16:02:00 GMT")]
    sent: list[SpotWarning] = []

    async def publish(e: Any) -> None:
        sent.append(e)

    agent = NoticeAgent(AzureScheduledEvents(azure.endpoint), job_id="job-az", node=VM, publish=publish)
    assert await agent.poll_once() == PollOutcome.PUBLISHED
    return agent


async def test_the_eviction_is_acknowledged_only_once_the_job_has_left_the_node(
    azure: FakeScheduledEvents,
) -> None:
    agent = await published_agent(azure)
    assert await agent.on_committed(committed((VM, "vm-8"))) == 0  # the job still uses this VM
    assert azure.started == []
    assert await agent.on_committed(committed(("vm-8",), generation=2)) == 1
    assert await agent.on_committed(committed(("vm-8",), generation=3)) == 0  # once
    assert azure.started == ["preempt-0001"]


async def test_a_commit_of_another_job_acknowledges_nothing(azure: FakeScheduledEvents) -> None:
    agent = await published_agent(azure)
    other = msgspec.structs.replace(committed(("vm-8",)), job_id="job-other")
    assert await agent.on_committed(other) == 0
    assert azure.started == []


@pytest.mark.slow
async def test_the_agent_acknowledges_when_the_commit_arrives_on_the_bus(
    azure: FakeScheduledEvents, nats_server: NatsServer
) -> None:
    agent = await published_agent(azure)
    async with client(nats_server.url) as (nc, _):
        await _acknowledge_on_commit(nc, agent)
        await nc.publish(s.GENERATION_COMMITTED, b"not json")  # ignored
        await nc.publish(s.GENERATION_COMMITTED, encode(committed(("vm-8",))))
        await nc.flush()

        async def acknowledged() -> bool:
            return azure.started == ["preempt-0001"]

        await eventually(acknowledged, timeout_s=WAIT_S, what="the eviction acknowledged")
