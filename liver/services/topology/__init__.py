"""Topology planner: from the surviving and added devices, the target (TP, PP, DP) layout and its
placement. ``memory`` and ``cost`` are the documented models, ``chooser`` the pure core; see
``docs/topology-model.md``."""

from .chooser import (
    CandidateScore,
    TopologyDecision,
    TopologyError,
    assess_layout,
    balanced_split,
    choose_topology,
)
from .cost import StepCost, bubble_fraction, step_cost
from .memory import (
    CPU_SMALL,
    H100_80GB,
    PROFILES,
    HardwareProfile,
    MemoryEstimate,
    SetupError,
    StageMemory,
    TrainingSetup,
    memory_estimate,
)

__all__ = [
    "CPU_SMALL",
    "H100_80GB",
    "PROFILES",
    "CandidateScore",
    "HardwareProfile",
    "MemoryEstimate",
    "SetupError",
    "StageMemory",
    "StepCost",
    "TopologyDecision",
    "TopologyError",
    "TrainingSetup",
    "assess_layout",
    "balanced_split",
    "bubble_fraction",
    "choose_topology",
    "memory_estimate",
    "step_cost",
]
