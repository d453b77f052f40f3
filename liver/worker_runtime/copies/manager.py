"""The runtime's side of peer copies: one :class:`~.peer.PeerCopies` per generation, refreshed at
every iteration boundary, gated before every update.

A world's copies are built at its first boundary (every rank of it reaches that boundary together),
refreshed at each later one with the state the iteration left, and kept when the world breaks: a
recovery reads the lost ranks' copies from them (the old generation's keepers) before the new world's
copies replace them. Copies never stop training: a copy that cannot be made (a peer that does not
publish its keeper, a local state without a tensor it should copy) is logged and the job runs without
that protection, as it did before copies existed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Annotated, Any, Final

import msgspec
import structlog

from liver.shared.geometry import ModelGeometry
from liver.shared.model import as_geometry

from .peer import LocalTensor, PeerCopies, reachable_host, unpack
from .sender import DEFAULT_STAGING_BYTES
from .wire import CopyError

IN_REFRESH: Final = "the loss hit its refresh"
"""Said when a lost rank's copy is one iteration behind the survivors: it died between its update and
the end of its copy's refresh, which no recovery covers yet (the survivors cannot go back a step)."""

log = structlog.get_logger(__name__)


class CopyOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a job keeps peer copies (``RuntimeOptions.copies``; None there keeps none)."""

    staging_bytes: Annotated[int, msgspec.Meta(ge=4096, le=1 << 34)] = DEFAULT_STAGING_BYTES
    """The sender's bounded staging buffer (host memory, pinned for a GPU job)."""
    gate_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    """How long an update waits for the last refresh to be read before giving that refresh up (the
    keeper then keeps the older copy)."""


class CopyManager:
    """The copies of whichever world the runtime trains in (see the module docstring)."""

    def __init__(self, options: CopyOptions, model: Any, *, build_timeout_s: float) -> None:
        self.options = options
        self.model: ModelGeometry = as_geometry(model)
        self.build_timeout_s = build_timeout_s
        self.copies: PeerCopies | None = None
        self._broken_for: int | None = None  # a generation whose copies could not be made
        self._state: Mapping[int, LocalTensor] | None = None  # the generation's trainer's, once taken

    def at_boundary(
        self,
        world: Any,
        trainer: object,
        iteration: int,
        state_of: Callable[[object], Mapping[int, LocalTensor]],
        gate_updates: Callable[[object, Callable[[], bool]], None] | None,
    ) -> None:
        """The iteration ``iteration`` of ``trainer`` (in ``world``) completed: send its copy."""
        copies = self._for(world)
        if copies is None or copies.sender is None:
            return
        if self._state is None:
            # A generation has one trainer, updated in place: views of its storage taken at its first
            # boundary stay its state.
            self._state = state_of(trainer)
            if gate_updates is not None:
                gate_updates(trainer, copies.gate)
        try:
            copies.refresh(iteration, self._state)
        except CopyError as error:
            log.error("copies.disabled", generation=world.generation, reason=str(error))
            self._drop(world.generation)
            return
        if gate_updates is None:
            copies.gate()  # no hook before the update: read now, on the training thread

    def stand_ins(
        self, plan: Any, broken: Any, old_rank: int | None, iteration: int
    ) -> dict[int, dict[int, LocalTensor]]:
        """The copies this process (``old_rank`` of the ``broken`` world, a ``WorldSpec``) sends from in
        the recovery ``plan``, as local states: each lost rank ``plan.stand_ins`` has it keep for.
        They are taken from the broken world's keeper, which takes no more refreshes from them, and must
        be of the ``iteration`` the survivors kept and intact (their sender's checksum); else
        :class:`~.wire.CopyError`, and the recovery falls back to the checkpoint."""
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
        out: dict[int, dict[int, LocalTensor]] = {}
        for rank in wanted:
            kept = copies.keeper.stop(rank)
            if kept is None:
                raise CopyError(f"no complete peer copy of old rank {rank} arrived before it was lost")
            if kept.iteration != iteration:
                behind = f" ({IN_REFRESH})" if kept.iteration == iteration - 1 else ""
                raise CopyError(
                    f"the peer copy of old rank {rank} is of iteration {kept.iteration}, the survivors kept "
                    f"iteration {iteration}{behind}"
                )
            out[rank] = unpack(kept, copies.model, copies.layout, copies.placement)
            log.info("copies.stand_in", generation=broken.generation, rank=rank, iteration=iteration)
        return out

    def settle(self) -> None:
        """Wait until the last refresh was read (before the trainer's tensors may be freed)."""
        if self.copies is not None:
            self.copies.gate()

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()
            self.copies = None

    def _drop(self, generation: int) -> None:
        self.close()
        self._broken_for = generation

    def _for(self, world: Any) -> PeerCopies | None:
        if self.copies is not None and self.copies.generation == world.generation:
            return self.copies
        if self._broken_for == world.generation:
            return None
        self.close()
        self._state = None
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
                timeout=timedelta(seconds=self.build_timeout_s),
            )
        except Exception as error:  # a store that times out, a keeper that cannot listen: no copies
            log.error("copies.unavailable", generation=world.generation, reason=str(error)[:300])
            self._drop(world.generation)
            return None
        return self.copies
