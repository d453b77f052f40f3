"""TLS on client connections: the server compose.yaml runs refuses plaintext clients and clients that do
not trust its CA, and every LiveR process verifies the server from ``$NATS_TLS_*`` (the end-to-end flow
over TLS is tests/infra/test_infra_deployment.py's)."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from infra_helpers import (
    REPO,
    client_tls,
    connected,
    make_env,
    make_tls,
    password_var,
    secured_server,
    without_nats_settings,
)

from liver.shared.connection import (
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_HOSTNAME_ENV,
    TLS_KEY_ENV,
    ConnectionConfigError,
    connect_options,
)
from liver.shared.nats_server import NatsServer

CLOSE_WAIT_S = 30.0


class Rig:
    def __init__(self, server: NatsServer, tls_dir: Path, passwords: dict[str, str]) -> None:
        self.server, self.tls_dir, self.passwords = server, tls_dir, passwords

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.url.removeprefix("tls://").rsplit(":", 1)
        return host, int(port)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    root = tmp_path_factory.mktemp("tls")
    passwords = make_env(root / ".env")
    tls_dir = make_tls(root / "tls")
    with secured_server(passwords, log_file=root / "nats-server.log", tls_dir=tls_dir) as server:
        yield Rig(server, tls_dir, passwords)


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tls(tmp_path_factory.mktemp("certs") / "tls")


@pytest.mark.slow
def test_a_plaintext_client_is_refused(rig: Rig) -> None:
    with socket.create_connection(rig.address, timeout=CLOSE_WAIT_S) as plain:
        info = plain.recv(65536)
        assert info.startswith(b"INFO ")
        assert json.loads(info[5:].split(b"\r\n")[0])["tls_required"] is True
        user = "subscriber"
        connect = {"verbose": False, "user": user, "pass": rig.passwords[password_var(user)]}
        plain.sendall(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        received = b""
        deadline = time.monotonic() + CLOSE_WAIT_S
        while time.monotonic() < deadline:
            chunk = plain.recv(65536)
            if not chunk:
                break  # the server closed the connection
            received += chunk
        else:
            pytest.fail(f"the server kept a plaintext connection open for {CLOSE_WAIT_S} s")
    assert b"PONG" not in received, "a plaintext client was served"


@pytest.mark.slow
async def test_a_client_that_trusts_the_local_ca_is_served(rig: Rig) -> None:
    user = "subscriber"
    password = rig.passwords[password_var(user)]
    async with connected(rig.server.url, user, password, client_tls(rig.tls_dir)) as (nc, errors):
        await nc.flush(timeout=CLOSE_WAIT_S)
        assert nc.is_connected and not errors


@pytest.mark.slow
async def test_a_client_that_does_not_trust_the_ca_is_refused(rig: Rig) -> None:
    user = "subscriber"
    password = rig.passwords[password_var(user)]
    with pytest.raises(ssl.SSLCertVerificationError):
        async with connected(rig.server.url, user, password, ssl.create_default_context()):
            pass


@pytest.mark.slow
async def test_a_liver_process_verifies_the_server_with_the_ca_in_its_environment(rig: Rig) -> None:
    user = "subscriber"
    env = {
        "NATS_USER": user,
        "NATS_PASSWORD": rig.passwords[password_var(user)],
        TLS_CA_ENV: str(rig.tls_dir / "ca.crt"),
    }
    options = connect_options(rig.server.url, env, name="liver-test")
    options.update(allow_reconnect=False, max_reconnect_attempts=1, connect_timeout=CLOSE_WAIT_S)
    nc = await nats.connect(**options)
    try:
        await nc.flush(timeout=CLOSE_WAIT_S)
    finally:
        await nc.close()


@pytest.mark.slow
def test_a_liver_command_over_tls_prints_what_it_found_and_nothing_else(rig: Rig) -> None:
    """nats-py's TLS upgrade made asyncio warn "returning true from eof_received() has no effect when
    using ssl" on stderr at every command's end (see liver/cli/bus_access.py)."""
    user = "operator"
    env = without_nats_settings(os.environ) | {
        "NATS_URL": rig.server.url,
        "NATS_USER": user,
        "NATS_PASSWORD": rig.passwords[password_var(user)],
        TLS_CA_ENV: str(rig.tls_dir / "ca.crt"),
        "PYTHONPATH": str(REPO),
    }
    result = subprocess.run(
        [sys.executable, "-m", "liver.cli.main", "status", "--wait", "0.5"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.startswith("services: none answered\n")


# -- the settings (no server) ---------------------------------------------------------------------------


def test_without_tls_settings_a_nats_url_gets_no_context() -> None:
    assert "tls" not in connect_options("nats://127.0.0.1:4222", {}, name="x")


def test_a_tls_url_without_a_ca_verifies_against_the_system_trust_store() -> None:
    context = connect_options("tls://nats.example:4222", {}, name="x")["tls"]
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname


@pytest.mark.slow
def test_the_ca_in_the_environment_is_the_one_trusted(tls_dir: Path) -> None:
    env = {TLS_CA_ENV: str(tls_dir / "ca.crt"), TLS_HOSTNAME_ENV: "nats"}
    options = connect_options("nats://127.0.0.1:4222", env, name="x")
    trusted = options["tls"].get_ca_certs()
    names = [dict(item[0] for item in ca["subject"]).get("commonName") for ca in trusted]
    assert "LiveR local CA" in names
    assert options["tls_hostname"] == "nats"


@pytest.mark.slow
def test_a_client_certificate_and_its_key_are_loaded_together(tls_dir: Path) -> None:
    env = {TLS_CERT_ENV: str(tls_dir / "server.crt"), TLS_KEY_ENV: str(tls_dir / "server.key")}
    assert isinstance(connect_options("nats://h:4222", env, name="x")["tls"], ssl.SSLContext)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({TLS_CERT_ENV: "/x.crt"}, TLS_KEY_ENV),
        ({TLS_KEY_ENV: "/x.key"}, TLS_CERT_ENV),
        ({TLS_CA_ENV: "/nowhere/ca.crt"}, TLS_CA_ENV),
    ],
)
def test_bad_tls_settings_are_refused_naming_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConnectionConfigError, match=f"^{named}: "):
        connect_options("nats://h:4222", env, name="x")


def test_a_ca_file_that_holds_no_certificate_is_refused_naming_it(tmp_path: Path) -> None:
    bogus = tmp_path / "ca.crt"
    bogus.write_text("not a certificate\n")
    with pytest.raises(ConnectionConfigError, match=f"^{TLS_CA_ENV}: .*no usable CA certificate"):
        connect_options("nats://h:4222", {TLS_CA_ENV: str(bogus)}, name="x")


@pytest.mark.slow
def test_a_certificate_with_a_key_that_is_not_its_own_is_refused(tls_dir: Path) -> None:
    env = {TLS_CERT_ENV: str(tls_dir / "server.crt"), TLS_KEY_ENV: str(tls_dir / "ca.key")}
    with pytest.raises(ConnectionConfigError, match=f"^{TLS_CERT_ENV}: .*not a certificate and its key"):
        connect_options("nats://h:4222", env, name="x")


@pytest.mark.slow
def test_make_tls_never_overwrites_a_ca(tls_dir: Path) -> None:
    before = (tls_dir / "ca.crt").read_bytes()
    with pytest.raises(Exception, match="returned non-zero exit status 1"):
        make_tls(tls_dir)
    assert (tls_dir / "ca.crt").read_bytes() == before
