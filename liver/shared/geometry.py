"""A model's shard geometry as data: what the planners need to know about a model, and nothing else.

The transfer planner, the plan checker and the view function never look at a model's architecture;
they need each logical tensor's global shape, dtype, pipeline home and tensor-parallel rule. A
:class:`ModelGeometry` is exactly that, as a versioned, torch-free structure (``docs/geometry.md``):

* a preset or a what-if model gives it from its description (:meth:`ModelSpec.geometry
  <liver.shared.model.ModelSpec.geometry>`);
* a user's own Megatron-core model gives it from Megatron's ``sharded_state_dict()``
  (:mod:`liver.worker_runtime.megatron.geometry`), built at a few probe layouts;
* both must agree for the model a preset describes (a test proves it for every preset).

Decoder layers are described once per run of identical layers: a parameter with ``layers=(a, b)``
stands for layers ``a .. b-1`` and its ``name`` holds ``{layer}`` where the global layer index goes.
A 96-layer model is thus a dozen entries, not a thousand, and a model whose layers differ (a custom
layer, an extra head) lists each kind of layer as its own run.

Logical shapes differ from Megatron's checkpoint shapes in two documented places (the view function
relies on both): SwiGLU's fused ``linear_fc1`` is ``[2, ffn, ...]`` (gate rows, then up rows) and
vocabulary tensors have the *real* vocabulary as dimension 0 (Megatron pads it to a multiple of
``make_vocab_size_divisible_by * tp``; the padding rows carry no state).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Annotated, Final, Literal, NamedTuple

import msgspec
from msgspec import Meta

from liver.shared.errors import InputError
from liver.shared.layout import MAX_LAYERS, LayoutError, ParallelLayout

GEOMETRY_SCHEMA_VERSION = 4
"""The version of :class:`ModelGeometry` (``docs/geometry.md``). Version 2 added ``ddp`` (how the
optimizer state is sharded), version 3 experts (``num_experts``, ``ParamGeometry.expert``), version 4
multi-token prediction (``mtp_num_layers``; experts outside the decoder layers); older geometries are
read as version 4 (the plain optimizer, no experts, no MTP)."""

LAYER_PLACEHOLDER = "{layer}"
EXPERT_PLACEHOLDER = "{expert}"
MTP_PREFIX = "mtp.layers."
"""How Megatron names the parameters of multi-token prediction layer ``k``: ``mtp.layers.<k>.<...>``."""

Rule = Literal["replicated", "column", "row", "swiglu", "vocab"]
Home = Literal["layer", "first", "last", "first+last", "all", "last_layer"]
"""Where a parameter lives: ``layer`` with its decoder layer, ``first``/``last`` on the first or last
pipeline stage, ``first+last`` on both (a tied or an MTP model's embedding), ``all`` on every stage,
``last_layer`` on the stage that holds the last decoder layer (the final norm of a model with
multi-token prediction, which Megatron keeps there even when a last stage of MTP layers follows)."""
Role = Literal["param", "fp32_param", "exp_avg", "exp_avg_sq", "step", "buffer"]
ParamDType = Literal["float32", "bfloat16", "float16"]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}

MAX_DIM: Final = 2**53
"""The largest size a dimension, vocabulary or bucket may have: beyond it no tensor fits any machine,
and a hostile number would only cost arithmetic on integers that big."""
MAX_EXPERTS: Final = 65_536
"""Experts per MoE layer (the largest models have a few hundred)."""
MAX_NAMED_PARAMETERS: Final = 1 << 20
"""Parameters a geometry may stand for once its runs of layers and experts are expanded (a 61-layer
model of 256 experts has under 50,000): the check of a geometry names each of them, so an unbounded
count would let one message exhaust a service's memory."""
MAX_NAME_BYTES: Final = 64 << 20
"""The characters of all those names together (500 each would otherwise still allow 500 MB)."""

_Name = Annotated[str, Meta(min_length=1, max_length=500)]
_Positive = Annotated[int, Meta(ge=1, le=MAX_DIM)]
_Dim = Annotated[int, Meta(ge=1, le=MAX_DIM)]
_Layer = Annotated[int, Meta(ge=0, le=MAX_LAYERS)]


class GeometryError(InputError):
    """A geometry that no Megatron-core model could have (the message names the field)."""


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
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
    expert: int = -1
    """The global index of the expert this tensor belongs to (``-1``: a dense tensor). An expert's
    tensors live whole on one EP rank and are cut by expert-TP (``rule``) and replicated over
    expert-DP (:meth:`ParallelLayout.grid <liver.shared.layout.ParallelLayout.grid>`)."""

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


class ParamGeometry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One parameter, or one run of a per-layer parameter (``layers`` set, ``{layer}`` in ``name``).

    ``name`` is the parameter's name in ``named_parameters()`` of a model that holds every layer (one
    pipeline stage), so the global layer index. Its fp32 master copy (when ``dtype`` is 16-bit) and
    its Adam moments are part of the state too (:meth:`ModelGeometry.tensors`).
    """

    name: _Name
    shape: tuple[_Dim, ...]
    dtype: ParamDType
    rule: Rule
    home: Home
    layers: tuple[_Layer, Annotated[int, Meta(ge=1, le=MAX_LAYERS)]] | None = None
    """``(first, stop)``: the decoder layers (0-based, ``stop`` excluded) this entry stands for."""
    buffer: bool = False
    """A persistent buffer that training updates outside the optimizer (Megatron's router
    ``expert_bias``, the aux-loss-free load balancing state): moved like a parameter, without optimizer
    state or gradient, and in no DDP buffer."""
    expert: bool = False
    """Whether this entry stands for one parameter of every expert (``{expert}`` in ``name``, the
    global expert index; the geometry's ``num_experts`` of them). Megatron's local experts are
    numbered from 0 on each EP rank; their global index is ``ep_rank * experts_per_rank + local``."""

    def count(self, num_experts: int = 0) -> int:
        """How many parameters this entry stands for (:meth:`names` without making them)."""
        runs = 1 if self.layers is None else max(self.layers[1] - self.layers[0], 0)
        return runs * (num_experts if self.expert else 1)

    def names(self, num_experts: int = 0) -> list[tuple[int | None, str]]:
        """``(decoder layer or None, name)`` for every parameter this entry stands for (every expert's
        too, layer by layer, when ``expert``)."""
        return [(i, n) for i, _expert, n in self.expert_names(num_experts)]

    def expert_names(self, num_experts: int) -> list[tuple[int | None, int, str]]:
        """``(decoder layer, expert or -1, name)`` for every parameter this entry stands for."""
        if self.layers is None:
            base: list[tuple[int | None, str]] = [(None, self.name)]
        else:
            base = [(i, self.name.replace(LAYER_PLACEHOLDER, str(i))) for i in range(*self.layers)]
        if not self.expert:
            return [(i, -1, n) for i, n in base]
        return [(i, e, n.replace(EXPERT_PLACEHOLDER, str(e))) for i, n in base for e in range(num_experts)]


class TpDivisor(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A size tensor parallelism must divide beyond the split dimensions (attention heads, groups)."""

    what: _Name
    value: _Positive


class DdpSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How Megatron's DDP lays out gradients and, with ``distributed_optimizer``, shards the optimizer
    state over DP (Megatron's ``DistributedDataParallelConfig``; :mod:`liver.reshard.dist_opt`).

    ``bucket_size`` is in elements and only applies with ``overlap_grad_reduce``, as in Megatron
    (``None`` there means its default, ``max(40_000_000, 1_000_000 * dp)``).
    ``num_distributed_optimizer_instances`` (Megatron's "partial distributed optimizer") shards the
    state over consecutive groups of ``dp * cp / k`` DP ranks (expert-DP: ``edp / k``) and replicates
    it across the ``k`` groups: every shard is held ``k`` times.
    """

    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    bucket_size: _Positive | None = None
    pad_buckets_for_high_nccl_busbw: bool = False
    num_distributed_optimizer_instances: Annotated[int, Meta(ge=1, le=MAX_DIM)] = 1

    def __post_init__(self) -> None:
        k = self.num_distributed_optimizer_instances
        if not isinstance(k, int) or k < 1:
            raise GeometryError(f"ddp.num_distributed_optimizer_instances: must be at least 1, got {k!r}")

    @property
    def instances(self) -> int:
        """How many times the distributed optimizer's state is held (1 without it)."""
        return self.num_distributed_optimizer_instances if self.distributed_optimizer else 1

    def canonical(self) -> DdpSettings:
        """The settings as far as they decide the state's layout: all defaults without the distributed
        optimizer (the plain optimizer's state does not depend on buckets), no bucket size without
        ``overlap_grad_reduce``; geometries compare (and plans match jobs) on this form."""
        if not self.distributed_optimizer:
            return DdpSettings()
        if not self.overlap_grad_reduce and self.bucket_size is not None:
            return msgspec.structs.replace(self, bucket_size=None)
        return self

    def effective_bucket_size(self, dp: int, pp_rank: int) -> int | None:
        """Elements after which a bucket closes on stage ``pp_rank`` (``None``: one bucket)."""
        if not self.overlap_grad_reduce or pp_rank > 0:
            return None
        return self.bucket_size if self.bucket_size is not None else max(40_000_000, 1_000_000 * dp)


class ModelGeometry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every parameter of a model with its shard geometry; see the module docstring."""

    schema_version: int = GEOMETRY_SCHEMA_VERSION
    name: _Name
    num_layers: Annotated[int, Meta(ge=1, le=MAX_LAYERS)]
    parameters: Annotated[tuple[ParamGeometry, ...], Meta(min_length=1)]
    vocab_size: _Positive | None = None
    """The real vocabulary (rows of every ``vocab`` tensor); needed when one exists."""
    make_vocab_size_divisible_by: _Positive = 128
    tp_divisible: tuple[TpDivisor, ...] = ()
    ddp: DdpSettings = DdpSettings()
    """How the job's optimizer state is sharded (the plain optimizer unless ``distributed_optimizer``):
    the job's setting, not the model's, so a geometry derived once is given it with :meth:`with_ddp`."""
    num_experts: Annotated[int, Meta(ge=0, le=MAX_EXPERTS)] = 0
    """Experts per MoE layer (0: a dense model); every ``expert`` entry stands for this many."""
    mtp_num_layers: Annotated[int, Meta(ge=0, le=MAX_LAYERS)] = 0
    """Multi-token prediction layers (Megatron's ``mtp_num_layers``): their parameters (``mtp.layers.<k>.``)
    live on the last stage, which then builds the word embeddings too (they feed the MTP layers), first
    in its module order, kept equal to the first stage's as a tied embedding is."""

    def __post_init__(self) -> None:
        if self.schema_version in (1, 2, 3):
            msgspec.structs.force_setattr(self, "schema_version", GEOMETRY_SCHEMA_VERSION)
        msgspec.structs.force_setattr(self, "ddp", self.ddp.canonical())
        if self.schema_version != GEOMETRY_SCHEMA_VERSION:
            raise GeometryError(
                f"schema_version: {self.schema_version} is not supported (expected {GEOMETRY_SCHEMA_VERSION})"
            )
        named = sum(p.count(self.num_experts) for p in self.parameters)
        if named > MAX_NAMED_PARAMETERS:
            raise GeometryError(
                f"parameters: stand for {named:,} parameters once expanded; at most {MAX_NAMED_PARAMETERS:,}"
            )
        name_bytes = sum(p.count(self.num_experts) * len(p.name) for p in self.parameters)
        if name_bytes > MAX_NAME_BYTES:
            raise GeometryError(
                f"parameters: their names come to {name_bytes:,} characters once expanded; at most "
                f"{MAX_NAME_BYTES:,}"
            )
        seen: set[str] = set()
        layers: set[int] = set()
        for i, p in enumerate(self.parameters):
            _check_param(p, f"parameters[{i}]", self)
            for layer, name in p.names(self.num_experts):
                if name in seen:
                    raise GeometryError(f"parameters[{i}].name: {name!r} is listed twice")
                seen.add(name)
                if layer is not None:
                    layers.add(layer)
        missing = sorted(set(range(self.num_layers)) - layers)
        if layers and missing:
            raise GeometryError(
                f"num_layers: {self.num_layers}, but no parameter belongs to decoder layer {missing[0]}"
            )

    @property
    def distributed(self) -> bool:
        """Whether the optimizer state is sharded over DP (Megatron's distributed optimizer)."""
        return self.ddp.distributed_optimizer

    def with_ddp(self, ddp: DdpSettings) -> ModelGeometry:
        """This geometry for a job whose DDP and optimizer are set so (in :meth:`DdpSettings.canonical`
        form)."""
        ddp = ddp.canonical()
        return self if ddp == self.ddp else msgspec.structs.replace(self, ddp=ddp)

    def padded_vocab(self, tp: int) -> int:
        """Megatron's padded vocabulary at tensor parallelism ``tp``."""
        if self.vocab_size is None:
            raise GeometryError(f"model {self.name!r} has no vocabulary tensor")
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    def check_layout(self, layout: ParallelLayout) -> None:
        """Raise :class:`LayoutError` naming the reason when Megatron could not shard this model so."""
        _check_layout(self, layout)

    def tensors(self, optimizer: bool = True) -> tuple[TensorSpec, ...]:
        """All logical tensors of the training state (Adam's when ``optimizer``), grouped by streaming
        layer and, within one, in parameter order: the order the executor walks. Persistent buffers
        (role ``buffer``) are state either way."""
        return _tensors(self, optimizer)

    @property
    def has_buffers(self) -> bool:
        """Whether the state holds persistent buffers besides parameters (:attr:`ParamGeometry.buffer`)."""
        return any(p.buffer for p in self.parameters)

    def parameter_count(self) -> int:
        return sum(math.prod(p.shape) * len(p.names(self.num_experts)) for p in self.parameters)

    def expert_parameter_count(self) -> int:
        """Parameters of the experts alone (each EP rank holds ``1/EP`` of them)."""
        return sum(math.prod(p.shape) * len(p.names(self.num_experts)) for p in self.parameters if p.expert)

    def digest(self) -> str:
        """A short fingerprint: two processes that derived the same geometry agree on it."""
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]


class LayerParam(NamedTuple):
    """One parameter of one decoder layer, as :func:`layer_runs` compares layers."""

    suffix: str
    """The name after ``decoder.layers.<i>.`` (``{expert}`` where an expert's global index goes)."""
    shape: tuple[int, ...]
    dtype: ParamDType
    rule: Rule
    expert: bool = False
    buffer: bool = False


def layer_runs(layers: Sequence[Sequence[LayerParam]]) -> list[ParamGeometry]:
    """The per-layer entries of a geometry: each run of consecutive layers of one kind (the same
    parameters in the same order) once, its parameters in the layer's own order.

    Runs are cut by whole layers, not parameter by parameter, although a parameter every layer has
    (the attention's) could span several kinds: a layer's parameters must come out of
    :meth:`ModelGeometry.tensors` in its ``named_parameters()`` order (DDP lays out the distributed
    optimizer's buffers by it), and one kind's order need not fit another's."""
    out: list[ParamGeometry] = []
    start = 0
    for stop in range(1, len(layers) + 1):
        if stop < len(layers) and tuple(layers[stop]) == tuple(layers[start]):
            continue
        for p in layers[start]:
            out.append(
                ParamGeometry(
                    name=f"decoder.layers.{LAYER_PLACEHOLDER}.{p.suffix}",
                    shape=p.shape,
                    dtype=p.dtype,
                    rule=p.rule,
                    home="layer",
                    layers=(start, stop),
                    expert=p.expert,
                    buffer=p.buffer,
                )
            )
        start = stop
    return out


def stream_layer(home: Home, num_layers: int) -> int:
    """The streaming unit of a parameter outside the decoder layers: the last stage's come last."""
    return num_layers + 1 if home in ("last", "last_layer") else 0


def _check_param(p: ParamGeometry, where: str, g: ModelGeometry) -> None:
    templated = LAYER_PLACEHOLDER in p.name
    if (p.layers is None) == templated:
        raise GeometryError(f"{where}.name: {LAYER_PLACEHOLDER} must appear exactly when `layers` is set")
    if (p.home == "layer") != (p.layers is not None):
        raise GeometryError(f"{where}.home: `layer` exactly for per-layer parameters, got {p.home!r}")
    if p.buffer and p.rule != "replicated":
        raise GeometryError(f"{where}.rule: a buffer is moved whole (replicated), got {p.rule!r}")
    if p.expert:
        if g.num_experts < 1:
            raise GeometryError(f"{where}.expert: an expert parameter needs the geometry's num_experts")
        if EXPERT_PLACEHOLDER not in p.name:
            raise GeometryError(f"{where}.name: an expert parameter has {EXPERT_PLACEHOLDER} in its name")
        if p.layers is None and p.home not in ("last", "last_layer"):
            raise GeometryError(
                f"{where}.home: an expert parameter outside the decoder layers (multi-token prediction's) "
                f"lives on the last stage, got {p.home!r}"
            )
        if p.rule == "vocab":
            raise GeometryError(f"{where}.rule: an expert parameter cannot be vocabulary-parallel")
    elif EXPERT_PLACEHOLDER in p.name:
        raise GeometryError(f"{where}.name: {EXPERT_PLACEHOLDER} appears but `expert` is not set")
    if p.layers is not None:
        first, stop = p.layers
        if not first < stop <= g.num_layers:
            raise GeometryError(f"{where}.layers: {p.layers} is not a run of the {g.num_layers} layers")
    need = {"column": 1, "row": 2, "swiglu": 2, "vocab": 1}.get(p.rule, 0)
    if len(p.shape) < need:
        raise GeometryError(f"{where}.shape: a {p.rule!r} tensor needs at least {need} dimensions")
    if p.rule == "swiglu" and p.shape[0] != 2:
        raise GeometryError(f"{where}.shape: a 'swiglu' tensor is [2, ffn, ...], got {list(p.shape)}")
    if p.rule == "vocab":
        if g.vocab_size is None:
            raise GeometryError(f"{where}.rule: a 'vocab' tensor needs the geometry's vocab_size")
        if p.shape[0] != g.vocab_size:
            raise GeometryError(f"{where}.shape: dimension 0 must be vocab_size ({g.vocab_size})")


_SPLIT_DIM: dict[str, int] = {"column": 0, "row": 1, "swiglu": 1}


def _check_layout(g: ModelGeometry, layout: ParallelLayout) -> None:
    tp = layout.tp
    for d in g.tp_divisible:
        if d.value % tp:
            raise LayoutError(f"{layout.describe()}: {d.what} ({d.value}) is not divisible by tp={tp}")
    if g.num_experts:
        if g.num_experts % layout.ep:
            raise LayoutError(
                f"{layout.describe()}: num_experts ({g.num_experts}) is not divisible by ep={layout.ep}"
            )
    elif layout.ep > 1 or layout.etp is not None:
        raise LayoutError(f"{layout.describe()}: expert parallelism needs a model with experts")
    layout.check_instances(g.ddp.instances)
    for p in g.parameters:
        dim = _SPLIT_DIM.get(p.rule)
        size, what = (layout.expert_tp, "etp") if p.expert else (tp, "tp")
        if dim is not None and p.shape[dim] % size:
            raise LayoutError(
                f"{layout.describe()}: dimension {dim} of {p.name} ({p.shape[dim]}) "
                f"is not divisible by {what}={size}"
            )
    if layout.pp > g.num_layers:
        raise LayoutError(f"{layout.describe()}: pp={layout.pp} exceeds the {g.num_layers} layers")
    layout.layers_per_stage(g.num_layers)


@functools.lru_cache(maxsize=64)
def _tensors(g: ModelGeometry, optimizer: bool) -> tuple[TensorSpec, ...]:
    by_layer: dict[int, list[tuple[int, int, int, list[TensorSpec]]]] = {}
    # Parameter order within a streaming layer is the order of the entries (a run contributes to each
    # of its layers in turn), except that consecutive expert entries go expert by expert, as Megatron
    # names them (``local_experts.0.linear_fc1``, ``local_experts.0.linear_fc2``, ``local_experts.1...``).
    block = 0
    for seq, p in enumerate(g.parameters):
        if not p.expert:
            block += 1
        for index, expert, name in p.expert_names(g.num_experts):
            layer = index + 1 if index is not None else stream_layer(p.home, g.num_layers)
            roles = _roles(p, name, layer, optimizer, expert)
            by_layer.setdefault(layer, []).append((block, max(expert, 0), seq, roles))
    out: list[TensorSpec] = []
    if optimizer:
        out.append(TensorSpec("optimizer.state.step", 0, (), "int64", "step", "replicated", "all", ""))
    for layer in sorted(by_layer):
        for *_key, roles in sorted(by_layer[layer], key=lambda e: e[:3]):
            out.extend(roles)
    return tuple(out)


def _roles(p: ParamGeometry, name: str, layer: int, optimizer: bool, expert: int) -> list[TensorSpec]:
    if p.buffer:
        return [TensorSpec(name, layer, p.shape, p.dtype, "buffer", p.rule, p.home, name, expert)]
    roles: list[tuple[Role, str]] = [("param", p.dtype)]
    if optimizer:
        if p.dtype != "float32":
            roles.append(("fp32_param", "float32"))
        roles += [("exp_avg", "float32"), ("exp_avg_sq", "float32")]
    return [
        TensorSpec(
            name if role == "param" else f"optimizer.state.{role}.{name}",
            layer,
            p.shape,
            dtype,
            role,
            p.rule,
            p.home,
            name,
            expert,
        )
        for role, dtype in roles
    ]
