"""One valid, fully populated instance of every bus message type, for a job of your choosing.

The fuzz run (:mod:`liver.chaos.fuzz`) mutates these into hostile input, and the message tests check
that each survives the codec: a sample that stopped being valid would fail both.
"""

from __future__ import annotations

from datetime import UTC, datetime

from liver.shared import messages as m
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.model import PRESETS

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
OLD = ParallelLayout(tp=2, pp=2, dp=2)
NEW = ParallelLayout(tp=2, pp=3, dp=1)
OLD_PLACEMENT = Placement(grid_devices(2, 4))
NEW_PLACEMENT = Placement(grid_devices(2, 4)[:6])
REF = m.ObjectRef(bucket="liver-plans", name="job-1/1/plan", size=12345, digest="SHA-256=abc")
SLICES = m.SliceIndex(bucket="liver-plans", prefix="job-1/1/s1-", count=8)


def samples(job_id: str = "job-1") -> dict[type, m.Message]:
    """One fully populated instance of every bus message type, all of job ``job_id``."""
    return {
        m.SpotWarning: m.SpotWarning(
            job_id=job_id,
            event_id="evt-1",
            node="ip-10-0-1-7.ec2.internal",
            provider="aws",
            notice_s=120.0,
            deadline=NOW,
        ),
        m.ScaleRequest: m.ScaleRequest(
            job_id=job_id,
            event_id="evt-2",
            reason="nightly scale-out",
            add=(m.NodeDevices(node="node002", devices=(0, 1, 2, 3)),),
            remove=("node001",),
        ),
        m.ResizeRequested: m.ResizeRequested(
            job_id=job_id,
            event_id="evt-1",
            trigger="spot_warning",
            generation=0,
            reason="node001 reclaimed by aws",
            keep=OLD_PLACEMENT.devices[:4],
            remove=OLD_PLACEMENT.devices[4:],
            add=(Device("node002", 0),),
            deadline=NOW,
        ),
        m.TopologyRequest: m.TopologyRequest(
            job_id=job_id,
            event_id="evt-1",
            event_ids=("evt-1", "evt-3"),
            from_generation=0,
            generation=1,
            layout=OLD,
            placement=OLD_PLACEMENT,
            remove=OLD_PLACEMENT.devices[4:6],
            lost=OLD_PLACEMENT.devices[6:],
            add=(Device("node002", 0),),
            deadline=NOW,
            device_memory_bytes=80 * 2**30,
        ),
        m.TopologyPlanned: m.TopologyPlanned(
            job_id=job_id,
            event_id="evt-1",
            from_generation=0,
            generation=1,
            model=PRESETS["gpt3-175b"].geometry(),
            from_layout=OLD,
            from_placement=OLD_PLACEMENT,
            layout=NEW,
            placement=NEW_PLACEMENT,
            candidates=(
                m.Candidate(layout=NEW, score=10.5, fits=True, bytes_moved=10**9, memory_bytes=8 * 2**30),
                m.Candidate(layout=ParallelLayout(6, 1, 1), score=0.0, fits=False, note="heads % 6 != 0"),
            ),
            explanation="TP2,PP3,DP1 keeps TP inside a node and moves the fewest bytes",
            deadline=NOW,
        ),
        m.TransferPlanned: m.TransferPlanned(
            job_id=job_id,
            event_id="evt-1",
            from_generation=0,
            generation=1,
            plan=REF,
            workers=(m.WorkerPlanRef(device=Device("node000", 0), ref=REF),),
            slices=m.SliceIndex(bucket="liver-plans", prefix="job-1/1/s1-", count=1),
            summary=m.PlanSummary(
                tasks=120,
                tasks_coalesced=40,
                rounds=3,
                bytes_moved=10**9,
                bytes_local=5 * 10**8,
                bytes_rank_order=2 * 10**9,
                lower_bound_bytes=9 * 10**8,
                max_receive_bytes=10**8,
                verified=True,
                plan_seconds=0.04,
            ),
        ),
        m.PlanningFailed: m.PlanningFailed(
            job_id=job_id,
            event_id="evt-1",
            generation=1,
            stage="topology",
            reason="no layout of gpt3-175b fits 7 devices or any fewer",
        ),
        m.WorldStarted: m.WorldStarted(job_id=job_id, generation=0, layout=OLD, placement=OLD_PLACEMENT),
        m.Hello: m.Hello(
            job_id=job_id,
            worker_id="w-0",
            device=Device("node000", 0),
            address="10.0.0.1:29500",
            generation=0,
            rank=0,
            memory_bytes=80 * 2**30,
        ),
        m.Heartbeat: m.Heartbeat(
            job_id=job_id,
            worker_id="w-0",
            device=Device("node000", 0),
            address="[::1]:29500",
            seq=7,
            iteration=1234,
        ),
        m.Prepare: m.Prepare(
            job_id=job_id,
            event_id="evt-1",
            from_generation=0,
            generation=1,
            from_layout=OLD,
            from_placement=OLD_PLACEMENT,
            layout=NEW,
            placement=NEW_PLACEMENT,
            lost=(OLD_PLACEMENT.devices[7],),
            plan=REF,
            slices=SLICES,
            staging_bytes=256 * 2**20,
            deadline=NOW,
        ),
        m.Switch: m.Switch(job_id=job_id, generation=1, deadline=NOW),
        m.Abort: m.Abort(job_id=job_id, generation=1, reason="node002 reclaimed during prepare"),
        m.WorkerStatus: m.WorkerStatus(
            job_id=job_id,
            worker_id="w-0",
            generation=1,
            phase="switched",
            iteration=1235,
            bytes_sent=10**6,
            bytes_received=2 * 10**6,
            pause_s=0.8,
        ),
        m.GenerationCommitted: m.GenerationCommitted(
            job_id=job_id,
            event_id="evt-1",
            previous_generation=0,
            generation=1,
            layout=NEW,
            placement=NEW_PLACEMENT,
            started_at_iteration=1235,
            downtime_s=0.8,
            bytes_moved=10**9,
            committed_at=NOW,
        ),
        m.GenerationAborted: m.GenerationAborted(
            job_id=job_id,
            event_id="evt-1",
            generation=1,
            active_generation=0,
            phase="prepare",
            reason="deadline passed before every worker was ready",
            outcome="kept_old_world",
            aborted_at=NOW,
        ),
        m.ErrorEvent: m.ErrorEvent(
            source="ingester",
            subject="spot.warning",
            field="$.notice_s",
            message="Expected `float` >= 0.0",
            payload='{"notice_s": -1}',
            payload_encoding="utf-8",
            payload_size=16,
            payload_truncated=False,
            at=NOW,
            job_id=job_id,
            stream_sequence=42,
        ),
    }
