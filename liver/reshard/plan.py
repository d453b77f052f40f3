"""The transfer plan: a contract between the transfer planner (which makes it) and the worker runtime
(which executes it). See ``docs/plan-format.md`` for the file format.

Ranks in a plan are logical ranks of their own world: ``src`` an old rank, ``dst`` a new rank. The
placements say which device each one runs on; a task whose source and destination share a device is
``local`` (a copy, no network).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Collection, Iterable, Iterator

import msgspec

from liver.reshard.boxes import Box, volume
from liver.shared.geometry import ModelGeometry, TensorSpec
from liver.shared.layout import Device, ParallelLayout, Placement, check_placement

PLAN_SCHEMA_VERSION = 4
"""The plan file's and the in-memory :class:`Plan`'s version (``docs/plan-format.md``). Version 1 carried
a :class:`~liver.shared.model.ModelSpec` as ``model``; version 2 carries the model's geometry
(:class:`~liver.shared.geometry.ModelGeometry`), so a plan can be made for any model; version 3 adds
context parallelism, expert parallelism and expert-TP to the layouts and experts to the geometry (a
tensor's ``expert``); version 4 the stand-ins (a lost rank's sends run by the keeper of its peer copy).
Versions 1 to 3 are still read."""

SLICE_SCHEMA_VERSION = 5
"""The stored per-device slice's version (:class:`SliceFile`). Version 1 repeated both worlds in every
slice; version 2 leaves them to the ``Prepare``, which every participant receives once; version 3 carries
the model's geometry instead of its ``ModelSpec``; version 4 geometries with experts; version 5 the
plan's stand-ins (a lost rank's tasks, in its keeper's slice)."""

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


class TaskTemplate(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A task of every layer of a :class:`LayerClass`: its slices name tensors by their offset from the
    layer's first tensor (:attr:`LayerClass.bases`), and ``src`` is a source slot that each layer maps to
    an old rank of its own (:attr:`LayerClass.sources`), so one template serves each of the layers.

    :class:`TransferTask` less its ``layer``; not a base class of it, because a struct's subclass adds
    its fields last and a task's array form (the plan file's) starts with ``layer``."""

    round: int
    src: int
    dst: int
    local: bool
    slices: tuple[Slice, ...]
    nbytes: int


class LayerClass(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Layers that move alike: the same tensors by shape and sharding, held by the same old and new ranks.
    A 96-layer model whose old and new pipelines cut it at different layers has a few dozen classes; the
    plan stores one set of tasks per class instead of per layer.

    ``bases[i]`` is the index in :attr:`Plan.tensors` of layer ``layers[i]``'s first tensor (a layer's
    tensors are consecutive there); a class of one layer may have base 0 and absolute indices.
    ``sources[i][slot]`` is the old rank that sends a template's ``src`` slot in layer ``layers[i]``:
    DP replicas take turns layer by layer, so the sending load stays balanced. Empty: slots are ranks.
    """

    layers: tuple[int, ...]
    bases: tuple[int, ...]
    tasks: tuple[TaskTemplate, ...]  # sorted by (round, slot, dst)
    sources: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        # A class that cannot be expanded would fail wherever its tasks are listed (an executor, the
        # verification), far from the code that made it.
        if len(self.bases) != len(self.layers):
            raise ValueError(f"`bases`: {len(self.bases)} for {len(self.layers)} layers")
        if self.sources:
            if len(self.sources) != len(self.layers):
                raise ValueError(f"`sources`: {len(self.sources)} source maps for {len(self.layers)} layers")
            slots = max((t.src for t in self.tasks), default=-1) + 1
            if any(t.src < 0 for t in self.tasks) or any(len(m) < slots for m in self.sources):
                raise ValueError(f"`sources`: every layer's map must name a rank for each of {slots} slots")

    def expand(self, i: int, rank_src: int | None = None, rank_dst: int | None = None) -> list[TransferTask]:
        """The tasks of layer ``layers[i]`` (those ``rank_src`` sends and/or ``rank_dst`` receives),
        sorted by (round, src, dst)."""
        layer, base = self.layers[i], self.bases[i]
        srcs = self.sources[i] if self.sources else None
        out = []
        for t in self.tasks:
            if rank_dst is not None and t.dst != rank_dst:
                continue
            src = t.src if srcs is None else srcs[t.src]
            if rank_src is not None and src != rank_src:
                continue
            slices = t.slices if base == 0 else tuple([(ti + base, box) for ti, box in t.slices])
            out.append(TransferTask(layer, t.round, src, t.dst, t.local, slices, t.nbytes))
        if srcs is not None:
            out.sort(key=_order)
        return out


def _order(t: TransferTask) -> tuple[int, int, int]:
    return (t.round, t.src, t.dst)


class Plan(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, dict=True):
    """A complete transfer plan, stored compactly as :class:`LayerClass` es; :attr:`tasks` lists every
    task, sorted by (layer, round, src, dst), expanded on first use.

    Why compact: a 1,024-device plan of a 96-layer model is ~40,000 tasks and ~370,000 slices, most of
    them the same layer's tasks again with other tensor indices. The planner computes each class once;
    a worker expands only its own tasks (:meth:`tasks_of`). Two plans are equal when they move the same
    (equal tasks), however their tasks are grouped: a plan read back from its file is one class per layer.
    """

    schema_version: int = PLAN_SCHEMA_VERSION
    model: ModelGeometry
    old: WorldConfig
    new: WorldConfig
    tensors: tuple[TensorSpec, ...]
    budget_bytes: int
    classes: tuple[LayerClass, ...]
    stand_ins: tuple[tuple[int, int], ...] = ()
    """``(old rank, keeper)`` for each lost old rank whose tasks its keeper runs from the peer copy of its
    state it keeps (``docs/architecture.md``, "Peer redundancy"): such a task's ``src`` is the lost
    rank, whose state the slices are, and it runs on the keeper's device (:meth:`src_device`)."""

    def src_device(self, src: int) -> Device:
        """The device that runs old rank ``src``'s sends: its own, or its keeper's when it stands in."""
        keeper = self._keepers.get(src)
        return self.old.placement.devices[src if keeper is None else keeper]

    def keeper_of(self, src: int) -> int | None:
        """The old rank that runs lost old rank ``src``'s sends from its copy (None: ``src`` runs them)."""
        return self._keepers.get(src)

    @functools.cached_property
    def _keepers(self) -> dict[int, int]:
        return dict(self.stand_ins)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        same = (
            self.schema_version,
            self.model,
            self.old,
            self.new,
            self.tensors,
            self.budget_bytes,
            self.stand_ins,
        ) == (
            other.schema_version,
            other.model,
            other.old,
            other.new,
            other.tensors,
            other.budget_bytes,
            other.stand_ins,
        )
        return same and (self.classes == other.classes or self.tasks == other.tasks)

    def __hash__(self) -> int:
        return hash((self.model, self.old, self.new, self.budget_bytes))

    @classmethod
    def of_tasks(
        cls,
        *,
        model: ModelGeometry,
        old: WorldConfig,
        new: WorldConfig,
        tensors: tuple[TensorSpec, ...],
        budget_bytes: int,
        tasks: Iterable[TransferTask],
        schema_version: int = PLAN_SCHEMA_VERSION,
        stand_ins: tuple[tuple[int, int], ...] = (),
    ) -> Plan:
        """The plan of these tasks as they are (a plan file's, a slice's): one class per layer."""
        listed = tuple(tasks)
        by_layer: dict[int, list[TaskTemplate]] = {}
        for t in listed:
            by_layer.setdefault(t.layer, []).append(
                TaskTemplate(t.round, t.src, t.dst, t.local, t.slices, t.nbytes)
            )
        classes = tuple(LayerClass((layer,), (0,), tuple(ts)) for layer, ts in sorted(by_layer.items()))
        plan = cls(
            schema_version=schema_version,
            model=model,
            old=old,
            new=new,
            tensors=tensors,
            budget_bytes=budget_bytes,
            classes=classes,
            stand_ins=stand_ins,
        )
        if all(a.layer <= b.layer for a, b in itertools.pairwise(listed)):
            # Already in the order the classes expand to (a file's and a slice's are): the executor
            # reading :attr:`tasks` gets these instead of a copy made from the classes.
            plan.__dict__["tasks"] = listed
        return plan

    def with_tasks(self, tasks: Iterable[TransferTask]) -> Plan:
        """This plan with other tasks (a test's broken plan, a plan cut down to some ranks)."""
        return Plan.of_tasks(
            schema_version=self.schema_version,
            model=self.model,
            old=self.old,
            new=self.new,
            tensors=self.tensors,
            budget_bytes=self.budget_bytes,
            tasks=tasks,
            stand_ins=self.stand_ins,
        )

    @functools.cached_property
    def tasks(self) -> tuple[TransferTask, ...]:
        """Every task, sorted by (layer, round, src, dst)."""
        return tuple(self._expand(None, None))

    def _expand(self, rank_src: int | None, rank_dst: int | None) -> Iterator[TransferTask]:
        order = sorted((layer, k, i) for k, c in enumerate(self.classes) for i, layer in enumerate(c.layers))
        for _layer, k, i in order:
            yield from self.classes[k].expand(i, rank_src, rank_dst)

    @property
    def task_count(self) -> int:
        """``len(self.tasks)`` without expanding them."""
        return sum(len(c.layers) * len(c.tasks) for c in self.classes)

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
        """The tasks one old rank sends and/or one new rank receives (a worker's part of the plan),
        expanded from the classes without expanding anyone else's."""
        if "tasks" in self.__dict__:  # already expanded
            return [
                t
                for t in self.tasks
                if (rank_src is None or t.src == rank_src) and (rank_dst is None or t.dst == rank_dst)
            ]
        return list(self._expand(rank_src, rank_dst))


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
    stand_ins: tuple[tuple[int, int], ...] = ()
    """The plan's :attr:`Plan.stand_ins`: a keeper's slice holds its lost ranks' tasks too."""

    def to_plan(self) -> Plan:
        return Plan.of_tasks(
            schema_version=self.schema_version,
            model=self.model,
            old=self.old,
            new=self.new,
            tensors=self.model.tensors(self.optimizer),
            budget_bytes=self.budget_bytes,
            tasks=self.tasks,
            stand_ins=self.stand_ins,
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
            stand_ins=self.stand_ins,
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
    stand_ins: tuple[tuple[int, int], ...] = ()

    def with_worlds(self, old: WorldConfig, new: WorldConfig) -> PlanSlice:
        return PlanSlice(
            model=self.model,
            optimizer=self.optimizer,
            old=old,
            new=new,
            budget_bytes=self.budget_bytes,
            device=self.device,
            tasks=self.tasks,
            stand_ins=self.stand_ins,
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
