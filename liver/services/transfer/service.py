"""The transfer planner on the bus: ``TopologyPlanned`` in, plan objects and ``TransferPlanned`` out.

Per message: decode strictly; plan and verify in a worker thread (a large plan takes seconds, and the
event loop must keep answering discovery and acknowledging progress meanwhile); store the full plan
file in the ``liver-plans`` object store (a large job's plan is far over the 1 MiB message limit) and
one slice per device, as an entry of the ``liver-slices`` key-value bucket or, when too large for one
message, as an object (:mod:`.store`); then publish ``TransferPlanned`` with the slices' naming rule
(``SliceIndex``: a worker derives its slice's location from the two placements), a reference per
device and the summary.

Names derive from the ``TopologyPlanned``'s stream sequence, so a redelivery (after a crash, say)
rewrites the same objects and entries and republishes the same ``Nats-Msg-Id`` (JetStream drops the
copy), while a re-plan of the same generation gets names of its own and cannot overwrite a plan workers
are reading.
Invalid input or a plan that fails verification: an ``ErrorEvent``, a dead letter, no
``TransferPlanned``. State that survives only on the message's ``lost`` devices: a ``PlanningFailed``
(stage ``transfer``) naming the tensor and the lost devices, under the same message id a plan would
have had; the coordinator aborts the generation and the job falls back to its checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from typing import Final

import msgspec
import structlog
from nats.aio.msg import Msg

from liver.reshard.planner import DEFAULT_BUDGET_BYTES, NoSurvivingSource, build_plan
from liver.services import bus as b
from liver.services.host import DEFAULT_ACK_WAIT_S, BusConnection, ConsumingService, keep_in_progress
from liver.services.transfer import core, store
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode
from liver.shared.logs import bind_message
from liver.shared.messages import TopologyPlanned, TransferPlanned, WorkerPlanRef

log = structlog.get_logger(__name__)

SOURCE: Final = "transfer"
BUDGET_ENV: Final = "LIVER_TRANSFER_BUDGET_BYTES"
"""Staging budget per destination and streaming round, in bytes (the worker's staging buffer)."""

MIN_BUDGET_BYTES: Final = 8
"""The largest element (int64): a smaller budget cannot move anything."""


class TransferSettings(msgspec.Struct, frozen=True, kw_only=True):
    durable: str = "transfer"
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    optimizer: bool = True
    """Plan the optimizer state (moments, master weights) along with the parameters."""
    max_deliver: int = 3
    ack_wait_s: float = DEFAULT_ACK_WAIT_S
    progress_every_s: float = DEFAULT_ACK_WAIT_S / 3
    """How often a long planning run tells JetStream it is still working (well under ``ack_wait_s``)."""
    store_timeout_s: float = 60.0
    """The longest one write of a plan object or slice entry may take."""
    retry_delay_s: float = 2.0
    plans_ttl_s: float = 7 * b.DAY_S
    """How long plan objects and slice entries live if nobody deletes them (a missed release)."""
    kv_slice_max_bytes: int = store.KV_SLICE_MAX_BYTES
    """Slices up to this size (and half the server's ``max_payload``) are key-value entries; larger
    ones are objects."""

    def __post_init__(self) -> None:
        s.validate_token(self.durable, "durable")
        if self.budget_bytes < MIN_BUDGET_BYTES:
            raise ValueError(f"budget_bytes must be >= {MIN_BUDGET_BYTES}, got {self.budget_bytes}")
        if self.max_deliver < 1:
            raise ValueError(f"max_deliver must be >= 1, got {self.max_deliver}")
        if self.kv_slice_max_bytes < 0:
            raise ValueError(f"kv_slice_max_bytes must be >= 0, got {self.kv_slice_max_bytes}")
        for field in ("ack_wait_s", "progress_every_s", "retry_delay_s", "plans_ttl_s", "store_timeout_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.progress_every_s >= self.ack_wait_s:
            raise ValueError(
                f"progress_every_s ({self.progress_every_s}) must be shorter than "
                f"ack_wait_s ({self.ack_wait_s})"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> TransferSettings:
        """Settings with ``$LIVER_TRANSFER_BUDGET_BYTES`` applied (explicit ``overrides`` win)."""
        env = os.environ if environ is None else environ
        fields: dict[str, object] = {}
        raw = env.get(BUDGET_ENV, "").strip()
        if raw:
            try:
                budget = int(raw)
            except ValueError:
                raise ValueError(f"{BUDGET_ENV}: {raw!r} is not a whole number of bytes") from None
            if budget < MIN_BUDGET_BYTES:
                raise ValueError(f"{BUDGET_ENV}: must be >= {MIN_BUDGET_BYTES}, got {budget}")
            fields["budget_bytes"] = budget
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)  # type: ignore[arg-type]


class TransferService(ConsumingService):
    """The transfer planner service (see the module docstring)."""

    name = SOURCE
    description = "Builds, verifies and stores transfer plans for planned topologies."

    def __init__(self, settings: TransferSettings | None = None, planner: core.Planner = build_plan) -> None:
        super().__init__("planned", "failed")
        self.settings = settings or TransferSettings()
        self._planner = planner
        self._writer: store.PlanWriter | None = None

    async def start(self, bus: BusConnection) -> None:
        js = self._js = bus.js
        await b.ensure_streams(
            js, (s.STREAM_CONTROL, s.STREAM_ERRORS, s.STREAM_DEAD_LETTERS), replicas=bus.replicas
        )
        objects = await b.ensure_object_store(
            js,
            s.OBJECT_STORE_PLANS,
            description="Transfer plans and per-device slices, by job, generation and request.",
            ttl_s=self.settings.plans_ttl_s,
            replicas=bus.replicas,
        )
        await b.ensure_kv(
            js,
            s.KV_PLAN_SLICES,
            description="Per-device plan slices that fit one message, by job, generation and request.",
            ttl_s=self.settings.plans_ttl_s,
            replicas=bus.replicas,
        )
        self._writer = store.PlanWriter(
            js,
            objects,
            object_bucket=s.OBJECT_STORE_PLANS,
            kv_bucket=s.KV_PLAN_SLICES,
            kv_max_bytes=store.kv_limit(bus.nc.max_payload, self.settings.kv_slice_max_bytes),
            timeout_s=self.settings.store_timeout_s,
        )
        config = b.pull_consumer_config(
            self.settings.durable,
            s.TOPOLOGY_PLANNED_ANY,
            ack_wait_s=self.settings.ack_wait_s,
            max_deliver=self.settings.max_deliver,
            description="The transfer planner: planned topologies.",
        )
        await self._consume(
            bus,
            stream=s.STREAM_CONTROL.name,
            config=config,
            batch=1,  # each message is seconds of work: leave the rest to other instances
            retry_delay_s=self.settings.retry_delay_s,
        )

    async def handle(self, msg: Msg) -> None:
        assert self._js is not None
        self.counts["received"] += 1
        try:
            topology = decode(msg.data, TopologyPlanned)
        except MessageError as error:
            await self._reject(msg, error)
            return
        if await self._reject_misaddressed(msg, topology):
            return
        with bind_message(topology):
            try:
                async with keep_in_progress(msg, self.settings.progress_every_s):
                    started = time.perf_counter()
                    planned = await asyncio.to_thread(
                        core.plan_transfer,
                        topology,
                        budget_bytes=self.settings.budget_bytes,
                        optimizer=self.settings.optimizer,
                        planner=self._planner,
                    )
                    self.metrics.plan_seconds.labels("transfer").observe(time.perf_counter() - started)
            except MessageError as error:
                await self._reject(msg, error)
                return
            except NoSurvivingSource as error:
                await self._fail(msg, topology, error)
                return
            seq = msg.metadata.sequence.stream
            stored_at = time.perf_counter()
            out = await self._store_plan(topology, planned, seq)
            store_seconds = time.perf_counter() - stored_at
            await self._js.publish(
                s.transfer_planned(topology.job_id),
                encode(out),
                headers={s.HEADER_MSG_ID: f"transfer-{msg.metadata.stream}-{seq}"},
            )
            await msg.ack()
            self.counts["planned"] += 1
            summary = planned.summary
            log.info(
                "transfer_planned",
                layout=topology.layout.describe(),
                from_layout=topology.from_layout.describe(),
                bytes_moved=summary.bytes_moved,
                bytes_rank_order=summary.bytes_rank_order,
                lower_bound_bytes=summary.lower_bound_bytes,
                tasks=summary.tasks_coalesced,
                rounds=summary.rounds,
                plan_seconds=round(summary.plan_seconds, 4),
                verify_seconds=round(planned.verify_seconds, 4),
                encode_seconds=round(planned.encode_seconds, 4),
                plan_object=out.plan.name,
                plan_bytes=out.plan.size,
                devices=len(out.workers),
                slices_as_objects=len(out.slices.objects),
                store_seconds=round(store_seconds, 4),
            )

    async def _store_plan(
        self, topology: TopologyPlanned, planned: core.PlannedTransfer, seq: int
    ) -> TransferPlanned:
        assert self._writer is not None
        job, generation = topology.job_id, topology.generation
        plan_name = s.plan_object_name(job, generation, f"plan-s{seq}")
        # Slice i is named by its index in slice_devices(old, new): workers derive their slice's location
        # from the Prepare's two placements instead of receiving a reference each.
        prefix = s.plan_object_name(job, generation, f"s{seq}") + "-"
        plan_ref, (index, refs) = await asyncio.gather(
            self._writer.put_object(plan_name, planned.plan_file),
            self._writer.put_slices(prefix, planned.slice_files),
        )
        return TransferPlanned(
            job_id=job,
            event_id=topology.event_id,
            from_generation=topology.from_generation,
            generation=generation,
            plan=plan_ref,
            workers=tuple(WorkerPlanRef(device=p.device, ref=r) for p, r in zip(planned.slices, refs)),
            slices=index,
            summary=planned.summary,
            deadline=topology.deadline,
        )

    async def _fail(self, msg: Msg, topology: TopologyPlanned, error: NoSurvivingSource) -> None:
        assert self._js is not None
        await self._js.publish(
            s.planning_failed(topology.job_id),
            encode(core.planning_failed(topology, error)),
            headers={s.HEADER_MSG_ID: f"transfer-{msg.metadata.stream}-{msg.metadata.sequence.stream}"},
        )
        await msg.ack()
        self.counts["failed"] += 1
        log.warning(
            "transfer_planning_failed",
            tensor=error.tensor,
            lost=[str(d) for d in error.lost],
            reason=str(error),
        )


def create_service(environ: Mapping[str, str]) -> TransferService:
    """What ``liver serve transfer`` runs, with ``$LIVER_TRANSFER_BUDGET_BYTES`` applied."""
    return TransferService(TransferSettings.from_env(environ))
