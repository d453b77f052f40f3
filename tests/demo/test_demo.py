"""``liver demo --short`` end to end, as a user runs it: one command, no NATS installed, no GPU.

The demo runs as a subprocess once for the module (two training workers and one standby, the real
services, the embedded server); the tests read its JSON result, its files, and the process table.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from demo_helpers import Run, run_demo

from liver.demo.procs import leftovers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_demo(tmp_path_factory.mktemp("demo"), "--short")


def test_the_demo_exits_0_with_a_successful_result(demo: Run) -> None:
    done, result, _ = demo
    assert done.returncode == 0, f"{result.error}\n{done.stderr[-4000:]}"
    assert result.ok and result.error is None


def test_a_spot_warning_scales_in_then_a_scale_request_scales_out_both_committed(demo: Run) -> None:
    _, result, _ = demo
    scale_in, scale_out = result.generations
    assert (scale_in.generation, scale_out.generation) == (1, 2)
    assert scale_in.trigger.startswith("spot warning") and scale_out.trigger.startswith("scale request")
    assert scale_in.outcome == scale_out.outcome == "committed"
    assert scale_in.devices_after < scale_in.devices_before
    assert scale_out.devices_after > scale_out.devices_before
    assert scale_in.layout_after == scale_out.layout_before
    assert scale_in.cut_iteration is not None and scale_out.cut_iteration is not None
    assert scale_in.cut_iteration < scale_out.cut_iteration


def test_each_reconfiguration_reports_its_pause_bytes_and_planning_time(demo: Run) -> None:
    _, result, _ = demo
    for row in result.generations:
        assert row.downtime_s is not None and 0 < row.downtime_s < row.handoff_s
        assert row.bytes_moved is not None and row.bytes_moved > 0
        assert row.plan_s is not None and row.plan_s > 0
        assert row.loss_before is not None and row.loss_after is not None


def test_training_runs_through_both_reconfigurations_with_finite_losses(demo: Run) -> None:
    _, result, _ = demo
    iterations = [p.iteration for p in result.steps]
    assert iterations == list(range(1, len(iterations) + 1))
    assert [p.generation for p in result.steps] == sorted(p.generation for p in result.steps)
    assert {p.generation for p in result.steps} == {0, 1, 2}
    assert all(math.isfinite(p.loss) for p in result.steps)


def test_the_timeline_png_is_written(demo: Run) -> None:
    _, result, _ = demo
    assert result.timeline_png is not None
    data = Path(result.timeline_png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_table_goes_with_the_progress_to_stderr(demo: Run) -> None:
    done, _, _ = demo
    assert "one row per generation" in done.stderr
    assert "spot warning" in done.stderr and "scale request" in done.stderr


def test_no_process_the_demo_started_is_left_behind(demo: Run) -> None:
    _, result, mark = demo
    assert result.mark == mark
    assert len(result.pids) == 3 + 4  # workers and services (plus the server and fork server, by mark)
    assert result.leftovers == []
    assert leftovers(mark) == []
