"""Logging for every LiveR process: structlog, JSON lines in containers, readable lines on a terminal.

Call :func:`configure_logging` once at process start. Log with event names and key-value pairs, never
formatted strings, so that the JSON can be queried (``log.info("handoff_aborted", reason=...)``).

Per-message context: wrap the handling of each bus message in :func:`bind_message`, which binds the
message's job, event and generation ids (and any extra ids) for every log line inside the block, and
only there::

    async def on_message(msg: nats.aio.msg.Msg) -> None:
        with bind_message(subject=msg.subject):
            warning = decode(msg.data, SpotWarning)
            with bind_message(warning):
                log.info("spot_warning_received", node=warning.node)

It uses structlog's ``bound_contextvars``, which restores the previous values on exit. Do not call
``bind_contextvars`` in a nats-py callback: the callbacks of one subscription share one task, so ids
bound for one message would stay on the log lines of the next.

Libraries that log through the standard library (nats-py among them) are routed through the same
renderer, so a container's output is JSON throughout.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final, TextIO

import msgspec
import structlog
import structlog.tracebacks

FORMAT_ENV: Final = "LIVER_LOG_FORMAT"
"""``json`` or ``console``; unset: JSON unless the output is a terminal."""

LEVEL_ENV: Final = "LIVER_LOG_LEVEL"

MESSAGE_IDS: Final = ("job_id", "event_id", "generation", "worker_id")
"""Message fields that :func:`bind_message` binds when a message has them."""


def _fallback(obj: object) -> object:
    """Anything msgspec cannot encode natively (a Path, an exception, a numpy scalar) is logged as text."""
    structlog_repr = getattr(obj, "__structlog__", None)
    if callable(structlog_repr):
        return structlog_repr()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return repr(obj)


_ENCODER: Final = msgspec.json.Encoder(enc_hook=_fallback)


def _serialize(event_dict: dict[str, Any], **_: Any) -> str:
    """structlog serializer: msgspec encodes Structs (messages, layouts) and datetimes as they are."""
    return _ENCODER.encode(event_dict).decode("utf-8")


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when a line is written, not when logging was configured: a stream
    captured then (a test's, a redirected one) may be closed by the time a later line comes."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure_logging(
    *,
    json_output: bool | None = None,
    level: int | str | None = None,
    stream: TextIO | None = None,
) -> None:
    """Configure structlog and the standard library's root logger for this process.

    ``json_output`` defaults to ``$LIVER_LOG_FORMAT`` and otherwise to "JSON unless writing to a
    terminal"; ``level`` to ``$LIVER_LOG_LEVEL`` or INFO; ``stream`` to the current ``sys.stderr`` at
    each write. Safe to call again (tests do).
    """
    out = stream if stream is not None else _CurrentStderr()
    if json_output is None:
        chosen = os.environ.get(FORMAT_ENV, "").strip().lower()
        json_output = chosen == "json" or (chosen != "console" and not _is_tty(out))
    level_value = _level(level if level is not None else os.environ.get(LEVEL_ENV, "INFO"))

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Any
    if json_output:
        # Structured tracebacks without frame locals: locals bloat lines and can hold credentials.
        shared.append(
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            )
        )
        renderer = structlog.processors.JSONRenderer(serializer=_serialize)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=_is_tty(out))

    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_value),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        # Not cached: loggers created at import time must follow a later reconfiguration.
        cache_logger_on_first_use=False,
    )

    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_liver", False)]:
        root.removeHandler(old)
    handler._liver = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level_value)


@contextmanager
def bind_message(msg: object | None = None, /, **ids: object) -> Iterator[None]:
    """Bind a message's ids (and ``ids``; ``None`` values skipped) to every log line in the block."""
    bound: dict[str, object] = {}
    if msg is not None:
        config = getattr(type(msg), "__struct_config__", None)
        if config is not None and isinstance(config.tag, str):
            bound["kind"] = config.tag
        for name in MESSAGE_IDS:
            value = getattr(msg, name, None)
            if value is not None:
                bound[name] = value
    bound.update({k: v for k, v in ids.items() if v is not None})
    with structlog.contextvars.bound_contextvars(**bound):
        yield


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _level(value: int | str) -> int:
    if isinstance(value, int):
        return value
    number = logging.getLevelName(value.strip().upper())
    if not isinstance(number, int):
        raise ValueError(f"{LEVEL_ENV}: unknown log level {value!r}")
    return number
