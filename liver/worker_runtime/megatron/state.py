"""A trainer's whole training state as LiveR sees it: local tensors by logical index, plus progress.

The executor streams *local state*: a mapping from an index into the model geometry's ``tensors()`` to
the torch tensor that holds this rank's shard of that logical tensor (``local_shape`` of the view, the
box at local index 0). :func:`local_state` gives exactly that for a live :class:`MegatronTrainer`:

* parameters, and the optimizer's fp32 master weights (half-precision models), ``exp_avg`` and
  ``exp_avg_sq``, as *views of the live storage*: a stream that writes into them (``into=``) writes the
  new model directly, and an old world's state is read where it lies;
* the Adam step as a fresh int64 scalar (Megatron keeps a float32 step per parameter; they must agree).

It maps the live parameters (``named_parameters()``) rather than ``sharded_state_dict()``: the latter
fragments SwiGLU's fc1 into copies, and with tied embeddings still consults ``parallel_state``.
``tests/reshard/test_views_megatron.py`` checks that the two agree on every shard. The translations:

* a later stage numbers its layers from 0; the logical name carries the global index
  (``TransformerLayer.layer_number - 1``);
* the last stage's ``output_layer.weight`` with tied embeddings is its replica of
  ``embedding.word_embeddings.weight`` (and so are its Adam moments);
* SwiGLU's fused ``[2*ffn/tp, h]`` fc1 is viewed as ``[2, ffn/tp, h]`` (gate rows, then up rows);
* vocabulary shards keep their padding rows (``local_shape`` includes them; they hold zeros, see
  :mod:`.train`).

Every tensor is checked against the view function when the state is taken and when it is loaded: a
mismatch raises :class:`StateMismatch` naming the tensor. The rest of the training state is
:class:`TrainingProgress` (iteration, data position, LR schedule, RNG streams).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import torch
from torch.optim.optimizer import _get_scalar_dtype

from liver.reshard.dist_opt import OwnedPiece, owned_pieces, owned_ranges
from liver.reshard.holdings import holding, is_dp_sharded, pieces_of
from liver.shared.errors import InputError
from liver.shared.geometry import MTP_PREFIX, ModelGeometry, TensorSpec
from liver.shared.layout import ParallelLayout
from liver.shared.model import as_geometry
from liver.worker_runtime.stream.executor import LocalTensor

if TYPE_CHECKING:  # megatron is imported where it is used: the checks and structs need none of it
    from liver.worker_runtime.megatron.trainer import MegatronTrainer

log = structlog.get_logger(__name__)

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}
_MOMENTS = ("exp_avg", "exp_avg_sq")
_LAYERS = "decoder.layers."
_LOCAL_EXPERTS = "mlp.experts.local_experts."


class StateMismatch(InputError):
    """A local state that does not agree with the view function (or the model) for some tensor."""


# --------------------------------------------------------------------------- checking


def expected_shards(
    spec: ModelGeometry, layout: ParallelLayout, rank: int
) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Tensor index -> the local shape of each piece, for every tensor ``rank`` holds (the holdings:
    one piece, or the owned pieces of optimizer state under the distributed optimizer)."""
    spec = as_geometry(spec)
    out: dict[int, tuple[tuple[int, ...], ...]] = {}
    for index, tensor in enumerate(spec.tensors()):
        pieces = holding(tensor, spec, layout, rank)
        if pieces is not None:
            out[index] = tuple(tuple(p.local_shape) for p in pieces)
    return out


def check_local_state(
    state: Mapping[int, LocalTensor],
    spec: ModelGeometry,
    layout: ParallelLayout,
    rank: int,
    *,
    complete: bool = True,
) -> None:
    """Raise :class:`StateMismatch` unless ``state`` holds exactly what the views give ``rank``: a tensor
    per held tensor, and a tuple of one tensor per piece for DP-sharded optimizer state.

    ``complete=False`` accepts a subset (a partly assembled state); shapes and dtypes still must match.
    """
    spec = as_geometry(spec)
    tensors = spec.tensors()
    expected = expected_shards(spec, layout, rank)
    for index, value in state.items():
        if not isinstance(index, int) or not 0 <= index < len(tensors):
            raise StateMismatch(f"state[{index!r}]: no tensor of {spec.name} has that index")
        name = tensors[index].name
        if index not in expected:
            raise StateMismatch(
                f"state[{index}] ({name}): rank {rank} holds no shard of it at {layout.describe()}"
            )
        sharded = is_dp_sharded(tensors[index], spec)
        pieces = value if sharded and isinstance(value, tuple) else (value,)
        if sharded != isinstance(value, tuple) or len(pieces) != len(expected[index]):
            raise StateMismatch(
                f"state[{index}] ({name}) is a {type(value).__name__}, the view at {layout.describe()} "
                f"rank {rank} holds {len(expected[index])} piece(s)"
                + (" as a tuple" if sharded else " as a tensor")
            )
        want = _TORCH_DTYPES[tensors[index].dtype]
        for piece, shape in zip(pieces, expected[index]):
            if not isinstance(piece, torch.Tensor):
                raise StateMismatch(f"state[{index}] ({name}) is a {type(piece).__name__}, not a tensor")
            if tuple(piece.shape) != shape:
                raise StateMismatch(
                    f"state[{index}] ({name}) has shape {tuple(piece.shape)}, the view at "
                    f"{layout.describe()} rank {rank} says {shape}"
                )
            if piece.dtype != want:
                raise StateMismatch(f"state[{index}] ({name}) has dtype {piece.dtype}, the model says {want}")
    if complete:
        missing = sorted(expected.keys() - state.keys())
        if missing:
            raise StateMismatch(
                f"state lacks {len(missing)} tensor(s) rank {rank} holds, first {tensors[missing[0]].name} "
                f"(index {missing[0]})"
            )


# --------------------------------------------------------------------------- live tensors


def logical_name(model: torch.nn.Module, local_name: str) -> str:
    """The logical tensor name of one of a GPT model's ``named_parameters()``."""
    if local_name.startswith(_LAYERS):
        index, _, rest = local_name.removeprefix(_LAYERS).partition(".")
        layer = model.decoder.layers[int(index)]
        if rest.startswith(_LOCAL_EXPERTS):
            # An EP rank numbers its experts from 0; the logical name carries the global expert index.
            local, _, tail = rest.removeprefix(_LOCAL_EXPERTS).partition(".")
            expert = layer.mlp.local_expert_indices[int(local)]
            rest = f"{_LOCAL_EXPERTS}{expert}.{tail}"
        return f"{_LAYERS}{layer.layer_number - 1}.{rest}"
    if local_name.startswith(MTP_PREFIX):  # a multi-token prediction layer (all on the last stage)
        index, _, rest = local_name.removeprefix(MTP_PREFIX).partition(".")
        head = f"{MTP_PREFIX}{index}.transformer_layer."
        if local_name.startswith(head + _LOCAL_EXPERTS):
            local, _, tail = local_name.removeprefix(head + _LOCAL_EXPERTS).partition(".")
            layer = model.mtp.layers[int(index)].transformer_layer
            return f"{head}{_LOCAL_EXPERTS}{layer.mlp.local_expert_indices[int(local)]}.{tail}"
        return local_name
    if local_name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False):
        return "embedding.word_embeddings.weight"
    return local_name


def named_parameters(trainer: MegatronTrainer) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """``(logical name, local name, parameter)`` of every model chunk's parameters, chunk by chunk."""
    for chunk in trainer.chunks:
        for local_name, param in chunk.named_parameters():
            yield logical_name(chunk, local_name), local_name, param


def named_buffers(trainer: MegatronTrainer) -> Iterator[tuple[str, torch.Tensor]]:
    """``(logical name, buffer)`` of every model chunk's buffers."""
    for chunk in trainer.chunks:
        for local_name, buffer in chunk.named_buffers():
            yield logical_name(chunk, local_name), buffer


def _optimizer_slots(trainer: MegatronTrainer) -> dict[int, tuple[torch.Tensor, torch.optim.Optimizer]]:
    """id(model parameter) -> (the tensor the optimizer updates, the torch optimizer holding its state).

    Under the distributed optimizer that tensor is the 1-D fp32 shard of the range this rank owns
    (a view of the parameter buffer for fp32 parameters), and parameters it owns nothing of are absent.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    slots: dict[int, tuple[torch.Tensor, torch.optim.Optimizer]] = {}
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        if isinstance(opt, DistributedOptimizer):
            # Its parameter groups list the fp32 parameters' shards before the 16-bit ones' masters,
            # so a group of both is not in model_param_group_index_map's order: pair them by kind.
            for models, mains in (
                (opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                (opt.model_fp32_groups, opt.shard_fp32_groups),
            ):
                for model_group, main_group in zip(models, mains):
                    for model_param, main_param in zip(model_group, main_group):
                        slots[id(model_param)] = (main_param, opt.optimizer)
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for model_param, main_param in zip(model_group, main_group):
                    slots[id(model_param)] = (main_param, opt.optimizer)
            for group in opt.fp32_from_fp32_groups:
                for param in group:
                    slots[id(param)] = (param, opt.optimizer)
        elif isinstance(opt, FP32Optimizer):
            if opt.optimizer is None:
                continue
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    slots[id(param)] = (param, opt.optimizer)
        else:
            raise StateMismatch(
                f"optimizer {type(opt).__name__}: only FP32Optimizer and Float16OptimizerWithFloat16Params "
                "state maps to logical tensors"
            )
    return slots


def _adam_state(main: torch.Tensor, inner: torch.optim.Optimizer, zeroed: bool = True) -> dict[str, Any]:
    """The Adam state of ``main``, created as Adam's first step would create it if it does not exist yet
    (zero moments, step 0), so that a fresh optimizer has storage to stream into; with ``zeroed=False``
    the moments are only allocated (a trainer the stream fills: the runtime zeroes them off the
    training thread, and the stream overwrites them)."""
    state = inner.state[main]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        make = torch.zeros_like if zeroed else torch.empty_like
        for moment in _MOMENTS:
            state[moment] = make(main, memory_format=torch.preserve_format)
    return state


def _as_local(tensor: torch.Tensor, spec: TensorSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` (live storage) viewed with the logical local shape; SwiGLU's fused rows fold in two."""
    if tuple(tensor.shape) == shape:
        return tensor
    if spec.rule == "swiglu" and tensor.numel() == torch.Size(shape).numel():
        return tensor.view(shape)
    raise StateMismatch(
        f"{spec.name}: the live tensor has shape {tuple(tensor.shape)}, the view says {shape}"
    )


def _step_value(steps: list[torch.Tensor]) -> int:
    values = {float(s) for s in steps}
    if len(values) > 1:
        raise StateMismatch(f"optimizer.state.step: parameters disagree on the Adam step ({sorted(values)})")
    value = values.pop() if values else 0.0
    if value != int(value) or value < 0:
        raise StateMismatch(f"optimizer.state.step: {value} is not a step count")
    return int(value)


def local_state(trainer: MegatronTrainer) -> dict[int, LocalTensor]:
    """This rank's local state: views of the live parameters and Adam state, and the step as a copy.

    Under the distributed optimizer the master weights and moments are the pieces of the range this
    rank owns (:func:`liver.reshard.dist_opt.owned_pieces`): views into the optimizer's 1-D shards.
    Checked against the holdings before it is returned. Creating the view of a fresh optimizer creates
    its (zero) Adam state, exactly as its first step would.
    """
    spec, layout, rank = trainer.geometry, trainer.layout, trainer.groups.rank
    tensors = spec.tensors()
    index_of = {t.name: i for i, t in enumerate(tensors)}
    expected = expected_shards(spec, layout, rank)
    slots = _optimizer_slots(trainer)
    owned = owned_pieces(spec, layout, rank) if spec.distributed else {}
    ranges = owned_ranges(spec, layout, rank) if spec.distributed else {}
    state: dict[int, LocalTensor] = {}
    steps: list[torch.Tensor] = []
    for name, local_name, param in named_parameters(trainer):
        index = index_of.get(name)
        if index is None:
            raise StateMismatch(f"parameter {local_name} (as {name}) is no tensor of {spec.name}")
        if index not in expected:
            raise StateMismatch(
                f"{name}: rank {rank} holds it, the view at {layout.describe()} says it must not"
            )
        if index in state:
            raise StateMismatch(f"{name}: two parameters of the model map to it")
        (shape,) = expected[index]
        state[index] = _as_local(param.detach(), tensors[index], shape)
        slot = slots.get(id(param))
        if spec.distributed:
            if slot is not None:
                main, inner = slot
                adam = _adam_state(main, inner, zeroed=not trainer.filled_by_stream)
                steps.append(adam["step"])
                if name not in ranges:
                    raise StateMismatch(f"{name}: the optimizer owns a range of it the planner does not")
                lo, hi = ranges[name]
                _add_owned(state, index_of, tensors, name, main, adam, owned.get(name, ()), param, hi - lo)
            continue
        if slot is None:
            raise StateMismatch(f"{name}: the optimizer does not update this parameter")
        main, inner = slot
        adam = _adam_state(main, inner, zeroed=not trainer.filled_by_stream)
        steps.append(adam["step"])
        if f"optimizer.state.fp32_param.{name}" in index_of:
            state[index_of[f"optimizer.state.fp32_param.{name}"]] = _as_local(
                main.detach(), tensors[index_of[f"optimizer.state.fp32_param.{name}"]], shape
            )
        elif main is not param:
            raise StateMismatch(f"{name}: the optimizer keeps a master copy the model description lacks")
        for role in _MOMENTS:
            moment_index = index_of[f"optimizer.state.{role}.{name}"]
            state[moment_index] = _as_local(adam[role], tensors[moment_index], shape)
    if spec.has_buffers:
        _add_buffers(trainer, state, index_of, tensors, expected)
    step_index = index_of["optimizer.state.step"]
    # A rank that owns no optimizer state (distributed optimizer) has no Adam step of its own: the
    # trainer counts the steps its optimizer took, the same number on every rank.
    step = _step_value(steps) if steps else trainer.adam_steps
    state[step_index] = torch.tensor(step, dtype=torch.int64)
    check_local_state(state, spec, layout, rank)
    return state


def _add_buffers(
    trainer: MegatronTrainer,
    state: dict[int, LocalTensor],
    index_of: Mapping[str, int],
    tensors: tuple[TensorSpec, ...],
    expected: Mapping[int, tuple[tuple[int, ...], ...]],
) -> None:
    """The persistent buffers the geometry lists (the router's ``expert_bias``): views of the live
    buffers, as parameters are."""
    for name, buffer in named_buffers(trainer):
        index = index_of.get(name)
        if index is None or tensors[index].role != "buffer":
            continue  # not training state (a non-persistent scratch buffer)
        if index not in expected:
            raise StateMismatch(f"{tensors[index].name}: this rank holds it, the view says it must not")
        (shape,) = expected[index]
        state[index] = _as_local(buffer.detach(), tensors[index], shape)


def _add_owned(
    state: dict[int, LocalTensor],
    index_of: Mapping[str, int],
    tensors: tuple[TensorSpec, ...],
    name: str,
    main: torch.Tensor,
    adam: Mapping[str, torch.Tensor],
    pieces: tuple[OwnedPiece, ...],
    param: torch.Tensor,
    owned_size: int,
) -> None:
    """The owned pieces of ``name``'s master weights and moments, as views of the optimizer's shards."""
    flats: dict[str, torch.Tensor] = {role: adam[role] for role in _MOMENTS}
    fp32_name = f"optimizer.state.fp32_param.{name}"
    if fp32_name in index_of:
        flats["fp32_param"] = main
    elif main.dtype != param.dtype:
        raise StateMismatch(f"{name}: the optimizer keeps a master copy the model description lacks")
    for role, flat in flats.items():
        if flat.dim() != 1 or flat.numel() != owned_size:
            raise StateMismatch(
                f"optimizer.state.{role}.{name}: the optimizer's shard has {flat.numel()} elements, the "
                f"range this rank owns {owned_size}"
            )
    if not pieces:
        return  # it owns padding only: nothing of it is state
    for role, flat in flats.items():
        index = index_of[f"optimizer.state.{role}.{name}"]
        state[index] = tuple(
            flat.detach()[p.offset : p.offset + math.prod(p.local_shape)].view(p.local_shape) for p in pieces
        )


def snapshot(trainer: MegatronTrainer) -> dict[int, LocalTensor]:
    """A copy of :func:`local_state` that later training does not change."""
    return {
        index: tuple(t.clone() for t in value) if isinstance(value, tuple) else value.clone()
        for index, value in local_state(trainer).items()
    }


def load_local_state(trainer: MegatronTrainer, state: Mapping[int, LocalTensor]) -> None:
    """Make ``trainer``'s parameters and Adam state equal ``state`` (a complete local state for its
    rank, e.g. what the executor assembled). Tensors that already are the live storage are left as they
    are; the step is written to every parameter's Adam state."""
    spec, layout, rank = trainer.geometry, trainer.layout, trainer.groups.rank
    check_local_state(state, spec, layout, rank)
    live = local_state(trainer)
    step_index = next(i for i, t in enumerate(spec.tensors()) if t.role == "step")
    with torch.no_grad():
        for index, target in live.items():
            if index == step_index:
                continue
            for to, source in zip(pieces_of(target), pieces_of(state[index])):
                if source.data_ptr() != to.data_ptr():
                    to.copy_(source)
    step = float(int(pieces_of(state[step_index])[0]))
    slots = _optimizer_slots(trainer)
    for main, inner in slots.values():
        inner.state[main]["step"].fill_(step)
    trainer.adam_steps = int(step)
    if spec.distributed:
        _check_params_follow_master(trainer, slots)
    log.debug("megatron_state.loaded", layout=layout.describe(), rank=rank, tensors=len(live), step=int(step))


def _check_params_follow_master(
    trainer: MegatronTrainer, slots: Mapping[int, tuple[torch.Tensor, torch.optim.Optimizer]]
) -> None:
    """Under the distributed optimizer Megatron keeps every 16-bit parameter equal to its fp32 master
    rounded (each owner writes its range after the step, then DP gathers): a loaded state must agree,
    or the next all-gather would silently replace parameters by other values."""
    spec, layout, rank = trainer.geometry, trainer.layout, trainer.groups.rank
    owned = owned_ranges(spec, layout, rank)
    with torch.no_grad():
        for name, _, param in named_parameters(trainer):
            slot = slots.get(id(param))
            if slot is None or param.dtype == torch.float32:
                continue
            lo, hi = owned[name]
            if not torch.equal(param.detach().reshape(-1)[lo:hi], slot[0].detach().to(param.dtype)):
                raise StateMismatch(
                    f"{name}: the loaded parameter is not its loaded fp32 master rounded to {param.dtype} "
                    f"on the range rank {rank} owns"
                )


# --------------------------------------------------------------------------- non-tensor state


class SchedulerState(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Megatron's ``OptimizerParamScheduler.state_dict()`` (steps are samples, as Megatron counts)."""

    max_lr: float
    min_lr: float
    lr_warmup_steps: int
    lr_decay_steps: int
    lr_decay_style: str
    num_steps: int
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    wd_incr_style: str


class RngState(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One process's random streams: torch's CPU generator (the device generator too on CPU), the
    model-parallel tracker's named streams, and Python's ``random``."""

    torch_cpu: bytes
    tracker: dict[str, bytes]
    python: tuple[int, tuple[int, ...], float | None]


class TrainingProgress(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything besides tensors that a resumed job needs. ``consumed_samples`` is the data position;
    the global batch size is part of it because it must not change across a reshard."""

    iteration: int
    consumed_samples: int
    global_batch_size: int
    scheduler: SchedulerState
    rng: RngState | None = None

    def __post_init__(self) -> None:
        for field in ("iteration", "consumed_samples"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must not be negative, got {getattr(self, field)}")
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be at least 1, got {self.global_batch_size}")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def rng_state() -> RngState:
    """This process's random streams now."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    version, internal, gauss = random.getstate()
    return RngState(
        torch_cpu=_tensor_bytes(torch.get_rng_state()),
        tracker={name: _tensor_bytes(state) for name, state in tracker.items()},
        python=(version, tuple(internal), gauss),
    )


def restore_rng_state(state: RngState) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(_bytes_tensor(state.torch_cpu))
    tensor_parallel.get_cuda_rng_tracker().set_states(
        {name: _bytes_tensor(data) for name, data in state.tracker.items()}
    )
    random.setstate((state.python[0], tuple(state.python[1]), state.python[2]))


def training_progress(trainer: MegatronTrainer, *, with_rng: bool = True) -> TrainingProgress:
    """The trainer's non-tensor state (this process's RNG streams when ``with_rng``)."""
    return TrainingProgress(
        iteration=trainer.iteration,
        consumed_samples=trainer.consumed_samples,
        global_batch_size=trainer.config.global_batch_size,
        scheduler=msgspec.convert(trainer.scheduler.state_dict(), SchedulerState),
        rng=rng_state() if with_rng else None,
    )


def restore_progress(trainer: MegatronTrainer, progress: TrainingProgress) -> None:
    """Put a freshly built trainer at ``progress`` (its schedule must be the one that produced it)."""
    if progress.global_batch_size != trainer.config.global_batch_size:
        raise StateMismatch(
            f"global_batch_size: the progress was made with {progress.global_batch_size}, the trainer "
            f"uses {trainer.config.global_batch_size} (it must stay constant)"
        )
    if trainer.scheduler.num_steps != 0:
        raise StateMismatch("restore_progress needs a trainer that has not stepped yet")
    current = msgspec.convert(trainer.scheduler.state_dict(), SchedulerState)
    for field in SchedulerState.__struct_fields__:
        if field != "num_steps" and getattr(current, field) != getattr(progress.scheduler, field):
            raise StateMismatch(
                f"scheduler.{field}: the progress has {getattr(progress.scheduler, field)!r}, the trainer "
                f"{getattr(current, field)!r}"
            )
    trainer.scheduler.load_state_dict(msgspec.to_builtins(progress.scheduler))
    trainer.iteration = progress.iteration
    trainer.consumed_samples = progress.consumed_samples
    if progress.rng is not None:
        restore_rng_state(progress.rng)
