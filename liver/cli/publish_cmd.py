"""``liver publish spot-warning|scale-request``: one resize event onto the bus, checked first.

The event is built from the flags, then parsed by the ingester's own parser
(:func:`liver.services.ingester.core.parse`): whatever the ingester would reject is refused here, with
the flag that is wrong, before anything is sent. It goes out through
:func:`liver.notice.publish.publish_event`, stored once however often the command is repeated (a retry
after a timeout, a shell loop run twice); the ingester also recognises an event id it has handled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final

import msgspec

from liver.cli.bus_access import connect_once, guarded, server_url
from liver.notice.publish import PUBLISH_TIMEOUT_S, publish_event
from liver.services.ingester.core import IngestEvent, parse
from liver.shared import subjects as s
from liver.shared.codec import MessageError
from liver.shared.errors import InputError
from liver.shared.messages import SCHEMA_VERSION, WarningKind


class EventKind(StrEnum):
    SPOT_WARNING = "spot-warning"
    SCALE_REQUEST = "scale-request"


SUBJECTS: Final[Mapping[EventKind, str]] = {
    EventKind.SPOT_WARNING: s.SPOT_WARNING,
    EventKind.SCALE_REQUEST: s.SCALE_REQUEST,
}

TAGS: Final[Mapping[EventKind, str]] = {
    EventKind.SPOT_WARNING: "spot_warning",
    EventKind.SCALE_REQUEST: "scale_request",
}

# The message's fields -> the flag a user wrote them with, for errors that name what to fix.
FLAGS: Final[Mapping[str, str]] = {
    "job_id": "--job",
    "event_id": "--event-id",
    "node": "--node",
    "provider": "--provider",
    "notice_s": "--notice",
    "deadline": "--deadline",
    "warning_kind": "--rebalance",
    "reason": "--reason",
    "add": "--add",
    "remove": "--remove",
    "target_devices": "--target-devices",
}


class PublishError(InputError):
    """A flag that does not make a valid event: printed as one line naming the flag, exit code 2."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("publish", help="publish a spot warning or a scale request (validated first)")
    kinds = p.add_subparsers(dest="kind", required=True)

    warning = kinds.add_parser(EventKind.SPOT_WARNING.value, help="a node of the job will be reclaimed")
    _common(warning)
    warning.add_argument("--node", required=True, help="the node that will be reclaimed")
    warning.add_argument("--notice", type=float, help="seconds of notice, from now")
    warning.add_argument("--deadline", help="the moment the node is gone (ISO 8601, with a time zone)")
    warning.add_argument("--provider", default="manual", help="aws, gcp, azure, manual, ... (default manual)")
    warning.add_argument(
        "--rebalance",
        action="store_true",
        help="a recommendation to move off the node, no reclaim scheduled (needs no --notice)",
    )

    request = kinds.add_parser(EventKind.SCALE_REQUEST.value, help="a planned change of the job's devices")
    _common(request)
    request.add_argument("--reason", required=True, help="why (shown with the generation it makes)")
    request.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="NODE:I,J,...",
        help="a node to add and the device indices the job may use on it (repeatable)",
    )
    request.add_argument("--remove", action="append", default=[], metavar="NODE", help="a node to give back")
    request.add_argument("--target-devices", type=int, help="or: the device count to reach")
    p.set_defaults(func=run)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", required=True, help="the job's id")
    p.add_argument("--event-id", help="the event's id (default: a new one, printed)")
    p.add_argument("--url", help="the NATS server (default $NATS_URL)")
    p.add_argument("--json", action="store_true", help="print the published event and its sequence as JSON")


def build_event(args: argparse.Namespace) -> tuple[str, IngestEvent]:
    """The subject and the event the flags describe, exactly as the ingester will read it."""
    kind = EventKind(args.kind)
    fields: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": TAGS[kind],
        "job_id": args.job,
        "event_id": args.event_id if args.event_id is not None else f"cli-{uuid.uuid4().hex[:16]}",
    }
    if kind is EventKind.SPOT_WARNING:
        fields |= {"node": args.node, "provider": args.provider}
        if args.notice is not None:
            fields["notice_s"] = args.notice
        if args.deadline is not None:
            fields["deadline"] = _deadline(args.deadline)
        if args.rebalance:
            fields["warning_kind"] = WarningKind.REBALANCE.value
    else:
        fields |= {"reason": args.reason, "add": [_node_devices(a) for a in args.add], "remove": args.remove}
        if args.target_devices is not None:
            fields["target_devices"] = args.target_devices
    subject = SUBJECTS[kind]
    try:
        return subject, parse(subject, json.dumps(fields).encode())
    except MessageError as exc:
        raise PublishError(_flag_error(exc)) from None


def _deadline(text: str) -> str:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise PublishError(f"--deadline: {text!r} is not an ISO 8601 time (2026-12-04T16:00:00Z)") from None
    if moment.tzinfo is None:
        raise PublishError(f"--deadline: {text!r} has no time zone (add Z or +00:00)")
    return moment.astimezone(UTC).isoformat()


_ADD = re.compile(r"^(?P<node>[^:]+):(?P<devices>\d+(?:,\d+)*)$")


def _node_devices(text: str) -> dict[str, Any]:
    match = _ADD.match(text.strip())
    if match is None:
        raise PublishError(f"--add: {text!r} is not NODE:I,J,... (a node and its device indices)")
    return {"node": match["node"], "devices": [int(i) for i in match["devices"].split(",")]}


def _flag_error(exc: MessageError) -> str:
    """``$.add[0].node`` -> ``--add (add[0].node)``: the flag to fix, and where in the event."""
    where = exc.path.removeprefix("$.").removeprefix("$")
    field = re.split(r"[.\[]", where, maxsplit=1)[0] if where else ""
    flag = FLAGS.get(field)
    if flag is None:
        return f"the event is invalid: {exc.reason} (at {exc.path})"
    detail = f" ({where})" if where != field else ""
    return f"{flag}{detail}: {exc.reason}"


async def publish(url: str, environ: Mapping[str, str], event: IngestEvent) -> tuple[int, bool]:
    """Publish ``event``; returns its stream sequence and whether JetStream had it already."""
    nc = await connect_once(url, environ, name="liver-publish")
    try:
        return await guarded(
            nc, publish_event(nc, event), needs="the publisher role", timeout_s=PUBLISH_TIMEOUT_S
        )
    finally:
        await nc.drain()


def run(args: argparse.Namespace) -> int:
    subject, event = build_event(args)
    url = server_url(args.url, os.environ)
    seq, duplicate = asyncio.run(publish(url, os.environ, event))
    if args.json:
        out = {"subject": subject, "stream_sequence": seq, "duplicate": duplicate, "event": event}
        print(msgspec.json.encode(out).decode())
    else:
        again = " (already stored: this event id was published before)" if duplicate else ""
        print(
            f"published {subject} for job {event.job_id}: event {event.event_id}, "
            f"{s.STREAM_INGEST.name} sequence {seq}{again}"
        )
    return 0
