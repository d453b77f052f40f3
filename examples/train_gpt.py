"""Train a tiny GPT with Megatron-core on CPU processes (gloo), at any (TP, PP, DP) that fits.

    torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2
    torchrun --nproc-per-node 2 examples/train_gpt.py --tp 1 --pp 2 --model tiny-llama --steps 30

DP is what is left: ``world_size / (tp * pp)``. The tokens come from LiveR's synthetic corpus (a sparse
Markov chain over the first ``--corpus-vocab`` token ids; its best loss is about ``log(4)``), so the
example needs no download. Rank 0 prints one line per logged step; ``--json`` prints JSON lines instead.
The ``__main__`` guard matters: Megatron's checkpointing starts helper processes by spawning this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


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
    parser.add_argument("--json", action="store_true", help="print one JSON object per logged step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    from liver.shared.layout import LayoutError, ParallelLayout
    from liver.shared.logs import configure_logging
    from liver.shared.model import ModelError, load_model
    from liver.worker_runtime.megatron_build import initialize_parallel_state
    from liver.worker_runtime.megatron_train import TrainConfig, build_trainer

    configure_logging(level="WARNING")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if world % (args.tp * args.pp):
            raise LayoutError(f"--tp {args.tp} x --pp {args.pp} does not divide the {world} processes")
        layout = ParallelLayout(tp=args.tp, pp=args.pp, dp=world // (args.tp * args.pp))
        spec = load_model(args.model)
        spec.check_layout(layout)
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
        config.micro_batches_per_rank(layout.dp)
    except (LayoutError, ModelError, ValueError) as exc:
        if rank == 0:
            print(f"train_gpt: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2

    initialize_parallel_state(layout)
    start = time.perf_counter()
    trainer = build_trainer(spec, layout, config)
    if rank == 0 and not args.json:
        print(
            f"{spec.name} at {layout.describe()}: {spec.parameter_count():,} parameters, "
            f"{trainer.num_microbatches} micro-batches of {config.micro_batch_size} per rank, "
            f"built in {time.perf_counter() - start:.2f} s"
        )
    for _ in range(args.steps):
        result = trainer.train_step()
        if rank == 0 and (result.iteration % args.log_every == 0 or result.iteration == args.steps):
            if args.json:
                print(json.dumps({"layout": layout.describe(), **result._asdict()}), flush=True)
            else:
                print(
                    f"step {result.iteration:4d}  loss {result.loss:.4f}  grad-norm {result.grad_norm:.4f}"
                    f"  lr {result.lr:.2e}  {result.seconds * 1000:.0f} ms",
                    flush=True,
                )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
