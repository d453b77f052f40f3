"""What makes a checkpoint durable and which one a restart uses: the manifest, the ``latest`` marker,
pruning and the RNG policy. No Megatron here: these rules are files and metadata (the multi-process
save, load and fail-stop tests are in ``test_checkpoint_fallback.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS
from liver.worker_runtime.megatron.checkpoint import (
    LATEST,
    MANIFEST,
    SCHEMA_VERSION,
    CheckpointError,
    CheckpointManifest,
    PeriodicCheckpoints,
    checkpoint_name,
    latest_checkpoint,
    prune_checkpoints,
    read_manifest,
    rng_streams_for,
)
from liver.worker_runtime.megatron.state import RngState, SchedulerState, TrainingProgress
from liver.worker_runtime.megatron.train_config import TrainConfig

TP2PP2 = ParallelLayout(tp=2, pp=2, dp=1)


def _stream(rank: int) -> RngState:
    return RngState(
        torch_cpu=bytes([rank]), tracker={"model-parallel-rng": bytes([rank])}, python=(3, (rank,), None)
    )


def _manifest(at: int = 6, layout: ParallelLayout = TP2PP2, **changes: Any) -> CheckpointManifest:
    """A valid manifest of a checkpoint taken after ``at`` steps, with ``changes`` applied."""
    fields: dict[str, Any] = dict(
        schema=SCHEMA_VERSION,
        format="megatron-core dist_checkpointing torch_dist/1",
        iteration=at,
        model=PRESETS["tiny-gpt"].geometry(),
        layout=layout,
        config=TrainConfig(),
        progress=TrainingProgress(
            iteration=at,
            consumed_samples=8 * at,
            global_batch_size=8,
            scheduler=SchedulerState(
                max_lr=5e-3,
                min_lr=5e-4,
                lr_warmup_steps=8,
                lr_decay_steps=8000,
                lr_decay_style="cosine",
                num_steps=8 * at,
                start_wd=0.01,
                end_wd=0.01,
                wd_incr_steps=8000,
                wd_incr_style="constant",
            ),
        ),
        rng=tuple(_stream(r) for r in range(layout.world_size)),
        adam_step=at,
        saved_at=1.7e9,
        save_seconds=0.5,
    )
    fields.update(changes)
    return CheckpointManifest(**fields)


def _commit(root: Path, iteration: int, *, marker: bool = True) -> Path:
    """A checkpoint directory as a save leaves it (tensor files stand in as one empty file)."""
    path = root / checkpoint_name(iteration)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"")
    (path / MANIFEST).write_bytes(msgspec.json.encode(_manifest(iteration)))
    if marker:
        (root / LATEST).write_text(path.name + "\n")
    return path


def test_a_manifest_survives_a_json_round_trip() -> None:
    manifest = _manifest()
    assert msgspec.json.decode(msgspec.json.encode(manifest), type=CheckpointManifest) == manifest


def test_a_manifest_with_a_stream_missing_for_some_rank_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"rng: 3 streams for the 4 ranks of TP2,PP2,DP1"):
        _manifest(rng=tuple(_stream(r) for r in range(3)))


def test_a_manifest_whose_iteration_disagrees_with_its_progress_is_refused() -> None:
    with pytest.raises(ValueError, match=r"iteration: 7 disagrees with progress\.iteration 6"):
        _manifest(6, iteration=7)


def test_a_manifest_of_another_schema_version_is_refused_on_read(tmp_path: Path) -> None:
    raw = msgspec.json.decode(msgspec.json.encode(_manifest()))
    raw["schema"] = SCHEMA_VERSION + 1
    path = tmp_path / checkpoint_name(6)
    path.mkdir()
    (path / MANIFEST).write_bytes(msgspec.json.encode(raw))
    with pytest.raises(CheckpointError, match="schema"):
        read_manifest(path)


def test_a_directory_without_a_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"no {MANIFEST}"):
        read_manifest(tmp_path)


def test_checkpoint_names_sort_in_iteration_order() -> None:
    names = [checkpoint_name(i) for i in (9, 10, 1_000_000, 99)]
    assert sorted(names) == [checkpoint_name(i) for i in (9, 10, 99, 1_000_000)]


def test_there_is_no_latest_checkpoint_before_the_first_commit(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None


def test_the_latest_checkpoint_is_the_one_the_marker_names(tmp_path: Path) -> None:
    _commit(tmp_path, 4)
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000004"


def test_a_save_that_crashed_before_its_marker_moved_leaves_the_previous_checkpoint_latest(
    tmp_path: Path,
) -> None:
    _commit(tmp_path, 4)
    (tmp_path / ".tmp-iter_0000006").mkdir()  # crashed while ranks wrote
    _commit(tmp_path, 8, marker=False)  # crashed between the rename and the marker
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000004"


def test_a_marker_naming_a_missing_checkpoint_raises_instead_of_falling_back_further(tmp_path: Path) -> None:
    _commit(tmp_path, 4)
    (tmp_path / LATEST).write_text("iter_0000006\n")
    with pytest.raises(CheckpointError, match="iter_0000006"):
        latest_checkpoint(tmp_path)


def test_a_marker_holding_something_else_than_a_checkpoint_name_is_refused(tmp_path: Path) -> None:
    (tmp_path / LATEST).write_text("../elsewhere\n")
    with pytest.raises(CheckpointError, match="not a checkpoint name"):
        latest_checkpoint(tmp_path)


def test_pruning_keeps_the_latest_and_the_ones_before_it_up_to_keep_last(tmp_path: Path) -> None:
    for iteration in (2, 4, 6):
        _commit(tmp_path, iteration)
    assert prune_checkpoints(tmp_path, keep_last=2) == ["iter_0000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "iter_0000006", LATEST]


def test_pruning_removes_leftovers_of_crashed_saves_but_never_the_latest(tmp_path: Path) -> None:
    _commit(tmp_path, 4)
    _commit(tmp_path, 6)
    (tmp_path / LATEST).write_text("iter_0000004\n")  # 6 was renamed but never committed
    (tmp_path / ".tmp-iter_0000008").mkdir()
    assert sorted(prune_checkpoints(tmp_path, keep_last=1)) == [".tmp-iter_0000008", "iter_0000006"]
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000004"


def test_a_load_at_the_saved_layout_continues_each_ranks_own_streams() -> None:
    manifest = _manifest(layout=TP2PP2)
    assert [rng_streams_for(manifest, TP2PP2, rank) for rank in range(4)] == [_stream(r) for r in range(4)]


def test_a_load_at_any_other_layout_reseeds_instead_of_reusing_a_stream_of_another_place() -> None:
    manifest = _manifest(layout=TP2PP2)
    for other in (
        ParallelLayout(tp=4, pp=1, dp=1),
        ParallelLayout(tp=2, pp=2, dp=2),
        ParallelLayout(tp=2, pp=2, dp=1, stage_layers=(1, 3)),
    ):
        assert rng_streams_for(manifest, other, 0) is None, other.describe()


def test_periodic_checkpoints_refuse_a_period_below_one() -> None:
    with pytest.raises(ValueError, match="every"):
        PeriodicCheckpoints("/nonexistent", every=0)
