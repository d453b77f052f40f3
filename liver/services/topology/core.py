"""The topology service's work on one request, without I/O: which devices may be used, the chooser's
decision, and the message that answers the coordinator.

The device pool is the live world less what leaves (``remove``) and what is gone (``lost``), plus what
is offered (``add``). ``lost`` travels on in ``TopologyPlanned`` so that the transfer planner takes no
state from those devices. A ``target_devices`` below the pool's size keeps the devices that hold state
first, whole nodes with the most state first, so that TP groups stay on one node and the fewest bytes
move; a target above it cannot be met and fails. A request whose deadline has passed fails without
planning: the coordinator has aborted it already, and a plan would only make the transfer planner work.

Every way planning can fail for reasons of the request or the job (no layout fits, the live layout does
not suit the model, an unmeetable target) is a :class:`PlanningFailed` with the reason; the coordinator
then aborts the handoff and keeps the old world.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import NamedTuple

from msgspec.structs import replace

from liver.reshard.plan import WorldConfig
from liver.shared.layout import Device
from liver.shared.messages import PlanningFailed, PlanningStage, TopologyPlanned, TopologyRequest

from .chooser import TopologyDecision, TopologyError, choose_topology
from .memory import SetupError
from .settings import JobProfile, TopologySettings

EXPLANATION_LIMIT = 20000
"""``TopologyPlanned.explanation``'s limit; the chooser's paragraph is far shorter, notes included."""


class Answer(NamedTuple):
    message: TopologyPlanned | PlanningFailed
    decision: TopologyDecision | None
    """``None`` when planning failed."""


def device_pool(request: TopologyRequest) -> tuple[Device, ...]:
    """The devices the target world may use (see the module docstring); raises :class:`TopologyError`
    when ``target_devices`` asks for more than there are."""
    gone = set(request.remove) | set(request.lost)
    survivors = tuple(d for d in request.placement.devices if d not in gone)
    pool = survivors + tuple(request.add)
    target = request.target_devices
    if target is None or target == len(pool):
        return pool
    if target > len(pool):
        raise TopologyError(
            f"target_devices: {target} devices asked for, but only {len(pool)} are available "
            f"({len(survivors)} of the live world and {len(request.add)} offered)"
        )
    return _keep_state(pool, frozenset(survivors), target)


def _keep_state(pool: Sequence[Device], holding: frozenset[Device], count: int) -> tuple[Device, ...]:
    """``count`` devices of ``pool``: nodes with the most state-holding devices first, and on each node
    the state-holding ones first; the result keeps the pool's order."""
    nodes: dict[str, list[Device]] = {}
    for device in pool:
        nodes.setdefault(device.node, []).append(device)
    order = sorted(nodes, key=lambda n: -sum(d in holding for d in nodes[n]))  # stable: pool order
    chosen: set[Device] = set()
    for node in order:
        for device in sorted(nodes[node], key=lambda d: d not in holding):
            if len(chosen) == count:
                break
            chosen.add(device)
    return tuple(d for d in pool if d in chosen)


def failed(request: TopologyRequest, reason: str) -> PlanningFailed:
    return PlanningFailed(
        job_id=request.job_id,
        event_id=request.event_id,
        generation=request.generation,
        stage=PlanningStage.TOPOLOGY,
        reason=reason[:2000],
    )


def answer(
    request: TopologyRequest, profile: JobProfile, settings: TopologySettings, now: datetime
) -> Answer:
    """Plan the target world of ``request`` for a job of ``profile`` at time ``now``."""
    if request.deadline <= now:
        return Answer(
            failed(request, f"the request's deadline {request.deadline.isoformat()} passed before planning"),
            None,
        )
    own = request.geometry
    if own is not None and own.num_layers != profile.model.num_layers:
        return Answer(
            failed(
                request,
                f"the job's model {own.name!r} has {own.num_layers} decoder layers, the model configured "
                f"for its memory and cost estimates ({profile.model.name!r}) {profile.model.num_layers}: "
                "configure a model of the same depth for this job",
            ),
            None,
        )
    notes: list[str] = []
    hardware = profile.hardware
    if request.device_memory_bytes is not None and request.device_memory_bytes != hardware.memory_bytes:
        notes.append(
            f"Device memory {request.device_memory_bytes} bytes as the workers reported "
            f"(the {hardware.name} profile says {hardware.memory_bytes})."
        )
        hardware = replace(hardware, memory_bytes=request.device_memory_bytes)
    try:
        devices = device_pool(request)
        if request.target_devices is not None:
            notes.append(f"{request.target_devices} devices asked for.")
        decision = choose_topology(
            profile.model,
            profile.setup,
            hardware,
            WorldConfig(request.layout, request.placement),
            devices,
            tolerance=settings.tolerance,
            top=settings.top,
            tp_across_nodes=settings.tp_across_nodes,
            staging_bytes=settings.staging_bytes,
            lost=request.lost,
            geometry=request.geometry,
            redundancy=settings.redundancy,
            copies=request.peer_copies,
        )
    except (TopologyError, SetupError) as exc:
        return Answer(failed(request, str(exc)), None)
    explanation = " ".join([*notes, decision.explanation])[:EXPLANATION_LIMIT]
    planned = TopologyPlanned(
        job_id=request.job_id,
        event_id=request.event_id,
        from_generation=request.from_generation,
        generation=request.generation,
        model=request.geometry or profile.model.geometry(),
        from_layout=request.layout,
        from_placement=request.placement,
        layout=decision.layout,
        placement=decision.placement,
        candidates=decision.message_candidates(),
        explanation=explanation,
        deadline=request.deadline,
        lost=request.lost,
        peer_copies=request.peer_copies,
    )
    return Answer(planned, decision)
