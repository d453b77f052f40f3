"""The ``liver`` console script: a thin face over the services, the runtime and the benchmarks.

Every subcommand validates its arguments and turns a bad one into a one-line error (exit code 2).
Subcommand modules are imported only for the command being run: the planner pulls in scipy, the
benchmarks and workers torch and Megatron-core, and `liver serve` must start in well under a second.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence

from liver.shared.errors import BusError, InputError

# name -> (module with add_parser(sub), one-line help shown by `liver --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("liver.cli.plan_cmd", "plan the state transfer of one resize and print its summary"),
    "serve": ("liver.cli.serve_cmd", "run one control-plane service until SIGTERM (drains, exits 0)"),
    "worker": ("liver.cli.worker_cmd", "run one training process of a LiveR job (your own job, or a preset)"),
    "workers": ("liver.cli.workers_cmd", "run a simulated job of N workers on the bus (no training)"),
    "demo": ("liver.cli.demo_cmd", "live scale-in and scale-out of a tiny Megatron GPT on CPU workers"),
    "sim": ("liver.sim.cli", "simulate a training job under volatile capacity (docs/simulator.md)"),
    "data": ("liver.cli.data_cmd", "prepare training data in Megatron's indexed format"),
    "geometry": ("liver.cli.geometry_cmd", "derive a Megatron-core model's shard geometry from its provider"),
    "publish": ("liver.cli.publish_cmd", "publish a spot warning or a scale request (validated first)"),
    "watch": ("liver.cli.watch_cmd", "follow handoff outcomes (and rejected input) as they happen"),
    "status": ("liver.cli.status_cmd", "the services that answer and where each job stands"),
    "notice": ("liver.cli.notice_cmd", "publish this node's preemption notices from its platform"),
    "chaos": ("liver.cli.chaos_cmd", "kill services and the nats-server during handoffs; check exactly-once"),
}

# name -> (module with add_arguments(parser) and run(args), help)
BENCHES: dict[str, tuple[str, str]] = {
    "plan": ("liver.bench.plan", "transfer planning at scale, against torch.distributed.checkpoint"),
    "stream": ("liver.bench.stream.bench", "layer-streaming executor vs raw send/recv, shadow overhead"),
    "bus": ("liver.bench.bus.bench", "control-plane latency from spot.warning to switch and commit"),
    "reconfig": ("liver.bench.reconfig", "live reconfiguration against stop-and-restart"),
    "copies": ("liver.bench.copies", "steady-state cost of peer copies, with against without"),
}


class CliError(InputError):
    """A bad argument: printed as one line, exit code 2."""


def _positionals(argv: Sequence[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")]


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in ``argv`` (if any) is imported and fully described."""
    words = _positionals(argv)
    chosen = words[0] if words else None
    parser = argparse.ArgumentParser(prog="liver", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text)
    bench = sub.add_parser("bench", help="benchmarks (each prints ratios against a baseline run alongside)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    chosen_bench = words[1] if chosen == "bench" and len(words) > 1 else None
    for name, (module, help_text) in BENCHES.items():
        if not _available(module):
            continue
        p = bench_sub.add_parser(name, help=help_text)
        if name == chosen_bench:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:  # a stub: only reachable with a malformed command line
        parser.error(f"unknown command: {' '.join(argv)}")
    try:
        return func(args)
    except (ValueError, CliError) as exc:
        print(f"liver {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BusError as exc:  # the server is unreachable or refused: nothing was done
        print(f"liver {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
