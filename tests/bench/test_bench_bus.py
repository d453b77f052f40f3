"""``liver bench bus``: the quick variant runs the real services and simulated workers as processes and
reports honest, self-consistent numbers.

No wall-clock assertions: latencies depend on the machine and its load; only their presence, order and
arithmetic are checked. That every event committed is checked outright.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from liver.bench.bus import bench as bus_bench
from liver.bench.bus import report as schema
from liver.bench.bus import rig


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bus_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def quick_run() -> tuple[int, str]:
    """One quick run (jobs of 8 and 16 workers, two warm-up and two counted events each), shared by the
    tests below; stdout captured by hand because capsys is function-scoped."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = bus_bench.run(_args("--quick", "--json"))
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def report(quick_run: tuple[int, str]) -> dict[str, Any]:
    return json.loads(quick_run[1])


def _fields(struct: type) -> set[str]:
    return {f.name for f in msgspec.structs.fields(struct)}


def _counted(size: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in size["records"] if not r["warmup"]]


@pytest.mark.slow
def test_json_mode_prints_exactly_one_object_and_exits_0(quick_run: tuple[int, str]) -> None:
    rc, stdout = quick_run
    lines = stdout.strip().splitlines()
    assert (rc, len(lines)) == (0, 1)
    assert isinstance(json.loads(lines[0]), dict)


@pytest.mark.slow
def test_report_has_every_field_of_its_schema(report: dict[str, Any]) -> None:
    assert set(report) == _fields(schema.BusBenchReport)
    for size in report["sizes"]:
        assert set(size) == _fields(schema.SizeReport)
        assert set(size["contract"]) == _fields(schema.ContractReport)
        assert set(size["commit_ms"]) == _fields(schema.Stat)
        for record in size["records"]:
            assert set(record) == _fields(schema.BusEventRecord)


@pytest.mark.slow
def test_every_event_of_every_size_committed(report: dict[str, Any]) -> None:
    assert report["ok"]
    assert [s["workers"] for s in report["sizes"]] == list(bus_bench.QUICK_WORKERS)
    for size in report["sizes"]:
        assert (size["events"], size["warmup"], size["committed"]) == (bus_bench.QUICK_EVENTS, 2, 2)
        assert [r["outcome"] for r in size["records"]] == ["committed"] * 4
        assert size["all_committed"]


@pytest.mark.slow
def test_events_alternate_scale_in_and_scale_out_by_one_node(report: dict[str, Any]) -> None:
    for size in report["sizes"]:
        n, k = size["workers"], size["devices_per_node"]
        kinds = [(r["kind"], r["devices_before"], r["devices_after"]) for r in size["records"]]
        assert kinds == [("scale_in", n, n - k), ("scale_out", n - k, n)] * 2
        assert [r["generation"] for r in size["records"]] == [1, 2, 3, 4]


@pytest.mark.slow
def test_each_stage_arrives_in_order_and_the_switch_before_the_commit(report: dict[str, Any]) -> None:
    order = (
        "resize_requested",
        "topology_request",
        "topology_planned",
        "transfer_planned",
        "switch",
        "outcome",
    )
    for size in report["sizes"]:
        for record in size["records"]:
            arrivals = [record["arrivals_ms"][stage] for stage in order]
            assert arrivals[0] > 0 and arrivals == sorted(arrivals), record["event_id"]
            assert (record["switch_ms"], record["commit_ms"]) == (arrivals[-2], arrivals[-1])


@pytest.mark.slow
def test_bus_overhead_is_the_latency_less_planning_and_worker_cpu(report: dict[str, Any]) -> None:
    for size in report["sizes"]:
        for r in _counted(size):
            transfer = r["transfer_plan_ms"] + r["transfer_verify_ms"] + r["transfer_encode_ms"]
            assert r["topology_planning_ms"] > 0 and transfer > 0
            assert r["planning_ms"] == pytest.approx(r["topology_planning_ms"] + transfer)
            assert r["worker_cpu_commit_ms"] >= 0
            expected = r["commit_ms"] - r["planning_ms"] - r["worker_cpu_commit_ms"]
            assert r["bus_overhead_commit_ms"] == pytest.approx(expected)
        assert size["bus_overhead_commit_ms"]["n"] == bus_bench.QUICK_EVENTS


@pytest.mark.slow
def test_every_service_and_the_workers_spent_cpu_on_an_event(report: dict[str, Any]) -> None:
    for size in report["sizes"]:
        spent = size["process_cpu_ms"]
        for process in ("nats-server", "ingester", "topology", "transfer", "coordinator", "workers"):
            assert spent[process]["max"] > 0, process


@pytest.mark.slow
def test_messages_per_event_cover_a_prepare_and_a_switch_per_worker(report: dict[str, Any]) -> None:
    for size in report["sizes"]:
        for r in _counted(size):
            assert r["messages_out"] >= 2 * size["workers"]
            assert r["messages_in"] > size["workers"]  # an ack per worker and phase, at least
            assert r["bytes_out"] > 0 and r["slice_bytes_total"] >= r["slice_bytes_max"] > 0


@pytest.mark.slow
def test_the_prepare_is_one_broadcast_and_the_slice_carries_no_world(report: dict[str, Any]) -> None:
    for size in report["sizes"]:
        c = size["contract"]
        assert c["participants"] == size["workers"]
        assert c["prepare_bytes_per_event"] == c["broadcast_prepare_bytes"] == c["prepare_bytes"]
        assert c["coordinator_encode_ms_per_event"] == pytest.approx(c["prepare_encode_ms"])
        assert c["prepare_placement_bytes"] < c["prepare_bytes"]
        assert c["slice_world_bytes"] == 0 < c["slice_bytes"] <= c["slice_bytes_per_event"]


@pytest.mark.slow
def test_checks_judge_every_size_once_each(report: dict[str, Any]) -> None:
    checks = report["checks"]
    assert [(c["workers"], c["level"]) for c in checks] == [
        (n, level) for n in bus_bench.QUICK_WORKERS for level in ("must", "aim", "aim")
    ]
    assert all(c["passed"] for c in checks if c["level"] == "must")


# -- pieces without a run ----------------------------------------------------------------------------------


def test_a_job_size_that_is_not_whole_nodes_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match=r"^--workers: 12 is not whole nodes of 8"):
        bus_bench.config_from(_args("--workers", "12"))


def test_event_counts_must_match_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"^--events: give one number or one per size \(2\), got 3"):
        bus_bench.config_from(_args("--events", "1,2,3"))
    assert bus_bench.config_from(_args("--events", "7")).events == (7, 7)
    assert bus_bench.config_from(_args("--workers", "16,2048")).events == bus_bench.DEFAULT_EVENTS


def test_percentiles_interpolate_between_the_closest_ranks() -> None:
    assert schema.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert schema.percentile([10.0, 20.0], 99) == pytest.approx(19.9)
    assert schema.percentile([5.0], 99) == 5.0


def test_planning_times_are_read_from_the_services_json_logs(tmp_path: Path) -> None:
    topology, transfer = tmp_path / "topology.log", tmp_path / "transfer.log"
    topology.write_text(
        'not json "topology_planned"\n'
        + json.dumps({"event": "topology_planned", "job_id": "j", "event_id": "e1", "planning_seconds": 0.5})
        + "\n"
    )
    transfer.write_text(
        json.dumps(
            {
                "event": "transfer_planned",
                "job_id": "j",
                "event_id": "e1",
                "plan_seconds": 0.1,
                "verify_seconds": 0.2,
                "encode_seconds": 0.3,
            }
        )
        + "\n"
    )
    times = rig.planning_times([topology, transfer])
    assert times == {
        ("j", "e1"): rig.Planning(
            topology_s=0.5, transfer_plan_s=0.1, transfer_verify_s=0.2, transfer_encode_s=0.3
        )
    }


def test_traffic_leaves_out_the_bench_connections_and_counts_new_ones_from_zero() -> None:
    conn = rig.ConnCounters
    before = {1: conn("liver-coordinator", 10, 20, 100, 200), 2: conn("liver-bench-observer", 5, 5, 5, 5)}
    after = {
        1: conn("liver-coordinator", 15, 30, 150, 260),
        2: conn("liver-bench-observer", 50, 50, 50, 50),
        3: conn("liver-sim-job", 4, 6, 40, 60),
    }
    assert rig.traffic_between(before, after, rig.BENCH_CLIENT_PREFIX) == rig.Traffic(9, 16, 90, 120)
