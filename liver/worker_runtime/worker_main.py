"""One LiveR training process on the bus: what ``liver worker`` runs.

The pieces, in the order they start:

1. **A rendezvous store.** Every worker hosts a TCPStore at the address it announces in its ``Hello``
   (``host:port``). The coordinator names the store of the worker that runs rank 0 of a new generation
   in that generation's ``Prepare``, and every process of both worlds builds the shadow world and the
   stream group on it; the job's first world uses the store of its rank 0 (``InitialWorld.store``, or
   this process's own when it is rank 0). No store outlives the process that hosts it, and none has to:
   a generation's groups only use their store while they are built.
2. **The runtime**: a :class:`~.runtime.LiveRuntime` over a
   :class:`~liver.worker_runtime.megatron.job.MegatronJob` (a Megatron-core GPT on gloo, synthetic data),
   starting in the first world or, for a standby worker, in none (its first :meth:`~.runtime.LiveRuntime.step`
   waits until a scale-out takes it in).
3. **The companion** (:class:`~liver.worker_runtime.companion.thread.Companion`, its own thread and NATS
   connection): hello, heartbeats, commands. :class:`~liver.worker_runtime.companion.bridge.RuntimeBridge`
   turns commands into runtime calls and runtime events into acks.
4. **The loop**: ``step()`` at every iteration boundary, ``train_step()`` in between, a metrics line per
   step (:mod:`.metrics`). Rank 0 of the first world announces it (``WorldStarted``) once it is built.

Checkpoints (``checkpoint_dir``, optional): the runtime saves one every ``checkpoint_every`` iterations
and, when a handoff fails because processes of the old world are gone, restarts the new world from the
latest one (:mod:`.fallback`): this worker acks the generation "failed" at once (the coordinator records
a checkpoint fallback), and once the restarted world (the failed generation + 1) has loaded, its rank 0
announces it with ``WorldStarted`` and every member's heartbeats speak for it. Without a directory such
a failure ends the worker (exit 1) with an error that says no checkpoint was configured. A worker whose
first world finds a checkpoint there starts from the latest one (the job was restarted, for instance
after ``NoLiveRecovery``: its launcher starts every process again, with a ``generation`` above the
job's last issued one so that the coordinator records the new world); ``checkpoint_resume=False``
(``--fresh-start``) starts from scratch instead.

How a worker ends. All ranks of a world must stop at the same boundary, or the ones still training wait
in a collective for the ones gone; so a worker stops only on a rule every rank evaluates alike: after
``max_steps`` iterations, or at the iteration written in ``stop_file`` (whoever stops the job writes an
iteration a few steps ahead of the furthest rank). A worker that leaves in a scale-in exits 0 after its
"switched" ack is out. SIGTERM/SIGINT stop the process at once (exit 0, no teardown of groups whose
peers may already be gone); any failure exits 1 after reporting it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any, Final

import msgspec
import structlog
from msgspec import Meta

from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.messages import WorkerPhase, WorldStarted
from liver.shared.model import PRESETS, as_geometry
from liver.shared.subjects import validate_token
from liver.worker_runtime.megatron.train_config import TrainConfig
from liver.worker_runtime.metrics import Aborted, MetricsLog, Started, Step, Stopped, Switched

if TYPE_CHECKING:
    from liver.worker_runtime.companion.thread import Companion
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.runtime import LiveRuntime, RuntimeEvent, RuntimeOptions

log = structlog.get_logger(__name__)

_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_-]")
"""Characters a node id may have and a worker id (a subject token) may not."""

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1

DEMO_TRAIN: Final = TrainConfig(global_batch_size=4, micro_batch_size=1, seq_length=16)
"""A training setup small enough for CPU workers: every layout of up to 4 ranks divides its batch."""


class WorkerStopped(BaseException):
    """SIGTERM or SIGINT arrived: leave now (a BaseException, so no ``except Exception`` swallows it)."""


class InitialWorld(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The world the job starts in, as its launcher gives it to every process of it."""

    generation: Annotated[int, Meta(ge=0)] = 0
    layout: ParallelLayout
    placement: Placement
    store: str | None = None
    """``host:port`` of rank 0's store; None only in the process that is rank 0 (it hosts it)."""
    announce: bool = True
    """Rank 0 publishes ``WorldStarted`` once the world is built."""


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything one training process needs besides the bus URL and credentials."""

    job_id: str
    node: str
    device: Annotated[int, Meta(ge=0)]
    worker_id: str = ""
    """Empty: ``w-<node>-<device>``, which is unique per device and stable across restarts."""
    model: str = "tiny-gpt"
    """A preset on synthetic data (the demo's job), unless ``job_factory`` names the user's own job."""
    train: TrainConfig = DEMO_TRAIN
    """The preset's training setup (a user's job brings its own)."""
    job_factory: str | None = None
    """``FILE.py:FUNCTION`` or ``MODULE:FUNCTION``: the user's function that returns their
    :class:`~liver.worker_runtime.megatron.job.MegatronJob` (model provider, corpus, hooks, train config)."""
    job_args: dict[str, str] = {}
    """Keyword arguments (strings) the job factory is called with."""
    host: str = "127.0.0.1"
    """Where this worker's store listens and what it announces (other workers must reach it)."""
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    """The store's port; 0: any free port (fine for every process but the first world's rank 0)."""
    initial: InitialWorld | None = None
    """None: a standby worker, in no world until a scale-out takes it in."""
    metrics: str | None = None
    max_steps: Annotated[int, Meta(ge=1)] | None = None
    stop_file: str | None = None
    heartbeat_s: Annotated[float, Meta(gt=0)] = 2.0
    memory_bytes: Annotated[int, Meta(ge=1)] | None = None
    control_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    build_timeout_s: Annotated[float, Meta(gt=0)] = 120.0
    switch_grace_s: Annotated[float, Meta(ge=0)] = 60.0
    announce_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    threads: Annotated[int, Meta(ge=1)] = 1
    """torch intra-op threads: several workers share a host's cores."""
    checkpoint_dir: str | None = None
    """Shared directory of the job's checkpoints; None: no checkpoints and no fallback to one."""
    checkpoint_every: Annotated[int, Meta(ge=1)] | None = None
    """Save every N iterations (None: never save here; a fallback still loads what is in the directory)."""
    checkpoint_keep: Annotated[int, Meta(ge=1)] = 2
    checkpoint_resume: bool = True
    """A first world that finds a checkpoint in ``checkpoint_dir`` starts from the latest one (the job
    was restarted); False: from scratch."""
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    """Serve the companion's Prometheus metrics on this port (0: a free one); None: none."""
    copies: bool = True
    """Keep peer copies of the state a node would take with it (``RuntimeOptions.copies``); the first
    world's announcement tells the planners, so a job without them is never planned from them."""
    copies_host_bytes: Annotated[int, Meta(ge=0)] | None = None
    """Host memory this process's peer copies may take (``CopyOptions.host_budget_bytes``; None: half
    the host's available memory over the world's processes on it)."""
    copies_go_back: bool = False
    """The peer copies also keep this process's own state of the last two refreshes, so that a loss in
    a copy's refresh goes back a step instead of to the checkpoint (``CopyOptions.go_back``)."""

    def __post_init__(self) -> None:
        validate_token(self.job_id, "job_id")
        if self.checkpoint_dir is not None and not self.checkpoint_dir:
            raise ValueError("`checkpoint_dir`: must not be empty (leave it out for no checkpoints)")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("`checkpoint_every`: needs `checkpoint_dir`, where the checkpoints go")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"`metrics_port`: {self.metrics_port} is not a port number (0-65535)")
        if self.copies_host_bytes is not None and self.copies_host_bytes < 0:
            raise ValueError(f"`copies_host_bytes`: must not be negative, got {self.copies_host_bytes}")
        if not self.copies and (self.copies_go_back or self.copies_host_bytes is not None):
            field = "copies_go_back" if self.copies_go_back else "copies_host_bytes"
            raise ValueError(f"`{field}`: an option of the peer copies, which `copies` turns off")
        if self.worker_id:
            validate_token(self.worker_id, "worker_id")
        if self.job_factory is None and self.model not in PRESETS:
            raise ValueError(f"`model`: unknown preset {self.model!r}; presets: {', '.join(sorted(PRESETS))}")
        if self.job_factory is None and self.job_args:
            raise ValueError("`job_args`: arguments of a job factory, but no `job_factory` is given")
        if self.initial is not None:
            rank = self.initial.placement.rank_on().get(self.device_id)
            if rank is None:
                raise ValueError(
                    f"`initial.placement`: device {self.device_id} has no rank in the initial world; "
                    "start it as a standby worker instead"
                )
            if rank != 0 and self.initial.store is None:
                raise ValueError("`initial.store`: needed by every rank but 0 (rank 0's store address)")
            if self.job_factory is None:  # a user's job is checked once it is made (make_job)
                try:
                    PRESETS[self.model].check_layout(self.initial.layout)
                    self.train.micro_batches_per_rank(self.initial.layout.dp)
                except ValueError as exc:
                    raise ValueError(f"`initial.layout`: {exc}") from None

    @property
    def device_id(self) -> Device:
        return Device(self.node, self.device)

    @property
    def name(self) -> str:
        return self.worker_id or _UNSAFE.sub("_", f"w-{self.node}-{self.device}")[:128]

    def runtime_options(self) -> RuntimeOptions:
        """How this worker's runtime waits, and where it checkpoints."""
        from liver.worker_runtime.copies.manager import CopyOptions
        from liver.worker_runtime.fallback import CheckpointOptions
        from liver.worker_runtime.runtime import RuntimeOptions

        checkpoint = None
        if self.checkpoint_dir is not None:
            checkpoint = CheckpointOptions(
                root=self.checkpoint_dir,
                every=self.checkpoint_every,
                keep_last=self.checkpoint_keep,
                resume=self.checkpoint_resume,
            )
        copies = (
            CopyOptions(go_back=self.copies_go_back, host_budget_bytes=self.copies_host_bytes)
            if self.copies
            else None
        )
        return RuntimeOptions(
            control_timeout_s=self.control_timeout_s,
            build_timeout_s=self.build_timeout_s,
            checkpoint=checkpoint,
            copies=copies,
        )

    def make_job(self) -> MegatronJob:
        """The job this worker trains: the preset on synthetic data, or the user's own job from its
        factory; its first layout checked against it (``ValueError`` naming ``initial.layout``)."""
        from liver.worker_runtime.megatron.job import MegatronJob, load_job

        if self.job_factory is None:
            return MegatronJob(PRESETS[self.model], self.train)
        job = load_job(self.job_factory, self.job_args)
        if self.initial is not None:
            try:
                job.model.check_layout(self.initial.layout)
                job.config.micro_batches_per_rank(self.initial.layout.dp)
            except ValueError as exc:
                raise ValueError(f"`initial.layout`: {exc}") from None
        return job

    @property
    def initial_rank(self) -> int | None:
        return None if self.initial is None else self.initial.placement.rank_on()[self.device_id]


class StopRule:
    """When to stop training: the same answer on every rank at the same iteration (module docstring)."""

    def __init__(self, max_steps: int | None, stop_file: str | None) -> None:
        self.max_steps = max_steps
        self.stop_file = Path(stop_file) if stop_file else None

    def why(self, iteration: int) -> str | None:
        """``steps`` or ``stop_file`` once ``iteration`` completed steps are enough; else None."""
        if self.max_steps is not None and iteration >= self.max_steps:
            return "steps"
        at = self._file_iteration()
        if at is not None and iteration >= at:
            return "stop_file"
        return None

    def _file_iteration(self) -> int | None:
        if self.stop_file is None:
            return None
        try:
            text = self.stop_file.read_text().strip()
        except FileNotFoundError:
            return None
        if not text:
            return None  # caught between the writer's create and its write
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"`stop_file`: {self.stop_file} holds {text[:40]!r}, not an iteration") from None


@contextmanager
def _signals_stop() -> Iterator[None]:
    """While inside, SIGTERM and SIGINT raise :class:`WorkerStopped` in the main thread."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise WorkerStopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(
    settings: WorkerSettings,
    url: str,
    environ: Mapping[str, str] | None = None,
    *,
    job: MegatronJob | None = None,
) -> int:
    """Run the worker until it stops (see the module docstring); returns the exit code.

    ``job`` is the job to train (a user's own :class:`~liver.worker_runtime.megatron.job.MegatronJob`,
    made in their script); None: the one ``settings`` names (:meth:`WorkerSettings.make_job`)."""
    with _signals_stop():
        try:
            return _Worker(settings, url, environ, job).run()
        except WorkerStopped as stopped:
            log.info("worker.stopped_by_signal", signal=str(stopped))
            return EXIT_OK


class _Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        url: str,
        environ: Mapping[str, str] | None,
        job: MegatronJob | None = None,
    ) -> None:
        self.settings = settings
        self.url = url
        self.environ = environ
        self.job = job
        self.geometry: ModelGeometry | None = None
        self.metrics = MetricsLog(settings.metrics, settings.name) if settings.metrics else None
        self.log = log.bind(job_id=settings.job_id, worker_id=settings.name, device=str(settings.device_id))
        self.iteration: int | None = None

    def _record(self, record_type: type, **fields: object) -> None:
        if self.metrics is not None:
            self.metrics.write(record_type, **fields)

    def run(self) -> int:
        import torch

        from liver.worker_runtime.companion.agent import AgentSettings, GenerationRank, WorkerIdentity
        from liver.worker_runtime.companion.bridge import RuntimeBridge, store_address
        from liver.worker_runtime.companion.thread import Companion
        from liver.worker_runtime.runtime import LiveRuntime
        from liver.worker_runtime.world import WorldSpec, host_store

        s = self.settings
        torch.set_num_threads(s.threads)
        job = self.job if self.job is not None else s.make_job()
        self.geometry = as_geometry(job.model)  # what every plan for this job must move
        timeout = timedelta(seconds=s.build_timeout_s)
        store = host_store(s.host, s.port, timeout=timeout)  # kept alive for the whole process
        address = f"{s.host}:{store.port}"
        identity = WorkerIdentity(
            job_id=s.job_id,
            worker_id=s.name,
            device=s.device_id,
            address=address,
            memory_bytes=s.memory_bytes,
        )
        initial = None
        initial_store = None
        rank = s.initial_rank
        if s.initial is not None:
            initial = WorldSpec(
                job=s.job_id,
                generation=s.initial.generation,
                layout=s.initial.layout,
                placement=s.initial.placement,
            )
            initial_store = store_address(address if rank == 0 else s.initial.store)
        bridge = RuntimeBridge(switch_grace_s=s.switch_grace_s)

        def on_event(event: RuntimeEvent) -> None:
            bridge.on_event(event)
            self._record_event(event)

        runtime = LiveRuntime(
            job,
            job=s.job_id,
            device=s.device_id,
            store=initial_store,
            initial=initial,
            options=s.runtime_options(),
            on_event=on_event,
            on_cut=job.hooks.at_cut if job.hooks is not None else None,
            on_switch=job.hooks.after_switch if job.hooks is not None else None,
        )
        companion = Companion(
            identity,
            bridge,
            url=self.url,
            world=None if initial is None or rank is None else GenerationRank(initial.generation, rank),
            environ=self.environ,
            settings=AgentSettings(heartbeat_s=s.heartbeat_s),
            metrics_port=s.metrics_port,
        )
        bridge.attach(runtime, companion.report, job_id=s.job_id, worker_id=s.name)
        self.log.info("worker.starting", address=address, standby=initial is None, rank=rank)
        companion.start()
        try:
            return self._train(runtime, companion)
        except WorkerStopped:
            self._record(Stopped, why="signal", iteration=self.iteration)
            raise
        except Exception as error:
            self.log.exception("worker.failed")
            text = (str(error) or type(error).__name__).splitlines()[0][:1500]
            pending = bridge.open_generation
            if pending is not None:  # the coordinator must not wait for this process until its deadline
                companion.report(WorkerPhase.FAILED, generation=pending, error=text)
            self._record(Stopped, why="error", iteration=self.iteration, error=text)
            return EXIT_FAILED
        finally:
            companion.close()
            if self.metrics is not None:
                self.metrics.close()

    def _train(self, runtime: LiveRuntime[Any], companion: Companion) -> int:
        from liver.worker_runtime.peers import StepAbandoned

        s = self.settings
        stop = StopRule(s.max_steps, s.stop_file)
        if s.initial is None:
            self._record(Started, generation=None, rank=None, layout=None)
        trainer = runtime.step()  # builds the first world, or waits to be taken into one
        seen = self._after_step(runtime, companion, 0)  # a joiner may already have fallen back
        if trainer is not None:
            world = runtime.world
            assert world is not None
            if s.initial is not None:
                self._record(
                    Started, generation=world.generation, rank=world.rank, layout=world.layout.describe()
                )
            self.iteration = runtime.factory.iteration(trainer)
            companion.set_iteration(self.iteration)
            if (
                s.initial is not None
                and s.initial.announce
                and s.initial_rank == 0
                and world.generation == s.initial.generation
            ):
                self._announce(world.layout, world.placement)
        why = "left"
        while trainer is not None:
            assert self.iteration is not None
            reason = stop.why(self.iteration)
            if reason is not None:
                why = reason
                break
            try:
                result = trainer.train_step()
            except StepAbandoned as abandoned:
                # A peer is lost: the state of the last completed step is kept, and the runtime's next
                # boundary recovers (live from the surviving replicas once the coordinator's recovery
                # request comes, or from the checkpoint).
                self.log.warning(
                    "worker.step_abandoned", iteration=abandoned.iteration, error=abandoned.reason
                )
                trainer = runtime.step()
                if trainer is not None:
                    self.iteration = runtime.factory.iteration(trainer)
                    companion.set_iteration(self.iteration)
                seen = self._after_step(runtime, companion, seen)
                continue
            world = runtime.world
            assert world is not None
            self.iteration = result.iteration
            companion.set_iteration(result.iteration)
            self._record(
                Step,
                iteration=result.iteration,
                loss=result.loss,
                grad_norm=result.grad_norm,
                generation=world.generation,
                rank=world.rank,
                layout=world.layout.describe(),
                step_s=result.seconds,
            )
            trainer = runtime.step()
            if trainer is not None and self.iteration is not None:
                self.iteration = runtime.factory.iteration(trainer)
            seen = self._after_step(runtime, companion, seen)
        self.log.info("worker.done", why=why, iteration=self.iteration, left=runtime.left)
        self._record(Stopped, why=why, iteration=self.iteration)
        runtime.close()
        return EXIT_OK

    def _after_step(self, runtime: LiveRuntime[Any], companion: Companion, seen: int) -> int:
        """Heed a fallback among the runtime's history entries past the first ``seen``; how many there
        are now. One length check at almost every boundary (the history grows only at a handoff)."""
        history = runtime.history
        if len(history) == seen:
            return seen
        from liver.worker_runtime.fallback import FallbackReport

        if any(isinstance(entry, FallbackReport) for entry in history[seen:]):
            self._after_fallback(runtime, companion)
        return len(history)

    def _after_fallback(self, runtime: LiveRuntime[Any], companion: Companion) -> None:
        """The job restarted from its checkpoint in a world of its own: heartbeats speak for it, and its
        rank 0 announces it (the coordinator waits for that after recording the fallback)."""
        from liver.worker_runtime.companion.agent import GenerationRank

        world = runtime.world
        report = runtime.fallbacks[-1]
        if world is None:  # it left: the restarted world does not include this device
            return
        companion.set_world(GenerationRank(world.generation, world.rank))
        self.log.warning(
            "worker.fell_back",
            generation=world.generation,
            rank=world.rank,
            checkpoint=report.checkpoint,
            iteration=report.iteration,
            steps_lost=report.steps_lost,
        )
        if world.rank == 0:
            self._announce(world.layout, world.placement, world.generation)

    def _announce(self, layout: ParallelLayout, placement: Placement, generation: int | None = None) -> None:
        from liver.worker_runtime.companion.announce import publish_world_started

        s = self.settings
        assert s.initial is not None or generation is not None
        if generation is None:
            assert s.initial is not None
            generation = s.initial.generation
        message = WorldStarted(
            job_id=s.job_id,
            generation=generation,
            layout=layout,
            placement=placement,
            geometry=self.geometry,
            peer_copies=s.copies,
        )
        asyncio.run(publish_world_started(message, self.url, self.environ, timeout_s=s.announce_timeout_s))

    def _record_event(self, event: RuntimeEvent) -> None:
        from liver.worker_runtime.runtime import ReshardPhase

        if event.phase in (ReshardPhase.SWITCHED, ReshardPhase.LEFT) and event.report is not None:
            r = event.report
            self._record(
                Switched,
                generation=r.generation,
                from_generation=r.from_generation,
                role=str(r.role),
                iteration=r.iteration,
                left=event.phase is ReshardPhase.LEFT,
                pause_s=r.pause_s,
                transfer_s=r.transfer_s,
                rebuild_s=r.rebuild_s,
                bytes_sent=r.bytes_sent,
                bytes_received=r.bytes_received,
                bytes_local=r.bytes_local,
                prepare_s=r.prepare_s,
                warmup_s=r.warmup_s,
            )
        elif event.phase is ReshardPhase.ABORTED and event.abort is not None:
            a = event.abort
            self._record(
                Aborted, generation=a.generation, stage=a.stage, reason=a.reason, iteration=a.iteration
            )


run_worker = run
"""``liver.run_worker(settings, url, job=...)``: what ``liver worker`` runs, for a script launched
otherwise (torchrun, a job controller) with its own :class:`WorkerSettings` and ``MegatronJob``."""


def exit_now(code: int) -> None:
    """Leave without interpreter teardown: process groups whose peers are gone can block a clean exit,
    and everything that must outlive the worker (acks, metrics) is already flushed."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = [
    "DEMO_TRAIN",
    "InitialWorld",
    "StopRule",
    "WorkerSettings",
    "WorkerStopped",
    "exit_now",
    "run",
    "run_worker",
]
