"""The three ways a job can follow a capacity change, and what each phase costs under a calibration.

* ``megatron``: stop-and-restart from the last checkpoint, as Megatron-LM does. The job notices a change
  only when it happens (a node gone, a node granted), rolls back to its last durable checkpoint (the
  paper's baseline saves nothing at the event), relaunches every process on the new device set, loads
  the checkpoint, initialises the distributed runtime and warms up.
* ``ucp``: the same restart with a checkpoint loaded and resharded at load time (Universal Checkpointing,
  ByteCheckpoint): only the load is faster.
* ``liver``: live reconfiguration. On a warning (or a granted node) the new world is prepared while the
  old one trains; the job pauses only for the switch and the layer-streamed transfer, timed as late as the
  warning allows (scale-in) or as soon as preparation is done (scale-out). When the preparation cannot
  finish before the deadline, or a node fails without notice, it reshards around the lost node from
  surviving DP replicas (:mod:`.survival`), and falls back to a Megatron-LM restart only when some state
  was held by lost nodes alone.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .calibration import Calibration
from .transitions import Transition

PolicyName = Literal["megatron", "ucp", "liver"]
POLICY_NAMES: tuple[PolicyName, ...] = ("megatron", "ucp", "liver")
LABELS: dict[str, str] = {
    "megatron": "Megatron-LM checkpoint",
    "ucp": "UCP (load-time reshape)",
    "liver": "LiveR",
}


class Policy(msgspec.Struct, frozen=True, kw_only=True):
    name: PolicyName
    label: str
    live: bool
    """Prepares the new world behind training and pauses only for switch + transfer."""
    load_factor: float
    """The restart's checkpoint load relative to Megatron-LM's (LiveR's fallback loads as Megatron)."""


def make_policy(name: str, calibration: Calibration) -> Policy:
    if name == "megatron":
        return Policy(name="megatron", label=LABELS[name], live=False, load_factor=1.0)
    if name == "ucp":
        return Policy(name="ucp", label=LABELS[name], live=False, load_factor=calibration.ucp_load_factor)
    if name == "liver":
        return Policy(name="liver", label=LABELS[name], live=True, load_factor=1.0)
    raise ValueError(f"unknown policy {name!r}; policies: {', '.join(POLICY_NAMES)}")


def restart_phases(calibration: Calibration, transition: Transition, load_factor: float) -> dict[str, float]:
    """Seconds of each restart phase (table 1's breakdown) to bring up ``transition``'s new world."""
    load = calibration.load_s(transition.load_max_rank_bytes, transition.load_total_bytes) * load_factor
    return {
        "misc": calibration.misc_s,
        "checkpoint_load": load,
        "init_warmup": calibration.init_s(transition.new_devices),
    }


def live_preparation_s(calibration: Calibration, transition: Transition) -> float:
    """Shadow world bootstrap + (mock) warm-up + planning, all overlapped with training; new processes
    are launched first when fresh nodes join."""
    launch = calibration.misc_s if transition.uses_fresh else 0.0
    return launch + calibration.init_s(transition.new_devices) + calibration.plan_s


def live_phases(calibration: Calibration, transition: Transition) -> dict[str, float]:
    """Seconds of the paused part of a live handoff."""
    return {"switch": calibration.switch_s, "transfer": transition.transfer_s}
