"""``liver bench plan``: the quick variant runs in-process and reports honest, self-consistent numbers.

No wall-clock assertions: timings depend on the machine; only their presence and sign are checked.
"""

from __future__ import annotations

import argparse
import json

import msgspec
import pytest

from liver.bench import plan as plan_bench
from liver.bench.dcp_baseline import build_workload, saved_metadata, time_load_planning
from liver.reshard.planner import default_world
from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def quick_run() -> tuple[int, str]:
    """One quick run shared by the tests below (stdout captured by hand: capsys is function-scoped)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = plan_bench.run(_args("--quick", "--json", "--repeat", "2"))
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def report(quick_run: tuple[int, str]) -> dict:
    return json.loads(quick_run[1])


def test_json_mode_prints_exactly_one_object(quick_run: tuple[int, str]) -> None:
    rc, stdout = quick_run
    assert rc == 0
    lines = stdout.strip().splitlines()
    assert len(lines) == 1
    assert isinstance(json.loads(lines[0]), dict)


def test_report_has_every_field_of_its_schema(report: dict) -> None:
    top = {f.name for f in msgspec.structs.fields(plan_bench.PlanBenchReport)}
    per_scenario = {f.name for f in msgspec.structs.fields(plan_bench.ScenarioReport)}
    per_dcp = {f.name for f in msgspec.structs.fields(plan_bench.DcpReport)}
    # The checks' struct is shared by every benchmark; a plan check names its scenario, not a job size.
    per_check = {f.name for f in msgspec.structs.fields(plan_bench.Check)} - {"workers"}
    assert set(report) == top
    for s in report["scenarios"]:
        assert set(s) == per_scenario
        assert set(s["dcp"]) == per_dcp
    for c in report["checks"]:
        assert set(c) == per_check
    msgspec.json.decode(json.dumps(report), type=plan_bench.PlanBenchReport)


def test_every_scenario_runs_in_quick_mode(report: dict) -> None:
    assert [s["name"] for s in report["scenarios"]] == list(plan_bench.SCENARIO_NAMES)
    assert report["quick"] is True
    assert all(len(s["plan_seconds_runs"]) == 2 for s in report["scenarios"])


def test_the_transfer_services_answer_is_timed_whole_with_its_parts_inside(report: dict) -> None:
    per_service = {f.name for f in msgspec.structs.fields(plan_bench.ServiceReport)}
    for s in report["scenarios"]:
        service = s["service"]
        assert set(service) == per_service
        assert 0 < service["verify_seconds"] + service["encode_seconds"] <= service["seconds"]
        assert service["plan_file_bytes"] > 0 and service["slice_file_bytes"] > 0


def test_every_plan_verifies(report: dict) -> None:
    assert report["ok"] is True
    for s in report["scenarios"]:
        assert s["verified"] is True, s["verify_errors"]
        assert s["verify_errors"] == []


def test_optimized_placement_moves_no_more_than_rank_order(report: dict) -> None:
    for s in report["scenarios"]:
        assert s["bytes_moved"] <= s["bytes_moved_rank_order"], s["name"]


def test_lower_bound_does_not_exceed_bytes_moved(report: dict) -> None:
    for s in report["scenarios"]:
        assert 0 <= s["lower_bound_bytes"] <= s["bytes_moved"], s["name"]


def test_bytes_moved_and_local_make_up_the_new_state(report: dict) -> None:
    for s in report["scenarios"]:
        assert s["bytes_local"] + s["bytes_moved"] == s["bytes_total"] > 0, s["name"]
        assert s["bytes_inter_node"] <= s["bytes_moved"]


def test_dcp_finds_the_same_overlaps_as_the_planner(report: dict) -> None:
    """Same metadata on both sides: DCP's read items cover the new state exactly, one per intersection
    (the quick plans are far under the staging budget, so the planner splits no slice)."""
    for s in report["scenarios"]:
        assert s["same_overlaps"] is True, s["name"]
        assert s["dcp"]["read_bytes"] == s["bytes_total"]
        assert s["dcp"]["read_items"] == s["slices"]
        assert s["dcp"]["local_chunks"] <= s["dcp"]["read_items"]


def test_coalescing_never_adds_tasks(report: dict) -> None:
    for s in report["scenarios"]:
        assert s["messages"] <= s["tasks"] <= s["slices"], s["name"]


def test_timings_are_reported_and_positive(report: dict) -> None:
    for s in report["scenarios"]:
        assert 0 < s["placement_seconds"] <= s["plan_seconds"]
        assert s["verify_seconds"] > 0
        assert s["dcp"]["seconds"] > 0 and s["dcp"]["ranks_timed"] == s["dcp"]["ranks_total"]
        assert 0 < s["dcp"]["busiest_rank_seconds"] <= s["dcp"]["seconds"]
        assert s["dcp_over_liver"] == pytest.approx(s["dcp"]["seconds"] / s["plan_seconds"])


def test_checks_cover_the_must_and_both_aims_per_scenario(report: dict) -> None:
    for s in report["scenarios"]:
        mine = [(c["level"], c["what"]) for c in report["checks"] if c["scenario"] == s["name"]]
        assert mine == [("must", "plan < 1 s"), ("aim", "plan < 0.1 s"), ("aim", ">= 10x faster than DCP")]


def test_scenario_option_runs_only_that_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_bench.run(_args("--quick", "--json", "--repeat", "1", "--scenario", "tp-change")) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in out["scenarios"]] == ["tp-change"]


def test_table_mode_prints_every_scenario_and_the_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_bench.run(_args("--quick", "--repeat", "1", "--scenario", "llama-gqa")) == 0
    out = capsys.readouterr().out
    assert "llama-gqa" in out
    assert "MUST" in out and "AIM" in out


@pytest.mark.parametrize(
    ("argv", "field"), [(("--repeat", "0"), "--repeat"), (("--dcp-budget", "0"), "--dcp-budget")]
)
def test_bad_numbers_are_rejected_naming_the_option(argv: tuple[str, ...], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        plan_bench.run(_args("--quick", *argv))


def test_dcp_metadata_keeps_one_chunk_per_distinct_old_shard() -> None:
    model = PRESETS["tiny-gpt"]
    old = default_world(ParallelLayout(2, 2, 3), devices_per_node=4)
    md = saved_metadata(model, model.tensors(True), old).state_dict_metadata
    qkv = md["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert [tuple(c.offsets) for c in qkv.chunks] == [(0, 0), (qkv.size[0] // 2, 0)]
    assert len(md["decoder.layers.0.input_layernorm.weight"].chunks) == 1  # replicated over TP and DP
    assert len(md["embedding.word_embeddings.weight"].chunks) == 2  # tied copy on the last stage dedup'ed
    assert len(md["optimizer.state.step"].chunks) == 1


def test_dcp_extrapolation_from_one_replica_matches_the_full_count() -> None:
    model = PRESETS["tiny-gpt"]
    old = default_world(ParallelLayout(2, 2, 2), devices_per_node=4)
    new = default_world(ParallelLayout(2, 1, 4), devices_per_node=4)
    work = build_workload(model, model.tensors(True), old, new)
    full = time_load_planning(work, new)
    part = time_load_planning(work, new, budget_seconds=1e-9)
    assert not full.extrapolated and full.ranks_timed == 8
    assert part.extrapolated and part.ranks_timed == 2  # one DP replica: TP2 x PP1
    assert (part.read_items, part.read_bytes) == (full.read_items, full.read_bytes)
