"""Logging: JSON lines with the ids of the message being handled, and only that message."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from liver.shared.layout import ParallelLayout
from liver.shared.logs import bind_message, configure_logging
from liver.shared.messages import SpotWarning, WorkerStatus

WARNING = SpotWarning(job_id="job-1", event_id="evt-1", node="node001", provider="aws", notice_s=120)


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """configure_logging changes process-wide state; give the next test the state it had."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


@pytest.fixture
def json_lines() -> io.StringIO:
    out = io.StringIO()
    configure_logging(json_output=True, level="DEBUG", stream=out)
    return out


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_message_binds_its_ids_for_the_lines_inside_the_block(json_lines: io.StringIO) -> None:
    log = structlog.get_logger()
    with bind_message(WARNING, subject="spot.warning"):
        log.info("spot_warning_received")
    log.info("idle")
    inside, after = lines(json_lines)
    assert inside["event"] == "spot_warning_received"
    assert (inside["job_id"], inside["event_id"], inside["kind"]) == ("job-1", "evt-1", "spot_warning")
    assert inside["subject"] == "spot.warning"
    assert "job_id" not in after


def test_a_generation_is_bound_when_the_message_has_one(json_lines: io.StringIO) -> None:
    status = WorkerStatus(job_id="job-1", worker_id="w-0", generation=4, phase="ready")
    with bind_message(status):
        structlog.get_logger().info("ack")
    (line,) = lines(json_lines)
    assert (line["generation"], line["worker_id"]) == (4, "w-0")


def test_a_nested_message_restores_the_outer_ids_on_exit(json_lines: io.StringIO) -> None:
    log = structlog.get_logger()
    with bind_message(job_id="outer"):
        with bind_message(job_id="inner"):
            log.info("a")
        log.info("b")
    assert [line["job_id"] for line in lines(json_lines)] == ["inner", "outer"]


def test_structs_in_log_values_are_written_as_json(json_lines: io.StringIO) -> None:
    structlog.get_logger().info("planned", layout=ParallelLayout(tp=2, pp=1, dp=4))
    (line,) = lines(json_lines)
    assert line["layout"] == {"tp": 2, "pp": 1, "dp": 4}  # defaults left out


def test_standard_library_loggers_come_out_as_json_with_the_bound_ids(json_lines: io.StringIO) -> None:
    with bind_message(WARNING):
        logging.getLogger("nats.aio.client").error("encountered error")
    (line,) = lines(json_lines)
    assert (line["logger"], line["level"], line["job_id"]) == ("nats.aio.client", "error", "job-1")


def test_exceptions_are_structured_without_frame_locals(json_lines: io.StringIO) -> None:
    secret = "do-not-log"
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        structlog.get_logger().exception("failed")
    (line,) = lines(json_lines)
    assert line["exception"][0]["exc_type"] == "RuntimeError"
    assert secret not in json_lines.getvalue()


def test_lines_below_the_level_are_dropped() -> None:
    out = io.StringIO()
    configure_logging(json_output=True, level="WARNING", stream=out)
    structlog.get_logger().info("chatty")
    structlog.get_logger().warning("important")
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["important"]


def test_a_terminal_gets_readable_lines_rather_than_json() -> None:
    out = io.StringIO()
    configure_logging(json_output=False, stream=out)
    structlog.get_logger().info("hello", job_id="job-1")
    text = out.getvalue()
    assert "hello" in text and "job_id=job-1" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_the_format_can_be_chosen_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIVER_LOG_FORMAT", "json")
    out = io.StringIO()
    configure_logging(stream=out)
    structlog.get_logger().info("hello")
    assert json.loads(out.getvalue())["event"] == "hello"


def test_without_a_stream_lines_go_to_the_stderr_of_the_moment_not_to_one_since_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A command configured logging while a test captured stderr; that capture is closed afterwards.
    captured = io.StringIO()
    monkeypatch.setattr("sys.stderr", captured)
    configure_logging(json_output=True, level="INFO")
    captured.close()
    now = io.StringIO()
    monkeypatch.setattr("sys.stderr", now)
    structlog.get_logger("t").warning("after_the_capture")
    logging.getLogger("stdlib").warning("stdlib_after_the_capture")
    events = [json.loads(line)["event"] for line in now.getvalue().splitlines()]
    assert events == ["after_the_capture", "stdlib_after_the_capture"]
