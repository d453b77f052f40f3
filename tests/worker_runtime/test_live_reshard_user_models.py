"""Models no ModelSpec describes reshard live through TP, PP and DP changes, scale-in and scale-out, and
continue exactly as a reload of their state (or a checkpoint save and load) at the new layout would.

Each model is built by its own provider (``megatron_user_models``: QK-layernorm attention, a QKV-only
bias, an extra tensor-parallel head), its geometry derived from Megatron's ``sharded_state_dict()`` in
a spawned interpreter, and the job runs the chain of ``live_chain`` (six processes) against the
baseline job (four). Dropout is on (Megatron's default 0.1 in each model's own config). The data is
Megatron's own pipeline: ``GPTDataset`` (through ``BlendedMegatronDatasetBuilder``) over the shipped
corpus, prepared into indexed ``.bin``/``.idx`` files by ``liver data prepare``.
"""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import pytest
from live_chain import (
    Chain,
    IndexedCorpus,
    Runs,
    Transition,
    bit_identical,
    live_trace,
    reports_of,
    run_chain,
)
from megatron_user_models import (
    DIVISIBLE_BY,
    KINDS,
    NUM_LAYERS,
    VOCAB_SIZE,
    UserModel,
    user_forward_step,
)
from repo_paths import EXAMPLES

from liver.shared.layout import ParallelLayout
from liver.worker_runtime.megatron.train_config import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CONFIG = TrainConfig(global_batch_size=4, micro_batch_size=1, seq_length=16)
TRANSITIONS = {
    1: Transition("TP and DP change", ParallelLayout(tp=1, pp=2, dp=2), (0, 1, 2, 3)),
    2: Transition("PP change and scale-in", ParallelLayout(tp=2, pp=1, dp=1), (0, 1)),
    3: Transition("scale-out", ParallelLayout(tp=2, pp=1, dp=2), (0, 1, 4, 5)),
}
SWITCHED = tuple(TRANSITIONS)
CORPUS_TEXT = EXAMPLES / "data" / "corpus.txt"
IDS = [TRANSITIONS[g].name for g in SWITCHED]


# Every model, every precision and every optimizer at least once (each chain is a six-process job and
# its baselines, ~20 s here, so not their full product): fp32 with the plain optimizer; bf16 with
# Megatron's mixed-precision optimizer (an fp32 master copy of every parameter moves too), with its
# distributed optimizer (master weights and moments sharded over DP), and with that one overlapping its
# gradient reduce-scatter and parameter all-gather with compute over several buckets.
PLAIN, DIST, OVERLAP = "plain", "dist-opt", "dist-opt-overlap"
MODELS = [
    ("value-head", "float32", PLAIN),
    ("qkv-bias", "bfloat16", PLAIN),
    ("qk-layernorm", "bfloat16", DIST),
    ("qkv-bias", "bfloat16", OVERLAP),
    ("heterogeneous", "float32", DIST),  # layers that differ (Nemotron-NAS), one without attention
]
assert {kind for kind, _, _ in MODELS} == set(KINDS)
assert {dtype for _, dtype, _ in MODELS} == {"float32", "bfloat16"}
OPTIMIZERS = {
    PLAIN: {},
    DIST: {"use_distributed_optimizer": True},
    OVERLAP: {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
        "bucket_size": 20_000,
    },
}


@pytest.fixture(scope="module", params=MODELS, ids=[f"{k}-{d}-{o}" for k, d, o in MODELS])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    from liver.worker_runtime.megatron.datasets import prepare_corpus
    from liver.worker_runtime.megatron.geometry import derive_geometry_in_subprocess
    from liver.worker_runtime.megatron.source import ModelSource

    prefix = str(tmp_path_factory.mktemp("corpus") / "corpus")
    prepare_corpus(CORPUS_TEXT, prefix)

    from liver.worker_runtime.megatron.train import TrainerHooks

    kind, dtype, optimizer = request.param
    provider = UserModel(kind, params_dtype=dtype)
    # The bf16 jobs bring their own forward step too: Megatron's loss on parallel_state's groups.
    own_step = TrainerHooks(forward_step=user_forward_step, loss_key="loss") if dtype == "bfloat16" else None
    geometry = derive_geometry_in_subprocess(
        provider,
        name=f"{kind}-{dtype}",
        num_layers=NUM_LAYERS,
        vocab_size=VOCAB_SIZE,
        make_vocab_size_divisible_by=DIVISIBLE_BY,
    )
    chain = Chain(
        job=f"user-{kind}-{dtype}-{optimizer}",
        model=ModelSource.from_provider(provider, geometry, max_sequence_length=32),
        config=msgspec.structs.replace(CONFIG, **OPTIMIZERS[optimizer]),
        start=ParallelLayout(tp=2, pp=2, dp=1),
        start_processes=(0, 1, 2, 3),
        transitions=TRANSITIONS,
        corpus=IndexedCorpus(prefix, CONFIG.seq_length, num_samples=400),
        hooks=own_step,
        check_layouts=request.param == MODELS[0],  # one job checks each new layout before its cut
    )
    return run_chain(chain, str(tmp_path_factory.mktemp("checkpoints")))


@pytest.mark.parametrize("generation", SWITCHED, ids=IDS)
def test_every_process_switches_at_the_same_cut(runs: Runs, generation: int) -> None:
    reports = reports_of(runs, generation)
    plan = runs.plans[generation]
    assert len(reports) == len(set(plan.old.placement.devices) | set(plan.new.placement.devices))
    assert {r["iteration"] for r in reports.values()} == {runs.cuts[generation]}


@pytest.mark.parametrize("generation", SWITCHED, ids=IDS)
def test_the_global_state_right_after_the_switch_equals_the_state_right_before_it(
    runs: Runs, generation: int
) -> None:
    assert bit_identical(runs.before[generation], runs.after[generation])


@pytest.mark.parametrize("generation", SWITCHED, ids=IDS)
def test_the_trace_after_the_switch_equals_a_reload_and_a_checkpoint_load_at_the_new_layout(
    runs: Runs, generation: int
) -> None:
    live = live_trace(runs, generation)
    assert len(live) >= 2
    assert live == runs.baseline[generation] == runs.checkpoint[generation]


def test_every_rank_reports_the_same_loss_and_the_loss_is_finite(runs: Runs) -> None:
    for generation in SWITCHED:
        traces = [live_trace(runs, generation, p) for p in TRANSITIONS[generation].processes]
        assert all(t == traces[0] for t in traces), generation
    assert all(math.isfinite(loss) for _, _, loss, _ in runs.live[0]["trace"])


def test_every_sample_of_the_data_is_read_once_across_the_switches_as_without_them(runs: Runs) -> None:
    # One reader per DP replica (TP rank 0 of the first stage); the DP replicas read disjoint slices.
    read = Counter(index for found in runs.live for _, index in found["samples"])
    steps = runs.live[0]["trace"][-1][1]
    without_switches = Counter(range(steps * CONFIG.global_batch_size))  # one world, the same sampler
    assert read == without_switches
    for found in runs.live:  # each step reads its own global batch
        for iteration, index in found["samples"]:
            assert index // CONFIG.global_batch_size == iteration - 1


def test_the_plans_move_the_optimizer_state_as_the_jobs_optimizer_shards_it(
    runs: Runs, request: pytest.FixtureRequest
) -> None:
    # The runtime refuses a plan whose geometry is not its job's: these plans are what the jobs ran.
    optimizer = request.node.callspec.params["runs"][2]
    for plan in runs.plans.values():
        assert plan.model.distributed == (optimizer != PLAIN)
        assert plan.model.ddp.overlap_grad_reduce == (optimizer == OVERLAP)
