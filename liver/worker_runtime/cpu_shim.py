"""Make megatron-core 0.16.1 run on a machine without CUDA.

Megatron-core assumes a GPU in a few places (``torch.cuda.current_device()``, ``Tensor.cuda()``, the
CUDA RNG). On a CPU-only torch each of them raises "Torch not compiled with CUDA enabled", so LiveR's
tests and its CPU demo could not build or train a model at all. This module is the one place that
bridges that gap. Its rules:

* :func:`apply_cpu_shim` does nothing when ``torch.cuda.is_available()``: on a GPU machine Megatron runs
  unmodified.
* Every patch only turns a call that would raise on a CPU-only torch into its CPU meaning. Nothing that
  already works changes behaviour.
* Patches are narrow: a megatron module gets its own view of ``torch`` (its global name ``torch`` is
  rebound; the real ``torch`` module is never modified), or one megatron function runs under a
  thread-local torch function mode. Nothing outside megatron sees a difference.
* Each patch is listed in :data:`PATCHES` with the reason it exists. Later work (training steps, DDP
  grad buffers, the optimizer, pipeline p2p; see ``shared/notes/megatron-on-cpu.md``) adds entries here
  with the same two tools rather than patching elsewhere.
"""

from __future__ import annotations

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
    """``torch`` as one megatron module sees it: the real module with a CPU-backed ``cuda``."""

    def __init__(self, cuda: _CudaAsCpu) -> None:
        super().__init__("torch")
        self.cuda = cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _give_module_cpu_cuda(module_name: str, **cuda_overrides: Any) -> None:
    """Rebind ``torch`` inside ``module_name`` to a view whose ``torch.cuda`` has ``cuda_overrides``."""
    module = importlib.import_module(module_name)
    if module.__dict__.get("torch") is not torch:
        raise RuntimeError(f"{module_name} does not hold the torch module as `torch`; the shim is stale")
    module.torch = _TorchWithCpuCuda(_CudaAsCpu(cuda_overrides))


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


def _run_method_with_cuda_calls_on_cpu(owner: type, name: str) -> None:
    """Wrap ``owner.name`` so its body runs under :class:`_CudaCallsOnCpu`."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _CudaCallsOnCpu():
            return original(*args, **kwargs)

    wrapper.__liver_cpu_shim__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _current_device() -> torch.device:
    return _CPU


def _patch_global_memory_buffer() -> None:
    _give_module_cpu_cuda("megatron.core.utils", current_device=_current_device)


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


def _patch_tied_embedding_sync() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _run_method_with_cuda_calls_on_cpu(LanguageModule, "setup_embeddings_and_output_layer")


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
            target="megatron.core.utils (module view of torch.cuda.current_device)",
            why="GlobalMemoryBuffer.get_tensor allocates with device=torch.cuda.current_device(); "
            "sequence-parallel gathers and some fused paths draw their scratch tensors from it.",
        ),
        _patch_global_memory_buffer,
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
