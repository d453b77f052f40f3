"""The training-loop API's control paths: what a resize request must satisfy, and how the runtime reacts
to the coordinator's commands (switch when allowed, abort) and to a missed deadline.

The multi-process part uses a toy trainer (no Megatron: its state is the model's logical tensors held
as the view function cuts them, and a step adds the same amount to every element), so that it runs in
seconds; ``test_live_reshard.py`` covers the real GPT job.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed as dist
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.reshard.plan import Plan, PlanSlice, WorldConfig
from liver.reshard.views import view
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS, ModelSpec
from liver.worker_runtime.generations import HandoffState
from liver.worker_runtime.handoff import Handoff, Role
from liver.worker_runtime.handoff import _stream as handoff_stream
from liver.worker_runtime.preparation import Preparation, ScheduleBuild, check_request
from liver.worker_runtime.runtime import (
    CheckpointOptions,
    LiveRuntime,
    ReshardPhase,
    ResizeRejected,
    RuntimeEvent,
    RuntimeOptions,
)
from liver.worker_runtime.stream import executor
from liver.worker_runtime.stream.executor import StreamOptions
from liver.worker_runtime.world import GroupKind, StoreAddress, World, WorldSpec

SPEC = PRESETS["tiny-gpt"]
JOB = "runtime-test"
DEVICES = tuple(Device("n0", i) for i in range(4))
DP2 = ParallelLayout(tp=1, pp=1, dp=2)
TP2 = ParallelLayout(tp=2, pp=1, dp=1)
PP2 = ParallelLayout(tp=1, pp=2, dp=1)
STORE = StoreAddress("127.0.0.1", 1)  # never dialled by the in-process tests


def world_config(layout: ParallelLayout, *processes: int) -> WorldConfig:
    return WorldConfig(layout, Placement(tuple(DEVICES[p] for p in processes)))


def plan_between(old: WorldConfig, new: WorldConfig, model: ModelSpec = SPEC, optimizer: bool = True) -> Plan:
    from liver.reshard.planner import build_plan

    return build_plan(model, old, new, budget_bytes=1 << 20, optimizer=optimizer)


# -- a toy trainer ------------------------------------------------------------------------------------------


class ToyTrainer:
    """The model's state as the views cut it; a step adds ``(iteration + 1) / 1000`` to every element and
    all-reduces the state's sum over the world (so a step is a collective, like a real one)."""

    def __init__(self, world: World, state: dict[int, torch.Tensor]) -> None:
        self.world = world
        self.state = state
        self.iteration = 0

    def train_step(self) -> float:
        total = torch.tensor([sum(float(t.double().sum()) for t in self.state.values())], dtype=torch.float64)
        dist.all_reduce(total, group=self.world.group(GroupKind.WORLD))
        self.iteration += 1
        for t in self.state.values():
            if t.is_floating_point():
                t.add_(self.iteration / 1000)
            else:
                t.fill_(self.iteration)
        return float(total.item())


class ToyFactory:
    def __init__(self, model: ModelSpec = SPEC) -> None:
        self._model = model

    @property
    def model(self) -> ModelSpec:
        return self._model

    def build(self, world: World) -> ToyTrainer:
        state = {}
        for index, tensor in enumerate(self._model.tensors()):
            shard = view(tensor, self._model, world.layout, world.rank)
            if shard is not None:
                dtype = torch.int64 if tensor.dtype == "int64" else torch.float32
                state[index] = torch.zeros(shard.local_shape, dtype=dtype)
        return ToyTrainer(world, state)

    def warm_up(self, layout: ParallelLayout, rank: int) -> None:
        return None

    def iteration(self, trainer: ToyTrainer) -> int:
        return trainer.iteration

    def local_state(self, trainer: ToyTrainer) -> dict[int, torch.Tensor]:
        return trainer.state

    def progress(self, trainer: ToyTrainer) -> bytes:
        return msgspec.json.encode({"iteration": trainer.iteration})

    def resume(self, trainer: ToyTrainer, state: Mapping[int, torch.Tensor], progress: bytes) -> None:
        for index, target in trainer.state.items():
            if state[index].data_ptr() != target.data_ptr():
                target.copy_(state[index])
        trainer.iteration = msgspec.json.decode(progress)["iteration"]

    def dispose(self, trainer: ToyTrainer) -> None:
        for t in trainer.state.values():
            t.untyped_storage().resize_(0)

    def capture_rng(self) -> torch.Tensor:
        return torch.get_rng_state()

    def restore_rng(self, captured: object) -> None:
        assert isinstance(captured, torch.Tensor)
        torch.set_rng_state(captured)


def member_runtime(device: int = 0, **kwargs: Any) -> LiveRuntime[ToyTrainer]:
    """A runtime of a process in the DP2 world on processes 0 and 1 (not started: no I/O)."""
    initial = WorldSpec(job=JOB, generation=0, layout=DP2, placement=world_config(DP2, 0, 1).placement)
    return LiveRuntime(ToyFactory(), job=JOB, device=DEVICES[device], store=STORE, initial=initial, **kwargs)


# -- what a request must satisfy (in-process: nothing is built before the first step) --------------------

OLD = world_config(DP2, 0, 1)
NEW = world_config(TP2, 1, 2)


def test_a_member_of_both_worlds_stays_and_one_only_in_the_old_world_leaves() -> None:
    plan = plan_between(OLD, NEW)
    assert member_runtime(1).request_resize(1, TP2, NEW.placement, plan, STORE) is Role.STAY
    assert member_runtime(0).request_resize(1, TP2, NEW.placement, plan, STORE) is Role.LEAVE


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a GPU this machine lacks")
def test_the_nccl_backend_is_refused_for_a_device_this_machine_has_no_gpu_for() -> None:
    with pytest.raises(ValueError, match=r"`device`: .* no CUDA device 0 here \(0 visible\)"):
        member_runtime(options=RuntimeOptions(backend="nccl"))


def test_a_process_in_no_world_joins() -> None:
    runtime = LiveRuntime(ToyFactory(), job=JOB, device=DEVICES[2])
    assert runtime.request_resize(1, TP2, NEW.placement, plan_between(OLD, NEW), STORE) is Role.JOIN
    assert runtime.pending_generation == 1


def test_a_generation_that_is_not_newer_is_refused() -> None:
    with pytest.raises(ValueError, match="`generation`"):
        member_runtime().request_resize(0, TP2, NEW.placement, plan_between(OLD, NEW), STORE)


def test_a_plan_for_another_model_is_refused() -> None:
    plan = plan_between(OLD, NEW, model=PRESETS["tiny-llama"])
    with pytest.raises(ValueError, match=r"`plan\.model`"):
        member_runtime().request_resize(1, TP2, NEW.placement, plan, STORE)


def test_a_plan_that_shards_the_optimizer_state_otherwise_than_the_job_is_refused_saying_so() -> None:
    from liver.shared.geometry import DdpSettings

    sharded = SPEC.geometry().with_ddp(DdpSettings(distributed_optimizer=True))
    plan = plan_between(OLD, NEW, model=sharded)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`plan\.model\.ddp`.*MegatronJob\.model"):
        member_runtime().request_resize(1, TP2, NEW.placement, plan, STORE)


def test_a_plan_that_leaves_the_optimizer_state_behind_is_refused() -> None:
    plan = plan_between(OLD, NEW, optimizer=False)
    with pytest.raises(ValueError, match=r"`plan\.tensors`"):
        member_runtime().request_resize(1, TP2, NEW.placement, plan, STORE)


def test_a_plan_to_another_world_than_the_requested_one_is_refused() -> None:
    plan = plan_between(OLD, world_config(TP2, 2, 1))
    with pytest.raises(ValueError, match=r"`plan\.new`"):
        member_runtime().request_resize(1, TP2, NEW.placement, plan, STORE)


def test_a_plan_from_another_world_than_this_processs_is_refused() -> None:
    plan = plan_between(world_config(DP2, 1, 0), NEW)
    with pytest.raises(ValueError, match=r"`plan\.old`"):
        member_runtime().request_resize(1, TP2, NEW.placement, plan, STORE)


def test_a_request_for_a_world_without_this_process_is_refused_where_it_is_in_no_world() -> None:
    runtime = LiveRuntime(ToyFactory(), job=JOB, device=DEVICES[3])
    with pytest.raises(ValueError, match="`placement`"):
        runtime.request_resize(1, TP2, NEW.placement, plan_between(OLD, NEW), STORE)


def test_a_plan_slice_for_another_device_is_refused() -> None:
    plan = plan_between(OLD, NEW)
    piece = PlanSlice(
        model=plan.model,
        optimizer=True,
        old=plan.old,
        new=plan.new,
        budget_bytes=plan.budget_bytes,
        device=DEVICES[1],
        tasks=plan.tasks_of(rank_src=1),
    )
    with pytest.raises(ValueError, match=r"`plan\.device`"):
        member_runtime(0).request_resize(1, TP2, NEW.placement, piece, STORE)
    assert member_runtime(1).request_resize(1, TP2, NEW.placement, piece, STORE) is Role.STAY


def test_a_lost_device_outside_the_old_world_is_refused() -> None:
    plan = plan_between(OLD, NEW)
    with pytest.raises(ValueError, match=r"`lost`: device .* is not in the old world"):
        member_runtime(1).request_resize(1, TP2, NEW.placement, plan, STORE, lost=(DEVICES[3],))


def test_a_lost_device_that_the_new_world_runs_on_is_refused() -> None:
    plan = plan_between(OLD, NEW)
    with pytest.raises(ValueError, match=r"`lost`: .* the new world runs on it"):
        member_runtime(0).request_resize(1, TP2, NEW.placement, plan, STORE, lost=(DEVICES[1],))


def test_a_request_that_calls_this_processs_own_device_lost_is_refused() -> None:
    plan = plan_between(OLD, NEW)
    with pytest.raises(ValueError, match="`lost`: names this process's own device"):
        member_runtime(0).request_resize(1, TP2, NEW.placement, plan, STORE, lost=(DEVICES[0],))


def test_a_deadline_without_a_timezone_is_refused() -> None:
    with pytest.raises(ValueError, match="`deadline`"):
        member_runtime().request_resize(1, TP2, NEW.placement, plan_between(OLD, NEW), STORE, datetime.now())


def test_a_newer_request_supersedes_the_pending_one_and_waits_behind_it() -> None:
    runtime = member_runtime(1)
    runtime.request_resize(1, TP2, NEW.placement, plan_between(OLD, NEW), STORE, switch_when_ready=False)
    runtime.request_resize(2, TP2, NEW.placement, plan_between(OLD, NEW), STORE, switch_when_ready=False)
    assert runtime.pending_generation == 2
    assert runtime.handoff_state is HandoffState.PREPARING  # generation 1's, let go of at the next boundary


def test_a_request_after_the_coordinators_switch_is_rejected_naming_the_switching_generation() -> None:
    runtime = member_runtime(1)
    runtime.request_resize(1, TP2, NEW.placement, plan_between(OLD, NEW), STORE, switch_when_ready=False)
    runtime.allow_switch(1)
    with pytest.raises(ResizeRejected, match="generation 2: generation 1 has the coordinator's Switch"):
        runtime.request_resize(2, TP2, NEW.placement, plan_between(OLD, NEW), STORE)


def test_after_an_abort_a_newer_request_is_accepted_even_past_the_switch() -> None:
    runtime = member_runtime(1)
    runtime.request_resize(1, TP2, NEW.placement, plan_between(OLD, NEW), STORE, switch_when_ready=False)
    runtime.allow_switch(1)
    runtime.abort(1, "the coordinator restarted before the switch")
    runtime.request_resize(2, TP2, NEW.placement, plan_between(OLD, NEW), STORE, switch_when_ready=False)
    assert runtime.pending_generation == 2


def test_an_aborted_queued_request_is_let_go_of_at_once_and_acked_aborted() -> None:
    heard: list[RuntimeEvent] = []
    runtime = member_runtime(1, on_event=heard.append)
    runtime.request_resize(1, TP2, NEW.placement, plan_between(OLD, NEW), STORE, switch_when_ready=False)
    runtime.request_resize(2, TP2, NEW.placement, plan_between(OLD, NEW), STORE, switch_when_ready=False)
    runtime.abort(2, "given up")
    assert runtime.pending_generation == 1
    (aborted,) = [e for e in heard if e.phase is ReshardPhase.ABORTED]
    assert aborted.generation == 2 and aborted.abort is not None and aborted.abort.by_request


def test_a_request_superseded_while_queued_is_let_go_of_and_the_newest_waits() -> None:
    heard: list[RuntimeEvent] = []
    runtime = member_runtime(1, on_event=heard.append)
    for generation in (1, 2, 3):
        plan = plan_between(OLD, NEW)
        runtime.request_resize(generation, TP2, NEW.placement, plan, STORE, switch_when_ready=False)
    assert runtime.pending_generation == 3
    assert [e.generation for e in heard if e.phase is ReshardPhase.ABORTED] == [2]


def test_the_listener_hears_the_request_and_its_failures_never_reach_the_caller() -> None:
    heard: list[RuntimeEvent] = []

    def listener(event: RuntimeEvent) -> None:
        heard.append(event)
        raise RuntimeError("a broken listener")

    runtime = member_runtime(1, on_event=listener)
    runtime.request_resize(1, TP2, NEW.placement, plan_between(OLD, NEW), STORE)
    assert [(e.generation, e.phase) for e in heard] == [(1, ReshardPhase.PREPARING)]


def test_a_process_never_taken_into_a_world_gives_up_after_its_join_timeout() -> None:
    runtime = LiveRuntime(
        ToyFactory(), job=JOB, device=DEVICES[3], options=RuntimeOptions(join_timeout_s=0.2)
    )
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not taken into any world"):
        runtime.step()
    assert time.monotonic() - started < 30  # without a join timeout it would wait for ever


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vote_every", 0),
        ("control_timeout_s", 0.0),
        ("build_timeout_s", -1.0),
        ("join_timeout_s", 0.0),
        ("recover_timeout_s", 0.0),
    ],
)
def test_options_out_of_range_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"`{field}`"):
        RuntimeOptions(**{field: value})


@pytest.mark.parametrize(("field", "value"), [("root", ""), ("every", 0), ("keep_last", 0)])
def test_checkpoint_options_out_of_range_are_refused_naming_the_field(field: str, value: object) -> None:
    fields: dict[str, Any] = {"root": "/shared/ckpt", field: value}
    with pytest.raises(ValueError, match=rf"`checkpoint\.{field}`"):
        CheckpointOptions(**fields)


def test_checkpoints_need_a_factory_that_can_save_and_fall_back() -> None:
    options = RuntimeOptions(checkpoint=CheckpointOptions(root="/shared/ckpt"))
    with pytest.raises(ValueError, match=r"`options\.checkpoint`: the factory ToyFactory cannot"):
        LiveRuntime(ToyFactory(), job=JOB, device=DEVICES[2], options=options)


# -- the transfer schedule, made in the preparation (in-process: no group is built) ----------------------


class NoNetwork:
    """A stream group of one process that refuses to move data (a plan that stays on one device)."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> None:
        raise AssertionError("sent a message")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> None:
        raise AssertionError("posted a receive")


class OneProcessStream:
    new = WorldSpec(
        job=JOB, generation=1, layout=ParallelLayout(tp=1, pp=1, dp=1), placement=Placement(DEVICES[:1])
    )

    def group(self) -> NoNetwork:
        return NoNetwork()


ONE = ParallelLayout(tp=1, pp=1, dp=1)


def test_the_handoff_streams_with_the_schedule_its_preparation_made(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_between(world_config(ONE, 0), world_config(ONE, 0))
    options = StreamOptions(message_bytes=4096)
    build = ScheduleBuild(plan, DEVICES[0], options)
    assert build.wait(120) and build.error is None
    state = {}
    prepared = build.result()
    assert prepared is not None
    for ti, (shard,) in prepared.schedule.old_shards.items():
        dtype = torch.int64 if plan.tensors[ti].dtype == "int64" else torch.float32
        t = state[ti] = torch.zeros(shard.local_shape, dtype=dtype)  # padding rows stay zero
        if shard.box is not None:
            inside = t[tuple(slice(0, hi - lo) for lo, hi in shard.box)]
            inside.copy_(torch.arange(1, inside.numel() + 1).reshape(inside.shape))
    old = ToyTrainer(None, state)  # type: ignore[arg-type]  # a trainer that never steps needs no world

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("the handoff built the schedule in the pause")

    monkeypatch.setattr(executor, "build_schedule", no_build)
    handoff = Handoff(
        factory=ToyFactory(),
        plan=plan,
        device=DEVICES[0],
        stream=OneProcessStream(),  # type: ignore[arg-type]
        old_world=None,
        new_world=None,
        old_trainer=old,
        iteration=0,
        from_generation=0,
        control_timeout=timedelta(seconds=5),
        join_timeout=timedelta(seconds=5),
        stream_options=options,
        schedule=prepared,
    )
    result = handoff_stream(handoff, 0, 0, None)
    assert result.stats.schedule_seconds == 0.0
    assert sorted(result.new_state) == sorted(state)
    assert all(torch.equal(result.new_state[ti], t) for ti, t in state.items())


def test_a_plan_that_does_not_fit_this_process_fails_the_preparation_before_the_cut() -> None:
    request, role, old, new = check_request(
        job=JOB,
        device=DEVICES[0],
        model=SPEC,
        active=WorldSpec(job=JOB, generation=0, layout=DP2, placement=OLD.placement),
        newest_generation=0,
        generation=1,
        layout=TP2,
        placement=NEW.placement,
        plan=plan_between(OLD, NEW),
        store=STORE,
        deadline=None,
        from_generation=None,
        switch_when_ready=True,
    )
    prep = Preparation(request, role, old, new)
    prep.schedule_build = ScheduleBuild(request.plan, DEVICES[3], StreamOptions())
    assert prep.schedule_build.wait(120)
    assert prep.schedule() is None
    failure = prep.failure()
    assert failure is not None
    assert failure.startswith("building the transfer schedule failed: `device`:")
    assert failure.endswith("is in neither world of the plan")


# -- commands and deadlines, on two processes ------------------------------------------------------------

GATED, COMMANDED, MISSED, BUILD_FAILS, RECOVERED = 1, 2, 3, 4, 5
PEER_TIMEOUT_S = 120.0
"""How long a process waits for its peer (a vote, a world's rendezvous): no test here is about that
timeout, and a busy machine may keep one process off the CPU for a while."""
MAX_ITERATIONS = 20_000
"""Only against a hang: the loop ends once every request is settled (about 110 iterations on an idle
machine; on a busy one each world build lasts more iterations, as the loop keeps stepping meanwhile)."""
WAIT_AFTER_READY = 3  # iterations a process keeps training while ready but not allowed to switch


REQUESTS: dict[int, dict[str, Any]] = {
    GATED: {"switch_when_ready": False},
    COMMANDED: {"switch_when_ready": False},
    MISSED: {"switch_when_ready": False, "deadline_in_s": 1.0},
    BUILD_FAILS: {},
    RECOVERED: {},
}


class FailingBuildFactory(ToyFactory):
    """Process 1's factory: building the trainer of generation BUILD_FAILS raises (before the cut)."""

    def build(self, world: World) -> ToyTrainer:
        if world.generation == BUILD_FAILS:
            raise RuntimeError("no memory left for the new trainer")
        return super().build(world)


def toy_process(proc: Proc, plans: dict[int, Plan]) -> dict[str, Any]:
    from liver.shared.logs import configure_logging
    from liver.worker_runtime.world import live_generations

    configure_logging(level="ERROR")
    address = StoreAddress("127.0.0.1", proc.store.port)
    events: list[RuntimeEvent] = []
    hooks: dict[str, list[tuple[int, int, int | None]]] = {"cut": [], "switch": []}

    def at_cut(generation: int, old: ToyTrainer) -> None:  # the user's hook: the old world still trains
        hooks["cut"].append((generation, old.iteration, runtime.generation))

    def after_switch(generation: int, new: ToyTrainer) -> None:
        hooks["switch"].append((generation, new.iteration, runtime.generation))

    runtime = LiveRuntime(
        FailingBuildFactory() if proc.rank == 1 else ToyFactory(),
        job=JOB,
        device=DEVICES[proc.rank],
        store=address,
        initial=WorldSpec(job=JOB, generation=0, layout=DP2, placement=world_config(DP2, 0, 1).placement),
        options=RuntimeOptions(control_timeout_s=PEER_TIMEOUT_S, build_timeout_s=PEER_TIMEOUT_S),
        on_event=events.append,
        on_cut=at_cut,
        on_switch=after_switch,
    )
    out: dict[str, Any] = {"generation_at": {}, "values_after_switch": {}, "allowed_at": None}
    out["hooks"] = hooks
    out["rng_kept_across_boundaries"] = True
    trainer = runtime.step()
    pending = sorted(plans)
    ready_since: int | None = None
    while trainer is not None and trainer.iteration < MAX_ITERATIONS:
        generation = runtime.generation
        if runtime.pending_generation is None and pending:
            g = pending.pop(0)
            options = dict(REQUESTS[g])
            deadline_in = options.pop("deadline_in_s", None)
            deadline = None if deadline_in is None else datetime.now(UTC) + timedelta(seconds=deadline_in)
            plan = plans[g]
            runtime.request_resize(g, plan.new.layout, plan.new.placement, plan, address, deadline, **options)
            ready_since = None
        elif runtime.pending_generation is None and not pending:
            break
        heard_ready = any(
            e.phase is ReshardPhase.READY and e.generation == runtime.pending_generation for e in events
        )
        if heard_ready and ready_since is None:
            ready_since = trainer.iteration
        if ready_since is not None and trainer.iteration == ready_since + WAIT_AFTER_READY:
            if runtime.pending_generation == GATED:
                runtime.allow_switch(GATED)
                out["allowed_at"] = trainer.iteration
            elif runtime.pending_generation == COMMANDED and proc.rank == 1:
                runtime.abort(COMMANDED, "the operator changed their mind")
        trainer.train_step()
        time.sleep(0.005)
        rng = torch.get_rng_state()
        trainer = runtime.step()
        if runtime.generation == generation and not torch.equal(rng, torch.get_rng_state()):
            out["rng_kept_across_boundaries"] = False  # a boundary without a switch touched the streams
        if runtime.generation != generation:
            out["generation_at"][runtime.generation] = trainer.iteration
            floats = {float(t.max()) for t in trainer.state.values() if t.is_floating_point() and t.numel()}
            out["values_after_switch"][runtime.generation] = (sorted(floats), trainer.iteration)
    out["history"] = [msgspec.to_builtins(h) | {"type": type(h).__name__} for h in runtime.history]
    out["events"] = [(e.generation, str(e.phase)) for e in events]
    out["live_generations"] = live_generations(JOB)
    runtime.close()
    return out


@pytest.fixture(scope="module")
def toy_runs() -> list[dict[str, Any]]:
    start = world_config(DP2, 0, 1)
    plans = {
        GATED: plan_between(start, world_config(TP2, 1, 0)),
        COMMANDED: plan_between(world_config(TP2, 1, 0), world_config(PP2, 0, 1)),
        MISSED: plan_between(world_config(TP2, 1, 0), world_config(PP2, 0, 1)),
        BUILD_FAILS: plan_between(world_config(TP2, 1, 0), world_config(PP2, 0, 1)),
        RECOVERED: plan_between(world_config(TP2, 1, 0), world_config(PP2, 0, 1)),
    }
    return [o.unwrap() for o in run_world(toy_process, 2, args=(plans,), timeout_s=120)]


@pytest.mark.slow
def test_every_switch_streams_with_the_schedule_made_while_training_went_on(toy_runs: list) -> None:
    switches = [h for found in toy_runs for h in found["history"] if h["type"] == "SwitchReport"]
    assert switches
    assert [h["schedule_s"] for h in switches] == [0.0] * len(switches)


def _aborts(found: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {h["generation"]: h for h in found["history"] if h["type"] == "AbortReport"}


@pytest.mark.slow
def test_a_gated_switch_waits_for_the_coordinators_switch_then_happens_at_one_cut(toy_runs: list) -> None:
    cuts = {found["generation_at"][GATED] for found in toy_runs}
    assert len(cuts) == 1
    assert cuts.pop() >= max(found["allowed_at"] for found in toy_runs)
    for found in toy_runs:
        assert [p for g, p in found["events"] if g == GATED] == ["preparing", "ready", "switched"]


@pytest.mark.slow
def test_every_element_of_the_new_shards_is_the_value_at_the_cut(toy_runs: list) -> None:
    for found in toy_runs:
        for generation in (GATED, RECOVERED):
            values, iteration = found["values_after_switch"][generation]
            assert values == [pytest.approx(sum(range(1, iteration + 1)) / 1000, rel=1e-5)], generation


@pytest.mark.slow
def test_an_abort_command_on_one_rank_aborts_the_handoff_on_every_rank(toy_runs: list) -> None:
    iterations = {_aborts(found)[COMMANDED]["iteration"] for found in toy_runs}
    assert len(iterations) == 1
    assert "the operator changed their mind" in _aborts(toy_runs[1])[COMMANDED]["reason"]
    assert "another rank" in _aborts(toy_runs[0])[COMMANDED]["reason"]
    for found in toy_runs:
        assert _aborts(found)[COMMANDED]["stage"] == "cut"
        assert COMMANDED not in found["generation_at"]


@pytest.mark.slow
def test_a_missed_deadline_aborts_the_handoff_before_the_switch(toy_runs: list) -> None:
    reasons = [_aborts(found)[MISSED]["reason"] for found in toy_runs]
    assert any("deadline" in reason for reason in reasons)  # the rank whose deadline passed first
    assert len({_aborts(found)[MISSED]["iteration"] for found in toy_runs}) == 1
    for found in toy_runs:
        assert MISSED not in found["generation_at"]


@pytest.mark.slow
def test_the_new_trainer_is_built_at_one_agreed_boundary_before_the_cut(toy_runs: list) -> None:
    for generation in (GATED, RECOVERED):
        reports = [
            h
            for found in toy_runs
            for h in found["history"]
            if h["type"] == "SwitchReport" and h["generation"] == generation
        ]
        assert len(reports) == 2
        assert len({r["prebuild_iteration"] for r in reports}) == 1
        assert all(r["prebuild_iteration"] < r["iteration"] for r in reports)
        assert all(r["prebuild_s"] > 0 for r in reports)


@pytest.mark.slow
def test_building_the_new_trainer_leaves_the_old_worlds_random_streams_as_they_were(toy_runs: list) -> None:
    assert all(found["rng_kept_across_boundaries"] for found in toy_runs)


@pytest.mark.slow
def test_a_build_that_fails_before_the_cut_aborts_the_handoff_everywhere_naming_why(toy_runs: list) -> None:
    iterations = {_aborts(found)[BUILD_FAILS]["iteration"] for found in toy_runs}
    assert len(iterations) == 1
    reason = _aborts(toy_runs[1])[BUILD_FAILS]["reason"]
    assert reason == "building the new trainer before the cut failed: no memory left for the new trainer"
    for found in toy_runs:
        assert _aborts(found)[BUILD_FAILS]["stage"] == "cut"
        assert BUILD_FAILS not in found["generation_at"]


@pytest.mark.slow
def test_after_aborted_handoffs_the_job_still_reshards_and_keeps_one_generation(toy_runs: list) -> None:
    for found in toy_runs:
        assert RECOVERED in found["generation_at"]
        assert found["live_generations"] == (RECOVERED,)


# -- a lost old rank without a checkpoint to fall back to ------------------------------------------------

ONE = ParallelLayout(tp=1, pp=1, dp=1)


def lost_rank_process(proc: Proc, plan: Plan) -> dict[str, Any]:
    """Process 1 (leaving) dies in its first streaming step; process 0 stays without a checkpoint."""
    import os

    from liver.shared.logs import configure_logging

    configure_logging(level="CRITICAL")

    def die(generation: int, layer: int, rnd: int) -> None:
        os._exit(0)

    address = StoreAddress("127.0.0.1", proc.store.port)
    runtime = LiveRuntime(
        ToyFactory(),
        job=JOB,
        device=DEVICES[proc.rank],
        store=address,
        initial=WorldSpec(job=JOB, generation=0, layout=TP2, placement=world_config(TP2, 0, 1).placement),
        options=RuntimeOptions(control_timeout_s=PEER_TIMEOUT_S, build_timeout_s=PEER_TIMEOUT_S),
        on_stream_step=die if proc.rank == 1 else None,
    )
    trainer = runtime.step()
    runtime.request_resize(1, ONE, plan.new.placement, plan, address)
    assert runtime.wait_prepared(PEER_TIMEOUT_S)
    assert trainer is not None
    trainer.train_step()
    trainer = runtime.step()  # the vote agrees to build the new trainer here; the cut comes next
    assert trainer is not None and runtime.pending_generation == 1
    trainer.train_step()
    try:
        runtime.step()
    except Exception as error:  # what the training loop sees
        return {"type": type(error).__name__, "message": str(error), "world": runtime.world}
    return {"type": None}


@pytest.mark.slow
def test_without_a_checkpoint_a_handoff_that_lost_an_old_rank_fails_saying_none_was_configured() -> None:
    plan = plan_between(world_config(TP2, 0, 1), world_config(ONE, 0))
    survivor, lost = run_world(lost_rank_process, 2, args=(plan,), timeout_s=120, wait_for={0})
    assert lost.status == "died"
    found = survivor.unwrap()
    assert found["type"] == "NoCheckpointConfigured"
    assert "the old world cannot be restored" in found["message"]
    assert "no checkpoint was configured" in found["message"]
    assert found["world"] is None


def _prep_for(new: WorldConfig) -> Any:
    from liver.worker_runtime.preparation import Preparation, ResizeRequest

    request = ResizeRequest(
        generation=1,
        from_generation=0,
        layout=new.layout,
        placement=new.placement,
        plan=plan_between(OLD, new),
        store=STORE,
        deadline=None,
        switch_when_ready=True,
    )
    old = WorldSpec(job=JOB, generation=0, layout=DP2, placement=OLD.placement)
    shadow = WorldSpec(job=JOB, generation=1, layout=new.layout, placement=new.placement)
    return Preparation(request, Role.STAY, old, shadow)


def test_a_failed_check_of_the_new_layouts_model_fails_the_preparation_naming_why() -> None:
    from liver.worker_runtime.preparation import LayoutCheck

    def mismatch() -> None:
        raise ValueError("rank 0 at TP2,PP1,DP1: decoder.layers.0.self_attention.linear_qkv.bias is missing")

    prep = _prep_for(NEW)
    prep.layout_check = LayoutCheck(mismatch)
    assert prep.layout_check.wait(30)
    assert not prep.ready()
    reason = prep.failure()
    assert reason is not None and "checking the new layout's model" in reason and "linear_qkv.bias" in reason


def test_the_layout_check_runs_once_per_handoff_in_the_process_of_new_rank_0() -> None:
    checked: list[ParallelLayout] = []

    class CheckingFactory(ToyFactory):
        def check_layout(self, layout: ParallelLayout) -> None:
            checked.append(layout)

    initial = WorldSpec(job=JOB, generation=0, layout=DP2, placement=OLD.placement)
    for device in (1, 2):  # new rank 0 and new rank 1 (NEW is on processes 1 and 2)
        runtime = LiveRuntime(
            CheckingFactory(), job=JOB, device=DEVICES[device], store=STORE, initial=initial
        )
        check = runtime._layout_check(_prep_for(NEW))
        if check is not None:
            check()
    assert checked == [TP2]


@pytest.mark.slow
def test_the_cut_hook_sees_the_old_trainer_at_the_cut_only_for_switches_that_reach_it(toy_runs: list) -> None:
    for found in toy_runs:
        cuts = {g: (iteration, current) for g, iteration, current in found["hooks"]["cut"]}
        assert set(cuts) == {GATED, RECOVERED}  # aborted at the vote or before it: never cut
        for generation, (iteration, current) in cuts.items():
            assert iteration == found["generation_at"][generation]
            assert current is not None and current < generation  # still on the old world


@pytest.mark.slow
def test_the_switch_hook_gets_the_new_trainer_once_committed_before_its_first_step(toy_runs: list) -> None:
    for found in toy_runs:
        switches = found["hooks"]["switch"]
        assert [g for g, _, _ in switches] == [GATED, RECOVERED]
        for generation, iteration, current in switches:
            assert (iteration, current) == (found["generation_at"][generation], generation)
