"""Helpers for the infra/ tests: read compose.yaml without PyYAML, resolve its variables, and connect to a
server running infra/nats.conf as one of its users.

Docker cannot run on the development machines, so the tests read the deployment files and act them out:
the compose file's commands and environments drive ``infra/entrypoint.sh`` subprocesses against a
nats-server started with the same config.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import ssl
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import nats
import nats.errors
from nats.aio.client import Client

from liver.shared.nats_server import NatsServer

REPO: Final = Path(__file__).resolve().parent.parent
INFRA: Final = REPO / "infra"
NATS_CONF: Final = INFRA / "nats.conf"
COMPOSE: Final = INFRA / "compose.yaml"
DOCKERFILE: Final = INFRA / "Dockerfile"
ENTRYPOINT: Final = INFRA / "entrypoint.sh"
MAKE_ENV: Final = INFRA / "make-env.sh"
MAKE_TLS: Final = INFRA / "make-tls.sh"

SERVICES: Final = ("ingester", "topology", "transfer", "coordinator")
ROLES: Final = (*SERVICES, "worker", "publisher", "subscriber", "operator")
"""Every user of infra/nats.conf."""


def password_var(role: str) -> str:
    """The environment variable holding ``role``'s password, for the server and for compose."""
    return f"LIVER_NATS_PASSWORD_{role.upper()}"


# -- a plain YAML subset ------------------------------------------------------------------------------


class YamlSubsetError(ValueError):
    """compose.yaml uses YAML this reader does not handle; keep the file plain."""


def _scalar(text: str, where: int) -> Any:
    text = text.strip()
    if text.startswith(("[", "{", '"')):
        try:
            return json.loads(text)
        except ValueError:
            raise YamlSubsetError(f"line {where}: flow values must be JSON: {text}") from None
    if text.startswith(("'", "&", "*", "!", "|", ">")):
        raise YamlSubsetError(f"line {where}: unsupported YAML: {text}")
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return text


def _strip_comment(line: str) -> str:
    in_quotes = False
    for i, ch in enumerate(line):
        if ch == '"':
            in_quotes = not in_quotes
        elif ch == "#" and not in_quotes and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def parse_yaml(text: str) -> dict[str, Any]:
    """Block mappings and sequences of scalars, JSON-style flow values, plain and double-quoted scalars."""
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise YamlSubsetError(f"line {number}: tabs in indentation")
        line = _strip_comment(raw)
        if line.strip():
            lines.append((number, len(line) - len(line.lstrip()), line.strip()))

    def block(i: int, indent: int) -> tuple[Any, int]:
        if lines[i][2].startswith("- "):
            items: list[Any] = []
            while i < len(lines) and lines[i][1] == indent and lines[i][2].startswith("- "):
                items.append(_scalar(lines[i][2][2:], lines[i][0]))
                i += 1
            return items, i
        mapping: dict[str, Any] = {}
        while i < len(lines) and lines[i][1] == indent:
            number, _, content = lines[i]
            key, sep, rest = content.partition(":")
            if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", key):
                raise YamlSubsetError(f"line {number}: expected `key: value`, got {content!r}")
            if key in mapping:
                raise YamlSubsetError(f"line {number}: duplicate key {key!r}")
            i += 1
            if rest.strip():
                mapping[key] = _scalar(rest, number)
            elif i < len(lines) and lines[i][1] > indent:
                mapping[key], i = block(i, lines[i][1])
            else:
                mapping[key] = None
        if i < len(lines) and lines[i][1] > indent:
            raise YamlSubsetError(f"line {lines[i][0]}: unexpected indentation")
        return mapping, i

    if not lines:
        return {}
    out, end = block(0, lines[0][1])
    if end != len(lines) or not isinstance(out, dict):
        raise YamlSubsetError(f"line {lines[min(end, len(lines) - 1)][0]}: not a mapping at the top level")
    return out


def load_compose() -> dict[str, Any]:
    return parse_yaml(COMPOSE.read_text())


# -- compose variables --------------------------------------------------------------------------------

_VARIABLE: Final = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_]\w*)")


class MissingVariable(KeyError):
    """A ``${VAR:?message}`` whose variable is not set: compose refuses to start."""


def interpolate(value: Any, variables: Mapping[str, str]) -> Any:
    """``value`` with compose's ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
    ``${VAR:?error}`` and ``$$`` substituted from ``variables`` (lists and mappings element-wise)."""
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3) or ""
        present = name in variables
        current = variables.get(name, "")
        empty_counts = op is not None and op.startswith(":")
        missing = not present or (empty_counts and current == "")
        if op is not None and op.endswith("?") and missing:
            raise MissingVariable(f"{name}: {arg}")
        if op is not None and op.endswith("-") and missing:
            return arg
        return current

    return _VARIABLE.sub(one, value)


def service_environment(service: str, variables: Mapping[str, str]) -> dict[str, str]:
    """The environment compose gives ``service``'s container, resolved against ``variables``."""
    spec = load_compose()["services"][service]
    return {k: str(v) for k, v in interpolate(spec.get("environment") or {}, variables).items()}


def service_command(service: str, variables: Mapping[str, str]) -> list[str]:
    return [str(part) for part in interpolate(load_compose()["services"][service]["command"], variables)]


# -- passwords and the server -------------------------------------------------------------------------


def make_env(path: Path) -> dict[str, str]:
    """Run infra/make-env.sh into ``path`` and return the variables it wrote."""
    subprocess.run(["sh", str(MAKE_ENV), str(path)], check=True, capture_output=True, timeout=120)
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def without_nats_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less anything that would give a child process other credentials or another server."""
    return {
        k: v
        for k, v in environ.items()
        if not k.startswith(("NATS_", "LIVER_NATS_PASSWORD_")) and k != "LIVER_NATS_SERVER"
    }


def make_tls(folder: Path) -> Path:
    """Run infra/make-tls.sh into ``folder`` (the CA and the server's certificate) and return it."""
    subprocess.run(["sh", str(MAKE_TLS), str(folder)], check=True, capture_output=True, timeout=120)
    return folder


def compose_tls_args(tls_dir: Path) -> tuple[str, ...]:
    """The TLS flags compose.yaml gives the nats server, with the files it mounts from ``infra/tls``
    taken from ``tls_dir`` instead."""
    spec = load_compose()["services"]["nats"]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in spec["volumes"]}
    command = [str(part) for part in spec["command"]]
    flags = command[command.index("--tls") :]
    return tuple(tls_dir / Path(mounts[f]).relative_to("tls") if f in mounts else f for f in map(str, flags))


def client_tls(tls_dir: Path) -> ssl.SSLContext:
    """A client context that trusts the CA make-tls.sh made in ``tls_dir``."""
    return ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))


@contextlib.contextmanager
def secured_server(
    passwords: Mapping[str, str], log_file: Path | None = None, tls_dir: Path | None = None
) -> Iterator[NatsServer]:
    """A nats-server started with infra/nats.conf and ``passwords`` in its environment; with
    ``tls_dir``, also with compose's TLS flags and the certificate make-tls.sh wrote there."""
    saved = dict(os.environ)
    os.environ.update(passwords)
    extra = tuple(map(str, compose_tls_args(tls_dir))) if tls_dir is not None else ()
    try:
        server = NatsServer(
            config_file=NATS_CONF, log_file=log_file, startup_timeout_s=60.0, extra_args=extra
        ).start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield server
    finally:
        server.stop()


def stream_messages(server: NatsServer) -> dict[str, int]:
    """Messages stored per stream, from the monitoring endpoint (which needs no NATS user)."""
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"{server.monitor_url}/jsz?streams=true", timeout=30
    ) as response:
        data = json.load(response)
    out: dict[str, int] = {}
    for account in data.get("account_details") or ():
        for stream in account.get("stream_detail") or ():
            out[stream["name"]] = stream["state"]["messages"]
    return out


def violations(log_file: Path) -> list[str]:
    """The server's log lines that report a refused publish or subscription."""
    return [line for line in log_file.read_text().splitlines() if "Violation" in line]


# -- clients ------------------------------------------------------------------------------------------


class Errors(list[str]):
    """What the server reported to a client asynchronously (lower-cased, as nats-py words them)."""

    def about(self, subject: str) -> list[str]:
        return [e for e in self if "permissions violation" in e and subject.lower() in e]


@contextlib.asynccontextmanager
async def connected(
    url: str, user: str | None, password: str | None, tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[Client, Errors]]:
    """A client logged in as ``user`` (anonymous when ``None``) whose asynchronous errors are collected;
    ``tls`` for a server that requires TLS."""
    errors = Errors()

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    # A positive max_reconnect_attempts: with 0, nats-py retries an unreachable server for ever. Without
    # reconnects, the first attempt must succeed: give it the time a busy machine needs.
    options: dict[str, Any] = {"allow_reconnect": False, "max_reconnect_attempts": 1, "connect_timeout": 30}
    if user is not None:
        options.update(user=user, password=password)
    if tls is not None:
        options["tls"] = tls
    nc = await nats.connect(url, error_cb=on_error, **options)
    try:
        yield nc, errors
    finally:
        if not nc.is_closed:
            await nc.close()
