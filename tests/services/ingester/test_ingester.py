"""The ingester against a real nats-server: resize requests out, bad input named and kept, no duplicates.

Each test gets a server of its own (it starts in about 0.1 s), so streams, the durable consumer and the
buckets start empty and LiveR's real names can be used.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from bus_helpers import Collector, client, error_events, eventually, put_membership, running, stored
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from liver.services.ingester.service import Ingester, IngesterSettings
from liver.shared import subjects as s
from liver.shared.codec import decode, encode
from liver.shared.layout import Device
from liver.shared.messages import Message, NodeDevices, ResizeRequested, ScaleRequest, SpotWarning
from liver.shared.nats_server import NatsServer

# Every test here starts a process (a nats-server, workers or a CLI): none is in the fast tier.
pytestmark = pytest.mark.slow

JOB = "job-1"
DEVICES = (Device("node-a", 0), Device("node-a", 1), Device("node-b", 0), Device("node-b", 1))
FAST = IngesterSettings(ack_wait_s=30.0, retry_delay_s=0.1, max_deliver=3)
"""Retries come quickly (a nak with ``retry_delay_s``); the ack wait is long, so that a busy machine never
has a message taken back while it is prefetched or handled, which would count as a delivery."""
WARNING = SpotWarning(job_id=JOB, event_id="evt-1", node="node-b", provider="aws", notice_s=120.0)


@pytest.fixture
def server() -> Iterator[NatsServer]:
    with NatsServer() as srv:
        yield srv


@dataclass
class Rig:
    nc: Client
    js: JetStreamContext
    ingester: Ingester
    resized: Collector
    errors: Collector
    dead: Collector

    async def publish(self, subject: str, payload: bytes | Message, msg_id: str | None = None) -> int:
        data = payload if isinstance(payload, bytes) else encode(payload)
        headers = {s.HEADER_MSG_ID: msg_id} if msg_id else None
        ack = await self.js.publish(subject, data, headers=headers)
        return ack.seq

    async def stored_resizes(self) -> list[ResizeRequested]:
        raw = await stored(self.js, s.STREAM_CONTROL.name, s.resize_requested(JOB))
        return [decode(m.data or b"", ResizeRequested) for m in raw]

    async def settled(self) -> bool:
        info = await self.js.consumer_info(s.STREAM_INGEST.name, FAST.durable)
        return info.num_pending == 0 and info.num_ack_pending == 0


@dataclass
class Started:
    nc: Client
    js: JetStreamContext
    url: str


@pytest.fixture
async def connection(server: NatsServer) -> AsyncIterator[Started]:
    async with client(server.url) as (nc, js):
        yield Started(nc, js, server.url)


async def rig_for(conn: Started, ingester: Ingester) -> Rig:
    return Rig(
        nc=conn.nc,
        js=conn.js,
        ingester=ingester,
        resized=await Collector.on(conn.nc, s.RESIZE_REQUESTED_ANY),
        errors=await Collector.on(conn.nc, s.errors("ingester")),
        dead=await Collector.on(conn.nc, s.dead_letters("ingester")),
    )


@pytest.fixture
async def rig(connection: Started) -> AsyncIterator[Rig]:
    ingester = Ingester(FAST)
    async with running(ingester, connection.url):
        await put_membership(connection.js, JOB, DEVICES, generation=2)
        yield await rig_for(connection, ingester)


# -- what it emits ------------------------------------------------------------------------------------


async def test_a_spot_warning_becomes_one_resize_request_for_the_nodes_devices(rig: Rig) -> None:
    seq = await rig.publish(s.SPOT_WARNING, WARNING)
    resize = await rig.resized.one(ResizeRequested)
    assert rig.resized.messages[0].subject == s.resize_requested(JOB)
    assert resize.event_id == "evt-1"
    assert resize.generation == 2
    assert resize.remove == DEVICES[2:]
    assert resize.keep == DEVICES[:2]
    published = (await rig.js.get_msg(s.STREAM_INGEST.name, seq)).time
    assert resize.deadline is not None and published is not None
    assert abs((resize.deadline - published).total_seconds() - 120.0) < 1e-3
    await eventually(rig.settled, what="the warning is acknowledged")


async def test_a_scale_request_becomes_a_resize_request_that_adds_devices(rig: Rig) -> None:
    request = ScaleRequest(
        job_id=JOB,
        event_id="evt-2",
        reason="more capacity",
        add=(NodeDevices(node="node-c", devices=(0, 1)),),
    )
    await rig.publish(s.SCALE_REQUEST, request)
    resize = await rig.resized.one(ResizeRequested)
    assert resize.trigger == "scale_request"
    assert resize.add == (Device("node-c", 0), Device("node-c", 1))
    assert resize.keep == DEVICES


# -- bad input ----------------------------------------------------------------------------------------


def spot(**changes: Any) -> bytes:
    body = json.loads(encode(WARNING))
    for key, value in changes.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    return json.dumps(body).encode()


BAD_INPUT = [
    pytest.param(s.SPOT_WARNING, b'{"job_id": "job-1", "event_id":', "$", id="malformed-json"),
    pytest.param(s.SPOT_WARNING, b"\xff\xfe not even utf-8", "$", id="binary"),
    pytest.param(s.SPOT_WARNING, spot(notice_s="soon"), "$.notice_s", id="wrong-type"),
    pytest.param(s.SPOT_WARNING, spot(node=None), "$.node", id="missing-field"),
    pytest.param(s.SPOT_WARNING, spot(colour="red"), "$.colour", id="unknown-field"),
    pytest.param(s.SPOT_WARNING, spot(job_id="job.1"), "$.job_id", id="unsafe-job-id"),
    pytest.param(s.SPOT_WARNING, spot(schema_version=99), "$.schema_version", id="newer-schema"),
    pytest.param(s.SPOT_WARNING, spot(notice_s=None), "$.notice_s", id="no-notice-nor-deadline"),
    pytest.param(s.SPOT_WARNING, spot(job_id="job-9"), "$.job_id", id="unknown-job"),
    pytest.param(s.SPOT_WARNING, spot(node="node-z"), "$.node", id="unknown-node"),
    pytest.param(
        s.SCALE_REQUEST,
        encode(ScaleRequest(job_id=JOB, event_id="evt-3", reason="drain", remove=("node-a", "node-z"))),
        "$.remove[1]",
        id="unknown-node-to-remove",
    ),
    pytest.param(s.SCALE_REQUEST, encode(WARNING), "$.kind", id="warning-on-the-request-subject"),
    # What an outside fuzz test found (issue 16, findings 6-9): each was retried, dead-lettered with no
    # error, acted on, or crashed the handler.
    pytest.param(
        s.SPOT_WARNING,
        b'{"schema_version": 2, "job_id": ' + b"[" * 1000 + b"]" * 1000 + b"}",
        "$",
        id="deep-json",
    ),
    pytest.param(s.SPOT_WARNING, spot(job_id="job-1\n"), "$.job_id", id="job-id-with-a-newline"),
    pytest.param(s.SPOT_WARNING, spot(event_id="nl-5\n"), "$.event_id", id="event-id-with-a-newline"),
    pytest.param(s.SPOT_WARNING, spot(notice_s=1e12), "$.notice_s", id="notice-of-30000-years"),
    pytest.param(s.SPOT_WARNING, spot(notice_s=1.79e308), "$.notice_s", id="notice-near-the-float-limit"),
    pytest.param(
        s.SCALE_REQUEST,
        json.dumps(
            {
                "schema_version": 2,
                "job_id": JOB,
                "event_id": "evt-4",
                "reason": "r",
                "add": [{"node": "node-c", "devices": [2**64]}],
            }
        ).encode(),
        "$.add[0].devices[0]",
        id="device-index-2^64",
    ),
    pytest.param(
        s.SCALE_REQUEST,
        json.dumps(
            {
                "schema_version": 2,
                "job_id": JOB,
                "event_id": "evt-5",
                "reason": "r",
                "target_devices": 2**63 - 1,
            }
        ).encode(),
        "$.target_devices",
        id="target-of-2^63-devices",
    ),
]


@pytest.mark.parametrize(("subject", "payload", "field"), BAD_INPUT)
async def test_bad_input_is_named_by_field_kept_as_a_dead_letter_and_terminated(
    rig: Rig, subject: str, payload: bytes, field: str
) -> None:
    seq = await rig.publish(subject, payload, msg_id="publisher-id-1")
    (error,) = error_events(await _wait(rig.errors))
    assert error.field == field
    assert error.source == "ingester"
    assert error.subject == subject
    assert error.stream_sequence == seq
    assert error.payload_size == len(payload)
    (dead,) = await rig.dead.wait_for(1)
    assert dead.data == payload
    assert dead.headers is not None
    assert dead.headers[s.HEADER_ORIGINAL_SUBJECT] == subject
    assert dead.headers[s.HEADER_ORIGINAL_STREAM] == s.STREAM_INGEST.name
    assert dead.headers[s.HEADER_ORIGINAL_SEQUENCE] == str(seq)
    assert dead.headers[s.HEADER_ERROR].startswith(field)
    assert dead.headers["Liver-Original-Msg-Id"] == "publisher-id-1"
    await eventually(rig.settled, what="the message is terminated, not left for redelivery")
    # Terminated only after the dead letter was stored (the copy above was seen in flight).
    assert len(await stored(rig.js, s.STREAM_DEAD_LETTERS.name, s.dead_letters("ingester"))) == 1
    assert rig.resized.messages == []
    assert rig.ingester.stats()["rejected"] == 1


async def test_a_warning_just_under_max_payload_is_dead_lettered_cut_and_the_ingester_keeps_serving(
    rig: Rig,
) -> None:
    # Finding 5: the dead-letter copy (the payload plus its headers) went over max_payload, the server
    # closed the ingester's connection and the ingester stayed up but deaf.
    limit = rig.nc.max_payload
    payload = spot(node="n" * (limit - len(spot()) - 64))
    assert limit - 200 < len(payload) <= limit
    await rig.publish(s.SPOT_WARNING, payload)
    (error,) = error_events(await _wait(rig.errors))
    assert (error.field, error.payload_size, error.payload_truncated) == ("$.node", len(payload), True)
    (dead,) = await rig.dead.wait_for(1)
    assert dead.headers is not None
    assert dead.headers["Liver-Payload-Truncated"] == "true"
    assert dead.headers["Liver-Payload-Size"] == str(len(payload))
    assert dead.headers["Liver-Payload-Digest"] == "SHA-256=" + hashlib.sha256(payload).hexdigest()
    assert payload.startswith(dead.data) and len(dead.data) < len(payload)
    await rig.publish(s.SPOT_WARNING, WARNING)
    assert (await rig.resized.one(ResizeRequested)).event_id == "evt-1"


async def _wait(collector: Collector) -> Collector:
    await collector.wait_for(1)
    return collector


async def test_the_ingester_keeps_serving_after_bad_input(rig: Rig) -> None:
    await rig.publish(s.SPOT_WARNING, b"garbage")
    await rig.publish(s.SPOT_WARNING, WARNING)
    resize = await rig.resized.one(ResizeRequested)
    assert resize.event_id == "evt-1"
    assert len(rig.errors.messages) == 1


# -- duplicates and redelivery ------------------------------------------------------------------------


async def test_a_republished_event_yields_no_second_resize(rig: Rig) -> None:
    # Different publisher ids (or a re-send after JetStream's dedup window): both reach the ingester.
    await rig.publish(s.SPOT_WARNING, WARNING, msg_id="first")
    await rig.publish(s.SPOT_WARNING, spot(provider="aws"), msg_id="second")
    await eventually(lambda: _counted(rig, "duplicates", 1), what="the second copy is seen as a duplicate")
    await eventually(rig.settled)
    assert len(await rig.stored_resizes()) == 1
    assert len(rig.resized.messages) == 1
    assert rig.errors.messages == []


async def _counted(rig: Rig, what: str, n: int) -> bool:
    return rig.ingester.stats()[what] == n


async def test_an_event_id_reused_for_a_different_event_is_rejected_at_the_event_id(rig: Rig) -> None:
    await rig.publish(s.SPOT_WARNING, WARNING)
    await rig.resized.wait_for(1)
    await rig.publish(s.SPOT_WARNING, spot(node="node-a"))
    (error,) = error_events(await _wait(rig.errors))
    assert error.field == "$.event_id"
    assert "already used by a different event" in error.message
    assert len(await rig.stored_resizes()) == 1


class LosesFirstAck(Ingester):
    """Acknowledges nothing on a message's first delivery, as if the ack were lost on the way."""

    async def handle(self, msg: Msg) -> None:
        if msg.metadata.num_delivered == 1:

            async def lost() -> None:
                return None

            msg.ack = lost  # type: ignore[method-assign]
        await super().handle(msg)


async def test_a_redelivered_event_whose_ack_was_lost_yields_no_second_resize(connection: Started) -> None:
    # Redelivered once the ack wait passes: short enough to wait out, long enough for a busy machine
    # to handle (and ack) the second delivery within it.
    ingester = LosesFirstAck(msgspec.structs.replace(FAST, ack_wait_s=3.0))
    async with running(ingester, connection.url):
        await put_membership(connection.js, JOB, DEVICES)
        rig = await rig_for(connection, ingester)
        await rig.publish(s.SPOT_WARNING, WARNING)
        await eventually(lambda: _counted(rig, "duplicates", 1), what="the redelivery is dropped")
        await eventually(rig.settled)
        assert ingester.stats()["received"] == 2
        assert ingester.stats()["resized"] == 1
        assert len(await rig.stored_resizes()) == 1


class CrashesBeforeRecording(Ingester):
    """Fails right after publishing the resize request, before recording the event as seen."""

    crashed = False

    async def start(self, bus: Any) -> None:
        await super().start(bus)
        assert self._seen is not None
        create = self._seen.create

        async def crash_once(key: str, value: bytes) -> int:
            if not self.crashed:
                self.crashed = True
                raise ConnectionError("simulated crash after the publish")
            return await create(key, value)

        self._seen.create = crash_once  # type: ignore[method-assign]


async def test_a_retry_after_a_crash_between_publish_and_record_stores_one_resize(
    connection: Started,
) -> None:
    ingester = CrashesBeforeRecording(FAST)
    async with running(ingester, connection.url):
        await put_membership(connection.js, JOB, DEVICES)
        rig = await rig_for(connection, ingester)
        await rig.publish(s.SPOT_WARNING, WARNING)
        await eventually(lambda: _counted(rig, "resized", 1), what="the retry completes")
        await eventually(rig.settled)
        assert ingester.crashed
        assert ingester.stats()["failed_attempts"] == 1
        # Published twice with the same Nats-Msg-Id: JetStream kept one.
        assert len(rig.resized.messages) == 2
        assert len(await rig.stored_resizes()) == 1


async def test_an_event_that_keeps_failing_goes_to_the_dead_letters_after_max_deliver(rig: Rig) -> None:
    kv = await rig.js.key_value(s.KV_MEMBERSHIP)
    await kv.put(JOB, b'{"not": "a membership"}')  # the coordinator's record is unreadable
    seq = await rig.publish(s.SPOT_WARNING, WARNING)
    (dead,) = await rig.dead.wait_for(1)
    assert dead.data == encode(WARNING)
    assert dead.headers is not None
    assert dead.headers[s.HEADER_ORIGINAL_SEQUENCE] == str(seq)
    assert dead.headers[s.HEADER_ERROR].startswith(f"gave up after {FAST.max_deliver} deliveries")
    assert "MembershipUnreadable" in dead.headers[s.HEADER_ERROR]
    await eventually(lambda: _counted(rig, "dead_lettered", 1))
    assert rig.ingester.stats()["failed_attempts"] == FAST.max_deliver
    assert rig.resized.messages == []


async def test_events_published_while_the_ingester_is_down_are_handled_when_it_returns(
    connection: Started,
) -> None:
    async with running(Ingester(FAST), connection.url):
        await put_membership(connection.js, JOB, DEVICES)
    resized = await Collector.on(connection.nc, s.RESIZE_REQUESTED_ANY)
    await connection.js.publish(s.SPOT_WARNING, encode(WARNING))
    assert resized.messages == []
    async with running(Ingester(FAST), connection.url):
        resize = await resized.one(ResizeRequested)
    assert resize.event_id == WARNING.event_id
