"""One HTTP exchange with a platform's metadata endpoint, for every notice source.

Plain ``urllib`` with a timeout and without proxies (metadata services are link-local, and a proxy from
the environment would send the request elsewhere). A status the protocol gives meaning to (404 while
nothing is scheduled, 401 for an expired token) is returned, not raised; an endpoint that cannot be
reached at all is a :class:`~liver.notice.model.NoticeSourceError` naming it.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping

from liver.notice.model import NoticeSourceError


class Response:
    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class Endpoint:
    """``base`` (``http://169.254.169.254``) and the timeout of one request."""

    def __init__(self, base: str, timeout_s: float) -> None:
        self.base = base.rstrip("/")
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def where(self, path: str) -> str:
        """``path`` at this endpoint without its query: how an error names what was read."""
        return self.base + path.split("?")[0]

    def send(
        self,
        path: str,
        *,
        method: str = "GET",
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        request = urllib.request.Request(
            self.base + path, data=body, method=method, headers=dict(headers or {})
        )
        try:
            with self._opener.open(request, timeout=timeout_s or self.timeout_s) as response:
                return Response(int(response.status), dict(response.headers), bytes(response.read()))
        except urllib.error.HTTPError as exc:
            return Response(int(exc.code), dict(exc.headers or {}), b"")
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise NoticeSourceError(f"{self.where(path)}: unreachable: {reason}") from None
