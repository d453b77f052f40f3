"""``liver watch``: follow handoff outcomes as they happen, as a table or as JSON lines.

It subscribes to ``generation.committed`` and ``generation.aborted`` (and, with ``--errors``, to every
service's rejected input, ``liver.errors.*``), optionally for one job, and prints one line per message.
A payload that does not decode is reported on stderr and skipped: a watcher never stops on someone
else's bad message. ``--count N`` returns after N lines and ``--timeout S`` after S seconds, so a
script can wait for the next commit (exit 1 when the timeout comes first).

An outcome is stored once in the generations stream, but a plain subscription can receive it twice: a
coordinator that restarts, or whose publish timed out when the server failed, publishes it again under
the same ``Nats-Msg-Id``. The watcher prints the first copy and drops the others by that header, so a
script counting commits counts each once.

A watch follows outcomes from its start: a restarted coordinator publishes its last outcome again (same
message id, same ``committed_at``/``aborted_at``), and a watch started since then must not count that
copy, or ``--count 1`` returns at once with a stale outcome. The stream drops such a copy only within
its two-minute duplicate window, and the watch uses plain subscriptions (all the ``subscriber`` role may
do), so the outcome's own time is compared with the watch's start: older is a copy. That assumes the
coordinator's clock and this host's agree (NTP).

The ``subscriber`` role may receive the outcomes only; ``--errors`` (every service's rejected input,
with its payload) needs the ``operator`` role. A refused subscription is one line naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Final, TextIO

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from liver.cli.bus_access import connect_once, guarded, job_flag, server_url, utc_text
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode
from liver.shared.errors import InputError
from liver.shared.messages import ErrorEvent, GenerationAborted, GenerationCommitted

OUTCOMES: Final = GenerationCommitted | GenerationAborted
_REMEMBERED: Final = 4096
"""Outcome ids the watcher remembers to drop a copy by (a copy comes seconds after the first)."""
SUBSCRIBE_TIMEOUT_S: Final = 10
"""How long the server may take to confirm the subscriptions."""


class WatchError(InputError):
    """A bad flag: printed as one line naming it, exit code 2."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("watch", help="follow handoff outcomes (and rejected input) as they happen")
    p.add_argument("--job", help="only this job's messages")
    p.add_argument("--errors", action="store_true", help="also every service's rejected input")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.add_argument("--count", type=int, help="return after this many messages")
    p.add_argument(
        "--timeout", type=float, help="return after this many seconds (exit 1 if --count is unmet)"
    )
    p.add_argument("--url", help="the NATS server (default $NATS_URL)")
    p.set_defaults(func=run)


def subjects(errors: bool) -> tuple[str, ...]:
    return (s.GENERATION_COMMITTED, s.GENERATION_ABORTED, *((s.ERRORS_ANY,) if errors else ()))


def render(subject: str, message: GenerationCommitted | GenerationAborted | ErrorEvent, as_json: bool) -> str:
    """One output line for a decoded message."""
    if as_json:
        return msgspec.json.encode({"subject": subject, "message": message}).decode()
    if isinstance(message, GenerationCommitted):
        m = message
        return (
            f"{utc_text(m.committed_at)}  committed  job {m.job_id}  generation {m.generation} "
            f"(from {m.previous_generation})  {m.layout.describe()} on {len(m.placement)} devices  "
            f"downtime {m.downtime_s:.3f} s  moved {m.bytes_moved / 1e6:,.1f} MB  "
            f"from iteration {m.started_at_iteration}  event {m.event_id}"
        )
    if isinstance(message, GenerationAborted):
        a = message
        fallback = f"  checkpoint {a.checkpoint}" if a.checkpoint else ""
        return (
            f"{utc_text(a.aborted_at)}  aborted    job {a.job_id}  generation {a.generation} "
            f"(active {a.active_generation})  in {a.phase.value}: {a.outcome.value}{fallback}  "
            f"event {a.event_id}  reason: {a.reason}"
        )
    e = message
    ids = "".join(f"  {k} {v}" for k, v in (("job", e.job_id), ("event", e.event_id)) if v)
    return f"{utc_text(e.at)}  rejected   by {e.source} on {e.subject}{ids}  {e.field}: {e.message}"


def parse(subject: str, data: bytes) -> GenerationCommitted | GenerationAborted | ErrorEvent:
    """The message on ``subject``; raises :class:`MessageError` naming the field."""
    if subject in (s.GENERATION_COMMITTED, s.GENERATION_ABORTED):
        return decode(data, OUTCOMES)  # type: ignore[no-any-return]
    return decode(data, ErrorEvent)


def before(message: GenerationCommitted | GenerationAborted | ErrorEvent, since: datetime) -> bool:
    """Whether ``message`` is an outcome from before ``since``: a copy published again, not a new one."""
    if isinstance(message, GenerationCommitted):
        return message.committed_at < since
    if isinstance(message, GenerationAborted):
        return message.aborted_at < since
    return False


async def watch(
    nc: Client,
    *,
    job: str | None = None,
    errors: bool = False,
    as_json: bool = False,
    count: int | None = None,
    timeout_s: float | None = None,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    ready: asyncio.Event | None = None,
    since: datetime | None = None,
) -> bool:
    """Print matching messages until ``count`` of them or ``timeout_s``; whether ``count`` was reached
    (True without one). ``ready`` is set once the subscriptions are on the server. Outcomes from before
    ``since`` (default: now, the watch's start) are copies published again and are skipped."""
    since = datetime.now(UTC) if since is None else since
    inbox: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_message(msg: Msg) -> None:
        inbox.put_nowait(msg)

    subs = [await nc.subscribe(subject, cb=on_message) for subject in subjects(errors)]
    await nc.flush(timeout=SUBSCRIBE_TIMEOUT_S)
    if ready is not None:
        ready.set()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    shown = 0
    printed: OrderedDict[str, None] = OrderedDict()  # Nats-Msg-Ids of the outcomes shown (bounded)
    try:
        while count is None or shown < count:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return count is None
            try:
                msg = await asyncio.wait_for(inbox.get(), left)
            except TimeoutError:
                return count is None
            try:
                message = parse(msg.subject, msg.data)
            except MessageError as exc:
                note = f"liver watch: skipped an invalid message on {msg.subject}: {exc}"
                print(note, file=err, flush=True)
                continue
            if job is not None and getattr(message, "job_id", None) != job:
                continue
            if before(message, since):
                continue  # an outcome from before the watch, published again (module docstring)
            msg_id = (msg.headers or {}).get(s.HEADER_MSG_ID)
            if msg_id is not None:
                if msg_id in printed:
                    continue  # the same outcome published again (see the module docstring)
                printed[msg_id] = None
                while len(printed) > _REMEMBERED:
                    printed.popitem(last=False)
            print(render(msg.subject, message, as_json), file=out, flush=True)
            shown += 1
        return True
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def _run(args: argparse.Namespace, url: str, environ: Mapping[str, str]) -> bool:
    nc = await connect_once(url, environ, name="liver-watch", keep_reconnecting=True)
    following = watch(
        nc, job=args.job, errors=args.errors, as_json=args.json, count=args.count, timeout_s=args.timeout
    )
    needs = "the operator role" if args.errors else "the subscriber or operator role"
    try:
        return await guarded(nc, following, needs=needs, timeout_s=SUBSCRIBE_TIMEOUT_S)
    finally:
        await nc.close()


def run(args: argparse.Namespace) -> int:
    if args.count is not None and args.count < 1:
        raise WatchError(f"--count: must be at least 1, got {args.count}")
    if args.timeout is not None and args.timeout <= 0:
        raise WatchError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    job_flag(args.job)
    url = server_url(args.url, os.environ)
    return 0 if asyncio.run(_run(args, url, os.environ)) else 1
