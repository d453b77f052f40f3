"""The layer-streaming executor: one process's part of a transfer plan, run over a process group.

Every process that runs an old rank, a new rank or both (one device can host one of each) calls
:func:`stream_plan` with the same plan and options. The executor walks the plan's steps ``(layer,
round)`` in order. In each step it first posts every receive (so a peer's send can always complete),
then its sends, then copies the slices that stay on this device, then waits. Receives land in place in
the new shard when the destination region is contiguous, otherwise in one buffer allocated once and
reused; staged pieces are then copied into the new shards. Sends go straight from the old storage
unless the slice is not contiguous there; such slices are cut into pieces of ``message_bytes`` and sent
from contiguous copies made in the same buffer, above the step's staged bytes, at most
``send_copy_bytes`` of them alive at once (a ring: the oldest send is waited for when the next copy
does not fit). The same code drives gloo on CPU and NCCL on GPU: it only needs ``send``/``recv`` on a
process group. There is no barrier between layers: completion is tracked per message, so a process
only ever waits for the peers it exchanges with, and because every process posts a step's receives
before anything that could block, the step order alone rules out deadlock.

Posting ahead. When every new shard is given in ``into`` (nothing to allocate), the executor posts the
next step's receives, then its sends, and does its local copies before it waits for the current step,
when the next step's staged pieces fit in the buffer beside the current one's and neither step sends
from copies; the buffer then holds two steps' staged pieces (still within ``B``). Receives and waits
keep the step order, so the deadlock argument above holds unchanged. ``on_step`` is called before a
step is posted, so possibly while the previous step is still in flight.

The schedule. What a process sends, receives and copies, and where, follows from the plan, its ranks,
its group and the options alone, so :func:`prepare_schedule` can derive it (and check the plan against
the identity) before the stream, while training still runs; ``stream_plan(..., schedule=)`` then only
checks that it was made for the same inputs. Without one, ``stream_plan`` builds it itself.

Memory (invariant I2). The extra memory the executor allocates is the one buffer (sized to what this
process's largest step stages plus its send copies, or to two steps' staged pieces when posting ahead,
never more than ``B = plan.budget_bytes``) and the
new shards of the layer being assembled (earlier layers' shards are the new state, not extra; shards
given in ``into`` are the caller's and never extra), so::

    peak_extra_bytes <= B + largest_new_layer_bytes

A step's send copies cannot wait for its staged pieces to be copied out (two processes doing that to
each other would deadlock), so both must fit in ``B`` at once: pieces are at most half of ``B``, and a
plan in which some step stages so much that one piece no longer fits beside it is refused before any
message with a :class:`PlanMismatch` naming the step (see ``.schedule.buffer_bytes``).

Old state versus invariant I4. Freeing each old layer as soon as no later step reads it keeps the
footprint near ``max(old, new)`` plus the extra, but a failure after the first free leaves a state that
can no longer train. The executor therefore never frees by default (``release_old=False``): it only
reads the old state, which stays intact and usable whatever happens, and the caller drops it after the
switch commits; the footprint then peaks at ``old + new + extra``. A caller whose switch is already
agreed and whose fallback on failure is the checkpoint (I4's fail-stop branch) may pass
``release_old=True``: old tensors are then popped from ``old_state`` after their last read and their
storage returned (when a tensor owns all of its storage), and a :class:`StreamError` says
``old_state_intact=False`` once that has begun. :class:`StreamStats` reports the peak footprint either way,
so the two modes can be measured against each other.

Failure. Every wait has the step's deadline (``timeout_s`` from the moment the step's messages were
posted, or from the moment its wait starts when it was posted ahead). A dead peer (the transport
reports a closed connection) or a silent one (the deadline passes)
stops the stream with a :class:`StreamError` naming the peer process, its plan rank, the layer and the
round. ``timeout_s`` must cover one step's transfer plus the skew between peers. The process group is
not usable afterwards (gloo closes the pair on a timeout): destroy it. ``on_step`` may raise to cancel a
stream; the same holds then.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from datetime import timedelta
from typing import Literal, NamedTuple, Protocol

import msgspec
import structlog
import torch

from liver.reshard.holdings import Holding, packed, pieces_of
from liver.reshard.plan import Plan
from liver.shared.errors import HandoffError
from liver.worker_runtime.stream.memory import MemoryLedger
from liver.worker_runtime.stream.schedule import (
    OWN,
    GroupRanks,
    LayerWork,
    PeerMessage,
    PlanMismatch,
    Region,
    Schedule,
    StreamStep,
    align,
    build_schedule,
    devices_in_stream_order,
    ranks_on_device,
)

__all__ = [
    "TORCH_DTYPES",
    "GroupRanks",
    "LayerStats",
    "P2PGroup",
    "PlanMismatch",
    "PreparedSchedule",
    "StreamError",
    "StreamOptions",
    "StreamResult",
    "StreamStats",
    "allocate_new_state",
    "devices_in_stream_order",
    "prepare_schedule",
    "ranks_on_device",
    "staging_bytes",
    "stream_device",
    "stream_plan",
]


LocalTensor = torch.Tensor | tuple[torch.Tensor, ...]
"""This process's local tensor of one logical tensor, or, for state DP ranks hold different pieces of
(the distributed optimizer's), one tensor per piece in the holding's order."""

log = structlog.get_logger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}

MIB = 1024 * 1024


class Work(Protocol):
    def wait(self, timeout: timedelta = ...) -> bool: ...


class P2PGroup(Protocol):
    """What the executor needs of a process group (``torch.distributed.ProcessGroup`` or a backend such
    as ``ProcessGroupGloo``/``ProcessGroupNCCL`` built directly on a store): group-local ranks."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Work: ...


class StreamError(HandoffError):
    """The stream stopped because a peer failed or fell silent; names the peer and where it happened."""

    def __init__(
        self,
        *,
        layer: int,
        round: int,
        peer: int,
        peer_rank: int,
        peer_world: Literal["old", "new"],
        direction: Literal["send", "recv"],
        reason: str,
        old_state_intact: bool,
    ) -> None:
        self.layer = layer
        self.round = round
        self.peer = peer
        self.peer_rank = peer_rank
        self.peer_world = peer_world
        self.direction = direction
        self.reason = reason
        self.old_state_intact = old_state_intact
        way = "sending to" if direction == "send" else "receiving from"
        state = "old state intact" if old_state_intact else "old state partly released"
        super().__init__(
            f"stream failed in layer {layer} round {round} {way} process {peer} "
            f"({peer_world} rank {peer_rank}): {reason} ({state})"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only construction: rebuild from the fields so the error survives a process boundary.
        fields = (
            "layer",
            "round",
            "peer",
            "peer_rank",
            "peer_world",
            "direction",
            "reason",
            "old_state_intact",
        )
        return (_rebuild_stream_error, ({f: getattr(self, f) for f in fields},))


def _rebuild_stream_error(fields: dict[str, object]) -> StreamError:
    return StreamError(**fields)  # type: ignore[arg-type]


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How to run a plan. ``message_bytes`` must be the same in every process of the stream (both sides
    cut non-contiguous slices with it); the rest is local to each process."""

    timeout_s: float = 60.0
    """Longest wait for one step's messages before the peer counts as failed."""
    max_bytes_per_s: float | None = None
    """Cap on this process's network bytes (sent + received) per second; ``None``: as fast as it goes.
    It is enforced between steps, so a small plan budget gives a smoother rate."""
    message_bytes: int = 32 * MIB
    """Piece size for slices that are not contiguous in their source shard (at most half of the plan's
    budget whatever is given, so a piece fits in the buffer beside a step's staged bytes)."""
    send_copy_bytes: int | None = None
    """Most bytes of contiguous send copies alive at once (inside the buffer, so within ``B``); ``None``:
    two pieces (copy one while the other is on the wire)."""
    direct_receive: bool = True
    """Receive a piece straight into the new shard when its region there is contiguous."""
    release_old: bool = False
    """Free old tensors after their last read (see the module docstring: gives up invariant I4)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.max_bytes_per_s is not None and not self.max_bytes_per_s > 0:
            raise ValueError(f"max_bytes_per_s must be positive or None, got {self.max_bytes_per_s}")
        if self.message_bytes < 8:
            raise ValueError(f"message_bytes must be at least 8 (one element), got {self.message_bytes}")
        if self.send_copy_bytes is not None and self.send_copy_bytes < self.message_bytes:
            raise ValueError(
                f"send_copy_bytes ({self.send_copy_bytes}) must hold one piece of message_bytes "
                f"({self.message_bytes})"
            )


class LayerStats(msgspec.Struct, frozen=True, kw_only=True):
    layer: int
    rounds: int
    seconds: float  # from its first step's posting to its last step's completion (may overlap the next)
    wait_seconds: float  # blocked on the network
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    messages_sent: int
    messages_received: int
    new_bytes: int  # this process's new shards of the layer (padding included)


class StreamStats(msgspec.Struct, frozen=True, kw_only=True):
    """What one process did. Bytes are payload (vocabulary padding is never sent)."""

    old_rank: int | None
    new_rank: int | None
    group_rank: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    budget_bytes: int  # B: the plan's budget for the buffer
    buffer_bytes: int  # the one buffer this process allocated for staged pieces and send copies (<= B)
    staging_bytes: int  # the most staged in it at once (two steps' pieces when posting ahead)
    send_copy_budget: int
    peak_send_copy_bytes: int  # the most send copies alive in it at once
    largest_new_layer_bytes: int
    peak_extra_bytes: int  # the buffer + the layer under assembly: <= B + largest_new_layer_bytes
    peak_footprint_bytes: int  # old state still held + new state + extra
    old_bytes: int
    old_bytes_released: int
    throttle_seconds: float
    layers: tuple[LayerStats, ...]
    schedule_seconds: float = 0.0  # building the schedule inside this call; 0 when a prepared one was given


class StreamResult(NamedTuple):
    new_state: dict[int, LocalTensor]
    """Tensor index -> this process's new shard (``local_shape`` of the new view, padding zeroed); a
    tuple of its pieces for state DP ranks hold different pieces of (:mod:`liver.reshard.holdings`)."""
    stats: StreamStats


def stream_plan(
    plan: Plan,
    *,
    old_rank: int | None,
    new_rank: int | None,
    group: P2PGroup,
    group_ranks: GroupRanks,
    old_state: MutableMapping[int, LocalTensor],
    into: Mapping[int, LocalTensor] | None = None,
    device: torch.device | str | None = None,
    options: StreamOptions | None = None,
    on_step: Callable[[int, int], None] | None = None,
    schedule: PreparedSchedule | None = None,
    staging: torch.Tensor | None = None,
    stand_in_state: Mapping[int, Mapping[int, LocalTensor]] | None = None,
) -> StreamResult:
    """Run this process's part of ``plan``; see the module docstring.

    ``old_state`` maps tensor index -> this process's old shard (``local_shape`` of the old view) for
    every tensor its old rank holds; empty when ``old_rank`` is None. ``into`` optionally gives
    preallocated new shards (e.g. the new model's storage) to write into instead of allocating.
    ``device`` is where new shards and buffers live (default: the old state's device, else the CPU).
    ``on_step(layer, round)`` is called before each of this process's steps (progress, cancellation).
    ``schedule`` is this process's schedule made beforehand by :func:`prepare_schedule` (while training
    still ran); it must have been made for the same plan, ranks, group and options (else
    :class:`PlanMismatch`); without it the schedule is built here. ``staging`` is the buffer to stage
    in, allocated (and its pages touched) beforehand: a 1-D ``uint8`` tensor on ``device`` of at least
    :func:`staging_bytes` (without it the executor allocates its own, and pays its first-touch page
    faults while it streams). It is extra memory all the same, and counted as such.
    ``stand_in_state`` maps each lost old rank this process stands in for (:attr:`Plan.stand_ins`: it
    keeps that rank's peer copy) to the copy as a local state (:func:`~..copies.peer.unpack`); its
    sends are made from it. Raises :class:`PlanMismatch` (or ``ValueError``) before any message is sent
    when the inputs do not fit the plan, and :class:`StreamError` when a peer fails.
    """
    opts = options or StreamOptions()
    if schedule is None:
        schedule = prepare_schedule(
            plan,
            old_rank=old_rank,
            new_rank=new_rank,
            group_ranks=group_ranks,
            group_rank=group.rank(),
            group_size=group.size(),
            options=opts,
        )
        schedule_s = schedule.seconds
    else:
        _check_prepared(schedule, plan, old_rank, new_rank, group_ranks, group.rank(), group.size(), opts)
        schedule_s = 0.0
    s = schedule.schedule
    dev = stream_device(device, old_state, into)
    _check_state(plan, s.old_shards, old_state, "old_state", dev, exact=True)
    standing = dict(stand_in_state or {})
    if standing.keys() != s.stand_in_shards.keys():
        raise PlanMismatch(
            f"stand_in_state: copies of old ranks {sorted(standing)}, the plan has this process stand in "
            f"for {sorted(s.stand_in_shards)}"
        )
    for rank, state in standing.items():
        _check_state(plan, s.stand_in_shards[rank], state, f"stand_in_state[{rank}]", dev, exact=True)
    if into is not None:
        _check_state(plan, s.new_shards, into, "into", dev, exact=False)
    preallocated = into is not None and all(ti in into for ti in s.new_shards)
    size = _buffer_size(plan, s, preallocated, touched=staging is not None)
    if staging is not None:
        if staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous():
            raise ValueError("`staging`: must be a contiguous 1-D uint8 tensor")
        if staging.device != dev or staging.numel() < size:
            raise ValueError(
                f"`staging`: {staging.numel()} bytes on {staging.device}, the stream needs {size} on {dev}"
            )
    stream = _Stream(plan, s, group, old_state, into, dev, opts, on_step, schedule_s, standing)
    return stream.run(ahead=preallocated, buffer_size=size, staging=staging)


def allocate_new_state(
    prepared: PreparedSchedule, device: torch.device | str = "cpu"
) -> dict[int, LocalTensor]:
    """Every new shard ``prepared``'s process will hold, allocated and zeroed now, to pass as ``into=``.

    For a caller with no storage of its own to stream into (no new model built before the cut). Left
    to the stream, allocation happens layer by layer while the bytes move, and the kernel's first-touch
    page faults of the whole new state (about 1 GiB/s for one process on the development VM, more than
    the transfer itself there) land on the paused path; made during preparation, they are paid beside
    training and the stream writes into memory already mapped. The result is the new state, not extra
    memory: it is what the stream would have returned.
    """
    dev = torch.device(device)
    plan = prepared.plan
    out: dict[int, LocalTensor] = {}
    for ti, pieces in prepared.schedule.new_shards.items():
        spec = plan.tensors[ti]
        made = [torch.zeros(p.local_shape, dtype=TORCH_DTYPES[spec.dtype], device=dev) for p in pieces]
        out[ti] = packed(spec, plan.model, made)
    return out


def staging_bytes(schedule: PreparedSchedule, *, preallocated: bool = True) -> int:
    """The staging buffer to allocate (and touch) beforehand and pass as ``stream_plan(..., staging=)``:
    streaming into preallocated new shards (``into=`` every one of them), or allocating them."""
    return _buffer_size(schedule.plan, schedule.schedule, preallocated, touched=True)


def _buffer_size(plan: Plan, s: Schedule, preallocated: bool, touched: bool) -> int:
    """With every new shard preallocated, steps are posted before the earlier ones are waited for as
    far as their staged pieces fit (never beyond B). In a buffer made and touched beforehand
    (``touched``) the window is as deep as B allows: every step's messages in flight at once measured
    faster than two steps on CPU (docs/benchmarks.md). In a buffer the stream allocates itself it is
    two steps: there a deeper window's first-touch page faults cost more than the overlap gains.
    Allocating shards, posting ahead would cost a whole layer."""
    size = s.buffer_bytes
    if preallocated:
        staged = sum(align(st.staging_bytes) for st in s.steps() if not st.copy_bytes)
        window = max(size, staged) if touched else min(max(size, staged), 2 * size)
        size = min(plan.budget_bytes, window)
    return size


class PreparedSchedule(NamedTuple):
    """A process's schedule and everything it was derived from.

    The schedule depends only on the plan, this process's ranks and group, and the options, never on
    tensor storage, so a switch builds it while training still runs (milliseconds for a tiny model,
    seconds for one with tens of thousands of slices) and the paused handoff only checks that it fits.
    """

    plan: Plan
    group_ranks: GroupRanks
    group_size: int
    message_bytes: int
    direct_receive: bool
    send_copy_bytes: int | None
    schedule: Schedule  # holds the old, new and group rank it was made for
    seconds: float  # what building it took


def prepare_schedule(
    plan: Plan,
    *,
    old_rank: int | None,
    new_rank: int | None,
    group_ranks: GroupRanks,
    group_rank: int,
    group_size: int,
    options: StreamOptions | None = None,
) -> PreparedSchedule:
    """This process's schedule for ``stream_plan(..., schedule=)``; raises :class:`PlanMismatch` when the
    plan and the identity do not fit (the checks ``stream_plan`` would do before its first message)."""
    opts = options or StreamOptions()
    t0 = time.perf_counter()
    built = build_schedule(
        plan,
        old_rank,
        new_rank,
        group_ranks,
        group_rank,
        group_size,
        opts.message_bytes,
        opts.direct_receive,
        opts.send_copy_bytes,
    )
    return PreparedSchedule(
        plan,
        group_ranks,
        group_size,
        opts.message_bytes,
        opts.direct_receive,
        opts.send_copy_bytes,
        built,
        time.perf_counter() - t0,
    )


def _check_prepared(
    prepared: PreparedSchedule,
    plan: Plan,
    old_rank: int | None,
    new_rank: int | None,
    group_ranks: GroupRanks,
    group_rank: int,
    group_size: int,
    opts: StreamOptions,
) -> None:
    """A prepared schedule must come from exactly this call's inputs: one made for another rank or plan
    would post messages no peer matches (a hang until the timeout) or write the wrong regions."""
    if not isinstance(prepared, PreparedSchedule):
        raise TypeError(f"schedule is a {type(prepared).__name__}, not a PreparedSchedule (prepare_schedule)")
    if prepared.plan is not plan and prepared.plan != plan:
        raise PlanMismatch(
            "schedule: prepared for another plan than the one streamed "
            f"({prepared.plan.old.layout.describe()} -> {prepared.plan.new.layout.describe()}, "
            f"{len(prepared.plan.tasks)} tasks; streamed: {plan.old.layout.describe()} -> "
            f"{plan.new.layout.describe()}, {len(plan.tasks)} tasks)"
        )
    for field, had, got in (
        ("old_rank", prepared.schedule.old_rank, old_rank),
        ("new_rank", prepared.schedule.new_rank, new_rank),
        ("group_ranks", prepared.group_ranks, group_ranks),
        ("group rank", prepared.schedule.group_rank, group_rank),
        ("group size", prepared.group_size, group_size),
        ("options.message_bytes", prepared.message_bytes, opts.message_bytes),
        ("options.direct_receive", prepared.direct_receive, opts.direct_receive),
        ("options.send_copy_bytes", prepared.send_copy_bytes, opts.send_copy_bytes),
    ):
        if had != got:
            raise PlanMismatch(f"schedule: prepared for {field} {had!r}, but this stream has {got!r}")


def stream_device(
    device: torch.device | str | None,
    old_state: Mapping[int, LocalTensor],
    into: Mapping[int, LocalTensor] | None = None,
) -> torch.device:
    """Where :func:`stream_plan` puts new shards and buffers: ``device``, else the old state's device,
    else (a process only in the new world) that of the shards it streams into, else the CPU."""
    if device is not None:
        return torch.device(device)
    for value in (*old_state.values(), *(into or {}).values()):
        return pieces_of(value)[0].device
    return torch.device("cpu")


def _check_state(
    plan: Plan,
    shards: Mapping[int, Holding],
    state: Mapping[int, LocalTensor],
    field: str,
    device: torch.device,
    exact: bool,
) -> None:
    for ti in state:
        if ti not in shards:
            what = plan.tensors[ti].name if isinstance(ti, int) and 0 <= ti < len(plan.tensors) else repr(ti)
            raise ValueError(f"{field}[{ti!r}] ({what}): this rank holds no such tensor in that world")
    for ti, pieces in shards.items():
        spec = plan.tensors[ti]
        value = state.get(ti)
        if value is None:
            if exact:
                raise ValueError(f"{field}[{ti}] ({spec.name}) is missing: the rank holds it")
            continue
        tensors = (value,) if isinstance(value, torch.Tensor) else value
        if not isinstance(tensors, tuple) or len(tensors) != len(pieces):
            raise ValueError(
                f"{field}[{ti}] ({spec.name}) must be {len(pieces)} tensor(s), one per piece the rank "
                f"holds, got a {type(value).__name__}"
                + (f" of {len(value)}" if isinstance(value, tuple) else "")
            )
        for k, (t, piece) in enumerate(zip(tensors, pieces)):
            where = f"{field}[{ti}]" + (f"[{k}]" if len(pieces) > 1 else "")
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{where} ({spec.name}) is a {type(t).__name__}, not a tensor")
            want_shape = piece.local_shape
            if tuple(t.shape) != tuple(want_shape):
                raise ValueError(
                    f"{where} ({spec.name}) has shape {tuple(t.shape)}, the view says {want_shape}"
                )
            if t.dtype != TORCH_DTYPES[spec.dtype]:
                raise ValueError(f"{where} ({spec.name}) has dtype {t.dtype}, the model says {spec.dtype}")
            if t.device != device:
                raise ValueError(f"{where} ({spec.name}) is on {t.device}, the stream runs on {device}")
            if not t.is_contiguous():
                raise ValueError(f"{where} ({spec.name}) is not contiguous")


def _piece(value: LocalTensor, k: int) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[k]


@functools.lru_cache(maxsize=1 << 16)
def _index(region: Region) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in region)


def _view(t: torch.Tensor, region: Region) -> torch.Tensor:
    # The four tensors of a parameter (and every layer alike) share regions: one index per region.
    return t[_index(region)]


def _extent(region: Region) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in region)


class _Pending(NamedTuple):
    work: Work
    msg: PeerMessage
    direction: Literal["send", "recv"]
    copy_bytes: int  # >0: the send goes from a copy of that size in the buffer, freed when it completes
    buffer: torch.Tensor  # keeps the message's memory alive until the work is done


class _Posted:
    """A step whose messages are posted and not yet all waited for."""

    __slots__ = ("base", "copied", "deadline", "local", "recvs", "sends", "step", "wait_s")

    def __init__(
        self,
        step: StreamStep,
        base: int,
        recvs: list[_Pending],
        sends: list[_Pending],
        copied: deque[int],
        deadline: float,
    ) -> None:
        self.step = step
        self.base = base  # where its staged pieces start in the buffer
        self.recvs = recvs
        self.sends = sends
        self.copied = copied  # indices into sends of those holding a copy, oldest first
        self.deadline = deadline
        self.wait_s = 0.0  # blocked while posting (waiting for room for a send copy)
        self.local = 0  # bytes copied locally (when it was posted)


class _CopyRing:
    """Where the next send copy goes in ``[lo, hi)`` of the buffer: pieces are placed in order and
    freed oldest first (the order their sends are waited for), wrapping to ``lo`` when the end is full."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.live: deque[tuple[int, int]] = deque()  # (offset, bytes), oldest first

    def place(self, nbytes: int) -> int | None:
        """An offset where ``nbytes`` fit now, or None until the oldest piece is freed."""
        if not self.live:
            if self.lo + nbytes > self.hi:
                raise AssertionError(f"send copy of {nbytes} bytes does not fit in [{self.lo}, {self.hi})")
            return self.lo
        first = self.live[0][0]
        last, size = self.live[-1]
        head = last + size
        if last >= first:  # not wrapped: free above the newest piece, then below the oldest
            if head + nbytes <= self.hi:
                return head
            return self.lo if self.lo + nbytes <= first else None
        return head if head + nbytes <= first else None

    def push(self, offset: int, nbytes: int) -> None:
        self.live.append((offset, nbytes))

    def pop(self) -> None:
        self.live.popleft()


class _Stream:
    def __init__(
        self,
        plan: Plan,
        schedule: Schedule,
        group: P2PGroup,
        old_state: MutableMapping[int, LocalTensor],
        into: Mapping[int, LocalTensor] | None,
        device: torch.device,
        opts: StreamOptions,
        on_step: Callable[[int, int], None] | None,
        schedule_s: float = 0.0,
        stand_ins: Mapping[int, Mapping[int, LocalTensor]] | None = None,
    ) -> None:
        self.plan = plan
        self.schedule_s = schedule_s
        self.s = schedule
        self.group = group
        self.old = old_state
        self.stand_ins = dict(stand_ins or {})
        self.into = into
        self.device = device
        self.opts = opts
        self.on_step = on_step
        self.mem = MemoryLedger()
        self.new: dict[int, LocalTensor] = {}
        self.buffer = torch.empty(0, dtype=torch.uint8, device=device)
        self.released = False
        self.released_bytes = 0
        self.sent = self.received = self.local = 0
        self.throttle_s = 0.0
        self.log = log.bind(
            old_rank=schedule.old_rank, new_rank=schedule.new_rank, group_rank=schedule.group_rank
        )

    def run(self, *, ahead: bool, buffer_size: int, staging: torch.Tensor | None) -> StreamResult:
        """Stream, posting ahead when ``ahead`` (every new shard given), in a buffer of ``buffer_size``
        bytes: the front of ``staging`` when given, else one allocated here."""
        t0 = time.perf_counter()
        self.t0 = t0
        old_bytes = sum(t.numel() * t.element_size() for v in self.old.values() for t in pieces_of(v))
        self.mem.add("old", old_bytes)
        self.ahead = ahead
        size = self.buffer_size = buffer_size
        if size:
            if staging is not None:
                self.buffer = staging[:size]
            else:
                self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.mem.add("buffer", size)
        self.log.info(
            "stream.start",
            steps=sum(len(lw.steps) for lw in self.s.layers),
            buffer_bytes=size,
            post_ahead=self.ahead,
            release_old=self.opts.release_old,
            schedule_seconds=round(self.schedule_s, 4),
        )
        if self.opts.release_old:
            for ti in self.s.unread_old:
                self._release(ti)
        layers = self._layers()
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.mem.sub("buffer", size)
        stats = StreamStats(
            old_rank=self.s.old_rank,
            new_rank=self.s.new_rank,
            group_rank=self.s.group_rank,
            seconds=time.perf_counter() - t0,
            bytes_sent=self.sent,
            bytes_received=self.received,
            bytes_local=self.local,
            budget_bytes=self.plan.budget_bytes,
            buffer_bytes=size,
            staging_bytes=self.mem.peak["staged"],
            send_copy_budget=self.s.copy_budget,
            peak_send_copy_bytes=self.mem.peak["send_copies"],
            largest_new_layer_bytes=max((lw.new_bytes for lw in self.s.layers), default=0),
            peak_extra_bytes=self.mem.peak_extra,
            peak_footprint_bytes=self.mem.peak_footprint,
            old_bytes=old_bytes,
            old_bytes_released=self.released_bytes,
            throttle_seconds=self.throttle_s,
            layers=tuple(layers),
            schedule_seconds=self.schedule_s,
        )
        self.log.info(
            "stream.done",
            seconds=round(stats.seconds, 4),
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            peak_extra_bytes=stats.peak_extra_bytes,
        )
        return StreamResult(dict(sorted(self.new.items())), stats)

    # -- the walk: steps posted in order, finished in order ----------------------------------------

    def _layers(self) -> list[LayerStats]:
        """Every step, in order; with ``self.ahead``, later steps are posted while earlier ones finish.

        A step is posted early only when neither it nor any step in flight sends from copies and its
        staged pieces fit in the buffer beside theirs (a FIFO ring: steps finish in the order they
        were posted). Every process still posts each step's receives before anything it could block
        on in that step, and blocks in step order, so the order alone still rules out deadlock.
        """
        flat = [(i, st) for i, lw in enumerate(self.s.layers) for st in lw.steps]
        ring = _CopyRing(0, self.buffer_size)
        posted: deque[_Posted] = deque()
        opened: dict[int, tuple[float, int]] = {}  # layer index -> (start, bytes owned)
        acc: dict[int, list[float | int]] = {}
        out: list[LayerStats] = []
        nxt = 0  # the next step of ``flat`` to post

        def open_layer(i: int) -> None:
            if i not in opened:
                opened[i] = (time.perf_counter(), self._allocate(self.s.layers[i]))
                acc[i] = [0.0, 0, 0, 0, 0, 0]  # wait s, sent, received, local, messages sent, received

        def close_layer(i: int) -> None:
            lw = self.s.layers[i]
            start, owned = opened[i]
            self.mem.move("assembly", "new", owned)
            wait_s, sent, received, local, n_sent, n_recv = acc.pop(i)
            stats = LayerStats(
                layer=lw.layer,
                rounds=len(lw.steps),
                seconds=time.perf_counter() - start,
                wait_seconds=float(wait_s),
                bytes_sent=int(sent),
                bytes_received=int(received),
                bytes_local=int(local),
                messages_sent=int(n_sent),
                messages_received=int(n_recv),
                new_bytes=lw.new_bytes,
            )
            self.log.debug(
                "stream.layer", layer=lw.layer, seconds=round(stats.seconds, 5), rounds=stats.rounds
            )
            out.append(stats)

        def can_post_ahead(st: StreamStep) -> bool:
            if not self.ahead or st.copy_bytes or any(p.step.copy_bytes for p in posted):
                return False
            return not st.staging_bytes or ring.place(align(st.staging_bytes)) is not None

        for i, lw in enumerate(self.s.layers):
            open_layer(i)
            for _ in lw.steps:
                batch: list[_Posted] = []
                while nxt < len(flat) and ((not posted and not batch) or can_post_ahead(flat[nxt][1])):
                    li, st = flat[nxt]
                    open_layer(li)
                    batch.append(self._post_recvs(st, ring))
                    posted.append(batch[-1])
                    nxt += 1
                # Every receive of the batch before any of its sends: a peer's send only flows once
                # the receive it matches is posted here.
                for b in batch:
                    self._post_sends(b)
                for b in batch:
                    b.local = self._copy_local(b.step)
                done = posted.popleft()
                before = (self.sent, self.received)
                a = acc[i]
                a[0] += self._finish_step(done, ring)
                a[1] += self.sent - before[0]
                a[2] += self.received - before[1]
                a[3] += done.local
                a[4] += len(done.step.sends)
                a[5] += len(done.step.recvs)
            close_layer(i)
        return out

    def _allocate(self, lw: LayerWork) -> int:
        """The layer's new shards, padding rows zeroed; returns the bytes this executor allocated."""
        owned = 0
        for ti in lw.new_tensors:
            pieces = self.s.new_shards[ti]
            spec = self.plan.tensors[ti]
            given = self.into.get(ti) if self.into is not None else None
            made: list[torch.Tensor] = []
            for k, shard in enumerate(pieces):
                if given is None:
                    t = torch.empty(shard.local_shape, dtype=TORCH_DTYPES[spec.dtype], device=self.device)
                    owned += t.numel() * t.element_size()
                else:
                    t = _piece(given, k)
                    self.mem.add("new", t.numel() * t.element_size())
                if shard.box is None:
                    t.zero_()
                elif shard.box and shard.box[0][1] - shard.box[0][0] < shard.local_shape[0]:
                    t[shard.box[0][1] - shard.box[0][0] :].zero_()
                made.append(t)
            self.new[ti] = packed(spec, self.plan.model, made)
        self.mem.add("assembly", owned)
        return owned

    # -- one step ----------------------------------------------------------------------------------

    def _post_recvs(self, step: StreamStep, ring: _CopyRing) -> _Posted:
        """Post the step's receives (staged ones into its part of the buffer)."""
        if self.on_step is not None:
            self.on_step(step.layer, step.round)
        self._throttle()
        base = 0
        if step.staging_bytes:
            at = ring.place(align(step.staging_bytes))
            if at is None:
                raise AssertionError(f"layer {step.layer} round {step.round}: posted without staging room")
            base = at
            ring.push(at, align(step.staging_bytes))
        posted = _Posted(step, base, [], [], deque(), time.monotonic() + self.opts.timeout_s)
        for msg in step.recvs:
            buf = self._recv_buffer(msg, base)
            work = self._post(step, msg, "recv", lambda b=buf, m=msg: self.group.recv([b], m.peer, step.tag))
            posted.recvs.append(_Pending(work, msg, "recv", 0, buf))
        self.mem.add("staged", step.staging_bytes)
        return posted

    def _post_sends(self, posted: _Posted) -> None:
        """Post the step's sends; one that sends from copies fills the part of the buffer above its
        staged pieces, waiting for its own oldest copies when that part is full."""
        step = posted.step
        if not step.sends:
            return
        lo = align(step.staging_bytes)
        copies = _CopyRing(lo, min(self.buffer_size, lo + max(self.s.copy_budget, step.largest_copy)))
        for msg in step.sends:
            src = _view(_piece(self._source(msg.source)[msg.tensor], msg.piece), msg.region)
            copy_bytes = 0
            if msg.copy:
                copy_bytes = align(msg.nbytes)
                while (at := copies.place(copy_bytes)) is None:
                    posted.wait_s += self._wait(step, posted.sends[posted.copied.popleft()], posted.deadline)
                    copies.pop()
                src = self._in_buffer(at, msg).copy_(src)
                copies.push(at, copy_bytes)
                self.mem.add("send_copies", copy_bytes)
                posted.copied.append(len(posted.sends))
            elif not src.is_contiguous():
                raise AssertionError(
                    f"schedule marked {self.plan.tensors[msg.tensor].name}{msg.box} contiguous"
                )
            work = self._post(step, msg, "send", lambda b=src, m=msg: self.group.send([b], m.peer, step.tag))
            posted.sends.append(_Pending(work, msg, "send", copy_bytes, src))

    def _source(self, rank: int) -> Mapping[int, LocalTensor]:
        """The old state a piece is read from: this process's own, or a lost rank's peer copy."""
        return self.old if rank == OWN else self.stand_ins[rank]

    def _copy_local(self, step: StreamStep) -> int:
        """The slices that stay here, while the step's messages are in flight; returns the bytes."""
        nbytes = 0
        for c in step.copies:
            _view(_piece(self.new[c.tensor], c.dst_piece), c.dst).copy_(
                _view(_piece(self._source(c.source)[c.tensor], c.src_piece), c.src)
            )
            nbytes += c.nbytes
        self.local += nbytes
        return nbytes

    def _finish_step(self, posted: _Posted, ring: _CopyRing) -> float:
        """Wait, assemble staged pieces; returns the seconds spent blocked on the network.
        The step's deadline runs from when it is posted or, if it was posted early, from now."""
        step = posted.step
        deadline = max(posted.deadline, time.monotonic() + self.opts.timeout_s)
        wait_s = posted.wait_s
        for p in posted.recvs:
            wait_s += self._wait(step, p, deadline)
            if p.msg.staging_offset >= 0:
                _view(_piece(self.new[p.msg.tensor], p.msg.piece), p.msg.region).copy_(p.buffer)
            self.received += p.msg.nbytes
        for i in posted.copied:
            wait_s += self._wait(step, posted.sends[i], deadline)
        for p in posted.sends:
            if p.copy_bytes == 0:
                wait_s += self._wait(step, p, deadline)
            self.sent += p.msg.nbytes
        self.mem.sub("staged", step.staging_bytes)
        if step.staging_bytes:
            ring.pop()
        if self.opts.release_old:
            for ti in step.release_after:
                self._release(ti)
        return wait_s

    def _recv_buffer(self, msg: PeerMessage, base: int) -> torch.Tensor:
        if msg.staging_offset < 0:
            buf = _view(_piece(self.new[msg.tensor], msg.piece), msg.region)
            if not buf.is_contiguous():
                raise AssertionError(
                    f"schedule marked {self.plan.tensors[msg.tensor].name}{msg.box} contiguous"
                )
            return buf
        return self._in_buffer(base + msg.staging_offset, msg)

    def _in_buffer(self, offset: int, msg: PeerMessage) -> torch.Tensor:
        dtype = TORCH_DTYPES[self.plan.tensors[msg.tensor].dtype]
        return self.buffer[offset : offset + msg.nbytes].view(dtype).view(_extent(msg.region))

    def _post(
        self, step: StreamStep, msg: PeerMessage, direction: Literal["send", "recv"], call: Callable[[], Work]
    ) -> Work:
        try:
            return call()
        except RuntimeError as exc:
            raise self._error(step, msg, direction, str(exc)) from exc

    def _wait(self, step: StreamStep, p: _Pending, deadline: float) -> float:
        """Wait for one message until the step's deadline; frees its send copy. Returns seconds waited."""
        t0 = time.perf_counter()
        left = max(deadline - time.monotonic(), 0.001)
        try:
            done = p.work.wait(timedelta(seconds=left))
        except RuntimeError as exc:
            raise self._error(step, p.msg, p.direction, str(exc)) from exc
        if done is False:
            raise self._error(step, p.msg, p.direction, f"no completion within {self.opts.timeout_s} s")
        if p.copy_bytes:
            self.mem.sub("send_copies", p.copy_bytes)
        return time.perf_counter() - t0

    def _error(
        self, step: StreamStep, msg: PeerMessage, direction: Literal["send", "recv"], reason: str
    ) -> StreamError:
        err = StreamError(
            layer=step.layer,
            round=step.round,
            peer=msg.peer,
            peer_rank=msg.peer_rank,
            peer_world="new" if direction == "send" else "old",
            direction=direction,
            reason=reason.splitlines()[0] if reason else "unknown transport error",
            old_state_intact=not self.released,
        )
        self.log.warning(
            "stream.failed",
            layer=step.layer,
            round=step.round,
            peer=msg.peer,
            direction=direction,
            reason=err.reason,
            old_state_intact=err.old_state_intact,
        )
        self.new.clear()
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        return err

    def _release(self, ti: int) -> None:
        value = self.old.pop(ti, None)
        if value is None:
            return
        self.released = True
        for t in pieces_of(value):
            nbytes = t.numel() * t.element_size()
            storage = t.untyped_storage()
            if t.storage_offset() == 0 and storage.nbytes() == nbytes:
                storage.resize_(0)
            self.mem.sub("old", nbytes)
            self.released_bytes += nbytes

    def _throttle(self) -> None:
        rate = self.opts.max_bytes_per_s
        if rate is None:
            return
        ready_at = self.t0 + (self.sent + self.received) / rate
        wait = ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
            self.throttle_s += wait
