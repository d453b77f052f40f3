"""Train a tiny GPT with Megatron-core on CPU processes (gloo) through LiveR's runtime, and reshard it live.

    torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2
    torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2 --reshard-at 10 --reshard-to 1,2,2
    torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2 --reshard-at 10 --reshard-to 2,1,1
    torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2 --initial-procs 2 --reshard-at 8 \
        --reshard-to 2,1,2

The job starts on the first ``--initial-procs`` processes (all by default) at ``--tp``/``--pp`` (DP is
what is left). With ``--reshard-at N --reshard-to TP,PP,DP`` it moves live to that layout after step N,
on the first ``TP*PP*DP`` processes: processes the new layout does not need stream their state out and
exit (scale-in); processes that were waiting outside the job warm up and join (scale-out). Training goes
on from the same step with the same global batch; rank 0 of each world prints the steps and the pause.

Here every process plans the transfer itself (``plan_resize``, the transfer service's core) and hands
the request to its runtime at step N; in a deployment the coordinator decides and each process's bus
companion hands in its slice of the plan. The tokens come from LiveR's synthetic corpus (a sparse Markov
chain over the first ``--corpus-vocab`` token ids; its best loss is about ``log(4)``), so the example
needs no download. ``--json`` prints JSON lines instead. The ``__main__`` guard matters: Megatron's
checkpointing starts helper processes by spawning this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--model", default="tiny-gpt", help="a LiveR preset or a model .json file")
    parser.add_argument("--steps", type=int, default=20, help="training iterations")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--corpus-vocab", type=int, default=128, help="token ids the corpus uses")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument(
        "--initial-procs", type=int, default=None, help="processes the job starts on (default: all)"
    )
    parser.add_argument("--reshard-at", type=int, default=None, help="reshard live after this step")
    parser.add_argument("--reshard-to", default=None, help="the new layout, TP,PP,DP")
    parser.add_argument("--json", action="store_true", help="print one JSON object per logged step")
    return parser.parse_args(argv)


def _store(rank: int) -> tuple[Any, Any]:
    """The job's store: torchrun's agent hosts one at MASTER_ADDR:MASTER_PORT; otherwise rank 0 does."""
    from liver import StoreAddress, host_store

    address = StoreAddress(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]))
    hosted = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0:
        hosted = host_store(address.host, address.port)
    return address, hosted


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from liver import (
        InputError,
        LayoutError,
        LiveRuntime,
        MegatronJob,
        ParallelLayout,
        Placement,
        RuntimeOptions,
        TrainConfig,
        WorldConfig,
        WorldSpec,
        configure_logging,
        grid_devices,
        load_model,
        plan_resize,
    )

    if "MASTER_PORT" not in os.environ or "RANK" not in os.environ:
        print("train_gpt: start it with torchrun (see --help)", file=sys.stderr)
        return 2
    configure_logging(level="WARNING")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    devices = grid_devices(world // per_node, per_node)
    try:
        initial = args.initial_procs or world
        if not 1 <= initial <= world or initial % (args.tp * args.pp):
            raise LayoutError(
                f"--tp {args.tp} x --pp {args.pp} does not divide {initial} of {world} processes"
            )
        layout = ParallelLayout(tp=args.tp, pp=args.pp, dp=initial // (args.tp * args.pp))
        spec = load_model(args.model)
        spec.check_layout(layout)
        target = None
        if (args.reshard_at is None) != (args.reshard_to is None):
            raise ValueError("--reshard-at and --reshard-to go together")
        if args.reshard_to is not None:
            target = ParallelLayout.parse(args.reshard_to)
            spec.check_layout(target)
            if target.world_size > world:
                raise LayoutError(f"--reshard-to {args.reshard_to} needs {target.world_size} processes")
        config = TrainConfig(
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length,
            lr=args.lr,
            min_lr=args.lr / 10,
            lr_decay_iters=max(args.steps, 2),
            corpus_vocab_size=args.corpus_vocab,
            seed=args.seed,
        )
        for checked in (layout, target):
            if checked is not None:
                config.micro_batches_per_rank(checked.dp)
    except (InputError, ValueError) as exc:
        if rank == 0:
            print(f"train_gpt: {exc}", file=sys.stderr)
        return 2

    address, _hosted = _store(rank)
    job = "train-gpt"
    start = WorldSpec(job=job, generation=0, layout=layout, placement=Placement(devices[:initial]))
    runtime = LiveRuntime(
        MegatronJob(spec, config),
        job=job,
        device=devices[rank],
        store=address,
        initial=start,
        options=RuntimeOptions(join_timeout_s=600),
    )
    plan = None
    if target is not None:
        old = WorldConfig(layout, start.placement)
        plan = plan_resize(spec, old, target, devices[: target.world_size]).plan
        if devices[rank] not in start.placement.devices:  # waiting outside the job: hand it in now
            runtime.request_resize(1, target, plan.new.placement, plan, address)

    started = time.perf_counter()
    trainer = runtime.step()
    if trainer is not None and runtime.world is not None and runtime.world.rank == 0 and not args.json:
        print(
            f"{spec.name} at {layout.describe()}: {spec.parameter_count():,} parameters, "
            f"{trainer.num_microbatches} micro-batches of {config.micro_batch_size} per rank, "
            f"built in {time.perf_counter() - started:.2f} s",
            flush=True,
        )
    generation = runtime.generation
    while trainer is not None and trainer.iteration < args.steps:
        due = plan is not None and trainer.iteration == args.reshard_at and runtime.generation == 0
        if due and runtime.pending_generation is None:
            runtime.request_resize(1, plan.new.layout, plan.new.placement, plan, address)
        result = trainer.train_step()
        lead = runtime.world is not None and runtime.world.rank == 0
        if lead and (result.iteration % args.log_every == 0 or result.iteration == args.steps):
            described = runtime.world.layout.describe() if runtime.world is not None else ""
            if args.json:
                print(json.dumps({"layout": described, **result._asdict()}), flush=True)
            else:
                print(
                    f"step {result.iteration:4d}  loss {result.loss:.4f}  grad-norm {result.grad_norm:.4f}"
                    f"  lr {result.lr:.2e}  {result.seconds * 1000:.0f} ms  [{described}]",
                    flush=True,
                )
        trainer = runtime.step()
        if runtime.generation != generation and runtime.world is not None:
            generation = runtime.generation
            _print_switch(runtime, args.json)
    runtime.close()
    return 0


def _print_switch(runtime: Any, as_json: bool) -> None:
    import msgspec

    report = runtime.last_switch
    if report is None or runtime.world is None or runtime.world.rank != 0:
        return
    if as_json:
        print(json.dumps({"switch": msgspec.to_builtins(report)}), flush=True)
        return
    print(
        f"switched to {runtime.world.layout.describe()} after step {report.iteration}: pause "
        f"{report.pause_s * 1000:.0f} ms (switch {report.switch_s * 1000:.0f}, transfer "
        f"{report.transfer_s * 1000:.0f}, rebuild {report.rebuild_s * 1000:.0f}); this rank received "
        f"{report.bytes_received / 1e6:.2f} MB, sent {report.bytes_sent / 1e6:.2f} MB",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
