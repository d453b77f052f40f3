"""How the bus commands (``liver publish``, ``liver watch``, ``liver status``, ``liver notice``) reach a
NATS server, and how what goes wrong there reads.

They talk to the job's server, never to an embedded one (an event published into a server nobody else
uses would be lost): ``--url``, else ``$NATS_URL``, with the same credentials from the environment as
the services (:func:`~liver.shared.connection.connect_options`). Unlike a service, a command gives up
at once when the server cannot be reached, so a typo in the URL is an error, not a hang.

Whatever the server refuses is one line, never a traceback (:func:`guarded`): credentials it does not
accept (:class:`CredentialsRefused`), a publish or subscription the user's permissions do not allow
(:class:`PermissionRefused`, naming the user, the subject and the role that has it), and a request
nobody answered in time (:class:`NoAnswer`). A refused publish raises nothing where it is made: the
server drops it and reports the violation to the connection's error callback, and the request behind
it would wait for its whole timeout. So the command's work is raced against that report and ends as
soon as it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Mapping
from datetime import datetime
from typing import Any, Final, TypeVar

import nats.errors
from nats.aio.client import Client

from liver.shared.connection import CREDS_ENV, PASSWORD_ENV, TOKEN_ENV, URL_ENV, USER_ENV, connect_options
from liver.shared.errors import BusError, InputError
from liver.shared.subjects import validate_token

T = TypeVar("T")


class BusUnreachable(BusError):
    """The server named by ``--url`` / ``$NATS_URL`` did not accept a connection."""


class CredentialsRefused(BusUnreachable):
    """The server answered, but refused the credentials (nats-py reports an authorization violation to
    the error callback and then only says that no server was available)."""


class PermissionRefused(BusError):
    """The server refused a publish or a subscription of the command: its user lacks the permission."""


class NoAnswer(BusError):
    """A request to the server (JetStream's API, a flush) was not answered in time."""


_REFUSAL: Final = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"')
_AUTHORIZATION_VIOLATION: Final = "authorization violation"
_INBOX: Final = "_INBOX."
_SETTLE_S: Final = 2.0
"""How long a refused command waits for the server's other refusals of what it had sent (one flush)."""

# nats-py upgrades a connection to TLS with ``loop.start_tls()`` and hands the TLS transport to a new
# ``asyncio.StreamReaderProtocol`` without calling its ``connection_made()`` (``start_tls`` is made with
# ``call_connection_made=False``). That protocol therefore never learns it runs over TLS and answers
# ``eof_received()`` with True, and asyncio's SSL protocol logs this warning when the server closes the
# stream: on every command over TLS, printed by logging's last-resort handler. It is harmless (the SSL
# transport closes itself all the same), so exactly this message of the ``asyncio`` logger is dropped.
_EOF_OVER_TLS: Final = "returning true from eof_received() has no effect when using ssl"


class _NoEofOverTlsWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _EOF_OVER_TLS


_EOF_FILTER: Final = _NoEofOverTlsWarning()


def silence_eof_over_tls_warning() -> None:
    """Drop asyncio's ``eof_received()`` warning about nats-py's TLS upgrade (see above); idempotent."""
    logger = logging.getLogger("asyncio")
    if _EOF_FILTER not in logger.filters:
        logger.addFilter(_EOF_FILTER)


class CliClient(Client):
    """A nats-py client that keeps what the server refused it (its permissions violations) and how
    the command spelled each subject: the server's report arrives lower-cased, and ``$SRV.PING`` or
    ``KV_liver-generations`` should be named as written."""

    def __init__(self) -> None:
        super().__init__()
        self.who = "this connection's NATS credentials"
        self.refusals: list[tuple[str, str]] = []
        """What the server refused, in order: ``("publish to", "$SRV.PING")``."""
        self.refused = asyncio.Event()
        self.credentials_refused = False
        self._spelled: dict[str, str] = {}

    def _remember(self, subject: str) -> None:
        if len(self._spelled) < 10_000:
            self._spelled.setdefault(subject.lower(), subject)

    async def publish(self, subject: str, *args: Any, **kwargs: Any) -> None:
        self._remember(subject)
        await super().publish(subject, *args, **kwargs)

    async def subscribe(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        self._remember(subject)
        return await super().subscribe(subject, *args, **kwargs)

    async def on_error(self, exc: Exception) -> None:
        """nats-py's error callback: note refusals; nothing is printed (the command reports them)."""
        text = str(exc).lower()
        if _AUTHORIZATION_VIOLATION in text or isinstance(exc, nats.errors.AuthorizationError):
            self.credentials_refused = True
        match = _REFUSAL.search(text)
        if match is not None and len(self.refusals) < 100:
            action = "publish to" if match[1] == "publish" else "subscribe to"
            self.refusals.append((action, self._spelled.get(match[2], match[2])))
            self.refused.set()

    def refusal_error(self, needs: str) -> PermissionRefused:
        """The refusal that says most: the first one not of the inbox the replies come to (a user that
        may not receive replies is also refused the request that tells what the command wanted)."""
        assert self.refusals
        telling = [r for r in self.refusals if not r[1].upper().startswith(_INBOX)]
        action, subject = (telling or self.refusals)[0]
        if subject.upper().startswith(_INBOX):
            subject = f"{_INBOX}> (the replies to its requests)"
        return PermissionRefused(f"{self.who} may not {action} {subject} (needs {needs})")


def utc_text(moment: datetime) -> str:
    """An aware time as ISO 8601, UTC written ``Z``: how the bus commands print moments."""
    return moment.isoformat().replace("+00:00", "Z")


def job_flag(job: str | None) -> str | None:
    """``--job`` as given, when it is a job id the bus accepts (or not given)."""
    if job is not None:
        try:
            validate_token(job, "job")
        except ValueError as exc:
            raise InputError(f"--job: {exc}") from None
    return job


def server_url(url: str | None, environ: Mapping[str, str]) -> str:
    """``url`` (``--url``), else ``$NATS_URL``; neither is an :class:`InputError` naming both."""
    chosen = (url or "").strip() or environ.get(URL_ENV, "").strip()
    if not chosen:
        raise InputError(f"--url: no server given and {URL_ENV} is not set (e.g. nats://127.0.0.1:4222)")
    return chosen


def _who(environ: Mapping[str, str]) -> tuple[str, str]:
    """Whose credentials these are, as an error names them, and the variables that give them."""
    if environ.get(USER_ENV, ""):
        return f"the NATS user '{environ[USER_ENV]}'", f"{USER_ENV} and {PASSWORD_ENV}"
    if environ.get(TOKEN_ENV, ""):
        return f"the NATS token in {TOKEN_ENV}", TOKEN_ENV
    if environ.get(CREDS_ENV, ""):
        return f"the NATS credentials in {environ[CREDS_ENV]}", CREDS_ENV
    return "a NATS client without credentials", f"{USER_ENV} and {PASSWORD_ENV} (or {TOKEN_ENV}, {CREDS_ENV})"


async def connect_once(
    url: str, environ: Mapping[str, str], *, name: str, keep_reconnecting: bool = False
) -> CliClient:
    """Connect with the services' options, but give up when the first connection fails; once connected,
    ``keep_reconnecting`` rides out a server restart as a service does (a long ``liver watch``)."""
    silence_eof_over_tls_warning()
    options = connect_options(url, environ, name=name)
    # nats-py retries a first connection for ever unless reconnects are capped (0 and -1 both mean no
    # cap there); one attempt is what a command wants.
    options["max_reconnect_attempts"] = 1
    nc = CliClient()
    nc.who, variables = _who(environ)
    try:
        await nc.connect(**options, error_cb=nc.on_error)  # errors are raised below, not printed
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        if nc.credentials_refused:
            # nats-py ends with "no servers available for connection"; the reason went to on_error.
            raise CredentialsRefused(
                f"the server at {url} refused the credentials of {nc.who} (authorization violation): "
                f"check {variables}"
            ) from exc
        raise BusUnreachable(f"cannot connect to {url}: {exc or type(exc).__name__}") from exc
    if keep_reconnecting:
        nc.options["max_reconnect_attempts"] = -1  # read by nats-py at each reconnect
    return nc


async def guarded(nc: Client, work: Awaitable[T], *, needs: str, timeout_s: float) -> T:
    """Run a command's ``work`` on ``nc`` and turn what the server refused into one-line errors: a
    permissions violation reported meanwhile ends it at once (:class:`PermissionRefused`, saying that it
    ``needs`` a role, e.g. "the operator role"), a request left unanswered becomes :class:`NoAnswer`
    (``timeout_s``: the longest wait of ``work``'s requests) and any other failure of the client a
    :class:`BusError` naming it. A plain client (not from :func:`connect_once`) only gets the last two."""
    task = asyncio.ensure_future(work)
    refused = nc.refused if isinstance(nc, CliClient) else asyncio.Event()
    refusal = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait({task, refusal}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        refusal.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if isinstance(nc, CliClient) and nc.refusals:
        # Refused: whatever ``work`` made of it (a timeout, a result without the refused part) is moot.
        if not task.cancelled():
            task.exception()  # retrieved, so that asyncio does not log it as lost
        # The server reports refusals in the order of what was sent, all before the answer to a flush.
        with contextlib.suppress(Exception):
            await nc.flush(timeout=int(_SETTLE_S))
        raise nc.refusal_error(needs) from None
    try:
        return task.result()
    except TimeoutError as exc:  # nats.errors.TimeoutError is one too
        raise NoAnswer(f"no answer from the server within {timeout_s:g} s") from exc
    except nats.errors.Error as exc:
        raise BusError(f"the server failed the request: {exc or type(exc).__name__}") from exc
