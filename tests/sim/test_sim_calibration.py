"""The calibration file: strict to read, every number with a source, and the derived numbers follow
from the paper's constants as their sources say."""

from __future__ import annotations

import json

import pytest

from liver.services.topology.memory import stage_state_bytes
from liver.shared.layout import ParallelLayout
from liver.sim.calibration import CalibrationError, bundled_profiles, load_calibration, with_overrides
from liver.sim.models import GPT_14B, GPT_20B
from liver.sim.reproduce import fit_storage_aggregate
from liver.sim.transitions import TransitionPlanner


def _profile_dict() -> dict:
    from importlib.resources import files

    return json.loads((files("liver.sim") / "profiles" / "paper-a800.json").read_text())


def test_the_paper_profile_is_bundled_and_loads() -> None:
    assert "paper-a800" in bundled_profiles()
    assert load_calibration().name == "paper-a800"


def test_a_file_without_a_source_for_a_number_is_rejected(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = _profile_dict()
    del data["sources"]["switch_s"]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="no source given for switch_s"):
        load_calibration(str(path))


def test_a_wrongly_typed_field_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = _profile_dict()
    data["switch_s"] = "fast"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match=r"\$\.switch_s"):
        load_calibration(str(path))


def test_a_negative_duration_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = _profile_dict()
    data["hardware"]["inter_node_bandwidth"] = -1
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="inter_node_bandwidth"):
        load_calibration(str(path))


def test_an_unknown_profile_lists_the_bundled_ones() -> None:
    with pytest.raises(CalibrationError, match="bundled: paper-a800"):
        load_calibration("nonexistent")


def test_overrides_are_validated_like_a_file() -> None:
    with pytest.raises(CalibrationError, match="checkpoint_interval_s"):
        with_overrides(load_calibration(), checkpoint_interval_s=-1.0)


def test_storage_bandwidth_reproduces_table_1s_checkpoint_load() -> None:
    cal = load_calibration()
    stages = stage_state_bytes(GPT_20B, cal.setup, ParallelLayout(4, 4, 2))
    biggest = max(state for state, _grad in stages)
    total = sum(state for state, _grad in stages) * 4 * 2
    assert cal.load_s(biggest, total) == pytest.approx(54.6, abs=0.01)


def test_init_reproduces_table_1_at_32_ranks_and_section_7s_growth() -> None:
    cal = load_calibration()
    assert cal.init_s(32) == pytest.approx(70.1, abs=0.01)
    assert cal.init_s(1024) - cal.init_s(32) == pytest.approx(90 - 60, abs=0.01)


def test_the_aggregate_storage_bandwidth_is_the_figure_11_fit() -> None:
    cal = load_calibration()
    assert fit_storage_aggregate(cal) == pytest.approx(cal.storage_bw_aggregate, rel=1e-3)


def test_a_restart_on_the_testbed_is_limited_by_each_rank_not_by_the_storage() -> None:
    cal = load_calibration()
    planner = TransitionPlanner(GPT_14B, cal)
    tr = planner.transition(None, 0, 0, 4)
    per_rank = tr.load_max_rank_bytes / cal.storage_bw_per_device
    assert cal.load_s(tr.load_max_rank_bytes, tr.load_total_bytes) == pytest.approx(per_rank)
