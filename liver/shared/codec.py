"""Bytes <-> bus messages, with one error type that names the offending field.

Services never see msgspec's exceptions: every way a payload can be wrong (not JSON, not an object,
wrong type, missing or unknown field, out-of-range number, bad id, another schema version, a failed
cross-field check) becomes a :class:`MessageError` whose ``path`` is a JSON path such as
``$.add[0].node`` and whose ``reason`` says what was expected. That is what an ingester puts into an
``ErrorEvent`` and what a user sees when their publisher is wrong.

The schema version is read first, on its own: a message from a newer publisher then fails with
"unsupported schema version" rather than with whichever of its new fields happens to be checked first.
"""

from __future__ import annotations

import base64
import re
from datetime import UTC, datetime
from typing import Any, Final, TypeVar, overload

import msgspec

from liver.shared.errors import InputError
from liver.shared.messages import READ_SCHEMA_VERSIONS, SCHEMA_VERSION, ErrorEvent, Message
from liver.shared.subjects import TOKEN_PATTERN

M = TypeVar("M", bound=Message)

Payload = bytes | bytearray | memoryview | str

ERROR_PAYLOAD_LIMIT: Final = 32 * 1024
"""Bytes of a rejected payload copied into an ErrorEvent (the dead-letter copy keeps all of it)."""


class MessageError(InputError):
    """A payload that is not a valid message of the expected type.

    ``path`` is the JSON path of the field at fault (``$`` for the whole message), ``reason`` what was
    wrong with it, ``expected`` the name of the type that was being decoded.
    """

    def __init__(self, expected: str, path: str, reason: str) -> None:
        self.expected = expected
        self.path = path
        self.reason = reason
        super().__init__(f"invalid {expected}: {reason} - at `{path}`")


class _Envelope(msgspec.Struct):
    schema_version: int


class _Ids(msgspec.Struct):
    job_id: object = None
    event_id: object = None


_ENCODER: Final = msgspec.json.Encoder()
_ENVELOPE: Final = msgspec.json.Decoder(_Envelope)
_IDS: Final = msgspec.json.Decoder(_Ids)
_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}

_AT = re.compile(r"^(?P<reason>.*) - at `(?P<path>\$[^`]*)`$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")
_CROSS_FIELD = re.compile(r"^`(?P<field>[^`]+)`: (?P<reason>.*)$", re.S)
_TOKEN_TEXT = "matching regex '{}'".format(TOKEN_PATTERN.replace("\\", "\\\\"))  # msgspec doubles backslashes
_TOKEN = re.compile(TOKEN_PATTERN)


def encode(msg: Message) -> bytes:
    """JSON bytes of a message, ready to publish."""
    return _ENCODER.encode(msg)


@overload
def decode(data: Payload, into: type[M]) -> M: ...
@overload
def decode(data: Payload, into: Any) -> Any: ...
def decode(data: Payload, into: Any) -> Any:
    """Decode ``data`` as ``into`` (a message type or a union of them, such as ``WorkerCommand``).

    Raises :class:`MessageError` for anything but a valid message of the current schema version.
    """
    decoder = _decoder(into)
    expected = _name(into)
    try:
        version = _ENVELOPE.decode(data).schema_version
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _translate(expected, exc) from None
    except RecursionError:
        raise _too_deep(expected) from None
    if version not in READ_SCHEMA_VERSIONS:
        raise MessageError(
            expected,
            "$.schema_version",
            f"unsupported schema version {version}; this build reads version {SCHEMA_VERSION}",
        )
    try:
        return decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _translate(expected, exc) from None
    except RecursionError:
        raise _too_deep(expected) from None


def _too_deep(expected: str) -> MessageError:
    """msgspec raises ``RecursionError`` (not one of its own errors) for JSON nested deeper than the
    interpreter's stack allows; no message of the contract is nested more than a few levels."""
    return MessageError(expected, "$", "malformed JSON: nested too deeply")


def error_event(
    *,
    source: str,
    subject: str,
    data: bytes,
    error: MessageError,
    stream_sequence: int | None = None,
    at: datetime | None = None,
) -> ErrorEvent:
    """The ``ErrorEvent`` a service publishes for a payload it rejected.

    The job and event ids are picked out of the payload when it is JSON and they are token-safe, so that
    an operator can find the error by the id they published with.
    """
    job_id, event_id = _readable_ids(data)
    kept = bytes(data[:ERROR_PAYLOAD_LIMIT])
    try:
        bytes(data).decode("utf-8")
        payload, encoding = kept.decode("utf-8", errors="ignore"), "utf-8"
    except UnicodeDecodeError:
        payload, encoding = base64.b64encode(kept).decode("ascii"), "base64"
    return ErrorEvent(
        source=source,
        subject=_clip(subject, 1000),
        field=_clip(error.path, 1000),
        message=_clip(error.reason, 2000),
        payload=payload,
        payload_encoding=encoding,
        payload_size=len(data),
        payload_truncated=len(data) > ERROR_PAYLOAD_LIMIT,
        at=at or datetime.now(UTC),
        job_id=job_id,
        event_id=event_id,
        stream_sequence=stream_sequence,
    )


def _clip(text: str, limit: int) -> str:
    """Reasons and paths can quote the bad input (an unknown field's name); keep the event decodable."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _decoder(into: Any) -> msgspec.json.Decoder[Any]:
    decoder = _DECODERS.get(into)
    if decoder is None:
        members = getattr(into, "__args__", (into,))
        if not all(isinstance(m, type) and issubclass(m, Message) for m in members):
            raise TypeError(f"decode needs a bus message type or a union of them, got {into!r}")
        decoder = _DECODERS[into] = msgspec.json.Decoder(into)
    return decoder


def _name(into: Any) -> str:
    members = getattr(into, "__args__", None)
    if members:
        return " | ".join(m.__name__ for m in members)
    return into.__name__


def _translate(expected: str, exc: msgspec.MsgspecError) -> MessageError:
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return MessageError(expected, "$", f"malformed JSON: {text}")
    path, reason = "$", text
    match = _AT.match(text)
    if match:
        path, reason = match["path"], match["reason"]
    for pattern in (_MISSING, _UNKNOWN):
        field = pattern.match(reason)
        if field:
            path = f"{path}.{field['field']}"
    cross = _CROSS_FIELD.match(reason)
    if cross:
        field = cross["field"]
        path = f"{path}{'' if field.startswith('[') else '.'}{field}"
        reason = cross["reason"]
    reason = reason.replace(_TOKEN_TEXT, "that is a token-safe id (1-128 ASCII letters, digits, '_' or '-')")
    return MessageError(expected, path, reason)


def _readable_ids(data: bytes) -> tuple[str | None, str | None]:
    try:
        ids = _IDS.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None, None

    def token(value: object) -> str | None:
        return value if isinstance(value, str) and _TOKEN.match(value) else None

    return token(ids.job_id), token(ids.event_id)
