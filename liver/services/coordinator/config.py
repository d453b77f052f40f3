"""The coordinator's tunables and the deadline arithmetic built on them.

Every phase of a handoff has a deadline derived from the trigger: a spot warning says when its node is
reclaimed, and the source ranks on that node must have sent their state before then. The handoff's
hard deadline is therefore the earliest reclaim time among its triggers, less a safety margin; a
trigger without a provider deadline (a planned change, a lost worker) gets a fixed budget from when it
arrived. The switch needs time to move the state, so everything before it (planning, preparing the
shadow world, recording the switch intent) must end early enough to leave that time::

    began ......... prepare deadline ........ hard deadline ... reclaim
    |  plan, prepare, record  |  switch (estimate)  |  margin  |
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import msgspec

from .record import MAX_SETTLED_IN_RECORD, Trigger

if TYPE_CHECKING:
    from liver.shared.messages import PlanSummary


class CoordinatorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Knobs of one coordinator. The defaults are the values LiveR is designed around."""

    heartbeat_timeout_s: float = 10.0
    """A worker unheard for this long is lost: four to five missed beats at the companion's 2 s beat,
    so one delayed message never costs a handoff, yet a dead node is noticed well within a spot
    warning's two minutes."""

    suspect_timeout_s: float = 5.0
    """Once a worker reports that its world lost a peer (``peer_lost``), a member of that world unheard
    for this long is lost: two to three beats. The loss is certain then, only not whose it is, and the
    survivors stand still until it is found."""

    probe_timeout_s: float = 1.0
    """How long the coordinator waits for a worker's answer when it asks the members of a world that
    lost a peer whether they are still there. A process that is gone is known at once (the bus has no
    subscriber for it); one that does not answer in time is left to the heartbeats."""

    margin_s: float = 5.0
    """A handoff must finish this long before its node is reclaimed. Providers' notices are
    approximate; finishing early keeps the source ranks alive for the whole transfer."""

    default_handoff_s: float = 120.0
    """Budget of a handoff whose trigger has no reclaim deadline (a planned change, a lost worker):
    the two-minute notice the system is built to meet anyway."""

    min_switch_s: float = 2.0
    """Time kept free for the switch before the transfer plan says how much must move: waiting for the
    next iteration boundary (the consistent cut) and swapping process-group references."""

    switch_overhead_s: float = 1.0
    """Fixed part of a switch once the plan is known (the cut and the reference swap)."""

    bandwidth_bytes_per_s: float = 1.25e9
    """Per-receiver bandwidth assumed when estimating the transfer: 10 Gbit/s, the slowest link LiveR
    is meant for. It only decides whether a plan can still finish in time, so erring low is safe."""

    staging_bytes: int = 512 * 1024 * 1024
    """Staging buffer each worker may use for the layer-streaming transfer (the paper's 512 MB-1 GB)."""

    max_remembered_events: int = 10_000
    """Event ids kept for de-duplication; JetStream's own window covers the rest."""

    record_settled_events: int = 512
    """Settled events the job's record keeps (oldest dropped first), so that any coordinator recognises
    a redelivered copy of one: far more than can settle within one ack wait, when a lost
    acknowledgement brings a copy back."""

    def __post_init__(self) -> None:
        for field in (
            "heartbeat_timeout_s",
            "suspect_timeout_s",
            "probe_timeout_s",
            "default_handoff_s",
            "min_switch_s",
            "bandwidth_bytes_per_s",
            "staging_bytes",
            "max_remembered_events",
            "record_settled_events",
        ):
            if getattr(self, field) <= 0:
                raise ValueError(f"`{field}`: must be positive, got {getattr(self, field)}")
        if self.record_settled_events > MAX_SETTLED_IN_RECORD:
            raise ValueError(
                f"`record_settled_events`: at most {MAX_SETTLED_IN_RECORD} (a record stays one small value), "
                f"got {self.record_settled_events}"
            )
        for field in ("margin_s", "switch_overhead_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"`{field}`: must not be negative, got {getattr(self, field)}")


def trigger_deadline(trigger: Trigger, config: CoordinatorConfig) -> datetime:
    """When a handoff serving ``trigger`` must be complete."""
    if trigger.deadline is not None:
        return trigger.deadline - timedelta(seconds=config.margin_s)
    return trigger.received_at + timedelta(seconds=config.default_handoff_s)


def handoff_deadline(triggers: Iterable[Trigger], config: CoordinatorConfig) -> datetime:
    """A handoff that serves several triggers must meet the earliest of their deadlines."""
    return min(trigger_deadline(t, config) for t in triggers)


def switch_estimate_s(summary: PlanSummary | None, config: CoordinatorConfig) -> float:
    """Seconds the switch is expected to take: the busiest receiver's bytes over the assumed bandwidth.

    Receivers work in parallel, so the slowest one bounds the transfer; before the plan exists only
    the fixed minimum is known.
    """
    if summary is None:
        return config.min_switch_s
    transfer = summary.max_receive_bytes / config.bandwidth_bytes_per_s
    return max(config.min_switch_s, config.switch_overhead_s + transfer)
