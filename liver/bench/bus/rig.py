"""The processes of ``liver bench bus`` and what the bench reads about them from outside.

Each control-plane service runs as ``liver serve <name>`` in a process of its own, and each simulated
job (:mod:`liver.worker_runtime.companion.simulated`, the code behind ``liver workers --simulate``) in
another, so that no service waits for another's Python code or for the simulated workers: that is how they run
in a deployment. What the bench needs from them it reads from outside, without changing them:

- CPU time per process from ``/proc/<pid>/task/*/schedstat`` (nanoseconds on a CPU, every thread;
  ``/proc/<pid>/stat`` counts in 10 ms ticks, too coarse for one event of a small job);
- messages and bytes per connection from the server's ``/connz`` monitoring endpoint (closed
  connections included, so a process that exits mid-run keeps its count);
- planning times from the services' JSON log lines (``topology_planned``, ``transfer_planned``), which
  is where the services report them.

A child is started with ``PR_SET_PDEATHSIG`` on Linux, so that a bench killed hard takes its
processes with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec
import nats.errors
from nats.aio.client import Client

from liver.shared.connection import CREDS_ENV, PASSWORD_ENV, TOKEN_ENV, USER_ENV
from liver.shared.errors import LiverError
from liver.shared.logs import FORMAT_ENV, LEVEL_ENV
from liver.shared.nats_server import URL_ENV

BENCH_CLIENT_PREFIX: Final = "liver-bench"
"""Connections of the bench itself (its observer and its control client): left out of message counts."""

_PR_SET_PDEATHSIG: Final = 1
_LOG_TAIL_BYTES: Final = 3000
_NO_PROXY: Final = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class RigError(LiverError, RuntimeError):
    """A child process died or never became ready; the message carries the end of its log."""


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def child_environment(url: str, log_level: str = "INFO") -> dict[str, str]:
    """This process's environment for a child on the bench's server: JSON logs, no credentials (the
    bench's server has no accounts, and credentials meant for another server must not leak to it)."""
    env = {k: v for k, v in os.environ.items() if k not in (USER_ENV, PASSWORD_ENV, TOKEN_ENV, CREDS_ENV)}
    env.update({URL_ENV: url, FORMAT_ENV: "json", LEVEL_ENV: log_level, "PYTHONUNBUFFERED": "1"})
    return env


@dataclass
class Child:
    """One process of the bench, its output going to ``log_path``."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check(self) -> None:
        """Raise :class:`RigError` when the process has exited."""
        code = self.proc.poll()
        if code is not None:
            raise RigError(f"{self.name} exited with code {code}; its log ends with:\n{self.log_tail()}")

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            data = self.log_path.read_bytes()
            return data[-_LOG_TAIL_BYTES:].decode("utf-8", errors="replace")
        return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (the services drain, the simulated workers stop), SIGKILL after ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def log_directory(path: Path | None, prefix: str) -> Iterator[Path]:
    """``path`` (created and kept), or a temporary directory named ``prefix...`` removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def spawn(name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path) -> Child:
    """Start ``argv`` with its standard output and error in ``log_dir/<name>.log``."""
    log_path = log_dir / f"{name}.log"
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=out, preexec_fn=preexec
        )
    return Child(name=name, proc=proc, log_path=log_path)


def service_argv(service: str) -> list[str]:
    """``liver serve <service>`` in this interpreter."""
    return [sys.executable, "-m", "liver.cli.serve_cmd", service]


def workers_argv(settings_json: bytes) -> list[str]:
    """A simulated job (see :func:`workers_main`) in this interpreter."""
    return [sys.executable, "-m", "liver.bench.bus.rig", "workers", settings_json.decode()]


async def wait_ready(nc: Client, child: Child, service: str, timeout_s: float) -> None:
    """Return once the service answers discovery (``$SRV.PING.liver-<service>``): it has declared its
    streams and consumers and is consuming."""
    deadline = time.monotonic() + timeout_s
    while True:
        child.check()
        try:
            await nc.request(f"$SRV.PING.liver-{service}", b"", timeout=0.5)
            return
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            pass
        if time.monotonic() > deadline:
            raise RigError(f"{child.name} did not answer discovery in {timeout_s} s:\n{child.log_tail()}")
        await asyncio.sleep(0.1)


# -- CPU time ---------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """CPU time of every live thread of ``pid`` (``None`` where ``/proc`` has no schedstat)."""
    base = Path(f"/proc/{pid}/task")
    try:
        tasks = os.listdir(base)
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            total += int((base / task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended between the listing and the read
    return total / 1e9


def cpu_of(pids: Mapping[str, int]) -> dict[str, float | None]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def cpu_delta(before: Mapping[str, float | None], after: Mapping[str, float | None]) -> dict[str, float]:
    """Seconds of CPU per process between two samples (processes missing from either are left out)."""
    out: dict[str, float] = {}
    for name, end in after.items():
        start = before.get(name)
        if start is not None and end is not None:
            out[name] = max(end - start, 0.0)
    return out


# -- server counters ----------------------------------------------------------------------------------------


class ConnCounters(msgspec.Struct, frozen=True):
    name: str
    in_msgs: int
    out_msgs: int
    in_bytes: int
    out_bytes: int


class Traffic(msgspec.Struct, frozen=True):
    """Messages and payload bytes the server received from (in) and delivered to (out) clients."""

    in_msgs: int
    out_msgs: int
    in_bytes: int
    out_bytes: int


def _get_json(url: str) -> dict:
    with _NO_PROXY.open(url, timeout=10.0) as response:
        return json.load(response)  # type: ignore[no-any-return]


def connections(monitor_url: str) -> dict[int, ConnCounters]:
    """Every connection the server knows, open or closed, by connection id."""
    data = _get_json(f"{monitor_url}/connz?state=all&limit=100000")
    out: dict[int, ConnCounters] = {}
    for conn in data.get("connections") or ():
        out[int(conn["cid"])] = ConnCounters(
            name=str(conn.get("name", "")),
            in_msgs=int(conn.get("in_msgs", 0)),
            out_msgs=int(conn.get("out_msgs", 0)),
            in_bytes=int(conn.get("in_bytes", 0)),
            out_bytes=int(conn.get("out_bytes", 0)),
        )
    return out


def server_version(monitor_url: str) -> str:
    return str(_get_json(f"{monitor_url}/varz").get("version", "unknown"))


def traffic_between(
    before: Mapping[int, ConnCounters], after: Mapping[int, ConnCounters], exclude_prefix: str
) -> Traffic:
    """What the clients not named ``exclude_prefix...`` sent and received between two snapshots."""
    zero = ConnCounters(name="", in_msgs=0, out_msgs=0, in_bytes=0, out_bytes=0)
    totals = [0, 0, 0, 0]
    for cid, end in after.items():
        if end.name.startswith(exclude_prefix):
            continue
        start = before.get(cid, zero)
        totals[0] += end.in_msgs - start.in_msgs
        totals[1] += end.out_msgs - start.out_msgs
        totals[2] += end.in_bytes - start.in_bytes
        totals[3] += end.out_bytes - start.out_bytes
    return Traffic(*totals)


# -- planning times from the services' logs ---------------------------------------------------------------


class Planning(msgspec.Struct, kw_only=True):
    """What the planners report about one event's planning (seconds)."""

    topology_s: float | None = None
    """The chooser's time (``planning_seconds`` of ``topology_planned``)."""
    transfer_plan_s: float | None = None
    transfer_verify_s: float | None = None
    transfer_encode_s: float | None = None
    """Plan file and per-device slices as bytes (``encode_seconds`` of ``transfer_planned``)."""


def planning_times(log_paths: Iterable[Path]) -> dict[tuple[str, str], Planning]:
    """Planning times by (job, event id) from the topology and transfer services' JSON log lines."""
    out: dict[tuple[str, str], Planning] = {}
    for path in log_paths:
        with open(path, "rb") as fh:
            for line in fh:
                if b'"topology_planned"' not in line and b'"transfer_planned"' not in line:
                    continue
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                key = (str(entry.get("job_id")), str(entry.get("event_id")))
                record = out.setdefault(key, Planning())
                if entry.get("event") == "topology_planned":
                    record.topology_s = float(entry["planning_seconds"])
                elif entry.get("event") == "transfer_planned":
                    record.transfer_plan_s = float(entry["plan_seconds"])
                    record.transfer_verify_s = float(entry["verify_seconds"])
                    record.transfer_encode_s = float(entry["encode_seconds"])
    return out


class LogFollower:
    """Reads a child's JSON log as it grows, remembering how far it got."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def entries(self) -> list[dict]:
        """The complete JSON lines written since the last call."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    out.append(entry)
        return out


# -- the simulated job's process ----------------------------------------------------------------------------


def workers_main(argv: Sequence[str]) -> int:
    """``python -m liver.bench.bus.rig workers '<SimSettings as JSON>'``: a simulated job until SIGTERM.

    The same job ``liver workers --simulate N`` runs, with settings the command line does not offer (a
    worker-id prefix per incarnation of a returning node). A thousand workers' INFO lines in one process
    are an artefact of the simulation (each real worker logs its own), so it logs warnings only.
    """
    from liver.shared.logs import configure_logging
    from liver.worker_runtime.companion.simulated import SimSettings, run_until_signalled

    if len(argv) != 2 or argv[0] != "workers":
        print("usage: python -m liver.bench.bus.rig workers '<SimSettings JSON>'", file=sys.stderr)
        return 2
    try:
        settings = msgspec.json.decode(argv[1], type=SimSettings)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        print(f"bad simulated-job settings: {exc}", file=sys.stderr)
        return 2
    configure_logging(level="WARNING")
    asyncio.run(run_until_signalled(settings, os.environ[URL_ENV], os.environ))
    return 0


if __name__ == "__main__":
    sys.exit(workers_main(sys.argv[1:]))
