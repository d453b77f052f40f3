"""The embedded nats-server: starts on free loopback ports, carries messages and JetStream, and goes away."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import nats
import nats.errors
import pytest

from liver.shared import subjects as s
from liver.shared.codec import decode, encode
from liver.shared.messages import SpotWarning
from liver.shared.nats_server import BINARY_ENV, NatsServer, NatsServerError, find_binary, nats_url

WARNING = SpotWarning(job_id="job-1", event_id="evt-1", node="node001", provider="aws", notice_s=120)


def _gone(pid: int) -> bool:
    """Exited, or a zombie waiting for a reaper that a container's init may never run."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


WAIT_S = 60.0
"""Upper bound on any wait here; a passing test waits milliseconds (a busy two-core machine may not)."""


def _wait_gone(pid: int, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


async def _quiet(_: Exception) -> None:
    """Connection errors are asserted on; keep nats-py from logging them as well."""


def test_the_binary_comes_from_the_installed_wheel() -> None:
    binary = find_binary()
    assert binary.name == "nats-server"
    assert os.access(binary, os.X_OK)


def test_a_binary_override_that_does_not_exist_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BINARY_ENV, "/nonexistent/nats-server")
    with pytest.raises(NatsServerError, match=BINARY_ENV):
        find_binary()


@pytest.mark.slow
def test_the_server_listens_on_loopback_and_reports_healthy(nats_server: NatsServer) -> None:
    assert nats_server.url.startswith("nats://127.0.0.1:")
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"{nats_server.monitor_url}/healthz", timeout=WAIT_S
    ) as response:
        assert response.status == 200


@pytest.mark.slow
async def test_a_published_message_reaches_a_subscriber(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        sub = await nc.subscribe("test.pubsub.spot")
        await nc.publish("test.pubsub.spot", encode(WARNING))
        received = await sub.next_msg(timeout=WAIT_S)
        assert decode(received.data, SpotWarning) == WARNING
    finally:
        await nc.drain()


@pytest.mark.slow
async def test_jetstream_keeps_a_message_for_a_durable_consumer_and_drops_a_duplicate(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="TEST_DURABLE", subjects=["test.durable.>"])
        headers = {s.HEADER_MSG_ID: WARNING.event_id}
        first = await js.publish("test.durable.spot", encode(WARNING), headers=headers)
        again = await js.publish("test.durable.spot", encode(WARNING), headers=headers)
        assert (again.seq, again.duplicate) == (first.seq, True)

        consumer = await js.pull_subscribe("test.durable.spot", durable="reader", stream="TEST_DURABLE")
        fetched = await consumer.fetch(2, timeout=WAIT_S)  # returns what is there, without waiting
        assert [decode(msg.data, SpotWarning) for msg in fetched] == [WARNING]
        await fetched[0].ack()
    finally:
        await nc.drain()


@pytest.mark.slow
async def test_liver_streams_buckets_and_object_store_can_be_declared_and_capture_their_subjects() -> None:
    with NatsServer() as server:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            for spec in s.STREAMS:
                await js.add_stream(
                    name=spec.name, subjects=list(spec.subjects), description=spec.description
                )
            expected = {
                s.SPOT_WARNING: s.STREAM_INGEST,
                s.SCALE_REQUEST: s.STREAM_INGEST,
                s.resize_requested("job-1"): s.STREAM_CONTROL,
                s.topology_planned("job-1"): s.STREAM_CONTROL,
                s.transfer_planned("job-1"): s.STREAM_CONTROL,
                s.GENERATION_COMMITTED: s.STREAM_GENERATIONS,
                s.GENERATION_ABORTED: s.STREAM_GENERATIONS,
                s.errors("ingester"): s.STREAM_ERRORS,
                s.dead_letters("ingester"): s.STREAM_DEAD_LETTERS,
            }
            for subject, spec in expected.items():
                ack = await js.publish(subject, b"{}")
                assert ack.stream == spec.name, subject

            kv = await js.create_key_value(bucket=s.KV_GENERATIONS)
            await kv.create("job-1", b"0")
            await js.create_key_value(bucket=s.KV_EVENTS_SEEN)
            store = await js.create_object_store(bucket=s.OBJECT_STORE_PLANS)
            name = s.plan_object_name("job-1", 1, "w-0")
            await store.put(name, b"x" * 2_000_000)
            assert len((await store.get(name)).data) == 2_000_000
        finally:
            await nc.drain()


@pytest.mark.slow
async def test_jetstream_data_survives_a_restart_with_the_same_store_dir(tmp_path: Path) -> None:
    with NatsServer(store_dir=tmp_path / "js") as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="TEST_KEPT", subjects=["test.kept"])
        await js.publish("test.kept", encode(WARNING))
        await nc.drain()
    with NatsServer(store_dir=tmp_path / "js") as server:
        nc = await nats.connect(server.url)
        try:
            stored = await nc.jetstream().get_last_msg("TEST_KEPT", "test.kept")
            assert decode(stored.data, SpotWarning) == WARNING
        finally:
            await nc.drain()


@pytest.mark.slow
async def test_a_config_file_adds_users_that_clients_must_log_in_as(tmp_path: Path) -> None:
    config = tmp_path / "auth.conf"
    config.write_text('authorization { users = [ { user: "liver", password: "s3cret" } ] }\n')
    with NatsServer(config_file=config) as server:
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            # One attempt: it must not time out before the server refuses it.
            await nats.connect(server.url, allow_reconnect=False, connect_timeout=30, error_cb=_quiet)
        nc = await nats.connect(server.url, user="liver", password="s3cret")
        await nc.drain()


@pytest.mark.slow
def test_a_bad_config_file_fails_the_start_with_the_server_log(tmp_path: Path) -> None:
    config = tmp_path / "broken.conf"
    config.write_text("authorization { users = [ \n")
    server = NatsServer(config_file=config, log_file=tmp_path / "server.log")
    with pytest.raises(NatsServerError, match="exited with code"):
        server.start()
    assert not server.running


@pytest.mark.slow
def test_stop_ends_the_process_and_removes_the_temporary_store() -> None:
    server = NatsServer().start()
    pid, store = server.pid, server.store_dir
    assert pid is not None and store.is_dir()
    server.stop()
    assert _wait_gone(pid)
    assert not store.exists()
    with pytest.raises(NatsServerError):
        _ = server.url


@pytest.mark.slow
def test_the_server_dies_with_a_parent_that_is_killed_hard(tmp_path: Path) -> None:
    parent_code = textwrap.dedent(
        """
        import time
        from liver.shared.nats_server import NatsServer
        server = NatsServer().start()
        print("server-pid", server.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        text=True,
    )
    try:
        assert parent.stdout is not None
        line = ""
        while not line.startswith("server-pid"):
            line = parent.stdout.readline()
            assert line, "the parent exited before starting the server"
        server_pid = int(line.split()[1])
        assert not _gone(server_pid)
    finally:
        parent.kill()
        parent.wait()
    try:
        assert _wait_gone(server_pid)
    finally:
        if not _gone(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_an_external_url_in_the_environment_starts_no_server() -> None:
    with nats_url({"NATS_URL": "nats://nats.example:4222"}) as url:
        assert url == "nats://nats.example:4222"


@pytest.mark.slow
async def test_without_an_external_url_a_local_server_serves_the_block() -> None:
    with nats_url({}) as url:
        nc = await nats.connect(url)
        await nc.drain()
    host, port = urlsplit(url).hostname, urlsplit(url).port
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, port), timeout=1).close()
