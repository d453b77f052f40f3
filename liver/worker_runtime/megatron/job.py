"""A Megatron-core GPT job as the live runtime sees it: the runtime's ``TrainerFactory`` for
:class:`~.trainer.MegatronTrainer`.

It ties the adapter's pieces to the runtime: build a trainer on a LiveR world, warm one up under a mock
world, read and load its local state, and carry its progress. :meth:`MegatronJob.resume` is the one
way a fresh trainer continues from a given state, used by the live switch and by any restart that
loads a gathered or checkpointed state, so that both continue identically.

How a resumed trainer's random streams are set: :mod:`.streams`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping

import msgspec
import structlog
import torch

from liver.reshard.holdings import pieces_of
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import ParallelLayout
from liver.shared.model import ModelSpec
from liver.worker_runtime.contract import KeptState
from liver.worker_runtime.megatron.build import groups_from_world, initialize_parallel_state
from liver.worker_runtime.megatron.data import Corpus
from liver.worker_runtime.megatron.source import ModelSource, UserProvider, as_source
from liver.worker_runtime.megatron.state import (
    RngState,
    TrainingProgress,
    load_local_state,
    local_state,
    restore_progress,
    restore_rng_state,
    rng_state,
    training_progress,
)
from liver.worker_runtime.megatron.streams import resume_streams
from liver.worker_runtime.megatron.train import TrainerHooks, build_trainer
from liver.worker_runtime.megatron.train_config import TrainConfig
from liver.worker_runtime.megatron.trainer import MegatronTrainer
from liver.worker_runtime.mock_warmup import WarmupReport, mock_warmup
from liver.worker_runtime.peers import StepAbandoned
from liver.worker_runtime.stream.executor import LocalTensor
from liver.worker_runtime.world import World

log = structlog.get_logger(__name__)


class MegatronJob:
    """Builds, warms up, reads and resumes :class:`MegatronTrainer` s of one model and training config."""

    def __init__(
        self,
        model: ModelSpec | ModelSource,
        config: TrainConfig,
        *,
        corpus: Corpus | None = None,
        warmup_steps: int = 1,
        hooks: TrainerHooks | None = None,
        check_layouts: bool = True,
    ) -> None:
        if warmup_steps < 1:
            raise ValueError(f"`warmup_steps`: must be at least 1, got {warmup_steps}")
        self.source = as_source(model)
        self.config = config
        self._model = self.source.geometry.with_ddp(config.ddp)
        self.corpus = corpus
        self.warmup_steps = warmup_steps
        self.hooks = hooks
        self.check_layouts = check_layouts

    @property
    def model(self) -> ModelGeometry:
        """What the plans for this job must move (the runtime checks each plan against it): the model's
        geometry with this job's DDP settings (the distributed optimizer shards its state over DP)."""
        return self._model

    def build(self, world: World) -> MegatronTrainer:
        return build_trainer(
            self.source,
            world.layout,
            self.config,
            groups=groups_from_world(world),
            corpus=self.corpus,
            hooks=self.hooks,
        )

    def build_for_stream(self, world: World) -> MegatronTrainer:
        """A trainer the switch streams the whole state into, built before the cut: a preset's weights
        are not initialised (the stream overwrites every value; the storage is zeroed before the cut, so
        vocabulary padding is zero as in every build). A user's provider builds as it always does."""
        return build_trainer(
            self.source,
            world.layout,
            self.config,
            groups=groups_from_world(world),
            corpus=self.corpus,
            hooks=self.hooks,
            initialize=False,
        )

    def storage(self, trainer: MegatronTrainer) -> list[torch.Tensor]:
        """Every tensor the trainer allocated: parameters, master weights, Adam moments and DDP buffers."""
        tensors = [t for value in local_state(trainer).values() for t in pieces_of(value)]
        buffers = [b for m in trainer.model_chunks for b in (*m.buffers, *m.expert_parallel_buffers)]
        for buffer in buffers:
            tensors.append(buffer.grad_data)
            if buffer.param_data is not None:
                tensors.append(buffer.param_data)
        return tensors

    def warm_up(self, layout: ParallelLayout, rank: int) -> WarmupReport:
        """Build and train a throw-away trainer as ``rank`` of ``layout`` under torch's fake backend.

        Megatron's ``parallel_state`` is built on the fake world for it and destroyed afterwards.
        """
        from megatron.core import parallel_state

        self.source.geometry.check_layout(layout)

        def build() -> MegatronTrainer:
            initialize_parallel_state(layout, gloo_groups=False)
            return build_trainer(self.source, layout, self.config, corpus=self.corpus, hooks=self.hooks)

        return mock_warmup(
            build,
            lambda trainer: trainer.train_step(),
            rank=rank,
            world_size=layout.world_size,
            steps=self.warmup_steps,
            teardown=lambda _: parallel_state.destroy_model_parallel(),
        )

    def check_layout(self, layout: ParallelLayout) -> None:
        """Before the cut, beside training: the user's model as Megatron builds it at ``layout`` (one rank
        of every stage and TP rank, meta device, fake process group, in a spawned interpreter) must be
        the geometry the plan moves; raises :class:`GeometryMismatch` naming the rank and parameter. A
        preset's build is checked against its views by parameter count at every build instead, and
        ``check_layouts=False`` skips it (the check costs an interpreter start and Megatron's import).
        When the check cannot run at all (the provider cannot be imported in a fresh interpreter) it is
        skipped with a warning: every build of the model is still checked, after the cut."""
        if not self.check_layouts or self.source.provider is None:
            return
        from liver.worker_runtime.megatron.geometry import (
            GeometryDerivationError,
            GeometryMismatch,
            in_subprocess,
        )

        provider = self.source.provider_ref or self.source.provider
        what = "checking the new layout's model"
        try:
            problem = in_subprocess(_layout_problem, (provider, self.source.geometry, layout), what, 600.0)
        except GeometryDerivationError as exc:  # the check itself could not run: the build checks later
            log.warning(
                "megatron_job.layout_check_skipped",
                layout=layout.describe(),
                reason=str(exc).splitlines()[0],
            )
            return
        if problem is not None:
            raise GeometryMismatch(problem)

    def iteration(self, trainer: MegatronTrainer) -> int:
        return trainer.iteration

    def abandoned(self, trainer: MegatronTrainer) -> StepAbandoned | None:
        """The trainer's step that met a lost peer (its state is the last completed iteration's), if any."""
        return trainer.abandoned

    def keep_state(self, trainer: MegatronTrainer) -> KeptState:
        """The state and progress of a trainer whose world broke, with the trainer's hold on that world's
        groups let go (see :class:`~liver.worker_runtime.contract.KeptState`)."""
        kept = KeptState(local_state(trainer), self.progress(trainer))
        trainer.drop_world()
        gc.collect()  # Megatron's modules hold reference cycles: the groups go only with a collection
        return kept

    def survives_one_loss(self, layout: ParallelLayout) -> bool:
        """Whether every piece of this job's state at ``layout`` has a copy on a second process, so that
        the survivors of any one lost process still hold all of it (else only the checkpoint restores
        it): the dense state needs a DP (or CP) replica, the experts an expert-DP one, and the optimizer
        state must be replicated with the parameters (the distributed optimizer gives each DP rank a
        shard of its own)."""
        if self.config.use_distributed_optimizer or layout.dp * layout.cp < 2:
            return False
        return self._model.num_experts == 0 or layout.edp >= 2

    def copy_state(self, trainer: MegatronTrainer) -> dict[int, LocalTensor]:
        """The trainer's state as :meth:`local_state` gives it but without its parameter gather (no
        collective: ranks call it at different times). What the peer copies read: the optimizer's
        pieces, and parameters only where no DP replica holds them, whose gather is a no-op."""
        return local_state(trainer)

    def gate_updates(self, trainer: MegatronTrainer, gate: Callable[[], object]) -> None:
        """Run ``gate`` right before each of ``trainer``'s updates (the peer copies wait there until
        their sender has read the state the last iteration left)."""
        trainer.before_update.append(gate)

    def abandon(self, trainer: MegatronTrainer, iteration: int, reason: str) -> StepAbandoned:
        """Mark the trainer's world broken between two steps (the vote or a checkpoint met a lost peer):
        its state is that of ``iteration``, torn only if parameters were waiting for a deferred
        all-gather."""
        trainer.abandoned = StepAbandoned(iteration, reason, torn=trainer.params_stale)
        return trainer.abandoned

    def local_state(self, trainer: MegatronTrainer) -> dict[int, LocalTensor]:
        """The trainer's state as the executor streams it. With ``overlap_param_gather`` a step leaves
        the parameters outside each rank's owned range stale until the next forward: they are gathered
        first (a collective over DP, which every rank of the world reaches at the same point: the cut)."""
        if trainer.abandoned is None:  # a broken world has no DP group to gather over (and a torn
            trainer.sync_params()  # state is never read)
        return local_state(trainer)

    def progress(self, trainer: MegatronTrainer) -> bytes:
        """The progress without this process's random streams (they are reseeded, see the docstring)."""
        return msgspec.json.encode(training_progress(trainer, with_rng=False))

    def resume(
        self,
        trainer: MegatronTrainer,
        state: Mapping[int, LocalTensor],
        progress: bytes | TrainingProgress,
    ) -> None:
        """Load ``state``, restore the progress and reseed: a fresh trainer continues from there."""
        if isinstance(progress, bytes):
            progress = msgspec.json.decode(progress, type=TrainingProgress)
        load_local_state(trainer, state)
        restore_progress(trainer, msgspec.structs.replace(progress, rng=None))
        resume_streams(self.config, progress.iteration, trainer.layout, trainer.groups.rank)
        log.debug(
            "megatron_job.resumed",
            layout=trainer.layout.describe(),
            rank=trainer.groups.rank,
            iteration=progress.iteration,
        )

    def save_checkpoint(self, trainer: MegatronTrainer, root: str, keep_last: int) -> str:
        """A durable ``dist_checkpointing`` checkpoint of ``trainer`` under ``root`` (a collective)."""
        from liver.worker_runtime.megatron.checkpoint import save_checkpoint

        return str(save_checkpoint(trainer, root, keep_last=keep_last))

    def resume_latest(self, world: World, root: str) -> tuple[MegatronTrainer, str] | None:
        """The first world's trainer from the latest checkpoint under ``root`` (the job was restarted),
        with that checkpoint's path; None when there is none (a first start). A collective over
        ``world``."""
        return self._restarted(world, root, None, required=False)

    def fall_back(
        self, world: World, root: str, reached_iteration: int | None
    ) -> tuple[MegatronTrainer, str]:
        """A trainer for ``world`` restarted from the latest checkpoint under ``root`` (I4's fail-stop
        branch); its random streams follow the move rule, as after a live switch."""
        restarted = self._restarted(world, root, reached_iteration, required=True)
        assert restarted is not None  # required: no checkpoint raised
        return restarted

    def _restarted(
        self, world: World, root: str, reached_iteration: int | None, *, required: bool
    ) -> tuple[MegatronTrainer, str] | None:
        from liver.worker_runtime.megatron.checkpoint import restart_from_checkpoint

        restarted = restart_from_checkpoint(
            root,
            self.source,
            world.layout,
            self.config,
            groups=groups_from_world(world),
            corpus=self.corpus,
            reached_iteration=reached_iteration,
            hooks=self.hooks,
            required=required,
        )
        return None if restarted is None else (restarted.trainer, str(restarted.checkpoint))

    def dispose(self, trainer: MegatronTrainer) -> None:
        """Free the storage of the parameters, master weights, Adam moments and DDP gradient buffers.

        Megatron's modules hold reference cycles (DDP's gradient hooks close over the wrapper), so
        dropping the trainer frees nothing until a full garbage collection. The trainer must never be
        used again.
        """
        freed = 0
        for tensor in self.storage(trainer):
            storage = tensor.untyped_storage()
            freed += storage.nbytes()
            storage.resize_(0)
        log.debug("megatron_job.disposed", layout=trainer.layout.describe(), freed_bytes=freed)

    def capture_rng(self) -> RngState:
        return rng_state()

    def restore_rng(self, captured: object) -> None:
        if not isinstance(captured, RngState):
            raise TypeError(f"`captured`: expected the RngState capture_rng returned, got {type(captured)}")
        restore_rng_state(captured)


def _layout_problem(
    provider: UserProvider | str, geometry: ModelGeometry, layout: ParallelLayout
) -> str | None:
    """In the spawned interpreter of :meth:`MegatronJob.check_layout`: what disagrees, or None. A
    provider loaded from a file comes by its reference (it is not importable by its module's name)."""
    from liver.worker_runtime.megatron.geometry import GeometryMismatch, check_layout_geometry
    from liver.worker_runtime.megatron.source import load_provider

    model = load_provider(provider) if isinstance(provider, str) else provider
    try:
        check_layout_geometry(model, geometry, layout)
    except GeometryMismatch as exc:
        return str(exc)
    return None


def load_job(reference: str, arguments: Mapping[str, str] | None = None) -> MegatronJob:
    """The user's job: ``make_job(**arguments)`` for the function ``FILE.py:FUNCTION`` (or
    ``MODULE:FUNCTION``) names, which returns a :class:`MegatronJob` (their provider, corpus, hooks and
    train config), as ``liver worker --job-factory`` runs it. :class:`InputError` names the flag:
    ``--job-factory`` for what cannot be loaded, called or returned, ``--job-arg`` for arguments the
    function does not take. A provider defined at the top of the same file gets its reference, so that
    the layout check before each cut can build it in another interpreter."""
    import dataclasses
    import inspect

    from liver.shared.errors import InputError
    from liver.worker_runtime.megatron.source import load_callable, reference_of

    arguments = dict(arguments or {})
    make = load_callable(reference, "--job-factory")
    try:
        inspect.signature(make).bind(**arguments)
    except TypeError as exc:
        raise InputError(f"--job-arg: {reference} does not take {sorted(arguments)}: {exc}") from None
    try:
        job = make(**arguments)
    except Exception as exc:
        raise InputError(f"--job-factory {reference}: raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(job, MegatronJob):
        raise InputError(f"--job-factory {reference}: returned {type(job).__name__}, not a liver.MegatronJob")
    source = job.source
    if source.provider is not None and source.provider_ref is None:
        found = reference_of(source.provider, reference)
        if found is not None:
            job.source = dataclasses.replace(source, provider_ref=found)
    return job
