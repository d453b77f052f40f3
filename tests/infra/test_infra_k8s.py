"""infra/k8s: every manifest is valid for Kubernetes (its JSON schemas, offline), and what the manifests
give LiveR's processes (commands, users, settings, the NATS cluster's config) is what they accept."""

from __future__ import annotations

import argparse
import copy
import shlex
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from infra_helpers import DOCKERFILE, INFRA, SERVICES, load_compose, make_tls
from repo_paths import REPO

from liver.cli import notice_cmd, serve_cmd, worker_cmd
from liver.services import bus as b
from liver.services.host import HEALTH_TIMEOUT_S
from liver.shared.metrics_http import HEALTH_PATH
from liver.shared.nats_server import find_binary

K8S = INFRA / "k8s"
KUBERNETES_VERSION = "1.33.0"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def every_document() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in documents(p)]


def find(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in every_document() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


CERT_MANAGER = "cert-manager.io/v1"
"""cert-manager's resources (tls.yaml): custom resources, which Kubernetes' own schemas do not cover."""


def kubernetes_documents() -> list[dict[str, Any]]:
    return [d for d in every_document() if d["apiVersion"] != CERT_MANAGER]


def cert_manager(kind: str) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d
        for d in every_document()
        if d["apiVersion"] == CERT_MANAGER and d["kind"] == kind
    }


@pytest.mark.parametrize("doc", kubernetes_documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_is_valid_for_kubernetes(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_only_resources_beyond_kubernetes_are_cert_managers_issuers_and_certificates() -> None:
    others = [d for d in every_document() if d not in kubernetes_documents()]
    assert others and {(d["apiVersion"], d["kind"]) for d in others} == {
        (CERT_MANAGER, "Issuer"),
        (CERT_MANAGER, "Certificate"),
    }
    assert all(d["metadata"]["namespace"] == "liver" for d in others)


def test_the_schema_check_refuses_a_misspelt_field() -> None:
    doc = copy.deepcopy(find("Deployment", "liver-ingester"))
    doc["spec"]["template"]["spec"]["containers"][0]["enviroment"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_applies_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)


# -- users ----------------------------------------------------------------------------------------------


def image_user() -> tuple[int, int]:
    """LiveR's image's USER (infra/Dockerfile) as (uid, gid)."""
    (user,) = [line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("USER ")]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit(), f"USER {user}: the kubelet cannot tell a name is not root"
    return int(uid), int(gid)


def pods() -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every workload."""
    return [
        (f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"])
        for d in kubernetes_documents()
        if "template" in d.get("spec", {})
    ]


def effective(pod: dict[str, Any], container: dict[str, Any], field: str) -> Any:
    """A securityContext field as the container gets it: its own, else the pod's."""
    return container.get("securityContext", {}).get(field, pod.get("securityContext", {}).get(field))


def test_every_container_that_must_not_run_as_root_runs_as_the_images_numeric_user() -> None:
    # The kubelet refuses runAsNonRoot with a named USER and no runAsUser: CreateContainerConfigError.
    uid, gid = image_user()
    checked = []
    for workload, pod in pods():
        for container in pod.get("initContainers", []) + pod["containers"]:
            if not effective(pod, container, "runAsNonRoot"):
                continue
            where = f"{workload} {container['name']}"
            user = effective(pod, container, "runAsUser")
            assert isinstance(user, int) and user != 0, f"{where}: runAsNonRoot with no numeric runAsUser"
            if container["image"].split(":")[0] == "liver":
                assert (user, effective(pod, container, "runAsGroup")) == (uid, gid), where
                checked.append(where)
    assert len(checked) == len(SERVICES) + 3, "the services, the notice agent, the example job's two"


def test_a_pod_that_writes_a_volume_owns_it_by_the_images_group() -> None:
    _, gid = image_user()
    read_only_sources = {"secret", "configMap", "projected", "downwardAPI"}
    writers = []
    for workload, pod in pods():
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        written = [
            m["name"]
            for c in pod.get("initContainers", []) + pod["containers"]
            if c["image"].split(":")[0] == "liver"
            for m in c.get("volumeMounts", [])
            if not m.get("readOnly") and not read_only_sources & set(volumes.get(m["name"], {}))
        ]
        if written:
            assert pod.get("securityContext", {}).get("fsGroup") == gid, f"{workload} writes {written}"
            writers.append(workload)
    assert writers == ["StatefulSet/liver-train"], "the example job's corpus"


# -- the services -------------------------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_runs_as_in_compose_and_is_ready_when_it_answers(service: str) -> None:
    (container,) = find("Deployment", f"liver-{service}")["spec"]["template"]["spec"]["containers"]
    env = env_of(container)
    assert container["args"] == [service]
    assert env["NATS_USER"] == service
    assert env["NATS_PASSWORD"]["secretKeyRef"] == {
        "name": "liver-nats-passwords",
        "key": f"LIVER_NATS_PASSWORD_{service.upper()}",
    }
    assert container["readinessProbe"]["httpGet"]["path"] == HEALTH_PATH
    compose = load_compose()["services"][service]["environment"]
    assert env["LIVER_METRICS_PORT"] == compose["LIVER_METRICS_PORT"]
    assert {p["containerPort"] for p in container["ports"]} == {int(env["LIVER_METRICS_PORT"])}


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def liver_containers() -> list[tuple[str, dict[str, Any]]]:
    """(workload container, spec) of every container that runs LiveR's image."""
    return [
        (f"{workload} {container['name']}", container)
        for workload, pod in pods()
        for container in pod.get("initContainers", []) + pod["containers"]
        if container["image"].split(":")[0] == "liver"
    ]


def test_no_liver_container_probes_by_starting_a_process() -> None:
    # An exec probe starts a Python interpreter in the container every period: about 120m of CPU per
    # service, above its request (issue 34). The services answer /healthz on their metrics port instead.
    execs = [
        f"{where} {kind}" for where, c in liver_containers() for kind in PROBES if "exec" in c.get(kind, {})
    ]
    assert execs == []


def test_every_http_probe_asks_the_metrics_server_of_the_container_for_its_health() -> None:
    probed = []
    for where, container in liver_containers():
        declared = {p["containerPort"]: p for p in container.get("ports", [])}
        by_name = {p["name"]: p["containerPort"] for p in declared.values() if "name" in p}
        for kind in PROBES:
            get = container.get(kind, {}).get("httpGet")
            if get is None:
                continue
            port = by_name.get(get["port"], get["port"])
            assert port in declared, f"{where} {kind}: port {get['port']!r} is not one the container declares"
            metrics = env_of(container).get("LIVER_METRICS_PORT")
            assert metrics is not None and int(metrics) == port, f"{where} {kind}: not its metrics port"
            assert container["args"][0] in SERVICES, f"{where}: only `liver serve` answers {HEALTH_PATH}"
            assert get["path"] == HEALTH_PATH and get.get("scheme", "HTTP") == "HTTP", f"{where} {kind}"
            assert container[kind].get("timeoutSeconds", 1) > HEALTH_TIMEOUT_S, (
                f"{where} {kind}: the probe must outwait the service's own check of its loop"
            )
            probed.append((container["args"][0], kind))
    assert sorted(probed) == sorted((s, k) for s in SERVICES for k in ("readinessProbe", "livenessProbe"))


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_keeps_what_it_declares_on_every_server_of_the_cluster(service: str) -> None:
    (container,) = find("Deployment", f"liver-{service}")["spec"]["template"]["spec"]["containers"]
    replicas = b.replicas_from(env_of(container))
    assert replicas == find("StatefulSet", "liver-nats")["spec"]["replicas"] == 3


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_accepts_the_settings_its_manifest_gives_it(service: str) -> None:
    (container,) = find("Deployment", f"liver-{service}")["spec"]["template"]["spec"]["containers"]
    env = {k: v if isinstance(v, str) else f"from-{k.lower()}" for k, v in env_of(container).items()}
    created = serve_cmd.find(service).create_service(env)
    assert created.name == service


# -- NATS ---------------------------------------------------------------------------------------------


def test_nats_runs_three_servers_with_a_volume_each() -> None:
    nats = find("StatefulSet", "liver-nats")
    assert nats["spec"]["replicas"] == 3
    (claim,) = nats["spec"]["volumeClaimTemplates"]
    (container,) = nats["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == container["args"][container["args"].index("--store_dir") + 1]


@pytest.mark.slow
def test_each_pods_cluster_config_with_the_projects_auth_config_is_valid_for_nats_server(
    tmp_path: Path,
) -> None:
    config = find("ConfigMap", "liver-nats-cluster")["data"]["cluster.conf"]
    # The certificates cert-manager keeps in liver-nats-tls and liver-nats-routes-tls, as the pod sees
    # them (make-tls.sh's here).
    tls = make_tls(tmp_path / "made")
    for folder in ("tls", "routes"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "tls.crt").write_bytes((tls / "server.crt").read_bytes())
        (tmp_path / folder / "tls.key").write_bytes((tls / "server.key").read_bytes())
    (tmp_path / "routes" / "ca.crt").write_bytes((tls / "ca.crt").read_bytes())
    assert "/etc/nats/tls/tls.crt" in config and "/etc/nats/tls/tls.key" in config
    config = config.replace("/etc/nats/tls/", f"{tmp_path}/tls/").replace(
        "/etc/nats/routes/", f"{tmp_path}/routes/"
    )
    (tmp_path / "cluster.conf").write_text(config)
    (tmp_path / "nats.conf").write_text((INFRA / "nats.conf").read_text())  # the liver-nats-auth Secret
    roles = (*SERVICES, "worker", "publisher", "subscriber", "operator")
    env = {f"LIVER_NATS_PASSWORD_{r.upper()}": f"p{r}" for r in roles} | {
        "SERVER_NAME": "liver-nats-1",
        "LIVER_NATS_ROUTE_PASSWORD": "proute",
    }
    # The pod's arguments, with the route password put in as the kubelet does ($(VAR) from the env).
    (container,) = find("StatefulSet", "liver-nats")["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(LIVER_NATS_ROUTE_PASSWORD)", "proute") for a in container["args"]]
    args = [str(tmp_path / "cluster.conf") if a == "/etc/nats/cluster.conf" else a for a in args]
    args = [str(tmp_path / "data") if a == "/data" else a for a in args]
    result = subprocess.run(
        [str(find_binary()), *args, "-t"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    routes = args[args.index("--routes") + 1].split(",")
    assert routes == [
        f"nats://route:proute@liver-nats-{i}.liver-nats-cluster.liver.svc:6222" for i in range(3)
    ]


# -- TLS ----------------------------------------------------------------------------------------------


def test_the_servers_certificate_comes_from_a_ca_issuer_whose_ca_cert_manager_makes() -> None:
    issuers, certificates = cert_manager("Issuer"), cert_manager("Certificate")
    for certificate in certificates.values():
        spec = certificate["spec"]
        assert spec["secretName"] and spec["issuerRef"]["kind"] == "Issuer"
        assert spec["issuerRef"]["name"] in issuers, "every certificate's issuer is defined here"
    for issuer in issuers.values():
        assert len(issuer["spec"]) == 1, "an Issuer is of exactly one type"
    ca = certificates["liver-ca"]["spec"]
    assert ca["isCA"] is True and "selfSigned" in issuers[ca["issuerRef"]["name"]]["spec"]
    server = certificates["liver-nats-server"]["spec"]
    assert issuers[server["issuerRef"]["name"]]["spec"] == {"ca": {"secretName": ca["secretName"]}}
    assert "server auth" in server["usages"]


def _client_containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    out = []
    for doc in kubernetes_documents():
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        for container in (pod or {}).get("containers", []):
            if "NATS_URL" in env_of(container):
                out.append((pod, container))
    return out


def test_the_servers_serve_tls_with_the_certificate_cert_manager_keeps() -> None:
    secret = cert_manager("Certificate")["liver-nats-server"]["spec"]["secretName"]
    config = find("ConfigMap", "liver-nats-cluster")["data"]["cluster.conf"]
    pod = find("StatefulSet", "liver-nats")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    (source,) = [
        src["secret"] for src in volume["projected"]["sources"] if src.get("secret", {}).get("name") == secret
    ]
    for item in source["items"]:
        assert f"{mount['mountPath']}/{item['path']}" in config, f"cluster.conf reads {item['key']}"
    assert {item["key"] for item in source["items"]} == {"tls.crt", "tls.key"}


def test_every_nats_client_speaks_tls_to_a_name_in_the_certificate_and_trusts_only_its_ca() -> None:
    certificate = cert_manager("Certificate")["liver-nats-server"]["spec"]
    clients = _client_containers()
    assert len(clients) == len(SERVICES) + 2, "the services, the notice agent and the example job"
    for pod, container in clients:
        env = env_of(container)
        url = env["NATS_URL"]
        assert url.startswith("tls://"), container["name"]
        assert url.removeprefix("tls://").rsplit(":", 1)[0] in certificate["dnsNames"]
        ca = Path(env["NATS_TLS_CA"])
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(ca.parent)]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == certificate["secretName"]
        assert volume["secret"]["items"] == [{"key": "ca.crt", "path": ca.name}], "never the server's key"


# -- the notice agent and the example job ---------------------------------------------------------------


def test_the_notice_agent_reads_only_nodes_and_runs_a_valid_command() -> None:
    (rule,) = find("ClusterRole", "liver-notice")["rules"]
    assert (rule["resources"], sorted(rule["verbs"])) == (["nodes"], ["get", "list", "watch"])
    spec = find("DaemonSet", "liver-notice")["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "liver-notice"
    (container,) = spec["containers"]
    env = env_of(container)
    assert env["LIVER_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NATS_USER"] == "publisher"
    assert container["args"][:2] == ["liver", "notice"]
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    notice_cmd.add_parser(sub)
    args = parser.parse_args(container["args"][1:])
    assert args.source == "kubernetes"
    assert notice_cmd.identity(args, {"LIVER_JOB_ID": env["LIVER_JOB_ID"], "LIVER_NODE": "node-a"})


def test_each_worker_of_the_example_job_gets_its_own_rank_of_one_world() -> None:
    job = find("StatefulSet", "liver-train")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (script,) = container["args"]
    ranks = []
    for ordinal in range(job["spec"]["replicas"]):
        pod = f"liver-train-{ordinal}"
        words = shlex.split(script.replace("$POD_NAME", pod))
        assert words[:3] == ["exec", "liver-entrypoint", "worker"]
        parser = argparse.ArgumentParser()
        worker_cmd.add_arguments(parser)
        settings = worker_cmd.settings_from(parser.parse_args(words[3:]))
        assert settings.initial is not None
        ranks.append(settings.initial.placement.rank_on()[settings.device_id])
    assert ranks == list(range(job["spec"]["replicas"]))


def test_the_example_job_runs_a_users_own_job_on_the_corpus_its_init_container_writes() -> None:
    import inspect

    from liver.worker_runtime.megatron.source import load_callable

    job = find("StatefulSet", "liver-train")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    words = shlex.split(container["args"][0].replace("$POD_NAME", "liver-train-0"))
    parser = argparse.ArgumentParser()
    worker_cmd.add_arguments(parser)
    settings = worker_cmd.settings_from(parser.parse_args(words[3:]))
    assert settings.job_factory == "/opt/liver/examples/your_own_job.py:make_job"
    (init,) = pod["initContainers"]
    written = init["args"][init["args"].index("--output-prefix") + 1]
    assert settings.job_args == {"data": written}
    image_root = REPO  # /opt/liver in the image (infra/Dockerfile)
    local = settings.job_factory.replace("/opt/liver", str(image_root))
    make_job = load_callable(local, "--job-factory")
    inspect.signature(make_job).bind(**settings.job_args)
