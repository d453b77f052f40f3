"""The contract between the live runtime and a training job: one protocol every job implements, and
optional ones, each of which unlocks a feature.

The runtime is generic over a job factory (``MegatronJob`` for Megatron-core). A factory for another
framework implements :class:`TrainerFactory`; each optional protocol it also implements is found once,
when the runtime starts (:meth:`JobAbilities.of`), and logged, so that what a job can and cannot do is
said at its start rather than discovered at its first loss. docs/job-contract.md walks through each one
with the Megatron job as the worked example.

==========================  ============================================================================
protocol                    unlocks
==========================  ============================================================================
:class:`TrainerFactory`     live reshards: build, read, resume and free a trainer of any layout
:class:`BuildsForStream`    the new trainer built for the stream (values not initialised) and its pages
                            touched before the cut, out of the pause
:class:`ChecksLayouts`      each new layout's model checked during the preparation, before the cut
:class:`RecoversLive`       a lost peer recovered live from the survivors (and their peer copies)
                            instead of the checkpoint
:class:`FeedsPeerCopies`    peer copies read without a collective, and gated right before each update
                            (without it they read ``local_state`` and wait at the boundary)
:class:`Checkpoints`        ``RuntimeOptions.checkpoint``: periodic saves, a resume at the start, and the
                            fallback when a handoff's old world is gone
==========================  ============================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Generic, Protocol, TypeVar, runtime_checkable

import torch

from liver.worker_runtime.peers import StepAbandoned
from liver.worker_runtime.stream.executor import LocalTensor

if TYPE_CHECKING:
    from liver.shared.geometry import ModelGeometry
    from liver.shared.layout import ParallelLayout
    from liver.shared.model import ModelSpec
    from liver.worker_runtime.world import World

T = TypeVar("T")


@dataclass
class KeptState:
    """The training state of a process whose world broke (a lost peer), kept apart from its trainer.

    The trainer's modules, DDP wrapper and optimizer hold the broken world's process groups, and a gloo
    group closes its connections only when the last reference to it goes: as long as the trainer lives,
    peers blocked in one of its collectives would wait for their timeout. So the runtime keeps only what
    the recovery streams (the local state's tensors and the training progress) and lets the rest go
    (:meth:`RecoversLive.keep_state`)."""

    state: dict[int, LocalTensor]
    progress: bytes
    stand_ins: dict[int, dict[int, LocalTensor]] = field(default_factory=dict)
    """The peer copies this process sends from in the recovery: lost old rank -> its copied state, read
    from the keeper of the broken world (``Plan.stand_ins`` names the ranks; empty: none)."""
    copy_failure: str | None = None
    """Why a copy this process should send from cannot be used (the tensor that failed its checksum, a
    copy of another iteration): the switch fails on it, in step with its peers, instead of the stream
    waiting for sends that never come."""

    def dispose(self) -> None:
        """Free the kept tensors' storage (after the commit: the new trainer has its own). The peer
        copies' tensors own their bytes and go with the last reference."""
        for value in self.state.values():
            for tensor in value if isinstance(value, tuple) else (value,):
                storage = tensor.untyped_storage()
                if storage.resizable():  # not one read back from a copy's bytes: those go with it
                    storage.resize_(0)
        self.state, self.stand_ins = {}, {}

    def go_back(self, state: dict[int, LocalTensor], progress: bytes) -> None:
        """Replace the kept state by an older iteration's (the survivors resume from the iteration a
        lost peer's copy holds, a step behind theirs)."""
        self.dispose()
        self.state, self.progress = state, progress


@runtime_checkable
class TrainerFactory(Protocol[T]):
    """How the runtime builds, reads and resumes the trainer of one world (``MegatronJob`` for Megatron).

    A trainer is whatever the training loop steps (model, optimizer, data iterator). The runtime needs
    its state as LiveR local state (tensor index into ``model.tensors()`` -> local tensor, or a tuple of
    them for a holding of several pieces), and its non-tensor progress as bytes that mean the same in
    every process. Required of every job; the optional protocols below add to it.
    """

    @property
    def model(self) -> ModelSpec | ModelGeometry:
        """What the plans for this job must move (the runtime checks each plan against it)."""
        ...

    def build(self, world: World) -> T:
        """A fresh trainer for this process's rank of ``world`` (already torch's default world)."""
        ...

    def warm_up(self, layout: ParallelLayout, rank: int) -> object:
        """Build and step a throw-away trainer for ``rank`` of ``layout`` under a mock world."""
        ...

    def iteration(self, trainer: T) -> int:
        """Completed training steps (the same number on every rank)."""
        ...

    def local_state(self, trainer: T) -> dict[int, LocalTensor]:
        """The trainer's whole tensor state; views of its live storage where the tensor has one."""
        ...

    def progress(self, trainer: T) -> bytes:
        """Iteration, data position and schedule: what a new rank must know besides tensors."""
        ...

    def resume(self, trainer: T, state: Mapping[int, LocalTensor], progress: bytes) -> None:
        """Make a freshly built ``trainer`` continue from ``state`` and ``progress``."""
        ...

    def dispose(self, trainer: T) -> None:
        """Free the memory of a trainer that will never step again (the old world's, after the commit),
        without waiting for Python's garbage collector."""
        ...

    def capture_rng(self) -> object:
        """This process's random streams (restored when a handoff is rolled back)."""
        ...

    def restore_rng(self, captured: object) -> None: ...


@runtime_checkable
class BuildsForStream(Protocol[T]):
    """A trainer built for the stream, and every tensor it allocated. Without it the runtime builds with
    ``build`` and touches the tensors of ``local_state``."""

    def build_for_stream(self, world: World) -> T:
        """A trainer whose tensor values the stream will overwrite (its build may skip initialising
        them)."""
        ...

    def storage(self, trainer: T) -> Iterable[torch.Tensor]:
        """Every tensor ``trainer`` allocated (the new trainer's are touched before the cut, so that no
        page fault falls in the pause)."""
        ...


@runtime_checkable
class ChecksLayouts(Protocol):
    """A check of the model a new layout would build, run during a handoff's preparation by the process
    that will hold new rank 0, beside training."""

    def check_layout(self, layout: ParallelLayout) -> None:
        """Raise when the model built at ``layout`` would not be what the plans move."""
        ...


@runtime_checkable
class RecoversLive(Protocol[T]):
    """What a live recovery from a lost peer needs: a trainer marked broken at a step boundary, its
    state kept apart from the broken world's groups, and whether a layout's survivors hold everything.
    Without it every loss outside a handoff falls back to the checkpoint."""

    def abandon(self, trainer: T, iteration: int, reason: str) -> StepAbandoned:
        """Mark ``trainer``'s world broken between two steps: its state is that of ``iteration``."""
        ...

    def abandoned(self, trainer: T) -> StepAbandoned | None:
        """The trainer's step that met a lost peer (its state is the last completed iteration's)."""
        ...

    def keep_state(self, trainer: T) -> KeptState:
        """The state and progress of a trainer whose world broke, with the trainer's hold on that
        world's groups let go."""
        ...

    def survives_one_loss(self, layout: ParallelLayout) -> bool:
        """Whether every piece of the state at ``layout`` is held by a second process (without peer
        copies)."""
        ...


@runtime_checkable
class FeedsPeerCopies(Protocol[T]):
    """How the peer copies read a trainer: its state without a collective (ranks read at different
    times), and a hook right before each update, where the copies wait until the last refresh was read.
    Without it they read ``local_state`` and wait at the boundary, on the training thread."""

    def copy_state(self, trainer: T) -> dict[int, LocalTensor]: ...

    def gate_updates(self, trainer: T, gate: Callable[[], object]) -> None: ...


@runtime_checkable
class Checkpoints(Protocol[T]):
    """What ``RuntimeOptions.checkpoint`` needs: durable saves, a resume at the start, and a fallback
    when a handoff's old world is gone."""

    def save_checkpoint(self, trainer: T, root: str, keep_last: int) -> str:
        """Save ``trainer`` durably under ``root`` (a collective over its world); the checkpoint's path."""
        ...

    def resume_latest(self, world: World, root: str) -> tuple[T, str] | None:
        """A trainer for this rank of ``world`` (already torch's default world) from the latest
        checkpoint under ``root``, and its path; None when no rank finds one. A collective over
        ``world``."""
        ...

    def fall_back(self, world: World, root: str, reached_iteration: int | None) -> tuple[T, str]:
        """A trainer for this rank of ``world`` (already torch's default world) loaded from the latest
        checkpoint under ``root`` as a move (see
        :func:`~liver.worker_runtime.megatron.streams.resume_streams`), and that checkpoint's path. A
        collective over ``world``."""
        ...


@dataclass(frozen=True)
class JobAbilities(Generic[T]):
    """The optional protocols a factory implements, found once (None: the protocol is missing)."""

    stream_builds: BuildsForStream[T] | None
    layout_checks: ChecksLayouts | None
    live_recovery: RecoversLive[T] | None
    peer_copies: FeedsPeerCopies[T] | None
    checkpointing: Checkpoints[T] | None

    @classmethod
    def of(cls, factory: TrainerFactory[T]) -> JobAbilities[T]:
        """What ``factory`` can do; ``TypeError`` naming what is missing when it is no
        :class:`TrainerFactory`."""
        if not isinstance(factory, TrainerFactory):
            missing = ", ".join(name for name in _REQUIRED if not hasattr(factory, name))
            raise TypeError(f"`factory`: {type(factory).__name__} is no TrainerFactory: it lacks {missing}")
        return cls(**{name: factory if isinstance(factory, p) else None for name, p in _OPTIONAL.items()})

    def names(self) -> list[str]:
        """The optional protocols found, by name (logged when the runtime starts)."""
        return [p.__name__ for name, p in _OPTIONAL.items() if getattr(self, name) is not None]


_OPTIONAL: Final[dict[str, type]] = {
    "stream_builds": BuildsForStream,
    "layout_checks": ChecksLayouts,
    "live_recovery": RecoversLive,
    "peer_copies": FeedsPeerCopies,
    "checkpointing": Checkpoints,
}
""":class:`JobAbilities`' fields and the protocol each holds."""

_REQUIRED = (
    "model",
    "build",
    "warm_up",
    "iteration",
    "local_state",
    "progress",
    "resume",
    "dispose",
    "capture_rng",
    "restore_rng",
)
