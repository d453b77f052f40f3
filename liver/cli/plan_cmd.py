"""``liver plan``: plan one resize and print its summary (optionally write the plan file)."""

from __future__ import annotations

import argparse
import sys
import time

import msgspec

from liver.reshard.plan import WorldConfig
from liver.reshard.plan_file import write_plan
from liver.reshard.planner import DEFAULT_BUDGET_BYTES, NoSurvivingSource, plan_resize
from liver.reshard.verifier import verify_plan
from liver.shared.geometry import DdpSettings
from liver.shared.layout import Device, ParallelLayout, Placement, default_devices, parse_devices
from liver.shared.model import as_geometry, load_model_or_geometry

MIB = 1024 * 1024


class PlanPrintout(msgspec.Struct, kw_only=True):
    """What ``liver plan --json`` prints."""

    model: str
    old_layout: str
    new_layout: str
    old_devices: int
    new_devices: int
    tensors: int
    tasks_before_coalescing: int
    tasks_after_coalescing: int
    messages: int
    rounds: int
    bytes_total: int
    bytes_local: int
    bytes_moved: int
    bytes_moved_rank_order: int
    bytes_inter_node: int
    lower_bound_bytes: int
    max_recv_bytes_per_rank: int
    max_round_recv_bytes: int
    budget_bytes: int
    placement: str
    verified: bool | None
    verify_errors: list[str]
    plan_seconds: float
    placement_seconds: float
    verify_seconds: float | None
    out: str | None


def layout_arg(text: str) -> ParallelLayout:
    """argparse type for ``TP,PP,DP``: keeps the layout error's own words in the usage message."""
    try:
        return ParallelLayout.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_lost(text: str, old_devices: tuple[Device, ...]) -> tuple[Device, ...]:
    """``NODE`` (every device of it) or ``NODE:I`` items, each naming devices of the old world."""
    by_node: dict[str, list[Device]] = {}
    for d in old_devices:
        by_node.setdefault(d.node, []).append(d)
    lost: list[Device] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        node, sep, index = item.rpartition(":")
        if not sep:
            if item not in by_node:
                raise ValueError(f"--lost: {item!r} is not a node of the old world")
            lost.extend(by_node[item])
        elif index.isdigit() and Device(node, int(index)) in old_devices:
            lost.append(Device(node, int(index)))
        else:
            raise ValueError(f"--lost: {item!r} is not a device (NODE:INDEX) of the old world")
    if not lost:
        raise ValueError("--lost: name at least one node or device")
    return tuple(dict.fromkeys(lost))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan the state transfer of one resize and print its summary")
    p.add_argument(
        "--model",
        required=True,
        help="a preset (gpt3-175b, llama3-8b, ...), a ModelSpec .json or a geometry .json (liver geometry)",
    )
    p.add_argument("--from", dest="old", required=True, type=layout_arg, metavar="TP,PP,DP[,CPn,EPn,ETPn]")
    p.add_argument("--to", dest="new", required=True, type=layout_arg, metavar="TP,PP,DP[,CPn,EPn,ETPn]")
    p.add_argument(
        "--devices",
        help="new device set: NxM, drop:NODE,..., or add:NxM (default: the old devices, trimmed or "
        "extended by whole nodes)",
    )
    p.add_argument(
        "--lost",
        metavar="NODE[:I],...",
        help="old devices that are gone (a whole node, or one device): no state is read from them, and "
        "the default new device set leaves them out",
    )
    p.add_argument("--per-node", type=int, default=8, help="devices per node of the old world (default 8)")
    p.add_argument("--budget-mib", type=float, default=DEFAULT_BUDGET_BYTES / MIB, help="staging buffer B")
    p.add_argument("--params-only", action="store_true", help="plan parameters only, no optimizer state")
    p.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="the job uses Megatron's distributed optimizer: master weights and Adam moments sharded over DP",
    )
    p.add_argument(
        "--bucket-size",
        type=int,
        metavar="ELEMENTS",
        help="with --distributed-optimizer: DDP buckets of this many elements (overlap_grad_reduce on)",
    )
    p.add_argument(
        "--rank-order", action="store_true", help="place new ranks in rank order (no optimisation)"
    )
    p.add_argument("--no-verify", action="store_true", help="skip the coverage proof")
    p.add_argument("--out", help="write the plan file (docs/plan-format.md) here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.per_node < 1:
        raise ValueError("--per-node must be at least 1")
    if args.budget_mib <= 0:
        raise ValueError("--budget-mib must be positive")
    model = load_model_or_geometry(args.model)
    if args.bucket_size is not None and not args.distributed_optimizer:
        raise ValueError("--bucket-size: only with --distributed-optimizer")
    if args.bucket_size is not None and args.bucket_size < 1:
        raise ValueError(f"--bucket-size: at least 1, got {args.bucket_size}")
    if args.distributed_optimizer:
        ddp = DdpSettings(
            distributed_optimizer=True,
            overlap_grad_reduce=args.bucket_size is not None,
            bucket_size=args.bucket_size,
        )
        model = as_geometry(model).with_ddp(ddp)
    # A PP that does not divide the layers gets the topology planner's balanced split (give the split
    # yourself as TP,PP,DP:a/b/... for another one).
    args.old = args.old.balanced(model.num_layers)
    args.new = args.new.balanced(model.num_layers)
    model.check_layout(args.old)
    model.check_layout(args.new)
    old_devices = default_devices(args.old.world_size, args.per_node)
    lost = parse_lost(args.lost, old_devices) if args.lost else ()
    alive = tuple(d for d in old_devices if d not in lost)
    if args.devices:
        new_devices = parse_devices(args.devices, old_devices)
        reused = [str(d) for d in new_devices if d in lost]
        if reused:
            raise ValueError(f"--lost: {', '.join(reused[:8])} also in the new device set (--devices)")
    elif args.new.world_size <= len(alive):
        new_devices = alive[: args.new.world_size]
    else:
        extra = args.new.world_size - len(alive)
        per = min(args.per_node, extra) if args.new.world_size > args.per_node else args.new.world_size
        added = parse_devices(f"add:{-(-extra // per)}x{per}", old_devices)[len(old_devices) :]
        new_devices = (alive + added)[: args.new.world_size]
    old = WorldConfig(args.old, Placement(old_devices))
    try:
        rp = plan_resize(
            model,
            old,
            args.new,
            new_devices,
            budget_bytes=int(args.budget_mib * MIB),
            optimizer=not args.params_only,
            optimize=not args.rank_order,
            lost=lost,
        )
    except NoSurvivingSource as exc:
        print(f"liver plan: no live transfer is possible: {exc}", file=sys.stderr)
        print("liver plan: a job in this state falls back to its last checkpoint", file=sys.stderr)
        return 1
    report = None
    verify_seconds = None
    if not args.no_verify:
        t0 = time.perf_counter()
        report = verify_plan(rp.plan, lost=lost)
        verify_seconds = time.perf_counter() - t0
    if args.out:
        write_plan(rp.plan, args.out)
    s = rp.stats
    summary = PlanPrintout(
        model=model.name,
        old_layout=args.old.describe(),
        new_layout=args.new.describe(),
        old_devices=len(old_devices),
        new_devices=len(new_devices),
        tensors=s.tensors,
        tasks_before_coalescing=s.slices,
        tasks_after_coalescing=s.tasks,
        messages=s.messages,
        rounds=s.rounds,
        bytes_total=s.bytes_total,
        bytes_local=s.bytes_local,
        bytes_moved=s.bytes_moved,
        bytes_moved_rank_order=rp.rank_order_bytes_moved,
        bytes_inter_node=s.bytes_inter_node,
        lower_bound_bytes=rp.lower_bound_bytes,
        max_recv_bytes_per_rank=s.max_recv_bytes,
        max_round_recv_bytes=s.max_round_recv_bytes,
        budget_bytes=rp.plan.budget_bytes,
        placement="rank-order" if args.rank_order else "optimized",
        verified=None if report is None else report.ok,
        verify_errors=[] if report is None else list(report.errors),
        plan_seconds=rp.plan_seconds,
        placement_seconds=rp.placement_seconds,
        verify_seconds=verify_seconds,
        out=args.out,
    )
    if args.json:
        sys.stdout.write(msgspec.json.encode(summary).decode() + "\n")
    else:
        _print_summary(summary)
    return 0 if report is None or report.ok else 1


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _print_summary(s: PlanPrintout) -> None:
    ratio = s.bytes_moved_rank_order / s.bytes_moved if s.bytes_moved else float("inf")
    rows = [
        ("model", s.model),
        ("transition", f"{s.old_layout} on {s.old_devices} devices -> {s.new_layout} on {s.new_devices}"),
        ("tensors", f"{s.tensors:,}"),
        ("tasks before coalescing", f"{s.tasks_before_coalescing:,}"),
        ("tasks after coalescing", f"{s.tasks_after_coalescing:,} ({s.messages:,} cross devices)"),
        ("streaming rounds", f"{s.rounds:,} (budget {s.budget_bytes / 2**20:,.0f} MiB per rank per round)"),
        ("new state", _gib(s.bytes_total)),
        ("copied locally", _gib(s.bytes_local)),
        ("bytes moved", f"{_gib(s.bytes_moved)} ({s.placement} placement)"),
        ("bytes moved, rank order", f"{_gib(s.bytes_moved_rank_order)} ({ratio:.2f}x the plan's)"),
        ("lower bound", _gib(s.lower_bound_bytes)),
        ("of which inter-node", _gib(s.bytes_inter_node)),
        ("largest receive per rank", _gib(s.max_recv_bytes_per_rank)),
        ("largest receive per round", f"{s.max_round_recv_bytes / 2**20:,.1f} MiB"),
        ("plan time", f"{s.plan_seconds * 1000:,.1f} ms (placement {s.placement_seconds * 1000:,.1f} ms)"),
    ]
    if s.verified is None:
        rows.append(("verification", "skipped"))
    else:
        verdict = "ok: every new shard covered exactly once" if s.verified else "FAILED"
        rows.append(("verification", f"{verdict} ({(s.verify_seconds or 0) * 1000:,.0f} ms)"))
        rows.extend(("  error", e) for e in s.verify_errors)
    if s.out:
        rows.append(("plan file", s.out))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
