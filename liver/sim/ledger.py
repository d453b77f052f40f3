"""GPU-second accounting: every second of every held device lands in exactly one bucket.

* **useful**: a device of the training world training, on progress that is never rolled back;
* **downtime**: held devices while the job is paused (restart, or a live switch and transfer);
* **lost**: training that a rollback to the last checkpoint threw away (moved out of useful);
* **idle**: held devices the training world does not use (a node being prepared, a node the layout
  leaves out, or every device while no layout fits).

So ``useful + downtime + lost + idle == allocated`` (the integral of held devices over time) holds by
construction, and efficiency is ``useful / allocated``. Checkpoints are taken every
``checkpoint_interval_s`` of training (0: continuously, nothing is ever lost).
"""

from __future__ import annotations

from typing import Literal

Mode = Literal["train", "pause", "down"]


class Ledger:
    def __init__(self, checkpoint_interval_s: float, held_devices: int) -> None:
        if checkpoint_interval_s < 0:
            raise ValueError(f"checkpoint_interval_s must not be negative, got {checkpoint_interval_s}")
        self.interval = checkpoint_interval_s
        self.t = 0.0
        self.held = held_devices
        self.mode: Mode = "down"
        self.world = 0
        self.rate = 0.0  # tokens per second of the training world
        self.allocated = self.useful = self.downtime = self.lost = self.idle = 0.0
        self.paused_s = 0.0
        self.tokens = self.tokens_lost = 0.0
        self._since_s = self._since_gpu = self._since_tokens = 0.0
        self.series: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)]
        """``(time, wasted GPU-seconds so far, paused seconds so far)`` at every change."""

    @property
    def wasted(self) -> float:
        return self.downtime + self.lost + self.idle

    def advance(self, now: float) -> None:
        d = now - self.t
        if d < -1e-9:
            raise ValueError(f"ledger cannot go back in time from {self.t} to {now}")
        if d <= 0:
            return
        self.allocated += self.held * d
        if self.mode == "train":
            self.useful += self.world * d
            self.idle += (self.held - self.world) * d
            self.tokens += self.rate * d
            self._track_checkpoint(d)
        elif self.mode == "pause":
            self.downtime += self.held * d
            self.paused_s += d
        else:
            self.idle += self.held * d
        self.t = now
        self.series.append((now, self.wasted, self.paused_s))

    def _track_checkpoint(self, d: float) -> None:
        if self.interval == 0:
            return
        total = self._since_s + d
        if total < self.interval:
            self._since_s = total
            self._since_gpu += self.world * d
            self._since_tokens += self.rate * d
        else:  # a checkpoint completed inside this stretch: only what follows the latest one is at risk
            left = total % self.interval
            self._since_s = left
            self._since_gpu = self.world * left
            self._since_tokens = self.rate * left

    def set(
        self,
        now: float,
        *,
        mode: Mode | None = None,
        held: int | None = None,
        world: int | None = None,
        rate: float | None = None,
    ) -> None:
        """Change what the devices do from ``now`` on."""
        self.advance(now)
        if mode is not None:
            self.mode = mode
        if held is not None:
            self.held = held
        if world is not None:
            self.world = world
        if rate is not None:
            self.rate = rate
        if self.mode == "train" and self.world > self.held:
            raise ValueError(f"training world of {self.world} devices exceeds the {self.held} held")

    def rollback(self, now: float) -> float:
        """Restore the last checkpoint: training since then becomes lost work. Returns its GPU-seconds."""
        self.advance(now)
        lost = self._since_gpu
        self.useful -= lost
        self.lost += lost
        self.tokens -= self._since_tokens
        self.tokens_lost += self._since_tokens
        self._since_s = self._since_gpu = self._since_tokens = 0.0
        self.series.append((now, self.wasted, self.paused_s))
        return lost
