"""The publish path of ``liver notice`` (and ``liver publish``) when nothing keeps the event, and what a
dry run logs: no server, a JetStream context that fails as a server without the stream makes it fail."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta
from typing import Any

import nats.errors
import pytest
import structlog

from liver.notice.agent import NoticeAgent, PollOutcome
from liver.notice.model import Notice, NoticeKind
from liver.notice.publish import publish_event
from liver.shared import subjects as s
from liver.shared.errors import BusError
from liver.shared.messages import SpotWarning

WARNING = SpotWarning(job_id="j", event_id="e-1", node="vm-1", provider="gcp", notice_s=30.0)
FIX = f"start the ingester once (it declares {s.STREAM_INGEST.name})"


class FailingJetStream:
    """``nc.jetstream()`` of a server where no stream takes the subject."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def publish(self, *_: Any, **__: Any) -> Any:
        raise self.error


class FakeClient:
    def __init__(self, error: Exception) -> None:
        self.js = FailingJetStream(error)

    def jetstream(self, **_: Any) -> FailingJetStream:
        return self.js


@pytest.mark.parametrize(
    "error",
    [
        nats.errors.NoRespondersError(),  # nobody listens on the subject
        nats.errors.TimeoutError(),  # a plain subscriber took it, and no stream acknowledged it
    ],
    ids=["no-responders", "timeout"],
)
async def test_an_event_no_stream_keeps_is_an_error_naming_the_stream_and_the_fix(error: Exception) -> None:
    with pytest.raises(BusError) as raised:
        await publish_event(FakeClient(error), WARNING)  # type: ignore[arg-type]
    message = str(raised.value)
    assert s.SPOT_WARNING in message and FIX in message


class Preempted:
    provider = "gcp"
    long_poll = False

    def poll(self) -> Notice:
        deadline = datetime(2026, 12, 4, 16, 0, tzinfo=UTC) + timedelta(seconds=30)
        return Notice(provider="gcp", kind=NoticeKind.TERMINATION, deadline=deadline, key="preempted-1")


async def test_the_agent_logs_why_a_notice_was_not_stored() -> None:
    client = FakeClient(nats.errors.TimeoutError())

    async def send(event: Any) -> None:
        await publish_event(client, event)  # type: ignore[arg-type]

    agent = NoticeAgent(Preempted(), job_id="j", node="vm-1", publish=send)
    with structlog.testing.capture_logs() as logged:
        assert await agent.poll_once() == PollOutcome.PUBLISH_FAILED
    (failed,) = [e for e in logged if e["event"] == "notice.publish_failed"]
    assert FIX in failed["error"] and failed["error"] != "nats: timeout"


async def test_a_dry_run_logs_that_it_did_not_publish(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from liver.cli import notice_cmd

    monkeypatch.setattr(notice_cmd, "source_of", lambda *_: Preempted())
    args = argparse.Namespace(source="gcp", interval=1.0, once=True, dry_run=True, url=None)
    # Whatever level an earlier test of this worker left configured, every event is captured (conftest
    # restores the configuration afterwards).
    structlog.reset_defaults()
    with structlog.testing.capture_logs() as logged:
        assert await notice_cmd._agent(args, "j", "vm-1", {}) == 0
    assert "notice.published" not in [e["event"] for e in logged]
    (shown,) = [e for e in logged if e["event"] == "notice.dry_run"]
    assert shown["event_id"] == "gcp-vm-1-preempted-1" and shown["published"] is False
    assert '"event_id":"gcp-vm-1-preempted-1"' in capsys.readouterr().out  # still printed
