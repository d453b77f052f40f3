"""Build the Megatron-core GPTModel that a :class:`ModelSpec` describes, at one :class:`ParallelLayout`.

The model description and the view function are LiveR's own metadata; this module is where they meet
the real model. Every ``ModelSpec`` field maps to exactly one Megatron setting, and every build is
checked against the views: if Megatron silently built something else (a TP=1 model because
``parallel_state`` was not initialised for the layout, a different pipeline split), the local parameter
count differs from what the views promise and the build fails instead of training the wrong shards.

Process groups are explicit: a build takes a :class:`ParallelGroups` (one world's TP, PP, DP, ...
groups) and hands Megatron a ``ProcessGroupCollection`` made from it, so a second world's model can be
built in a process whose ``parallel_state`` still describes the first. :func:`groups_from_world` makes
one from a LiveR :class:`~liver.worker_runtime.world.World`; :func:`groups_from_parallel_state` is the
one place that reads ``parallel_state`` (a plain ``torchrun`` job). Two things still come from
``torch.distributed``'s *default* world, whatever groups are passed (Megatron's ``get_pg_size`` answers 1
without one, the tied-embedding sync compares ``dist.get_rank()`` with group members, the optimizer
gathers its parameter-group keys over it): the world being built must be the default one when its
model is built. :func:`build_gpt_model` checks that instead of building a TP=1 model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from liver.reshard.views import view
from liver.shared.errors import HandoffError
from liver.shared.layout import LayoutError, ParallelLayout
from liver.shared.model import ModelSpec
from liver.worker_runtime.megatron.cpu_shim import apply_cpu_shim
from liver.worker_runtime.megatron.layer_spec import gpt_layer_spec, local_mtp_block_spec

if TYPE_CHECKING:
    from liver.worker_runtime.world import World

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
        "virtual_pipeline_model_parallel_size",
        "use_cpu_initialization",
        "sequence_parallel",
        "context_parallel_size",
        "num_moe_experts",
        "moe_ffn_hidden_size",
        "moe_router_topk",
        "moe_router_enable_expert_bias",
        "moe_token_dispatcher_type",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate",
        "moe_layer_freq",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "moe_grouped_gemm",
        "multi_latent_attention",
        "mtp_num_layers",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
        "qk_layernorm",
        "rope_type",
    }
)


class MegatronBuildError(HandoffError):
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
    # A build on explicit groups may have created the memory buffer; initialisation insists on making it.
    parallel_state.destroy_global_memory_buffer()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        create_gloo_process_groups=gloo_groups,
    )


@dataclass(frozen=True)
class ParallelGroups:
    """One world's process groups as Megatron-core uses them.

    ``embd`` (first and last stage of this rank's pipeline) is ``None`` on middle stages and
    ``pos_embd`` (first stage) on every later stage, as in ``parallel_state``. ``world`` is every rank
    of the world. ``instances`` of the distributed optimizer (Megatron's partial distributed optimizer)
    shard its state over ``intra_dp_cp`` / ``intra_edp`` and reduce gradients across ``inter_dist_opt``;
    ``dist_opt_instance``, every rank of this one's instance, reduces the grad norm (with one instance:
    ``dp_cp``, ``edp``, None and ``world``). ``cp``, ``dp_cp`` and ``tp_cp`` are the context-parallel groups,
    ``ep``, ``etp``, ``edp``, ``tp_ep`` and ``tp_ep_pp`` the expert groups (Megatron's second numbering,
    :mod:`liver.shared.layout`); in a layout without CP or EP they are the dense groups that stand in
    for them (:func:`liver.worker_runtime.world.alias_of`).
    """

    layout: ParallelLayout
    rank: int
    world: dist.ProcessGroup
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    mp: dist.ProcessGroup
    tp_dp: dist.ProcessGroup
    embd: dist.ProcessGroup | None
    pos_embd: dist.ProcessGroup | None
    cp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    tp_cp: dist.ProcessGroup
    ep: dist.ProcessGroup
    etp: dist.ProcessGroup
    edp: dist.ProcessGroup
    tp_ep: dist.ProcessGroup
    tp_ep_pp: dist.ProcessGroup
    intra_dp_cp: dist.ProcessGroup
    intra_edp: dist.ProcessGroup
    dist_opt_instance: dist.ProcessGroup
    inter_dist_opt: dist.ProcessGroup | None = None

    @property
    def instances(self) -> int:
        """The distributed optimizer's instances: as many as the world holds of ``dist_opt_instance``."""
        return self.layout.world_size // self.dist_opt_instance.size()

    def __post_init__(self) -> None:
        layout = self.layout
        c = layout.coords(self.rank)
        tp, cp, dp, etp, ep = layout.tp, layout.cp, layout.dp, layout.expert_tp, layout.ep
        k = self.instances
        if k * self.dist_opt_instance.size() != layout.world_size or (cp * dp) % k or layout.edp % k:
            raise MegatronBuildError(
                f"rank {self.rank} of {layout.describe()}: its dist_opt_instance group of "
                f"{self.dist_opt_instance.size()} does not split the world into instances the layout takes"
            )
        share, block = cp * dp // k, layout.edp // k
        if (self.inter_dist_opt is None) != (k == 1):
            raise MegatronBuildError(
                f"rank {self.rank} of {layout.describe()}: {k} distributed-optimizer instances "
                f"{'need' if k > 1 else 'have no use for'} an inter-instance group"
            )
        if self.inter_dist_opt is not None and (
            self.inter_dist_opt.size() != k or self.inter_dist_opt.rank() != c.edp // block
        ):
            raise MegatronBuildError(
                f"rank {self.rank} of {layout.describe()}: its inter_dist_opt group is rank "
                f"{self.inter_dist_opt.rank()} of {self.inter_dist_opt.size()}, the layout says rank "
                f"{c.edp // block} of {k}"
            )
        for name, group, size, index in (
            ("intra_dp_cp", self.intra_dp_cp, share, (c.cp + cp * c.dp) % share),
            ("intra_edp", self.intra_edp, block, c.edp % block),
            ("tp", self.tp, tp, c.tp),
            ("pp", self.pp, layout.pp, c.pp),
            ("dp", self.dp, dp, c.dp),
            ("mp", self.mp, tp * layout.pp, c.tp + tp * c.pp),
            ("tp_dp", self.tp_dp, tp * cp * dp, c.tp + tp * (c.cp + cp * c.dp)),
            ("world", self.world, layout.world_size, self.rank),
            ("cp", self.cp, cp, c.cp),
            ("dp_cp", self.dp_cp, cp * dp, c.cp + cp * c.dp),
            ("tp_cp", self.tp_cp, tp * cp, c.tp + tp * c.cp),
            ("ep", self.ep, ep, c.ep),
            ("etp", self.etp, etp, c.etp),
            ("edp", self.edp, layout.edp, c.edp),
            ("tp_ep", self.tp_ep, etp * ep, c.etp + etp * c.ep),
            ("tp_ep_pp", self.tp_ep_pp, etp * ep * layout.pp, c.etp + etp * (c.ep + ep * c.pp)),
        ):
            if group.size() != size or group.rank() != index:
                raise MegatronBuildError(
                    f"rank {self.rank} of {layout.describe()}: its {name} group is rank {group.rank()} of "
                    f"{group.size()}, the layout says rank {index} of {size}"
                )
        in_embd = c.pp in (0, layout.pp - 1)
        if (self.embd is not None) != in_embd:
            raise MegatronBuildError(
                f"rank {self.rank} of {layout.describe()}: stage {c.pp} "
                f"{'needs' if in_embd else 'has no place in'} an embedding group"
            )
        if (self.pos_embd is not None) != (c.pp == 0):
            raise MegatronBuildError(
                f"rank {self.rank} of {layout.describe()}: only the first stage has a position-embedding "
                "group"
            )

    @property
    def pp_rank(self) -> int:
        return self.pp.rank()

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank() == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank() == self.pp.size() - 1

    def collection(self) -> ProcessGroupCollection:
        """Megatron's ``ProcessGroupCollection`` for the model, DDP, optimizer and schedules."""
        return ProcessGroupCollection(
            tp=self.tp,
            pp=self.pp,
            mp=self.mp,
            embd=self.embd,
            pos_embd=self.pos_embd,
            cp=self.cp,
            tp_cp=self.tp_cp,
            hcp=[self.cp],
            ep=self.ep,
            expt_tp=self.etp,
            tp_ep=self.tp_ep,
            tp_ep_pp=self.tp_ep_pp,
            tp_dp_cp=self.tp_dp,
            dp=self.dp,
            dp_cp=self.dp_cp,
            expt_dp=self.edp,
            intra_dp_cp=self.intra_dp_cp,
            intra_expt_dp=self.intra_edp,
            intra_dist_opt=self.dist_opt_instance,
            **({} if self.inter_dist_opt is None else {"inter_dist_opt": self.inter_dist_opt}),
        )


def groups_from_parallel_state(layout: ParallelLayout) -> ParallelGroups:
    """The groups ``parallel_state`` holds, checked against ``layout`` (the one place that reads it)."""
    _check_parallel_state(layout)
    return ParallelGroups(
        layout=layout,
        rank=dist.get_rank(),
        world=parallel_state.get_intra_distributed_optimizer_instance_group(),  # one instance: all
        tp=parallel_state.get_tensor_model_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group(),
        dp=parallel_state.get_data_parallel_group(),
        mp=parallel_state.get_model_parallel_group(),
        tp_dp=parallel_state.get_tensor_and_data_parallel_group(),
        embd=parallel_state.get_embedding_group(check_initialized=False),
        pos_embd=parallel_state.get_position_embedding_group(check_initialized=False),
        cp=parallel_state.get_context_parallel_group(),
        dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
        tp_cp=parallel_state.get_tensor_and_context_parallel_group(),
        ep=parallel_state.get_expert_model_parallel_group(),
        etp=parallel_state.get_expert_tensor_parallel_group(),
        edp=parallel_state.get_expert_data_parallel_group(),
        tp_ep=parallel_state.get_expert_tensor_and_model_parallel_group(),
        tp_ep_pp=parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
        intra_dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
        intra_edp=parallel_state.get_expert_data_parallel_group(),
        dist_opt_instance=parallel_state.get_intra_distributed_optimizer_instance_group(),
    )


def groups_from_world(world: World) -> ParallelGroups:
    """The groups of a LiveR ``World`` (see :mod:`liver.worker_runtime.world`)."""
    from liver.worker_runtime.world import GroupKind

    def optional(kind: GroupKind) -> dist.ProcessGroup | None:
        return world.group(kind) if world.member_of(kind) else None

    return ParallelGroups(
        layout=world.layout,
        rank=world.rank,
        world=world.group(GroupKind.WORLD),
        tp=world.group(GroupKind.TP),
        pp=world.group(GroupKind.PP),
        dp=world.group(GroupKind.DP),
        mp=world.group(GroupKind.MP),
        tp_dp=world.group(GroupKind.TP_DP),
        embd=optional(GroupKind.EMBD),
        pos_embd=optional(GroupKind.POS_EMBD),
        cp=world.group(GroupKind.CP),
        dp_cp=world.group(GroupKind.DP_CP),
        tp_cp=world.group(GroupKind.TP_CP),
        ep=world.group(GroupKind.EP),
        etp=world.group(GroupKind.ETP),
        edp=world.group(GroupKind.EDP),
        tp_ep=world.group(GroupKind.TP_EP),
        tp_ep_pp=world.group(GroupKind.TP_EP_PP),
        intra_dp_cp=world.group(GroupKind.INTRA_DP_CP),
        intra_edp=world.group(GroupKind.INTRA_EDP),
        dist_opt_instance=world.group(GroupKind.DIST_OPT_INSTANCE),
        inter_dist_opt=world.group(GroupKind.INTER_DIST_OPT) if world.spec.instances > 1 else None,
    )


def ensure_global_memory_buffer() -> None:
    """Megatron's attention draws scratch tensors from ``parallel_state``'s buffer even when it is
    given explicit groups; ``destroy_model_parallel`` drops the buffer, so check before each use."""
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def check_default_world(groups: ParallelGroups) -> None:
    """The default world must be the one ``groups`` belong to (see the module docstring)."""
    if not dist.is_initialized():
        raise MegatronBuildError(
            f"rank {groups.rank}: torch.distributed has no default world; Megatron would build a TP=1 "
            "model. Adopt the world as the default before building (World.adopt_as_default)"
        )
    size, rank = dist.get_world_size(), dist.get_rank()
    if (size, rank) != (groups.layout.world_size, groups.rank):
        raise MegatronBuildError(
            f"the default world is rank {rank} of {size}, but the model is built for rank {groups.rank} "
            f"of {groups.layout.describe()}; adopt that world as the default first"
        )


def pipeline_split(num_layers: int, layout: ParallelLayout, mtp_num_layers: int = 0) -> dict[str, Any]:
    """The TransformerConfig settings that give each stage ``layout.layers_per_stage`` layers.

    Megatron's ``num_layers_in_first/last_pipeline_stage`` covers splits whose middle stages are equal
    and non-empty; any other split uses its explicit ``pipeline_model_parallel_layout``, which then
    names the multi-token prediction layers too (on the last stage, where Megatron puts them). Uneven
    model chunks (virtual pipelining) always take a pipeline layout.
    """
    if layout.vpp > 1 and layout.stage_layers:
        return {"pipeline_model_parallel_layout": layout.pipeline_layout(num_layers, mtp_num_layers)}
    per_stage = layout.layers_per_stage(num_layers)
    if layout.pp == 1 or len(set(per_stage)) == 1:
        return {}
    first, *middle, last = per_stage
    if first > 0 and last > 0 and len(set(middle)) <= 1 and all(n > 0 for n in middle):
        return {"num_layers_in_first_pipeline_stage": first, "num_layers_in_last_pipeline_stage": last}
    return {"pipeline_model_parallel_layout": layout.pipeline_layout(num_layers, mtp_num_layers)}


def transformer_config(
    spec: ModelSpec, layout: ParallelLayout, overrides: Mapping[str, Any] | None = None
) -> TransformerConfig:
    """Megatron's TransformerConfig for ``spec`` at ``layout`` (plus settings the spec does not cover)."""
    overrides = dict(overrides or {})
    clash = sorted(_DERIVED_FIELDS & overrides.keys())
    if clash:
        raise ValueError(f"config_overrides: {clash[0]} is derived from the ModelSpec or the layout")
    dtype = _DTYPES[spec.params_dtype]
    moe: dict[str, Any] = {}
    if spec.num_experts:
        # Megatron's defaults for the rest (aux-loss coefficient, token dropping) unless the job
        # overrides them; with TP > 1 an MoE layer needs sequence parallelism.
        moe = {
            "num_moe_experts": spec.num_experts,
            "moe_ffn_hidden_size": spec.expert_ffn,
            "moe_router_topk": spec.moe_router_topk,
            "moe_router_enable_expert_bias": spec.moe_router_enable_expert_bias,
            "moe_token_dispatcher_type": spec.moe_token_dispatcher,
            "moe_shared_expert_intermediate_size": spec.moe_shared_expert_intermediate_size,
            "moe_shared_expert_gate": spec.moe_shared_expert_gate,
            "moe_layer_freq": (
                spec.moe_layer_freq if isinstance(spec.moe_layer_freq, int) else list(spec.moe_layer_freq)
            ),
            # Megatron's aux-loss-free balancing (the expert bias) routes with sigmoid scores only.
            **({"moe_router_score_function": "sigmoid"} if spec.moe_router_enable_expert_bias else {}),
            "expert_model_parallel_size": layout.ep,
            "expert_tensor_parallel_size": layout.expert_tp,
            "moe_grouped_gemm": False,
        }
    config_class: type[TransformerConfig] = TransformerConfig
    mla: dict[str, Any] = {}
    if spec.multi_latent_attention:
        # DeepSeek trains MLA with its latent norms (qk_layernorm) and YaRN; LiveR builds it with plain
        # rope, which changes no state (YaRN's scaling only rescales the rotary frequencies).
        config_class = MLATransformerConfig
        mla = {
            "q_lora_rank": spec.q_lora_rank,
            "kv_lora_rank": spec.kv_lora_rank,
            "qk_head_dim": spec.qk_head_dim,
            "qk_pos_emb_head_dim": spec.qk_pos_emb_head_dim,
            "v_head_dim": spec.v_head_dim,
            "qk_layernorm": True,
            "rope_type": "rope",
        }
    return config_class(
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
        context_parallel_size=layout.cp,
        sequence_parallel=bool(spec.num_experts) and layout.tp > 1,
        use_cpu_initialization=True,
        **pipeline_split(spec.num_layers, layout, spec.mtp_num_layers),
        **({"virtual_pipeline_model_parallel_size": layout.vpp} if layout.vpp > 1 else {}),
        # (a pipeline layout gives it too; Megatron checks that both agree)
        **moe,
        **mla,
        **({"mtp_num_layers": spec.mtp_num_layers} if spec.mtp_num_layers else {}),
        **overrides,
    )


def expected_local_parameter_count(spec: ModelSpec, layout: ParallelLayout, rank: int) -> int:
    """Elements of the parameters ``rank`` holds according to the views (vocabulary padding included)."""
    total = 0
    for tensor in spec.tensors(optimizer=False):
        if tensor.role == "buffer":
            continue
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
    actual += (
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )
    if actual != (layout.tp, layout.pp, layout.dp, layout.cp, layout.ep, layout.expert_tp):
        raise MegatronBuildError(
            f"parallel_state is TP{actual[0]},PP{actual[1]},DP{actual[2]},CP{actual[3]},EP{actual[4]},"
            f"ETP{actual[5]} but the layout is {layout.describe()}"
        )


def seed_build(seed: int, layout: ParallelLayout, rank: int) -> None:
    """Seed a build as Megatron's training loop does (``seed + 100 * pp_rank``; the TP ranks of a stage
    build the same master weights and keep their slice), and ready the model-parallel RNG tracker."""
    coords = layout.coords(rank)
    stage_seed = seed + 100 * coords.pp
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        stage_seed, tp_rank=coords.tp, ep_rank=coords.ep, etp_rank=coords.etp
    )


def build_gpt_model(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    groups: ParallelGroups | None = None,
    seed: int = 1234,
    config_overrides: Mapping[str, Any] | None = None,
) -> GPTModel:
    """This rank's part of ``spec`` at ``layout``: :func:`build_gpt_chunks`'s one model chunk (a layout
    with virtual pipeline parallelism has several: build them with that)."""
    if layout.vpp > 1:
        raise MegatronBuildError(
            f"{layout.describe()}: a rank holds {layout.vpp} model chunks; build them with build_gpt_chunks"
        )
    (model,) = build_gpt_chunks(spec, layout, groups=groups, seed=seed, config_overrides=config_overrides)
    return model


def build_gpt_chunks(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    groups: ParallelGroups | None = None,
    seed: int = 1234,
    config_overrides: Mapping[str, Any] | None = None,
) -> list[GPTModel]:
    """Build this rank's part of ``spec`` at ``layout`` (local layer spec, CPU initialisation): one
    ``GPTModel`` per model chunk (``layout.vpp`` with virtual pipeline parallelism, each built with its
    ``vp_stage`` on one shared ``TransformerConfig``, as Megatron-LM's ``get_model`` builds them).

    ``groups`` are the world's process groups; without them ``parallel_state`` must be initialised for
    ``layout`` (:func:`initialize_parallel_state`) and its groups are used.
    Half-precision models come back cast as Megatron's ``Float16Module`` casts them (all parameters in
    ``params_dtype``) but unwrapped, so parameter names and ``sharded_state_dict()`` keys are the views'.
    Seeds follow Megatron's training loop (``seed + 100 * pp_rank``; TP ranks of a stage build the same
    master weights and keep their slice), and the model-parallel RNG tracker is ready for dropout.
    """
    spec.check_layout(layout)
    if layout.cp > 1:
        raise MegatronBuildError(
            f"{layout.describe()}: context parallelism needs Transformer Engine's attention "
            "(megatron-core 0.16.1 has no other that takes a context-parallel group); LiveR builds the "
            "local layer spec, so CP layouts are planned but not built here"
        )
    apply_cpu_shim()
    if groups is None:
        groups = groups_from_parallel_state(layout)
    if groups.layout != layout:
        raise MegatronBuildError(
            f"the groups are for {groups.layout.describe()}, the build is for {layout.describe()}"
        )
    check_default_world(groups)
    ensure_global_memory_buffer()
    rank = groups.rank
    config = transformer_config(spec, layout, config_overrides)
    seed_build(seed, layout, rank)
    chunks = [
        _build_chunk(spec, layout, config, groups, vp_stage if layout.vpp > 1 else None)
        for vp_stage in range(layout.vpp)
    ]
    built = sum(p.numel() for chunk in chunks for p in chunk.parameters())
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
    return chunks


def _build_chunk(
    spec: ModelSpec,
    layout: ParallelLayout,
    config: TransformerConfig,
    groups: ParallelGroups,
    vp_stage: int | None,
) -> GPTModel:
    v, last_chunk = vp_stage or 0, layout.vpp - 1
    layers = gpt_layer_spec(spec, config, groups.pp_rank, vp_stage)
    mtp = local_mtp_block_spec(config, groups.pp_rank, vp_stage) if spec.mtp_num_layers else None
    model = GPTModel(
        config=config,
        transformer_layer_spec=layers,
        mtp_block_spec=mtp,
        vocab_size=spec.padded_vocab(layout.tp),
        max_sequence_length=spec.max_sequence_length,
        pre_process=groups.is_first_stage and v == 0,
        post_process=groups.is_last_stage and v == last_chunk,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type=spec.position_embedding,
        pg_collection=groups.collection(),
        vp_stage=vp_stage,
    )
    # The torch norms and the position embeddings are created in fp32 whatever params_dtype says;
    # Megatron's training loop casts the whole module when it wraps it in Float16Module. Cast here so
    # every parameter has the dtype the views give it (wrapping later in Float16Module is a no-op cast).
    if config.bf16:
        model.bfloat16()
    elif config.fp16:
        model.half()
    return model


@dataclass(frozen=True)
class SpecProvider:
    """Builds the GPT a :class:`ModelSpec` describes at a layout (``parallel_state`` initialised for it):
    the :data:`~liver.worker_runtime.megatron.geometry.Provider` of a preset. Picklable, so a spawned
    interpreter can derive its geometry."""

    spec: ModelSpec

    def __call__(
        self,
        layout: ParallelLayout,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
    ) -> GPTModel:
        """Built on ``parallel_state``'s groups (the probes'), which ``pg_collection`` holds too; with
        virtual pipelining, model chunk ``vp_stage``."""
        if vp_stage is None:
            return build_gpt_model(self.spec, layout)
        # One chunk, as a user's provider builds it (the parameter count covers all chunks: the caller
        # checks their geometry instead).
        apply_cpu_shim()
        config = transformer_config(self.spec, layout)
        return _build_chunk(self.spec, layout, config, groups_from_parallel_state(layout), vp_stage)
