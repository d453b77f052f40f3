"""EC2 Spot interruption notices from the instance metadata service (IMDSv2).

The protocol, as AWS documents it:

- ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` returns a session token;
  every read carries it as ``X-aws-ec2-metadata-token``. A token that expired (or a service restarted
  under it) answers ``401``: the source takes a new token and reads again, once.
- ``GET /latest/meta-data/spot/instance-action`` answers ``404`` while no interruption is scheduled,
  and ``{"action": "terminate" | "stop" | "hibernate", "time": "2026-12-04T16:00:00Z"}`` (about two
  minutes ahead) once one is.
- ``GET /latest/meta-data/events/recommendations/rebalance`` answers ``404`` until EC2 sees the instance
  at elevated risk of interruption, then ``{"noticeTime": "2026-12-04T15:50:00Z"}``: the earlier,
  lower-priority signal, read only while no interruption is scheduled (a scheduled one supersedes it).

Anything else (the endpoint unreachable, a timeout, another status, a body that is not that JSON) is a
:class:`~liver.notice.model.NoticeSourceError` naming what was read: the agent logs it and polls again.
One request at a time (:mod:`liver.notice.http`), off the event loop (the agent runs it in a thread):
the metadata service answers on the instance itself, in milliseconds.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final, Literal

import msgspec

from liver.notice.http import Endpoint
from liver.notice.model import Notice, NoticeKind, NoticeSourceError

DEFAULT_ENDPOINT: Final = "http://169.254.169.254"
TOKEN_TTL_S: Final = 21600  # six hours, the most IMDSv2 grants
TOKEN_PATH: Final = "/latest/api/token"
ACTION_PATH: Final = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH: Final = "/latest/meta-data/events/recommendations/rebalance"


class _InstanceAction(msgspec.Struct, frozen=True):
    action: Literal["terminate", "stop", "hibernate"]
    time: datetime


class _Rebalance(msgspec.Struct, frozen=True, rename="camel"):
    notice_time: datetime


_ACTION = msgspec.json.Decoder(_InstanceAction)
_REBALANCE = msgspec.json.Decoder(_Rebalance)
_KINDS: Final = {"terminate": NoticeKind.TERMINATION, "stop": NoticeKind.STOP, "hibernate": NoticeKind.STOP}


class AwsSpotNotices:
    """Reads the instance's scheduled Spot interruption, if any (:meth:`poll`)."""

    provider = "aws"
    long_poll = False

    def __init__(
        self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 2.0, rebalance: bool = True
    ) -> None:
        self.endpoint = Endpoint(endpoint, timeout_s)
        self.rebalance = rebalance
        self._token: str | None = None

    def poll(self) -> Notice | None:
        """The interruption scheduled for this instance; else (with ``rebalance``) EC2's rebalance
        recommendation; None while there is neither."""
        body = self._read(ACTION_PATH)
        if body is not None:
            return self._interruption(body)
        if not self.rebalance:
            return None
        body = self._read(REBALANCE_PATH)
        return None if body is None else self._recommendation(body)

    def _read(self, path: str) -> bytes | None:
        """The body at ``path`` (None for 404: nothing announced), with a session token renewed once on
        401."""
        for attempt in range(2):
            if self._token is None:
                self._token = self._new_token()
            answer = self.endpoint.send(path, headers={"X-aws-ec2-metadata-token": self._token})
            if answer.status == 401 and attempt == 0:  # the token expired: one new token, one more read
                self._token = None
                continue
            break
        if answer.status == 404:
            return None
        if answer.status != 200:
            raise NoticeSourceError(f"{self.endpoint.where(path)}: HTTP {answer.status}")
        return answer.body

    def _interruption(self, body: bytes) -> Notice:
        where = self.endpoint.where(ACTION_PATH)
        try:
            action = _ACTION.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise NoticeSourceError(f"{where}: not an instance action: {exc}") from None
        if action.time.tzinfo is None:
            raise NoticeSourceError(f"{where}: `time` has no time zone: {action.time}")
        return Notice(
            provider=self.provider,
            kind=_KINDS[action.action],
            deadline=action.time,
            key=f"{action.action}-{action.time.strftime('%Y%m%dT%H%M%SZ')}",
        )

    def _recommendation(self, body: bytes) -> Notice:
        where = self.endpoint.where(REBALANCE_PATH)
        try:
            recommendation = _REBALANCE.decode(body)
        except msgspec.DecodeError as exc:
            raise NoticeSourceError(f"{where}: not a rebalance recommendation: {exc}") from None
        if recommendation.notice_time.tzinfo is None:
            raise NoticeSourceError(f"{where}: `noticeTime` has no time zone: {recommendation.notice_time}")
        return Notice(
            provider=self.provider,
            kind=NoticeKind.REBALANCE,
            deadline=None,
            key=f"rebalance-{recommendation.notice_time.strftime('%Y%m%dT%H%M%SZ')}",
        )

    def _new_token(self) -> str:
        answer = self.endpoint.send(
            TOKEN_PATH, method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)}
        )
        if answer.status != 200 or not answer.body.strip():
            raise NoticeSourceError(
                f"{self.endpoint.where(TOKEN_PATH)}: no session token (HTTP {answer.status})"
            )
        return answer.body.decode("ascii", errors="replace").strip()
