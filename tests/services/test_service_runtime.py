"""The service runtime: credentials, declarations, discovery, consuming without crashing, clean shutdown."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
import structlog
import structlog.testing
from bus_helpers import WAIT_S, Collector, client, eventually, put_membership, running, scrape
from nats.aio.msg import Msg

from liver.cli import serve_cmd
from liver.services import bus as b
from liver.services.host import (
    BusConnection,
    ConnectionLost,
    ConsumingService,
    PullConsumer,
    hosted,
    micro_name,
    run_until_signalled,
    status_subject,
)
from liver.services.ingester.service import Ingester
from liver.shared import subjects as s
from liver.shared.codec import encode
from liver.shared.connection import (
    CREDS_ENV,
    PASSWORD_ENV,
    TOKEN_ENV,
    USER_ENV,
    connect_options,
)
from liver.shared.connection import ConnectionConfigError as RuntimeConfigError
from liver.shared.layout import Device
from liver.shared.logs import configure_logging
from liver.shared.messages import SpotWarning
from liver.shared.nats_server import URL_ENV, NatsServer
from liver.shared.outage import is_outage

URL = "nats://127.0.0.1:4222"


# -- credentials --------------------------------------------------------------------------------------


def test_without_credentials_the_client_connects_anonymously() -> None:
    options = connect_options(URL, {}, name="liver-x")
    assert options["servers"] == [URL]
    assert not {"user", "password", "token", "user_credentials"} & set(options)


def test_a_comma_separated_url_lists_several_servers() -> None:
    options = connect_options("nats://a:4222, nats://b:4222", {}, name="liver-x")
    assert options["servers"] == ["nats://a:4222", "nats://b:4222"]


def test_user_and_password_come_from_the_environment() -> None:
    options = connect_options(URL, {USER_ENV: "ingester", PASSWORD_ENV: "secret"}, name="liver-x")
    assert (options["user"], options["password"]) == ("ingester", "secret")


def test_a_token_comes_from_the_environment() -> None:
    assert connect_options(URL, {TOKEN_ENV: "t0k3n"}, name="liver-x")["token"] == "t0k3n"


def test_a_creds_file_comes_from_the_environment(tmp_path: Path) -> None:
    creds = tmp_path / "svc.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    assert connect_options(URL, {CREDS_ENV: str(creds)}, name="liver-x")["user_credentials"] == str(creds)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({USER_ENV: "ingester"}, PASSWORD_ENV),
        ({PASSWORD_ENV: "secret"}, USER_ENV),
        ({USER_ENV: "ingester", PASSWORD_ENV: "secret", TOKEN_ENV: "t"}, TOKEN_ENV),
        ({CREDS_ENV: "/nonexistent/svc.creds"}, CREDS_ENV),
    ],
    ids=["user-without-password", "password-without-user", "two-methods", "missing-creds-file"],
)
def test_inconsistent_credentials_are_refused_naming_the_variable(env: Mapping[str, str], named: str) -> None:
    with pytest.raises(RuntimeConfigError, match=f"^{named}:"):
        connect_options(URL, env, name="liver-x")


def test_a_url_without_a_scheme_is_refused() -> None:
    with pytest.raises(RuntimeConfigError, match=URL_ENV):
        connect_options("127.0.0.1:4222", {}, name="liver-x")


@pytest.fixture
def server() -> Iterator[NatsServer]:
    with NatsServer() as srv:
        yield srv


@pytest.fixture
def password_server(tmp_path: Path) -> Iterator[NatsServer]:
    config = tmp_path / "auth.conf"
    config.write_text('authorization { user: "svc", password: "right" }\n')
    with NatsServer(config_file=config) as srv:
        yield srv


@pytest.mark.slow
async def test_a_service_connects_with_the_password_in_its_environment(password_server: NatsServer) -> None:
    env = {USER_ENV: "svc", PASSWORD_ENV: "right"}
    async with hosted(Ingester(), password_server.url, env) as h:
        assert h.bus.nc.is_connected


@pytest.mark.slow
async def test_a_wrong_password_fails_to_connect(password_server: NatsServer) -> None:
    async def quiet(_: Exception) -> None:
        return None

    options = connect_options(password_server.url, {USER_ENV: "svc", PASSWORD_ENV: "wrong"}, name="liver-x")
    options["max_reconnect_attempts"] = 0
    options["allow_reconnect"] = False
    options["connect_timeout"] = 30  # one attempt: it must not time out before the server refuses it
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(**options, error_cb=quiet)


# -- declarations -------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_declaring_every_stream_twice_changes_nothing(server: NatsServer) -> None:
    async with client(server.url) as (_, js):
        await b.ensure_streams(js)
        before = {spec.name: (await js.stream_info(spec.name)).config for spec in s.STREAMS}
        with structlog.testing.capture_logs() as logged:
            await b.ensure_streams(js)
        after = {spec.name: (await js.stream_info(spec.name)).config for spec in s.STREAMS}
    assert [e for e in logged if e["event"] == "stream_updated"] == []
    assert before == after


@pytest.mark.slow
async def test_a_stream_declared_with_an_outdated_config_is_brought_up_to_date(server: NatsServer) -> None:
    async with client(server.url) as (_, js):
        await js.add_stream(name=s.STREAM_INGEST.name, subjects=[s.SPOT_WARNING])
        await b.ensure_stream(js, s.STREAM_INGEST)
        config = (await js.stream_info(s.STREAM_INGEST.name)).config
    assert sorted(config.subjects or ()) == sorted(s.STREAM_INGEST.subjects)
    assert config.max_age == b.STREAM_LIMITS[s.STREAM_INGEST.name]


# -- discovery ----------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_running_service_answers_discovery_ping_info_and_stats(server: NatsServer) -> None:
    ingester = Ingester()
    async with running(ingester, server.url) as h, client(server.url) as (nc, _):
        name = micro_name("ingester")
        ping = json.loads((await nc.request(f"$SRV.PING.{name}", b"", timeout=WAIT_S)).data)
        assert (ping["name"], ping["id"]) == (name, h.micro.id)
        info = json.loads((await nc.request(f"$SRV.INFO.{name}", b"", timeout=WAIT_S)).data)
        assert info["metadata"] == {"service": "ingester"}
        stats = json.loads((await nc.request(f"$SRV.STATS.{name}", b"", timeout=WAIT_S)).data)
        (endpoint,) = stats["endpoints"]
        assert endpoint["data"] == ingester.stats()
        status = json.loads((await nc.request(status_subject("ingester"), b"", timeout=WAIT_S)).data)
        assert status == ingester.stats()


@pytest.mark.slow
async def test_a_stopped_service_no_longer_answers_ping(server: NatsServer) -> None:
    async with running(Ingester(), server.url):
        pass
    async with client(server.url) as (nc, _):
        with pytest.raises(nats.errors.NoRespondersError):  # the server says so at once
            await nc.request(f"$SRV.PING.{micro_name('ingester')}", b"", timeout=WAIT_S)


class StuckOnStop:
    """A service whose message in hand never settles: its ``stop`` waits for ever."""

    name = "stuck"
    description = "never stops"

    def __init__(self) -> None:
        self.cancelled = False

    async def start(self, bus: object) -> None:
        return None

    async def stop(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    def stats(self) -> Mapping[str, int]:
        return {}

    def health_problem(self) -> str | None:
        return None


@pytest.mark.slow
async def test_a_service_that_cannot_settle_its_message_is_cut_off_after_the_stop_grace(
    server: NatsServer,
) -> None:
    service = StuckOnStop()
    with structlog.testing.capture_logs() as logged:
        async with hosted(service, server.url, {}, stop_grace_s=0.2) as h:
            nc = h.bus.nc
    assert service.cancelled
    assert nc.is_closed
    (timed_out,) = [e for e in logged if e["event"] == "service_stop_timed_out"]
    assert timed_out["service"] == "stuck"


class Idle:
    """A service that does nothing; with ``overflow``, it publishes one message over ``max_payload``
    once it is started (its headers uncounted by nats-py's own check), so the server closes its
    connection, as it closed the ingester's over a too-big dead letter."""

    name = "idle"
    description = "does nothing"

    def __init__(self, overflow: bool = False) -> None:
        self.overflow = overflow
        self.bus: Any = None

    async def start(self, bus: Any) -> None:
        self.bus = bus
        if self.overflow:
            asyncio.get_running_loop().call_later(0.1, asyncio.ensure_future, self._overflow())

    async def _overflow(self) -> None:
        nc = self.bus.nc
        await nc.publish("liver.test.too-big", b"x" * (nc.max_payload - 8), headers={"Pad": "y" * 256})

    async def stop(self) -> None:
        return None

    def stats(self) -> Mapping[str, int]:
        return {}

    def health_problem(self) -> str | None:
        return None


@pytest.mark.slow
async def test_a_connection_the_server_closes_is_reported_as_lost(server: NatsServer) -> None:
    async with hosted(Idle(), server.url, {}) as h:
        await h.service._overflow()
        await asyncio.wait_for(h.lost.wait(), WAIT_S)
        assert h.bus.nc.is_closed


@pytest.mark.slow
async def test_a_service_closing_its_own_connection_is_not_a_loss(server: NatsServer) -> None:
    async with hosted(Idle(), server.url, {}) as h:
        pass
    assert h.bus.nc.is_closed and not h.lost.is_set()


@pytest.mark.slow
async def test_a_host_whose_connection_is_lost_ends_with_an_error_instead_of_staying_deaf(
    server: NatsServer,
) -> None:
    with pytest.raises(ConnectionLost, match="idle: the server closed the connection"):
        await asyncio.wait_for(run_until_signalled(Idle(overflow=True), server.url, {}), PROCESS_S)


class Holding(ConsumingService):
    """A service that takes one message at a time and holds it until released: a queue that stands."""

    name = "holding"
    description = "holds its message"

    def __init__(self, ack_wait_s: float = 60.0, batch: int = 1) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.taken = 0
        self.deliveries: list[int] = []
        self.ack_wait_s = ack_wait_s
        self.batch = batch

    async def start(self, bus: BusConnection) -> None:
        self._js = bus.js
        await b.ensure_stream(bus.js, s.STREAM_INGEST)
        config = b.pull_consumer_config(
            "holding", s.SCALE_REQUEST, ack_wait_s=self.ack_wait_s, max_deliver=3, description="t"
        )
        await self._consume(
            bus, stream=s.STREAM_INGEST.name, config=config, batch=self.batch, retry_delay_s=0.1
        )

    async def handle(self, msg: Msg) -> None:
        self.taken += 1
        self.deliveries.append(msg.metadata.num_delivered)
        await self.release.wait()
        await msg.ack()


@pytest.mark.slow
async def test_the_queue_depth_of_a_services_consumer_is_a_metric(server: NatsServer) -> None:
    service = Holding()
    async with hosted(service, server.url, {}, metrics_port=0) as h, client(server.url) as (_, js):
        for i in range(3):
            await js.publish(s.SCALE_REQUEST, f"held-{i}".encode())
        assert h.metrics_port

        async def standing() -> bool:
            now = await asyncio.to_thread(scrape, h.metrics_port)
            waiting = now.get(("liver_queue_messages", (("service", "holding"), ("state", "waiting"))))
            unacked = now.get(("liver_queue_messages", (("service", "holding"), ("state", "unacked"))))
            return (waiting, unacked) == (2, 1)

        await eventually(standing, what="two messages waiting and one in hand on /metrics")
        assert await service.queue_depth() == (2, 1)
        service.release.set()


@pytest.mark.slow
async def test_messages_held_past_the_ack_wait_are_kept_in_progress_and_never_redelivered(
    server: NatsServer,
) -> None:
    service = Holding(ack_wait_s=1.0, batch=4)
    async with hosted(service, server.url, {}), client(server.url) as (_, js):
        for i in range(3):
            await js.publish(s.SCALE_REQUEST, f"held-{i}".encode())
        assert service._consumer is not None
        consumer = service._consumer.consumer

        async def kept_for_two_ack_waits() -> bool:  # one in hand and two prefetched all the while
            return service.taken == 1 and consumer.kept_alive >= 3 * 6

        await eventually(kept_for_two_ack_waits, what="six keep-alive rounds of three held messages")
        info = await js.consumer_info(s.STREAM_INGEST.name, "holding")
        assert (info.num_redelivered, info.num_ack_pending) == (0, 3)
        service.release.set()
        await eventually(lambda: _true(service.taken == 3), what="all three handled")
    assert service.deliveries == [1, 1, 1]


@pytest.mark.slow
async def test_a_message_held_by_a_service_that_died_is_redelivered_after_the_short_ack_wait(
    server: NatsServer,
) -> None:
    dying, next_one = Holding(ack_wait_s=1.0), Holding(ack_wait_s=1.0)
    async with client(server.url) as (_, js):
        async with hosted(dying, server.url, {}) as h:
            await js.publish(s.SCALE_REQUEST, b"held")
            await eventually(lambda: _true(dying.taken == 1), what="the message in hand")
            await h.bus.nc.close()  # dies: no ack, no nak, no keep-alive
        next_one.release.set()
        async with hosted(next_one, server.url, {}):
            await eventually(lambda: _true(next_one.taken == 1), what="the message redelivered")
    assert next_one.deliveries == [2]


async def _true(value: bool) -> bool:
    return value


# -- consuming ----------------------------------------------------------------------------------------


class Flaky:
    """A handler that raises on the first delivery of any message whose payload is ``boom``."""

    def __init__(self) -> None:
        self.handled: list[tuple[bytes, int]] = []

    async def __call__(self, msg: Msg) -> None:
        self.handled.append((msg.data, msg.metadata.num_delivered))
        if msg.data == b"boom" and msg.metadata.num_delivered == 1:
            raise RuntimeError("handler bug")
        await msg.ack()


@pytest.mark.slow
async def test_a_handler_that_raises_neither_stops_the_consumer_nor_loses_the_message(
    server: NatsServer,
) -> None:
    async with client(server.url) as (_, js):
        await b.ensure_stream(js, s.STREAM_INGEST)
        handler = Flaky()
        config = b.pull_consumer_config("flaky", None, ack_wait_s=5, max_deliver=3, description="test")
        consumer = PullConsumer(
            js, stream=s.STREAM_INGEST.name, config=config, handler=handler, retry_delay_s=0.1
        )
        await consumer.start()
        try:
            boom = (await js.publish(s.SPOT_WARNING, b"boom")).seq
            await js.publish(s.SPOT_WARNING, b"fine")

            async def retried() -> bool:
                return (b"boom", 2) in handler.handled

            await eventually(retried, what="the failed message is delivered again")

            async def fine_handled() -> bool:  # on a busy machine the retry may come before it
                return (b"fine", 1) in handler.handled

            await eventually(fine_handled, what="the next message handled")
            assert (b"fine", 1) in handler.handled
            assert consumer.failed == 1
            assert consumer.last_error(boom) is None  # cleared by the successful retry
        finally:
            await consumer.stop()


class UnreachableBus:
    """A handler that finds no stream leader ``times`` times (as during an election), then acknowledges."""

    def __init__(self, times: int) -> None:
        self.times = times
        self.calls: list[int] = []

    async def __call__(self, msg: Msg) -> None:
        self.calls.append(msg.metadata.num_delivered)
        if len(self.calls) <= self.times:
            try:
                raise nats.errors.NoRespondersError
            except nats.errors.NoRespondersError as exc:
                raise nats.js.errors.NoStreamResponseError from exc
        await msg.ack()


@pytest.mark.slow
async def test_a_handler_failing_only_because_the_bus_is_unreachable_keeps_its_delivery(
    server: NatsServer,
) -> None:
    """An election longer than all of a message's deliveries must not dead-letter the message."""
    async with client(server.url) as (_, js):
        await b.ensure_stream(js, s.STREAM_INGEST)
        handler = UnreachableBus(times=8)
        config = b.pull_consumer_config("electing", None, ack_wait_s=5, max_deliver=2, description="test")
        consumer = PullConsumer(
            js, stream=s.STREAM_INGEST.name, config=config, handler=handler, retry_delay_s=0.01
        )
        await consumer.start()
        try:
            await js.publish(s.SPOT_WARNING, b"during an election")

            async def acked() -> bool:
                return len(handler.calls) == 9

            await eventually(acked, what="the message handled once the bus answers again")
            assert handler.calls == [1] * 9  # all on the first delivery
            assert (consumer.outage_retries, consumer.failed) == (8, 0)
        finally:
            await consumer.stop()


@pytest.mark.slow
async def test_an_outage_longer_than_the_bound_counts_as_a_failed_delivery(server: NatsServer) -> None:
    async with client(server.url) as (_, js):
        await b.ensure_stream(js, s.STREAM_INGEST)
        handler = UnreachableBus(times=1_000_000)
        config = b.pull_consumer_config("outlasting", None, ack_wait_s=5, max_deliver=2, description="test")
        consumer = PullConsumer(
            js, stream=s.STREAM_INGEST.name, config=config, handler=handler, retry_delay_s=0.01, outage_s=0.0
        )
        await consumer.start()
        try:
            await js.publish(s.SPOT_WARNING, b"for ever unreachable")

            async def redelivered() -> bool:
                return 2 in handler.calls

            await eventually(redelivered, what="the message nak'ed and delivered again")
            assert consumer.failed >= 1
        finally:
            await consumer.stop()


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (nats.errors.NoRespondersError(), True),
        (nats.errors.TimeoutError(), True),
        (nats.js.errors.ServiceUnavailableError(), True),
        (nats.errors.ConnectionReconnectingError(), True),
        (ValueError("a bad field"), False),
        (nats.js.errors.KeyWrongLastSequenceError(), False),
    ],
)
def test_only_errors_that_say_the_bus_is_unreachable_are_outages(error: Exception, outage: bool) -> None:
    assert is_outage(error) is outage


def test_a_timeout_on_a_connection_that_stayed_up_is_the_handlers_own_failure() -> None:
    assert not is_outage(nats.errors.TimeoutError(), timeouts=False)
    assert is_outage(nats.errors.NoRespondersError(), timeouts=False)


def test_an_error_raised_from_none_inside_an_outage_is_not_an_outage() -> None:
    try:
        try:
            raise nats.errors.NoRespondersError
        except nats.errors.NoRespondersError:
            raise ValueError("a bad field") from None
    except ValueError as exc:
        assert not is_outage(exc)


def test_an_error_raised_from_an_outage_is_an_outage() -> None:
    try:
        try:
            raise nats.errors.NoRespondersError
        except nats.errors.NoRespondersError as cause:
            raise RuntimeError("could not publish the event") from cause
    except RuntimeError as exc:
        assert is_outage(exc)


@pytest.mark.slow
async def test_log_lines_carry_the_ids_of_the_message_being_handled_and_only_that_one(
    server: NatsServer,
) -> None:
    out = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configure_logging(json_output=True, stream=out)
    try:
        async with running(Ingester(), server.url), client(server.url) as (nc, js):
            await put_membership(js, "job-7", (Device("n1", 0), Device("n2", 0)), generation=3)
            resized = await Collector.on(nc, s.RESIZE_REQUESTED_ANY)
            errors = await Collector.on(nc, s.errors("ingester"))
            good = SpotWarning(job_id="job-7", event_id="evt-7", node="n1", provider="aws", notice_s=60.0)
            good_seq = (await js.publish(s.SPOT_WARNING, encode(good))).seq
            await resized.wait_for(1)
            bad = {
                "schema_version": 1,
                "job_id": "job-8",
                "event_id": "evt-8",
                "node": "n1",
                "provider": "aws",
            }
            bad_seq = (await js.publish(s.SPOT_WARNING, json.dumps(bad).encode())).seq
            await errors.wait_for(1)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        structlog.reset_defaults()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    (resize,) = [line for line in lines if line["event"] == "resize_requested"]
    assert (resize["job_id"], resize["event_id"], resize["generation"]) == ("job-7", "evt-7", 3)
    assert (resize["stream_sequence"], resize["subject"]) == (good_seq, s.SPOT_WARNING)
    (rejected,) = [line for line in lines if line["event"] == "message_rejected"]
    assert (rejected["job_id"], rejected["event_id"]) == ("job-8", "evt-8")
    assert rejected["stream_sequence"] == bad_seq
    assert rejected["field"] == "$.notice_s"
    assert "generation" not in rejected  # nothing of the previous message leaked into this one
    (started,) = [line for line in lines if line["event"] == "service_started"]
    assert "job_id" not in started


# -- the process --------------------------------------------------------------------------------------


def _pid_gone(pid: int) -> bool:
    """Exited, or a zombie that a container's init may never reap."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


PROCESS_S = 120.0
"""How long a ``liver serve`` process may take to start (an interpreter importing LiveR, an embedded
server) or to stop, on a busy machine."""


class LogReader:
    """The JSON log lines a subprocess writes to stderr, read on a thread so nothing blocks."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.lines: queue.Queue[dict[str, object]] = queue.Queue()
        self.seen: list[dict[str, object]] = []
        assert proc.stderr is not None
        self._thread = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _read(self, stream: io.BufferedReader) -> None:
        for raw in stream:
            try:
                self.lines.put(json.loads(raw))
            except ValueError:
                self.lines.put({"event": "unparsed", "text": raw.decode(errors="replace")})

    def wait_for(self, event: str, timeout_s: float = PROCESS_S) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.get("event") == event:
                return line
        raise AssertionError(f"no {event!r} log line; saw {self.seen[-10:]}")


@pytest.mark.slow
def test_liver_serve_drains_on_sigterm_exits_0_and_leaves_no_server_behind() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (URL_ENV, USER_ENV, PASSWORD_ENV, TOKEN_ENV)}
    env["LIVER_LOG_FORMAT"] = "json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "liver.cli.serve_cmd", "ingester"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        logs = LogReader(proc)
        embedded = logs.wait_for("nats_server_started")
        logs.wait_for("service_started")
        url, server_pid = str(embedded["url"]), int(embedded["pid"])  # type: ignore[call-overload]

        async def ping() -> dict[str, object]:
            async with client(url) as (nc, _):
                return json.loads(
                    (await nc.request(f"$SRV.PING.{micro_name('ingester')}", b"", timeout=WAIT_S)).data
                )

        assert asyncio.run(ping())["name"] == "liver-ingester"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=PROCESS_S) == 0
        logs.wait_for("service_stopped")
        logs.wait_for("nats_server_stopped")
        deadline = time.monotonic() + WAIT_S
        while not _pid_gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pid_gone(server_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serving_a_service_that_is_not_built_yet_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(serve_cmd.SERVICES, "coordinator", "liver.services.coordinator.not_there")  # type: ignore[index]
    monkeypatch.delenv(URL_ENV, raising=False)
    assert serve_cmd.main(["coordinator"]) == 2
    assert "the coordinator service is not part of this build yet" in capsys.readouterr().err


def test_the_budget_option_is_refused_for_services_other_than_transfer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert serve_cmd.main(["ingester", "--budget-bytes", "1024"]) == 2
    assert "--budget-bytes applies to the transfer service only" in capsys.readouterr().err


@pytest.mark.slow
def test_liver_serve_waiting_for_an_unreachable_server_exits_0_on_sigterm() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (USER_ENV, PASSWORD_ENV, TOKEN_ENV)}
    env.update({"LIVER_LOG_FORMAT": "json", URL_ENV: "nats://127.0.0.1:1"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "liver.cli.serve_cmd", "ingester"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        logs = LogReader(proc)
        logs.wait_for("nats_error")  # refused, and retrying
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=PROCESS_S) == 0
        logs.wait_for("signal_received_while_starting")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
