"""``liver worker``: one training process of a LiveR job: your own Megatron-core job, or a preset.

Your job is a function that returns a :class:`~liver.MegatronJob` (your model provider, corpus, hooks
and train config), named ``FILE.py:FUNCTION`` or ``MODULE:FUNCTION``; ``--job-arg KEY=VALUE`` passes it
keyword arguments (strings)::

    liver worker --job J --job-factory my_job.py:make_job --job-arg data=/data/corpus --node N ...

Without ``--job-factory`` the worker trains a preset (``--model``, tiny-gpt by default) on synthetic
data, as the demo does. In the job's first world::

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
    from liver.worker_runtime.megatron.train_config import TrainConfig
    from liver.worker_runtime.worker_main import InitialWorld, WorkerSettings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one training process of a LiveR job (your own job, or a preset)")
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


def _job_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE with KEY a Python identifier")
    return key.strip(), value


FIELD_FLAGS: dict[str, str] = {
    "initial.store": "--store",
    "initial.placement": "--placement",
    "initial.layout": "--layout",
    "job_id": "--job",
    "worker_id": "--worker-id",
    "model": "--model",
    "job_factory": "--job-factory",
    "job_args": "--job-arg",
    "checkpoint_dir": "--checkpoint-dir",
    "checkpoint_every": "--checkpoint-every",
    "metrics_port": "--metrics-port",
    "copies_go_back": "--copies-go-back",
    "copies_host_bytes": "--copies-host-bytes",
    "copies": "--no-copies",
}
"""The flag that sets each of :class:`~liver.worker_runtime.worker_main.WorkerSettings`' fields, for
errors: a user of ``liver worker`` knows the flags, not the fields."""


def in_flags(error: ValueError) -> ValueError:
    """``error`` with the settings' field names (`` `initial.store` ``) replaced by their flags."""
    text = str(error)
    for field, flag in FIELD_FLAGS.items():
        text = text.replace(f"`{field}`", flag)
    return ValueError(text)


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
    p.add_argument(
        "--job-factory",
        metavar="FILE.py:FUNCTION",
        help="your function that returns the MegatronJob to train (default: a preset, --model)",
    )
    p.add_argument(
        "--job-arg",
        action="append",
        default=[],
        type=_job_arg,
        metavar="KEY=VALUE",
        help="a keyword argument (a string) for the job factory; repeat for more",
    )
    p.add_argument("--model", help="model preset on synthetic data, without --job-factory (default tiny-gpt)")
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
    p.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="the preset trains with Megatron's distributed optimizer (master weights and Adam moments "
        "sharded over DP; a lost process's shard is recovered from its peer copy on another node)",
    )
    p.add_argument(
        "--optimizer-instances",
        type=int,
        default=1,
        metavar="K",
        help="with --distributed-optimizer: Megatron's num_distributed_optimizer_instances (the state "
        "sharded within K groups of DP ranks and held once in each; default 1)",
    )
    p.add_argument(
        "--no-copies",
        action="store_true",
        help="keep no peer copies (the planners are told: a node lost without notice whose state no "
        "replica holds then falls back to the checkpoint at once)",
    )
    p.add_argument(
        "--copies-host-bytes",
        type=int,
        metavar="BYTES",
        help="host memory this process's peer copies may take (default: half the host's available "
        "memory over the job's processes on it); a keeper whose copies do not fit keeps none",
    )
    p.add_argument(
        "--copies-go-back",
        action="store_true",
        help="keep this process's own state of the last two copy refreshes, so that a process lost in "
        "its copy's refresh is recovered a step back instead of from the checkpoint (host memory: twice "
        "the process's state)",
    )
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
    from liver.worker_runtime.worker_main import InitialWorld

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
    if args.optimizer_instances < 1:
        raise ValueError(f"--optimizer-instances: must be at least 1, got {args.optimizer_instances}")
    if args.optimizer_instances != 1 and (args.job_factory is not None or not args.distributed_optimizer):
        raise ValueError(
            "--optimizer-instances: an option of the preset's --distributed-optimizer (a --job-factory "
            "job sets num_distributed_optimizer_instances in its own TrainConfig)"
        )
    train = TrainConfig(
        global_batch_size=args.global_batch,
        micro_batch_size=args.micro_batch,
        seq_length=args.seq_length,
        use_distributed_optimizer=args.distributed_optimizer,
        num_distributed_optimizer_instances=args.optimizer_instances,
    )
    if args.job_factory is not None and args.model is not None:
        raise ValueError("--model: a --job-factory job brings its own model")
    if args.job_factory is not None and args.distributed_optimizer:
        raise ValueError(
            "--distributed-optimizer: a --job-factory job brings its own TrainConfig "
            "(set use_distributed_optimizer there)"
        )
    job_args = dict(args.job_arg)
    if len(job_args) != len(args.job_arg):
        raise ValueError("--job-arg: the same KEY is given twice")
    try:
        return _settings(args, initial, train, job_args)
    except ValueError as exc:
        raise in_flags(exc) from None


def _settings(
    args: argparse.Namespace, initial: InitialWorld | None, train: TrainConfig, job_args: dict[str, str]
) -> WorkerSettings:
    from liver.worker_runtime.worker_main import WorkerSettings

    return WorkerSettings(
        job_id=args.job,
        node=args.node,
        device=args.device,
        worker_id=args.worker_id,
        model=args.model or "tiny-gpt",
        train=train,
        job_factory=args.job_factory,
        job_args=job_args,
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
        copies=not args.no_copies,
        copies_host_bytes=args.copies_host_bytes,
        copies_go_back=args.copies_go_back,
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
    try:
        job = settings.make_job()  # the user's job fails here, naming the flag, before any connection
    except ValueError as exc:
        raise in_flags(exc) from None
    exit_now(run_worker(settings, url, environ, job=job))
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
