"""Reading and writing plan files (format: ``docs/plan-format.md``).

The file repeats each rank's old and new box per tensor so that a reader in any language can execute or
audit a plan without reimplementing the view function. On read those boxes are recomputed and must
agree: a plan file for a different model or layout is rejected with the tensor and rank named.
"""

from __future__ import annotations

import msgspec

from liver.reshard.boxes import Box
from liver.reshard.plan import PLAN_SCHEMA_VERSION, Plan, TransferTask, WorldConfig
from liver.reshard.views import world_shards
from liver.shared.errors import InputError
from liver.shared.geometry import ModelGeometry, TensorSpec
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import ModelSpec


class PlanFileError(InputError):
    """A plan file that cannot be read or does not describe a consistent plan."""


class ShardEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """``[tensor index, box or null (padding only), local shape]``."""

    tensor: int
    box: Box | None
    local_shape: tuple[int, ...]


class RankEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rank: int
    device: Device
    shards: tuple[ShardEntry, ...]


class WorldEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    layout: ParallelLayout
    ranks: tuple[RankEntry, ...]


class PlanFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    schema_version: int
    model: ModelGeometry
    budget_bytes: int
    tensors: tuple[TensorSpec, ...]
    old: WorldEntry
    new: WorldEntry
    tasks: tuple[TransferTask, ...]
    stand_ins: tuple[tuple[int, int], ...] = ()
    """``[old rank, keeper]``: the lost ranks whose tasks their copies' keepers run (version 4)."""


class _PlanFileV1(PlanFile, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Version 1: the model as a ``ModelSpec`` (read, converted to its geometry, never written)."""

    model: ModelSpec  # type: ignore[assignment]


class _Version(msgspec.Struct):
    schema_version: int


def _upgrade(old: _PlanFileV1, source: str) -> PlanFile:
    """A version 1 file as version 2: the model becomes its geometry, and since the geometry lists
    tensors in Megatron's module order (version 1 had ``linear_qkv`` before ``linear_proj``), every
    tensor index in the shards and tasks is renumbered by name. Slice order within a task, which is
    the order of the bytes in its message, is kept."""
    geometry = old.model.geometry()
    tensors = geometry.tensors(optimizer=any(t.role == "step" for t in old.tensors))
    index = {t.name: i for i, t in enumerate(tensors)}
    if sorted(index) != sorted(t.name for t in old.tensors):
        raise PlanFileError(f"{source}: $.tensors does not match the tensors of $.model")
    remap = [index[t.name] for t in old.tensors]
    if any(tensors[remap[i]] != t for i, t in enumerate(old.tensors)):
        raise PlanFileError(f"{source}: $.tensors does not match the tensors of $.model")

    def world(entry: WorldEntry, name: str) -> WorldEntry:
        ranks = []
        for r in entry.ranks:
            shards = []
            for k, e in enumerate(r.shards):
                if not 0 <= e.tensor < len(remap):
                    raise PlanFileError(
                        f"{source}: $.{name}.ranks[{r.rank}].shards[{k}]: no tensor {e.tensor}"
                    )
                shards.append(ShardEntry(remap[e.tensor], e.box, e.local_shape))
            ranks.append(RankEntry(r.rank, r.device, tuple(sorted(shards, key=lambda e: e.tensor))))
        return WorldEntry(entry.layout, tuple(ranks))

    tasks = []
    for k, task in enumerate(old.tasks):
        if any(not 0 <= ti < len(remap) for ti, _ in task.slices):
            raise PlanFileError(f"{source}: $.tasks[{k}].slices name a tensor the plan does not have")
        slices = tuple((remap[ti], box) for ti, box in task.slices)
        tasks.append(msgspec.structs.replace(task, slices=slices))
    return PlanFile(
        schema_version=PLAN_SCHEMA_VERSION,
        model=geometry,
        budget_bytes=old.budget_bytes,
        tensors=tensors,
        old=world(old.old, "old"),
        new=world(old.new, "new"),
        tasks=tuple(tasks),
    )


def _world_entry(plan: Plan, world: WorldConfig) -> WorldEntry:
    return WorldEntry(
        world.layout,
        tuple(
            RankEntry(r, dev, shards)
            for (r, dev), shards in zip(enumerate(world.placement.devices), _shards(plan, world))
        ),
    )


def _shards(plan: Plan, world: WorldConfig) -> list[tuple[ShardEntry, ...]]:
    """Each rank's shard entries; ranks that hold the same (DP replicas) share one tuple."""
    entries: dict[int, tuple[ShardEntry, ...]] = {}
    out = []
    for held in world_shards(plan.tensors, plan.model, world.layout):
        mine = entries.get(id(held))
        if mine is None:
            mine = entries[id(held)] = tuple(ShardEntry(ti, s.box, s.local_shape) for ti, s in held.items())
        out.append(mine)
    return out


def to_file(plan: Plan) -> PlanFile:
    return PlanFile(
        schema_version=plan.schema_version,
        model=plan.model,
        budget_bytes=plan.budget_bytes,
        tensors=plan.tensors,
        old=_world_entry(plan, plan.old),
        new=_world_entry(plan, plan.new),
        tasks=plan.tasks,
        stand_ins=plan.stand_ins,
    )


def encode_plan(plan: Plan) -> bytes:
    return msgspec.json.encode(to_file(plan))


def write_plan(plan: Plan, path: str) -> None:
    with open(path, "wb") as fh:
        fh.write(encode_plan(plan))


def decode_plan(data: bytes, source: str = "plan") -> Plan:
    """Decode and cross-check a plan file; errors name the field or the inconsistent shard."""
    try:
        version = msgspec.json.decode(data, type=_Version, strict=True).schema_version
        if version not in (1, 2, 3, PLAN_SCHEMA_VERSION):
            raise PlanFileError(
                f"{source}: schema_version {version} is not supported (expected 1 to {PLAN_SCHEMA_VERSION})"
            )
        if version == 1:
            f = _upgrade(msgspec.json.decode(data, type=_PlanFileV1, strict=True), source)
        else:
            f = msgspec.json.decode(data, type=PlanFile, strict=True)
    except msgspec.ValidationError as exc:
        raise PlanFileError(f"{source}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise PlanFileError(f"{source}: not valid JSON ({exc})") from None
    except RecursionError:
        raise PlanFileError(f"{source}: not valid JSON (nested too deeply)") from None
    try:
        worlds = []
        for name, entry in (("old", f.old), ("new", f.new)):
            f.model.check_layout(entry.layout)
            placement = Placement(tuple(r.device for r in entry.ranks))
            world = WorldConfig(entry.layout, placement)
            for expect, r in enumerate(entry.ranks):
                if r.rank != expect:
                    raise PlanFileError(
                        f"{source}: {name}.ranks[{expect}].rank is {r.rank}, expected {expect}"
                    )
            worlds.append(world)
    except ValueError as exc:
        if isinstance(exc, PlanFileError):
            raise
        raise PlanFileError(f"{source}: {exc}") from None
    tensors = f.model.tensors(optimizer=any(t.role == "step" for t in f.tensors))
    if f.tensors != tensors:
        raise PlanFileError(f"{source}: $.tensors does not match the tensors of $.model")
    plan = Plan.of_tasks(
        schema_version=PLAN_SCHEMA_VERSION,  # an older file means the same under this version
        model=f.model,
        old=worlds[0],
        new=worlds[1],
        tensors=f.tensors,
        budget_bytes=f.budget_bytes,
        tasks=f.tasks,
        stand_ins=f.stand_ins,
    )
    for name, entry, world in (("old", f.old, plan.old), ("new", f.new, plan.new)):
        for r, expected in zip(entry.ranks, _shards(plan, world)):
            if r.shards != expected:
                raise PlanFileError(
                    f"{source}: $.{name}.ranks[{r.rank}].shards disagree with the view function "
                    f"for layout {world.layout.describe()}"
                )
    return plan


def read_plan(path: str) -> Plan:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise PlanFileError(f"cannot read plan file {path}: {exc.strerror}") from None
    return decode_plan(data, source=path)
