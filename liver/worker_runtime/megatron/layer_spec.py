"""The decoder-layer spec LiveR builds a :class:`~liver.shared.model.ModelSpec` with: Megatron-core's
local spec (no Transformer Engine, no apex), with mixtures of experts as ``SequentialMLP``.

One gap of the local spec is bridged here: Megatron requires sequence parallelism for an MoE layer
with TP > 1 (its token dispatchers scatter tokens over TP), and the local spec's torch norm refuses a
sequence-parallel config. Torch's own ``LayerNorm``/``RMSNorm`` compute the same on a sequence shard
as on the whole sequence; what sequence parallelism needs of a norm is that Megatron all-reduces its
gradients over TP, which it does for every parameter tagged ``sequence_parallel`` (as its Transformer
Engine and apex norms are). :class:`SequenceParallelTorchNorm` is that norm.

Multi-latent attention (DeepSeek's MLA) needs two more without Transformer Engine: a local core
attention that takes its query/key and value head sizes (:class:`LocalMLAAttention`), and Megatron's
MLA module told that Transformer Engine is absent (it decides so from imports that succeed without it).
:func:`local_block_spec` carries all three for a user's own provider.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from liver.shared.model import ModelSpec

__all__ = [
    "LocalMLAAttention",
    "SequenceParallelTorchNorm",
    "gpt_layer_spec",
    "local_block_spec",
    "local_mtp_block_spec",
]


class SequenceParallelTorchNorm:
    """Torch's ``LayerNorm`` or ``RMSNorm`` (as the local spec's ``WrappedTorchNorm``), with its
    parameters tagged ``sequence_parallel`` when the config is (module docstring)."""

    def __new__(  # type: ignore[misc]
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm:
            raise ValueError("zero_centered_gamma and persist_layer_norm need apex or Transformer Engine")
        norm_cls: Any = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(
            config.normalization
        )
        if norm_cls is None:
            raise ValueError(f"normalization {config.normalization!r} is not LayerNorm or RMSNorm")
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


class LocalMLAAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention`` with multi-latent attention's head sizes.

    MLA builds its core attention with ``k_channels`` (the query/key head: ``qk_head_dim +
    qk_pos_emb_head_dim``) and ``v_channels`` (``v_head_dim``), which only Transformer Engine's
    attention takes; the local one refuses them. The computation is the same for any head size: the
    scores use the query/key heads as given (MLA passes its own ``softmax_scale``), and only the
    context's width, heads times the value head, differs from ``kv_channels`` times heads."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def _without_transformer_engine() -> None:
    """``multi_latent_attention`` decides that Transformer Engine is present when its Megatron
    wrappers import, which they do without it (as ``None``), and then asks ``isinstance(...,
    TELinear)`` (``isinstance() arg 2 must be a type``): told the truth when it is absent."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


def _with_local_fixes(config: TransformerConfig, layers: list[ModuleSpec]) -> None:
    """The fixes of :func:`local_block_spec`, made in place on Megatron's local layer specs."""
    if config.multi_latent_attention:
        _without_transformer_engine()
    for layer in {id(spec): spec for spec in layers}.values():
        layer.submodules.input_layernorm = SequenceParallelTorchNorm
        layer.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
        if config.multi_latent_attention:
            attention = layer.submodules.self_attention.submodules
            attention.core_attention = LocalMLAAttention
            # The latent norms run on a sequence shard too under sequence parallelism.
            for norm in ("q_layernorm", "kv_layernorm"):
                if getattr(attention, norm) is not IdentityOp:
                    setattr(attention, norm, SequenceParallelTorchNorm)


def local_block_spec(
    config: TransformerConfig, pp_rank: int | None = None, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """Megatron's own decoder block spec without Transformer Engine (``get_gpt_decoder_block_spec``:
    dense and MoE layers as ``config.moe_layer_freq`` says, ``SequentialMLP`` experts) for the layers
    pipeline stage ``pp_rank`` builds (its model chunk ``vp_stage`` with virtual pipelining), with the
    fixes it needs without Transformer Engine: its torch norms accept sequence parallelism
    (:class:`SequenceParallelTorchNorm`; an MoE model with TP > 1 needs it), and multi-latent
    attention (``config.multi_latent_attention``, an ``MLATransformerConfig``) gets a core attention
    that takes its head sizes (:class:`LocalMLAAttention`) and a correct answer to whether Transformer
    Engine is present.

    For a user's own provider: ``GPTModel(config, transformer_layer_spec=local_block_spec(config,
    pg_collection.pp.rank()), ...)`` builds the model Megatron's local spec describes."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=False,
        normalization=config.normalization,
        pp_rank=pp_rank,
        vp_stage=vp_stage,
    )
    _with_local_fixes(config, block.layer_specs)
    block.layer_norm = SequenceParallelTorchNorm
    return block


def local_mtp_block_spec(
    config: TransformerConfig, pp_rank: int | None = None, vp_stage: int | None = None
) -> Any:
    """Megatron's multi-token prediction block spec without Transformer Engine
    (``get_gpt_mtp_block_spec``) for pipeline stage ``pp_rank``, ``None`` where it builds none: each MTP
    layer a decoder layer of the model's last layer's kind (whatever layers the stage holds itself: a
    last stage may hold none), with :func:`local_block_spec`'s fixes and norms that take sequence
    parallelism. Give it to ``GPTModel(..., mtp_block_spec=...)``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

    layers = get_gpt_decoder_layer_specs(
        config, use_transformer_engine=False, normalization=config.normalization
    )
    _with_local_fixes(config, layers[-1:])
    mtp = get_gpt_mtp_block_spec(
        config, layers[-1], use_transformer_engine=False, vp_stage=vp_stage, pp_rank=pp_rank
    )
    if mtp is None:
        return None
    for layer in {id(spec): spec for spec in mtp.layer_specs}.values():
        for norm in ("enorm", "hnorm", "layer_norm"):
            setattr(layer.submodules, norm, SequenceParallelTorchNorm)
    return mtp


def gpt_layer_spec(
    spec: ModelSpec, config: TransformerConfig, pp_rank: int, vp_stage: int | None = None
) -> ModuleSpec | TransformerBlockSubmodules:
    """The local layer spec for ``spec``: a plain dense GPT's, or Megatron's block of dense and MoE
    layers, with multi-latent attention where ``spec`` has it (:func:`local_block_spec`), for the layers
    pipeline stage ``pp_rank`` builds (its model chunk ``vp_stage`` with virtual pipelining)."""
    if not spec.num_experts and not spec.multi_latent_attention and not spec.mtp_num_layers:
        return get_gpt_layer_local_spec(normalization=spec.normalization)
    return local_block_spec(config, pp_rank, vp_stage)
