"""Make megatron-core 0.16.1 run on a machine without CUDA.

Megatron-core assumes a GPU in a few places (``torch.cuda.current_device()``, ``device="cuda"``,
``Tensor.cuda()``, ``torch.cuda.synchronize()``, the CUDA RNG, ``'torch.cuda.FloatTensor'`` type
strings). On a CPU-only torch each of them raises "Torch not compiled with CUDA enabled" or fails a
device check, so LiveR's tests and its CPU demo could not build or train a model at all. This module is
the one place that bridges that gap; with it, GPTModel, 1F1B pipelining, Megatron DDP, its optimizers
(FP32, mixed precision and distributed) and gradient clipping run on CPU processes over gloo. Its rules:

* :func:`apply_cpu_shim` does nothing when ``torch.cuda.is_available()``: on a GPU machine Megatron runs
  unmodified.
* Every patch only turns a call that would raise (or a check that would reject a CPU tensor) on a
  CPU-only torch into its CPU meaning. Nothing that already works changes behaviour, and the arithmetic
  is untouched: a patched run computes bit for bit what the unpatched code computes on the CPU.
* Patches are narrow: a megatron module gets its own view of ``torch`` (its global name ``torch`` is
  rebound; the real ``torch`` module is never modified), or one megatron function runs under a
  thread-local torch function mode. Nothing outside megatron sees a difference.
* Each patch is listed in :data:`PATCHES` with the reason it exists; new ones are added here with the
  same two tools rather than patching elsewhere (see ``shared/notes/megatron-on-cpu.md``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import torch
from torch.overrides import TorchFunctionMode

log = structlog.get_logger(__name__)


class ShimPatch(msgspec.Struct, frozen=True):
    """One documented patch: where it applies and why Megatron needs it on a CPU-only torch."""

    target: str
    why: str


_CPU = torch.device("cpu")


class _CudaAsCpu(types.ModuleType):
    """``torch.cuda`` as one megatron module sees it: the current device is the CPU.

    Only the names given as overrides change; every other attribute is the real ``torch.cuda``'s.
    """

    def __init__(self, overrides: dict[str, Any]) -> None:
        super().__init__("torch.cuda")
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchWithCpuCuda(types.ModuleType):
    """``torch`` as one megatron module sees it: the real module with a CPU-backed ``cuda``.

    ``overrides`` replace top-level names too (the tensor factories that take ``device="cuda"``).
    """

    def __init__(self, cuda: _CudaAsCpu, overrides: dict[str, Any] | None = None) -> None:
        super().__init__("torch")
        self.cuda = cuda
        self.__dict__.update(overrides or {})

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _give_module_cpu_cuda(
    module_name: str, torch_overrides: dict[str, Any] | None = None, **cuda_overrides: Any
) -> None:
    """Rebind ``torch`` inside ``module_name`` to a view whose ``torch.cuda`` has ``cuda_overrides``
    (and whose top-level names have ``torch_overrides``)."""
    module = importlib.import_module(module_name)
    if module.__dict__.get("torch") is not torch:
        raise RuntimeError(f"{module_name} does not hold the torch module as `torch`; the shim is stale")
    module.torch = _TorchWithCpuCuda(_CudaAsCpu(cuda_overrides), torch_overrides)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


def _factory_on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``factory`` with a ``device="cuda"`` keyword turned into the CPU (any other device untouched)."""

    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    return wrapper


# The factories megatron's training modules call with a literal ``device="cuda"``.
_CPU_FACTORIES: dict[str, Any] = {
    name: _factory_on_cpu(getattr(torch, name)) for name in ("tensor", "zeros", "ones", "empty", "full")
}


def _no_op(*args: Any, **kwargs: Any) -> None:
    """``torch.cuda.synchronize`` on a CPU: every CPU op (gloo's included) has finished when it returns."""


def _give_module_cpu_device(module_name: str) -> None:
    """The module's ``torch.cuda.current_device()`` is the CPU, ``torch.cuda.synchronize()`` returns at
    once, and its tensor factories place ``device="cuda"`` tensors on the CPU."""
    _give_module_cpu_cuda(module_name, _CPU_FACTORIES, current_device=_current_device, synchronize=_no_op)


class _CudaCallsOnCpu(TorchFunctionMode):
    """Inside this mode ``Tensor.cuda()`` returns the tensor itself (it is already where it will live).

    Torch function modes are thread-local, so a companion thread is never affected.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


class _CpuTensorsReportCudaTypes(TorchFunctionMode):
    """Inside this mode ``Tensor.type()`` spells a CPU tensor's type as its CUDA twin
    (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``), for megatron's string checks of the device.

    Only the no-argument form (the type query) changes; ``Tensor.type(dtype)`` casts as before.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if (
            func is torch.Tensor.type
            and len(args) == 1
            and not kwargs
            and isinstance(result, str)
            and result.startswith("torch.")
            and not result.startswith("torch.cuda.")
        ):
            return "torch.cuda." + result.removeprefix("torch.")
        return result


def _under_mode(original: Callable[..., Any], mode: type[TorchFunctionMode]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with mode():
            return original(*args, **kwargs)

    wrapper.__liver_cpu_shim__ = original  # type: ignore[attr-defined]
    return wrapper


def _run_method_under_mode(owner: type, name: str, mode: type[TorchFunctionMode]) -> None:
    """Wrap ``owner.name`` so its body runs under the thread-local torch function ``mode``."""
    setattr(owner, name, _under_mode(getattr(owner, name), mode))


def _run_method_with_cuda_calls_on_cpu(owner: type, name: str) -> None:
    """Wrap ``owner.name`` so its body runs under :class:`_CudaCallsOnCpu`."""
    _run_method_under_mode(owner, name, _CudaCallsOnCpu)


def _run_function_under_mode(module_names: tuple[str, ...], name: str, mode: type[TorchFunctionMode]) -> None:
    """Rebind the function ``name`` to one that runs under ``mode``, in every module that imported it
    by name (the first module defines it; the others hold a reference made at import time)."""
    modules = [importlib.import_module(m) for m in module_names]
    original = getattr(modules[0], name)
    wrapper = _under_mode(original, mode)
    for module in modules:
        if getattr(module, name) is not original:
            raise RuntimeError(f"{module.__name__}.{name} is not {module_names[0]}.{name}; the shim is stale")
        setattr(module, name, wrapper)


def _current_device() -> torch.device:
    return _CPU


def _patch_megatron_utils() -> None:
    _give_module_cpu_device("megatron.core.utils")


class _DropCpuRngWarning(logging.Filter):
    """With the CPU as the device, the device RNG *is* the CPU RNG, so it changes inside every fork."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def _cpu_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _patch_rng_tracker() -> None:
    module_name = "megatron.core.tensor_parallel.random"
    _give_module_cpu_cuda(
        module_name,
        current_device=_current_device,
        get_rng_state=_cpu_rng_state,
        set_rng_state=_set_cpu_rng_state,
        manual_seed=torch.manual_seed,
    )
    module = importlib.import_module(module_name)
    module._get_cuda_rng_state = _cpu_rng_state
    module._set_cuda_rng_state = _set_cpu_rng_state
    logging.getLogger(module_name).addFilter(_DropCpuRngWarning())


_DEVICE_MODULES = (
    "megatron.core.transformer.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
)


def _patch_training_devices() -> None:
    for module_name in _DEVICE_MODULES:
        if module_name != _BUFFERS:
            _give_module_cpu_device(module_name)
    streams = {"Stream": _new_stream, "default_stream": _current_stream, "stream": _on_stream}
    _give_module_cpu_cuda(
        _BUFFERS, _CPU_FACTORIES, current_device=_current_device, synchronize=_no_op, **streams
    )
    _give_module_cpu_cuda(
        "megatron.core.distributed.distributed_data_parallel", current_device=_current_device, **streams
    )


_BUFFERS = "megatron.core.distributed.param_and_grad_buffer"


def _patch_device_type_checks() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    _run_function_under_mode(
        ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"),
        "clip_grad_by_total_norm_fp32",
        _CpuTensorsReportCudaTypes,
    )
    _run_method_under_mode(Float16OptimizerWithFloat16Params, "__init__", _CpuTensorsReportCudaTypes)
    _run_method_under_mode(DistributedOptimizer, "__init__", _CpuTensorsReportCudaTypes)


def _patch_tied_embedding_sync() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _run_method_with_cuda_calls_on_cpu(LanguageModule, "setup_embeddings_and_output_layer")


class _NoStream:
    """A CUDA stream on a CPU: work is ordered by the one thread that issues it, so waiting, recording
    and synchronising have nothing to do."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoStream:
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_NO_STREAM = _NoStream()


def _current_stream(device: Any = None) -> _NoStream:
    return _NO_STREAM


def _new_stream(*args: Any, **kwargs: Any) -> _NoStream:
    return _NoStream()


def _on_stream(stream: Any) -> contextlib.nullcontext[None]:
    """``torch.cuda.stream(s)``: nothing to switch; reusable, as DDP enters one such context twice."""
    return contextlib.nullcontext()


def _split_list(sizes: Any) -> Any:
    """Split sizes as ``all_to_all_single`` takes them: a list of ints (gloo refuses a tensor)."""
    if isinstance(sizes, torch.Tensor):
        return [int(n) for n in sizes.tolist()]
    if sizes is not None and not isinstance(sizes, list):
        return [int(n) for n in sizes]
    return sizes


def _all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Any = None,
    input_split_sizes: Any = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    return torch.distributed.all_to_all_single(
        output,
        input,
        output_split_sizes=_split_list(output_split_sizes),
        input_split_sizes=_split_list(input_split_sizes),
        group=group,
        async_op=async_op,
    )


def _all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """``all_gather`` into outputs of different first dimensions, which gloo refuses: every rank pads
    its input to the largest, gathers, and each output keeps its own rows (the same values)."""
    sizes = {t.shape[0] for t in tensor_list}
    if len(sizes) <= 1:
        return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    rows = max(sizes)
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    gathered = [tensor.new_empty((rows, *tensor.shape[1:])) for _ in tensor_list]
    torch.distributed.all_gather(gathered, padded, group=group)
    for out, got in zip(tensor_list, gathered):
        out.copy_(got[: out.shape[0]])
    return None


class _DistributedOnGloo(types.ModuleType):
    """``torch.distributed`` as megatron's tensor-parallel mappings see it: uneven ``all_gather`` and
    tensor split sizes work on gloo (the only two calls that change)."""

    def __init__(self) -> None:
        super().__init__("torch.distributed")
        self.all_to_all_single = _all_to_all_single
        self.all_gather = _all_gather

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


def _patch_moe() -> None:
    streams = {"Stream": _new_stream, "current_stream": _current_stream, "stream": _on_stream}
    for module_name in (
        "megatron.core.transformer.moe.router",
        "megatron.core.transformer.moe.experts",
        "megatron.core.tensor_parallel.layers",
    ):
        _give_module_cpu_device(module_name)
    _give_module_cpu_cuda(
        "megatron.core.transformer.moe.token_dispatcher",
        _CPU_FACTORIES,
        current_device=_current_device,
        synchronize=_no_op,
        **streams,
    )
    _give_module_cpu_cuda(
        "megatron.core.transformer.moe.moe_utils", _CPU_FACTORIES, current_device=_current_device, **streams
    )
    _give_module_cpu_cuda(
        "megatron.core.tensor_parallel.mappings",
        {**_CPU_FACTORIES, "distributed": _DistributedOnGloo()},
        current_device=_current_device,
    )
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if "te_general_gemm" not in moe_utils.__dict__:
        moe_utils.te_general_gemm = None


_REGISTRY: tuple[tuple[ShimPatch, Callable[[], None]], ...] = (
    (
        ShimPatch(
            target="megatron.core.tensor_parallel.random (module view of torch.cuda; "
            "_get_cuda_rng_state, _set_cuda_rng_state)",
            why="model_parallel_cuda_manual_seed and CudaRNGStatesTracker.add/fork read and write the "
            "CUDA generator (torch.cuda.get_rng_state raises, _set_cuda_rng_state silently queues a "
            "lazy call that never runs). On CPU the device generator is the CPU generator, so the "
            "tracker seeds, forks and restores torch's CPU RNG: dropout inside tensor-parallel regions "
            "gets its own per-TP-rank stream exactly as on a GPU. Megatron's 'CPU RNG state changed "
            "within GPU RNG context' warning is dropped because it is always true here.",
        ),
        _patch_rng_tracker,
    ),
    (
        ShimPatch(
            target="megatron.core.utils (module view of torch: torch.cuda.current_device is the CPU, "
            "device='cuda' factories allocate on the CPU)",
            why="GlobalMemoryBuffer.get_tensor allocates with device=torch.cuda.current_device(); "
            "the local attention and sequence-parallel gathers draw their scratch tensors from it. "
            "Without apex or Transformer Engine, the grad-norm fallback local_multi_tensor_l2_norm "
            "returns its result on device='cuda'.",
        ),
        _patch_megatron_utils,
    ),
    (
        ShimPatch(
            target="LanguageModule.setup_embeddings_and_output_layer (Tensor.cuda() is a no-op inside)",
            why="With tied embeddings and PP>1 the last stage zero-fills its copy of the word "
            "embeddings and all-reduces it with the first stage after `weight.data.cuda()`; on CPU "
            "the weight is already where the gloo all-reduce needs it.",
        ),
        _patch_tied_embedding_sync,
    ),
    (
        ShimPatch(
            target="megatron.core.transformer.utils, "
            "megatron.core.models.common.embeddings.rotary_pos_embedding, "
            "megatron.core.pipeline_parallel.{p2p_communication,schedules}, "
            "megatron.core.distributed.{param_and_grad_buffer,distributed_data_parallel}, "
            "megatron.core.optimizer.{optimizer,"
            "clip_grads,distrib_optimizer} (module view of torch: torch.cuda.current_device is the "
            "CPU, torch.cuda.synchronize returns at once, tensor factories put device='cuda' on the CPU)",
            why="A training step allocates on the GPU by name: the default causal attention mask "
            "(device='cuda', used when no mask is passed), RoPE's frequencies (moved to "
            "current_device on first use), pipeline receive buffers and shape "
            "messages (current_device), the schedules' token counter (device='cuda'), DDP's "
            "contiguous grad (and distributed-optimizer param) buffers (current_device), the "
            "optimizers' loss scale and found-inf flags and clip_grads' norm accumulators "
            "(device='cuda'). p2p calls torch.cuda.synchronize after batch_isend_irecv to guard a NCCL "
            "race; gloo's waits have already completed every CPU transfer when they return. With "
            "several distributed-optimizer instances DDP makes a communication stream at build "
            "(megatron.core.distributed.distributed_data_parallel) and, with overlap_grad_reduce, "
            "reduces on it and waits for the default stream (the buffer's view of torch.cuda has "
            "Stream, default_stream and a reusable stream context that do nothing).",
        ),
        _patch_training_devices,
    ),
    (
        ShimPatch(
            target="clip_grad_by_total_norm_fp32 (in clip_grads and optimizer), "
            "Float16OptimizerWithFloat16Params.__init__, DistributedOptimizer.__init__ "
            "(Tensor.type() spells CPU types as torch.cuda.* inside)",
            why="These check the device with type strings: clipping asserts every grad is a "
            "'torch.cuda.FloatTensor', and the mixed-precision and distributed optimizers accept only "
            "'torch.cuda.{Float,Half,BFloat16}Tensor' parameters. The dtype half of each check still "
            "applies; only the device half, which is the CPU by construction here, is answered as "
            "Megatron expects.",
        ),
        _patch_device_type_checks,
    ),
)

_REGISTRY += (
    (
        ShimPatch(
            target="megatron.core.transformer.moe.{router,experts,token_dispatcher,moe_utils}, "
            "megatron.core.tensor_parallel.{layers,mappings} (module views of torch: current_device is "
            "the CPU, device='cuda' factories allocate on the CPU, CUDA streams are no-ops; the "
            "mappings' torch.distributed takes tensor split sizes and uneven all_gather on gloo); "
            "moe_utils.te_general_gemm = None when Transformer Engine is absent",
            why="Mixtures of experts: the router moves its weight to current_device and allocates its "
            "aux-loss bookkeeping there, SequentialMLP's and the sequence-parallel gathers' buffers are "
            "allocated on current_device, the all-to-all dispatcher makes a CUDA stream at build and "
            "moves its split sizes through it (on a CPU they stay tensors, which gloo's "
            "all_to_all_single refuses), the all-to-all dispatcher with TP > 1 gathers uneven token "
            "counts (gloo's all_gather refuses outputs of different sizes: pad, gather, trim), and the "
            "router's gemm refers to te_general_gemm, which is only bound when Transformer Engine "
            "imports (a NameError otherwise).",
        ),
        _patch_moe,
    ),
)

_REGISTRY += (
    (
        ShimPatch(
            target="megatron.core.transformer.multi_token_prediction (module view of torch: "
            "current_device is the CPU, device='cuda' factories allocate on the CPU)",
            why="Multi-token prediction: the MTP loss tracker (MTPLossLoggingHelper.save_loss_to_tracker) "
            "allocates its per-layer losses on torch.cuda.current_device(), as does the roll of labels "
            "across context-parallel ranks.",
        ),
        lambda: _give_module_cpu_device("megatron.core.transformer.multi_token_prediction"),
    ),
)

PATCHES: tuple[ShimPatch, ...] = tuple(patch for patch, _ in _REGISTRY)

_lock = threading.Lock()
_applied = False


def apply_cpu_shim() -> bool:
    """Apply every patch once when CUDA is absent; return whether the shim is active.

    Safe to call from every entry point that builds or runs a Megatron model: later calls are free.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    with _lock:
        if not _applied:
            for patch, apply in _REGISTRY:
                apply()
                log.debug("cpu_shim.patched", target=patch.target)
            _applied = True
    return True


def cpu_shim_active() -> bool:
    """Whether :func:`apply_cpu_shim` has patched megatron in this process."""
    return _applied
