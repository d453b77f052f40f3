"""How the bus commands (``liver publish``, ``liver watch``) reach a NATS server.

They talk to the job's server, never to an embedded one (an event published into a server nobody else
uses would be lost): ``--url``, else ``$NATS_URL``, with the same credentials from the environment as
the services (:func:`~liver.shared.connection.connect_options`). Unlike a service, a command gives up
at once when the server cannot be reached, so a typo in the URL is an error, not a hang.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

import nats
import nats.errors
from nats.aio.client import Client

from liver.shared.connection import URL_ENV, connect_options
from liver.shared.errors import BusError, InputError
from liver.shared.subjects import validate_token


class BusUnreachable(BusError):
    """The server named by ``--url`` / ``$NATS_URL`` did not accept a connection."""


def utc_text(moment: datetime) -> str:
    """An aware time as ISO 8601, UTC written ``Z``: how the bus commands print moments."""
    return moment.isoformat().replace("+00:00", "Z")


def job_flag(job: str | None) -> str | None:
    """``--job`` as given, when it is a job id the bus accepts (or not given)."""
    if job is not None:
        try:
            validate_token(job, "job")
        except ValueError as exc:
            raise InputError(f"--job: {exc}") from None
    return job


def server_url(url: str | None, environ: Mapping[str, str]) -> str:
    """``url`` (``--url``), else ``$NATS_URL``; neither is an :class:`InputError` naming both."""
    chosen = (url or "").strip() or environ.get(URL_ENV, "").strip()
    if not chosen:
        raise InputError(f"--url: no server given and {URL_ENV} is not set (e.g. nats://127.0.0.1:4222)")
    return chosen


async def connect_once(
    url: str, environ: Mapping[str, str], *, name: str, keep_reconnecting: bool = False
) -> Client:
    """Connect with the services' options, but give up when the first connection fails; once connected,
    ``keep_reconnecting`` rides out a server restart as a service does (a long ``liver watch``)."""
    options = connect_options(url, environ, name=name)
    # nats-py retries a first connection for ever unless reconnects are capped (0 and -1 both mean no
    # cap there); one attempt is what a command wants.
    options["max_reconnect_attempts"] = 1

    async def quiet(_exc: Exception) -> None:  # the failure is raised below, not printed by nats-py
        return None

    try:
        nc = await nats.connect(**options, error_cb=quiet)
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        raise BusUnreachable(f"cannot connect to {url}: {exc or type(exc).__name__}") from exc
    if keep_reconnecting:
        nc.options["max_reconnect_attempts"] = -1  # read by nats-py at each reconnect
    return nc
