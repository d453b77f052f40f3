"""What every ``liver bench`` report shares: its checks, how it is printed, and the facts about the host.

The four benchmarks judge their numbers against the issue's targets in the same way (a must decides the
exit code, an aim is only reported) and print them in the same line format, so the judgement and its
printing live here once. Each benchmark keeps its own report struct: their JSON schemas predate this
module and stay as they were, so what is shared is built by these helpers rather than inherited (a
base struct would move the shared fields to the front of every report).
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec

R = TypeVar("R")


class Check(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One of the issue's targets, judged on this run's numbers.

    ``scenario`` and ``workers`` say what a check judges in the benchmarks that run several cases
    (``bench plan``: a scenario, ``bench bus``: a job size); unset, they are left out of the JSON, so
    each benchmark's checks keep the fields they always had.
    """

    scenario: str | None = None
    workers: int | None = None
    level: str  # "must" (decides the exit code) or "aim" (reported)
    what: str
    passed: bool
    detail: str


def check_line(c: Check) -> str:
    """``MUST PASS  <scenario>: <what>  (<detail>)``, as every benchmark prints its checks."""
    subject = ""
    if c.scenario is not None:
        subject = f"{c.scenario}: "
    elif c.workers is not None:
        subject = f"{c.workers} workers: "
    return f"{c.level.upper():<4} {'PASS' if c.passed else 'FAIL'}  {subject}{c.what}  ({c.detail})"


def musts_passed(checks: Iterable[Check]) -> bool:
    """Every must held (aims do not count)."""
    return all(c.passed for c in checks if c.level == "must")


def emit(report: R, as_json: bool, print_table: Callable[[R], None]) -> None:
    """One JSON object on one line (``--json``: stdout carries nothing else), or the human tables."""
    if as_json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        print_table(report)


def progress(bench: str, text: str) -> None:
    """A progress line on stderr (stdout is the report's)."""
    print(f"[bench {bench}] {text}", file=sys.stderr, flush=True)


def load_average() -> float:
    """The 1-minute load average (other work on the machine skews wall-clock timings); NaN if unknown."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def machine() -> str:
    """The CPU architecture and model (or system) name.

    Read from ``/proc/cpuinfo`` where there is one: ``platform.processor()`` runs ``uname -p`` in a
    subprocess on Linux and answers only the architecture again.
    """
    return f"{platform.machine()} {_cpu_model() or platform.system()}"


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return None


def size(n: float, digits: int = 1) -> str:
    """Bytes in the largest binary unit they reach, ``digits`` after the point (whole bytes below 1 KiB)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.{digits}f} {unit}"
    return f"{n:,.0f} B"
