"""Build the Megatron-core GPTModel that a :class:`ModelSpec` describes, at one :class:`ParallelLayout`.

The model description and the view function are LiveR's own metadata; this module is where they meet
the real model. Every ``ModelSpec`` field maps to exactly one Megatron setting, and every build is
checked against the views: if Megatron silently built something else (a TP=1 model because
``parallel_state`` was not initialised for the layout, a different pipeline split), the local parameter
count differs from what the views promise and the build fails instead of training the wrong shards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import structlog
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from liver.shared.layout import LayoutError, ParallelLayout
from liver.shared.model import ModelSpec
from liver.shared.views import view
from liver.worker_runtime.cpu_shim import apply_cpu_shim

log = structlog.get_logger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# TransformerConfig fields that the ModelSpec and the layout decide; overriding them would make the
# built model disagree with the views.
_DERIVED_FIELDS = frozenset(
    {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "gated_linear_unit",
        "activation_func",
        "add_bias_linear",
        "add_qkv_bias",
        "normalization",
        "params_dtype",
        "pipeline_dtype",
        "bf16",
        "fp16",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "num_layers_in_first_pipeline_stage",
        "num_layers_in_last_pipeline_stage",
        "pipeline_model_parallel_layout",
        "use_cpu_initialization",
        "sequence_parallel",
    }
)


class MegatronBuildError(RuntimeError):
    """Megatron built (or would build) a model that does not match the LiveR model and layout."""


def initialize_parallel_state(layout: ParallelLayout, *, gloo_groups: bool = True) -> None:
    """(Re)initialise ``parallel_state`` on the default world for ``layout``.

    ``gloo_groups=False`` is for a mock world (the ``fake`` backend) where gloo groups cannot exist.
    """
    if not dist.is_initialized():
        raise MegatronBuildError("torch.distributed is not initialised; join a world first")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise LayoutError(
            f"layout {layout.describe()} needs {layout.world_size} ranks, the world has {world}"
        )
    apply_cpu_shim()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        create_gloo_process_groups=gloo_groups,
    )


def pipeline_split(spec: ModelSpec, layout: ParallelLayout) -> dict[str, Any]:
    """The TransformerConfig settings that give each stage ``layout.layers_per_stage`` layers.

    Megatron's ``num_layers_in_first/last_pipeline_stage`` covers splits whose middle stages are equal
    and non-empty; any other split uses its explicit ``pipeline_model_parallel_layout``.
    """
    per_stage = layout.layers_per_stage(spec.num_layers)
    if layout.pp == 1 or len(set(per_stage)) == 1:
        return {}
    first, *middle, last = per_stage
    if first > 0 and last > 0 and len(set(middle)) <= 1 and all(n > 0 for n in middle):
        return {"num_layers_in_first_pipeline_stage": first, "num_layers_in_last_pipeline_stage": last}
    stages: list[list[str]] = [["decoder"] * n for n in per_stage]
    stages[0].insert(0, "embedding")
    stages[-1].append("loss")
    return {"pipeline_model_parallel_layout": stages}


def transformer_config(
    spec: ModelSpec, layout: ParallelLayout, overrides: Mapping[str, Any] | None = None
) -> TransformerConfig:
    """Megatron's TransformerConfig for ``spec`` at ``layout`` (plus settings the spec does not cover)."""
    overrides = dict(overrides or {})
    clash = sorted(_DERIVED_FIELDS & overrides.keys())
    if clash:
        raise ValueError(f"config_overrides: {clash[0]} is derived from the ModelSpec or the layout")
    dtype = _DTYPES[spec.params_dtype]
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu,
        add_bias_linear=spec.bias,
        add_qkv_bias=False,  # add_bias_linear already gives linear_qkv its bias
        normalization=spec.normalization,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        sequence_parallel=False,
        use_cpu_initialization=True,
        **pipeline_split(spec, layout),
        **overrides,
    )


def expected_local_parameter_count(spec: ModelSpec, layout: ParallelLayout, rank: int) -> int:
    """Elements of the parameters ``rank`` holds according to the views (vocabulary padding included)."""
    total = 0
    for tensor in spec.tensors(optimizer=False):
        shard = view(tensor, spec, layout, rank)
        if shard is not None:
            total += math.prod(shard.local_shape)
    return total


def _check_parallel_state(layout: ParallelLayout) -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise MegatronBuildError("parallel_state is not initialised; call initialize_parallel_state")
    actual = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(),
    )
    if actual != (layout.tp, layout.pp, layout.dp):
        raise MegatronBuildError(
            f"parallel_state is TP{actual[0]},PP{actual[1]},DP{actual[2]} but the layout is "
            f"{layout.describe()}"
        )


def build_gpt_model(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    seed: int = 1234,
    config_overrides: Mapping[str, Any] | None = None,
) -> GPTModel:
    """Build this rank's part of ``spec`` at ``layout`` (local layer spec, CPU initialisation).

    ``parallel_state`` must already be initialised for ``layout`` (:func:`initialize_parallel_state`).
    Half-precision models come back cast as Megatron's ``Float16Module`` casts them (all parameters in
    ``params_dtype``) but unwrapped, so parameter names and ``sharded_state_dict()`` keys are the views'.
    Seeds follow Megatron's training loop (``seed + 100 * pp_rank``; TP ranks of a stage build the same
    master weights and keep their slice), and the model-parallel RNG tracker is ready for dropout.
    """
    spec.check_layout(layout)
    apply_cpu_shim()
    _check_parallel_state(layout)
    rank = dist.get_rank()
    coords = layout.coords(rank)
    if coords.tp != parallel_state.get_tensor_model_parallel_rank() or (
        coords.pp != parallel_state.get_pipeline_model_parallel_rank()
    ):
        raise MegatronBuildError(
            f"rank {rank}: parallel_state places it at tp={parallel_state.get_tensor_model_parallel_rank()}"
            f", pp={parallel_state.get_pipeline_model_parallel_rank()}; the layout says {coords}"
        )
    config = transformer_config(spec, layout, config_overrides)
    stage_seed = seed + 100 * coords.pp
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=spec.normalization),
        vocab_size=spec.padded_vocab(layout.tp),
        max_sequence_length=spec.max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type=spec.position_embedding,
    )
    # The torch norms and the position embeddings are created in fp32 whatever params_dtype says;
    # Megatron's training loop casts the whole module when it wraps it in Float16Module. Cast here so
    # every parameter has the dtype the views give it (wrapping later in Float16Module is a no-op cast).
    if config.bf16:
        model.bfloat16()
    elif config.fp16:
        model.half()
    built = sum(p.numel() for p in model.parameters())
    expected = expected_local_parameter_count(spec, layout, rank)
    if built != expected:
        raise MegatronBuildError(
            f"rank {rank}: Megatron built {built} local parameter elements for {spec.name} at "
            f"{layout.describe()}, the views say {expected}"
        )
    log.debug(
        "megatron_build.built",
        model=spec.name,
        layout=layout.describe(),
        rank=rank,
        local_parameters=built,
    )
    return model
