"""LiveR's one exception root and its families.

A caller that wants to handle LiveR's failures, and only those, catches :class:`LiverError` (or one
family) instead of naming the module-specific classes. Each concrete class keeps the built-in base it
always had (``ValueError`` for bad input, ``RuntimeError`` for failures at run time), so code that
catches those still does, and each keeps its message naming the field, peer or stage.

The families, by what the caller can do about it:

* :class:`InputError`: something from outside (a bus message, a CLI argument, a config, a plan file, a
  user's model or layout) does not validate. Fix the input; nothing was changed.
* :class:`PlanningError`: the input is valid, but no layout or transfer plan satisfies it (too few
  devices, not enough memory, state that survives nowhere).
* :class:`HandoffError`: a live reshard (or the world it builds, streams into or falls back from) did
  not happen as asked; the message names the stage and, where known, the peer.
* :class:`BusError`: NATS or JetStream failed under LiveR (the server, a stream, a bucket, a record).

This module imports nothing, so every layer can use it.
"""

from __future__ import annotations

__all__ = ["BusError", "HandoffError", "InputError", "LiverError", "PlanningError"]


class LiverError(Exception):
    """Every failure LiveR raises on purpose."""


class InputError(LiverError, ValueError):
    """Input from outside LiveR does not validate (the message names the field)."""


class PlanningError(LiverError, ValueError):
    """Valid input that no layout, placement or transfer plan can satisfy."""


class HandoffError(LiverError, RuntimeError):
    """A live reshard, its worlds, its stream or its fallback failed (the message names the stage)."""


class BusError(LiverError, RuntimeError):
    """NATS or JetStream failed under LiveR."""
