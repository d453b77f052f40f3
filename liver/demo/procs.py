"""Every process the demo starts, and the guarantee that none outlives it.

Two kinds of process:

* **Services** run as ``liver serve <name>`` subprocesses, exactly as deployed. Each gets a session (and
  so a process group) of its own, so that a Ctrl-C in the terminal reaches only the demo, which then
  stops everything in order; and ``PR_SET_PDEATHSIG``, so that a demo killed hard takes them along.
* **Workers** (training processes) run :func:`liver.worker_runtime.worker_main.run`, the function behind
  ``liver worker``, in children of one *fork server* that imported torch and Megatron-core once. An
  interpreter that imports them takes 10-25 s of CPU on a busy 2-core laptop; six workers importing at
  once would take minutes before the first step. Each child makes itself a process group leader, asks
  for SIGKILL when the fork server dies, and lets go of the fork server's liveness pipe; the fork
  server then exits when the demo does (the pipe closes), so a hard-killed demo leaves nothing behind.

Stopping (:meth:`ProcessBook.stop_all`): workers first (they hold nothing anyone else needs), then the
services (SIGTERM: they drain their connections and exit 0), each given a grace period before SIGKILL
to its whole process group. Every child's environment carries :data:`MARK_ENV`, so a test can verify
that nothing with the mark survived.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

import structlog

log = structlog.get_logger(__name__)

MARK_ENV: Final = "LIVER_DEMO_RUN"
"""Set in the environment of every process the demo starts (and so of their children)."""

PRELOAD: Final = [
    "liver.demo.preload",
    "torch",
    "torch.distributed",
    "megatron.core",
    "liver.worker_runtime.megatron.job",
    "liver.worker_runtime.runtime",
    "liver.worker_runtime.companion.thread",
    "liver.worker_runtime.worker_main",
]
"""What the workers' fork server imports once."""

_PR_SET_PDEATHSIG: Final = 1
_ctx = mp.get_context("forkserver")

Kind = Literal["service", "worker"]


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _service_preexec() -> None:
    die_with_parent(signal.SIGTERM)


def _release_fork_server_pipes() -> None:
    """Close this child's copies of the fork server's and the resource tracker's liveness pipes.

    The standard library hands every forked child a write end of both, so that they live as long as
    any child might use them. A worker never starts processes of its own; holding them would only keep
    the fork server alive after the demo died, and with it every worker (whose death signal is tied to
    the fork server): a hard-killed demo would leave all of them behind.
    """
    from multiprocessing import forkserver, resource_tracker

    server, tracker = forkserver._forkserver, resource_tracker._resource_tracker
    for owner, attribute in ((server, "_forkserver_alive_fd"), (tracker, "_fd")):
        fd = getattr(owner, attribute, None)
        if isinstance(fd, int):
            with contextlib.suppress(OSError):
                os.close(fd)
            setattr(owner, attribute, None)


def _worker_entry(settings_json: bytes, url: str, environ: dict[str, str], log_path: str) -> None:
    """A worker child: own process group, dies with the fork server, logs to its file, runs the worker."""
    os.setpgid(0, 0)
    die_with_parent(signal.SIGKILL)
    _release_fork_server_pipes()
    os.environ.update(environ)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import msgspec

    from liver.shared.logs import configure_logging
    from liver.worker_runtime.worker_main import WorkerSettings, exit_now, run

    configure_logging()
    settings = msgspec.json.decode(settings_json, type=WorkerSettings)
    exit_now(run(settings, url, environ))


@dataclass
class DemoProcess:
    """One process the demo started."""

    name: str
    kind: Kind
    pid: int
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    process: mp.process.BaseProcess | None = None
    stopped: bool = False

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        assert self.process is not None
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        if self.popen is not None:
            return self.popen.poll()
        assert self.process is not None
        return self.process.exitcode

    def signal_group(self, sig: int) -> None:
        """``sig`` to the process's group (it leads one), or to it alone if the group is gone."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def wait(self, timeout_s: float) -> bool:
        """Whether it exited within ``timeout_s``."""
        if self.popen is not None:
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        assert self.process is not None
        self.process.join(timeout_s)
        return not self.process.is_alive()


@dataclass
class ProcessBook:
    """Starts the demo's processes and stops every one of them (see the module docstring)."""

    log_dir: Path
    environ: Mapping[str, str]
    """The environment of every child (the demo's, plus bus settings and :data:`MARK_ENV`)."""
    started: list[DemoProcess] = field(default_factory=list)
    _preloaded: bool = False

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if MARK_ENV not in self.environ:
            raise ValueError(f"`environ`: must carry {MARK_ENV} so that leftovers can be found")

    def start_service(self, name: str, extra_env: Mapping[str, str] | None = None) -> DemoProcess:
        log_path = self.log_dir / f"service-{name}.log"
        env = {**self.environ, **(extra_env or {})}
        with log_path.open("ab") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "liver.cli.serve_cmd", name],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_service_preexec,
            )
        entry = DemoProcess(name=name, kind="service", pid=popen.pid, log_path=log_path, popen=popen)
        self.started.append(entry)
        log.info("demo.service_started", service=name, pid=popen.pid)
        return entry

    def start_worker(self, name: str, settings_json: bytes, url: str) -> DemoProcess:
        """Fork a worker from the preloaded fork server (the first call waits for the preload)."""
        if not self._preloaded:
            _ctx.set_forkserver_preload(PRELOAD)
            self._preloaded = True
        log_path = self.log_dir / f"{name}.log"
        process = _ctx.Process(
            target=_worker_entry,
            args=(settings_json, url, dict(self.environ), str(log_path)),
            name=name,
            daemon=False,
        )
        process.start()
        assert process.pid is not None
        entry = DemoProcess(name=name, kind="worker", pid=process.pid, log_path=log_path, process=process)
        self.started.append(entry)
        log.info("demo.worker_started", worker=name, pid=process.pid)
        return entry

    def workers(self) -> list[DemoProcess]:
        return [p for p in self.started if p.kind == "worker"]

    def services(self) -> list[DemoProcess]:
        return [p for p in self.started if p.kind == "service"]

    def stop(self, entries: list[DemoProcess], grace_s: float, sig: int = signal.SIGTERM) -> None:
        """``sig`` to each live entry's group, then SIGKILL to those still alive after ``grace_s``."""
        live = [p for p in entries if p.alive()]
        for p in live:
            p.signal_group(sig)
        end = time.monotonic() + grace_s
        for p in live:
            if not p.wait(max(end - time.monotonic(), 0.0)):
                log.warning("demo.kill", process=p.name, pid=p.pid, after_s=grace_s)
                p.signal_group(signal.SIGKILL)
                p.wait(5.0)
        for p in entries:
            p.stopped = True

    def stop_all(self, grace_s: float = 10.0, *, fork_server: bool = True) -> None:
        """Workers first, then services, then (``fork_server``) the fork server and its resource
        tracker; nothing the book started is alive after. A long-lived process that forks children
        of its own from the same fork server (a test session) keeps it with ``fork_server=False``."""
        self.stop(self.workers(), grace_s)
        self.stop(self.services(), grace_s)
        if self._preloaded and fork_server:
            stop_fork_server()


def stop_fork_server() -> None:
    """Stop this process's multiprocessing fork server, and the resource tracker it started, now
    instead of at interpreter exit.

    Uses the standard library's own (private, test-only) stop hooks when they exist; without them both
    still exit when this process does, since their liveness pipes close then.
    """
    from multiprocessing import forkserver, resource_tracker

    for owner in (forkserver._forkserver, resource_tracker._resource_tracker):
        stop = getattr(owner, "_stop", None)
        if callable(stop):
            with contextlib.suppress(OSError, ChildProcessError):
                stop()


def leftovers(mark: str) -> list[int]:
    """Pids of live processes whose environment carries ``MARK_ENV=mark``, except this process and its
    ancestors (which may carry the mark because they gave it to us) and zombies."""
    import psutil

    found = []
    needle = f"{MARK_ENV}={mark}".encode()
    me = psutil.Process()
    exempt = {me.pid, *(p.pid for p in me.parents())}
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid in exempt:
            continue
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(proc.pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found
