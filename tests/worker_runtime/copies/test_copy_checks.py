"""A recovery checks what it resumes from: a peer copy whose bytes changed after its sender read them,
or that holds a value that is not finite, is refused with the tensor named, and so is a recovered state
with a NaN (Megatron-LM #5281: a replica-rebuilt checkpoint with NaNs restarted 44 times)."""

from __future__ import annotations

import math

import pytest
import torch

from liver.reshard.holdings import holding
from liver.reshard.redundancy import copied_tensors
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS
from liver.worker_runtime.copies.keeper import KeptCopy
from liver.worker_runtime.copies.peer import unpack
from liver.worker_runtime.copies.wire import CopyError, checksum
from liver.worker_runtime.handoff import RecoveredStateInvalid, check_finite

MODEL = PRESETS["tiny-gpt"].geometry()
LAYOUT = ParallelLayout(tp=2, pp=1, dp=1)  # DP=1 on two nodes: each rank's whole shard is copied
PLACEMENT = Placement((Device("a", 0), Device("b", 0)))
SOURCE = 1


def pieces_of_copy() -> list[tuple[str, torch.Tensor]]:
    """Rank SOURCE's copied pieces, in the order its sender sends them, with values."""
    tensors = MODEL.tensors(optimizer=True)
    g = torch.Generator().manual_seed(0)
    out = []
    for ti in copied_tensors(MODEL, LAYOUT, PLACEMENT, SOURCE):
        t = tensors[ti]
        for shard in holding(t, MODEL, LAYOUT, SOURCE) or ():
            values = torch.randn(math.prod(shard.local_shape), generator=g).to(getattr(torch, t.dtype))
            out.append((t.name, values))
    return out


def kept_copy(pieces: list[tuple[str, torch.Tensor]]) -> KeptCopy:
    raw = [p.contiguous().view(torch.uint8).numpy().tobytes() for _, p in pieces]
    data = bytearray(b"".join(raw))
    return KeptCopy(SOURCE, 0, 5, tuple(checksum(r) for r in raw), memoryview(data).toreadonly())


def offset_of(pieces: list[tuple[str, torch.Tensor]], index: int) -> int:
    return sum(p.numel() * p.element_size() for _, p in pieces[:index])


def test_an_intact_copy_unpacks_to_its_senders_values() -> None:
    pieces = pieces_of_copy()
    state = unpack(kept_copy(pieces), MODEL, LAYOUT, PLACEMENT)
    got = [p for value in state.values() for p in (value if isinstance(value, tuple) else (value,))]
    assert len(got) == len(pieces)
    assert all(torch.equal(a.reshape(-1), b) for a, (_, b) in zip(got, pieces))


def test_a_flipped_bit_names_the_tensor_it_is_in() -> None:
    pieces = pieces_of_copy()
    copy = kept_copy(pieces)
    victim = len(pieces) // 2
    copy.data.obj[offset_of(pieces, victim) + 3] ^= 0x10  # host memory, after the copy arrived
    with pytest.raises(
        CopyError, match=rf"rank {SOURCE} \(iteration 5\): {pieces[victim][0]} fails its checksum"
    ):
        unpack(copy, MODEL, LAYOUT, PLACEMENT)


def test_a_copy_holding_a_nan_is_refused_with_the_tensor_named() -> None:
    pieces = pieces_of_copy()
    index = next(i for i, (_, p) in enumerate(pieces) if p.dtype == torch.float32 and p.numel() > 1)
    pieces[index][1][1] = float("nan")  # the sender read a NaN: the checksum is the NaN's
    with pytest.raises(CopyError, match=rf"{pieces[index][0]} holds values that are not finite"):
        unpack(kept_copy(pieces), MODEL, LAYOUT, PLACEMENT)


def test_a_copy_with_fewer_checksums_than_pieces_is_refused_saying_so() -> None:
    pieces = pieces_of_copy()
    copy = kept_copy(pieces)
    short = copy._replace(checksums=copy.checksums[:-1])
    with pytest.raises(
        CopyError, match=rf"carries {len(short.checksums)} checksums, none for {pieces[-1][0]}"
    ):
        unpack(short, MODEL, LAYOUT, PLACEMENT)


def test_a_recovered_state_with_an_infinity_names_the_tensor() -> None:
    tensors = MODEL.tensors(optimizer=True)
    state = {0: torch.zeros(4), 1: (torch.zeros(2), torch.tensor([1.0, float("inf")]))}
    with pytest.raises(RecoveredStateInvalid, match=rf"the recovered {tensors[1].name} holds values"):
        check_finite(MODEL, state)


def test_a_finite_recovered_state_passes_whatever_its_integer_tensors_hold() -> None:
    check_finite(MODEL, {0: torch.ones(3), 1: torch.tensor([2**62], dtype=torch.int64)})


def own_copy(nan_in_local: bool = False) -> tuple[KeptCopy, dict[int, torch.Tensor], str]:
    """Rank SOURCE's own copy as its sender keeps it: what it sends (checksummed), then the rest of the
    tensors it holds (those a replica on another node holds too), with the values of each tensor."""
    tensors = MODEL.tensors(optimizer=True)
    held = [ti for ti, t in enumerate(tensors) if holding(t, MODEL, LAYOUT, SOURCE) is not None]
    copied = set(copied_tensors(MODEL, LAYOUT, PLACEMENT, SOURCE))
    local = [ti for ti in held if ti not in copied]
    g = torch.Generator().manual_seed(1)
    values: dict[int, torch.Tensor] = {}
    raw: list[bytes] = []
    for ti in [*sorted(copied), *local]:
        t = tensors[ti]
        (shard,) = holding(t, MODEL, LAYOUT, SOURCE) or ()
        values[ti] = torch.randn(shard.local_shape, generator=g).to(getattr(torch, t.dtype))
        raw.append(values[ti].reshape(-1).view(torch.uint8).numpy().tobytes())
    bad = next(ti for ti in local if values[ti].is_floating_point())
    if nan_in_local:
        values[bad].view(-1)[0] = float("nan")
        raw[len(copied) + local.index(bad)] = values[bad].reshape(-1).view(torch.uint8).numpy().tobytes()
    crcs = tuple(checksum(r) for r in raw[: len(copied)])
    data = memoryview(bytearray(b"".join(raw))).toreadonly()
    return KeptCopy(SOURCE, 0, 4, crcs, data), values, tensors[bad].name


def test_a_processs_own_copy_unpacks_to_every_tensor_it_holds() -> None:
    copy, values, _ = own_copy()
    state = unpack(copy, MODEL, LAYOUT, PLACEMENT, held=list(values))
    assert sorted(state) == sorted(values)
    assert all(torch.equal(state[ti], values[ti]) for ti in values)


def test_an_own_copy_with_a_nan_in_what_only_replicas_hold_names_the_tensor() -> None:
    copy, values, name = own_copy(nan_in_local=True)
    with pytest.raises(CopyError, match=rf"{name} holds values that are not finite"):
        unpack(copy, MODEL, LAYOUT, PLACEMENT, held=list(values))
