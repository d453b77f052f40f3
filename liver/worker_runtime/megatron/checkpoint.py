"""Durable checkpoints of a Megatron training job, and the fail-stop fallback that restarts from them.

The live path (I1) never touches storage; this module is what the job falls back to when the live path
cannot finish (I4): a handoff whose old-world ranks are gone has lost state that only the old world
held, so the job restarts from its last durable checkpoint on the new layout. It is also the baseline
LiveR is measured against (``liver.bench.restart``).

Format: Megatron-core's ``dist_checkpointing`` (``torch_dist`` backend, torch DCP files), written from the
model's and the optimizer's own ``sharded_state_dict()``. Every tensor is stored once under its global
shape with each shard at its global offset, so a checkpoint saved at one (TP, PP, DP) loads into a
trainer built at any other: the load computes which part of which saved shard each new rank needs
(reshape on load). Vocabulary tensors are saved with the save-time padded vocabulary; the load reads the
rows both paddings share and zero-fills the rest (Megatron's ``allow_shape_mismatch``), which is exact
because padding rows are zero (see :mod:`.train`). The plain optimizer is Megatron's ``FP32Optimizer``
or mixed-precision ``Float16OptimizerWithFloat16Params``, whose state is parameter-shaped, so it reshards
exactly like the parameters. The distributed optimizer's state is saved in LiveR's own terms instead
(:func:`_owned_sharded_state`): each range a rank owns is a few boxes of the logical master weights and
moments, saved as irregular shards at their global offsets, so it too reshards TP, PP and DP on load,
with nothing gathered on one rank. Megatron's formats for it do not serve: its default fails in
megatron-core 0.16.1 ("ShardedTensor.flattened_range is not supported"), ``dp_reshardable`` reshards DP
only, and ``fully_reshardable`` gathers a stage's whole optimizer state on its DP rank 0 and, in 0.16.1,
corrupts a buffer of several buckets (NVIDIA/Megatron-LM#5077), which every pipelined model with tied
embeddings has.

Besides tensors, a checkpoint holds a manifest (``liver_manifest.json``): the model, the layout it was
saved at, the train config, the :class:`TrainingProgress` (iteration, data position, LR schedule) and
every saving rank's RNG streams. What a load does with them follows the one rule of
:func:`.streams.resume_streams`: a plain restart at the layout the checkpoint
was saved at restores each rank's own streams, so the job continues as if it had not stopped. At any
other layout no saved stream has a meaning (a stream belongs to a rank's place: its TP slice of a
dropout mask, its stage), and the fail-stop fallback is a move even at the saved layout (the devices
changed: a rank that replaced a lost one never held its streams); there every rank is reseeded from the
job's seed, the checkpoint's iteration and its new coordinates exactly as a live switch reseeds, so a
fallback and a live reshard into the same layout from the same iteration continue identically, with
dropout too.

Atomicity: ranks write into ``.tmp-iter_NNNNNNN``; when every rank has written, rank 0 writes the
manifest, syncs the files, renames the directory to ``iter_NNNNNNN`` and only then replaces the
``latest`` marker (write, sync, rename). A checkpoint is durable once ``latest`` names it; a crash at
any earlier point leaves the previous checkpoint as the latest. Old checkpoints beyond ``keep_last``
and leftovers of crashed saves are removed after the marker moves. The directory must be shared by
all ranks (a shared file system across nodes), as for any Megatron checkpoint.

Process groups: ``dist_checkpointing.save/load`` run their collectives on torch.distributed's default
world (``get_rank()``, ``barrier()``, ``all_gather_object`` without a group), so the trainer's world must
be the default one (checked, as for building). Everything that takes a group gets the trainer's own:
the model's ``dp_cp_group``, the fully parallel save's DP group. What Megatron still reads from
``parallel_state`` (the DP rank in the tied output layer's replica id) answers for the trainer's world
while the state dicts are built (:mod:`.pinned_state`), and every replica id is then checked against
the trainer's groups, so a stale ``parallel_state`` (the previous world's) can never decide what is
saved.

Writing: Megatron's default ``torch_dist`` writer starts a ``multiprocessing.Manager`` with the spawn
method and forks one writer process per file on every save. That cannot run in a daemonic process (the
test worlds) and restarts the training script without a ``__main__`` guard; here the same format is
written by torch DCP's synchronous ``FileSystemWriter`` in the training process (one file per rank,
fsynced), and read by Megatron's default ``torch_dist`` loader.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import msgspec
import structlog
import torch
import torch.distributed as dist
from torch.optim.optimizer import _get_scalar_dtype

from liver.reshard.dist_opt import shard_group
from liver.reshard.holdings import SHARDED_ROLES, holding, is_dp_sharded, pieces_of
from liver.reshard.views import grid_of
from liver.shared.errors import HandoffError
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import ParallelLayout
from liver.shared.model import ModelSpec
from liver.worker_runtime.megatron.state import (
    RngState,
    TrainingProgress,
    local_state,
    restore_progress,
    rng_state,
    training_progress,
)
from liver.worker_runtime.megatron.streams import resume_streams
from liver.worker_runtime.megatron.train_config import TrainConfig

if TYPE_CHECKING:  # Megatron is imported where it is used: the manifest and marker logic need none of it
    from megatron.core.dist_checkpointing.mapping import ShardedStateDict

    from liver.worker_runtime.megatron.build import ParallelGroups
    from liver.worker_runtime.megatron.data import Corpus
    from liver.worker_runtime.megatron.source import ModelSource
    from liver.worker_runtime.megatron.train import TrainerHooks
    from liver.worker_runtime.megatron.trainer import MegatronTrainer

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointManifest",
    "Fallback",
    "PeriodicCheckpoints",
    "check_replica_ids",
    "checkpoint_name",
    "latest_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "read_manifest",
    "restart_from_checkpoint",
    "rng_streams_for",
    "save_checkpoint",
]

log = structlog.get_logger(__name__)

SCHEMA_VERSION = 2
"""Version 2 records the model's geometry (version 1 a ``ModelSpec``): any model's checkpoint says what
it holds."""
MANIFEST = "liver_manifest.json"
LATEST = "latest"
FORMAT = "megatron-core dist_checkpointing torch_dist/1"
_NAME = re.compile(r"^iter_(\d{7,})$")
_TMP_PREFIX = ".tmp-"
T = TypeVar("T")


class CheckpointError(HandoffError):
    """A checkpoint that cannot be written, found, trusted or loaded as asked."""


class CheckpointManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a checkpoint holds besides its tensors; written last, so its presence means complete.

    ``rng`` holds every saving rank's streams in rank order of ``layout``; ``adam_step`` is the step
    every parameter's Adam state had. A load writes it into every parameter's state: Megatron keeps it
    in its common state only when it is not zero.
    """

    schema: int
    format: str
    iteration: int
    model: ModelGeometry
    layout: ParallelLayout
    config: TrainConfig
    progress: TrainingProgress
    rng: tuple[RngState, ...]
    adam_step: int
    saved_at: float
    save_seconds: float

    def __post_init__(self) -> None:
        if self.schema != SCHEMA_VERSION:
            raise ValueError(f"schema: version {self.schema}, this LiveR reads {SCHEMA_VERSION}")
        if self.iteration != self.progress.iteration:
            raise ValueError(
                f"iteration: {self.iteration} disagrees with progress.iteration {self.progress.iteration}"
            )
        if len(self.rng) != self.layout.world_size:
            raise ValueError(
                f"rng: {len(self.rng)} streams for the {self.layout.world_size} ranks of "
                f"{self.layout.describe()}"
            )
        if self.adam_step < 0:
            raise ValueError(f"adam_step must not be negative, got {self.adam_step}")


def checkpoint_name(iteration: int) -> str:
    """The directory name of the checkpoint taken after ``iteration`` steps."""
    if iteration < 0:
        raise ValueError(f"iteration must not be negative, got {iteration}")
    return f"iter_{iteration:07d}"


# --------------------------------------------------------------------------- files


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``path`` so that after a crash it holds either its old content or ``data``, never a mix."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(partial, path)
    _fsync_path(path.parent)


def read_manifest(checkpoint: str | os.PathLike[str]) -> CheckpointManifest:
    """The manifest of one checkpoint directory; raises :class:`CheckpointError` naming the problem."""
    path = Path(checkpoint) / MANIFEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint}: no {MANIFEST}; not a complete LiveR checkpoint") from None
    try:
        return msgspec.json.decode(data, type=CheckpointManifest, strict=True)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint the ``latest`` marker under ``root`` names, or ``None`` when none was committed.

    A marker that names a missing or incomplete checkpoint raises: it means the directory was changed
    behind the job's back, and silently falling back further would lose more steps than it should.
    """
    marker = Path(root) / LATEST
    try:
        name = marker.read_text().strip()
    except FileNotFoundError:
        return None
    if not _NAME.match(name):
        raise CheckpointError(f"{marker}: {name!r} is not a checkpoint name (iter_NNNNNNN)")
    path = Path(root) / name
    read_manifest(path)
    return path


def _checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def prune_checkpoints(root: str | os.PathLike[str], keep_last: int) -> list[str]:
    """Keep the latest checkpoint and the ``keep_last - 1`` committed before it; remove the rest.

    Also removed: leftovers of saves that crashed before their commit (``.tmp-`` directories, and
    checkpoints newer than the latest, which a crash between the rename and the marker leaves). Only
    call it while no save is in flight (saves are collective, so between them). Returns what it removed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    root = Path(root)
    latest = latest_checkpoint(root)
    if latest is None:
        return []
    latest_iteration = int(_NAME.match(latest.name).group(1))  # type: ignore[union-attr]
    removed = []
    committed = [(i, p) for i, p in _checkpoint_dirs(root) if i <= latest_iteration]
    stale = [p for _, p in committed[: max(len(committed) - keep_last, 0)]]
    stale += [p for i, p in _checkpoint_dirs(root) if i > latest_iteration]
    stale += [p for p in root.iterdir() if p.name.startswith(_TMP_PREFIX) and p.is_dir()]
    for path in stale:
        shutil.rmtree(path)
        removed.append(path.name)
    return removed


# --------------------------------------------------------------------------- sharded state dicts


_EXPERT_KEY = ".experts.experts."


def check_replica_ids(state: ShardedStateDict, groups: ParallelGroups) -> None:
    """Every shard's replica id must name this rank's DP rank (last entry; DP x CP, or expert-DP for an
    expert's shard) and, where it has one, its TP rank (expert-TP): a replica id computed from another
    world's groups would make the save keep the wrong copy (or none) of a replicated tensor, and the
    load check the wrong coverage."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    dense = (groups.dp_cp.rank(), groups.tp.rank())
    expert = (groups.edp.rank(), groups.etp.rank())
    for shard in nested_values(state):
        if not isinstance(shard, ShardedBase):
            continue
        replica = shard.replica_id
        if not isinstance(replica, tuple) or len(replica) != 3:
            raise CheckpointError(f"{shard.key}: replica id {replica!r} is not Megatron's (pp, tp, dp) form")
        # Megatron files experts under ``...mlp.experts.experts...``, replicated over expert-DP.
        dp_rank, tp_rank = expert if _EXPERT_KEY in shard.key else dense
        if replica[2] != dp_rank or replica[1] not in (0, tp_rank):
            raise CheckpointError(
                f"{shard.key}: replica id {replica} does not match this rank (TP rank {tp_rank}, DP rank "
                f"{dp_rank} of {groups.layout.describe()}); the state dict was built from stale groups"
            )


def _sharded_state_dict(trainer: MegatronTrainer, *, loading: bool) -> dict[str, Any]:
    from liver.worker_runtime.megatron.pinned_state import parallel_state_of

    groups = trainer.groups
    with parallel_state_of(groups):
        # Megatron-LM files model chunks under model0, model1, ...; the tensors' keys are global, so
        # a checkpoint saved with one VPP loads with another.
        models = {
            key: chunk.sharded_state_dict(metadata={"dp_cp_group": groups.dp_cp})
            for key, chunk in zip(_model_keys(trainer), trainer.chunks, strict=True)
        }
        if trainer.geometry.distributed or trainer.geometry.num_experts:
            state: dict[str, Any] = dict(models)
            check_replica_ids(state, groups)
            state[_OWNED] = _owned_sharded_state(trainer)
            return state
        # An MoE job at EP > 1 chains a dense and an expert optimizer; one at EP 1 has one. Without
        # Megatron's ``chained_<i>.`` prefixes every state tensor has the same key either way, so a
        # checkpoint saved at one EP loads at another (the fallback's reshape).
        optimizer = trainer.optimizer.sharded_state_dict(
            models, is_loading=loading, metadata={"chained_optim_avoid_prefix": True}
        )
    state = {**models, "optimizer": optimizer}
    check_replica_ids(state, groups)
    return state


def _model_keys(trainer: MegatronTrainer) -> list[str]:
    """The checkpoint's key of each model chunk, as Megatron-LM names them."""
    chunks = trainer.layout.vpp
    return ["model"] if chunks == 1 else [f"model{v}" for v in range(chunks)]


_OWNED = "liver_optimizer"
"""The distributed optimizer's master weights and moments, as LiveR's logical tensors (see below)."""


def _owned_sharded_state(trainer: MegatronTrainer) -> dict[str, list[Any]]:
    """The distributed optimizer's state (and a mixture of experts' optimizer state) as
    ``ShardedTensor`` s of LiveR's logical tensors.

    An MoE job's plain optimizer is one Megatron optimizer at EP 1 and a chain of a dense and an
    expert one at EP > 1, whose saved hyperparameters (``param_groups``) do not load across that
    change; as logical tensors its state loads at any layout (DP replicas save once, by replica id).

    Megatron's own formats for this optimizer either reshard DP only (``dp_reshardable``) or gather a
    stage's whole optimizer state on one rank and, in 0.16.1, corrupt a buffer of several buckets
    (``fully_reshardable``; the tied embedding of a pipelined model always has a bucket of its own).
    Each piece a rank owns (:mod:`liver.reshard.holdings`) is a box of its logical tensor, so it is saved
    as one irregular shard at its global offset (``axis_fragmentations=None``: DCP checks coverage) and
    a load at any layout reads the boxes it owns there. TP replicas of a replicated tensor and the tied
    embedding's copy on the last stage are saved by one rank only (replica ids); padding holds none.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    geometry, layout, rank = trainer.geometry, trainer.layout, trainer.groups.rank
    stage = layout.coords(rank).pp
    tensors = geometry.tensors()
    out: dict[str, list[Any]] = {}
    for index, value in local_state(trainer).items():
        t = tensors[index]
        if t.role not in SHARDED_ROLES:
            continue
        pieces = holding(t, geometry, layout, rank) or ()
        tp, _ep, replica, _pp = grid_of(t, layout).place(rank)
        tp_replica = tp if t.rule == "replicated" else 0
        pp_replica = int(t.home == "first+last" and stage == layout.pp - 1 and layout.pp > 1)
        # The distributed optimizer's owner of a piece is its main replica; with several instances of
        # it, only the first instance's (as Megatron's own formats: the instance index).
        group = shard_group(geometry, grid_of(t, layout).replicas)
        dp_replica = replica // group if is_dp_sharded(t, geometry) else replica
        shards = []
        for piece, local in zip(pieces, pieces_of(value)):
            if piece.box is None:
                continue
            data = local[tuple(slice(0, hi - lo) for lo, hi in piece.box)]
            shards.append(
                ShardedTensor(
                    key=f"{_OWNED}.{t.name}",
                    data=data,
                    dtype=data.dtype,
                    local_shape=tuple(data.shape),
                    global_shape=t.shape,
                    global_offset=tuple(lo for lo, _ in piece.box),
                    axis_fragmentations=None,
                    replica_id=(pp_replica, tp_replica, dp_replica),
                )
            )
        out[t.name] = shards
    return out


def _load_owned(targets: Mapping[str, list[torch.Tensor]], loaded: Mapping[str, list[torch.Tensor]]) -> None:
    """Write what a load read for :func:`_owned_sharded_state` into the live optimizer state: the
    ``targets`` are the views the request was made of (a load that read into them in place is done)."""
    with torch.no_grad():
        for name, views in targets.items():
            read = loaded.get(name, [])
            if len(read) != len(views):
                raise CheckpointError(
                    f"{name}: the load read {len(read)} pieces, this rank owns {len(views)}"
                )
            for view, data in zip(views, read):
                if view.data_ptr() != data.data_ptr():
                    view.copy_(data)


@functools.cache
def _in_process_torch_dist_save() -> type:
    """Megatron's ``torch_dist`` save, written by torch DCP in this process (see the module docstring).

    The state dict is translated exactly as Megatron's own strategy translates it (same keys, same
    main-replica filtering, same planner), so the files are the ``torch_dist`` format its loader reads.
    The class is made on first use so that importing this module does not import Megatron.
    """
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def __init__(self) -> None:
            super().__init__("torch_dist", 1, keep_only_main_replica=True, thread_count=1)

        def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            dcp_save(
                mcore_to_pyt_state_dict(flat, False),
                storage_writer=FileSystemWriter(checkpoint_dir, single_file_per_rank=True, sync_files=True),
                planner=MCoreSavePlanner(flatten_state_dict=False),
            )

    return InProcessTorchDistSave


def _save_strategy(groups: ParallelGroups) -> Any:
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    strategy = _in_process_torch_dist_save()()
    if groups.layout.dp > 1:
        # DP replicas hold the same shards: spread their writing over the DP group (an explicit group)
        # instead of letting DP rank 0 write everything.
        return FullyParallelSaveStrategyWrapper(strategy, parallelization_group=groups.dp)
    return strategy


def _adam_step(trainer: MegatronTrainer) -> int:
    step_index = next(i for i, t in enumerate(trainer.geometry.tensors()) if t.role == "step")
    return int(local_state(trainer)[step_index])


def _check_trainer(trainer: MegatronTrainer) -> None:
    from liver.worker_runtime.megatron.build import check_default_world

    check_default_world(trainer.groups)


# --------------------------------------------------------------------------- save


def _range_over_ranks(value: int) -> tuple[int, int]:
    """The smallest and the largest ``value`` over the default world (one all-reduce)."""
    values = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return -int(values[1]), int(values[0])


def _on_rank_zero(action: Callable[[], T], what: str) -> T | None:
    """Run a file-system step on rank 0 only and let every rank know whether it worked, so that a
    failure raises on all ranks instead of leaving the others waiting in the next collective."""
    result: T | None = None
    failure: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            result = action()
        except Exception as exc:  # reported to every rank below
            failure[0] = f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise CheckpointError(f"{what} failed on rank 0: {failure[0]}")
    return result


def save_checkpoint(trainer: MegatronTrainer, root: str | os.PathLike[str], *, keep_last: int = 2) -> Path:
    """Save the trainer's whole training state as ``root/iter_NNNNNNN`` and commit it as the latest.

    A collective over the trainer's world (every rank calls it at the same iteration). Returns the
    committed checkpoint's path once every rank knows it is durable.
    """
    from megatron.core import dist_checkpointing

    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    _check_trainer(trainer)
    started = time.perf_counter()
    root = Path(root)
    lowest, highest = _range_over_ranks(trainer.iteration)
    if lowest != highest:
        raise CheckpointError(f"the ranks are at iterations {lowest} to {highest}; a save is a collective")
    name = checkpoint_name(trainer.iteration)
    final, staging = root / name, root / f"{_TMP_PREFIX}{name}"
    if _latest_name(root) == name:  # every rank reads the marker: only saves move it
        raise CheckpointError(f"{final} is already the latest checkpoint; it is not overwritten")

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)  # a crashed save of the same iteration
        staging.mkdir()

    _on_rank_zero(prepare, f"preparing {staging}")
    trainer.sync_params()  # overlap_param_gather: the parameters other DP ranks updated, first
    state = _sharded_state_dict(trainer, loading=False)
    dist_checkpointing.save(state, str(staging), sharded_strategy=_save_strategy(trainer.groups))
    mine = rng_state()
    streams = [mine] * dist.get_world_size()
    dist.all_gather_object(streams, mine)
    manifest = CheckpointManifest(
        schema=SCHEMA_VERSION,
        format=FORMAT,
        iteration=trainer.iteration,
        model=trainer.geometry,
        layout=trainer.layout,
        config=trainer.config,
        progress=training_progress(trainer, with_rng=False),
        rng=tuple(streams),
        adam_step=_adam_step(trainer),
        saved_at=time.time(),
        save_seconds=time.perf_counter() - started,
    )

    def commit() -> list[str]:
        _write_durably(staging / MANIFEST, msgspec.json.encode(manifest))
        for path in staging.rglob("*"):
            if path.is_file():
                _fsync_path(path)
        if final.exists():  # renamed by a save that crashed before its marker: never committed
            shutil.rmtree(final)
        os.rename(staging, final)
        _fsync_path(root)
        _write_durably(root / LATEST, f"{name}\n".encode())
        return prune_checkpoints(root, keep_last)

    removed = _on_rank_zero(commit, f"committing {final}")
    log.info(
        "checkpoint.saved",
        rank=trainer.groups.rank,
        layout=trainer.layout.describe(),
        checkpoint=name,
        seconds=round(time.perf_counter() - started, 4),
        removed=removed,
    )
    return final


def _latest_name(root: Path) -> str | None:
    """The name the ``latest`` marker holds (unchecked), or ``None``."""
    try:
        return (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None


class PeriodicCheckpoints:
    """A checkpoint every ``every`` iterations, keeping the last ``keep_last``: call :meth:`after_step`
    once per iteration on every rank."""

    def __init__(self, root: str | os.PathLike[str], *, every: int, keep_last: int = 2) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.root = Path(root)
        self.every = every
        self.keep_last = keep_last

    def after_step(self, trainer: MegatronTrainer) -> Path | None:
        """Save when the trainer's iteration is a multiple of ``every``; the committed path, if saved."""
        if trainer.iteration == 0 or trainer.iteration % self.every:
            return None
        return save_checkpoint(trainer, self.root, keep_last=self.keep_last)


# --------------------------------------------------------------------------- load


def _check_compatible(manifest: CheckpointManifest, trainer: MegatronTrainer, path: Path) -> None:
    if manifest.model != trainer.geometry:
        differing = [
            f
            for f in ModelGeometry.__struct_fields__
            if getattr(manifest.model, f) != getattr(trainer.geometry, f)
        ]
        raise CheckpointError(f"{path}: saved for another model (model.{differing[0]} differs)")
    if manifest.config.global_batch_size != trainer.config.global_batch_size:
        raise CheckpointError(
            f"{path}: global_batch_size was {manifest.config.global_batch_size}, the trainer uses "
            f"{trainer.config.global_batch_size} (it must stay constant)"
        )
    if trainer.iteration != 0 or trainer.scheduler.num_steps != 0:
        raise CheckpointError("load_checkpoint needs a freshly built trainer that has not stepped")


def rng_streams_for(
    manifest: CheckpointManifest, layout: ParallelLayout, rank: int, *, moved: bool = False
) -> RngState | None:
    """The saved streams ``rank`` continues, or ``None`` when the job moved (a fallback) or the layout
    changed, and the rank must be reseeded instead (see the module docstring)."""
    if moved or layout != manifest.layout:
        return None
    return manifest.rng[rank]


def _set_adam_step(trainer: MegatronTrainer, step: int) -> None:
    """Megatron keeps the Adam step in the common state only when it is non-zero; write it into every
    parameter's state so that a checkpoint of step 0 loads into a usable optimizer too."""
    trainer.adam_steps = step
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        inner = opt.optimizer
        if inner is None:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param]["step"] = torch.tensor(float(step), dtype=_get_scalar_dtype())


def load_checkpoint(
    trainer: MegatronTrainer, checkpoint: str | os.PathLike[str], *, moved: bool = False
) -> CheckpointManifest:
    """Load a checkpoint saved at any layout into a freshly built trainer (a collective over its world).

    Parameters, master weights and Adam moments are read with reshape; the Adam step, the progress and
    (for a plain restart at the saved layout, see :func:`rng_streams_for`) the RNG streams come from the
    manifest. ``moved``: the job moved to other devices (the fallback), so the streams are reseeded as a
    live switch reseeds them. The loaded state is checked against the view function before it is
    returned.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    started = time.perf_counter()
    path = Path(checkpoint)
    manifest = read_manifest(path)
    _check_compatible(manifest, trainer, path)
    _check_trainer(trainer)
    state = _sharded_state_dict(trainer, loading=True)
    targets = {name: [shard.data for shard in shards] for name, shards in state.get(_OWNED, {}).items()}
    loaded = dist_checkpointing.load(state, str(path), strict=StrictHandling.RAISE_ALL)
    for key, chunk in zip(_model_keys(trainer), trainer.chunks, strict=True):
        chunk.load_state_dict(loaded[key], strict=True)
    if _OWNED in loaded:
        _load_owned(targets, loaded[_OWNED])
    else:
        trainer.optimizer.load_state_dict(loaded["optimizer"])
    _set_adam_step(trainer, manifest.adam_step)

    rng = rng_streams_for(manifest, trainer.layout, trainer.groups.rank, moved=moved)
    restore_progress(trainer, msgspec.structs.replace(manifest.progress, rng=None))
    resume_streams(manifest.config, manifest.iteration, trainer.layout, trainer.groups.rank, rng)
    local_state(trainer)  # the loaded state still agrees with the view function
    log.info(
        "checkpoint.loaded",
        rank=trainer.groups.rank,
        checkpoint=path.name,
        saved_layout=manifest.layout.describe(),
        layout=trainer.layout.describe(),
        rng="restored" if rng is not None else "reseeded",
        seconds=round(time.perf_counter() - started, 4),
    )
    return manifest


# --------------------------------------------------------------------------- fail-stop fallback


class Fallback(NamedTuple):
    """The job after a fail-stop fallback: a trainer on the new layout at the checkpoint's iteration."""

    trainer: MegatronTrainer
    checkpoint: Path
    manifest: CheckpointManifest
    steps_lost: int | None  # steps the old world had completed past the checkpoint, when known
    seconds: float  # agreement + build + load on this rank


_NO_CHECKPOINT, _UNREADABLE = -1, -2


def _agree_on_checkpoint(root: str | os.PathLike[str]) -> tuple[Path, CheckpointManifest]:
    """The latest checkpoint, agreed by every rank of the new world before any of them loads.

    Each rank reads the marker itself; a rank that finds none, cannot read it, or finds another one
    (a root that is not shared, a marker that moved) makes every rank raise, instead of some ranks
    loading while the others wait in a collective forever.
    """
    checkpoint, manifest = _agree_on_latest(root)
    if checkpoint is None or manifest is None:
        raise CheckpointError(f"{root}: no committed checkpoint; the job can only start over")
    return checkpoint, manifest


def _agree_on_latest(root: str | os.PathLike[str]) -> tuple[Path | None, CheckpointManifest | None]:
    """:func:`_agree_on_checkpoint`, where no checkpoint on every rank is an answer too (None)."""
    problem = ""
    checkpoint, manifest, iteration = None, None, _NO_CHECKPOINT
    try:
        checkpoint = latest_checkpoint(root)
        if checkpoint is not None:
            manifest = read_manifest(checkpoint)
            iteration = manifest.iteration
    except CheckpointError as exc:
        checkpoint, iteration, problem = None, _UNREADABLE, str(exc)
    lowest, highest = _range_over_ranks(iteration)
    if highest != lowest:
        raise CheckpointError(
            f"{root}: the ranks of the new world found different latest checkpoints (iterations "
            f"{lowest} to {highest}; -1: none, -2: unreadable{', here: ' + problem if problem else ''}); "
            "the checkpoint root must be shared and no save may run"
        )
    if problem:
        raise CheckpointError(problem)
    return checkpoint, manifest


def restart_from_checkpoint(
    root: str | os.PathLike[str],
    spec: ModelSpec | ModelSource,
    layout: ParallelLayout,
    config: TrainConfig,
    *,
    groups: ParallelGroups,
    corpus: Corpus | None = None,
    reached_iteration: int | None = None,
    hooks: TrainerHooks | None = None,
    required: bool = True,
) -> Fallback | None:
    """Restart the job on ``layout`` from the last durable checkpoint under ``root`` (invariant I4).

    For a handoff that cannot complete because ranks of the old world are gone: the survivors and any
    replacements have formed the new world (``groups``, adopted as the default world; the old world is
    the caller's to release) and call this together. Whatever the old world did after its last
    checkpoint is lost and redone (``reached_iteration``, the last step it completed, gives
    ``steps_lost``); the result trains exactly as a live switch into ``layout`` at the checkpoint's
    iteration would (the random streams are reseeded as after a move, even at the saved layout).
    Without a checkpoint it raises; with ``required=False`` it returns None instead (a restarted job's
    first start, as Megatron's ``--load`` of an empty directory). A collective over the default world;
    ranks that find different checkpoints raise."""
    from liver.worker_runtime.megatron.build import check_default_world
    from liver.worker_runtime.megatron.train import build_trainer

    started = time.perf_counter()
    check_default_world(groups)
    checkpoint, manifest = _agree_on_checkpoint(root) if required else _agree_on_latest(root)
    if checkpoint is None or manifest is None:
        return None
    steps_lost = None if reached_iteration is None else reached_iteration - manifest.iteration
    if steps_lost is not None and steps_lost < 0:
        raise CheckpointError(
            f"reached_iteration: {reached_iteration} is before the latest checkpoint ({manifest.iteration})"
        )
    trainer = build_trainer(spec, layout, config, groups=groups, corpus=corpus, hooks=hooks)
    load_checkpoint(trainer, checkpoint, moved=True)
    seconds = time.perf_counter() - started
    log.warning(
        "checkpoint.fallback" if required else "checkpoint.resumed",
        rank=groups.rank,
        checkpoint=checkpoint.name,
        iteration=manifest.iteration,
        steps_lost=steps_lost,
        saved_layout=manifest.layout.describe(),
        layout=layout.describe(),
        seconds=round(seconds, 4),
    )
    return Fallback(trainer, checkpoint, manifest, steps_lost, seconds)
