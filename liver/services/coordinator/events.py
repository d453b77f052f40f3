"""What the coordinator's core reacts to.

Most events are bus messages from ``shared.messages`` as they arrive (resize requests, plans, planning
failures, started worlds, worker presence and acks). The rest, defined here, are what the adapter
observes itself: the result of a key-value write it was asked to make, a change of the record made by
someone else, a lost worker, the passing of time.
"""

from __future__ import annotations

import msgspec

from liver.shared.layout import Device
from liver.shared.messages import (
    Heartbeat,
    Hello,
    PlanningFailed,
    ResizeRequested,
    TopologyPlanned,
    TransferPlanned,
    WorkerStatus,
    WorldStarted,
)

from .record import GenerationRecord


class WorkerLost(msgspec.Struct, frozen=True, kw_only=True):
    """The adapter knows a worker is gone before its heartbeat deadline (its node was reclaimed)."""

    worker_id: str
    reason: str


class WorkersProbed(msgspec.Struct, frozen=True, kw_only=True):
    """What :class:`~.actions.ProbeWorkers` found. ``gone``: the bus has no subscriber for the worker
    (its process, or its connection, is gone), twice in a row; ``answered``: its companion replied;
    ``silent``: no answer in time (left to the heartbeats)."""

    probe: int
    generation: int
    gone: tuple[str, ...] = ()
    answered: tuple[str, ...] = ()
    silent: tuple[str, ...] = ()
    gone_devices: tuple[Device, ...] = ()
    """Of the devices asked by place (``ProbeWorkers.devices``), those with no worker on the bus."""


class Tick(msgspec.Struct, frozen=True):
    """Time passed: check heartbeats and phase deadlines."""


class BusReconnected(msgspec.Struct, frozen=True):
    """The adapter's connection to the bus is back after an outage (a server restart, a network cut):
    commands sent and acks published meanwhile may be gone, as worker traffic is not stored."""


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
    | WorkersProbed
    | WorldStarted
    | Tick
    | BusReconnected
    | RecordWritten
    | RecordConflict
    | RecordWriteFailed
    | RecordObserved
)
