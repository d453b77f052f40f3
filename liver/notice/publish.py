"""The one way a resize event goes onto the bus from outside the services (``liver publish``,
``liver notice``): checked by the ingester's own parser, then published on JetStream with a message id
derived from the job and event id, so a repeat is stored once.

It only publishes: the ``publisher`` role of ``infra/nats.conf`` may do nothing else. The stream that
keeps events until the ingester takes them is the ingester's to declare; a server without it is an
error that says so, since an event published there would be lost. That shows as "no responders", or,
when a plain subscriber of the subject takes the event instead, as a publish that is never
acknowledged: the role cannot ask JetStream which it is, so a timeout names the missing stream and its
fix as the likely cause.
"""

from __future__ import annotations

from typing import Final

import nats.errors
import nats.js.errors
from nats.aio.client import Client

from liver.services.ingester.core import IngestEvent, parse
from liver.shared import subjects as s
from liver.shared.codec import encode
from liver.shared.errors import BusError
from liver.shared.messages import ScaleRequest, SpotWarning

PUBLISH_TIMEOUT_S: Final = 10.0


class NotStored(BusError):
    """The server has no stream for the event's subject: nothing would keep it for the ingester."""


class NotAcknowledged(BusError):
    """JetStream did not acknowledge the event in time: most often no stream keeps its subject and a
    plain subscriber of the subject took it instead (the server then sends no "no responders")."""


def _start_the_ingester(subject: str) -> str:
    return (
        f"no stream keeps {subject} on this server: start the ingester once (it declares "
        f"{s.STREAM_INGEST.name}), then publish again"
    )


def subject_of(event: IngestEvent) -> str:
    if isinstance(event, SpotWarning):
        return s.SPOT_WARNING
    if isinstance(event, ScaleRequest):
        return s.SCALE_REQUEST
    raise TypeError(f"not a resize event: {type(event).__name__}")


def checked(event: IngestEvent) -> IngestEvent:
    """``event`` as the ingester will read it; raises :class:`~liver.shared.codec.MessageError` naming
    the field the ingester would reject."""
    return parse(subject_of(event), encode(event))


async def publish_event(nc: Client, event: IngestEvent) -> tuple[int, bool]:
    """Publish a checked event; returns its stream sequence and whether JetStream had it already."""
    subject = subject_of(event)
    js = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
    try:
        ack = await js.publish(
            subject,
            encode(event),
            headers={s.HEADER_MSG_ID: f"{subject}-{event.job_id}-{event.event_id}"},
            timeout=PUBLISH_TIMEOUT_S,
        )
    except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
        raise NotStored(_start_the_ingester(subject)) from None
    except TimeoutError:  # nats.errors.TimeoutError too
        raise NotAcknowledged(
            f"no acknowledgement of {subject} within {PUBLISH_TIMEOUT_S:g} s; most likely "
            f"{_start_the_ingester(subject)} (else the server is slow or the connection is down)"
        ) from None
    return ack.seq, bool(ack.duplicate)
