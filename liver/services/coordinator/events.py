"""What the coordinator's core reacts to.

Most events are bus messages from ``shared.messages`` as they arrive (resize requests, plans, worker
presence and acks). The rest are defined here:

* messages the bus does not carry yet (:class:`PlanningFailed`, :class:`WorldStarted`), written as
  ``Message`` subclasses so that they can travel as they are once ``shared`` adopts them;
* what the adapter observes itself: the result of a key-value write it was asked to make, a change of
  the record made by someone else, a lost worker, the passing of time.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from liver.shared.layout import ParallelLayout, Placement
from liver.shared.messages import (
    EventId,
    Generation,
    Heartbeat,
    Hello,
    JobId,
    Message,
    Reason,
    ResizeRequested,
    TopologyPlanned,
    TransferPlanned,
    WorkerStatus,
)

from .record import GenerationRecord

PlanningStage = Literal["topology", "transfer"]


class PlanningFailed(Message, kw_only=True, tag="planning_failed"):
    """A planner could not produce a target (no layout fits) or a plan (some state has no source).

    Published by the topology or transfer planner; consumed by the coordinator, which aborts the
    handoff: with the old world intact it keeps training there, with ranks already lost it falls back.
    """

    job_id: JobId
    event_id: EventId
    generation: Generation
    stage: PlanningStage
    reason: Reason


class WorldStarted(Message, kw_only=True, tag="world_started"):
    """A world started outside the live path: the job's first one, or a restart from a checkpoint.

    Published by whatever launched it; consumed by the coordinator, which records it as the live
    generation. After a checkpoint fallback its generation must be newer than every id issued so far
    (the aborted generation plus one is).
    """

    job_id: JobId
    generation: Generation
    layout: ParallelLayout
    placement: Placement


class WorkerLost(msgspec.Struct, frozen=True, kw_only=True):
    """The adapter knows a worker is gone before its heartbeat deadline (its node was reclaimed)."""

    worker_id: str
    reason: str


class Tick(msgspec.Struct, frozen=True):
    """Time passed: check heartbeats and phase deadlines."""


class RecordWritten(msgspec.Struct, frozen=True, kw_only=True):
    """The compare-and-set the core asked for succeeded; ``revision`` is the key's new revision."""

    revision: int


class RecordConflict(msgspec.Struct, frozen=True, kw_only=True):
    """The compare-and-set failed because the key was at another revision; here is what it holds.

    ``stored`` is ``None`` when the key does not exist (it was deleted).
    """

    stored: GenerationRecord | None
    revision: int


class RecordWriteFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The write's outcome is unknown (timeout, lost connection); the core retries the same write."""

    error: str


class RecordObserved(msgspec.Struct, frozen=True, kw_only=True):
    """The key changed (from a watch); lets a coordinator notice that another one took over."""

    record: GenerationRecord
    revision: int


Event = (
    ResizeRequested
    | TopologyPlanned
    | TransferPlanned
    | PlanningFailed
    | WorkerStatus
    | Hello
    | Heartbeat
    | WorkerLost
    | WorldStarted
    | Tick
    | RecordWritten
    | RecordConflict
    | RecordWriteFailed
    | RecordObserved
)
