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
  seconds: a long poll, so a preemption is seen the moment it is announced.

The source long-polls ``preempted`` (up to ``wait_s``) and then reads ``maintenance-event``. A notice's
key is the ETag of the value that announced it: the same announcement read again, or by a restarted
agent, is the same event. Its deadline is the moment it was first seen plus the documented notice.
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
        self._etag: str | None = None
        self._first_seen: dict[str, datetime] = {}

    def poll(self) -> Notice | None:
        """The announcement in force, or None; waits up to ``wait_s`` for ``preempted`` to change."""
        query = {"wait_for_change": "true", "timeout_sec": str(max(1, int(self.wait_s)))}
        if self._etag is not None:
            query["last_etag"] = self._etag
        preempted = self._read(PREEMPTED_PATH, query, timeout_s=self.wait_s + self.endpoint.timeout_s)
        self._etag = preempted.headers.get("ETag") or preempted.headers.get("etag") or self._etag
        value = preempted.body.decode("ascii", errors="replace").strip().upper()
        if value == "TRUE":
            return self._notice(NoticeKind.TERMINATION, f"preempted-{self._etag}", PREEMPTION_NOTICE)
        if value != "FALSE":
            raise NoticeSourceError(
                f"{self.endpoint.where(PREEMPTED_PATH)}: not TRUE or FALSE: {value[:80]!r}"
            )
        maintenance = self._read(MAINTENANCE_PATH, {})
        event = maintenance.body.decode("ascii", errors="replace").strip().upper()
        if event == "TERMINATE_ON_HOST_MAINTENANCE":
            etag = maintenance.headers.get("ETag") or maintenance.headers.get("etag") or "unknown"
            return self._notice(NoticeKind.TERMINATION, f"maintenance-{etag}", TERMINATION_NOTICE)
        if event in ("NONE", "MIGRATE_ON_HOST_MAINTENANCE") or event.startswith("MIGRATE"):
            return None
        raise NoticeSourceError(f"{self.endpoint.where(MAINTENANCE_PATH)}: unknown event {event[:80]!r}")

    def _notice(self, kind: NoticeKind, key: str, notice: timedelta) -> Notice:
        seen = self._first_seen.setdefault(key, datetime.now(UTC))
        return Notice(provider=self.provider, kind=kind, deadline=seen + notice, key=key)

    def _read(self, path: str, query: dict[str, str], timeout_s: float | None = None) -> Response:
        answer = self.endpoint.send(
            path + (f"?{urlencode(query)}" if query else ""), headers=HEADERS, timeout_s=timeout_s
        )
        if answer.status != 200:
            raise NoticeSourceError(f"{self.endpoint.where(path)}: HTTP {answer.status}")
        return answer
