"""The image: infra/Dockerfile (read, since Docker cannot run here), and the entrypoint and health check it
installs (run as they are)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from infra_helpers import DOCKERFILE, ENTRYPOINT, INFRA, MAKE_ENV, REPO, SERVICES, without_nats_settings

from liver.shared.nats_server import URL_ENV, NatsServer

HEALTHCHECK = INFRA / "healthcheck.py"
PROCESS_S = 180
"""Upper bound on one of these commands (most start an interpreter that imports LiveR): seconds on a busy
machine, and a bound costs nothing when the command ends first."""


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends in a continuation line"
    return out


def of(keyword: str) -> list[str]:
    return [args for k, args in instructions() if k == keyword]


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY, flags dropped."""
    out = []
    for args in of("COPY"):
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        out.append((words[:-1], words[-1]))
    return out


def destination_of(source: str) -> str:
    (dest,) = [d for sources, d in copies() if source in sources]
    return dest


def run_entrypoint(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = without_nats_settings(os.environ)
    environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
    environ["LIVER_PYTHON"] = sys.executable
    environ.update(env or {})
    return subprocess.run(
        ["bash", str(ENTRYPOINT), *args], env=environ, capture_output=True, text=True, timeout=PROCESS_S
    )


# -- the Dockerfile -----------------------------------------------------------------------------------


def test_the_image_starts_from_the_official_python_3_11_slim_image() -> None:
    assert instructions()[0] == ("FROM", "python:3.11-slim")


def test_the_image_installs_the_torch_version_the_project_pins() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch==")]
    assert f"TORCH_VERSION={pin.removeprefix('torch==')}" in of("ARG")
    assert any('"torch==${TORCH_VERSION}"' in run for run in of("RUN"))


def test_the_project_is_pip_installed_after_its_sources_are_copied() -> None:
    steps = [(k, a) for k, a in instructions() if k in ("COPY", "RUN")]
    install = next(i for i, (k, a) in enumerate(steps) if k == "RUN" and "pip install ." in a)
    copied_before = {s for k, a in steps[:install] if k == "COPY" for s in shlex.split(a)[:-1]}
    assert {"pyproject.toml", "README.md", "liver"} <= copied_before


def test_everything_the_image_copies_exists_and_passes_the_dockerignore() -> None:
    ignore = (INFRA / "Dockerfile.dockerignore").read_text().split()
    for sources, _ in copies():
        for source in sources:
            assert (REPO / source).exists(), source
            assert f"!{source}" in ignore or f"!{source}/" in ignore, f"{source} is excluded from the context"


def test_the_entrypoint_is_the_copied_script_with_the_health_check_beside_it() -> None:
    (entrypoint,) = of("ENTRYPOINT")
    command = json.loads(entrypoint)
    assert len(command) == 1
    link = command[0]
    script = destination_of("infra/entrypoint.sh")
    assert any(f"ln -s {script} {link}" in run for run in of("RUN"))
    assert Path(destination_of("infra/healthcheck.py")).parent == Path(script).parent
    assert Path(link).parent == Path("/usr/local/bin"), "compose's health checks call it by name"


def image_user() -> tuple[int, int]:
    """The image's USER as (uid, gid): numbers, or Kubernetes cannot tell that it is not root."""
    (user,) = of("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit(), f"USER {user}: not a numeric uid:gid"
    return int(uid), int(gid)


def test_the_image_runs_as_an_unprivileged_numeric_user_and_group_it_creates() -> None:
    # runAsNonRoot refuses a named USER ("image has non-numeric user (liver), cannot verify user is
    # non-root"): every LiveR pod would stay in CreateContainerConfigError.
    uid, gid = image_user()
    assert uid != 0 and gid != 0
    runs = of("RUN")
    assert any(re.search(rf"groupadd\b.*--gid {gid}\b", run) for run in runs), "the group, with that gid"
    assert any(re.search(rf"useradd\b.*--uid {uid}\b.*--gid {gid}\b", run) for run in runs), "the user"


# -- the entrypoint -----------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [ENTRYPOINT, MAKE_ENV], ids=lambda p: p.name)
def test_the_scripts_are_executable(script: Path) -> None:
    assert os.access(script, os.X_OK)


@pytest.mark.slow
def test_help_lists_every_command() -> None:
    result = run_entrypoint("help")
    assert result.returncode == 0
    for command in (*SERVICES, "worker", "simulate", "run", "health", "liver"):
        assert command in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args", [(), ("nonsense",), ("run",)], ids=["nothing", "unknown", "run-alone"])
def test_a_missing_or_unknown_command_exits_2(args: tuple[str, ...]) -> None:
    result = run_entrypoint(*args)
    assert result.returncode == 2
    assert result.stderr


@pytest.mark.slow
def test_run_replaces_the_entrypoint_with_the_given_command() -> None:
    """exec: the command gets the container's signals (docker stop) directly."""
    proc = subprocess.Popen(
        ["bash", str(ENTRYPOINT), "run", "sh", "-c", "echo $$"], stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate(timeout=PROCESS_S)
    assert proc.returncode == 0
    assert int(out) == proc.pid


@pytest.mark.slow
def test_liver_passes_its_arguments_to_the_liver_command(tmp_path: Path) -> None:
    fake = tmp_path / "liver"
    fake.write_text('#!/bin/sh\necho "liver got: $*"\n')
    fake.chmod(0o755)
    result = run_entrypoint("liver", "plan", "--model", "tiny-gpt", env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "liver got: plan --model tiny-gpt"


@pytest.mark.slow
def test_a_service_command_reaches_liver_serve() -> None:
    result = run_entrypoint("ingester", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: liver serve" in result.stdout


@pytest.mark.slow
def test_worker_reaches_liver_worker() -> None:
    result = run_entrypoint("worker", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: liver worker " in result.stdout and "--placement" in result.stdout


@pytest.mark.slow
def test_simulate_reaches_liver_workers() -> None:
    result = run_entrypoint("simulate", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: liver workers" in result.stdout and "--simulate" in result.stdout


# -- the health check ---------------------------------------------------------------------------------


def run_healthcheck(*args: str, url: str | None) -> subprocess.CompletedProcess[str]:
    env = without_nats_settings(os.environ)
    if url is not None:
        env[URL_ENV] = url
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args], env=env, capture_output=True, text=True, timeout=PROCESS_S
    )


@pytest.mark.slow
def test_the_health_check_of_an_unknown_service_is_a_usage_error() -> None:
    result = run_healthcheck("nonsense", url="nats://127.0.0.1:4222")
    assert result.returncode == 2
    assert "usage: healthcheck.py {coordinator,ingester,topology,transfer}" in result.stderr


@pytest.mark.slow
def test_the_health_check_needs_the_server_url() -> None:
    result = run_healthcheck("ingester", url=None)
    assert result.returncode == 2
    assert URL_ENV in result.stderr


@pytest.mark.slow
def test_the_health_check_fails_when_no_service_answers(nats_server: NatsServer) -> None:
    result = run_healthcheck("coordinator", url=nats_server.url)
    assert result.returncode == 1
    assert "no liver-coordinator is answering discovery" in result.stderr


@pytest.mark.slow
def test_the_health_check_fails_when_the_server_is_unreachable() -> None:
    result = run_healthcheck("ingester", url="nats://127.0.0.1:1")
    assert result.returncode == 1
    assert "cannot connect to nats://127.0.0.1:1" in result.stderr
