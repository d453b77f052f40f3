"""``/metrics`` of a Prometheus registry over HTTP, for a service process or a worker's companion.

``prometheus-client``'s own server on a daemon thread, with a way to stop it (the library starts one
per registry and never stops it; a process that hosts a service for a while, or a test, must).
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    """``/metrics`` of ``registry`` on ``addr:port`` (port 0: a free one, see :attr:`port`)."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> None:
        server, thread = start_http_server(port, addr, registry=registry)
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.port: int = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
