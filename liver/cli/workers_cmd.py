"""``liver workers --simulate N``: a stand-in job of N workers on the bus, with no training, until SIGTERM.

The workers say hello, beat, read their plan slices and acknowledge Prepare and Switch after
``--ack-delay`` seconds, so the control plane can be run, demonstrated and benchmarked without a model.
Real workers are not started here: they run inside training processes (``Companion``).

It connects to ``$NATS_URL`` with the same credentials as the services (``$NATS_USER``/``$NATS_PASSWORD``,
``$NATS_TOKEN`` or ``$NATS_CREDS``); without ``NATS_URL`` it starts an embedded nats-server, which is only
useful to try the command out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from liver.shared.logs import configure_logging

if TYPE_CHECKING:
    from liver.worker_runtime.companion.simulated import SimSettings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workers", help="run simulated workers of a job until SIGTERM (a stand-in job)")
    add_arguments(p)
    p.set_defaults(func=run)


def _nodes(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give node names separated by commas")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--simulate", type=int, required=True, metavar="N", help="number of simulated workers to run"
    )
    p.add_argument("--job", default="demo", help="job id (default: demo)")
    p.add_argument(
        "--nodes",
        type=_nodes,
        default=(),
        metavar="NAME,NAME,...",
        help="node names, filled --devices-per-node at a time (default: node000, node001, ...)",
    )
    p.add_argument(
        "--devices-per-node", type=int, default=8, metavar="K", help="devices per node (default 8)"
    )
    world = p.add_mutually_exclusive_group()
    world.add_argument(
        "--generation",
        type=int,
        default=0,
        metavar="G",
        help="the generation the workers train in, worker i as rank i (default 0)",
    )
    world.add_argument(
        "--joining", action="store_true", help="the workers are in no world yet: spares for a scale-out"
    )
    p.add_argument(
        "--layout",
        metavar="TP,PP,DP",
        help="the starting world's layout (TP*PP*DP = N): announce it to the coordinator (WorldStarted)",
    )
    p.add_argument(
        "--ack-delay", type=float, default=0.0, metavar="S", help="seconds before each ack (default 0)"
    )
    p.add_argument(
        "--iteration-s", type=float, default=0.1, metavar="S", help="seconds per simulated iteration"
    )
    p.add_argument("--heartbeat-s", type=float, default=2.0, metavar="S", help="seconds between heartbeats")
    p.add_argument("--memory-bytes", type=int, metavar="B", help="device memory each worker reports")
    for action, what in (
        ("fail", "acknowledge 'failed'"),
        ("hang", "never acknowledge (keep beating)"),
        ("crash", "go silent (stop beating and acking, as a reclaimed node)"),
    ):
        p.add_argument(
            f"--{action}-at",
            action="append",
            default=[],
            metavar="PHASE[:WORKER[:GEN]]",
            help=f"{what} at prepare or switch; WORKER an index or '*' (all); repeatable",
        )


def settings_from(args: argparse.Namespace) -> SimSettings:
    """The :class:`~liver.worker_runtime.companion.simulated.SimSettings` the arguments describe."""
    from liver.shared.layout import ParallelLayout
    from liver.worker_runtime.companion.simulated import Fault, SimSettings

    faults = tuple(
        Fault.parse(action, spec)  # type: ignore[arg-type]
        for action in ("fail", "hang", "crash")
        for spec in getattr(args, f"{action}_at")
    )
    return SimSettings(
        job_id=args.job,
        workers=args.simulate,
        nodes=args.nodes,
        devices_per_node=args.devices_per_node,
        generation=None if args.joining else args.generation,
        ack_delay_s=args.ack_delay,
        iteration_s=args.iteration_s,
        heartbeat_s=args.heartbeat_s,
        memory_bytes=args.memory_bytes,
        faults=faults,
        layout=None if args.layout is None else ParallelLayout.parse(args.layout),
    )


def run(args: argparse.Namespace) -> int:
    from liver.shared.connection import connect_options
    from liver.shared.nats_server import nats_url
    from liver.worker_runtime.companion.simulated import run_until_signalled

    settings = settings_from(args)
    environ = dict(os.environ)
    configure_logging()
    with nats_url(environ) as url:
        connect_options(url, environ, name="liver-sim")  # bad settings fail before anything starts
        asyncio.run(run_until_signalled(settings, url, environ))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m liver.cli.workers_cmd --simulate N``: the same as ``liver workers --simulate N``."""
    parser = argparse.ArgumentParser(prog="liver workers", description="run simulated workers until SIGTERM")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"liver workers: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
