"""The topology planner's core: enumerate the layouts a device set allows, keep those that are valid
and fit, score them, and choose one that is nearly the fastest while moving the fewest bytes.

Rules of validity (each rejection names its rule in :attr:`CandidateScore.rule`):

* ``tp_divisibility``: attention heads, query groups and the FFN width must divide by TP (Megatron's
  column/row split; the vocabulary is padded per TP, so it never blocks a layout);
* ``pp_layers``: at most one pipeline stage per decoder layer; layers that do not divide go to a
  balanced uneven split (:func:`balanced_split`);
* ``batch``: the global batch must divide into ``dp`` replicas of whole micro-batches; with virtual
  pipeline parallelism (``VPP``, candidates of up to :data:`MAX_VPP` equal chunks per stage) each
  rank's micro-batches must also be a multiple of ``pp`` (Megatron's interleaved schedule runs them in
  groups of ``pp`` per chunk);
* ``tp_across_nodes``: every TP group must fit on one node (required unless ``tp_across_nodes=True``,
  then such layouts are scored with TP traffic over the network); TP's per-layer all-reduces sit on the
  critical path and the network is ~8x slower than NVLink;
* ``memory``: the memory model's peak (:mod:`.memory`) must fit the usable device memory.

All devices are used when any layout allows it; otherwise the largest count that has a valid, fitting
layout (a prime count of devices often has none), leaving the fewest devices idle, and the explanation
says so. Among layouts within ``tolerance`` of the best estimated throughput one whose world survives
the loss of any one node without notice wins (from replicas on other nodes or from the peer copies
the job keeps by default: any world on two nodes or more), then the one whose placement moves the
fewest bytes (the current layout on unchanged devices moves none), then the current layout, then the
faster: a lower bound ranks them so only a few are placed, and each placement's bytes are exact
(:func:`.placement.bytes_moved`). The decision says how its world survives a node's loss
(:class:`NodeLoss`) and the host memory its peer copies take (:mod:`liver.reshard.redundancy`); a job
that keeps no copies (``copies=False``), or copies beyond the hardware profile's host-memory budget
(``HardwareProfile.copies_budget_bytes``), survive only from replicas on other nodes.

Devices of the current world that are ``lost`` are not in ``devices`` (they can hold no new rank), and
the transfer planner takes no state from them. The bytes-moved tie-break needs no change for that: it
counts the new state less what each new rank finds on its own device, and a byte that must move is
sent once whichever surviving replica sends it. Only the placement's weighting of bytes from a
neighbour on the same node versus another node depends on who can send, so the placement's cost matrix
gets ``lost`` too. Whether the state survives at all does not depend on the candidate (every layout
needs all of it), so the transfer planner, which finds the tensor without a surviving holder, says so.
"""

from __future__ import annotations

import enum
import math
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from liver.reshard.placement import (
    DEFAULT_INTER_NODE_WEIGHT,
    bytes_moved,
    local_lower_bound,
    optimized_placement,
)
from liver.reshard.plan import WorldConfig
from liver.reshard.planner import DEFAULT_BUDGET_BYTES, orphaned_shards
from liver.reshard.redundancy import redundancy as copy_redundancy
from liver.shared.errors import PlanningError
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, LayoutError, ParallelLayout, Placement, balanced_split
from liver.shared.messages import Candidate
from liver.shared.model import ModelSpec

from .cost import StepCost, step_cost
from .memory import HardwareProfile, SetupError, TrainingSetup, memory_estimate
from .placement import node_local_placement

Redundancy = Literal["none", "node"]
"""What the state must survive: nothing in particular, or the loss of any one node (see
:func:`choose_topology`)."""


class NodeLoss(enum.StrEnum):
    """How a world's state comes through the loss of any one of its nodes without notice."""

    REPLICAS = "replicas"  # a replica on another node holds every piece: nothing extra is kept
    COPIES = "copies"  # what no replica holds is recovered from the peer copies kept on another node
    CHECKPOINT = "checkpoint"  # only the durable checkpoint: one node holds the world, or what no
    # replica holds has no peer copy (the job keeps none, or they do not fit the host-memory budget)


MAX_VPP = 8
"""The most model chunks per stage the chooser considers (each chunk adds pipeline hand-offs)."""

Rule = Literal["ok", "tp_divisibility", "pp_layers", "batch", "sequence", "tp_across_nodes", "memory"]

_RULE_WORDS: dict[str, str] = {
    "tp_divisibility": "TP does not divide the heads, query groups or FFN",
    "pp_layers": "more stages than layers",
    "batch": "global batch does not divide over DP",
    "sequence": "the sequence does not split over CP",
    "tp_across_nodes": "TP groups would span nodes",
    "memory": "out of memory",
}


class TopologyError(PlanningError):
    """No layout of the device set is valid and fits; ``candidates`` says why for each."""

    def __init__(self, message: str, candidates: tuple[CandidateScore, ...] = ()) -> None:
        super().__init__(message)
        self.candidates = candidates


class CandidateScore(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One layout the planner considered, with its scores or the rule that rejected it."""

    layout: ParallelLayout
    devices: int
    rule: Rule
    reason: str = ""
    tokens_per_s: float = 0.0
    """Estimated throughput; also filled in for layouts rejected only for memory."""
    cost: StepCost | None = None
    memory_peak_bytes: int | None = None
    memory_peak_stage: int | None = None
    memory_usable_bytes: int | None = None
    bytes_moved: int | None = None
    """Exact for placed candidates; ``None`` where the planner did not place it."""
    tp_within_node: bool = True

    @property
    def feasible(self) -> bool:
        return self.rule == "ok"


class TopologyDecision(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The chosen target world of a resize and why."""

    layout: ParallelLayout
    placement: Placement
    tokens_per_s: float
    bytes_moved: int
    memory_peak_bytes: int
    memory_usable_bytes: int
    devices_idle: tuple[Device, ...]
    """Devices of the new set the layout leaves unused (only when no layout uses them all)."""
    candidates: tuple[CandidateScore, ...]
    """The fastest valid layouts (best first), then the most instructive rejected ones."""
    considered: int
    feasible: int
    explanation: str
    planning_seconds: float
    node_loss: NodeLoss = NodeLoss.CHECKPOINT
    """How the chosen world recovers from a node lost without notice."""
    copies_host_bytes: int = 0
    """Host memory the peer copies take on the process that keeps the most (two buffers per copy; 0
    when replicas on other nodes hold every piece). Copies that can go back a step
    (``CopyOptions.go_back``) also keep each process's own state twice (``own_copy_bytes``)."""

    @property
    def world(self) -> WorldConfig:
        return WorldConfig(self.layout, self.placement)

    def message_candidates(self) -> tuple[Candidate, ...]:
        """The candidates as the ``TopologyPlanned`` message carries them."""
        return tuple(
            Candidate(
                layout=c.layout,
                score=c.tokens_per_s if c.feasible else 0.0,
                fits=c.feasible,
                bytes_moved=c.bytes_moved,
                memory_bytes=c.memory_peak_bytes,
                note=(c.reason if not c.feasible else _cost_note(c))[:500],
            )
            for c in self.candidates
        )


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _size(nbytes: float) -> str:
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def _cost_note(c: CandidateScore) -> str:
    if c.cost is None:
        return ""
    k = c.cost
    return (
        f"{c.tokens_per_s:.4g} tokens/s; step {k.step_s:.3g} s = compute {k.compute_s:.3g} + TP "
        f"{k.tp_comm_s:.3g} + PP {k.pp_comm_s:.3g} + bubble {k.bubble_s:.3g} + DP {k.dp_comm_s:.3g}; "
        f"peak memory {_size(c.memory_peak_bytes or 0)} (stage {c.memory_peak_stage})"
    )


@dataclass(eq=False)
class _Scored:
    score: CandidateScore
    devices: tuple[Device, ...] = ()


def _rejected(layout: ParallelLayout, rule: Rule, reason: str) -> _Scored:
    """``layout`` refused by ``rule``, for ``reason``: no scores, no devices."""
    return _Scored(CandidateScore(layout=layout, devices=layout.world_size, rule=rule, reason=reason))


class _Chooser:
    """One planning call: its inputs and the caches its candidates share."""

    def __init__(
        self,
        model: ModelSpec,
        setup: TrainingSetup,
        hardware: HardwareProfile,
        current: WorldConfig,
        devices: tuple[Device, ...],
        tp_across_nodes: bool,
        staging_bytes: int,
        inter_node_weight: float,
        lost: Collection[Device] = (),
        geometry: ModelGeometry | None = None,
        copies: bool = True,
    ) -> None:
        self.model = model
        self.geometry = geometry
        self.copies = copies
        self.setup = setup
        self.hardware = hardware
        self.current = current
        self.devices = devices
        self.tp_across_nodes = tp_across_nodes
        self.staging_bytes = staging_bytes
        self.inter_node_weight = inter_node_weight
        self.nodes: dict[str, list[Device]] = {}
        for d in devices:
            self.nodes.setdefault(d.node, []).append(d)
        self.lost = frozenset(lost)
        self.surviving = set(current.placement.devices) - self.lost
        self._selections: dict[tuple[int, int], tuple[Device, ...] | None] = {}

    def select(self, count: int, group: int) -> tuple[Device, ...] | None:
        """``count`` devices in whole groups of ``group`` per node, or ``None`` when the nodes cannot
        hold that many; prefers nodes and devices that hold state already, so fresh ones stay idle."""
        key = (count, group)
        if key in self._selections:
            return self._selections[key]
        order = sorted(
            self.nodes.items(),
            key=lambda kv: (-sum(d in self.surviving for d in kv[1]), -len(kv[1])),
        )
        chosen: set[Device] = set()
        left = count
        for _node, devs in order:
            take = min(len(devs) // group * group, left // group * group)
            ranked = sorted(devs, key=lambda d: (d not in self.surviving, d.index))
            chosen.update(ranked[:take])
            left -= take
        result = None if left else tuple(d for d in self.devices if d in chosen)
        self._selections[key] = result
        return result

    def layouts(self, count: int) -> list[ParallelLayout]:
        """Every (TP, PP, DP) with ``count`` ranks, balanced splits, and the current layout if it fits."""
        out = []
        cur = self.current.layout
        # Context parallelism follows the sequence length, which a resize does not change: keep it.
        cp = cur.cp if count % cur.cp == 0 else 1
        experts = self.model.num_experts
        for tp in _divisors(count // cp):
            for pp in _divisors(count // (cp * tp)):
                dp = count // (cp * tp * pp)
                split = balanced_split(self.model.num_layers, pp) if pp <= self.model.num_layers else ()
                # Expert parallelism with expert-TP = TP: EP must divide the experts and CP x DP.
                eps = [ep for ep in _divisors(experts) if (cp * dp) % ep == 0] if experts else [1]
                out.extend(ParallelLayout(tp, pp, dp, split, cp=cp, ep=ep) for ep in eps)
                # The interleaved schedule where the layers cut into pp x vpp equal chunks.
                for vpp in range(2, MAX_VPP + 1) if pp > 1 else ():
                    if self.model.num_layers % (pp * vpp) == 0:
                        out.extend(ParallelLayout(tp, pp, dp, cp=cp, ep=ep, vpp=vpp) for ep in eps)
        if cur.world_size == count and cur not in out:
            out.append(cur)
        return out

    def evaluate(self, layout: ParallelLayout) -> _Scored:
        """``layout`` judged by the rules of validity (module docstring) in their fixed order, then
        scored on the devices it would take: the first rule it breaks is the one its score names."""
        broken = self.broken_rule(layout)
        if broken is not None:
            return _rejected(layout, *broken)
        devices, within = self.devices_for(layout)
        if devices is None:
            sizes = sorted({len(v) for v in self.nodes.values()})
            reason = (
                f"TP groups of {layout.tp} cannot stay within nodes of {'/'.join(map(str, sizes))} devices"
            )
            return _rejected(layout, "tp_across_nodes", reason)
        return self.score(layout, devices, within)

    def broken_rule(self, layout: ParallelLayout) -> tuple[Rule, str] | None:
        """The first rule ``layout`` breaks that needs no devices (TP divisibility, the job's own
        model, stages per layer, the batch, the sequence) with its reason, or ``None``."""
        model, setup = self.model, self.setup
        tp, pp, dp = layout.tp, layout.pp, layout.dp
        for what, value, size, name in (
            ("num_attention_heads", model.num_attention_heads, tp, "tp"),
            ("num_query_groups", model.query_groups, tp, "tp"),
            ("ffn_hidden_size", model.ffn_hidden_size, tp, "tp")
            if not model.num_experts
            else ("moe_ffn_hidden_size", model.expert_ffn, layout.expert_tp, "etp"),
        ):
            if value % size:
                return "tp_divisibility", f"{what} ({value}) is not divisible by {name}={size}"
        if self.geometry is not None:
            try:
                self.geometry.check_layout(layout)
            except LayoutError as exc:
                rule: Rule = "pp_layers" if f"pp={pp}" in str(exc) else "tp_divisibility"
                return rule, f"the job's model: {str(exc).partition(': ')[2] or exc}"
        if pp > model.num_layers:
            return "pp_layers", f"pp={pp} exceeds the {model.num_layers} layers"
        try:
            layout.layers_per_stage(model.num_layers)
        except LayoutError as exc:
            return "pp_layers", str(exc)
        if setup.global_batch_size % (dp * setup.micro_batch_size):
            return (
                "batch",
                f"global batch {setup.global_batch_size} is not a multiple of "
                f"dp * micro_batch = {dp} * {setup.micro_batch_size}",
            )
        try:
            layout.check_micro_batches(setup.global_batch_size // (dp * setup.micro_batch_size))
        except LayoutError as exc:
            return "batch", str(exc)
        if setup.sequence_length % (2 * layout.cp):
            # Context parallelism gives each rank two chunks of the sequence (load balance under the
            # causal mask), so 2 * CP must divide it.
            return (
                "sequence",
                f"sequence length {setup.sequence_length} is not a multiple of 2 * cp = {2 * layout.cp}",
            )
        return None

    def devices_for(self, layout: ParallelLayout) -> tuple[tuple[Device, ...] | None, bool]:
        """The devices ``layout``'s ranks would take and whether its TP groups stay within nodes; no
        devices when they cannot and TP may not span nodes."""
        n = layout.world_size
        devices = self.select(n, layout.tp)
        if devices is not None:
            return devices, True
        if not self.tp_across_nodes:
            return None, False
        devices = self.select(n, 1)
        assert devices is not None  # n <= len(self.devices)
        return devices, False

    def score(self, layout: ParallelLayout, devices: tuple[Device, ...], within: bool) -> _Scored:
        """``layout`` on ``devices`` (TP groups ``within`` nodes or not) scored by the cost model, and
        refused by the memory rule when its peak does not fit (its scores kept: a near miss)."""
        n = layout.world_size
        single_node = len({d.node for d in devices}) == 1
        per_node = min(len(v) for v in self.nodes.values())
        # Before placing: a block of ranks can stay on a node when every node holds whole blocks (the
        # simulator scores its transitions on the actual placement).
        mem = memory_estimate(
            self.model, self.setup, self.hardware, layout, self.staging_bytes, self.geometry
        )
        cost = step_cost(
            self.model,
            self.setup,
            self.hardware,
            layout,
            tp_within_node=within or single_node,
            single_node=single_node,
            ep_within_node=within and per_node % (layout.expert_tp * layout.ep) == 0,
            cp_within_node=within and per_node % (layout.tp * layout.cp) == 0,
        )
        peak = mem.peak
        fields = {
            "tokens_per_s": cost.tokens_per_s,
            "cost": cost,
            "memory_peak_bytes": peak.total_bytes,
            "memory_peak_stage": peak.stage,
            "memory_usable_bytes": mem.usable_bytes,
            "tp_within_node": within or single_node,
        }
        if not mem.fits:
            reason = (
                f"needs {_size(peak.total_bytes)} per device on stage {peak.stage} (state "
                f"{_size(peak.state_bytes)}, grads {_size(peak.grad_bytes)}, activations "
                f"{_size(peak.activation_bytes)} for {peak.in_flight} micro-batches), "
                f"{_size(mem.usable_bytes)} usable"
            )
            return _Scored(CandidateScore(layout=layout, devices=n, rule="memory", reason=reason, **fields))
        return _Scored(CandidateScore(layout=layout, devices=n, rule="ok", **fields), devices)

    def evaluate_count(self, count: int) -> list[_Scored]:
        return [self.evaluate(layout) for layout in self.layouts(count)]

    def place(self, scored: _Scored) -> tuple[Placement, int]:
        layout = scored.score.layout
        if scored.score.tp_within_node and len({d.node for d in scored.devices}) > 1:
            placement = node_local_placement(
                self.model, self.current, scored.devices, layout, self.inter_node_weight, lost=self.lost
            )
        else:
            placement = optimized_placement(
                self.model, self.current, scored.devices, layout, True, self.inter_node_weight, lost=self.lost
            )
        world = WorldConfig(layout, placement)
        # The class overlap behind both counts is computed once per layout (class_overlap's cache).
        return placement, bytes_moved(self.model, self.current, world)

    def survives_node_loss(self, layout: ParallelLayout, placement: Placement) -> bool:
        """Whether the state on ``placement`` keeps a holder outside every one of its nodes (the
        transfer planner's own rule): the loss of any one node then recovers live."""
        model = self.geometry if self.geometry is not None else self.model.geometry()
        nodes: dict[str, list[Device]] = {}
        for device in placement.devices:
            nodes.setdefault(device.node, []).append(device)
        if len(nodes) < 2:
            return False
        world = WorldConfig(layout, placement)
        return all(not orphaned_shards(model, world, lost) for lost in nodes.values())

    @staticmethod
    def on_one_node(placement: Placement) -> bool:
        return len({d.node for d in placement.devices}) < 2

    def lost_to_checkpoint(self, layout: ParallelLayout, placement: Placement) -> bool:
        """Whether a node's loss leaves the world of ``layout`` on ``placement`` only the checkpoint.
        A world on one node always; any other survives from replicas or peer copies when the job keeps
        copies and no host-memory budget is counted, which needs no look at its state."""
        if self.on_one_node(placement):
            return True
        if self.copies and self.hardware.copies_budget_bytes is None:
            return False
        return self.node_loss(layout, placement)[0] is NodeLoss.CHECKPOINT

    def node_loss(self, layout: ParallelLayout, placement: Placement) -> tuple[NodeLoss, int]:
        """How the world of ``layout`` on ``placement`` comes through a node's loss, and the host
        memory its peer copies take on the process that keeps most (0 when the job keeps none)."""
        model = self.geometry if self.geometry is not None else self.model.geometry()
        r = copy_redundancy(model, layout, placement)
        if not any(r.kept_bytes):
            return (NodeLoss.CHECKPOINT if self.on_one_node(placement) else NodeLoss.REPLICAS), 0
        if not self.copies:
            return NodeLoss.CHECKPOINT, 0
        host = max(r.kept_bytes)
        if self.on_one_node(placement) or not self.copies_fit(host):
            return NodeLoss.CHECKPOINT, host
        return NodeLoss.COPIES, host

    def copies_fit(self, host_bytes: int) -> bool:
        budget = self.hardware.copies_budget_bytes
        return budget is None or host_bytes <= budget

    def lower_bound(self, scored: _Scored) -> int:
        layout = scored.score.layout
        return local_lower_bound(self.model, self.current, scored.devices, layout)


def choose_topology(
    model: ModelSpec,
    setup: TrainingSetup,
    hardware: HardwareProfile,
    current: WorldConfig,
    devices: Sequence[Device],
    *,
    tolerance: float = 0.02,
    top: int = 5,
    tp_across_nodes: bool = False,
    staging_bytes: int = DEFAULT_BUDGET_BYTES,
    inter_node_weight: float = DEFAULT_INTER_NODE_WEIGHT,
    lost: Collection[Device] = (),
    geometry: ModelGeometry | None = None,
    redundancy: Redundancy = "none",
    copies: bool = True,
) -> TopologyDecision:
    """The target layout and placement for ``model`` on ``devices`` (surviving and added devices),
    coming from ``current`` of which the ``lost`` devices are gone (see the module docstring). Raises
    :class:`TopologyError` naming the reason when no layout of any number of the devices is valid and
    fits, or when ``devices`` names a lost device. ``geometry``, the job's own model as Megatron
    describes it, must suit every layout chosen too (``model`` then only sizes memory and cost).
    ``redundancy="node"``: only layouts (with their placements) whose state survives the loss of any
    one node compete, when some feasible layout does (a node lost without notice then recovers live
    instead of from the checkpoint), at whatever cost in throughput; the others otherwise."""
    started = time.perf_counter()
    devices = tuple(devices)
    _validate(model, setup, current, devices, tolerance, top, staging_bytes)
    gone = sorted(set(lost) & set(devices))
    if gone:
        raise TopologyError(f"devices: device {gone[0]} is lost and cannot hold a rank")
    chooser = _Chooser(
        model,
        setup,
        hardware,
        current,
        devices,
        tp_across_nodes,
        staging_bytes,
        inter_node_weight,
        lost,
        geometry,
        copies,
    )
    everything, scored = _largest_feasible_count(chooser)
    feasible = sorted(
        (s for s in scored if s.score.feasible),
        key=lambda s: (-s.score.tokens_per_s, s.score.layout.tp, s.score.layout.pp),
    )
    contest = _Contest(chooser)
    if redundancy == "node":
        feasible = contest.node_survivors(feasible) or feasible
    best = feasible[0].score.tokens_per_s
    near = [s for s in feasible if s.score.tokens_per_s >= best * (1 - tolerance)]
    winner = contest.winner(near)
    return _decision(contest, winner, feasible, scored, everything, top, tolerance, started)


def _largest_feasible_count(chooser: _Chooser) -> tuple[list[_Scored], list[_Scored]]:
    """Every layout of all the devices scored, and those of the largest device count that has a
    feasible layout (the same list when all the devices have one). Raises :class:`TopologyError` when
    no count has one."""
    devices = chooser.devices
    everything = chooser.evaluate_count(len(devices))
    scored = everything
    count = len(devices)
    while not any(s.score.feasible for s in scored):
        count -= 1
        if count == 0:
            raise TopologyError(
                _nothing_fits(chooser.model, devices, everything), tuple(s.score for s in everything)
            )
        scored = chooser.evaluate_count(count)
    return everything, scored


class _Contest:
    """The candidates' placements, each computed once when first needed (placing is the costly step,
    so the bytes bound decides which are placed at all), and the preference among those placed."""

    def __init__(self, chooser: _Chooser) -> None:
        self.chooser = chooser
        self._placed: dict[int, tuple[Placement, int]] = {}  # by id(): _Scored compares by identity

    def place(self, s: _Scored) -> tuple[Placement, int]:
        """The placement of ``s`` and the bytes it moves, placing it now when it is not yet."""
        done = self._placed.get(id(s))
        if done is None:
            done = self._placed[id(s)] = self.chooser.place(s)
        return done

    def placed(self, s: _Scored) -> tuple[Placement, int] | None:
        """The placement of ``s`` and the bytes it moves when it is placed already, else ``None``."""
        return self._placed.get(id(s))

    def node_survivors(self, feasible: list[_Scored]) -> list[_Scored]:
        """Those of ``feasible`` (all placed now, in order) whose state survives a node's loss live."""
        for s in feasible:
            self.place(s)
        return [s for s in feasible if self.chooser.survives_node_loss(s.score.layout, self.place(s)[0])]

    def preference(self, s: _Scored) -> tuple:
        """Lower is better: survives a node's loss live, moves fewer bytes, keeps the current layout,
        faster, then smaller TP and PP. ``s`` must be placed."""
        lay = s.score.layout
        placement, moved = self._placed[id(s)]
        lost_to_checkpoint = self.chooser.lost_to_checkpoint(lay, placement)
        return (
            lost_to_checkpoint,
            moved,
            lay != self.chooser.current.layout,
            -s.score.tokens_per_s,
            lay.tp,
            lay.pp,
        )

    def winner(self, near: list[_Scored]) -> _Scored:
        """The preferred of ``near`` (the candidates within the tolerance of the fastest). Only those
        whose lower bound on the bytes moved could beat the fewest found are placed, unless the preferred
        of those leaves a node's loss only the checkpoint on a set of several nodes: then all of them."""
        chooser = self.chooser
        bounded = sorted(((chooser.lower_bound(s), i) for i, s in enumerate(near)))
        fewest = math.inf
        for bound, i in bounded:
            if bound > fewest:
                break  # sorted by bound: no later candidate can move fewer bytes
            fewest = min(fewest, self.place(near[i])[1])
        winner = min((s for s in near if id(s) in self._placed), key=self.preference)
        if self.preference(winner)[0] and len(chooser.nodes) > 1:
            # The bytes bound left some candidates unplaced; one of them may survive a node's loss.
            for _bound, i in bounded:
                self.place(near[i])
            winner = min(near, key=self.preference)
        return winner


def _decision(
    contest: _Contest,
    winner: _Scored,
    feasible: list[_Scored],
    scored: list[_Scored],
    everything: list[_Scored],
    top: int,
    tolerance: float,
    started: float,
) -> TopologyDecision:
    """The decision for ``winner``: the ``top`` fastest candidates (``winner`` among them) with their
    exact bytes, the most instructive rejections, how its world survives a node's loss, and why."""
    chooser = contest.chooser
    shown = feasible[:top] if any(s is winner for s in feasible[:top]) else [*feasible[: top - 1], winner]
    for s in shown:
        contest.place(s)
    shown_scores = [msgspec.structs.replace(s.score, bytes_moved=contest.place(s)[1]) for s in shown]
    rejected = _most_instructive(scored, top)
    placement, moved = contest.place(winner)
    node_loss, copies_bytes = chooser.node_loss(winner.score.layout, placement)
    chosen = msgspec.structs.replace(winner.score, bytes_moved=moved)
    used = set(placement.devices)
    idle = tuple(d for d in chooser.devices if d not in used)
    fastest = contest.placed(feasible[0])
    fastest_bytes = fastest[1] if fastest is not None else None
    explanation = _explain(
        chooser, chosen, feasible[0].score, fastest_bytes, shown_scores, everything, scored, idle, tolerance
    ) + _survival_words(chooser, node_loss, placement, copies_bytes)
    return TopologyDecision(
        layout=chosen.layout,
        placement=placement,
        tokens_per_s=chosen.tokens_per_s,
        bytes_moved=moved,
        memory_peak_bytes=chosen.memory_peak_bytes or 0,
        memory_usable_bytes=chosen.memory_usable_bytes or 0,
        devices_idle=idle,
        candidates=(*shown_scores, *rejected),
        considered=len(scored),
        feasible=len(feasible),
        explanation=explanation,
        planning_seconds=time.perf_counter() - started,
        node_loss=node_loss,
        copies_host_bytes=copies_bytes,
    )


def assess_layout(
    model: ModelSpec,
    setup: TrainingSetup,
    hardware: HardwareProfile,
    current: WorldConfig,
    devices: Sequence[Device],
    layout: ParallelLayout,
    *,
    tp_across_nodes: bool = False,
    staging_bytes: int = DEFAULT_BUDGET_BYTES,
) -> CandidateScore:
    """One layout judged as :func:`choose_topology` judges it (its rule, reason and scores), on
    ``layout.world_size`` of ``devices``; for the CLI's ``--explain`` and for tests of each rule."""
    devices = tuple(devices)
    _validate(model, setup, current, devices, 0.0, 1, staging_bytes)
    if layout.world_size > len(devices):
        raise TopologyError(
            f"layout: {layout.describe()} needs {layout.world_size} devices, {len(devices)} given"
        )
    chooser = _Chooser(
        model, setup, hardware, current, devices, tp_across_nodes, staging_bytes, DEFAULT_INTER_NODE_WEIGHT
    )
    return chooser.evaluate(layout).score


def _validate(
    model: ModelSpec,
    setup: TrainingSetup,
    current: WorldConfig,
    devices: tuple[Device, ...],
    tolerance: float,
    top: int,
    staging_bytes: int,
) -> None:
    if not devices:
        raise TopologyError("devices: the new device set is empty")
    if len(set(devices)) != len(devices):
        dup = next(d for d, k in Counter(devices).items() if k > 1)
        raise TopologyError(f"devices: device {dup} appears twice")
    if not 0 <= tolerance < 1:
        raise TopologyError(f"tolerance must be in [0, 1), got {tolerance}")
    if top < 1:
        raise TopologyError(f"top must be at least 1, got {top}")
    if staging_bytes < 0:
        raise TopologyError(f"staging_bytes must not be negative, got {staging_bytes}")
    try:
        setup.check_model(model)
    except SetupError as exc:
        raise TopologyError(f"setup: {exc}") from None
    try:
        model.check_layout(current.layout)
    except LayoutError as exc:
        raise TopologyError(f"current.layout: {exc}") from None


_REJECTION_ORDER = {
    "memory": 0,
    "tp_across_nodes": 1,
    "batch": 2,
    "sequence": 3,
    "pp_layers": 4,
    "tp_divisibility": 5,
}


def _most_instructive(scored: list[_Scored], top: int) -> list[CandidateScore]:
    """Rejected layouts worth showing: near misses on memory first (fastest first), then the rest."""
    rejected = [s.score for s in scored if not s.score.feasible]
    rejected.sort(key=lambda c: (_REJECTION_ORDER[c.rule], -c.tokens_per_s, c.layout.tp, c.layout.pp))
    return rejected[:top]


def _rule_counts(scored: list[_Scored]) -> str:
    counts = Counter(s.score.rule for s in scored if not s.score.feasible)
    return ", ".join(f"{k} {_RULE_WORDS[rule]}" for rule, k in sorted(counts.items(), key=lambda kv: -kv[1]))


def _nothing_fits(model: ModelSpec, devices: tuple[Device, ...], everything: list[_Scored]) -> str:
    n = len(devices)
    text = f"no layout of {model.name} fits {n} devices or any fewer: with all {n}, " + _rule_counts(
        everything
    )
    misses = [s.score for s in everything if s.score.rule == "memory"]
    if misses:
        closest = min(misses, key=lambda c: c.memory_peak_bytes or 0)
        text += f"; the closest, {closest.layout.describe()}, {closest.reason}"
    elif everything:
        text += f"; e.g. {everything[0].score.layout.describe()}: {everything[0].score.reason}"
    return text


def _survival_words(chooser: _Chooser, node_loss: NodeLoss, placement: Placement, copies_bytes: int) -> str:
    if node_loss is NodeLoss.REPLICAS:
        return " A node lost without notice is recovered live from the replicas on the other nodes."
    if node_loss is NodeLoss.COPIES:
        return (
            " A node lost without notice is recovered live from the peer copies of what no replica holds "
            f"({_size(copies_bytes)} of host memory on the process that keeps the most)."
        )
    if chooser.on_one_node(placement):
        return " One node holds the whole world: its loss leaves only the checkpoint."
    if not chooser.copies:
        return (
            " The job keeps no peer copies and some state is held on one node only: a node lost without "
            "notice leaves only the checkpoint."
        )
    return (
        f" The peer copies of what no replica holds would take {_size(copies_bytes)} of host memory on "
        f"the process that keeps the most, more than the {_size(chooser.hardware.copies_budget_bytes or 0)} "
        f"the {chooser.hardware.name} profile allows: a node lost without notice leaves only the checkpoint."
    )


def _explain(
    chooser: _Chooser,
    chosen: CandidateScore,
    fastest: CandidateScore,
    fastest_bytes: int | None,
    shown: list[CandidateScore],
    everything: list[_Scored],
    scored: list[_Scored],
    idle: tuple[Device, ...],
    tolerance: float,
) -> str:
    n = len(chooser.devices)
    fresh = sum(d not in chooser.surviving for d in chooser.devices)
    k = chosen.cost
    assert k is not None
    parts = [
        f"{n} devices on {len(chooser.nodes)} nodes ({n - fresh} with state, {fresh} new).",
    ]
    if idle:
        parts.append(
            f"No layout uses all {n} devices ({_rule_counts(everything)}), so the plan uses "
            f"{chosen.devices} and leaves {len(idle)} idle ({', '.join(map(str, idle[:8]))}"
            f"{', ...' if len(idle) > 8 else ''})."
        )
    parts.append(
        f"Of {len(scored)} layouts of {chosen.devices} devices, {sum(s.score.feasible for s in scored)} "
        f"are valid and fit" + (f" (rejected: {_rule_counts(scored)})." if _rule_counts(scored) else ".")
    )
    keeps = chosen.layout == chooser.current.layout
    parts.append(
        f"Chose {chosen.layout.describe()}{' (the current layout)' if keeps else ''}: an estimated "
        f"{chosen.tokens_per_s:.4g} tokens/s (step {k.step_s:.3g} s: compute {k.compute_s:.3g}, TP "
        f"{k.tp_comm_s:.3g}, PP {k.pp_comm_s:.3g}, bubble {k.bubble_s:.3g}, DP {k.dp_comm_s:.3g}), peak "
        f"memory {_size(chosen.memory_peak_bytes or 0)} of {_size(chosen.memory_usable_bytes or 0)} usable "
        f"(stage {chosen.memory_peak_stage}), moving {_size(chosen.bytes_moved or 0)} between devices."
    )
    if fastest.layout != chosen.layout:
        gain = fastest.tokens_per_s / chosen.tokens_per_s - 1
        moved = f" but would move {_size(fastest_bytes)}" if fastest_bytes is not None else ""
        parts.append(
            f"The fastest, {fastest.layout.describe()}, is {gain:.1%} faster under the cost model{moved}; "
            f"within the {tolerance:.0%} tolerance the planner prefers moving fewer bytes."
        )
    elif len(shown) > 1:
        runner = shown[1]
        parts.append(
            f"It is the fastest; the runner-up {runner.layout.describe()} reaches "
            f"{runner.tokens_per_s:.4g} tokens/s and would move {_size(runner.bytes_moved or 0)}."
        )
    return " ".join(parts)
