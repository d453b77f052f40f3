"""infra/compose.yaml, read with a plain YAML-subset reader (PyYAML is not a dependency): the services it
runs, the users and settings it gives them, and that those settings are ones LiveR accepts."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from infra_helpers import (
    COMPOSE,
    INFRA,
    REPO,
    SERVICES,
    YamlSubsetError,
    load_compose,
    parse_yaml,
    password_var,
    service_command,
    service_environment,
)

from liver.cli import serve_cmd, workers_cmd
from liver.shared.nats_server import find_binary

VARIABLES = {
    password_var(role): f"p{role}" for role in (*SERVICES, "worker", "publisher", "subscriber", "operator")
}
"""What infra/make-env.sh would put in infra/.env (values do not matter here)."""


def services() -> dict[str, Any]:
    return load_compose()["services"]


# -- the reader itself --------------------------------------------------------------------------------


def test_the_reader_parses_mappings_sequences_and_flow_values() -> None:
    text = 'a:\n  b: 1\n  c: ["x", "y"]  # note\n  d:\n    - plain\n    - "quoted: yes"\n  e: {}\nf: true\n'
    assert parse_yaml(text) == {
        "a": {"b": 1, "c": ["x", "y"], "d": ["plain", "quoted: yes"], "e": {}},
        "f": True,
    }


@pytest.mark.parametrize(
    "text", ["a: &anchor 1\n", "a: 'single'\n", "a:\n  b: 1\n c: 2\n", "a: 1\na: 2\n"], ids=str.strip
)
def test_the_reader_refuses_yaml_it_does_not_handle(text: str) -> None:
    with pytest.raises(YamlSubsetError):
        parse_yaml(text)


# -- the server ---------------------------------------------------------------------------------------


def test_compose_runs_nats_and_the_four_services() -> None:
    assert {"nats", *SERVICES} <= set(services())


def test_jetstream_is_kept_on_a_named_volume() -> None:
    nats = services()["nats"]
    command = nats["command"]
    store = command[command.index("--store_dir") + 1]
    volume = next(v for v in nats["volumes"] if v.split(":")[1] == store)
    assert volume.split(":")[0] in load_compose()["volumes"]


@pytest.mark.slow
def test_compose_runs_the_nats_server_version_the_tests_run() -> None:
    tested = subprocess.run([str(find_binary()), "--version"], capture_output=True, text=True, timeout=120)
    (version,) = re.findall(r"v(\d+\.\d+\.\d+)", tested.stdout + tested.stderr)
    assert services()["nats"]["image"] == f"nats:{version}-alpine"


def test_the_server_is_healthy_only_when_its_health_endpoint_says_so() -> None:
    test = services()["nats"]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[-1].endswith(":8222/healthz")
    assert "http_port: 8222" in (INFRA / "nats.conf").read_text()


# -- the services -------------------------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_runs_its_own_command_as_its_own_nats_user(service: str) -> None:
    spec = services()[service]
    assert spec["command"] == [service] and service in serve_cmd.SERVICES
    env = spec["environment"]
    assert (env["NATS_URL"], env["NATS_USER"]) == ("tls://nats:4222", service)
    assert env["NATS_PASSWORD"].startswith(f"${{{password_var(service)}:?")
    assert spec["depends_on"] == {"nats": {"condition": "service_healthy"}}
    assert spec["healthcheck"]["test"] == ["CMD", "liver-entrypoint", "health", service]
    assert spec["init"] is True, "an init reaps children and forwards SIGTERM"


@pytest.mark.slow
def test_the_server_speaks_tls_with_the_certificate_make_tls_writes(tmp_path: Path) -> None:
    spec = services()["nats"]
    command = spec["command"]
    assert "--tls" in command, "TLS on client connections"
    cert, key = command[command.index("--tlscert") + 1], command[command.index("--tlskey") + 1]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in spec["volumes"]}
    subprocess.run(["sh", str(INFRA / "make-tls.sh"), str(tmp_path / "tls")], check=True, capture_output=True)
    for inside in (cert, key):
        outside = mounts[inside]
        assert outside.startswith("./tls/"), f"{inside} comes from the folder make-tls.sh fills"
        assert (tmp_path / outside).is_file()


@pytest.mark.parametrize("service", [*SERVICES, "simulate"])
def test_each_liver_client_verifies_the_server_against_the_local_ca(service: str) -> None:
    spec = services()[service]
    env = spec["environment"]
    assert env["NATS_URL"].startswith("tls://")
    assert f"./tls/ca.crt:{env['NATS_TLS_CA']}:ro" in spec["volumes"]


@pytest.mark.parametrize("service", [*SERVICES, "simulate"])
def test_each_liver_container_is_built_from_the_one_image(service: str) -> None:
    build = services()[service]["build"]
    assert (COMPOSE.parent / build["context"]).resolve() == REPO
    assert (REPO / build["dockerfile"]).is_file()
    assert services()[service]["image"] == services()["ingester"]["image"]


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_accepts_the_settings_compose_gives_it(service: str) -> None:
    env = service_environment(service, VARIABLES)
    created = serve_cmd.find(service).create_service(env)
    assert created.name == service


def test_the_demo_job_is_a_valid_simulation_of_the_coordinators_job() -> None:
    spec = services()["simulate"]
    assert spec["profiles"] == ["demo"], "the stand-in job starts only when asked for"
    command = service_command("simulate", VARIABLES)
    assert command[0] == "simulate"
    parser = argparse.ArgumentParser()
    workers_cmd.add_arguments(parser)
    settings = workers_cmd.settings_from(parser.parse_args(command[1:]))
    assert settings.job_id == service_environment("coordinator", VARIABLES)["LIVER_JOB_ID"]
    assert settings.layout is not None and settings.layout.world_size == settings.workers
    assert service_environment("simulate", VARIABLES)["NATS_USER"] == "worker"


def test_compose_refuses_to_start_without_the_passwords() -> None:
    for service in ("nats", *SERVICES, "simulate"):
        with pytest.raises(KeyError, match=re.escape("run infra/make-env.sh")):
            service_environment(service, {})


def test_every_variable_compose_reads_is_documented() -> None:
    names = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", COMPOSE.read_text()))
    readme = (INFRA / "README.md").read_text()
    assert names and sorted(n for n in names if n not in readme) == []
