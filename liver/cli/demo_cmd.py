"""``liver demo``: live scale-in and scale-out of a Megatron-core GPT on this machine, no GPU, no NATS.

It starts an embedded NATS server, the four services and the training workers, reclaims one node with
a spot warning, brings capacity back with a scale request, and prints a table per generation (trigger,
layouts, downtime, bytes moved, planning time, loss before and after) and the path of a PNG timeline.
Everything it started is stopped when it ends, also on Ctrl-C. ``--short`` is a smaller job (two
training workers and one standby) with fewer steps; ``--json`` prints the result as JSON on stdout
(progress goes to stderr). Exit code 0 when both reconfigurations committed and nothing was left behind,
1 otherwise, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

TABLE_WIDTH: Final = 170


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="live scale-in and scale-out of a tiny Megatron GPT on CPU workers")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--short", action="store_true", help="2 training workers + 1 standby, fewer steps")
    p.add_argument(
        "--fail-stop",
        action="store_true",
        help="no spot warning: kill a node's workers mid-training; the job recovers live from its replica "
        "(with --distributed-optimizer, from the peer copies of the lost shards)",
    )
    p.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="train with Megatron's distributed optimizer: each process alone holds its shard of the "
        "optimizer state, and a node lost without notice is recovered from the peer copies kept on the "
        "other node",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("liver-demo"),
        metavar="DIR",
        help="where logs, metrics, summary.json and timeline.png go (default ./liver-demo)",
    )
    p.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds (default 600)")


def run(args: argparse.Namespace) -> int:
    import msgspec
    from rich.console import Console

    from liver.demo.orchestrator import run_demo
    from liver.demo.scenario import FULL, FULL_FAIL_STOP, SHORT, SHORT_FAIL_STOP
    from liver.demo.summary import print_summary
    from liver.shared.logs import configure_logging

    if args.fail_stop:
        scenario = SHORT_FAIL_STOP if args.short else FULL_FAIL_STOP
    else:
        scenario = SHORT if args.short else FULL
    if args.timeout is not None:
        if not args.timeout > 0:
            raise ValueError(f"--timeout: must be positive, got {args.timeout}")
        scenario = msgspec.structs.replace(scenario, timeout_s=args.timeout)
    if args.distributed_optimizer:
        train = msgspec.structs.replace(scenario.train, use_distributed_optimizer=True)
        scenario = msgspec.structs.replace(scenario, train=train)
    console = Console(stderr=args.json)
    if not console.is_terminal:
        console = Console(stderr=args.json, width=TABLE_WIDTH)  # a log or a pipe: room for the table
    configure_logging(level="WARNING", stream=sys.stderr)
    result = run_demo(
        scenario,
        args.out,
        name=("short" if args.short else "full")
        + ("-fail-stop" if args.fail_stop else "")
        + ("-distributed-optimizer" if args.distributed_optimizer else ""),
        console=console,
        live=not args.json,
    )
    print_summary(result, console)
    if args.json:
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
        sys.stdout.flush()
    if result.interrupted:
        return 130
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m liver.cli.demo_cmd``: the same as ``liver demo``."""
    parser = argparse.ArgumentParser(prog="liver demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"liver demo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
