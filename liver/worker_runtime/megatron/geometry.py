"""A model's shard geometry, derived from Megatron-core's own ``sharded_state_dict()``.

LiveR plans for any model Megatron-core can checkpoint with ``dist_checkpointing``: the geometry of a
user's model is what Megatron says about it, not a table kept by hand. The model is built a few times
on the ``meta`` device (no memory, no initialisation cost) by the user's own provider, each time as one
rank of a *probe layout* on torch's ``fake`` process group, and every parameter's ``ShardedTensor`` (or
factory) is read:

* TP1·PP1, rank 0: names (``named_parameters()``, so global layer indices), shapes, dtypes, order, and
  which parameters Megatron stacks per decoder layer (a prepended layer axis);
* TP2, ranks 0 and 1: each parameter's tensor-parallel rule, from the axis Megatron fragments (0:
  column, 1: row, none: replicated), SwiGLU's factory, and the vocabulary's padded rows;
* a pipeline of three or more stages (the fewest that split the layers evenly; two for a two-layer
  model), one rank per stage: where each parameter outside the decoder layers lives (first stage,
  last, both as with tied embeddings, every stage).

Each probe's answer is checked for what the view function assumes (an even split, contiguous boxes in
rank order, the padded vocabulary as Megatron pads it); anything else is refused with the parameter
named, never guessed. The result is a :class:`~liver.shared.geometry.ModelGeometry`; a test proves that
for every preset it equals :meth:`ModelSpec.geometry <liver.shared.model.ModelSpec.geometry>`.

The probes need ``torch.distributed`` to themselves: :func:`derive_geometry` refuses to run in a process
that has a default world (a training process does), :func:`derive_geometry_in_subprocess` runs it in a
fresh interpreter for one.
"""

from __future__ import annotations

import inspect
import math
import multiprocessing
import queue
import re
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import torch
import torch.distributed as dist

from liver.shared.errors import HandoffError, InputError
from liver.shared.geometry import (
    EXPERT_PLACEHOLDER,
    LAYER_PLACEHOLDER,
    MTP_PREFIX,
    Home,
    LayerParam,
    ModelGeometry,
    ParamGeometry,
    Rule,
    TensorSpec,
    TpDivisor,
    layer_runs,
)
from liver.shared.layout import ParallelLayout

log = structlog.get_logger(__name__)

Provider = Callable[[ParallelLayout, Any], torch.nn.Module]
"""Builds this rank's part of the model at ``layout`` on the given ``ProcessGroupCollection``
(:data:`.source.UserProvider`), unwrapped (no DDP) and cast to its training dtype. In the probes
``parallel_state`` is initialised for the layout too, and the collection holds its groups."""

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_KEY_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class GeometryDerivationError(InputError):
    """Megatron describes a parameter in a way the view function cannot follow (named in the message)."""


class ProbeBuildError(GeometryDerivationError):
    """The provider could not build the model at a probe layout (the layout is named)."""


@dataclass(frozen=True)
class _Piece:
    """One ``ShardedTensor`` of a parameter on one probe rank (the layer axis taken off)."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    fragments: tuple[int, ...]


@dataclass
class _Param:
    """What one probe rank saw of one parameter."""

    name: str
    key: str
    layer: int | None  # the global decoder layer when Megatron stacks it
    shape: tuple[int, ...]
    dtype: str
    factory: bool
    pieces: list[_Piece] = field(default_factory=list)
    expert: int | None = None  # the global expert when Megatron stacks experts too (a second axis)
    buffer: bool = False  # a persistent buffer (the router's expert_bias), not a parameter

    @property
    def ident(self) -> tuple[str, int | None, int | None]:
        return (self.key, self.layer, self.expert)


@dataclass(frozen=True)
class _Probe:
    layout: ParallelLayout
    rank: int
    params: list[_Param]
    config: Any
    vocab_rows: int | None  # the model's (padded) vocabulary at this layout, when it has one

    def by_ident(self) -> dict[tuple[str, int | None, int | None], _Param]:
        return {p.ident: p for p in self.params}


# --------------------------------------------------------------------------- the probes


@contextmanager
def _fake_world(layout: ParallelLayout, rank: int) -> Iterator[None]:
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from liver.worker_runtime.megatron.build import initialize_parallel_state, seed_build

    # A model that initialises its weights as on a GPU (use_cpu_initialization=False) forks Megatron's
    # model-parallel RNG tracker, which must be seeded as a real build seeds it; the caller's own random
    # streams are left as they were.
    gpus = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        initialize_parallel_state(layout, gloo_groups=False)
        with torch.random.fork_rng(devices=gpus):
            seed_build(0, layout, rank)
            yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _probe(provider: Provider, layout: ParallelLayout, rank: int, device: str) -> _Probe:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from liver.worker_runtime.megatron.build import groups_from_parallel_state

    with _fake_world(layout, rank):
        groups = groups_from_parallel_state(layout)
        collection = groups.collection()
        try:
            with torch.device(device):
                model = provider(layout, collection)
            # A multi-token prediction stage files its state by its DP x CP group (Megatron reads it here).
            state = model.sharded_state_dict(metadata={"dp_cp_group": groups.dp_cp})
        except Exception as exc:  # the user's code: reported with the probe it failed at
            raise ProbeBuildError(
                f"the provider failed to build rank {rank} of {layout.describe()}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        names = {id(p): n for n, p in model.named_parameters()}
        param_ids = set(names)
        # Persistent buffers Megatron checkpoints are training state too (the router's expert_bias).
        names.update({id(b): n for n, b in model.named_buffers() if id(b) not in names})
        out: dict[int, _Param] = {}
        for value in nested_values(state):
            if isinstance(value, ShardedObject):
                continue
            if not isinstance(value, (ShardedTensor, ShardedTensorFactory)):
                raise GeometryDerivationError(
                    f"sharded_state_dict() holds a {type(value).__name__}; only tensors and factories "
                    "of parameters can be resharded"
                )
            param = value.data
            if id(param) not in names:
                raise GeometryDerivationError(
                    f"sharded_state_dict() key {value.key!r} is neither a parameter nor a buffer of the "
                    "model (state that training changes would be lost in a reshard)"
                )
            built = [value] if isinstance(value, ShardedTensor) else list(nested_values({"x": value.build()}))
            first = built[0]
            layer, expert, skip = _stacking(first)
            dtype = _DTYPES.get(param.dtype)
            if dtype is None:
                raise GeometryDerivationError(f"{names[id(param)]}: dtype {param.dtype} is not supported")
            seen = out.setdefault(
                id(param),
                _Param(
                    name=names[id(param)],
                    key=value.key,
                    layer=layer,
                    shape=tuple(param.shape),
                    dtype=dtype,
                    factory=isinstance(value, ShardedTensorFactory),
                    expert=expert,
                    buffer=id(param) not in param_ids,
                ),
            )
            for sh in built:
                seen.pieces.append(
                    _Piece(
                        key=sh.key,
                        global_shape=tuple(sh.global_shape[skip:]),
                        global_offset=tuple(sh.global_offset[skip:]),
                        local_shape=tuple(sh.local_shape),
                        fragments=tuple(sh.axis_fragmentations[skip:]),
                    )
                )
        missing = sorted({names[i] for i in param_ids} - {p.name for p in out.values()})
        if missing:
            raise GeometryDerivationError(
                f"parameter {missing[0]} is not in sharded_state_dict(): Megatron could not checkpoint "
                "it, so LiveR cannot move it"
            )
        vocab = getattr(model, "vocab_size", None)
        config = getattr(model, "config", None)
        order = _module_order(model)
        params = sorted(out.values(), key=lambda p: order[p.name])
        return _Probe(layout, rank, params, config, vocab if isinstance(vocab, int) else None)


def _stacking(sh: Any) -> tuple[int | None, int | None, int]:
    """``(decoder layer, expert, prepended axes)`` of one ``ShardedTensor``.

    Megatron files a block of identical layers under one key per parameter with the layer as a
    prepended axis (and the expert as a second, for experts); a block whose layers differ (a list or
    an ``N > 1`` ``moe_layer_freq``, ``linear_attention_freq``, heterogeneous block specs) under one key
    per layer, ``decoder.layers.<n>.<...>``, with only the experts' axis prepended."""
    skip = sh.prepend_axis_num
    if sh.key.startswith(MTP_PREFIX):  # multi-token prediction: outside the decoder, experts stacked
        if skip > 1:
            raise GeometryDerivationError(f"{sh.key}: {skip} prepended axes on a multi-token prediction key")
        return None, (sh.global_offset[0] if skip else None), skip
    per_layer = _KEY_LAYER.match(sh.key)
    if per_layer is not None:
        if skip > 1:
            raise GeometryDerivationError(f"{sh.key}: {skip} prepended axes on a per-layer key")
        return int(per_layer.group(1)), (sh.global_offset[0] if skip else None), skip
    if skip > 2:
        raise GeometryDerivationError(f"{sh.key}: {skip} prepended axes")
    return (sh.global_offset[0] if skip else None), (sh.global_offset[1] if skip == 2 else None), skip


def _module_order(model: torch.nn.Module) -> dict[str, int]:
    """Parameters and buffers by position in module order, each module's parameters before its buffers
    (``named_parameters()``'s order, with the buffers where ``state_dict()`` puts them)."""
    order: dict[str, int] = {}
    for prefix, module in model.named_modules():
        head = f"{prefix}." if prefix else ""
        for name, _ in module.named_parameters(recurse=False):
            order.setdefault(head + name, len(order))
        for name, _ in module.named_buffers(recurse=False):
            order.setdefault(head + name, len(order))
    return order


# --------------------------------------------------------------------------- generalising


def _rule(
    base: _Param, tp2: tuple[_Param, _Param], vocab: tuple[int, int, int] | None
) -> tuple[Rule, tuple[int, ...]]:
    """The tensor-parallel rule and logical shape of ``base`` from what TP ranks 0 and 1 hold.

    ``vocab``: the real vocabulary and its padded size at TP1 and TP2. A tensor split along axis 0 whose
    rows are the padded vocabulary at both probes is a vocabulary tensor (its logical rows the real
    vocabulary); every other split must be even and in rank order."""
    name = base.name
    shape = base.shape
    if base.factory:
        return "swiglu", _swiglu_shape(base, tp2)
    fragments = {a for r in tp2 for piece in r.pieces for a, n in enumerate(piece.fragments) if n > 1}
    if not fragments:
        for r in tp2:
            if r.shape != shape:
                raise GeometryDerivationError(f"{name}: unsplit at TP2 but {r.shape} instead of {shape}")
        return "replicated", shape
    if len(fragments) > 1 or any(len(r.pieces) != 1 for r in tp2):
        raise GeometryDerivationError(f"{name}: Megatron splits it along several axes {sorted(fragments)}")
    (axis,) = fragments
    if axis > 1:
        raise GeometryDerivationError(f"{name}: split along axis {axis}; LiveR follows axes 0 and 1")
    pieces = [r.pieces[0] for r in tp2]
    if vocab is not None and axis == 0 and shape[0] == vocab[1] and pieces[0].global_shape[0] == vocab[2]:
        per = vocab[2] // 2
        for tp_rank, piece in enumerate(pieces):
            if piece.local_shape[0] != per or piece.global_offset[0] != per * tp_rank:
                raise GeometryDerivationError(
                    f"{name}: TP rank {tp_rank} of 2 holds vocabulary rows {piece.global_offset[0]} + "
                    f"{piece.local_shape[0]}, not its equal share of {vocab[2]} padded rows"
                )
        return "vocab", (vocab[0], *shape[1:])
    per = shape[axis] // 2
    for tp_rank, piece in enumerate(pieces):
        if (
            piece.global_shape != shape
            or piece.local_shape[axis] != per
            or piece.global_offset[axis] != per * tp_rank
        ):
            raise GeometryDerivationError(
                f"{name}: TP rank {tp_rank} of 2 holds {piece.local_shape} at {piece.global_offset} of "
                f"{piece.global_shape}, not an even split of {shape} along axis {axis}"
            )
    return ("column" if axis == 0 else "row"), shape


def _swiglu_shape(base: _Param, tp2: tuple[_Param, _Param]) -> tuple[int, ...]:
    """``[2, ffn, ...]`` for SwiGLU's fused fc1 (gate rows, then up rows), checked at TP1 and TP2."""
    rows, *rest = base.shape
    ffn = rows // 2
    for tp_rank, r in enumerate((base, *tp2)):
        tp = 1 if r is base else 2
        rank = 0 if r is base else tp_rank - 1
        per = ffn // tp
        want = [(2 * ffn, per * rank), (2 * ffn, ffn + per * rank)]
        got = [(p.global_shape[0], p.global_offset[0]) for p in r.pieces]
        if rows % 2 or got != want:
            raise GeometryDerivationError(
                f"{base.name}: a sharded factory that is not SwiGLU's gate/up split ({got} at TP{tp})"
            )
    return (2, ffn, *rest)


def _homes(
    stages: list[set[tuple[str, int | None, int | None]]], ident: tuple[str, int | None, int | None]
) -> Home:
    held = [i for i, s in enumerate(stages) if ident in s]
    last = len(stages) - 1
    if held == list(range(len(stages))) and len(stages) > 2:
        return "all"
    if held == [0]:
        return "first"
    if held == [last]:
        return "last"
    if held == [0, last]:
        return "first+last"
    raise GeometryDerivationError(f"{ident[0]}: held by pipeline stages {held} of {len(stages)}")


def _tp1_rule(base: _Param, vocab: tuple[int, int, int] | None) -> tuple[Rule, tuple[int, ...]]:
    """For a model that cannot be built at TP2 (so every layout has TP1): each tensor whole, but the
    vocabulary, whose local rows stay padded."""
    if base.factory:
        rows, *rest = base.shape
        return "swiglu", (2, rows // 2, *rest)
    if vocab is not None and base.layer is None and base.shape and base.shape[0] == vocab[1]:
        return "vocab", (vocab[0], *base.shape[1:])
    return "replicated", base.shape


def _homes_probe(num_layers: int) -> ParallelLayout | None:
    """A pipeline with a first, a middle and a last stage, split evenly when the layers allow it (a
    provider that ignores ``layout.stage_layers`` then builds it right); two stages for two layers."""
    if num_layers < 2:
        return None
    if num_layers == 2:
        return ParallelLayout(tp=1, pp=2, dp=1)
    even = next((p for p in range(3, min(num_layers, 8) + 1) if num_layers % p == 0), None)
    if even is not None:
        return ParallelLayout(tp=1, pp=even, dp=1)
    return ParallelLayout(tp=1, pp=3, dp=1, stage_layers=(1, num_layers - 2, 1))


def _tp_divisors(config: Any) -> tuple[TpDivisor, ...]:
    """The sizes TP must divide: the config's heads, query groups and FFN width; for a heterogeneous
    model (Megatron's ``HeterogeneousTransformerConfig``, a config per layer) every layer's own, as
    their greatest common divisor (a TP divides each exactly when it divides that)."""
    if config is None:
        return ()
    layers = [config]
    per_layer = getattr(config, "get_config_for_layer", None)
    if callable(per_layer) and getattr(config, "heterogeneous_block_specs", False):
        layers = [per_layer(n) for n in range(1, config.num_layers + 1)]

    def common(name: str, fallback: str | None = None) -> int | None:
        values = [
            getattr(c, name, None) or (getattr(c, fallback, None) if fallback else None) for c in layers
        ]
        ints = [int(v) for v in values if isinstance(v, (int, float)) and v > 0]
        return math.gcd(*ints) if ints else None

    heads = common("num_attention_heads")
    groups = common("num_query_groups", "num_attention_heads")
    # An MoE model's FFN is its experts', split by expert-TP (its shape checks say so); no dense one.
    ffn = None if getattr(config, "num_moe_experts", None) else common("ffn_hidden_size")
    out = []
    for what, value in (
        ("num_attention_heads", heads),
        ("num_query_groups", groups),
        ("ffn_hidden_size", ffn),
    ):
        if isinstance(value, int) and value > 0:
            out.append(TpDivisor(what, value))
    return tuple(out)


def _expert_suffix(p: _Param, suffix: str) -> str:
    """``suffix`` with the expert's index as ``{expert}``: the path component equal to it (at EP 1 an
    expert's local index is its global one, as Megatron's ``local_experts.<i>``), the last such one in
    a multi-token prediction layer's name (``mtp.layers.<k>.`` comes before it)."""
    parts = suffix.split(".")
    hits = [i for i, part in enumerate(parts) if part == str(p.expert)]
    if hits and suffix.startswith(MTP_PREFIX):
        hits = hits[-1:]
    if len(hits) != 1:
        raise GeometryDerivationError(
            f"{p.name}: Megatron checkpoints it as expert {p.expert}, but its name does not name that "
            "expert once"
        )
    parts[hits[0]] = EXPERT_PLACEHOLDER
    return ".".join(parts)


def _check_expert_split(provider: Provider, base: _Probe, experts: int, device: str) -> None:
    """At EP 2 (two ranks), rank 1 must hold experts ``E/2 .. E-1`` as its local ``0 .. E/2-1``, whole:
    the view function deals experts out so."""
    probe = _probe(provider, ParallelLayout(tp=1, pp=1, dp=2, ep=2), 1, device)
    half = experts // 2
    want = {(p.key, p.layer, p.expert): p for p in base.params if p.expert is not None and p.expert >= half}
    got = {p.ident: p for p in probe.params if p.expert is not None}
    if set(got) != set(want):
        raise GeometryDerivationError(
            f"at EP2, rank 1 holds experts {sorted({i[2] for i in got})}; LiveR expects {half}..{experts - 1}"
        )
    for ident, p in got.items():
        local = p.expert - half  # type: ignore[operator]
        if p.shape != want[ident].shape or f".{local}." not in p.name:
            raise GeometryDerivationError(
                f"{p.name}: at EP2 Megatron checkpoints it as expert {p.expert}, not as local expert {local} "
                f"of EP rank 1 (shape {p.shape})"
            )


def derive_geometry(
    provider: Provider,
    *,
    name: str,
    num_layers: int,
    vocab_size: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    device: str = "meta",
) -> ModelGeometry:
    """The geometry of the model ``provider`` builds; see the module docstring.

    ``vocab_size`` is the tokenizer's real vocabulary (Megatron only knows the padded one) and
    ``make_vocab_size_divisible_by`` its padding multiple per TP rank, as the user passes them to
    Megatron. Raises :class:`GeometryDerivationError` naming the parameter Megatron describes in a
    way LiveR cannot follow.
    """
    _check_arguments(name, num_layers, vocab_size, make_vocab_size_divisible_by)
    base = _probe(provider, ParallelLayout(tp=1, pp=1, dp=1), 0, device)
    experts = _check_base(base, num_layers, vocab_size, make_vocab_size_divisible_by)
    if len(experts) > 1 and len(experts) % 2 == 0:
        _check_expert_split(provider, base, len(experts), device)
    tp2 = _tp2_probes(provider, name, device)
    stages = _stage_probes(provider, num_layers, device)
    with_last_layer = _with_last_layer(provider, base, num_layers, device)
    vocab = _vocab(vocab_size, make_vocab_size_divisible_by)
    out = _parameters(base, tp2, stages, with_last_layer, vocab, num_layers)
    geometry = ModelGeometry(
        name=name,
        num_layers=num_layers,
        parameters=tuple(out),
        vocab_size=vocab_size if any(p.rule == "vocab" for p in out) else None,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tp_divisible=_tp_divisors(base.config) if tp2 is not None else (TpDivisor("tensor parallelism", 1),),
        num_experts=len(experts),
        mtp_num_layers=getattr(base.config, "mtp_num_layers", None) or 0,
    )
    geometry = msgspec.convert(msgspec.to_builtins(geometry), ModelGeometry)  # the wire's field limits too
    log.info("geometry.derived", model=name, parameters=len(out), digest=geometry.digest())
    return geometry


def _check_arguments(
    name: str, num_layers: int, vocab_size: int | None, make_vocab_size_divisible_by: int
) -> None:
    """Refuse :func:`derive_geometry`'s arguments before any probe is built, and a process whose
    ``torch.distributed`` has a default world already (the probes make worlds of their own)."""
    if dist.is_initialized():
        raise GeometryDerivationError(
            "derive_geometry builds probe worlds of its own; this process already has a default world "
            "(use derive_geometry_in_subprocess)"
        )
    if num_layers < 1:
        raise GeometryDerivationError(f"num_layers must be at least 1, got {num_layers}")
    if make_vocab_size_divisible_by < 1:
        raise GeometryDerivationError(
            f"make_vocab_size_divisible_by must be at least 1, got {make_vocab_size_divisible_by}"
        )
    if vocab_size is not None and vocab_size < 1:
        raise GeometryDerivationError(f"vocab_size must be at least 1, got {vocab_size}")
    if not name:
        raise GeometryDerivationError("name: give the model a name")


def _padded_vocab(vocab_size: int | None, make_vocab_size_divisible_by: int, tp: int) -> int | None:
    """The vocabulary as Megatron pads it at TP ``tp`` (``None`` without one)."""
    if vocab_size is None:
        return None
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _vocab(vocab_size: int | None, make_vocab_size_divisible_by: int) -> tuple[int, int, int] | None:
    """The real vocabulary and its padded rows at TP1 and TP2, as :func:`_rule` reads them."""
    if vocab_size is None:
        return None
    padded = [_padded_vocab(vocab_size, make_vocab_size_divisible_by, tp) for tp in (1, 2)]
    return (vocab_size, padded[0] or 0, padded[1] or 0)


def _check_base(
    base: _Probe, num_layers: int, vocab_size: int | None, make_vocab_size_divisible_by: int
) -> list[int]:
    """The experts the TP1 probe numbers (``[]`` for a dense model), once it agrees with the arguments:
    the layers built and stacked, the vocabulary's padded rows, experts numbered from 0."""
    built_layers = getattr(base.config, "num_layers", None)
    stacked = {p.layer for p in base.params if p.layer is not None}
    if isinstance(built_layers, int) and built_layers != num_layers:
        raise GeometryDerivationError(
            f"num_layers: {num_layers}, but the provider's TransformerConfig builds {built_layers} layers"
        )
    if stacked and stacked != set(range(num_layers)):
        raise GeometryDerivationError(
            f"num_layers: {num_layers}, but Megatron stacks parameters of decoder layers "
            f"{min(stacked)}..{max(stacked)}"
        )
    if base.vocab_rows is not None and vocab_size is None:
        raise GeometryDerivationError(
            f"vocab_size: the model has a vocabulary ({base.vocab_rows} padded rows at TP1); give the "
            "tokenizer's real size (--vocab-size), which Megatron does not know"
        )
    padded = _padded_vocab(vocab_size, make_vocab_size_divisible_by, 1)
    if base.vocab_rows is not None and padded is not None and base.vocab_rows != padded:
        raise GeometryDerivationError(
            f"the model's vocabulary is {base.vocab_rows} rows at TP1, but vocab_size={vocab_size} padded "
            f"to a multiple of {make_vocab_size_divisible_by} is {padded}"
        )
    experts = sorted({p.expert for p in base.params if p.expert is not None})
    if experts and experts != list(range(len(experts))):
        raise GeometryDerivationError(f"Megatron numbers the experts {experts[0]}..{experts[-1]}, not from 0")
    return experts


def _tp2_probes(
    provider: Provider, name: str, device: str
) -> list[dict[tuple[str, int | None, int | None], _Param]] | None:
    """What TP ranks 0 and 1 of TP2 hold, by parameter; ``None`` when the model cannot be built at
    TP2 (e.g. one query group: Megatron allows no tensor parallelism at all), so every layout has TP1."""
    try:
        return [_probe(provider, ParallelLayout(tp=2, pp=1, dp=1), r, device).by_ident() for r in (0, 1)]
    except ProbeBuildError as exc:
        log.info("geometry.tp1_only", model=name, reason=str(exc))
        return None


def _stage_probes(
    provider: Provider, num_layers: int, device: str
) -> list[set[tuple[str, int | None, int | None]]]:
    """Per stage of the homes probe (:func:`_homes_probe`), the parameters outside the decoder layers it
    holds; none for a one-layer model."""
    stages: list[set[tuple[str, int | None, int | None]]] = []
    homes_layout = _homes_probe(num_layers)
    if homes_layout is not None:
        for stage in range(homes_layout.pp):
            probe = _probe(provider, homes_layout, stage, device)
            stages.append({p.ident for p in probe.params if p.layer is None})
    return stages


def _with_last_layer(
    provider: Provider, base: _Probe, num_layers: int, device: str
) -> set[tuple[str, int | None, int | None]]:
    """The last stage's parameters outside the decoder layers that Megatron keeps with the last decoder
    layer instead (with multi-token prediction: the final norm); none without it."""
    if not (getattr(base.config, "mtp_num_layers", None) and num_layers > 0):
        return set()
    # A pipeline whose last stage holds only the MTP layers shows which.
    apart = ParallelLayout(tp=1, pp=2, dp=1, stage_layers=(num_layers, 0))
    probe = _probe(provider, apart, 0, device)
    return {p.ident for p in probe.params if p.layer is None}


def _parameters(
    base: _Probe,
    tp2: list[dict[tuple[str, int | None, int | None], _Param]] | None,
    stages: list[set[tuple[str, int | None, int | None]]],
    with_last_layer: set[tuple[str, int | None, int | None]],
    vocab: tuple[int, int, int] | None,
    num_layers: int,
) -> list[ParamGeometry]:
    """The geometry's parameters in module order: those outside the decoder layers before or after
    them (as the probes place them), and the decoder layers' as runs of alike layers (:func:`layer_runs`),
    each expert's once."""
    head: list[ParamGeometry] = []  # outside the decoder layers, before them in module order
    tail: list[ParamGeometry] = []
    layers: list[list[LayerParam]] = [[] for _ in range(num_layers)]
    for p in base.params:
        rule, shape = _tp_rule(p, tp2, vocab)
        if p.layer is not None:
            entry = _layer_param(p, rule, shape)
            if entry not in layers[p.layer]:  # another expert of a layer already counted
                layers[p.layer].append(entry)
            continue
        home: Home = _homes(stages, p.ident) if stages else "first+last" if rule == "vocab" else "first"
        if home == "last" and p.ident in with_last_layer:
            home = "last_layer"
        pname = p.name if p.expert is None else _expert_suffix(p, p.name)
        side = tail if any(layers) else head
        if p.expert is not None and any(q.name == pname for q in side):
            continue  # another expert of a multi-token prediction layer already counted
        param = ParamGeometry(
            name=pname,
            shape=shape,
            dtype=p.dtype,  # type: ignore[arg-type]
            rule=rule,
            home=home,
            buffer=p.buffer,
            expert=p.expert is not None,
        )
        side.append(param)
    return [*head, *layer_runs(layers), *tail]


def _tp_rule(
    p: _Param,
    tp2: list[dict[tuple[str, int | None, int | None], _Param]] | None,
    vocab: tuple[int, int, int] | None,
) -> tuple[Rule, tuple[int, ...]]:
    """``p``'s tensor-parallel rule and logical shape: from the TP2 probes, or the TP1-only rule."""
    if tp2 is None:
        return _tp1_rule(p, vocab)
    pair = tuple(r.get(p.ident) for r in tp2)
    if None in pair:
        raise GeometryDerivationError(f"{p.name}: not on both TP ranks of TP2")
    return _rule(p, pair, vocab if p.layer is None else None)  # type: ignore[arg-type]


def _layer_param(p: _Param, rule: Rule, shape: tuple[int, ...]) -> LayerParam:
    """A decoder layer's parameter as every layer of its kind has it, once its name is checked to be
    ``decoder.layers.<its layer>.<...>``."""
    match = _LAYER_NAME.match(p.name)
    if match is None or int(match.group(1)) != p.layer:
        raise GeometryDerivationError(
            f"{p.name}: Megatron checkpoints it as decoder layer {p.layer}; LiveR expects the name "
            f"decoder.layers.{p.layer}.<...>"
        )
    suffix = match.group(2) if p.expert is None else _expert_suffix(p, match.group(2))
    return LayerParam(suffix, shape, p.dtype, rule, p.expert is not None, p.buffer)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- in a fresh interpreter


def _child(work: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    try:
        torch.set_num_threads(1)
        results.put((work(*args), None))
    except BaseException as exc:  # reported to the parent, which raises
        results.put((None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


_DAEMON_FLAG = threading.Lock()


def in_subprocess(work: Callable[..., Any], args: tuple[Any, ...], what: str, timeout_s: float) -> Any:
    """``work(*args)`` in a spawned interpreter: its result, or :class:`GeometryDerivationError`."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_child, args=(work, args, results), daemon=True)
    # multiprocessing refuses children to a daemonic process (a training process some launchers start
    # as one). This child is joined or killed before we return and dies with us (it is a daemon too),
    # which is what the rule protects, so the flag is lifted for its start only.
    # Spawning re-imports the training script as ``__mp_main__``: it must guard its entry point with
    # ``if __name__ == "__main__"``, as any script that uses multiprocessing must.
    here = multiprocessing.current_process()
    with _DAEMON_FLAG:
        daemonic = here._config.get("daemon")  # type: ignore[attr-defined]
        here._config["daemon"] = False  # type: ignore[attr-defined]
        try:
            child.start()
        finally:
            here._config["daemon"] = daemonic  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                result, error = results.get(timeout=1.0)
                break
            except queue.Empty:
                if not child.is_alive():
                    raise GeometryDerivationError(
                        f"the interpreter {what} exited with code {child.exitcode} before answering (is "
                        "the provider importable by name there?)"
                    ) from None
                if time.monotonic() > deadline:
                    raise GeometryDerivationError(f"{what} took more than {timeout_s} s") from None
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if error is not None:
        raise GeometryDerivationError(f"{what} failed: {error}")
    return result


def _derive(provider: Provider, kwargs: dict[str, Any]) -> ModelGeometry:
    return derive_geometry(provider, **kwargs)


def derive_geometry_in_subprocess(
    provider: Provider, *, timeout_s: float = 600.0, **kwargs: Any
) -> ModelGeometry:
    """:func:`derive_geometry` in a spawned interpreter (``provider`` must be importable by name there):
    for a process that already has a default world, such as a training process under ``torchrun``."""
    return in_subprocess(_derive, (provider, kwargs), "deriving the geometry", timeout_s)


# --------------------------------------------------------------------------- checking a built model


def takes_vp_stage(provider: Callable[..., Any]) -> bool:
    """Whether ``provider`` accepts ``vp_stage=`` (a parameter of that name, or ``**kwargs``)."""
    try:
        parameters = inspect.signature(provider).parameters.values()
    except (TypeError, ValueError):  # a builtin or an object without a signature: let the call tell
        return True
    return any(p.name == "vp_stage" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def call_provider(
    provider: Callable[..., Any], layout: ParallelLayout, pg_collection: Any
) -> list[torch.nn.Module]:
    """The rank's model chunks from ``provider`` (one without virtual pipelining)."""
    if layout.vpp == 1:
        return [provider(layout, pg_collection)]
    if not takes_vp_stage(provider):
        raise InputError(
            f"provider: {layout.describe()} interleaves {layout.vpp} model chunks per stage; the provider "
            "must take vp_stage (provider(layout, pg_collection, vp_stage=v), as Megatron-LM's "
            "model_provider) and build chunk v with it"
        )
    return [provider(layout, pg_collection, vp_stage=v) for v in range(layout.vpp)]


class GeometryMismatch(HandoffError):
    """A built model whose ``sharded_state_dict()`` disagrees with the geometry a plan was made for."""


def model_geometry_mismatches(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    geometry: ModelGeometry,
    layout: ParallelLayout,
    rank: int,
    *,
    metadata: dict[str, Any] | None = None,
    limit: int = 20,
) -> list[str]:
    """Where ``model`` (this rank's part, built at ``layout``) and the view function of ``geometry``
    disagree, parameter by parameter: the boxes Megatron says each parameter covers against the boxes
    the plan will stream into it. Empty when they agree.

    Run on every build of a user's model (:meth:`.source.ModelSource.build`): a joiner's in its mock
    warm-up, before the cut; a staying rank's when it builds the new world's model after the cut, before
    any byte is streamed into it (a mismatch there rolls the handoff back). With virtual pipeline
    chunks ``model`` is the rank's chunks, all of them: together they hold its part.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from liver.reshard.views import view

    problems: list[str] = []
    tensors = {t.name: t for t in geometry.tensors(optimizer=False)}
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    names: dict[int, str] = {}
    values: list[Any] = []
    for chunk in chunks:
        names.update({id(p): n for n, p in chunk.named_parameters()})
        names.update({id(b): n for n, b in chunk.named_buffers() if id(b) not in names})
        values.extend(nested_values(chunk.sharded_state_dict(metadata=metadata)))
    covered: dict[str, list[tuple[tuple[int, int], ...] | None]] = {}
    for value in values:
        if not isinstance(value, (ShardedTensor, ShardedTensorFactory)) or id(value.data) not in names:
            continue
        local = names[id(value.data)]
        built = [value] if isinstance(value, ShardedTensor) else list(nested_values({"x": value.build()}))
        layer, expert, skip = _stacking(built[0])
        match = _LAYER_NAME.match(local)
        if layer is not None and match is not None:
            name = f"decoder.layers.{layer}.{match.group(2)}"
        elif local in tensors or expert is not None:
            name = local
        else:
            name = value.key  # a replica filed under another parameter's key (tied embeddings)
        if expert is not None:  # the local expert's name, with its global index
            name = _global_expert_name(name, expert, geometry)
        tensor = tensors.get(name)
        if tensor is None:
            problems.append(f"{local}: no parameter of {geometry.name} is called {name}")
            continue
        for sh in built:
            offset, size = tuple(sh.global_offset[skip:]), tuple(sh.local_shape)
            covered.setdefault(name, []).append(_liver_box(tensor, geometry, offset, size))
    for name, tensor in tensors.items():
        shard = view(tensor, geometry, layout, rank)
        want = None if shard is None else shard.box
        boxes = covered.get(name)
        if boxes is None:
            if shard is not None:
                problems.append(f"{name}: the plan streams {want} into it, the model has no such parameter")
            continue
        got = _merge(boxes)
        if shard is None:
            problems.append(f"{name}: the model holds {got}, the plan gives this rank none of it")
        elif got != want:
            problems.append(f"{name}: the model covers {got}, the plan {want}")
        if len(problems) >= limit:
            break
    return problems


def _global_expert_name(name: str, expert: int, geometry: ModelGeometry) -> str:
    """``name`` (with its global layer index) with its local expert index replaced by ``expert``: the
    component that a geometry template matching it has as ``{expert}``."""
    parts = name.split(".")
    for p in geometry.parameters:
        if not p.expert:
            continue
        template = p.name.split(".")
        if len(parts) == len(template) and all(
            a == b
            for a, b in zip(parts, template, strict=True)
            if b not in (EXPERT_PLACEHOLDER, LAYER_PLACEHOLDER)
        ):
            return ".".join(str(expert) if b == EXPERT_PLACEHOLDER else a for a, b in zip(parts, template))
    return name  # reported as no such parameter


def _liver_box(
    tensor: TensorSpec, geometry: ModelGeometry, offset: tuple[int, ...], size: tuple[int, ...]
) -> tuple[tuple[int, int], ...] | None:
    """The logical box one Megatron shard covers (``None``: vocabulary padding only)."""
    if tensor.rule == "vocab":
        lo, hi = offset[0], min(offset[0] + size[0], tensor.shape[0])
        if lo >= hi:
            return None
        return ((lo, hi), *((0, n) for n in tensor.shape[1:]))
    if tensor.rule == "swiglu":
        ffn = tensor.shape[1]
        half, lo = divmod(offset[0], ffn)
        return ((half, half + 1), (lo, lo + size[0]), *((0, n) for n in tensor.shape[2:]))
    return tuple((o, o + n) for o, n in zip(offset, size, strict=True))


def _merge(boxes: list[tuple[tuple[int, int], ...] | None]) -> tuple[tuple[int, int], ...] | str | None:
    """One box from a parameter's pieces: SwiGLU's gate and up halves with the same rows make one."""
    if len(boxes) == 1:
        return boxes[0]
    real = sorted(b for b in boxes if b is not None)
    if len(real) == 2 and real[0][0] == (0, 1) and real[1][0] == (1, 2) and real[0][1:] == real[1][1:]:
        return ((0, 2), *real[0][1:])
    return f"{len(boxes)} pieces {boxes}"


def check_model_geometry(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    geometry: ModelGeometry,
    layout: ParallelLayout,
    rank: int,
    *,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Raise :class:`GeometryMismatch` naming the first disagreements of :func:`model_geometry_mismatches`
    (``metadata`` goes to ``sharded_state_dict``: the world's ``dp_cp_group`` when it is not
    ``parallel_state``'s)."""
    problems = model_geometry_mismatches(model, geometry, layout, rank, metadata=metadata)
    if problems:
        raise GeometryMismatch(
            f"rank {rank} at {layout.describe()}: the model does not match the geometry of "
            f"{geometry.name} ({geometry.digest()}): " + "; ".join(problems[:5])
        )


def check_layout_geometry(provider: Provider, geometry: ModelGeometry, layout: ParallelLayout) -> None:
    """Build ``provider``'s model on the meta device as one rank of every (stage, TP rank, EP rank,
    expert-TP rank) of ``layout`` (the other ranks build alike) under the fake process group, and check
    each against ``geometry``: raises :class:`GeometryMismatch` naming the rank and the parameters.
    Needs a process without a default world (``MegatronJob.check_layout`` runs it in a spawned
    interpreter for one that has one)."""
    from liver.worker_runtime.megatron.build import groups_from_parallel_state

    geometry.check_layout(layout)
    for rank in layout.class_representatives().values():
        with _fake_world(layout, rank):
            groups = groups_from_parallel_state(layout)
            try:
                with torch.device("meta"):
                    model = call_provider(provider, layout, groups.collection())
            except InputError:
                raise
            except Exception as exc:  # the user's code: reported with the rank it failed at
                raise GeometryMismatch(
                    f"the provider failed to build rank {rank} of {layout.describe()}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            check_model_geometry(model, geometry, layout, rank, metadata={"dp_cp_group": groups.dp_cp})
