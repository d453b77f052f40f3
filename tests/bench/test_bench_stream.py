"""``liver bench stream``: the quick variant runs real processes and reports honest, self-consistent numbers.

No wall-clock assertions: throughput and slowdown depend on the machine; only their presence and
consistency are checked. The musts (bit-exact shards, extra memory within its bound, the loop's results
untouched by the shadow preparation) are checked outright.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from typing import Any

import msgspec
import pytest
import torch

from liver.bench.procs import ProcsError, run_procs
from liver.bench.stream import bench as stream_bench
from liver.bench.stream import workload
from liver.bench.stream.report import StreamBenchReport
from liver.reshard.views import tp_shard
from liver.shared.geometry import ModelGeometry


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    stream_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def _run_json(*argv: str) -> tuple[int, str]:
    """Run the benchmark in this process (its workers are processes of their own), stdout captured."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = stream_bench.run(_args("--quick", "--json", *argv))
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def quick_run() -> tuple[int, str]:
    """One quick run (TP2 -> TP1 x DP2, two processes) shared by the tests below."""
    return _run_json()


@pytest.fixture(scope="module")
def report(quick_run: tuple[int, str]) -> dict[str, Any]:
    return json.loads(quick_run[1])


@pytest.fixture(scope="module")
def pp_report() -> dict[str, Any]:
    """PP2 -> TP2: slices leave their old shard non-contiguous, so the send-copy path is exercised."""
    rc, out = _run_json("--reshape", "pp-to-tp", "--size-mib", "8", "--repeat", "1", "--loop-steps", "0")
    assert rc == 0
    return json.loads(out)


# -- the quick run ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_json_mode_prints_exactly_one_object_and_exits_zero(quick_run: tuple[int, str]) -> None:
    rc, stdout = quick_run
    assert rc == 0
    lines = stdout.strip().splitlines()
    assert len(lines) == 1
    assert isinstance(json.loads(lines[0]), dict)


@pytest.mark.slow
def test_report_decodes_into_its_schema(report: dict[str, Any]) -> None:
    decoded = msgspec.json.decode(json.dumps(report), type=StreamBenchReport, strict=True)
    assert decoded.config.quick is True
    assert (decoded.config.old_layout, decoded.config.new_layout) == ("TP2,PP1,DP1", "TP1,PP1,DP2")


@pytest.mark.slow
def test_new_shards_are_bit_exact(report: dict[str, Any]) -> None:
    stream = report["stream"]
    assert stream["bit_exact"] is True
    assert stream["mismatched"] == []
    model = msgspec.convert(report["config"]["model"], ModelGeometry)
    # TP1 x DP2: each of the two new ranks holds every tensor of the state.
    assert stream["tensors_checked"] == 2 * len(model.tensors(optimizer=True))


@pytest.mark.slow
def test_extra_memory_stays_within_b_plus_the_largest_new_layer(report: dict[str, Any]) -> None:
    config = report["config"]
    assert len(report["memory"]) == config["procs"]
    for m in report["memory"]:
        assert m["within_bound"] is True
        assert m["bound_bytes"] == config["budget_bytes"] + m["largest_new_layer_bytes"]
        assert 0 < m["peak_extra_bytes"] <= m["bound_bytes"]
        assert m["staging_bytes"] <= m["buffer_bytes"] <= config["budget_bytes"]
        assert m["peak_send_copy_bytes"] <= config["send_copy_budget_bytes"]


@pytest.mark.slow
def test_throughput_and_ceiling_come_from_the_same_bytes(report: dict[str, Any]) -> None:
    s, config = report["stream"], report["config"]
    assert s["bytes_moved"] > 0
    for field in ("raw_seconds", "floor_seconds", "into_seconds", "alloc_seconds"):
        assert len(s[field]) == config["repeat"], field
    assert s["raw_ceiling_bytes_per_s"] == pytest.approx(s["bytes_moved"] / min(s["raw_seconds"]))
    assert s["floor_bytes_per_s"] == pytest.approx(s["bytes_moved"] / min(s["floor_seconds"]))
    assert s["floor_ratio"] == pytest.approx(s["floor_bytes_per_s"] / s["raw_ceiling_bytes_per_s"])
    assert s["ratio_to_floor"] == pytest.approx(s["throughput_bytes_per_s"] / s["floor_bytes_per_s"])
    assert s["throughput_bytes_per_s"] == pytest.approx(s["bytes_moved"] / min(s["into_seconds"]))
    assert s["alloc_throughput_bytes_per_s"] == pytest.approx(s["bytes_moved"] / min(s["alloc_seconds"]))
    assert s["ratio"] == pytest.approx(s["throughput_bytes_per_s"] / s["raw_ceiling_bytes_per_s"])
    assert s["alloc_ratio"] == pytest.approx(s["alloc_throughput_bytes_per_s"] / s["raw_ceiling_bytes_per_s"])
    assert s["alloc_ratio_to_floor"] == pytest.approx(
        s["alloc_throughput_bytes_per_s"] / s["floor_bytes_per_s"]
    )


@pytest.mark.slow
def test_the_allocation_before_each_allocated_stream_is_reported_beside_it(report: dict[str, Any]) -> None:
    s, config = report["stream"], report["config"]
    assert len(s["alloc_prepare_seconds"]) == config["repeat"]
    assert all(x > 0 for x in s["alloc_prepare_seconds"])


@pytest.mark.slow
def test_the_executor_time_is_part_of_each_stream_run(report: dict[str, Any]) -> None:
    s = report["stream"]
    assert all(0 < e <= w for e, w in zip(s["into_executor_seconds"], s["into_seconds"]))
    assert all(0 < e <= w for e, w in zip(s["alloc_executor_seconds"], s["alloc_seconds"]))


@pytest.mark.slow
def test_the_state_moves_half_over_the_network_and_half_locally(report: dict[str, Any]) -> None:
    # TP2 -> TP1 x DP2: each process keeps its half and receives the other one.
    s, config = report["stream"], report["config"]
    assert s["bytes_moved"] + s["bytes_local"] == 2 * config["state_bytes"]
    assert abs(s["bytes_moved"] - s["bytes_local"]) < 0.1 * config["state_bytes"]


@pytest.mark.slow
def test_layer_breakdown_covers_every_layer_and_every_byte(report: dict[str, Any]) -> None:
    layers = report["layers"]
    assert [row["layer"] for row in layers] == list(range(report["config"]["model"]["num_layers"] + 2))
    assert all(row["seconds"] > 0 and row["seconds_allocating"] > 0 for row in layers)
    assert sum(row["bytes_moved"] for row in layers) == report["stream"]["bytes_moved"]
    assert sum(row["bytes_local"] for row in layers) == report["stream"]["bytes_local"]
    assert max(row["rounds"] for row in layers) > 1, "the quick budget should split a layer into rounds"


@pytest.mark.slow
def test_shadow_preparation_leaves_the_loop_results_unchanged(report: dict[str, Any]) -> None:
    loop, config = report["loop"], report["config"]
    assert loop["results_unchanged"] is True
    assert len(loop["ratios"]) == len(loop["prepare_seconds"]) == config["loop_repeats"]
    assert all(0 < w <= p for w, p in zip(loop["world_build_seconds"], loop["prepare_seconds"]))
    assert loop["slowdown"] == pytest.approx(loop["median_ratio"] - 1.0)
    low, high = loop["ratio_quartiles"]
    assert min(loop["ratios"]) <= low <= loop["median_ratio"] <= high <= max(loop["ratios"])


@pytest.mark.slow
def test_checks_report_every_must_and_aim_with_its_numbers(report: dict[str, Any]) -> None:
    checks = [(c["level"], c["what"]) for c in report["checks"]]
    assert checks == [
        ("must", "bit-exact new shards"),
        ("must", "extra memory <= B + largest new layer shard"),
        ("aim", "stream into preallocated shards >= 90% of the floor"),
        ("aim", "stream into shards allocated during preparation >= 90% of the floor"),
        ("must", "shadow preparation leaves the loop's results unchanged"),
        ("aim", "shadow preparation slows the loop by < 1% (in 3 of 4 pairs)"),
    ]
    assert all(c["passed"] for c in report["checks"] if c["level"] == "must")
    assert report["ok"] is True
    assert all(c["detail"] for c in report["checks"])


@pytest.mark.slow
def test_send_copies_of_non_contiguous_slices_stay_within_their_budget(pp_report: dict[str, Any]) -> None:
    assert pp_report["stream"]["bit_exact"] is True
    assert pp_report["loop"] is None
    config = pp_report["config"]
    for m in pp_report["memory"]:
        assert 0 < m["peak_send_copy_bytes"] <= config["send_copy_budget_bytes"]
        # The copies live in the one buffer: no term beyond B + the largest new layer shard.
        assert m["buffer_bytes"] <= config["budget_bytes"]
        assert m["peak_extra_bytes"] <= config["budget_bytes"] + m["largest_new_layer_bytes"]
        assert m["within_bound"] is True


@pytest.mark.slow
def test_table_mode_prints_the_breakdown_and_the_checks(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--quick", "--size-mib", "8", "--repeat", "1", "--loop-steps", "0")
    assert stream_bench.run(_args(*argv)) == 0
    out = capsys.readouterr().out
    assert "raw send/recv ceiling" in out and "stream, preallocated" in out and "layer  rounds" in out
    assert "raw + local copies" in out
    assert "MUST PASS  bit-exact new shards" in out
    assert "MUST PASS  extra memory <= B + largest new layer shard" in out


# -- the pieces, without processes ---------------------------------------------------------------------


@pytest.mark.parametrize("mib", [8, 100, 1024])
def test_synthetic_model_hits_the_requested_size_within_one_vocabulary_row(mib: int) -> None:
    target = mib * workload.MIB
    model = workload.synthetic_model(target)
    size = workload.state_bytes(model)
    row = workload.state_bytes(msgspec.structs.replace(model, vocab_size=model.vocab_size + 1)) - size
    assert size <= target < size + row
    assert model.hidden_size % workload.HIDDEN_STEP == 0


def test_decoder_layers_hold_most_of_the_synthetic_state() -> None:
    model = workload.synthetic_model(1024 * workload.MIB)
    tensors = model.tensors(optimizer=True)
    in_layers = sum(t.nbytes for t in tensors if 1 <= t.layer <= model.num_layers)
    assert in_layers > 0.9 * workload.state_bytes(model)


def test_a_box_of_content_is_that_slice_of_the_whole_tensor() -> None:
    """What makes the checksum check sound: a process computes another process's slice by itself."""
    model = workload.synthetic_model(8 * workload.MIB)
    for ti, t in enumerate(model.tensors(optimizer=True)[:8]):
        whole = workload.box_content(ti, t, tuple((0, n) for n in t.shape))
        for tp_rank in range(2):
            shard = tp_shard(t, model, 2, tp_rank)
            assert shard.box is not None
            part = workload.box_content(ti, t, shard.box)
            assert torch.equal(part, whole[tuple(slice(lo, hi) for lo, hi in shard.box)]), t.name


def test_content_differs_between_tensors_and_elements() -> None:
    model = workload.synthetic_model(8 * workload.MIB)
    tensors = model.tensors(optimizer=True)
    ti = next(
        i for i, t in enumerate(tensors) if t.name.endswith("linear_fc1.weight") and t.role == "exp_avg"
    )
    box = ((0, 64), (0, 48))
    a = workload.box_content(ti, tensors[ti], box)
    b = workload.box_content(ti + 1, tensors[ti + 1], box)
    assert a.unique().numel() > 0.9 * a.numel()
    assert not torch.equal(a, b.to(a.dtype))


@pytest.mark.parametrize("mib", [0.0625, 1, 64, 4096])
def test_message_split_leaves_room_for_staging_beside_two_pieces(mib: float) -> None:
    budget = int(mib * workload.MIB)
    copies, message = workload.message_split(budget)
    assert copies == 2 * message <= budget // 4
    assert message >= 8 and message % 8 == 0
    assert message <= workload.MAX_MESSAGE_BYTES


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (("--size-mib", "0"), "--size-mib"),
        (("--size-mib", "1"), "--size-mib"),  # below the smallest synthetic model
        (("--budget-mib", "0.01"), "--budget-mib"),
        (("--repeat", "0"), "--repeat"),
        (("--loop-repeats", "0"), "--loop-repeats"),
        (("--loop-steps", "-1"), "--loop-steps"),
        (("--procs", "5"), "--procs"),
        (("--procs", "3"), "--procs"),  # tp-to-dp needs an even count
        (("--timeout", "0"), "--timeout"),
        (("--model", "tiny-gpt", "--size-mib", "8"), "--size-mib"),
        (("--model", "no-such-model"), "no-such-model"),
    ],
)
def test_bad_options_are_rejected_naming_the_option(argv: tuple[str, ...], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        stream_bench.run(_args("--quick", *argv))


def test_pp_to_tp_accepts_three_processes() -> None:
    old, new = workload.reshape_layouts("pp-to-tp", 3)
    assert (old.pp, new.tp) == (3, 3)


def _fails_on_rank_one(rank: int, size: int) -> int:
    if rank == 1:
        raise RuntimeError("synthetic failure in a worker")
    return rank


@pytest.mark.slow
def test_a_failing_worker_is_reported_by_its_process_number() -> None:
    with pytest.raises(ProcsError, match=r"process 1 raised(.|\n)*synthetic failure in a worker"):
        run_procs(_fails_on_rank_one, 2, timeout_s=60)


@pytest.fixture(scope="module")
def dist_report() -> dict[str, Any]:
    """TP1 x DP2 -> TP2 with the distributed optimizer, of a preset's state: the old ranks each own half
    of the master weights and moments, which reach the new ranks piece by piece."""
    argv = ("--model", "tiny-gpt", "--distributed-optimizer", "--reshape", "dp-to-tp")
    rc, out = _run_json(*argv, "--repeat", "1", "--loop-steps", "0")
    assert rc == 0
    return json.loads(out)


@pytest.mark.slow
def test_the_distributed_optimizers_pieces_arrive_bit_exact(dist_report: dict[str, Any]) -> None:
    from liver.reshard.holdings import holding, is_dp_sharded
    from liver.shared.layout import ParallelLayout

    model = msgspec.convert(dist_report["config"]["model"], ModelGeometry)
    assert model.name == "tiny-gpt" and model.distributed
    stream = dist_report["stream"]
    assert stream["bit_exact"] is True and stream["mismatched"] == []
    old = ParallelLayout.parse(dist_report["config"]["old_layout"])
    sharded = [t for t in model.tensors(optimizer=True) if is_dp_sharded(t, model)]
    split = [t for t in sharded if all(holding(t, model, old, r) for r in (0, 1))]
    assert sharded and split  # the two old ranks own parts of the same tensor
