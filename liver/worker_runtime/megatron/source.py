"""Which model a Megatron job trains: how to build this rank's part of it at a layout, and its geometry.

The adapter (trainer, state mapping, checkpoints, live switch) never looks at a model's architecture:
it needs a way to build the model for a world and the model's geometry (what the plans move). A
:class:`ModelSource` is those two things, from either

* a :class:`~liver.shared.model.ModelSpec` (LiveR's presets and the demo): built by
  :func:`~.build.build_gpt_model`, geometry :meth:`ModelSpec.geometry`; or
* the user's own **model provider**, the function their Megatron-core training script already has,
  given the layout and the world's process groups: ``provider(layout, pg_collection) -> GPTModel``.
  Its geometry is derived from Megatron's own ``sharded_state_dict()`` (:mod:`.geometry`).

Every build of a user's model is checked against the geometry, box for box (a metadata walk, no
collective): the new world's model is built during the handoff, so a provider that builds something
other than what the plan moves fails there, naming the parameter, instead of corrupting the state.
Seeds follow Megatron's training loop for both (``seed + 100 * pp_rank`` before the build).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from liver.shared.errors import InputError
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import ParallelLayout
from liver.shared.model import ModelRef, ModelSpec
from liver.worker_runtime.megatron.build import (
    ParallelGroups,
    build_gpt_chunks,
    check_default_world,
    ensure_global_memory_buffer,
    seed_build,
)
from liver.worker_runtime.megatron.cpu_shim import apply_cpu_shim
from liver.worker_runtime.megatron.pinned_state import parallel_state_of

__all__ = [
    "ModelSource",
    "UserProvider",
    "as_source",
    "load_callable",
    "load_provider",
    "reference_of",
    "source_of",
]

UserProvider = Callable[..., torch.nn.Module]
"""The user's model provider, ``provider(layout, pg_collection)``: this rank's part of the model at
``layout`` on the given groups (pass ``pg_collection`` to ``GPTModel``; the first and last stage are
``pg_collection.pp.rank() == 0`` and ``== pg_collection.pp.size() - 1``), unwrapped and cast to its
training dtype. With virtual pipeline parallelism (``layout.vpp > 1``) it is called once per model chunk
as ``provider(layout, pg_collection, vp_stage=v)``, as Megatron-LM's ``model_provider(..., vp_stage)``:
chunk ``v`` is ``GPTModel(..., vp_stage=v)`` with ``virtual_pipeline_model_parallel_size`` in its config,
pre-processing on chunk 0 of the first stage and post-processing on the last chunk of the last."""


@dataclass(frozen=True)
class ModelSource:
    """How to build the model at a layout, and its geometry. Make one with :meth:`from_spec` or
    :meth:`from_provider`."""

    name: str
    geometry: ModelGeometry
    vocab_size: int
    """The real vocabulary: the loss masks logits past it, the data draws tokens below it."""
    max_sequence_length: int
    spec: ModelSpec | None = None
    provider: UserProvider | None = None
    provider_ref: str | None = None
    """``MODULE:FUNCTION`` or ``FILE.py:FUNCTION`` when the provider was loaded by name: how another
    interpreter finds it (a provider loaded from a file is not importable by its module name)."""

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelSource:
        return cls(
            name=spec.name,
            geometry=spec.geometry(),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_sequence_length,
            spec=spec,
        )

    @classmethod
    def from_provider(
        cls,
        provider: UserProvider,
        geometry: ModelGeometry,
        *,
        max_sequence_length: int,
        reference: str | None = None,
    ) -> ModelSource:
        """The user's model, whose ``geometry`` was derived from it (:mod:`.geometry`)."""
        if geometry.vocab_size is None:
            raise ValueError("`geometry`: a language model needs a vocabulary tensor (vocab_size is None)")
        if max_sequence_length < 1:
            raise ValueError(f"`max_sequence_length`: must be at least 1, got {max_sequence_length}")
        return cls(
            name=geometry.name,
            geometry=geometry,
            vocab_size=geometry.vocab_size,
            max_sequence_length=max_sequence_length,
            provider=provider,
            provider_ref=reference,
        )

    def build(
        self,
        layout: ParallelLayout,
        groups: ParallelGroups,
        *,
        seed: int,
        config_overrides: Mapping[str, Any] | None = None,
    ) -> list[torch.nn.Module]:
        """This rank's part of the model at ``layout`` on ``groups`` (the default world's): its model
        chunks (one without virtual pipeline parallelism).

        ``config_overrides`` (dropout) apply to a ``ModelSpec``'s model; a user's model keeps the
        settings of the user's own ``TransformerConfig``.
        """
        if self.spec is not None:
            return build_gpt_chunks(
                self.spec, layout, groups=groups, seed=seed, config_overrides=config_overrides
            )
        assert self.provider is not None
        from liver.worker_runtime.megatron.geometry import call_provider, check_model_geometry

        self.geometry.check_layout(layout)
        apply_cpu_shim()
        check_default_world(groups)
        ensure_global_memory_buffer()
        seed_build(seed, layout, groups.rank)
        with parallel_state_of(groups):  # a provider (and the tied output layer) may ask parallel_state
            chunks = call_provider(self.provider, layout, groups.collection())
            check_model_geometry(
                chunks, self.geometry, layout, groups.rank, metadata={"dp_cp_group": groups.dp_cp}
            )
        return chunks


def as_source(model: ModelSpec | ModelSource) -> ModelSource:
    """A source for either (a ``ModelSpec`` is the preset's source)."""
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, ModelSpec):
        return ModelSource.from_spec(model)
    raise TypeError(f"`model`: expected a ModelSpec or a ModelSource, got {type(model).__name__}")


def load_provider(reference: str) -> UserProvider:
    """The provider ``MODULE:FUNCTION`` or ``FILE.py:FUNCTION`` names; errors name what is missing."""
    return load_callable(reference, "provider")


def load_callable(reference: str, what: str) -> Callable[..., Any]:
    """The function ``MODULE:FUNCTION`` or ``FILE.py:FUNCTION`` names (a file is loaded as a module of
    its own); :class:`InputError` names ``what`` and the part that is missing or fails to import."""
    where, _, name = reference.rpartition(":")
    if not where or not name:
        raise InputError(f"{what} {reference!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise InputError(f"{what} {reference!r}: no such file {where}")
            spec = importlib.util.spec_from_file_location(f"liver_provider_{path.stem}", path)
            if spec is None or spec.loader is None:
                raise InputError(f"{what} {reference!r}: {where} is not a Python file")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except InputError:
        raise
    except Exception as exc:  # the user's file: a syntax error, an import that fails, ...
        raise InputError(
            f"{what} {reference!r}: cannot import {where}: {type(exc).__name__}: {exc}"
        ) from None
    found = getattr(module, name, None)
    if not callable(found):
        raise InputError(f"{what} {reference!r}: {where} has no function {name!r}")
    return found


def reference_of(function: Callable[..., Any], loaded_from: str) -> str | None:
    """``FILE.py:NAME`` (or ``MODULE:NAME``) for a module-level ``function`` of the module that
    ``loaded_from`` (a :func:`load_callable` reference) loaded, so that another interpreter can find it
    too; None for anything else (a closure, a function of another module)."""
    where, _, _ = loaded_from.rpartition(":")
    name = getattr(function, "__name__", None)
    module = sys.modules.get(getattr(function, "__module__", "") or "")
    if name is None or module is None or getattr(module, name, None) is not function:
        return None
    if where.endswith(".py"):
        path = getattr(module, "__file__", None)
        if path is None or Path(path).resolve() != Path(where).resolve():
            return None
        return f"{Path(where).resolve()}:{name}"
    return f"{module.__name__}:{name}" if module.__name__ == where else None


def source_of(ref: ModelRef) -> ModelSource:
    """The source a :class:`~liver.shared.model.ModelRef` names (its provider imported here)."""
    if ref.spec is not None:
        return ModelSource.from_spec(ref.spec)
    assert ref.provider is not None and ref.geometry is not None and ref.max_sequence_length is not None
    return ModelSource.from_provider(
        load_provider(ref.provider),
        ref.geometry,
        max_sequence_length=ref.max_sequence_length,
        reference=ref.provider,
    )
