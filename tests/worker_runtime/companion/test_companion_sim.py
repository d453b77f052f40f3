"""The simulated job: real worker agents on the bus whose only runtime is to acknowledge."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from bus_helpers import Collector, client, eventually
from companion_helpers import DEVICES, NEW, NEW_LAYOUT, OLD_LAYOUT, prepare, put_slices, slices, switch
from nats.aio.client import Client

from liver.cli import workers_cmd
from liver.shared import subjects as s
from liver.shared.codec import decode, encode
from liver.shared.layout import Device, ParallelLayout
from liver.shared.messages import GenerationCommitted, Heartbeat, Hello, Message, WorkerStatus, WorldStarted
from liver.shared.nats_server import URL_ENV, NatsServer
from liver.worker_runtime.companion.simulated import Fault, SimSettings, SimulatedJob, simulated_job

_jobs = itertools.count()


@pytest.fixture
def job() -> str:
    return f"job-s{os.getpid()}-{next(_jobs)}"


def settings(job: str, **changes: Any) -> SimSettings:
    fields: dict[str, Any] = {"job_id": job, "workers": 4, "devices_per_node": 4, "heartbeat_s": 0.1}
    fields.update(changes)
    return SimSettings(**fields)


@asynccontextmanager
async def sim(url: str, config: SimSettings) -> AsyncIterator[tuple[Client, SimulatedJob]]:
    async with client(url) as (nc, _), simulated_job(config, nc) as job:
        yield nc, job


async def publish(nc: Client, subject: str, message: Message) -> None:
    await nc.publish(subject, encode(message))
    await nc.flush()


async def prepare_all(nc: Client, job: SimulatedJob, generation: int = 1) -> None:
    await put_slices(nc.jetstream(), job.settings.job_id, generation)
    await publish(nc, s.worker_commands(job.settings.job_id), prepare(job.settings.job_id, generation))


def acks(collector: Collector) -> list[WorkerStatus]:
    return [decode(m.data, WorkerStatus) for m in collector.messages]


def network_bytes(device: Device) -> tuple[int, int]:
    plan = slices()[device].to_plan()
    old, new = plan.old.placement.devices, plan.new.placement.devices
    sent = sum(t.nbytes for t in plan.tasks if not t.local and old[t.src] == device)
    received = sum(t.nbytes for t in plan.tasks if not t.local and new[t.dst] == device)
    return sent, received


@pytest.mark.slow
async def test_each_simulated_worker_says_hello_from_its_own_device_as_its_rank(
    nats_server: NatsServer, job: str
) -> None:
    async with client(nats_server.url) as (nc, _):
        hellos = await Collector.on(nc, s.worker_hello(job))
        async with sim(nats_server.url, settings(job, generation=2)):
            got = [decode(m.data, Hello) for m in await hellos.wait_for(4)]
    assert sorted((h.device, h.rank) for h in got) == [(d, i) for i, d in enumerate(DEVICES)]
    assert {h.generation for h in got} == {2}
    assert len({h.worker_id for h in got}) == 4


@pytest.mark.slow
async def test_spares_say_hello_in_no_world(nats_server: NatsServer, job: str) -> None:
    async with client(nats_server.url) as (nc, _):
        hellos = await Collector.on(nc, s.worker_hello(job))
        config = settings(job, workers=2, nodes=("spare-a",), generation=None)
        async with sim(nats_server.url, config):
            got = [decode(m.data, Hello) for m in await hellos.wait_for(2)]
    assert {(h.device.node, h.generation, h.rank) for h in got} == {("spare-a", None, None)}


@pytest.mark.slow
async def test_heartbeats_report_the_advancing_iteration(nats_server: NatsServer, job: str) -> None:
    async with client(nats_server.url) as (nc, _):
        beats = await Collector.on(nc, s.worker_heartbeat(job))
        async with sim(nats_server.url, settings(job, workers=1, iteration_s=0.02)):
            await beats.wait_for(3)
    iterations = [decode(m.data, Heartbeat).iteration for m in beats.messages]
    assert all(i is not None for i in iterations)
    assert iterations == sorted(iterations) and iterations[-1] > iterations[0]  # type: ignore[operator]


@pytest.mark.slow
async def test_workers_ack_prepare_then_switch_with_one_cut_and_their_bytes(
    nats_server: NatsServer, job: str
) -> None:
    async with client(nats_server.url) as (nc, _):
        status = await Collector.on(nc, s.worker_status(job))
        async with sim(nats_server.url, settings(job)) as (_, simulated):
            await prepare_all(nc, simulated)
            await status.wait_for(4)
            await publish(nc, s.worker_commands(job), switch(job, 1))
            await status.wait_for(8)
    ready, switched = acks(status)[:4], acks(status)[4:]
    assert {a.phase for a in ready} == {"ready"} and {a.phase for a in switched} == {"switched"}
    assert len({a.iteration for a in switched}) == 1
    by_worker = {w.identity.worker_id: w.identity.device for w in simulated.workers}
    for ack in switched:
        sent, received = network_bytes(by_worker[ack.worker_id])
        assert (ack.bytes_sent, ack.bytes_received) == (sent, received)
        assert ack.pause_s is not None and ack.pause_s >= 0
    assert sum(a.bytes_received or 0 for a in switched) > 0


@pytest.mark.slow
async def test_the_ack_delay_holds_each_ack_back(nats_server: NatsServer, job: str) -> None:
    async with client(nats_server.url) as (nc, _):
        status = await Collector.on(nc, s.worker_status(job))
        async with sim(nats_server.url, settings(job, workers=1, ack_delay_s=0.3)) as (_, simulated):
            sent_at = time.monotonic()
            await prepare_all(nc, simulated)
            await status.wait_for(1)
            waited = time.monotonic() - sent_at
    assert waited >= 0.3


@pytest.mark.slow
async def test_a_worker_set_to_fail_at_prepare_acks_failed_and_the_others_ready(
    nats_server: NatsServer, job: str
) -> None:
    config = settings(job, faults=(Fault.parse("fail", "prepare:1"),))
    async with client(nats_server.url) as (nc, _):
        status = await Collector.on(nc, s.worker_status(job))
        async with sim(nats_server.url, config) as (_, simulated):
            await prepare_all(nc, simulated)
            await status.wait_for(4)
    failing = simulated.workers[1].identity.worker_id
    phases = {a.worker_id: a.phase for a in acks(status)}
    assert phases.pop(failing) == "failed"
    assert set(phases.values()) == {"ready"}
    assert next(a for a in acks(status) if a.worker_id == failing).error == "simulated failure at prepare"


@pytest.mark.slow
async def test_a_worker_set_to_crash_at_switch_goes_silent(nats_server: NatsServer, job: str) -> None:
    config = settings(job, heartbeat_s=0.05, faults=(Fault.parse("crash", "switch:2"),))
    async with client(nats_server.url) as (nc, _):
        status = await Collector.on(nc, s.worker_status(job))
        beats = await Collector.on(nc, s.worker_heartbeat(job))
        async with sim(nats_server.url, config) as (sim_nc, simulated):
            crashed = simulated.workers[2].identity.worker_id
            await prepare_all(nc, simulated)
            await status.wait_for(4)
            await publish(nc, s.worker_commands(job), switch(job, 1))
            await status.wait_for(7)
            await eventually(lambda: _true(simulated.workers[2].agent is None), what="crashed")
            await simulated.departed()
            # Every beat the crashed worker sent is at the server (the job's connection), then here.
            await sim_nc.flush()
            await nc.flush()
            seen = len(beats.messages)
            await beats.wait_for(seen + 6)
            after = [decode(m.data, Heartbeat).worker_id for m in beats.messages[seen:]]
    switched = {a.worker_id for a in acks(status) if a.phase == "switched"}
    assert crashed not in switched and len(switched) == 3
    assert crashed not in after


@pytest.mark.slow
async def test_a_worker_outside_the_committed_world_leaves(nats_server: NatsServer, job: str) -> None:
    async with client(nats_server.url) as (nc, _):
        status = await Collector.on(nc, s.worker_status(job))
        async with sim(nats_server.url, settings(job)) as (_, simulated):
            await prepare_all(nc, simulated)
            await status.wait_for(4)
            await publish(nc, s.worker_commands(job), switch(job, 1))
            await status.wait_for(8)
            committed = GenerationCommitted(
                job_id=job,
                event_id="evt-1",
                previous_generation=0,
                generation=1,
                layout=NEW_LAYOUT,
                placement=NEW.placement,
                started_at_iteration=acks(status)[-1].iteration or 0,
                downtime_s=0.0,
                bytes_moved=0,
                committed_at=datetime.now(UTC),
            )
            await publish(nc, s.GENERATION_COMMITTED, committed)
            await eventually(lambda: _true(len(simulated.active) == 2), what="two workers left")
    assert sorted(w.identity.device for w in simulated.active) == list(NEW.placement.devices)


@pytest.mark.slow
async def test_a_job_with_a_layout_announces_its_starting_world(job: str) -> None:
    with NatsServer() as server:
        async with client(server.url) as (_, js):
            await js.add_stream(name="WORLDS", subjects=[s.world_started(job)])
            config = settings(job, generation=0, layout=OLD_LAYOUT)
            async with sim(server.url, config):
                msg = await js.get_last_msg("WORLDS", s.world_started(job))
    world = decode(msg.data or b"", WorldStarted)
    assert (world.generation, world.layout) == (0, OLD_LAYOUT)
    assert world.placement.devices == DEVICES


async def _true(value: bool) -> bool:
    return value


# -- settings and the command line -----------------------------------------------------------------------


def test_fault_specs_name_phase_worker_and_generation() -> None:
    assert Fault.parse("fail", "switch") == Fault(action="fail", phase="switch")
    assert Fault.parse("hang", "prepare:3") == Fault(action="hang", phase="prepare", worker=3)
    assert Fault.parse("crash", "switch:*:2") == Fault(action="crash", phase="switch", generation=2)
    for bad in ("commit", "switch:x", "prepare:1:2:3", ""):
        with pytest.raises(ValueError, match="PHASE"):
            Fault.parse("fail", bad)


def test_settings_refuse_what_cannot_be_simulated() -> None:
    with pytest.raises(ValueError, match="`nodes`"):
        SimSettings(job_id="j", workers=9, nodes=("a",), devices_per_node=8)
    with pytest.raises(ValueError, match="`layout`"):
        SimSettings(job_id="j", workers=4, layout=ParallelLayout(tp=2, pp=1, dp=1))
    with pytest.raises(ValueError, match=r"`faults\[0\].worker`"):
        SimSettings(job_id="j", workers=2, faults=(Fault(action="fail", phase="prepare", worker=2),))
    with pytest.raises(ValueError, match="job_id"):
        SimSettings(job_id="a.b", workers=1)


def test_command_line_options_become_settings() -> None:
    parser = argparse.ArgumentParser()
    workers_cmd.add_arguments(parser)
    argv = "--simulate 4 --job j1 --nodes a,b --devices-per-node 2 --layout 2,1,2 --ack-delay 0.5"
    args = parser.parse_args([*argv.split(), "--fail-at", "prepare:1", "--crash-at", "switch:*:3"])
    config = workers_cmd.settings_from(args)
    assert config.devices() == (Device("a", 0), Device("a", 1), Device("b", 0), Device("b", 1))
    assert config.layout == ParallelLayout(tp=2, pp=1, dp=2)
    assert config.ack_delay_s == 0.5 and config.generation == 0
    assert config.faults == (
        Fault(action="fail", phase="prepare", worker=1),
        Fault(action="crash", phase="switch", generation=3),
    )


@pytest.mark.slow
def test_liver_workers_simulate_runs_until_sigterm_and_exits_cleanly(
    nats_server: NatsServer, job: str
) -> None:
    async def hellos() -> list[Hello]:
        async with client(nats_server.url) as (nc, _):
            collector = await Collector.on(nc, s.worker_hello(job))
            process = subprocess.Popen(
                [sys.executable, "-m", "liver.cli.workers_cmd", "--simulate", "2", "--job", job],
                env={**os.environ, URL_ENV: nats_server.url, "LIVER_LOG_FORMAT": "json"},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            try:
                # A new interpreter importing LiveR: seconds on a busy machine.
                got = [decode(m.data, Hello) for m in await collector.wait_for(2, timeout_s=120)]
            finally:
                process.send_signal(signal.SIGTERM)
                _, stderr = await asyncio.to_thread(process.communicate, timeout=60)
            assert process.returncode == 0, stderr.decode()[-2000:]
            assert b"simulated_job_stopped" in stderr
            return got

    got = asyncio.run(hellos())
    assert {h.job_id for h in got} == {job} and len({h.worker_id for h in got}) == 2


def test_bad_options_are_one_line_errors() -> None:
    assert workers_cmd.main(["--simulate", "0", "--job", "j"]) == 2
    assert workers_cmd.main(["--simulate", "2", "--fail-at", "commit"]) == 2
