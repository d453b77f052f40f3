"""Capacity traces: generated regimes are reproducible and possible; CSV traces are read strictly, every
error naming its line and field."""

from __future__ import annotations

import statistics

import pytest

from liver.sim.trace import (
    REGIMES,
    CapacityEvent,
    Trace,
    TraceError,
    generate,
    initial_nodes,
    parse_csv,
    read_csv,
    to_csv,
)

HOURS = 3600.0


def _regime(seed: int, regime: str = "high", arrivals: str = "poisson") -> Trace:
    return generate(
        mean_interval_s=REGIMES[regime],
        duration_s=8 * HOURS,
        nodes=4,
        min_nodes=2,
        max_nodes=4,
        notice_s=120.0,
        seed=seed,
        devices_per_node=8,
        arrivals=arrivals,  # type: ignore[arg-type]
    )


def _parse(body: str, duration: float = 8 * HOURS) -> Trace:
    return parse_csv(
        "time,node,kind,notice\n" + body, initial=initial_nodes(4), devices_per_node=8, duration_s=duration
    )


def test_a_seed_gives_the_same_trace_every_time() -> None:
    assert _regime(7) == _regime(7)


def test_different_seeds_give_different_traces() -> None:
    assert _regime(7).events != _regime(8).events


def test_generated_node_count_stays_within_the_band() -> None:
    for seed in range(10):
        trace = _regime(seed)
        held = set(trace.initial_nodes)
        order = sorted(trace.events, key=lambda e: e.effect_time)
        for ev in order:
            if ev.kind == "add":
                held.add(ev.node)
            else:
                held.remove(ev.node)
            assert 2 <= len(held) <= 4


@pytest.mark.parametrize("arrivals", ["poisson", "uniform"])
def test_regimes_average_their_mean_interval(arrivals: str) -> None:
    for regime, mean in REGIMES.items():
        counts = [len(_regime(seed, regime, arrivals).events) for seed in range(30)]
        expected = 8 * HOURS / mean
        assert abs(statistics.mean(counts) - expected) < 0.15 * expected + 1


def test_removals_carry_the_notice_and_additions_take_effect_at_once() -> None:
    trace = _regime(3)
    assert {e.notice for e in trace.events if e.kind == "remove"} == {120.0}
    assert {e.notice for e in trace.events if e.kind == "add"} == {0.0}


def test_csv_round_trip_keeps_every_event() -> None:
    trace = _regime(5)
    again = _parse(to_csv(trace.events).split("\n", 1)[1])
    assert [(e.time, e.node, e.kind, e.notice) for e in again.events] == [
        (e.time, e.node, e.kind, e.notice) for e in trace.events
    ]


def test_comments_and_blank_lines_are_skipped() -> None:
    trace = _parse("# a spot reclaim\n\n600,node003,remove,120\n")
    assert trace.events == (CapacityEvent(600.0, "node003", "remove", 120.0, line=4),)


@pytest.mark.parametrize(
    ("body", "line", "field"),
    [
        ("600,node003,remove\n", 2, None),
        ("abc,node003,remove,120\n", 2, "time"),
        ("600,node003,remove,-5\n", 2, "notice"),
        ("600,node003,reclaim,120\n", 2, "kind"),
        ("600,node003,remove,inf\n", 2, "notice"),
        ("600,node009,remove,120\n", 2, "node"),
        ("600,node001,add,0\n", 2, "node"),
        ("600,node003,remove,120\n300,node002,remove,120\n", 3, "time"),
        ("600,node003,remove,120\n900,node003,remove,120\n", 3, "node"),
        ("30000,node003,remove,120\n", 2, "time"),
        ("600,,remove,120\n", 2, "node"),
    ],
)
def test_a_bad_row_names_its_line_and_field(body: str, line: int, field: str | None) -> None:
    with pytest.raises(TraceError) as err:
        _parse(body)
    text = str(err.value)
    assert f"line {line}" in text
    if field:
        assert f"field '{field}'" in text


def test_a_wrong_header_is_rejected_with_its_line() -> None:
    with pytest.raises(TraceError, match=r"line 1: expected the header time,node,kind,notice"):
        parse_csv("t,n,k\n", initial=initial_nodes(4), devices_per_node=8, duration_s=HOURS)


def test_a_missing_file_is_reported_by_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = tmp_path / "none.csv"
    with pytest.raises(TraceError, match="cannot read trace"):
        read_csv(missing, initial=initial_nodes(4), devices_per_node=8, duration_s=HOURS)


def test_a_node_added_then_removed_is_possible() -> None:
    trace = _parse("100,node004,add,0\n200,node004,remove,120\n")
    assert [e.kind for e in trace.events] == ["add", "remove"]


def test_generation_refuses_a_band_that_allows_no_event() -> None:
    with pytest.raises(TraceError, match="no event can change the capacity"):
        generate(
            mean_interval_s=600,
            duration_s=HOURS,
            nodes=4,
            min_nodes=4,
            max_nodes=4,
            notice_s=120,
            seed=0,
            devices_per_node=8,
        )
