"""Megatron-core trains on CPU with gloo, and its whole training state round-trips through LiveR's local
state bit for bit.

Two processes run every scenario once (Megatron's import is the expensive part, so they share it): each
scenario builds a LiveR world for one layout (explicit process groups, adopted as the default world),
trains a tiny GPT for a few steps, snapshots the local state and the progress, trains on, and then
builds a *fresh* trainer (another seed, so nothing survives by accident; built while ``parallel_state``
describes a different layout, so any leak of it would show) that loads the snapshot and trains the same
steps. The tests below read what the processes reported.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, NamedTuple

import msgspec
import pytest
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS, ModelSpec

pytestmark = pytest.mark.slow

FIRST_STEPS = 3
CONTINUED_STEPS = 2


ALLTOALL = msgspec.structs.replace(  # with shared experts and their gate beside the routed ones
    PRESETS["tiny-moe"],
    name="tiny-moe-alltoall",
    moe_token_dispatcher="alltoall",
    moe_shared_expert_intermediate_size=64,
    moe_shared_expert_gate=True,
)


class Case(NamedTuple):
    spec: ModelSpec
    layout: ParallelLayout


CASES: dict[str, Case] = {
    # SwiGLU (fc1 folded to [2, ffn/tp, h]), GQA, RMSNorm, RoPE, untied output layer, vocab padding.
    "TP2-llama": Case(PRESETS["tiny-llama"], ParallelLayout(tp=2, pp=1, dp=1)),
    # 1F1B over two stages; the last stage holds the tied word embeddings' replica; learned positions.
    "PP2-gpt": Case(PRESETS["tiny-gpt"], ParallelLayout(tp=1, pp=2, dp=1)),
    # Megatron DDP: gradients all-reduced over DP, each replica reads half of every global batch; with
    # dropout, so the resumed run matches only if the RNG streams moved with the progress.
    "DP2-gpt-dropout": Case(PRESETS["tiny-gpt"], ParallelLayout(tp=1, pp=1, dp=2)),
    # Experts over EP with the all-to-all token dispatcher (its CUDA streams and its split sizes, a CPU
    # tensor, on gloo), and at TP2 with sequence parallelism, where it gathers uneven token counts.
    "EP2-moe-alltoall": Case(ALLTOALL, ParallelLayout(tp=1, pp=1, dp=2, ep=2)),
    "TP2-moe-alltoall": Case(ALLTOALL, ParallelLayout(tp=2, pp=1, dp=1)),
    # The interleaved 1F1B schedule: each stage holds two model chunks (layers 0 and 2 on the first,
    # 1 and 3 on the last), the tied embeddings' replica on the last stage's last chunk.
    "PP2-VPP2-gpt": Case(PRESETS["tiny-gpt"], ParallelLayout(tp=1, pp=2, dp=1, vpp=2)),
}
DROPOUT = {"DP2-gpt-dropout": 0.1}
# parallel_state is initialised for this (another) layout of two ranks while the fresh trainer is
# built and trained on explicit groups.
DECOY: dict[str, ParallelLayout] = {
    "TP2-llama": ParallelLayout(tp=1, pp=1, dp=2),
    "PP2-gpt": ParallelLayout(tp=2, pp=1, dp=1),
    "DP2-gpt-dropout": ParallelLayout(tp=1, pp=2, dp=1),
    "EP2-moe-alltoall": ParallelLayout(tp=2, pp=1, dp=1),
    "TP2-moe-alltoall": ParallelLayout(tp=1, pp=1, dp=2, ep=2),
    "PP2-VPP2-gpt": ParallelLayout(tp=2, pp=1, dp=1),
}


def _trace(results: list[Any]) -> list[tuple[float, float, float]]:
    return [(r.loss, r.grad_norm, r.lr) for r in results]


def _padding_magnitude(trainer: Any) -> float:
    """The largest absolute value in the vocabulary padding rows of the parameters and Adam moments."""
    from liver.reshard.views import view
    from liver.worker_runtime.megatron.state import local_state

    spec, layout, rank = trainer.geometry, trainer.layout, trainer.groups.rank
    largest = 0.0
    for index, tensor in local_state(trainer).items():
        shard = view(spec.tensors()[index], spec, layout, rank)
        if spec.tensors()[index].rule != "vocab":
            continue
        held = 0 if shard.box is None else shard.box[0][1] - shard.box[0][0]
        if held < tensor.shape[0]:
            largest = max(largest, float(tensor[held:].abs().max()))
    return largest


def _views_share_storage(trainer: Any) -> bool:
    from liver.worker_runtime.megatron.state import local_state, named_parameters

    index_of = {t.name: i for i, t in enumerate(trainer.geometry.tensors())}
    live = local_state(trainer)
    return all(live[index_of[name]].data_ptr() == p.data_ptr() for name, _, p in named_parameters(trainer))


def _scenario(proc: Proc, generation: int, case: str) -> dict[str, Any]:
    import torch
    from megatron.core import parallel_state

    from liver.shared.layout import Device, Placement
    from liver.worker_runtime.megatron.build import (
        MegatronBuildError,
        expected_local_parameter_count,
        groups_from_world,
        initialize_parallel_state,
    )
    from liver.worker_runtime.megatron.state import (
        load_local_state,
        local_state,
        restore_progress,
        snapshot,
        training_progress,
    )
    from liver.worker_runtime.megatron.train import build_trainer
    from liver.worker_runtime.megatron.train_config import TrainConfig
    from liver.worker_runtime.world import StoreAddress, WorldSpec, build_world

    spec, layout = CASES[case]
    devices = tuple(Device("node0", i) for i in range(layout.world_size))
    world = build_world(
        WorldSpec(job="megatron-train", generation=generation, layout=layout, placement=Placement(devices)),
        devices[proc.rank],
        StoreAddress("127.0.0.1", proc.store.port),
        timeout=timedelta(seconds=120),  # must succeed; a busy machine may keep a rank off the CPU a while
    )
    out: dict[str, Any] = {}
    try:
        groups = groups_from_world(world)
        try:  # this process has no default world yet: Megatron would build a TP=1 model
            build_trainer(spec, layout, TrainConfig(), groups=groups)
        except MegatronBuildError as exc:
            out["refusal_without_default_world"] = str(exc)
        world.adopt_as_default()
        dropout = DROPOUT.get(case, 0.0)
        config = TrainConfig(
            global_batch_size=4,
            micro_batch_size=1,
            seq_length=16,
            hidden_dropout=dropout,
            attention_dropout=dropout,
        )
        trainer = build_trainer(spec, layout, config, groups=groups)
        out["parameters"] = sum(p.numel() for chunk in trainer.chunks for p in chunk.parameters())
        out["chunks"] = len(trainer.chunks)
        out["expected_parameters"] = expected_local_parameter_count(spec, layout, groups.rank)
        out["views_share_storage"] = _views_share_storage(trainer)
        out["first"] = _trace([trainer.train_step() for _ in range(FIRST_STEPS)])
        state, progress = snapshot(trainer), training_progress(trainer)
        out["continued"] = _trace([trainer.train_step() for _ in range(CONTINUED_STEPS)])
        out["padding_magnitude"] = _padding_magnitude(trainer)

        initialize_parallel_state(DECOY[case])
        reseeded = msgspec.structs.replace(config, seed=config.seed + 1)
        fresh = build_trainer(spec, layout, reseeded, groups=groups)
        out["fresh_tensors_differing"] = sum(
            not torch.equal(t, state[i]) for i, t in local_state(fresh).items()
        )
        load_local_state(fresh, state)
        restore_progress(fresh, progress)
        out["resumed"] = _trace([fresh.train_step() for _ in range(CONTINUED_STEPS)])
        out["resumed_position"] = (fresh.iteration, fresh.consumed_samples)
        if dropout:  # the control: the same load without the RNG streams
            blind = build_trainer(spec, layout, reseeded, groups=groups)
            load_local_state(blind, state)
            restore_progress(blind, msgspec.structs.replace(progress, rng=None))
            out["resumed_without_rng"] = _trace([blind.train_step() for _ in range(CONTINUED_STEPS)])
        parallel_state.destroy_model_parallel()
        if layout.dp > 1:
            dist_config = msgspec.structs.replace(config, use_distributed_optimizer=True)
            sharded = build_trainer(spec, layout, dist_config, groups=groups)
            out["distributed_optimizer_loss"] = sharded.train_step().loss
            sharded.train_step()
            state, progress = snapshot(sharded), training_progress(sharded)
            out["distributed_pieces"] = sorted(len(v) for v in state.values() if isinstance(v, tuple))
            out["distributed_continued"] = _trace([sharded.train_step() for _ in range(CONTINUED_STEPS)])
            reseeded = msgspec.structs.replace(dist_config, seed=config.seed + 1)
            fresh = build_trainer(spec, layout, reseeded, groups=groups)
            load_local_state(fresh, state)
            restore_progress(fresh, progress)
            out["distributed_resumed"] = _trace([fresh.train_step() for _ in range(CONTINUED_STEPS)])
        return out
    finally:
        world.release()


def _all_scenarios(proc: Proc) -> dict[str, Any]:
    import torch

    from liver.shared.logs import configure_logging

    configure_logging(level="WARNING")
    torch.set_num_threads(1)
    return {case: _scenario(proc, g, case) for g, case in enumerate(CASES)}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[int, Any]]:
    outcomes = run_world(_all_scenarios, 2, timeout_s=240, group_timeout_s=120)
    by_rank = [o.unwrap() for o in outcomes]
    return {case: {rank: found[case] for rank, found in enumerate(by_rank)} for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_builds_exactly_the_parameters_the_views_give_it(reports: Any, case: str) -> None:
    for rank, found in reports[case].items():
        assert found["parameters"] == found["expected_parameters"] > 0, f"rank {rank}"


@pytest.mark.parametrize("case", list(CASES))
def test_every_local_parameter_tensor_is_a_view_of_the_live_parameter(reports: Any, case: str) -> None:
    assert all(found["views_share_storage"] for found in reports[case].values())


@pytest.mark.parametrize("case", list(CASES))
def test_losses_are_finite_and_decrease(reports: Any, case: str) -> None:
    found = reports[case][0]
    losses = [loss for loss, _, _ in found["first"] + found["continued"]]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_reports_the_same_loss_and_grad_norm(reports: Any, case: str) -> None:
    traces = [found["first"] + found["continued"] for found in reports[case].values()]
    assert all(trace == traces[0] for trace in traces)


@pytest.mark.parametrize("case", list(CASES))
def test_a_fresh_trainer_loaded_with_the_local_state_continues_bit_identically(
    reports: Any, case: str
) -> None:
    for rank, found in reports[case].items():
        assert found["resumed"] == found["continued"], f"rank {rank}"


@pytest.mark.parametrize("case", list(CASES))
def test_the_fresh_trainer_starts_from_other_weights_so_the_load_is_what_restores_them(
    reports: Any, case: str
) -> None:
    for found in reports[case].values():
        assert found["fresh_tensors_differing"] > 0


@pytest.mark.parametrize("case", list(CASES))
def test_progress_restores_the_iteration_and_the_data_position(reports: Any, case: str) -> None:
    steps = FIRST_STEPS + CONTINUED_STEPS
    for found in reports[case].values():
        assert found["resumed_position"] == (steps, steps * 4)


@pytest.mark.parametrize("case", list(CASES))
def test_vocabulary_padding_rows_stay_exactly_zero_through_training(reports: Any, case: str) -> None:
    for found in reports[case].values():
        assert found["padding_magnitude"] == 0.0


def test_building_without_a_default_world_is_refused_instead_of_building_tp1(reports: Any) -> None:
    for found in reports["TP2-llama"].values():
        assert "no default world" in found["refusal_without_default_world"]


def test_the_distributed_optimizer_trains_like_the_plain_one(reports: Any) -> None:
    for found in reports["DP2-gpt-dropout"].values():
        assert found["distributed_optimizer_loss"] == found["first"][0][0]


def test_the_distributed_optimizers_owned_pieces_round_trip_bit_identically(reports: Any) -> None:
    for found in reports["DP2-gpt-dropout"].values():
        assert found["distributed_pieces"]  # its moments are pieces of the range the rank owns
        assert found["distributed_resumed"] == found["distributed_continued"]


def test_with_dropout_the_rng_streams_are_what_makes_the_resumed_run_identical(reports: Any) -> None:
    for found in reports["DP2-gpt-dropout"].values():
        assert found["resumed"] == found["continued"]
        assert [loss for loss, _, _ in found["resumed_without_rng"]] != [
            loss for loss, _, _ in found["continued"]
        ]


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"optimizer": "sgd"}, "hooks.optimizer_config.optimizer"),
    ],
)
def test_a_users_optimizer_liver_cannot_move_is_refused_naming_the_field(settings: dict, field: str) -> None:
    from megatron.core.optimizer import OptimizerConfig

    from liver.worker_runtime.megatron.train import TrainerHooks

    with pytest.raises(ValueError, match=field):
        TrainerHooks(optimizer_config=OptimizerConfig(lr=1e-3, **settings))
