"""Virtual pipeline parallelism: every rank's model chunks hold exactly what the view function gives the
rank, as Megatron-core assigns chunks (chunk ``c`` of ``pp * vpp`` on stage ``c % pp``).

One spawned interpreter builds every rank of each layout on the meta device under the fake process
group, one ``GPTModel`` per model chunk (``vp_stage``, with ``parallel_state``'s virtual pipeline size
set, as Megatron's training loop builds them), and compares the boxes of all its chunks'
``sharded_state_dict()`` with the views'. The chunks are built here as Megatron-LM's ``get_model`` builds
them, not with LiveR's builder, so that the check does not lean on what it checks.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from mp_helpers import in_fresh_interpreter

from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS, ModelSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CHILD_S = 600.0

EIGHT = msgspec.structs.replace(PRESETS["tiny-gpt"], name="tiny-gpt-8", num_layers=8)
CASES: dict[str, tuple[ModelSpec, str]] = {
    "tied GPT, PP2 VPP2": (PRESETS["tiny-gpt"], "TP1,PP2,VPP2,DP1"),
    "GQA SwiGLU, TP2 PP2 VPP2": (PRESETS["tiny-llama"], "TP2,PP2,VPP2,DP1"),
    "8 layers, PP2 VPP4": (EIGHT, "TP1,PP2,VPP4,DP1"),
    "8 layers, PP4 VPP2": (EIGHT, "TP1,PP4,VPP2,DP1"),
    "experts over EP, PP2 VPP2": (PRESETS["tiny-moe"], "TP1,PP2,VPP2,DP2,EP2"),
    "DeepSeek's shape (MLA, dense first, MTP), PP2 VPP2": (PRESETS["tiny-deepseek"], "TP1,PP2,VPP2,DP1"),
    # Megatron pipeline layouts: uneven chunks, a last chunk of the head alone
    "8 layers, uneven chunks": (EIGHT, "TP1,PP2,DP1:Etttt|t|ttt|L"),
    "DeepSeek's shape, uneven chunks": (PRESETS["tiny-deepseek"], "TP1,PP2,DP1:Et|tt|t|mL"),
}


def _chunks(spec: ModelSpec, layout: ParallelLayout, groups: Any) -> list[Any]:
    """The rank's model chunks, as Megatron's training loop builds them with virtual pipelining."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from liver.worker_runtime.megatron.build import transformer_config
    from liver.worker_runtime.megatron.layer_spec import (
        gpt_layer_spec,
        local_block_spec,
        local_mtp_block_spec,
    )

    config = transformer_config(spec, layout)  # virtual_pipeline_model_parallel_size from the layout
    pp, last = groups.pp_rank, layout.pp - 1
    blocks = bool(spec.num_experts or spec.multi_latent_attention or spec.mtp_num_layers)
    return [
        GPTModel(
            config=config,
            transformer_layer_spec=local_block_spec(config, pp, v)
            if blocks
            else gpt_layer_spec(spec, config, pp),
            mtp_block_spec=local_mtp_block_spec(config, pp, v) if spec.mtp_num_layers else None,
            vocab_size=spec.padded_vocab(layout.tp),
            max_sequence_length=spec.max_sequence_length,
            pre_process=pp == 0 and v == 0,
            post_process=pp == last and v == layout.vpp - 1,
            share_embeddings_and_output_weights=spec.tied_embeddings,
            position_embedding_type=spec.position_embedding,
            pg_collection=groups.collection(),
            vp_stage=v,
        )
        for v in range(layout.vpp)
    ]


def child_main() -> dict[str, Any]:
    import torch
    from megatron.core import parallel_state

    from liver.worker_runtime.megatron.build import groups_from_parallel_state
    from liver.worker_runtime.megatron.geometry import _fake_world, model_geometry_mismatches

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for case, (spec, text) in CASES.items():
        layout = ParallelLayout.parse(text)
        geometry = spec.geometry()
        ranks: dict[int, tuple[int, list[str]]] = {}
        for rank in range(layout.world_size):
            with _fake_world(layout, rank), torch.device("meta"):
                parallel_state.set_virtual_pipeline_model_parallel_world_size(layout.vpp)
                try:
                    groups = groups_from_parallel_state(layout)
                    chunks = _chunks(spec, layout, groups)
                    metadata = {"dp_cp_group": groups.dp_cp}
                    problems = model_geometry_mismatches(chunks, geometry, layout, rank, metadata=metadata)
                    ranks[rank] = (len(chunks), problems)
                finally:
                    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        out[case] = ranks
    return out


@pytest.fixture(scope="module")
def found() -> dict[str, Any]:
    return in_fresh_interpreter(child_main, CHILD_S)


@pytest.mark.parametrize("case", list(CASES))
def test_every_ranks_chunks_hold_what_the_views_give_the_rank(found: dict[str, Any], case: str) -> None:
    layout = ParallelLayout.parse(CASES[case][1])
    ranks = found[case]
    assert sorted(ranks) == list(range(layout.world_size))
    assert all(count == layout.vpp and problems == [] for count, problems in ranks.values()), ranks
