"""One worker's half of the handoff protocol, on an event loop and a NATS connection it is given.

The agent says hello, beats, reads its commands (its own subject and the job-wide one), fetches its plan
slice on ``Prepare``, hands each command to the runtime through :class:`RuntimeHooks`, and publishes the
runtime's acks. The Prepare is one job-wide broadcast: the agent takes part only when its device is in
either world and not among the Prepare's ``lost``, and finds its slice by its device's index. It is
separate from the thread that hosts it (:mod:`.thread`) so that a simulated job
(:mod:`.simulated`) can run a thousand agents on one loop and one connection.

The rules it keeps, because the coordinator relies on them:

* **A repeated command is answered, not redone.** A coordinator that restarted mid-switch sends the
  switch again; a worker that already switched re-publishes its "switched" ack (same cut, pause and
  bytes) without calling the runtime a second time. A repeated Prepare re-publishes the last ack too.
* **Abort of a generation the runtime never saw is a no-op**: no ack, and no hook unless it carries
  the checkpoint fallback (``Abort.fallback``): a process whose world lost a peer waits for a recovery
  that will never come otherwise, and must end at once. One that arrives before its Prepare (the two
  travel on different subjects) also stops that Prepare from starting later.
* **Only one shadow world at a time (I2).** A Prepare of a newer generation ends an older one that has
  not switched: the runtime gets ``on_abort`` for it first. A Prepare older than one already seen is
  stale and ignored.
* **A Prepare that is not for this worker is dropped first**, before any other rule: a spare or a
  lost device neither acks nor ends a handoff of its own because of it.
* **Bad input never stops the worker.** A command that does not decode, or a plan slice that does not
  check, becomes an ``ErrorEvent`` naming the field (and, for a slice, a "failed" ack so the coordinator
  aborts at once instead of at its deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, NamedTuple, Protocol, Unpack

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from liver.reshard.plan import Plan
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode, error_event
from liver.shared.layout import Device
from liver.shared.logs import bind_message
from liver.shared.messages import (
    Abort,
    AckDetails,
    Heartbeat,
    Hello,
    Message,
    Prepare,
    Switch,
    WorkerCommand,
    WorkerPhase,
    WorkerStatus,
)
from liver.worker_runtime.companion.slices import (
    PlanFetcher,
    PlanFetchError,
    decode_slice,
    fetch_context,
    view_of,
)
from liver.worker_runtime.generations import HandoffState, can_move, check_move

log = structlog.get_logger(__name__)

SOURCE: Final = "worker"
"""Errors go to ``liver.errors.worker``."""

KEEP_GENERATIONS: Final = 8
"""Handoffs remembered for re-acks; far more than the two generations a worker holds at once."""

_REASON_LIMIT: Final = 2000


def decode_command(data: bytes, job_id: str) -> WorkerCommand:
    """A command for ``job_id``'s workers; :class:`MessageError` naming the field otherwise (a command
    of another job on this job's subject is a misconfigured publisher, not something to act on)."""
    command = decode(data, WorkerCommand)
    if command.job_id != job_id:
        raise MessageError(
            type(command).__name__, "$.job_id", f"{command.job_id!r} is not this job {job_id!r}"
        )
    return command


class GenerationRank(NamedTuple):
    """The generation a worker trains in and its rank there: what its heartbeats report."""

    generation: int
    rank: int


class WorkerIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """Who this worker is, as its Hello tells the coordinator."""

    job_id: str
    worker_id: str
    device: Device
    address: str
    """Where the worker's data plane listens (``host:port``)."""
    memory_bytes: int | None = None
    """Device memory the worker may use (the topology planner's memory model needs it)."""

    def hello(self, world: GenerationRank | None) -> Hello:
        return Hello(
            job_id=self.job_id,
            worker_id=self.worker_id,
            device=self.device,
            address=self.address,
            generation=None if world is None else world.generation,
            rank=None if world is None else world.rank,
            memory_bytes=self.memory_bytes,
        )

    def check(self) -> None:
        """Raise :class:`MessageError` naming the field when the coordinator would refuse the Hello.

        Checked by a round trip through the decoder because that is where the bus enforces its field
        constraints (token-safe ids, ``host:port``), so the worker fails at start, not silently later.
        """
        decode(encode(self.hello(None)), Hello)


class AgentSettings(msgspec.Struct, frozen=True, kw_only=True):
    heartbeat_s: float = 2.0
    """The coordinator declares a worker lost after ``heartbeat_timeout_s`` (10 s): four to five beats."""
    fetch_timeout_s: float = 30.0
    """Upper bound on reading a plan slice; the Prepare's deadline bounds it further."""

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "fetch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}`: must be > 0, got {getattr(self, name)}")


class RuntimeHooks(Protocol):
    """What the agent calls when a command arrives, on the companion's thread, never the training one.

    Hooks must return at once: while one runs, no heartbeat goes out and no other command is read. Hand
    the command to the training thread (a flag, a queue: :class:`~.thread.CommandBox`) and do the work
    there; report the outcome with ``Companion.report``. A hook that raises is reported as "failed".
    """

    def on_prepare(self, prepare: Prepare, plan: Plan) -> None: ...

    def on_switch(self, switch: Switch) -> None: ...

    def on_abort(self, abort: Abort) -> None: ...


Stage = HandoffState
"""The agent's view of a handoff moves through the worker's one table (:mod:`..generations`): FETCHING,
PREPARING, READY, SWITCHING, then SWITCHED, ABORTED or FAILED."""

_RUNTIME_KNOWS: Final = frozenset({Stage.PREPARING, Stage.READY, Stage.SWITCHING, Stage.SWITCHED})
_ENDED: Final = frozenset({Stage.SWITCHED, Stage.ABORTED, Stage.FAILED})
_RESENT: Final = frozenset({Stage.READY, Stage.SWITCHED, Stage.FAILED})
"""Acks the coordinator may be waiting for (or must hear of), sent again after a reconnect."""
_PHASE_STAGE: Final[dict[WorkerPhase, Stage]] = {
    WorkerPhase.READY: Stage.READY,
    WorkerPhase.SWITCHED: Stage.SWITCHED,
    WorkerPhase.ABORTED: Stage.ABORTED,
    WorkerPhase.FAILED: Stage.FAILED,
}
"""The state an ack moves the handoff to: the ack's phase is the state's name."""


def _ack_moves(frm: Stage, to: Stage) -> bool:
    """Whether an ack moves the handoff from ``frm`` to ``to``: a move of the table, or the runtime's
    own abort or failure acked after the companion already marked it (on an Abort, or a plan that did
    not read), which then becomes the ack to repeat. Any other ack is still published (the coordinator
    ignores what does not apply) but does not become the handoff's ack to repeat."""
    return can_move(frm, to) or (frm is to and to in (Stage.ABORTED, Stage.FAILED))


@dataclass
class HandoffView:
    """This worker's view of one generation's handoff."""

    prepare: Prepare
    stage: Stage
    ack: WorkerStatus | None = None
    """The last ack that moved the stage: what a repeated command is answered with."""
    plan: Plan | None = None
    early_switch: Switch | None = None
    """A switch that arrived while the plan was still being read (only after a coordinator restart)."""


@dataclass
class Presence:
    """What heartbeats say. The training thread writes it (a plain attribute write is atomic), the loop
    reads it at each beat: no lock, so reporting progress never waits."""

    world: GenerationRank | None = None
    iteration: int | None = None
    broken: int | None = None
    """The generation whose world this process reported lost a peer (its last ``peer_lost`` ack)."""

    @property
    def world_broken(self) -> bool:
        """Whether the world heartbeats speak for is the one that lost a peer."""
        return self.world is not None and self.broken == self.world.generation


@dataclass
class AgentCounts:
    commands: int = 0
    rejected: int = 0
    acks: int = 0
    heartbeats: int = 0
    hooks_failed: int = 0


class WorkerAgent:
    """The protocol of one worker over ``nc`` (see the module docstring). Use only on ``nc``'s loop."""

    def __init__(
        self,
        nc: Client,
        identity: WorkerIdentity,
        hooks: RuntimeHooks,
        *,
        presence: Presence | None = None,
        settings: AgentSettings | None = None,
        fetcher: PlanFetcher | None = None,
        broadcast: bool = True,
    ) -> None:
        """``broadcast=False``: the host reads the job-wide command subject once for many agents and
        hands each decoded command to :meth:`handle_command` (a simulated job does)."""
        self.nc = nc
        self._broadcast = broadcast
        self.identity = identity
        self.hooks = hooks
        self.presence = presence or Presence()
        self.settings = settings or AgentSettings()
        self.counts = AgentCounts()
        self._fetcher = fetcher or PlanFetcher(fetch_context(nc))
        self._log = log.bind(job_id=identity.job_id, worker_id=identity.worker_id)
        self._handoffs: dict[int, HandoffView] = {}
        self._aborted_unseen: set[int] = set()
        self._newest = -1
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._seq = 0
        self._running = False

    # -- what the host reads ------------------------------------------------------------------------

    @property
    def latest_generation(self) -> int | None:
        """The newest generation this worker was asked to prepare (the default for an ack); a plain
        attribute read, so the training thread may ask while the loop changes the handoffs."""
        return None if self._newest < 0 else self._newest

    def handoff(self, generation: int) -> HandoffView | None:
        return self._handoffs.get(generation)

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe to this worker's commands, say hello and start beating."""
        job, worker = self.identity.job_id, self.identity.worker_id
        subjects = [s.worker_command(job, worker)]
        if self._broadcast:
            subjects.append(s.worker_commands(job))
        for subject in subjects:
            self._subs.append(await self.nc.subscribe(subject, cb=self._on_command))
        self._subs.append(await self.nc.subscribe(s.worker_probe(job, worker), cb=self._on_probe))
        device = self.identity.device
        self._subs.append(
            await self.nc.subscribe(s.device_probe(job, device.node, device.index), cb=self._on_probe)
        )
        # Round trip: once start returns, the server has the subscriptions and no command can be missed.
        await self.nc.flush()
        self._running = True
        await self.announce()
        self._heartbeat = asyncio.create_task(self._beat(), name=f"heartbeat-{worker}")
        self._log.info("worker_agent_started", device=str(self.identity.device), world=self.presence.world)

    async def stop(self) -> None:
        """Stop reading commands and beating; acks already handed over are published first."""
        if not self._running:
            return
        self._running = False
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._subs.clear()
        pending = [t for t in self._tasks if not t.done()]
        fetches = [t for t in pending if t.get_name().startswith("fetch-")]
        for task in fetches:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._log.info("worker_agent_stopped", **self.counters())

    async def rebind(self, nc: Client) -> None:
        """Carry on over ``nc`` after the server closed the old connection for good (it reconnects by
        itself after an outage, not after a protocol error): the handoffs in flight, the presence and
        the counters stay; the subscriptions, the heartbeat and the plan reads move to ``nc``, and the
        hello that :meth:`start` sends re-sends the ack of a handoff still in flight."""
        await self.stop()
        self.nc = nc
        self._fetcher = PlanFetcher(fetch_context(nc))
        await self.start()

    async def announce(self) -> None:
        """Hello again (after a reconnect), with the ack of a handoff still in flight.

        The coordinator treats both as repeats, so this costs nothing when nothing was lost, and recovers
        an ack that was buffered when the connection dropped.
        """
        await self._send(s.worker_hello(self.identity.job_id), self.identity.hello(self.presence.world))
        newest = self._handoffs.get(max(self._handoffs, default=-1))
        if newest is not None and newest.ack is not None and newest.stage in _RESENT:
            await self._send(s.worker_status(self.identity.job_id), newest.ack)

    # -- acks from the runtime --------------------------------------------------------------------------

    def status(self, phase: WorkerPhase, **details: Unpack[AckDetails]) -> WorkerStatus:
        """Build an ack (safe from any thread); ``generation`` defaults to the newest prepared one."""
        generation = details.pop("generation", None)
        if generation is None:
            generation = self.latest_generation
            if generation is None:
                raise ValueError("`generation`: no generation has been prepared; give it explicitly")
        error = details.pop("error", None)
        return WorkerStatus(
            job_id=self.identity.job_id,
            worker_id=self.identity.worker_id,
            generation=generation,
            phase=phase,
            error=None if error is None else _clip(error),
            **details,
        )

    def report(self, ack: WorkerStatus) -> None:
        """Publish the runtime's ack and move the handoff's stage (on the loop's thread)."""
        h = self._handoffs.get(ack.generation)
        target = _PHASE_STAGE.get(ack.phase)
        if h is not None and target is not None:
            if _ack_moves(h.stage, target):
                h.stage, h.ack = target, ack
                if target is Stage.SWITCHED:
                    self._enter(h)
            else:
                self._log.info(
                    "ack_out_of_turn", generation=ack.generation, phase=ack.phase, stage=h.stage.value
                )
        elif h is None:
            self._log.info("ack_for_unprepared_generation", generation=ack.generation, phase=ack.phase)
        if ack.phase == WorkerPhase.PEER_LOST:
            self.presence.broken = ack.generation
        self.counts.acks += 1
        self._spawn(self._send(s.worker_status(self.identity.job_id), ack), "ack")

    def _enter(self, h: HandoffView) -> None:
        """After the switch, heartbeats speak for the new world (or for none: a leaving worker)."""
        rank = view_of(h.prepare).new_rank.get(self.identity.device)
        self.presence.world = None if rank is None else GenerationRank(h.prepare.generation, rank)

    # -- commands ---------------------------------------------------------------------------------------

    async def _on_probe(self, msg: Msg) -> None:
        """The coordinator asks whether this process is still there: yes (its world lost a peer, and a
        process that is gone cannot answer)."""
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(b"")

    async def _on_command(self, msg: Msg) -> None:
        with bind_message(subject=msg.subject):
            self.counts.commands += 1
            try:
                command = decode_command(msg.data, self.identity.job_id)
            except MessageError as error:
                await self._reject(msg.subject, msg.data, error)
                return
            self.handle_command(command)

    def handle_command(self, command: Prepare | Switch | Abort) -> None:
        """Act on a decoded command of this worker's job (the host checked the job)."""
        with bind_message(command):
            try:
                match command:
                    case Prepare():
                        self._on_prepare(command)
                    case Switch():
                        self._on_switch(command)
                    case Abort():
                        self._on_abort(command)
            except Exception:
                # A bug here must not take the worker off the bus: log it and keep reading.
                self._log.exception("command_handling_failed")

    def _on_prepare(self, prepare: Prepare) -> None:
        if not view_of(prepare).participates(self.identity.device):
            self._log.debug("prepare_not_for_this_worker", device=str(self.identity.device))
            return
        g = prepare.generation
        h = self._handoffs.get(g)
        if h is not None:
            self._log.info("prepare_repeated", stage=h.stage.value)
            self._repeat(h)
            return
        world = self.presence.world
        if g in self._aborted_unseen or g < self._newest or (world is not None and g <= world.generation):
            self._log.warning(
                "stale_prepare_ignored",
                newest=self._newest,
                world=None if world is None else world.generation,
            )
            return
        h = HandoffView(prepare=prepare, stage=Stage.FETCHING)
        self._handoffs[g] = h
        self._newest = g
        self._forget_old()
        for other in list(self._handoffs.values()):
            if other is h or other.stage in _ENDED:
                continue
            if other.stage is Stage.SWITCHING:
                self._fail(h, f"still switching to generation {other.prepare.generation}")
                return
            reason = f"superseded by the prepare of generation {g}"
            self._log.warning("handoff_superseded", superseded=other.prepare.generation)
            self._end(
                other, Abort(job_id=self.identity.job_id, generation=other.prepare.generation, reason=reason)
            )
        self._spawn(self._fetch_and_prepare(h), f"fetch-{g}")

    async def _fetch_and_prepare(self, h: HandoffView) -> None:
        try:
            await self._prepare_from_plan(h)
        except Exception as exc:
            # A bug must still reach the coordinator as a failure now, not as a silent missed deadline.
            self._log.exception("prepare_failed_unexpectedly")
            if h.stage is Stage.FETCHING:
                self._fail(h, f"preparing raised {type(exc).__name__}: {exc}")

    async def _prepare_from_plan(self, h: HandoffView) -> None:
        prepare = h.prepare
        left_s = (prepare.deadline - datetime.now(UTC)).total_seconds()
        timeout_s = min(self.settings.fetch_timeout_s, left_s)
        if timeout_s <= 0:
            self._fail(
                h, f"the prepare deadline {prepare.deadline.isoformat()} passed before the plan was read"
            )
            return
        where = view_of(prepare).slice_location(prepare, self.identity.device)
        try:
            data = await self._fetcher.fetch_slice(where, timeout_s)
        except PlanFetchError as exc:
            if h.stage is Stage.FETCHING:
                limit = (
                    f"fetch_timeout_s = {self.settings.fetch_timeout_s:g} s"
                    if timeout_s == self.settings.fetch_timeout_s
                    else f"the prepare deadline {prepare.deadline.isoformat()}"
                )
                self._fail(h, f"plan slice of generation {prepare.generation} not read ({limit}): {exc}")
            return
        try:
            plan = decode_slice(data, prepare, self.identity.device)
        except MessageError as error:
            await self._reject(str(where), data, error)
            if h.stage is Stage.FETCHING:
                self._fail(h, f"plan slice {where} refused: {error}")
            return
        if h.stage is not Stage.FETCHING:
            self._log.info("plan_read_after_end", generation=prepare.generation, stage=h.stage.value)
            return
        h.plan, h.stage = plan, check_move(prepare.generation, h.stage, Stage.PREPARING, "plan read")
        self._log.info(
            "plan_slice_read", generation=prepare.generation, tasks=len(plan.tasks), bytes=len(data)
        )
        if not self._call(h, "on_prepare", prepare, plan):
            return
        if h.early_switch is not None:
            early, h.early_switch = h.early_switch, None
            self._on_switch(early)

    def _on_switch(self, switch: Switch) -> None:
        h = self._handoffs.get(switch.generation)
        if h is None:
            self._log.debug("switch_not_for_this_worker")
            return
        match h.stage:
            case Stage.FETCHING:
                h.early_switch = switch
            case Stage.PREPARING | Stage.READY:
                h.stage = check_move(switch.generation, h.stage, Stage.SWITCHING, "the Switch")
                self._call(h, "on_switch", switch)
            case Stage.SWITCHING:
                self._log.debug("switch_repeated_while_switching")
            case _:
                self._log.info("switch_repeated", stage=h.stage.value)
                self._repeat(h)

    def _on_abort(self, abort: Abort) -> None:
        h = self._handoffs.get(abort.generation)
        if h is None:
            # Never prepared here: nothing to undo. Remember it so a Prepare overtaken by its own abort
            # (they travel on different subjects) does not start a world nobody will switch to.
            self._aborted_unseen.add(abort.generation)
            while len(self._aborted_unseen) > KEEP_GENERATIONS:
                self._aborted_unseen.discard(min(self._aborted_unseen))
            if abort.fallback:
                self._tell_fallback(abort)
            else:
                self._log.debug("abort_of_unknown_generation")
            return
        if h.stage in _ENDED:
            if h.stage is Stage.SWITCHED and abort.fallback:
                self._tell_fallback(abort)
            else:
                self._log.debug("abort_repeated", stage=h.stage.value)
            return
        self._end(h, abort)

    def _tell_fallback(self, abort: Abort) -> None:
        """The job falls back to its checkpoint: a process whose world lost a peer, waiting for a
        recovery it was never sent, must hear it now, not at its recovery timeout."""
        self._log.warning("fallback_abort_of_unknown_generation", reason=abort.reason)
        try:
            self.hooks.on_abort(abort)
        except Exception:
            self.counts.hooks_failed += 1
            self._log.exception("hook_failed", hook="on_abort", generation=abort.generation)

    def _end(self, h: HandoffView, abort: Abort) -> None:
        """Stop a handoff: the runtime is told only if it knew of it."""
        knew = h.stage in _RUNTIME_KNOWS
        h.stage = check_move(abort.generation, h.stage, Stage.ABORTED, abort.reason)
        h.early_switch = None
        if knew:
            self._call(h, "on_abort", abort)

    def _repeat(self, h: HandoffView) -> None:
        if h.ack is not None:
            self.counts.acks += 1
            self._spawn(self._send(s.worker_status(self.identity.job_id), h.ack), "re-ack")

    def _call(self, h: HandoffView, hook: str, *args: object) -> bool:
        try:
            getattr(self.hooks, hook)(*args)
        except Exception as exc:
            self.counts.hooks_failed += 1
            self._log.exception("hook_failed", hook=hook, generation=h.prepare.generation)
            self._fail(h, f"{hook} raised {type(exc).__name__}: {exc}")
            return False
        return True

    def _fail(self, h: HandoffView, error: str) -> None:
        self._log.warning("handoff_failed", generation=h.prepare.generation, error=error)
        self.report(self.status(WorkerPhase.FAILED, generation=h.prepare.generation, error=error))

    def _forget_old(self) -> None:
        while len(self._handoffs) > KEEP_GENERATIONS:
            del self._handoffs[min(self._handoffs)]

    async def _reject(self, subject: str, data: bytes, error: MessageError) -> None:
        self.counts.rejected += 1
        self._log.warning("input_rejected", field=error.path, reason=error.reason, expected=error.expected)
        event = error_event(source=SOURCE, subject=subject, data=data, error=error)
        await self._send(s.errors(SOURCE), event)

    # -- presence ---------------------------------------------------------------------------------------

    async def _beat(self) -> None:
        period = self.settings.heartbeat_s
        # Spread the beats of many workers over the period instead of sending them all at once.
        await asyncio.sleep(period * (zlib.crc32(self.identity.worker_id.encode()) % 1000) / 1000)
        while True:
            if self.nc.is_connected:
                world, iteration = self.presence.world, self.presence.iteration
                beat = Heartbeat(
                    job_id=self.identity.job_id,
                    worker_id=self.identity.worker_id,
                    device=self.identity.device,
                    address=self.identity.address,
                    generation=None if world is None else world.generation,
                    rank=None if world is None else world.rank,
                    seq=self._seq,
                    iteration=iteration,
                    broken=self.presence.world_broken,
                )
                self._seq += 1
                self.counts.heartbeats += 1
                await self._send(s.worker_heartbeat(self.identity.job_id), beat)
            await asyncio.sleep(period)

    # -- publishing -----------------------------------------------------------------------------------

    async def _send(self, subject: str, message: Message) -> None:
        try:
            await self.nc.publish(subject, encode(message))
        except nats.errors.Error as exc:
            # Closed, draining or the reconnect buffer is full: the ack of an open handoff is sent again
            # by announce() after the reconnect, and the coordinator repeats its commands.
            self._log.warning("publish_failed", subject=subject, error=repr(exc))

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def counters(self) -> dict[str, int]:
        """The agent's counters (commands, rejected, acks, heartbeats, hooks_failed): the stop log line
        and the metrics."""
        c = self.counts
        return {
            "commands": c.commands,
            "rejected": c.rejected,
            "acks": c.acks,
            "heartbeats": c.heartbeats,
            "hooks_failed": c.hooks_failed,
        }


def _clip(text: str) -> str:
    return text if len(text) <= _REASON_LIMIT else text[: _REASON_LIMIT - 3] + "..."
