"""The ``liver`` console script: a thin face over the services, the runtime and the benchmarks.

Every subcommand validates its arguments and turns a bad one into a one-line error (exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from liver.cli import plan_cmd, serve_cmd, workers_cmd
from liver.sim import cli as sim_cli


class CliError(Exception):
    """A bad argument: printed as one line, exit code 2."""


def _bench_plan(sub: argparse._SubParsersAction) -> None:
    from liver.bench import plan_bench

    p = sub.add_parser("plan", help="transfer planning at scale, against torch.distributed.checkpoint")
    plan_bench.add_arguments(p)
    p.set_defaults(func=plan_bench.run)


def _bench_stream(sub: argparse._SubParsersAction) -> None:
    from liver.bench import stream_bench

    p = sub.add_parser("stream", help="layer-streaming executor vs raw send/recv, and shadow-world overhead")
    stream_bench.add_arguments(p)
    p.set_defaults(func=stream_bench.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="liver", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    workers_cmd.add_parser(sub)
    sim_cli.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (each prints ratios against a baseline run alongside)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    _bench_plan(bench_sub)
    _bench_stream(bench_sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, CliError) as exc:
        print(f"liver {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
