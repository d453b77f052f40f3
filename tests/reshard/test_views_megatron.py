"""The view function agrees with Megatron-core's ``sharded_state_dict()`` for every parameter.

Megatron is the ground truth: two spawned gloo processes build real GPTModels (local layer spec, CPU) at
several layouts, and the same processes then emulate every rank of larger layouts on torch's ``fake``
backend (Megatron's sharding metadata depends only on the rank and the config, so a lone process that
believes it is rank 5 of 8 reports exactly what that rank would). The children compare; the parent
collects what they found and checks what needs every rank (who holds a tensor, and that Megatron's main
replicas tile each tensor exactly once).

The documented differences between LiveR's logical tensors and Megatron's checkpoint tensors are
translated explicitly (see :func:`expected_megatron_shards` and :func:`liver_box_of`):

* decoder layers: Megatron stacks them (key ``decoder.layers.<suffix>`` with a prepended layer axis whose
  offset is the global layer index); LiveR names them ``decoder.layers.{i}.<suffix>``. The local layer
  spec also renames the norms in checkpoints (``input_layernorm.`` -> ``self_attention.linear_qkv.
  layer_norm_``, ``pre_mlp_layernorm.`` -> ``mlp.linear_fc1.layer_norm_``).
* SwiGLU fc1: Megatron's sharded factory gives two shards per rank of a ``[2*ffn, ...]`` tensor
  fragmented ``2*tp`` ways (gate chunk ``r``, up chunk ``tp + r``); LiveR's tensor is ``[2, ffn, ...]``.
* vocabulary: Megatron's global shape is the padded vocabulary; LiveR's is the real one and a box stops
  at ``vocab_size`` (a rank holding only padding has no box).
"""

from __future__ import annotations

import queue as queue_mod
import time
import traceback
from collections import defaultdict
from datetime import timedelta
from typing import Any, NamedTuple

import pytest
import torch.multiprocessing as mp

from liver.reshard.boxes import Box, disjoint_cover, full_box
from liver.reshard.views import view
from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS, ModelSpec, TensorSpec

# Two spawned interpreters import torch and Megatron (seconds each, more on a busy machine): the
# children's own deadline (CHILDREN_S) ends a stuck run, and the test's limit is above it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CHILDREN_S = 480.0
PEER_TIMEOUT_S = 120.0
"""For the gloo rendezvous and collectives, which must succeed."""

GPT = ModelSpec(  # LayerNorm, GeLU, biases, tied embeddings, learned absolute positions
    name="gpt-bf16",
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=256,
    num_attention_heads=4,
    vocab_size=1000,
    make_vocab_size_divisible_by=16,
    max_sequence_length=64,
    params_dtype="bfloat16",
)
# GQA 8/4, SwiGLU, RMSNorm, no bias, untied, rope; the padded vocabulary is 1008 at TP1, 1024 at TP2.
LLAMA = PRESETS["tiny-llama"]
TINY_GPT = PRESETS["tiny-gpt"]
LLAMA_TIED_6 = ModelSpec(
    name="llama-tied-6",
    num_layers=6,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=8,
    num_query_groups=2,
    vocab_size=500,
    make_vocab_size_divisible_by=16,
    tied_embeddings=True,
    swiglu=True,
    bias=False,
    normalization="RMSNorm",
    position_embedding="rope",
    max_sequence_length=64,
    params_dtype="float32",
)
# kv_channels * heads != hidden, and at TP4 the last rank's vocabulary rows are all padding (90 of 128).
PADDED = ModelSpec(
    name="padding-only-rank",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=192,
    num_attention_heads=8,
    num_query_groups=4,
    kv_channels=16,
    vocab_size=90,
    make_vocab_size_divisible_by=32,
    tied_embeddings=False,
    swiglu=True,
    bias=True,
    normalization="LayerNorm",
    position_embedding="rope",
    max_sequence_length=32,
    params_dtype="float32",
)


class Case(NamedTuple):
    spec: ModelSpec
    layout: ParallelLayout


# Built in a real two-process gloo world (collectives such as the tied-embedding sync really run).
GLOO_CASES: dict[str, Case] = {
    "TP1PP1DP2-gpt": Case(TINY_GPT, ParallelLayout(tp=1, pp=1, dp=2)),
    "TP2PP1-gpt-bf16-tied": Case(GPT, ParallelLayout(tp=2, pp=1, dp=1)),
    "TP2PP1-llama": Case(LLAMA, ParallelLayout(tp=2, pp=1, dp=1)),
    "TP1PP2-gpt-tied": Case(TINY_GPT, ParallelLayout(tp=1, pp=2, dp=1)),
    "TP1PP2-uneven-3/1-tied": Case(TINY_GPT, ParallelLayout(tp=1, pp=2, dp=1, stage_layers=(3, 1))),
}
# Every rank emulated on the fake backend, split over the two child processes.
EMULATED_CASES: dict[str, Case] = {
    "TP2PP2-llama-tied": Case(LLAMA_TIED_6, ParallelLayout(tp=2, pp=2, dp=1, stage_layers=(2, 4))),
    "TP2PP2DP2-gpt": Case(TINY_GPT, ParallelLayout(tp=2, pp=2, dp=2)),
    "TP4-padding-only-rank": Case(PADDED, ParallelLayout(tp=4, pp=1, dp=1)),
    "PP4-layout-1/2/1/2-tied": Case(
        LLAMA_TIED_6, ParallelLayout(tp=1, pp=4, dp=1, stage_layers=(1, 2, 1, 2))
    ),
    "TP2PP3-empty-first-stage": Case(LLAMA_TIED_6, ParallelLayout(tp=2, pp=3, dp=1, stage_layers=(0, 3, 3))),
}
ALL_CASES = {**GLOO_CASES, **EMULATED_CASES}

# The local layer spec's checkpoint names for the two pre-norms (sharded_state_dict_keys_map).
_NORM_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
_LAYER_PREFIX = "decoder.layers."


class ViewMismatch(Exception):
    """The view's answer cannot even be translated into Megatron's terms."""


class MegatronShard(NamedTuple):
    """The geometry of one ShardedTensor, as Megatron writes it into a checkpoint."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    axis_fragmentations: tuple[int, ...]
    dtype: str


class Held(NamedTuple):
    """One logical tensor a rank holds, in LiveR's terms, and whether Megatron calls it the main copy."""

    name: str
    box: Box | None
    main: bool


class RankReport(NamedTuple):
    mismatches: list[str]
    held: list[Held]
    parameters: int
    sharded_parameters: int


# --------------------------------------------------------------------------- translations (no torch)


def _split_layer_name(name: str) -> tuple[int, str] | None:
    if not name.startswith(_LAYER_PREFIX):
        return None
    index, _, suffix = name.removeprefix(_LAYER_PREFIX).partition(".")
    return int(index), suffix


def megatron_key(name: str) -> str:
    """Megatron's checkpoint key for a LiveR tensor name (layer index dropped, norms renamed)."""
    split = _split_layer_name(name)
    if split is None:
        return name
    _, suffix = split
    for ours, theirs in _NORM_KEYS.items():
        if suffix.startswith(ours):
            suffix = theirs + suffix.removeprefix(ours)
    return _LAYER_PREFIX + suffix


def liver_name(key: str, layer: int | None) -> str:
    """LiveR's tensor name for a Megatron checkpoint key (and the layer axis offset, when stacked)."""
    if layer is None:
        return key
    suffix = key.removeprefix(_LAYER_PREFIX)
    for ours, theirs in _NORM_KEYS.items():
        if suffix.startswith(theirs):
            suffix = ours + suffix.removeprefix(theirs)
    return f"{_LAYER_PREFIX}{layer}.{suffix}"


def expected_megatron_shards(
    tensor: TensorSpec, spec: ModelSpec, layout: ParallelLayout, rank: int
) -> list[MegatronShard]:
    """What Megatron must report for ``tensor`` on ``rank`` if the view function is right."""
    shard = view(tensor, spec, layout, rank)
    if shard is None:
        return []
    tp_rank = layout.coords(rank).tp
    rest = tensor.shape[1:]
    pieces: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []  # global, offset, local
    if tensor.rule == "vocab":
        per = shard.local_shape[0]
        # A padding-only rank has no box; its local block still starts at tp_rank * per.
        lo = shard.box[0][0] if shard.box is not None else tp_rank * per
        pieces.append(((spec.padded_vocab(layout.tp), *rest), (lo,) + (0,) * len(rest), shard.local_shape))
    elif tensor.rule == "swiglu":
        if shard.box is None or shard.box[0] != (0, 2):
            raise ViewMismatch(f"{tensor.name}: a SwiGLU box must span gate and up, the view gives {shard}")
        ffn = tensor.shape[1]
        (lo, hi), tail = shard.box[1], tensor.shape[2:]
        fused = (2 * ffn, *tail)
        local = (hi - lo, *tail)
        pieces.append((fused, (lo,) + (0,) * len(tail), local))  # gate rows
        pieces.append((fused, (ffn + lo,) + (0,) * len(tail), local))  # up rows
    else:
        if shard.box is None:
            raise ViewMismatch(f"{tensor.name}: the view gives no box for a non-vocabulary tensor")
        pieces.append((tensor.shape, tuple(lo for lo, _ in shard.box), shard.local_shape))
    split = _split_layer_name(tensor.name)
    out = []
    for global_shape, offset, local in pieces:
        frag = tuple(g // n if n and g % n == 0 else -1 for g, n in zip(global_shape, local))
        if split is not None:
            layer, _ = split
            global_shape, offset, frag = (
                (spec.num_layers, *global_shape),
                (layer, *offset),
                (spec.num_layers, *frag),
            )
        out.append(MegatronShard(megatron_key(tensor.name), global_shape, offset, local, frag, tensor.dtype))
    return out


def liver_box_of(shard: MegatronShard, tensor: TensorSpec, stacked: bool) -> Box | None:
    """The LiveR box that one Megatron shard covers (``None``: vocabulary padding only)."""
    offset, local = shard.global_offset, shard.local_shape
    if stacked:
        offset = offset[1:]
    if tensor.rule == "vocab":
        lo, hi = offset[0], min(offset[0] + local[0], tensor.shape[0])
        if lo >= hi:
            return None
        return ((lo, hi), *full_box(tensor.shape[1:]))
    if tensor.rule == "swiglu":
        ffn = tensor.shape[1]
        half, lo = divmod(offset[0], ffn)
        if lo + local[0] > ffn:
            raise ViewMismatch(f"{tensor.name}: Megatron shard {shard} crosses the gate/up boundary")
        return ((half, half + 1), (lo, lo + local[0]), *full_box(tensor.shape[2:]))
    return tuple((o, o + n) for o, n in zip(offset, local))


def merge_swiglu_halves(boxes: list[Box]) -> Box | None:
    """Gate and up boxes with the same rows make one ``[0:2, rows, ...]`` box of the logical tensor."""
    if len(boxes) != 2:
        return None
    a, b = sorted(boxes)
    if a[0] == (0, 1) and b[0] == (1, 2) and a[1:] == b[1:]:
        return ((0, 2), *a[1:])
    return None


# --------------------------------------------------------------------------- child side (torch, megatron)


def _megatron_parameter_shards(model: Any) -> tuple[list[tuple[Any, MegatronShard]], set[int], list[str]]:
    """(ShardedTensor, geometry) for every parameter in ``model.sharded_state_dict()``.

    Also returns the ids of the parameters seen and problems (tensors that are not parameters,
    unknown objects).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    params = {id(p) for p in model.parameters()}
    out: list[tuple[Any, MegatronShard]] = []
    seen: set[int] = set()
    problems: list[str] = []
    for value in nested_values(model.sharded_state_dict()):
        if isinstance(value, ShardedObject):
            if not value.key.endswith("._extra_state"):
                problems.append(f"unexpected ShardedObject {value.key}")
            continue
        if isinstance(value, ShardedTensorFactory):
            if id(value.data) not in params:
                problems.append(f"factory {value.key} does not wrap a parameter")
                continue
            seen.add(id(value.data))
            built = [v for v in nested_values({"x": value.build()}) if isinstance(v, ShardedTensor)]
        elif isinstance(value, ShardedTensor):
            if id(value.data) not in params:
                problems.append(f"ShardedTensor {value.key} is not a parameter")
                continue
            seen.add(id(value.data))
            built = [value]
        else:
            problems.append(f"unexpected {type(value).__name__} in sharded_state_dict")
            continue
        for sh in built:
            geometry = MegatronShard(
                sh.key,
                tuple(sh.global_shape),
                tuple(sh.global_offset),
                tuple(sh.local_shape),
                tuple(sh.axis_fragmentations),
                str(sh.dtype).removeprefix("torch."),
            )
            out.append((sh, geometry))
    return out, seen, problems


def _is_main(replica_id: Any) -> bool:
    ids = replica_id if isinstance(replica_id, tuple) else (replica_id,)
    return all(i == 0 for i in ids)


def inspect_rank(spec: ModelSpec, layout: ParallelLayout, gloo_groups: bool) -> RankReport:
    """Build this rank's model and compare every parameter's sharding with the view function."""
    import torch.distributed as dist

    from liver.worker_runtime.megatron.build import (
        MegatronBuildError,
        build_gpt_model,
        initialize_parallel_state,
    )

    initialize_parallel_state(layout, gloo_groups=gloo_groups)
    rank = dist.get_rank()
    try:
        model = build_gpt_model(spec, layout)
    except MegatronBuildError as exc:  # the parameter count disagrees with the views
        return RankReport([str(exc)], [], parameters=0, sharded_parameters=0)
    names = {t.name: t for t in spec.tensors(optimizer=False)}
    shards, seen, mismatches = _megatron_parameter_shards(model)

    for name, p in model.named_parameters():
        if id(p) not in seen:
            mismatches.append(f"parameter {name} is missing from sharded_state_dict()")

    expected: dict[MegatronShard, str] = {}
    for tensor in names.values():
        try:
            for shard in expected_megatron_shards(tensor, spec, layout, rank):
                expected[shard] = tensor.name
        except ViewMismatch as exc:
            mismatches.append(str(exc))
    actual = {geometry for _, geometry in shards}
    for geometry in sorted(actual - expected.keys()):
        mismatches.append(f"Megatron holds {geometry}; the views expect no such shard")
    for geometry in sorted(expected.keys() - actual):
        mismatches.append(f"views expect {geometry} for {expected[geometry]}; Megatron has none")
    if len(shards) != len(actual):
        mismatches.append("Megatron reports the same shard twice on one rank")

    boxes: dict[str, list[Box | None]] = defaultdict(list)
    main: dict[str, set[bool]] = defaultdict(set)
    for sh, geometry in shards:
        stacked = sh.prepend_axis_num == 1
        name = liver_name(geometry.key, geometry.global_offset[0] if stacked else None)
        tensor = names.get(name)
        if tensor is None:
            mismatches.append(f"Megatron key {geometry.key} (as {name}) is no LiveR tensor")
            continue
        try:
            boxes[name].append(liver_box_of(geometry, tensor, stacked))
        except ViewMismatch as exc:
            mismatches.append(str(exc))
            continue
        main[name].add(_is_main(sh.replica_id))
    held: list[Held] = []
    for name, pieces in boxes.items():
        tensor = names[name]
        if tensor.rule == "swiglu":
            box = merge_swiglu_halves([b for b in pieces if b is not None])
            if box is None:
                mismatches.append(f"{name}: SwiGLU halves {pieces} do not form one box")
        else:
            box = pieces[0]
            if len(pieces) != 1:
                mismatches.append(f"{name}: {len(pieces)} Megatron shards on one rank")
        shard = view(tensor, spec, layout, rank)
        if shard is None or shard.box != box:
            mismatches.append(f"{name}: Megatron covers {box}, the view says {shard}")
        if len(main[name]) != 1:
            mismatches.append(f"{name}: pieces disagree on being the main replica")
        held.append(Held(name, box, main[name].pop()))
    return RankReport(
        mismatches,
        held,
        parameters=sum(1 for _ in model.parameters()),
        sharded_parameters=len(seen),
    )


def shim_checks() -> dict[str, Any]:
    """Facts about the CPU shim, gathered over the gloo world (parallel_state at TP2)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from liver.worker_runtime.megatron.cpu_shim import cpu_shim_active

    facts: dict[str, Any] = {"active": cpu_shim_active()}
    buffer = parallel_state.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "liver-test")
    facts["memory_buffer_device"] = buffer.device.type
    before = torch.get_rng_state()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        forked = torch.rand(4).tolist()
    facts["cpu_rng_restored"] = bool(torch.equal(before, torch.get_rng_state()))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (parallel_state.get_tensor_model_parallel_rank(), forked))
    facts["tp_forked_streams"] = gathered
    return facts


def _tied_embedding_checksums() -> list[float]:
    """Sum of the word-embedding weight on the first stage and of its tied copy on the last."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from liver.worker_runtime.megatron.build import build_gpt_model

    model = build_gpt_model(*GLOO_CASES["TP1PP2-gpt-tied"])
    weight = (
        model.embedding.word_embeddings.weight
        if parallel_state.is_pipeline_first_stage()
        else model.output_layer.weight
    )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, float(weight.detach().double().sum()))
    return gathered


def _build_refusal() -> str:
    """Building TP2 while parallel_state is TP1 must fail loudly, never build a TP=1 model."""
    from liver.worker_runtime.megatron.build import (
        MegatronBuildError,
        build_gpt_model,
        initialize_parallel_state,
    )

    initialize_parallel_state(ParallelLayout(tp=1, pp=1, dp=2))
    try:
        build_gpt_model(LLAMA, ParallelLayout(tp=2, pp=1, dp=1))
    except MegatronBuildError as exc:
        return str(exc)
    return "built"


def child_main(child: int, port: int, results: Any) -> None:
    """``port``: the store the parent hosts (so that there is no port to race for)."""
    """One of two processes: the gloo cases together, then its half of the emulated ranks."""
    try:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from torch.testing._internal.distributed.fake_pg import FakeStore

        torch.set_num_threads(1)
        out: dict[str, Any] = {"cases": defaultdict(dict), "timings": {}}
        start = time.perf_counter()
        timeout = timedelta(seconds=PEER_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=child, world_size=2, timeout=timeout)
        for case, (spec, layout) in GLOO_CASES.items():
            out["cases"][case][child] = inspect_rank(spec, layout, gloo_groups=True)
            if case == "TP2PP1-llama":
                out["shim"] = shim_checks()
            if case == "TP1PP2-gpt-tied":
                out["tied_checksums"] = _tied_embedding_checksums()
        out["refusal"] = _build_refusal()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        out["timings"]["gloo"] = time.perf_counter() - start

        start = time.perf_counter()
        for case, (spec, layout) in EMULATED_CASES.items():
            for rank in range(child, layout.world_size, 2):
                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
                out["cases"][case][rank] = inspect_rank(spec, layout, gloo_groups=False)
                parallel_state.destroy_model_parallel()
                dist.destroy_process_group()
        out["timings"]["emulated"] = time.perf_counter() - start
        out["cases"] = {k: dict(v) for k, v in out["cases"].items()}
        results.put((child, out, None))
    except BaseException:
        results.put((child, None, traceback.format_exc()))


# --------------------------------------------------------------------------- parent side


@pytest.fixture(scope="module")
def reports() -> dict[str, Any]:
    """Run both child processes once; every test below reads their findings."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # Hosted here on a port the kernel picks: a port picked here and bound by a child later (after its
    # imports) could be taken meanwhile.
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=child_main, args=(c, port, results), daemon=True) for c in (0, 1)]
    for p in procs:
        p.start()
    found: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + CHILDREN_S
    try:
        while len(found) + len(errors) < 2:
            try:
                child, out, error = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    errors.append(f"children exited with {[p.exitcode for p in procs]} or timed out")
                    break
                continue
            if error:
                errors.append(f"child {child}:\n{error}")
            else:
                found[child] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    merged: dict[str, Any] = {"cases": defaultdict(dict), "by_child": found}
    for out in found.values():
        for case, ranks in out["cases"].items():
            merged["cases"][case].update(ranks)
    return merged


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_every_megatron_parameter_shard_matches_the_view(reports: dict[str, Any], case: str) -> None:
    layout = ALL_CASES[case].layout
    by_rank: dict[int, RankReport] = reports["cases"][case]
    assert sorted(by_rank) == list(range(layout.world_size))
    problems = [f"rank {r}: {m}" for r, rep in sorted(by_rank.items()) for m in rep.mismatches]
    assert not problems, "\n".join(problems)
    for rep in by_rank.values():
        assert rep.sharded_parameters == rep.parameters > 0


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_megatron_and_the_views_agree_on_which_ranks_hold_each_tensor(
    reports: dict[str, Any], case: str
) -> None:
    spec, layout = ALL_CASES[case]
    megatron_holders: dict[str, set[int]] = defaultdict(set)
    for rank, rep in reports["cases"][case].items():
        for held in rep.held:
            megatron_holders[held.name].add(rank)
    for tensor in spec.tensors(optimizer=False):
        liver_holders = {r for r in range(layout.world_size) if view(tensor, spec, layout, r) is not None}
        assert megatron_holders[tensor.name] == liver_holders, tensor.name


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_megatron_main_replicas_cover_each_tensor_exactly_once(reports: dict[str, Any], case: str) -> None:
    spec, _ = ALL_CASES[case]
    main_boxes: dict[str, list[Box]] = defaultdict(list)
    for rep in reports["cases"][case].values():
        for held in rep.held:
            if held.main and held.box is not None:
                main_boxes[held.name].append(held.box)
    for tensor in spec.tensors(optimizer=False):
        problem = disjoint_cover(full_box(tensor.shape), main_boxes[tensor.name])
        assert problem is None, f"{tensor.name}: {problem}"


def megatron_lm_padded_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding`` (megatron/training/tokenizer, not in megatron-core)."""
    after = vocab_size
    while after % (divisible_by * tp):
        after += 1
    return after


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_padded_vocabulary_is_the_one_megatron_lm_training_builds(case: str) -> None:
    # megatron-core takes the padded size as given, so the builder's input needs its own check.
    spec, layout = ALL_CASES[case]
    assert spec.padded_vocab(layout.tp) == megatron_lm_padded_vocab(
        spec.vocab_size, spec.make_vocab_size_divisible_by, layout.tp
    )


def test_tied_embedding_copy_on_the_last_stage_is_a_replica_not_a_main_copy(reports: dict[str, Any]) -> None:
    by_rank = reports["cases"]["TP1PP2-gpt-tied"]
    [first] = [h for h in by_rank[0].held if h.name == "embedding.word_embeddings.weight"]
    [last] = [h for h in by_rank[1].held if h.name == "embedding.word_embeddings.weight"]
    assert first.main and not last.main
    assert first.box == last.box == ((0, TINY_GPT.vocab_size), (0, TINY_GPT.hidden_size))


def test_a_rank_holding_only_vocabulary_padding_has_no_box(reports: dict[str, Any]) -> None:
    vocabulary = {"embedding.word_embeddings.weight", "output_layer.weight"}
    last_rank = reports["cases"]["TP4-padding-only-rank"][3]
    assert {h.name: h.box for h in last_rank.held if h.name in vocabulary} == dict.fromkeys(vocabulary)
    third_rank = reports["cases"]["TP4-padding-only-rank"][2]
    assert {h.box[0] for h in third_rank.held if h.name in vocabulary} == {(64, PADDED.vocab_size)}


def test_cpu_shim_syncs_the_tied_embedding_copy_over_gloo(reports: dict[str, Any]) -> None:
    first, last = reports["by_child"][0]["tied_checksums"]
    assert first == last and first != 0.0


def test_cpu_shim_global_memory_buffer_allocates_on_the_cpu(reports: dict[str, Any]) -> None:
    for out in reports["by_child"].values():
        assert out["shim"]["active"] is True
        assert out["shim"]["memory_buffer_device"] == "cpu"


def test_cpu_shim_rng_tracker_forks_one_stream_per_tp_rank_and_restores_the_cpu_rng(
    reports: dict[str, Any],
) -> None:
    streams = dict(reports["by_child"][0]["shim"]["tp_forked_streams"])
    assert sorted(streams) == [0, 1]
    assert streams[0] != streams[1]
    for out in reports["by_child"].values():
        assert out["shim"]["cpu_rng_restored"] is True


def test_build_refuses_a_layout_that_parallel_state_was_not_initialised_for(reports: dict[str, Any]) -> None:
    for out in reports["by_child"].values():
        assert "parallel_state is TP1,PP1,DP2,CP1,EP1,ETP1 but the layout is TP2,PP1,DP1" in out["refusal"]
