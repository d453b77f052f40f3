"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from liver.shared.nats_server import NatsServer


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """One nats-server with JetStream for the whole session (it starts in well under a second).

    It is a plain subprocess, so it needs no event loop; connect clients inside each test (or in
    fixtures of the test's loop scope). Tests share it: give streams, consumers, buckets and subjects
    names of their own, and start a private ``NatsServer`` for tests that need LiveR's real stream
    names or must stop the server.
    """
    with NatsServer() as server:
        yield server
