"""Announce a job's first world to the coordinator (``WorldStarted``), as a launcher does.

A world started outside the live path (the job's first one, or a restart from a checkpoint) is not
known to the coordinator until someone says so. In a LiveR training job the process that runs rank 0
of that world says so once the world is built, so the announcement never precedes the world.

The message goes into the control stream with a de-duplication id per job and generation: a rank 0
that restarts with the same world announces the same world, and JetStream drops the copy. The stream
is created by the coordinator; a process that starts first retries until ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import nats
import nats.errors
import nats.js.errors
import structlog

from liver.shared import subjects as s
from liver.shared.codec import encode
from liver.shared.connection import connect_options
from liver.shared.messages import WorldStarted

log = structlog.get_logger(__name__)


def world_msg_id(job_id: str, generation: int) -> str:
    return f"{job_id}-world-{generation}"


async def publish_world_started(
    message: WorldStarted,
    url: str,
    environ: Mapping[str, str] | None = None,
    *,
    timeout_s: float = 30.0,
    retry_s: float = 0.5,
) -> bool:
    """Store ``message`` in the control stream; returns whether the stream already had it.

    Raises ``TimeoutError`` when no control stream took it within ``timeout_s``.
    """
    options = connect_options(url, environ, name=f"liver-announce-{message.job_id}")
    nc = await nats.connect(**options)
    try:
        js = nc.jetstream()
        give_up = time.monotonic() + timeout_s
        subject = s.world_started(message.job_id)
        headers = {s.HEADER_MSG_ID: world_msg_id(message.job_id, message.generation)}
        while True:
            try:
                ack = await js.publish(subject, encode(message), headers=headers, timeout=5.0)
            except (TimeoutError, nats.errors.Error, nats.js.errors.Error) as exc:
                if time.monotonic() + retry_s > give_up:
                    raise TimeoutError(
                        f"{subject}: not stored within {timeout_s} s (is a coordinator running?): {exc!r}"
                    ) from None
                log.info("world_started_retry", error=repr(exc))
                await asyncio.sleep(retry_s)
                continue
            log.info(
                "world_started_published",
                job_id=message.job_id,
                generation=message.generation,
                layout=message.layout.describe(),
                duplicate=bool(ack.duplicate),
            )
            return bool(ack.duplicate)
    finally:
        try:
            await nc.drain()
        except (TimeoutError, nats.errors.Error):
            await nc.close()
