"""A training worker's own record of what happened to it, one JSON object per line.

Each worker appends to its own file (``liver worker --metrics PATH``): a line per training step and a
line per handoff outcome, each with the wall-clock time. Tools that show a run (``liver demo``'s table
and timeline) read these files after the fact, so the record is what the worker itself saw (the loss
of each step, the pause it measured), not what the control plane inferred. Line-buffered appends: a
worker killed mid-run leaves every line it finished.

This module imports neither torch nor Megatron: readers stay light.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated

import msgspec
from msgspec import Meta

Seconds = Annotated[float, Meta(ge=0)]


class Record(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Base of every line: when it was written (Unix time) and by which worker."""

    t: float
    worker_id: str


class Started(Record, tag="started"):
    """The worker's first world is built (``generation`` None: a standby worker, in no world yet)."""

    generation: int | None
    rank: int | None
    layout: str | None


class Step(Record, tag="step"):
    """One completed training step as this rank saw it (the loss agrees on every rank of a world)."""

    iteration: int
    loss: float
    grad_norm: float
    generation: int
    rank: int
    layout: str
    step_s: Seconds


class Switched(Record, tag="switched"):
    """This process committed a handoff: it trains in ``generation`` now, or ``left`` the job."""

    generation: int
    from_generation: int
    role: str
    iteration: int
    left: bool
    pause_s: Seconds
    transfer_s: Seconds
    rebuild_s: Seconds
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    prepare_s: Seconds | None = None
    warmup_s: Seconds | None = None


class Aborted(Record, tag="aborted"):
    """A handoff this process gave up (training went on in the old world)."""

    generation: int
    stage: str
    reason: str
    iteration: int | None


class Stopped(Record, tag="stopped"):
    """The worker ended: ``why`` is ``steps``, ``stop_file``, ``left``, ``signal`` or ``error``."""

    why: str
    iteration: int | None
    error: str | None = None


Line = Started | Step | Switched | Aborted | Stopped

_DECODER = msgspec.json.Decoder(Line)
_ENCODER = msgspec.json.Encoder()


class MetricsLog:
    """Appends records to one file; safe to call from any thread (runtime events come from several)."""

    def __init__(self, path: str | Path, worker_id: str) -> None:
        self.path = Path(path)
        self.worker_id = worker_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[bytes] | None = self.path.open("ab", buffering=0)
        self._lock = threading.Lock()

    def write(self, record_type: type[Record], **fields: object) -> None:
        record = record_type(t=time.time(), worker_id=self.worker_id, **fields)
        data = _ENCODER.encode(record) + b"\n"
        with self._lock:
            if self._fh is not None:
                self._fh.write(data)

    def close(self) -> None:
        with self._lock:
            fh, self._fh = self._fh, None
        if fh is not None:
            fh.close()


def read_lines(path: str | Path) -> Iterator[Line]:
    """Every complete record in ``path``; a torn last line (the writer was killed) is skipped, any other
    line that does not decode is a ``ValueError`` naming the line and the field."""
    with Path(path).open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.endswith(b"\n"):
                return
            try:
                yield _DECODER.decode(raw)
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{number}: not a metrics record: {exc}") from None
