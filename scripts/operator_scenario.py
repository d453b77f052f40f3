"""The operator scenario of docs/benchmarks.md, repeated with fresh seeds, and its counts.

Each run is one ``liver chaos --workers real`` schedule (real training processes on three loopback
nodes): every service killed once inside a handoff (the coordinator at a stage the seed picks), one
training process killed inside a handoff, a worker lost and a node lost without notice, and calm
steps; then the loss no replica covers (a TP2 job, DP=1, loses a process). Usage:

    .venv/bin/python scripts/operator_scenario.py --runs 20 --first-seed 100 [--log-dir DIR]

Prints one line per run and the totals; exits 1 if any run broke an invariant.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from liver.chaos.real import run_real_chaos, run_unreplicated_loss
from liver.chaos.run import ChaosConfig
from liver.chaos.schedule import Target, make_schedule
from liver.shared.logs import configure_logging


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=100)
    parser.add_argument("--log-dir", type=Path, help="keep each run's logs under DIR/<seed>")
    args = parser.parse_args()
    configure_logging(level="WARNING")
    config = ChaosConfig(nodes=3, outcome_timeout_s=120.0, settle_timeout_s=120.0)
    totals: Counter[str] = Counter()
    coordinator_stages: Counter[str] = Counter()
    recoveries: list[float] = []
    unreplicated: list[float] = []
    failed = 0
    for seed in range(args.first_seed, args.first_seed + args.runs):
        schedule = make_schedule(seed, steps=9, kills=5, server_kills=0, worker_kills=1, losses=2)
        where = None if args.log_dir is None else args.log_dir / str(seed)
        result = run_real_chaos(schedule, config, where, lambda _: None)
        dp1 = run_unreplicated_loss(config, None if where is None else where / "dp1")
        for step in result.steps:
            totals[f"step {step.outcome}"] += 1
            if step.kill is not None and step.kill.target == Target.COORDINATOR:
                coordinator_stages[step.kill.stage.value] += 1
        totals["kills"] += sum(result.kills.values())
        totals["losses"] += len(result.losses)
        totals["losses recovered live"] += sum(loss.training_s is not None for loss in result.losses)
        totals["violations"] += len(result.violations)
        totals["workers exiting non-zero"] += sum(code != 0 for code in result.worker_exits.values())
        totals["dp1 NoLiveRecovery"] += dp1.passed
        recoveries += [loss.training_s for loss in result.losses if loss.training_s is not None]
        unreplicated.append(dp1.seconds)
        ok = result.passed and dp1.passed
        failed += not ok
        print(
            f"seed {seed}: {'ok' if ok else 'FAILED'} steps {[s.outcome for s in result.steps]} "
            f"kills {result.kills} losses "
            f"{[(loss.kind.value, loss.training_s and round(loss.training_s, 2)) for loss in result.losses]} "
            f"violations {[v.detail for v in result.violations]} failure {result.failure} "
            f"dp1 exit {dp1.exitcode} in {dp1.seconds:.2f} s ({result.seconds:.0f} s)",
            flush=True,
        )
    print(f"runs {args.runs}, failed {failed}")
    print(f"totals {dict(totals)}")
    print(f"coordinator killed at {dict(coordinator_stages)}")
    if recoveries:
        median = sorted(recoveries)[len(recoveries) // 2]
        print(f"kill to training again: median {median:.2f} s, max {max(recoveries):.2f} s")
    print(f"dp1 survivor ended: max {max(unreplicated):.2f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
