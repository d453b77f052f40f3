"""``liver sim``: the subcommands run end to end, print JSON that adds up, and report bad input by name."""

from __future__ import annotations

import argparse
import json

import pytest

from liver.sim.cli import add_parser


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="liver")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


SMALL = ["--hours", "2", "--regime", "high", "--seed", "3"]


def test_run_prints_every_policy_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["sim", "run", *SMALL, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in out["policies"]] == ["megatron", "ucp", "liver"]
    for p in out["policies"]:
        assert 0 <= p["efficiency"] <= 1
        assert sum(p["event_outcomes"].values()) == out["events"]
        parts = p["useful_gpu_hours"] + p["downtime_gpu_hours"] + p["lost_gpu_hours"] + p["idle_gpu_hours"]
        assert parts == pytest.approx(p["allocated_gpu_hours"])


def test_a_mixture_of_experts_is_simulated_with_expert_parallel_layouts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _run(["sim", "run", *SMALL, "--model", "mixtral-8x7b", "--nodes", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    liver = next(p for p in out["policies"] if p["policy"] == "liver")
    assert sum(liver["event_outcomes"].values()) == out["events"] > 0
    assert liver["efficiency"] > max(p["efficiency"] for p in out["policies"] if p["policy"] != "liver")


def test_a_written_trace_replays_to_the_same_results(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "trace.csv"
    assert _run(["sim", "trace", *SMALL, "--out", str(path)]) == 0
    capsys.readouterr()
    _run(["sim", "run", *SMALL, "--json"])
    generated = json.loads(capsys.readouterr().out)["policies"]
    _run(["sim", "run", "--hours", "2", "--trace", str(path), "--json"])
    replayed = json.loads(capsys.readouterr().out)["policies"]
    for g, r in zip(generated, replayed, strict=True):
        assert r["efficiency"] == pytest.approx(g["efficiency"], rel=1e-9)
        assert r["reconfigurations"] == g["reconfigurations"]


def test_a_bad_trace_row_is_an_error_naming_line_and_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.csv"
    path.write_text("time,node,kind,notice\n600,node003,remove,soon\n")
    with pytest.raises(ValueError, match=r"line 2, field 'notice'"):
        _run(["sim", "run", "--trace", str(path)])


def test_an_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown policy 'checkpoint'"):
        _run(["sim", "run", *SMALL, "--policies", "megatron,checkpoint"])


def test_bad_numbers_name_their_flag() -> None:
    with pytest.raises(ValueError, match="--hours"):
        _run(["sim", "run", "--hours", "0"])


def test_plots_are_written(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert _run(["sim", "run", *SMALL, "--policies", "megatron,liver", "--plots", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    for name in ("wasted.png", "event-downtime.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
