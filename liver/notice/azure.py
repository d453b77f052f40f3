"""Azure Spot evictions and terminations from Scheduled Events, acknowledged once the job has moved.

The protocol, as Microsoft documents it (every request carries ``Metadata: true``; one without it is
refused with ``400``):

- ``GET /metadata/scheduledevents?api-version=2020-07-01`` answers
  ``{"DocumentIncarnation": n, "Events": [...]}``; an event has ``EventId``, ``EventType`` (``Preempt``
  for a Spot eviction, about 30 seconds ahead; ``Terminate`` for a deletion, as far ahead as the scale
  set's termination notification says; ``Freeze``, ``Reboot`` and ``Redeploy`` leave the VM the job's),
  ``Resources`` (the VM names it applies to), ``EventStatus`` (``Scheduled`` or ``Started``) and
  ``NotBefore`` (an RFC 1123 time, empty once started).
- ``POST`` to the same address with ``{"StartRequests": [{"EventId": ...}]}`` acknowledges an event:
  Azure may then go ahead at once instead of waiting for ``NotBefore``. The agent does that when a
  generation without this node has committed, so the node is released as soon as the job no longer
  needs it, and never before.
- ``GET /metadata/instance/compute/name?api-version=2021-02-01&format=text`` is this VM's name, which
  decides whether an event's ``Resources`` include it.

A notice's key is the ``EventId``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Final

import msgspec

from liver.notice.http import Endpoint
from liver.notice.model import Notice, NoticeKind, NoticeSourceError

DEFAULT_ENDPOINT: Final = "http://169.254.169.254"
EVENTS_PATH: Final = "/metadata/scheduledevents?api-version=2020-07-01"
NAME_PATH: Final = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
HEADERS: Final = {"Metadata": "true"}
ENDING: Final = {"Preempt": NoticeKind.TERMINATION, "Terminate": NoticeKind.TERMINATION}
PREEMPT_NOTICE: Final = timedelta(seconds=30)


class _Event(msgspec.Struct, frozen=True):
    EventId: str
    EventType: str
    Resources: list[str] = msgspec.field(default_factory=list)
    EventStatus: str = "Scheduled"
    NotBefore: str = ""


class _Document(msgspec.Struct, frozen=True):
    DocumentIncarnation: int
    Events: list[_Event]


_DOCUMENT = msgspec.json.Decoder(_Document)


class AzureScheduledEvents:
    """Reads the Preempt or Terminate event scheduled for this VM (:meth:`poll`), and acknowledges one
    (:meth:`acknowledge`)."""

    provider = "azure"
    long_poll = False

    def __init__(
        self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 2.0, vm_name: str | None = None
    ) -> None:
        self.endpoint = Endpoint(endpoint, timeout_s)
        self.vm_name = vm_name

    def poll(self) -> Notice | None:
        where = self.endpoint.where(EVENTS_PATH)
        answer = self.endpoint.send(EVENTS_PATH, headers=HEADERS)
        if answer.status != 200:
            raise NoticeSourceError(f"{where}: HTTP {answer.status}")
        try:
            document = _DOCUMENT.decode(answer.body)
        except msgspec.DecodeError as exc:
            raise NoticeSourceError(f"{where}: not a scheduled events document: {exc}") from None
        name = self._name()
        for event in document.Events:
            kind = ENDING.get(event.EventType)
            if kind is None or (event.Resources and name not in event.Resources):
                continue
            return Notice(
                provider=self.provider, kind=kind, deadline=self._deadline(event), key=event.EventId
            )
        return None

    def acknowledge(self, notice: Notice) -> None:
        """Tell Azure the event may start now (the job has moved off this VM)."""
        body = json.dumps({"StartRequests": [{"EventId": notice.key}]}).encode()
        answer = self.endpoint.send(
            EVENTS_PATH, method="POST", headers={**HEADERS, "Content-Type": "application/json"}, body=body
        )
        if answer.status != 200:
            where = self.endpoint.where(EVENTS_PATH)
            raise NoticeSourceError(f"{where}: acknowledging {notice.key}: HTTP {answer.status}")

    def _name(self) -> str:
        if self.vm_name is None:
            answer = self.endpoint.send(NAME_PATH, headers=HEADERS)
            if answer.status != 200 or not answer.body.strip():
                where = self.endpoint.where(NAME_PATH)
                raise NoticeSourceError(f"{where}: HTTP {answer.status}")
            self.vm_name = answer.body.decode("utf-8", errors="replace").strip()
        return self.vm_name

    def _deadline(self, event: _Event) -> datetime:
        if event.NotBefore.strip():
            try:
                return parsedate_to_datetime(event.NotBefore).astimezone(UTC)
            except (TypeError, ValueError):
                raise NoticeSourceError(
                    f"event {event.EventId}: NotBefore {event.NotBefore!r} is not an RFC 1123 time"
                ) from None
        # Started, or announced without a time: the shortest notice Azure gives.
        return datetime.now(UTC) + PREEMPT_NOTICE
