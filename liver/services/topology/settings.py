"""What the topology service needs to know that no message tells it: each job's model, training setup
and hardware, and the chooser's knobs.

A :class:`TopologyRequest` names devices and layouts only; the memory and cost models also need the
model, the batch geometry and the device type, which are properties of the job's deployment. They come
from a JSON file (``$LIVER_TOPOLOGY_CONFIG``), from environment variables (one default profile, for a
service that serves one job or many alike), or both, the variables overriding the file's default::

    {
      "default": {"model": "llama3-8b", "hardware": "h100-80gb",
                  "setup": {"global_batch_size": 512, "sequence_length": 8192}},
      "jobs": {"job-7": {"model": {... a ModelSpec ...}, "hardware": {... a HardwareProfile ...},
                         "setup": {...}}},
      "tolerance": 0.02, "top": 5, "tp_across_nodes": false, "staging_bytes": 536870912
    }

``model`` is a preset name (:data:`liver.shared.model.PRESETS`) or a full ``ModelSpec``; ``hardware``
a profile name (:data:`~liver.services.topology.memory.PROFILES`) or a full ``HardwareProfile``. Device
memory reported by the workers (``Hello.memory_bytes``, forwarded by the coordinator) replaces the
profile's at planning time. Every error names the variable or the JSON path at fault.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from liver.reshard.planner import DEFAULT_BUDGET_BYTES
from liver.services.host import DEFAULT_ACK_WAIT_S
from liver.shared.errors import InputError
from liver.shared.model import PRESETS, ModelError, ModelSpec, load_model
from liver.shared.subjects import SubjectError, validate_token

from .chooser import Redundancy
from .memory import PROFILES, HardwareProfile, SetupError, TrainingSetup

CONFIG_ENV: Final = "LIVER_TOPOLOGY_CONFIG"
"""Path of the JSON configuration file (the format in the module docstring)."""
MODEL_ENV: Final = "LIVER_TOPOLOGY_MODEL"
"""The default profile's model: a preset name or the path of a ``.json`` ``ModelSpec``."""
HARDWARE_ENV: Final = "LIVER_TOPOLOGY_HARDWARE"
"""The default profile's hardware: a profile name (``h100-80gb``, ``cpu-small``)."""
GLOBAL_BATCH_ENV: Final = "LIVER_TOPOLOGY_GLOBAL_BATCH"
MICRO_BATCH_ENV: Final = "LIVER_TOPOLOGY_MICRO_BATCH"
SEQUENCE_LENGTH_ENV: Final = "LIVER_TOPOLOGY_SEQUENCE_LENGTH"
REDUNDANCY_ENV: Final = "LIVER_TOPOLOGY_REDUNDANCY"
"""``node``: prefer layouts whose state survives the loss of any one node (``none`` by default)."""
"""The default profile's training setup (batch sizes in sequences, length in tokens)."""


class TopologyConfigError(InputError):
    """The configuration cannot be used; the message names the variable or JSON path."""


class JobProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything the memory and cost models need about one job besides its devices."""

    model: ModelSpec
    setup: TrainingSetup
    hardware: HardwareProfile


class _ProfileFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    model: str | ModelSpec
    setup: TrainingSetup
    hardware: str | HardwareProfile


class _ConfigFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    default: _ProfileFile | None = None
    jobs: dict[str, _ProfileFile] = {}
    tolerance: Annotated[float, Meta(ge=0, lt=1)] = 0.02
    top: Annotated[int, Meta(ge=1)] = 5
    tp_across_nodes: bool = False
    staging_bytes: Annotated[int, Meta(ge=0)] = DEFAULT_BUDGET_BYTES
    redundancy: Redundancy = "none"


class TopologySettings(msgspec.Struct, frozen=True, kw_only=True):
    """The service's configuration, resolved and checked (build it with :meth:`from_env` or directly)."""

    default: JobProfile | None = None
    """The profile of every job not listed in ``jobs``."""
    jobs: dict[str, JobProfile] = {}
    tolerance: float = 0.02
    """Layouts within this fraction of the best estimated throughput count as equal; the one moving
    the fewest bytes wins among them."""
    top: int = 5
    """Candidates listed in ``TopologyPlanned`` (and the log) besides the chosen one's rivals."""
    tp_across_nodes: bool = False
    staging_bytes: int = DEFAULT_BUDGET_BYTES
    """The workers' transfer staging buffer: memory training cannot use (I2)."""
    redundancy: Redundancy = "none"
    """``node``: only layouts whose state survives the loss of any one node compete when one does, so
    that a node lost without notice recovers live (:func:`~.chooser.choose_topology`)."""
    durable: str = "topology"
    max_deliver: int = 3
    ack_wait_s: float = DEFAULT_ACK_WAIT_S
    progress_every_s: float = DEFAULT_ACK_WAIT_S / 3
    retry_delay_s: float = 2.0

    def __post_init__(self) -> None:
        if self.default is None and not self.jobs:
            raise TopologyConfigError(
                f"no job profile configured: set {CONFIG_ENV} to a JSON file, or {MODEL_ENV}, "
                f"{HARDWARE_ENV}, {GLOBAL_BATCH_ENV} and {SEQUENCE_LENGTH_ENV}"
            )
        for where, profile in [("default", self.default), *((f"jobs.{k}", v) for k, v in self.jobs.items())]:
            if profile is None:
                continue
            try:
                profile.setup.check_model(profile.model)
            except SetupError as exc:
                raise TopologyConfigError(f"`{where}.setup`: {exc}") from None
        for job in self.jobs:
            try:
                validate_token(job, "job_id")
            except SubjectError as exc:
                raise TopologyConfigError(f"`jobs`: {exc}") from None
        if not 0 <= self.tolerance < 1:
            raise TopologyConfigError(f"`tolerance`: must be in [0, 1), got {self.tolerance}")
        if self.top < 1:
            raise TopologyConfigError(f"`top`: must be at least 1, got {self.top}")
        if self.staging_bytes < 0:
            raise TopologyConfigError(f"`staging_bytes`: must not be negative, got {self.staging_bytes}")
        validate_token(self.durable, "durable")
        if self.max_deliver < 1:
            raise TopologyConfigError(f"`max_deliver`: must be >= 1, got {self.max_deliver}")
        for field in ("ack_wait_s", "progress_every_s", "retry_delay_s"):
            if getattr(self, field) <= 0:
                raise TopologyConfigError(f"`{field}`: must be > 0, got {getattr(self, field)}")
        if self.progress_every_s >= self.ack_wait_s:
            raise TopologyConfigError(
                f"`progress_every_s` ({self.progress_every_s}) must be shorter than `ack_wait_s` "
                f"({self.ack_wait_s})"
            )

    def profile_for(self, job_id: str) -> JobProfile | None:
        """The job's own profile, else the default; ``None`` when the service knows nothing of it."""
        return self.jobs.get(job_id, self.default)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> TopologySettings:
        """Settings from ``$LIVER_TOPOLOGY_CONFIG`` and the ``LIVER_TOPOLOGY_*`` variables (see the
        module docstring); explicit ``overrides`` win."""
        env = os.environ if environ is None else environ
        path = env.get(CONFIG_ENV, "").strip()
        file = _read_file(path) if path else _ConfigFile()
        where = f"{CONFIG_ENV} ({path})" if path else "the configuration"
        default = _resolve(file.default, f"{where}: `default`") if file.default is not None else None
        jobs = {job: _resolve(p, f"{where}: `jobs.{job}`") for job, p in file.jobs.items()}
        default = _apply_env(default, env)
        fields: dict[str, object] = {
            "default": default,
            "jobs": jobs,
            "tolerance": file.tolerance,
            "top": file.top,
            "tp_across_nodes": file.tp_across_nodes,
            "staging_bytes": file.staging_bytes,
            "redundancy": _redundancy(env) or file.redundancy,
        }
        fields.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**fields)  # type: ignore[arg-type]
        except TopologyConfigError as exc:
            raise TopologyConfigError(f"{where}: {exc}") from None


def _redundancy(env: Mapping[str, str]) -> Redundancy | None:
    value = env.get(REDUNDANCY_ENV, "").strip()
    if not value:
        return None
    if value not in ("none", "node"):
        raise TopologyConfigError(f"{REDUNDANCY_ENV}: {value!r} is neither 'none' nor 'node'")
    return value  # type: ignore[return-value]


def _read_file(path: str) -> _ConfigFile:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise TopologyConfigError(f"{CONFIG_ENV}: cannot read {path}: {exc.strerror}") from None
    try:
        return msgspec.json.decode(data, type=_ConfigFile, strict=True)
    except msgspec.ValidationError as exc:
        raise TopologyConfigError(f"{CONFIG_ENV} ({path}): {exc}") from None
    except msgspec.DecodeError as exc:
        raise TopologyConfigError(f"{CONFIG_ENV} ({path}): not valid JSON ({exc})") from None


def _model(value: str | ModelSpec, where: str) -> ModelSpec:
    if isinstance(value, ModelSpec):
        return value
    try:
        return load_model(value)
    except ModelError as exc:
        raise TopologyConfigError(f"{where}: {exc}") from None


def _hardware(value: str | HardwareProfile, where: str) -> HardwareProfile:
    if isinstance(value, HardwareProfile):
        return value
    profile = PROFILES.get(value)
    if profile is None:
        raise TopologyConfigError(
            f"{where}: unknown hardware profile {value!r}; profiles: {', '.join(sorted(PROFILES))}"
        )
    return profile


def _resolve(raw: _ProfileFile, where: str) -> JobProfile:
    return JobProfile(
        model=_model(raw.model, f"{where}.model"),
        setup=raw.setup,
        hardware=_hardware(raw.hardware, f"{where}.hardware"),
    )


def _positive_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise TopologyConfigError(f"{name}: {raw!r} is not a whole number") from None
    if value < 1:
        raise TopologyConfigError(f"{name}: must be at least 1, got {value}")
    return value


def _apply_env(default: JobProfile | None, env: Mapping[str, str]) -> JobProfile | None:
    """The default profile with the variables that are set applied over it (or built from them)."""
    model_name = env.get(MODEL_ENV, "").strip()
    hardware_name = env.get(HARDWARE_ENV, "").strip()
    sizes = {
        "global_batch_size": _positive_int(env, GLOBAL_BATCH_ENV),
        "micro_batch_size": _positive_int(env, MICRO_BATCH_ENV),
        "sequence_length": _positive_int(env, SEQUENCE_LENGTH_ENV),
    }
    given = {k: v for k, v in sizes.items() if v is not None}
    if not (model_name or hardware_name or given):
        return default
    model = _model(model_name, MODEL_ENV) if model_name else None
    hardware = _hardware(hardware_name, HARDWARE_ENV) if hardware_name else None
    if default is None:
        missing = [
            name
            for name, value in (
                (MODEL_ENV, model),
                (HARDWARE_ENV, hardware),
                (GLOBAL_BATCH_ENV, given.get("global_batch_size")),
                (SEQUENCE_LENGTH_ENV, given.get("sequence_length")),
            )
            if value is None
        ]
        if missing:
            raise TopologyConfigError(
                f"{missing[0]}: needed with the other LIVER_TOPOLOGY_* variables when {CONFIG_ENV} gives "
                f"no default profile (presets: {', '.join(sorted(PRESETS))}; "
                f"hardware: {', '.join(sorted(PROFILES))})"
            )
        assert model is not None and hardware is not None
        setup = _setup(given)
        return JobProfile(model=model, setup=setup, hardware=hardware)
    setup = default.setup
    if given:
        setup = _setup({**msgspec.structs.asdict(default.setup), **given})
    return JobProfile(model=model or default.model, setup=setup, hardware=hardware or default.hardware)


def _setup(fields: dict[str, object]) -> TrainingSetup:
    try:
        return TrainingSetup(**fields)  # type: ignore[arg-type]
    except SetupError as exc:
        raise TopologyConfigError(
            f"{GLOBAL_BATCH_ENV}/{MICRO_BATCH_ENV}/{SEQUENCE_LENGTH_ENV}: {exc}"
        ) from None
