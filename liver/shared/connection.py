"""How any LiveR process connects to NATS: servers from ``$NATS_URL``, credentials from the environment.

It lives in ``shared`` because both sides of the bus connect the same way (a service process and the
worker companion inside a training process) while ``services`` and ``worker_runtime`` may not import
each other. One way of authenticating at a time: user and password together, a token, or a creds file.

TLS: a server that requires it is always spoken to over TLS (nats-py upgrades the connection when the
server's INFO says so, and a ``tls://`` URL asks for it). ``$NATS_TLS_CA`` names the CA bundle that
signed the server's certificate (a private CA, as infra/make-tls.sh or cert-manager makes); without it
the system's trust store is used. ``$NATS_TLS_CERT`` and ``$NATS_TLS_KEY`` add a client certificate for
a server that verifies clients, and ``$NATS_TLS_HOSTNAME`` the name to verify when the URL's host is not
in the server's certificate.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from liver.shared.errors import InputError
from liver.shared.nats_server import URL_ENV

USER_ENV: Final = "NATS_USER"
PASSWORD_ENV: Final = "NATS_PASSWORD"
TOKEN_ENV: Final = "NATS_TOKEN"
CREDS_ENV: Final = "NATS_CREDS"
"""Path of a ``.creds`` file (a user JWT and its nkey seed)."""

TLS_CA_ENV: Final = "NATS_TLS_CA"
"""Path of the PEM bundle of the CA(s) that signed the server's certificate."""
TLS_CERT_ENV: Final = "NATS_TLS_CERT"
"""Path of this client's PEM certificate (mutual TLS), given with ``$NATS_TLS_KEY``."""
TLS_KEY_ENV: Final = "NATS_TLS_KEY"
TLS_HOSTNAME_ENV: Final = "NATS_TLS_HOSTNAME"
"""The server name to verify instead of the URL's host (connecting through an IP or a tunnel)."""

DRAIN_TIMEOUT_S: Final = 10.0
"""How long a drain may take on shutdown; a container's stop grace period is usually 10-30 s."""


class ConnectionConfigError(InputError):
    """A bad connection setting in the environment; the message names the variable."""


def connect_options(
    url: str,
    environ: Mapping[str, str] | None = None,
    *,
    name: str,
    reconnect_time_wait_s: float = 1.0,
) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect``: servers, credentials, reconnect for ever, bounded drain."""
    env = os.environ if environ is None else environ
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ConnectionConfigError(f"{URL_ENV}: no server URL in {url!r}")
    for server in servers:
        if "://" not in server:
            raise ConnectionConfigError(f"{URL_ENV}: {server!r} is not a URL such as nats://host:4222")
    user, password = env.get(USER_ENV, ""), env.get(PASSWORD_ENV, "")
    token, creds = env.get(TOKEN_ENV, ""), env.get(CREDS_ENV, "")
    if bool(user) != bool(password):
        missing = PASSWORD_ENV if user else USER_ENV
        raise ConnectionConfigError(f"{missing}: {USER_ENV} and {PASSWORD_ENV} are given together")
    chosen = [v for v, given in ((USER_ENV, user), (TOKEN_ENV, token), (CREDS_ENV, creds)) if given]
    if len(chosen) > 1:
        raise ConnectionConfigError(
            f"{chosen[1]}: give one of {USER_ENV}/{PASSWORD_ENV}, {TOKEN_ENV}, {CREDS_ENV}"
        )
    if reconnect_time_wait_s <= 0:
        raise ConnectionConfigError(f"reconnect_time_wait_s: must be > 0, got {reconnect_time_wait_s}")
    options: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "connect_timeout": 5,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": reconnect_time_wait_s,
        "drain_timeout": DRAIN_TIMEOUT_S,
    }
    if user:
        options["user"], options["password"] = user, password
    if token:
        options["token"] = token
    if creds:
        if not Path(creds).is_file():
            raise ConnectionConfigError(f"{CREDS_ENV}: {creds} is not a readable file")
        options["user_credentials"] = creds
    context = tls_context(env, wanted=any(server.startswith("tls://") for server in servers))
    if context is not None:
        options["tls"] = context
    hostname = env.get(TLS_HOSTNAME_ENV, "").strip()
    if hostname:
        options["tls_hostname"] = hostname
    return options


def tls_context(environ: Mapping[str, str], *, wanted: bool = False) -> ssl.SSLContext | None:
    """The client TLS context the environment describes; None when it describes none and ``wanted`` is
    false (a server that requires TLS then still gets the system's trust store, from nats-py).

    Every file is loaded here, so a missing or unreadable one is named before anything connects."""
    ca, cert, key = (environ.get(v, "").strip() for v in (TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV))
    if bool(cert) != bool(key):
        missing = TLS_KEY_ENV if cert else TLS_CERT_ENV
        raise ConnectionConfigError(f"{missing}: {TLS_CERT_ENV} and {TLS_KEY_ENV} are given together")
    if not (ca or cert or wanted):
        return None
    for variable, path in ((TLS_CA_ENV, ca), (TLS_CERT_ENV, cert), (TLS_KEY_ENV, key)):
        if path and not Path(path).is_file():
            raise ConnectionConfigError(f"{variable}: {path} is not a readable file")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if ca:
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise ConnectionConfigError(
                f"{TLS_CA_ENV}: {ca} holds no usable CA certificate ({exc})"
            ) from None
    if cert:
        try:
            context.load_cert_chain(certfile=cert, keyfile=key)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise ConnectionConfigError(
                f"{TLS_CERT_ENV}: {cert} with {TLS_KEY_ENV} {key} is not a certificate and its key ({exc})"
            ) from None
    return context
