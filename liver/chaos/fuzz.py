"""``liver chaos --fuzz N``: hostile messages on every subject LiveR reads, and what must hold after them.

Around the same processes as a chaos run (four services, a nats-server, a simulated job), a seeded
generator publishes ``N`` messages, each a valid sample of the subject's message type
(:mod:`.samples`) made invalid in one way of a category (:class:`Category`): not JSON, not an object,
invalid UTF-8, nested past the stack, near the server's payload limit, a field missing, unknown, of the
wrong type, out of range or not token-safe, another message's kind, another schema version; and on the
public subjects also an unknown job or node. Every candidate is first decoded here with the type the
subject carries, and only one the codec refuses (or, for the semantic categories, one the ingester must
refuse) is sent, so each message sent must be answered.

What must hold: each message gets an error event (matched by its stream sequence, or for unstored
worker traffic by its payload) and, from a service, a dead letter (matched the same way); no process
dies; every service still answers discovery; and the job still resizes afterwards, while a copy of that
event's id with other content is refused as a conflict and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors

from liver.bench.bus import rig
from liver.chaos.run import JOB, ChaosConfig, ChaosRun, EventKind
from liver.chaos.samples import samples
from liver.chaos.schedule import SERVICES, make_schedule
from liver.services.bus import HEADER_PAYLOAD_DIGEST
from liver.shared import messages as m
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode, error_event

HUGE_MARGIN: Final = 4096
"""Bytes below the server's ``max_payload`` an oversized payload stays (its headers must fit too)."""
DEEP: Final = 1200
"""Nesting depth of the deep payloads: deeper than the codec's recursion allows."""
CORE_AHEAD: Final = 200
"""Unanswered worker-traffic messages the sender lets a reader be behind before it waits."""
CATCH_UP_S: Final = 30.0
CONFLICT_QUIET_S: Final = 3.0
"""How long after a conflicting copy is refused no new outcome may appear (a handoff commits in 0.2 s)."""
ATTEMPTS: Final = 20
"""Tries at making one message of a category invalid before another category is drawn."""


class Category(StrEnum):
    NOT_JSON = "not_json"
    EMPTY = "empty"
    INVALID_UTF8 = "invalid_utf8"
    NOT_AN_OBJECT = "not_an_object"
    DEEP_NESTING = "deep_nesting"
    HUGE = "huge"
    MISSING_FIELD = "missing_field"
    UNKNOWN_FIELD = "unknown_field"
    WRONG_TYPE = "wrong_type"
    OUT_OF_RANGE = "out_of_range"
    BAD_TOKEN = "bad_token"
    WRONG_KIND = "wrong_kind"
    SCHEMA_VERSION = "schema_version"
    UNKNOWN_JOB = "unknown_job"
    UNKNOWN_NODE = "unknown_node"


SEMANTIC: Final = (Category.UNKNOWN_JOB, Category.UNKNOWN_NODE)
"""Categories of valid messages that only the ingester's judgement refuses (public subjects only)."""


@dataclass(frozen=True)
class Channel:
    """A subject LiveR reads, the message type it carries, and how a bad message there is answered."""

    subject: str
    types: tuple[type[m.Message], ...]
    stream: str | None
    """The stream that keeps the subject; ``None`` for core NATS (worker traffic)."""
    dead_letter: bool
    """A service reads it (error event and dead letter); the workers only publish an error event."""
    answered: bool = True
    """Whether a bad message gets an error event at all: the outcome subjects are the coordinator's
    output, and the workers reading them drop what does not decode (anyone may publish there)."""

    @property
    def public(self) -> bool:
        return self.subject in (s.SPOT_WARNING, s.SCALE_REQUEST)

    def decodes(self, data: bytes) -> bool:
        target: Any = self.types[0] if len(self.types) == 1 else m.WorkerCommand
        try:
            decoded = decode(data, target)
        except MessageError:
            return False
        return not self.subject.startswith("liver.worker.command") or getattr(decoded, "job_id", JOB) == JOB


def channels(job: str = JOB) -> tuple[Channel, ...]:
    ingest, control = s.STREAM_INGEST.name, s.STREAM_CONTROL.name
    return (
        Channel(s.SPOT_WARNING, (m.SpotWarning,), ingest, True),
        Channel(s.SCALE_REQUEST, (m.ScaleRequest,), ingest, True),
        Channel(s.resize_requested(job), (m.ResizeRequested,), control, True),
        Channel(s.topology_request(job), (m.TopologyRequest,), control, True),
        Channel(s.topology_planned(job), (m.TopologyPlanned,), control, True),
        Channel(s.transfer_planned(job), (m.TransferPlanned,), control, True),
        Channel(s.planning_failed(job), (m.PlanningFailed,), control, True),
        Channel(s.world_started(job), (m.WorldStarted,), control, True),
        Channel(s.worker_hello(job), (m.Hello,), None, True),
        Channel(s.worker_heartbeat(job), (m.Heartbeat,), None, True),
        Channel(s.worker_status(job), (m.WorkerStatus,), None, True),
        Channel(s.worker_commands(job), (m.Prepare, m.Switch, m.Abort), None, False),
        Channel(s.GENERATION_COMMITTED, (m.GenerationCommitted,), s.STREAM_GENERATIONS.name, False, False),
        Channel(s.GENERATION_ABORTED, (m.GenerationAborted,), s.STREAM_GENERATIONS.name, False, False),
    )


class Hostile(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    subject: str
    category: Category
    data: bytes


# -- making hostile payloads ------------------------------------------------------------------------------


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, i))
    else:
        yield path, value


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def _delete(obj: Any, path: tuple[Any, ...]) -> None:
    for key in path[:-1]:
        obj = obj[key]
    del obj[path[-1]]


_BAD_TOKENS: Final = ("{u}\n", "a b{u}", "a.b{u}", "*{u}", ">{u}", "{u}\t", "é{u}", "x" * 300 + "{u}", "")
_BAD_NUMBERS: Final = (2**64, -(2**63) - 1, 1e308, -1, 1e23, 2**53 + 1, -0.5)
_WRONG_VALUES: Final = ([], {}, "text", True, None, 1.5)


class HostileMaker:
    """Seeded maker of invalid payloads for each channel (see the module docstring)."""

    def __init__(self, seed: int, job: str = JOB, max_payload: int = 1 << 20) -> None:
        self.rng = random.Random(seed)
        self.job = job
        self.max_payload = max_payload
        self._samples = samples(job)
        self._sent: set[tuple[str, bytes]] = set()
        self.kinds = [str(t.__struct_config__.tag) for t in m.MESSAGE_TYPES]

    def _template(self, channel: Channel, index: int) -> dict[str, Any]:
        kind = self.rng.choice(channel.types)
        obj: dict[str, Any] = json.loads(encode(self._samples[kind]))
        unique = f"fz-{index}"
        for field in ("event_id", "worker_id", "reason", "explanation"):
            if field in obj:
                obj[field] = unique
                break
        else:
            if "generation" in obj:
                obj["generation"] = index + 1
        return obj

    def make(self, channel: Channel, index: int) -> Hostile | None:
        """One hostile message for ``channel``, or ``None`` when no category gave a new invalid one."""
        categories = [c for c in Category if channel.public or c not in SEMANTIC]
        for _ in range(ATTEMPTS):
            category = self.rng.choice(categories)
            data = self._payload(channel, category, index)
            if data is None or (channel.subject, data) in self._sent:
                continue
            if category not in SEMANTIC and channel.decodes(data):
                continue
            self._sent.add((channel.subject, data))
            return Hostile(index=index, subject=channel.subject, category=category, data=data)
        return None

    def _payload(self, channel: Channel, category: Category, index: int) -> bytes | None:
        obj = self._template(channel, index)
        leaves = [(p, v) for p, v in _leaves(obj) if p and p[0] != "kind"]
        strings = [(p, v) for p, v in leaves if isinstance(v, str)]
        numbers = [(p, v) for p, v in leaves if isinstance(v, int | float) and not isinstance(v, bool)]
        rng = self.rng
        match category:
            case Category.NOT_JSON:
                text = rng.choice(("{", "}{", "nul", "{'a': 1}", "[1,", '{"a":}', "\x00\x01"))
                return f"{text} fz-{index}".encode()
            case Category.EMPTY:
                return b""
            case Category.INVALID_UTF8:
                return encode_obj(obj).replace(b"fz-", b"\xff\xfe-", 1) if b"fz-" in encode_obj(obj) else None
            case Category.NOT_AN_OBJECT:
                return json.dumps(rng.choice(([index, "fz"], index, f"fz-{index}", None))).encode()
            case Category.DEEP_NESTING:
                depth = DEEP + index % 97
                return ("[" * depth + f'"fz-{index}"' + "]" * depth).encode()
            case Category.HUGE:
                if not strings:
                    return None
                path, _ = rng.choice(strings)
                size = self.max_payload - HUGE_MARGIN - (index % 1000)
                _set(obj, path, "")
                room = size - len(encode_obj(obj))
                _set(obj, path, f"fz-{index}-" + "x" * max(room - 12, 0))
                return encode_obj(obj)
            case Category.MISSING_FIELD:
                top = [k for k in obj if k not in ("kind", "schema_version")]
                _delete(obj, (rng.choice(top),))
                return encode_obj(obj)
            case Category.UNKNOWN_FIELD:
                obj[f"fz_unknown_{index}"] = index
                return encode_obj(obj)
            case Category.WRONG_TYPE:
                path, value = rng.choice(leaves)
                _set(obj, path, rng.choice([w for w in _WRONG_VALUES if type(w) is not type(value)]))
                return encode_obj(obj)
            case Category.OUT_OF_RANGE:
                if not numbers:
                    return None
                path, _ = rng.choice(numbers)
                _set(obj, path, rng.choice(_BAD_NUMBERS))
                return encode_obj(obj)
            case Category.BAD_TOKEN:
                ids = [(p, v) for p, v in strings if p[-1] in ("job_id", "event_id", "worker_id", "node")]
                if not ids:
                    return None
                path, _ = rng.choice(ids)
                _set(obj, path, rng.choice(_BAD_TOKENS).format(u=index))
                return encode_obj(obj)
            case Category.WRONG_KIND:
                obj["kind"] = rng.choice([k for k in self.kinds if k != obj.get("kind")] + [f"fz-{index}"])
                return encode_obj(obj)
            case Category.SCHEMA_VERSION:
                obj["schema_version"] = rng.choice((0, m.SCHEMA_VERSION + 1, 99, -1, "3"))
                return encode_obj(obj)
            case Category.UNKNOWN_JOB:
                obj["job_id"] = f"fz-nojob-{index}"
                return encode_obj(obj)
            case Category.UNKNOWN_NODE:
                if channel.subject == s.SPOT_WARNING:
                    obj["node"] = f"fz-node-{index}"
                else:
                    obj["add"] = []
                    obj["remove"] = [f"fz-node-{index}"]
                    obj.pop("target_devices", None)
                return encode_obj(obj)
        return None


def encode_obj(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


# -- the run ----------------------------------------------------------------------------------------------


class FuzzResult(msgspec.Struct, kw_only=True):
    seed: int
    sent: int
    by_category: dict[str, int]
    by_subject: dict[str, int]
    answered: int
    """Messages answered with an error event (of those on subjects where one is expected)."""
    expected_answers: int
    dead_lettered: int
    expected_dead_letters: int
    unanswered: list[str]
    """``subject category index`` of each message without an error event (or a dead letter it needed)."""
    unplanned_exits: dict[str, int]
    services_answering: list[str]
    resized_after: bool
    conflict_refused: bool
    seconds: float
    send_seconds: float

    @property
    def passed(self) -> bool:
        return (
            not self.unanswered
            and not self.unplanned_exits
            and set(self.services_answering) == {t.value for t in SERVICES}
            and self.resized_after
            and self.conflict_refused
        )


@dataclass
class _Sent:
    hostile: Hostile
    channel: Channel
    sequence: int | None = None
    answered: bool = False
    dead_lettered: bool = False


def _pending(x: _Sent) -> bool:
    """Whether ``x`` still lacks an answer it must get."""
    return (x.channel.answered and not x.answered) or (x.channel.dead_letter and not x.dead_lettered)


def _payload_key(subject: str, data: bytes) -> tuple[str, int, str]:
    """How an error event shows an unstored payload: its size and (cut, maybe base64) text."""
    shown = error_event(source="fuzz", subject=subject, data=data, error=MessageError("fuzz", "$", "fuzz"))
    return subject, shown.payload_size, hashlib.sha256(shown.payload.encode()).hexdigest()


class FuzzRun:
    def __init__(
        self, seed: int, count: int, log_dir: Path, progress: Callable[[str], None] = lambda _: None
    ) -> None:
        self.seed = seed
        self.count = count
        self.progress = progress
        # One step, run after the fuzz: the job must still resize.
        self.rig = ChaosRun(make_schedule(seed, steps=1, kills=0, server_kills=0), ChaosConfig(), log_dir)
        self.sent: list[_Sent] = []
        self._by_error: dict[tuple[Any, ...], _Sent] = {}
        self._by_letter: dict[tuple[Any, ...], _Sent] = {}
        self._error_seq = 1
        self._dlq_seq = 1

    async def run(self, answer_timeout_s: float) -> FuzzResult:
        started = time.monotonic()
        try:
            self.progress("starting a nats-server, four services and the simulated job")
            await self.rig.start()
            self._error_seq = await self._last_seq(s.STREAM_ERRORS.name) + 1
            self._dlq_seq = await self._last_seq(s.STREAM_DEAD_LETTERS.name) + 1
            sending = time.monotonic()
            await self._send()
            send_seconds = time.monotonic() - sending
            self.progress(
                f"sent {len(self.sent)} hostile messages in {send_seconds:.1f} s; waiting for answers"
            )
            waiting = time.monotonic()
            await self._await_answers(answer_timeout_s)
            left = sum(_pending(x) for x in self.sent)
            self.progress(
                f"answers read in {time.monotonic() - waiting:.1f} s ({left} missing); resizing the job"
            )
            answering = await self._answering()
            resized, conflict = await self._still_resizes()
        finally:
            await self.rig.close()
        unanswered = [
            f"{x.hostile.subject} {x.hostile.category.value} {x.hostile.index}"
            for x in self.sent
            if _pending(x)
        ]
        return FuzzResult(
            seed=self.seed,
            sent=len(self.sent),
            by_category=dict(Counter(x.hostile.category.value for x in self.sent)),
            by_subject=dict(Counter(x.hostile.subject for x in self.sent)),
            answered=sum(x.answered for x in self.sent if x.channel.answered),
            expected_answers=sum(x.channel.answered for x in self.sent),
            dead_lettered=sum(x.dead_lettered for x in self.sent),
            expected_dead_letters=sum(x.channel.dead_letter for x in self.sent),
            unanswered=unanswered,
            unplanned_exits=dict(self.rig.procs.unplanned_exits),
            services_answering=answering,
            resized_after=resized,
            conflict_refused=conflict,
            seconds=time.monotonic() - started,
            send_seconds=send_seconds,
        )

    async def _last_seq(self, stream: str) -> int:
        return int((await self.rig.js.stream_info(stream)).state.last_seq)

    async def _send(self) -> None:
        """Publish the hostile messages. Worker traffic is core NATS, with no flow control: a reader
        that falls more than ``CORE_AHEAD`` messages behind is waited for (up to ``CATCH_UP_S``), so that
        a slow reader is not cut off by the server and its dropped messages counted as unanswered."""
        assert self.rig.nc is not None
        nc = self.rig.nc
        maker = HostileMaker(self.seed, max_payload=nc.max_payload)
        chans = channels()
        for index in range(self.count):
            channel = chans[index % len(chans)]
            hostile = maker.make(channel, index)
            if hostile is None:
                continue
            sent = _Sent(hostile=hostile, channel=channel)
            if channel.stream is not None:
                ack = await self.rig.js.publish(
                    channel.subject, hostile.data, headers={s.HEADER_MSG_ID: f"fuzz-{self.seed}-{index}"}
                )
                sent.sequence = ack.seq
            else:
                await nc.publish(channel.subject, hostile.data)
            self._index(sent)
            if index % 50 == 49:
                await nc.flush()
                self.rig.procs.restart_exited_services()
                await self._catch_up()
        await nc.flush()

    def _index(self, x: _Sent) -> None:
        """Remember ``x`` under the keys its error event and dead letter will carry."""
        self.sent.append(x)
        if x.sequence is not None:
            self._by_error[(x.channel.subject, x.sequence)] = x
            self._by_letter[(x.channel.stream, x.sequence)] = x
        else:
            self._by_error[_payload_key(x.channel.subject, x.hostile.data)] = x
            self._by_letter[(x.channel.subject, hashlib.sha256(x.hostile.data).hexdigest())] = x

    async def _catch_up(self) -> None:
        core = [x for x in self.sent if x.sequence is None and x.channel.answered]
        deadline = time.monotonic() + CATCH_UP_S
        while sum(not x.answered for x in core) > CORE_AHEAD and time.monotonic() < deadline:
            await self._collect()
            await asyncio.sleep(0.1)

    async def _read_new(self, stream: str, start: int) -> tuple[list[Any], int]:
        """The messages of ``stream`` from sequence ``start`` on, and the sequence to read next: as many
        as could be read (a failed request ends the read; the next call goes on from there)."""
        js = self.rig.js
        out = []
        seq = start
        try:
            last = await self._last_seq(stream)
            while seq <= last:
                with contextlib.suppress(nats.js.errors.NotFoundError):  # none is deleted; do not spin
                    out.append(await js.get_msg(stream, seq))
                seq += 1
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            pass
        return out, seq

    async def _collect(self) -> None:
        """Read the error events and dead letters published since the last call; mark what they answer."""
        errors, self._error_seq = await self._read_new(s.STREAM_ERRORS.name, self._error_seq)
        letters, self._dlq_seq = await self._read_new(s.STREAM_DEAD_LETTERS.name, self._dlq_seq)
        for raw in errors:
            try:
                event = decode(raw.data or b"", m.ErrorEvent)
            except MessageError:
                continue
            if event.stream_sequence is not None:
                found = self._by_error.get((event.subject, event.stream_sequence))
            else:
                payload = hashlib.sha256(event.payload.encode()).hexdigest()
                found = self._by_error.get((event.subject, event.payload_size, payload))
            if found is not None:
                found.answered = True
        for raw in letters:
            headers = raw.headers or {}
            stream, seq = headers.get(s.HEADER_ORIGINAL_STREAM), headers.get(s.HEADER_ORIGINAL_SEQUENCE)
            if stream is not None and seq is not None and seq.isdigit():
                found = self._by_letter.get((stream, int(seq)))
            else:
                digest = headers.get(HEADER_PAYLOAD_DIGEST, "").removeprefix("SHA-256=")
                digest = digest or hashlib.sha256(raw.data or b"").hexdigest()
                found = self._by_letter.get((headers.get(s.HEADER_ORIGINAL_SUBJECT, ""), digest))
            if found is not None:
                found.dead_lettered = True

    async def _await_answers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            await self._collect()
            self.rig.procs.restart_exited_services()
            if not any(_pending(x) for x in self.sent) or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.5)

    async def _answering(self) -> list[str]:
        assert self.rig.nc is not None
        out = []
        for target in SERVICES:
            try:
                await self.rig.nc.request(f"$SRV.PING.liver-{target.value}", b"", timeout=5.0)
                out.append(target.value)
            except (nats.errors.Error, TimeoutError):
                pass
        return out

    async def _still_resizes(self) -> tuple[bool, bool]:
        """The job resizes on a valid event, and a copy of its id with other content changes nothing."""
        step = self.rig.schedule.steps[0]
        record = await self.rig.step(step)
        if record.outcome != "committed":
            return False, False
        event_id = record.event_ids[0]
        if record.kind == EventKind.SHRINK:
            subject = s.SPOT_WARNING
            other: m.Message = m.SpotWarning(
                job_id=JOB, event_id=event_id, node=record.nodes[0], provider="fuzz", notice_s=60.0
            )
        else:
            subject = s.SCALE_REQUEST
            back = m.NodeDevices(node=record.nodes[0], devices=(0,))
            other = m.ScaleRequest(job_id=JOB, event_id=event_id, reason="the same id again", add=(back,))
        outcomes_before = len(await self.rig.outcomes())
        ack = await self.rig.js.publish(subject, encode(other))
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            errors, self._error_seq = await self._read_new(s.STREAM_ERRORS.name, self._error_seq)
            for raw in errors:
                try:
                    event = decode(raw.data or b"", m.ErrorEvent)
                except MessageError:
                    continue
                if event.subject == subject and event.stream_sequence == ack.seq:
                    # Refused; and nothing started from it either (an outcome would follow in seconds).
                    await asyncio.sleep(CONFLICT_QUIET_S)
                    return True, len(await self.rig.outcomes()) == outcomes_before
            await asyncio.sleep(0.2)
        return True, False


def run_fuzz(
    seed: int,
    count: int,
    log_dir: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
    answer_timeout_s: float = 300.0,
) -> FuzzResult:
    with rig.log_directory(log_dir, "liver-fuzz-") as where:
        return asyncio.run(FuzzRun(seed, count, where, progress).run(answer_timeout_s))
