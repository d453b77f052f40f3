"""Your own DeepSeek-shaped Megatron-core model, as a provider LiveR can move live.

DeepSeek-V3's shape at toy size: multi-latent attention, a dense first layer before MoE layers
(``moe_layer_freq``), routed experts with sigmoid routing and aux-loss-free balancing beside a shared
expert, the all-to-all token dispatcher, and one multi-token prediction layer. The provider is what a
Megatron-core script writes, with LiveR's ``local_block_spec`` / ``local_mtp_block_spec`` in place of
Megatron's Transformer Engine specs (they carry the fixes Megatron's local spec needs for MoE with TP,
for MLA and for MTP without Transformer Engine).

Its settings are module constants: LiveR calls the provider in spawned interpreters too (the geometry
probes, the check of each new layout), where only what the module defines exists. Try it::

    liver geometry --provider examples/your_own_moe.py:model_provider --name my-deepseek \\
        --num-layers 4 --vocab-size 1000 --make-vocab-size-divisible-by 16 --out my-deepseek.json
    liver bench reconfig --provider examples/your_own_moe.py:model_provider --num-layers 4 \\
        --vocab-size 1000 --make-vocab-size-divisible-by 16 --max-seq 64 --from 1,1,2,EP2 --to 1,2,1 --quick
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig

from liver import ParallelLayout, local_block_spec, local_mtp_block_spec, pipeline_split  # LiveR

NUM_LAYERS, VOCAB_SIZE, DIVISIBLE_BY, MAX_SEQUENCE = 4, 1000, 16, 64


def padded_vocab_size(tp: int) -> int:
    multiple = DIVISIBLE_BY * tp
    return -(-VOCAB_SIZE // multiple) * multiple


def transformer_config(layout: ParallelLayout) -> MLATransformerConfig:
    """The model's TransformerConfig at ``layout`` (its parallel sizes from the layout)."""
    return MLATransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=64,
        ffn_hidden_size=128,  # the dense layer's
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
        qk_layernorm=True,
        rope_type="rope",  # YaRN (DeepSeek's) calls CUDA in its forward; it changes no state
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        sequence_parallel=layout.tp > 1,  # Megatron's MoE layers need it with TP
        use_cpu_initialization=not torch.cuda.is_available(),
        num_moe_experts=4,
        moe_layer_freq=[0, 1, 1, 1],
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=32,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        mtp_num_layers=1,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        **pipeline_split(NUM_LAYERS, layout, mtp_num_layers=1),  # LiveR: the layout's stage sizes
    )


def model_provider(layout: ParallelLayout, pg_collection: Any, vp_stage: int | None = None) -> GPTModel:
    """This rank's part of the model at ``layout`` on the given process groups (its model chunk
    ``vp_stage`` with virtual pipeline parallelism)."""
    config = transformer_config(layout)
    stage = pg_collection.pp.rank()
    block = local_block_spec(config, stage, vp_stage)  # LiveR
    chunk = 0 if vp_stage is None else vp_stage
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        mtp_block_spec=local_mtp_block_spec(config, stage, vp_stage),  # LiveR
        vocab_size=padded_vocab_size(layout.tp),
        max_sequence_length=MAX_SEQUENCE,
        pre_process=stage == 0 and chunk == 0,
        post_process=stage == pg_collection.pp.size() - 1 and chunk == layout.vpp - 1,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
