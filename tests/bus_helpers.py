"""Helpers for service tests against a real nats-server: collect what a service publishes, read streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import nats
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from liver.services.host import Hosted, Service, hosted
from liver.shared import subjects as s
from liver.shared.codec import decode, encode
from liver.shared.layout import Device
from liver.shared.messages import ErrorEvent, JobMembership, WorkerDevice

T = TypeVar("T")

WAIT_S = 60.0
"""Upper bound on any wait in these tests; a passing test waits milliseconds. Generous on purpose: the
suite must pass on a busy two-core machine, and a bound costs nothing when the condition comes true."""

CONNECT_TIMEOUT_S = 30.0
"""nats-py's default (2 s) for connecting, per attempt."""

REQUEST_TIMEOUT_S = 30.0
"""For the JetStream API calls a test makes itself (nats-py's default is 5 s)."""


class Collector:
    """Everything published on one subject (pattern) from now on, in arrival order."""

    def __init__(self) -> None:
        self.messages: list[Msg] = []
        self._arrived = asyncio.Event()
        self._sub: Subscription | None = None

    @classmethod
    async def on(cls, nc: Client, subject: str) -> Collector:
        collector = cls()

        async def cb(msg: Msg) -> None:
            collector.messages.append(msg)
            collector._arrived.set()

        collector._sub = await nc.subscribe(subject, cb=cb)
        await nc.flush(timeout=int(WAIT_S))  # the server has the subscription before anything is sent
        return collector

    @property
    def subscription(self) -> Subscription | None:
        return self._sub

    async def close(self) -> None:
        """Stop collecting (what arrived stays in ``messages``)."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def wait_for(self, count: int = 1, timeout_s: float = WAIT_S) -> list[Msg]:
        deadline = time.monotonic() + timeout_s
        while len(self.messages) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"expected {count} messages, got {len(self.messages)} in {timeout_s} s")
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
        return self.messages[:count]

    async def one(self, into: type[T], timeout_s: float = WAIT_S) -> T:
        (msg,) = await self.wait_for(1, timeout_s)
        return decode(msg.data, into)  # type: ignore[no-any-return]


async def drained(nc: Client, *collectors: Collector) -> None:
    """Return once everything the server routed to ``nc`` so far is in the collectors' ``messages``: a
    round trip (it is in their subscriptions' queues), then those queues emptied (a collector records a
    message as soon as its queue hands it over)."""
    await nc.flush(timeout=int(WAIT_S))

    async def emptied() -> bool:
        return all(c._sub is None or c._sub.pending_msgs == 0 for c in collectors)

    await eventually(emptied, what="the collectors' queues emptied")


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = WAIT_S, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def client(url: str) -> AsyncIterator[tuple[Client, JetStreamContext]]:
    nc = await nats.connect(url, connect_timeout=CONNECT_TIMEOUT_S)
    try:
        yield nc, nc.jetstream(timeout=REQUEST_TIMEOUT_S)
    finally:
        await nc.drain()


@contextlib.asynccontextmanager
async def running(service: Service, url: str, metrics_port: int | None = None) -> AsyncIterator[Hosted]:
    """The service hosted as in production, without the environment's credentials."""
    async with hosted(service, url, environ={}, metrics_port=metrics_port) as h:
        yield h


async def stored(js: JetStreamContext, stream: str, subject: str) -> list[RawStreamMsg]:
    """Every message of ``stream`` on ``subject`` (a literal subject), oldest first."""
    out: list[RawStreamMsg] = []
    seq = 0
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq + 1, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return out
        out.append(msg)
        assert msg.seq is not None
        seq = msg.seq


async def put_membership(
    js: JetStreamContext, job_id: str, devices: tuple[Device, ...], generation: int = 0
) -> JobMembership:
    membership = JobMembership(
        job_id=job_id,
        generation=generation,
        workers=tuple(WorkerDevice(worker_id=f"w{i}", device=d) for i, d in enumerate(devices)),
    )
    kv = await js.key_value(s.KV_MEMBERSHIP)
    await kv.put(job_id, encode(membership))
    return membership


def error_events(collector: Collector) -> list[ErrorEvent]:
    return [decode(m.data, ErrorEvent) for m in collector.messages]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample a local ``/metrics`` serves: (name, sorted labels) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
