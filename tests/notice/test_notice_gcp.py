"""The Compute Engine notice source, against a local server that speaks the metadata protocol: the
``Metadata-Flavor`` header, ETags and ``wait_for_change`` long polls."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from local_http import LocalHttp, QuietHandler, nothing_listening, serving

from liver.notice.agent import NoticeAgent, PollOutcome
from liver.notice.gcp import MAINTENANCE_PATH, PREEMPTED_PATH, PREEMPTION_NOTICE, GcpNotices
from liver.notice.model import NoticeKind, NoticeSourceError
from liver.shared.messages import SpotWarning


def etag(value: str) -> str:
    return hashlib.sha1(value.encode()).hexdigest()[:16]


class FakeMetadata:
    """The two keys a preemption watcher reads, with ETags and long polls."""

    def __init__(self) -> None:
        self.values = {PREEMPTED_PATH: "FALSE", MAINTENANCE_PATH: "NONE"}
        self.changed = threading.Condition()
        self.waits: list[float] = []  # how long each long poll was held
        self.refuse = False
        self.ended: list[str] = []  # why each long poll returned: "changed" or "timeout"
        self.reads = 0  # requests answered at once, without wait_for_change
        self.etags = True  # answers carry an ETag (False: a server that sends none)
        fake = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                if fake.refuse or self.headers.get("Metadata-Flavor") != "Google":
                    self.answer(403, b"Missing Metadata-Flavor:Google header.")
                    return
                url = urlsplit(self.path)
                if url.path not in fake.values:
                    self.answer(404, b"not found")
                    return
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                if query.get("wait_for_change") == "true":
                    started = time.monotonic()
                    limit = started + float(query.get("timeout_sec", "30"))
                    with fake.changed:
                        # As Google's server does: with last_etag, answer at once when the value's ETag
                        # is another; without one, wait for the value to change from what it is now.
                        last = query.get("last_etag") or etag(fake.values[url.path])
                        same = etag(fake.values[url.path]) == last
                        while same and time.monotonic() < limit:
                            fake.changed.wait(limit - time.monotonic())
                            same = etag(fake.values[url.path]) == last
                    fake.waits.append(time.monotonic() - started)
                    fake.ended.append("timeout" if same else "changed")
                else:
                    fake.reads += 1
                value = fake.values[url.path]
                self.answer(200, value.encode(), {"ETag": etag(value)} if fake.etags else {})

        self.http = LocalHttp(Handler)
        self.endpoint = self.http.endpoint

    def set(self, path: str, value: str) -> None:
        with self.changed:
            self.values[path] = value
            self.changed.notify_all()


@pytest.fixture
def metadata() -> Iterator[FakeMetadata]:
    fake = FakeMetadata()
    with serving(fake.http):
        yield fake


def test_a_running_vm_has_no_notice(metadata: FakeMetadata) -> None:
    assert GcpNotices(metadata.endpoint, wait_s=1).poll() is None


def test_a_preemption_is_a_notice_thirty_seconds_ahead(metadata: FakeMetadata) -> None:
    metadata.set(PREEMPTED_PATH, "TRUE")
    before = datetime.now(UTC)
    notice = GcpNotices(metadata.endpoint, wait_s=1).poll()
    assert notice is not None and notice.kind == NoticeKind.TERMINATION and notice.provider == "gcp"
    assert before + timedelta(seconds=29) <= notice.deadline <= datetime.now(UTC) + timedelta(seconds=30)


def test_a_termination_for_host_maintenance_is_a_notice_but_a_migration_is_not(
    metadata: FakeMetadata,
) -> None:
    source = GcpNotices(metadata.endpoint, wait_s=1)
    metadata.set(MAINTENANCE_PATH, "MIGRATE_ON_HOST_MAINTENANCE")
    assert source.poll() is None
    metadata.set(MAINTENANCE_PATH, "TERMINATE_ON_HOST_MAINTENANCE")
    notice = source.poll()
    assert notice is not None and notice.key.startswith("maintenance-")


def test_the_long_poll_returns_as_soon_as_the_vm_is_preempted(metadata: FakeMetadata) -> None:
    source = GcpNotices(metadata.endpoint, wait_s=30)
    assert source.poll() is None  # the first read returns at once, with the value's ETag
    timer = threading.Timer(0.3, metadata.set, (PREEMPTED_PATH, "TRUE"))
    timer.start()
    try:
        notice = source.poll()  # held by the server until the value changes
    finally:
        timer.cancel()
    assert notice is not None
    assert metadata.ended[-1] == "changed"


def test_a_long_poll_with_no_change_returns_after_its_wait(metadata: FakeMetadata) -> None:
    source = GcpNotices(metadata.endpoint, wait_s=1)
    assert source.poll() is None  # a plain read: answered at once, with the value's ETag
    assert source.poll() is None  # a long poll with that ETag: held until its wait is over
    assert metadata.ended == ["timeout"]


def test_an_agent_started_after_the_preemption_reads_it_at_once_and_dates_it_from_that_read(
    metadata: FakeMetadata,
) -> None:
    metadata.set(PREEMPTED_PATH, "TRUE")  # announced before the agent started
    source = GcpNotices(metadata.endpoint, wait_s=3)
    started = datetime.now(UTC)
    notice = source.poll()
    read = datetime.now(UTC)
    assert notice is not None and notice.kind == NoticeKind.TERMINATION
    assert (metadata.waits, metadata.ended) == ([], [])  # no long poll was held: a plain first read
    assert read - started < timedelta(seconds=1)
    # 30 s from the first read, not from the end of a long poll's wait
    assert started + PREEMPTION_NOTICE <= notice.deadline <= read + PREEMPTION_NOTICE
    assert notice.deadline - started < PREEMPTION_NOTICE + timedelta(seconds=1)


def test_after_the_first_read_the_source_long_polls_even_without_an_etag(metadata: FakeMetadata) -> None:
    metadata.etags = False  # a server that sends no ETag must not turn the long poll into a busy loop
    source = GcpNotices(metadata.endpoint, wait_s=1)
    assert source.poll() is None
    assert source.poll() is None
    assert metadata.ended == ["timeout"]


def test_the_same_preemption_read_again_is_the_same_event(metadata: FakeMetadata) -> None:
    metadata.set(PREEMPTED_PATH, "TRUE")
    source = GcpNotices(metadata.endpoint, wait_s=1)
    first = source.poll()
    again = source.poll()
    # The same id and the same deadline: the ingester drops the repeat as a duplicate (a different
    # deadline under the same id would be a conflict).
    assert first is not None and first == again
    assert first.event_id("vm-1") == again.event_id("vm-1")


def test_a_second_preemption_of_a_reused_node_name_is_a_new_event(metadata: FakeMetadata) -> None:
    metadata.set(PREEMPTED_PATH, "TRUE")
    first = GcpNotices(metadata.endpoint, wait_s=1).poll()
    # The VM is gone; a new one under the same name (a managed instance group recreates it so) is
    # preempted in turn, and its metadata server gives `TRUE` the same ETag.
    second = GcpNotices(metadata.endpoint, wait_s=1).poll()
    assert first is not None and second is not None
    assert first.event_id("vm-1") != second.event_id("vm-1")


def test_a_preemption_after_the_flag_went_back_is_a_new_event(metadata: FakeMetadata) -> None:
    source = GcpNotices(metadata.endpoint, wait_s=1)
    metadata.set(PREEMPTED_PATH, "TRUE")
    first = source.poll()
    metadata.set(PREEMPTED_PATH, "FALSE")
    assert source.poll() is None
    metadata.set(PREEMPTED_PATH, "TRUE")  # the same value, so the same ETag, as the first time
    second = source.poll()
    assert first is not None and second is not None
    assert first.event_id("vm-1") != second.event_id("vm-1")


def test_a_termination_for_maintenance_read_again_is_the_same_event_and_a_later_one_is_new(
    metadata: FakeMetadata,
) -> None:
    source = GcpNotices(metadata.endpoint, wait_s=1)
    metadata.set(MAINTENANCE_PATH, "TERMINATE_ON_HOST_MAINTENANCE")
    first, again = source.poll(), source.poll()
    assert first is not None and first == again
    later = GcpNotices(metadata.endpoint, wait_s=1).poll()  # another VM under the same name
    assert later is not None and later.event_id("vm-1") != first.event_id("vm-1")


def test_a_refused_read_is_a_source_error_naming_the_status(metadata: FakeMetadata) -> None:
    metadata.refuse = True  # as the server answers a request without Metadata-Flavor: Google
    with pytest.raises(NoticeSourceError, match="HTTP 403"):
        GcpNotices(metadata.endpoint, wait_s=1).poll()


def test_an_unexpected_value_is_a_source_error(metadata: FakeMetadata) -> None:
    metadata.set(PREEMPTED_PATH, "MAYBE")
    with pytest.raises(NoticeSourceError, match="not TRUE or FALSE"):
        GcpNotices(metadata.endpoint, wait_s=1).poll()


def test_an_unreachable_metadata_server_is_a_source_error() -> None:
    with pytest.raises(NoticeSourceError, match="unreachable"):
        GcpNotices(nothing_listening(), wait_s=1, timeout_s=1).poll()


async def test_the_agent_publishes_a_preemption_once(metadata: FakeMetadata) -> None:
    events: list[Any] = []

    async def publish(event: Any) -> None:
        events.append(event)

    agent = NoticeAgent(GcpNotices(metadata.endpoint, wait_s=1), job_id="j", node="vm-1", publish=publish)
    assert await agent.poll_once() == PollOutcome.NONE
    metadata.set(PREEMPTED_PATH, "TRUE")
    assert await agent.poll_once() == PollOutcome.PUBLISHED
    assert await agent.poll_once() == PollOutcome.ALREADY_PUBLISHED
    (event,) = events
    assert isinstance(event, SpotWarning) and event.provider == "gcp" and event.node == "vm-1"


def test_notice_once_with_the_gcp_source_prints_the_preemption(
    metadata: FakeMetadata, capsys: pytest.CaptureFixture[str]
) -> None:
    from liver.cli.main import main
    from liver.shared.codec import decode

    metadata.set(PREEMPTED_PATH, "TRUE")
    argv = ["notice", "--source", "gcp", "--endpoint", metadata.endpoint, "--job", "j", "--node", "vm-1"]
    assert main([*argv, "--interval", "1", "--once", "--dry-run"]) == 0
    warning = decode(capsys.readouterr().out.strip().splitlines()[-1].encode(), SpotWarning)
    assert (warning.provider, warning.node) == ("gcp", "vm-1")
