"""``/metrics`` of a Prometheus registry over HTTP, for a service process or a worker's companion, and
``/healthz`` of a service beside it.

``prometheus-client``'s WSGI app on a threading server on a daemon thread, with a way to stop it (the
library's ``start_http_server`` never stops its server; a process that hosts a service for a while, or a
test, must). With a ``health`` check, ``GET /healthz`` answers 200 while it says the process can serve
and 503 otherwise, with ``{"status": ..., "reason": ...}``: the probe of a container costs an HTTP request
instead of a process started in it (``liver.services.host.ServiceHealth`` is the services' check).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

HEALTH_PATH: Final = "/healthz"
"""Where a service's health is answered (the Kubernetes manifests' ``httpGet`` probes)."""


@dataclass(frozen=True)
class Health:
    """One answer of a health check: whether the process can serve, and why not (one line)."""

    ok: bool
    reason: str


HealthCheck = Callable[[], Health]
"""Called on the HTTP server's thread for every ``/healthz`` request; must return within a probe's
timeout."""

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per request: a probe every few seconds would drown the service's own log."""

    def log_message(self, format: str, *args: Any) -> None:
        return None


def _health_app(health: HealthCheck) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Length", "0")])
            return [b""]
        try:
            answer = health()
        except Exception as exc:  # a broken check is an unhealthy process, not a crashed server thread
            answer = Health(ok=False, reason=f"the health check failed: {exc!r}")
        status = "200 OK" if answer.ok else "503 Service Unavailable"
        body = json.dumps({"status": "ok" if answer.ok else "unavailable", "reason": answer.reason}).encode()
        start_response(
            status,
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("Cache-Control", "no-store"),
            ],
        )
        return [b"" if method == "HEAD" else body]

    return app


def _not_found(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    start_response("404 Not Found", [("Content-Length", "0")])
    return [b""]


class MetricsServer:
    """``/metrics`` of ``registry`` on ``addr:port`` (port 0: a free one, see :attr:`port`); with
    ``health``, ``/healthz`` too (without, ``/healthz`` is 404: only a service has a health to tell)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        addr: str = "0.0.0.0",
        *,
        health: HealthCheck | None = None,
    ) -> None:
        metrics = make_wsgi_app(registry)
        healthz = _health_app(health) if health is not None else _not_found

        def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
            if environ.get("PATH_INFO") == HEALTH_PATH:
                return healthz(environ, start_response)
            return metrics(environ, start_response)  # type: ignore[no-any-return]

        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsHTTPServer", (ThreadingWSGIServer,), {"address_family": family})
        self._server: WSGIServer = make_server(addr, port, app, server_class, handler_class=_QuietHandler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="metrics-http", daemon=True
        )
        self._thread.start()
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
