"""One world's peer copies on one process: its keeper, its sender, and the state's byte order.

Every process of a world builds its :class:`PeerCopies` when the world is built: it publishes its
keeper's address in the job's store (under the world's namespace) before it looks up its own keeper's,
so no process waits for one that waits for it. What it keeps must fit its host-memory budget: a keeper
whose sources' copies do not fit keeps none (it publishes that it is unavailable, and its sources run
without the protection, as when it cannot listen), and own copies that do not fit beside them are not
kept (no going back a step). The bytes of a copy are the copied tensors'
(:func:`~liver.reshard.redundancy.copied_tensors`) local pieces in tensor order, each piece as its
holding lays it out; :func:`unpack` reads them back as a local state, without asking the sender.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Collection, Mapping
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from liver.reshard.holdings import holding, is_dp_sharded, pieces_of
from liver.reshard.redundancy import NO_KEEPER, Redundancy, copied_tensors, own_copy_bytes, redundancy
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import ParallelLayout, Placement
from liver.worker_runtime.stream.executor import LocalTensor

from .keeper import CopyKeeper, KeptCopy
from .sender import DEFAULT_STAGING_BYTES, CopySender
from .wire import CopyError

log = structlog.get_logger(__name__)

UNAVAILABLE = "-"
"""A keeper's store entry when it could not listen or has no room: its sources send nothing."""

_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}


def reachable_host(store_host: str, store_port: int) -> str:
    """The address of this host on the interface that reaches the store: the one its peers reach too."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((store_host, store_port))  # no packet is sent: only the route is chosen
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class PeerCopies:
    """Rank ``rank``'s copies in world ``generation`` (``layout`` on ``placement``) of ``model``."""

    def __init__(
        self,
        model: ModelGeometry,
        layout: ParallelLayout,
        placement: Placement,
        generation: int,
        rank: int,
        store: dist.Store,
        *,
        namespace: str,
        host: str,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        gate_timeout_s: float = 60.0,
        timeout: timedelta = timedelta(seconds=120),
        keep_own: bool = False,
        host_budget_bytes: int | None = None,
    ) -> None:
        self.model = model
        self.layout = layout
        self.placement = placement
        self.generation = generation
        self.rank = rank
        self.gate_timeout_s = gate_timeout_s
        self.plan: Redundancy = redundancy(model, layout, placement)
        self.copied = self.plan.copied[rank]
        self._not_sent: list[int] | None = None  # what this rank holds but does not send, once known
        self._log = log.bind(generation=generation, rank=rank)
        sources = self.plan.sources(rank)
        kept_bytes = self.plan.kept_bytes[rank]
        budget = math.inf if host_budget_bytes is None else host_budget_bytes
        self.keeper: CopyKeeper | None = None
        if sources:
            # Published either way, so that no sender waits for a keeper that will not listen.
            if kept_bytes > budget:
                store.set(f"{namespace}/copies/{rank}", UNAVAILABLE)
                self._log.error(
                    "copies.no_room", sources=list(sources), kept_bytes=kept_bytes, budget_bytes=budget
                )
                kept_bytes = 0
            else:
                try:
                    self.keeper = CopyKeeper(generation, sources)
                    store.set(f"{namespace}/copies/{rank}", f"{host}:{self.keeper.port}")
                except OSError as error:
                    store.set(f"{namespace}/copies/{rank}", UNAVAILABLE)
                    self._log.error("copies.no_keeper", reason=str(error))
        if keep_own:
            own = own_copy_bytes(model, layout, placement)[rank]
            if kept_bytes + own > budget:
                self._log.warning(
                    "copies.no_room_to_go_back", own_bytes=own, kept_bytes=kept_bytes, budget_bytes=budget
                )
                keep_own = False
        self.sender: CopySender | None = None
        keeper = self.plan.keepers[rank]
        if keeper != NO_KEEPER:
            key = f"{namespace}/copies/{keeper}"
            store.wait([key], timeout)
            address = store.get(key).decode()
            if address == UNAVAILABLE:
                self._log.error("copies.keeper_unavailable", keeper=keeper)
            else:
                at, _, port = address.rpartition(":")
                self.sender = CopySender(
                    (at, int(port)), generation, rank, staging_bytes=staging_bytes, keep_own=keep_own
                )
        self._log.info(
            "copies.ready",
            keeper=keeper,
            sources=list(sources),
            copy_bytes=self.plan.copy_bytes[rank],
            kept_bytes=self.plan.kept_bytes[rank],
        )

    def refresh(self, iteration: int, state: Mapping[int, LocalTensor]) -> None:
        """Send this rank's copied pieces of ``state`` (after ``iteration``) to its keeper in the
        background; :meth:`gate` before the next update."""
        if self.sender is None:
            return
        try:
            tensors = [piece for ti in self.copied for piece in pieces_of(state[ti])]
        except KeyError as missing:
            raise CopyError(f"the local state has no tensor {missing} that rank {self.rank} copies") from None
        local: list[torch.Tensor] = []
        if self.sender.keep_own:
            if self._not_sent is None:  # a generation's local state holds the same tensors every step
                self._not_sent = sorted(set(state) - set(self.copied))
            local = [piece for ti in self._not_sent for piece in pieces_of(state[ti])]
        self.sender.refresh(iteration, tensors, local)

    def gate(self) -> bool:
        """Before an update: wait until the last refresh was read (False: given up after
        ``gate_timeout_s``, or the sender failed; the keeper keeps an older copy)."""
        return True if self.sender is None else self.sender.wait_read(self.gate_timeout_s)

    def wait_sent(self, iteration: int, timeout: float | None = None) -> bool:
        """Until this process's copy of ``iteration`` was sent whole (True without a sender)."""
        return True if self.sender is None else self.sender.wait_sent(iteration, timeout)

    def kept(self, source: int) -> KeptCopy | None:
        return None if self.keeper is None else self.keeper.latest(source)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.keeper is not None:
            self.keeper.close()


def unpack(
    copy: KeptCopy,
    model: ModelGeometry,
    layout: ParallelLayout,
    placement: Placement,
    held: Collection[int] = (),
) -> dict[int, LocalTensor]:
    """Rank ``copy.source``'s copied tensors as its local state would hold them (fresh tensors); with
    ``held`` (the rank's own copy, :meth:`~.sender.CopySender.own`) also the rest of the tensors it
    holds, which follow what it sent and never left the process.

    Checked before anything is built on them: :class:`CopyError`, naming the tensor, when the bytes do
    not fit what that rank copies in this world, a sent tensor no longer matches the checksum its
    sender took, or a tensor holds a value that is not finite (a NaN copied is a NaN resumed from)."""
    tensors = model.tensors(optimizer=True)
    copied = copied_tensors(model, layout, placement, copy.source)
    rest = sorted(set(held) - set(copied))
    out: dict[int, LocalTensor] = {}
    offset = index = 0
    data = copy.data
    whose = "own" if held else "peer"
    of = f"the {whose} copy of rank {copy.source} (iteration {copy.iteration})"
    for ti, sent in [*((ti, True) for ti in copied), *((ti, False) for ti in rest)]:
        t = tensors[ti]
        dtype = _TORCH_DTYPES[t.dtype]
        pieces = []
        for shard in holding(t, model, layout, copy.source) or ():
            nbytes = math.prod(shard.local_shape) * t.itemsize
            if offset + nbytes > len(data):
                raise CopyError(f"{of} ends inside {t.name}")
            if sent:
                if index >= len(copy.checksums):
                    raise CopyError(f"{of} carries {len(copy.checksums)} checksums, none for {t.name}")
                if not copy.intact(index, offset, offset + nbytes):
                    raise CopyError(
                        f"{of}: {t.name} fails its checksum (its bytes changed after its sender read them)"
                    )
                index += 1
            raw = torch.frombuffer(bytearray(data[offset : offset + nbytes]), dtype=torch.uint8)
            piece = raw.view(dtype).reshape(shard.local_shape)
            if piece.is_floating_point() and not bool(torch.isfinite(piece).all()):
                raise CopyError(f"{of}: {t.name} holds values that are not finite")
            pieces.append(piece)
            offset += nbytes
        out[ti] = tuple(pieces) if is_dp_sharded(t, model) else pieces[0]
    if offset != len(data) or index != len(copy.checksums):
        raise CopyError(
            f"{of} has {len(data) - offset} bytes and {len(copy.checksums) - index} pieces beyond its state"
        )
    return out
