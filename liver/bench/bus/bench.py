"""``liver bench bus``: the control plane's latency from a resize event to the switch and to the commit.

An embedded nats-server, the four services each in a process of its own (``liver serve ingester``,
``topology``, ``transfer``, ``coordinator``, as deployed: no service waits on another's Python code or
on the simulated workers), and a stand-in job whose workers acknowledge at once (the code behind
``liver workers --simulate``, ``--workers-per-process`` workers per process). For each job size the
bench publishes events one at a time that keep the job resizing: a spot warning for the last node
(scale-in), then a scale request that brings the node back (scale-out, with fresh worker processes on
it), and so on. The first ``--warmup`` events are not counted (the first one replans the job from the
TP1 x PP1 x DP-N world the bench announces, and every process warms its caches).

Per event, from the moment the event is published (:mod:`.observer`):

- **switch**: the Switch broadcast received by a subscriber of the job's command subject;
- **commit**: ``generation.committed`` received;
- **planning**: the topology chooser's time plus the transfer planner's plan, verification and
  encoding, as the services log them (:mod:`.rig`);
- **worker CPU**: CPU time of the stand-in job's processes over the same interval, less their idle
  rate (heartbeats) measured just before the event;
- **bus overhead** = latency - planning - worker CPU: what the bus and the services' own handling
  (decoding, the state machine, JetStream round trips, object-store traffic, and the transfer
  service's work it does not time) add;
- the time each stage's message appeared and every process's CPU time in each stage, and the messages
  and payload bytes the server received from and delivered to the services and workers (``/connz``,
  heartbeats subtracted).

The handoff's Prepare (one job-wide broadcast carrying both placements once) and one worker's plan
slice (its tasks only: the worlds come from the Prepare) are also timed on their own (``contract``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from liver.bench.bus import rig
from liver.bench.bus.observer import BusObserver, Timeline
from liver.bench.bus.report import (
    STAGE_GAPS,
    BusBenchReport,
    BusEventRecord,
    ContractReport,
    SizeReport,
    Stat,
    checks_for,
    gap,
    print_report,
    stat,
)
from liver.bench.report import emit, load_average, machine, progress, utc_now
from liver.reshard.plan import SliceFile
from liver.services.coordinator.service import CONFIG_ENV as COORDINATOR_CONFIG_ENV
from liver.services.coordinator.service import INSTANCE_ENV, JOB_ENV
from liver.services.host import status_subject
from liver.services.topology.settings import CONFIG_ENV as TOPOLOGY_CONFIG_ENV
from liver.services.transfer.core import plan_transfer
from liver.services.transfer.service import TransferSettings
from liver.shared import subjects as s
from liver.shared.codec import decode, encode
from liver.shared.layout import ParallelLayout, Placement
from liver.shared.logs import configure_logging
from liver.shared.messages import (
    JobMembership,
    NodeDevices,
    Prepare,
    ScaleRequest,
    SpotWarning,
    TopologyPlanned,
    TransferPlanned,
    WorkerCommand,
    WorldStarted,
)
from liver.shared.model import PRESETS
from liver.shared.nats_server import NatsServer
from liver.worker_runtime.companion.simulated import SimSettings
from liver.worker_runtime.companion.slices import PlanFetcher, PlanFetchError, decode_slice

DEFAULT_WORKERS: Final = (64, 1024)
DEFAULT_EVENTS: Final = (100, 20)
"""Counted events of a job of up to ``LARGE_JOB`` workers, and of a larger one."""
LARGE_JOB: Final = 256
QUICK_WORKERS: Final = (8, 16)
QUICK_EVENTS: Final = 2
QUICK_DEVICES_PER_NODE: Final = 4
IDLE_WINDOW_S: Final = 0.5
"""How long the simulated job's idle CPU rate is measured before each event."""
HEARTBEAT_TIMEOUT_S: Final = 60.0
"""The coordinator's (or five heartbeat periods, if longer). A stand-in job's thousand workers share
one process, and while it decodes their Prepares (an O(N) message each) their heartbeats wait behind
it for many seconds, which one real worker's do not: the production default (10 s) would have the
coordinator declare simulated workers lost. Only liveness is affected: no message on a handoff's path
waits on it."""
FROZEN_ITERATION_S: Final = 1e6
"""The stand-in job's iteration never advances: every simulated process fixes the switch's cut at the
iteration it has reached, and processes that count on their own would disagree (the coordinator logs
that as an error). Nothing the bench measures depends on the iteration."""
DEFAULT_WORKERS_PER_PROCESS: Final = 1024
"""One process for a job of up to a thousand workers: its CPU time is then spent one worker after
another, so subtracting it from the latency removes the simulation's serial work and nothing more.
Several processes on several cores shorten the simulated latencies but overlap their CPU time, and the
subtraction would then count that time more than once."""
READY_TIMEOUT_S: Final = 180.0
SETTLE_TIMEOUT_S: Final = 600.0
RELEASE_WAIT_S: Final = 180.0

# -- arguments ----------------------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers separated by commas") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one number")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``liver bench bus``."""
    parser.add_argument(
        "--workers",
        type=_int_list,
        metavar="N,N,...",
        help=f"job sizes in workers (default {','.join(map(str, DEFAULT_WORKERS))})",
    )
    parser.add_argument(
        "--events",
        type=_int_list,
        metavar="E[,E,...]",
        help="counted events per size: one number for every size or one per size (default "
        f"{DEFAULT_EVENTS[0]} up to {LARGE_JOB} workers, {DEFAULT_EVENTS[1]} above)",
    )
    parser.add_argument(
        "--warmup", type=int, help="events run before counting, per size (default 2: one of each kind)"
    )
    parser.add_argument(
        "--devices-per-node", type=int, help="devices per node: what a spot warning removes (default 8)"
    )
    parser.add_argument(
        "--workers-per-process",
        type=int,
        default=DEFAULT_WORKERS_PER_PROCESS,
        help=f"simulated workers per process, whole nodes (default {DEFAULT_WORKERS_PER_PROCESS}: "
        "see the bus overhead's definition)",
    )
    parser.add_argument(
        "--model",
        default="tiny-gpt",
        choices=sorted(PRESETS),
        help="the job's model for the planners (default tiny-gpt: planning is reported apart from the bus)",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=2.0,
        help="the stand-in workers' heartbeat period (default 2, the companion's)",
    )
    parser.add_argument(
        "--notice-s", type=float, default=120.0, help="notice of each spot warning (default 120)"
    )
    parser.add_argument(
        "--event-timeout", type=float, default=300.0, help="seconds before an event counts as lost"
    )
    parser.add_argument(
        "--log-dir", type=Path, help="keep the services' and workers' logs here (default: a temporary folder)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny jobs, two events each: what CI runs")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


class BusBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    sizes: tuple[int, ...]
    events: tuple[int, ...]
    warmup: int
    devices_per_node: int
    workers_per_process: int
    heartbeat_s: float
    model: str
    notice_s: float
    event_timeout_s: float
    quick: bool


def default_events(workers: int) -> int:
    """Events per size when ``--events`` is not given: many for a small job, fewer for a large one,
    whose events each take seconds of planning and of the simulated workers' decoding."""
    return DEFAULT_EVENTS[0] if workers <= LARGE_JOB else DEFAULT_EVENTS[1]


def config_from(args: argparse.Namespace) -> BusBenchConfig:
    """The run the arguments describe; every bad value is a ``ValueError`` naming its option."""
    sizes = args.workers or (QUICK_WORKERS if args.quick else DEFAULT_WORKERS)
    per_node = args.devices_per_node or (QUICK_DEVICES_PER_NODE if args.quick else 8)
    warmup = 2 if args.warmup is None else args.warmup
    if per_node < 1:
        raise ValueError(f"--devices-per-node: must be at least 1, got {per_node}")
    for n in sizes:
        if n % per_node or n < 2 * per_node:
            raise ValueError(
                f"--workers: {n} is not whole nodes of {per_node} devices, at least two of them "
                "(a spot warning takes one node away)"
            )
    if args.events is None:
        events = tuple(QUICK_EVENTS if args.quick else default_events(n) for n in sizes)
    else:
        events = args.events * len(sizes) if len(args.events) == 1 else args.events
    if len(events) != len(sizes):
        raise ValueError(f"--events: give one number or one per size ({len(sizes)}), got {len(events)}")
    if any(e < 1 for e in events):
        raise ValueError(f"--events: every count must be at least 1, got {list(events)}")
    if warmup < 0:
        raise ValueError(f"--warmup: must not be negative, got {warmup}")
    if args.workers_per_process < 1:
        raise ValueError(f"--workers-per-process: must be at least 1, got {args.workers_per_process}")
    if not args.heartbeat_s > 0:
        raise ValueError(f"--heartbeat-s: must be positive, got {args.heartbeat_s}")
    if not args.notice_s > 0:
        raise ValueError(f"--notice-s: must be positive, got {args.notice_s}")
    if not args.event_timeout > 0:
        raise ValueError(f"--event-timeout: must be positive, got {args.event_timeout}")
    return BusBenchConfig(
        sizes=tuple(sizes),
        events=tuple(events),
        warmup=warmup,
        devices_per_node=per_node,
        workers_per_process=args.workers_per_process,
        heartbeat_s=args.heartbeat_s,
        model=args.model,
        notice_s=args.notice_s,
        event_timeout_s=args.event_timeout,
        quick=args.quick,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every event of every size committed."""
    config = config_from(args)
    configure_logging(level="WARNING")  # stderr: stdout carries the report alone
    load_before = load_average()
    with (
        rig.log_directory(args.log_dir, "liver-bench-bus-") as logs,
        NatsServer(log_file=logs / "nats-server.log") as server,
    ):
        sizes, version = asyncio.run(_bench(config, server, logs))
    checks = [c for r in sizes for c in checks_for(r)]
    report = BusBenchReport(
        quick=config.quick,
        date=utc_now(),
        python=platform.python_version(),
        nats_server=version,
        machine=machine(),
        cpus=os.cpu_count() or 1,
        load_average=(load_before, load_average()),
        services="each service in a process of its own (liver serve); the stand-in job in processes "
        "of its own",
        sizes=sizes,
        checks=checks,
        ok=all(r.all_committed for r in sizes),
    )
    emit(report, args.json, print_report)
    return 0 if report.ok else 1


def _progress(text: str) -> None:
    progress("bus", text)


# -- the run ------------------------------------------------------------------------------------------------


def _hardware(model: str) -> str:
    """The planners' hardware profile: the tiny models are CPU-sized, the others H100-sized."""
    return "cpu-small" if model.startswith("tiny-") else "h100-80gb"


def _global_batch(workers: int, per_node: int) -> int:
    """A batch every data-parallel size of both worlds divides, so the planner can use every device."""
    return math.lcm(workers, workers - per_node)


async def _bench(config: BusBenchConfig, server: NatsServer, tmp: Path) -> tuple[list[SizeReport], str]:
    env = rig.child_environment(server.url)
    jobs = {
        _job(n): {
            "model": config.model,
            "hardware": _hardware(config.model),
            "setup": {
                "global_batch_size": _global_batch(n, config.devices_per_node),
                "sequence_length": PRESETS[config.model].max_sequence_length,
            },
        }
        for n in config.sizes
    }
    topology_config = tmp / "topology.json"
    topology_config.write_bytes(msgspec.json.encode({"jobs": jobs}))
    control = await nats.connect(server.url, name=f"{rig.BENCH_CLIENT_PREFIX}-control")
    watch = await nats.connect(server.url, name=f"{rig.BENCH_CLIENT_PREFIX}-observer")
    shared: dict[str, rig.Child] = {}
    try:
        _progress("starting the ingester, topology and transfer services")
        for name in ("ingester", "topology", "transfer"):
            child_env = {**env, TOPOLOGY_CONFIG_ENV: str(topology_config)} if name == "topology" else env
            shared[name] = rig.spawn(name, rig.service_argv(name), child_env, tmp)
        for name, child in shared.items():
            await rig.wait_ready(control, child, name, READY_TIMEOUT_S)
        reports = []
        for n, events in zip(config.sizes, config.events, strict=True):
            size = SizeRun(config, n, events, server, control, watch, env, tmp, shared)
            reports.append(await size.run())
        return reports, rig.server_version(server.monitor_url)
    finally:
        for child in shared.values():
            child.stop()
        await watch.close()
        with contextlib.suppress(Exception):
            await control.drain()


def _job(workers: int) -> str:
    return f"bus-{workers}"


class SizeRun:
    """The events of one job size, from starting its coordinator and workers to stopping them."""

    def __init__(
        self,
        config: BusBenchConfig,
        workers: int,
        events: int,
        server: NatsServer,
        control: Client,
        watch: Client,
        env: dict[str, str],
        tmp: Path,
        shared: dict[str, rig.Child],
    ) -> None:
        self.config = config
        self.n = workers
        self.k = config.devices_per_node
        self.events = events
        self.server = server
        self.nc = control
        self.js: JetStreamContext = control.jetstream()
        self.watch = watch
        self.env = env
        self.tmp = tmp
        self.shared = shared
        self.job = _job(workers)
        devices = SimSettings(job_id=self.job, workers=workers, devices_per_node=self.k).devices()
        self.devices = devices
        nodes = list(dict.fromkeys(d.node for d in devices))
        per_process = max(config.workers_per_process // self.k, 1)
        self.main = [self._sim(nodes[i : i + per_process], "w") for i in range(0, len(nodes), per_process)]
        """The stand-in job, whole nodes per process. Its workers start in no world (``generation``
        ``None``) and the bench announces the first world as a launcher does: a simulated process
        numbers its ranks from 0, so only the announced placement gives every worker its global rank,
        which each worker takes from the first Prepare it switches with."""
        identities = [i for settings in self.main for i in settings.identities()]
        self.probe = identities[0]
        self.node = nodes[-1]
        """The node every spot warning reclaims and every scale request brings back."""
        self.children: dict[str, rig.Child] = {}
        self.status_requests = 0
        self.incarnation = 0
        self.released: set[object] = set()

    # -- processes --------------------------------------------------------------------------------------

    def pids(self) -> dict[str, int]:
        out = {"nats-server": self.server.pid or 0}
        out.update({name: child.pid for name, child in self.shared.items()})
        out.update({name: child.pid for name, child in self.children.items()})
        return out

    def sample(self) -> dict[str, float | None]:
        return rig.cpu_of(self.pids())

    def _worker_processes(self) -> list[str]:
        return [name for name in self.children if name.startswith(("workers", "spares"))]

    def _sim(self, nodes: Sequence[str], prefix: str) -> SimSettings:
        return SimSettings(
            job_id=self.job,
            workers=len(nodes) * self.k,
            nodes=tuple(nodes),
            devices_per_node=self.k,
            generation=None,
            worker_prefix=prefix,
            fetch_timeout_s=self.config.notice_s,
            iteration_s=FROZEN_ITERATION_S,
            heartbeat_s=self.config.heartbeat_s,
        )

    def _spawn_workers(self, name: str, settings: SimSettings) -> None:
        argv = rig.workers_argv(msgspec.json.encode(settings))
        self.children[name] = rig.spawn(f"{name}-{self.n}", argv, self.env, self.tmp)

    async def run(self) -> SizeReport:
        _progress(f"{self.n} workers: starting the coordinator and the simulated job")
        settings = self.tmp / f"coordinator-{self.n}.json"
        timeout = max(HEARTBEAT_TIMEOUT_S, 5 * self.config.heartbeat_s)
        settings.write_bytes(msgspec.json.encode({"core": {"heartbeat_timeout_s": timeout}}))
        env = {
            **self.env,
            JOB_ENV: self.job,
            INSTANCE_ENV: f"bench-{self.n}",
            COORDINATOR_CONFIG_ENV: str(settings),
        }
        self.children["coordinator"] = rig.spawn(
            f"coordinator-{self.n}", rig.service_argv("coordinator"), env, self.tmp
        )
        self.coordinator_log = rig.LogFollower(self.children["coordinator"].log_path)
        observer = BusObserver(self.watch, self.job, self.probe.worker_id, self.sample)
        await observer.start()
        records: list[BusEventRecord] = []
        contract: ContractReport | None = None
        # The Prepare and slice are captured during the last warm-up event, where the bench's own reads
        # cannot disturb a counted one.
        capture_at = max(self.config.warmup - 1, 0)
        try:
            await rig.wait_ready(self.nc, self.children["coordinator"], "coordinator", READY_TIMEOUT_S)
            for i, settings in enumerate(self.main):
                self._spawn_workers(f"workers-{i}", settings)
            hellos = {i.worker_id for settings in self.main for i in settings.identities()}
            await observer.wait_hellos(hellos, READY_TIMEOUT_S)
            world = WorldStarted(
                job_id=self.job,
                generation=0,
                layout=ParallelLayout(tp=1, pp=1, dp=self.n),
                placement=Placement(self.devices),
            )
            await self.js.publish(s.world_started(self.job), encode(world))
            await self._membership(generation=0, count=self.n)
            devices = self.n
            for index in range(self.config.warmup + self.events):
                record, timeline, piece = await self._event(observer, index, devices, index == capture_at)
                records.append(record)
                if index == capture_at and record.outcome == "committed":
                    contract = self._contract(timeline, piece)
                _progress(
                    f"{self.n} workers: event {index + 1}/{self.config.warmup + self.events} "
                    f"{record.kind} {record.outcome}"
                    + (f" in {record.commit_ms:,.1f} ms" if record.commit_ms is not None else "")
                )
                if record.outcome != "committed":
                    break
                devices = record.devices_after or devices
        finally:
            for child in self.children.values():
                child.stop()
            self.children.clear()
            await observer.stop()
        planning = rig.planning_times(c.log_path for c in (self.shared["topology"], self.shared["transfer"]))
        for record in records:
            _finish(record, planning.get((self.job, record.event_id)))
        return self._report(records, contract)

    # -- one event ----------------------------------------------------------------------------------------

    async def _event(
        self, observer: BusObserver, index: int, devices: int, capture: bool
    ) -> tuple[BusEventRecord, Timeline, bytes | None]:
        scale_in = index % 2 == 0
        kind = "scale_in" if scale_in else "scale_out"
        event_id = f"{kind.replace('_', '-')}-{index:04d}"
        if not scale_in:
            await self._node_returns(observer)
        workers = self._worker_processes()
        idle0, started = self.sample(), time.perf_counter()
        await asyncio.sleep(IDLE_WINDOW_S)
        idle = rig.cpu_delta(idle0, self.sample())
        window = time.perf_counter() - started
        idle_rate = sum(idle.get(w, 0.0) for w in workers) / window
        conns_before = await asyncio.to_thread(rig.connections, self.server.monitor_url)
        beats, beat_bytes, polls = observer.heartbeats, observer.heartbeat_bytes, self.status_requests
        cpu0 = self.sample()
        timeline = observer.arm(event_id)
        if scale_in:
            message: SpotWarning | ScaleRequest = SpotWarning(
                job_id=self.job,
                event_id=event_id,
                node=self.node,
                provider="bench",
                notice_s=self.config.notice_s,
            )
            subject = s.SPOT_WARNING
        else:
            message = ScaleRequest(
                job_id=self.job,
                event_id=event_id,
                reason="the reclaimed node is back",
                add=(NodeDevices(node=self.node, devices=tuple(range(self.k))),),
            )
            subject = s.SCALE_REQUEST
        await self.js.publish(subject, encode(message), headers={s.HEADER_MSG_ID: f"{self.job}-{event_id}"})
        reading = asyncio.create_task(self._capture_slice(timeline)) if capture else None
        record = BusEventRecord(
            index=index,
            event_id=event_id,
            kind=kind,
            warmup=index < self.config.warmup,
            outcome="timeout",
            devices_before=devices,
        )
        try:
            await asyncio.wait_for(timeline.done.wait(), self.config.event_timeout_s)
        except TimeoutError:
            record.reason = f"no outcome within {self.config.event_timeout_s} s"
        piece = None
        if reading is not None:
            if not reading.done():
                reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, PlanFetchError):
                piece = await reading
        if record.reason:
            return record, timeline, piece
        record.idle_cpu_share = {p: v / 1e3 / window for p, v in _grouped(idle).items()}
        _timings(record, timeline, cpu0, workers, idle_rate)
        if timeline.aborted is not None:
            record.outcome, record.reason = "aborted", timeline.aborted.reason
            return record, timeline, piece
        committed = timeline.committed
        assert committed is not None
        expected = devices - self.k if scale_in else devices + self.k
        record.devices_after = len(committed.placement)
        record.generation = committed.generation
        record.layout_after = committed.layout.describe()
        if record.devices_after != expected:
            record.outcome = "committed_short"
            record.reason = (
                f"the planner used {record.devices_after} of {expected} devices: the idle ones' workers "
                "leave, and the job would shrink; choose another --model"
            )
            return record, timeline, piece
        record.outcome = "committed"
        conns_commit = await asyncio.to_thread(rig.connections, self.server.monitor_url)
        at_commit = (observer.heartbeats, observer.heartbeat_bytes, self.status_requests)
        await self._settle(committed.generation, expected, left=self.node if scale_in else None)
        conns_after = await asyncio.to_thread(rig.connections, self.server.monitor_url)
        # Each heartbeat is published once and delivered once (to the coordinator); each status request
        # of the bench is delivered to the coordinator, which publishes the reply.
        start = (beats, beat_bytes, polls)
        record.heartbeats = observer.heartbeats - beats
        record.messages_in, record.messages_out, record.bytes_in, record.bytes_out = _net(
            rig.traffic_between(conns_before, conns_commit, rig.BENCH_CLIENT_PREFIX), start, at_commit
        )
        end = (observer.heartbeats, observer.heartbeat_bytes, self.status_requests)
        totals = _net(rig.traffic_between(conns_before, conns_after, rig.BENCH_CLIENT_PREFIX), start, end)
        record.messages_in_total, record.messages_out_total, record.bytes_in_total, record.bytes_out_total = (
            totals
        )
        if "transfer_planned" in timeline.raw:
            planned = decode(timeline.raw["transfer_planned"], TransferPlanned)
            sizes = [w.ref.size for w in planned.workers]
            record.slice_bytes_total, record.slice_bytes_max = sum(sizes), max(sizes, default=0)
        return record, timeline, piece

    async def _node_returns(self, observer: BusObserver) -> None:
        """Fresh worker processes on the reclaimed node say hello, as after a node comes back; the
        coordinator must count them before the scale request arrives."""
        self.incarnation += 1
        settings = self._sim([self.node], f"r{self.incarnation}")
        self._spawn_workers("spares", settings)
        await observer.wait_hellos({i.worker_id for i in settings.identities()}, READY_TIMEOUT_S)

        async def counted() -> bool:
            return (await self._status()).get("workers") == self.n

        await _until(counted, SETTLE_TIMEOUT_S, f"the coordinator counts {self.n} workers")

    async def _settle(self, generation: int, devices: int, left: str | None) -> None:
        """Wait until the commit's aftermath is over: the membership the ingester reads names the new
        world, the coordinator is stable again, and the workers of a reclaimed node have gone."""
        await self._membership(generation, devices)

        async def stable() -> bool:
            return (await self._status()).get("phase") == "stable"

        await _until(stable, SETTLE_TIMEOUT_S, "the coordinator is stable")

        async def released() -> bool:
            for entry in self.coordinator_log.entries():
                if entry.get("event") in ("plan_released", "plan_release_failed"):
                    self.released.add(entry.get("generation"))
            return generation in self.released

        # The release runs after the commit on the coordinator's loop; the next event must not queue
        # behind it. The coordinator skips it silently when the plan store cannot be listed, so a
        # release that never reports is waited for a while only.
        try:
            await _until(released, RELEASE_WAIT_S, "the plan released")
        except rig.RigError:
            _progress(f"{self.n} workers: no plan release reported for generation {generation}")
        if left is not None and "spares" in self.children:
            self.children.pop("spares").stop()

    async def _status(self) -> dict[str, Any]:
        """The coordinator's status; empty while it is too busy to answer (a large job's aftermath)."""
        self.status_requests += 1
        try:
            reply = await self.nc.request(status_subject("coordinator"), b"", timeout=5.0)
        except nats.errors.TimeoutError:
            return {}
        return msgspec.json.decode(reply.data)  # type: ignore[no-any-return]

    async def _membership(self, generation: int, count: int) -> None:
        kv = None

        async def published() -> bool:
            nonlocal kv
            try:
                kv = kv or await self.js.key_value(s.KV_MEMBERSHIP)
                entry = await kv.get(self.job)
            except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError):
                return False
            members = decode(entry.value or b"", JobMembership)
            return members.generation == generation and len(members.workers) == count

        await _until(published, SETTLE_TIMEOUT_S, f"membership of generation {generation} ({count} workers)")

    # -- the contract's cost --------------------------------------------------------------------------------

    async def _capture_slice(self, timeline: Timeline) -> bytes | None:
        """The probe worker's plan slice, read as soon as the plan is announced (the coordinator has the
        plan's objects deleted once the handoff ends)."""
        await timeline.planned.wait()
        planned = decode(timeline.raw["transfer_planned"], TransferPlanned)
        i = next((i for i, w in enumerate(planned.workers) if w.device == self.probe.device), None)
        return None if i is None else await PlanFetcher(self.js).fetch_slice(planned.slices.location(i), 60.0)

    def _contract(self, timeline: Timeline, piece_bytes: bytes | None) -> ContractReport | None:
        data = timeline.raw.get("prepare")
        planned_raw = timeline.raw.get("transfer_planned")
        if data is None or planned_raw is None or piece_bytes is None:
            return None
        prepare = decode(data, WorkerCommand)
        planned = decode(planned_raw, TransferPlanned)
        if not isinstance(prepare, Prepare) or prepare.generation != planned.generation:
            return None
        device = self.probe.device
        piece = msgspec.json.decode(piece_bytes, type=SliceFile)
        participants = len(planned.workers)
        reps = max(5, min(200, 20_000 // self.n))
        encode_s = _median_time(lambda: encode(prepare), reps)
        decode_s = _median_time(lambda: decode(data, WorkerCommand), reps)
        slice_s = _median_time(lambda: decode_slice(piece_bytes, prepare, device), reps)
        unreported = None
        if "topology_planned" in timeline.raw:
            topology = decode(timeline.raw["topology_planned"], TopologyPlanned)
            t0 = time.perf_counter()
            again = plan_transfer(topology, budget_bytes=TransferSettings().budget_bytes)
            wall = time.perf_counter() - t0
            timed = again.summary.plan_seconds + again.verify_seconds + again.encode_seconds
            unreported = (wall - timed) * 1e3
        placements = msgspec.json.encode(prepare.from_placement), msgspec.json.encode(prepare.placement)
        return ContractReport(
            participants=participants,
            prepare_bytes=len(data),
            prepare_placement_bytes=sum(map(len, placements)),
            prepare_plan_ref_bytes=len(msgspec.json.encode(prepare.slices)),
            prepare_encode_ms=encode_s * 1e3,
            prepare_decode_ms=decode_s * 1e3,
            prepare_bytes_per_event=len(data),
            coordinator_encode_ms_per_event=encode_s * 1e3,
            sim_prepare_decode_ms_per_event=decode_s * 1e3,
            broadcast_prepare_bytes=len(data),
            slice_bytes=len(piece_bytes),
            slice_world_bytes=0,
            slice_tasks=len(piece.tasks),
            slice_decode_ms=slice_s * 1e3,
            slice_bytes_per_event=sum(w.ref.size for w in planned.workers),
            sim_slice_decode_ms_per_event=slice_s * 1e3 * participants,
            transfer_unreported_ms=unreported,
        )

    # -- the size's report ----------------------------------------------------------------------------------

    def _report(self, records: list[BusEventRecord], contract: ContractReport | None) -> SizeReport:
        counted = [r for r in records if not r.warmup and r.outcome == "committed"]

        def of(field: str) -> Stat | None:
            return stat(getattr(r, field) for r in counted)

        stages = {
            name: st for name, *_ in STAGE_GAPS if (st := stat(gap(r, name) for r in counted)) is not None
        }
        processes = sorted({p for r in counted for p in r.process_cpu_ms})
        layouts = {r.kind: r.layout_after for r in counted if r.layout_after is not None}
        return SizeReport(
            workers=self.n,
            devices_per_node=self.k,
            worker_processes=len(self.main),
            heartbeat_s=self.config.heartbeat_s,
            job_id=self.job,
            model=self.config.model,
            hardware=_hardware(self.config.model),
            global_batch_size=_global_batch(self.n, self.k),
            layouts=layouts,
            events=sum(not r.warmup for r in records),
            warmup=sum(r.warmup for r in records),
            committed=len(counted),
            all_committed=len(records) == self.config.warmup + self.events
            and all(r.outcome == "committed" for r in records),
            switch_ms=of("switch_ms"),
            commit_ms=of("commit_ms"),
            planning_ms=of("planning_ms"),
            topology_planning_ms=of("topology_planning_ms"),
            transfer_planning_ms=stat(_transfer_planning(r) for r in counted),
            worker_cpu_switch_ms=of("worker_cpu_switch_ms"),
            worker_cpu_commit_ms=of("worker_cpu_commit_ms"),
            bus_overhead_switch_ms=of("bus_overhead_switch_ms"),
            bus_overhead_commit_ms=of("bus_overhead_commit_ms"),
            stages_ms=stages,
            stage_cpu_ms={
                name: {
                    p: statistics.median(v)
                    for p in processes
                    if (v := [r.stage_cpu_ms[name][p] for r in counted if p in r.stage_cpu_ms.get(name, {})])
                }
                for name, *_ in STAGE_GAPS
            },
            process_cpu_ms={
                p: st for p in processes if (st := stat(r.process_cpu_ms.get(p) for r in counted)) is not None
            },
            idle_cpu_share={
                p: statistics.median(v)
                for p in sorted({p for r in counted for p in r.idle_cpu_share})
                if (v := [r.idle_cpu_share[p] for r in counted if p in r.idle_cpu_share])
            },
            messages_in=of("messages_in"),
            messages_out=of("messages_out"),
            bytes_in=of("bytes_in"),
            bytes_out=of("bytes_out"),
            messages_in_total=of("messages_in_total"),
            messages_out_total=of("messages_out_total"),
            contract=contract,
            records=records,
        )


def _timings(
    record: BusEventRecord,
    timeline: Timeline,
    cpu0: dict[str, float | None],
    workers: list[str],
    idle_rate: float,
) -> None:
    """Fill in the event's latencies, the processes' CPU time and the workers' share of it."""
    t0 = timeline.published_at
    record.arrivals_ms = {k: (v - t0) * 1e3 for k, v in timeline.arrivals.items()}
    record.switch_ms = record.arrivals_ms.get("switch")
    record.commit_ms = record.arrivals_ms.get("outcome") if timeline.committed is not None else None
    record.worker_idle_cpu_ms_per_s = idle_rate * 1e3
    end = timeline.cpu.get("outcome")
    if end is not None:
        record.process_cpu_ms = _grouped(rig.cpu_delta(cpu0, end))
    samples = {"published": cpu0, **timeline.cpu}
    for name, start, stop in STAGE_GAPS:
        a, b = samples.get(start or "published"), samples.get(stop)
        if a is not None and b is not None:
            record.stage_cpu_ms[name] = _grouped(rig.cpu_delta(a, b))
    for point, field in (("switch", "worker_cpu_switch_ms"), ("outcome", "worker_cpu_commit_ms")):
        sample, at = timeline.cpu.get(point), timeline.arrivals.get(point)
        if sample is None or at is None:
            continue
        used = rig.cpu_delta(cpu0, sample)
        if not all(w in used for w in workers):
            continue  # no /proc here: the workers' share cannot be told apart
        busy = sum(used[w] for w in workers) - idle_rate * (at - t0)
        setattr(record, field, max(busy, 0.0) * 1e3)


def _grouped(seconds: dict[str, float]) -> dict[str, float]:
    """Milliseconds per process, the stand-in job's processes (``workers-<i>``) added up as ``workers``."""
    out: dict[str, float] = {}
    for name, value in seconds.items():
        key = "workers" if name.startswith("workers-") else name
        out[key] = out.get(key, 0.0) + value * 1e3
    return out


def _net(traffic: rig.Traffic, start: tuple[int, int, int], end: tuple[int, int, int]) -> tuple[int, ...]:
    """Messages in and out, bytes in and out, less the heartbeats and the bench's status requests."""
    beats, beat_bytes, polls = (b - a for a, b in zip(start, end, strict=True))
    return (
        traffic.in_msgs - beats - polls,
        traffic.out_msgs - beats - polls,
        traffic.in_bytes - beat_bytes,
        traffic.out_bytes - beat_bytes,
    )


def _finish(record: BusEventRecord, planning: rig.Planning | None) -> None:
    """Add the planners' reported times and derive the bus overhead (see the module docstring)."""
    if planning is None:
        return
    record.topology_planning_ms = None if planning.topology_s is None else planning.topology_s * 1e3
    for name in ("plan", "verify", "encode"):
        value = getattr(planning, f"transfer_{name}_s")
        setattr(record, f"transfer_{name}_ms", None if value is None else value * 1e3)
    transfer = _transfer_planning(record)
    if record.topology_planning_ms is None or transfer is None:
        return
    record.planning_ms = record.topology_planning_ms + transfer
    for latency, cpu, field in (
        ("switch_ms", "worker_cpu_switch_ms", "bus_overhead_switch_ms"),
        ("commit_ms", "worker_cpu_commit_ms", "bus_overhead_commit_ms"),
    ):
        total, workers = getattr(record, latency), getattr(record, cpu)
        if total is not None and workers is not None:
            setattr(record, field, total - record.planning_ms - workers)


def _transfer_planning(record: BusEventRecord) -> float | None:
    parts = (record.transfer_plan_ms, record.transfer_verify_ms, record.transfer_encode_ms)
    return None if any(p is None for p in parts) else sum(p for p in parts if p is not None)


async def _until(check: Callable[[], Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise rig.RigError(f"not true after {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


def _median_time(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m liver.bench.bus.bench``: the same as ``liver bench bus``."""
    parser = argparse.ArgumentParser(prog="liver bench bus", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"liver bench bus: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
