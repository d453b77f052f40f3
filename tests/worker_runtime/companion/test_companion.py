"""The worker companion against a real nats-server: presence, commands, acks, bad input, threads."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import statistics
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import nats.errors
import pytest
from bus_helpers import Collector, client, eventually, scrape
from companion_helpers import (
    DEVICES,
    NEW_LAYOUT,
    RecordingHooks,
    abort,
    prepare,
    put_object,
    put_slice_entries,
    put_slices,
    slice_index,
    slices,
    switch,
)
from nats.aio.client import Client

from liver.reshard.plan import Plan
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode
from liver.shared.layout import Device
from liver.shared.messages import Abort, ErrorEvent, Heartbeat, Hello, Message, WorkerStatus
from liver.shared.nats_server import NatsServer
from liver.worker_runtime.companion.agent import AgentSettings, GenerationRank, WorkerIdentity
from liver.worker_runtime.companion.thread import CommandBox, Companion, CompanionError, Prepared

FAST = AgentSettings(heartbeat_s=0.05, fetch_timeout_s=60.0)
START_S = 60.0
"""How long a companion may take to connect and say hello (the companion's default is 30 s)."""
_jobs = itertools.count()
_markers = itertools.count()


def identity(job: str, device: Device = DEVICES[0], **changes: Any) -> WorkerIdentity:
    fields: dict[str, Any] = {
        "job_id": job,
        "worker_id": f"w-{device.node}-{device.index}",
        "device": device,
        "address": f"10.0.0.{device.index + 1}:29500",
        "memory_bytes": 80 << 30,
    }
    fields.update(changes)
    return WorkerIdentity(**fields)


@pytest.fixture
def job() -> str:
    """A job id of its own per test: tests share one server, and subjects carry the job."""
    return f"job-c{os.getpid()}-{next(_jobs)}"


@asynccontextmanager
async def running(companion: Companion) -> AsyncIterator[Companion]:
    """Start and close on a worker thread, as a training process would, without blocking this loop."""
    await asyncio.to_thread(companion.start, START_S)
    try:
        yield companion
    finally:
        await asyncio.to_thread(companion.close)


async def publish(nc: Client, subject: str, message: Message | bytes) -> None:
    await nc.publish(subject, message if isinstance(message, bytes) else encode(message))
    await nc.flush()


def companion_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("liver-companion-")]


async def statuses(collector: Collector, count: int) -> list[WorkerStatus]:
    return [decode(m.data, WorkerStatus) for m in await collector.wait_for(count)]


async def prepared(nc: Client, job: str, companion: Companion, hooks: RecordingHooks, g: int = 1) -> None:
    """Store the plan's slices and have ``companion`` prepare generation ``g`` from its own."""
    await put_slices(nc.jetstream(), job, g)
    await publish(nc, s.worker_commands(job), prepare(job, g))
    await eventually(lambda: _true(len(hooks.named("prepare")) == 1), what="on_prepare called")


async def _true(value: bool) -> bool:
    return value


def _beat_iterations(beats: Collector) -> list[int | None]:
    return [decode(m.data, Heartbeat).iteration for m in beats.messages]


async def handled(nc: Client, job: str) -> None:
    """Return once the companion has handled every command published so far on the job's subject.

    A malformed marker is published after them: the companion reads the subject through one
    subscription, whose messages it handles one at a time and in order, so the error event for the
    marker proves that the commands before it were handled. (What the companion published while
    handling them, on its one connection, reaches ``nc`` before that event.)
    """
    marker = f"marker-{next(_markers)}"
    errors = await Collector.on(nc, s.errors("worker"))
    try:
        await publish(nc, s.worker_commands(job), marker.encode())

        async def reported() -> bool:
            return any(decode(m.data, ErrorEvent).payload == marker for m in errors.messages)

        await eventually(reported, what=f"the companion handled the commands before {marker}")
    finally:
        await errors.close()


@asynccontextmanager
async def prepared_companion(
    url: str, job: str, hooks: RecordingHooks, me: WorkerIdentity | None = None
) -> AsyncIterator[tuple[Client, Companion, Collector]]:
    """A bus client, a collector of the job's acks (there before any is sent), and a running companion
    for ``me`` (the first device's worker by default) that has prepared generation 1 from its slice."""
    async with client(url) as (nc, _):
        acks = await Collector.on(nc, s.worker_status(job))
        async with running(Companion(identity(job) if me is None else me, hooks, url=url)) as companion:
            await prepared(nc, job, companion, hooks)
            yield nc, companion, acks


# -- presence ---------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_hello_names_the_node_device_address_and_memory(nats_server: NatsServer, job: str) -> None:
    async with client(nats_server.url) as (nc, _):
        hellos = await Collector.on(nc, s.worker_hello(job))
        me = identity(job, DEVICES[2])
        async with running(Companion(me, RecordingHooks(), url=nats_server.url, world=GenerationRank(3, 2))):
            hello = await hellos.one(Hello)
    assert (hello.worker_id, hello.device, hello.address) == (me.worker_id, Device("node000", 2), me.address)
    assert hello.device.node == "node000"
    assert hello.memory_bytes == 80 << 30
    assert (hello.generation, hello.rank) == (3, 2)


@pytest.mark.slow
async def test_the_companion_answers_a_probe_by_its_name_and_by_its_device_until_it_closes(
    nats_server: NatsServer, job: str
) -> None:
    me = identity(job, DEVICES[1])
    by_name = s.worker_probe(job, me.worker_id)
    by_device = s.device_probe(job, me.device.node, me.device.index)
    async with client(nats_server.url) as (nc, _):
        async with running(Companion(me, RecordingHooks(), url=nats_server.url)):
            for subject in (by_name, by_device):
                await nc.request(subject, b"", timeout=10.0)
        for subject in (by_name, by_device):  # a process that is gone has no subscriber left
            with pytest.raises(nats.errors.NoRespondersError):
                await nc.request(subject, b"", timeout=10.0)


@pytest.mark.slow
async def test_heartbeats_count_up_and_carry_the_iteration_and_the_world(
    nats_server: NatsServer, job: str
) -> None:
    async with client(nats_server.url) as (nc, _):
        beats = await Collector.on(nc, s.worker_heartbeat(job))
        companion = Companion(identity(job), RecordingHooks(), url=nats_server.url, settings=FAST)
        async with running(companion):
            await beats.wait_for(1)
            companion.set_iteration(41)
            companion.set_world(GenerationRank(5, 0))
            # Beats sent before the change may still be on their way: wait for the first one after it.
            await eventually(lambda: _true(_beat_iterations(beats)[-1] == 41), what="a beat of iteration 41")
            first = len(beats.messages)
            await beats.wait_for(first + 2)
    got = [decode(m.data, Heartbeat) for m in beats.messages]
    assert [b.seq for b in got] == list(range(len(got)))
    last = got[-1]
    assert (last.iteration, last.generation, last.rank) == (41, 5, 0)
    assert got[0].generation is None and got[0].iteration is None


@pytest.mark.slow
async def test_after_a_peer_lost_ack_heartbeats_say_the_world_broke(
    nats_server: NatsServer, job: str
) -> None:
    async with client(nats_server.url) as (nc, _):
        beats = await Collector.on(nc, s.worker_heartbeat(job))
        companion = Companion(
            identity(job), RecordingHooks(), url=nats_server.url, world=GenerationRank(3, 0), settings=FAST
        )
        async with running(companion):
            await beats.wait_for(1)
            assert not decode(beats.messages[-1].data, Heartbeat).broken
            companion.report("peer_lost", generation=3, iteration=9)

            async def broken() -> bool:
                return bool(beats.messages) and decode(beats.messages[-1].data, Heartbeat).broken

            await eventually(broken, what="a beat saying the world broke")
            companion.set_world(GenerationRank(4, 0))  # recovered: a new world, whole

            async def whole() -> bool:
                last = decode(beats.messages[-1].data, Heartbeat)
                return last.generation == 4 and not last.broken

            await eventually(whole, what="a beat from the recovered world")


# -- commands ---------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_prepare_fetches_the_plan_slice_and_hands_the_runtime_a_plan(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks()
    async with prepared_companion(nats_server.url, job, hooks):
        pass
    ((command, plan),) = hooks.named("prepare")  # type: ignore[misc]
    assert isinstance(plan, Plan)
    assert command.generation == 1
    mine = slices()[DEVICES[0]]
    assert plan.tasks == mine.tasks and len(plan.tasks) > 0
    assert plan.new.layout == NEW_LAYOUT
    assert plan.tensors == mine.model.tensors(mine.optimizer)
    assert hooks.threads == {f"liver-companion-{identity(job).worker_id}"}


@pytest.mark.slow
async def test_an_ack_from_the_training_thread_is_published_as_worker_status(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks()
    async with prepared_companion(nats_server.url, job, hooks) as (_, companion, acks):
        companion.report("ready")
        (ack,) = await statuses(acks, 1)
    assert (ack.worker_id, ack.generation, ack.phase) == (identity(job).worker_id, 1, "ready")


@pytest.mark.slow
async def test_a_repeated_switch_re_acks_switched_without_switching_again(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks()
    async with prepared_companion(nats_server.url, job, hooks) as (nc, companion, acks):
        companion.report("ready")
        await publish(nc, s.worker_commands(job), switch(job, 1))
        await eventually(lambda: _true(len(hooks.named("switch")) == 1), what="on_switch called")
        companion.report("switched", iteration=120, pause_s=0.25, bytes_received=4096)
        await acks.wait_for(2)
        await publish(nc, s.worker_commands(job), switch(job, 1))
        ready, first, again = await statuses(acks, 3)
    assert ready.phase == "ready"
    assert first.phase == again.phase == "switched"
    assert first == again
    assert (again.iteration, again.pause_s, again.bytes_received) == (120, 0.25, 4096)
    assert len(hooks.named("switch")) == 1


@pytest.mark.slow
async def test_after_the_switch_heartbeats_speak_for_the_new_world(nats_server: NatsServer, job: str) -> None:
    hooks = RecordingHooks()
    me = identity(job, DEVICES[1])
    async with client(nats_server.url) as (nc, _):
        beats = await Collector.on(nc, s.worker_heartbeat(job))
        companion = Companion(me, hooks, url=nats_server.url, world=GenerationRank(0, 1), settings=FAST)
        async with running(companion):
            await prepared(nc, job, companion, hooks)
            companion.report("ready")
            await publish(nc, s.worker_commands(job), switch(job, 1))
            await eventually(lambda: _true(len(hooks.named("switch")) == 1), what="on_switch called")
            companion.report("switched", iteration=7)
            # The ack reaches the companion's loop between two beats: wait for the first beat after it.

            async def new_world() -> bool:
                return bool(beats.messages) and decode(beats.messages[-1].data, Heartbeat).generation == 1

            await eventually(new_world, what="a beat from generation 1")
            seen = len(beats.messages)
            await beats.wait_for(seen + 2)
    last = decode(beats.messages[-1].data, Heartbeat)
    assert (last.generation, last.rank) == (1, 1)  # node000:1 is rank 1 of the new placement


@pytest.mark.slow
async def test_abort_of_an_unknown_generation_is_a_no_op(nats_server: NatsServer, job: str) -> None:
    hooks = RecordingHooks()
    async with prepared_companion(nats_server.url, job, hooks) as (nc, companion, acks):
        companion.report("ready")
        await publish(nc, s.worker_commands(job), abort(job, 9))
        # A repeated Prepare is answered with the last ack: the marker that the abort was handled.
        await publish(nc, s.worker_commands(job), prepare(job, 1))
        first, marker = await statuses(acks, 2)
        await publish(nc, s.worker_commands(job), switch(job, 1))
        await eventually(lambda: _true(len(hooks.named("switch")) == 1), what="still switches")
    assert (first.phase, marker.phase) == ("ready", "ready")
    assert all(decode(m.data, WorkerStatus).generation == 1 for m in acks.messages)
    assert hooks.named("abort") == []


@pytest.mark.slow
async def test_a_fallback_abort_of_a_generation_never_prepared_still_reaches_the_runtime(
    nats_server: NatsServer, job: str
) -> None:
    """A survivor of a DP=1 world waits for a recovery no replica allows: the coordinator's checkpoint
    fallback names a generation this worker never saw, and must end that wait at once."""
    hooks = RecordingHooks()
    async with prepared_companion(nats_server.url, job, hooks) as (nc, _, _):
        fallback = Abort(job_id=job, generation=9, reason="no replica holds the state", fallback=True)
        await publish(nc, s.worker_commands(job), fallback)
        await eventually(lambda: _true(len(hooks.named("abort")) == 1), what="on_abort called")
    (heard,) = hooks.named("abort")
    assert heard == fallback


@pytest.mark.slow
async def test_a_prepare_overtaken_by_its_abort_never_starts(nats_server: NatsServer, job: str) -> None:
    hooks = RecordingHooks()
    me = identity(job)
    async with (
        client(nats_server.url) as (nc, js),
        running(Companion(me, hooks, url=nats_server.url)),
    ):
        acks = await Collector.on(nc, s.worker_status(job))
        await put_slices(js, job, 2)
        await publish(nc, s.worker_commands(job), abort(job, 1))
        await publish(nc, s.worker_commands(job), prepare(job, 1))
        await publish(nc, s.worker_commands(job), prepare(job, 2))
        await eventually(lambda: _true(len(hooks.named("prepare")) == 1), what="generation 2 prepared")
    assert [p.generation for p, _ in hooks.named("prepare")] == [2]  # type: ignore[misc]
    assert acks.messages == []


@pytest.mark.slow
async def test_abort_of_a_prepared_generation_reaches_the_runtime_once(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks()
    async with prepared_companion(nats_server.url, job, hooks) as (nc, _, _):
        await publish(nc, s.worker_commands(job), abort(job, 1, "node reclaimed"))
        await publish(nc, s.worker_commands(job), abort(job, 1, "node reclaimed"))
        await publish(nc, s.worker_commands(job), switch(job, 1))
        await eventually(lambda: _true(len(hooks.named("abort")) == 1), what="on_abort called")
        await handled(nc, job)  # the repeated abort and the switch too
    assert [a.reason for a in hooks.named("abort")] == ["node reclaimed"]  # type: ignore[attr-defined]
    assert hooks.named("switch") == []


@pytest.mark.slow
async def test_a_newer_prepare_ends_an_unswitched_older_one_first(nats_server: NatsServer, job: str) -> None:
    hooks = RecordingHooks()
    async with prepared_companion(nats_server.url, job, hooks) as (nc, _, _):
        await put_slices(nc.jetstream(), job, 2)
        await publish(nc, s.worker_commands(job), prepare(job, 2))
        await eventually(lambda: _true(len(hooks.named("prepare")) == 2), what="second prepare")
        # The old one again: stale, ignored.
        await publish(nc, s.worker_commands(job), prepare(job, 1))
        await handled(nc, job)
    assert [name for name, _ in hooks.calls] == ["prepare", "abort", "prepare"]
    assert hooks.named("abort")[0].generation == 1  # type: ignore[attr-defined]


# -- bad input --------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_bad_command_payloads_produce_error_events_naming_the_field(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks()
    me = identity(job)
    wrong_type = msgspec.json.decode(encode(switch(job, 1)))
    wrong_type["generation"] = "one"
    async with client(nats_server.url) as (nc, _):
        errors = await Collector.on(nc, s.errors("worker"))
        beats = await Collector.on(nc, s.worker_heartbeat(job))
        companion = Companion(me, hooks, url=nats_server.url, settings=FAST)
        async with running(companion):
            mine = s.worker_command(job, me.worker_id)
            await publish(nc, mine, b"{not json")
            await publish(nc, mine, msgspec.json.encode(wrong_type))
            await publish(nc, mine, switch("another-job", 1))
            got = [decode(m.data, ErrorEvent) for m in await errors.wait_for(3)]
            seen = len(beats.messages)
            await beats.wait_for(seen + 1)  # still alive and beating
            assert companion.running
    assert [e.field for e in got] == ["$", "$.generation", "$.job_id"]
    assert all(e.source == "worker" and e.subject == mine for e in got)
    assert "malformed JSON" in got[0].message
    assert got[2].job_id == "another-job"
    assert hooks.calls == []


@pytest.mark.slow
async def test_a_plan_slice_for_another_device_is_refused_and_reported_failed(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks()
    me = identity(job, DEVICES[0])
    async with client(nats_server.url) as (nc, js):
        acks = await Collector.on(nc, s.worker_status(job))
        errors = await Collector.on(nc, s.errors("worker"))
        index = slice_index(job, 1)
        # Device 3's slice where device 0's belongs.
        await put_object(js, index.name(0), msgspec.json.encode(slices()[DEVICES[3]].stored(1)))
        async with running(Companion(me, hooks, url=nats_server.url)):
            await publish(nc, s.worker_commands(job), prepare(job, 1, index))
            (ack,) = await statuses(acks, 1)
            (error,) = [decode(m.data, ErrorEvent) for m in await errors.wait_for(1)]
    assert ack.phase == "failed" and ack.generation == 1
    assert ack.error is not None and "$.device" in ack.error
    assert error.field == "$.device"
    assert hooks.calls == []


@pytest.mark.slow
async def test_prepare_reads_a_slice_stored_as_a_key_value_entry(nats_server: NatsServer, job: str) -> None:
    hooks = RecordingHooks()
    async with (
        client(nats_server.url) as (nc, js),
        running(Companion(identity(job), hooks, url=nats_server.url)),
    ):
        index = await put_slice_entries(js, job, 1)
        assert index.kv_bucket == s.KV_PLAN_SLICES and index.objects == ()
        await publish(nc, s.worker_commands(job), prepare(job, 1, index))
        await eventually(lambda: _true(len(hooks.named("prepare")) == 1), what="on_prepare called")
    ((_, plan),) = hooks.named("prepare")  # type: ignore[misc]
    assert isinstance(plan, Plan) and plan.tasks == slices()[DEVICES[0]].tasks


@pytest.mark.slow
async def test_a_missing_slice_entry_is_reported_failed_naming_its_key_after_the_fetch_timeout(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks()
    # Long enough for the first read to come back on a busy machine (the error then says "no such
    # entry", not "not read"): the entry is looked for until the time is up.
    settings = AgentSettings(heartbeat_s=0.05, fetch_timeout_s=3.0)
    async with client(nats_server.url) as (nc, js):
        acks = await Collector.on(nc, s.worker_status(job))
        index = await put_slice_entries(js, job, 1)  # the bucket exists; the keys below do not
        elsewhere = msgspec.structs.replace(index, prefix=s.plan_object_name(job, 1, "nothing") + "-")
        async with running(Companion(identity(job), hooks, url=nats_server.url, settings=settings)):
            await publish(nc, s.worker_commands(job), prepare(job, 1, elsewhere))
            (ack,) = await statuses(acks, 1)
    assert ack.phase == "failed" and ack.error is not None
    assert f"key-value entry {s.KV_PLAN_SLICES}/{job}.1.nothing.00000: no such entry" in ack.error
    assert "fetch_timeout_s = 3 s" in ack.error
    assert hooks.calls == []


@pytest.mark.slow
async def test_a_missing_plan_object_is_reported_failed(nats_server: NatsServer, job: str) -> None:
    hooks = RecordingHooks()
    me = identity(job)
    async with client(nats_server.url) as (nc, js):
        acks = await Collector.on(nc, s.worker_status(job))
        await put_slices(js, job, 1)  # the bucket exists; the objects named below do not
        async with running(Companion(me, hooks, url=nats_server.url)):
            await publish(nc, s.worker_commands(job), prepare(job, 1, slice_index(job, 1, "nothing")))
            (ack,) = await statuses(acks, 1)
    assert ack.phase == "failed"
    assert ack.error is not None and "not read" in ack.error and "nothing-00000" in ack.error
    assert "no such object" in ack.error
    assert hooks.calls == []


@pytest.mark.slow
async def test_a_slice_of_another_generation_is_refused_and_reported_failed(
    nats_server: NatsServer, job: str
) -> None:
    me = identity(job)
    async with client(nats_server.url) as (nc, js):
        acks = await Collector.on(nc, s.worker_status(job))
        index = slice_index(job, 1)
        await put_object(js, index.name(0), msgspec.json.encode(slices()[DEVICES[0]].stored(7)))
        async with running(Companion(me, RecordingHooks(), url=nats_server.url)):
            await publish(nc, s.worker_commands(job), prepare(job, 1, index))
            (ack,) = await statuses(acks, 1)
    assert ack.phase == "failed" and ack.error is not None and "$.generation" in ack.error


@pytest.mark.slow
async def test_a_worker_in_neither_world_ignores_the_broadcast_prepare(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks()
    spare = identity(job, Device("node009", 0))
    async with client(nats_server.url) as (nc, js):
        acks = await Collector.on(nc, s.worker_status(job))
        await put_slices(js, job, 1)
        async with running(Companion(spare, hooks, url=nats_server.url)):
            await publish(nc, s.worker_commands(job), prepare(job, 1))
            await publish(nc, s.worker_commands(job), switch(job, 1))
            await handled(nc, job)
    assert hooks.calls == [] and acks.messages == []


@pytest.mark.slow
async def test_a_lost_device_of_the_old_world_ignores_the_broadcast_prepare(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks()
    me = identity(job, DEVICES[3])
    async with client(nats_server.url) as (nc, js):
        acks = await Collector.on(nc, s.worker_status(job))
        await put_slices(js, job, 1)
        async with running(Companion(me, hooks, url=nats_server.url)):
            await publish(nc, s.worker_commands(job), prepare(job, 1, lost=(DEVICES[3],)))
            await handled(nc, job)
    assert hooks.calls == [] and acks.messages == []


@pytest.mark.slow
async def test_an_old_rank_leaving_the_job_takes_part_and_gets_what_it_sends(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks()
    me = identity(job, DEVICES[3])  # in the old world, not in the new one
    async with prepared_companion(nats_server.url, job, hooks, me):
        pass
    ((_, plan),) = hooks.named("prepare")  # type: ignore[misc]
    assert isinstance(plan, Plan) and plan.tasks == slices()[DEVICES[3]].tasks
    assert plan.tasks and all(plan.old.placement.devices[t.src] == DEVICES[3] for t in plan.tasks)


@pytest.mark.slow
async def test_a_hook_that_raises_is_reported_failed_and_the_companion_keeps_running(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks(raise_in="prepare")
    async with prepared_companion(nats_server.url, job, hooks) as (_, companion, acks):
        (ack,) = await statuses(acks, 1)
        assert companion.running and companion.connected
    assert ack.phase == "failed" and ack.error is not None and "on_prepare raised RuntimeError" in ack.error


@pytest.mark.slow
def test_an_identity_the_bus_would_refuse_fails_at_construction(nats_server: NatsServer) -> None:
    with pytest.raises(MessageError) as caught:
        Companion(identity("job-x", worker_id="w.1"), RecordingHooks(), url=nats_server.url)
    assert caught.value.path == "$.worker_id"
    with pytest.raises(MessageError) as caught:
        Companion(identity("job-x", address="no-port"), RecordingHooks(), url=nats_server.url)
    assert caught.value.path == "$.address"


@pytest.mark.slow
def test_an_ack_that_is_not_a_valid_message_raises_in_the_caller(nats_server: NatsServer) -> None:
    with Companion(identity("job-y"), RecordingHooks(), url=nats_server.url) as companion:
        with pytest.raises(ValueError, match="`error`"):
            companion.report("failed", generation=1)
        with pytest.raises(ValueError, match="`generation`"):
            companion.report("ready")  # nothing prepared, no generation given


# -- threads, stalls, reconnects ---------------------------------------------------------------------------


@pytest.mark.slow
def test_close_leaves_no_thread_behind(nats_server: NatsServer) -> None:
    before = companion_threads()
    companion = Companion(identity("job-z"), RecordingHooks(), url=nats_server.url).start(START_S)
    assert companion.running and len(companion_threads()) == len(before) + 1
    companion.close()
    assert not companion.running
    assert companion_threads() == before
    assert not companion.connected


@pytest.mark.slow
async def test_acks_handed_over_just_before_close_are_still_published(
    nats_server: NatsServer, job: str
) -> None:
    hooks = RecordingHooks()
    async with client(nats_server.url) as (nc, _):
        acks = await Collector.on(nc, s.worker_status(job))
        companion = Companion(identity(job), hooks, url=nats_server.url)
        await asyncio.to_thread(companion.start, START_S)
        await prepared(nc, job, companion, hooks)

        def report_and_close() -> None:
            companion.report("ready")
            companion.report("failed", error="shutting down")
            companion.close()

        await asyncio.to_thread(report_and_close)
        got = await statuses(acks, 2)
    assert [a.phase for a in got] == ["ready", "failed"]
    assert not companion.running


def test_start_gives_up_cleanly_when_no_server_answers() -> None:
    # A port bound here and never listened on refuses every connection, and no other process can take
    # it meanwhile (as it could the port of a server that was stopped).
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"nats://127.0.0.1:{closed.getsockname()[1]}"
        before = companion_threads()
        companion = Companion(identity("job-z"), RecordingHooks(), url=url, reconnect_time_wait_s=0.05)
        with pytest.raises(CompanionError, match="not connected"):
            companion.start(timeout_s=0.5)
        assert companion_threads() == before


@pytest.fixture
def private_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.mark.slow
async def test_a_stalled_bus_does_not_slow_the_training_loop(private_server: NatsServer, job: str) -> None:
    """The server is frozen (SIGSTOP) while the training loop reports: every call returns at once, and
    everything it handed over arrives once the server runs again."""
    hooks = RecordingHooks()
    calls = 200
    async with client(private_server.url) as (nc, _):
        acks = await Collector.on(nc, s.worker_status(job))
        async with running(Companion(identity(job), hooks, url=private_server.url)) as companion:
            await prepared(nc, job, companion, hooks)

            def training_loop() -> list[float]:
                costs = []
                for i in range(calls):
                    t0 = time.perf_counter()
                    companion.set_iteration(i)
                    companion.report("preparing")
                    costs.append(time.perf_counter() - t0)
                return costs

            assert private_server.pid is not None
            os.kill(private_server.pid, signal.SIGSTOP)
            try:
                costs = await asyncio.to_thread(training_loop)
            finally:
                os.kill(private_server.pid, signal.SIGCONT)
            await acks.wait_for(calls)
    # The loop ran to its end while the server was frozen, so no call waited for the bus. The bounds
    # are generous: a call costs microseconds, plus at worst a few GIL switch intervals (5 ms each)
    # while the companion thread encodes what it was handed.
    assert statistics.median(costs) < 0.001
    assert sum(costs) < 2.0


class Proxy:
    """A TCP proxy in front of the server whose connections the test can cut (a network blip)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.mark.slow
async def test_after_a_reconnect_the_worker_says_hello_again_with_its_open_ack(
    nats_server: NatsServer, job: str
) -> None:
    port = int(nats_server.url.rsplit(":", 1)[1])
    proxy = Proxy(port)
    await proxy.start()
    hooks = RecordingHooks()
    try:
        async with client(nats_server.url) as (nc, _):
            hellos = await Collector.on(nc, s.worker_hello(job))
            acks = await Collector.on(nc, s.worker_status(job))
            companion = Companion(
                identity(job), hooks, url=f"nats://127.0.0.1:{proxy.port}", reconnect_time_wait_s=0.05
            )
            async with running(companion):
                await hellos.wait_for(1)
                await prepared(nc, job, companion, hooks)
                companion.report("ready")
                await acks.wait_for(1)
                proxy.cut()
                await hellos.wait_for(2)
                first, again = await statuses(acks, 2)
                await eventually(lambda: _true(companion.connected), what="reconnected")
    finally:
        await proxy.stop()
    assert first == again and again.phase == "ready"


@pytest.mark.slow
async def test_a_connection_the_server_closes_is_renewed_with_the_handoff_and_its_open_ack(
    nats_server: NatsServer, job: str
) -> None:
    # nats-py reconnects after an outage by itself, but not after the server closed the connection on a
    # protocol error; a companion left on it would be deaf (issue 16, finding 5's worker-side twin).
    hooks = RecordingHooks()
    async with client(nats_server.url) as (nc, _):
        hellos = await Collector.on(nc, s.worker_hello(job))
        acks = await Collector.on(nc, s.worker_status(job))
        async with running(Companion(identity(job), hooks, url=nats_server.url)) as companion:
            await hellos.wait_for(1)
            await prepared(nc, job, companion, hooks)
            companion.report("ready")
            await acks.wait_for(1)
            old = companion._nc
            assert old is not None
            too_big = old.publish(
                "liver.test.too-big", b"x" * (old.max_payload - 8), headers={"Pad": "y" * 256}
            )
            asyncio.run_coroutine_threadsafe(too_big, companion._loop).result(30)
            await hellos.wait_for(2)
            first, again = await statuses(acks, 2)
            await eventually(lambda: _true(companion.connected and companion._nc is not old), what="renewed")
            assert companion.reconnections == 1 and old.is_closed
            await publish(nc, s.worker_commands(job), switch(job, 1))
            await eventually(
                lambda: _true(len(hooks.named("switch")) == 1), what="a command on the new connection"
            )
    assert first == again and again.phase == "ready"


# -- the training thread's side ----------------------------------------------------------------------------


def test_command_box_hands_commands_over_in_arrival_order() -> None:
    box = CommandBox()
    assert not box.pending and box.take() == []
    plan = slices()[DEVICES[0]].to_plan()
    box.on_prepare(prepare("j", 1), plan)
    box.on_switch(switch("j", 1))
    box.on_abort(abort("j", 1))
    assert box.pending
    taken = box.take()
    assert [type(c).__name__ for c in taken] == ["Prepared", "Switch", "Abort"]
    assert isinstance(taken[0], Prepared) and taken[0].plan is plan
    assert not box.pending and box.take() == []


@pytest.mark.slow
async def test_the_companion_serves_its_counters_progress_and_world_as_metrics(
    nats_server: NatsServer, job: str
) -> None:
    me = identity(job)
    companion = Companion(
        me, RecordingHooks(), url=nats_server.url, settings=FAST, world=GenerationRank(2, 1), metrics_port=0
    )
    async with running(companion):
        assert companion.metrics_port
        companion.set_iteration(41)
        labels = (("job", job), ("worker", me.worker_id))
        beats = ("liver_worker_stat", tuple(sorted((*labels, ("stat", "heartbeats")))))
        first = await asyncio.to_thread(scrape, companion.metrics_port)

        async def beat_again() -> bool:
            now = await asyncio.to_thread(scrape, companion.metrics_port)
            return now[beats] > first[beats]

        await eventually(beat_again, what="the heartbeat counter moving")
        seen = await asyncio.to_thread(scrape, companion.metrics_port)
    assert seen[("liver_worker_iteration", labels)] == 41
    assert (seen[("liver_worker_generation", labels)], seen[("liver_worker_rank", labels)]) == (2, 1)
    assert seen[("liver_worker_connected", labels)] == 1
