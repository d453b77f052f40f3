"""``liver worker``: one training process of a LiveR job (a Megatron-core GPT on CPU, gloo, synthetic data).

In the job's first world::

    liver worker --job J --node N --device I --layout TP,PP,DP --placement node000:0,node000:1,... \\
        [--port P] [--store HOST:PORT]

``--placement`` lists the device of each rank (rank 0 first). Rank 0 hosts the first world's store on
``--port`` and announces the world to the coordinator once it is built; every other rank gives
``--store`` (rank 0's ``host:port``). A standby worker (``--standby``) says hello and waits until a
scale-out takes it in. See :mod:`liver.worker_runtime.worker_main` for the rest (when a worker stops,
what it reports, the metrics file).

It connects to ``$NATS_URL`` with the services' credentials (``$NATS_USER``/``$NATS_PASSWORD``,
``$NATS_TOKEN`` or ``$NATS_CREDS``); unlike a service it never starts a server of its own: a worker
alone on a private server would have no coordinator to talk to.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.logs import configure_logging

if TYPE_CHECKING:
    from liver.worker_runtime.worker_main import WorkerSettings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one training process of a LiveR job (CPU, tiny Megatron GPT)")
    add_arguments(p)
    p.set_defaults(func=run)


def parse_device(text: str) -> Device:
    node, sep, index = text.strip().rpartition(":")
    if not sep or not node or not index.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not NODE:INDEX (e.g. node000:1)")
    return Device(node, int(index))


def _placement(text: str) -> Placement:
    devices = tuple(parse_device(part) for part in text.split(",") if part.strip())
    if not devices:
        raise argparse.ArgumentTypeError(f"{text!r}: give NODE:INDEX per rank, separated by commas")
    try:
        return Placement(devices)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _layout(text: str) -> ParallelLayout:
    try:
        return ParallelLayout.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("--node", required=True, help="the node this process runs on")
    p.add_argument("--device", type=int, required=True, metavar="I", help="device index on the node")
    p.add_argument("--worker-id", default="", help="worker id (default w-NODE-I)")
    p.add_argument("--model", default="tiny-gpt", help="model preset (default tiny-gpt)")
    world = p.add_mutually_exclusive_group(required=True)
    world.add_argument("--layout", type=_layout, metavar="TP,PP,DP", help="the first world's layout")
    world.add_argument("--standby", action="store_true", help="in no world: wait for a scale-out")
    p.add_argument(
        "--placement", type=_placement, metavar="NODE:I,...", help="the first world's device per rank"
    )
    p.add_argument("--generation", type=int, default=0, help="the first world's generation (default 0)")
    p.add_argument("--store", metavar="HOST:PORT", help="rank 0's store (every first-world rank but 0)")
    p.add_argument("--no-announce", action="store_true", help="rank 0 does not publish WorldStarted")
    p.add_argument("--host", default="127.0.0.1", help="address this worker's store listens on")
    p.add_argument("--port", type=int, default=0, help="port of this worker's store (0: any free port)")
    p.add_argument("--metrics", metavar="PATH", help="append a JSON line per step and per handoff here")
    p.add_argument("--steps", type=int, metavar="N", help="stop after N iterations")
    p.add_argument("--stop-file", metavar="PATH", help="stop once the iteration written in PATH is reached")
    p.add_argument("--global-batch", type=int, default=4, help="global batch size in samples (default 4)")
    p.add_argument("--micro-batch", type=int, default=1, help="micro-batch size (default 1)")
    p.add_argument("--seq-length", type=int, default=16, help="sequence length (default 16)")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="seconds between heartbeats")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--metrics-port", type=int, help="serve the companion's Prometheus metrics on this port (0: any free)"
    )
    ckpt = p.add_argument_group("checkpoints (where a restart starts, and a lost handoff's fallback)")
    ckpt.add_argument(
        "--checkpoint-dir", metavar="DIR", help="shared directory of the job's checkpoints (default: none)"
    )
    ckpt.add_argument(
        "--checkpoint-every", type=int, metavar="N", help="save a checkpoint every N iterations"
    )
    ckpt.add_argument(
        "--checkpoint-keep", type=int, default=2, metavar="K", help="checkpoints kept (default 2)"
    )
    ckpt.add_argument(
        "--fresh-start",
        action="store_true",
        help="start the first world from scratch even if the directory holds a checkpoint "
        "(default: a restarted job goes on from the latest one)",
    )


def settings_from(args: argparse.Namespace) -> WorkerSettings:
    """The :class:`~liver.worker_runtime.worker_main.WorkerSettings` the arguments describe."""
    from liver.worker_runtime.megatron.train_config import TrainConfig
    from liver.worker_runtime.worker_main import InitialWorld, WorkerSettings

    initial = None
    if args.layout is not None:
        if args.placement is None:
            raise ValueError("--placement: needed with --layout (the device of each rank)")
        initial = InitialWorld(
            generation=args.generation,
            layout=args.layout,
            placement=args.placement,
            store=args.store,
            announce=not args.no_announce,
        )
    elif args.placement is not None or args.store is not None:
        raise ValueError("--placement/--store: a --standby worker is in no world yet")
    train = TrainConfig(
        global_batch_size=args.global_batch, micro_batch_size=args.micro_batch, seq_length=args.seq_length
    )
    return WorkerSettings(
        job_id=args.job,
        node=args.node,
        device=args.device,
        worker_id=args.worker_id,
        model=args.model,
        train=train,
        host=args.host,
        port=args.port,
        initial=initial,
        metrics=args.metrics,
        max_steps=args.steps,
        stop_file=args.stop_file,
        heartbeat_s=args.heartbeat_s,
        threads=args.threads,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        checkpoint_keep=args.checkpoint_keep,
        checkpoint_resume=not args.fresh_start,
        metrics_port=args.metrics_port,
    )


def run(args: argparse.Namespace) -> int:
    from liver.shared.connection import connect_options
    from liver.shared.nats_server import URL_ENV
    from liver.worker_runtime.worker_main import exit_now
    from liver.worker_runtime.worker_main import run as run_worker

    settings = settings_from(args)
    environ = dict(os.environ)
    url = environ.get(URL_ENV, "").strip()
    if not url:
        raise ValueError(f"{URL_ENV}: a worker needs the job's NATS server (its coordinator is there)")
    connect_options(url, environ, name="liver-worker")  # bad settings fail before anything starts
    configure_logging()
    exit_now(run_worker(settings, url, environ))
    return 0  # not reached: exit_now leaves the process


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m liver.cli.worker_cmd ...``: the same as ``liver worker ...``."""
    parser = argparse.ArgumentParser(prog="liver worker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"liver worker: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
