"""The EC2 notice source and the agent, against a local server that speaks IMDSv2 as AWS documents it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from bus_helpers import client, stored
from local_http import LocalHttp, QuietHandler, nothing_listening, serving

from liver.cli.main import main
from liver.notice.agent import NoticeAgent, PollOutcome
from liver.notice.aws import ACTION_PATH, REBALANCE_PATH, TOKEN_PATH, AwsSpotNotices
from liver.notice.model import NoticeKind, NoticeSourceError
from liver.notice.publish import publish_event
from liver.services import bus as b
from liver.shared import subjects as s
from liver.shared.codec import decode
from liver.shared.messages import SpotWarning, WarningKind
from liver.shared.nats_server import NatsServer

WHEN = "2026-12-04T16:02:00Z"
RECOMMENDED = "2026-12-04T15:50:00Z"


class FakeImds:
    """IMDSv2 on loopback: tokens by PUT, the instance action by GET with a valid token."""

    def __init__(self) -> None:
        self.action: bytes | None = None  # the body of spot/instance-action; None: 404
        self.rebalance: bytes | None = None  # the body of events/recommendations/rebalance; None: 404
        self.valid: set[str] = set()
        self.issued = 0
        self.requests: list[tuple[str, str]] = []
        fake = self

        class Handler(QuietHandler):
            def do_PUT(self) -> None:
                fake.requests.append(("PUT", self.path))
                if self.path != TOKEN_PATH or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self.answer(400)
                    return
                fake.issued += 1
                token = f"token-{fake.issued}"
                fake.valid.add(token)
                self.answer(200, token.encode())

            def do_GET(self) -> None:
                fake.requests.append(("GET", self.path))
                body = {ACTION_PATH: fake.action, REBALANCE_PATH: fake.rebalance}.get(self.path)
                if self.headers.get("X-aws-ec2-metadata-token") not in fake.valid:
                    self.answer(401)
                elif body is None:
                    self.answer(404)
                else:
                    self.answer(200, body)

        self.http = LocalHttp(Handler)
        self.endpoint = self.http.endpoint

    def schedule(self, action: str = "terminate", time: str = WHEN) -> None:
        self.action = json.dumps({"action": action, "time": time}).encode()

    def recommend_rebalance(self, time: str = RECOMMENDED) -> None:
        self.rebalance = json.dumps({"noticeTime": time}).encode()

    def expire_tokens(self) -> None:
        self.valid.clear()


@pytest.fixture
def imds() -> Iterator[FakeImds]:
    fake = FakeImds()
    with serving(fake.http):
        yield fake


# -- the source ----------------------------------------------------------------------------------------


def test_no_scheduled_interruption_is_no_notice(imds: FakeImds) -> None:
    assert AwsSpotNotices(imds.endpoint).poll() is None


def test_a_scheduled_termination_is_a_notice_with_its_deadline(imds: FakeImds) -> None:
    imds.schedule()
    notice = AwsSpotNotices(imds.endpoint).poll()
    assert notice is not None
    assert (notice.provider, notice.kind) == ("aws", NoticeKind.TERMINATION)
    assert notice.deadline == datetime(2026, 12, 4, 16, 2, tzinfo=UTC)


def test_a_stop_or_hibernation_is_a_notice_too(imds: FakeImds) -> None:
    imds.schedule("hibernate")
    notice = AwsSpotNotices(imds.endpoint).poll()
    assert notice is not None and notice.kind == NoticeKind.STOP


def test_the_same_interruption_read_twice_is_the_same_event(imds: FakeImds) -> None:
    imds.schedule()
    source = AwsSpotNotices(imds.endpoint)
    first, second = source.poll(), source.poll()
    assert first is not None and second is not None
    assert first.event_id("node-a") == second.event_id("node-a") == "aws-node-a-terminate-20261204T160200Z"
    assert first.event_id("node-b") != first.event_id("node-a")


def test_a_rebalance_recommendation_is_an_undated_notice_of_its_own(imds: FakeImds) -> None:
    imds.recommend_rebalance()
    notice = AwsSpotNotices(imds.endpoint).poll()
    assert notice is not None
    assert (notice.kind, notice.deadline) == (NoticeKind.REBALANCE, None)
    assert notice.event_id("node-a") == "aws-node-a-rebalance-20261204T155000Z"
    warning = notice.warning("job-n", "node-a")
    assert (warning.warning_kind, warning.notice_s, warning.deadline) == (WarningKind.REBALANCE, None, None)


def test_a_scheduled_interruption_supersedes_the_recommendation(imds: FakeImds) -> None:
    imds.recommend_rebalance()
    imds.schedule()
    notice = AwsSpotNotices(imds.endpoint).poll()
    assert notice is not None and notice.kind == NoticeKind.TERMINATION


def test_recommendations_are_not_read_when_switched_off(imds: FakeImds) -> None:
    imds.recommend_rebalance()
    assert AwsSpotNotices(imds.endpoint, rebalance=False).poll() is None
    assert ("GET", REBALANCE_PATH) not in imds.requests


@pytest.mark.parametrize("body", [b"[]", b'{"noticeTime": "soon"}', b'{"noticeTime": "2026-12-04T15:50:00"}'])
def test_an_answer_that_is_not_a_recommendation_is_a_source_error(imds: FakeImds, body: bytes) -> None:
    imds.rebalance = body
    with pytest.raises(NoticeSourceError, match="rebalance"):
        AwsSpotNotices(imds.endpoint).poll()


def test_a_token_is_taken_once_and_reused(imds: FakeImds) -> None:
    source = AwsSpotNotices(imds.endpoint)
    source.poll()
    source.poll()
    assert imds.issued == 1


def test_an_expired_token_is_renewed_and_the_read_repeated(imds: FakeImds) -> None:
    source = AwsSpotNotices(imds.endpoint)
    assert source.poll() is None  # with the first token
    imds.schedule()
    imds.expire_tokens()
    notice = source.poll()
    assert notice is not None
    assert imds.issued == 2


def test_an_unreachable_endpoint_is_a_source_error_naming_it() -> None:
    with pytest.raises(NoticeSourceError, match="unreachable"):
        AwsSpotNotices(nothing_listening(), timeout_s=1.0).poll()


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"action": "reboot", "time": "2026-12-04T16:02:00Z"}', b'{"action": "terminate"}'],
)
def test_an_answer_that_is_not_an_instance_action_is_a_source_error(imds: FakeImds, body: bytes) -> None:
    imds.action = body
    with pytest.raises(NoticeSourceError, match="not an instance action"):
        AwsSpotNotices(imds.endpoint).poll()


def test_a_time_without_a_zone_is_a_source_error(imds: FakeImds) -> None:
    imds.schedule(time="2026-12-04T16:02:00")
    with pytest.raises(NoticeSourceError, match="time zone"):
        AwsSpotNotices(imds.endpoint).poll()


# -- the agent --------------------------------------------------------------------------------------------


class Sent:
    def __init__(self, fail: int = 0) -> None:
        self.events: list[Any] = []
        self.fail = fail

    async def __call__(self, event: Any) -> None:
        if self.fail:
            self.fail -= 1
            raise TimeoutError("the bus did not answer")
        self.events.append(event)


async def test_the_agent_publishes_a_notice_once_however_often_it_polls(imds: FakeImds) -> None:
    sent = Sent()
    agent = NoticeAgent(AwsSpotNotices(imds.endpoint), job_id="job-n", node="node-a", publish=sent)
    assert await agent.poll_once() == PollOutcome.NONE
    imds.schedule()
    outcomes = [await agent.poll_once() for _ in range(3)]
    assert outcomes == [PollOutcome.PUBLISHED, PollOutcome.ALREADY_PUBLISHED, PollOutcome.ALREADY_PUBLISHED]
    (event,) = sent.events
    assert isinstance(event, SpotWarning)
    assert (event.job_id, event.node, event.provider) == ("job-n", "node-a", "aws")
    assert event.deadline == datetime(2026, 12, 4, 16, 2, tzinfo=UTC)


async def test_the_agent_publishes_the_recommendation_then_the_interruption_as_two_events(
    imds: FakeImds,
) -> None:
    sent = Sent()
    agent = NoticeAgent(AwsSpotNotices(imds.endpoint), job_id="job-n", node="node-a", publish=sent)
    imds.recommend_rebalance()
    assert await agent.poll_once() == PollOutcome.PUBLISHED
    imds.schedule()
    assert await agent.poll_once() == PollOutcome.PUBLISHED
    assert [(e.warning_kind, e.deadline is None) for e in sent.events] == [
        (WarningKind.REBALANCE, True),
        (WarningKind.INTERRUPTION, False),
    ]


async def test_a_failed_publish_is_retried_at_the_next_poll(imds: FakeImds) -> None:
    imds.schedule()
    sent = Sent(fail=1)
    agent = NoticeAgent(AwsSpotNotices(imds.endpoint), job_id="job-n", node="node-a", publish=sent)
    assert await agent.poll_once() == PollOutcome.PUBLISH_FAILED
    assert await agent.poll_once() == PollOutcome.PUBLISHED
    assert len(sent.events) == 1


async def test_a_source_that_fails_does_not_stop_the_agent(imds: FakeImds) -> None:
    imds.action = b"garbage"
    sent = Sent()
    agent = NoticeAgent(AwsSpotNotices(imds.endpoint), job_id="job-n", node="node-a", publish=sent)
    assert await agent.poll_once() == PollOutcome.SOURCE_FAILED
    imds.schedule()
    assert await agent.poll_once() == PollOutcome.PUBLISHED


@pytest.mark.slow
async def test_a_restarted_agent_sends_the_notice_again_and_the_stream_keeps_one(
    imds: FakeImds, nats_server: NatsServer
) -> None:
    imds.schedule()
    async with client(nats_server.url) as (nc, js):
        await b.ensure_stream(js, s.STREAM_INGEST)

        async def send(event: Any) -> None:
            await publish_event(nc, event)

        for _ in range(2):  # two agent lifetimes: each forgets what the other sent
            agent = NoticeAgent(
                AwsSpotNotices(imds.endpoint), job_id="job-restart", node="node-a", publish=send
            )
            assert await agent.poll_once() == PollOutcome.PUBLISHED
        kept = [
            w
            for m in await stored(js, s.STREAM_INGEST.name, s.SPOT_WARNING)
            if (w := decode(m.data, SpotWarning)).job_id == "job-restart"
        ]
    assert [w.event_id for w in kept] == ["aws-node-a-terminate-20261204T160200Z"]


# -- the command -----------------------------------------------------------------------------------------


def test_notice_once_in_dry_run_prints_the_event(imds: FakeImds, capsys: pytest.CaptureFixture[str]) -> None:
    imds.schedule()
    argv = ["notice", "--source", "aws", "--endpoint", imds.endpoint, "--job", "j", "--node", "n1"]
    assert main([*argv, "--once", "--dry-run"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    warning = decode(out.encode(), SpotWarning)
    assert (warning.job_id, warning.node, warning.event_id) == (
        "j",
        "n1",
        "aws-n1-terminate-20261204T160200Z",
    )


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--node", "n1"), "--job"),
        (("--job", "j"), "--node"),
        (("--job", "a.b", "--node", "n1"), "--job"),
        (("--job", "j", "--node", "bad node"), "--node"),
        (("--job", "j", "--node", "n1", "--interval", "0"), "--interval"),
    ],
)
def test_notice_names_a_bad_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...], flag: str
) -> None:
    monkeypatch.delenv("LIVER_JOB_ID", raising=False)
    monkeypatch.delenv("LIVER_NODE", raising=False)
    assert main(["notice", "--source", "aws", *argv, "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(f"liver notice: error: {flag}")


def test_notice_takes_job_and_node_from_the_environment(
    imds: FakeImds, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    imds.schedule()
    monkeypatch.setenv("LIVER_JOB_ID", "env-job")
    monkeypatch.setenv("LIVER_NODE", "env-node")
    assert main(["notice", "--source", "aws", "--endpoint", imds.endpoint, "--once", "--dry-run"]) == 0
    warning = decode(capsys.readouterr().out.strip().splitlines()[-1].encode(), SpotWarning)
    assert (warning.job_id, warning.node) == ("env-job", "env-node")


def test_notice_once_exits_1_when_the_source_cannot_be_read(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["notice", "--source", "aws", "--endpoint", nothing_listening(), "--job", "j", "--node", "n1"]
    assert asyncio.run(asyncio.to_thread(main, [*argv, "--once", "--dry-run"])) == 1


def test_an_endpoint_that_never_answers_is_a_source_error_after_the_timeout() -> None:
    import socket

    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(NoticeSourceError, match="unreachable"):
            AwsSpotNotices(endpoint, timeout_s=0.3).poll()
