"""Which failures of a NATS call only say that the bus could not be reached just now.

A stream whose leader is being elected, a server being restarted, a client reconnecting: the same call
succeeds seconds later. Code that retries a message or a read tells these apart from failures that say
something about the message itself, which retrying cannot fix.
"""

from __future__ import annotations

from typing import Final

import nats.errors
import nats.js.errors

_OUTAGE_ERRORS: Final = (
    TimeoutError,  # nats.errors.TimeoutError and FlushTimeoutError are TimeoutErrors too
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) says the bus could not be reached just now.

    A stream whose leader is being elected, a server being restarted, a client reconnecting: the same
    call succeeds seconds later. Such a failure says nothing about the message, so it must not use up
    the message's deliveries (five at 0.1 s apart are gone before an election ends, and the message
    would be dead-lettered although nothing was wrong with it).
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, _OUTAGE_ERRORS):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
