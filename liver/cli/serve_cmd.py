"""``liver serve ingester|topology|transfer|coordinator``: run one control-plane service until SIGTERM.

Each service is its own process (so each can be scaled, restarted and given bus permissions of its
own). It connects to ``$NATS_URL`` with ``$NATS_USER``/``$NATS_PASSWORD``, ``$NATS_TOKEN`` or
``$NATS_CREDS``; without ``NATS_URL`` it starts an embedded nats-server that stops with it.

A service module ``liver.services.<name>.service`` is imported only when that service is asked for and
provides ``create_service(environ) -> Service`` (see :class:`liver.services.host.Service`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Final

from liver.shared.errors import InputError
from liver.shared.logs import configure_logging

SERVICES: Final[Mapping[str, str]] = {
    "ingester": "liver.services.ingester.service",
    "topology": "liver.services.topology.service",
    "transfer": "liver.services.transfer.service",
    "coordinator": "liver.services.coordinator.service",
}


class ServeError(InputError):
    """The service cannot be started: printed as one line, exit code 2."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run one control-plane service until SIGTERM (drains, exits 0)")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("service", choices=sorted(SERVICES), help="which service this process runs")
    p.add_argument(
        "--budget-bytes",
        type=int,
        help="transfer: staging budget per destination and round (default $LIVER_TRANSFER_BUDGET_BYTES, "
        "else 512 MiB)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus /metrics and the health check /healthz on this port (default "
        "$LIVER_METRICS_PORT; unset: none)",
    )


def find(service: str) -> ModuleType:
    """The module of ``service``; a service whose module is not in this build is a :class:`ServeError`."""
    module_name = SERVICES.get(service)
    if module_name is None:
        raise ServeError(f"unknown service {service!r}; services: {', '.join(sorted(SERVICES))}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ServeError(
                f"the {service} service is not part of this build yet ({module_name} is missing)"
            ) from None
        raise
    if not callable(getattr(module, "create_service", None)):
        raise ServeError(f"{module_name} has no create_service(environ) function")
    return module


def run(args: argparse.Namespace) -> int:
    from liver.services.host import serve

    environ = dict(os.environ)
    if args.budget_bytes is not None:
        if args.service != "transfer":
            raise ServeError("--budget-bytes applies to the transfer service only")
        from liver.services.transfer.service import BUDGET_ENV, MIN_BUDGET_BYTES

        if args.budget_bytes < MIN_BUDGET_BYTES:
            raise ServeError(f"--budget-bytes must be at least {MIN_BUDGET_BYTES}, got {args.budget_bytes}")
        environ[BUDGET_ENV] = str(args.budget_bytes)
    if args.metrics_port is not None:
        from liver.services.metrics import METRICS_PORT_ENV

        if not 0 <= args.metrics_port <= 65535:
            raise ServeError(f"--metrics-port must be a port number (0-65535), got {args.metrics_port}")
        environ[METRICS_PORT_ENV] = str(args.metrics_port)
    module = find(args.service)
    configure_logging()
    return serve(module.create_service(environ), environ)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m liver.cli.serve_cmd SERVICE``: the same as ``liver serve SERVICE``."""
    parser = argparse.ArgumentParser(
        prog="liver serve", description="run one control-plane service until SIGTERM"
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"liver serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
