"""Real training workers on a real bus, driven by a scripted stand-in for the coordinator.

Three worker processes (the function behind ``liver worker``) train a tiny Megatron GPT on CPU: p0 and
p1 start as TP2 (p0 is rank 0: it hosts the first world's store and announces the world), p2 is a
standby worker. The test plays the coordinator's part of the protocol by hand, with real plans from the
transfer planner stored as the transfer service stores them:

    gen 1  TP2 on p0,p1 -> TP1 on p0        scale-in: p1 streams its state out, acks, exits 0
    gen 2  TP1 on p0    -> TP2 on p0,p2     scale-out: p2 warms up, joins at the cut
    gen 3  TP2 on p0,p2 -> TP1 on p0        prepared, then aborted: both keep training in gen 2

Each Prepare (one for the whole job) names p0's store (the address p0 announced in its hello), as the
coordinator does for the worker that runs the new rank 0. The test then stops the job through the stop file.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from liver.demo.procs import MARK_ENV, ProcessBook
from liver.reshard.plan import WorldConfig
from liver.reshard.planner import build_plan
from liver.services import bus as b
from liver.services.transfer.core import device_slices
from liver.shared import subjects as s
from liver.shared.codec import decode, encode
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.messages import (
    Abort,
    Heartbeat,
    Hello,
    ObjectRef,
    Prepare,
    SliceIndex,
    Switch,
    WorkerStatus,
    WorldStarted,
)
from liver.shared.model import PRESETS
from liver.shared.nats_server import NatsServer
from liver.worker_runtime.metrics import Aborted, Started, Step, Stopped, Switched, read_lines
from liver.worker_runtime.worker_main import InitialWorld, WorkerSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

JOB = "wm-job"
MODEL = PRESETS["tiny-gpt"]
P0, P1, P2 = Device("n0", 0), Device("n0", 1), Device("n1", 0)
START = WorldConfig(ParallelLayout(tp=2, pp=1, dp=1), Placement((P0, P1)))
GEN1 = WorldConfig(ParallelLayout(tp=1, pp=1, dp=1), Placement((P0,)))
GEN2 = WorldConfig(ParallelLayout(tp=2, pp=1, dp=1), Placement((P0, P2)))
BUDGET = 256 * 1024
STEPS_BETWEEN = 2
START_TIMEOUT_S = 240.0
PHASE_TIMEOUT_S = 180.0
"""Generous, as every limit here: three Megatron processes share a (possibly busy) two-core machine."""


def worker_id(device: Device) -> str:
    return f"w-{device.node}-{device.index}"


@dataclass
class Bus:
    """What the stand-in coordinator heard, by kind."""

    hellos: dict[str, Hello] = field(default_factory=dict)
    beats: dict[str, Heartbeat] = field(default_factory=dict)
    statuses: list[WorkerStatus] = field(default_factory=list)
    worlds: list[WorldStarted] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def until(self, what: str, check: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))

    def acks(self, generation: int, phase: str) -> dict[str, WorkerStatus]:
        return {a.worker_id: a for a in self.statuses if a.generation == generation and a.phase == phase}

    def iteration(self, worker: str) -> int:
        beat = self.beats.get(worker)
        return -1 if beat is None or beat.iteration is None else beat.iteration


async def listen(nc: Client, bus: Bus) -> None:
    def into(kind: type, sink: Callable[[Any], None]) -> Callable[[Msg], Any]:
        async def cb(msg: Msg) -> None:
            sink(decode(msg.data, kind))
            bus.changed.set()

        return cb

    await nc.subscribe(s.worker_hello(JOB), cb=into(Hello, lambda m: bus.hellos.__setitem__(m.worker_id, m)))
    await nc.subscribe(
        s.worker_heartbeat(JOB), cb=into(Heartbeat, lambda m: bus.beats.__setitem__(m.worker_id, m))
    )
    await nc.subscribe(s.worker_status(JOB), cb=into(WorkerStatus, bus.statuses.append))
    await nc.subscribe(s.world_started(JOB), cb=into(WorldStarted, bus.worlds.append))
    await nc.flush()


async def prepare_all(nc: Client, bus: Bus, generation: int, old: WorldConfig, new: WorldConfig) -> set[str]:
    """Plan, store the slices, Prepare every participant and wait until all are ready; their ids."""
    plan = build_plan(MODEL, old, new, BUDGET, True)
    js = nc.jetstream()
    store = await js.object_store(s.OBJECT_STORE_PLANS)
    pieces = device_slices(plan, True)
    index = SliceIndex(
        bucket=s.OBJECT_STORE_PLANS, prefix=s.plan_object_name(JOB, generation, "s") + "-", count=len(pieces)
    )
    for i, piece in enumerate(pieces):  # in slice_devices order, as the transfer service stores them
        await store.put(index.name(i), msgspec.json.encode(piece.stored(generation)))
    rank0 = bus.hellos[worker_id(new.placement.devices[0])]
    participants = sorted({*old.placement.devices, *new.placement.devices})
    prepare = Prepare(
        job_id=JOB,
        event_id=f"evt-{generation}",
        from_generation=generation - 1,
        generation=generation,
        from_layout=old.layout,
        from_placement=old.placement,
        layout=new.layout,
        placement=new.placement,
        plan=ObjectRef(bucket=s.OBJECT_STORE_PLANS, name=s.plan_object_name(JOB, generation), size=1),
        slices=index,
        staging_bytes=BUDGET,
        deadline=datetime.now(UTC) + timedelta(seconds=PHASE_TIMEOUT_S),
        store=rank0.address,
    )
    await nc.publish(s.worker_commands(JOB), encode(prepare))  # one Prepare for the whole job
    names = {worker_id(d) for d in participants}
    await bus.until(
        f"ready of generation {generation}",
        lambda: names <= bus.acks(generation, "ready").keys() or bool(bus.acks(generation, "failed")),
        PHASE_TIMEOUT_S,
    )
    assert not bus.acks(generation, "failed"), bus.acks(generation, "failed")
    return names


async def handoff(
    nc: Client, bus: Bus, generation: int, old: WorldConfig, new: WorldConfig
) -> dict[str, WorkerStatus]:
    """Prepare every participant, Switch once all are ready; the switched acks."""
    names = await prepare_all(nc, bus, generation, old, new)
    deadline = datetime.now(UTC) + timedelta(seconds=PHASE_TIMEOUT_S)
    await nc.publish(
        s.worker_commands(JOB), encode(Switch(job_id=JOB, generation=generation, deadline=deadline))
    )
    await bus.until(
        f"switched of generation {generation}",
        lambda: names <= bus.acks(generation, "switched").keys() or bool(bus.acks(generation, "failed")),
        PHASE_TIMEOUT_S,
    )
    assert not bus.acks(generation, "failed"), bus.acks(generation, "failed")
    return bus.acks(generation, "switched")


async def aborted_handoff(
    nc: Client, bus: Bus, generation: int, old: WorldConfig, new: WorldConfig
) -> dict[str, WorkerStatus]:
    """Prepare every participant, then Abort instead of Switch; the aborted acks."""
    names = await prepare_all(nc, bus, generation, old, new)
    abort = Abort(job_id=JOB, generation=generation, reason="the stand-in changed its mind")
    await nc.publish(s.worker_commands(JOB), encode(abort))
    await bus.until(
        f"aborted of generation {generation}",
        lambda: names <= bus.acks(generation, "aborted").keys(),
        PHASE_TIMEOUT_S,
    )
    return bus.acks(generation, "aborted")


@dataclass
class Run:
    bus: Bus
    switched: dict[int, dict[str, WorkerStatus]]
    aborted: dict[str, WorkerStatus]
    abort_iteration: int
    exitcodes: dict[str, int | None]
    metrics: dict[str, list[Any]]


def worker_settings(device: Device, tmp: Path, **fields: Any) -> WorkerSettings:
    return WorkerSettings(
        job_id=JOB,
        node=device.node,
        device=device.index,
        metrics=str(tmp / f"{worker_id(device)}.jsonl"),
        stop_file=str(tmp / "stop"),
        heartbeat_s=0.3,
        control_timeout_s=120.0,
        build_timeout_s=180.0,
        **fields,
    )


async def scenario(url: str, tmp: Path, book: ProcessBook) -> Run:
    nc = await nats.connect(url)
    bus = Bus()
    try:
        js = nc.jetstream()
        await b.ensure_streams(js, (s.STREAM_CONTROL,))
        with contextlib.suppress(Exception):
            await js.create_object_store(s.OBJECT_STORE_PLANS)
        await listen(nc, bus)
        # p0 hosts the first world's store on a port of its choosing (a port picked here and bound there
        # later could be taken meanwhile) and names it in its hello; p1 is told that address.
        p0 = worker_id(P0)
        first = InitialWorld(layout=START.layout, placement=START.placement, store=None)
        book.start_worker(p0, msgspec.json.encode(worker_settings(P0, tmp, initial=first)), url)
        await bus.until("p0's hello", lambda: p0 in bus.hellos, START_TIMEOUT_S)
        first = msgspec.structs.replace(first, store=bus.hellos[p0].address)
        for device, fields in ((P1, {"initial": first}), (P2, {})):
            settings = worker_settings(device, tmp, **fields)
            book.start_worker(worker_id(device), msgspec.json.encode(settings), url)
        everyone = {worker_id(d) for d in (P0, P1, P2)}
        await bus.until("three hellos", lambda: everyone <= bus.hellos.keys(), START_TIMEOUT_S)
        await bus.until("the first world announced", lambda: bool(bus.worlds), START_TIMEOUT_S)
        await bus.until("training", lambda: bus.iteration(p0) >= STEPS_BETWEEN, PHASE_TIMEOUT_S)
        switched: dict[int, dict[str, WorkerStatus]] = {}
        for generation, old, new in ((1, START, GEN1), (2, GEN1, GEN2)):
            switched[generation] = await handoff(nc, bus, generation, old, new)
            goal = (switched[generation][p0].iteration or 0) + STEPS_BETWEEN
            reached = lambda g=goal: bus.iteration(p0) >= g  # noqa: E731
            await bus.until(f"training on gen {generation}", reached, PHASE_TIMEOUT_S)
        aborted = await aborted_handoff(nc, bus, 3, GEN2, GEN1)
        abort_iteration = bus.iteration(p0)
        goal = abort_iteration + STEPS_BETWEEN
        await bus.until("training on after the abort", lambda: bus.iteration(p0) >= goal, PHASE_TIMEOUT_S)
        (tmp / "stop").write_text(str(max(bus.iteration(w) for w in everyone) + 3))
        for proc in book.workers():
            await asyncio.to_thread(proc.wait, PHASE_TIMEOUT_S)
        exitcodes = {p.name: p.exitcode for p in book.workers()}
        metrics = {p.name: list(read_lines(tmp / f"{p.name}.jsonl")) for p in book.workers()}
        return Run(bus, switched, aborted, abort_iteration, exitcodes, metrics)
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("workers")
    with NatsServer() as server:
        environ = {**os.environ, MARK_ENV: "test-worker-main", "NATS_URL": server.url}
        book = ProcessBook(log_dir=tmp / "logs", environ=environ)
        try:
            return asyncio.run(scenario(server.url, tmp, book))
        finally:
            book.stop_all(grace_s=5.0, fork_server=False)  # other tests of the session fork from it


def steps(run: Run, device: Device) -> list[Step]:
    return [r for r in run.metrics[worker_id(device)] if isinstance(r, Step)]


# -- the tests ---------------------------------------------------------------------------------------------


def test_rank_0_announces_the_first_world_once_it_is_built(run: Run) -> None:
    assert [(w.generation, w.layout, w.placement) for w in run.bus.worlds] == [
        (0, START.layout, START.placement)
    ]


def test_every_worker_says_hello_with_the_address_of_its_own_store(run: Run) -> None:
    addresses = {h.address for h in run.bus.hellos.values()}
    assert len(addresses) == 3
    assert all(a.startswith("127.0.0.1:") and int(a.rsplit(":", 1)[1]) > 0 for a in addresses)
    assert run.bus.hellos[worker_id(P2)].generation is None


@pytest.mark.parametrize("generation", [1, 2])
def test_every_participant_acks_ready_then_switched_at_one_cut(run: Run, generation: int) -> None:
    acks = run.switched[generation]
    cuts = {a.iteration for a in acks.values()}
    assert len(cuts) == 1 and None not in cuts
    assert all(a.pause_s is not None and a.pause_s > 0 for a in acks.values())
    ready = run.bus.acks(generation, "ready")
    assert ready.keys() == acks.keys()


def test_the_leaving_worker_streams_its_state_out_and_exits_0(run: Run) -> None:
    p1 = worker_id(P1)
    assert run.switched[1][p1].bytes_sent and run.switched[1][p1].bytes_sent > 0
    assert run.exitcodes[p1] == 0
    last = run.metrics[p1][-1]
    assert isinstance(last, Stopped) and last.why == "left"
    switched = [r for r in run.metrics[p1] if isinstance(r, Switched)]
    assert [(r.generation, r.left) for r in switched] == [(1, True)]


def test_the_joiner_receives_its_shard_and_trains_from_the_cut_on(run: Run) -> None:
    cut = run.switched[2][worker_id(P2)].iteration
    assert cut is not None
    assert (run.switched[2][worker_id(P2)].bytes_received or 0) > 0
    joined = steps(run, P2)
    assert joined and joined[0].iteration == cut + 1 and joined[0].generation == 2
    # The two TP ranks of generation 2 compute one loss per step.
    p0 = {r.iteration: r.loss for r in steps(run, P0) if r.generation == 2}
    assert all(p0[r.iteration] == r.loss for r in joined)


def test_training_goes_on_through_both_handoffs_with_finite_losses(run: Run) -> None:
    trace = steps(run, P0)
    iterations = [r.iteration for r in trace]
    assert iterations == list(range(1, len(trace) + 1))
    assert [r.generation for r in trace] == sorted(r.generation for r in trace)
    assert {r.generation for r in trace} == {0, 1, 2}
    assert all(math.isfinite(r.loss) for r in trace)


def test_an_aborted_handoff_is_acked_aborted_and_training_goes_on_in_the_old_world(run: Run) -> None:
    assert run.aborted.keys() == {worker_id(P0), worker_id(P2)}
    assert not run.bus.acks(3, "switched") and not run.bus.acks(3, "failed")
    after = [r for r in steps(run, P0) if r.iteration > run.abort_iteration]
    assert after and {r.generation for r in after} == {2}
    records = [r for r in run.metrics[worker_id(P0)] if isinstance(r, Aborted)]
    assert [(r.generation, r.stage) for r in records] == [(3, "cut")]


def test_heartbeats_speak_for_the_world_each_worker_is_in_after_the_switches(run: Run) -> None:
    beat = run.bus.beats[worker_id(P2)]
    assert (beat.generation, beat.rank) == (2, 1)


def test_every_worker_stops_at_the_iteration_of_the_stop_file_and_exits_0(run: Run) -> None:
    assert run.exitcodes == {worker_id(d): 0 for d in (P0, P1, P2)}
    ends = {
        name: records[-1]
        for name, records in run.metrics.items()
        if name != worker_id(P1)  # it left at the scale-in
    }
    assert all(isinstance(r, Stopped) and r.why == "stop_file" for r in ends.values())
    assert len({r.iteration for r in ends.values()}) == 1
    started = [r for r in run.metrics[worker_id(P2)] if isinstance(r, Started)]
    assert [r.generation for r in started] == [None]
