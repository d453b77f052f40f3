"""How ``liver demo`` turns what it saw into its result: the workers' metrics files, the rows per
generation, the table and the timeline (no processes: recorded inputs only)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from rich.console import Console

from liver.demo.observer import Arrival, Observer, PublishedTrigger
from liver.demo.runlog import RunLog
from liver.demo.scenario import FULL, SHORT, Scenario
from liver.demo.summary import DemoResult, StepPoint, generation_rows, print_summary
from liver.demo.timeline import write_timeline
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.messages import Candidate, GenerationCommitted, TopologyPlanned
from liver.shared.model import PRESETS
from liver.worker_runtime.metrics import MetricsLog, Step, Switched

T0 = 1_800_000_000.0
OLD = ParallelLayout(tp=2, pp=1, dp=1)
NEW = ParallelLayout(tp=1, pp=1, dp=1)
A, B = Device("n0", 0), Device("n1", 0)


def write_steps(path: Path, worker: str, steps: list[tuple[int, float, int]], layout: str) -> None:
    log = MetricsLog(path / f"{worker}.jsonl", worker)
    for iteration, loss, generation in steps:
        log.write(
            Step,
            iteration=iteration,
            loss=loss,
            grad_norm=1.0,
            generation=generation,
            rank=0,
            layout=layout,
            step_s=0.1,
        )
    log.close()


def observer_with_one_commit() -> Observer:
    observer = Observer(nc=None, job_id="demo")  # type: ignore[arg-type]
    observer.triggers.append(
        PublishedTrigger("spot_warning", "evt-1", "spot warning n1", "n1 reclaimed", T0 + 10)
    )
    planned = TopologyPlanned(
        job_id="demo",
        event_id="evt-1",
        from_generation=0,
        generation=1,
        model=PRESETS["tiny-gpt"].geometry(),
        from_layout=OLD,
        from_placement=Placement((A, B)),
        layout=NEW,
        placement=Placement((A,)),
        candidates=(Candidate(layout=NEW, score=1.0, fits=True),),
        explanation="the only layout of one device",
    )
    committed = GenerationCommitted(
        job_id="demo",
        event_id="evt-1",
        previous_generation=0,
        generation=1,
        layout=NEW,
        placement=Placement((A,)),
        started_at_iteration=3,
        downtime_s=0.25,
        bytes_moved=4096,
        committed_at=datetime.now(UTC),
    )
    observer.topology[1] = Arrival(T0 + 10.5, planned)
    observer.committed[1] = Arrival(T0 + 12.0, committed)
    return observer


def test_the_trace_has_one_step_per_iteration_whichever_ranks_reported_it(tmp_path: Path) -> None:
    write_steps(tmp_path, "w-a", [(1, 6.0, 0), (2, 5.5, 0), (3, 5.0, 0), (4, 4.8, 1)], "TP2,PP1,DP1")
    write_steps(tmp_path, "w-b", [(1, 6.0, 0), (2, 5.5, 0), (3, 5.0, 0)], "TP2,PP1,DP1")
    runlog = RunLog(tmp_path)
    runlog.refresh()
    assert [(p.iteration, p.loss, p.generation) for p in runlog.trace()] == [
        (1, 6.0, 0),
        (2, 5.5, 0),
        (3, 5.0, 0),
        (4, 4.8, 1),
    ]
    assert runlog.max_iteration() == 4


def test_refresh_reads_only_what_was_appended_and_waits_for_a_torn_line(tmp_path: Path) -> None:
    write_steps(tmp_path, "w-a", [(1, 6.0, 0)], "TP1,PP1,DP1")
    runlog = RunLog(tmp_path)
    runlog.refresh()
    with (tmp_path / "w-a.jsonl").open("ab") as fh:
        fh.write(b'{"kind":"step","iteration":2')
    runlog.refresh()
    assert len(runlog.workers["w-a"].steps) == 1
    with (tmp_path / "w-a.jsonl").open("ab") as fh:
        fh.write(b',"loss":5.0,"grad_norm":1.0,"generation":0,"rank":0,"layout":"x","step_s":0.1,')
        fh.write(b'"t":1.0,"worker_id":"w-a"}\n')
    runlog.refresh()
    assert [s.iteration for s in runlog.workers["w-a"].steps] == [1, 2]


def test_a_row_joins_trigger_plan_commit_and_the_losses_around_the_cut(tmp_path: Path) -> None:
    write_steps(tmp_path, "w-a", [(1, 6.0, 0), (2, 5.5, 0), (3, 5.0, 0), (4, 4.8, 1)], "x")
    runlog = RunLog(tmp_path)
    runlog.refresh()
    (row,) = generation_rows(observer_with_one_commit(), runlog)
    assert (row.generation, row.trigger, row.outcome) == (1, "spot warning n1", "committed")
    assert (row.layout_before, row.layout_after) == ("TP2,PP1,DP1", "TP1,PP1,DP1")
    assert (row.devices_before, row.devices_after) == (2, 1)
    assert (row.cut_iteration, row.downtime_s, row.bytes_moved) == (3, 0.25, 4096)
    assert row.handoff_s == pytest.approx(2.0)
    assert (row.loss_before, row.loss_after) == (5.0, 4.8)


def test_a_trigger_the_planner_never_answered_has_no_row(tmp_path: Path) -> None:
    observer = observer_with_one_commit()
    observer.triggers.append(
        PublishedTrigger("scale_request", "evt-2", "scale request +n2", "add n2", T0 + 20)
    )
    runlog = RunLog(tmp_path)
    runlog.refresh()
    assert [r.event_id for r in generation_rows(observer, runlog)] == ["evt-1"]


def result_with_one_commit(tmp_path: Path) -> DemoResult:
    write_steps(tmp_path, "w-a", [(1, 6.0, 0), (2, 5.5, 0), (3, 5.0, 0), (4, 4.8, 1)], "x")
    runlog = RunLog(tmp_path)
    runlog.refresh()
    rows = generation_rows(observer_with_one_commit(), runlog)
    steps = [
        StepPoint(iteration=i, loss=5.0 - 0.1 * i, generation=int(i > 3), t=float(i)) for i in range(1, 7)
    ]
    return DemoResult(
        ok=True, scenario="test", out_dir=str(tmp_path), mark="m", pids=[], generations=rows, steps=steps
    )


def test_the_timeline_is_a_png(tmp_path: Path) -> None:
    result = result_with_one_commit(tmp_path)
    path = write_timeline(result, tmp_path / "t.png", {1: 2.5}, {1: 3.6})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_steps_draws_no_timeline(tmp_path: Path) -> None:
    result = DemoResult(ok=False, scenario="test", out_dir="", mark="m", pids=[], generations=[], steps=[])
    with pytest.raises(ValueError, match="`steps`"):
        write_timeline(result, tmp_path / "t.png", {}, {})


def test_the_table_shows_each_generation_with_pause_bytes_and_losses(tmp_path: Path) -> None:
    console = Console(record=True, width=200)
    print_summary(result_with_one_commit(tmp_path), console)
    text = console.export_text()
    assert "spot warning n1" in text and "TP2,PP1,DP1 (2) -> TP1,PP1,DP1 (1)" in text
    assert "0.25 s" in text and "4.00 KiB" in text and "5.000 -> 4.800" in text


def test_switch_records_of_a_generation_are_found_across_workers(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "w-a.jsonl", "w-a")
    for generation in (1, 2):
        log.write(
            Switched,
            generation=generation,
            from_generation=generation - 1,
            role="stay",
            iteration=3,
            left=False,
            pause_s=0.2,
            transfer_s=0.1,
            rebuild_s=0.1,
            bytes_sent=1,
            bytes_received=2,
            bytes_local=3,
        )
    log.close()
    runlog = RunLog(tmp_path)
    runlog.refresh()
    assert [r.generation for r in runlog.switches(2)] == [2]


@pytest.mark.parametrize("scenario", [FULL, SHORT], ids=["full", "short"])
def test_the_scenarios_reclaim_an_active_node_and_bring_back_a_standby_one(scenario: Scenario) -> None:
    assert scenario.reclaimed_node in scenario.active_nodes
    assert scenario.standby_node not in scenario.active_nodes
    assert len(scenario.first_devices) == scenario.layout.world_size


def test_a_scenario_whose_layout_does_not_fit_its_devices_is_refused() -> None:
    with pytest.raises(ValueError, match="`layout`"):
        Scenario(
            layout=ParallelLayout(tp=2, pp=2, dp=1),
            devices_per_node=1,
            active_nodes=("a", "b"),
            standby_node="c",
            reclaimed_node="b",
            warmup_steps=1,
            steps_between=1,
            tail_steps=1,
        )
