"""Container health check of a LiveR service: exit 0 when the service answers NATS discovery.

``healthcheck.py SERVICE`` connects to ``$NATS_URL`` with the container's own credentials (the
service's user may publish ``$SRV.PING.liver-<service>``, see infra/nats.conf) and sends one
discovery ping. The service answers while it can serve, so an answer is a better signal than a live
process: a service still waiting for its server, or stuck, gets no answer and the check fails (exit 1,
one line on stderr). A bad argument or setting exits 2.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Final

import nats
import nats.errors

from liver.cli.serve_cmd import SERVICES
from liver.services.host import micro_name
from liver.shared.connection import ConnectionConfigError, connect_options
from liver.shared.nats_server import URL_ENV

TIMEOUT_S: Final = 3.0
"""For the connection and for the answer; well under compose's health check timeout."""


class Unhealthy(Exception):
    """The service did not answer as expected; the message says why."""


def ping_subject(service: str) -> str:
    """The discovery subject of one service: only its own, which is all its user may ping."""
    return f"$SRV.PING.{micro_name(service)}"


async def ping(service: str, environ: Mapping[str, str]) -> dict[str, object]:
    """The service's discovery answer; raises :class:`Unhealthy` when there is none."""
    url = environ.get(URL_ENV, "").strip()
    if not url:
        raise ConnectionConfigError(f"{URL_ENV}: required (the server the service is connected to)")
    options = connect_options(url, environ, name=f"liver-healthcheck-{service}")
    # nats-py retries an unreachable server for ever unless max_reconnect_attempts is positive.
    options.update(connect_timeout=TIMEOUT_S, allow_reconnect=False, max_reconnect_attempts=1)
    problems: list[str] = []

    async def on_error(exc: Exception) -> None:
        problems.append(str(exc))

    try:
        nc = await asyncio.wait_for(nats.connect(**options, error_cb=on_error), 2 * TIMEOUT_S)
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        why = "; ".join(dict.fromkeys(problems)) or str(exc) or type(exc).__name__
        raise Unhealthy(f"cannot connect to {url}: {why}") from None
    try:
        reply = await nc.request(ping_subject(service), b"", timeout=TIMEOUT_S)
    except nats.errors.NoRespondersError:
        raise Unhealthy(f"no {micro_name(service)} is answering discovery") from None
    except (TimeoutError, nats.errors.Error) as exc:
        why = "; ".join(dict.fromkeys(problems)) or f"no answer within {TIMEOUT_S} s ({type(exc).__name__})"
        raise Unhealthy(f"{micro_name(service)}: {why}") from None
    finally:
        await nc.close()
    try:
        answer = json.loads(reply.data)
    except ValueError:
        raise Unhealthy(f"{micro_name(service)} answered with something that is not JSON") from None
    if not isinstance(answer, dict) or answer.get("name") != micro_name(service):
        raise Unhealthy(f"the answer is not from {micro_name(service)}: {reply.data[:200]!r}")
    return answer


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    if len(args) != 1 or args[0] not in SERVICES:
        print(f"usage: healthcheck.py {{{','.join(sorted(SERVICES))}}}", file=sys.stderr)
        return 2
    service = args[0]
    try:
        answer = asyncio.run(ping(service, env))
    except ConnectionConfigError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 2
    except Unhealthy as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    print(f"{micro_name(service)} {answer.get('id', '?')} {answer.get('version', '?')} ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
