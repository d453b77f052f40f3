"""What one change of the device set costs, from the real planners, cached by the shape of the change.

The simulator asks one question per reconfiguration: the job runs ``old_layout`` on ``w`` nodes; ``kept``
of them stay and ``fresh`` nodes without state join; what is the target world, and what would moving to
it cost? The answer comes from the same code a job would run:

* the target layout and placement from the topology planner (:func:`topology_chooser`, behind the small
  :data:`ChooseLayout` interface so another chooser can be plugged in);
* the transfer from the transfer planner (:func:`build_plan` on the chosen world, then timed round by
  round: in each streaming round every device sends and receives its bytes over the node's links and
  the network, the round lasts as long as its busiest device plus a fixed round latency);
* a restart's checkpoint read from the memory model's per-rank training state of the target layout.

Node identities do not matter to these numbers beyond which nodes survive, so the question is asked on
a canonical cluster: the old world in rank order on ``node000..``, the last ``w - kept`` nodes dropped,
fresh nodes appended. Answers are cached per ``(old layout, w, kept, fresh)``: a 1,024-GPU trace with
dozens of events asks only a handful of distinct questions. (The chooser's placement is not rank order;
treating the current world as rank order on its nodes is the one approximation this makes.)
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import msgspec

from liver.reshard.plan import Plan, WorldConfig
from liver.reshard.planner import NoSurvivingSource, build_plan, plan_stats
from liver.services.topology import choose_topology
from liver.services.topology.cost import step_cost
from liver.services.topology.memory import stage_state_bytes
from liver.services.topology.placement import blocks_within_nodes, tp_groups_within_nodes
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.model import ModelSpec

from .calibration import Calibration

ChooseLayout = Callable[[ModelSpec, tuple[Device, ...], WorldConfig | None], tuple[ParallelLayout, Placement]]
"""``choose_layout(model, devices, current) -> (layout, placement)``: the target world for a device set,
coming from ``current`` (``None`` at the start). Raises ``ValueError`` when no layout fits."""


def topology_chooser(calibration: Calibration) -> ChooseLayout:
    """The project's topology planner (:func:`liver.services.topology.choose_topology`) as a
    :data:`ChooseLayout`, with the calibration's training setup, hardware and staging buffer."""

    def choose(
        model: ModelSpec, devices: tuple[Device, ...], current: WorldConfig | None
    ) -> tuple[ParallelLayout, Placement]:
        if current is None:
            # No state yet: any valid layout serves as the origin; nothing is moved from it.
            current = WorldConfig(ParallelLayout(1, 1, 1), Placement(devices[:1]))
        decision = choose_topology(
            model,
            calibration.setup,
            calibration.hardware,
            current,
            devices,
            staging_bytes=calibration.staging_bytes,
            top=1,  # the simulator needs the decision, not the runners-up the explanation would place
        )
        return decision.layout, decision.placement

    return choose


class Transition(msgspec.Struct, frozen=True, kw_only=True):
    """The target world of one device-set change and what reaching it costs (canonical node indices:
    ``0..kept-1`` are surviving nodes of the old world in its order, ``kept..`` the fresh ones)."""

    old_layout: ParallelLayout | None
    new_layout: ParallelLayout | None
    """``None`` when no layout of the new device set is valid and fits: the job cannot run."""
    why_none: str = ""
    used_nodes: tuple[int, ...] = ()
    """Canonical indices of the nodes the new world runs on."""
    new_devices: int = 0
    tokens_per_s: float = 0.0
    """The cost model's estimate for the new world (for tokens trained; efficiency does not use it)."""
    step_s: float = 0.0
    bytes_total: int = 0
    bytes_moved: int = 0
    bytes_inter_node: int = 0
    max_recv_bytes: int = 0
    rounds: int = 0
    transfer_s: float = 0.0
    """Live handoff: the layer-streamed transfer as the project's executor runs it (0 without an old
    world); see :func:`streaming_seconds`."""
    transfer_barrier_s: float = 0.0
    """The same with a barrier after every streaming step (the paper's Algorithm 1), for comparison."""
    load_max_rank_bytes: int = 0
    load_total_bytes: int = 0
    """Restart: the largest rank's checkpoint shard and all ranks' shards of the new layout."""
    unchanged: bool = False
    """The new world is the old one on the same nodes: nothing to do."""

    kept: int = 0
    """How many old-world nodes survive in the new device set (canonical indices ``0..kept-1``)."""
    lost: int = 0
    """How many old-world nodes are gone before the transfer (the last ones of the old world): the
    transfer reads nothing from them (a handoff around a loss)."""

    @property
    def uses_fresh(self) -> bool:
        """Whether nodes without state (new processes) join the new world."""
        return any(i >= self.kept for i in self.used_nodes)


class TransitionKey(msgspec.Struct, frozen=True):
    old_layout: ParallelLayout | None
    old_nodes: int
    kept: int
    fresh: int
    lost: int = 0


class TransitionPlanner:
    """Answers and caches :class:`Transition` questions for one model and calibration."""

    def __init__(
        self, model: ModelSpec, calibration: Calibration, choose: ChooseLayout | None = None
    ) -> None:
        self.model = model
        self.calibration = calibration
        self.choose = choose or topology_chooser(calibration)
        self._default_choose = choose is None
        self.cache: dict[TransitionKey, Transition] = {}
        self.misses = 0
        self.hits = 0
        self.planning_seconds = 0.0

    def rebind(self, calibration: Calibration) -> TransitionPlanner:
        """A planner for ``calibration`` that shares this one's cache when the fields transitions depend
        on are the same (restart and preparation costs are applied later, from the calibration)."""
        other = TransitionPlanner(self.model, calibration, self.choose)
        if _transition_fields(calibration) == _transition_fields(self.calibration):
            other.cache = self.cache
        else:
            other.choose = topology_chooser(calibration) if self._default_choose else self.choose
        other._default_choose = self._default_choose
        return other

    def transition(
        self, old_layout: ParallelLayout | None, old_nodes: int, kept: int, fresh: int, lost: int = 0
    ) -> Transition:
        """``lost`` of the ``old_nodes - kept`` dropped nodes are gone before the transfer: the plan reads
        from surviving replicas only, and the answer has no layout when some state survives nowhere."""
        if not 0 <= kept <= old_nodes or fresh < 0:
            raise ValueError(f"transition: kept={kept}, fresh={fresh} for a world on {old_nodes} nodes")
        if not 0 <= lost <= old_nodes - kept:
            raise ValueError(f"transition: lost={lost} of the {old_nodes - kept} nodes dropped")
        key = TransitionKey(
            old_layout,
            old_nodes if old_layout else 0,
            kept if old_layout else 0,
            fresh,
            lost if old_layout else 0,
        )
        hit = self.cache.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        self.misses += 1
        started = time.perf_counter()
        result = self._compute(key)
        self.planning_seconds += time.perf_counter() - started
        self.cache[key] = result
        return result

    def _compute(self, key: TransitionKey) -> Transition:
        cal, model = self.calibration, self.model
        per = cal.devices_per_node
        old: WorldConfig | None = None
        if key.old_layout is not None:
            old_devices = grid_devices(key.old_nodes, per)[: key.old_layout.world_size]
            old = WorldConfig(key.old_layout, Placement(old_devices))
        total_nodes = key.kept + key.fresh
        if total_nodes == 0:
            return Transition(
                old_layout=key.old_layout, new_layout=None, why_none="no devices", kept=key.kept
            )
        # Kept nodes are the first ``kept`` of the old world; fresh nodes follow them with new names.
        canonical = [*range(key.kept), *range(key.old_nodes, key.old_nodes + key.fresh)]
        grid = grid_devices(key.old_nodes + key.fresh, per)
        devices = tuple(d for n in canonical for d in grid[n * per : (n + 1) * per])
        try:
            layout, placement = self.choose(model, devices, old)
        except ValueError as exc:
            return Transition(old_layout=key.old_layout, new_layout=None, why_none=str(exc), kept=key.kept)
        node_index = {grid[n * per].node: i for i, n in enumerate(canonical)}
        used = tuple(sorted({node_index[d.node] for d in placement.devices}))
        new = WorldConfig(layout, placement)
        nodes_used = len({d.node for d in placement.devices})
        cost = step_cost(
            model,
            cal.setup,
            cal.hardware,
            layout,
            tp_within_node=tp_groups_within_nodes(layout, placement) or nodes_used == 1,
            single_node=nodes_used == 1,
            ep_within_node=blocks_within_nodes(placement, layout.expert_tp * layout.ep),
            cp_within_node=blocks_within_nodes(placement, layout.tp * layout.cp),
        )
        stages = stage_state_bytes(model, cal.setup, layout)
        fields = {
            "old_layout": key.old_layout,
            "new_layout": layout,
            "used_nodes": used,
            "new_devices": layout.world_size,
            "tokens_per_s": cost.tokens_per_s,
            "step_s": cost.step_s,
            "load_max_rank_bytes": max(state for state, _grad in stages),
            "load_total_bytes": sum(state for state, _grad in stages) * (layout.world_size // layout.pp),
            "kept": key.kept,
            "lost": key.lost,
        }
        if old is None:
            return Transition(**fields)
        unchanged = layout == old.layout and placement.devices == old.placement.devices
        # The lost nodes are the last of the old world, among the dropped ones (never a destination).
        gone = {grid[n * per].node for n in range(key.old_nodes - key.lost, key.old_nodes)}
        lost = [d for d in old.placement.devices if d.node in gone]
        try:
            plan = build_plan(
                model, old, new, cal.staging_bytes, optimizer=cal.transfer_optimizer_state, lost=lost
            )
        except NoSurvivingSource as exc:
            return Transition(
                old_layout=key.old_layout, new_layout=None, why_none=str(exc), kept=key.kept, lost=key.lost
            )
        stats = plan_stats(plan)
        timing = streaming_seconds(plan, cal)
        return Transition(
            **fields,
            bytes_total=stats.bytes_total,
            bytes_moved=stats.bytes_moved,
            bytes_inter_node=stats.bytes_inter_node,
            max_recv_bytes=stats.max_recv_bytes,
            rounds=stats.rounds,
            transfer_s=0.0 if unchanged else timing[0],
            transfer_barrier_s=0.0 if unchanged else timing[1],
            unchanged=unchanged,
        )


def _transition_fields(calibration: Calibration) -> tuple[object, ...]:
    c = calibration
    return (
        c.hardware,
        c.setup,
        c.devices_per_node,
        c.staging_bytes,
        c.transfer_optimizer_state,
        c.round_latency_s,
    )


def streaming_seconds(plan: Plan, calibration: Calibration) -> tuple[float, float]:
    """The layer-streamed transfer of ``plan``: ``(as this project's executor runs it, with barriers)``.

    The plan's steps ``(layer, round)`` run in order on every device. Within a step a device's sends
    and receives proceed at once (full-duplex links), so it is busy for its busier direction
    (:meth:`Calibration.transfer_link_s`) plus ``round_latency_s``. The project's executor has no
    barrier: a device starts a step when it has finished its previous one, and its messages complete
    once the peers it exchanges with have started the step too, so it finishes the step at
    ``max(own ready, peers' ready) + busy``; the transfer ends when the last device finishes. With a
    barrier after every step (the paper's Algorithm 1) each step instead lasts as long as its busiest
    device, and steps that touch disjoint pipeline stages no longer overlap: the second number, for
    comparison. Local copies (same device) are free next to the network.
    """
    old_dev, new_dev = plan.old.placement.devices, plan.new.placement.devices
    # (layer, round) -> device -> [send intra, send inter, recv intra, recv inter], and who talks to whom
    steps: dict[tuple[int, int], dict[Device, list[int]]] = defaultdict(
        lambda: defaultdict(lambda: [0, 0, 0, 0])
    )
    peers: dict[tuple[int, int], dict[Device, set[Device]]] = defaultdict(lambda: defaultdict(set))
    for t in plan.tasks:
        if t.local:
            continue
        src, dst = old_dev[t.src], new_dev[t.dst]
        inter = 1 if src.node != dst.node else 0
        step = (t.layer, t.round)
        steps[step][src][inter] += t.nbytes
        steps[step][dst][2 + inter] += t.nbytes
        peers[step][src].add(dst)
        peers[step][dst].add(src)
    latency = calibration.round_latency_s
    with_barriers = 0.0
    ready: dict[Device, float] = defaultdict(float)
    for step in sorted(steps):
        busy = {
            device: max(
                calibration.transfer_link_s(s_intra, s_inter), calibration.transfer_link_s(r_intra, r_inter)
            )
            + latency
            for device, (s_intra, s_inter, r_intra, r_inter) in steps[step].items()
        }
        with_barriers += max(busy.values())
        start = {d: max(ready[d], *(ready[p] for p in peers[step][d])) for d in busy}
        for device, seconds in busy.items():
            ready[device] = start[device] + seconds
    return max(ready.values(), default=0.0), with_barriers


__all__ = [
    "ChooseLayout",
    "Transition",
    "TransitionKey",
    "TransitionPlanner",
    "streaming_seconds",
    "topology_chooser",
]
