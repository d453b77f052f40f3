"""The worker's side of a handoff as one state machine (``liver/worker_runtime/generations.py``).

The table itself (every state reachable, every handoff able to end), then a property test: a real
:class:`LiveRuntime` of one process (a one-rank world on loopback, the toy job of ``test_runtime``)
driven by Hypothesis with what a coordinator that restarts, re-plans and aborts can send it, in any
order, between iteration boundaries. Whatever the order: a newer request is refused only after the
coordinator's Switch of a pending one that no abort ended, no process holds more than the active
world and one shadow world, every move goes through the table, and once the commands stop every
request ends exactly once (switched or aborted).
"""

from __future__ import annotations

import itertools
from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_runtime import ToyFactory, ToyTrainer, plan_between

from liver.reshard.plan import WorldConfig
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.worker_runtime import preparation
from liver.worker_runtime.generations import (
    ENDED,
    TRANSITIONS,
    HandoffState,
    IllegalHandoffMove,
    check_move,
)
from liver.worker_runtime.runtime import (
    LiveRuntime,
    ReshardPhase,
    ResizeRejected,
    RuntimeEvent,
    RuntimeOptions,
)
from liver.worker_runtime.world import StoreAddress, WorldSpec, host_store, live_generations

S = HandoffState


def _reachable(start: HandoffState) -> set[HandoffState]:
    seen, todo = {start}, deque([start])
    while todo:
        for nxt in TRANSITIONS[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_state_is_reachable_from_where_a_handoff_begins() -> None:
    begins = _reachable(S.FETCHING) | _reachable(S.QUEUED) | _reachable(S.PREPARING)
    assert begins == set(HandoffState)


def test_every_handoff_can_end_from_every_state() -> None:
    for state in HandoffState:
        assert _reachable(state) & ENDED, state


def test_ended_states_are_never_left() -> None:
    assert all(not TRANSITIONS[state] for state in ENDED)


def test_a_move_the_table_does_not_allow_raises_naming_both_states() -> None:
    with pytest.raises(IllegalHandoffMove, match="generation 7: switched -> preparing is not allowed"):
        check_move(7, S.SWITCHED, S.PREPARING, "a bug")


# -- the property: a one-process runtime under every order of commands --------------------------------------

DEVICE = Device("n0", 0)
ONE = ParallelLayout(tp=1, pp=1, dp=1)
WORLD = WorldConfig(ONE, Placement((DEVICE,)))
_jobs = itertools.count()
_store = host_store("127.0.0.1", 0)
STORE = StoreAddress("127.0.0.1", _store.port)
PLAN = plan_between(WORLD, WORLD)
SETTLE_BOUNDARIES = 400
"""Boundaries the runtime gets, once the commands stop, to end every request (a few on an idle machine)."""

MOVES: set[tuple[HandoffState, HandoffState]] = set()


def _recording(generation: int, frm: HandoffState, to: HandoffState, why: str) -> HandoffState:
    MOVES.add((frm, to))
    return check_move(generation, frm, to, why)


class RuntimeUnderCommands(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.job = f"machine-{next(_jobs)}"
        self.events: list[RuntimeEvent] = []
        self.runtime: LiveRuntime[ToyTrainer] = LiveRuntime(
            ToyFactory(),
            job=self.job,
            device=DEVICE,
            store=STORE,
            initial=WorldSpec(job=self.job, generation=0, layout=ONE, placement=WORLD.placement),
            options=RuntimeOptions(control_timeout_s=30, build_timeout_s=30),
            on_event=self.events.append,
        )
        trainer = self.runtime.step()
        assert trainer is not None
        self.trainer = trainer
        self.newest = 0
        self.requested: list[int] = []
        self.allowed: set[int] = set()
        self.aborted: set[int] = set()
        """Generations aborted while still open (each must end aborted)."""
        self._aborts_sent: list[int] = []

    def _open(self) -> list[int]:
        ended = self._ended()
        return [g for g in self.requested if g not in ended]

    def _ended(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for e in self.events:
            if e.phase in (ReshardPhase.SWITCHED, ReshardPhase.ABORTED):
                out.setdefault(e.generation, []).append(str(e.phase))
        return out

    @rule()
    def request(self) -> None:
        g = self.newest + 1
        pending = self.runtime.pending_generation
        aborted = set(self._aborts_sent)
        switching = pending is not None and pending in self.allowed and pending not in aborted
        try:
            self.runtime.request_resize(g, ONE, WORLD.placement, PLAN, STORE, switch_when_ready=False)
        except ResizeRejected:
            assert switching, f"generation {g} refused while {pending} had no Switch or was aborted"
            return
        self.newest = g
        self.requested.append(g)

    # The commands name a generation by a fixed-range draw: which generations are still open depends on
    # how far the background builds came (timing), and Hypothesis needs the same draws to replay.
    @precondition(lambda self: bool(self.requested))
    @rule(pick=st.integers(min_value=0, max_value=7))
    def abort(self, pick: int) -> None:
        g = self.requested[-1 - pick % len(self.requested)]
        if g not in self._ended():
            self.aborted.add(g)  # aborted while open: it must end aborted
        self._aborts_sent.append(g)
        self.runtime.abort(g, "the coordinator restarted")

    @precondition(lambda self: bool(self.requested))
    @rule(pick=st.integers(min_value=0, max_value=7))
    def allow(self, pick: int) -> None:
        g = self.requested[-1 - pick % len(self.requested)]
        self.allowed.add(g)
        self.runtime.allow_switch(g)

    @rule(boundaries=st.integers(min_value=1, max_value=4))
    def train(self, boundaries: int) -> None:
        for _ in range(boundaries):
            self.trainer.train_step()
            trainer = self.runtime.step()
            assert trainer is not None
            self.trainer = trainer

    @invariant()
    def at_most_the_active_world_and_one_shadow_world(self) -> None:
        assert len(live_generations(self.job)) <= 2

    @invariant()
    def the_pending_handoff_has_not_ended(self) -> None:
        state = self.runtime.handoff_state
        assert state is None or state not in ENDED

    def teardown(self) -> None:
        try:
            for g in self._open():
                self.runtime.allow_switch(g)
            for _ in range(SETTLE_BOUNDARIES):
                if self.runtime.pending_generation is None:
                    break
                for g in self._open():
                    self.runtime.allow_switch(g)
                self.trainer.train_step()
                trainer = self.runtime.step()
                assert trainer is not None
                self.trainer = trainer
            ended = self._ended()
            assert sorted(ended) == self.requested, "every request ends"
            assert all(len(outcomes) == 1 for outcomes in ended.values()), ended
            assert all(ended[g] == ["aborted"] for g in self.aborted), "an abort before the end wins"
        finally:
            self.runtime.close()


@pytest.mark.slow
def test_a_runtime_under_any_order_of_commands_keeps_the_handoff_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    RuntimeUnderCommands.TestCase.settings = settings(
        max_examples=25,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    RuntimeUnderCommands.TestCase().runTest()


def _train_until(machine: RuntimeUnderCommands, state: HandoffState | None, limit: int = 400) -> None:
    for _ in range(limit):
        if machine.runtime.handoff_state is state:
            return
        machine.train(1)
    raise AssertionError(f"the handoff never reached {state}")


@pytest.mark.slow
def test_every_move_the_runtime_makes_is_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's moves, each by a scripted order of commands (the property test's random orders
    reach them too, but not each one in every run)."""
    monkeypatch.setattr(preparation, "check_move", _recording)
    MOVES.clear()
    m = RuntimeUnderCommands()
    try:
        m.request()  # 1: PREPARING
        m.request()  # 2: QUEUED behind 1, which is given up
        m.request()  # 3: QUEUED; 2 let go of while queued (QUEUED -> RELEASING -> ABORTED)
        _train_until(m, HandoffState.READY)  # 1 let go of (PREPARING -> RELEASING), 3 goes ahead
        m.allow(0)  # 3: READY -> SWITCHING -> SWITCHED
        _train_until(m, None)
        m.request()  # 4
        _train_until(m, HandoffState.READY)
        m.abort(0)  # 4: READY -> RELEASING -> ABORTED
        _train_until(m, None)
    finally:
        m.teardown()
    runtime_moves = {
        (S.QUEUED, S.PREPARING),
        (S.QUEUED, S.RELEASING),
        (S.PREPARING, S.READY),
        (S.PREPARING, S.RELEASING),
        (S.READY, S.SWITCHING),
        (S.READY, S.RELEASING),
        (S.SWITCHING, S.SWITCHED),
        (S.RELEASING, S.ABORTED),
    }
    assert runtime_moves <= MOVES, sorted(runtime_moves - MOVES)
