"""``liver notice``: the notice agent of one node (a DaemonSet or a sidecar), or one look with ``--once``.

It polls the platform's own signal about the node it runs on and publishes each new notice as a
``spot.warning`` for the job (:mod:`liver.notice.agent`). The job and node come from the flags or from
``$LIVER_JOB_ID`` / ``$LIVER_NODE`` (in Kubernetes, the downward API's ``spec.nodeName``); they are
checked against the bus's rules before the first poll. ``--dry-run`` prints what it would publish
(logged as ``notice.dry_run``, not ``notice.published``).
SIGTERM or SIGINT stops it between two polls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
from collections.abc import Mapping
from enum import StrEnum
from typing import Final

from nats.aio.client import Client
from nats.aio.msg import Msg

from liver.cli.bus_access import connect_once, guarded, job_flag, server_url
from liver.notice import aws, azure, gcp
from liver.notice.agent import NoticeAgent, NoticeSource, PollOutcome
from liver.notice.aws import AwsSpotNotices
from liver.notice.azure import AzureScheduledEvents
from liver.notice.detect import detect
from liver.notice.gcp import GcpNotices
from liver.notice.kubernetes import DEFAULT_GRACE_S, KubernetesNotices
from liver.notice.publish import PUBLISH_TIMEOUT_S, publish_event
from liver.services.ingester.core import IngestEvent
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode
from liver.shared.errors import InputError
from liver.shared.logs import configure_logging
from liver.shared.messages import NODE_PATTERN, GenerationCommitted

JOB_ENV: Final = "LIVER_JOB_ID"
NODE_ENV: Final = "LIVER_NODE"


class Source(StrEnum):
    AWS = "aws"
    GCP = "gcp"
    AZURE = "azure"
    KUBERNETES = "kubernetes"
    AUTO = "auto"


class NoticeError(InputError):
    """A bad flag or environment variable: printed as one line naming it, exit code 2."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("notice", help="publish this node's preemption notices from its platform")
    p.add_argument("--source", required=True, choices=[x.value for x in Source], help="the platform")
    p.add_argument("--job", help=f"the job's id (default ${JOB_ENV})")
    p.add_argument("--node", help=f"this node's id, as the job's workers name it (default ${NODE_ENV})")
    p.add_argument(
        "--interval",
        type=float,
        default=5.0,
        help="seconds between polls; gcp: the long poll's wait (default 5)",
    )
    p.add_argument(
        "--endpoint",
        help="the metadata service, or for kubernetes an API server without authentication "
        "(default: the platform's own address; kubernetes: in-cluster credentials, else the kubeconfig)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        help=f"kubernetes: seconds from a disruption taint to the node's end (default {DEFAULT_GRACE_S:g})",
    )
    p.add_argument(
        "--no-rebalance",
        action="store_true",
        help="aws: publish only scheduled interruptions, not EC2's earlier rebalance recommendations",
    )
    p.add_argument("--once", action="store_true", help="poll once, publish what is there, and exit")
    p.add_argument("--dry-run", action="store_true", help="print the events instead of publishing them")
    p.add_argument("--url", help="the NATS server (default $NATS_URL)")
    p.set_defaults(func=run)


def source_of(args: argparse.Namespace, node: str, environ: Mapping[str, str]) -> NoticeSource:
    source = Source(args.source)
    if source is Source.AUTO:
        if args.endpoint:
            raise NoticeError("--endpoint: give it with a --source, not with auto")
        source = Source(detect(environ).value)
    if source is Source.AWS:
        return AwsSpotNotices(args.endpoint or aws.DEFAULT_ENDPOINT, rebalance=not args.no_rebalance)
    if source is Source.GCP:  # a long poll: --interval is how long one waits for a change
        return GcpNotices(args.endpoint or gcp.DEFAULT_ENDPOINT, wait_s=args.interval)
    if source is Source.AZURE:
        return AzureScheduledEvents(args.endpoint or azure.DEFAULT_ENDPOINT)
    if source is Source.KUBERNETES:  # a watch: --interval is how long one watch lasts
        return KubernetesNotices.connect(node, args.endpoint, wait_s=args.interval, grace_s=args.grace)
    raise NoticeError(f"--source: unknown source {args.source!r}")  # argparse's choices keep this out


def identity(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, str]:
    """The job and node this agent speaks for, checked as the bus checks them."""
    job = args.job or environ.get(JOB_ENV, "")
    node = args.node or environ.get(NODE_ENV, "")
    if not job:
        raise NoticeError(f"--job: not given and ${JOB_ENV} is not set")
    if not node:
        raise NoticeError(f"--node: not given and ${NODE_ENV} is not set")
    job_flag(job)
    if re.match(NODE_PATTERN, node) is None:
        raise NoticeError(f"--node: {node!r} is not a node id the bus accepts ({NODE_PATTERN})")
    return job, node


async def _agent(args: argparse.Namespace, job: str, node: str, environ: Mapping[str, str]) -> int:
    source = source_of(args, node, environ)
    if args.dry_run:

        async def show(event: IngestEvent) -> None:
            print(encode(event).decode(), flush=True)

        agent = NoticeAgent(source, job_id=job, node=node, publish=show, dry_run=True)
        return await _drive(agent, args)
    nc = await connect_once(
        server_url(args.url, environ), environ, name="liver-notice", keep_reconnecting=True
    )
    try:

        async def send(event: IngestEvent) -> None:
            await publish_event(nc, event)

        agent = NoticeAgent(source, job_id=job, node=node, publish=send)

        async def drive() -> int:
            if hasattr(source, "acknowledge") and not args.once:
                await _acknowledge_on_commit(nc, agent)
            return await _drive(agent, args)

        # A refused publish or subscription ends the agent with one line: no retry would be allowed.
        return await guarded(nc, drive(), needs="the publisher role", timeout_s=PUBLISH_TIMEOUT_S)
    finally:
        await nc.drain()


async def _acknowledge_on_commit(nc: Client, agent: NoticeAgent) -> None:
    """Hand every commit of the job to the agent (a source that takes acknowledgements gets them once
    the node is out of the job's world)."""

    async def on_commit(msg: Msg) -> None:
        try:
            committed = decode(msg.data, GenerationCommitted)
        except MessageError:
            return  # someone else's bad message: the watch of generation outcomes reports it
        await agent.on_committed(committed)

    await nc.subscribe(s.GENERATION_COMMITTED, cb=on_commit)
    await nc.flush()


async def _drive(agent: NoticeAgent, args: argparse.Namespace) -> int:
    if args.once:
        outcome = await agent.poll_once()
        return 1 if outcome in (PollOutcome.SOURCE_FAILED, PollOutcome.PUBLISH_FAILED) else 0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await agent.run(args.interval, stop)
    return 0


def run(args: argparse.Namespace) -> int:
    if not 0.1 <= args.interval <= 3600:
        raise NoticeError(f"--interval: must be 0.1-3600 seconds, got {args.interval}")
    if not 0 < args.grace <= 86400:
        raise NoticeError(f"--grace: must be > 0 and at most a day, got {args.grace}")
    job, node = identity(args, os.environ)
    if not args.dry_run:
        server_url(args.url, os.environ)  # a missing URL is an error now, not after the first notice
    configure_logging()
    return asyncio.run(_agent(args, job, node, os.environ))
