"""infra/nats.conf, and the passwords infra/make-env.sh makes for it: accepted by nats-server, one user per
role, no password in the file, and no name that LiveR does not use."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest
from infra_helpers import (
    INFRA,
    MAKE_ENV,
    NATS_CONF,
    ROLES,
    SERVICES,
    load_compose,
    make_env,
    password_var,
    without_nats_settings,
)

from liver.services.host import micro_name, status_subject
from liver.shared import subjects as s
from liver.shared.nats_server import find_binary


def check_config(args: list[str], variables: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """``nats-server ARGS -t``: parse the config and flags, start nothing."""
    env = without_nats_settings(os.environ)
    env.update(variables)
    return subprocess.run(
        [str(find_binary()), *args, "-t"], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def passwords(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_env(tmp_path_factory.mktemp("env") / ".env")


def quoted_subjects() -> list[str]:
    """Every subject the config's permission lists name."""
    return re.findall(r'"([^"\s]+)"', NATS_CONF.read_text())


_STREAM_TOKEN = {
    "$JS.API.STREAM.MSG.GET.": 5,
    "$JS.API.STREAM.NAMES": None,  # a listing, not a stream
    "$JS.API.STREAM.": 4,
    "$JS.API.CONSUMER.DURABLE.CREATE.": 5,
    "$JS.API.CONSUMER.MSG.NEXT.": 5,
    "$JS.API.CONSUMER.": 4,
    "$JS.API.DIRECT.GET.": 4,
    "$JS.ACK.": 2,
    "$JS.FC.": 2,
    "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.": 5,
}
"""Where the stream's name sits in a JetStream subject, by prefix (the longest matching prefix wins)."""


def stream_named(subject: str) -> str | None:
    """The stream a JetStream API, ack or advisory subject is about (``KV_``/``OBJ_`` for buckets)."""
    if subject.startswith("$KV."):
        return f"KV_{subject.split('.')[1]}"
    if subject.startswith("$O."):
        return f"OBJ_{subject.split('.')[1]}"
    for prefix in sorted(_STREAM_TOKEN, key=len, reverse=True):
        if subject.startswith(prefix):
            position = _STREAM_TOKEN[prefix]
            return None if position is None else subject.split(".")[position]
    return None


# -- the server accepts it ----------------------------------------------------------------------------


@pytest.mark.slow
def test_nats_server_accepts_the_config_with_the_passwords_make_env_writes(passwords: dict[str, str]) -> None:
    result = check_config(["-c", str(NATS_CONF)], passwords)
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stderr + result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("role", ROLES)
def test_nats_server_refuses_to_start_without_a_users_password(passwords: dict[str, str], role: str) -> None:
    missing = {k: v for k, v in passwords.items() if k != password_var(role)}
    result = check_config(["-c", str(NATS_CONF)], missing)
    assert result.returncode != 0
    assert password_var(role) in result.stderr


@pytest.mark.slow
def test_the_server_command_of_compose_is_accepted_with_the_mounted_config(passwords: dict[str, str]) -> None:
    nats = load_compose()["services"]["nats"]
    mounts = {}
    for volume in nats["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = str(INFRA / source)
    args = [mounts.get(arg, arg) for arg in nats["command"]]
    assert str(NATS_CONF) in args, "compose mounts infra/nats.conf where the command reads its config"
    result = check_config(args, passwords)
    assert result.returncode == 0, result.stderr


# -- what it says -------------------------------------------------------------------------------------


def test_there_is_one_user_per_role_and_each_password_comes_from_its_variable() -> None:
    text = NATS_CONF.read_text()
    users = re.findall(r"^\s*user:\s*(\S+)\s*$", text, flags=re.MULTILINE)
    assert sorted(users) == sorted(ROLES)
    passwords = re.findall(r"^\s*password:\s*(\S+)\s*$", text, flags=re.MULTILINE)
    assert passwords == [f"${password_var(user)}" for user in users]


def test_every_stream_bucket_and_store_the_config_names_is_one_liver_uses() -> None:
    known = {spec.name for spec in s.STREAMS}
    known |= {
        f"KV_{bucket}" for bucket in (s.KV_GENERATIONS, s.KV_MEMBERSHIP, s.KV_EVENTS_SEEN, s.KV_PLAN_SLICES)
    }
    known.add(f"OBJ_{s.OBJECT_STORE_PLANS}")
    named = {name for name in map(stream_named, quoted_subjects()) if name is not None}
    assert named, "the config names no stream at all"
    assert named <= known, f"names LiveR does not use: {sorted(named - known)}"


def test_every_application_subject_the_config_names_is_one_liver_uses() -> None:
    known = {
        *s.PUBLIC_SUBJECTS,
        s.RESIZE_REQUESTED_ANY,
        s.TOPOLOGY_REQUEST_ANY,
        s.TOPOLOGY_PLANNED_ANY,
        s.TRANSFER_PLANNED_ANY,
        s.PLANNING_FAILED_ANY,
        s.WORLD_STARTED_ANY,
        s.WORKER_HELLO_ANY,
        s.WORKER_HEARTBEAT_ANY,
        s.WORKER_STATUS_ANY,
        f"{s.PREFIX}.worker.cmd.>",
        f"{s.PREFIX}.worker.probe.>",
        *(s.errors(source) for source in (*SERVICES, "worker")),
        *(s.dead_letters(service) for service in SERVICES),
        *(status_subject(service) for service in SERVICES),
        *(f"$SRV.PING.{micro_name(service)}" for service in SERVICES),
        *(f"$SRV.*.{micro_name(service)}" for service in SERVICES),
        *(f"$SRV.*.{micro_name(service)}.*" for service in SERVICES),
        "$SRV.*",
        "$SRV.PING",  # the operator's discovery of every service (liver status)
        s.ERRORS_ANY,  # the operator's watch of every service's rejected input (liver watch --errors)
        "_INBOX.>",
        ">",
    }
    assert s.worker_command("j", "w").startswith(f"{s.PREFIX}.worker.cmd.")
    assert s.worker_probe("j", "w").startswith(f"{s.PREFIX}.worker.probe.")
    application = [x for x in quoted_subjects() if not x.startswith(("$JS.", "$KV.", "$O."))]
    assert sorted(set(application) - known) == []


# -- the passwords ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_make_env_writes_a_distinct_password_for_every_role_readable_by_the_owner_only(
    tmp_path: Path,
) -> None:
    written = make_env(tmp_path / ".env")
    # Every user's, and the route password of the Kubernetes NATS cluster (test_infra_cluster.py).
    assert sorted(written) == sorted([*(password_var(role) for role in ROLES), "LIVER_NATS_ROUTE_PASSWORD"])
    assert len(set(written.values())) == len(written)
    for value in written.values():
        assert re.fullmatch(r"p[0-9a-f]{48}", value), "a letter first, so nats-server reads a string"
    assert stat.S_IMODE((tmp_path / ".env").stat().st_mode) == 0o600


@pytest.mark.slow
def test_make_env_never_overwrites_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / ".env"
    target.write_text("LIVER_NATS_PASSWORD_WORKER=pkeepme\n")
    result = subprocess.run(["sh", str(MAKE_ENV), str(target)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "exists" in result.stderr
    assert target.read_text() == "LIVER_NATS_PASSWORD_WORKER=pkeepme\n"


def test_compose_hands_the_server_every_password_and_nothing_else() -> None:
    environment = load_compose()["services"]["nats"]["environment"]
    assert sorted(environment) == sorted(password_var(role) for role in ROLES)
    for name, value in environment.items():
        assert value.startswith(f"${{{name}:?"), f"{name}: compose must refuse to start without it"


def test_the_generated_env_file_is_kept_out_of_git() -> None:
    assert ".env" in (INFRA / ".gitignore").read_text().split()
