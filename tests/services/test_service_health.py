"""A hosted service's ``/healthz`` (issue 34, item 1): what the container's exec probe checked, the
service answering NATS discovery (connected, started, its loop not stuck), now answered by the service's
own metrics server, so a probe costs an HTTP request instead of a Python interpreter.

The decision is :func:`~liver.services.host.decide_health` of a :class:`~liver.services.host.ServiceState`;
:class:`~liver.services.host.ServiceHealth` reads that state on the service's event loop for each probe.
The fast tests fake the connection and the service; one slow test probes a real ``liver serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats.errors
import pytest
from prometheus_client import CollectorRegistry

from liver.services.host import (
    HEALTH_TIMEOUT_S,
    ConsumingService,
    PullConsumer,
    ServiceHealth,
    ServiceState,
    decide_health,
)
from liver.shared.connection import PASSWORD_ENV, TOKEN_ENV, USER_ENV
from liver.shared.metrics_http import HEALTH_PATH, MetricsServer
from liver.shared.nats_server import URL_ENV, NatsServer, free_port

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def probe(port: int, timeout_s: float = 10.0) -> tuple[int, dict[str, Any]]:
    """What a kubelet's httpGet probe of ``/healthz`` gets: the status and the JSON body."""
    try:
        with OPENER.open(f"http://127.0.0.1:{port}{HEALTH_PATH}", timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- the decision -------------------------------------------------------------------------------------

HEALTHY = ServiceState(started=True, stopping=False, lost=False, connected=True, server_answered=True)


def test_a_started_connected_service_whose_server_answers_is_healthy() -> None:
    assert decide_health(HEALTHY).ok


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"started": False}, "starting"),
        ({"stopping": True}, "stopping"),
        ({"lost": True}, "closed"),
        ({"connected": False, "server_answered": False}, "disconnected"),
        ({"server_answered": False}, "no answer from the NATS server"),
        ({"problem": "its consumer of LIVER_INGEST/ingester stopped"}, "LIVER_INGEST/ingester"),
    ],
)
def test_each_reason_not_to_serve_is_unhealthy_and_named(change: dict[str, Any], reason: str) -> None:
    state = ServiceState(**{**HEALTHY.__dict__, **change})
    health = decide_health(state)
    assert not health.ok
    assert reason in health.reason


def test_a_lost_connection_is_named_before_anything_else() -> None:
    state = ServiceState(started=True, stopping=True, lost=True, connected=False, server_answered=False)
    assert "closed" in decide_health(state).reason


# -- the state, read on the service's loop, answered over HTTP ----------------------------------------


class FakeClient:
    """The connection's side of the state: connected or not, and how a PING to the server ends."""

    def __init__(self) -> None:
        self.is_connected = True
        self.flush_error: Exception | None = None
        self.flushes = 0

    async def flush(self, timeout: float) -> None:
        self.flushes += 1
        if self.flush_error is not None:
            raise self.flush_error


class FakeService:
    name = "fake"

    def __init__(self) -> None:
        self.problem: str | None = None

    def health_problem(self) -> str | None:
        return self.problem


class Loop:
    """An event loop in a thread of its own, as the service's loop is to the metrics server's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def rig() -> Iterator[SimpleNamespace]:
    loop = Loop()
    service = FakeService()
    nc = FakeClient()
    health = ServiceHealth(service, timeout_s=0.5)  # type: ignore[arg-type]
    server = MetricsServer(CollectorRegistry(), 0, addr="127.0.0.1", health=health)
    lost = loop.run(_event())
    hosted = SimpleNamespace(bus=SimpleNamespace(nc=nc), lost=lost)
    try:
        yield SimpleNamespace(
            loop=loop, service=service, nc=nc, health=health, port=server.port, hosted=hosted
        )
    finally:
        server.close()
        loop.close()


async def _event() -> asyncio.Event:
    return asyncio.Event()


async def _started(health: ServiceHealth, hosted: Any) -> None:
    health.started(hosted)


def test_before_the_service_has_started_it_is_503_starting(rig: SimpleNamespace) -> None:
    status, body = probe(rig.port)
    assert status == 503 and "starting" in body["reason"]


def test_once_started_and_connected_it_is_200_and_each_probe_pings_the_server(rig: SimpleNamespace) -> None:
    rig.loop.run(_started(rig.health, rig.hosted))
    assert probe(rig.port) == (200, {"status": "ok", "reason": "ok"})
    assert probe(rig.port)[0] == 200
    assert rig.nc.flushes == 2


def test_a_disconnected_service_is_503_without_waiting_for_a_ping(rig: SimpleNamespace) -> None:
    rig.loop.run(_started(rig.health, rig.hosted))
    rig.nc.is_connected = False
    status, body = probe(rig.port)
    assert status == 503 and "disconnected" in body["reason"]
    assert rig.nc.flushes == 0
    rig.nc.is_connected = True
    assert probe(rig.port)[0] == 200, "reconnected: healthy again"


def test_a_server_that_does_not_answer_the_ping_is_503(rig: SimpleNamespace) -> None:
    rig.loop.run(_started(rig.health, rig.hosted))
    rig.nc.flush_error = nats.errors.FlushTimeoutError()
    status, body = probe(rig.port)
    assert status == 503 and "no answer from the NATS server" in body["reason"]


def test_a_service_whose_consumer_stopped_by_itself_is_503(rig: SimpleNamespace) -> None:
    rig.loop.run(_started(rig.health, rig.hosted))
    rig.service.problem = "its consumer of LIVER_INGEST/ingester stopped: boom"
    status, body = probe(rig.port)
    assert status == 503 and body["reason"] == "its consumer of LIVER_INGEST/ingester stopped: boom"


def test_a_lost_connection_and_a_stopping_service_are_503(rig: SimpleNamespace) -> None:
    rig.loop.run(_started(rig.health, rig.hosted))
    rig.health.stopping()
    assert probe(rig.port)[1]["reason"].startswith("stopping")
    rig.loop.loop.call_soon_threadsafe(rig.hosted.lost.set)
    time.sleep(0.05)
    status, body = probe(rig.port)
    assert status == 503 and "closed" in body["reason"]


def test_a_stuck_event_loop_is_503_within_the_health_checks_timeout(rig: SimpleNamespace) -> None:
    # What the exec probe caught with its discovery ping: a service whose loop no longer runs answers
    # nothing, though its HTTP thread still would.
    rig.loop.run(_started(rig.health, rig.hosted))
    rig.loop.loop.call_soon_threadsafe(time.sleep, 2.0)
    started = time.monotonic()
    status, body = probe(rig.port)
    assert status == 503 and "did not answer" in body["reason"]
    assert time.monotonic() - started < 1.5, "the probe is answered after the health check's timeout"
    rig.loop.run(asyncio.sleep(0.05))  # the loop is back: the late reading ends before the loop closes
    assert probe(rig.port)[0] == 200


def test_a_stopped_loop_is_503_not_an_error(rig: SimpleNamespace) -> None:
    rig.loop.run(_started(rig.health, rig.hosted))
    rig.loop.close()
    rig.loop.close = lambda: None  # type: ignore[method-assign]
    assert probe(rig.port)[0] == 503


def test_the_default_timeout_fits_inside_the_probes() -> None:
    assert 0 < HEALTH_TIMEOUT_S <= 3.0


# -- what a consuming service reports -----------------------------------------------------------------


class Consuming(ConsumingService):
    name = "consuming"
    description = "t"

    async def start(self, bus: Any) -> None:  # pragma: no cover - not started here
        raise NotImplementedError

    async def handle(self, msg: Any) -> None:  # pragma: no cover
        raise NotImplementedError


def _pull_consumer() -> PullConsumer:
    from nats.js import api

    js = SimpleNamespace(_nc=SimpleNamespace(), _prefix="$JS.API")
    config = api.ConsumerConfig(durable_name="ingester", ack_wait=5.0)
    return PullConsumer(js, stream="LIVER_INGEST", config=config, handler=None)  # type: ignore[arg-type]


async def test_a_consumer_never_started_or_stopped_on_purpose_is_no_problem() -> None:
    # A standby coordinator starts only its dead-letter watch, and stops its consumer when it stands down:
    # it still answered discovery, so it is still healthy.
    consumer = _pull_consumer()
    assert consumer.problem() is None
    consumer._stopping = True
    consumer._task = asyncio.create_task(asyncio.sleep(0))
    await consumer._task
    assert consumer.problem() is None


async def test_a_consumer_whose_task_ended_by_itself_is_a_problem_named_by_its_stream() -> None:
    consumer = _pull_consumer()
    consumer._task = asyncio.create_task(asyncio.sleep(3600))
    assert consumer.problem() is None, "running"
    consumer._task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await consumer._task
    problem = consumer.problem()
    assert problem is not None and "LIVER_INGEST/ingester" in problem


def test_a_consuming_service_reports_its_consumers_problem() -> None:
    service = Consuming()
    assert service.health_problem() is not None, "started without a consumer"
    service._consumer = SimpleNamespace(problem=lambda: None)  # type: ignore[assignment]
    assert service.health_problem() is None
    service._consumer = SimpleNamespace(problem=lambda: "its consumer of S/d stopped")  # type: ignore[assignment]
    assert service.health_problem() == "its consumer of S/d stopped"


# -- a real `liver serve` -----------------------------------------------------------------------------

PROCESS_S = 120.0


def _wait_for(port: int, status: int, what: str, proc: subprocess.Popen[bytes], log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + PROCESS_S
    last: object = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"liver serve exited {proc.returncode}: {log.read_text()[-3000:]}"
        try:
            got, body = probe(port, timeout_s=5)
        except OSError as exc:  # not listening yet
            last = exc
        else:
            last = (got, body)
            if got == status:
                return body
        time.sleep(0.1)
    raise AssertionError(
        f"{what}: /healthz never answered {status}; last {last!r}\n{log.read_text()[-3000:]}"
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_liver_serve_is_unhealthy_until_connected_healthy_while_serving_and_unhealthy_without_its_server(
    tmp_path: Path,
) -> None:
    nats_port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in (USER_ENV, PASSWORD_ENV, TOKEN_ENV)}
    env.update(
        {
            URL_ENV: f"nats://127.0.0.1:{nats_port}",
            "LIVER_METRICS_PORT": str(metrics_port),
            "LIVER_LOG_FORMAT": "json",
        }
    )
    log, store = tmp_path / "serve.log", tmp_path / "store"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "liver.cli.serve_cmd", "ingester"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    server: NatsServer | None = None
    try:
        body = _wait_for(metrics_port, 503, "no server yet", proc, log)
        assert "starting" in body["reason"]
        server = NatsServer(store_dir=store, extra_args=("-p", str(nats_port))).start()
        assert _wait_for(metrics_port, 200, "connected and consuming", proc, log)["status"] == "ok"
        server.stop()
        body = _wait_for(metrics_port, 503, "its server stopped", proc, log)
        assert "NATS" in body["reason"] or "disconnected" in body["reason"]
        server = NatsServer(store_dir=store, extra_args=("-p", str(nats_port))).start()
        _wait_for(metrics_port, 200, "reconnected", proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=PROCESS_S) == 0
    finally:
        if server is not None:
            server.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
