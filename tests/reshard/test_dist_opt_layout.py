"""The planner's restatement of Megatron's distributed-optimizer layout (``liver.reshard.dist_opt``)
equals what Megatron-core itself builds, and a flat range is a handful of boxes.

Megatron's side: every rank of a layout is built in turn under torch's fake process group
(``parallel_state`` initialised for the layout), with Megatron's own DDP and distributed optimizer, and
its buffers (``param_index_map``, ``bucket_indices``) and owned ranges (``gbuf_ranges``) are read.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import msgspec
import pytest
from megatron.core import parallel_state
from megatron_user_models import DIVISIBLE_BY, NUM_LAYERS, VOCAB_SIZE, UserModel

from liver.reshard.boxes import volume
from liver.reshard.dist_opt import buffer_layouts, flat_range_boxes, owned_ranges
from liver.shared.geometry import DdpSettings
from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS

# -- flat ranges as boxes -----------------------------------------------------------------------------


def _flat_indices(shape: tuple[int, ...], box: Any) -> list[int]:
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return [
        sum(i * s for i, s in zip(index, strides))
        for index in itertools.product(*(range(lo, hi) for lo, hi in box))
    ]


@pytest.mark.parametrize("seed", range(40))
def test_a_flat_range_is_at_most_2ndim_minus_1_boxes_that_cover_it_in_order(seed: int) -> None:
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
    total = math.prod(shape)
    lo = rng.randint(0, total)
    hi = rng.randint(lo, total)
    boxes = flat_range_boxes(shape, lo, hi)
    assert len(boxes) <= max(0, 2 * len(shape) - 1)
    covered = [i for box in boxes for i in sorted(_flat_indices(shape, box))]
    assert covered == list(range(lo, hi))
    for box in boxes:  # each box is contiguous in the flattening
        flat = sorted(_flat_indices(shape, box))
        assert flat == list(range(flat[0], flat[0] + volume(box)))


def test_a_range_outside_the_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[3, 13\)"):
        flat_range_boxes((3, 4), 3, 13)


# -- Megatron's own layout ----------------------------------------------------------------------------


def _megatron(source: Any, layout: ParallelLayout, ddp: DdpSettings, dtype: str) -> dict[int, tuple]:
    from liver.worker_runtime.megatron.build import initialize_parallel_state
    from liver.worker_runtime.megatron.dist_opt import megatron_buffer_layouts, megatron_owned_ranges
    from liver.worker_runtime.megatron.train import build_trainer
    from liver.worker_runtime.megatron.train_config import TrainConfig
    from liver.worker_runtime.mock_warmup import fake_world

    config = TrainConfig(
        global_batch_size=2 * layout.dp,
        micro_batch_size=1,
        seq_length=16,
        use_distributed_optimizer=ddp.distributed_optimizer,
        overlap_grad_reduce=ddp.overlap_grad_reduce,
        bucket_size=ddp.bucket_size,
    )
    out = {}
    for rank in range(layout.world_size):
        with fake_world(rank, layout.world_size):
            initialize_parallel_state(layout, gloo_groups=False)
            try:
                trainer = build_trainer(source, layout, config)
                out[rank] = (megatron_buffer_layouts(trainer), megatron_owned_ranges(trainer))
            finally:
                parallel_state.destroy_model_parallel()
    return out


SPECS = {
    **PRESETS,
    # DeepSeek's shape without its multi-token prediction layer (whose stage builds the embedding first)
    "tiny-deepseek-no-mtp": msgspec.structs.replace(PRESETS["tiny-deepseek"], mtp_num_layers=0),
}


def _source(model: str, dtype: str) -> Any:
    if model in SPECS:
        return msgspec.structs.replace(SPECS[model], params_dtype=dtype)
    from liver.worker_runtime.megatron.geometry import derive_geometry
    from liver.worker_runtime.megatron.source import ModelSource

    provider = UserModel(model, params_dtype=dtype)
    geometry = derive_geometry(
        provider,
        name=model,
        num_layers=NUM_LAYERS,
        vocab_size=VOCAB_SIZE,
        make_vocab_size_divisible_by=DIVISIBLE_BY,
    )
    return ModelSource.from_provider(provider, geometry, max_sequence_length=32)


ONE_BUCKET = DdpSettings(distributed_optimizer=True)
SMALL_BUCKETS = DdpSettings(distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=3000)
CASES = [
    ("tiny-gpt", "float32", ParallelLayout(tp=2, pp=2, dp=2), ONE_BUCKET),
    ("tiny-gpt", "bfloat16", ParallelLayout(tp=1, pp=3, dp=3, stage_layers=(1, 2, 1)), SMALL_BUCKETS),
    ("tiny-llama", "bfloat16", ParallelLayout(tp=2, pp=2, dp=2), SMALL_BUCKETS),
    ("tiny-llama", "float32", ParallelLayout(tp=2, pp=1, dp=3), ONE_BUCKET),
    ("qkv-bias", "bfloat16", ParallelLayout(tp=2, pp=2, dp=2), SMALL_BUCKETS),
    ("qk-layernorm", "float32", ParallelLayout(tp=1, pp=2, dp=4), SMALL_BUCKETS),
    # a dense first layer, then MoE layers: the dense layer alone on stage 0, then beside experts
    ("tiny-deepseek-no-mtp", "float32", ParallelLayout.parse("TP1,PP2,DP2,EP2:1/3"), SMALL_BUCKETS),
    ("tiny-deepseek", "bfloat16", ParallelLayout.parse("TP2,PP1,DP2,EP2,ETP1"), ONE_BUCKET),
    ("tiny-deepseek", "float32", ParallelLayout.parse("TP1,PP2,DP2,EP2:1/3"), SMALL_BUCKETS),
    ("tiny-deepseek", "bfloat16", ParallelLayout.parse("TP2,PP2,DP1"), ONE_BUCKET),
    # a last stage of the MTP layer and the head alone: the final norm stays with the last layer
    ("tiny-deepseek", "float32", ParallelLayout.parse("TP1,PP2,DP2,EP2:4/0"), SMALL_BUCKETS),
    # virtual pipeline chunks: a DDP per chunk, only the first bucketed; the tied embedding's replica
    # on the last chunk of the last stage, the MTP layer (and its embedding) there too
    ("tiny-gpt", "float32", ParallelLayout.parse("TP1,PP2,VPP2,DP2"), SMALL_BUCKETS),
    ("tiny-llama", "bfloat16", ParallelLayout.parse("TP2,PP2,VPP2,DP2"), ONE_BUCKET),
    ("tiny-deepseek", "float32", ParallelLayout.parse("TP1,PP2,VPP2,DP2,EP2"), SMALL_BUCKETS),
    (
        "tiny-gpt",
        "float32",
        ParallelLayout(tp=2, pp=2, dp=2),
        DdpSettings(overlap_grad_reduce=True, bucket_size=3000),
    ),
]
IDS = [
    f"{m}-{d}-{lay.describe()}-{'dist' if s.distributed_optimizer else 'ddp'}-{s.bucket_size}"
    for m, d, lay, s in CASES
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "dtype", "layout", "ddp"), CASES, ids=IDS)
def test_every_ranks_buffers_and_owned_ranges_are_megatrons(
    model: str, dtype: str, layout: ParallelLayout, ddp: DdpSettings
) -> None:
    source = _source(model, dtype)
    geometry = (source.geometry() if callable(source.geometry) else source.geometry).with_ddp(ddp)
    real = _megatron(source, layout, ddp, dtype)
    buckets = set()
    for rank, (buffers, ranges) in real.items():
        assert buffer_layouts(geometry, layout, rank, ddp) == buffers, f"rank {rank}"
        if ddp.distributed_optimizer:
            assert owned_ranges(geometry, layout, rank) == ranges, f"rank {rank}"
        buckets.add(sum(len(b.buckets) for b in buffers))
    if ddp.bucket_size is not None:
        assert max(buckets) > 1  # the case really has several buckets


# -- ownership as boxes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "layout", "ddp"),
    [
        ("tiny-gpt", ParallelLayout(tp=2, pp=2, dp=3), SMALL_BUCKETS),
        ("tiny-gpt", ParallelLayout.parse("TP1,PP2,VPP2,DP3"), SMALL_BUCKETS),
        ("tiny-llama", ParallelLayout(tp=2, pp=1, dp=4), ONE_BUCKET),
        (
            "llama3-8b",
            ParallelLayout(tp=4, pp=4, dp=2),
            DdpSettings(distributed_optimizer=True, overlap_grad_reduce=True),
        ),
    ],
)
def test_the_dp_ranks_owned_boxes_tile_every_tp_shard_exactly_once(
    model: str, layout: ParallelLayout, ddp: DdpSettings
) -> None:
    from liver.reshard.boxes import disjoint_cover
    from liver.reshard.dist_opt import owned_boxes, stage_parameters
    from liver.reshard.views import tp_shard

    geometry = PRESETS[model].geometry().with_ddp(ddp)
    for pp, tp in itertools.product(range(layout.pp), range(layout.tp)):
        ranks = [layout.rank_of(tp, dp, pp) for dp in range(layout.dp)]
        owned = [owned_boxes(geometry, layout, r) for r in ranks]
        names = set().union(*owned)
        stage = [
            t for t in stage_parameters(geometry, layout, pp) if tp_shard(t, geometry, layout.tp, tp).box
        ]
        assert names == {t.param for t in stage}, (pp, tp)
        for t in stage:
            box = tp_shard(t, geometry, layout.tp, tp).box
            parts = [b for o in owned for b in o.get(t.param, ())]
            assert disjoint_cover(box, parts) is None, (t.param, pp, tp)
