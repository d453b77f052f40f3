"""GPT-family model descriptions, as Megatron-core builds them, and their logical tensors.

A :class:`ModelSpec` is enough to list every tensor of the training state (parameters, fp32 master
weights, Adam moments, the step counter) with Megatron-core's parameter names (local layer spec), the
global shape, dtype, the pipeline position and the tensor-parallel sharding rule. The view function in
:mod:`liver.shared.views` turns a rule into each rank's box.

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
fp32). ``tests/test_views_megatron.py`` checks all of this against ``sharded_state_dict()``.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import msgspec

from liver.shared.errors import InputError
from liver.shared.layout import LayoutError, ParallelLayout

Rule = Literal["replicated", "column", "row", "swiglu", "vocab"]
Home = Literal["layer", "first", "last", "first+last", "all"]
Role = Literal["param", "fp32_param", "exp_avg", "exp_avg_sq", "step"]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}


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
            if getattr(self, field) < 1:
                raise ModelError(f"{field} must be at least 1, got {getattr(self, field)}")
        if self.num_attention_heads % self.query_groups:
            raise ModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.query_groups})"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ModelError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}) unless kv_channels is given"
            )

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab(self, tp: int) -> int:
        """Megatron's padded vocabulary at tensor parallelism ``tp``."""
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    def check_layout(self, layout: ParallelLayout) -> None:
        """Raise :class:`LayoutError` naming the reason when Megatron could not shard this model so."""
        tp = layout.tp
        for what, value in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.query_groups),
            ("ffn_hidden_size", self.ffn_hidden_size),
        ):
            if value % tp:
                raise LayoutError(f"{layout.describe()}: {what} ({value}) is not divisible by tp={tp}")
        if layout.pp > self.num_layers:
            raise LayoutError(f"{layout.describe()}: pp={layout.pp} exceeds the {self.num_layers} layers")
        layout.layers_per_stage(self.num_layers)

    def tensors(self, optimizer: bool = True) -> tuple[TensorSpec, ...]:
        """All logical tensors of the training state, grouped by streaming layer."""
        return _tensors(self, optimizer)

    def parameter_count(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors(optimizer=False) if t.role == "param")


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One logical tensor of the training state.

    ``layer`` is the streaming unit: 0 holds the embeddings and the step counter, ``1..L`` the decoder
    layers (Megatron's ``decoder.layers.{layer-1}``), ``L+1`` the final norm and output layer.
    ``home`` says which pipeline stages hold it; ``rule`` how tensor parallelism splits it.
    ``param`` is the parameter an optimizer state belongs to (itself for a parameter).
    """

    name: str
    layer: int
    shape: tuple[int, ...]
    dtype: str
    role: Role
    rule: Rule
    home: Home
    param: str

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def _param_list(m: ModelSpec) -> list[tuple[str, int, tuple[int, ...], Rule, Home]]:
    """(name, layer, logical shape, rule, home) for every parameter, in Megatron's module order."""
    h, f, L = m.hidden_size, m.ffn_hidden_size, m.num_layers
    qkv_rows = (m.num_attention_heads + 2 * m.query_groups) * m.head_dim
    attn_out = m.num_attention_heads * m.head_dim
    norm_has_bias = m.normalization == "LayerNorm"
    out: list[tuple[str, int, tuple[int, ...], Rule, Home]] = []
    emb_home: Home = "first+last" if m.tied_embeddings else "first"
    out.append(("embedding.word_embeddings.weight", 0, (m.vocab_size, h), "vocab", emb_home))
    if m.position_embedding == "learned_absolute":
        out.append(
            ("embedding.position_embeddings.weight", 0, (m.max_sequence_length, h), "replicated", "first")
        )
    for i in range(L):
        p = f"decoder.layers.{i}."
        lay = i + 1

        def add(name: str, shape: tuple[int, ...], rule: Rule, p: str = p, lay: int = lay) -> None:
            out.append((p + name, lay, shape, rule, "layer"))

        add("input_layernorm.weight", (h,), "replicated")
        if norm_has_bias:
            add("input_layernorm.bias", (h,), "replicated")
        add("self_attention.linear_qkv.weight", (qkv_rows, h), "column")
        if m.bias:
            add("self_attention.linear_qkv.bias", (qkv_rows,), "column")
        add("self_attention.linear_proj.weight", (h, attn_out), "row")
        if m.bias:
            add("self_attention.linear_proj.bias", (h,), "replicated")
        add("pre_mlp_layernorm.weight", (h,), "replicated")
        if norm_has_bias:
            add("pre_mlp_layernorm.bias", (h,), "replicated")
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
    out.append(("decoder.final_layernorm.weight", L + 1, (h,), "replicated", "last"))
    if norm_has_bias:
        out.append(("decoder.final_layernorm.bias", L + 1, (h,), "replicated", "last"))
    if not m.tied_embeddings:
        out.append(("output_layer.weight", L + 1, (m.vocab_size, h), "vocab", "last"))
    return out


@functools.lru_cache(maxsize=64)
def _tensors(m: ModelSpec, optimizer: bool) -> tuple[TensorSpec, ...]:
    params = _param_list(m)
    roles: list[tuple[Role, str]] = [("param", m.params_dtype)]
    if optimizer:
        if m.params_dtype != "float32":
            roles.append(("fp32_param", "float32"))
        roles += [("exp_avg", "float32"), ("exp_avg_sq", "float32")]
    out: list[TensorSpec] = []
    if optimizer:
        out.append(TensorSpec("optimizer.state.step", 0, (), "int64", "step", "replicated", "all", ""))
    # Keep each layer's tensors together so the streaming executor walks them in order.
    by_layer: dict[int, list[TensorSpec]] = {}
    for name, layer, shape, rule, home in params:
        for role, dtype in roles:
            full = name if role == "param" else f"optimizer.state.{role}.{name}"
            by_layer.setdefault(layer, []).append(
                TensorSpec(full, layer, shape, dtype, role, rule, home, name)
            )
    for layer in sorted(by_layer):
        out.extend(by_layer[layer])
    return tuple(out)


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
    try:
        with open(preset_or_path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ModelError(f"cannot read model file {preset_or_path}: {exc.strerror}") from None
    try:
        return msgspec.json.decode(data, type=ModelSpec, strict=True)
    except msgspec.ValidationError as exc:
        raise ModelError(f"model file {preset_or_path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ModelError(f"model file {preset_or_path}: not valid JSON ({exc})") from None
