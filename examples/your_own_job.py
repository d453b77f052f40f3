"""Your own Megatron-core job, resharded live: your model provider and TransformerConfig, your
OptimizerConfig and LR schedule, your forward step and loss, Megatron's indexed datasets. The LiveR
lines are marked ``# LiveR``.

On the bus, as a deployment runs it (the coordinator moves the job when a spot warning or a scale
request comes; ``make_job`` below is all LiveR needs of this file)::

    liver data prepare --input examples/data/corpus.txt --output-prefix /tmp/liver-data/corpus
    liver worker --job your-job --job-factory examples/your_own_job.py:make_job \
        --job-arg data=/tmp/liver-data/corpus --node node000 --device 0 --layout 2,1,2 \
        --placement node000:0,node000:1,node001:0,node001:1 --port 29400    # rank 0; the others: --store

Alone under torchrun, planning one move itself (no bus, no services)::

    torchrun --nproc-per-node 4 examples/your_own_job.py --data /tmp/liver-data/corpus --tp 2 --pp 2 \
        --reshard-at 4 --reshard-to 2,1,1

The model is not one of LiveR's presets: a GPT with QK-layernorm attention (RMSNorm on queries and
keys), SwiGLU and grouped-query attention, built by the provider below exactly as a Megatron-core
training script builds its model, except that it is handed the layout and the world's process groups
(LiveR builds it again for every world the job moves to). The forward step is ``pretrain_gpt``'s: the
model computes Megatron's vocab-parallel cross entropy, which finds its TP group in ``parallel_state``;
LiveR keeps ``parallel_state`` answering for whichever world the step runs in. LiveR learns the model's
shard geometry from Megatron's own ``sharded_state_dict()``. With ``--reshard-at N --reshard-to
TP,PP,DP`` the job moves live after step N, as soon as the new world is prepared beside training
(past ``--steps`` the script waits for that and trains two steps on the new world), to that layout on
the first ``TP*PP*DP`` processes (the others stream their state out and exit; ``TP1,PP2,VPP2,DP1``
moves to the interleaved schedule, ``--vpp`` starts on it); here every process plans
the move itself, in a deployment the coordinator does and each process's bus companion hands in its
slice of the plan. ``--json`` prints JSON lines; ``--distributed-optimizer`` trains with Megatron's
distributed optimizer, whose sharded state moves live as well. Runs on CPU (gloo) as on GPUs (NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig

from liver import (  # LiveR
    LiveRuntime,
    MegatronCorpus,
    MegatronJob,
    ModelSource,
    ParallelLayout,
    Placement,
    RuntimeOptions,
    StoreAddress,
    TrainConfig,
    TrainerHooks,
    WorldConfig,
    WorldSpec,
    configure_logging,
    derive_geometry,
    grid_devices,
    host_store,
    pipeline_split,
    plan_resize,
)

NUM_LAYERS, VOCAB_SIZE, DIVISIBLE_BY, MAX_SEQUENCE = 4, 258, 16, 64  # the byte tokenizer's vocabulary
LR, STEPS = 3e-3, 20


def padded_vocab_size(tp: int) -> int:
    multiple = DIVISIBLE_BY * tp
    return -(-VOCAB_SIZE // multiple) * multiple


def model_provider(layout: ParallelLayout, pg_collection: Any, vp_stage: int | None = None) -> GPTModel:
    """Your model provider: this rank's part of the model at ``layout`` on the given process groups;
    with virtual pipeline parallelism (``layout.vpp > 1``, the interleaved schedule) its model chunk
    ``vp_stage``, as Megatron-LM's ``model_provider(pre_process, post_process, vp_stage)``."""
    first_chunk = vp_stage is None or vp_stage == 0
    last_chunk = vp_stage is None or vp_stage == layout.vpp - 1
    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        qk_layernorm=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        **pipeline_split(NUM_LAYERS, layout),  # LiveR: the layout's stage (or chunk) sizes, if uneven
        pipeline_dtype=torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
        vocab_size=padded_vocab_size(layout.tp),
        max_sequence_length=MAX_SEQUENCE,
        pre_process=pg_collection.pp.rank() == 0 and first_chunk,
        post_process=pg_collection.pp.rank() == pg_collection.pp.size() - 1 and last_chunk,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[Any, ...]:
    """Your loss (Megatron's contract): summed loss, token count, and what to report."""
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.float().view(-1) * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator: Any, model: GPTModel) -> tuple[torch.Tensor, Any]:
    """Your forward step: the batch as Megatron's GPTDataset gives it, the loss computed by the model."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def optimizer_config(distributed: bool) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="adam",
        lr=LR,
        min_lr=LR / 10,
        weight_decay=0.01,
        clip_grad=1.0,
        use_distributed_optimizer=distributed,
    )


def lr_schedule(optimizer: Any) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=LR,
        min_lr=LR / 10,
        lr_warmup_steps=2 * 8,  # Megatron counts samples: 2 iterations of the global batch of 8
        lr_decay_steps=STEPS * 8,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=STEPS * 8,
        wd_incr_style="constant",
    )


def at_cut(generation: int, trainer: Any) -> None:
    """Your hook at a live move's cut: every process of the old world, with its trainer (``model``,
    ``optimizer``, ``scheduler``, ``iteration``) before anything moves; save, log or check here."""
    if trainer.groups.rank == 0:
        described = trainer.layout.describe()
        print(f"cut: generation {generation} at iteration {trainer.iteration} on {described}", flush=True)


def after_switch(generation: int, trainer: Any) -> None:
    """Your hook once a move has committed: the new world's trainer, before its first step."""
    if trainer.groups.rank == 0:
        described = trainer.layout.describe()
        print(
            f"switched: generation {generation} at iteration {trainer.iteration} on {described}", flush=True
        )


def make_job(
    data: str, distributed_optimizer: str = "no", samples: str = "100000", optimizer_instances: str = "1"
) -> MegatronJob:
    """LiveR: your model, data, optimizer, schedule and step, for every world the job moves to.

    ``liver worker --job-factory examples/your_own_job.py:make_job --job-arg data=PREFIX`` calls it in
    every process (arguments are strings: ``--job-arg distributed_optimizer=yes``; with it,
    ``--job-arg optimizer_instances=2`` runs Megatron's partial distributed optimizer, whose second
    instance holds what a lost node took, so nothing else is kept for it)."""
    distributed = distributed_optimizer.lower() in ("1", "yes", "true")
    if not optimizer_instances.isdigit():
        raise ValueError(f"optimizer_instances: a whole number, got {optimizer_instances!r}")
    geometry = derive_geometry(  # LiveR: the shard geometry, from sharded_state_dict() (before any world)
        model_provider,
        name="qk-norm-gpt",
        num_layers=NUM_LAYERS,
        vocab_size=VOCAB_SIZE,
        make_vocab_size_divisible_by=DIVISIBLE_BY,
    )
    train = TrainConfig(
        global_batch_size=8,
        micro_batch_size=2,
        seq_length=32,
        use_distributed_optimizer=distributed,
        num_distributed_optimizer_instances=int(optimizer_instances),
    )
    corpus = MegatronCorpus([data], seq_length=train.seq_length, num_samples=int(samples))
    return MegatronJob(
        ModelSource.from_provider(model_provider, geometry, max_sequence_length=MAX_SEQUENCE),
        train,
        corpus=corpus,
        hooks=TrainerHooks(
            optimizer_config=optimizer_config(distributed),
            scheduler=lr_schedule,
            forward_step=forward_step,
            at_cut=at_cut,
            after_switch=after_switch,
        ),
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", required=True, help="the indexed dataset's prefix (liver data prepare)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per stage (interleaved 1F1B)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--reshard-at", type=int, default=None)
    parser.add_argument("--reshard-to", default=None, help="TP,PP,DP or TP1,PP2,VPP2,DP1")
    parser.add_argument("--distributed-optimizer", action="store_true", help="Megatron's ZeRO-1 optimizer")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="nccl" if torch.cuda.is_available() else "gloo",
        help="NCCL on GPUs (one per process, by local rank), gloo on CPUs (default: by what is here)",
    )
    args = parser.parse_args()
    if (args.reshard_at is None) != (args.reshard_to is None):
        parser.error("--reshard-at and --reshard-to go together")
    configure_logging(level="WARNING")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    devices = grid_devices(1, world)
    layout = ParallelLayout(tp=args.tp, pp=args.pp, dp=world // (args.tp * args.pp), vpp=args.vpp)
    address = StoreAddress(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    _hosted = host_store(address.host, address.port) if rank == 0 and not _agent_store() else None

    # A few batches beyond --steps: a move still being prepared then is waited for and finished.
    job = make_job(
        args.data, "yes" if args.distributed_optimizer else "no", samples=str((args.steps + 6) * 8)
    )
    start = WorldSpec(job="your-job", generation=0, layout=layout, placement=Placement(devices))
    options = RuntimeOptions(backend=args.backend)
    runtime = LiveRuntime(  # LiveR
        job,
        job="your-job",
        device=devices[rank],
        store=address,
        initial=start,
        options=options,
        on_cut=at_cut,
        on_switch=after_switch,
    )

    after = 0 if args.reshard_at is not None else 2  # steps on the new world, two at least
    trainer = runtime.step()  # LiveR: the trainer of the world this process is in (None: it left)
    while trainer is not None and (trainer.iteration < args.steps or after < 2):
        if trainer.iteration == args.reshard_at and runtime.generation == 0:  # LiveR: move live
            target = ParallelLayout.parse(args.reshard_to)
            new_devices = devices[: target.world_size]
            plan = plan_resize(job.model, WorldConfig(layout, start.placement), target, new_devices).plan
            runtime.request_resize(1, plan.new.layout, plan.new.placement, plan, address)
        if trainer.iteration >= args.steps and runtime.generation == 0:
            runtime.wait_prepared(600)  # past --steps: let the move finish rather than train on
        result = trainer.train_step()
        after += runtime.generation > 0
        if runtime.world is not None and runtime.world.rank == 0:
            described = runtime.world.layout.describe()
            if args.json:
                print(
                    json.dumps({"layout": described, "generation": runtime.generation, **result._asdict()}),
                    flush=True,
                )
            else:
                print(f"step {result.iteration:3d}  loss {result.loss:.4f}  [{described}]", flush=True)
        trainer = runtime.step()  # LiveR: switches at the agreed iteration boundary
    runtime.close()
    return 0


def _agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


if __name__ == "__main__":
    sys.exit(main())
