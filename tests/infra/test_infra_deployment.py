"""The compose deployment acted out without Docker: a nats-server with infra/nats.conf, the passwords
infra/make-env.sh wrote and TLS on client connections with the certificate infra/make-tls.sh made, the
four services started through infra/entrypoint.sh with the commands and environments compose.yaml gives
them, and the demo profile's simulated job as the worker user.

Each process therefore connects as its own NATS user, so the end-to-end flow below passing with no
permission violation in the server's log is what shows that the config's allow lists are sufficient
(tests/infra/test_infra_permissions.py shows that they refuse the rest). Every client, the services' health
checks included, verifies the server against the local CA, as compose.yaml has them do.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO

import pytest
from bus_helpers import REQUEST_TIMEOUT_S, WAIT_S, Collector
from infra_helpers import (
    ENTRYPOINT,
    INFRA,
    REPO,
    SERVICES,
    client_tls,
    connected,
    interpolate,
    load_compose,
    make_env,
    make_tls,
    password_var,
    secured_server,
    service_command,
    service_environment,
    stream_messages,
    violations,
    without_nats_settings,
)

from liver.shared import subjects as s
from liver.shared.messages import GenerationCommitted
from liver.shared.nats_server import NatsServer

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180.0
"""Four Python processes importing LiveR at once on a busy two-core machine."""
STOP_TIMEOUT_S = 60.0
"""How long a process may take to stop after SIGTERM (it drains its connection) before it is killed."""


def _load_healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("liver_infra_healthcheck", INFRA / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = _load_healthcheck()


@dataclass
class Deployment:
    server: NatsServer
    log_file: Path
    variables: dict[str, str]
    """What compose would read from infra/.env: the passwords make-env.sh wrote."""
    logs: Path
    processes: dict[str, subprocess.Popen[bytes]]
    tls_dir: Path
    """What infra/make-tls.sh wrote: the CA every client trusts and the server's certificate."""

    def environment(self, service: str) -> dict[str, str]:
        """``service``'s container environment from compose.yaml, pointed at the test server, plus what
        lets ``infra/entrypoint.sh`` find this interpreter's ``liver`` and ``python``."""
        env = without_nats_settings(os.environ)
        env.update(service_environment(service, self.variables))
        assert env["NATS_URL"] == "tls://nats:4222", "compose points the service at its nats service"
        env["NATS_URL"] = self.server.url
        assert env["NATS_TLS_CA"] == "/etc/liver/tls/ca.crt", "compose mounts the local CA there"
        env["NATS_TLS_CA"] = str(self.tls_dir / "ca.crt")
        if "LIVER_METRICS_PORT" in env:  # one port per container there; here every process shares a host
            env["LIVER_METRICS_PORT"] = "0"
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["LIVER_PYTHON"] = sys.executable
        return env

    def start(self, service: str) -> subprocess.Popen[bytes]:
        """``docker compose up SERVICE``: the image's entrypoint with compose's command and environment."""
        command = ["bash", str(ENTRYPOINT), *service_command(service, self.variables)]
        stderr: IO[bytes] = (self.logs / f"{service}.log").open("wb")
        proc = subprocess.Popen(
            command,
            env=self.environment(service),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
        )
        stderr.close()
        self.processes[service] = proc
        return proc

    def log_of(self, service: str) -> str:
        return (self.logs / f"{service}.log").read_text(errors="replace")[-3000:]


def _stop(*procs: subprocess.Popen[bytes]) -> list[int]:
    """SIGTERM all at once (as ``docker compose down``), then wait; kill what is left after
    STOP_TIMEOUT_S."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]


async def _wait_healthy(deployment: Deployment, service: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    env = deployment.environment(service)
    while True:
        proc = deployment.processes[service]
        if proc.poll() is not None:
            raise AssertionError(f"{service} exited with {proc.returncode}:\n{deployment.log_of(service)}")
        try:
            await healthcheck.ping(service, env)
            return
        except healthcheck.Unhealthy:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{service} not answering after {START_TIMEOUT_S} s:\n{deployment.log_of(service)}"
                ) from None
            await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("deployment")
    variables = make_env(root / ".env")
    logs = root / "logs"
    logs.mkdir()
    log_file = root / "nats-server.log"
    tls_dir = make_tls(root / "tls")
    with secured_server(variables, log_file=log_file, tls_dir=tls_dir) as server:
        assert server.url.startswith("tls://"), "the server requires TLS of its clients"
        stack = Deployment(
            server=server, log_file=log_file, variables=variables, logs=logs, processes={}, tls_dir=tls_dir
        )
        try:
            for service in SERVICES:
                stack.start(service)

            async def all_healthy() -> None:
                await asyncio.gather(*(_wait_healthy(stack, service) for service in SERVICES))

            asyncio.run(all_healthy())
            yield stack
        finally:
            _stop(*stack.processes.values())


def _healthcheck_command(service: str, variables: dict[str, str]) -> list[str]:
    """compose.yaml's health check of ``service``, with the image's ``liver-entrypoint`` mapped to the
    script in this checkout."""
    test = interpolate(load_compose()["services"][service]["healthcheck"]["test"], variables)
    assert test[:2] == ["CMD", "liver-entrypoint"], test
    return ["bash", str(ENTRYPOINT), *test[2:]]


def test_each_service_passes_its_compose_health_check_as_its_own_user(deployment: Deployment) -> None:
    checks = {
        service: subprocess.Popen(
            _healthcheck_command(service, deployment.variables),
            env=deployment.environment(service),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for service in SERVICES
    }
    for service, proc in checks.items():
        out, err = proc.communicate(timeout=START_TIMEOUT_S)
        assert proc.returncode == 0, f"{service}: {err.decode()}"
        assert out.decode().startswith(f"liver-{service} ") and out.decode().rstrip().endswith(" ok")


def test_a_health_check_with_a_wrong_password_fails(deployment: Deployment) -> None:
    env = deployment.environment("ingester")
    env["NATS_PASSWORD"] = "pwrong"
    result = subprocess.run(
        _healthcheck_command("ingester", deployment.variables),
        env=env,
        capture_output=True,
        timeout=START_TIMEOUT_S,
    )
    assert result.returncode == 1
    assert "authorization violation" in result.stderr.decode().lower()


async def test_a_spot_warning_from_the_publisher_is_committed_and_seen_by_the_subscriber(
    deployment: Deployment,
) -> None:
    variables, url = deployment.variables, deployment.server.url
    tls = client_tls(deployment.tls_dir)
    job = service_environment("coordinator", variables)["LIVER_JOB_ID"]
    simulate = deployment.start("simulate")
    try:

        async def membership_published() -> None:
            deadline = time.monotonic() + START_TIMEOUT_S
            while stream_messages(deployment.server).get(f"KV_{s.KV_MEMBERSHIP}", 0) < 1:
                assert simulate.poll() is None, deployment.log_of("simulate")
                assert time.monotonic() < deadline, "the coordinator never published the job's workers"
                await asyncio.sleep(0.2)

        await membership_published()
        async with (
            connected(url, "subscriber", variables[password_var("subscriber")], tls) as (
                watcher,
                watch_errors,
            ),
            connected(url, "publisher", variables[password_var("publisher")], tls) as (
                publisher,
                publish_errors,
            ),
        ):
            committed = await Collector.on(watcher, s.GENERATION_COMMITTED)
            js = publisher.jetstream(timeout=REQUEST_TIMEOUT_S)
            malformed = (
                b'{"schema_version": 1, "job_id": "%s", "event_id": "bad-1", "node": 7}' % job.encode()
            )
            assert (await js.publish(s.SPOT_WARNING, malformed)).stream == s.STREAM_INGEST.name
            # As an outside client sends it (infra/README.md): plain JSON, no LiveR code.
            warning = {
                "schema_version": 1,
                "job_id": job,
                "event_id": "spot-1",
                "node": "node001",
                "provider": "aws",
                "notice_s": 120,
            }
            await js.publish(s.SPOT_WARNING, json.dumps(warning).encode())
            # Through four service processes and the simulated job, each on a busy machine.
            out = await committed.one(GenerationCommitted, timeout_s=START_TIMEOUT_S)
            assert not watch_errors and not publish_errors
        assert (out.job_id, out.event_id, out.previous_generation, out.generation) == (job, "spot-1", 0, 1)
        assert {d.node for d in out.placement.devices} == {"node000"}

        async def malformed_kept() -> None:
            deadline = time.monotonic() + WAIT_S
            while True:
                counts = stream_messages(deployment.server)
                if (
                    counts.get(s.STREAM_ERRORS.name, 0) >= 1
                    and counts.get(s.STREAM_DEAD_LETTERS.name, 0) >= 1
                ):
                    return
                assert time.monotonic() < deadline, f"the malformed event was not dead-lettered: {counts}"
                await asyncio.sleep(0.1)

        await malformed_kept()
        assert violations(deployment.log_file) == []
    finally:
        assert _stop(simulate) == [0], deployment.log_of("simulate")
