"""LiveR: live reconfiguration for elastic LLM training.

The names a training script needs, in one place::

    from liver import LiveRuntime, MegatronJob, ModelSpec, TrainConfig, WorldSpec, ...

Everything else stays in its module (``liver.services.*``, ``liver.worker_runtime.*``, ``liver.shared.*``).
The exports load on first use (PEP 562): ``import liver`` alone, which every ``liver`` command does,
pulls in neither torch nor Megatron-core, so a service starts in a fraction of a second. The error
families (:class:`LiverError` and those under it) are plain and load at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from liver.shared.errors import BusError, HandoffError, InputError, LiverError, PlanningError

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the same names load lazily
    from liver.reshard.plan import Plan, WorldConfig
    from liver.reshard.planner import plan_resize
    from liver.shared.geometry import ModelGeometry
    from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement, grid_devices
    from liver.shared.logs import configure_logging
    from liver.shared.model import ModelError, ModelSpec, load_model
    from liver.worker_runtime.companion.bridge import RuntimeBridge
    from liver.worker_runtime.companion.thread import Companion
    from liver.worker_runtime.contract import (
        BuildsForStream,
        Checkpoints,
        ChecksLayouts,
        FeedsPeerCopies,
        JobAbilities,
        KeptState,
        RecoversLive,
        TrainerFactory,
    )
    from liver.worker_runtime.copies.manager import CopyOptions
    from liver.worker_runtime.generations import HandoffState
    from liver.worker_runtime.handoff import HandoffAborted, HandoffFailed, SwitchReport
    from liver.worker_runtime.megatron.build import pipeline_split
    from liver.worker_runtime.megatron.datasets import MegatronCorpus, prepare_corpus
    from liver.worker_runtime.megatron.geometry import derive_geometry, derive_geometry_in_subprocess
    from liver.worker_runtime.megatron.job import MegatronJob, load_job
    from liver.worker_runtime.megatron.layer_spec import (
        SequenceParallelTorchNorm,
        local_block_spec,
        local_mtp_block_spec,
    )
    from liver.worker_runtime.megatron.source import ModelSource
    from liver.worker_runtime.megatron.train import TrainerHooks
    from liver.worker_runtime.megatron.train_config import TrainConfig
    from liver.worker_runtime.peers import StepAbandoned
    from liver.worker_runtime.runtime import (
        AbortReport,
        CheckpointOptions,
        FallbackReport,
        LiveRuntime,
        ReshardPhase,
        ResizeRejected,
        RuntimeEvent,
        RuntimeOptions,
    )
    from liver.worker_runtime.worker_main import InitialWorld, WorkerSettings, run_worker
    from liver.worker_runtime.world import StoreAddress, WorldSpec, host_store

_LAZY: dict[str, str] = {
    # the runtime, one call per iteration
    "LiveRuntime": "liver.worker_runtime.runtime",
    "RuntimeOptions": "liver.worker_runtime.runtime",
    "CheckpointOptions": "liver.worker_runtime.runtime",
    "CopyOptions": "liver.worker_runtime.copies.manager",
    "RuntimeEvent": "liver.worker_runtime.runtime",
    "ReshardPhase": "liver.worker_runtime.runtime",
    "AbortReport": "liver.worker_runtime.runtime",
    "FallbackReport": "liver.worker_runtime.runtime",
    "ResizeRejected": "liver.worker_runtime.runtime",
    "SwitchReport": "liver.worker_runtime.handoff",
    "HandoffAborted": "liver.worker_runtime.handoff",
    "HandoffFailed": "liver.worker_runtime.handoff",
    "StepAbandoned": "liver.worker_runtime.peers",
    "HandoffState": "liver.worker_runtime.generations",
    # the job contract: what a job implements, and what each optional part unlocks
    "BuildsForStream": "liver.worker_runtime.contract",
    "Checkpoints": "liver.worker_runtime.contract",
    "ChecksLayouts": "liver.worker_runtime.contract",
    "FeedsPeerCopies": "liver.worker_runtime.contract",
    "JobAbilities": "liver.worker_runtime.contract",
    "KeptState": "liver.worker_runtime.contract",
    "RecoversLive": "liver.worker_runtime.contract",
    "TrainerFactory": "liver.worker_runtime.contract",
    # one training process on the bus (what `liver worker` runs)
    "WorkerSettings": "liver.worker_runtime.worker_main",
    "InitialWorld": "liver.worker_runtime.worker_main",
    "run_worker": "liver.worker_runtime.worker_main",
    "load_job": "liver.worker_runtime.megatron.job",
    # the Megatron-core job
    "MegatronJob": "liver.worker_runtime.megatron.job",
    "ModelSource": "liver.worker_runtime.megatron.source",
    "TrainerHooks": "liver.worker_runtime.megatron.train",
    "MegatronCorpus": "liver.worker_runtime.megatron.datasets",
    "prepare_corpus": "liver.worker_runtime.megatron.datasets",
    "derive_geometry": "liver.worker_runtime.megatron.geometry",
    "local_block_spec": "liver.worker_runtime.megatron.layer_spec",
    "local_mtp_block_spec": "liver.worker_runtime.megatron.layer_spec",
    "pipeline_split": "liver.worker_runtime.megatron.build",
    "SequenceParallelTorchNorm": "liver.worker_runtime.megatron.layer_spec",
    "derive_geometry_in_subprocess": "liver.worker_runtime.megatron.geometry",
    "TrainConfig": "liver.worker_runtime.megatron.train_config",
    # worlds and where they meet
    "WorldSpec": "liver.worker_runtime.world",
    "StoreAddress": "liver.worker_runtime.world",
    "host_store": "liver.worker_runtime.world",
    # the bus side inside a training process
    "Companion": "liver.worker_runtime.companion.thread",
    "RuntimeBridge": "liver.worker_runtime.companion.bridge",
    # models, layouts and plans
    "ModelSpec": "liver.shared.model",
    "ModelGeometry": "liver.shared.geometry",
    "ModelError": "liver.shared.model",
    "load_model": "liver.shared.model",
    "ParallelLayout": "liver.shared.layout",
    "Placement": "liver.shared.layout",
    "Device": "liver.shared.layout",
    "LayoutError": "liver.shared.layout",
    "grid_devices": "liver.shared.layout",
    "Plan": "liver.reshard.plan",
    "WorldConfig": "liver.reshard.plan",
    "plan_resize": "liver.reshard.planner",
    "configure_logging": "liver.shared.logs",
}

__all__ = [
    "AbortReport",
    "BuildsForStream",
    "BusError",
    "CheckpointOptions",
    "Checkpoints",
    "ChecksLayouts",
    "Companion",
    "CopyOptions",
    "Device",
    "FallbackReport",
    "FeedsPeerCopies",
    "HandoffAborted",
    "HandoffError",
    "HandoffFailed",
    "HandoffState",
    "InitialWorld",
    "InputError",
    "JobAbilities",
    "KeptState",
    "LayoutError",
    "LiveRuntime",
    "LiverError",
    "MegatronCorpus",
    "MegatronJob",
    "ModelError",
    "ModelGeometry",
    "ModelSource",
    "ModelSpec",
    "ParallelLayout",
    "Placement",
    "Plan",
    "PlanningError",
    "RecoversLive",
    "ReshardPhase",
    "ResizeRejected",
    "RuntimeBridge",
    "RuntimeEvent",
    "RuntimeOptions",
    "SequenceParallelTorchNorm",
    "StepAbandoned",
    "StoreAddress",
    "SwitchReport",
    "TrainConfig",
    "TrainerFactory",
    "TrainerHooks",
    "WorkerSettings",
    "WorldConfig",
    "WorldSpec",
    "configure_logging",
    "derive_geometry",
    "derive_geometry_in_subprocess",
    "grid_devices",
    "host_store",
    "load_job",
    "load_model",
    "local_block_spec",
    "local_mtp_block_spec",
    "pipeline_split",
    "plan_resize",
    "prepare_corpus",
    "run_worker",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'liver' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
