"""The metrics HTTP server's health path: ``/healthz`` answers 200 or 503 from the health check it is
given, next to ``/metrics``, so that Kubernetes can probe a service over HTTP instead of starting a
Python interpreter in the container every 10 s (issue 34, item 1)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from liver.shared.metrics_http import HEALTH_PATH, Health, MetricsServer

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(port: int, path: str, method: str = "GET") -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with OPENER.open(request, timeout=10) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


class Switch:
    """A health check whose answer the test sets."""

    def __init__(self) -> None:
        self.answer = Health(ok=True, reason="ok")
        self.calls = 0

    def __call__(self) -> Health:
        self.calls += 1
        return self.answer


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("liver_probe_test", "a series", registry=registry).inc()
    return registry


@pytest.fixture
def switch() -> Switch:
    return Switch()


@pytest.fixture
def served(registry: CollectorRegistry, switch: Switch) -> Iterator[MetricsServer]:
    server = MetricsServer(registry, 0, addr="127.0.0.1", health=switch)
    try:
        yield server
    finally:
        server.close()


def test_the_health_path_is_the_probes(served: MetricsServer) -> None:
    assert HEALTH_PATH == "/healthz"


def test_healthy_is_200_with_the_reason_as_json(served: MetricsServer, switch: Switch) -> None:
    status, body, headers = get(served.port, HEALTH_PATH)
    assert status == 200
    assert json.loads(body) == {"status": "ok", "reason": "ok"}
    assert headers["Content-Type"].startswith("application/json")
    assert switch.calls == 1, "every probe asks the health check again"


def test_unhealthy_is_503_with_the_reason(served: MetricsServer, switch: Switch) -> None:
    switch.answer = Health(ok=False, reason="disconnected from NATS")
    status, body, _ = get(served.port, HEALTH_PATH)
    assert status == 503
    assert json.loads(body) == {"status": "unavailable", "reason": "disconnected from NATS"}
    switch.answer = Health(ok=True, reason="ok")
    assert get(served.port, HEALTH_PATH)[0] == 200, "each answer is the state now, nothing cached"


def test_a_health_check_that_raises_is_503_not_a_crash(served: MetricsServer, switch: Switch) -> None:
    def broken() -> Health:
        raise RuntimeError("boom")

    served_broken = MetricsServer(CollectorRegistry(), 0, addr="127.0.0.1", health=broken)
    try:
        status, body, _ = get(served_broken.port, HEALTH_PATH)
        assert status == 503
        assert "boom" in json.loads(body)["reason"]
    finally:
        served_broken.close()


def test_the_query_string_does_not_matter_and_head_has_no_body(served: MetricsServer) -> None:
    assert get(served.port, f"{HEALTH_PATH}?verbose=1")[0] == 200
    status, body, _ = get(served.port, HEALTH_PATH, method="HEAD")
    assert (status, body) == (200, b"")


def test_only_get_and_head_are_answered(served: MetricsServer, switch: Switch) -> None:
    status, _, headers = get(served.port, HEALTH_PATH, method="POST")
    assert status == 405
    assert "GET" in headers["Allow"]
    assert switch.calls == 0


def test_metrics_are_still_served_beside_it(served: MetricsServer, switch: Switch) -> None:
    switch.answer = Health(ok=False, reason="stopping")
    status, body, _ = get(served.port, "/metrics")
    assert status == 200
    assert b"liver_probe_test_total 1.0" in body
    assert switch.calls == 0, "a scrape does not run the health check"


def test_without_a_health_check_the_health_path_is_not_found(registry: CollectorRegistry) -> None:
    server = MetricsServer(registry, 0, addr="127.0.0.1")
    try:
        assert get(server.port, HEALTH_PATH)[0] == 404, (
            "a worker's companion does not pretend to be a service"
        )
        assert get(server.port, "/metrics")[0] == 200
    finally:
        server.close()
