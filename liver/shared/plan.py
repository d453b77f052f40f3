"""The transfer plan: a contract between the transfer planner (which makes it) and the worker runtime
(which executes it). See ``docs/plan-format.md`` for the file format.

Ranks in a plan are logical ranks of their own world: ``src`` an old rank, ``dst`` a new rank. The
placements say which device each one runs on; a task whose source and destination share a device is
``local`` (a copy, no network).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import msgspec

from liver.shared.boxes import Box, volume
from liver.shared.geometry import ModelGeometry, TensorSpec
from liver.shared.layout import Device, ParallelLayout, Placement, check_placement

PLAN_SCHEMA_VERSION = 3
"""The plan file's and the in-memory :class:`Plan`'s version (``docs/plan-format.md``). Version 1 carried
a :class:`~liver.shared.model.ModelSpec` as ``model``; version 2 carries the model's geometry
(:class:`~liver.shared.geometry.ModelGeometry`), so a plan can be made for any model; version 3 adds
context parallelism, expert parallelism and expert-TP to the layouts and experts to the geometry (a
tensor's ``expert``). Versions 1 and 2 are still read."""

SLICE_SCHEMA_VERSION = 4
"""The stored per-device slice's version (:class:`SliceFile`). Version 1 repeated both worlds in every
slice; version 2 leaves them to the ``Prepare``, which every participant receives once; version 3 carries
the model's geometry instead of its ``ModelSpec``; version 4 geometries with experts."""

Slice = tuple[int, Box]
"""``(tensor index into Plan.tensors, global box)``: one hyper-rectangle of one tensor."""


class WorldConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A layout and where its ranks run."""

    layout: ParallelLayout
    placement: Placement

    def __post_init__(self) -> None:
        check_placement(self.layout, self.placement)


class TransferTask(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True, order=True):
    """One coalesced message: everything ``src`` sends ``dst`` for one layer in one streaming round.

    ``nbytes`` is the payload size (sum over slices of elements times item size).
    """

    layer: int
    round: int
    src: int
    dst: int
    local: bool
    slices: tuple[Slice, ...]
    nbytes: int


class Plan(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A complete transfer plan. Tasks are sorted by (layer, round, src, dst)."""

    schema_version: int = PLAN_SCHEMA_VERSION
    model: ModelGeometry
    old: WorldConfig
    new: WorldConfig
    tensors: tuple[TensorSpec, ...]
    budget_bytes: int
    tasks: tuple[TransferTask, ...]

    def steps(self) -> Iterator[tuple[int, int, list[TransferTask]]]:
        """``(layer, round, tasks)`` in streaming order."""
        current: tuple[int, int] | None = None
        batch: list[TransferTask] = []
        for task in self.tasks:
            key = (task.layer, task.round)
            if key != current:
                if batch:
                    assert current is not None
                    yield current[0], current[1], batch
                current, batch = key, []
            batch.append(task)
        if batch:
            assert current is not None
            yield current[0], current[1], batch

    def tasks_of(self, rank_src: int | None = None, rank_dst: int | None = None) -> list[TransferTask]:
        """The tasks one old rank sends and/or one new rank receives (a worker's part of the plan)."""
        return [
            t
            for t in self.tasks
            if (rank_src is None or t.src == rank_src) and (rank_dst is None or t.dst == rank_dst)
        ]


class PlanSlice(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One device's part of a plan with the two worlds it runs between: the tasks it sends as an old
    rank and receives as a new rank.

    What the runtime takes instead of the whole plan. The tensor list is not repeated (a large model has
    thousands of tensors, and a job has thousands of devices): it is ``model.tensors(optimizer)``, which
    is what a plan's ``tensors`` are. :meth:`to_plan` gives the executor a plan with only these tasks.
    The object store holds the same thing without the worlds (:class:`SliceFile`).
    """

    schema_version: int = PLAN_SCHEMA_VERSION
    model: ModelGeometry
    optimizer: bool
    old: WorldConfig
    new: WorldConfig
    budget_bytes: int
    device: Device
    tasks: tuple[TransferTask, ...]

    def to_plan(self) -> Plan:
        return Plan(
            schema_version=self.schema_version,
            model=self.model,
            old=self.old,
            new=self.new,
            tensors=self.model.tensors(self.optimizer),
            budget_bytes=self.budget_bytes,
            tasks=self.tasks,
        )

    def stored(self, generation: int) -> SliceFile:
        """What the transfer service writes for this device when planning ``generation``."""
        return SliceFile(
            generation=generation,
            model=self.model,
            optimizer=self.optimizer,
            budget_bytes=self.budget_bytes,
            device=self.device,
            tasks=self.tasks,
        )


class SliceFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One device's slice as the object store holds it: a :class:`PlanSlice` without the worlds.

    The worlds are O(devices) each and every participant already has them from the job-wide
    ``Prepare``; repeating them made 97% of a 1,024-device job's slices. ``generation`` lets the
    reader refuse a slice of another handoff. Ranks in ``tasks`` refer to the ``Prepare``'s
    ``from_placement`` (``src``) and ``placement`` (``dst``).
    """

    schema_version: int = SLICE_SCHEMA_VERSION
    generation: int
    model: ModelGeometry
    optimizer: bool
    budget_bytes: int
    device: Device
    tasks: tuple[TransferTask, ...]

    def with_worlds(self, old: WorldConfig, new: WorldConfig) -> PlanSlice:
        return PlanSlice(
            model=self.model,
            optimizer=self.optimizer,
            old=old,
            new=new,
            budget_bytes=self.budget_bytes,
            device=self.device,
            tasks=self.tasks,
        )


def slice_devices(old: Placement, new: Placement) -> tuple[Device, ...]:
    """Every device of either world once: the old world's in rank order, then the new world's that
    are not in the old one, in rank order. A slice's index in this order names its object
    (``SliceIndex.name``), so writer and readers agree without a list of names on the bus."""
    seen = set(old.devices)
    return (*old.devices, *(d for d in new.devices if d not in seen))


def slice_participants(old: Placement, new: Placement, lost: Collection[Device]) -> dict[Device, int]:
    """Each participant's slice index: every device of either world but ``lost`` (old-world devices
    whose worker is gone). One rule for the coordinator, which counts their acks, and the workers,
    which each decide from the ``Prepare`` whether they take part."""
    return {d: i for i, d in enumerate(slice_devices(old, new)) if d not in lost}


def slice_bytes(tensors: tuple[TensorSpec, ...], s: Slice) -> int:
    return volume(s[1]) * tensors[s[0]].itemsize
