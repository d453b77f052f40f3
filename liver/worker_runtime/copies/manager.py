"""The runtime's side of peer copies: one :class:`~.peer.PeerCopies` per generation, refreshed at
every iteration boundary, gated before every update.

A world's copies are built at its first boundary (every rank of it reaches that boundary together),
refreshed at each later one with the state the iteration left, and kept when the world breaks: a
recovery reads the lost ranks' copies from them (the old generation's keepers) before the new world's
copies replace them. A lost rank that died in its copy's refresh leaves a copy one step behind the
survivors; each sender also keeps its own whole state as its last two refreshes read it
(:meth:`~.sender.CopySender.own`) and the boundaries' progress, so that every survivor can go back to
that iteration (:meth:`CopyManager.can_go_back`, :meth:`CopyManager.own_state`; the runtime has them
agree on it). Copies never stop training: a copy that cannot be made (a peer that does not
publish its keeper, a local state without a tensor it should copy) is logged and the job runs without
that protection, as it did before copies existed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from typing import Annotated, Any, Final

import msgspec
import psutil
import structlog

from liver.shared.geometry import ModelGeometry
from liver.shared.model import as_geometry

from .keeper import KeptCopy
from .peer import LocalTensor, PeerCopies, reachable_host, unpack
from .sender import DEFAULT_STAGING_BYTES
from .wire import CopyError

IN_REFRESH: Final = "the loss hit its refresh"
"""Said when a lost rank's copy is one iteration behind the survivors (it died between its update and
the end of its copy's refresh) and the survivors could not all go back to that iteration."""

PROGRESS_KEPT: Final = 2
"""Boundaries whose training progress is remembered with ``go_back``: as many as the own copies."""

log = structlog.get_logger(__name__)


class CopyOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a job keeps peer copies (``RuntimeOptions.copies``; None there keeps none)."""

    staging_bytes: Annotated[int, msgspec.Meta(ge=4096, le=1 << 34)] = DEFAULT_STAGING_BYTES
    """The sender's bounded staging buffer (host memory, pinned for a GPU job)."""
    gate_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    """How long an update waits for the last refresh to be read before giving that refresh up (the
    keeper then keeps the older copy)."""
    host_budget_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Host memory the copies of one process may take: those it keeps for its peers (double-buffered)
    and, with ``go_back``, its own. None: half the host's available memory when a world's copies are
    built, shared evenly by the world's processes on this node. A keeper whose copies do not fit keeps
    none (its peers train without that protection; logged ``copies.no_room``); own copies that do not
    fit beside them are not kept."""
    go_back: bool = False
    """Keep each process's own whole state as its last two refreshes read it, so that a loss in a copy's
    refresh (the lost rank's copy a step behind the survivors) goes back a step instead of falling back
    to the checkpoint. It costs twice the process's state in host memory and a copy of it per step
    (gpt-29m on a 2-core VM, where the copies' threads share the cores: the steady step +10.0% with it,
    +6.3% with copies alone)."""


class CopyManager:
    """The copies of whichever world the runtime trains in (see the module docstring)."""

    def __init__(self, options: CopyOptions, model: Any, *, build_timeout_s: float) -> None:
        self.options = options
        self.model: ModelGeometry = as_geometry(model)
        self.build_timeout_s = build_timeout_s
        self.copies: PeerCopies | None = None
        self._broken_for: int | None = None  # a generation whose copies could not be made
        self._gated = False  # the generation's trainer waits for the copies' reads before its updates
        self._progress: dict[int, Any] = {}  # iteration -> the trainer's progress at that boundary

    def at_boundary(
        self,
        world: Any,
        trainer: object,
        iteration: int,
        state_of: Callable[[object], Mapping[int, LocalTensor]],
        gate_updates: Callable[[object, Callable[[], bool]], None] | None,
        progress_of: Callable[[object], Any] | None = None,
    ) -> None:
        """The iteration ``iteration`` of ``trainer`` (in ``world``) completed: send its copy (and
        remember the trainer's progress, which going back to this iteration needs)."""
        copies = self._for(world)
        if copies is None or copies.sender is None:
            return
        if self.options.go_back and progress_of is not None:
            self._progress[iteration] = progress_of(trainer)
            for old in sorted(self._progress)[:-PROGRESS_KEPT]:
                del self._progress[old]
        if not self._gated:
            self._gated = True
            if gate_updates is not None:
                gate_updates(trainer, copies.gate)
        # Taken at every boundary: most of it are views of the trainer's storage, updated in place, but
        # not all (the Adam step is a scalar made from the optimizer's own, and a copy of the first
        # boundary's would take a process back to the wrong step).
        state = state_of(trainer)
        try:
            copies.refresh(iteration, state)
        except CopyError as error:
            log.error("copies.disabled", generation=world.generation, reason=str(error))
            self._drop(world.generation)
            return
        if gate_updates is None:
            copies.gate()  # no hook before the update: read now, on the training thread

    def stand_in_copies(self, plan: Any, broken: Any, old_rank: int | None) -> dict[int, KeptCopy]:
        """The last complete copies of the lost ranks this process (``old_rank`` of the ``broken``
        world, a ``WorldSpec``) stands in for in the recovery ``plan`` (``Plan.stand_ins``); its keeper
        takes no more refreshes from them. :class:`~.wire.CopyError` when one is missing."""
        wanted = [r for r, keeper in plan.stand_ins if keeper == old_rank]
        if not wanted:
            return {}
        copies = self.copies
        if (
            copies is None
            or copies.keeper is None
            or copies.generation != broken.generation
            or (copies.layout, copies.placement) != (plan.old.layout, plan.old.placement)
        ):
            raise CopyError(
                f"the recovery reads the peer copies of old ranks {wanted} here, but this process keeps "
                f"none of generation {broken.generation}"
            )
        out: dict[int, KeptCopy] = {}
        for rank in wanted:
            kept = copies.keeper.stop(rank)
            if kept is None:
                raise CopyError(f"no complete peer copy of old rank {rank} arrived before it was lost")
            out[rank] = kept
        return out

    def stand_ins(
        self, copies: Mapping[int, KeptCopy], generation: int, iteration: int
    ) -> dict[int, dict[int, LocalTensor]]:
        """The lost ranks' ``copies`` this process sends from (:meth:`stand_in_copies`), as local states.
        They must be of ``iteration``, the one the survivors resume from, and intact (their sender's
        checksums, finite values); else :class:`~.wire.CopyError`, and the recovery falls back to the
        checkpoint."""
        out: dict[int, dict[int, LocalTensor]] = {}
        for rank, kept in copies.items():
            if kept.iteration != iteration:
                behind = f" ({IN_REFRESH})" if kept.iteration == iteration - 1 else ""
                raise CopyError(
                    f"the peer copy of old rank {rank} is of iteration {kept.iteration}, the survivors "
                    f"resume from iteration {iteration}{behind}"
                )
            assert self.copies is not None
            out[rank] = unpack(kept, self.copies.model, self.copies.layout, self.copies.placement)
            log.info("copies.stand_in", generation=generation, rank=rank, iteration=iteration)
        return out

    def can_go_back(self, iteration: int) -> bool:
        """Whether this process can resume from ``iteration``: its own copy of that refresh (every
        tensor it holds) is still kept, and its progress at that boundary known."""
        copies = self.copies
        if copies is None or copies.sender is None or iteration not in self._progress:
            return False
        return copies.sender.own(iteration) is not None

    def own_state(self, iteration: int, held: Collection[int]) -> tuple[dict[int, LocalTensor], Any]:
        """This process's state (the tensors ``held``) and progress at ``iteration``, from its own copy
        (:meth:`can_go_back` first); :class:`~.wire.CopyError` when it fails its checks."""
        copies = self.copies
        assert copies is not None and copies.sender is not None
        own = copies.sender.own(iteration)
        if own is None:
            raise CopyError(f"this process's own copy of iteration {iteration} is gone")
        data, checksums = own
        kept = KeptCopy(copies.rank, copies.generation, iteration, checksums, memoryview(data).toreadonly())
        state = unpack(kept, copies.model, copies.layout, copies.placement, held)
        return state, self._progress[iteration]

    def settle(self) -> None:
        """Wait until the last refresh was read (before the trainer's tensors may be freed)."""
        if self.copies is not None:
            self.copies.gate()

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()
            self.copies = None

    def host_budget(self, placement: Any, rank: int) -> int:
        """The host memory rank ``rank``'s copies may take in a world on ``placement``
        (``CopyOptions.host_budget_bytes``)."""
        if self.options.host_budget_bytes is not None:
            return self.options.host_budget_bytes
        node = placement.devices[rank].node
        local = sum(d.node == node for d in placement.devices)
        return psutil.virtual_memory().available // (2 * local)

    def _drop(self, generation: int) -> None:
        self.close()
        self._broken_for = generation

    def _for(self, world: Any) -> PeerCopies | None:
        if self.copies is not None and self.copies.generation == world.generation:
            return self.copies
        if self._broken_for == world.generation:
            return None
        self.close()
        self._gated = False
        store = world.store
        try:
            self.copies = PeerCopies(
                self.model,
                world.layout,
                world.placement,
                world.generation,
                world.rank,
                store,
                namespace=world.spec.namespace,
                host=reachable_host(store.host, store.port),
                staging_bytes=self.options.staging_bytes,
                gate_timeout_s=self.options.gate_timeout_s,
                keep_own=self.options.go_back,
                host_budget_bytes=self.host_budget(world.placement, world.rank),
                timeout=timedelta(seconds=self.build_timeout_s),
            )
        except Exception as error:  # a store that times out, a keeper that cannot listen: no copies
            log.error("copies.unavailable", generation=world.generation, reason=str(error)[:300])
            self._drop(world.generation)
            return None
        return self.copies
