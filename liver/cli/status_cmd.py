"""``liver status``: which services answer, and where each job stands.

Services are found the way NATS finds micro services: one ``$SRV.PING`` request, every reply within
``--wait`` seconds counted (each service process registers ``liver-<name>``; several instances of one
service each answer). Jobs are read from the coordinator's own records: the generation record in
``liver-generations`` (the live world, the last issued generation, the handoff in flight and the last
outcome) and the membership in ``liver-membership`` (the current world's workers). A record that does
not decode is shown as such, never skipped silently: it is what an operator needs to see.

It pings ``$SRV.PING`` and reads the two buckets through JetStream's API: of the users of
``infra/nats.conf`` only ``operator`` may do both (a service may ping only itself, ``publisher`` and
``subscriber`` neither). Any other user gets one line naming the subject it was refused, never a wait for
the timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Mapping
from typing import Final, TypeVar

import msgspec
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from liver.cli.bus_access import connect_once, guarded, job_flag, server_url, utc_text
from liver.services.coordinator.record import GenerationRecord
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode
from liver.shared.errors import InputError
from liver.shared.messages import AbortOutcome, GenerationAborted, GenerationCommitted, JobMembership

REQUEST_TIMEOUT_S: Final = 10.0
NEEDS: Final = "the operator role"
"""What a user refused a subject of ``liver status`` lacks (infra/nats.conf)."""
M = TypeVar("M", GenerationRecord, JobMembership)


class StatusError(InputError):
    """A bad flag: printed as one line naming it, exit code 2."""


class ServiceSeen(msgspec.Struct, frozen=True):
    name: str
    id: str
    version: str


class JobStatus(msgspec.Struct, kw_only=True):
    job_id: str
    record: GenerationRecord | None = None
    record_error: str | None = None
    membership: JobMembership | None = None
    membership_error: str | None = None


class Status(msgspec.Struct, kw_only=True):
    services: list[ServiceSeen]
    jobs: list[JobStatus]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="the services that answer and where each job stands")
    p.add_argument("--job", help="only this job")
    p.add_argument("--wait", type=float, default=1.0, help="seconds to collect service replies (default 1)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--url", help="the NATS server (default $NATS_URL)")
    p.set_defaults(func=run)


async def services(nc: Client, wait_s: float) -> list[ServiceSeen]:
    """Every micro service that answers ``$SRV.PING`` within ``wait_s``, sorted by name."""
    replies: list[Msg] = []
    inbox = nc.new_inbox()

    async def collect(msg: Msg) -> None:
        replies.append(msg)

    sub = await nc.subscribe(inbox, cb=collect)
    try:
        await nc.publish("$SRV.PING", b"", reply=inbox)
        await nc.flush(timeout=int(REQUEST_TIMEOUT_S))
        await asyncio.sleep(wait_s)
    finally:
        await sub.unsubscribe()
    seen = []
    for msg in replies:
        try:
            reply = json.loads(msg.data)
            seen.append(ServiceSeen(str(reply["name"]), str(reply["id"]), str(reply.get("version", ""))))
        except (ValueError, KeyError, TypeError):
            continue  # not a micro service's reply: nothing to report about it
    return sorted(seen, key=lambda x: (x.name, x.id))


async def _bucket(nc: Client, name: str) -> KeyValue | None:
    try:
        return await nc.jetstream(timeout=REQUEST_TIMEOUT_S).key_value(name)
    except nats.js.errors.BucketNotFoundError:
        return None


async def _keys(kv: KeyValue | None) -> list[str]:
    if kv is None:
        return []
    try:
        return sorted(await kv.keys())
    except nats.js.errors.NoKeysError:
        return []


async def _value(kv: KeyValue | None, key: str) -> bytes | None:
    if kv is None:
        return None
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    return entry.value


async def jobs(nc: Client, job: str | None) -> list[JobStatus]:
    """Each job's generation record and membership (``job`` only, when given)."""
    records = await _bucket(nc, s.KV_GENERATIONS)
    members = await _bucket(nc, s.KV_MEMBERSHIP)
    names = [job] if job is not None else sorted({*await _keys(records), *await _keys(members)})
    out = []
    for name in names:
        record, record_error = _decoded(await _value(records, name), GenerationRecord)
        membership, membership_error = _decoded(await _value(members, name), JobMembership)
        out.append(
            JobStatus(
                job_id=name,
                record=record,
                record_error=record_error,
                membership=membership,
                membership_error=membership_error,
            )
        )
    return out


def _decoded(data: bytes | None, into: type[M]) -> tuple[M | None, str | None]:
    """A stored value as ``into``, or why it does not decode (None and None: nothing stored)."""
    if data is None:
        return None, None
    try:
        return decode(data, into), None
    except MessageError as exc:
        return None, str(exc)


async def status(nc: Client, job: str | None, wait_s: float) -> Status:
    return Status(services=await services(nc, wait_s), jobs=await jobs(nc, job))


def render(st: Status) -> str:
    """The status as text: services first, then a block per job."""
    lines = []
    if st.services:
        counts: dict[str, list[ServiceSeen]] = {}
        for svc in st.services:
            counts.setdefault(svc.name, []).append(svc)
        lines.append(
            "services: "
            + ", ".join(f"{name} x{len(v)} ({v[0].version})" for name, v in sorted(counts.items()))
        )
    else:
        lines.append("services: none answered")
    if not st.jobs:
        lines.append("jobs: none recorded")
    for j in st.jobs:
        lines.append(f"job {j.job_id}")
        lines.extend(f"  {line}" for line in _job_lines(j))
    return "\n".join(lines)


def _not_live(r: GenerationRecord) -> str:
    """Why the job has no live world, from what the record holds. A checkpoint fallback's abort names
    the checkpoint when it is known; the coordinator does not learn whether the job keeps checkpoints,
    so without one the line claims neither a restart from a checkpoint nor its absence."""
    o = r.last_outcome
    if not isinstance(o, GenerationAborted) or o.outcome is not AbortOutcome.CHECKPOINT_FALLBACK:
        return "not live (waiting for the job's launcher to report its world)"
    if o.checkpoint is not None:
        return f"not live (generation {o.generation} fell back; restarting from checkpoint {o.checkpoint})"
    return (
        f"not live (generation {o.generation} fell back: its workers restart from their latest "
        "checkpoint if they keep one; it trains again once its launcher reports a new world)"
    )


def _job_lines(j: JobStatus) -> list[str]:
    out = []
    r = j.record
    if r is not None:
        state = "live" if r.live else _not_live(r)
        out.append(
            f"generation {r.generation} (issued {r.issued}): {r.layout.describe()} on "
            f"{len(r.placement)} devices, {state}; written by {r.writer}"
        )
        p = r.pending
        if p is not None:
            target = (
                f" -> {p.layout.describe()} on {len(p.placement)} devices" if p.layout and p.placement else ""
            )
            out.append(
                f"handoff in flight: generation {p.generation} in {p.phase.value}{target}, "
                f"event {p.event_id}, began {utc_text(p.began_at)}, "
                f"deadline {utc_text(p.deadline)}"
            )
        else:
            out.append("handoff in flight: none")
        o = r.last_outcome
        if isinstance(o, GenerationCommitted):
            out.append(
                f"last outcome: generation {o.generation} committed {utc_text(o.committed_at)}, "
                f"downtime {o.downtime_s:.3f} s, event {o.event_id}"
            )
        elif isinstance(o, GenerationAborted):
            out.append(
                f"last outcome: generation {o.generation} aborted {utc_text(o.aborted_at)} in "
                f"{o.phase.value} ({o.outcome.value}), event {o.event_id}: {o.reason}"
            )
    elif j.record_error is not None:
        out.append(f"generation record does not decode: {j.record_error}")
    else:
        out.append("no generation record (no coordinator has started this job)")
    m = j.membership
    if m is not None:
        nodes = sorted({w.device.node for w in m.workers})
        out.append(f"workers: {len(m.workers)} in generation {m.generation}, on {len(nodes)} nodes")
        if m.standbys:
            devices = ", ".join(str(w.device) for w in m.standbys)
            out.append(f"standbys: {len(m.standbys)} ({devices})")
        else:
            out.append("standbys: none")
    elif j.membership_error is not None:
        out.append(f"membership does not decode: {j.membership_error}")
    else:
        out.append("workers: no membership recorded")
    return out


async def _run(args: argparse.Namespace, url: str, environ: Mapping[str, str]) -> Status:
    nc = await connect_once(url, environ, name="liver-status")
    try:
        return await guarded(nc, status(nc, args.job, args.wait), needs=NEEDS, timeout_s=REQUEST_TIMEOUT_S)
    finally:
        await nc.close()


def run(args: argparse.Namespace) -> int:
    if not 0 < args.wait <= 60:
        raise StatusError(f"--wait: must be > 0 and at most 60 seconds, got {args.wait}")
    job_flag(args.job)
    url = server_url(args.url, os.environ)
    st = asyncio.run(_run(args, url, os.environ))
    if args.json:
        print(msgspec.json.encode(st).decode())
    else:
        print(render(st))
    return 0
