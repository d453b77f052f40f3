"""The generation coordinator: a pure state machine (:mod:`.core`) fed by a bus adapter.

The core takes events (bus messages, key-value write results, ticks) with the current time and returns
actions (commands, publishes, compare-and-set writes, notes); it reads no clock and does no I/O, so
every path through it is a unit test.
"""

from liver.shared.messages import PlanningFailed, TopologyRequest, WorldStarted

from .actions import (
    Action,
    ExpectTransfer,
    Note,
    ProbeWorkers,
    Publish,
    ReleasePlan,
    RequestTopology,
    SendCommand,
    Settle,
    WriteMembership,
    WriteRecord,
)
from .config import CoordinatorConfig
from .core import Coordinator, CoordinatorError
from .events import (
    BusReconnected,
    Event,
    RecordConflict,
    RecordObserved,
    RecordWriteFailed,
    RecordWritten,
    Tick,
    WorkerLost,
    WorkersProbed,
)
from .membership import Change, Expired, Member, Membership, MembershipError
from .phases import TRANSITIONS, WAITS, GenerationPhase, IllegalTransition, Wait
from .record import GenerationRecord, Participant, PendingHandoff, Trigger

__all__ = [
    "TRANSITIONS",
    "WAITS",
    "Action",
    "BusReconnected",
    "Change",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorError",
    "Event",
    "ExpectTransfer",
    "Expired",
    "GenerationPhase",
    "GenerationRecord",
    "IllegalTransition",
    "Member",
    "Membership",
    "MembershipError",
    "Note",
    "Participant",
    "PendingHandoff",
    "PlanningFailed",
    "ProbeWorkers",
    "Publish",
    "RecordConflict",
    "RecordObserved",
    "RecordWriteFailed",
    "RecordWritten",
    "ReleasePlan",
    "RequestTopology",
    "SendCommand",
    "Settle",
    "Tick",
    "TopologyRequest",
    "Trigger",
    "Wait",
    "WorkerLost",
    "WorkersProbed",
    "WorldStarted",
    "WriteMembership",
    "WriteRecord",
]
