"""The real-workers chaos run's check on each worker's iterations: they never go back, but a recovery
whose lost worker died in its copy's refresh trains the old generation's last step again, once."""

from __future__ import annotations

import json
from pathlib import Path

from liver.chaos.checker import Invariant
from liver.chaos.real import check_real


def metrics(tmp_path: Path, steps: list[tuple[int, int]]) -> Path:
    lines = [json.dumps({"kind": "step", "generation": g, "iteration": i}) for g, i in steps]
    (tmp_path / "w-node000-0.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def iteration_violations(tmp_path: Path, steps: list[tuple[int, int]]) -> list[str]:
    found = check_real([], [], [], metrics(tmp_path, steps), {})
    return [v.detail for v in found if v.invariant is Invariant.ITERATIONS]


def test_iterations_that_only_go_forward_pass(tmp_path: Path) -> None:
    assert iteration_violations(tmp_path, [(0, 1), (0, 2), (1, 3), (1, 4)]) == []


def test_a_new_generation_may_train_the_last_step_again(tmp_path: Path) -> None:
    assert iteration_violations(tmp_path, [(0, 1), (0, 2), (1, 2), (1, 3)]) == []


def test_a_step_repeated_within_one_generation_is_a_violation(tmp_path: Path) -> None:
    assert iteration_violations(tmp_path, [(0, 1), (0, 2), (0, 2)])


def test_going_back_more_than_the_last_step_is_a_violation(tmp_path: Path) -> None:
    assert iteration_violations(tmp_path, [(0, 1), (0, 2), (0, 3), (1, 2)])
