"""The topology planner on the bus: ``TopologyRequest`` in, ``TopologyPlanned`` or ``PlanningFailed`` out.

Per message: decode strictly (bad input: an ``ErrorEvent``, a dead letter, ``term``); find the job's
profile (:mod:`.settings`); choose in a worker thread (a thousand-device job takes most of a second,
and the loop must keep answering discovery and telling JetStream the message is in progress); publish
the answer on the job's subject; acknowledge. The answer's ``Nats-Msg-Id`` derives from the request's
stream sequence, so a redelivery after a crash republishes the same id and JetStream drops the copy.

The chosen layout, its rivals with their scores and the explanation travel in ``TopologyPlanned`` and
are logged too, so an operator reading the log sees why a job got the layout it got.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Final

import structlog
from nats.aio.msg import Msg

from liver.services import bus as b
from liver.services.host import BusConnection, ConsumingService, keep_in_progress
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode
from liver.shared.logs import bind_message
from liver.shared.messages import PlanningFailed, TopologyPlanned, TopologyRequest

from .core import Answer, answer, failed
from .settings import TopologySettings

log = structlog.get_logger(__name__)

SOURCE: Final = "topology"


class TopologyService(ConsumingService):
    """The topology planner service (see the module docstring)."""

    name = SOURCE
    description = "Chooses the target layout and placement of each requested generation."

    def __init__(self, settings: TopologySettings) -> None:
        super().__init__("planned", "failed")
        self.settings = settings

    async def start(self, bus: BusConnection) -> None:
        js = self._js = bus.js
        await b.ensure_streams(
            js, (s.STREAM_CONTROL, s.STREAM_ERRORS, s.STREAM_DEAD_LETTERS), replicas=bus.replicas
        )
        config = b.pull_consumer_config(
            self.settings.durable,
            s.TOPOLOGY_REQUEST_ANY,
            ack_wait_s=self.settings.ack_wait_s,
            max_deliver=self.settings.max_deliver,
            description="The topology planner: the coordinators' topology requests.",
        )
        await self._consume(
            bus,
            stream=s.STREAM_CONTROL.name,
            config=config,
            batch=1,  # planning a large job takes a while: leave the rest to other instances
            retry_delay_s=self.settings.retry_delay_s,
        )

    async def handle(self, msg: Msg) -> None:
        assert self._js is not None
        self.counts["received"] += 1
        try:
            request = decode(msg.data, TopologyRequest)
        except MessageError as error:
            await self._reject(msg, error)
            return
        if await self._reject_misaddressed(msg, request):
            return
        with bind_message(request):
            profile = self.settings.profile_for(request.job_id)
            if profile is None:
                result = Answer(
                    failed(
                        request, f"the topology service has no model configured for job {request.job_id!r}"
                    ),
                    None,
                )
            else:
                async with keep_in_progress(msg, self.settings.progress_every_s):
                    started = time.perf_counter()
                    result = await asyncio.to_thread(
                        answer, request, profile, self.settings, datetime.now(UTC)
                    )
                    self.metrics.plan_seconds.labels("topology").observe(time.perf_counter() - started)
            out = result.message
            subject = (
                s.topology_planned(request.job_id)
                if isinstance(out, TopologyPlanned)
                else s.planning_failed(request.job_id)
            )
            meta = msg.metadata
            ack = await self._js.publish(
                subject,
                encode(out),
                headers={s.HEADER_MSG_ID: f"topology-{meta.stream}-{meta.sequence.stream}"},
            )
            await msg.ack()
            self._report(request, result, republished=bool(ack.duplicate))

    def _report(self, request: TopologyRequest, result: Answer, *, republished: bool) -> None:
        out, decision = result.message, result.decision
        if isinstance(out, PlanningFailed):
            self.counts["failed"] += 1
            log.warning("topology_planning_failed", reason=out.reason, republished=republished)
            return
        assert decision is not None
        self.counts["planned"] += 1
        log.info(
            "topology_planned",
            from_layout=request.layout.describe(),
            layout=out.layout.describe(),
            devices=len(out.placement),
            devices_idle=[str(d) for d in decision.devices_idle],
            tokens_per_s=round(decision.tokens_per_s, 3),
            bytes_moved=decision.bytes_moved,
            memory_peak_bytes=decision.memory_peak_bytes,
            memory_usable_bytes=decision.memory_usable_bytes,
            considered=decision.considered,
            feasible=decision.feasible,
            candidates=[
                {
                    "layout": c.layout.describe(),
                    "score": round(c.score, 3),
                    "fits": c.fits,
                    "bytes": c.bytes_moved,
                }
                for c in out.candidates
            ],
            explanation=out.explanation,
            planning_seconds=round(decision.planning_seconds, 4),
            republished=republished,
        )


def create_service(environ: Mapping[str, str]) -> TopologyService:
    """What ``liver serve topology`` runs, configured by ``$LIVER_TOPOLOGY_CONFIG`` and the
    ``LIVER_TOPOLOGY_*`` variables (:mod:`.settings`)."""
    return TopologyService(TopologySettings.from_env(environ))
