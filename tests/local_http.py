"""A local HTTP server for the fakes of platform endpoints (metadata services, the Kubernetes API): a
request handler that stays quiet, and a server on a free loopback port served from a daemon thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, *_: Any) -> None:
        return None

    def answer(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class LocalHttp:
    """``handler`` on ``127.0.0.1`` and a free port (``endpoint``), served while :func:`serving`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"


@contextmanager
def serving(http: LocalHttp) -> Iterator[LocalHttp]:
    # serve_forever polls for shutdown every 0.5 s by default: each test would wait that long at its end
    thread = threading.Thread(target=http.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield http
    finally:
        http.server.shutdown()
        http.server.server_close()


def nothing_listening(handler: type[BaseHTTPRequestHandler] = QuietHandler) -> str:
    """An endpoint whose port was bound and closed again: a connection there is refused."""
    http = LocalHttp(handler)
    http.server.server_close()
    return http.endpoint
