"""The discrete-event simulation (SimPy) of one training job, one trace and one policy.

Processes: one per trace event (announce at ``time``, take effect ``notice`` later) and one controller
that follows the policy (:mod:`.policies`). They meet through the cluster state (held nodes, nodes under
a removal warning) and a wake-up signal; every change of what the devices do goes through the
:class:`~.ledger.Ledger`, so time is conserved whatever the policy does.

Rules every policy shares:

* the job starts at t=0 already training on the initial nodes (no start-up cost is charged);
* a restart targets every held node not under a warning (a scheduler does not launch on a node it is
  about to lose), and starts over when that set changes before it completes;
* a node under a warning that the job's world (running or starting) does not use is handed back at
  once; the live policy also hands back a warned node as soon as it has switched away from it;
* a restart rolls back to the last checkpoint (the paper's baselines save nothing at the event).

Live handoffs follow the design's state machine: events that arrive during a handoff are queued, except
one that takes away a node of the pending target, which cancels the handoff before its switch and
re-plans. Each reconfiguration is recorded with the events it served; every event ends with an outcome.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import Any, Literal, NamedTuple

import msgspec
import simpy

from liver.shared.layout import Device, ParallelLayout

from .ledger import Ledger
from .policies import Policy, live_phases, live_preparation_s, restart_phases
from .survival import state_survives
from .trace import CapacityEvent, Trace
from .transitions import Transition, TransitionPlanner

EPS = 1e-9

Outcome = Literal["served", "released", "unchanged", "pending"]


class Reconfiguration(msgspec.Struct, kw_only=True):
    """One reconfiguration: a restart, a live handoff, or the live policy's checkpoint fallback."""

    index: int
    kind: Literal["restart", "live", "fallback"]
    start: float
    """When the job paused (restart) or the preparation began (live)."""
    end: float = math.nan
    status: Literal["done", "down", "failed", "running at end"] = "done"
    """``down``: no layout fits the devices left; ``failed``: a live handoff lost a node mid-transfer."""
    reason: str = ""
    pause_s: float = 0.0
    """Seconds the job was paused (restart: until training resumed; live: switch + transfer)."""
    lost_gpu_s: float = 0.0
    preparation_s: float = 0.0
    """Live: preparation overlapped with training (not a pause)."""
    attempts: int = 1
    """Restarts that began (a change of the device set mid-restart starts over)."""
    phases: dict[str, float] = {}
    devices_before: int = 0
    devices_after: int = 0
    layout_before: str = ""
    layout_after: str = ""
    bytes_moved: int = 0
    events: list[int] = []
    lost_nodes: list[str] = []
    """Live: nodes of the old world gone before the transfer, planned around (their state came from
    DP replicas elsewhere); the pause then runs from the first loss to the end of the transfer."""


class EventRecord(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    time: float
    node: str
    kind: str
    notice: float
    outcome: Outcome
    reconfiguration: int | None
    """The reconfiguration that served it (``outcome == "served"``)."""
    downtime_s: float
    """Its share of that reconfiguration's pause (shared equally among the events it served)."""


class SimResult(msgspec.Struct, frozen=True, kw_only=True):
    policy: str
    label: str
    trace: str
    model: str
    calibration: str
    duration_s: float
    initial_devices: int
    allocated_gpu_s: float
    useful_gpu_s: float
    downtime_gpu_s: float
    lost_gpu_s: float
    idle_gpu_s: float
    paused_s: float
    """Wall seconds the job was paused: the cumulative downtime."""
    tokens: float
    tokens_lost: float
    fallbacks: int
    cancelled_handoffs: int
    handoffs_around_loss: int = 0
    """Live handoffs that planned around nodes gone before the transfer instead of falling back."""
    reconfigurations: list[Reconfiguration]
    events: list[EventRecord]
    series: list[tuple[float, float, float]]
    """``(time, wasted GPU-seconds, paused seconds)``, cumulative."""
    early_releases: dict[str, float]
    """Warned nodes the job handed back before their removal, and when."""

    @property
    def efficiency(self) -> float:
        """Goodput as a share of what was paid for: useful GPU-seconds over allocated GPU-seconds."""
        return self.useful_gpu_s / self.allocated_gpu_s if self.allocated_gpu_s else 1.0

    @property
    def wasted_gpu_hours(self) -> float:
        return (self.downtime_gpu_s + self.lost_gpu_s + self.idle_gpu_s) / 3600


class _World(NamedTuple):
    layout: ParallelLayout
    nodes: tuple[str, ...]
    """Nodes the world runs on, in the order the planner's canonical indices follow."""
    basis: tuple[str, ...]
    """The device set (held nodes not under a warning) this world was chosen for."""
    transition: Transition


class _Handoff(NamedTuple):
    basis: tuple[str, ...]
    transition: Transition
    nodes: tuple[str, ...]
    started: float
    preparation_s: float
    phases: dict[str, float]
    pause_s: float
    switch_at: float
    lost: tuple[str, ...] = ()
    """Nodes of the running world gone before the transfer ends: never read from (a handoff around a
    loss, switched as soon as it is ready)."""


class Simulation:
    """One run. Build it, call :meth:`run` once."""

    def __init__(self, trace: Trace, policy: Policy, planner: TransitionPlanner) -> None:
        cal = planner.calibration
        if trace.devices_per_node != cal.devices_per_node:
            raise ValueError(
                f"trace has {trace.devices_per_node} devices per node, calibration "
                f"{cal.name} {cal.devices_per_node}"
            )
        self.trace = trace
        self.policy = policy
        self.planner = planner
        self.cal = cal
        self.per = cal.devices_per_node
        self.env = simpy.Environment()
        self.held: list[str] = list(trace.initial_nodes)
        self.doomed: dict[str, float] = {}
        self.released: dict[str, float] = {}  # warned nodes handed back before their removal
        self.gone_at: dict[str, float] = {}
        self.world: _World | None = None
        self.starting: tuple[str, ...] = ()
        self.down_basis: tuple[str, ...] | None = None
        self.hopeless_basis: tuple[str, ...] | None = None
        self.ledger = Ledger(cal.checkpoint_interval_s, len(self.held) * self.per)
        self.wake = self.env.event()
        self.pending: list[int] = []
        self.outcome: list[tuple[Outcome, int | None]] = [("pending", None)] * len(trace.events)
        self.reconfigs: list[Reconfiguration] = []
        self.active: Reconfiguration | None = None
        self.cancelled = 0
        self._ran = False

    # --- cluster state -------------------------------------------------------------------------
    def _notify(self) -> None:
        self.wake.succeed()
        self.wake = self.env.event()

    def _basis(self) -> tuple[str, ...]:
        return tuple(n for n in self.held if n not in self.doomed)

    def _set_held(self) -> None:
        self.ledger.set(self.env.now, held=len(self.held) * self.per)

    def _release_unused_warned(self) -> None:
        in_use = set(self.world.nodes if self.world else ()) | set(self.starting)
        for node in [n for n in self.held if n in self.doomed and n not in in_use]:
            self.held.remove(node)
            self.released[node] = self.env.now
            for i in list(self.pending):
                ev = self.trace.events[i]
                if ev.kind == "remove" and ev.node == node and self.outcome[i][0] == "pending":
                    self.outcome[i] = ("released", None)
                    self.pending.remove(i)
        self._set_held()

    def _event(self, i: int, ev: CapacityEvent) -> Generator[simpy.Event, Any, None]:
        yield self.env.timeout(ev.time)
        if ev.kind == "remove":
            self.doomed[ev.node] = ev.effect_time
            if ev.node in self.held:
                self.pending.append(i)
                self._release_unused_warned()
            self._notify()
        if ev.notice > 0:
            yield self.env.timeout(ev.notice)
        if ev.kind == "add":
            self.held.append(ev.node)
            self._set_held()
            self.pending.append(i)
        else:
            self.doomed.pop(ev.node, None)
            if ev.node in self.held:
                self.held.remove(ev.node)
                self.gone_at[ev.node] = self.env.now
                if self.world is not None and ev.node in self.world.nodes:
                    # The world has lost a rank: training stops now; the controller reacts at once.
                    self.ledger.set(self.env.now, mode="pause", world=0)
                self._set_held()
                if i not in self.pending and self.outcome[i][0] == "pending":
                    self.pending.append(i)
        self._notify()

    def _claim(self, rec: Reconfiguration, only: Sequence[int] | None = None) -> None:
        """Mark pending events (or those of ``only``) as served by ``rec``."""
        chosen = list(self.pending) if only is None else [i for i in only if i in self.pending]
        for i in chosen:
            if self.outcome[i][0] == "pending":
                self.outcome[i] = ("served", rec.index)
                rec.events.append(i)
            self.pending.remove(i)

    def _settle(self, outcome: Outcome) -> None:
        for i in self.pending:
            if self.outcome[i][0] == "pending":
                self.outcome[i] = (outcome, None)
        self.pending.clear()

    def _plan(
        self, basis: Sequence[str], live: bool, lost: Sequence[str] = ()
    ) -> tuple[Transition, tuple[str, ...]]:
        """The target world for ``basis`` and the actual nodes it uses.

        A live handoff starts from the running world (the topology planner prefers layouts that move
        fewer bytes from it; its ``lost`` nodes send nothing). A restart loads everything from the
        checkpoint, so where the state was does not matter: its target depends on the device set alone,
        which lets every restart of every policy share one planner answer per device count."""
        world = self.world if live else None
        if world is None:
            tr = self.planner.transition(None, 0, 0, len(basis))
            return tr, tuple(basis[i] for i in tr.used_nodes)
        kept_nodes = [n for n in world.nodes if n in basis]
        fresh = len(basis) - len(kept_nodes)
        gone = sum(n in lost for n in world.nodes if n not in basis)
        tr = self.planner.transition(world.layout, len(world.nodes), len(kept_nodes), fresh, gone)
        ordered = [*kept_nodes, *(n for n in basis if n not in kept_nodes)]
        return tr, tuple(ordered[i] for i in tr.used_nodes)

    def _begin_training(self, tr: Transition, nodes: tuple[str, ...], basis: tuple[str, ...]) -> None:
        assert tr.new_layout is not None
        self.world = _World(tr.new_layout, nodes, basis, tr)
        self.starting = ()
        self.hopeless_basis = None
        self.ledger.set(self.env.now, mode="train", world=tr.new_devices, rate=tr.tokens_per_s)
        self._release_unused_warned()

    # --- the run -------------------------------------------------------------------------------
    def run(self) -> SimResult:
        if self._ran:
            raise RuntimeError("a Simulation runs once")
        self._ran = True
        for i, ev in enumerate(self.trace.events):
            self.env.process(self._event(i, ev))
        self.env.process(self._controller())
        self.env.run(until=self.trace.duration_s)
        self.ledger.advance(self.trace.duration_s)
        if self.active is not None:
            self.active.status = "running at end"
            self.active.end = self.trace.duration_s
            if self.active.kind != "live":
                self.active.pause_s = self.trace.duration_s - self.active.start
        return self._result()

    def _controller(self) -> Generator[simpy.Event, Any, None]:
        basis = self._basis()
        tr, nodes = self._plan(basis, live=False)
        if tr.new_layout is None:
            self.down_basis = basis
            self.ledger.set(0.0, mode="down")
        else:
            self._begin_training(tr, nodes, basis)
        while True:
            wake = self.wake
            yield wake
            if self.policy.live:
                yield from self._react_live()
            else:
                yield from self._react_restart()

    def _world_broken(self) -> bool:
        return self.world is not None and any(n not in self.held for n in self.world.nodes)

    def _react_restart(self) -> Generator[simpy.Event, Any, None]:
        if self.world is None:
            if self._basis() != self.down_basis:
                yield from self._restart("restart", "capacity changed while no layout fitted")
            else:
                self._settle("unchanged")
            return
        if self._world_broken():
            yield from self._restart("restart", "a node of the training world is gone")
            return
        grown = [i for i in self.pending if self.trace.events[i].kind == "add"]
        if not grown:
            return  # warnings: a restart-based job acts only when the node is gone
        world = self.world
        tr, nodes = self._plan(self._basis(), live=False)
        if tr.new_layout is None or (tr.new_layout == world.layout and set(nodes) == set(world.nodes)):
            for i in grown:
                self.outcome[i] = ("unchanged", None)
                self.pending.remove(i)
            return
        yield from self._restart("restart", "new nodes granted")

    def _restart(
        self, kind: Literal["restart", "fallback"], reason: str
    ) -> Generator[simpy.Event, Any, None]:
        env = self.env
        world = self.world
        rec = Reconfiguration(
            index=len(self.reconfigs),
            kind=kind,
            start=env.now,
            reason=reason,
            devices_before=world.transition.new_devices if world else 0,
            layout_before=world.layout.describe() if world else "",
        )
        self.reconfigs.append(rec)
        self.active = rec
        rec.lost_gpu_s = self.ledger.rollback(env.now)
        self.world = None
        self.ledger.set(env.now, mode="pause")
        load_factor = self.policy.load_factor if kind == "restart" else 1.0
        attempt = 0
        while True:
            attempt += 1
            rec.attempts = attempt
            self._claim(rec)
            basis = self._basis()
            tr, nodes = self._plan(basis, live=False) if basis else (None, ())
            if tr is None or tr.new_layout is None:
                self.starting = ()
                self.down_basis = basis
                self.ledger.set(env.now, mode="down")
                self._release_unused_warned()
                rec.status, rec.end = "down", env.now
                rec.reason += "; no layout fits the devices left"
                rec.pause_s = env.now - rec.start
                self.active = None
                return
            self.starting = nodes
            self._release_unused_warned()
            rec.phases = restart_phases(self.cal, tr, load_factor)
            end = env.now + sum(rec.phases.values())
            while env.now < end - EPS:
                wake = self.wake
                yield env.timeout(end - env.now) | wake
                if env.now < end - EPS and self._basis() != basis:
                    break  # the device set changed: start over on the new one
            else:
                break
        self._begin_training(tr, nodes, basis)
        rec.end = env.now
        rec.pause_s = env.now - rec.start
        rec.devices_after = tr.new_devices
        rec.layout_after = tr.new_layout.describe()
        self.down_basis = None
        self.active = None

    def _react_live(self) -> Generator[simpy.Event, Any, None]:
        env = self.env
        while True:
            if self.world is None:
                if self._basis() != self.down_basis:
                    yield from self._restart("fallback", "capacity changed while no layout fitted")
                else:
                    self._settle("unchanged")
                return
            basis = self._basis()
            broken = self._world_broken()
            if not broken and basis == self.world.basis:
                self._release_unused_warned()
                self._settle("unchanged")  # e.g. a node granted and warned again before it was used
                return
            if not broken and basis == self.hopeless_basis:
                return  # waiting for the deadline: the fallback restart follows
            world = self.world
            handoff = self._prepare(world, basis)
            if broken and not isinstance(handoff, _Handoff):
                # Some state was only on the nodes gone (or nothing fits): only the checkpoint has it.
                yield from self._restart("fallback", "a node of the training world is gone before a handoff")
                continue
            if handoff == "unchanged":
                self.world = world._replace(basis=basis)
                self._settle("unchanged")
                self._release_unused_warned()
                return
            if isinstance(handoff, str):
                self.hopeless_basis = basis  # the fallback restart follows at the deadline
                return
            h = handoff
            tr = h.transition
            serves = list(self.pending)
            switch_at = h.switch_at
            cancelled = False
            while env.now < switch_at - EPS:
                wake = self.wake
                yield env.timeout(switch_at - env.now) | wake
                if env.now >= switch_at - EPS:
                    break
                if any(n not in self.held and n not in h.lost for n in world.nodes) or any(
                    n not in self.held for n in h.nodes
                ):
                    cancelled = True  # a loss the handoff did not plan around
                    break
                warned = [self.doomed[n] for n in h.nodes if n in self.doomed]
                if warned and min(warned) < switch_at + h.pause_s - EPS:
                    cancelled = True  # the target loses a node before it would be live
                    break
                if warned and isinstance(self._prepare(world, self._basis(), around_loss=False), _Handoff):
                    cancelled = True  # one handoff to the new target (or none) still makes every deadline
                    break
                if self._basis() != h.basis:
                    # Queued behind this handoff: switch as soon as it is ready, so that what follows
                    # (a granted node idling, a warned node's notice running out) waits the least.
                    switch_at = max(env.now, h.started + h.preparation_s)
            if cancelled:
                self.cancelled += 1
                continue  # re-plan from the new state (pending events stay pending)
            rec = Reconfiguration(
                index=len(self.reconfigs),
                kind="live",
                start=h.started,
                preparation_s=h.preparation_s,
                phases=h.phases,
                devices_before=world.transition.new_devices,
                layout_before=world.layout.describe(),
                devices_after=tr.new_devices,
                layout_after=tr.new_layout.describe() if tr.new_layout else "",
                bytes_moved=tr.bytes_moved,
                lost_nodes=list(h.lost),
            )
            if h.lost:
                rec.reason = "planned around lost nodes: their state came from DP replicas elsewhere"
            self.reconfigs.append(rec)
            self.active = rec
            self._claim(rec, serves)
            self.ledger.set(env.now, mode="pause")
            # Paused since the first planned-around loss, if it came before the switch.
            paused_since = min((self.gone_at.get(n, math.inf) for n in h.lost), default=env.now)
            paused_since = min(paused_since, env.now)
            yield env.timeout(h.pause_s)
            rec.pause_s = env.now - paused_since
            rec.end = env.now
            self.active = None
            lost = [
                n
                for n in (*(n for n in world.nodes if n not in h.lost), *h.nodes)
                if self.gone_at.get(n, math.inf) < env.now - EPS
            ]
            if lost or any(n not in self.held and n not in self.gone_at for n in h.nodes):
                rec.status = "failed"
                rec.reason = "a node was lost during the transfer"
                yield from self._restart("fallback", "a live handoff failed mid-transfer")
                continue
            self._begin_training(tr, h.nodes, h.basis)

    def _prepare(self, world: _World, basis: tuple[str, ...], around_loss: bool = True) -> _Handoff | str:
        """The live handoff from ``world`` to ``basis`` starting now, or why there is none:
        ``"unchanged"`` (same world), ``"nothing fits"``, or ``"too late"`` (preparation plus pause
        would end after the earliest deadline of a warned node of the running world, or a node of it is
        already gone, and, with ``around_loss``, some state would be left only on the nodes lost).

        A handoff around a loss is what the coordinator does when the transfer planner can read every
        shard from a surviving DP replica: the job trains until the node is gone, pauses, and switches as
        soon as the new world is ready, the lost nodes sending nothing."""
        tr, nodes = self._plan(basis, live=True)
        if tr.new_layout is None:
            return "nothing fits"
        if tr.unchanged:
            return "unchanged"
        now = self.env.now
        prep = live_preparation_s(self.cal, tr)
        phases = live_phases(self.cal, tr)
        pause = sum(phases.values())
        deadline = min((self.doomed[n] for n in world.nodes if n in self.doomed), default=math.inf)
        broken = any(n not in self.held for n in world.nodes)
        if broken or now + prep + pause > deadline + EPS:
            if not around_loss:
                return "too late"
            return self._prepare_around_loss(world, basis, now + prep + pause)
        # Scale-out: switch once ready (the new devices idle until then). Scale-in only: keep the
        # warned devices training until the last moment that still lets the transfer finish in time.
        switch_at = now + prep if tr.uses_fresh or math.isinf(deadline) else deadline - pause
        return _Handoff(basis, tr, nodes, now, prep, phases, pause, switch_at)

    def _prepare_around_loss(self, world: _World, basis: tuple[str, ...], end: float) -> _Handoff | str:
        """The handoff to ``basis`` that switches as soon as it is ready and reads nothing from the nodes
        of ``world`` gone before ``end`` (already gone, or warned to go by then); ``"too late"`` when some
        state would survive nowhere."""
        lost = tuple(n for n in world.nodes if n not in self.held or self.doomed.get(n, math.inf) < end - EPS)
        if not self._survives(world, lost):
            return "too late"
        tr, nodes = self._plan(basis, live=True, lost=lost)
        if tr.new_layout is None:  # the canonical cluster lost state the actual placement kept
            return "too late"
        now = self.env.now
        prep = live_preparation_s(self.cal, tr)
        phases = live_phases(self.cal, tr)
        return _Handoff(basis, tr, nodes, now, prep, phases, sum(phases.values()), now + prep, lost)

    def _survives(self, world: _World, lost: Sequence[str]) -> bool:
        """The transfer planner's rule (:mod:`.survival`) on the running world, placed in rank order on
        its nodes as the transition planner's canonical cluster places it."""
        devices = [Device(n, i) for n in world.nodes for i in range(self.per)][: world.layout.world_size]
        gone = set(lost)
        return state_survives(
            self.planner.model, world.layout, devices, [d for d in devices if d.node in gone]
        )

    # --- results -------------------------------------------------------------------------------
    def _result(self) -> SimResult:
        led = self.ledger
        events = []
        for i, ev in enumerate(self.trace.events):
            outcome, rec_index = self.outcome[i]
            share = 0.0
            if rec_index is not None:
                rec = self.reconfigs[rec_index]
                share = rec.pause_s / len(rec.events)
            events.append(
                EventRecord(
                    index=i,
                    time=ev.time,
                    node=ev.node,
                    kind=ev.kind,
                    notice=ev.notice,
                    outcome=outcome,
                    reconfiguration=rec_index,
                    downtime_s=share,
                )
            )
        return SimResult(
            policy=self.policy.name,
            label=self.policy.label,
            trace=self.trace.name,
            model=self.planner.model.name,
            calibration=self.cal.name,
            duration_s=self.trace.duration_s,
            initial_devices=len(self.trace.initial_nodes) * self.per,
            allocated_gpu_s=led.allocated,
            useful_gpu_s=led.useful,
            downtime_gpu_s=led.downtime,
            lost_gpu_s=led.lost,
            idle_gpu_s=led.idle,
            paused_s=led.paused_s,
            tokens=led.tokens,
            tokens_lost=led.tokens_lost,
            fallbacks=sum(r.kind == "fallback" for r in self.reconfigs),
            cancelled_handoffs=self.cancelled,
            handoffs_around_loss=sum(r.kind == "live" and bool(r.lost_nodes) for r in self.reconfigs),
            reconfigurations=self.reconfigs,
            events=events,
            series=led.series,
            early_releases=dict(self.released),
        )


def simulate(trace: Trace, policy: Policy, planner: TransitionPlanner) -> SimResult:
    """Run ``trace`` under ``policy``; share ``planner`` between runs to share its cache."""
    return Simulation(trace, policy, planner).run()
