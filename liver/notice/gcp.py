"""Compute Engine preemption and host-maintenance notices from the metadata server.

The protocol, as Google documents it (every request carries ``Metadata-Flavor: Google``; the server
refuses one without it with ``403``):

- ``GET /computeMetadata/v1/instance/preempted`` is ``FALSE`` until the VM (Spot or preemptible) is
  being preempted, then ``TRUE``; the VM stops about 30 seconds later.
- ``GET /computeMetadata/v1/instance/maintenance-event`` is ``NONE``, ``MIGRATE_ON_HOST_MAINTENANCE``
  (a live migration: the node stays) or ``TERMINATE_ON_HOST_MAINTENANCE`` (the VM stops about 60
  seconds later).
- Each answer carries an ``ETag`` for its value; ``?wait_for_change=true&last_etag=E&timeout_sec=T``
  answers at once when the value's ETag is no longer ``E``, else when it changes or after ``T``
  seconds: a long poll, so a preemption is seen the moment it is announced. Without ``last_etag`` it
  waits for the value to change from what it is now, even when that is already ``TRUE``.

The source first reads ``preempted`` plainly (answered at once: an agent started after the announcement
sees it without waiting), then long-polls it (up to ``wait_s``) with the ETag of the value it last read;
while ``preempted`` is ``FALSE`` it reads ``maintenance-event`` too. A notice's deadline is the moment
the source first saw the announcement plus the documented notice.

A notice's key is that deadline (to the microsecond): it stays the same however often the source reads
the same announcement, and a later one (the flag cleared and set again, or a new VM under the same name
preempted in turn) gets a new key. The ETag cannot be the key: it is the value's, so every ``TRUE`` may
have the same one, and a second preemption of a reused node name would be dropped by the ingester as
the first one again. An agent restarted during a notice sees it for the first time once more: a new
event, with a deadline from that sighting (later than the first agent's).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Final
from urllib.parse import urlencode

from liver.notice.http import Endpoint, Response
from liver.notice.model import Notice, NoticeKind, NoticeSourceError

DEFAULT_ENDPOINT: Final = "http://metadata.google.internal"
PREEMPTED_PATH: Final = "/computeMetadata/v1/instance/preempted"
MAINTENANCE_PATH: Final = "/computeMetadata/v1/instance/maintenance-event"
HEADERS: Final = {"Metadata-Flavor": "Google"}
PREEMPTION_NOTICE: Final = timedelta(seconds=30)
TERMINATION_NOTICE: Final = timedelta(seconds=60)


class GcpNotices:
    """Reads whether this VM is being preempted or terminated for host maintenance (:meth:`poll`)."""

    provider = "gcp"
    long_poll = True

    def __init__(
        self, endpoint: str = DEFAULT_ENDPOINT, *, wait_s: float = 10.0, timeout_s: float = 2.0
    ) -> None:
        self.endpoint = Endpoint(endpoint, timeout_s)
        self.wait_s = wait_s
        self._read_once = False
        self._etag: str | None = None
        self._preemption: Notice | None = None  # the announcement in force, as first seen
        self._maintenance: Notice | None = None

    def poll(self) -> Notice | None:
        """The announcement in force, or None; after the first read, waits up to ``wait_s`` for
        ``preempted`` to change."""
        if self._read_once:
            query = {"wait_for_change": "true", "timeout_sec": str(max(1, int(self.wait_s)))}
            if self._etag is not None:  # without one the server waits for a change: still no busy loop
                query["last_etag"] = self._etag
            preempted = self._read(PREEMPTED_PATH, query, timeout_s=self.wait_s + self.endpoint.timeout_s)
        else:
            preempted = self._read(PREEMPTED_PATH, {})  # answered at once: a notice already in force
            self._read_once = True
        self._etag = _etag(preempted) or self._etag
        value = preempted.body.decode("ascii", errors="replace").strip().upper()
        if value == "TRUE":
            if self._preemption is None:
                self._preemption = self._notice("preempted", PREEMPTION_NOTICE)
            return self._preemption
        if value != "FALSE":
            raise NoticeSourceError(
                f"{self.endpoint.where(PREEMPTED_PATH)}: not TRUE or FALSE: {value[:80]!r}"
            )
        self._preemption = None
        maintenance = self._read(MAINTENANCE_PATH, {})
        event = maintenance.body.decode("ascii", errors="replace").strip().upper()
        if event == "TERMINATE_ON_HOST_MAINTENANCE":
            if self._maintenance is None:
                self._maintenance = self._notice("maintenance", TERMINATION_NOTICE)
            return self._maintenance
        if event in ("NONE", "MIGRATE_ON_HOST_MAINTENANCE") or event.startswith("MIGRATE"):
            self._maintenance = None
            return None
        raise NoticeSourceError(f"{self.endpoint.where(MAINTENANCE_PATH)}: unknown event {event[:80]!r}")

    def _notice(self, what: str, notice: timedelta) -> Notice:
        """A termination first seen now: its deadline, and a key made from it."""
        deadline = datetime.now(UTC) + notice
        key = f"{what}-{deadline.strftime('%Y%m%dT%H%M%S%fZ')}"
        return Notice(provider=self.provider, kind=NoticeKind.TERMINATION, deadline=deadline, key=key)

    def _read(self, path: str, query: dict[str, str], timeout_s: float | None = None) -> Response:
        answer = self.endpoint.send(
            path + (f"?{urlencode(query)}" if query else ""), headers=HEADERS, timeout_s=timeout_s
        )
        if answer.status != 200:
            raise NoticeSourceError(f"{self.endpoint.where(path)}: HTTP {answer.status}")
        return answer


def _etag(answer: Response) -> str | None:
    return next((v for k, v in answer.headers.items() if k.lower() == "etag" and v), None)
