"""Megatron's ``parallel_state`` answering for one LiveR world, for the length of a block.

Code written for a plain Megatron job asks ``parallel_state`` for its groups: a user's
``forward_step_func`` and ``get_batch``, Megatron's own ``tensor_parallel.vocab_parallel_cross_entropy``
(the standard GPT loss), ``mpu.is_pipeline_last_stage()`` in a provider. In a LiveR process several
worlds exist across a handoff (the active one trains while the next is built; after the switch the
first one's groups are gone), so a ``parallel_state`` initialised once would describe the wrong world,
and re-initialising it on every switch would make every group twice. Instead, a world's own groups
are installed in ``parallel_state``'s module globals for the block and the previous values are put
back afterwards, also when the block raises, so a rolled-back handoff leaves it as it was.

Everything that trains, builds, saves or loads a world's trainer runs inside :func:`parallel_state_of`,
expert and context-parallel groups included (:class:`~.build.ParallelGroups`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from megatron.core import parallel_state

if TYPE_CHECKING:
    from liver.worker_runtime.megatron.build import ParallelGroups

__all__ = ["parallel_state_of", "parallel_state_values"]


def parallel_state_values(groups: ParallelGroups) -> dict[str, Any]:
    """The ``parallel_state`` globals, by name, that describe ``groups``' world to this rank."""
    from liver.worker_runtime.world import GroupKind, alias_of, memberships

    layout, rank = groups.layout, groups.rank
    c = layout.coords(rank)
    ranks = {slot.kind: list(slot.ranks) for slot in memberships(layout, rank, groups.instances)}

    def members(kind: GroupKind) -> list[int]:
        return ranks[alias_of(layout, kind, groups.instances) or kind]

    return {
        "_TENSOR_MODEL_PARALLEL_GROUP": groups.tp,
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": members(GroupKind.TP),
        "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": layout.tp,
        "_MPU_TENSOR_MODEL_PARALLEL_RANK": c.tp,
        "_PIPELINE_MODEL_PARALLEL_GROUP": groups.pp,
        "_PIPELINE_GLOBAL_RANKS": members(GroupKind.PP),
        "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": layout.pp,
        "_MPU_PIPELINE_MODEL_PARALLEL_RANK": c.pp,
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": None,
        # With virtual pipelining every caller passes its chunk (vp_stage); the size tells them to.
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": layout.vpp if layout.vpp > 1 else None,
        "_DATA_PARALLEL_GROUP": groups.dp,
        "_DATA_PARALLEL_GROUP_GLOO": None,
        "_DATA_PARALLEL_GLOBAL_RANKS": members(GroupKind.DP),
        "_MPU_DATA_PARALLEL_WORLD_SIZE": layout.dp,
        "_MPU_DATA_PARALLEL_RANK": c.dp,
        "_DATA_PARALLEL_GROUP_WITH_CP": groups.dp_cp,
        "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": None,
        "_DATA_PARALLEL_GROUP_WITH_CP_AG": None,
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": members(GroupKind.DP_CP),
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": groups.intra_dp_cp,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": None,
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": groups.dist_opt_instance,
        "_MODEL_PARALLEL_GROUP": groups.mp,
        "_MODEL_PARALLEL_GLOBAL_RANKS": members(GroupKind.MP),
        "_TENSOR_AND_DATA_PARALLEL_GROUP": groups.tp_dp if layout.cp == 1 else None,
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": groups.tp_dp,
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": groups.tp_cp,
        "_EMBEDDING_GROUP": groups.embd,
        "_EMBEDDING_GLOBAL_RANKS": ranks.get(GroupKind.EMBD),
        "_POSITION_EMBEDDING_GROUP": groups.pos_embd,
        "_POSITION_EMBEDDING_GLOBAL_RANKS": ranks.get(GroupKind.POS_EMBD),
        "_CONTEXT_PARALLEL_GROUP": groups.cp,
        "_CONTEXT_PARALLEL_GLOBAL_RANKS": members(GroupKind.CP),
        "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": [groups.cp],
        "_EXPERT_MODEL_PARALLEL_GROUP": groups.ep,
        "_EXPERT_MODEL_PARALLEL_RANKS": members(GroupKind.EP),
        "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE": layout.ep,
        "_MPU_EXPERT_MODEL_PARALLEL_RANK": c.ep,
        "_EXPERT_TENSOR_PARALLEL_GROUP": groups.etp,
        "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE": layout.expert_tp,
        "_MPU_EXPERT_TENSOR_PARALLEL_RANK": c.etp,
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": groups.tp_ep,
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": groups.tp_ep_pp,
        "_EXPERT_DATA_PARALLEL_GROUP": groups.edp,
        "_EXPERT_DATA_PARALLEL_GROUP_GLOO": None,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": groups.intra_edp,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": None,
        "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": groups.inter_dist_opt,
    }


@contextlib.contextmanager
def parallel_state_of(groups: ParallelGroups) -> Iterator[None]:
    """Within the block, ``parallel_state`` describes ``groups``' world (see the module docstring)."""
    values = parallel_state_values(groups)
    saved = {name: getattr(parallel_state, name) for name in values}
    for name, value in values.items():
        setattr(parallel_state, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(parallel_state, name, value)
