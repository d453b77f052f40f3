"""``liver chaos``: kill the services and the nats-server during handoffs and check exactly-once.

Runs everything itself (a nats-server on a free loopback port with a store on disk, the four services,
a simulated job of two-device nodes), publishes a seeded series of spot warnings and scale requests,
kills its targets with SIGKILL inside the handoffs, and checks the invariants (:mod:`liver.chaos.checker`)
on what the bus kept. Exit code 0 when every invariant held and every step ended, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="kill services and the nats-server during handoffs; check exactly-once")
    p.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    p.add_argument("--steps", type=int, default=10, help="events published, one step each (default 10)")
    p.add_argument("--kills", type=int, default=6, help="steps with a kill (default 6)")
    p.add_argument("--server-kills", type=int, default=1, help="of which of the nats-server (default 1)")
    p.add_argument("--nodes", type=int, default=4, help="two-device nodes of the job (default 4, at least 3)")
    p.add_argument(
        "--outcome-timeout", type=float, default=180.0, metavar="S", help="longest wait for one step (180)"
    )
    p.add_argument(
        "--fuzz",
        type=int,
        metavar="N",
        help="instead of kills: N hostile messages on every subject LiveR reads (liver.chaos.fuzz)",
    )
    p.add_argument(
        "--workers",
        choices=("simulated", "real"),
        default="simulated",
        help="the job: simulated node processes (default), or real training processes (a tiny Megatron "
        "GPT on CPU, one `liver worker` per device, two per node, standbys), with losses without notice",
    )
    p.add_argument(
        "--worker-kills", type=int, default=0, help="real: kills of a training process inside a handoff"
    )
    p.add_argument(
        "--restart-losses",
        type=int,
        default=0,
        help="real: kills of a training process inside a handoff while the coordinator, killed there "
        "too, is down (of the --kills)",
    )
    p.add_argument(
        "--losses",
        type=int,
        default=0,
        help="real: steps that are a loss (a worker, or a node) instead of an event",
    )
    p.add_argument(
        "--job-factory", metavar="FILE.py:FUNCTION", help="real: your own job (as liver worker --job-factory)"
    )
    p.add_argument(
        "--job-arg", action="append", default=[], metavar="KEY=VALUE", help="real: for --job-factory"
    )
    p.add_argument(
        "--unreplicated-loss",
        action="store_true",
        help="real: instead of a schedule, kill one process of a TP2 job with no replica and no checkpoint; "
        "its survivor must recover live from the peer copy it keeps",
    )
    p.add_argument("--log-dir", type=Path, help="keep every process's log here (default: a removed temp dir)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from liver.chaos.run import ChaosConfig, run_chaos, summary
    from liver.chaos.schedule import make_schedule
    from liver.cli.main import CliError
    from liver.shared.logs import configure_logging

    if args.outcome_timeout <= 0:
        raise CliError(f"--outcome-timeout: must be > 0, got {args.outcome_timeout}")
    if args.nodes < 3:
        raise CliError(f"--nodes: at least 3 (a world of two and one to come back), got {args.nodes}")
    real_only = (args.worker_kills, args.restart_losses, args.losses, args.job_factory, args.job_arg)
    if args.workers != "real" and (any(real_only) or args.unreplicated_loss):
        raise CliError(
            "--worker-kills, --restart-losses, --losses, --job-factory, --job-arg and --unreplicated-loss "
            "need --workers real"
        )
    try:
        schedule = make_schedule(
            args.seed,
            steps=args.steps,
            kills=args.kills,
            server_kills=args.server_kills,
            worker_kills=args.worker_kills,
            losses=args.losses,
            restart_losses=args.restart_losses,
        )
    except ValueError as exc:
        raise CliError(str(exc).replace("`", "--").replace("_", "-")) from None
    configure_logging(level="WARNING")

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if args.fuzz is not None:
        return _fuzz(args, progress)

    if args.unreplicated_loss:
        return _unreplicated(args, progress)
    if args.workers == "real":
        return _real(args, schedule, progress)
    config = ChaosConfig(nodes=args.nodes, outcome_timeout_s=args.outcome_timeout)
    result = run_chaos(schedule, config, args.log_dir, progress)
    if args.json:
        payload = {"result": msgspec.to_builtins(result), "summary": summary(result), "passed": result.passed}
        sys.stdout.write(msgspec.json.encode(payload).decode() + "\n")
    else:
        _print(result, summary(result))
    return 0 if result.passed else 1


def _print(result: object, figures: dict[str, object]) -> None:
    from liver.chaos.run import ChaosResult

    assert isinstance(result, ChaosResult)
    print(f"seed {result.seed}: {len(result.steps)} steps in {result.seconds:.0f} s")
    for step in result.steps:
        kill = f"kill {step.kill.target.value} at {step.kill.stage.value}" if step.kill else ""
        took = "no outcome" if step.seconds is None else f"{step.seconds:6.1f} s"
        print(
            f"  {step.index:3d} {step.kind.value:<13} {','.join(step.nodes):<15} {took:>10}  "
            f"{step.outcome:<9} gen {','.join(map(str, step.generations)):<6} {kill}"
        )
    print(
        f"outcomes {result.outcomes}: {result.committed} committed, {result.aborted} aborted, "
        f"{result.replanned} re-planned; kills {result.kills}; unplanned exits {result.unplanned_exits}; "
        f"dead letters {result.dead_letters}; error events {result.error_events}"
    )
    for key, value in figures.items():
        print(f"  {key}: {value:.2f}" if isinstance(value, float) else f"  {key}: {value}")
    if result.violations:
        print("VIOLATIONS:")
        for v in result.violations:
            print(f"  {v.invariant.value}: {v.detail}")
    else:
        print("every invariant held")


def _fuzz(args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    from liver.chaos.fuzz import run_fuzz
    from liver.cli.main import CliError

    if not 1 <= args.fuzz <= 1_000_000:
        raise CliError(f"--fuzz: between 1 and 1,000,000 messages, got {args.fuzz}")
    result = run_fuzz(args.seed, args.fuzz, args.log_dir, progress, answer_timeout_s=args.outcome_timeout)
    if args.json:
        payload = {"fuzz": msgspec.to_builtins(result), "passed": result.passed}
        sys.stdout.write(msgspec.json.encode(payload).decode() + "\n")
        return 0 if result.passed else 1
    print(
        f"seed {result.seed}: {result.sent} hostile messages sent in {result.send_seconds:.1f} s, "
        f"run {result.seconds:.0f} s"
    )
    print(f"  answered with an error event: {result.answered}/{result.expected_answers} expected")
    print(f"  dead-lettered: {result.dead_lettered}/{result.expected_dead_letters} expected")
    print(f"  by category: {dict(sorted(result.by_category.items()))}")
    print(f"  by subject: {dict(sorted(result.by_subject.items()))}")
    print(f"  services answering discovery: {', '.join(result.services_answering) or 'none'}")
    print(f"  unplanned exits: {result.unplanned_exits or 'none'}")
    print(
        f"  the job resized afterwards: {result.resized_after}; a conflicting copy refused: "
        f"{result.conflict_refused}"
    )
    for line in result.unanswered[:20]:
        print(f"  UNANSWERED {line}")
    print("every message answered" if result.passed else "FAILED")
    return 0 if result.passed else 1


def _unreplicated(args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    from liver.chaos.real import run_unreplicated_loss
    from liver.chaos.run import ChaosConfig

    config = ChaosConfig(nodes=args.nodes, outcome_timeout_s=args.outcome_timeout)
    result = run_unreplicated_loss(config, args.log_dir, progress)
    if args.json:
        payload = {"unreplicated_loss": msgspec.to_builtins(result), "passed": result.passed}
        sys.stdout.write(msgspec.json.encode(payload).decode() + "\n")
        return 0 if result.passed else 1
    training = "never" if result.training_s is None else f"{result.training_s:.2f} s after the kill"
    print(
        f"a TP2 job with no replica lost a process: recovered live: {result.recovered_live} "
        f"(committed {result.seconds:.2f} s after the kill), training again {training}; "
        f"survivor alive: {result.survivor_alive}; checkpoint-fallback aborts: {result.fallbacks}"
    )
    if result.in_refresh:
        print(
            f"({result.in_refresh} earlier attempt(s) killed the victim inside its copy's refresh and "
            "the survivors could not go back to its copy's iteration: run again)"
        )
    print("as expected" if result.passed else "FAILED")
    return 0 if result.passed else 1


def _real(args: argparse.Namespace, schedule: object, progress: Callable[[str], None]) -> int:
    from liver.chaos.real import run_real_chaos
    from liver.chaos.run import ChaosConfig
    from liver.chaos.schedule import Schedule
    from liver.cli.main import CliError

    assert isinstance(schedule, Schedule)
    job_args = {}
    for text in args.job_arg:
        key, sep, value = text.partition("=")
        if not sep or not key.isidentifier():
            raise CliError(f"--job-arg: {text!r} is not KEY=VALUE")
        job_args[key] = value
    config = ChaosConfig(nodes=args.nodes, outcome_timeout_s=args.outcome_timeout)
    result = run_real_chaos(
        schedule, config, args.log_dir, progress, job_factory=args.job_factory, job_args=job_args
    )
    from liver.chaos.real import real_summary

    figures = real_summary(result)
    if args.json:
        payload = {"result": msgspec.to_builtins(result), "summary": figures, "passed": result.passed}
        sys.stdout.write(msgspec.json.encode(payload).decode() + "\n")
        return 0 if result.passed else 1
    print(f"seed {result.seed}: {len(result.steps)} steps in {result.seconds:.0f} s, real training processes")
    for step in result.steps:
        kill = f"kill {step.kill.target.value} at {step.kill.stage.value}" if step.kill else ""
        what = step.loss.value + " lost" if step.loss is not None else step.kind.value
        took = "no outcome" if step.seconds is None else f"{step.seconds:6.1f} s"
        print(
            f"  {step.index:3d} {what:<13} {','.join(step.nodes):<15} {took:>10}  "
            f"{step.outcome:<9} gen {','.join(map(str, step.generations)):<6} {kill}"
        )
    for loss in result.losses:
        devices = ",".join(map(str, loss.devices))
        training = "never" if loss.training_s is None else f"{loss.training_s:.2f} s"
        print(
            f"  loss of {devices} (step {loss.step}): generation {loss.generation}, "
            f"training again after {training}"
        )
    print(f"kills {result.kills}; worker exits {result.worker_exits}")
    for key, value in figures.items():
        print(f"  {key}: {value:.2f}" if isinstance(value, float) else f"  {key}: {value}")
    if result.violations:
        print("VIOLATIONS:")
        for v in result.violations:
            print(f"  {v.invariant.value}: {v.detail}")
    else:
        print("every invariant held")
    return 0 if result.passed else 1
