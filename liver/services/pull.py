"""A continuous pull from a durable JetStream consumer: each message reaches its reader as it arrives.

Why not nats-py's ``PullSubscription.fetch(n)``: when a message arrives during its long poll, ``fetch``
keeps waiting for the other ``n - 1`` until its timeout, so a lone message (a worker's ack, a spot
warning) could sit there for most of the fetch timeout; ``fetch(1)`` avoids that but costs a request
round trip per message. Here one pull request for up to ``size`` messages stays outstanding on the
consumer's ``MSG.NEXT`` subject, and every message it brings is handed out at once, in stream order.

How the request is kept alive:

- The next request is sent only when the reader asks for a message and none is outstanding: when the
  last one was used up (``size`` delivered) or ended (status 404/408/409). So at most ``size`` messages
  are held by this process (in hand plus buffered), as with ``fetch(size)``; their ack-wait clocks run.
- Each request carries an expiry and an idle heartbeat. No sign from a request for two heartbeats means
  it is gone (a server restart, a reconnect); a new one is sent. Each request has its own reply
  subject, on which the server sends its statuses, so the end of a presumed-lost request that was only
  slow does not end the new one. Messages arrive with their stream subject, not the reply subject, so
  any that such a request still brings count against the current one (and are handed out like any
  other: they are real deliveries and must be settled).
- A 409 that is not a normal end (too many waiting requests, consumer deleted, ...) or a 400 means
  the request was refused: wait ``backoff_s`` before the next one instead of spinning on it.

The messages are the core client's ``Msg`` objects built with the connection, exactly what
``fetch`` returns: ``metadata``, ``ack``, ``nak``, ``term`` and ``in_progress`` work on them.

The inbox subscription keeps nats-py's default pending limits: requests bound what can arrive, and a
lower limit could only drop deliveries (they would come back after the ack wait, not sooner).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from typing import Final

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api

log = structlog.get_logger(__name__)

HEARTBEAT: Final = api.StatusCode.CONTROL_MESSAGE.value
NORMAL_ENDS: Final = frozenset({api.StatusCode.NO_MESSAGES.value, api.StatusCode.REQUEST_TIMEOUT.value})
NORMAL_409_ENDS: Final = frozenset(
    {"Message Size Exceeds MaxBytes", "Batch Completed", "Leadership Change", "Server Shutdown"}
)
"""409 descriptions with which the server ends a request it accepted: ask again at once."""

DRAIN_TIMEOUT_S: Final = 2.0
RECONNECT_POLL_S: Final = 0.05


class ContinuousPull:
    """One outstanding pull request on ``stream``/``durable``, its messages read with :meth:`next`."""

    def __init__(
        self,
        nc: Client,
        *,
        stream: str,
        durable: str,
        size: int,
        expires_s: float,
        heartbeat_s: float,
        backoff_s: float,
        api_prefix: str = "$JS.API",
    ) -> None:
        for name, value in (("expires_s", expires_s), ("heartbeat_s", heartbeat_s), ("backoff_s", backoff_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._nc = nc
        self._next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._size = size
        self._expires_s = expires_s
        # The server refuses a heartbeat above half the expiry ("heartbeat value too large").
        self._heartbeat_s = min(heartbeat_s, expires_s / 2)
        self._backoff_s = backoff_s
        self._ids = {"stream": stream, "consumer": durable}  # on every log line
        self._inbox: collections.deque[Msg] = collections.deque()
        self._arrived = asyncio.Event()
        self._sub: Subscription | None = None
        self._reply_prefix = ""
        self._current: str | None = None  # reply subject of the outstanding request
        self._owed = 0  # messages the outstanding request may still bring
        self._sign_at = 0.0  # last time the outstanding request showed it is alive
        self._not_before = 0.0  # no request before this (after a refusal)
        self.requests_sent = 0

    def waiting(self) -> list[Msg]:
        """Messages delivered and not yet handed out by :meth:`next` (their ack timers are running)."""
        return [m for m in self._inbox if m.reply]

    async def start(self) -> None:
        self._reply_prefix = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(f"{self._reply_prefix}.*", cb=self._arrive)

    async def _arrive(self, msg: Msg) -> None:
        if msg.reply or msg.subject == self._current:
            self._sign_at = time.monotonic()
        self._inbox.append(msg)
        self._arrived.set()

    async def next(self) -> Msg:
        """The next delivered message. Cancelling a wait loses nothing: it stays for :meth:`close`."""
        while True:
            while self._inbox:
                msg = self._inbox.popleft()
                status = None if msg.reply else JetStreamContext.is_status_msg(msg)
                if status is None:
                    if self._current is not None:
                        self._owed -= 1
                        if self._owed == 0:
                            self._current = None  # used up
                    return msg
                if msg.subject == self._current:
                    self._ended(status, msg)
            await self._request()
            self._arrived.clear()
            if self._inbox:  # arrived while the request was being sent
                continue
            timeout = self._heartbeat_s
            if self._current is None and self._not_before > time.monotonic():
                timeout = min(timeout, self._not_before - time.monotonic())
            elif self._current is None:  # not connected: ask as soon as the client is back
                timeout = min(timeout, RECONNECT_POLL_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout)
            if self._current is not None and time.monotonic() - self._sign_at > 2 * self._heartbeat_s:
                log.warning("pull_request_lost", owed=self._owed, **self._ids)
                self._current = None

    def _ended(self, status: str, msg: Msg) -> None:
        if status == HEARTBEAT:
            return
        self._current = None
        description = (msg.headers or {}).get(api.Header.DESCRIPTION, "")
        if status in NORMAL_ENDS or (
            status == api.StatusCode.CONFLICT.value and description in NORMAL_409_ENDS
        ):
            return
        log.warning(
            "pull_request_refused",
            status=status,
            description=description,
            retry_in_s=self._backoff_s,
            **self._ids,
        )
        self._not_before = time.monotonic() + self._backoff_s

    async def _request(self) -> None:
        now = time.monotonic()
        if self._current is not None or now < self._not_before or not self._nc.is_connected:
            return
        reply = f"{self._reply_prefix}.{self.requests_sent + 1}"
        request = {
            "batch": self._size,
            "expires": int(self._expires_s * 1e9),
            "idle_heartbeat": int(self._heartbeat_s * 1e9),
        }
        try:
            await self._nc.publish(self._next_subject, json.dumps(request).encode(), reply=reply)
        except nats.errors.Error as exc:
            log.warning("pull_request_failed", error=repr(exc), retry_in_s=self._backoff_s, **self._ids)
            self._not_before = now + self._backoff_s
            return
        self._current, self._owed, self._sign_at = reply, self._size, now
        self.requests_sent += 1

    async def close(self) -> list[Msg]:
        """Stop receiving; returns the messages delivered but never handed out (the caller settles them).

        Draining the subscription collects what the server sent before it saw the unsubscribe; what it
        sends later (nothing, once it sees no interest in the reply subject) would come back after the
        ack wait.
        """
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                if not self._nc.is_connected:
                    raise nats.errors.ConnectionReconnectingError
                await asyncio.wait_for(sub.drain(), DRAIN_TIMEOUT_S)
            except (TimeoutError, nats.errors.Error):
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        left = [m for m in self._inbox if m.reply]
        self._inbox.clear()
        self._current = None
        return left
