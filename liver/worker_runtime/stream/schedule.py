"""One process's part of a transfer plan, turned into the exact messages it posts (pure, no torch).

Sender and receiver never exchange metadata: each side derives the same message sequence from the plan
alone. For every task the slices go in the task's order; a slice that is contiguous in its source's
local tensor is one message (sent straight from the old storage), a slice that is not is cut with
:func:`liver.reshard.boxes.split` into pieces of at most ``message_bytes`` so the sender's contiguous
copies stay bounded (pieces are also at most half of the plan's budget). Both sides therefore must use
the same ``message_bytes``.

On the receiving side a piece whose destination region is contiguous in the new local tensor can be
received in place (``direct_receive``); every other piece gets an offset in the staging buffer. Offsets
are assigned in decreasing item size, so every offset is a multiple of its element size without padding
and the staging need of a step is exactly the bytes it stages, which the planner keeps within the budget.

One buffer holds both what a step stages and the contiguous copies it sends: the copies use the part
above the step's staged bytes. :func:`buffer_bytes` sizes it (never more than the plan's budget ``B``)
and refuses a plan in which some step stages so much that one send piece no longer fits beside it, so
the executor's extra memory is the buffer plus the layer under assembly, within ``B`` plus that layer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterator, Sequence
from typing import Final, NamedTuple

import msgspec

from liver.reshard.boxes import Box, contains, split, volume
from liver.reshard.holdings import Holding, holding, is_dp_sharded
from liver.reshard.plan import Plan, TransferTask
from liver.reshard.redundancy import copied_tensors
from liver.reshard.views import Shard
from liver.shared.errors import InputError
from liver.shared.layout import Device
from liver.shared.model import TensorSpec

Region = tuple[tuple[int, int], ...]
"""A box in a local tensor's own indices (0-based), as ``(lo, hi)`` per dimension."""


class PlanMismatch(InputError):
    """The plan, this process's identity and its group numbering do not fit together."""


LOST_RANK: Final = -1
"""``GroupRanks.old`` of an old rank whose process is gone (a lost device): no process, no message."""

OWN: Final = -1
"""``PeerMessage.source`` / ``LocalCopy.source`` of a piece of this process's own old state (else the
lost old rank it stands in for, whose peer copy holds the piece)."""


class GroupRanks(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where each plan rank lives in the process group that carries the stream.

    ``old[r]`` is the group rank of the process running old rank ``r`` (:data:`LOST_RANK` when its
    device is lost: a plan made around it never reads from it), ``new[r]`` the same for new rank ``r``.
    A process that runs an old and a new rank (one device, both worlds) appears in both.
    """

    old: tuple[int, ...]
    new: tuple[int, ...]

    @classmethod
    def by_device(cls, plan: Plan, lost: Collection[Device] = ()) -> GroupRanks:
        """The default numbering: one process per device, old devices in old rank order first, then the
        devices only the new world uses in new rank order; ``lost`` devices have no process, but a lost
        rank that stands in (:attr:`Plan.stand_ins`) is its keeper's process, which runs its sends."""
        order = devices_in_stream_order(plan, lost)
        index = {d: i for i, d in enumerate(order)}
        old = [index.get(d, LOST_RANK) for d in plan.old.placement.devices]
        for rank, keeper in plan.stand_ins:
            old[rank] = old[keeper]
        return cls(old=tuple(old), new=tuple(index[d] for d in plan.new.placement.devices))


def devices_in_stream_order(plan: Plan, lost: Collection[Device] = ()) -> tuple[Device, ...]:
    """Every device of either world once, but the ``lost`` ones: the numbering of
    :meth:`GroupRanks.by_device` (the same as :func:`liver.worker_runtime.world.stream_devices`)."""
    seen = dict.fromkeys(d for d in plan.old.placement.devices if d not in lost)
    for d in plan.new.placement.devices:
        if d in lost:
            raise PlanMismatch(f"device {d} is lost, but the plan's new world runs on it")
        seen.setdefault(d)
    return tuple(seen)


def ranks_on_device(plan: Plan, device: Device) -> tuple[int | None, int | None]:
    """``(old rank, new rank)`` that run on ``device``; ``None`` where a world does not use it."""
    return plan.old.placement.rank_on().get(device), plan.new.placement.rank_on().get(device)


class PeerMessage(NamedTuple):
    """One point-to-point message: a piece of one slice of one task."""

    peer: int  # group rank of the other process
    peer_rank: int  # the other side's plan rank (an old rank when receiving, a new rank when sending)
    tensor: int
    box: Box  # global indices of the piece
    nbytes: int
    region: Region  # in this side's local tensor: the old shard when sending, the new one when receiving
    copy: bool  # sender: the region is not contiguous, so the piece goes from a contiguous copy
    staging_offset: int  # receiver: offset in the staging buffer, -1 when received in place
    piece: int = 0  # which of this side's local tensors of ``tensor`` (see ``Holding``) holds ``region``
    source: int = OWN  # sender: the old rank whose state ``region`` is in (OWN: this process's own)


class LocalCopy(NamedTuple):
    """A slice moving from this process's old shard to its new shard without the network."""

    tensor: int
    src: Region
    dst: Region
    nbytes: int
    src_piece: int = 0
    dst_piece: int = 0
    source: int = OWN  # the old rank whose state ``src`` is in (OWN: this process's own)


class StreamStep(NamedTuple):
    """This process's share of one streaming step ``(layer, round)``.

    Sends are ordered by destination, receives by source, each in task and slice order, which is the
    order the other side posts them in.
    """

    layer: int
    round: int
    tag: int
    recvs: tuple[PeerMessage, ...]
    sends: tuple[PeerMessage, ...]
    copies: tuple[LocalCopy, ...]
    staging_bytes: int
    release_after: tuple[int, ...]  # old tensors this process reads for the last time in this step
    copy_bytes: int = 0  # its sends from contiguous copies, each rounded up to ALIGN
    largest_copy: int = 0  # the largest of them, rounded up to ALIGN


class LayerWork(NamedTuple):
    """A layer's new shards (allocated when the layer starts) and its steps."""

    layer: int
    new_tensors: tuple[int, ...]
    new_bytes: int
    steps: tuple[StreamStep, ...]


class Schedule(NamedTuple):
    old_rank: int | None
    new_rank: int | None
    group_rank: int
    old_shards: dict[int, Holding]  # every tensor this process's old rank holds, as its pieces
    stand_in_shards: dict[int, dict[int, Holding]]  # lost old rank it stands in for -> its copied pieces
    new_shards: dict[int, Holding]  # every tensor its new rank holds
    layers: tuple[LayerWork, ...]
    unread_old: tuple[int, ...]  # old tensors no task of this plan reads from this process
    staging_bytes: int  # the largest staging need of any step (at most the plan's budget)
    buffer_bytes: int  # the one buffer for staged pieces and send copies (at most the plan's budget)
    copy_budget: int  # the most bytes of send copies alive at once

    def steps(self) -> Iterator[StreamStep]:
        for lw in self.layers:
            yield from lw.steps


ALIGN = 8
"""Send copies start at multiples of the widest element size, so any dtype can view them."""


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def step_tag(layer: int, rnd: int) -> int:
    """A message tag both sides derive from the step, so a message can never match another step's."""
    return (layer * 65536 + rnd) % 2_147_483_647


def region_is_contiguous(region: Region, shape: Sequence[int]) -> bool:
    """Whether ``region`` of a row-major tensor of ``shape`` is one contiguous run of memory.

    It is when, after the first dimension it spans more than one index of, it spans every later
    dimension in full.
    """
    spread = False
    for (lo, hi), n in zip(region, shape):
        if spread and hi - lo != n:
            return False
        if hi - lo > 1:
            spread = True
    return True


def _local(box: Box, origin: Box) -> Region:
    return tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


class _Placed(NamedTuple):
    """Where one slice sits in its source's and destination's local tensors (which piece of each)."""

    src_shard: Shard
    dst_shard: Shard
    src: Region
    dst: Region
    elements: int
    src_contiguous: bool
    dst_contiguous: bool
    src_piece: int
    dst_piece: int


ViewKey = tuple[tuple[int, ...], str, str, int, int]


def view_key(t: TensorSpec) -> ViewKey:
    """Every field of a tensor that :func:`liver.reshard.views.view` reads: tensors with one key have one
    view in every layout. A parameter and its optimizer states share a key, so a schedule derives
    shards and regions once per parameter instead of once per tensor (a quarter of the work)."""
    return (t.shape, t.rule, t.home, t.layer, t.expert)


class _Views:
    """Holdings memoized by :func:`view_key` (and, for state DP ranks hold different pieces of, the
    parameter), per layout and rank."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        model = plan.model
        self.keys = [(view_key(t), t.param if is_dp_sharded(t, model) else None) for t in plan.tensors]
        self.memo: dict[tuple[object, bool, int], Holding | None] = {}

    def __call__(self, ti: int, rank: int, old: bool) -> Holding | None:
        k = (self.keys[ti], old, rank)
        if k in self.memo:
            return self.memo[k]
        layout = self.plan.old.layout if old else self.plan.new.layout
        s = self.memo[k] = holding(self.plan.tensors[ti], self.plan.model, layout, rank)
        return s

    def shards(self, rank: int | None, old: bool) -> dict[int, Holding]:
        if rank is None:
            return {}
        out: dict[int, Holding] = {}
        for ti in range(len(self.keys)):
            s = self(ti, rank, old)
            if s is not None:
                out[ti] = s
        return out


def _containing(pieces: Holding | None, box: Box) -> int:
    """The index of the piece that holds ``box`` whole, or -1."""
    for k, piece in enumerate(pieces or ()):
        if piece.box is not None and contains(piece.box, box):
            return k
    return -1


def holding_elements(pieces: Holding) -> int:
    """Elements of state in a holding (padding excluded)."""
    return sum(volume(p.box) for p in pieces if p.box is not None)


def holding_bytes(pieces: Holding, itemsize: int) -> int:
    """Bytes of a holding's local tensors (padding included)."""
    return sum(_numel(p.local_shape) for p in pieces) * itemsize


def _check_identity(
    plan: Plan,
    old_rank: int | None,
    new_rank: int | None,
    ranks: GroupRanks,
    group_rank: int,
    group_size: int,
) -> None:
    n_old, n_new = plan.old.layout.world_size, plan.new.layout.world_size
    if old_rank is None and new_rank is None:
        raise PlanMismatch("old_rank and new_rank are both None: this process takes no part in the plan")
    if old_rank is not None and not 0 <= old_rank < n_old:
        raise PlanMismatch(f"old_rank {old_rank} outside the old world of {n_old} ranks")
    if new_rank is not None and not 0 <= new_rank < n_new:
        raise PlanMismatch(f"new_rank {new_rank} outside the new world of {n_new} ranks")
    standing = dict(plan.stand_ins)
    for field, got, want in (("group_ranks.old", ranks.old, n_old), ("group_ranks.new", ranks.new, n_new)):
        if len(got) != want:
            raise PlanMismatch(f"{field} has {len(got)} entries, the world has {want} ranks")
        present = [
            g
            for r, g in enumerate(got)
            if field == "group_ranks.new" or (g != LOST_RANK and r not in standing)
        ]
        if len(set(present)) != len(present):
            raise PlanMismatch(f"{field} maps two ranks to one process: {list(got)}")
        bad = [g for g in present if not 0 <= g < group_size]
        if bad:
            raise PlanMismatch(f"{field} names group ranks {bad} outside a group of {group_size}")
    for lost_rank, keeper in standing.items():
        if (
            0 <= lost_rank < len(ranks.old)
            and 0 <= keeper < len(ranks.old)
            and ranks.old[lost_rank] != ranks.old[keeper]
        ):
            raise PlanMismatch(
                f"group_ranks.old: old rank {lost_rank} stands in on {keeper}'s process, not elsewhere"
            )
    for field, table, rank in (("old_rank", ranks.old, old_rank), ("new_rank", ranks.new, new_rank)):
        own = field == "new_rank"
        here = [r for r, g in enumerate(table) if g == group_rank and (own or r not in standing)]
        if here != ([] if rank is None else [rank]):
            raise PlanMismatch(
                f"{field} is {rank}, but group_ranks put {here or 'no rank'} of that world in this process "
                f"(group rank {group_rank})"
            )


def build_schedule(
    plan: Plan,
    old_rank: int | None,
    new_rank: int | None,
    ranks: GroupRanks,
    group_rank: int,
    group_size: int,
    message_bytes: int,
    direct_receive: bool = True,
    copy_budget: int | None = None,
) -> Schedule:
    """The messages, copies, staging offsets and buffer size of one process; raises
    :class:`PlanMismatch`. ``copy_budget`` caps the send copies alive at once (default two pieces)."""
    _check_identity(plan, old_rank, new_rank, ranks, group_rank, group_size)
    message_bytes = _piece_bytes(plan, message_bytes)
    views = _Views(plan)
    old_shards = views.shards(old_rank, old=True)
    new_shards = views.shards(new_rank, old=False)
    # The lost ranks whose sends this process runs from the peer copies it keeps.
    standing = [r for r, k in plan.stand_ins if old_rank is not None and k == old_rank]
    stand_in_shards = {r: _copied_shards(plan, views, r) for r in standing}
    walk = _TaskWalk(plan, views, ranks, old_rank, new_rank, stand_in_shards, message_bytes, direct_receive)
    for task in plan.tasks:
        walk.add(task)
    _check_coverage(plan, new_shards, walk.received, new_rank)
    release = _releases(walk.last_read)
    unread = tuple(ti for ti in old_shards if ti not in walk.last_read)
    steps_by_layer = _steps_by_layer(plan, walk.by_step, release, new_rank)
    layers = _layer_work(plan, new_shards, steps_by_layer)
    every_step = [st for lw in layers for st in lw.steps]
    staging_max = max((st.staging_bytes for st in every_step), default=0)
    cap = 2 * message_bytes if copy_budget is None else copy_budget
    buffer = buffer_bytes(every_step, plan.budget_bytes, cap, old_rank, new_rank)
    return Schedule(
        old_rank,
        new_rank,
        group_rank,
        old_shards,
        stand_in_shards,
        new_shards,
        tuple(layers),
        unread,
        staging_max,
        buffer,
        cap,
    )


def _piece_bytes(plan: Plan, message_bytes: int) -> int:
    """The largest piece a non-contiguous slice is cut into: ``message_bytes``, but at most half of the
    plan's budget, so a piece and a step's staged bytes fit in B together unless the step stages more
    than half of it; both sides derive the same size from the plan."""
    if message_bytes < 8:
        raise PlanMismatch(f"message_bytes must be at least 8 (one element), got {message_bytes}")
    return min(message_bytes, max(ALIGN, plan.budget_bytes // 2 // ALIGN * ALIGN))


def _place(plan: Plan, views: _Views, task: TransferTask, ti: int, box: Box) -> _Placed:
    """Where slice ``box`` of tensor ``ti`` sits in the task's source and destination holdings."""
    t = plan.tensors[ti]
    s_pieces, d_pieces = views(ti, task.src, old=True), views(ti, task.dst, old=False)
    sk, dk = _containing(s_pieces, box), _containing(d_pieces, box)
    if sk < 0:
        raise PlanMismatch(
            f"task layer {task.layer} round {task.round}: old rank {task.src} does not hold {t.name}{box}"
        )
    if dk < 0:
        raise PlanMismatch(
            f"task layer {task.layer} round {task.round}: new rank {task.dst} does not need {t.name}{box}"
        )
    assert s_pieces is not None and d_pieces is not None
    s, d = s_pieces[sk], d_pieces[dk]
    assert s.box is not None and d.box is not None
    src, dst = _local(box, s.box), _local(box, d.box)
    return _Placed(
        s,
        d,
        src,
        dst,
        volume(box),
        region_is_contiguous(src, s.local_shape),
        region_is_contiguous(dst, d.local_shape),
        sk,
        dk,
    )


class _StepMessages(NamedTuple):
    """What one step ``(layer, round)`` of this process gathers while the tasks are walked."""

    recvs: list[PeerMessage]
    sends: list[PeerMessage]
    copies: list[LocalCopy]


class _Route(NamedTuple):
    """One task as this process takes part in it."""

    task: TransferTask
    sending: bool  # its old rank, or a lost one it stands in for, is the task's source
    receiving: bool  # its new rank is the task's destination
    source: int  # OWN, or the lost old rank whose peer copy the task reads
    src_g: int  # the group ranks of the sending and the receiving process
    dst_g: int
    out: _StepMessages  # the task's step


class _TaskWalk:
    """The tasks of a plan, walked once in plan order, turned into this process's messages and local
    copies per step, together with what the checks after the walk need: the elements each new tensor
    receives and the step each own old tensor is read for the last time in. Slices are placed once per
    parameter (:func:`view_key`), source and destination."""

    def __init__(
        self,
        plan: Plan,
        views: _Views,
        ranks: GroupRanks,
        old_rank: int | None,
        new_rank: int | None,
        stand_in_shards: dict[int, dict[int, Holding]],
        message_bytes: int,
        direct_receive: bool,
    ) -> None:
        self.plan = plan
        self.views = views
        self.ranks = ranks
        self.old_rank = old_rank
        self.new_rank = new_rank
        self.stand_in_shards = stand_in_shards
        self.served = {old_rank, *stand_in_shards} if old_rank is not None else set()
        self.message_bytes = message_bytes
        self.direct_receive = direct_receive
        self.placed: dict[tuple[ViewKey, int, int, Box], _Placed] = {}
        self.received: dict[int, int] = defaultdict(int)
        self.last_read: dict[int, tuple[int, int]] = {}
        self.by_step: dict[tuple[int, int], _StepMessages] = {}

    def add(self, task: TransferTask) -> None:
        """This process's share of ``task`` (nothing when it neither sends nor receives it)."""
        route = self._route(task)
        if route is None:
            return
        if route.sending:
            self._note_reads(route)
        for ti, box in task.slices:
            self._add_slice(route, ti, box)

    def _route(self, task: TransferTask) -> _Route | None:
        """How this process takes part in ``task`` (None: not at all), once the plan's ranks, locality
        and the group's numbering are checked to agree on it."""
        sending = task.src in self.served
        receiving = task.dst == self.new_rank
        if not (sending or receiving):
            return None
        ranks = self.ranks
        if not 0 <= task.src < len(ranks.old) or not 0 <= task.dst < len(ranks.new):
            raise PlanMismatch(f"task layer {task.layer}: ranks {task.src}->{task.dst} outside the worlds")
        src_g, dst_g = ranks.old[task.src], ranks.new[task.dst]
        if src_g == LOST_RANK:
            raise PlanMismatch(f"task layer {task.layer} {task.src}->{task.dst} reads from a lost old rank")
        if task.local != (src_g == dst_g):
            raise PlanMismatch(
                f"task layer {task.layer} {task.src}->{task.dst}: the plan says local={task.local}, "
                f"but group_ranks put them in processes {src_g} and {dst_g}"
            )
        out = self.by_step.setdefault((task.layer, task.round), _StepMessages([], [], []))
        source = OWN if task.src == self.old_rank else task.src
        return _Route(task, sending, receiving, source, src_g, dst_g, out)

    def _note_reads(self, route: _Route) -> None:
        """Record when this process's own old tensors are read last; check that a peer copy it sends
        from holds what the task reads."""
        task = route.task
        if route.source == OWN:  # the peer copies are kept whole until the stream ends
            for ti, _box in task.slices:
                self.last_read[ti] = (task.layer, task.round)
        elif any(ti not in self.stand_in_shards[route.source] for ti, _ in task.slices):
            raise PlanMismatch(
                f"task layer {task.layer} {task.src}->{task.dst}: the peer copy of old rank {task.src} "
                "does not hold every tensor it sends"
            )

    def _add_slice(self, route: _Route, ti: int, box: Box) -> None:
        """One slice of the task: a local copy, one message, or pieces, as its placement allows."""
        task = route.task
        k = (self.views.keys[ti], task.src, task.dst, box)
        p = self.placed.get(k)
        if p is None:
            p = self.placed[k] = _place(self.plan, self.views, task, ti, box)
        if route.receiving:
            self.received[ti] += p.elements
        if task.local:
            nbytes = p.elements * self.plan.tensors[ti].itemsize
            route.out.copies.append(
                LocalCopy(ti, p.src, p.dst, nbytes, p.src_piece, p.dst_piece, route.source)
            )
        elif p.src_contiguous:  # one message, straight from the old storage
            self._add_whole(route, ti, box, p)
        else:
            self._add_pieces(route, ti, box, p)

    def _add_whole(self, route: _Route, ti: int, box: Box, p: _Placed) -> None:
        """The slice as one message: its source region is contiguous."""
        task = route.task
        nbytes = p.elements * self.plan.tensors[ti].itemsize
        if route.sending:
            route.out.sends.append(
                PeerMessage(
                    route.dst_g, task.dst, ti, box, nbytes, p.src, False, -1, p.src_piece, route.source
                )
            )
        else:
            staged = not (self.direct_receive and p.dst_contiguous)
            route.out.recvs.append(
                PeerMessage(
                    route.src_g, task.src, ti, box, nbytes, p.dst, False, 0 if staged else -1, p.dst_piece
                )
            )

    def _add_pieces(self, route: _Route, ti: int, box: Box, p: _Placed) -> None:
        """The slice cut into pieces of at most ``message_bytes``: its source region is not contiguous,
        so each piece is sent from a contiguous copy where its own region is not contiguous either."""
        task = route.task
        itemsize = self.plan.tensors[ti].itemsize
        s, d = p.src_shard, p.dst_shard
        assert s.box is not None and d.box is not None
        for piece in split(box, max(1, self.message_bytes // itemsize)):
            nbytes = volume(piece) * itemsize
            if route.sending:
                src_region = _local(piece, s.box)
                copy = not region_is_contiguous(src_region, s.local_shape)
                route.out.sends.append(
                    PeerMessage(
                        route.dst_g,
                        task.dst,
                        ti,
                        piece,
                        nbytes,
                        src_region,
                        copy,
                        -1,
                        p.src_piece,
                        route.source,
                    )
                )
            else:
                dst_region = _local(piece, d.box)
                staged = not (self.direct_receive and region_is_contiguous(dst_region, d.local_shape))
                route.out.recvs.append(
                    PeerMessage(
                        route.src_g,
                        task.src,
                        ti,
                        piece,
                        nbytes,
                        dst_region,
                        False,
                        0 if staged else -1,
                        p.dst_piece,
                    )
                )


def _check_coverage(
    plan: Plan, new_shards: dict[int, Holding], received: dict[int, int], new_rank: int | None
) -> None:
    """Every element of every new shard arrives: a plan that leaves a hole would train on garbage."""
    for ti, pieces in new_shards.items():
        need = holding_elements(pieces)
        if received[ti] != need:
            raise PlanMismatch(
                f"new rank {new_rank} receives {received[ti]} of the {need} elements of "
                f"{plan.tensors[ti].name}: the plan does not cover its shard"
            )


def _releases(last_read: dict[int, tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """The old tensors each step reads for the last time, so the executor may free them after it."""
    release: dict[tuple[int, int], list[int]] = defaultdict(list)
    for ti, key in last_read.items():
        release[key].append(ti)
    return release


def _steps_by_layer(
    plan: Plan,
    by_step: dict[tuple[int, int], _StepMessages],
    release: dict[tuple[int, int], list[int]],
    new_rank: int | None,
) -> dict[int, list[StreamStep]]:
    """The steps, in ``(layer, round)`` order, grouped by layer."""
    steps: dict[int, list[StreamStep]] = defaultdict(list)
    for (layer, rnd), messages in sorted(by_step.items()):
        steps[layer].append(_stream_step(plan, layer, rnd, messages, release[(layer, rnd)], new_rank))
    return steps


def _stream_step(
    plan: Plan, layer: int, rnd: int, messages: _StepMessages, release: list[int], new_rank: int | None
) -> StreamStep:
    """One step with its staging offsets, its messages in the order the other side posts them and its
    send copies' sizes; a step that stages more than the plan's budget is refused."""
    recvs, sends, copies = messages
    recvs_placed, need = _place_staging(recvs, plan.tensors)
    if need > plan.budget_bytes:
        raise PlanMismatch(
            f"layer {layer} round {rnd}: new rank {new_rank} stages {need} bytes, over the plan's "
            f"budget of {plan.budget_bytes}"
        )
    recvs_placed.sort(key=lambda m: m.peer_rank)
    sends.sort(key=lambda m: m.peer_rank)
    copied = [align(m.nbytes) for m in sends if m.copy]
    return StreamStep(
        layer,
        rnd,
        step_tag(layer, rnd),
        tuple(recvs_placed),
        tuple(sends),
        tuple(copies),
        need,
        tuple(release),
        sum(copied),
        max(copied, default=0),
    )


def _layer_work(
    plan: Plan, new_shards: dict[int, Holding], steps_by_layer: dict[int, list[StreamStep]]
) -> list[LayerWork]:
    """Every layer that has new shards or steps, in order: its new shards are allocated when it starts."""
    new_by_layer: dict[int, list[int]] = defaultdict(list)
    for ti in new_shards:
        new_by_layer[plan.tensors[ti].layer].append(ti)
    layers = []
    for layer in sorted(set(new_by_layer) | set(steps_by_layer)):
        idx = tuple(new_by_layer.get(layer, ()))
        nbytes = sum(holding_bytes(new_shards[ti], plan.tensors[ti].itemsize) for ti in idx)
        layers.append(LayerWork(layer, idx, nbytes, tuple(steps_by_layer.get(layer, ()))))
    return layers


def _copied_shards(plan: Plan, views: _Views, rank: int) -> dict[int, Holding]:
    """What the peer copy of lost old rank ``rank`` holds: its pieces of the tensors it copied."""
    out: dict[int, Holding] = {}
    for ti in copied_tensors(plan.model, plan.old.layout, plan.old.placement, rank):
        pieces = views(ti, rank, old=True)
        if pieces is not None:
            out[ti] = pieces
    return out


def buffer_bytes(
    steps: Sequence[StreamStep], budget: int, copy_budget: int, old_rank: int | None, new_rank: int | None
) -> int:
    """The one buffer's size: the most any step needs for its staged pieces plus up to ``copy_budget``
    of send copies above them, capped at ``budget``.

    Raises :class:`PlanMismatch` when a step stages so much that one send piece no longer fits beside
    it within ``budget``: a stream that held them apart would exceed ``B``, and one that made the
    copies wait for the staged pieces could deadlock with a peer doing the same.
    """
    want = 0
    for st in steps:
        need = st.staging_bytes
        if st.copy_bytes:
            need = align(need) + max(st.largest_copy, min(copy_budget, st.copy_bytes))
        want = max(want, need)
    size = min(want, budget)
    for st in steps:
        if st.copy_bytes and align(st.staging_bytes) + st.largest_copy > size:
            raise PlanMismatch(
                f"layer {st.layer} round {st.round}: new rank {new_rank} stages {st.staging_bytes} bytes "
                f"and old rank {old_rank} sends a non-contiguous piece of {st.largest_copy} bytes from a "
                f"contiguous copy; both must fit in the plan's budget of {budget} bytes: plan with a "
                f"budget of at least {align(st.staging_bytes) + st.largest_copy} or use a smaller "
                f"message_bytes"
            )
    return size


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _place_staging(
    recvs: list[PeerMessage], tensors: tuple[TensorSpec, ...]
) -> tuple[list[PeerMessage], int]:
    """Give every staged piece an offset, widest elements first, so each offset is aligned."""
    staged = sorted(
        (i for i, m in enumerate(recvs) if m.staging_offset >= 0),
        key=lambda i: -tensors[recvs[i].tensor].itemsize,
    )
    out = list(recvs)
    offset = 0
    for i in staged:
        out[i] = recvs[i]._replace(staging_offset=offset)
        offset += recvs[i].nbytes
    return out, offset
