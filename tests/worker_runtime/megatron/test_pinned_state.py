"""``parallel_state`` answers for the world a trainer belongs to, exactly as Megatron's own
initialisation would have set it, and only for the length of the block."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from megatron.core import parallel_state

from liver.shared.layout import ParallelLayout
from liver.worker_runtime.megatron.build import groups_from_parallel_state, initialize_parallel_state
from liver.worker_runtime.megatron.pinned_state import parallel_state_of, parallel_state_values
from liver.worker_runtime.mock_warmup import fake_world

LAYOUT = ParallelLayout(tp=2, pp=3, dp=2)

GETTERS = (
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_context_parallel_world_size",
    "get_expert_model_parallel_world_size",
    "get_expert_tensor_parallel_world_size",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_tensor_model_parallel_src_rank",
)


def _answers() -> dict[str, object]:
    return {name: getattr(parallel_state, name)() for name in GETTERS}


@pytest.fixture(autouse=True)
def _clean_parallel_state():
    # destroy_model_parallel (0.16.1) leaves _EMBEDDING_GLOBAL_RANKS behind; a middle stage initialised
    # later would then see the previous rank's list. parallel_state_of sets it for every rank.
    parallel_state._EMBEDDING_GLOBAL_RANKS = None
    yield
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("rank", [0, 5, 7, 11])
def test_the_installed_values_are_those_megatron_sets_for_the_same_world(rank: int) -> None:
    with fake_world(rank, LAYOUT.world_size):
        initialize_parallel_state(LAYOUT, gloo_groups=False)
        megatron = _answers()
        groups = groups_from_parallel_state(LAYOUT)
        values = parallel_state_values(groups)
        for name, value in values.items():
            theirs = getattr(parallel_state, name)
            if theirs is None:
                continue  # a value Megatron computes on demand (sizes and ranks): compared below
            if isinstance(theirs, dist.ProcessGroup):  # Megatron makes some groups twice (CP is 1)
                assert dist.get_process_group_ranks(value) == dist.get_process_group_ranks(theirs), name
            elif isinstance(theirs, list) and theirs and isinstance(theirs[0], dist.ProcessGroup):
                assert [dist.get_process_group_ranks(g) for g in value] == [
                    dist.get_process_group_ranks(g) for g in theirs
                ], name
            else:
                assert value is not None and list(value) == list(theirs), name
        with parallel_state_of(groups):
            assert _answers() == megatron


def test_the_block_answers_for_its_world_and_the_previous_answers_return_after_it() -> None:
    with fake_world(3, LAYOUT.world_size):
        initialize_parallel_state(LAYOUT, gloo_groups=False)
        groups = groups_from_parallel_state(LAYOUT)
        before = _answers()
        parallel_state.destroy_model_parallel()
        assert not parallel_state.model_parallel_is_initialized()
        with parallel_state_of(groups):
            assert parallel_state.model_parallel_is_initialized()
            assert parallel_state.get_tensor_model_parallel_group() is groups.tp
            assert _answers() == before
        assert not parallel_state.model_parallel_is_initialized()
        assert parallel_state._MPU_TENSOR_MODEL_PARALLEL_RANK is None


def test_the_previous_state_returns_when_the_block_raises() -> None:
    with fake_world(4, LAYOUT.world_size):
        initialize_parallel_state(LAYOUT, gloo_groups=False)
        groups = groups_from_parallel_state(LAYOUT)
        parallel_state.destroy_model_parallel()
        with pytest.raises(RuntimeError, match="rolled back"), parallel_state_of(groups):
            raise RuntimeError("rolled back")
        assert parallel_state.get_tensor_model_parallel_group(check_initialized=False) is None
