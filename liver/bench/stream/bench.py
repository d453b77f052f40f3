"""``liver bench stream``: the layer-streaming executor against the raw network, and shadow-world overhead.

Local processes (gloo on loopback) hold a synthetic training state (a GPT-like :class:`ModelSpec`
sized to ``--size-mib``: bf16 parameters, fp32 master weights and both Adam moments) sharded by the
old layout, and reshard it to the new one with :func:`stream_plan` over the handoff's stream group.

What is measured, all in the same run and the same processes:

* **Stream throughput**: bytes moved between processes / the stream's wall time (the slowest process,
  from a common barrier to its return), in two modes: into preallocated new shards (``into=``: the new
  model's storage, already in memory, as the raw exchange's buffers are) and allocating its new shards
  as the executor does by default (first-touch page faults on the clock, a real cost of that path).
* **Raw ceiling**: every pair of processes that exchanges bytes in the plan exchanges the same number of
  bytes as one tensor with one send/recv, all pairs at once, between buffers already in memory; best of
  ``--repeat``. One untimed exchange warms the connections first, and each repeat runs the raw exchange
  and both stream modes in a rotating order, so drift and warm-up favour none of them.
* **Raw + local copies**: the raw exchange again, with each process copying the slices it keeps from
  its old shards into its new ones (the executor's own local copies) on its main thread while the
  messages are in flight. No executor of this plan can do less data movement, so this is the most it
  can reach on the machine; the stream's ratio to it is the executor's own efficiency.
* **Memory**: the executor's own ledger of what it allocated beyond the state (its one buffer for
  staged pieces and send copies, the layer under assembly) against the bound ``B + largest new layer
  shard``, where ``B`` (``--budget-mib``) is the plan's budget, send copies included. As an OS-level
  cross-check, the process's resident-set high-water mark during the stream less the resident set
  before it and the new state.
* **Bit-exactness**: every element's value is a function of its tensor and global index, so each
  process computes the checksum its new shards must have without any other process's data, and
  compares it with the checksum of what it received, for every repeat.
* **Shadow-world overhead**: a training-like loop (matmuls and a gradient all-reduce on the active
  world, ``--loop-steps`` steps) runs alone and while the next generation's groups and the stream group
  are built beside it (``build_world_async`` on a background thread, then the stream group on another);
  segments alternate (alone first, then with first, ...) and the median of the per-pair ratios is
  reported. Mock warm-up is not part of it: only joiners (ranks new to the job) warm up, and a joiner is
  a process of its own that never trains in the active world, so on real machines it shares no core
  with the loop; here, with every process in the active world, there is no joiner to warm up.

This module is the command (its options, the run, the exit code); the synthetic state is in
:mod:`.workload`, each process's measurements in :mod:`.worker` and :mod:`.loop`, the report and its
checks in :mod:`.report`, the tables in :mod:`.printing`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from liver.bench.procs import ProcsError, run_procs
from liver.bench.report import emit, load_average, progress
from liver.bench.stream import worker
from liver.bench.stream.printing import print_report
from liver.bench.stream.report import StreamBenchConfig, build_report
from liver.bench.stream.worker import ProcessResult, Setup
from liver.bench.stream.workload import (
    MIB,
    RESHAPES,
    local_devices,
    message_split,
    pair_bytes,
    reshape_layouts,
    state_bytes,
    synthetic_model,
)
from liver.reshard.plan import WorldConfig
from liver.reshard.planner import build_plan, plan_stats
from liver.shared.geometry import DdpSettings
from liver.shared.layout import Placement
from liver.shared.model import as_geometry, load_model_or_geometry
from liver.worker_runtime.stream.executor import StreamOptions
from liver.worker_runtime.world import host_store

FULL_DEFAULTS = {"size_mib": 1024.0, "budget_mib": 64.0, "repeat": 3, "loop_steps": 100, "loop_repeats": 10}
QUICK_DEFAULTS = {"size_mib": 16.0, "budget_mib": 0.25, "repeat": 2, "loop_steps": 20, "loop_repeats": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``liver bench stream``; unset sizes take the full or the ``--quick`` defaults."""
    full, quick = FULL_DEFAULTS, QUICK_DEFAULTS
    parser.add_argument(
        "--size-mib",
        type=float,
        help=f"training state in total (default {full['size_mib']:g}, quick {quick['size_mib']:g})",
    )
    parser.add_argument(
        "--model",
        help="stream this model's state instead of a synthetic one: a preset, a ModelSpec .json, or a "
        "geometry .json (`liver geometry --provider ...` writes one for your own model); not with "
        "--size-mib",
    )
    parser.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="the job uses Megatron's distributed optimizer: its master weights and Adam moments are "
        "sharded over DP and move piece by piece",
    )
    parser.add_argument("--procs", type=int, default=2, help="local processes, 2-4 (default 2)")
    parser.add_argument(
        "--reshape",
        choices=RESHAPES,
        default="tp-to-dp",
        help="tp-to-dp: TP n -> TP n/2 x DP 2; pp-to-tp: PP n -> TP n (default tp-to-dp)",
    )
    parser.add_argument(
        "--budget-mib",
        type=float,
        help=f"B, the executor's memory budget beyond the layer under assembly "
        f"(default {full['budget_mib']:g}, quick {quick['budget_mib']:g})",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        help=f"raw and stream repeats (default {full['repeat']}, quick {quick['repeat']})",
    )
    parser.add_argument(
        "--loop-steps",
        type=int,
        help=f"steps per training-loop segment, 0 to skip the loop "
        f"(default {full['loop_steps']}, quick {quick['loop_steps']})",
    )
    parser.add_argument(
        "--loop-repeats",
        type=int,
        help=f"pairs of loop segments, alone and with a shadow world "
        f"(default {full['loop_repeats']}, quick {quick['loop_repeats']})",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds before a process counts as hung (default 900)"
    )
    parser.add_argument("--quick", action="store_true", help="CI-sized: a small state, few repeats")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    v = {k: getattr(args, k) if getattr(args, k) is not None else d for k, d in defaults.items()}
    if not v["size_mib"] > 0:
        raise ValueError(f"--size-mib: must be positive, got {v['size_mib']:g}")
    if not v["budget_mib"] > 0:
        raise ValueError(f"--budget-mib: must be positive, got {v['budget_mib']:g}")
    if v["repeat"] < 1:
        raise ValueError(f"--repeat: at least 1, got {v['repeat']}")
    if v["loop_steps"] < 0:
        raise ValueError(f"--loop-steps: must not be negative, got {v['loop_steps']}")
    if v["loop_repeats"] < 1:
        raise ValueError(f"--loop-repeats: at least 1, got {v['loop_repeats']}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout: must be positive, got {args.timeout:g}")
    return v


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every must check held (bit-exact shards, extra memory within its bound,
    the loop's results unchanged), 1 when one failed or a worker process failed."""
    v = _resolve(args)
    old_layout, new_layout = reshape_layouts(args.reshape, args.procs)
    budget = int(v["budget_mib"] * MIB)
    copies, message = message_split(budget)
    if args.model is not None and args.size_mib is not None:
        raise ValueError("--size-mib: the state of --model is the model's own; give one of them")
    if args.model is not None:
        model = as_geometry(load_model_or_geometry(args.model))
    else:
        model = synthetic_model(int(v["size_mib"] * MIB)).geometry()
    if args.distributed_optimizer:
        model = model.with_ddp(DdpSettings(distributed_optimizer=True))
    model.check_layout(old_layout)
    model.check_layout(new_layout)
    requested = state_bytes(model) if args.model is not None else int(v["size_mib"] * MIB)
    devices = local_devices(args.procs)
    plan = build_plan(
        model,
        WorldConfig(old_layout, Placement(devices)),
        WorldConfig(new_layout, Placement(devices)),
        budget_bytes=budget,
    )
    pstats = plan_stats(plan)
    group_timeout = min(args.timeout, 300.0)
    options = StreamOptions(timeout_s=group_timeout, message_bytes=message, send_copy_bytes=copies)
    config = StreamBenchConfig(
        quick=args.quick,
        procs=args.procs,
        reshape=args.reshape,
        old_layout=old_layout.describe(),
        new_layout=new_layout.describe(),
        model=model,
        state_bytes=state_bytes(model),
        requested_bytes=requested,
        budget_bytes=budget,
        send_copy_budget_bytes=copies,
        message_bytes=message,
        repeat=v["repeat"],
        loop_steps=v["loop_steps"],
        loop_repeats=v["loop_repeats"],
        rounds=pstats.rounds,
        backend="gloo",
    )
    progress(
        "stream",
        f"{config.state_bytes / MIB:,.1f} MiB of state, {config.old_layout} -> {config.new_layout} on "
        f"{args.procs} processes, {pstats.bytes_moved / MIB:,.1f} MiB to move, B = {budget / MIB:g} MiB",
    )
    load_before = load_average()
    store = host_store()
    setup = Setup(
        plan=plan,
        store_port=store.port,
        options=options,
        pair_bytes=pair_bytes(plan),
        repeat=v["repeat"],
        loop_steps=v["loop_steps"],
        loop_repeats=v["loop_repeats"],
        group_timeout_s=group_timeout,
    )
    try:
        results: list[ProcessResult] = run_procs(
            worker.measure_process, args.procs, (setup,), timeout_s=args.timeout, preload=[worker.__name__]
        )
    except ProcsError as exc:
        print(f"liver bench stream: a worker process failed\n{exc}", file=sys.stderr)
        return 1
    finally:
        del store
    load = [load_before, load_average()]
    report = build_report(config, plan, pstats.bytes_moved, pstats.bytes_local, results, load)
    emit(report, args.json, print_report)
    return 0 if report.ok else 1
