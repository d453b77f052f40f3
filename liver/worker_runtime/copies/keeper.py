"""The receiving side of peer copies: one listening socket, a thread per source, two buffers each.

A refresh is received into the source's spare buffer while its last complete copy stays readable; only a
refresh read whole, with an iteration after the kept one's, is swapped in, marked with the checksums the
sender took of each piece. The bytes are checked against them when they are used (:func:`~.peer.unpack`,
before a recovery reads them, naming a tensor that fails), not at every refresh: on a node that trains,
the CPU time of checksumming every refresh twice is the copies' largest cost, and a corruption in transit
or in memory is caught the same way before anything is built on it. A source that dies mid-refresh
therefore leaves its last complete copy, which is what a recovery reads (:meth:`CopyKeeper.latest`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Collection
from typing import NamedTuple

import structlog

from .wire import HEADER, MAX_PAYLOAD, CopyError, checksum, read_hello, read_trailer, recv_exactly

log = structlog.get_logger(__name__)

RECV_CHUNK = 4 << 20
"""Bytes received at a time."""


class KeptCopy(NamedTuple):
    """A source's last complete copy: its state after ``iteration``, as its sender's bytes."""

    source: int
    generation: int
    iteration: int
    checksums: tuple[int, ...]
    """CRC-32C the sender took of each piece's bytes (a local tensor, or a DP-sharded part of one)."""
    data: memoryview  # read-only

    def intact(self, index: int, start: int, stop: int) -> bool:
        """Whether piece ``index``, at bytes ``start:stop`` of the copy, still matches the checksum its
        sender took (a bit can flip in transit or in host memory)."""
        return index < len(self.checksums) and checksum(self.data[start:stop]) == self.checksums[index]


class CopyKeeper:
    """Keeps the copies of ``sources`` (ranks of world ``generation``) sent to ``host``:port."""

    def __init__(
        self,
        generation: int,
        sources: Collection[int],
        host: str = "0.0.0.0",
    ) -> None:
        self.generation = generation
        self.sources = frozenset(sources)
        self._listener = socket.create_server((host, 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Condition()
        self._copies: dict[int, KeptCopy] = {}
        self._spare: dict[int, bytearray] = {}
        self._connections: dict[int, socket.socket] = {}
        self._closed = False
        self._log = log.bind(generation=generation, sources=sorted(self.sources))
        self._acceptor = threading.Thread(
            target=self._accept, name=f"liver-copies-accept-{generation}", daemon=True
        )
        self._acceptor.start()

    def latest(self, source: int) -> KeptCopy | None:
        """``source``'s last complete copy (None: none arrived whole yet). Its buffer is reused for the
        refresh after next: read it only while ``source`` sends no more (it is lost), or after
        :meth:`stop`."""
        with self._lock:
            return self._copies.get(source)

    def stop(self, source: int) -> KeptCopy | None:
        """Take no more refreshes from ``source`` (its connection is closed) and return its last
        complete copy, which then stays as it is: what a recovery reads."""
        with self._lock:
            self.sources = self.sources - {source}
            conn = self._connections.pop(source, None)
            kept = self._copies.get(source)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        return kept

    def wait_for(self, source: int, iteration: int, timeout: float) -> KeptCopy | None:
        """``source``'s copy once it is of ``iteration`` or later, or whatever it has after ``timeout``."""
        with self._lock:
            self._lock.wait_for(
                lambda: (
                    self._closed or ((c := self._copies.get(source)) is not None and c.iteration >= iteration)
                ),
                timeout,
            )
            return self._copies.get(source)

    def close(self) -> None:
        """Stop accepting and receiving; the copies stay readable."""
        with self._lock:
            self._closed = True
            connections = list(self._connections.values())
            self._lock.notify_all()
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    # -- the threads ---------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, _addr = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="liver-copies-recv", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        source = -1
        try:
            conn.settimeout(None)
            hello = read_hello(conn)
            if hello.generation != self.generation or hello.rank not in self.sources:
                raise CopyError(
                    f"rank {hello.rank} of generation {hello.generation} does not send its copy here "
                    f"(generation {self.generation}, sources {sorted(self.sources)})"
                )
            source = hello.rank
            with self._lock:
                if self._closed:
                    return
                old = self._connections.get(source)
                self._connections[source] = conn  # a sender that reconnects replaces its old connection
            if old is not None:
                old.close()
            while self._receive(conn, source):
                pass
        except (OSError, CopyError) as error:
            with self._lock:
                closed = self._closed
            if not closed:
                self._log.info("copies.connection_ended", source=source, reason=str(error)[:200])
        finally:
            conn.close()

    def _receive(self, conn: socket.socket, source: int) -> bool:
        """One refresh into the spare buffer, swapped in when whole and checked; False at a clean end."""
        header = bytearray(HEADER.size)
        first = conn.recv_into(header)
        if first == 0:
            return False  # the sender closed between refreshes
        recv_exactly(conn, memoryview(header)[first:])
        iteration, nbytes = HEADER.unpack(header)
        if nbytes > MAX_PAYLOAD:
            raise CopyError(f"source {source} announces {nbytes} bytes, more than any shard")
        spare = self._spare.pop(source, None)
        if spare is None or len(spare) != nbytes:
            spare = bytearray(nbytes)
        view = memoryview(spare)
        for start in range(0, nbytes, RECV_CHUNK):
            recv_exactly(conn, view[start : start + RECV_CHUNK])
        crcs = read_trailer(conn)
        with self._lock:
            if source not in self.sources:
                return False  # stopped meanwhile: the kept copy stays as it was
            current = self._copies.get(source)
            if current is not None and iteration <= current.iteration:
                self._log.error(
                    "copies.stale_refresh", source=source, iteration=iteration, kept=current.iteration
                )
                self._spare[source] = spare
                return True
            self._copies[source] = KeptCopy(source, self.generation, iteration, crcs, view.toreadonly())
            if current is not None:
                self._spare[source] = current.data.obj  # type: ignore[assignment]
            self._lock.notify_all()
        return True
