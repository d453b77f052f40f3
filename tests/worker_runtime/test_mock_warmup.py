"""Mock warm-up: a cold rank builds and steps its model under a fake world, then leaves no trace in c10d."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_helpers import World as Proc
from mp_helpers import run_world
from torch import nn
from torch.distributed import distributed_c10d as c10d

from liver.shared.layout import Device, ParallelLayout, Placement
from liver.worker_runtime.mock_warmup import MockWarmupError, mock_warmup
from liver.worker_runtime.world import (
    GroupKind,
    StoreAddress,
    World,
    WorldSpec,
    build_world,
    group_members,
    host_store,
)

RANK, WORLD_SIZE = 2, 4


CALLS = {"forward": 0, "backward": 0}


class _CopyToShards(torch.autograd.Function):
    """Megatron's column-parallel input: identity forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        CALLS["backward"] += 1
        return grad


class _ReduceFromShards(torch.autograd.Function):
    """Megatron's row-parallel output: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        CALLS["forward"] += 1
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ShardedMLP(nn.Module):
    """A tensor-parallel-style block: its shard width depends on the world it is built in."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32 // dist.get_world_size())
        self.down = nn.Linear(32 // dist.get_world_size(), 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromShards.apply(self.down(torch.relu(self.up(_CopyToShards.apply(x)))))


def _step(model: ShardedMLP) -> None:
    loss = model(torch.randn(8, 16, requires_grad=True)).square().mean()
    loss.backward()
    assert model.up.weight.grad is not None


@pytest.fixture
def clean_c10d() -> Iterator[None]:
    assert not dist.is_initialized(), "an earlier test left a default process group in this process"
    before = set(c10d._world.pg_map)
    yield
    assert set(c10d._world.pg_map) == before


def test_the_model_is_built_for_its_place_in_the_world_it_will_join(clean_c10d: None) -> None:
    seen: dict[str, Any] = {}

    def build() -> ShardedMLP:
        seen["rank"], seen["size"] = dist.get_rank(), dist.get_world_size()
        return ShardedMLP()

    def step(model: ShardedMLP) -> None:
        seen["shard_rows"] = model.up.weight.shape[0]
        _step(model)

    CALLS.update(forward=0, backward=0)
    report = mock_warmup(build, step, rank=RANK, world_size=WORLD_SIZE, steps=2)
    assert (seen["rank"], seen["size"], seen["shard_rows"]) == (RANK, WORLD_SIZE, 8)
    assert CALLS == {"forward": 2, "backward": 2}  # the collectives ran, with no peer anywhere
    assert len(report.step_seconds) == 2
    assert report.fake_groups >= 1


def test_teardown_leaves_no_default_world_and_restores_the_group_counter(clean_c10d: None) -> None:
    counter = c10d._world.group_count

    def build() -> ShardedMLP:
        dist.new_group([0, 1])  # what parallel_state does under the fake world
        dist.new_group([2, 3])
        return ShardedMLP()

    report = mock_warmup(build, _step, rank=RANK, world_size=WORLD_SIZE)
    assert report.fake_groups == 2  # the fake default world and the one group rank 2 is in
    assert not dist.is_initialized()
    assert c10d._world.group_count == counter


def test_a_failing_step_is_reported_and_still_tears_the_fake_world_down(clean_c10d: None) -> None:
    def broken(model: ShardedMLP) -> None:
        raise ValueError("shape mismatch")

    with pytest.raises(MockWarmupError, match="shape mismatch"):
        mock_warmup(ShardedMLP, broken, rank=RANK, world_size=WORLD_SIZE)
    assert not dist.is_initialized()


@pytest.fixture
def store() -> Iterator[StoreAddress]:
    master = host_store()
    yield StoreAddress("127.0.0.1", master.port)
    del master


def _one_rank_world(job: str, store: StoreAddress) -> World:
    device = Device("local", 0)
    spec = WorldSpec(job, 0, ParallelLayout(tp=1, pp=1, dp=1), Placement((device,)))
    return build_world(spec, device, store)


def test_warmup_is_refused_in_a_process_that_has_a_default_world(store: StoreAddress) -> None:
    world = _one_rank_world("warmrefused", store)
    world.adopt_as_default()
    try:
        with pytest.raises(MockWarmupError, match="default process group exists"):
            mock_warmup(ShardedMLP, _step, rank=RANK, world_size=WORLD_SIZE)
        assert c10d._world.default_pg is world.group(GroupKind.WORLD)
    finally:
        world.release()
    assert not dist.is_initialized()


def test_a_world_built_during_the_warmup_survives_the_teardown(store: StoreAddress, clean_c10d: None) -> None:
    built: list[World] = []

    def step(model: ShardedMLP) -> None:
        _step(model)
        built.append(_one_rank_world("warmbeside", store))  # as a background build would, meanwhile

    mock_warmup(ShardedMLP, step, rank=RANK, world_size=WORLD_SIZE)
    (world,) = built
    try:
        t = torch.ones(2)
        dist.all_reduce(t, group=world.group(GroupKind.WORLD))
        assert t.tolist() == [1.0, 1.0]
    finally:
        world.release()


# -- a tiny Megatron GPT: warm up as TP rank 1 of 2 under the fake world, then train in a real world ---


def megatron_scenario(proc: Proc) -> dict[str, Any]:
    index, address = proc.rank, _quiet_child(proc)
    from megatron.core import parallel_state

    from liver.shared.model import PRESETS
    from liver.worker_runtime.megatron.build import build_gpt_model, initialize_parallel_state

    spec = PRESETS["tiny-gpt"]
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)
    parameters: dict[str, int] = {}

    def build(layout: ParallelLayout, gloo_groups: bool) -> Any:
        initialize_parallel_state(layout, gloo_groups=gloo_groups)
        model = build_gpt_model(spec, layout)
        parameters[layout.describe()] = sum(p.numel() for p in model.parameters())
        return model

    def step(model: Any) -> float:
        loss = model(tokens, positions, mask, labels=tokens).mean()
        loss.backward()
        return float(loss.item())

    warm = ParallelLayout(tp=2, pp=1, dp=1)
    report = mock_warmup(
        lambda: build(warm, gloo_groups=False),
        step,
        rank=1,
        world_size=2,
        teardown=lambda _: parallel_state.destroy_model_parallel(),
    )
    out: dict[str, Any] = {"default_after_warmup": dist.is_initialized(), "report": report}

    # Then it joins a real (one-rank) world and trains there.
    real = ParallelLayout(tp=1, pp=1, dp=1)
    device = Device("n0", index)
    world = build_world(WorldSpec("warmjob", 0, real, Placement((device,))), device, address)
    world.adopt_as_default()
    started = time.perf_counter()
    model = build(real, gloo_groups=True)
    out["real_build_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    out["loss"] = step(model)
    out["real_step_seconds"] = time.perf_counter() - started
    out["parameters"] = parameters
    parallel_state.destroy_model_parallel()
    world.release()
    out["megatron_groups"] = _megatron_rank_groups()
    return out


GROUP_LAYOUTS = [
    ParallelLayout(2, 2, 2),
    ParallelLayout(4, 1, 2),
    ParallelLayout(1, 3, 2),
    ParallelLayout(2, 4, 1),
]


def _megatron_rank_groups() -> dict[str, dict[str, list[tuple[int, ...]]]]:
    """The groups Megatron's own rank generator makes for each layout (what ``new_group`` would get)."""
    from megatron.core.parallel_state import (
        RankGenerator,
        default_embedding_ranks,
        default_position_embedding_ranks,
    )

    out = {}
    for layout in GROUP_LAYOUTS:
        gen = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=1, order="tp-cp-ep-dp-pp")
        pipelines = gen.get_ranks("pp")
        groups = {
            "world": [list(range(layout.world_size))],
            "tp": gen.get_ranks("tp"),
            "pp": pipelines,
            "dp": gen.get_ranks("dp"),
            "mp": gen.get_ranks("tp-pp"),
            "tp_dp": gen.get_ranks("tp-dp"),
            "embd": [default_embedding_ranks(p) for p in pipelines],
            "pos_embd": [default_position_embedding_ranks(p) for p in pipelines],
        }
        out[layout.describe()] = {k: sorted(tuple(sorted(g)) for g in v) for k, v in groups.items()}
    return out


def _quiet_child(proc: Proc) -> StoreAddress:
    """In a child: log warnings only, and return the address of the store the test process hosts."""
    from liver.shared.logs import configure_logging

    configure_logging(level="WARNING")
    return StoreAddress("127.0.0.1", proc.store.port)


def _run(scenario: Any, size: int, timeout_s: float) -> list[Any]:
    return [outcome.unwrap() for outcome in run_world(scenario, size, timeout_s=timeout_s)]


@pytest.fixture(scope="module")
def megatron_run() -> dict[str, Any]:
    (run,) = _run(megatron_scenario, 1, timeout_s=240.0)
    return run


@pytest.mark.slow
def test_a_megatron_rank_warms_up_alone_then_trains_in_a_real_world(megatron_run: dict) -> None:
    report = megatron_run["report"]
    assert megatron_run["default_after_warmup"] is False
    assert report.fake_groups > 0  # parallel_state's groups, made and destroyed under the mock
    assert len(report.step_seconds) == 1
    # The warm-up built the TP=2 half of the model: about half of the TP=1 model's parameters.
    half, whole = megatron_run["parameters"]["TP2,PP1,DP1"], megatron_run["parameters"]["TP1,PP1,DP1"]
    assert whole / 2 < half < whole
    assert 0 < megatron_run["loss"] < 20


@pytest.mark.slow
@pytest.mark.parametrize("layout", GROUP_LAYOUTS, ids=lambda lay: lay.describe())
def test_world_groups_are_the_groups_megatron_builds(megatron_run: dict, layout: ParallelLayout) -> None:
    for kind, expected in megatron_run["megatron_groups"][layout.describe()].items():
        assert sorted(group_members(layout, GroupKind(kind))) == expected, kind
