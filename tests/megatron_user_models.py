"""Megatron-core models that no ``ModelSpec`` describes, built the way a user builds theirs.

Each is a model provider in Megatron's sense (``parallel_state`` initialised for the layout, the user's
own ``TransformerConfig`` and layer spec) and picklable, so that spawned test processes can build it.
They differ from LiveR's presets where a real model would:

* ``qk-layernorm``: RMSNorm on queries and keys (OLMo 2, Gemma-style attention), SwiGLU, untied;
* ``qkv-bias``: biases on the QKV projection only (Qwen-style), GeLU, tied embeddings;
* ``value-head``: a GPT with an extra tensor-parallel head on the last stage (a reward or value model);
* ``heterogeneous``: layers that differ, as Nemotron-NAS builds them (Megatron's
  ``HeterogeneousTransformerConfig`` and heterogeneous layer spec): one layer without attention, the
  others with their own number of query groups (2, 4, 2), so TP must divide their common divisor.

Three more for the edges: ``tp1-only`` (its provider refuses any TP above 1), ``broken`` (a provider
that raises) and ``dp-differs`` (it drops a bias at DP 2, which no probe builds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from liver.shared.layout import ParallelLayout

NUM_LAYERS = 4
VOCAB_SIZE = 1000
DIVISIBLE_BY = 16
KINDS = ("qk-layernorm", "qkv-bias", "value-head", "heterogeneous")
HETEROGENEOUS_BLOCKS = {
    "block_configs": [
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"n_heads_in_group": None, "no_op": True}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"n_heads_in_group": 1}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
    ]
}


def padded_vocab(tp: int) -> int:
    multiple = DIVISIBLE_BY * tp
    return -(-VOCAB_SIZE // multiple) * multiple


@dataclass(frozen=True)
class UserModel:
    kind: str
    params_dtype: str = "float32"
    cpu_initialization: bool = True
    """False: Megatron initialises weights as on a GPU, through the model-parallel RNG tracker."""

    def config(self, layout: ParallelLayout) -> Any:
        from megatron.core.transformer.transformer_config import TransformerConfig

        from liver.worker_runtime.megatron.build import pipeline_split

        dtype = getattr(torch, self.params_dtype)
        common: dict[str, Any] = dict(
            num_layers=NUM_LAYERS,
            hidden_size=64,
            num_attention_heads=4,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            use_cpu_initialization=self.cpu_initialization,
            **pipeline_split(NUM_LAYERS, layout),
        )
        if self.kind == "qk-layernorm":
            return TransformerConfig(
                **common,
                ffn_hidden_size=128,
                num_query_groups=2,
                normalization="RMSNorm",
                qk_layernorm=True,
                gated_linear_unit=True,
                activation_func=F.silu,
                add_bias_linear=False,
            )
        if self.kind == "qkv-bias":
            return TransformerConfig(**common, ffn_hidden_size=256, add_bias_linear=False, add_qkv_bias=True)
        if self.kind == "value-head":
            return TransformerConfig(**common, ffn_hidden_size=256)
        if self.kind == "heterogeneous":
            import json

            from megatron.core.transformer.heterogeneous.heterogeneous_config import (
                HeterogeneousTransformerConfig,
            )

            return HeterogeneousTransformerConfig(
                **common,
                ffn_hidden_size=256,
                normalization="RMSNorm",
                gated_linear_unit=True,
                activation_func=F.silu,
                add_bias_linear=False,
                heterogeneous_layers_config_encoded_json=json.dumps(HETEROGENEOUS_BLOCKS),
            )
        if self.kind == "tp1-only":  # as a model Megatron refuses to split (its check, not ours)
            if layout.tp > 1:
                raise ValueError(f"this model cannot be split over tp={layout.tp}")
            return TransformerConfig(**common, ffn_hidden_size=256)
        if self.kind == "broken":
            raise RuntimeError("the provider's own bug")
        if self.kind == "dp-differs":  # a provider with a bug no probe sees (they all have DP 1)
            return TransformerConfig(
                **common, ffn_hidden_size=256, add_bias_linear=False, add_qkv_bias=layout.dp == 1
            )
        raise ValueError(f"unknown kind {self.kind!r}")

    def __call__(self, layout: ParallelLayout, pg_collection: Any) -> Any:
        """A model provider as LiveR calls one: the layout and the world's process groups."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel

        from liver.worker_runtime.megatron.cpu_shim import apply_cpu_shim

        apply_cpu_shim()
        config = self.config(layout)
        if self.kind == "heterogeneous":
            from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import (
                get_gpt_heterogeneous_layer_spec,
            )

            spec = get_gpt_heterogeneous_layer_spec(config, use_te=False)
        else:
            spec = get_gpt_layer_local_spec(
                qk_layernorm=self.kind == "qk-layernorm", normalization=config.normalization
            )
        cls = _value_head_gpt() if self.kind == "value-head" else GPTModel
        model = cls(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab(layout.tp),
            max_sequence_length=32,
            pre_process=pg_collection.pp.rank() == 0,
            post_process=pg_collection.pp.rank() == pg_collection.pp.size() - 1,
            share_embeddings_and_output_weights=self.kind not in ("qk-layernorm", "heterogeneous"),
            position_embedding_type="rope"
            if self.kind in ("qk-layernorm", "heterogeneous")
            else "learned_absolute",
            pg_collection=pg_collection,
        )
        if config.bf16:
            model.bfloat16()
        return model


def _value_head_gpt() -> type:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class _ValueHeadGPT(GPTModel):
        """A GPT with one more column-parallel projection on its last stage (8 outputs per token)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.post_process:
                self.value_head = ColumnParallelLinear(
                    self.config.hidden_size,
                    8,
                    config=self.config,
                    init_method=self.config.init_method,
                    bias=True,
                    gather_output=False,
                    tp_group=self.pg_collection.tp,
                )

    return _ValueHeadGPT


def user_forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
    """A forward step as a plain Megatron script writes it: the stage and the TP group come from
    ``parallel_state`` (Megatron's ``vocab_parallel_cross_entropy`` reads it), not from LiveR."""
    from functools import partial

    from megatron.core import parallel_state, tensor_parallel

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None)
    if not parallel_state.is_pipeline_last_stage():
        return output, partial(user_loss_func, batch["loss_mask"])
    losses = tensor_parallel.vocab_parallel_cross_entropy(output.float(), batch["labels"])
    return losses, partial(user_loss_func, batch["loss_mask"])


def user_loss_func(loss_mask: Any, losses: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Megatron's three-value loss contract, reported under the user's own key."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


@dataclass(frozen=True)
class MixedMoE:
    """A user's MoE model whose decoder layers differ, built as Megatron's own block spec builds one
    (``moe_layer_freq``: a list of 0/1 per layer, or every ``N``-th layer), through LiveR's
    ``local_block_spec`` (Megatron's local spec with norms that take sequence parallelism), optionally
    with multi-latent attention (``q_lora_rank``: its query latent, 0 for none) and multi-token
    prediction layers."""

    moe_layer_freq: int | tuple[int, ...]
    num_layers: int = NUM_LAYERS
    num_experts: int = 4
    swiglu: bool = False
    shared_expert: int | None = None
    latent_attention: bool = False
    q_lora_rank: int = 32
    mtp_num_layers: int = 0

    def config(self, layout: ParallelLayout) -> Any:
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

        from liver.worker_runtime.megatron.build import pipeline_split

        freq = self.moe_layer_freq
        attention: dict[str, Any] = {"num_query_groups": 2}
        config_class = TransformerConfig
        if self.latent_attention:
            config_class = MLATransformerConfig
            attention = {
                "q_lora_rank": self.q_lora_rank or None,
                "kv_lora_rank": 16,
                "qk_head_dim": 16,
                "qk_pos_emb_head_dim": 8,
                "v_head_dim": 16,
                "qk_layernorm": True,
                "rope_type": "rope",
            }
        if self.mtp_num_layers:
            attention["mtp_num_layers"] = self.mtp_num_layers
        return config_class(
            num_layers=self.num_layers,
            hidden_size=64,
            ffn_hidden_size=128,
            num_attention_heads=4,
            **attention,
            normalization="RMSNorm",
            gated_linear_unit=self.swiglu,
            activation_func=F.silu if self.swiglu else F.gelu,
            add_bias_linear=False,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            sequence_parallel=layout.tp > 1,
            use_cpu_initialization=True,
            num_moe_experts=self.num_experts,
            moe_ffn_hidden_size=32,
            moe_router_topk=2,
            moe_shared_expert_intermediate_size=self.shared_expert,
            moe_layer_freq=freq if isinstance(freq, int) else list(freq),
            moe_grouped_gemm=False,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.expert_tp,
            **pipeline_split(self.num_layers, layout, self.mtp_num_layers),
        )

    def __call__(self, layout: ParallelLayout, pg_collection: Any) -> Any:
        from megatron.core.models.gpt.gpt_model import GPTModel

        from liver.worker_runtime.megatron.cpu_shim import apply_cpu_shim
        from liver.worker_runtime.megatron.layer_spec import local_block_spec, local_mtp_block_spec

        apply_cpu_shim()
        config = self.config(layout)
        stage = pg_collection.pp.rank()
        block = local_block_spec(config, stage)
        return GPTModel(
            config=config,
            transformer_layer_spec=block,
            mtp_block_spec=local_mtp_block_spec(config, stage) if self.mtp_num_layers else None,
            vocab_size=padded_vocab(layout.tp),
            max_sequence_length=32,
            pre_process=pg_collection.pp.rank() == 0,
            post_process=pg_collection.pp.rank() == pg_collection.pp.size() - 1,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            pg_collection=pg_collection,
        )
