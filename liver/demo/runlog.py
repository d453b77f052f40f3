"""The workers' metrics files of one run, read as they grow: the demo's source for losses and pauses.

Every worker appends its own JSON lines (:mod:`liver.worker_runtime.metrics`); :class:`RunLog` keeps an
offset per file and decodes only what was added since the last :meth:`RunLog.refresh`, so the progress
display can poll it twice a second at no cost, and the summary reads the same records at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from liver.worker_runtime.metrics import Aborted, Line, Started, Step, Stopped, Switched

_DECODER = msgspec.json.Decoder(Line)


@dataclass
class WorkerLog:
    """What one worker wrote so far."""

    worker_id: str
    records: list[Line] = field(default_factory=list)

    @property
    def steps(self) -> list[Step]:
        return [r for r in self.records if isinstance(r, Step)]

    @property
    def last_step(self) -> Step | None:
        for record in reversed(self.records):
            if isinstance(record, Step):
                return record
        return None

    @property
    def switches(self) -> list[Switched]:
        return [r for r in self.records if isinstance(r, Switched)]

    @property
    def aborts(self) -> list[Aborted]:
        return [r for r in self.records if isinstance(r, Aborted)]

    @property
    def started(self) -> Started | None:
        return next((r for r in self.records if isinstance(r, Started)), None)

    @property
    def stopped(self) -> Stopped | None:
        return next((r for r in reversed(self.records) if isinstance(r, Stopped)), None)


@dataclass(frozen=True)
class TracePoint:
    """One training step of the job (the loss every rank of its world agrees on)."""

    iteration: int
    loss: float
    generation: int
    layout: str
    t: float  # when the first rank finished it (Unix time)


@dataclass
class RunLog:
    directory: Path
    workers: dict[str, WorkerLog] = field(default_factory=dict)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def refresh(self) -> None:
        """Read what every worker appended since the last call (a torn last line waits for the next)."""
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with path.open("rb") as fh:
                fh.seek(offset)
                data = fh.read()
            end = data.rfind(b"\n") + 1
            if end == 0:
                continue
            self._offsets[path] = offset + end
            log = self.workers.setdefault(path.stem, WorkerLog(path.stem))
            for number, raw in enumerate(data[:end].splitlines(), start=1):
                try:
                    log.records.append(_DECODER.decode(raw))
                except msgspec.DecodeError as exc:
                    raise ValueError(f"{path}: record {number} after byte {offset}: {exc}") from None

    def trace(self) -> list[TracePoint]:
        """The job's steps in order, one per iteration (the newest generation's if a step repeats)."""
        best: dict[int, TracePoint] = {}
        for log in self.workers.values():
            for step in log.steps:
                point = TracePoint(step.iteration, step.loss, step.generation, step.layout, step.t)
                known = best.get(step.iteration)
                if known is None or (point.generation, -point.t) > (known.generation, -known.t):
                    best[step.iteration] = point
        return [best[i] for i in sorted(best)]

    def max_iteration(self) -> int:
        steps = [log.last_step.iteration for log in self.workers.values() if log.last_step is not None]
        return max(steps, default=0)

    def switches(self, generation: int) -> list[Switched]:
        return [r for log in self.workers.values() for r in log.switches if r.generation == generation]
