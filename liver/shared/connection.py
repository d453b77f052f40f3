"""How any LiveR process connects to NATS: servers from ``$NATS_URL``, credentials from the environment.

It lives in ``shared`` because both sides of the bus connect the same way (a service process and the
worker companion inside a training process) while ``services`` and ``worker_runtime`` may not import
each other. One way of authenticating at a time: user and password together, a token, or a creds file.
"""

from __future__ import annotations

import os
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
    return options
