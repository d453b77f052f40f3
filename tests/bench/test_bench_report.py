"""The checks every benchmark shares: one struct whose JSON keeps each benchmark's fields, one line format."""

from __future__ import annotations

import msgspec
import pytest

from liver.bench.report import Check, check_line, musts_passed, size


def test_a_check_leaves_out_the_scope_it_does_not_have() -> None:
    plain = Check(level="must", what="w", passed=True, detail="d")
    plan = Check(scenario="tp-change", level="aim", what="w", passed=False, detail="d")
    bus = Check(workers=64, level="must", what="w", passed=True, detail="d")
    assert msgspec.json.encode(plain) == b'{"level":"must","what":"w","passed":true,"detail":"d"}'
    assert msgspec.json.encode(plan) == (
        b'{"scenario":"tp-change","level":"aim","what":"w","passed":false,"detail":"d"}'
    )
    assert msgspec.json.encode(bus) == b'{"workers":64,"level":"must","what":"w","passed":true,"detail":"d"}'
    for c in (plain, plan, bus):
        assert msgspec.json.decode(msgspec.json.encode(c), type=Check) == c


def test_a_check_line_names_its_verdict_and_its_scope() -> None:
    assert check_line(Check(level="must", what="bit-exact", passed=True, detail="0 mismatches")) == (
        "MUST PASS  bit-exact  (0 mismatches)"
    )
    assert check_line(
        Check(scenario="scale-in", level="aim", what="plan < 0.1 s", passed=False, detail="x")
    ) == ("AIM  FAIL  scale-in: plan < 0.1 s  (x)")
    assert check_line(
        Check(workers=8, level="must", what="every event committed", passed=True, detail="y")
    ) == ("MUST PASS  8 workers: every event committed  (y)")


def test_only_musts_decide() -> None:
    aim_failed = Check(level="aim", what="a", passed=False, detail="")
    must_held = Check(level="must", what="m", passed=True, detail="")
    must_failed = Check(level="must", what="m", passed=False, detail="")
    assert musts_passed([aim_failed, must_held])
    assert not musts_passed([must_held, must_failed])
    assert musts_passed([])


@pytest.mark.parametrize(
    ("n", "digits", "text"),
    [
        (0, 1, "0 B"),
        (1023, 1, "1,023 B"),
        (1024, 2, "1.00 KiB"),
        (3 * 2**20 // 2, 1, "1.5 MiB"),
        (-(2**30), 2, "-1.00 GiB"),
        (5 * 2**40, 1, "5.0 TiB"),
    ],
)
def test_sizes_take_the_largest_binary_unit_they_reach(n: float, digits: int, text: str) -> None:
    assert size(n, digits) == text
