"""The seam between a training process's bus companion and its
:class:`~liver.worker_runtime.runtime.LiveRuntime`.

Commands come in on the companion's thread and must return at once (a hook that blocks stops the
heartbeats); the runtime's :meth:`~liver.worker_runtime.runtime.LiveRuntime.request_resize`, ``allow_switch``
and ``abort`` are thread-safe and only hand the work to background threads or the next iteration boundary, so
the
hooks call them directly:

* ``Prepare`` -> ``request_resize`` with the worker's plan slice, the new generation's rendezvous store
  (``Prepare.store``: the address of the worker that runs new rank 0) and a deadline, and
  ``switch_when_ready=False``: the ranks may vote to switch only after the coordinator's ``Switch``,
  which is the coordinator's point of no return;
* ``Switch`` -> ``allow_switch``; ``Abort`` -> ``abort``.

Runtime events go the other way as acks (:meth:`RuntimeBridge.on_event`, on whatever thread the runtime
raised them): ``ready``; ``switched`` with the cut iteration, the pause and the bytes, also from a
process that left (the coordinator waits for every participant, leavers included); and, for a handoff
the runtime gave up on its own, ``failed`` with the stage and the reason, so that the coordinator aborts
at once instead of at its deadline. A handoff the coordinator aborted is acked ``aborted``.

A handoff that failed with the old world gone (``falling_back``: the runtime restarts from its last
checkpoint) is acked ``failed`` too, with a reason that says so, the moment the runtime knows: the
coordinator, past its switch, records that as a checkpoint fallback and waits (DOWN) for the restarted
world, which the worker that runs its rank 0 announces with ``WorldStarted`` (generation = the failed
one + 1). The restart itself (``fell_back``) has no ack: no generation of the coordinator's is open.

A world that lost a peer outside a handoff (``peer_lost``) is acked ``peer_lost`` with the broken
generation: the coordinator then gives that world's silent members a much shorter timeout, so the
recovery's Prepare (naming the lost device) comes within seconds rather than after the full heartbeat
timeout.

Why the runtime's deadline is later than the Prepare's: the Prepare's deadline is when the coordinator
must have sent ``Switch``; the switch itself may run until the handoff's hard deadline, which the
Prepare does not carry. Were the runtime to give up at the Prepare's deadline, a ``Switch`` sent just
before it could meet ranks that abort on their own, which the coordinator (past its point of no return)
would have to treat as a checkpoint fallback. The runtime's deadline is only the safety net for a
coordinator that vanished; the coordinator enforces the real ones and sends ``Abort``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Final, Protocol, Unpack

import structlog

from liver.reshard.plan import Plan
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.messages import Abort, AckDetails, Prepare, Switch, WorkerPhase
from liver.worker_runtime.runtime import ReshardPhase, RuntimeEvent
from liver.worker_runtime.world import StoreAddress

log = structlog.get_logger(__name__)

DEFAULT_SWITCH_GRACE_S = 60.0
"""How long after the Prepare's deadline the runtime keeps a prepared generation (see the docstring)."""


class ResizeTarget(Protocol):
    """The part of :class:`~liver.worker_runtime.runtime.LiveRuntime` the bridge drives (a protocol, so tests
    can fake it)."""

    def request_resize(
        self,
        generation: int,
        layout: ParallelLayout,
        placement: Placement,
        plan: Plan,
        store: StoreAddress,
        deadline: object = None,
        *,
        from_generation: int | None = None,
        switch_when_ready: bool = True,
        lost: tuple[Device, ...] = (),
    ) -> object: ...

    def allow_switch(self, generation: int) -> None: ...

    def abort(self, generation: int, reason: str, *, fallback: bool = False) -> None: ...


class Reporter(Protocol):
    """:meth:`~.thread.Companion.report`: hands an ack to the companion's thread; never blocks."""

    def __call__(self, phase: WorkerPhase, **details: Unpack[AckDetails]) -> None: ...


def store_address(text: str | None) -> StoreAddress:
    """The ``host:port`` of ``Prepare.store`` as the runtime's :class:`StoreAddress`; ``ValueError`` names
    the field when it is missing or malformed."""
    if text is None:
        raise ValueError(
            "`store`: the Prepare names no rendezvous store (its coordinator does not know the address of "
            "the worker that runs the new rank 0)"
        )
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"`store`: {text!r} is not host:port")
    try:
        return StoreAddress(host, int(port))
    except ValueError as exc:
        raise ValueError(f"`store`: {exc}") from None


class RuntimeBridge:
    """Companion hooks that drive a runtime, and the runtime listener that acks (see the module docstring).

    Build it first, give :meth:`on_event` to the runtime and the bridge itself to the companion as its
    hooks, then :meth:`attach` both. Commands that arrive before :meth:`attach` raise, which the agent
    reports as a failed handoff (the companion is started after attaching, so none should).
    """

    def __init__(self, *, switch_grace_s: float = DEFAULT_SWITCH_GRACE_S) -> None:
        if not switch_grace_s >= 0:
            raise ValueError(f"`switch_grace_s`: must not be negative, got {switch_grace_s}")
        self.switch_grace_s = switch_grace_s
        self._runtime: ResizeTarget | None = None
        self._report: Reporter | None = None
        self._open: int | None = None
        self._log = log

    @property
    def open_generation(self) -> int | None:
        """The generation this process was asked to prepare and has not switched to or given up yet:
        the one to report "failed" for when the process itself fails."""
        return self._open

    def attach(self, runtime: ResizeTarget, report: Reporter, **context: object) -> None:
        self._runtime, self._report = runtime, report
        self._log = log.bind(**context)

    def _target(self) -> ResizeTarget:
        if self._runtime is None:
            raise RuntimeError("the bridge has no runtime attached yet")
        return self._runtime

    # -- companion hooks (the companion's thread) ------------------------------------------------------

    def on_prepare(self, prepare: Prepare, plan: Plan) -> None:
        runtime = self._target()
        store = store_address(prepare.store)
        deadline = prepare.deadline + timedelta(seconds=self.switch_grace_s)
        role = runtime.request_resize(
            prepare.generation,
            prepare.layout,
            prepare.placement,
            plan,
            store,
            deadline,
            from_generation=prepare.from_generation,
            switch_when_ready=False,
            lost=prepare.lost,
        )
        self._open = prepare.generation
        self._log.info(
            "bridge.prepare_accepted",
            generation=prepare.generation,
            role=str(role),
            layout=prepare.layout.describe(),
            store=prepare.store,
        )

    def on_switch(self, switch: Switch) -> None:
        self._target().allow_switch(switch.generation)
        self._log.info("bridge.switch_allowed", generation=switch.generation)

    def on_abort(self, abort: Abort) -> None:
        self._target().abort(abort.generation, abort.reason, fallback=abort.fallback)
        self._log.info(
            "bridge.abort_requested",
            generation=abort.generation,
            reason=abort.reason,
            fallback=abort.fallback,
        )

    # -- runtime listener (the thread that caused the event) -------------------------------------------

    def on_event(self, event: RuntimeEvent) -> None:
        report = self._report
        if report is None:
            self._log.warning("bridge.event_before_attach", phase=str(event.phase))
            return
        g = event.generation
        if event.phase in _ENDS_HANDOFF and self._open == g:
            self._open = None
        phase = ack_of(event)
        if phase is None:
            if event.phase is ReshardPhase.FELL_BACK and event.fallback is not None:
                f = event.fallback
                self._log.warning(
                    "bridge.fell_back",
                    generation=f.generation,
                    failed_generation=f.failed_generation,
                    checkpoint=f.checkpoint,
                    iteration=f.iteration,
                )
            return
        if phase is WorkerPhase.SWITCHED:
            r = event.report
            if r is None:  # the runtime always attaches its report to these; refuse to ack without it
                report(WorkerPhase.FAILED, generation=g, error=f"{event.phase} without a switch report")
                return
            report(
                phase,
                generation=g,
                iteration=r.iteration,
                pause_s=r.pause_s,
                bytes_sent=r.bytes_sent,
                bytes_received=r.bytes_received,
            )
        elif phase in (WorkerPhase.ABORTED, WorkerPhase.FAILED):
            abort = event.abort
            why = "no reason given" if abort is None else f"{abort.stage}: {abort.reason}"
            falling_back = event.phase is ReshardPhase.FALLING_BACK
            if falling_back:
                why = "the old world is gone" if abort is None else why
                why = f"{why}; falling back to the last checkpoint"
            report(phase, generation=g, error=why, falling_back=falling_back)
        else:
            report(phase, generation=g)


_ENDS_HANDOFF: Final = frozenset(
    {ReshardPhase.SWITCHED, ReshardPhase.LEFT, ReshardPhase.ABORTED, ReshardPhase.FALLING_BACK}
)

_ACK: Final[dict[ReshardPhase, WorkerPhase | None]] = {
    ReshardPhase.PREPARING: None,  # the coordinator knows: it sent the Prepare
    ReshardPhase.READY: WorkerPhase.READY,
    ReshardPhase.SWITCHED: WorkerPhase.SWITCHED,
    ReshardPhase.LEFT: WorkerPhase.SWITCHED,  # the coordinator waits for leavers too
    ReshardPhase.ABORTED: WorkerPhase.FAILED,  # "aborted" when given up at the coordinator's word
    ReshardPhase.FALLING_BACK: WorkerPhase.FAILED,  # past the switch, the old world gone
    ReshardPhase.FELL_BACK: None,  # no generation of the coordinator's is open: WorldStarted says it
    ReshardPhase.PEER_LOST: WorkerPhase.PEER_LOST,
}
"""The ack each runtime event becomes: the phases are one vocabulary, so this is a lookup."""


def ack_of(event: RuntimeEvent) -> WorkerPhase | None:
    """The ack phase for ``event`` (None: no ack): an abort is ``aborted`` when the coordinator asked
    for it (an Abort, or a newer Prepare), ``failed`` when this process or another gave it up."""
    if event.phase is ReshardPhase.ABORTED and event.abort is not None and event.abort.by_request:
        return WorkerPhase.ABORTED
    return _ACK[event.phase]
