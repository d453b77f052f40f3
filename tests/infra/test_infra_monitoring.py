"""infra/'s monitoring: Prometheus scrapes the port every service serves its metrics on and keeps the LiveR
job the series carry, and the Grafana dashboard queries only series the services expose, as what they are
(no counter function over a gauge)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import cast

import yaml  # PyYAML comes with the kubernetes client (liver notice --source kubernetes)
from infra_helpers import INFRA, SERVICES, load_compose
from prometheus_client.core import Metric

from liver.services.metrics import ServiceMetrics
from liver.shared.layout import Device
from liver.shared.messages import GenerationCommitted
from liver.worker_runtime.companion.agent import GenerationRank, Presence, WorkerAgent, WorkerIdentity
from liver.worker_runtime.companion.metrics import CompanionCollector, companion_registry

DASHBOARD = INFRA / "grafana" / "dashboards" / "liver.json"


def scraped_targets() -> list[str]:
    config = yaml.safe_load((INFRA / "prometheus.yml").read_text())
    return [t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]


def service_families() -> list[Metric]:
    """Every family a service exposes (with one outcome observed, so every family has samples)."""
    metrics = ServiceMetrics()
    metrics.watch_stats("ingester", lambda: {"received": 1})
    from datetime import UTC, datetime

    from liver.shared.layout import Device, ParallelLayout, Placement

    metrics.outcome(
        GenerationCommitted(
            job_id="j",
            event_id="e",
            previous_generation=0,
            generation=1,
            layout=ParallelLayout(tp=1, pp=1, dp=1),
            placement=Placement((Device("n", 0),)),
            started_at_iteration=1,
            downtime_s=0.1,
            bytes_moved=1,
            committed_at=datetime.now(UTC),
        ),
        "spot_warning",
        datetime.now(UTC),
    )
    metrics.plan_seconds.labels("transfer").observe(0.1)
    metrics.queue.labels("ingester", "waiting").set(0)
    return list(metrics.registry.collect())


def worker_families() -> list[Metric]:
    """Every family a worker's companion exposes (in a world, with a counter, so each has samples)."""
    identity = WorkerIdentity(job_id="j", worker_id="w", device=Device("n", 0), address="n:1")
    agent = SimpleNamespace(counters=lambda: {"heartbeats": 1})
    presence = Presence(world=GenerationRank(1, 0), iteration=1)
    collector = CompanionCollector(identity, presence, lambda: cast(WorkerAgent, agent), lambda: True)
    return list(companion_registry(collector).collect())


def exposed_names() -> set[str]:
    """Every series name a service exposes."""
    return {sample.name for family in service_families() for sample in family.samples}


def label_names() -> dict[str, set[str]]:
    """The label names of every series LiveR exposes (the services' and the workers'), by series name."""
    out: dict[str, set[str]] = {}
    for family in service_families() + worker_families():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def gauges() -> set[str]:
    """Every series LiveR declares a gauge (a value that goes up and down, or is set: not a counter)."""
    return {f.name for f in service_families() + worker_families() if f.type == "gauge"}


def expressions() -> list[tuple[str, str]]:
    """(expr, legend) of every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(t["expr"], t.get("legendFormat", "")) for p in dashboard["panels"] for t in p["targets"]]


def series_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(liver_[a-z_]+)", expr))


def test_prometheus_scrapes_every_service_on_the_port_compose_gives_it() -> None:
    services = load_compose()["services"]
    ports = {services[s]["environment"]["LIVER_METRICS_PORT"] for s in SERVICES}
    assert len(ports) == 1
    (port,) = ports
    assert sorted(scraped_targets()) == sorted(f"{s}:{port}" for s in SERVICES)


def test_the_dashboard_queries_only_series_the_services_expose() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\b(liver_[a-z_]+)", e)}
    exposed = exposed_names()
    assert used, "the dashboard queries nothing"
    assert sorted(used - exposed) == []


PROMETHEUS_TARGET_LABELS = ("job", "instance")
"""The labels Prometheus gives every series it scrapes (the scrape job's name, the target's address)."""


def test_prometheus_keeps_the_job_label_the_series_carry() -> None:
    # Without honor_labels Prometheus files a scraped `job` under `exported_job` and puts its own scrape
    # job's name in `job`: "Live generation" would show "liver-services", and "Bytes moved" (by job)
    # would merge every LiveR job into one series.
    carried = set().union(*label_names().values())
    clashing = carried & set(PROMETHEUS_TARGET_LABELS)
    assert clashing == {"job"}, "honoring the series' labels overrides `job`, none other of Prometheus' own"
    config = yaml.safe_load((INFRA / "prometheus.yml").read_text())
    for scrape in config["scrape_configs"]:
        assert scrape.get("honor_labels") is True, scrape["job_name"]


def test_the_dashboard_reads_job_only_from_series_that_carry_the_liver_job() -> None:
    # Honoring labels, a series without `job` keeps the scrape job's name there: not a LiveR job.
    labels = label_names()
    readers = [
        (expr, name)
        for expr, legend in expressions()
        if "{{job}}" in legend or re.search(r"\bby \([^)]*\bjob\b", expr)
        for name in series_in(expr)
    ]
    assert readers, "the dashboard shows LiveR's jobs"
    for expr, name in readers:
        assert "job" in labels[name], expr


def test_the_dashboard_takes_no_rate_or_increase_of_a_gauge() -> None:
    # rate(), irate() and increase() read a counter (and take a drop for its reset): over a gauge they are
    # wrong. A gauge's change is delta() or deriv().
    declared = gauges()
    assert "liver_service_stat" in declared and "liver_generation" in declared
    for expr, _ in expressions():
        for function, name in re.findall(r"\b(rate|irate|increase)\s*\(\s*(liver_[a-z_]+)", expr):
            assert name not in declared, f"{function}() of the gauge {name}: {expr}"


def test_grafana_is_provisioned_with_the_prometheus_source_the_dashboard_uses() -> None:
    source = yaml.safe_load(
        (INFRA / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    (prometheus,) = source["datasources"]
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    assert uids == {prometheus["uid"]}
    assert prometheus["url"] == "http://prometheus:9090"
    assert "prometheus" in load_compose()["services"]
