"""Durable checkpoints and the fail-stop fallback (invariant I4), on real Megatron trainers.

Three processes play one job. Two train a tiny GPT at (TP2) and checkpoint every two steps; after
step 7 one of them is killed (SIGKILL, mid-job, as a lost node). The survivor's next step fails; it
and a replacement process that never saw the old world form a new world at (TP1, PP2) and fall back to
the last durable checkpoint. The same two processes then load that checkpoint again into fresh
trainers, once at (TP1, PP2) while ``parallel_state`` describes another layout (the reference run) and
once at (TP1, PP1, DP2); then a bf16 model and a model with dropout go through a save and a load. The
parent gathers every local state through the view function's boxes and compares global tensors element
for element. The tests below read what the processes reported.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pytest
import torch
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.reshard.views import view
from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS, ModelSpec

# The processes' own limits (run_world's) end a stuck run; the test's limit is above them.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PEER_TIMEOUT_S = 120.0
"""Every rendezvous and collective here must succeed (a lost peer surfaces at once, as a closed
connection): a busy machine may keep a rank off the CPU for a while."""

SPEC = PRESETS["tiny-gpt"]  # tied embeddings: the last stage's output layer is a replica of them
BF16 = msgspec.structs.replace(SPEC, name="tiny-gpt-bf16", params_dtype="bfloat16")
OLD = ParallelLayout(tp=2, pp=1, dp=1)
NEW = ParallelLayout(tp=1, pp=2, dp=1)  # the vocabulary padding changes too (1024 rows -> 1008)
DP = ParallelLayout(tp=1, pp=1, dp=2)
EVERY, KEEP_LAST = 2, 2
STEPS_BEFORE_LOSS = 7
STEPS_AFTER = 3
GLOBAL_BATCH = 4
SURVIVOR, DOOMED, REPLACEMENT = 0, 1, 2


def _config(**changes: Any) -> Any:
    from liver.worker_runtime.megatron.train_config import TrainConfig

    return TrainConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=1, seq_length=16, **changes)


def _trace(results: list[Any]) -> list[tuple[float, float, float]]:
    return [(r.loss, r.grad_norm, r.lr) for r in results]


def _arrays(trainer: Any) -> dict[int, np.ndarray]:
    from liver.worker_runtime.megatron.state import snapshot

    # bf16 has no numpy type; widening to fp32 is exact.
    return {
        index: (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
        for index, tensor in snapshot(trainer).items()
    }


def _world(
    proc: Proc, generation: int, layout: ParallelLayout, procs: tuple[int, ...], timeout_s: float
) -> Any:
    from liver.shared.layout import Device, Placement
    from liver.worker_runtime.world import StoreAddress, WorldSpec, build_world

    devices = {SURVIVOR: Device("node0", 0), DOOMED: Device("node0", 1), REPLACEMENT: Device("node1", 0)}
    placement = Placement(tuple(devices[p] for p in procs))
    world = build_world(
        WorldSpec(job="fallback", generation=generation, layout=layout, placement=placement),
        devices[proc.rank],
        StoreAddress("127.0.0.1", proc.store.port),
        timeout=timedelta(seconds=timeout_s),
    )
    world.adopt_as_default(timedelta(seconds=timeout_s))
    return world


def _old_world(proc: Proc, root: str, evidence: str, out: dict[str, Any]) -> None:
    """Train at OLD with periodic checkpoints; the doomed process dies at the start of step 8.

    What each rank held when a checkpoint was taken goes to ``evidence`` (the doomed process cannot
    report it)."""
    from liver.worker_runtime.megatron.build import groups_from_world
    from liver.worker_runtime.megatron.checkpoint import PeriodicCheckpoints
    from liver.worker_runtime.megatron.train import build_trainer

    world = _world(proc, 0, OLD, (SURVIVOR, DOOMED), timeout_s=PEER_TIMEOUT_S)
    trainer = build_trainer(SPEC, OLD, _config(), groups=groups_from_world(world))
    checkpoints = PeriodicCheckpoints(root, every=EVERY, keep_last=KEEP_LAST)
    results = []
    for _ in range(STEPS_BEFORE_LOSS):
        results.append(trainer.train_step())
        if checkpoints.after_step(trainer) is not None:
            arrays = _arrays(trainer)
            np.savez(
                Path(evidence) / f"rank{proc.rank}-iter{trainer.iteration}.npz",
                **{str(i): a for i, a in arrays.items()},
            )
    out["old_trace"] = _trace(results)
    out["listing"] = sorted(os.listdir(root))
    if proc.rank == DOOMED:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        trainer.train_step()
    except Exception as exc:  # the lost peer surfaces as a failed collective
        out["failure"] = f"{type(exc).__name__}: {exc}"
    world.release()


def _new_worlds(proc: Proc, root: str, out: dict[str, Any]) -> None:
    from liver.worker_runtime.megatron.build import groups_from_world, initialize_parallel_state
    from liver.worker_runtime.megatron.checkpoint import (
        CheckpointError,
        check_replica_ids,
        latest_checkpoint,
        load_checkpoint,
        restart_from_checkpoint,
    )
    from liver.worker_runtime.megatron.train import build_trainer

    procs = (SURVIVOR, REPLACEMENT)
    # The replacement waits here until the survivor has noticed the loss and arrives.
    world = _world(proc, 1, NEW, procs, timeout_s=180)
    groups = groups_from_world(world)
    fallback = restart_from_checkpoint(
        root, SPEC, NEW, _config(), groups=groups, reached_iteration=STEPS_BEFORE_LOSS
    )
    assert fallback is not None  # required: none found raises
    trainer = fallback.trainer
    out["fallback_checkpoint"] = fallback.checkpoint.name
    out["steps_lost"] = fallback.steps_lost
    out["fallback_state"] = _arrays(trainer)
    out["fallback_position"] = (trainer.iteration, trainer.consumed_samples, trainer.scheduler.num_steps)
    out["fallback_trace"] = _trace([trainer.train_step() for _ in range(STEPS_AFTER)])
    try:
        load_checkpoint(trainer, fallback.checkpoint)
    except CheckpointError as exc:
        out["stepped_trainer_refusal"] = str(exc)
    world.release()

    # The reference: a fresh trainer (other initial weights) at the same layout loads the same
    # checkpoint while parallel_state describes another layout of two ranks.
    world = _world(proc, 2, NEW, procs, timeout_s=PEER_TIMEOUT_S)
    groups = groups_from_world(world)
    initialize_parallel_state(DP)
    reference = build_trainer(SPEC, NEW, _config(seed=99), groups=groups)
    load_checkpoint(reference, latest_checkpoint(root))
    out["reference_trace"] = _trace([reference.train_step() for _ in range(STEPS_AFTER)])
    from megatron.core import parallel_state

    unpinned = reference.gpt.sharded_state_dict(metadata={"dp_cp_group": groups.dp})
    try:
        check_replica_ids(unpinned, groups)
        out["stale_replica_ids"] = None
    except CheckpointError as exc:
        out["stale_replica_ids"] = str(exc)
    parallel_state.destroy_model_parallel()
    world.release()

    world = _world(proc, 3, DP, procs, timeout_s=PEER_TIMEOUT_S)
    groups = groups_from_world(world)
    replicas = build_trainer(SPEC, DP, _config(seed=7), groups=groups)
    load_checkpoint(replicas, latest_checkpoint(root))
    out["dp_state"] = _arrays(replicas)
    other_batch = build_trainer(
        SPEC, DP, msgspec.structs.replace(_config(), global_batch_size=8), groups=groups
    )
    try:
        load_checkpoint(other_batch, latest_checkpoint(root))
    except CheckpointError as exc:
        out["batch_size_refusal"] = str(exc)
    world.release()


def _mixed_precision(proc: Proc, root: str, out: dict[str, Any]) -> None:
    """A bf16 model (fp32 master weights in the optimizer) saved by two DP replicas (the fully parallel
    save over the DP group) and loaded at (TP1, PP2)."""
    from liver.worker_runtime.megatron.build import groups_from_world
    from liver.worker_runtime.megatron.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from liver.worker_runtime.megatron.train import build_trainer

    procs = (SURVIVOR, REPLACEMENT)
    world = _world(proc, 4, DP, procs, timeout_s=PEER_TIMEOUT_S)
    trainer = build_trainer(BF16, DP, _config(), groups=groups_from_world(world))
    for _ in range(2):
        trainer.train_step()
    save_checkpoint(trainer, root)
    out["bf16_saved_state"] = _arrays(trainer)
    world.release()
    world = _world(proc, 5, NEW, procs, timeout_s=PEER_TIMEOUT_S)
    trainer = build_trainer(BF16, NEW, _config(seed=5), groups=groups_from_world(world))
    load_checkpoint(trainer, latest_checkpoint(root))
    out["bf16_loaded_state"] = _arrays(trainer)
    world.release()


def _same_layout_with_dropout(proc: Proc, root: str, out: dict[str, Any]) -> None:
    """With dropout, a load at the layout the checkpoint was saved at continues the saved random
    streams: the resumed run is the uninterrupted one."""
    from liver.worker_runtime.megatron.build import groups_from_world
    from liver.worker_runtime.megatron.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from liver.worker_runtime.megatron.train import build_trainer

    procs = (SURVIVOR, REPLACEMENT)
    dropout = _config(hidden_dropout=0.1, attention_dropout=0.1)
    world = _world(proc, 6, DP, procs, timeout_s=PEER_TIMEOUT_S)
    trainer = build_trainer(SPEC, DP, dropout, groups=groups_from_world(world))
    trainer.train_step()
    save_checkpoint(trainer, root)
    out["dropout_continued"] = _trace([trainer.train_step() for _ in range(2)])
    world.release()
    world = _world(proc, 7, DP, procs, timeout_s=PEER_TIMEOUT_S)
    resumed = build_trainer(
        SPEC, DP, msgspec.structs.replace(dropout, seed=3), groups=groups_from_world(world)
    )
    load_checkpoint(resumed, latest_checkpoint(root))
    out["dropout_resumed"] = _trace([resumed.train_step() for _ in range(2)])
    world.release()


def _job(proc: Proc, root: str, evidence: str, bf16_root: str, dropout_root: str) -> dict[str, Any]:
    from liver.shared.logs import configure_logging

    configure_logging(level="ERROR")
    out: dict[str, Any] = {}
    if proc.rank != REPLACEMENT:
        _old_world(proc, root, evidence, out)
    _new_worlds(proc, root, out)
    _mixed_precision(proc, bf16_root, out)
    _same_layout_with_dropout(proc, dropout_root, out)
    return out


class Reports(NamedTuple):
    procs: dict[int, dict[str, Any]]  # what the survivor and the replacement reported
    root: Path
    saved_states: list[dict[int, np.ndarray]]  # both old ranks' local states at the latest checkpoint


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Reports:
    root, evidence = tmp_path_factory.mktemp("checkpoints"), tmp_path_factory.mktemp("evidence")
    bf16_root, dropout_root = tmp_path_factory.mktemp("bf16"), tmp_path_factory.mktemp("dropout")
    outcomes = run_world(
        _job,
        3,
        (str(root), str(evidence), str(bf16_root), str(dropout_root)),
        timeout_s=420,
        wait_for={SURVIVOR, REPLACEMENT},
        group_timeout_s=PEER_TIMEOUT_S,
    )
    assert outcomes[DOOMED].status == "died", outcomes[DOOMED]
    procs = {proc: outcomes[proc].unwrap() for proc in (SURVIVOR, REPLACEMENT)}
    saved = []
    for rank in (SURVIVOR, DOOMED):
        with np.load(evidence / f"rank{rank}-iter6.npz") as found:
            saved.append({int(i): found[i] for i in found.files})
    return Reports(procs, root, saved)


def _global(
    states: list[dict[int, np.ndarray]], layout: ParallelLayout, spec: ModelSpec = SPEC
) -> dict[str, torch.Tensor]:
    """Each logical tensor assembled from the ranks' local states through the view boxes; every DP
    replica must hold the same values, and every element must be covered."""
    out: dict[str, torch.Tensor] = {}
    for index, tensor in enumerate(spec.tensors()):
        full = torch.full(tensor.shape, float("nan"), dtype=torch.float64)
        for rank, state in enumerate(states):
            shard = view(tensor, spec, layout, rank)
            if shard is None or shard.box is None:
                continue
            target = tuple(slice(lo, hi) for lo, hi in shard.box)
            local = torch.from_numpy(state[index])[tuple(slice(0, hi - lo) for lo, hi in shard.box)].double()
            seen = full[target]
            assert bool(torch.isnan(seen).all()) or torch.equal(seen, local), (
                f"{tensor.name}: replicas differ"
            )
            full[target] = local
        assert not bool(torch.isnan(full).any()), f"{tensor.name}: not covered at {layout.describe()}"
        out[tensor.name] = full
    return out


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in a if not torch.equal(a[name], b[name])]


def _new_states(reports: Reports, key: str) -> list[dict[int, np.ndarray]]:
    return [reports.procs[SURVIVOR][key], reports.procs[REPLACEMENT][key]]


def test_periodic_checkpoints_keep_the_last_two_and_mark_the_latest(reports: Reports) -> None:
    assert reports.procs[SURVIVOR]["listing"] == ["iter_0000004", "iter_0000006", "latest"]
    assert (reports.root / "latest").read_text().strip() == "iter_0000006"


def test_the_lost_rank_surfaces_in_the_survivor_as_a_failed_step(reports: Reports) -> None:
    assert reports.procs[SURVIVOR]["failure"]


def test_the_fallback_restarts_from_the_last_durable_checkpoint(reports: Reports) -> None:
    for proc in (SURVIVOR, REPLACEMENT):
        assert reports.procs[proc]["fallback_checkpoint"] == "iter_0000006"
        assert reports.procs[proc]["fallback_position"] == (6, 6 * GLOBAL_BATCH, 6 * GLOBAL_BATCH)


def test_the_fallback_reports_the_steps_the_old_world_completed_past_the_checkpoint(
    reports: Reports,
) -> None:
    assert [reports.procs[proc]["steps_lost"] for proc in (SURVIVOR, REPLACEMENT)] == [1, 1]


def test_the_state_loaded_at_a_new_tp_and_pp_equals_the_saved_global_state_element_for_element(
    reports: Reports,
) -> None:
    saved = _global(reports.saved_states, OLD)
    assert _differing(saved, _global(_new_states(reports, "fallback_state"), NEW)) == []


def test_the_state_loaded_at_a_new_dp_equals_the_saved_global_state_element_for_element(
    reports: Reports,
) -> None:
    saved = _global(reports.saved_states, OLD)
    assert _differing(saved, _global(_new_states(reports, "dp_state"), DP)) == []


def test_the_trace_after_the_fallback_equals_a_fresh_load_of_the_same_checkpoint_at_that_layout(
    reports: Reports,
) -> None:
    for proc in (SURVIVOR, REPLACEMENT):
        found = reports.procs[proc]
        assert found["fallback_trace"] == found["reference_trace"]
    assert reports.procs[SURVIVOR]["fallback_trace"] == reports.procs[REPLACEMENT]["fallback_trace"]


def test_the_first_step_after_the_fallback_redoes_the_lost_step_from_the_trained_state(
    reports: Reports,
) -> None:
    # Step 7 ran at (TP2) after the checkpoint of step 6 and was lost; the fallback runs it again at
    # (TP1, PP2): the same state and batch, summed in another order.
    lost_step_loss = reports.procs[SURVIVOR]["old_trace"][6][0]
    redone_loss = reports.procs[SURVIVOR]["fallback_trace"][0][0]
    assert redone_loss == pytest.approx(lost_step_loss, rel=1e-5)
    assert redone_loss < reports.procs[SURVIVOR]["old_trace"][0][0] - 0.5  # not a fresh model


def test_a_stale_parallel_state_would_give_wrong_replica_ids_and_is_caught(reports: Reports) -> None:
    # (TP1, PP2) rank 1 holds the tied output layer, whose replica id Megatron takes from parallel_state;
    # parallel_state described (TP1, PP1, DP2), where that process is DP rank 1.
    assert reports.procs[SURVIVOR]["stale_replica_ids"] is None
    assert "embedding.word_embeddings.weight" in reports.procs[REPLACEMENT]["stale_replica_ids"]


def test_a_trainer_that_has_stepped_is_refused_as_a_load_target(reports: Reports) -> None:
    for proc in (SURVIVOR, REPLACEMENT):
        assert "freshly built" in reports.procs[proc]["stepped_trainer_refusal"]


def test_a_checkpoint_is_refused_for_another_global_batch_size(reports: Reports) -> None:
    for proc in (SURVIVOR, REPLACEMENT):
        assert "global_batch_size" in reports.procs[proc]["batch_size_refusal"]


def test_a_mixed_precision_state_saved_by_dp_replicas_loads_at_another_layout_element_for_element(
    reports: Reports,
) -> None:
    saved = _global(_new_states(reports, "bf16_saved_state"), DP, BF16)
    loaded = _global(_new_states(reports, "bf16_loaded_state"), NEW, BF16)
    assert any(t.role == "fp32_param" for t in BF16.tensors())
    assert _differing(saved, loaded) == []


def test_with_dropout_a_load_at_the_saved_layout_continues_exactly_as_the_uninterrupted_run(
    reports: Reports,
) -> None:
    for proc in (SURVIVOR, REPLACEMENT):
        found = reports.procs[proc]
        assert found["dropout_resumed"] == found["dropout_continued"]


# -- the automatic fallback: a live handoff that loses an old rank ------------------------------------------
#
# p0 and p1 train at (TP2) through LiveRuntime, which checkpoints every two steps. After step 3 the job
# hands off to (TP2) on p0 and p2 (a joiner that never saw the old world): p1 must stream its TP shard
# to p2 and dies in its first streaming step. p0 cannot restore the old world; it and p2 agree on the
# store to fall back and restart as generation 2 from the checkpoint of step 2, at the saved layout on
# other devices. The reference is the live path's own load: a fresh trainer resumed (MegatronJob.resume,
# what a live switch runs after streaming) from that checkpoint's state and progress. Dropout is on, so
# the random streams decide the losses.

AUTO_JOB = "auto-fallback"
AUTO_LAYOUT = ParallelLayout(tp=2, pp=1, dp=1)
AUTO_EVERY, AUTO_CUT, AUTO_STEPS_AFTER = 2, 3, 2
STAY, LEAVER, JOINER = 0, 1, 2


def _dropout_config() -> Any:
    return _config(hidden_dropout=0.1, attention_dropout=0.1)


def _auto_devices() -> Any:
    from liver.shared.layout import Device

    return tuple(Device("node0", i) for i in range(3))


def _auto_plan() -> Any:
    from liver.reshard.plan import WorldConfig
    from liver.reshard.planner import build_plan
    from liver.shared.layout import Placement

    devices = _auto_devices()
    old = WorldConfig(AUTO_LAYOUT, Placement((devices[STAY], devices[LEAVER])))
    new = WorldConfig(AUTO_LAYOUT, Placement((devices[STAY], devices[JOINER])))
    return build_plan(SPEC, old, new, budget_bytes=1 << 20, optimizer=True)


def _auto_job(proc: Proc, root: str, plan: Any) -> dict[str, Any]:
    from liver.shared.logs import configure_logging
    from liver.worker_runtime.megatron.checkpoint import latest_checkpoint, load_checkpoint
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.state import local_state, rng_state
    from liver.worker_runtime.runtime import CheckpointOptions, LiveRuntime, RuntimeOptions
    from liver.worker_runtime.world import StoreAddress, WorldSpec, build_world

    configure_logging(level="CRITICAL")
    devices = _auto_devices()
    address = StoreAddress("127.0.0.1", proc.store.port)
    job = MegatronJob(SPEC, _dropout_config())
    events: list[str] = []

    def die(generation: int, layer: int, rnd: int) -> None:
        os._exit(0)

    runtime = LiveRuntime(
        job,
        job=AUTO_JOB,
        device=devices[proc.rank],
        store=address,
        initial=None
        if proc.rank == JOINER
        else WorldSpec(job=AUTO_JOB, generation=0, layout=AUTO_LAYOUT, placement=plan.old.placement),
        options=RuntimeOptions(
            control_timeout_s=PEER_TIMEOUT_S,
            build_timeout_s=PEER_TIMEOUT_S,
            checkpoint=CheckpointOptions(root=root, every=AUTO_EVERY),
        ),
        on_event=lambda e: events.append(f"{e.generation}:{e.phase}"),
        on_stream_step=die if proc.rank == LEAVER else None,
    )
    out: dict[str, Any] = {}
    if proc.rank == JOINER:
        runtime.request_resize(1, AUTO_LAYOUT, plan.new.placement, plan, address)
        trainer = runtime.step()  # warms up, joins, fails with the others, falls back
    else:
        trainer = runtime.step()
        runtime.request_resize(1, AUTO_LAYOUT, plan.new.placement, plan, address, switch_when_ready=False)
        # Groups built before the first boundary: the new trainer is built there, the cut waits for SWITCH.
        assert runtime.wait_prepared(180), "the handoff's groups were not built"
        while trainer.iteration < AUTO_CUT:
            trainer.train_step()
            if trainer.iteration < AUTO_CUT:
                trainer = runtime.step()
        out["listing_at_cut"] = sorted(os.listdir(root))
        runtime.allow_switch(1)  # both old ranks, at the same boundary: the cut is at AUTO_CUT
        trainer = runtime.step()  # the cut at AUTO_CUT: the handoff fails, the job falls back
    out["rng_after_fallback"] = rng_state()
    out["position"] = (trainer.iteration, trainer.consumed_samples, trainer.scheduler.num_steps)
    out["trace"] = _trace([trainer.train_step() for _ in range(AUTO_STEPS_AFTER)])
    out["world"] = (runtime.world.generation, runtime.world.rank, runtime.world.layout)
    out["fallbacks"] = [msgspec.to_builtins(r) for r in runtime.fallbacks]
    out["events"] = events
    rank = runtime.world.rank
    runtime.close()

    # The reference: the checkpoint's state and progress, resumed as a live switch resumes a trainer.
    new_devices = plan.new.placement
    world = build_world(
        WorldSpec(job="auto-reference", generation=0, layout=AUTO_LAYOUT, placement=new_devices),
        devices[proc.rank],
        address,
        timeout=timedelta(seconds=120),
    )
    world.adopt_as_default(timedelta(seconds=PEER_TIMEOUT_S))
    loaded = job.build(world)
    manifest = load_checkpoint(loaded, latest_checkpoint(root))  # a plain restart, not a move
    out["rng_after_plain_load"] = rng_state()
    state = {i: t.clone() for i, t in local_state(loaded).items()}
    resumed = job.build(world)
    job.resume(resumed, state, msgspec.json.encode(manifest.progress))
    out["rng_after_live_resume"] = rng_state()
    out["reference_trace"] = _trace([resumed.train_step() for _ in range(AUTO_STEPS_AFTER)])
    out["reference_rank"] = world.rank
    assert world.rank == rank
    world.release()
    return out


@pytest.fixture(scope="module")
def automatic(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    root = tmp_path_factory.mktemp("automatic")
    outcomes = run_world(
        _auto_job,
        3,
        (str(root), _auto_plan()),
        timeout_s=420,
        wait_for={STAY, JOINER},
        group_timeout_s=PEER_TIMEOUT_S,
    )
    assert outcomes[LEAVER].status == "died", outcomes[LEAVER]
    return {proc: outcomes[proc].unwrap() for proc in (STAY, JOINER)}


def test_a_handoff_that_loses_an_old_rank_falls_back_to_the_checkpoint_on_the_new_world(
    automatic: dict[int, dict[str, Any]],
) -> None:
    assert automatic[STAY]["listing_at_cut"] == ["iter_0000002", "latest"]
    for proc, new_rank in ((STAY, 0), (JOINER, 1)):
        found = automatic[proc]
        assert found["world"] == (2, new_rank, AUTO_LAYOUT)  # the failed generation + 1
        [fallback] = found["fallbacks"]
        assert fallback["failed_generation"] == 1 and fallback["generation"] == 2
        assert fallback["checkpoint"].endswith("iter_0000002")
        assert (fallback["iteration"], fallback["reached_iteration"], fallback["steps_lost"]) == (2, 3, 1)
        assert found["position"] == (2, 2 * GLOBAL_BATCH, 2 * GLOBAL_BATCH)


def test_the_stayer_reports_the_fallback_first_as_a_failed_handoff_then_as_the_restart(
    automatic: dict[int, dict[str, Any]],
) -> None:
    assert automatic[STAY]["events"] == ["1:preparing", "1:ready", "1:falling_back", "2:fell_back"]
    assert automatic[JOINER]["events"][-2:] == ["1:falling_back", "2:fell_back"]


def test_after_the_automatic_fallback_the_losses_equal_the_live_paths_load_of_that_checkpoint_bit_for_bit(
    automatic: dict[int, dict[str, Any]],
) -> None:
    for proc in (STAY, JOINER):
        assert automatic[proc]["trace"] == automatic[proc]["reference_trace"]


def test_a_fallback_and_a_live_switch_into_the_same_layout_leave_identical_random_streams(
    automatic: dict[int, dict[str, Any]],
) -> None:
    for proc in (STAY, JOINER):
        assert automatic[proc]["rng_after_fallback"] == automatic[proc]["rng_after_live_resume"]


def test_a_fallback_reseeds_even_at_the_saved_layout_where_a_plain_restart_continues_the_saved_streams(
    automatic: dict[int, dict[str, Any]],
) -> None:
    # The joiner's rank 1 was the lost process's: a plain restart would hand it that process's streams.
    for proc in (STAY, JOINER):
        assert automatic[proc]["rng_after_fallback"] != automatic[proc]["rng_after_plain_load"]
