"""The fast tier (``pytest -m "not slow"``) starts no process: a test outside it that starts one fails,
naming what it started, whether the test itself or a fixture it is the first to need starts it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


def _run(pytester: pytest.Pytester, body: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    slow: starts a process\n")
    pytester.makepyfile(test_probe=body)
    return pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider")


def test_a_fast_test_that_starts_a_subprocess_fails_naming_it(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "import subprocess\n\ndef test_it():\n    subprocess.run(['true'])\n")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*StartsAProcess*subprocess*true*mark it slow*"])


def test_a_fast_test_whose_module_fixture_starts_a_process_fails(pytester: pytest.Pytester) -> None:
    body = (
        "import multiprocessing, pytest\n\n"
        "@pytest.fixture(scope='module')\n"
        "def worker():\n"
        "    p = multiprocessing.get_context('spawn').Process(target=print)\n"
        "    p.start()\n"
        "    yield p\n"
        "    p.join()\n\n"
        "def test_it(worker):\n"
        "    pass\n"
    )
    _run(pytester, body).assert_outcomes(errors=1)


def test_a_slow_test_is_left_alone(pytester: pytest.Pytester) -> None:
    """Not run by starting one: this test is itself in the fast tier, so a process would be refused by
    the guard around it; the probe shows instead that nothing is patched for a slow test."""
    body = (
        "import multiprocessing.process, subprocess, pytest\n\n"
        "BEFORE = (subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start)\n\n"
        "@pytest.fixture(scope='session', autouse=True)\n"
        "def _fork_server():\n"
        "    pass  # not the suite's Megatron fork server\n\n"
        "@pytest.mark.slow\n"
        "def test_slow():\n"
        "    assert (subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start) == BEFORE\n\n"
        "def test_fast():\n"
        "    assert subprocess.Popen.__init__ is not BEFORE[0]\n"
    )
    _run(pytester, body).assert_outcomes(passed=2)


def test_a_fast_test_may_not_use_the_shared_nats_server(pytester: pytest.Pytester) -> None:
    _run(pytester, "def test_it(nats_server):\n    pass\n").assert_outcomes(errors=1)
