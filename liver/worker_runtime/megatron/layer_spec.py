"""The decoder-layer spec LiveR builds a :class:`~liver.shared.model.ModelSpec` with: Megatron-core's
local spec (no Transformer Engine, no apex), with mixtures of experts as ``SequentialMLP``.

One gap of the local spec is bridged here: Megatron requires sequence parallelism for an MoE layer
with TP > 1 (its token dispatchers scatter tokens over TP), and the local spec's torch norm refuses a
sequence-parallel config. Torch's own ``LayerNorm``/``RMSNorm`` compute the same on a sequence shard
as on the whole sequence; what sequence parallelism needs of a norm is that Megatron all-reduces its
gradients over TP, which it does for every parameter tagged ``sequence_parallel`` (as its Transformer
Engine and apex norms are). :class:`SequenceParallelTorchNorm` is that norm.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from liver.shared.model import ModelSpec

__all__ = ["SequenceParallelTorchNorm", "gpt_layer_spec", "local_block_spec"]


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


def local_block_spec(config: TransformerConfig, pp_rank: int | None = None) -> TransformerBlockSubmodules:
    """Megatron's own decoder block spec without Transformer Engine (``get_gpt_decoder_block_spec``:
    dense and MoE layers as ``config.moe_layer_freq`` says, ``SequentialMLP`` experts) for the layers
    pipeline stage ``pp_rank`` builds, with the fixes it needs on CPU: its torch norms accept sequence
    parallelism (:class:`SequenceParallelTorchNorm`; an MoE model with TP > 1 needs it).

    For a user's own provider: ``GPTModel(config, transformer_layer_spec=local_block_spec(config,
    pg_collection.pp.rank()), ...)`` builds the model Megatron's local spec describes."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=config.normalization, pp_rank=pp_rank
    )
    for layer in {id(spec): spec for spec in block.layer_specs}.values():
        layer.submodules.input_layernorm = SequenceParallelTorchNorm
        layer.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    block.layer_norm = SequenceParallelTorchNorm
    return block


def gpt_layer_spec(
    spec: ModelSpec, config: TransformerConfig, pp_rank: int
) -> ModuleSpec | TransformerBlockSubmodules:
    """The local layer spec for ``spec``: dense, or Megatron's block of dense and MoE layers
    (:func:`local_block_spec`) for the layers pipeline stage ``pp_rank`` builds."""
    if not spec.num_experts:
        return get_gpt_layer_local_spec(normalization=spec.normalization)
    return local_block_spec(config, pp_rank)
