"""``liver publish`` and ``liver watch``: what a person types to feed and follow a job."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from bus_helpers import WAIT_S, Collector, client, put_membership, running, stored

from liver.cli import publish_cmd, status_cmd
from liver.cli.bus_access import BusUnreachable, connect_once
from liver.cli.main import build_parser, main
from liver.cli.status_cmd import JobStatus, Status, render, status
from liver.cli.watch_cmd import watch
from liver.services import bus as b
from liver.services.coordinator.record import (
    GenerationRecord,
    PendingHandoff,
    PendingPhase,
    Trigger,
    TriggerSource,
)
from liver.services.ingester.service import Ingester
from liver.shared import subjects as s
from liver.shared.codec import decode, encode
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.messages import (
    AbortOutcome,
    ErrorEvent,
    GenerationAborted,
    GenerationCommitted,
    HandoffPhase,
    ResizeRequested,
    ScaleRequest,
    SpotWarning,
    WarningKind,
)
from liver.shared.nats_server import NatsServer

NOW = datetime(2026, 12, 4, 16, 0, tzinfo=UTC)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


UNUSED_URL = f"nats://127.0.0.1:{_closed_port()}"  # nothing listens: a command that connected would fail


def event_of(*argv: str) -> tuple[str, Any]:
    args = build_parser(["publish", *argv]).parse_args(["publish", *argv])
    return publish_cmd.build_event(args)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- building and checking an event --------------------------------------------------------------------


def test_a_spot_warning_is_built_from_its_flags() -> None:
    subject, event = event_of("spot-warning", "--job", "job-7", "--node", "n1", "--notice", "120")
    assert subject == s.SPOT_WARNING
    assert isinstance(event, SpotWarning)
    assert (event.job_id, event.node, event.notice_s, event.provider) == ("job-7", "n1", 120.0, "manual")
    assert event.event_id.startswith("cli-")


def test_a_rebalance_recommendation_needs_no_notice() -> None:
    _, event = event_of("spot-warning", "--job", "j", "--node", "n1", "--provider", "aws", "--rebalance")
    assert isinstance(event, SpotWarning)
    assert (event.warning_kind, event.notice_s, event.deadline) == (WarningKind.REBALANCE, None, None)


def test_a_deadline_is_read_as_an_aware_time() -> None:
    _, event = event_of(
        "spot-warning", "--job", "j", "--node", "n1", "--deadline", "2026-12-04T17:00:00+01:00"
    )
    assert event.deadline == datetime(2026, 12, 4, 16, 0, tzinfo=UTC)


def test_a_scale_request_names_nodes_to_add_with_their_devices_and_nodes_to_remove() -> None:
    subject, event = event_of(
        "scale-request",
        "--job",
        "j",
        "--event-id",
        "e-1",
        "--reason",
        "more capacity",
        "--add",
        "n9:0,1",
        "--remove",
        "n1",
    )
    assert subject == s.SCALE_REQUEST
    assert isinstance(event, ScaleRequest)
    assert [d for a in event.add for d in a.as_devices()] == [Device("n9", 0), Device("n9", 1)]
    assert (event.remove, event.event_id) == (("n1",), "e-1")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("spot-warning", "--job", "j", "--node", "n1"), "--notice"),  # neither notice nor deadline
        (("spot-warning", "--job", "j", "--node", "n1", "--notice", "-5"), "--notice"),
        (("spot-warning", "--job", "a.b", "--node", "n1", "--notice", "5"), "--job"),
        (("spot-warning", "--job", "j", "--node", "bad node", "--notice", "5"), "--node"),
        (("spot-warning", "--job", "j", "--node", "n1", "--deadline", "tomorrow"), "--deadline"),
        (("spot-warning", "--job", "j", "--node", "n1", "--deadline", "2026-12-04T17:00:00"), "--deadline"),
        (("scale-request", "--job", "j", "--reason", "r"), "--target-devices"),  # nothing asked
        (("scale-request", "--job", "j", "--reason", "r", "--add", "n9"), "--add"),
        (("scale-request", "--job", "j", "--reason", "r", "--add", "n9:0,0"), "--add"),
        (("scale-request", "--job", "j", "--reason", "r", "--target-devices", "0"), "--target-devices"),
    ],
)
def test_a_bad_flag_is_named_before_anything_is_sent(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], flag: str
) -> None:
    code, out, err = cli(capsys, "publish", *argv, "--url", UNUSED_URL)
    assert code == 2, err
    assert out == ""
    assert err.startswith(f"liver publish: error: {flag}"), err


def test_without_a_server_url_the_command_says_how_to_give_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)
    code, _, err = cli(capsys, "publish", "spot-warning", "--job", "j", "--node", "n1", "--notice", "5")
    assert code == 2
    assert "--url" in err and "NATS_URL" in err


def test_an_unreachable_server_is_an_error_not_a_hang(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(
        capsys, "publish", "spot-warning", "--job", "j", "--node", "n1", "--notice", "5", "--url", UNUSED_URL
    )
    assert code == 1
    assert f"cannot connect to {UNUSED_URL}" in err


async def test_connecting_to_nothing_raises_bus_unreachable() -> None:
    with pytest.raises(BusUnreachable):
        await connect_once(UNUSED_URL, {}, name="liver-test")


# -- publishing ------------------------------------------------------------------------------------------


async def declare_ingest_stream(url: str) -> None:
    """LIVER_INGEST, declared as the ingester declares it on start."""
    async with client(url) as (_, js):
        await b.ensure_stream(js, s.STREAM_INGEST)


@pytest.mark.slow
def test_a_published_warning_is_stored_once_however_often_it_is_sent(
    nats_server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncio.run(declare_ingest_stream(nats_server.url))
    argv = ("publish", "spot-warning", "--job", "cli-once", "--event-id", "e-1", "--node", "n1")
    first = cli(capsys, *argv, "--notice", "90", "--url", nats_server.url, "--json")
    second = cli(capsys, *argv, "--notice", "90", "--url", nats_server.url, "--json")
    assert first[0] == second[0] == 0
    a, b = json.loads(first[1]), json.loads(second[1])
    assert (a["duplicate"], b["duplicate"]) == (False, True)
    assert a["stream_sequence"] == b["stream_sequence"]

    async def kept() -> list[SpotWarning]:
        async with client(nats_server.url) as (_, js):
            msgs = await stored(js, s.STREAM_INGEST.name, s.SPOT_WARNING)
        return [w for m in msgs if (w := decode(m.data, SpotWarning)).job_id == "cli-once"]

    (warning,) = asyncio.run(kept())
    assert (warning.event_id, warning.node, warning.notice_s) == ("e-1", "n1", 90.0)


@pytest.mark.slow
def test_a_server_without_the_ingest_stream_is_an_error_that_says_what_to_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with NatsServer() as bare:
        capsys.readouterr()  # the server's own start line
        argv = ("publish", "spot-warning", "--job", "j", "--node", "n1", "--notice", "5")
        code, out, err = cli(capsys, *argv, "--url", bare.url)
    assert (code, out) == (1, "")
    assert f"start the ingester once (it declares {s.STREAM_INGEST.name})" in err


@pytest.mark.slow
async def test_the_ingester_turns_a_published_warning_into_a_resize_request(nats_server: NatsServer) -> None:
    async with running(Ingester(), nats_server.url), client(nats_server.url) as (nc, js):
        await put_membership(js, "cli-ingest", (Device("n1", 0), Device("n2", 0)), generation=2)
        resized = await Collector.on(nc, s.resize_requested("cli-ingest"))
        args = build_parser(["publish"]).parse_args(
            ["publish", "spot-warning", "--job", "cli-ingest", "--node", "n2", "--notice", "60"]
        )
        _, event = publish_cmd.build_event(args)
        await publish_cmd.publish(nats_server.url, {}, event)
        request = await resized.one(ResizeRequested)
    assert (request.job_id, request.event_id, request.generation) == ("cli-ingest", event.event_id, 2)
    assert [d.node for d in request.remove] == ["n2"]


# -- watching --------------------------------------------------------------------------------------------


def committed(job: str, generation: int = 1, at: datetime = NOW) -> GenerationCommitted:
    layout = ParallelLayout(tp=1, pp=1, dp=2)
    return GenerationCommitted(
        job_id=job,
        event_id="e-1",
        previous_generation=generation - 1,
        generation=generation,
        layout=layout,
        placement=Placement((Device("n1", 0), Device("n2", 0))),
        started_at_iteration=40,
        downtime_s=0.25,
        bytes_moved=2 * 10**8,
        committed_at=at,
    )


def aborted(job: str) -> GenerationAborted:
    return GenerationAborted(
        job_id=job,
        event_id="e-2",
        generation=2,
        active_generation=1,
        phase="prepare",
        reason="a worker was not ready by the deadline",
        outcome="kept_old_world",
        aborted_at=NOW,
    )


def rejection(job: str) -> ErrorEvent:
    return ErrorEvent(
        source="ingester",
        subject=s.SPOT_WARNING,
        field="$.node",
        message="bad node",
        payload="{}",
        payload_encoding="utf-8",
        payload_size=2,
        payload_truncated=False,
        at=NOW,
        job_id=job,
    )


async def watched(
    url: str, sends: list[tuple[str, bytes]] | list[tuple[str, bytes, dict[str, str]]], **options: Any
) -> tuple[bool, str, str]:
    """Run :func:`watch` until its subscriptions are live, publish ``sends`` (with headers, if given),
    return what it printed."""
    out, err = io.StringIO(), io.StringIO()
    ready = asyncio.Event()
    options.setdefault("since", NOW)  # the outcomes here are all at NOW
    async with client(url) as (nc, _):
        task = asyncio.create_task(watch(nc, out=out, err=err, ready=ready, **options))
        await asyncio.wait_for(ready.wait(), WAIT_S)
        for subject, data, *headers in sends:
            await nc.publish(subject, data, headers=headers[0] if headers else None)
        await nc.flush()
        reached = await asyncio.wait_for(task, WAIT_S)
    return reached, out.getvalue(), err.getvalue()


@pytest.mark.slow
async def test_watch_prints_one_line_per_outcome_of_the_job_it_follows(nats_server: NatsServer) -> None:
    sends = [
        (s.GENERATION_COMMITTED, encode(committed("other-job"))),
        (s.GENERATION_COMMITTED, encode(committed("watched"))),
        (s.GENERATION_ABORTED, encode(aborted("watched"))),
    ]
    reached, out, _ = await watched(nats_server.url, sends, job="watched", count=2)
    assert reached
    first, second = out.splitlines()
    assert "committed  job watched  generation 1 (from 0)  TP1,PP1,DP2 on 2 devices" in first
    assert "downtime 0.250 s  moved 200.0 MB" in first
    assert "aborted    job watched  generation 2 (active 1)  in prepare: kept_old_world" in second


@pytest.mark.slow
async def test_watch_prints_an_outcome_published_again_under_its_message_id_once(
    nats_server: NatsServer,
) -> None:
    first = committed("again", generation=4)
    msg_id = {s.HEADER_MSG_ID: s.generation_msg_id("again", 4)}
    sends = [
        (s.GENERATION_COMMITTED, encode(first), msg_id),  # the coordinator publishes the commit,
        (s.GENERATION_COMMITTED, encode(first), msg_id),  # restarts, and publishes it again
        (s.GENERATION_COMMITTED, encode(committed("again", generation=5)), {}),
    ]
    reached, out, _ = await watched(nats_server.url, sends, job="again", count=2)
    assert reached
    assert [line.split("generation ")[1][:1] for line in out.splitlines()] == ["4", "5"]


@pytest.mark.slow
async def test_watch_does_not_count_an_outcome_from_before_its_start_published_again(
    nats_server: NatsServer,
) -> None:
    """A restarted coordinator publishes its last outcome again, message id and time unchanged: a watch
    started since then waits for the next outcome instead of returning that copy."""
    earlier = committed("restart", generation=6, at=datetime.now(UTC) - timedelta(minutes=5))
    out, err, ready = io.StringIO(), io.StringIO(), asyncio.Event()
    async with client(nats_server.url) as (nc, _):
        task = asyncio.create_task(watch(nc, job="restart", count=1, out=out, err=err, ready=ready))
        await asyncio.wait_for(ready.wait(), WAIT_S)
        later = committed("restart", generation=7, at=datetime.now(UTC))
        again = {s.HEADER_MSG_ID: s.generation_msg_id("restart", 6)}
        await nc.publish(s.GENERATION_COMMITTED, encode(earlier), headers=again)
        await nc.publish(s.GENERATION_COMMITTED, encode(later))
        await nc.flush()
        assert await asyncio.wait_for(task, WAIT_S)
    (line,) = out.getvalue().splitlines()
    assert "job restart  generation 7" in line, line


@pytest.mark.slow
async def test_watch_in_json_prints_decodable_messages(nats_server: NatsServer) -> None:
    sends = [(s.GENERATION_COMMITTED, encode(committed("json-job", generation=3)))]
    _, out, _ = await watched(nats_server.url, sends, job="json-job", count=1, as_json=True)
    (line,) = out.splitlines()
    obj = json.loads(line)
    assert obj["subject"] == s.GENERATION_COMMITTED
    assert decode(json.dumps(obj["message"]).encode(), GenerationCommitted) == committed("json-job", 3)


@pytest.mark.slow
async def test_watch_skips_an_invalid_message_with_a_note_and_carries_on(nats_server: NatsServer) -> None:
    sends = [
        (s.GENERATION_COMMITTED, b"not json"),
        (s.GENERATION_COMMITTED, encode(committed("after-bad"))),
    ]
    reached, out, err = await watched(nats_server.url, sends, job="after-bad", count=1)
    assert reached and "job after-bad" in out
    assert "skipped an invalid message on generation.committed" in err


@pytest.mark.slow
async def test_watch_shows_rejected_input_only_when_asked(nats_server: NatsServer) -> None:
    sends = [
        (s.errors("ingester"), encode(rejection("err-job"))),
        (s.GENERATION_COMMITTED, encode(committed("err-job"))),
    ]
    _, without, _ = await watched(nats_server.url, sends, job="err-job", count=1)
    assert "rejected" not in without and "committed" in without
    _, with_errors, _ = await watched(nats_server.url, sends, job="err-job", count=2, errors=True)
    first, second = with_errors.splitlines()
    assert "rejected   by ingester on spot.warning  job err-job  $.node: bad node" in first
    assert "committed" in second


@pytest.mark.slow
async def test_watch_returns_at_its_timeout_and_says_whether_the_count_was_met(
    nats_server: NatsServer,
) -> None:
    reached, out, _ = await watched(nats_server.url, [], job="quiet", count=1, timeout_s=0.2)
    assert (reached, out) == (False, "")
    reached, _, _ = await watched(nats_server.url, [], job="quiet", timeout_s=0.2)
    assert reached


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(("--count", "0"), "--count"), (("--timeout", "-1"), "--timeout"), (("--job", "a.b"), "--job")],
)
def test_watch_names_a_bad_flag(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], flag: str) -> None:
    code, _, err = cli(capsys, "watch", *argv, "--url", UNUSED_URL)
    assert code == 2
    assert err.startswith(f"liver watch: error: {flag}"), err


# -- status ----------------------------------------------------------------------------------------------


def record(job: str) -> GenerationRecord:
    layout = ParallelLayout(tp=1, pp=1, dp=2)
    trigger = Trigger(
        event_id="e-9", kind=TriggerSource.SPOT_WARNING, received_at=NOW, remove=(Device("n2", 0),)
    )
    return GenerationRecord(
        job_id=job,
        writer="coord-a",
        generation=2,
        layout=layout,
        placement=Placement((Device("n1", 0), Device("n2", 0))),
        issued=3,
        pending=PendingHandoff(
            generation=3,
            phase=PendingPhase.PREPARE,
            event_id="e-9",
            triggers=(trigger,),
            began_at=NOW,
            deadline=NOW,
        ),
        last_outcome=committed(job, generation=2),
    )


@pytest.mark.slow
async def test_status_shows_the_services_that_answer_and_where_each_job_stands(
    nats_server: NatsServer,
) -> None:
    async with running(Ingester(), nats_server.url), client(nats_server.url) as (nc, js):
        kv = await b.ensure_kv(js, s.KV_GENERATIONS, description="test")
        await kv.put("st-job", encode(record("st-job")))
        await kv.put("st-broken", b"{}")
        await put_membership(js, "st-job", (Device("n1", 0), Device("n2", 0)), generation=2)
        st = await status(nc, None, wait_s=0.5)
    text = render(st)
    assert "liver-ingester x1" in text
    job = text[text.index("job st-job") :]
    assert "generation 2 (issued 3): TP1,PP1,DP2 on 2 devices, live; written by coord-a" in job
    assert "handoff in flight: generation 3 in prepare, event e-9" in job
    assert "last outcome: generation 2 committed" in job
    assert "workers: 2 in generation 2, on 2 nodes" in job
    broken = text[text.index("job st-broken") : text.index("job st-job")]
    assert "generation record does not decode" in broken


@pytest.mark.slow
async def test_status_of_one_job_reads_only_that_job(nats_server: NatsServer) -> None:
    async with client(nats_server.url) as (nc, js):
        kv = await b.ensure_kv(js, s.KV_GENERATIONS, description="test")
        await kv.put("st-one", encode(record("st-one")))
        st = await status(nc, "st-one", wait_s=0.1)
        unknown = await status(nc, "st-nobody", wait_s=0.1)
    assert [j.job_id for j in st.jobs] == ["st-one"]
    assert st.jobs[0].record == record("st-one")
    assert "no generation record (no coordinator has started this job)" in render(unknown)


def fallback(job: str, checkpoint: str | None) -> GenerationRecord:
    """The record after generation 3's handoff failed with the old world gone."""
    lost = GenerationAborted(
        job_id=job,
        event_id="e-9",
        generation=3,
        active_generation=2,
        phase=HandoffPhase.SWITCH,
        reason="worker w1 on n2:0 failed: the old world is gone",
        outcome=AbortOutcome.CHECKPOINT_FALLBACK,
        aborted_at=NOW,
        checkpoint=checkpoint,
    )
    layout = ParallelLayout(tp=1, pp=1, dp=2)
    placement = Placement((Device("n1", 0), Device("n2", 0)))
    return GenerationRecord(
        job_id=job,
        writer="coord-a",
        generation=2,
        layout=layout,
        placement=placement,
        issued=3,
        live=False,
        last_outcome=lost,
    )


def test_status_after_a_fallback_claims_no_checkpoint_it_was_not_told_of() -> None:
    text = render(Status(services=[], jobs=[JobStatus(job_id="fb", record=fallback("fb", None))]))
    assert "restarting from a checkpoint" not in text
    assert "generation 3 fell back: its workers restart from their latest checkpoint if they keep one" in text
    with_one = render(Status(services=[], jobs=[JobStatus(job_id="fb", record=fallback("fb", "/ckpt/40"))]))
    assert "not live (generation 3 fell back; restarting from checkpoint /ckpt/40)" in with_one


class SilentServer:
    """Speaks just enough NATS to be connected to (its INFO, a PONG to each PING) and answers nothing
    else: every request to it goes unanswered."""

    INFO = (
        b'INFO {"server_id":"silent","version":"2.11.0","proto":1,"max_payload":1048576,"headers":true}\r\n'
    )

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.sendall(self.INFO)
            pending = b""
            while data := conn.recv(65536):
                *lines, pending = (pending + data).split(b"\r\n")
                for line in lines:
                    if line == b"PING":
                        conn.sendall(b"PONG\r\n")


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    try:
        yield server
    finally:
        server.sock.close()


@pytest.mark.slow
def test_status_against_a_server_that_does_not_answer_is_one_line_naming_the_wait(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, silent_server: SilentServer
) -> None:
    monkeypatch.setattr(status_cmd, "REQUEST_TIMEOUT_S", 1.0)
    code, out, err = cli(capsys, "status", "--wait", "0.1", "--url", silent_server.url)
    assert (code, out) == (1, "")
    assert err == "liver status: error: no answer from the server within 1 s\n"


@pytest.mark.parametrize(("argv", "flag"), [(("--wait", "0"), "--wait"), (("--job", "a b"), "--job")])
def test_status_names_a_bad_flag(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], flag: str
) -> None:
    code, _, err = cli(capsys, "status", *argv, "--url", UNUSED_URL)
    assert code == 2
    assert err.startswith(f"liver status: error: {flag}"), err
