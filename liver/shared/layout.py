"""Parallel layouts, devices and placements.

Megatron-core's default rank order is ``tp-cp-ep-dp-pp``. A world has ``tp * cp * dp * pp`` ranks and
two ways of numbering them, one for dense parameters and one for experts (``parallel_state``'s two
generators, which share the pipeline groups)::

    rank = tp_rank  + tp  * (cp_rank + cp * (dp_rank  + dp  * pp_rank))
         = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))     edp = tp * cp * dp / (etp * ep)

TP ranks are adjacent (they share a node when they can), then context-parallel ranks, DP replicas,
pipeline stages. Dense parameters are cut by TP and replicated over CP and DP; expert parameters are
dealt out whole over EP, cut by expert-TP and replicated over expert-DP. Both numberings are one
:class:`Grid` shape, ``rank = tp + tp_size * (ep + ep_size * (replica + replicas * pp))`` (dense: no EP,
CP and DP as replicas), and every part of LiveR uses them through :meth:`ParallelLayout.grid`,
:meth:`ParallelLayout.rank_of` and :meth:`ParallelLayout.coords`.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

import msgspec

from liver.shared.errors import InputError


class LayoutError(InputError):
    """A layout, device list or placement that cannot describe a training world."""


class RankCoords(NamedTuple):
    """A rank's place in both numberings (module docstring)."""

    tp: int
    dp: int
    pp: int
    cp: int = 0
    ep: int = 0
    etp: int = 0
    edp: int = 0


class Grid(NamedTuple):
    """How one kind of parameter (dense or expert) sees a world's ranks:
    ``rank = tp + tp_size * (ep + ep_size * (replica + replicas * pp))``. Ranks that differ only in
    ``replica`` hold the same shard."""

    tp: int
    ep: int
    replicas: int
    pp: int

    @property
    def width(self) -> int:
        """Ranks of one replica of one stage: ``tp * ep``."""
        return self.tp * self.ep

    def rank(self, tp: int, ep: int, replica: int, pp: int) -> int:
        return tp + self.tp * (ep + self.ep * (replica + self.replicas * pp))

    def place(self, rank: int) -> tuple[int, int, int, int]:
        """``(tp, ep, replica, pp)`` of ``rank``."""
        tp, rest = rank % self.tp, rank // self.tp
        ep, rest = rest % self.ep, rest // self.ep
        return tp, ep, rest % self.replicas, rest // self.replicas


MAX_WORLD_SIZE: Final = 1_048_576
"""Ranks of one world: far beyond any job, and small enough that a layout read from outside cannot
make a planner allocate without bound."""
MAX_LAYERS: Final = 65_536


class ParallelLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """(TP, PP, DP), context parallelism, expert parallelism and expert-TP, with the number of decoder
    layers on each pipeline stage.

    ``stage_layers`` is empty for an even split; otherwise it has one entry per stage (uneven splits, as
    Megatron allows with ``num_layers_in_first/last_pipeline_stage`` or a pipeline layout), and with
    virtual pipeline parallelism one per model chunk, ``pp * vpp`` of them in Megatron's order of
    virtual stages (chunk ``v`` of stage ``s`` is entry ``v * pp + s``), as a
    ``pipeline_model_parallel_layout`` gives them (:func:`parse_pipeline_layout`). ``etp`` is
    ``None`` for Megatron's default, expert-TP equal to TP. ``dp`` is the data parallelism of dense
    parameters without CP (Megatron's ``data_parallel_size``); the expert-data parallelism follows from
    the rest (:attr:`edp`).
    """

    tp: int
    pp: int
    dp: int
    stage_layers: tuple[int, ...] = ()
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int = 1
    """Virtual pipeline parallelism (Megatron's interleaved 1F1B): each stage holds ``vpp`` model chunks,
    non-adjacent. The layers are cut into ``pp * vpp`` chunks (equal unless ``stage_layers`` says);
    chunk ``c`` lives on stage ``c % pp`` (as its model chunk ``c // pp``), as Megatron's
    ``get_transformer_layer_offset`` with a ``vp_stage`` places them."""

    def __post_init__(self) -> None:
        for field in ("tp", "pp", "dp", "cp", "ep"):
            if getattr(self, field) < 1:
                raise LayoutError(f"{field} must be at least 1, got {getattr(self, field)}")
        if self.etp is not None and self.etp < 1:
            raise LayoutError(f"etp must be at least 1, got {self.etp}")
        if self.world_size > MAX_WORLD_SIZE:
            raise LayoutError(
                f"the layout has {self.world_size} ranks; at most {MAX_WORLD_SIZE} are supported"
            )
        if self.etp == self.tp:
            msgspec.structs.force_setattr(self, "etp", None)  # one spelling of the default
        per_stage = self.tp * self.cp * self.dp
        if per_stage % (self.expert_tp * self.ep):
            raise LayoutError(
                f"ep={self.ep} x etp={self.expert_tp} must divide the {per_stage} ranks of a pipeline stage "
                f"(tp x cp x dp), as Megatron carves expert groups out of them"
            )
        if self.ep == 1 and self.expert_tp != self.tp:
            # Megatron builds and steps it, but at EP 1 expert gradients are reduced over the dense DP
            # group, which is wrong when expert-TP differs from TP (the replicas diverge).
            raise LayoutError(
                f"etp={self.expert_tp} differs from tp={self.tp} with ep=1: Megatron reduces such expert "
                "gradients over the wrong group"
            )
        if self.vpp < 1:
            raise LayoutError(f"vpp must be at least 1, got {self.vpp}")
        if self.vpp > 1 and self.pp < 2:
            raise LayoutError(f"vpp={self.vpp} interleaves pipeline stages: it needs pp of 2 or more")
        if self.stage_layers:
            chunks = self.pp * self.vpp
            if len(self.stage_layers) != chunks:
                per = f"pp x vpp is {chunks} (one per model chunk)" if self.vpp > 1 else f"pp is {self.pp}"
                raise LayoutError(f"stage_layers has {len(self.stage_layers)} entries but {per}")
            if any(n < 0 for n in self.stage_layers):
                raise LayoutError("stage_layers entries must not be negative")
            if sum(self.stage_layers) > MAX_LAYERS:
                raise LayoutError(
                    f"stage_layers adds up to {sum(self.stage_layers)} layers; at most {MAX_LAYERS}"
                )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_tp(self) -> int:
        """Expert tensor parallelism (TP unless set)."""
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Expert data parallelism: the replicas of each expert shard within a stage."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    def grid(self, expert: bool = False) -> Grid:
        """The numbering of dense (``expert=False``) or expert parameters (module docstring)."""
        if expert:
            return Grid(self.expert_tp, self.ep, self.edp, self.pp)
        return Grid(self.tp, 1, self.cp * self.dp, self.pp)

    def shard_class(self, rank: int) -> tuple[int, int, int, int]:
        """``(stage, TP rank, EP rank, expert-TP rank)``: ranks with one class hold the same shard of
        every tensor (they differ only as DP, CP or expert-DP replicas)."""
        c = self.coords(rank)
        return (c.pp, c.tp, c.ep, c.etp)

    def class_representatives(self) -> dict[tuple[int, int, int, int], int]:
        """The first rank of each :meth:`shard_class`, by class."""
        out: dict[tuple[int, int, int, int], int] = {}
        for r in range(self.world_size):
            out.setdefault(self.shard_class(r), r)
        return out

    def rank_of(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside a world of {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        etp, ep, edp, _ = self.grid(expert=True).place(rank)
        return RankCoords(tp, dp, pp, cp, ep, etp, edp)

    def chunk_sizes(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers in each of the ``pp * vpp`` model chunks, in Megatron's order of virtual
        stages (chunk ``v`` of stage ``s`` is entry ``v * pp + s``; one chunk per stage without virtual
        pipelining); raises when the split does not fit ``num_layers``."""
        chunks = self.pp * self.vpp
        if self.stage_layers:
            if sum(self.stage_layers) != num_layers:
                raise LayoutError(
                    f"stage_layers {list(self.stage_layers)} sum to {sum(self.stage_layers)}, "
                    f"the model has {num_layers} layers"
                )
            return self.stage_layers
        if num_layers % chunks:
            if self.vpp > 1:
                raise LayoutError(f"{num_layers} layers do not split into pp x vpp = {chunks} equal chunks")
            raise LayoutError(f"{num_layers} layers do not split evenly over pp={self.pp}; give stage_layers")
        return (num_layers // chunks,) * chunks

    def layers_per_stage(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers on each stage (all its chunks); raises when the split does not fit."""
        sizes = self.chunk_sizes(num_layers)
        return tuple(sum(sizes[stage :: self.pp]) for stage in range(self.pp))

    def balanced(self, num_layers: int) -> ParallelLayout:
        """This layout, with :func:`balanced_split`'s chunks when they do not divide ``num_layers`` and no
        split is given (as the topology planner chooses them)."""
        chunks = self.pp * self.vpp
        if self.stage_layers or num_layers % chunks == 0:
            return self
        if self.vpp > 1 and chunks > num_layers:  # (balanced_split names pp's own limit)
            raise LayoutError(
                f"{num_layers} layers cannot fill pp x vpp = {chunks} model chunks; give the chunks as "
                "a pipeline layout (TP,PP,DP:E|t|...|L, empty chunks allowed)"
            )
        return msgspec.structs.replace(self, stage_layers=balanced_split(num_layers, chunks))

    def chunk_layers(self, num_layers: int, stage: int) -> tuple[range, ...]:
        """The decoder layers of each model chunk stage ``stage`` holds, in chunk order: one chunk
        without virtual pipeline parallelism; with it, chunk ``v`` is the ``(v * pp + stage)``-th entry
        of :meth:`chunk_sizes`."""
        sizes = self.chunk_sizes(num_layers)
        starts = [sum(sizes[:c]) for c in range(len(sizes))]
        chunks = (v * self.pp + stage for v in range(self.vpp))
        return tuple(range(starts[c], starts[c] + sizes[c]) for c in chunks)

    def check_instances(self, instances: int) -> None:
        """Raise :class:`LayoutError` when DP x CP or expert-DP does not split into ``instances`` of a
        distributed optimizer (Megatron's ``num_distributed_optimizer_instances``), as Megatron's
        ``initialize_model_parallel`` asserts."""
        for size, what in ((self.dp * self.cp, "dp*cp"), (self.edp, "edp")):
            if size % instances:
                raise LayoutError(
                    f"{self.describe()}: {what} ({size}) is not divisible by the distributed optimizer's "
                    f"{instances} instances (num_distributed_optimizer_instances)"
                )

    def check_micro_batches(self, micro_batches: int) -> None:
        """Raise :class:`LayoutError` when a rank's ``micro_batches`` per step cannot run this layout's
        schedule: Megatron's interleaved one (``vpp > 1``) runs them in groups of ``pp`` per chunk."""
        if self.vpp > 1 and micro_batches % self.pp:
            raise LayoutError(
                f"{self.describe()}: the interleaved schedule needs the micro-batches per rank "
                f"({micro_batches}) to be a multiple of pp={self.pp}"
            )

    def layers_by_stage(self, num_layers: int) -> tuple[tuple[int, ...], ...]:
        """The decoder layers (0-based) each pipeline stage holds, in order (not contiguous with VPP)."""
        return tuple(
            tuple(layer for chunk in self.chunk_layers(num_layers, stage) for layer in chunk)
            for stage in range(self.pp)
        )

    def stage_of_layers(self, num_layers: int) -> tuple[int, ...]:
        """For each decoder layer (0-based), the pipeline stage that owns it."""
        out = [0] * num_layers
        for stage, layers in enumerate(self.layers_by_stage(num_layers)):
            for layer in layers:
                out[layer] = stage
        return tuple(out)

    def describe(self) -> str:
        virtual = f"VPP{self.vpp}," if self.vpp > 1 else ""
        text = f"TP{self.tp},PP{self.pp},{virtual}DP{self.dp}"
        if self.cp > 1:
            text += f",CP{self.cp}"
        if self.ep > 1:
            text += f",EP{self.ep}"
        if self.etp is not None:
            text += f",ETP{self.etp}"
        if self.stage_layers:
            text += "[" + "/".join(map(str, self.stage_layers)) + "]"
        return text

    def pipeline_layout(self, num_layers: int, mtp_num_layers: int = 0) -> str:
        """This split as Megatron's ``pipeline_model_parallel_layout`` string: the embedding on the
        first chunk, the multi-token prediction layers and the loss on the last (``"Et|t|t|tmL"``)."""
        stages = ["t" * n for n in self.chunk_sizes(num_layers)]
        stages[0] = "E" + stages[0]
        stages[-1] += "m" * mtp_num_layers + "L"
        return "|".join(stages)

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """Parse ``"TP,PP,DP"``, optionally followed by ``,CPn``, ``,EPn``, ``,ETPn`` (any order) and
        ``":l0/l1/..."`` for an uneven pipeline split: ``"2,2,4,EP4,ETP1:3/5"``; ``VPPn`` anywhere
        (``"TP8,PP16,VPP8,DP8"``); or a Megatron ``pipeline_model_parallel_layout`` after the colon
        (``"TP1,PP2,DP2:Et|ttt|t|tmL"``, :func:`parse_pipeline_layout`; its stages give ``vpp``); what
        :meth:`describe` writes reads back."""
        text = text.strip()
        if text.endswith("]") and "[" in text:  # the form describe() writes: "TP2,PP2,DP1[1/3]"
            head, _, stages = text[:-1].partition("[")
        else:
            head, _, stages = text.partition(":")
        parts = [p.strip().upper() for p in head.split(",")]
        virtual = [p for p in parts if p.startswith("VPP")]
        if len(virtual) > 1:
            raise LayoutError(f"layout {text!r}: VPPn given twice")
        parts = [p for p in parts if not p.startswith("VPP")]
        if len(parts) < 3:
            raise LayoutError(f"layout {text!r}: expected TP,PP,DP such as 2,2,1 (then CPn, EPn, ETPn)")
        named: dict[str, str] = {}
        for p in parts[3:]:
            key = next((k for k in ("ETP", "EP", "CP") if p.startswith(k)), None)
            if key is None or key.lower() in named:
                raise LayoutError(f"layout {text!r}: {p!r} is not one of CPn, EPn, ETPn (each once)")
            named[key.lower()] = p.removeprefix(key)
        try:
            tp, pp, dp = (int(p.removeprefix(k)) for p, k in zip(parts[:3], ("TP", "PP", "DP")))
            sizes = {k: int(v) for k, v in named.items()}
            if virtual:
                sizes["vpp"] = int(virtual[0].removeprefix("VPP"))
            megatron = bool(stages) and not stages.replace("/", "").strip().isdigit()
            stage_layers = tuple(int(s) for s in stages.split("/")) if stages and not megatron else ()
        except ValueError:
            raise LayoutError(f"layout {text!r}: sizes and stage layer counts must be integers") from None
        if megatron:
            stage_layers, vpp = parse_pipeline_layout(stages, pp)
            if sizes.setdefault("vpp", vpp) != vpp:
                raise LayoutError(
                    f"layout {text!r}: VPP{sizes['vpp']}, but the pipeline layout has {vpp} chunk(s) "
                    "per stage"
                )
            stage_layers = stage_layers if len(set(stage_layers)) > 1 else ()
        return cls(tp=tp, pp=pp, dp=dp, stage_layers=stage_layers, **sizes)


_PIPELINE_LAYOUT_REPEAT = (re.compile(r"\(([^()]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))


def parse_pipeline_layout(text: str, pp: int) -> tuple[tuple[int, ...], int]:
    """Megatron's ``pipeline_model_parallel_layout`` string (``"Ettt|(tt|)*29,m|L"``: stages split by
    ``|``, ``E`` the embedding, ``t`` a decoder layer, ``m`` a multi-token prediction layer, ``L`` the
    loss, ``(...)*n`` and ``x*n`` repeat, commas cosmetic) as ``(decoder layers per model chunk, vpp)``:
    ``pp * vpp`` stages in Megatron's order of virtual stages. LiveR keeps what lies outside the decoder
    layers where Megatron's default puts it, so the embedding must open the first stage and the MTP
    layers and the loss close the last; anything else is refused naming why."""
    expanded = text.replace(",", "").strip()
    if len(expanded) > 100_000:
        raise LayoutError("pipeline layout: longer than 100,000 characters")
    for pattern in _PIPELINE_LAYOUT_REPEAT:
        while True:
            unrolled = pattern.sub(lambda m: m.group(1) * int(m.group(2)), expanded)
            if unrolled == expanded:
                break
            if len(unrolled) > 4 * MAX_LAYERS:
                raise LayoutError(f"pipeline layout {text!r}: unrolls beyond {MAX_LAYERS} layers")
            expanded = unrolled
    stages = expanded.split("|")
    bad = sorted(set(expanded) - set("EtmL|"))
    if bad:
        raise LayoutError(
            f"pipeline layout {text!r}: {bad[0]!r} is not a layer (E embedding, t decoder, m MTP, L loss)"
        )
    if len(stages) % pp:
        raise LayoutError(f"pipeline layout {text!r}: {len(stages)} stages do not divide over pp={pp}")
    if expanded.count("E") != 1 or not stages[0].startswith("E"):
        raise LayoutError(f"pipeline layout {text!r}: the embedding (E) must open the first stage, once")
    if expanded.count("L") != 1 or not stages[-1].endswith("L"):
        raise LayoutError(f"pipeline layout {text!r}: the loss (L) must close the last stage, once")
    if "m" in expanded and not re.fullmatch(r"t*m+L", stages[-1]):
        raise LayoutError(
            f"pipeline layout {text!r}: LiveR keeps multi-token prediction layers (m) at the end of the "
            "last stage, right before the loss, as Megatron's default does"
        )
    return tuple(stage.count("t") for stage in stages), len(stages) // pp


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


def balanced_split(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage for ``pp`` stages: ``()`` (even) when they divide; otherwise the spare layers go
    to the middle stages, then the last, never the first (it already holds the embeddings and the most
    micro-batches in flight)."""
    if pp < 1 or pp > num_layers:
        raise LayoutError(f"cannot split {num_layers} layers over pp={pp}")
    base, extra = divmod(num_layers, pp)
    if not extra:
        return ()
    split = [base] * pp
    for stage in [*range(1, pp - 1), pp - 1][:extra]:
        split[stage] += 1
    return tuple(split)
