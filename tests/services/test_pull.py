"""The continuous pull under PullConsumer: each message handled as it arrives, nothing lost or doubled.

Each test has its own stream on the session's nats-server (the restart test has a server of its own).
A handler error that naks and gets the message back is specified in test_service_runtime.py.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import nats
import pytest
import structlog.testing
from bus_helpers import CONNECT_TIMEOUT_S, WAIT_S, client, eventually
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from liver.services import bus as b
from liver.services.host import PullConsumer, keep_in_progress
from liver.services.pull import ContinuousPull
from liver.shared.nats_server import NatsServer

# Every test here starts a process (a nats-server, workers or a CLI): none is in the fast tier.
pytestmark = pytest.mark.slow

_names = itertools.count()


class Recorder:
    """A handler that acknowledges each message and remembers its payload and delivery count."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.seen: list[tuple[bytes, int]] = []

    async def __call__(self, msg: Msg) -> None:
        self.seen.append((msg.data, msg.metadata.num_delivered))
        await msg.ack()

    @property
    def payloads(self) -> list[bytes]:
        return [data for data, _ in self.seen]


class Stream(NamedTuple):
    nc: Client
    js: JetStreamContext
    name: str
    subject: str


@pytest.fixture
async def stream(nats_server: NatsServer) -> AsyncIterator[Stream]:
    """A fresh stream of its own on the session's server."""
    n = next(_names)
    name, subject = f"PULL_{n}", f"test.pull.{n}"
    async with client(nats_server.url) as (nc, js):
        await js.add_stream(name=name, subjects=[subject])
        try:
            yield Stream(nc, js, name, subject)
        finally:
            await js.delete_stream(name)


def consumer(
    js: JetStreamContext, stream: str, handler: Recorder, *, batch: int, ack_wait_s: float = 30.0, **kw: float
) -> PullConsumer:
    config = b.pull_consumer_config("pulled", None, ack_wait_s=ack_wait_s, max_deliver=5, description="test")
    return PullConsumer(js, stream=stream, config=config, handler=handler, batch=batch, **kw)  # type: ignore[arg-type]


EXPIRES_S = 300.0
"""How long a pull request lives where a test tells waiting for a message from waiting for the request
to expire: far beyond any wait here (WAIT_S)."""


async def settled(js: JetStreamContext, stream: str, last: int) -> None:
    """Wait until the server has every message up to stream sequence ``last`` acknowledged and none out."""

    async def acked() -> bool:
        info = await js.consumer_info(stream, "pulled")
        return info.ack_floor.stream_seq >= last and info.num_ack_pending == 0 and info.num_pending == 0

    await eventually(acked, what=f"every message up to {last} acknowledged")


async def waiting_requests(js: JetStreamContext, stream: str, count: int = 1) -> None:
    async def waiting() -> bool:
        return (await js.consumer_info(stream, "pulled")).num_waiting >= count

    await eventually(waiting, what=f"{count} pull request(s) waiting on the server")


async def test_a_lone_message_is_handled_at_once_not_when_the_pull_request_expires(
    stream: Stream,
) -> None:
    _, js, name, subject = stream
    handler = Recorder()
    pulled = consumer(js, name, handler, batch=64, fetch_timeout_s=EXPIRES_S)
    await pulled.start()
    try:
        await waiting_requests(js, name)
        await js.publish(subject, b"alone")

        async def handled() -> bool:
            return handler.payloads == [b"alone"]

        await eventually(handled, what=f"the lone message is handled well before {EXPIRES_S:g} s")
    finally:
        await pulled.stop()


async def test_a_burst_larger_than_the_request_is_handled_completely_and_in_stream_order(
    stream: Stream,
) -> None:
    _, js, name, subject = stream
    handler = Recorder()
    pulled = consumer(js, name, handler, batch=8)
    await pulled.start()
    try:
        sent = [f"m{i}".encode() for i in range(100)]
        for data in sent:
            await js.publish(subject, data)

        async def all_handled() -> bool:
            return len(handler.seen) >= len(sent)

        await eventually(all_handled, what="the whole burst is handled")
        assert handler.payloads == sent
        assert pulled.handled == len(sent)
    finally:
        await pulled.stop()


async def test_stop_naks_prefetched_messages_and_another_instance_then_gets_them(
    stream: Stream,
) -> None:
    _, js, name, subject = stream
    release = asyncio.Event()

    class Blocking(Recorder):
        async def __call__(self, msg: Msg) -> None:
            await release.wait()
            await super().__call__(msg)

    first = Blocking()
    pulled = consumer(js, name, first, batch=10)  # the ack wait (30 s) cannot explain a redelivery
    await pulled.start()
    for i in range(5):
        await js.publish(subject, f"m{i}".encode())

    async def all_delivered() -> bool:
        return (await js.consumer_info(name, "pulled")).num_ack_pending == 5

    await eventually(all_delivered, what="all five delivered to the first instance")
    stopping = asyncio.create_task(pulled.stop())
    # Not a wait for time to pass: any yield lets stop() run up to its wait for the message in hand (its
    # flag is set by then), since that message's handler is blocked on ``release``.
    await asyncio.sleep(0.05)
    release.set()  # the message in hand is finished, the four prefetched ones are given back
    await stopping
    assert first.payloads == [b"m0"]

    second = Recorder()
    other = consumer(js, name, second, batch=10)
    await other.start()
    try:

        async def taken_over() -> bool:
            return len(second.seen) >= 4

        await eventually(taken_over, what="the prefetched messages reach the other instance")
        assert sorted(second.seen) == [(f"m{i}".encode(), 2) for i in range(1, 5)]
    finally:
        await other.stop()


async def test_stop_while_idle_returns_without_waiting_for_the_request_to_expire(
    stream: Stream,
) -> None:
    _, js, name, _ = stream
    pulled = consumer(js, name, Recorder(), batch=16, fetch_timeout_s=EXPIRES_S)
    await pulled.start()
    await waiting_requests(js, name)
    started = time.monotonic()
    await pulled.stop()
    assert time.monotonic() - started < WAIT_S  # far less than the request's EXPIRES_S


async def test_two_instances_on_one_durable_share_the_messages_without_duplicates(
    stream: Stream,
) -> None:
    _, js, name, subject = stream
    one, two = Recorder("one"), Recorder("two")
    instances = [consumer(js, name, one, batch=4), consumer(js, name, two, batch=4)]
    for instance in instances:
        await instance.start()
    try:
        await waiting_requests(js, name, count=2)
        sent = {f"m{i}".encode() for i in range(200)}
        for data in sorted(sent):
            last = (await js.publish(subject, data)).seq

        async def all_handled() -> bool:
            return len(one.seen) + len(two.seen) >= len(sent)

        await eventually(all_handled, what="every message handled by one of the instances")
        # Nothing left to deliver or redeliver: a duplicate would have been handled (and acked) by now.
        await settled(js, name, last)
        handled = one.payloads + two.payloads
        assert sorted(handled) == sorted(sent)
        assert one.seen and two.seen
    finally:
        for instance in instances:
            await instance.stop()


ACK_WAIT_S = 4.0


async def test_messages_from_the_pull_are_jetstream_messages_that_can_be_kept_in_progress_and_terminated(
    stream: Stream,
) -> None:
    _, js, name, subject = stream
    seen: list[tuple[str, str, int, int]] = []

    async def slow_then_term(msg: Msg) -> None:
        meta = msg.metadata
        seen.append((meta.stream, meta.consumer, meta.sequence.stream, meta.num_delivered))
        async with keep_in_progress(msg, every_s=0.2):
            await asyncio.sleep(ACK_WAIT_S + 1.0)  # past the ack wait: only the progress reports keep it ours
        await msg.term()

    # Reports every 0.2 s against an ack wait of ACK_WAIT_S: a busy machine may stall the loop for a
    # while without the message being taken back.
    config = b.pull_consumer_config("pulled", None, ack_wait_s=ACK_WAIT_S, max_deliver=5, description="test")
    pulled = PullConsumer(js, stream=name, config=config, handler=slow_then_term, batch=4)
    await pulled.start()
    try:
        seq = (await js.publish(subject, b"long")).seq

        async def settled() -> bool:
            info = await js.consumer_info(name, "pulled")
            return info.ack_floor.stream_seq == seq and info.num_ack_pending == 0

        await eventually(settled, what="the terminated message is settled")
        # Delivered once (the consumer's sequence counts redeliveries) and terminated: never again.
        assert (await js.consumer_info(name, "pulled")).delivered.consumer_seq == 1
        assert seen == [(name, "pulled", seq, 1)]
    finally:
        await pulled.stop()


async def test_a_refused_pull_request_is_asked_again_once_per_backoff_not_in_a_loop(
    stream: Stream,
) -> None:
    _, js, name, subject = stream
    config = b.pull_consumer_config("pulled", None, ack_wait_s=30, max_deliver=5, description="test")
    await js.add_consumer(name, config)
    pull = ContinuousPull(
        stream.nc, stream=name, durable="pulled", size=4, expires_s=30, heartbeat_s=1, backoff_s=0.25
    )
    await pull.start()
    reading = asyncio.create_task(pull.next())
    try:
        await waiting_requests(js, name)
        with structlog.testing.capture_logs() as logged:
            started = time.monotonic()
            await js.delete_consumer(name, "pulled")  # the waiting request ends with 409 Consumer Deleted
            await asyncio.sleep(1.0)  # the window in which the refusals are counted

            async def refused_twice() -> bool:  # a busy machine may have run the loop less often
                return len([e for e in logged if e["event"] == "pull_request_refused"]) >= 2

            await eventually(refused_twice, what="the request refused, then asked again")
            refusals = [e for e in logged if e["event"] == "pull_request_refused"]
            window = time.monotonic() - started
        assert refusals[0]["description"] == "Consumer Deleted"
        # Then no responders, once per 0.25 s, not once per round trip: at most 6 in a 1 s window.
        assert 2 <= len(refusals) <= 2 + window / 0.25
        await js.add_consumer(name, config)
        await js.publish(subject, b"again")
        assert (await asyncio.wait_for(reading, WAIT_S)).data == b"again"
    finally:
        reading.cancel()
        await pull.close()


async def _true(value: bool) -> bool:
    return value


def _stored_bytes(store: Path) -> bytes:
    """What the server's message files under ``store`` hold (JetStream writes payloads as they are)."""
    return b"".join(block.read_bytes() for block in store.rglob("*.blk"))


@pytest.mark.parametrize("crash", [False, True], ids=["graceful", "killed"])
async def test_a_server_restart_in_the_middle_of_consuming_loses_nothing(tmp_path: Path, crash: bool) -> None:
    """A graceful stop ends the waiting request (409 Server Shutdown); a killed server says nothing, and
    the request it held is replaced once its heartbeats stop."""
    store = tmp_path / "js"
    server = NatsServer(store_dir=store).start()
    port = server.url.rsplit(":", 1)[1]
    nc = await nats.connect(
        server.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1, connect_timeout=CONNECT_TIMEOUT_S
    )
    js = nc.jetstream()
    await js.add_stream(name="PULL_RESTART", subjects=["test.pull.restart"])

    class Slow(Recorder):
        async def __call__(self, msg: Msg) -> None:
            await asyncio.sleep(0.01)
            await super().__call__(msg)

    handler = Slow()
    # The restart comes while a request for 64 is only partly used: the new server knows nothing of it.
    pulled = consumer(js, "PULL_RESTART", handler, batch=64, ack_wait_s=2.0, heartbeat_s=0.2)
    await pulled.start()
    try:
        before = [f"before{i}".encode() for i in range(30)]
        for data in before:
            await js.publish("test.pull.restart", data)
        await eventually(lambda: _true(len(handler.seen) >= 10), what="ten messages handled")
        if crash:
            # The store writes behind the acknowledgement of a publish: wait until the message files
            # hold every message (written in order, so the last one), which a SIGKILL then cannot undo.
            await eventually(lambda: _true(before[-1] in _stored_bytes(store)), what="the messages on disk")
            assert server.pid is not None
            os.kill(server.pid, signal.SIGKILL)
        await asyncio.to_thread(server.stop)
        server = await asyncio.to_thread(NatsServer(store_dir=store, extra_args=("-p", port)).start)
        after = [f"after{i}".encode() for i in range(10)]
        for data in after:
            await js.publish("test.pull.restart", data)

        async def all_handled() -> bool:
            return set(before + after) <= set(handler.payloads)

        await eventually(all_handled, what="every message handled after the restart")
    finally:
        await pulled.stop()
        await nc.close()
        server.stop()
