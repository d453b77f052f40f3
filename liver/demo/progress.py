"""What the demo shows while it runs: the phase, every worker's world and progress, and the events.

On a terminal this is a live panel (rich) redrawn twice a second; elsewhere (a pipe, a CI log, the
test suite) the same information comes as plain lines: each phase and event once, and a one-line status
every few seconds, so a log shows that training went on.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from liver.demo.observer import Observer
from liver.demo.runlog import RunLog

PLAIN_STATUS_EVERY_S = 10.0


class Progress:
    def __init__(self, console: Console, *, live: bool) -> None:
        self.console = console
        self.live = live and console.is_terminal
        self.started = time.monotonic()
        self.phase_text = "starting"
        self.notes: deque[str] = deque(maxlen=8)
        self._live: Live | None = None
        self._last_plain = 0.0

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.started:6.1f}s"

    def _plain(self, text: str) -> None:
        self.console.print(f"[{self._elapsed()}] {text}", highlight=False, markup=False)

    def phase(self, text: str) -> None:
        self.phase_text = text
        if not self.live:
            self._plain(text)

    def note(self, text: str) -> None:
        self.notes.append(f"[{self._elapsed()}] {text}")
        if not self.live:
            self._plain(f"  {text}")

    async def run(self, observer: Observer, runlog: RunLog) -> None:
        """Redraw until cancelled."""
        if self.live:
            with Live(self._render(observer, runlog), console=self.console, refresh_per_second=4) as live:
                self._live = live
                try:
                    while True:
                        await asyncio.sleep(0.5)
                        runlog.refresh()
                        live.update(self._render(observer, runlog))
                finally:
                    self._live = None
        else:
            while True:
                await asyncio.sleep(1.0)
                runlog.refresh()
                if time.monotonic() - self._last_plain >= PLAIN_STATUS_EVERY_S:
                    self._last_plain = time.monotonic()
                    self._plain(f"  {self._status_line(runlog)}")

    @staticmethod
    def _status_line(runlog: RunLog) -> str:
        trace = runlog.trace()
        if not trace:
            return "no training step yet"
        last = trace[-1]
        return (
            f"iteration {last.iteration}, loss {last.loss:.3f}, generation {last.generation} ({last.layout})"
        )

    def _render(self, observer: Observer, runlog: RunLog) -> Group:
        header = Text.assemble(
            ("LiveR demo ", "bold"), (self._elapsed(), "cyan"), "  ", (self.phase_text, "yellow")
        )
        table = Table(expand=False, show_edge=False, pad_edge=False)
        for column in ("worker", "gen", "rank", "layout", "iter", "loss", "state"):
            table.add_column(column)
        names = sorted(set(observer.hellos) | set(runlog.workers))
        for name in names:
            beat = observer.beats.get(name)
            log = runlog.workers.get(name)
            step = log.last_step if log is not None else None
            stopped = log.stopped if log is not None else None
            if stopped is not None:
                state, where = f"stopped ({stopped.why})", None
            elif step is not None:
                state, where = "training", (step.generation, step.rank, step.layout)
            elif beat is not None and beat.message.generation is not None:
                state, where = "starting", (beat.message.generation, beat.message.rank, "")
            else:
                state, where = "standby", None
            table.add_row(
                name,
                "-" if where is None else str(where[0]),
                "-" if where is None else str(where[1]),
                "-" if where is None else where[2],
                str(step.iteration) if step is not None else "-",
                f"{step.loss:.3f}" if step is not None else "-",
                state,
            )
        return Group(header, table, Text("\n".join(self.notes), style="dim"))
