"""The simulator's cost constants: one msgspec Struct, loaded from a JSON file, every number with its source.

A calibration says what each phase of a reconfiguration costs; the simulator never invents a duration
that is not derived from one of these fields, the model description and the planners' output:

* stop-and-restart (Megatron-LM checkpoint): ``misc_s`` + checkpoint load + ``init_s(n)``, where the load
  reads each rank's shard of the training state at ``storage_bw_per_device``, capped by the shared
  storage's ``storage_bw_aggregate`` (``load_s``), and progress since the last checkpoint
  (``checkpoint_interval_s``) is lost;
* checkpoint with load-time reshape (UCP): the same with the load multiplied by ``ucp_load_factor``;
* live reconfiguration (LiveR): preparation ``init_s(n) + plan_s`` overlapped with training, then a
  pause of ``switch_s`` plus the layer-streamed transfer, timed per streaming round from the real plan
  over the hardware profile's intra- and inter-node bandwidths plus ``round_latency_s`` per round.

``sources`` maps every numeric field to where its value comes from (a paper table or section, a spec
sheet, or the command of this project that measured or fitted it); loading a file whose ``sources``
misses a field is an error, so an undocumented number cannot slip in.
"""

from __future__ import annotations

import importlib.resources
from typing import Annotated

import msgspec
from msgspec import Meta

from liver.services.topology.memory import HardwareProfile, TrainingSetup
from liver.shared.errors import InputError

DEFAULT_PROFILE = "paper-a800"

_DOCUMENTED = (
    "devices_per_node",
    "misc_s",
    "storage_bw_per_device",
    "storage_bw_aggregate",
    "init_base_s",
    "init_per_rank_s",
    "checkpoint_interval_s",
    "ucp_load_factor",
    "plan_s",
    "switch_s",
    "round_latency_s",
    "staging_bytes",
    "transfer_optimizer_state",
    "hardware",
    "setup",
)


class CalibrationError(InputError):
    """A calibration file that is missing, unreadable or inconsistent; the message names the field."""


class Calibration(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Cost constants of one testbed (see the module docstring for how each is used)."""

    name: str
    description: str
    hardware: HardwareProfile
    """Device memory and FLOPs for the topology planner; its bandwidths also time the live transfer."""
    setup: TrainingSetup
    """Batch geometry the topology planner checks layouts against."""
    devices_per_node: Annotated[int, Meta(ge=1)]
    misc_s: Annotated[float, Meta(ge=0)]
    """Restart: process launch, setup and synchronisation outside load and init."""
    storage_bw_per_device: Annotated[float, Meta(gt=0)]
    """Restart: bytes/s one rank reads its checkpoint shard at."""
    storage_bw_aggregate: Annotated[float, Meta(gt=0)]
    """Restart: bytes/s the shared checkpoint storage serves to all ranks together."""
    init_base_s: Annotated[float, Meta(ge=0)]
    init_per_rank_s: Annotated[float, Meta(ge=0)]
    """Distributed init + warm-up of an ``n``-rank world: ``init_base_s + init_per_rank_s * n``."""
    checkpoint_interval_s: Annotated[float, Meta(ge=0)]
    """Seconds of training between durable checkpoints; 0 checkpoints continuously (nothing is lost)."""
    ucp_load_factor: Annotated[float, Meta(ge=0)]
    """UCP's checkpoint load time as a fraction of Megatron-LM's."""
    plan_s: Annotated[float, Meta(ge=0)]
    """Live: topology and transfer planning, part of the preparation overlapped with training."""
    switch_s: Annotated[float, Meta(ge=0)]
    """Live: the atomic switch (drain, cut agreement, process-group swap): paused."""
    round_latency_s: Annotated[float, Meta(ge=0)]
    """Live: fixed cost of one streaming round (launch, wait-all, barrier)."""
    staging_bytes: Annotated[int, Meta(ge=1)]
    """Live: the staging buffer B, the planner's per-round receive budget."""
    transfer_optimizer_state: bool
    """Live: whether the handoff moves Adam state and fp32 master weights, or the parameters only."""
    sources: dict[str, str]

    def __post_init__(self) -> None:
        missing = [f for f in _DOCUMENTED if not self.sources.get(f, "").strip()]
        if missing:
            raise CalibrationError(f"sources: no source given for {', '.join(missing)}")
        unknown = sorted(set(self.sources) - set(_DOCUMENTED))
        if unknown:
            raise CalibrationError(f"sources: {', '.join(unknown)} are not calibration fields")

    def init_s(self, ranks: int) -> float:
        """Distributed initialisation and warm-up of a world of ``ranks`` ranks."""
        return self.init_base_s + self.init_per_rank_s * ranks

    def load_s(self, max_rank_bytes: float, total_bytes: float) -> float:
        """Megatron-LM checkpoint load: the slowest rank's read, or the storage's, whichever is longer."""
        return max(max_rank_bytes / self.storage_bw_per_device, total_bytes / self.storage_bw_aggregate)

    def transfer_link_s(self, intra_bytes: float, inter_bytes: float) -> float:
        """One rank's share of a streaming round: its bytes over the node's links and over the network
        (the testbed's NIC sits behind the same PCIe complex, so the two add up)."""
        return (
            intra_bytes / self.hardware.intra_node_bandwidth
            + inter_bytes / self.hardware.inter_node_bandwidth
        )


def load_calibration(name_or_path: str = DEFAULT_PROFILE) -> Calibration:
    """A bundled profile by name (``liver/sim/profiles/NAME.json``) or a JSON file by path."""
    if name_or_path.endswith(".json"):
        try:
            with open(name_or_path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise CalibrationError(f"cannot read calibration file {name_or_path}: {exc.strerror}") from None
        where = name_or_path
    else:
        resource = importlib.resources.files("liver.sim") / "profiles" / f"{name_or_path}.json"
        if not resource.is_file():
            raise CalibrationError(
                f"unknown calibration profile {name_or_path!r}; bundled: {', '.join(bundled_profiles())}, "
                "or a path to a .json file"
            )
        data = resource.read_bytes()
        where = f"profile {name_or_path}"
    try:
        return msgspec.json.decode(data, type=Calibration, strict=True)
    except msgspec.ValidationError as exc:
        raise CalibrationError(f"calibration {where}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise CalibrationError(f"calibration {where}: not valid JSON ({exc})") from None


def bundled_profiles() -> list[str]:
    folder = importlib.resources.files("liver.sim") / "profiles"
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def with_overrides(calibration: Calibration, **changes: object) -> Calibration:
    """A copy with some fields changed, validated as a file would be (errors name the field)."""
    try:
        return msgspec.convert(
            {**msgspec.structs.asdict(calibration), **changes}, type=Calibration, from_attributes=True
        )
    except msgspec.ValidationError as exc:
        raise CalibrationError(f"calibration override: {exc}") from None
