"""The generation coordinator on the bus: one job's pure core (:mod:`.core`) fed with what arrives,
its actions carried out in the order it gives them.

What feeds the core, all through one lock so that it sees one event at a time:

* the job's control traffic, through one durable pull consumer on ``LIVER_CONTROL`` in stream order
  (resize requests, planned topologies, planned transfers, planning failures, started worlds): a plan
  is therefore always seen after the topology it was made for;
* worker hello, heartbeat and status, on plain subjects (they are not worth storing: a restarted
  coordinator re-sends its switch and the workers ack again);
* changes of the job's record by anyone (a watch on the key), which is how a coordinator learns that
  another one took the job over;
* ticks, at the core's :meth:`~.core.Coordinator.next_deadline`;
* the results of its own record writes, fed back before anything else.

What it does with the actions: :class:`WriteRecord` is a compare-and-set on the key (:mod:`.kv`);
:class:`RequestTopology` publishes a ``TopologyRequest`` (with the smallest device memory the workers
reported); :class:`ExpectTransfer` needs nothing, because the transfer planner reads planned
topologies from the stream itself and the core ignores plans of targets it dropped; commands go to one
worker's subject or the job's; outcomes are published with their dedup id; membership is put in
``liver-membership`` for the ingester; :class:`Settle` acknowledges the held resize requests
(:mod:`.held`); :class:`ReleasePlan` deletes the generation's plan objects by name in the background;
notes are logged.

On start the core is restored from the stored record (resuming or aborting a handoff a predecessor
left), after the worker subscriptions are up so that no ack to a re-sent switch is missed. A
coordinator that finds the record written by another stands by: it stops consuming, hands its held
requests back, and keeps only watching.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from liver.services import bus as b
from liver.services.host import DEFAULT_ACK_WAIT_S, BusConnection, ConsumingService
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode
from liver.shared.logs import bind_message
from liver.shared.messages import (
    GenerationCommitted,
    Heartbeat,
    Hello,
    PlanningFailed,
    ResizeRequested,
    TopologyPlanned,
    TransferPlanned,
    WorkerStatus,
    WorldStarted,
)

from .actions import (
    Action,
    ExpectTransfer,
    Note,
    ProbeWorkers,
    Publish,
    ReleasePlan,
    RequestTopology,
    SendCommand,
    Settle,
    SettleOutcome,
    WriteMembership,
    WriteRecord,
)
from .config import CoordinatorConfig
from .core import Coordinator
from .events import BusReconnected, Event, RecordConflict, RecordWriteFailed, Tick, WorkersProbed
from .held import HeldEvents, with_device_memory
from .kv import BUS_FAILURES, RecordStore
from .phases import GenerationPhase

log = structlog.get_logger(__name__)

SOURCE: Final = "coordinator"
JOB_ENV: Final = "LIVER_JOB_ID"
"""The job this coordinator runs (required): one coordinator process per job."""
INSTANCE_ENV: Final = "LIVER_COORDINATOR_ID"
"""This process's name in the records it writes; default: ``coordinator-`` and a random suffix. Give
each process its own: two coordinators with one name could not tell their writes apart."""
CONFIG_ENV: Final = "LIVER_COORDINATOR_CONFIG"
"""Path of a JSON file with :class:`CoordinatorSettings` fields (``core`` holds the state machine's
:class:`~.config.CoordinatorConfig`); ``$LIVER_JOB_ID`` and ``$LIVER_COORDINATOR_ID`` win over it."""

MIN_TICK_S: Final = 0.05
"""Ticks never come closer than this: a deadline the core cannot act on yet (a write in flight) must
not spin the loop."""
TICK_SLACK_S: Final = 0.005
"""The core acts when ``now`` is *past* a deadline."""
PUBLISH_ATTEMPTS: Final = 3
PROBE_RECHECK_S: Final = 0.2
"""Before a worker with no subscriber on the bus counts as gone, it is asked once more after this long."""
RELEASE_CONCURRENCY: Final = 32
"""Object deletions in flight at once when a plan is released (each is three round trips)."""


def control_subjects(job_id: str) -> dict[str, type]:
    """The job's control subjects the coordinator consumes, and the message type each carries."""
    return {
        s.resize_requested(job_id): ResizeRequested,
        s.topology_planned(job_id): TopologyPlanned,
        s.transfer_planned(job_id): TransferPlanned,
        s.planning_failed(job_id): PlanningFailed,
        s.world_started(job_id): WorldStarted,
    }


def _new_instance_id() -> str:
    return f"coordinator-{uuid.uuid4().hex[:12]}"


class CoordinatorSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one coordinator process runs its job; the defaults suit production, tests shorten them."""

    job_id: str
    instance_id: str = msgspec.field(default_factory=_new_instance_id)
    durable: str = ""
    """The durable consumer's name; empty: ``coordinator-<job>``. Coordinators that share it split the
    job's control traffic (only one should be active); coordinators with their own see all of it."""
    ack_wait_s: float = DEFAULT_ACK_WAIT_S
    progress_every_s: float = DEFAULT_ACK_WAIT_S / 3
    """How often held resize requests are reported in progress (well under ``ack_wait_s``)."""
    retry_delay_s: float = 1.0
    """Pause before a failed message is redelivered, and before a record write is retried."""
    max_deliver: int = 20
    batch: int = 64
    remember_settled: int = 10_000
    core: CoordinatorConfig = msgspec.field(default_factory=CoordinatorConfig)

    def __post_init__(self) -> None:
        s.validate_token(self.job_id, "job_id")
        s.validate_token(self.instance_id, "instance_id")
        if self.durable:
            s.validate_token(self.durable, "durable")
        for field in ("max_deliver", "batch", "remember_settled"):
            if getattr(self, field) < 1:
                raise ValueError(f"`{field}`: must be >= 1, got {getattr(self, field)}")
        for field in ("ack_wait_s", "progress_every_s", "retry_delay_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"`{field}`: must be > 0, got {getattr(self, field)}")
        if self.progress_every_s >= self.ack_wait_s:
            raise ValueError(
                f"`progress_every_s` ({self.progress_every_s}) must be shorter than `ack_wait_s` "
                f"({self.ack_wait_s})"
            )

    @property
    def durable_name(self) -> str:
        return self.durable or f"coordinator-{self.job_id}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> CoordinatorSettings:
        """Settings from ``$LIVER_COORDINATOR_CONFIG``, ``$LIVER_JOB_ID`` and ``$LIVER_COORDINATOR_ID``
        (explicit ``overrides`` win); errors name the variable and the field."""
        env = os.environ if environ is None else environ
        fields: dict[str, Any] = {}
        path = env.get(CONFIG_ENV, "").strip()
        if path:
            try:
                with open(path, "rb") as fh:
                    loaded = msgspec.json.decode(fh.read())
            except OSError as exc:
                raise ValueError(f"{CONFIG_ENV}: cannot read {path}: {exc.strerror}") from None
            except msgspec.DecodeError as exc:
                raise ValueError(f"{CONFIG_ENV} ({path}): not valid JSON ({exc})") from None
            if not isinstance(loaded, dict):
                raise ValueError(f"{CONFIG_ENV} ({path}): expected a JSON object")
            fields.update(loaded)
        for name, field in ((JOB_ENV, "job_id"), (INSTANCE_ENV, "instance_id")):
            value = env.get(name, "").strip()
            if value:
                fields[field] = value
        fields.update({k: v for k, v in overrides.items() if v is not None})
        if "job_id" not in fields:
            raise ValueError(f"{JOB_ENV}: the job this coordinator runs is required")
        where = f"{CONFIG_ENV} ({path})" if path else "coordinator settings"
        try:
            return msgspec.convert(fields, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{where}: {exc}") from None


class CoordinatorService(ConsumingService):
    """The coordinator of one job on the bus (see the module docstring)."""

    name = SOURCE
    description = "Runs the generation state machine of one job: handoffs, worker commands, commits."

    def __init__(self, settings: CoordinatorSettings) -> None:
        super().__init__(
            "worker_rejected",
            "commands",
            "published",
            "record_writes",
            "record_conflicts",
            "settled",
            "ticks",
            "probes",
        )
        self.settings = settings
        self.job_id = settings.job_id
        self.core = Coordinator(settings.job_id, instance_id=settings.instance_id, config=settings.core)
        self._control = control_subjects(settings.job_id)
        self._lock = asyncio.Lock()
        self._held = HeldEvents(settings.remember_settled)
        self._nc: Client | None = None
        self._records: RecordStore | None = None
        self._members: KeyValue | None = None
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._tick_at: datetime | None = None
        self._standing_by = False

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self, bus: BusConnection) -> None:
        self._nc, js = bus.nc, bus.js
        self._js = js
        await b.ensure_streams(
            js,
            (s.STREAM_CONTROL, s.STREAM_GENERATIONS, s.STREAM_ERRORS, s.STREAM_DEAD_LETTERS),
            replicas=bus.replicas,
        )
        self._records = await RecordStore.open(js, self.job_id, replicas=bus.replicas)
        self._members = await b.ensure_kv(
            js,
            s.KV_MEMBERSHIP,
            description="Each job's current workers and devices, by job id.",
            replicas=bus.replicas,
        )
        job = self.job_id
        for subject, handler in (
            (s.worker_hello(job), self._on_presence),
            (s.worker_heartbeat(job), self._on_presence),
            (s.worker_status(job), self._on_status),
        ):
            self._subs.append(await bus.nc.subscribe(subject, cb=handler))
        await bus.nc.flush()
        stored = await self._records.read()
        with bind_message(job_id=job):
            if stored is None:
                log.info("no_record_yet", waiting_for=s.world_started(job))
            else:
                async with self._lock:
                    await self._run(lambda now: self.core.restore(stored.record, stored.revision, now))
        self._spawn(self._follow_record(), "watch-record")
        self._spawn(self._tick_loop(), "ticks")
        self._spawn(self._keep_alive_loop(), "keep-alive")
        durable = self.settings.durable_name
        config = b.pull_consumer_config(
            durable,
            None,
            ack_wait_s=self.settings.ack_wait_s,
            max_deliver=self.settings.max_deliver,
            description=f"The coordinator of job {job}: its control traffic in stream order.",
        )
        config = dataclasses.replace(config, filter_subjects=list(self._control))
        await self._consume(
            bus,
            stream=s.STREAM_CONTROL.name,
            config=config,
            batch=self.settings.batch,
            retry_delay_s=self.settings.retry_delay_s,
            consume=not self._standing_by,
        )

    async def stop(self) -> None:
        await super().stop()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._subs = []
        # Whoever runs the job next gets the unsettled requests at once instead of after ack_wait.
        returned = await self._held.give_back()
        if returned:
            log.info("held_requests_returned", job_id=self.job_id, count=returned)

    def stats(self) -> dict[str, int | float | str]:
        record = self.core.record
        pending = self.core.pending_generation
        out: dict[str, int | float | str] = {
            "job_id": self.job_id,
            "instance_id": self.settings.instance_id,
            "phase": self.core.phase.value,
            "generation": -1 if record is None else record.generation,
            "pending_generation": -1 if pending is None else pending,
            "revision": self.core.revision,
            "workers": len(self.core.membership),
            "held": len(self._held),
            "heartbeats_missed": self.core.silent_workers,
        }
        out.update(super().stats())
        return out

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=f"coordinator-{self.job_id}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- input ------------------------------------------------------------------------------------------

    async def handle(self, msg: Msg) -> None:
        """One message of the job's control traffic (resize requests are held until settled)."""
        if self._standing_by:
            # Fetched before the consumer stopped: a coordinator sharing the durable must get it.
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()
            return
        self.counts["received"] += 1
        into = self._control.get(msg.subject)
        if into is None:  # the consumer's filters allow none; a foreign edit of the consumer might
            await self._reject(msg, MessageError("message", "$", f"unexpected subject {msg.subject}"))
            return
        try:
            event = decode(msg.data, into)
        except MessageError as error:
            await self._reject(msg, error)
            return
        if await self._reject_misaddressed(msg, event):
            return
        with bind_message(event):
            if not isinstance(event, ResizeRequested):
                await self._feed(event)
                await msg.ack()
                return
            settled = self._held.settled_as(event.event_id)
            if settled is not None:
                await msg.ack()
                log.info("settled_event_redelivered", settled=settled)
                return
            self._held.hold(event.event_id, msg)
            await self._feed(event)
            if event.event_id in self._held and event.event_id not in self.core.open_events:
                # A copy of an event that ended before this coordinator took over (the core knows its
                # id from the record): nothing will settle it, so holding it would only get it
                # redelivered for ever.
                await self._held.settle([event.event_id], SettleOutcome.ENDED_BEFORE)
                log.info("ended_event_acknowledged")

    async def on_reconnected(self) -> None:
        """The host's connection is back after an outage: the core re-sends the command of its phase."""
        if self._standing_by or self._js is None:
            return
        with bind_message(job_id=self.job_id):
            await self._feed(BusReconnected())

    async def _on_presence(self, msg: Msg) -> None:
        into = Hello if msg.subject == s.worker_hello(self.job_id) else Heartbeat
        event = await self._decode_worker(msg, into)
        if event is not None:
            with bind_message(event):
                await self._feed(event)

    async def _on_status(self, msg: Msg) -> None:
        event = await self._decode_worker(msg, WorkerStatus)
        if event is not None:
            with bind_message(event):
                await self._feed(event)

    async def _decode_worker(self, msg: Msg, into: type) -> Any:
        """Worker traffic is core NATS (in no stream): bad input becomes an error event and a
        dead letter made from the payload itself, as for stored input; only if JetStream cannot take
        them is it just logged (a worker's heartbeat must never stall the coordinator)."""
        assert self._js is not None
        try:
            return decode(msg.data, into)
        except MessageError as error:
            self.counts["worker_rejected"] += 1
            try:
                await b.reject_unstored(self._js, SOURCE, subject=msg.subject, data=msg.data, error=error)
            except BUS_FAILURES as exc:
                with bind_message(job_id=self.job_id):
                    log.warning(
                        "worker_message_rejected",
                        subject=msg.subject,
                        field=error.path,
                        reason=error.reason,
                        report_failed=repr(exc),
                    )
            return None

    async def _follow_record(self) -> None:
        assert self._records is not None
        while True:
            try:
                async with contextlib.aclosing(self._records.watch()) as observations:
                    async for observed in observations:
                        if observed.revision > self.core.revision:
                            with bind_message(job_id=self.job_id, generation=observed.record.generation):
                                await self._feed(observed)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("record_watch_failed", job_id=self.job_id, error=repr(exc))
            await asyncio.sleep(self.settings.retry_delay_s)

    async def _tick_loop(self) -> None:
        ticked = False
        while True:
            deadline = self.core.next_deadline()
            self._tick_at = deadline
            self._wake.clear()
            delay: float | None = None
            if deadline is not None:
                delay = max((deadline - datetime.now(UTC)).total_seconds(), 0.0) + TICK_SLACK_S
                if ticked:
                    delay = max(delay, MIN_TICK_S)
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
                ticked = False
            except TimeoutError:
                self.counts["ticks"] += 1
                with bind_message(job_id=self.job_id):
                    await self._feed(Tick())
                ticked = True

    async def _keep_alive_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.progress_every_s)
            await self._held.keep_alive()

    # -- the core ---------------------------------------------------------------------------------------

    async def _feed(self, event: Event) -> None:
        async with self._lock:
            await self._run(lambda now: self.core.handle(event, now))

    async def _run(self, step: Callable[[datetime], list[Action]]) -> None:
        """Apply one step of the core and everything it leads to: write results go straight back in."""
        actions = step(datetime.now(UTC))
        while True:
            result = await self._execute(actions)
            if result is None:
                break
            if isinstance(result, RecordWriteFailed):
                await asyncio.sleep(self.settings.retry_delay_s)
            actions = self.core.handle(result, datetime.now(UTC))
        if self.core.phase is GenerationPhase.STANDBY and not self._standing_by:
            self._standing_by = True
            self._spawn(self._stand_by(), "stand-by")
        deadline = self.core.next_deadline()
        if deadline is not None and (self._tick_at is None or deadline < self._tick_at):
            self._wake.set()

    async def _stand_by(self) -> None:
        """Another coordinator runs the job: leave its control traffic to it."""
        if self._consumer is not None:
            await self._consumer.consumer.stop()  # keep the dead-letter watch until the service stops
        returned = await self._held.give_back()
        with bind_message(job_id=self.job_id):
            log.warning("standing_by", returned_requests=returned, record_revision=self.core.revision)

    async def _execute(self, actions: list[Action]) -> Event | None:
        """Carry out ``actions`` in order; return the result of the record write among them, if any
        (the core has at most one write in flight)."""
        result: Event | None = None
        for action in actions:
            try:
                if isinstance(action, WriteRecord):
                    result = await self._write(action)
                else:
                    await self._perform(action)
            except Exception as exc:
                log.exception("action_failed", action=type(action).__name__)
                if isinstance(action, WriteRecord):
                    result = RecordWriteFailed(error=repr(exc)[:500])
        return result

    async def _write(self, action: WriteRecord) -> Event:
        assert self._records is not None
        self.counts["record_writes"] += 1
        outcome = await self._records.write(action)
        if isinstance(outcome, RecordConflict):
            self.counts["record_conflicts"] += 1
        if isinstance(outcome, RecordWriteFailed):
            log.warning(
                "record_write_failed", error=outcome.error, expected_revision=action.expected_revision
            )
        return outcome

    async def _perform(self, action: Action) -> None:
        assert self._nc is not None and self._js is not None and self._members is not None
        match action:
            case Note():
                getattr(log, action.level)(action.event, **action.fields)
            case SendCommand():
                command = action.command
                subject = (
                    s.worker_commands(self.job_id)
                    if action.worker_id is None
                    else s.worker_command(self.job_id, action.worker_id)
                )
                await self._nc.publish(subject, encode(command))
                self.counts["commands"] += 1
            case RequestTopology():
                request = with_device_memory(action.request, self.core.membership)
                msg_id = s.topology_request_msg_id(self.job_id, request.generation)
                await self._publish(s.topology_request(self.job_id), encode(request), msg_id)
                log.info(
                    "topology_requested",
                    generation=request.generation,
                    remove=len(request.remove),
                    lost=len(request.lost),
                    add=len(request.add),
                    target_devices=request.target_devices,
                    device_memory_bytes=request.device_memory_bytes,
                    deadline=request.deadline,
                )
            case ExpectTransfer():
                # The transfer planner reads the topology stream itself; the core ignores any plan
                # whose target it no longer wants.
                log.debug("transfer_left_to_planner", generation=action.topology.generation)
            case Publish():
                message = action.message
                subject = (
                    s.GENERATION_COMMITTED
                    if isinstance(message, GenerationCommitted)
                    else s.GENERATION_ABORTED
                )
                duplicate = await self._publish(subject, encode(message), action.msg_id)
                self.counts["published"] += 1
                if not duplicate:
                    self.metrics.outcome(message, action.trigger, action.began_at)
                log.info(
                    "outcome_published", subject=subject, generation=message.generation, duplicate=duplicate
                )
            case WriteMembership():
                await self._members.put(self.job_id, encode(action.record))
            case Settle():
                acked = await self._held.settle(action.event_ids, action.outcome)
                self.counts["settled"] += len(action.event_ids)
                log.info(
                    "events_settled",
                    event_ids=list(action.event_ids),
                    outcome=action.outcome,
                    acknowledged=len(acked),
                    settled_generation=action.generation,
                )
            case ReleasePlan():
                self._spawn(self._release_plan(action), f"release-{action.generation}")
            case ProbeWorkers():
                self._spawn(self._probe(action), f"probe-{action.generation}")
            case _:
                raise TypeError(f"not a coordinator action: {type(action).__name__}")

    async def _probe(self, action: ProbeWorkers) -> None:
        """Ask every worker at once; one with no subscriber on the bus is asked once more after a
        moment (a companion that is reconnecting has none for that long) before it counts as gone.
        The answer goes back into the core, off the core's lock while the requests are out."""
        assert self._nc is not None
        nc = self._nc

        async def ask(subject: str) -> str:
            try:
                await nc.request(subject, b"", timeout=action.timeout_s)
            except nats.errors.NoRespondersError:
                return "gone"
            except Exception:  # a timeout, or the bus itself away: not evidence that the worker is gone
                return "silent"
            return "answered"

        subjects = {w: s.worker_probe(self.job_id, w) for w in action.worker_ids}
        subjects.update({d: s.device_probe(self.job_id, d.node, d.index) for d in action.devices})
        first = dict(zip(subjects, await asyncio.gather(*map(ask, subjects.values())), strict=True))
        doubtful = [k for k, found in first.items() if found == "gone"]
        if doubtful:
            await asyncio.sleep(PROBE_RECHECK_S)
            again = await asyncio.gather(*(ask(subjects[k]) for k in doubtful))
            first.update(zip(doubtful, again, strict=True))
        self.counts["probes"] += len(subjects)

        def named(found: str) -> tuple[str, ...]:
            return tuple(w for w in action.worker_ids if first[w] == found)

        result = WorkersProbed(
            probe=action.probe,
            generation=action.generation,
            gone=named("gone"),
            answered=named("answered"),
            silent=named("silent"),
            gone_devices=tuple(d for d in action.devices if first[d] == "gone"),
        )
        with bind_message(job_id=self.job_id):
            await self._feed(result)

    async def _publish(self, subject: str, data: bytes, msg_id: str) -> bool:
        """Publish to JetStream with a dedup id, retrying a failed attempt (the id makes that safe);
        returns whether the stream had it already."""
        assert self._js is not None
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                ack = await self._js.publish(subject, data, headers={s.HEADER_MSG_ID: msg_id})
                return bool(ack.duplicate)
            except BUS_FAILURES as exc:
                if attempt == PUBLISH_ATTEMPTS:
                    raise
                log.warning("publish_retried", subject=subject, attempt=attempt, error=repr(exc))
                await asyncio.sleep(self.settings.retry_delay_s)
        raise AssertionError("unreachable")

    async def _release_plan(self, action: ReleasePlan) -> None:
        """Delete the generation's plan by the names the core took from ``TransferPlanned``: the
        objects one by one (a bounded number in flight), the key-value slices with one purge of the
        stream filtered on the plan's key pattern (one request for a thousand entries, and no delete
        markers left behind).

        No listing: a list reads the metadata of every object in the store (every job's, for the
        store's whole TTL). What is not deleted here expires with the TTL.
        """
        with bind_message(job_id=self.job_id, generation=action.generation):
            if not action.objects and not action.kv_keys:
                log.info("plan_release_skipped", why="the plan's object names are not known here")
                return
            (deleted, missing, failed), purged = await asyncio.gather(
                self._delete_objects(action.bucket, action.objects), self._purge_entries(action)
            )
            log.info("plan_released", objects=deleted, missing=missing, failed=failed, entries=purged)

    async def _purge_entries(self, action: ReleasePlan) -> str:
        """Purge the plan's slice entries; what became of them (for the log)."""
        assert self._js is not None
        if not action.kv_bucket or not action.kv_keys:
            return "none"
        subject = f"$KV.{action.kv_bucket}.{action.kv_keys}"
        try:
            await self._js.purge_stream(f"KV_{action.kv_bucket}", subject=subject)
        except nats.js.errors.NotFoundError:
            return "no bucket"
        except BUS_FAILURES as exc:
            log.warning("plan_release_failed", entries=subject, error=repr(exc))
            return "failed"
        return "purged"

    async def _delete_objects(self, bucket: str, names: tuple[str, ...]) -> tuple[int, int, int]:
        """Delete ``names`` from object store ``bucket``: (deleted, missing, failed)."""
        assert self._js is not None
        if not names:
            return 0, 0, 0
        try:
            store = await self._js.object_store(bucket)
        except nats.js.errors.NotFoundError:
            return 0, len(names), 0  # no store: nothing to delete
        except BUS_FAILURES as exc:
            log.warning("plan_release_failed", bucket=bucket, error=repr(exc))
            return 0, 0, len(names)
        deleted = missing = 0
        failed: list[str] = []
        window = asyncio.Semaphore(RELEASE_CONCURRENCY)

        async def delete(name: str) -> None:
            nonlocal deleted, missing
            async with window:
                try:
                    await store.delete(name)
                    deleted += 1
                except nats.js.errors.NotFoundError:
                    missing += 1
                except BUS_FAILURES as exc:
                    failed.append(name)
                    if len(failed) == 1:
                        log.warning("plan_release_failed", object=name, error=repr(exc))

        await asyncio.gather(*(delete(n) for n in names))
        return deleted, missing, len(failed)


def create_service(environ: Mapping[str, str]) -> CoordinatorService:
    """What ``liver serve coordinator`` runs: the job from ``$LIVER_JOB_ID``, the rest from
    ``$LIVER_COORDINATOR_CONFIG`` (see :class:`CoordinatorSettings`)."""
    return CoordinatorService(CoordinatorSettings.from_env(environ))
