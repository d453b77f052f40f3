"""The sending side of peer copies: a background thread that reads the live state after a step.

The training thread hands it the tensors after each optimizer step (:meth:`CopySender.refresh`) and goes
on; the thread checksums each piece (a local tensor, or a DP-sharded part of one) and sends them chunk
by chunk: host memory as it is (the kernel copies it into the socket, no copy of ours), device memory
through a pinned staging buffer of fixed size.
The state changes again only at the next update, which first waits for :meth:`CopySender.wait_read`: until
the thread has read the last chunk. A read that takes longer than the gate allows is cancelled rather than
let the update tear it: the thread stops reading at once, drops the connection (the keeper keeps its older
copy) and reconnects for the next refresh. While it reads, the thread also keeps what it read, with
the rest of the rank's state (what replicas on other nodes hold, which is not sent), as this rank's own
copy: the last two refreshes sent whole (:meth:`CopySender.own`), what the survivors go back to when a
lost peer died in its refresh.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import threading
from collections.abc import Sequence

import structlog
import torch

from .wire import HEADER, CopyError, checksum, hello, trailer

log = structlog.get_logger(__name__)

DEFAULT_STAGING_BYTES = 16 << 20


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat ``uint8`` tensor without a copy (a contiguous one is made first
    when it is not contiguous)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def host_bytes(view: torch.Tensor) -> memoryview:
    """The bytes of a contiguous ``uint8`` host tensor, read in place. Not through ``Tensor.numpy()``:
    that marks the storage as not resizable for good, and the runtime frees an old trainer's storage
    by resizing it to nothing. The tensor must outlive the view (the sender holds it)."""
    n = view.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(view.data_ptr())).cast("B")


class _Cancelled(CopyError):
    """The gate gave the refresh being read up (internal: the thread reconnects for the next)."""


class CopySender:
    """Sends rank ``rank``'s copy of generation ``generation`` to the keeper at ``address``."""

    def __init__(
        self,
        address: tuple[str, int],
        generation: int,
        rank: int,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        connect_timeout_s: float = 30.0,
        keep_own: bool = False,
    ) -> None:
        if staging_bytes < 1:
            raise ValueError(f"`staging_bytes`: must be positive, got {staging_bytes}")
        self.address = address
        self.generation = generation
        self.rank = rank
        self.connect_timeout_s = connect_timeout_s
        self.keep_own = keep_own
        pin = torch.cuda.is_available()  # only device memory is staged; host memory is sent as it is
        self._staging = torch.empty(staging_bytes if pin else 0, dtype=torch.uint8, pin_memory=pin)
        self._chunk = staging_bytes
        self._staging_view = memoryview(self._staging.numpy())
        self._cond = threading.Condition()
        self._reading = threading.Lock()  # held while a chunk is copied out of the live tensors
        self._job: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None
        self._read = True  # the last refresh's tensors were read (or given up)
        self._cancel = False
        self._closed = False
        self._sock: socket.socket | None = None
        self.failure: CopyError | None = None
        self.sent_iteration: int | None = None
        """The last iteration sent whole (acknowledged by nothing: the keeper checks it)."""
        self._own: list[tuple[int, bytearray, tuple[int, ...]]] = []  # the last two sent whole
        """This rank's own state as its last two refreshes read it (oldest first; what it sent, then the
        rest of its state): what a recovery goes back to when a lost peer's copy is a step behind."""
        self.cancelled = 0
        self._log = log.bind(generation=generation, rank=rank, keeper=f"{address[0]}:{address[1]}")
        self._thread = threading.Thread(target=self._run, name=f"liver-copies-send-{rank}", daemon=True)
        self._thread.start()

    def refresh(
        self, iteration: int, tensors: Sequence[torch.Tensor], local: Sequence[torch.Tensor] = ()
    ) -> None:
        """Send ``tensors`` (the state after ``iteration``) in the background, and keep them with
        ``local`` (the rest of this rank's state, which its replicas hold) as this rank's own copy. Call
        :meth:`wait_read` before anything changes them."""
        views = [byte_view(t) for t in tensors]
        local_views = [byte_view(t) for t in local]
        with self._cond:
            if self._closed or self.failure is not None:
                return
            self._cond.wait_for(lambda: self._read)
            self._job = (iteration, views, local_views)
            self._read = False
            self._cancel = False
            self._cond.notify_all()

    def wait_read(self, timeout: float | None = None) -> bool:
        """Block until the last refresh's tensors were read; after ``timeout`` cancel the read (the
        keeper keeps its older copy) and return False. Afterwards nothing reads them until the next
        :meth:`refresh`."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._read, timeout)
            if done:
                return self.failure is None
            self._cancel = True
        self._unblock()  # a send stuck behind a slow keeper fails: the refresh is dropped
        with self._reading:  # a chunk being read finishes; no later one starts
            pass
        self.cancelled += 1
        self._log.warning("copies.read_cancelled", timeout_s=timeout)
        return False

    def own(self, iteration: int) -> tuple[bytes | bytearray, tuple[int, ...]] | None:
        """This rank's own copy of ``iteration`` (its bytes and checksums) if it is one of the last two
        sent whole; call it once the sender is settled (nothing is being sent)."""
        with self._cond:
            for it, data, crcs in self._own:
                if it == iteration:
                    return data, crcs
        return None

    def wait_sent(self, iteration: int, timeout: float | None = None) -> bool:
        """Block until the refresh of ``iteration`` was sent whole (its trailer is in the socket, which
        the kernel delivers even if this process exits next); False after ``timeout``, a failure or a
        close."""
        with self._cond:
            self._cond.wait_for(
                lambda: self.sent_iteration == iteration or self.failure is not None or self._closed, timeout
            )
            return self.sent_iteration == iteration

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cancel = True
            self._cond.notify_all()
        self._unblock()
        with self._reading:
            pass
        self._thread.join(timeout=10)

    def _unblock(self) -> None:
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    # -- the thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._job is not None)
                if self._closed:
                    break
                assert self._job is not None
                iteration, views, local = self._job
                self._job = None
            try:
                self._send(iteration, views, local)
                with self._cond:
                    self.sent_iteration = iteration
                    self._cond.notify_all()
            except _Cancelled:
                self._drop_connection()
            except OSError as error:
                with self._cond:
                    closed, cancelled = self._closed, self._cancel
                if cancelled and not closed:
                    self._drop_connection()  # the gate gave this refresh up: reconnect for the next
                    continue
                if not closed:
                    self.failure = CopyError(f"sending the copy of iteration {iteration} failed: {error}")
                    self._log.warning("copies.send_failed", iteration=iteration, error=str(error)[:200])
                self._drop_connection()
                self._finish_read()
                return
            finally:
                self._finish_read()
        self._drop_connection()

    def _finish_read(self) -> None:
        with self._cond:
            self._read = True
            self._cond.notify_all()

    def _drop_connection(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection(self.address, timeout=self.connect_timeout_s)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(hello(self.generation, self.rank))
            self._sock = sock
        return self._sock

    def _send(self, iteration: int, views: list[torch.Tensor], local: list[torch.Tensor]) -> None:
        """One refresh: host memory is sent as it is, chunk by chunk (the kernel copies it into the
        socket, so reading ends with the last send); device memory goes through the staging buffer
        (reading ends with the last copy out of it)."""
        sock = self._connect()
        total = sum(v.numel() for v in views)
        sock.sendall(HEADER.pack(iteration, total))
        size = self._chunk
        crcs: list[int] = []
        own = self._own_buffer(total + sum(v.numel() for v in local)) if self.keep_own else None
        at = 0
        pieces = [*((v, True) for v in views), *((v, False) for v in (local if own is not None else ()))]
        for view, sent in pieces:  # what is not sent (replicas hold it) is kept here only, unchecksummed
            crc = 0
            n = view.numel()
            host = None if view.is_cuda else host_bytes(view)
            for start in range(0, n, size):
                end = min(start + size, n)
                with self._reading:
                    if self._cancel:
                        raise _Cancelled
                    if host is not None:
                        chunk = host[start:end]
                    else:
                        self._staging[: end - start].copy_(view[start:end])
                        chunk = self._staging_view[: end - start]
                    if own is not None:
                        own[at : at + end - start] = chunk
                        at += end - start
                    if sent and host is not None:  # the kernel reads the live memory: under the lock
                        crc = checksum(chunk, crc)
                        sock.sendall(chunk)
                if sent and host is None:  # the staging buffer is ours: sent outside the lock
                    crc = checksum(chunk, crc)
                    sock.sendall(chunk)
            if sent:
                crcs.append(crc)
        self._finish_read()  # nothing of the live tensors is read any more: the update may go on
        sock.sendall(trailer(crcs))
        if own is not None:
            with self._cond:
                self._own = [*self._own[-1:], (iteration, own, tuple(crcs))]

    def _own_buffer(self, total: int) -> bytearray:
        """The buffer this refresh's own copy goes into: the older of the two kept, which is dropped
        now (a recovery needs at most the last two refreshes, and the last is not touched)."""
        with self._cond:
            if len(self._own) < 2:
                return bytearray(total)
            (_, oldest, _), self._own = self._own[0], self._own[1:]
        return oldest if len(oldest) == total else bytearray(total)
