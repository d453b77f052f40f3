"""Prometheus metrics of one service process (``prometheus-client``), served by ``hosted(metrics_port=)``.

Every service has a :class:`ServiceMetrics` of its own registry (several services share a process in
the tests and in ``liver demo``; each keeps its own series). Three kinds of series:

- the service's own counters, exactly as its ``$SRV.STATS`` reports them (``stats()``: messages
  received, events resized or de-duplicated, plans made or failed, dead letters, record conflicts, ...),
  as ``liver_service_stat{service, stat}``: one source of truth for both views;
- the depth of the service's queue, from its durable consumer (``liver_queue_messages{service, state}``,
  ``state`` ``waiting`` or ``unacked``);
- what only a series can show: handoff outcomes by trigger (``liver_handoffs_total{job, outcome,
  trigger}``), their downtime and duration (histograms), bytes moved, the live generation, and planning
  time per planner.

Off by default in the library; ``liver serve --metrics-port`` (``$LIVER_METRICS_PORT``, set in the
images) serves ``/metrics`` on that port (:class:`~liver.shared.metrics_http.MetricsServer`), and the
service's ``/healthz`` beside it (:class:`~liver.services.host.ServiceHealth`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from liver.shared.messages import GenerationAborted, GenerationCommitted

METRICS_PORT_ENV: Final = "LIVER_METRICS_PORT"

DOWNTIME_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
DURATION_BUCKETS: Final = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PLAN_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class _Stats(Collector):
    """``stats()`` of the service, read at each scrape (numbers only: a phase name is not a sample)."""

    def __init__(self, service: str, stats: Callable[[], Mapping[str, int | float | str]]) -> None:
        self.service = service
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "liver_service_stat",
            "A service's own counters, as $SRV.STATS reports them",
            labels=["service", "stat"],
        )
        for name, value in sorted(self.stats().items()):
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            family.add_metric([self.service, name], float(value))
        yield family


class ServiceMetrics:
    """The series of one service (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._stats_watched = False
        r = self.registry
        self.handoffs = Counter(
            "liver_handoffs",
            "Handoffs by outcome and first trigger",
            ["job", "outcome", "trigger"],
            registry=r,
        )
        self.downtime = Histogram(
            "liver_handoff_downtime_seconds",
            "Training stood still in a committed handoff (the slowest worker's pause)",
            ["job"],
            buckets=DOWNTIME_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "liver_handoff_duration_seconds",
            "From a handoff's first trigger to its outcome",
            ["job", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.bytes_moved = Counter(
            "liver_bytes_moved", "State moved between devices by committed handoffs", ["job"], registry=r
        )
        self.generation = Gauge("liver_generation", "The job's live generation", ["job"], registry=r)
        self.queue = Gauge(
            "liver_queue_messages",
            "Messages of the service's durable consumer: waiting to be delivered, or delivered and not yet "
            "acknowledged (refreshed every few seconds while metrics are served)",
            ["service", "state"],
            registry=r,
        )
        self.plan_seconds = Histogram(
            "liver_plan_seconds", "Planning time per request", ["planner"], buckets=PLAN_BUCKETS, registry=r
        )

    def watch_stats(self, service: str, stats: Callable[[], Mapping[str, int | float | str]]) -> None:
        """Export ``stats()`` of ``service`` at every scrape (once per registry)."""
        if not self._stats_watched:
            self.registry.register(_Stats(service, stats))
            self._stats_watched = True

    def outcome(
        self,
        message: GenerationCommitted | GenerationAborted,
        trigger: str | None,
        began_at: datetime | None,
    ) -> None:
        """Count one handoff outcome (published for the first time)."""
        job = message.job_id
        if isinstance(message, GenerationCommitted):
            kind, at = "committed", message.committed_at
            self.downtime.labels(job).observe(message.downtime_s)
            self.bytes_moved.labels(job).inc(message.bytes_moved)
            self.generation.labels(job).set(message.generation)
        else:
            kind, at = "aborted", message.aborted_at
            self.generation.labels(job).set(message.active_generation)
        self.handoffs.labels(job, kind, trigger or "unknown").inc()
        if began_at is not None:
            self.duration.labels(job, kind).observe(max(0.0, (at - began_at).total_seconds()))
