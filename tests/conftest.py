"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from liver.shared.nats_server import NatsServer

# Hypothesis' default deadline (200 ms an example) and its too-slow health check measure wall-clock time,
# which a busy two-core machine stretches: a property fails on what it computes, never on how long it
# took. Tests that set their own settings inherit these for what they leave out.
settings.register_profile("liver", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("liver")


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """One nats-server with JetStream for the whole session (it starts in well under a second).

    It is a plain subprocess, so it needs no event loop; connect clients inside each test (or in
    fixtures of the test's loop scope). Tests share it: give streams, consumers, buckets and subjects
    names of their own, and start a private ``NatsServer`` for tests that need LiveR's real stream
    names or must stop the server.
    """
    with NatsServer(startup_timeout_s=60.0) as server:
        yield server
