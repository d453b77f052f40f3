"""The transfer service's work on one ``TopologyPlanned``, without I/O: plan, verify, summarise, slice
and encode (all of it CPU work that the adapter runs off its event loop).

The placement is the topology planner's (it travels in the message), so this only plans the transfer
for it. The summary also says what a plain rank-order placement would have moved and what no placement
can avoid moving, so that every handoff reports how much its placement saved.

A plan that fails the independent verification is refused (:class:`~liver.shared.codec.MessageError`
at ``$``): publishing it would have workers execute a transfer that loses or duplicates state.

The message's ``lost`` devices are gone: no state is taken from them (the planner picks among the
surviving DP replicas) and the verification proves it. When some state survives nowhere the answer is
a :class:`~liver.shared.messages.PlanningFailed` (:func:`planning_failed`): the input was sound, the job
cannot continue live, and the coordinator falls back to the checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import NamedTuple, Protocol

import msgspec

from liver.reshard.placement import local_lower_bound, rank_order_placement
from liver.reshard.plan import Plan, PlanSlice, TransferTask, WorldConfig
from liver.reshard.plan_file import encode_plan
from liver.reshard.planner import (
    NoSurvivingSource,
    build_plan,
    plan_stats,
    rank_order_bytes_moved,
)
from liver.reshard.verifier import verify_plan
from liver.shared.codec import MessageError
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, LayoutError, ParallelLayout
from liver.shared.messages import PlanningFailed, PlanningStage, PlanSummary, TopologyPlanned


class Planner(Protocol):
    """``build_plan``'s signature: the service takes it as a parameter so a test can hand it a faulty one."""

    def __call__(
        self,
        model: ModelGeometry,
        old: WorldConfig,
        new: WorldConfig,
        budget_bytes: int,
        optimizer: bool,
        *,
        lost: Collection[Device] = (),
        copies: bool = False,
    ) -> Plan: ...


VERIFY_ERRORS_REPORTED = 5


class PlannedTransfer(NamedTuple):
    plan: Plan
    summary: PlanSummary
    slices: tuple[PlanSlice, ...]
    plan_file: bytes
    """The plan in the plan-file format (``docs/plan-format.md``): the auditable whole."""
    slice_files: tuple[bytes, ...]
    """``slices`` as :class:`~liver.reshard.plan.SliceFile` JSON (no worlds), in the same order, which is
    :func:`~liver.reshard.plan.slice_devices`'s: what each device fetches."""
    verify_seconds: float
    encode_seconds: float
    """Writing the plan file lists every rank's shards: for a large job it costs more than planning."""


def _check_layout(model: ModelGeometry, layout: ParallelLayout, path: str) -> None:
    try:
        model.check_layout(layout)
    except LayoutError as exc:
        raise MessageError("TopologyPlanned", path, f"model {model.name!r} cannot use it: {exc}") from None


def plan_transfer(
    msg: TopologyPlanned,
    *,
    budget_bytes: int,
    optimizer: bool = True,
    planner: Planner = build_plan,
) -> PlannedTransfer:
    """The verified plan for ``msg``, its summary and each device's slice; raises :class:`MessageError`
    for input that cannot be planned, :class:`NoSurvivingSource` when state was held only by ``lost``
    devices (answer it with :func:`planning_failed`)."""
    model = msg.model
    _check_layout(model, msg.from_layout, "$.from_layout")
    _check_layout(model, msg.layout, "$.layout")
    old = WorldConfig(msg.from_layout, msg.from_placement)
    new = WorldConfig(msg.layout, msg.placement)
    lost = msg.lost
    t0 = time.perf_counter()
    # A recovery is planned from the peer copies where no survivor holds the state, unless the job's
    # world announced that it keeps none (RuntimeOptions.copies): then such a loss fails here, at once.
    plan = planner(model, old, new, budget_bytes, optimizer, lost=lost, copies=msg.peer_copies)
    plan_seconds = time.perf_counter() - t0
    report = verify_plan(plan, lost=lost)
    verify_seconds = time.perf_counter() - t0 - plan_seconds
    if not report.ok:
        shown = "; ".join(report.errors[:VERIFY_ERRORS_REPORTED])
        raise MessageError(
            "TopologyPlanned",
            "$",
            f"the transfer plan failed verification ({len(report.errors)} errors): {shown}",
        )
    stats = plan_stats(plan)
    devices = msg.placement.devices
    if rank_order_placement(old, devices, msg.layout) == msg.placement:
        rank_order_bytes = stats.bytes_moved
    else:
        rank_order_bytes, _ = rank_order_bytes_moved(
            model, old, msg.layout, devices, budget_bytes, optimizer, lost=lost
        )
    summary = PlanSummary(
        tasks=stats.slices,
        tasks_coalesced=stats.tasks,
        rounds=stats.rounds,
        bytes_moved=stats.bytes_moved,
        bytes_local=stats.bytes_local,
        bytes_rank_order=rank_order_bytes,
        lower_bound_bytes=local_lower_bound(model, old, devices, msg.layout, optimizer),
        max_receive_bytes=stats.max_recv_bytes,
        verified=True,
        plan_seconds=plan_seconds,
    )
    slices = device_slices(plan, optimizer)
    t1 = time.perf_counter()
    plan_file = encode_plan(plan)
    slice_files = tuple(msgspec.json.encode(piece.stored(msg.generation)) for piece in slices)
    return PlannedTransfer(
        plan=plan,
        summary=summary,
        slices=slices,
        plan_file=plan_file,
        slice_files=slice_files,
        verify_seconds=verify_seconds,
        encode_seconds=time.perf_counter() - t1,
    )


def planning_failed(msg: TopologyPlanned, error: NoSurvivingSource) -> PlanningFailed:
    """The answer to ``msg`` when the state its world needs survives on no device."""
    return PlanningFailed(
        job_id=msg.job_id,
        event_id=msg.event_id,
        generation=msg.generation,
        stage=PlanningStage.TRANSFER,
        reason=str(error)[:2000],
    )


def device_slices(plan: Plan, optimizer: bool) -> tuple[PlanSlice, ...]:
    """One slice per device of either world (old devices first, in rank order), empty ones included:
    a device with nothing to send or receive still learns that from its slice."""
    old_dev, new_dev = plan.old.placement.devices, plan.new.placement.devices
    tasks: dict[Device, list[TransferTask]] = {d: [] for d in (*old_dev, *new_dev)}
    for task in plan.tasks:
        src, dst = plan.src_device(task.src), new_dev[task.dst]  # a stand-in's tasks run on its keeper
        tasks[src].append(task)
        if dst != src:
            tasks[dst].append(task)
    return tuple(
        PlanSlice(
            model=plan.model,
            optimizer=optimizer,
            old=plan.old,
            new=plan.new,
            budget_bytes=plan.budget_bytes,
            device=device,
            tasks=tuple(mine),
            stand_ins=plan.stand_ins,
        )
        for device, mine in tasks.items()
    )
