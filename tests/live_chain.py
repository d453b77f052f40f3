"""A chain of live reshards of a real Megatron job, and the baseline it must equal bit for bit.

Shared by the live-reshard tests (LiveR's own GPT, models no ModelSpec describes). One job of six
processes runs the chain through :class:`LiveRuntime` (each process with a companion thread that hands in
the requests, as the bus companion does): it starts on ``chain.start`` and p0, playing the coordinator,
publishes the next request through the store ``chain.steps`` steps after each cut. Placements come from
the planner. Every process snapshots its local state after each step; the snapshot before a switch is
the state at the cut. A second, separate job of four processes is the checkpoint-equivalent baseline:
for each generation it builds fresh trainers at the new layout, loads the global state gathered at the
cut (sliced with the view function) and trains as many steps as the live job did there; and it saves a
``dist_checkpointing`` checkpoint at the old layout and loads it at the new one.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import msgspec
import numpy as np
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.reshard.holdings import holding, packed
from liver.reshard.plan import Plan, WorldConfig
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import ModelSpec
from liver.worker_runtime.megatron.train_config import TrainConfig

DEVICES = tuple(Device("n0", i) for i in range(6))
BUDGET = 256 * 1024  # staging budget: several rounds per layer
ITERATION_CAP = 100  # a safety stop: no scenario here comes near it
PREPARE_STEPS = 8
"""Steps a world trains beside a preparation before its loop waits for the groups to be built: enough to
show that training goes on, and a bound on a generation's length however slow a busy machine makes the
joiners' start (six processes on two cores), so that a chain stays far below ``ITERATION_CAP``."""
CONTROL_TIMEOUT_S = 120.0
"""Generous: six Megatron processes share a (possibly busy) two-core machine, and a rank may wait that
long for its peers' votes. A failed stream must abort far sooner (see the fault test)."""


OPTIMIZERS = {
    "plain": TrainConfig(global_batch_size=4, micro_batch_size=1, seq_length=16, hidden_dropout=0.1),
    "dist-opt": TrainConfig(
        global_batch_size=4,
        micro_batch_size=1,
        seq_length=16,
        hidden_dropout=0.1,
        use_distributed_optimizer=True,
    ),
}
"""The chains' two jobs, with Adam as Megatron keeps it plainly and with its distributed optimizer
(dropout on, so the random streams move too)."""


class Transition(NamedTuple):
    name: str
    layout: ParallelLayout
    processes: tuple[int, ...]


class Chain(NamedTuple):
    """One live job's scenario: the model (a ``ModelSpec`` or a ``ModelSource``), where it starts, the
    generations it moves through, and optionally one process whose stream fails in one generation."""

    job: str
    model: Any
    config: TrainConfig
    start: ParallelLayout
    start_processes: tuple[int, ...]
    transitions: dict[int, Transition]
    steps: int = 2  # steps on the start world, and on each new world before the next request
    fault_process: int | None = None
    fault_generation: int | None = None
    corpus: Any = None
    """``() -> Corpus`` called in each process (picklable), or ``None`` for the synthetic corpus."""
    hooks: Any = None
    """The job's ``TrainerHooks`` (picklable), in the live job and the baselines alike."""
    check_layouts: bool = False
    """Check each new layout's model before the cut (``MegatronJob.check_layout``: a spawned interpreter
    per switch, so only where a test is about it)."""

    @property
    def geometry(self) -> ModelGeometry:
        """The model's geometry with the job's DDP settings (the distributed optimizer's shards)."""
        model = self.model.geometry() if isinstance(self.model, ModelSpec) else self.model.geometry
        return model.with_ddp(self.config.ddp)

    @property
    def switched(self) -> tuple[int, ...]:
        """The generations the job switches to (the faulty one is rolled back)."""
        return tuple(g for g in self.transitions if g != self.fault_generation)


class IndexedCorpus(NamedTuple):
    """Megatron's ``GPTDataset`` over one indexed dataset, recording the samples it reads."""

    prefix: str
    seq_length: int
    num_samples: int

    def __call__(self) -> Any:
        from liver.worker_runtime.megatron.datasets import MegatronCorpus

        return MegatronCorpus(
            [self.prefix], seq_length=self.seq_length, num_samples=self.num_samples, record=True
        )


def _cut(runtime: Any) -> int:
    return runtime.last_switch.iteration if runtime.last_switch is not None else 0


def make_plans(chain: Chain) -> dict[int, Plan]:
    """The planner's plans for the chain, as the transfer service would make them."""
    from liver.reshard.planner import plan_resize

    old = WorldConfig(chain.start, Placement(tuple(DEVICES[p] for p in chain.start_processes)))
    plans = {}
    for generation, t in chain.transitions.items():
        devices = [DEVICES[p] for p in t.processes]
        plans[generation] = plan_resize(chain.geometry, old, t.layout, devices, budget_bytes=BUDGET).plan
        old = plans[generation].new
    return plans


# -- state helpers (numpy, so that results cross process boundaries as plain arrays) ---------------------


def as_numpy(state: dict[int, Any]) -> dict[int, np.ndarray]:
    """Plain arrays; a bfloat16 tensor (numpy has no such type) as its bits, an int16 array."""
    import torch

    def plain(tensor: Any) -> np.ndarray:
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16)
        return tensor.numpy().copy()

    return {
        index: tuple(plain(t) for t in value) if isinstance(value, tuple) else plain(value)
        for index, value in state.items()
    }


def gather(
    states: dict[int, dict[int, np.ndarray]], layout: ParallelLayout, geometry: ModelGeometry
) -> dict[int, np.ndarray]:
    """The global tensors, assembled from every rank's local state through the view function's boxes.

    Every element must be covered, and every replica of an element (DP replicas, the tied embedding's
    copy on the last stage) must hold the same bits.
    """
    tensors = geometry.tensors()
    full: dict[int, np.ndarray] = {}
    seen: dict[int, np.ndarray] = {}
    for rank, state in sorted(states.items()):
        for index, value in state.items():
            spec = tensors[index]
            pieces = holding(spec, geometry, layout, rank)
            assert pieces is not None, f"rank {rank} holds {spec.name}, which its view does not give it"
            locals_ = value if isinstance(value, tuple) else (value,)
            assert len(locals_) == len(pieces), f"rank {rank}: {spec.name} has the wrong number of pieces"
            for shard, local in zip(pieces, locals_):
                if shard.box is None:
                    continue
                target = full.setdefault(index, np.zeros(spec.shape, dtype=local.dtype))
                covered = seen.setdefault(index, np.zeros(spec.shape, dtype=bool))
                box = tuple(slice(lo, hi) for lo, hi in shard.box)
                piece = local[tuple(slice(0, hi - lo) for lo, hi in shard.box)]
                overlap = covered[box]
                if overlap.any():
                    assert np.array_equal(target[box][overlap], piece[overlap]), (
                        f"{spec.name}: rank {rank}'s replica disagrees with another rank's"
                    )
                target[box] = piece
                covered[box] = True
    for index, spec in enumerate(tensors):
        assert index in seen and seen[index].all(), f"{spec.name} is not fully covered"
    return full


def local_slice(
    full: dict[int, np.ndarray], layout: ParallelLayout, rank: int, geometry: ModelGeometry
) -> dict[int, np.ndarray]:
    """``rank``'s local state of ``layout`` cut out of the global tensors (vocabulary padding zero)."""
    out: dict[int, Any] = {}
    for index, spec in enumerate(geometry.tensors()):
        pieces = holding(spec, geometry, layout, rank)
        if pieces is None:
            continue
        made = []
        for shard in pieces:
            local = np.zeros(shard.local_shape, dtype=full[index].dtype)
            if shard.box is not None:
                local[tuple(slice(0, hi - lo) for lo, hi in shard.box)] = full[index][
                    tuple(slice(lo, hi) for lo, hi in shard.box)
                ]
            made.append(local)
        out[index] = packed(spec, geometry, made)
    return out


def max_deviation(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(
        float(np.max(np.abs(a[i].astype(np.float64) - b[i].astype(np.float64)), initial=0.0)) for i in a
    )


def next_trainer(runtime: Any, out: dict[str, Any]) -> Any:
    """The runtime's next trainer; into ``out`` the state right after a move (``after``) and its
    iteration (``after_iteration``), the first time the trainer is on a new world."""
    from liver.worker_runtime.megatron.state import snapshot

    before = runtime.generation
    trainer = runtime.step()
    if trainer is not None and runtime.generation != before:
        out["after"], out["after_iteration"] = as_numpy(snapshot(trainer)), trainer.iteration
    return trainer


def bit_identical(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[i].dtype == b[i].dtype and a[i].tobytes() == b[i].tobytes() for i in a
    )


# -- the live job ------------------------------------------------------------------------------------------


def _quiet() -> None:
    import torch

    from liver.shared.logs import configure_logging

    configure_logging(level="WARNING")
    torch.set_num_threads(1)


def _companion(runtime: Any, address: Any, plans: dict[int, Plan], device: Device) -> None:
    """What the bus companion will do: wait for each request that concerns this device, hand it in."""
    from liver.worker_runtime.world import connect_store

    store = connect_store(address, timedelta(seconds=240))
    for generation, plan in sorted(plans.items()):
        if device not in plan.old.placement.devices and device not in plan.new.placement.devices:
            continue
        store.wait([f"go/{generation}"], timedelta(seconds=240))
        runtime.request_resize(
            generation,
            plan.new.layout,
            plan.new.placement,
            plan,
            address,
            deadline=datetime.now(UTC) + timedelta(seconds=120),
        )


def _storage_left(trainer: Any) -> int:
    """Bytes still allocated to a trainer's parameters, Adam moments and gradient buffers."""
    tensors = [p for chunk in trainer.chunks for p in chunk.parameters()]
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for state in opt.optimizer.state.values():
            tensors += [state["exp_avg"], state["exp_avg_sq"]]
    tensors += [buffer.grad_data for chunk in trainer.model_chunks for buffer in chunk.buffers]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def live_process(proc: Proc, plans: dict[int, Plan], chain: Chain) -> dict[str, Any]:
    _quiet()
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.state import snapshot
    from liver.worker_runtime.runtime import LiveRuntime, RuntimeOptions
    from liver.worker_runtime.world import StoreAddress, WorldSpec, live_generations

    device = DEVICES[proc.rank]
    address = StoreAddress("127.0.0.1", proc.store.port)
    corpus = chain.corpus() if chain.corpus is not None else None
    factory = MegatronJob(
        chain.model, chain.config, corpus=corpus, hooks=chain.hooks, check_layouts=chain.check_layouts
    )

    def cancel_stream(generation: int, layer: int, rnd: int) -> None:
        if proc.rank == chain.fault_process and generation == chain.fault_generation:
            raise RuntimeError(f"injected fault in layer {layer} round {rnd}")

    runtime = LiveRuntime(
        factory,
        job=chain.job,
        device=device,
        store=address,
        initial=WorldSpec(
            job=chain.job,
            generation=0,
            layout=chain.start,
            placement=Placement(tuple(DEVICES[p] for p in chain.start_processes)),
        ),
        options=RuntimeOptions(control_timeout_s=CONTROL_TIMEOUT_S, build_timeout_s=180, join_timeout_s=200),
        on_stream_step=cancel_stream,
    )
    threading.Thread(target=_companion, args=(runtime, address, plans, device), daemon=True).start()

    out: dict[str, Any] = {
        "trace": [],
        "step_seconds": [],
        "switches": {},
        "progress": {},
        "old_storage_left": [],
        "samples": [],  # (iteration, sample index) read as the first TP rank of the first stage
    }
    published: set[int] = set()
    last: tuple[int, dict[int, np.ndarray], bytes] | None = None  # (iteration, state, progress)
    generation = None
    trainer = runtime.step()
    while trainer is not None:
        if runtime.generation != generation and runtime.last_switch is not None:
            # a switch committed (or, in a joiner, the join)
            entry = {"after": as_numpy(snapshot(trainer))}
            if last is not None:
                entry["before"], entry["before_iteration"] = last[1], last[0]
                out["progress"][runtime.generation] = last[2]
            out["switches"][runtime.generation] = entry
        generation = runtime.generation
        iteration = trainer.iteration
        aborts = runtime.aborts
        last_generation = max(chain.transitions)
        done = runtime.generation == last_generation and iteration >= _cut(runtime) + chain.steps
        if done or (aborts and iteration >= aborts[-1].iteration + chain.steps) or iteration >= ITERATION_CAP:
            break
        if proc.rank == 0:  # the coordinator: the next request, STEPS steps after the last cut
            nxt = (runtime.generation or 0) + 1
            if nxt in chain.transitions and nxt not in published and iteration >= _cut(runtime) + chain.steps:
                published.add(nxt)
                proc.store.set(f"go/{nxt}", "1")
        if runtime.pending_generation is not None and (
            chain.check_layouts or iteration >= _cut(runtime) + chain.steps + PREPARE_STEPS
        ):
            # The check of the new layout's model starts an interpreter beside six training processes on
            # two cores, and joiners import Megatron: pause here until the preparation is done rather
            # than train on towards the iteration cap.
            runtime.wait_prepared(CONTROL_TIMEOUT_S)
        read_before = len(corpus.read) if corpus is not None else 0
        result = trainer.train_step()
        coords = trainer.layout.coords(trainer.groups.rank)
        if corpus is not None and coords.tp == 0 and coords.pp == 0:
            out["samples"] += [(result.iteration, i) for i in corpus.read[read_before:]]
        out["trace"].append((runtime.generation, result.iteration, result.loss, result.grad_norm))
        out["step_seconds"].append(result.seconds)
        trainer.sync_params()  # overlap_param_gather: what other DP ranks updated, before it is read
        last = (trainer.iteration, as_numpy(snapshot(trainer)), factory.progress(trainer))
        previous, trainer = trainer, runtime.step()
        if trainer is not previous:  # switched (or left): the old trainer's memory is already free
            out["old_storage_left"].append(_storage_left(previous))
        del previous

    out["left"] = runtime.left
    if runtime.left:
        assert last is not None and runtime.last_switch is not None
        out["switches"][runtime.last_switch.generation] = {"before": last[1], "before_iteration": last[0]}
    for report in runtime.reports:  # taken at the end: first_step_s is filled in after the switch
        out["switches"][report.generation]["report"] = msgspec.to_builtins(report)
    out["history"] = [msgspec.to_builtins(h) | {"type": type(h).__name__} for h in runtime.history]
    out["generation"] = runtime.generation
    out["live_generations"] = live_generations(chain.job)
    runtime.close()
    return out


# -- the baseline job: fresh trainers at each new layout, loaded with the gathered state -------------------


class Reload(NamedTuple):
    generation: int
    old_layout: ParallelLayout
    layout: ParallelLayout
    state: dict[int, np.ndarray]  # the global tensors at the cut
    progress: bytes
    steps: int


def _fresh_world(proc: Proc, generation: int, layout: ParallelLayout) -> Any:
    from liver.worker_runtime.world import StoreAddress, WorldSpec, build_world

    size = layout.world_size
    spec = WorldSpec(
        job="baseline", generation=generation, layout=layout, placement=Placement(DEVICES[:size])
    )
    address = StoreAddress("127.0.0.1", proc.store.port)
    world = build_world(spec, DEVICES[proc.rank], address, timeout=timedelta(seconds=120))
    world.adopt_as_default()
    return world


def _loaded(reload: Reload, layout: ParallelLayout, rank: int, geometry: ModelGeometry) -> dict[int, Any]:
    import torch

    tensors = geometry.tensors()
    out = {}

    def tensor(a: np.ndarray, dtype: str) -> Any:
        t = torch.from_numpy(a)
        return t.view(torch.bfloat16) if dtype == "bfloat16" else t

    for i, a in local_slice(reload.state, layout, rank, geometry).items():
        dtype = tensors[i].dtype
        out[i] = tuple(tensor(x, dtype) for x in a) if isinstance(a, tuple) else tensor(a, dtype)
    return out


def baseline_process(
    proc: Proc, reloads: list[Reload], checkpoints: str, chain: Chain
) -> dict[str, dict[int, list]]:
    """For each generation: (1) fresh trainers at the new layout load the gathered cut state directly;
    (2) trainers at the old layout holding that state save a ``dist_checkpointing`` checkpoint, and fresh
    trainers at the new layout load it (reshape on load). Both then train as many steps as the live job."""
    _quiet()
    from pathlib import Path

    from liver.worker_runtime.megatron.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.streams import reseed

    corpus = chain.corpus() if chain.corpus is not None else None
    factory = MegatronJob(
        chain.model, chain.config, corpus=corpus, hooks=chain.hooks, check_layouts=chain.check_layouts
    )
    geometry = chain.geometry
    traces: dict[str, dict[int, list]] = {"reload": {}, "checkpoint": {}}
    for reload in reloads:
        root = Path(checkpoints) / f"gen{reload.generation}"
        if proc.rank < reload.old_layout.world_size:
            world = _fresh_world(proc, 2 * reload.generation, reload.old_layout)
            trainer = factory.build(world)
            factory.resume(trainer, _loaded(reload, reload.old_layout, world.rank, geometry), reload.progress)
            save_checkpoint(trainer, root)
            del trainer
            world.release()
        if proc.rank >= reload.layout.world_size:
            continue
        # Every member of the new world arrives only after its save: the checkpoint is complete here.
        world = _fresh_world(proc, 2 * reload.generation + 1, reload.layout)
        trainer = factory.build(world)
        factory.resume(trainer, _loaded(reload, reload.layout, world.rank, geometry), reload.progress)
        steps = [trainer.train_step() for _ in range(reload.steps)]
        traces["reload"][reload.generation] = [(r.iteration, r.loss, r.grad_norm) for r in steps]
        del trainer
        trainer = factory.build(world)
        checkpoint = latest_checkpoint(root)
        assert checkpoint is not None
        manifest = load_checkpoint(trainer, checkpoint)
        reseed(chain.config, manifest.iteration, reload.layout, world.rank)  # the live path's rule
        steps = [trainer.train_step() for _ in range(reload.steps)]
        traces["checkpoint"][reload.generation] = [(r.iteration, r.loss, r.grad_norm) for r in steps]
        del trainer
        world.release()
    return traces


# -- running both ------------------------------------------------------------------------------------------


class Runs(NamedTuple):
    live: list[dict[str, Any]]
    baseline: dict[int, list[tuple[int, float, float]]]  # direct reload of the gathered state
    checkpoint: dict[int, list[tuple[int, float, float]]]  # save at the old layout, load at the new
    plans: dict[int, Plan]
    before: dict[int, dict[int, np.ndarray]]
    after: dict[int, dict[int, np.ndarray]]
    cuts: dict[int, int]


def _old_layout(plans: dict[int, Plan], generation: int) -> ParallelLayout:
    return plans[generation].old.layout


def run_chain(chain: Chain, checkpoints: str) -> Runs:
    """The live job through the chain, then the baseline job for each of its switches."""
    plans = make_plans(chain)
    live = [
        o.unwrap()
        for o in run_world(live_process, 6, args=(plans, chain), timeout_s=280, group_timeout_s=120)
    ]
    before, after, cuts, reloads = {}, {}, {}, []
    for generation in chain.switched:
        plan = plans[generation]
        old_rank = plan.old.placement.rank_on()
        new_rank = plan.new.placement.rank_on()
        olds = {
            old_rank[DEVICES[p]]: r["switches"][generation]["before"]
            for p, r in enumerate(live)
            if DEVICES[p] in old_rank
        }
        news = {
            new_rank[DEVICES[p]]: r["switches"][generation]["after"]
            for p, r in enumerate(live)
            if DEVICES[p] in new_rank
        }
        before[generation] = gather(olds, plan.old.layout, chain.geometry)
        after[generation] = gather(news, plan.new.layout, chain.geometry)
        cuts[generation] = live[0]["switches"][generation]["report"]["iteration"]
    end = live[0]["trace"][-1][1]
    for generation in chain.switched:
        until = cuts.get(generation + 1, end)
        plan = plans[generation]
        reloads.append(
            Reload(
                generation,
                plan.old.layout,
                plan.new.layout,
                before[generation],
                live[0]["progress"][generation],
                until - cuts[generation],
            )
        )
    outcomes = run_world(
        baseline_process, 4, args=(reloads, checkpoints, chain), timeout_s=240, group_timeout_s=90
    )
    failed = [o for o in outcomes if o.status != "ok"]
    if failed:  # every failed process's own end: the first rank's is often only a peer's disconnect
        raise AssertionError(
            "\n".join(f"baseline rank {o.rank} {o.status}:\n{o.traceback[-2500:]}" for o in failed)
        )
    baseline = outcomes[0].unwrap()
    return Runs(live, baseline["reload"], baseline["checkpoint"], plans, before, after, cuts)


def reports_of(runs: Runs, generation: int) -> dict[int, dict[str, Any]]:
    """Process index -> its switch report for ``generation`` (every process of either world)."""
    return {
        p: r["switches"][generation]["report"] for p, r in enumerate(runs.live) if generation in r["switches"]
    }


def live_trace(runs: Runs, generation: int, process: int = 0) -> list[tuple[int, float, float]]:
    return [(it, loss, norm) for gen, it, loss, norm in runs.live[process]["trace"] if gen == generation]
