"""Shared fixtures."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import threading
import traceback
from collections.abc import Generator, Iterator

import pytest
import structlog
from hypothesis import HealthCheck, settings

# Python's bytecode cache stays on for the suite and every process it starts, even where the environment
# turns it off (PYTHONDONTWRITEBYTECODE): without it each process compiles every LiveR and test module
# again, and pytest's assertion rewriter alone takes about 7 s a process on a 2-core machine.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

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


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """A test that runs a CLI command configures structlog for the whole process (a level filter, a
    renderer): restore the configuration after it, so that a later test in the same worker captures
    the logs it expects."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session", autouse=True)
def _fork_server(request: pytest.FixtureRequest) -> None:
    """The fork server every multi-process test and benchmark shares, started with Megatron-core loaded
    before any of them runs (see ``mp_helpers.start_fork_server``); not for a run without such tests."""
    if any(item.get_closest_marker("slow") is not None for item in request.session.items):
        from mp_helpers import start_fork_server

        start_fork_server()


# -- the fast tier starts no process ---------------------------------------------------------------------
# ``pytest -m "not slow"`` is the tier a developer runs on every change: it must need nothing but the test
# process. A test without the ``slow`` mark that starts a process (a nats-server, training processes, a
# CLI in a subprocess) fails here, naming what it started, instead of quietly making the tier slow.


class StartsAProcess(AssertionError):
    """A test outside the slow tier started a process."""


def _refuse(what: str) -> None:
    raise StartsAProcess(f"this test starts {what}: mark it slow (the fast tier starts no process)")


@pytest.fixture(autouse=True)
def _fast_tests_use_no_nats_server(request: pytest.FixtureRequest) -> None:
    """The shared server may already run for an earlier slow test in this worker: using it is refused
    all the same."""
    if request.node.get_closest_marker("slow") is None and "nats_server" in request.fixturenames:
        _refuse("the shared nats-server (the nats_server fixture)")


@contextlib.contextmanager
def _no_process(item: pytest.Item) -> Iterator[None]:
    """Refuse a process for the whole of a fast test's protocol (see ``pytest_runtest_protocol``), so a
    module- or session-scoped fixture that the test is the first to need is caught too."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    import multiprocessing.process
    import subprocess

    def no_popen(self: object, args: object, *rest: object, **kwargs: object) -> None:
        _refuse(f"a subprocess ({args!r:.120})")

    def no_start(self: multiprocessing.process.BaseProcess) -> None:
        _refuse(f"a process ({self.name})")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", no_popen)
        patch.setattr(multiprocessing.process.BaseProcess, "start", no_start)
        yield


# -- what a hung test was waiting for ----------------------------------------------------------------------
# pytest-timeout prints the threads' stacks, which for an asyncio test show only the event loop waiting
# in select(); the coroutine that never resumed is invisible. Shortly before it fires, print every
# pending task's stack too (a CI failure then names the await that hung).

DUMP_BEFORE_TIMEOUT_S = 20.0


def _dump_pending_tasks(phase: str, nodeid: str) -> None:
    out = sys.__stderr__
    if out is None:
        return
    print(f"\n===== {nodeid} ({phase}) still running: pending asyncio tasks =====", file=out)
    for obj in gc.get_objects():
        if isinstance(obj, asyncio.Task) and not obj.done():
            print(f"--- {obj.get_name()}: {obj.get_coro()!r}", file=out)
            for frame in obj.get_stack(limit=40):
                print(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=out)
    for ident, frame in sys._current_frames().items():
        print(f"--- thread {ident}", file=out)
        traceback.print_stack(frame, file=out)
    out.flush()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 0)
    with _no_process(item):
        if limit <= DUMP_BEFORE_TIMEOUT_S:
            return (yield)
        timer = threading.Timer(limit - DUMP_BEFORE_TIMEOUT_S, _dump_pending_tasks, ("test", item.nodeid))
        timer.daemon = True
        timer.start()
        try:
            return (yield)
        finally:
            timer.cancel()


# -- the order the files run in ----------------------------------------------------------------------------
# With ``-n`` (the README's test command), pytest-xdist hands each worker whole files (``--dist loadfile``)
# in collection order. The multi-process files take up to two minutes each: started last, one of them
# would run alone at the end while the other worker idles. So the heaviest files go first, longest
# first, then the other files with a slow test, and the many short files fill the tail. Without ``-n``
# the order changes nothing but when each file runs.


HEAVIEST_FIRST = (
    "test_live_reshard_user_models.py",
    "test_live_reshard_moe.py",
    "test_live_reshard_vpp.py",
    "test_bench_reconfig.py",
    "test_chaos.py",
    "test_chaos_real.py",
    "test_fail_stop_copies.py",
    "test_live_reshard.py",
    "test_example_your_own_job.py",
    "test_geometry_megatron.py",
    "test_demo_fail_stop.py",
)
"""The files that took longest in a full run here, longest first: only an order, so a stale entry costs
nothing but a less even end."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}

    def rank(item: pytest.Item) -> tuple[int, int]:
        if item.path.name in HEAVIEST_FIRST:
            return 0, HEAVIEST_FIRST.index(item.path.name)
        return (1, 0) if item.path in slow_files else (2, 0)

    items.sort(key=rank)  # stable: within a file the tests keep their order
