"""Peer copies: a keeper holds one complete, checksummed copy of each source's state per iteration,
received from a background sender over real TCP on loopback."""

from __future__ import annotations

import socket

import pytest
import torch

from liver.worker_runtime.copies.keeper import CopyKeeper, KeptCopy
from liver.worker_runtime.copies.sender import CopySender
from liver.worker_runtime.copies.wire import HEADER, MAX_TENSORS, TRAILER, hello, trailer

WAIT_S = 30.0


def state(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1000, generator=g),
        torch.randn(33, 7, generator=g).to(torch.bfloat16),
        torch.tensor(seed, dtype=torch.int64),
    ]


def as_bytes(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


def each_intact(kept: KeptCopy, tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor's bytes in the copy match the checksum its sender took."""
    out, start = [], 0
    for i, t in enumerate(tensors):
        stop = start + t.numel() * t.element_size()
        out.append(kept.intact(i, start, stop))
        start = stop
    return out


@pytest.fixture
def keeper():
    k = CopyKeeper(generation=3, sources=[1], host="127.0.0.1")
    yield k
    k.close()


def test_a_refresh_arrives_whole_with_its_iteration_and_checksum(keeper: CopyKeeper) -> None:
    sender = CopySender(("127.0.0.1", keeper.port), 3, 1, staging_bytes=256)  # many chunks
    try:
        tensors = state(7)
        sender.refresh(7, tensors)
        assert sender.wait_read(WAIT_S)
        kept = keeper.wait_for(1, 7, WAIT_S)
        assert kept is not None and kept.iteration == 7 and kept.generation == 3
        assert bytes(kept.data) == as_bytes(tensors)
        assert len(kept.checksums) == len(tensors) and each_intact(kept, tensors) == [True] * 3
    finally:
        sender.close()


def test_each_refresh_replaces_the_copy_once_complete(keeper: CopyKeeper) -> None:
    sender = CopySender(("127.0.0.1", keeper.port), 3, 1, staging_bytes=1000)
    try:
        for it in range(1, 6):
            tensors = state(it)
            sender.refresh(it, tensors)
            assert sender.wait_read(WAIT_S)
            kept = keeper.wait_for(1, it, WAIT_S)
            assert kept is not None and kept.iteration == it
            assert bytes(kept.data) == as_bytes(tensors)
    finally:
        sender.close()


def test_a_sender_keeps_its_own_state_of_the_last_two_refreshes_sent_whole(keeper: CopyKeeper) -> None:
    sender = CopySender(("127.0.0.1", keeper.port), 3, 1, staging_bytes=1000, keep_own=True)
    try:
        replicated = [torch.arange(50, dtype=torch.float32)]  # what replicas hold: kept here, not sent
        for it in range(1, 4):
            sender.refresh(it, state(it), [replicated[0] + it])
            assert sender.wait_sent(it, WAIT_S)
        assert sender.own(1) is None  # only the last two
        for it in (2, 3):
            own = sender.own(it)
            assert own is not None
            assert bytes(own[0]) == as_bytes([*state(it), replicated[0] + it])
        kept = keeper.wait_for(1, 3, WAIT_S)
        assert kept is not None and own[1] == kept.checksums  # the last one, as it was sent
    finally:
        sender.close()


def test_a_sender_keeps_no_own_state_unless_asked(keeper: CopyKeeper) -> None:
    sender = CopySender(("127.0.0.1", keeper.port), 3, 1, staging_bytes=1000)
    try:
        sender.refresh(1, state(1), [torch.zeros(10)])
        assert sender.wait_sent(1, WAIT_S) and sender.own(1) is None
    finally:
        sender.close()


def test_a_refresh_given_up_keeps_the_own_state_of_the_one_before() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # a keeper that accepts but never reads
    address = ("127.0.0.1", listener.getsockname()[1])
    sender = CopySender(address, 3, 1, staging_bytes=1 << 16, keep_own=True)
    try:
        sender.refresh(1, state(1))  # small: fits in the socket buffers, sent whole
        assert sender.wait_sent(1, WAIT_S)
        sender.refresh(2, [torch.zeros(64 << 20, dtype=torch.uint8)])  # far more than they take
        assert not sender.wait_read(0.5)  # given up: the refresh of 2 is never sent whole
        own = sender.own(1)
        assert own is not None and bytes(own[0]) == as_bytes(state(1))
        assert sender.own(2) is None
    finally:
        sender.close()
        listener.close()


def test_a_flipped_bit_in_a_kept_copy_is_detected_in_its_tensor_only(keeper: CopyKeeper) -> None:
    sender = CopySender(("127.0.0.1", keeper.port), 3, 1)
    try:
        tensors = state(2)
        sender.refresh(2, tensors)
        kept = keeper.wait_for(1, 2, WAIT_S)
        assert kept is not None and all(each_intact(kept, tensors))
        buffer = kept.data.obj
        buffer[4017] ^= 0x04  # host memory corrupted after the copy arrived, in the second tensor
        assert each_intact(kept, tensors) == [True, False, True]
    finally:
        sender.close()


def raw_sender(port: int, rank: int = 1, generation: int = 3) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(hello(generation, rank))
    return sock


def test_a_sender_lost_mid_refresh_leaves_the_last_complete_copy(keeper: CopyKeeper) -> None:
    sender = CopySender(("127.0.0.1", keeper.port), 3, 1)
    tensors = state(4)
    sender.refresh(4, tensors)
    assert keeper.wait_for(1, 4, WAIT_S) is not None
    sender.close()
    sock = raw_sender(keeper.port)  # the next refresh's sender dies halfway through its payload
    sock.sendall(HEADER.pack(5, 4000) + b"\x00" * 1000)
    sock.close()
    kept = keeper.wait_for(1, 5, 2.0)  # the truncated refresh never completes
    assert kept is not None and kept.iteration == 4 and bytes(kept.data) == as_bytes(tensors)


def test_a_refresh_whose_bytes_differ_from_the_senders_checksum_is_not_intact(keeper: CopyKeeper) -> None:
    sock = raw_sender(keeper.port)
    try:
        payload = b"\x01" * 64  # corrupted in transit: the trailer is the checksum the sender took
        sock.sendall(HEADER.pack(9, len(payload)) + payload + trailer([12345]))
        kept = keeper.wait_for(1, 9, WAIT_S)
        assert kept is not None and kept.iteration == 9 and not kept.intact(0, 0, len(payload))
    finally:
        sock.close()


def test_a_trailer_announcing_more_tensors_than_any_shard_is_refused(keeper: CopyKeeper) -> None:
    sender = CopySender(("127.0.0.1", keeper.port), 3, 1)
    sender.refresh(4, state(4))
    assert keeper.wait_for(1, 4, WAIT_S) is not None
    sender.close()
    sock = raw_sender(keeper.port)
    try:
        sock.sendall(HEADER.pack(5, 8) + b"\x00" * 8 + TRAILER.pack(MAX_TENSORS + 1))
        assert keeper.wait_for(1, 5, 2.0).iteration == 4  # the garbage refresh never replaces the copy
    finally:
        sock.close()


def test_a_connection_for_another_generation_or_rank_is_refused(keeper: CopyKeeper) -> None:
    for rank, generation in ((2, 3), (1, 4)):
        sock = raw_sender(keeper.port, rank, generation)
        try:
            sock.sendall(HEADER.pack(1, 1) + b"x" + trailer([0]))
            assert sock.recv(1) == b""  # closed by the keeper
        except ConnectionResetError:
            pass  # closed by the keeper with our bytes unread
        finally:
            sock.close()
    assert keeper.latest(1) is None


def test_a_read_slower_than_the_gate_is_cancelled_and_the_next_refresh_goes_through() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # a keeper that accepts but never reads
    port = listener.getsockname()[1]
    sender = CopySender(("127.0.0.1", port), 3, 1, staging_bytes=1 << 16)
    try:
        big = [torch.zeros(64 << 20, dtype=torch.uint8)]  # far more than the socket buffers take
        sender.refresh(1, big)
        assert not sender.wait_read(0.5)  # gave up: nothing reads the tensors any more
        assert sender.cancelled == 1 and sender.failure is None
    finally:
        sender.close()
        listener.close()


def test_a_stopped_source_keeps_its_copy_unchanged(keeper: CopyKeeper) -> None:
    sender = CopySender(("127.0.0.1", keeper.port), 3, 1)
    try:
        sender.refresh(1, state(1))
        assert keeper.wait_for(1, 1, WAIT_S) is not None
        kept = keeper.stop(1)
        sender.refresh(2, state(2))
        sender.wait_read(WAIT_S)
        assert keeper.wait_for(1, 2, 1.0).iteration == 1
        assert kept is not None and bytes(kept.data) == as_bytes(state(1))
    finally:
        sender.close()


def test_sending_leaves_the_live_storage_free_to_be_released(keeper: CopyKeeper) -> None:
    # The runtime frees an old trainer's tensors by resizing their storage to nothing: reading them for a
    # copy must not pin it (Tensor.numpy() would, for good).
    sender = CopySender(("127.0.0.1", keeper.port), 3, 1)
    try:
        tensors = state(5)
        sender.refresh(5, tensors)
        assert sender.wait_read(WAIT_S) and keeper.wait_for(1, 5, WAIT_S) is not None
        for t in tensors:
            t.untyped_storage().resize_(0)
    finally:
        sender.close()
