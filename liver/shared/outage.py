"""Which failures of a NATS call only say that the bus could not be reached just now.

A stream whose leader is being elected, a server being restarted, a client reconnecting: the same call
succeeds seconds later. Code that retries a message or a read tells these apart from failures that say
something about the message itself, which retrying cannot fix.
"""

from __future__ import annotations

from typing import Final

import nats.errors
import nats.js.errors

_UNREACHABLE: Final = (
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
"""Failures that say nothing answered at all: no responders (a stream without a leader during an
election), a connection being re-established, a server that says JetStream is unavailable."""


def is_outage(exc: BaseException, *, timeouts: bool = True) -> bool:
    """Whether ``exc`` (or what it was raised from) says the bus could not be reached just now.

    A stream whose leader is being elected, a server being restarted, a client reconnecting: the same
    call succeeds seconds later. Such a failure says nothing about the message, so it must not use up
    the message's deliveries (five at 0.1 s apart are gone before an election ends, and the message
    would be dead-lettered although nothing was wrong with it). A timeout counts only with
    ``timeouts``: the caller knows whether its connection was lost meanwhile, and a timeout on a
    connection that stayed up is the handler's own failure (a slow store, a peer that never answers).
    """
    kinds = (*_UNREACHABLE, TimeoutError) if timeouts else _UNREACHABLE
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kinds):
            return True
        seen.add(id(current))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return False
