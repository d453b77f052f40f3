"""Bookkeeping of the bytes the streaming executor allocates and holds.

The executor counts its own allocations instead of asking the allocator: the figure must mean the same
on CPU and GPU, must not include other threads' training memory, and is what invariant I2 bounds.
"""

from __future__ import annotations

from typing import Literal

Extra = Literal["buffer", "assembly"]
"""Memory that exists only because a transfer is running: the one buffer (staged pieces and contiguous
copies of non-contiguous slices being sent, allocated once, at most ``B``) and the new shards of the
layer being assembled."""

Held = Literal["old", "new"]
"""Training state: old shards not yet released, and new shards of finished layers."""

Inside = Literal["staged", "send_copies"]
"""How much of the buffer is in use; counted for the report, never on top of the buffer itself."""


class MemoryLedger:
    """Current and peak bytes per category; ``peak_extra`` is the figure ``B`` + the largest new layer
    shard bounds."""

    def __init__(self) -> None:
        self.now: dict[str, int] = {
            "buffer": 0,
            "assembly": 0,
            "old": 0,
            "new": 0,
            "staged": 0,
            "send_copies": 0,
        }
        self.peak: dict[str, int] = dict(self.now)
        self.peak_extra = 0
        self.peak_footprint = 0

    def add(self, what: Extra | Held | Inside, nbytes: int) -> None:
        self.now[what] += nbytes
        if self.now[what] > self.peak[what]:
            self.peak[what] = self.now[what]
        extra = self.now["buffer"] + self.now["assembly"]
        self.peak_extra = max(self.peak_extra, extra)
        self.peak_footprint = max(self.peak_footprint, extra + self.now["old"] + self.now["new"])

    def sub(self, what: Extra | Held | Inside, nbytes: int) -> None:
        self.now[what] -= nbytes
        if self.now[what] < 0:
            raise AssertionError(f"memory ledger: {what} went negative ({self.now[what]})")

    def move(self, src: Extra | Held, dst: Extra | Held, nbytes: int) -> None:
        """Re-label bytes (a finished layer's new shards stop being extra and become state)."""
        self.now[src] -= nbytes
        self.add(dst, nbytes)
