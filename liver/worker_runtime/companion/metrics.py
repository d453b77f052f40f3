"""Prometheus metrics of one worker's companion, read at each scrape from what it already keeps.

Series (labels ``job``, ``worker``): ``liver_worker_stat{stat}`` (commands received and rejected, acks
sent, heartbeats sent, hooks that failed: the agent's counters), ``liver_worker_iteration``,
``liver_worker_generation`` and ``liver_worker_rank`` (what the heartbeats report; absent before the
process has a world) and ``liver_worker_connected`` (1 while the bus connection is up). Nothing is
counted twice and the training thread does no work for them: a scrape reads plain attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from liver.worker_runtime.companion.agent import Presence, WorkerAgent, WorkerIdentity


class CompanionCollector(Collector):
    def __init__(
        self,
        identity: WorkerIdentity,
        presence: Presence,
        agent: Callable[[], WorkerAgent | None],
        connected: Callable[[], bool],
    ) -> None:
        self.labels = [identity.job_id, identity.worker_id]
        self.presence = presence
        self.agent = agent
        self.connected = connected

    def collect(self) -> Iterator[Metric]:
        names = ["job", "worker"]

        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=names)

        stats = GaugeMetricFamily("liver_worker_stat", "The companion's counters", labels=[*names, "stat"])
        agent = self.agent()
        if agent is not None:
            for name, value in agent.counters().items():
                stats.add_metric([*self.labels, name], float(value))
        yield stats
        connected = gauge("liver_worker_connected", "1 while the bus connection is up")
        connected.add_metric(self.labels, 1.0 if self.connected() else 0.0)
        yield connected
        iteration = gauge("liver_worker_iteration", "The iteration heartbeats report")
        if self.presence.iteration is not None:
            iteration.add_metric(self.labels, float(self.presence.iteration))
        yield iteration
        world = self.presence.world
        generation = gauge("liver_worker_generation", "The generation of this process's world")
        rank = gauge("liver_worker_rank", "This process's rank in that world")
        if world is not None:
            generation.add_metric(self.labels, float(world.generation))
            rank.add_metric(self.labels, float(world.rank))
        yield generation
        yield rank


def companion_registry(collector: CompanionCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry
