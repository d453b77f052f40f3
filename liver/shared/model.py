"""GPT-family model descriptions, as Megatron-core builds them, and their logical tensors.

A :class:`ModelSpec` describes the GPT that LiveR's own trainer builds, for what-if planning (``liver
plan``, ``liver sim``, the topology planner's memory and cost models) and the demo. What the planners
consume is its :meth:`ModelSpec.geometry` (:mod:`liver.shared.geometry`): every tensor of the training
state (parameters, fp32 master weights, Adam moments, the step counter) with Megatron-core's parameter
names (local layer spec), the global shape, dtype, the pipeline position and the tensor-parallel
sharding rule, exactly what Megatron's own ``sharded_state_dict()`` of the built model gives. The view
function in :mod:`liver.reshard.views` turns a rule into each rank's box.

Logical shapes differ from Megatron's in two documented places:

* SwiGLU's fused ``linear_fc1`` (weight ``[2*ffn, hidden]``, gate rows then up rows) is described as
  ``[2, ffn, hidden]``: each TP rank holds a gate slice *and* the matching up slice, which is not one
  contiguous row range of the fused matrix but is one box of the 3-d view.
* Vocabulary tensors have the real vocabulary size as dimension 0. Megatron pads the vocabulary to a
  multiple of ``make_vocab_size_divisible_by * tp``; the padding rows carry no state, so they are not
  part of the logical tensor (the padding size changes with TP, the logical shape does not).

Decoder-layer names carry the *global* layer index (``decoder.layers.{i}.…``). Megatron's module on a
later pipeline stage numbers its own layers from 0 in ``named_parameters()``, and its checkpoint keys
stack all layers under ``decoder.layers.…`` with a leading layer axis (the local layer spec also files
``input_layernorm``/``pre_mlp_layernorm`` under ``self_attention.linear_qkv.layer_norm_*`` and
``mlp.linear_fc1.layer_norm_*`` there). Half-precision models hold every parameter in ``params_dtype``,
as after Megatron's ``Float16Module`` cast (the raw GPTModel creates norms and position embeddings in
fp32). ``tests/reshard/test_views_megatron.py`` checks all of this against ``sharded_state_dict()``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import msgspec

from liver.shared.errors import InputError
from liver.shared.geometry import (
    DTYPE_BYTES,
    EXPERT_PLACEHOLDER,
    MAX_DIM,
    MAX_EXPERTS,
    MTP_PREFIX,
    Home,
    LayerParam,
    ModelGeometry,
    ParamGeometry,
    Role,
    Rule,
    TensorSpec,
    TpDivisor,
    layer_runs,
)
from liver.shared.layout import MAX_LAYERS, ParallelLayout

__all__ = [
    "DTYPE_BYTES",
    "PRESETS",
    "Home",
    "ModelError",
    "ModelSpec",
    "Role",
    "Rule",
    "TensorSpec",
    "load_model",
]


class ModelError(InputError):
    """A model description that Megatron-core could not build."""


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A GPT model as Megatron-core's ``GPTModel`` with the local layer spec builds it."""

    name: str = "custom"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    vocab_size: int
    make_vocab_size_divisible_by: int = 128
    tied_embeddings: bool = True
    swiglu: bool = False
    bias: bool = True
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    position_embedding: Literal["learned_absolute", "rope"] = "learned_absolute"
    max_sequence_length: int = 2048
    params_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    num_experts: int = 0
    """Experts in every decoder layer's MLP (0: a dense model). Megatron's ``num_moe_experts`` with
    the local spec's ``SequentialMLP``: a router, then each expert's own ``linear_fc1``/``linear_fc2``."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's FFN size (``ffn_hidden_size`` when not given)."""
    moe_router_topk: int = 2
    moe_shared_expert_intermediate_size: int | None = None
    """An FFN every token passes through beside its routed experts (Megatron's shared experts: a
    dense, tensor-parallel MLP after the experts; no bias)."""
    moe_shared_expert_gate: bool = False
    """A learned sigmoid gate on the shared experts' output (``gate_weight``, ``[1, hidden]``)."""
    moe_token_dispatcher: Literal["allgather", "alltoall"] = "allgather"
    """Megatron's ``moe_token_dispatcher_type`` (``flex`` needs DeepEP, which is GPU-only)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing: each router keeps an fp32 ``expert_bias`` buffer that every step
    updates from the tokens each expert received (state the optimizer does not hold)."""
    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention (Megatron's ``MLASelfAttention``, with its latent norms as
    DeepSeek trains it: ``qk_layernorm``): queries through a low-rank latent (``q_lora_rank``; ``None``:
    one projection), keys and values from a shared ``kv_lora_rank`` latent plus a rotary part. No
    biases; ``kv_channels`` and ``num_query_groups`` do not apply."""
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    mtp_num_layers: int = 0
    """Multi-token prediction layers (Megatron's MTP block, DeepSeek-V3's one): each an embedding and a
    hidden-state norm, a projection of both, a decoder layer of the last layer's kind and a norm, on the
    last stage, which then keeps a replica of the word embeddings."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """Which decoder layers are MoE layers, as Megatron's ``moe_layer_freq``: every ``N``-th layer
    (layer ``i`` when ``i % N == 0``), or one 0 (dense, ``ffn_hidden_size``) or 1 (MoE) per layer;
    DeepSeek-V3's first three dense layers are ``(0, 0, 0, 1, ...)``."""

    def __post_init__(self) -> None:
        for field in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "vocab_size",
            "make_vocab_size_divisible_by",
            "max_sequence_length",
        ):
            if not 1 <= getattr(self, field) <= MAX_DIM:
                raise ModelError(f"{field} must be between 1 and {MAX_DIM}, got {getattr(self, field)}")
        for field in (
            "num_query_groups",
            "kv_channels",
            "moe_ffn_hidden_size",
            "moe_shared_expert_intermediate_size",
        ):
            value = getattr(self, field)
            if value is not None and not 1 <= value <= MAX_DIM:
                raise ModelError(f"{field} must be between 1 and {MAX_DIM}, got {value}")
        if self.num_layers > MAX_LAYERS:
            raise ModelError(f"num_layers must be at most {MAX_LAYERS}, got {self.num_layers}")
        if self.num_attention_heads % self.query_groups:
            raise ModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.query_groups})"
            )
        if not 0 <= self.num_experts <= MAX_EXPERTS:
            raise ModelError(f"num_experts must be between 0 and {MAX_EXPERTS}, got {self.num_experts}")
        if self.num_experts:
            if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size < 1:
                raise ModelError(f"moe_ffn_hidden_size must be at least 1, got {self.moe_ffn_hidden_size}")
            shared = self.moe_shared_expert_intermediate_size
            if shared is not None and shared < 1:
                raise ModelError(f"moe_shared_expert_intermediate_size must be at least 1, got {shared}")
            if shared is not None and self.bias:
                raise ModelError(
                    "moe_shared_expert_intermediate_size: Megatron's shared experts have no bias"
                )
            if self.moe_shared_expert_gate and shared is None:
                raise ModelError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size")
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ModelError(
                    f"moe_router_topk must be between 1 and num_experts ({self.num_experts}), "
                    f"got {self.moe_router_topk}"
                )
        self._check_moe_layer_freq()
        self._check_latent_attention()
        if not 0 <= self.mtp_num_layers <= MAX_LAYERS:
            raise ModelError(f"mtp_num_layers must be between 0 and {MAX_LAYERS}, got {self.mtp_num_layers}")
        if self.mtp_num_layers and self.position_embedding != "rope":
            raise ModelError(
                "mtp_num_layers: multi-token prediction is described with rope position embeddings"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ModelError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}) unless kv_channels is given"
            )

    def _check_moe_layer_freq(self) -> None:
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if not 1 <= freq <= MAX_LAYERS:
                raise ModelError(f"moe_layer_freq must be between 1 and {MAX_LAYERS}, got {freq}")
        else:
            if len(freq) != self.num_layers:
                raise ModelError(
                    f"moe_layer_freq: {len(freq)} entries for {self.num_layers} layers (one 0 or 1 per layer)"
                )
            bad = next((i for i, v in enumerate(freq) if v not in (0, 1)), None)
            if bad is not None:
                raise ModelError(f"moe_layer_freq[{bad}]: {freq[bad]} is neither 0 (dense) nor 1 (MoE)")
        if not self.num_experts and freq != 1:
            raise ModelError("moe_layer_freq: a dense model (num_experts 0) has no MoE layers to place")
        if self.num_experts and not any(self.moe_layers):
            raise ModelError("moe_layer_freq: no decoder layer is an MoE layer; use num_experts 0")

    def _check_latent_attention(self) -> None:
        sizes = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
        for field in (*sizes, "q_lora_rank"):
            value = getattr(self, field)
            if value is not None and not 1 <= value <= MAX_DIM:
                raise ModelError(f"{field} must be between 1 and {MAX_DIM}, got {value}")
        if not self.multi_latent_attention:
            if self.q_lora_rank is not None:
                raise ModelError("q_lora_rank: only multi-latent attention has a query latent")
            return
        if self.bias:
            raise ModelError(
                "multi_latent_attention: Megatron's MLA projections have no bias; set bias false"
            )
        if self.position_embedding != "rope":
            raise ModelError("multi_latent_attention: MLA applies rotary embeddings itself; use rope")
        for field in ("num_query_groups", "kv_channels"):
            if getattr(self, field) is not None:
                raise ModelError(
                    f"{field}: does not apply to multi-latent attention (every head has its own)"
                )

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each decoder layer is an MoE layer (all ``False`` for a dense model)."""
        if not self.num_experts:
            return (False,) * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return tuple(i % freq == 0 for i in range(self.num_layers))
        return tuple(bool(v) for v in freq)

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def expert_ffn(self) -> int:
        """Each expert's FFN size."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab(self, tp: int) -> int:
        """Megatron's padded vocabulary at tensor parallelism ``tp``."""
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    def check_layout(self, layout: ParallelLayout) -> None:
        """Raise :class:`LayoutError` naming the reason when Megatron could not shard this model so."""
        self.geometry().check_layout(layout)

    def geometry(self) -> ModelGeometry:
        """The shard geometry of the model this describes: what Megatron's ``sharded_state_dict()`` of
        the built model gives (:mod:`liver.worker_runtime.megatron.geometry`; a test proves it)."""
        return _geometry(self)

    def tensors(self, optimizer: bool = True) -> tuple[TensorSpec, ...]:
        """All logical tensors of the training state, grouped by streaming layer."""
        return self.geometry().tensors(optimizer)

    def parameter_count(self) -> int:
        return self.geometry().parameter_count()


def _param_list(m: ModelSpec) -> list[tuple[str, int, tuple[int, ...], Rule, Home]]:
    """(name, layer, logical shape, rule, home) for every parameter, in Megatron's module order
    (``named_parameters()``); an expert's parameters once, with ``{expert}`` in the name."""
    h, f, L = m.hidden_size, m.ffn_hidden_size, m.num_layers
    qkv_rows = (m.num_attention_heads + 2 * m.query_groups) * m.head_dim
    attn_out = m.num_attention_heads * m.head_dim
    norm_has_bias = m.normalization == "LayerNorm"
    moe_layers = m.moe_layers
    out: list[tuple[str, int, tuple[int, ...], Rule, Home]] = []
    # MTP layers on the last stage read the word embeddings too: it keeps a replica, as of a tied one.
    emb_home: Home = "first+last" if m.tied_embeddings or m.mtp_num_layers else "first"
    out.append(("embedding.word_embeddings.weight", 0, (m.vocab_size, h), "vocab", emb_home))
    if m.position_embedding == "learned_absolute":
        out.append(
            ("embedding.position_embeddings.weight", 0, (m.max_sequence_length, h), "replicated", "first")
        )

    def layer(p: str, lay: int, home: Home, moe: bool) -> None:
        """One decoder layer's parameters under ``p`` (a dense or an MoE layer)."""

        def add(name: str, shape: tuple[int, ...], rule: Rule) -> None:
            out.append((p + name, lay, shape, rule, home))

        add("input_layernorm.weight", (h,), "replicated")
        if norm_has_bias:
            add("input_layernorm.bias", (h,), "replicated")
        if m.multi_latent_attention:
            _add_latent_attention(m, add, norm_has_bias)
        else:
            # Megatron's order: Attention creates linear_proj before SelfAttention adds linear_qkv.
            add("self_attention.linear_proj.weight", (h, attn_out), "row")
            if m.bias:
                add("self_attention.linear_proj.bias", (h,), "replicated")
            add("self_attention.linear_qkv.weight", (qkv_rows, h), "column")
            if m.bias:
                add("self_attention.linear_qkv.bias", (qkv_rows,), "column")
        add("pre_mlp_layernorm.weight", (h,), "replicated")
        if norm_has_bias:
            add("pre_mlp_layernorm.bias", (h,), "replicated")
        if moe:
            add("mlp.router.weight", (m.num_experts, h), "replicated")
            if m.moe_router_enable_expert_bias:
                add("mlp.router.expert_bias", (m.num_experts,), "replicated")
            e, fe = f"mlp.experts.local_experts.{EXPERT_PLACEHOLDER}.", m.expert_ffn
            if m.swiglu:
                add(e + "linear_fc1.weight", (2, fe, h), "swiglu")
                if m.bias:
                    add(e + "linear_fc1.bias", (2, fe), "swiglu")
            else:
                add(e + "linear_fc1.weight", (fe, h), "column")
                if m.bias:
                    add(e + "linear_fc1.bias", (fe,), "column")
            add(e + "linear_fc2.weight", (h, fe), "row")
            if m.bias:
                add(e + "linear_fc2.bias", (h,), "replicated")
            fs = m.moe_shared_expert_intermediate_size
            if fs is not None:  # Megatron's SharedExpertMLP: no bias, its gate first
                if m.moe_shared_expert_gate:
                    add("mlp.shared_experts.gate_weight", (1, h), "replicated")
                add(
                    "mlp.shared_experts.linear_fc1.weight",
                    (2, fs, h) if m.swiglu else (fs, h),
                    "swiglu" if m.swiglu else "column",
                )
                add("mlp.shared_experts.linear_fc2.weight", (h, fs), "row")
            return
        if m.swiglu:
            add("mlp.linear_fc1.weight", (2, f, h), "swiglu")
            if m.bias:
                add("mlp.linear_fc1.bias", (2, f), "swiglu")
        else:
            add("mlp.linear_fc1.weight", (f, h), "column")
            if m.bias:
                add("mlp.linear_fc1.bias", (f,), "column")
        add("mlp.linear_fc2.weight", (h, f), "row")
        if m.bias:
            add("mlp.linear_fc2.bias", (h,), "replicated")

    for i in range(L):
        layer(f"decoder.layers.{i}.", i + 1, "layer", moe_layers[i])
    # With MTP layers Megatron keeps the final norm with the last decoder layer (their stage may differ).
    final: Home = "last_layer" if m.mtp_num_layers else "last"
    out.append(("decoder.final_layernorm.weight", L + 1, (h,), "replicated", final))
    if norm_has_bias:
        out.append(("decoder.final_layernorm.bias", L + 1, (h,), "replicated", final))
    for k in range(m.mtp_num_layers):  # Megatron's MTP layers: norms, projection, the last layer's kind
        mtp = f"{MTP_PREFIX}{k}."
        for norm in ("enorm", "hnorm"):
            out.append((f"{mtp}{norm}.weight", L + 1, (h,), "replicated", "last"))
            if norm_has_bias:
                out.append((f"{mtp}{norm}.bias", L + 1, (h,), "replicated", "last"))
        out.append((f"{mtp}eh_proj.weight", L + 1, (h, 2 * h), "column", "last"))
        layer(f"{mtp}transformer_layer.", L + 1, "last", moe_layers[-1])
        out.append((f"{mtp}final_layernorm.weight", L + 1, (h,), "replicated", "last"))
        if norm_has_bias:
            out.append((f"{mtp}final_layernorm.bias", L + 1, (h,), "replicated", "last"))
    if not m.tied_embeddings:
        out.append(("output_layer.weight", L + 1, (m.vocab_size, h), "vocab", "last"))
    return out


def _add_latent_attention(
    m: ModelSpec, add: Callable[[str, tuple[int, ...], Rule], None], norm_bias: bool
) -> None:
    """MLA's parameters in Megatron's module order: the output projection (the base attention makes
    it), then the query path, the shared key/value latent and its up-projection, then the latent norms.
    Every projection is column-parallel over the heads, the down-projections over their latent
    (Megatron's local spec builds them as ``ColumnParallelLinear`` and gathers the latent after)."""
    h, heads = m.hidden_size, m.num_attention_heads
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    add("self_attention.linear_proj.weight", (h, heads * m.v_head_dim), "row")
    if m.q_lora_rank is None:
        add("self_attention.linear_q_proj.weight", (heads * q_head, h), "column")
    else:
        add("self_attention.linear_q_down_proj.weight", (m.q_lora_rank, h), "column")
        add("self_attention.linear_q_up_proj.weight", (heads * q_head, m.q_lora_rank), "column")
    add("self_attention.linear_kv_down_proj.weight", (m.kv_lora_rank + m.qk_pos_emb_head_dim, h), "column")
    add(
        "self_attention.linear_kv_up_proj.weight",
        (heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank),
        "column",
    )
    norms = (("q_layernorm", m.q_lora_rank), ("kv_layernorm", m.kv_lora_rank))
    for norm, size in norms:
        if size is None:
            continue
        add(f"self_attention.{norm}.weight", (size,), "replicated")
        if norm_bias:
            add(f"self_attention.{norm}.bias", (size,), "replicated")


@functools.lru_cache(maxsize=64)
def _geometry(m: ModelSpec) -> ModelGeometry:
    head: list[ParamGeometry] = []
    tail: list[ParamGeometry] = []
    layers: list[list[LayerParam]] = [[] for _ in range(m.num_layers)]
    for name, layer, shape, rule, home in _param_list(m):
        if home == "layer":
            suffix = name.removeprefix(f"decoder.layers.{layer - 1}.")
            buffer = suffix.endswith(".router.expert_bias")  # kept in fp32 by Megatron
            layers[layer - 1].append(
                LayerParam(
                    suffix=suffix,
                    shape=shape,
                    dtype="float32" if buffer else m.params_dtype,
                    rule=rule,
                    expert=EXPERT_PLACEHOLDER in suffix,
                    buffer=buffer,
                )
            )
        else:
            buffer = name.endswith(".router.expert_bias")  # an MTP layer's router
            (head if layer == 0 else tail).append(
                ParamGeometry(
                    name=name,
                    shape=shape,
                    dtype="float32" if buffer else m.params_dtype,
                    rule=rule,
                    home=home,
                    expert=EXPERT_PLACEHOLDER in name,
                    buffer=buffer,
                )
            )
    params = [*head, *layer_runs(layers), *tail]
    return ModelGeometry(
        name=m.name,
        num_layers=m.num_layers,
        parameters=tuple(params),
        vocab_size=m.vocab_size,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        tp_divisible=(
            TpDivisor("num_attention_heads", m.num_attention_heads),
            TpDivisor("num_query_groups", m.query_groups),
            *(() if m.num_experts else (TpDivisor("ffn_hidden_size", m.ffn_hidden_size),)),
        ),
        num_experts=m.num_experts,
        mtp_num_layers=m.mtp_num_layers,
    )


PRESETS: dict[str, ModelSpec] = {
    "gpt3-175b": ModelSpec(
        name="gpt3-175b",
        num_layers=96,
        hidden_size=12288,
        ffn_hidden_size=4 * 12288,
        num_attention_heads=96,
        vocab_size=51200,
        max_sequence_length=2048,
    ),
    "llama3-8b": ModelSpec(
        name="llama3-8b",
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        vocab_size=128256,
        tied_embeddings=False,
        swiglu=True,
        bias=False,
        normalization="RMSNorm",
        position_embedding="rope",
        max_sequence_length=8192,
    ),
    "llama2-70b": ModelSpec(
        name="llama2-70b",
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        num_query_groups=8,
        vocab_size=32000,
        tied_embeddings=False,
        swiglu=True,
        bias=False,
        normalization="RMSNorm",
        position_embedding="rope",
        max_sequence_length=4096,
    ),
    # Llama 3.1 405B as Meta trained it on 16,384 GPUs (TP8, PP16, interleaved, with the embedding and
    # the loss on pipeline chunks of their own: 126 layers do not cut into 16 x 8 equal chunks).
    "llama3-405b": ModelSpec(
        name="llama3-405b",
        num_layers=126,
        hidden_size=16384,
        ffn_hidden_size=53248,
        num_attention_heads=128,
        num_query_groups=8,
        vocab_size=128256,
        tied_embeddings=False,
        swiglu=True,
        bias=False,
        normalization="RMSNorm",
        position_embedding="rope",
        max_sequence_length=8192,
    ),
    "tiny-gpt": ModelSpec(
        name="tiny-gpt",
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=256,
        num_attention_heads=4,
        vocab_size=1000,
        make_vocab_size_divisible_by=16,
        max_sequence_length=64,
        params_dtype="float32",
    ),
    "mixtral-8x7b": ModelSpec(
        name="mixtral-8x7b",
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        vocab_size=32000,
        tied_embeddings=False,
        swiglu=True,
        bias=False,
        normalization="RMSNorm",
        position_embedding="rope",
        max_sequence_length=32768,
        num_experts=8,
        moe_router_topk=2,
    ),
    "moe-200b": ModelSpec(
        # A 64-expert model of about 200B parameters (top-8 routing), sized like the MoE models of 2026.
        name="moe-200b",
        num_layers=40,
        hidden_size=5120,
        ffn_hidden_size=5120,
        num_attention_heads=40,
        num_query_groups=8,
        vocab_size=128256,
        tied_embeddings=False,
        swiglu=True,
        bias=False,
        normalization="RMSNorm",
        position_embedding="rope",
        max_sequence_length=4096,
        num_experts=64,
        moe_ffn_hidden_size=5120,
        moe_router_topk=8,
    ),
    "deepseek-v3": ModelSpec(
        # DeepSeek-V3 (671B): multi-latent attention, three dense layers then 58 MoE layers of 256 routed
        # experts (top-8, sigmoid routing, aux-loss-free balancing) beside one shared expert, and one
        # multi-token prediction layer (the 14B that make its released checkpoint 685B).
        name="deepseek-v3",
        num_layers=61,
        hidden_size=7168,
        ffn_hidden_size=18432,
        num_attention_heads=128,
        multi_latent_attention=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        vocab_size=129280,
        tied_embeddings=False,
        swiglu=True,
        bias=False,
        normalization="RMSNorm",
        position_embedding="rope",
        max_sequence_length=4096,
        num_experts=256,
        moe_ffn_hidden_size=2048,
        moe_router_topk=8,
        moe_shared_expert_intermediate_size=2048,
        moe_token_dispatcher="alltoall",
        moe_router_enable_expert_bias=True,
        moe_layer_freq=(0, 0, 0, *(1,) * 58),
        mtp_num_layers=1,
    ),
    "tiny-moe": ModelSpec(
        name="tiny-moe",
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        vocab_size=1000,
        make_vocab_size_divisible_by=16,
        bias=False,
        max_sequence_length=64,
        params_dtype="float32",
        num_experts=4,
        moe_router_topk=2,
    ),
    "tiny-deepseek": ModelSpec(
        # DeepSeek's shape at CI size: multi-latent attention, a dense first layer, then MoE layers of
        # routed experts (sigmoid routing, aux-loss-free balancing) beside a shared expert, all-to-all,
        # and a multi-token prediction layer.
        name="tiny-deepseek",
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        multi_latent_attention=True,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
        vocab_size=1000,
        make_vocab_size_divisible_by=16,
        tied_embeddings=False,
        swiglu=True,
        bias=False,
        normalization="RMSNorm",
        position_embedding="rope",
        max_sequence_length=64,
        params_dtype="float32",
        num_experts=4,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=32,
        moe_token_dispatcher="alltoall",
        moe_router_enable_expert_bias=True,
        moe_layer_freq=(0, 1, 1, 1),
        mtp_num_layers=1,
    ),
    "tiny-llama": ModelSpec(
        name="tiny-llama",
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=192,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=1000,
        make_vocab_size_divisible_by=16,
        tied_embeddings=False,
        swiglu=True,
        bias=False,
        normalization="RMSNorm",
        position_embedding="rope",
        max_sequence_length=64,
        params_dtype="float32",
    ),
}


def load_model(preset_or_path: str) -> ModelSpec:
    """A preset by name, or a JSON file holding a :class:`ModelSpec`; errors name the bad field."""
    if preset_or_path in PRESETS:
        return PRESETS[preset_or_path]
    if not preset_or_path.endswith(".json"):
        raise ModelError(
            f"unknown model preset {preset_or_path!r}; presets: {', '.join(sorted(PRESETS))}, "
            "or a path to a .json model file"
        )
    data = _read(preset_or_path)
    try:
        return msgspec.json.decode(data, type=ModelSpec, strict=True)
    except msgspec.ValidationError as exc:
        raise ModelError(f"model file {preset_or_path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ModelError(f"model file {preset_or_path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ModelError(f"model file {preset_or_path}: not valid JSON (nested too deeply)") from None


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ModelError(f"cannot read model file {path}: {exc.strerror}") from None


def as_geometry(model: ModelSpec | ModelGeometry) -> ModelGeometry:
    """The geometry the planners consume, from either a model description or a geometry."""
    return model.geometry() if isinstance(model, ModelSpec) else model


def load_model_or_geometry(preset_or_path: str) -> ModelSpec | ModelGeometry:
    """A preset, a ``.json`` ``ModelSpec``, or a ``.json`` ``ModelGeometry`` (``liver geometry`` writes
    one for a user's own model; it has ``parameters``). Errors name the file and the bad field."""
    if preset_or_path in PRESETS or not preset_or_path.endswith(".json"):
        return load_model(preset_or_path)
    try:
        fields = msgspec.json.decode(_read(preset_or_path))
    except msgspec.DecodeError as exc:
        raise ModelError(f"model file {preset_or_path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ModelError(f"model file {preset_or_path}: not valid JSON (nested too deeply)") from None
    kind: type[ModelSpec | ModelGeometry] = ModelSpec
    if isinstance(fields, dict) and "parameters" in fields:
        kind = ModelGeometry
    try:
        return msgspec.convert(fields, kind, strict=True)
    except msgspec.ValidationError as exc:
        what = "geometry" if kind is ModelGeometry else "model"
        raise ModelError(f"{what} file {preset_or_path}: {exc}") from None


class ModelRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A model another process can build, as data: a preset's ``spec``, or the importable name of a
    user's model ``provider`` (``MODULE:FUNCTION`` or ``FILE.py:FUNCTION``) with the geometry derived
    from it. What the benchmarks hand their worker processes."""

    spec: ModelSpec | None = None
    provider: str | None = None
    geometry: ModelGeometry | None = None
    max_sequence_length: int | None = None

    def __post_init__(self) -> None:
        if (self.spec is None) == (self.provider is None):
            raise ModelError("ModelRef: give either spec or provider")
        if self.provider is not None and (self.geometry is None or not self.max_sequence_length):
            raise ModelError("ModelRef: a provider needs its geometry and max_sequence_length")

    @classmethod
    def of(cls, model: ModelSpec | ModelRef) -> ModelRef:
        return model if isinstance(model, ModelRef) else cls(spec=model)

    @property
    def name(self) -> str:
        return self.spec.name if self.spec is not None else self.model_geometry().name

    @property
    def sequence_limit(self) -> int:
        if self.spec is not None:
            return self.spec.max_sequence_length
        assert self.max_sequence_length is not None
        return self.max_sequence_length

    def model_geometry(self) -> ModelGeometry:
        model = self.spec if self.spec is not None else self.geometry
        assert model is not None
        return as_geometry(model)
