"""What ``liver bench bus`` sees of one job on the bus: when each stage of a handoff showed up.

The observer is one more subscriber on the job's subjects, on a connection of its own. It timestamps the
first arrival of each stage's message after an event is armed (the ingester's resize request, the
coordinator's topology request, the planners' answers, the Switch broadcast, the outcome), takes a CPU
sample of the bench's processes at each of them (a read of a few ``/proc`` files), and otherwise does
as little as possible in its callbacks (messages are decoded afterwards), so that its timestamps are
the bus's and not the bench's. It also counts heartbeats (background traffic to subtract from
per-event counts), remembers every worker that said hello, and keeps the handoff's Prepare (one
job-wide broadcast, which the probe worker takes part in).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode
from liver.shared.messages import (
    Abort,
    GenerationAborted,
    GenerationCommitted,
    Hello,
    Prepare,
    Switch,
    WorkerCommand,
)

CpuSample = Mapping[str, float | None]

STAGES: Final = ("resize_requested", "topology_request", "topology_planned", "transfer_planned")
"""The control-plane messages of a handoff, in the order they appear (``planning_failed`` aside)."""


@dataclass
class Timeline:
    """One event as the observer saw it; times are ``time.perf_counter()`` seconds."""

    event_id: str
    published_at: float
    arrivals: dict[str, float] = field(default_factory=dict)
    raw: dict[str, bytes] = field(default_factory=dict)
    cpu: dict[str, CpuSample] = field(default_factory=dict)
    planned: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the transfer plan is announced (its slices are readable until the handoff ends)."""
    committed: GenerationCommitted | None = None
    aborted: GenerationAborted | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class BusObserver:
    """The bench's subscriber for one job (see the module docstring)."""

    def __init__(self, nc: Client, job_id: str, probe_worker: str, sample: Callable[[], CpuSample]) -> None:
        self.nc = nc
        self.job_id = job_id
        self.probe_worker = probe_worker
        self._sample = sample
        self.current: Timeline | None = None
        self.heartbeats = 0
        self.heartbeat_bytes = 0
        self.hellos: set[str] = set()
        self._hello_arrived = asyncio.Event()
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        job = self.job_id
        stage_subjects = {
            s.resize_requested(job): "resize_requested",
            s.topology_request(job): "topology_request",
            s.topology_planned(job): "topology_planned",
            s.transfer_planned(job): "transfer_planned",
            s.planning_failed(job): "planning_failed",
        }
        for subject, stage in stage_subjects.items():
            self._subs.append(await self.nc.subscribe(subject, cb=self._stage_cb(stage)))
        for subject, cb in (
            (s.worker_commands(job), self._on_broadcast),
            (s.GENERATION_COMMITTED, self._on_outcome),
            (s.GENERATION_ABORTED, self._on_outcome),
            (s.worker_hello(job), self._on_hello),
            (s.worker_heartbeat(job), self._on_heartbeat),
        ):
            self._subs.append(await self.nc.subscribe(subject, cb=cb))
        await self.nc.flush()

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()

    def arm(self, event_id: str) -> Timeline:
        """Start watching for ``event_id``; call right before publishing it."""
        self.current = Timeline(event_id=event_id, published_at=time.perf_counter())
        return self.current

    async def wait_hellos(self, worker_ids: set[str], timeout_s: float) -> None:
        """Return once every one of ``worker_ids`` said hello."""
        deadline = time.monotonic() + timeout_s
        while not worker_ids <= self.hellos:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(worker_ids - self.hellos)
                raise TimeoutError(
                    f"{len(missing)} workers did not say hello in {timeout_s} s (first: {missing[:3]})"
                )
            self._hello_arrived.clear()
            try:
                await asyncio.wait_for(self._hello_arrived.wait(), left)
            except TimeoutError:
                continue

    # -- callbacks ----------------------------------------------------------------------------------------

    def _stage_cb(self, stage: str) -> Callable[[Msg], object]:
        async def cb(msg: Msg) -> None:
            now = time.perf_counter()
            current = self.current
            if current is not None and stage not in current.arrivals:
                current.arrivals[stage] = now
                current.cpu[stage] = self._sample()
                current.raw[stage] = msg.data
                if stage == "transfer_planned":
                    current.planned.set()

        return cb

    async def _on_broadcast(self, msg: Msg) -> None:
        now = time.perf_counter()
        current = self.current
        if current is None:
            return
        try:
            command = decode(msg.data, WorkerCommand)
        except MessageError:
            return
        if isinstance(command, Prepare) and "prepare" not in current.arrivals:
            current.arrivals["prepare"] = now
            current.raw["prepare"] = msg.data
        elif isinstance(command, Switch) and "switch" not in current.arrivals:
            current.arrivals["switch"] = now
            current.cpu["switch"] = self._sample()
        elif isinstance(command, Abort) and "abort" not in current.arrivals:
            current.arrivals["abort"] = now

    async def _on_outcome(self, msg: Msg) -> None:
        now = time.perf_counter()
        current = self.current
        if current is None or current.done.is_set():
            return
        cpu = self._sample()
        try:
            if msg.subject == s.GENERATION_COMMITTED:
                outcome: GenerationCommitted | GenerationAborted = decode(msg.data, GenerationCommitted)
            else:
                outcome = decode(msg.data, GenerationAborted)
        except MessageError:
            return
        if outcome.job_id != self.job_id or outcome.event_id != current.event_id:
            return
        current.arrivals["outcome"] = now
        current.cpu["outcome"] = cpu
        if isinstance(outcome, GenerationCommitted):
            current.committed = outcome
        else:
            current.aborted = outcome
        current.done.set()

    async def _on_hello(self, msg: Msg) -> None:
        try:
            hello = decode(msg.data, Hello)
        except MessageError:
            return
        self.hellos.add(hello.worker_id)
        self._hello_arrived.set()

    async def _on_heartbeat(self, msg: Msg) -> None:
        self.heartbeats += 1
        self.heartbeat_bytes += len(msg.data)
