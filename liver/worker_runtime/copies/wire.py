"""The framing of peer copies on a TCP connection (sender -> keeper).

A connection opens with a hello (``LVRC``, the wire version, the job's generation and the sender's
rank), then carries refreshes: a header (iteration, payload bytes), the payload, and a trailer with
the payload's CRC-32. A refresh the keeper cannot read whole, or whose checksum differs, never replaces
the copy it has.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import zlib
from typing import Final, NamedTuple

from liver.shared.errors import HandoffError

MAGIC: Final = b"LVRC"
VERSION: Final = 1
HELLO: Final = struct.Struct("!4sHxxQQ")  # magic, version, generation, sender rank
HEADER: Final = struct.Struct("!QQ")  # iteration, payload bytes
TRAILER: Final = struct.Struct("!I")  # CRC-32 of the payload
DEFAULT_NICENESS: Final = 0
"""How far below training the copies' threads run (``nice``). None by default: the update waits for the
sender's read, so a sender starved by other processes' training threads (more processes than cores)
would stall its own training; at ``nice`` 10 no gain showed in ``liver bench copies`` either."""
MAX_PAYLOAD: Final = 1 << 44
"""A header announcing more than 16 TiB is garbage (no process's shard is that large)."""


class CopyError(HandoffError):
    """A peer copy could not be sent, received or trusted (the message says which and why)."""


class Hello(NamedTuple):
    generation: int
    rank: int


def lower_priority(niceness: int) -> None:
    """Run the calling thread ``niceness`` steps below the process's CPU priority (Linux schedules
    threads one by one): the copies then take the CPU time that training leaves. Where that cannot be
    set (another system, or no permission) the thread runs as it is."""
    if niceness <= 0:
        return
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


def checksum(data: memoryview | bytes | bytearray, running: int = 0) -> int:
    """CRC-32 of ``data`` continuing ``running`` (zlib's, about 3 GB/s here; releases the GIL)."""
    return zlib.crc32(data, running)


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; :class:`CopyError` when the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise CopyError(f"the peer closed the connection after {got} of {len(view)} bytes")
        got += n


def read_struct(sock: socket.socket, fmt: struct.Struct) -> tuple:
    buf = bytearray(fmt.size)
    recv_exactly(sock, memoryview(buf))
    return fmt.unpack(buf)


def read_hello(sock: socket.socket) -> Hello:
    magic, version, generation, rank = read_struct(sock, HELLO)
    if magic != MAGIC:
        raise CopyError(f"not a peer-copy connection (magic {magic!r})")
    if version != VERSION:
        raise CopyError(f"peer-copy wire version {version}, expected {VERSION}")
    return Hello(generation, rank)


def hello(generation: int, rank: int) -> bytes:
    return HELLO.pack(MAGIC, VERSION, generation, rank)
