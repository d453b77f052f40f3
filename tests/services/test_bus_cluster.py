"""A clustered bus: three nats-servers on loopback as one JetStream cluster, as the deployment runs them.

Every stream, bucket and object store the services declare is kept on all three servers
(``$LIVER_JS_REPLICAS=3``), and a server killed in the middle of a handoff costs the job nothing: the
handoff commits, every event ends in exactly one outcome, and nothing aborts (issue 16).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import pytest
from bus_helpers import Collector, eventually

from liver.services import bus as b
from liver.services.coordinator import CoordinatorConfig
from liver.services.coordinator.service import CoordinatorService, CoordinatorSettings
from liver.services.host import hosted
from liver.services.ingester.service import Ingester, IngesterSettings
from liver.services.topology.memory import CPU_SMALL, TrainingSetup
from liver.services.topology.service import TopologyService
from liver.services.topology.settings import JobProfile, TopologySettings
from liver.services.transfer.service import TransferService, TransferSettings
from liver.shared import subjects as s
from liver.shared.codec import decode, encode
from liver.shared.layout import ParallelLayout
from liver.shared.messages import (
    GenerationAborted,
    GenerationCommitted,
    NodeDevices,
    ScaleRequest,
    SpotWarning,
)
from liver.shared.model import PRESETS
from liver.shared.nats_server import NatsCluster
from liver.worker_runtime.companion.simulated import SimSettings, simulated_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENV = {b.REPLICAS_ENV: "3"}
HANDOFF_S = 180.0
"""Through four services and a simulated job on a busy two-core machine, across a leader election."""
_jobs = itertools.count()


@pytest.fixture(scope="module")
def cluster() -> Iterator[NatsCluster]:
    with NatsCluster(3) as running_cluster:
        yield running_cluster


@contextlib.asynccontextmanager
async def services(url: str, job: str) -> AsyncIterator[None]:
    topology = TopologySettings(
        default=JobProfile(
            model=PRESETS["tiny-gpt"],
            setup=TrainingSetup(global_batch_size=12, sequence_length=64),
            hardware=CPU_SMALL,
        ),
        staging_bytes=1 << 20,
        retry_delay_s=0.1,
    )
    coordinator = CoordinatorSettings(
        job_id=job, retry_delay_s=0.1, core=CoordinatorConfig(heartbeat_timeout_s=60.0, margin_s=0.5)
    )
    async with (
        hosted(Ingester(IngesterSettings(retry_delay_s=0.1)), url, ENV),
        hosted(TopologyService(topology), url, ENV),
        hosted(TransferService(TransferSettings(retry_delay_s=0.1)), url, ENV),
        hosted(CoordinatorService(coordinator), url, ENV),
    ):
        yield


@contextlib.asynccontextmanager
async def connected(url: str) -> AsyncIterator[Any]:
    nc = await nats.connect(servers=url.split(","), connect_timeout=30, reconnect_time_wait=0.2)
    try:
        yield nc
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def job_on(url: str, job: str) -> AsyncIterator[None]:
    """TP2 x DP2 on node000 and node001, and two spares on node002."""
    world = SimSettings(
        job_id=job, workers=4, devices_per_node=2, layout=ParallelLayout(2, 1, 2), heartbeat_s=0.5
    )
    spares = SimSettings(
        job_id=job, workers=2, nodes=("node002",), devices_per_node=2, generation=None, worker_prefix="spare",
        heartbeat_s=0.5,
    )  # fmt: skip
    async with connected(url) as nc, simulated_job(world, nc), simulated_job(spares, nc):
        yield


def outcome_ids(messages: list[Any]) -> dict[str, int]:
    """How many outcomes name each event."""
    counts: dict[str, int] = {}
    for message in messages:
        for event_id in message.event_ids:
            counts[event_id] = counts.get(event_id, 0) + 1
    return counts


async def test_every_stream_bucket_and_store_is_kept_on_three_servers(cluster: NatsCluster) -> None:
    job = f"cl{os.getpid()}x{next(_jobs)}"
    async with services(cluster.urls, job), connected(cluster.urls) as nc:
        js = nc.jetstream(timeout=30)
        names = [spec.name for spec in s.STREAMS] + [
            f"KV_{s.KV_GENERATIONS}",
            f"KV_{s.KV_MEMBERSHIP}",
            f"KV_{s.KV_EVENTS_SEEN}",
            f"KV_{s.KV_PLAN_SLICES}",
            f"OBJ_{s.OBJECT_STORE_PLANS}",
        ]
        replicas = {name: (await js.stream_info(name)).config.num_replicas for name in names}
    assert replicas == dict.fromkeys(names, 3)


async def test_a_server_killed_during_a_handoff_loses_nothing_and_aborts_nothing(
    cluster: NatsCluster,
) -> None:
    job = f"cl{os.getpid()}x{next(_jobs)}"
    async with services(cluster.urls, job), connected(cluster.urls) as nc, job_on(cluster.urls, job):
        js = nc.jetstream(timeout=30)
        committed = await Collector.on(nc, s.GENERATION_COMMITTED)
        aborted = await Collector.on(nc, s.GENERATION_ABORTED)

        def mine() -> list[GenerationCommitted]:
            # A publish whose acknowledgement was lost with the killed server is sent again under the
            # same Nats-Msg-Id: the stream keeps one copy, a plain subscriber receives both and drops
            # the second by that id, as a user's subscriber does (README).
            seen: set[str] = set()
            out = []
            for m in committed.messages:
                msg_id = (m.headers or {}).get(s.HEADER_MSG_ID)
                if msg_id is None or msg_id not in seen:
                    out.append(decode(m.data, GenerationCommitted))
                if msg_id is not None:
                    seen.add(msg_id)
            return [c for c in out if c.job_id == job]

        async def commits(count: int) -> list[GenerationCommitted]:
            async def arrived() -> bool:
                return len(mine()) >= count

            await eventually(arrived, timeout_s=HANDOFF_S, what=f"{count} commits of {job}")
            return mine()

        async def publish(subject: str, message: Any) -> None:
            for attempt in range(20):  # the stream's leader may be being elected
                try:
                    await js.publish(subject, encode(message), headers={s.HEADER_MSG_ID: message.event_id})
                    return
                except (nats.errors.Error, TimeoutError):
                    if attempt == 19:
                        raise
                    await asyncio.sleep(0.5)

        async def live() -> bool:
            try:
                return (await (await js.key_value(s.KV_MEMBERSHIP)).get(job)) is not None
            except (nats.errors.Error, nats.js.errors.Error):
                return False

        await eventually(live, timeout_s=HANDOFF_S, what="the coordinator published the job's workers")
        await publish(
            s.SPOT_WARNING,
            SpotWarning(job_id=job, event_id="w-1", node="node001", provider="aws", notice_s=120),
        )
        await commits(1)
        leader = (await js.stream_info(s.STREAM_CONTROL.name)).cluster.leader
        victim = int(leader.rsplit("-", 1)[1])
        grow = ScaleRequest(
            job_id=job, event_id="g-1", reason="back", add=(NodeDevices(node="node002", devices=(0, 1)),)
        )
        await publish(s.SCALE_REQUEST, grow)
        cluster.kill(victim)  # the control stream's leader, while the scale request is being handled
        try:
            await commits(2)
            await publish(
                s.SPOT_WARNING,
                SpotWarning(job_id=job, event_id="w-2", node="node000", provider="aws", notice_s=120),
            )
            out = await commits(3)
        finally:
            cluster.restart(victim)
    mine_aborted = [
        a for a in (decode(m.data, GenerationAborted) for m in aborted.messages) if a.job_id == job
    ]
    assert [c.generation for c in out] == [1, 2, 3]
    assert mine_aborted == [], [a.reason for a in mine_aborted]
    assert outcome_ids(out) == {"w-1": 1, "g-1": 1, "w-2": 1}
    assert {d.node for d in out[-1].placement.devices} == {"node002"}
