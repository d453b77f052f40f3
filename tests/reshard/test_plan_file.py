"""Plan files: written, read back, and rejected when inconsistent."""

import msgspec
import pytest

from liver.reshard.plan import WorldConfig
from liver.reshard.plan_file import PlanFileError, decode_plan, encode_plan, read_plan, write_plan
from liver.reshard.planner import build_plan, default_world
from liver.shared.layout import ParallelLayout, Placement, default_devices
from liver.shared.model import PRESETS


@pytest.fixture(scope="module")
def plan():
    old = default_world(ParallelLayout(2, 2, 1))
    return build_plan(
        PRESETS["tiny-llama"], old, WorldConfig(ParallelLayout(1, 1, 2), Placement(default_devices(2)))
    )


def test_a_written_plan_reads_back_equal(plan, tmp_path):
    path = tmp_path / "plan.json"
    write_plan(plan, str(path))
    assert read_plan(str(path)) == plan


def test_the_file_lists_each_ranks_boxes(plan):
    doc = msgspec.json.decode(encode_plan(plan))
    assert len(doc["old"]["ranks"]) == 4 and len(doc["new"]["ranks"]) == 2
    first = doc["new"]["ranks"][0]["shards"][0]
    assert len(first) == 3  # [tensor index, box, local shape]


def test_a_field_of_the_wrong_type_is_named(plan):
    doc = msgspec.json.decode(encode_plan(plan))
    doc["budget_bytes"] = "lots"
    with pytest.raises(PlanFileError, match=r"budget_bytes"):
        decode_plan(msgspec.json.encode(doc))


def test_boxes_that_disagree_with_the_view_function_are_rejected(plan):
    doc = msgspec.json.decode(encode_plan(plan))
    doc["new"]["layout"]["tp"] = 2
    doc["new"]["layout"]["dp"] = 1
    with pytest.raises(PlanFileError, match=r"new\.ranks\[0\]\.shards"):
        decode_plan(msgspec.json.encode(doc))


def test_not_json_is_a_clear_error():
    with pytest.raises(PlanFileError, match="not valid JSON"):
        decode_plan(b"{nope")


def test_an_unknown_schema_version_is_refused(plan):
    doc = msgspec.json.decode(encode_plan(plan))
    doc["schema_version"] = 99
    with pytest.raises(PlanFileError, match="schema_version"):
        decode_plan(msgspec.json.encode(doc))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(PlanFileError, match="cannot read"):
        read_plan(str(tmp_path / "absent.json"))
