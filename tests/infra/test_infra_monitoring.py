"""infra/'s monitoring: Prometheus scrapes the port every service serves its metrics on, and the Grafana
dashboard queries only series the services expose."""

from __future__ import annotations

import json
import re

import yaml  # PyYAML comes with the kubernetes client (liver notice --source kubernetes)
from infra_helpers import INFRA, SERVICES, load_compose

from liver.services.metrics import ServiceMetrics
from liver.shared.messages import GenerationCommitted

DASHBOARD = INFRA / "grafana" / "dashboards" / "liver.json"


def scraped_targets() -> list[str]:
    config = yaml.safe_load((INFRA / "prometheus.yml").read_text())
    return [t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]


def exposed_names() -> set[str]:
    """Every series name a service exposes (with one outcome observed, so every family has samples)."""
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
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


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
