"""EC2 Spot interruption notices from the instance metadata service (IMDSv2).

The protocol, as AWS documents it:

- ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` returns a session token;
  every read carries it as ``X-aws-ec2-metadata-token``. A token that expired (or a service restarted
  under it) answers ``401``: the source takes a new token and reads again, once.
- ``GET /latest/meta-data/spot/instance-action`` answers ``404`` while no interruption is scheduled,
  and ``{"action": "terminate" | "stop" | "hibernate", "time": "2026-12-04T16:00:00Z"}`` (about two
  minutes ahead) once one is.

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


class _InstanceAction(msgspec.Struct, frozen=True):
    action: Literal["terminate", "stop", "hibernate"]
    time: datetime


_ACTION = msgspec.json.Decoder(_InstanceAction)
_KINDS: Final = {"terminate": NoticeKind.TERMINATION, "stop": NoticeKind.STOP, "hibernate": NoticeKind.STOP}


class AwsSpotNotices:
    """Reads the instance's scheduled Spot interruption, if any (:meth:`poll`)."""

    provider = "aws"
    long_poll = False

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 2.0) -> None:
        self.endpoint = Endpoint(endpoint, timeout_s)
        self._token: str | None = None

    def poll(self) -> Notice | None:
        """The interruption scheduled for this instance, or None while there is none."""
        where = self.endpoint.where(ACTION_PATH)
        for attempt in range(2):
            if self._token is None:
                self._token = self._new_token()
            answer = self.endpoint.send(ACTION_PATH, headers={"X-aws-ec2-metadata-token": self._token})
            if answer.status == 401 and attempt == 0:  # the token expired: one new token, one more read
                self._token = None
                continue
            break
        if answer.status == 404:
            return None
        if answer.status != 200:
            raise NoticeSourceError(f"{where}: HTTP {answer.status}")
        try:
            action = _ACTION.decode(answer.body)
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

    def _new_token(self) -> str:
        answer = self.endpoint.send(
            TOKEN_PATH, method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)}
        )
        if answer.status != 200 or not answer.body.strip():
            raise NoticeSourceError(
                f"{self.endpoint.where(TOKEN_PATH)}: no session token (HTTP {answer.status})"
            )
        return answer.body.decode("ascii", errors="replace").strip()
