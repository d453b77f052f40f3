"""Parallel layouts, devices and placements.

Megatron-core's default rank order is ``tp-cp-ep-dp-pp`` (context and expert parallelism are 1 here),
so within a world of ``tp * dp * pp`` ranks::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

TP ranks are adjacent (they share a node when they can), then DP replicas, then pipeline stages.
Every part of LiveR uses this one formula through :func:`ParallelLayout.rank_of` and
:func:`ParallelLayout.coords`.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from liver.shared.errors import InputError


class LayoutError(InputError):
    """A layout, device list or placement that cannot describe a training world."""


class RankCoords(NamedTuple):
    tp: int
    dp: int
    pp: int


class ParallelLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """(TP, PP, DP) with the number of decoder layers on each pipeline stage.

    ``stage_layers`` is empty for an even split; otherwise it has one entry per stage (uneven splits, as
    Megatron allows with ``num_layers_in_first/last_pipeline_stage`` or a pipeline layout).
    """

    tp: int
    pp: int
    dp: int
    stage_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for field in ("tp", "pp", "dp"):
            if getattr(self, field) < 1:
                raise LayoutError(f"{field} must be at least 1, got {getattr(self, field)}")
        if self.stage_layers:
            if len(self.stage_layers) != self.pp:
                raise LayoutError(f"stage_layers has {len(self.stage_layers)} entries but pp is {self.pp}")
            if any(n < 0 for n in self.stage_layers):
                raise LayoutError("stage_layers entries must not be negative")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside a world of {self.world_size}")
        tp = rank % self.tp
        rest = rank // self.tp
        return RankCoords(tp, rest % self.dp, rest // self.dp)

    def layers_per_stage(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers on each stage; raises when the split does not fit ``num_layers``."""
        if self.stage_layers:
            if sum(self.stage_layers) != num_layers:
                raise LayoutError(
                    f"stage_layers {list(self.stage_layers)} sum to {sum(self.stage_layers)}, "
                    f"the model has {num_layers} layers"
                )
            return self.stage_layers
        if num_layers % self.pp:
            raise LayoutError(f"{num_layers} layers do not split evenly over pp={self.pp}; give stage_layers")
        return (num_layers // self.pp,) * self.pp

    def stage_of_layers(self, num_layers: int) -> tuple[int, ...]:
        """For each decoder layer (0-based), the pipeline stage that owns it."""
        out: list[int] = []
        for stage, n in enumerate(self.layers_per_stage(num_layers)):
            out.extend([stage] * n)
        return tuple(out)

    def describe(self) -> str:
        text = f"TP{self.tp},PP{self.pp},DP{self.dp}"
        if self.stage_layers:
            text += "[" + "/".join(map(str, self.stage_layers)) + "]"
        return text

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """Parse ``"TP,PP,DP"`` (optionally ``"TP,PP,DP:l0/l1/..."`` for an uneven pipeline split)."""
        head, _, stages = text.strip().partition(":")
        parts = [
            p.strip().upper().removeprefix("TP").removeprefix("PP").removeprefix("DP")
            for p in head.split(",")
        ]
        if len(parts) != 3:
            raise LayoutError(f"layout {text!r}: expected TP,PP,DP such as 2,2,1")
        try:
            tp, pp, dp = (int(p) for p in parts)
            stage_layers = tuple(int(s) for s in stages.split("/")) if stages else ()
        except ValueError:
            raise LayoutError(f"layout {text!r}: TP, PP, DP and stage sizes must be integers") from None
        return cls(tp=tp, pp=pp, dp=dp, stage_layers=stage_layers)


class Device(msgspec.Struct, frozen=True, order=True, forbid_unknown_fields=True):
    """One accelerator (or one CPU worker slot): a node id and a local index on it."""

    node: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}:{self.index}"


class Placement(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Logical rank -> device, for one world. ``devices[r]`` is where rank ``r`` runs."""

    devices: tuple[Device, ...]

    def __post_init__(self) -> None:
        if len(set(self.devices)) != len(self.devices):
            seen: set[Device] = set()
            for d in self.devices:
                if d in seen:
                    raise LayoutError(f"device {d} appears twice in the placement")
                seen.add(d)

    def __len__(self) -> int:
        return len(self.devices)

    def rank_on(self) -> dict[Device, int]:
        return {d: r for r, d in enumerate(self.devices)}


def grid_devices(nodes: int, per_node: int, prefix: str = "node") -> tuple[Device, ...]:
    """``nodes`` nodes of ``per_node`` devices each, named ``node000``.. in order."""
    width = max(3, len(str(nodes - 1)))
    return tuple(Device(f"{prefix}{n:0{width}d}", i) for n in range(nodes) for i in range(per_node))


def check_placement(layout: ParallelLayout, placement: Placement) -> None:
    """A placement must give every rank of the layout exactly one distinct device."""
    if len(placement) != layout.world_size:
        raise LayoutError(
            f"layout {layout.describe()} needs {layout.world_size} devices, placement has {len(placement)}"
        )


def default_devices(world_size: int, per_node: int = 8) -> tuple[Device, ...]:
    """The devices of a job in rank order: whole nodes of ``per_node`` (fewer when the job is smaller)."""
    per = min(per_node, world_size)
    nodes = -(-world_size // per)
    return grid_devices(nodes, per)[:world_size]


def parse_devices(spec: str, current: tuple[Device, ...]) -> tuple[Device, ...]:
    """A new device set, written relative to ``current`` or absolutely.

    * ``NxM``: N nodes of M devices, named ``node000``... (the same names ``current`` uses);
    * ``drop:NODE[,NODE...]``: ``current`` without those nodes;
    * ``add:NxM``: ``current`` plus N new nodes of M devices, named after the highest existing node.
    """
    spec = spec.strip()
    if spec.startswith("drop:"):
        names = [n.strip() for n in spec[5:].split(",") if n.strip()]
        known = {d.node for d in current}
        unknown = [n for n in names if n not in known]
        if not names or unknown:
            raise LayoutError(f"--devices {spec!r}: unknown node(s) {', '.join(unknown) or '(none given)'}")
        drop = set(names)
        return tuple(d for d in current if d.node not in drop)
    if spec.startswith("add:"):
        nodes, per = _grid_spec(spec[4:], spec)
        existing = {d.node for d in current}
        start = len(existing)
        added: list[Device] = []
        n = start
        while len(added) < nodes * per:
            name = f"node{n:03d}"
            n += 1
            if name in existing:
                continue
            added.extend(Device(name, i) for i in range(per))
        return current + tuple(added)
    nodes, per = _grid_spec(spec, spec)
    return grid_devices(nodes, per)


def _grid_spec(text: str, whole: str) -> tuple[int, int]:
    try:
        nodes, per = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise LayoutError(
            f"--devices {whole!r}: expected NODESxPER_NODE (e.g. 120x8), drop:NODE,... or add:NxM"
        ) from None
    if nodes < 1 or per < 1:
        raise LayoutError(f"--devices {whole!r}: node and device counts must be at least 1")
    return nodes, per
