"""What a notice source reports, and the ``spot.warning`` it becomes."""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum

import msgspec

from liver.shared.errors import BusError
from liver.shared.messages import SpotWarning, WarningKind


class NoticeKind(StrEnum):
    """What the platform announced."""

    TERMINATION = "termination"  # the instance is reclaimed (EC2 terminate, GCE preemption, ...)
    STOP = "stop"  # stopped or hibernated: the node goes away all the same
    REBALANCE = "rebalance"  # at elevated risk of an interruption, none scheduled (EC2's recommendation)


class NoticeSourceError(BusError):
    """The platform's endpoint could not be read (unreachable, refused, or an answer that is not its
    documented format); the agent logs it and polls again."""


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class Notice(msgspec.Struct, frozen=True, kw_only=True):
    """One announcement about this node: the provider, what it announced, and when the node goes (None
    for a rebalance recommendation, which names no time).

    ``key`` identifies the announcement itself (provider, node, the time it names, the action): it does
    not change however often the announcement is read, so it makes the event id.
    """

    provider: str
    kind: NoticeKind
    deadline: datetime | None
    key: str

    def event_id(self, node: str) -> str:
        """A token-safe event id, the same for every read of this notice on ``node``."""
        return _UNSAFE.sub("-", f"{self.provider}-{node}-{self.key}").strip("-")[:128]

    def warning(self, job_id: str, node: str) -> SpotWarning:
        return SpotWarning(
            job_id=job_id,
            event_id=self.event_id(node),
            node=node,
            provider=self.provider,
            deadline=self.deadline,
            warning_kind=WarningKind.REBALANCE
            if self.kind is NoticeKind.REBALANCE
            else WarningKind.INTERRUPTION,
        )
