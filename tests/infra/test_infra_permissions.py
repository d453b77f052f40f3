"""infra/nats.conf refuses what its users are not meant to do.

A refused connection raises at connect. A refused publish raises nothing at the call: the server drops
the message and reports a permissions violation to the client's error callback, and the connection stays
up; a refused subscription is reported the same way. Each test pairs a refusal with something the same
user is allowed, so that a config refusing everything would fail too. (That the allow lists suffice for
the real services is shown by tests/infra/test_infra_deployment.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import nats
import nats.errors
import pytest
from bus_helpers import REQUEST_TIMEOUT_S, WAIT_S, Collector, drained, eventually
from infra_helpers import (
    REPO,
    ROLES,
    SERVICES,
    Errors,
    connected,
    make_env,
    password_var,
    secured_server,
    service_environment,
    violations,
    without_nats_settings,
)
from nats.aio.client import Client

from liver.cli import publish_cmd, serve_cmd
from liver.cli.bus_access import connect_once
from liver.cli.main import main
from liver.cli.watch_cmd import watch
from liver.services import bus as b
from liver.services.coordinator.record import GenerationRecord
from liver.services.host import hosted
from liver.shared import subjects as s
from liver.shared.codec import encode
from liver.shared.connection import PASSWORD_ENV, TLS_CA_ENV, USER_ENV
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.messages import ErrorEvent, GenerationCommitted, JobMembership, SpotWarning, WorkerDevice
from liver.shared.nats_server import URL_ENV, NatsServer
from liver.worker_runtime.companion.slices import PlanFetcher, PlanFetchError

# Every test here starts a process (a nats-server, workers or a CLI): none is in the fast tier.
pytestmark = pytest.mark.slow


class Rig:
    def __init__(self, server: NatsServer, passwords: dict[str, str]) -> None:
        self.server = server
        self.url = server.url
        self.passwords = passwords

    def login(self, role: str) -> tuple[str, str]:
        return role, self.passwords[password_var(role)]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    root = tmp_path_factory.mktemp("permissions")
    passwords = make_env(root / ".env")
    with secured_server(passwords, log_file=root / "nats-server.log") as server:
        yield Rig(server, passwords)


async def refused(errors: list[str], kind: str, subject: str) -> None:
    """Wait for the server's report that ``kind`` ("publish" or "subscription") to ``subject`` was refused."""
    wanted = f'permissions violation for {kind} to "{subject.lower()}"'

    async def reported() -> bool:
        return any(wanted in e for e in errors)

    await eventually(reported, timeout_s=WAIT_S, what=f"{kind} to {subject} refused; errors: {errors}")


async def delivered(publisher: Client, subject: str, to: Collector, receiver: Client, errors: Errors) -> None:
    """Publish ``{}`` on ``subject`` until ``to`` has it: core NATS is at most once, and on a loaded
    machine a first delivery has been seen to go missing (both clients connected, no error reported).
    What this shows is that the receiver *may* receive it; a refusal would never arrive."""
    deadline = time.monotonic() + WAIT_S
    while not to.messages:
        await publisher.publish(subject, b"{}")
        await publisher.flush(timeout=int(WAIT_S))
        try:
            await to.wait_for(1, timeout_s=min(5.0, max(0.1, deadline - time.monotonic())))
        except AssertionError:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"nothing on {subject} in {WAIT_S} s: publisher connected={publisher.is_connected}, "
                    f"receiver connected={receiver.is_connected}, receiver errors={errors}, "
                    f"receiver stats={receiver.stats}"
                ) from None


def warning(event_id: str) -> bytes:
    return encode(SpotWarning(job_id="job-p", event_id=event_id, node="n1", provider="aws", notice_s=60.0))


async def ingest_stream(rig: Rig) -> None:
    """LIVER_INGEST, declared as the ingester declares it, so that publishes to it are acknowledged."""
    async with connected(rig.url, *rig.login("ingester")) as (nc, _):
        await b.ensure_stream(nc.jetstream(timeout=REQUEST_TIMEOUT_S), s.STREAM_INGEST)


# -- who may connect ----------------------------------------------------------------------------------


async def test_a_client_without_credentials_is_refused(rig: Rig) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        async with connected(rig.url, None, None):
            pass


async def test_a_wrong_password_is_refused_and_the_right_one_accepted(rig: Rig) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        async with connected(rig.url, "publisher", rig.passwords[password_var("subscriber")]):
            pass
    async with connected(rig.url, *rig.login("publisher")) as (nc, _):
        assert nc.is_connected


@pytest.mark.parametrize("role", ROLES)
async def test_every_user_logs_in_with_the_password_from_its_variable(rig: Rig, role: str) -> None:
    async with connected(rig.url, *rig.login(role)) as (nc, errors):
        await nc.flush()
        assert nc.is_connected and not errors


# -- the publisher ------------------------------------------------------------------------------------


async def test_the_publisher_publishes_events_but_not_generation_outcomes(rig: Rig) -> None:
    await ingest_stream(rig)
    async with (
        connected(rig.url, *rig.login("subscriber")) as (watcher, _),
        connected(rig.url, *rig.login("publisher")) as (nc, errors),
    ):
        outcomes = await Collector.on(watcher, s.GENERATION_COMMITTED)
        js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        ack = await js.publish(s.SPOT_WARNING, warning("pub-1"))
        assert ack.stream == s.STREAM_INGEST.name
        scale = b'{"schema_version": 1, "job_id": "job-p", "event_id": "pub-2", "add": []}'
        assert (await js.publish(s.SCALE_REQUEST, scale)).stream == s.STREAM_INGEST.name
        await nc.publish(s.GENERATION_COMMITTED, b'{"forged": true}')
        await refused(errors, "publish", s.GENERATION_COMMITTED)
        await drained(watcher, outcomes)
        assert outcomes.messages == [], "the forged outcome reached a subscriber"
        assert errors.about(s.SPOT_WARNING) == [] and errors.about(s.SCALE_REQUEST) == []
        assert nc.is_connected, "a refused publish does not cost the connection"


async def test_the_publisher_cannot_read_the_control_plane(rig: Rig) -> None:
    async with connected(rig.url, *rig.login("publisher")) as (nc, errors):
        await nc.subscribe(s.RESIZE_REQUESTED_ANY)
        await refused(errors, "subscription", s.RESIZE_REQUESTED_ANY)
        await nc.publish(f"$JS.API.STREAM.PURGE.{s.STREAM_INGEST.name}", b"")
        await refused(errors, "publish", f"$JS.API.STREAM.PURGE.{s.STREAM_INGEST.name}")


# -- the subscriber -----------------------------------------------------------------------------------


async def test_the_subscriber_receives_generation_outcomes_but_cannot_publish_events(rig: Rig) -> None:
    await ingest_stream(rig)
    async with (
        connected(rig.url, *rig.login("coordinator")) as (coordinator, _),
        connected(rig.url, *rig.login("subscriber")) as (nc, errors),
        connected(rig.url, *rig.login("ingester")) as (ingester, _),
    ):
        outcomes = await Collector.on(nc, s.GENERATION_ABORTED)
        await delivered(coordinator, s.GENERATION_ABORTED, outcomes, nc, errors)
        before = (
            await ingester.jetstream(timeout=REQUEST_TIMEOUT_S).stream_info(s.STREAM_INGEST.name)
        ).state.messages
        await nc.publish(s.SPOT_WARNING, warning("sub-1"))
        await refused(errors, "publish", s.SPOT_WARNING)
        after = (
            await ingester.jetstream(timeout=REQUEST_TIMEOUT_S).stream_info(s.STREAM_INGEST.name)
        ).state.messages
        assert after == before, "the refused warning was stored"


async def test_the_subscriber_cannot_listen_to_worker_commands(rig: Rig) -> None:
    async with connected(rig.url, *rig.login("subscriber")) as (nc, errors):
        await nc.subscribe("liver.worker.cmd.>")
        await refused(errors, "subscription", "liver.worker.cmd.>")


# -- services and workers -----------------------------------------------------------------------------


CROSSINGS = [
    ("ingester", s.resize_requested("job-p"), s.GENERATION_COMMITTED),
    ("ingester", s.errors("ingester"), s.errors("coordinator")),
    ("topology", s.topology_planned("job-p"), s.transfer_planned("job-p")),
    ("topology", s.planning_failed("job-p"), s.topology_request("job-p")),
    ("transfer", s.transfer_planned("job-p"), s.topology_planned("job-p")),
    ("transfer", s.planning_failed("job-p"), s.topology_request("job-p")),
    ("coordinator", s.worker_command("job-p", "w1"), s.resize_requested("job-p")),
    ("coordinator", s.GENERATION_COMMITTED, s.SPOT_WARNING),
    ("worker", s.worker_status("job-p"), s.worker_command("job-p", "w2")),
    ("worker", s.worker_hello("job-p"), s.GENERATION_COMMITTED),
    ("operator", "$SRV.PING", s.SPOT_WARNING),
    ("operator", "$SRV.PING", s.worker_command("job-p", "w1")),
    ("operator", "$SRV.PING", f"$KV.{s.KV_GENERATIONS}.job-p"),
]
"""A user, a subject it publishes, and another role's subject it must not."""


@pytest.mark.parametrize(("role", "own", "foreign"), CROSSINGS, ids=[f"{r}-to-{f}" for r, _, f in CROSSINGS])
async def test_a_user_cannot_publish_another_roles_subjects(
    rig: Rig, role: str, own: str, foreign: str
) -> None:
    async with connected(rig.url, *rig.login(role)) as (nc, errors):
        await nc.publish(own, b"{}")
        await nc.publish(foreign, b"{}")
        await refused(errors, "publish", foreign)
        assert errors.about(own) == []


async def test_a_service_may_not_delete_streams_it_declares(rig: Rig) -> None:
    await ingest_stream(rig)
    async with connected(rig.url, *rig.login("ingester")) as (nc, errors):
        js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        await js.stream_info(s.STREAM_INGEST.name)
        await nc.publish(f"$JS.API.STREAM.DELETE.{s.STREAM_INGEST.name}", b"")
        await refused(errors, "publish", f"$JS.API.STREAM.DELETE.{s.STREAM_INGEST.name}")
        assert (await js.stream_info(s.STREAM_INGEST.name)).config.name == s.STREAM_INGEST.name


async def test_a_service_cannot_answer_discovery_for_another(rig: Rig) -> None:
    async with connected(rig.url, *rig.login("topology")) as (nc, errors):
        await nc.subscribe("$SRV.PING.liver-topology")
        await nc.subscribe("$SRV.PING.liver-coordinator")
        await refused(errors, "subscription", "$SRV.PING.liver-coordinator")
        assert errors.about("$SRV.PING.liver-topology") == []


async def test_a_worker_receives_its_commands_but_not_the_workers_reports(rig: Rig) -> None:
    async with (
        connected(rig.url, *rig.login("coordinator")) as (coordinator, _),
        connected(rig.url, *rig.login("worker")) as (nc, errors),
    ):
        commands = await Collector.on(nc, s.worker_command("job-p", "w1"))
        await delivered(coordinator, s.worker_command("job-p", "w1"), commands, nc, errors)
        await nc.subscribe(s.WORKER_STATUS_ANY)
        await refused(errors, "subscription", s.WORKER_STATUS_ANY)


async def test_slice_entries_are_written_by_the_transfer_planner_read_by_workers_purged_by_the_coordinator(
    rig: Rig,
) -> None:
    key, bucket = "job-p.1.s1.00000", s.KV_PLAN_SLICES
    async with (
        connected(rig.url, *rig.login("transfer")) as (transfer, transfer_errors),
        connected(rig.url, *rig.login("worker")) as (worker, errors),
        connected(rig.url, *rig.login("coordinator")) as (coordinator, coordinator_errors),
    ):
        kv = await b.ensure_kv(
            transfer.jetstream(timeout=REQUEST_TIMEOUT_S), bucket, description="test", ttl_s=60.0
        )
        await kv.put(key, b"slice")
        fetcher = PlanFetcher(worker.jetstream(timeout=REQUEST_TIMEOUT_S))
        assert await fetcher.fetch_entry(bucket, key, WAIT_S) == b"slice"
        await worker.publish(f"$KV.{bucket}.{key}", b"forged")
        await refused(errors, "publish", f"$KV.{bucket}.{key}")
        await worker.publish(f"$JS.API.STREAM.PURGE.KV_{bucket}", b"")
        await refused(errors, "publish", f"$JS.API.STREAM.PURGE.KV_{bucket}")
        assert await fetcher.fetch_entry(bucket, key, WAIT_S) == b"slice", "the forged write did not land"
        await coordinator.jetstream(timeout=REQUEST_TIMEOUT_S).purge_stream(
            f"KV_{bucket}", subject=f"$KV.{bucket}.job-p.1.s1.*"
        )
        # Waits its whole time for an entry that is gone: long enough for a first read to come back on a
        # busy machine (only a read that found nothing says "no such entry").
        with pytest.raises(PlanFetchError, match="no such entry"):
            await fetcher.fetch_entry(bucket, key, 3.0)
        assert transfer_errors == [] and coordinator_errors == []


async def test_the_server_logs_every_refusal_it_reports(rig: Rig) -> None:
    """Operators see refusals in the server's log too (the deployment test relies on it)."""
    async with connected(rig.url, *rig.login("publisher")) as (nc, errors):
        await nc.publish(s.GENERATION_ABORTED, b"{}")
        await refused(errors, "publish", s.GENERATION_ABORTED)

    # The server reports to the client first and then writes its log line: wait for the line.
    async def logged() -> bool:
        return 'Publish Violation - Subject "generation.aborted"' in rig.server.log_file.read_text()

    await eventually(logged, what="the refusal in the server's log")
    log = rig.server.log_file.read_text()
    assert 'Publish Violation - Subject "generation.aborted"' in log
    assert '"$G/user:publisher"' in log


# -- the commands people use under these roles --------------------------------------------------------


async def test_liver_publish_and_liver_watch_need_no_more_than_the_publisher_and_subscriber_roles(
    rig: Rig,
) -> None:
    await ingest_stream(rig)
    publisher = {USER_ENV: "publisher", PASSWORD_ENV: rig.passwords[password_var("publisher")]}
    subscriber = {USER_ENV: "subscriber", PASSWORD_ENV: rig.passwords[password_var("subscriber")]}
    event = SpotWarning(job_id="job-cli", event_id="cli-1", node="n1", provider="aws", notice_s=30.0)
    seq, duplicate = await publish_cmd.publish(rig.url, publisher, event)
    assert seq > 0 and not duplicate
    watcher = await connect_once(rig.url, subscriber, name="liver-watch")
    try:
        out, err, ready = io.StringIO(), io.StringIO(), asyncio.Event()
        task = asyncio.create_task(watch(watcher, job="job-cli", count=1, out=out, err=err, ready=ready))
        await asyncio.wait_for(ready.wait(), WAIT_S)
        # Committed once the watch runs: a watch skips outcomes from before its start (published again).
        outcome = GenerationCommitted(
            job_id="job-cli",
            event_id="cli-1",
            previous_generation=0,
            generation=1,
            layout=ParallelLayout(tp=1, pp=1, dp=1),
            placement=Placement((Device("n1", 0),)),
            started_at_iteration=3,
            downtime_s=0.1,
            bytes_moved=1,
            committed_at=datetime.now(UTC),
        )
        async with connected(rig.url, *rig.login("coordinator")) as (coordinator, errors):
            await coordinator.publish(s.GENERATION_COMMITTED, encode(outcome))
            await coordinator.flush()
            assert await asyncio.wait_for(task, WAIT_S)
            assert errors == []
    finally:
        await watcher.close()
    assert "committed  job job-cli  generation 1" in out.getvalue()


# -- the operator: liver status and liver watch --errors -------------------------------------------------

CLI_TIMEOUT_S = 120.0
"""A `liver` process importing LiveR on a busy two-core machine, plus its own waits."""


def cli_environment(rig: Rig, role: str, password: str | None = None) -> dict[str, str]:
    """What a person logged in as ``role`` has in the environment of a `liver` command."""
    return without_nats_settings(os.environ) | {
        URL_ENV: rig.url,
        USER_ENV: role,
        PASSWORD_ENV: rig.passwords[password_var(role)] if password is None else password,
    }


async def liver(environ: dict[str, str], *argv: str) -> tuple[int, str, str]:
    """``liver ARGV`` in a process of its own, as a person runs it: exit code, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "liver.cli.main",
        *argv,
        env=environ | {"PYTHONPATH": str(REPO)},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), CLI_TIMEOUT_S)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def in_process(environ: dict[str, str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    """``liver ARGV`` run here (:func:`main`) with ``environ``'s NATS settings."""
    for name in (URL_ENV, USER_ENV, PASSWORD_ENV):
        monkeypatch.setenv(name, environ[name])
    for name in ("NATS_TOKEN", "NATS_CREDS", TLS_CA_ENV):
        monkeypatch.delenv(name, raising=False)
    return main(list(argv))


@contextlib.asynccontextmanager
async def the_four_services(rig: Rig) -> AsyncIterator[None]:
    """The ingester, topology and transfer planners and coordinator, each as its own user with the
    settings compose gives it (hosted here, on this loop)."""
    async with contextlib.AsyncExitStack() as stack:
        for service in SERVICES:
            compose = service_environment(service, rig.passwords)
            environ = {
                k: v for k, v in compose.items() if not k.startswith(("NATS_", "LIVER_METRICS", "LIVER_LOG"))
            }
            environ |= {USER_ENV: service, PASSWORD_ENV: rig.passwords[password_var(service)]}
            created = serve_cmd.find(service).create_service(environ)
            await stack.enter_async_context(hosted(created, rig.url, environ))
        yield


def job_record(job: str) -> tuple[GenerationRecord, JobMembership]:
    layout, placement = ParallelLayout(tp=1, pp=1, dp=2), Placement((Device("n1", 0), Device("n2", 0)))
    record = GenerationRecord(
        job_id=job, writer="coord-p", generation=2, layout=layout, placement=placement, issued=2
    )
    workers = tuple(WorkerDevice(worker_id=f"w{i}", device=d) for i, d in enumerate(placement.devices))
    return record, JobMembership(job_id=job, generation=2, workers=workers)


def operator_refusals(rig: Rig, after: int) -> list[str]:
    """The server's refusals of the operator user among its violations after the first ``after``."""
    return [line for line in violations(rig.server.log_file)[after:] if '"$G/user:operator"' in line]


async def test_liver_status_as_the_operator_shows_the_four_services_and_the_jobs_records(rig: Rig) -> None:
    before = len(violations(rig.server.log_file))
    async with the_four_services(rig):
        record, membership = job_record("job-status")
        async with connected(rig.url, *rig.login("coordinator")) as (coordinator, errors):
            js = coordinator.jetstream(timeout=REQUEST_TIMEOUT_S)
            await (await js.key_value(s.KV_GENERATIONS)).put("job-status", encode(record))
            await (await js.key_value(s.KV_MEMBERSHIP)).put("job-status", encode(membership))
            assert errors == []
        code, out, err = await liver(cli_environment(rig, "operator"), "status", "--wait", "3")
    assert (code, err) == (0, ""), err
    assert out.startswith("services: "), out
    for service in SERVICES:
        assert f"liver-{service} x1" in out, out
    job = out[out.index("job job-status") :]
    assert "generation 2 (issued 2): TP1,PP1,DP2 on 2 devices, live; written by coord-p" in job
    assert "workers: 2 in generation 2, on 2 nodes" in job
    assert operator_refusals(rig, before) == []


async def test_liver_status_as_the_subscriber_is_one_line_naming_the_permission(rig: Rig) -> None:
    code, out, err = await liver(cli_environment(rig, "subscriber"), "status")
    assert (code, out) == (1, "")
    assert err == (
        "liver status: error: the NATS user 'subscriber' may not publish to $SRV.PING "
        "(needs the operator role)\n"
    ), err


def test_liver_status_as_a_service_is_one_line_naming_the_permission(
    rig: Rig, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service may ping only itself: its user is not enough for liver status."""
    assert in_process(cli_environment(rig, "coordinator"), monkeypatch, "status") == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "liver status: error: the NATS user 'coordinator' may not publish to $SRV.PING "
        "(needs the operator role)\n"
    )


def test_a_wrong_password_reads_as_refused_credentials(
    rig: Rig, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert in_process(cli_environment(rig, "operator", password="pwrong"), monkeypatch, "status") == 1
    _, err = capsys.readouterr()
    assert err.startswith(
        f"liver status: error: the server at {rig.url} refused the credentials of the NATS user 'operator' "
        "(authorization violation)"
    ), err
    assert "no servers available" not in err


def test_liver_watch_errors_as_the_subscriber_is_one_line_naming_the_permission(
    rig: Rig, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The subscriber role receives generation outcomes (nats.conf); rejected input is the operator's."""
    environ = cli_environment(rig, "subscriber")
    assert in_process(environ, monkeypatch, "watch", "--errors", "--count", "1", "--timeout", "5") == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "liver watch: error: the NATS user 'subscriber' may not subscribe to liver.errors.* "
        "(needs the operator role)\n"
    )


async def test_the_operator_watches_every_services_rejected_input(rig: Rig) -> None:
    before = len(violations(rig.server.log_file))
    operator = cli_environment(rig, "operator")
    watcher = await connect_once(rig.url, operator, name="liver-watch")
    try:
        out, err, ready = io.StringIO(), io.StringIO(), asyncio.Event()
        task = asyncio.create_task(watch(watcher, errors=True, count=1, out=out, err=err, ready=ready))
        await asyncio.wait_for(ready.wait(), WAIT_S)
        rejected = ErrorEvent(
            source="ingester",
            subject=s.SPOT_WARNING,
            field="$.node",
            message="bad node",
            payload="{}",
            payload_encoding="utf-8",
            payload_size=2,
            payload_truncated=False,
            at=datetime.now(UTC),
            job_id="job-op",
        )
        async with connected(rig.url, *rig.login("ingester")) as (ingester, errors):
            await ingester.publish(s.errors("ingester"), encode(rejected))
            await ingester.flush()
            assert await asyncio.wait_for(task, WAIT_S)
            assert errors == []
    finally:
        await watcher.close()
    assert "rejected   by ingester on spot.warning  job job-op  $.node: bad node" in out.getvalue()
    assert operator_refusals(rig, before) == []
