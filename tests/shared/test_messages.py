"""Bus messages: every type survives encode/decode, and every kind of bad input is named by field."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from typing import Any

import msgspec
import pytest

from liver.chaos.samples import NEW, NEW_PLACEMENT, NOW, OLD, OLD_PLACEMENT, SLICES, samples
from liver.shared import messages as m
from liver.shared.codec import ERROR_PAYLOAD_LIMIT, MessageError, decode, encode, error_event
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.model import PRESETS


def payload(msg: m.Message, **changes: Any) -> bytes:
    """The message's JSON with fields replaced (``None`` deletes a field): a hand-made bad publisher."""
    obj = json.loads(encode(msg))
    for key, value in changes.items():
        if value is None:
            obj.pop(key)
        else:
            obj[key] = value
    return json.dumps(obj).encode()


def rejected(data: bytes | str, into: Any) -> MessageError:
    with pytest.raises(MessageError) as info:
        decode(data, into)
    return info.value


def rejection_event(data: bytes) -> m.ErrorEvent:
    """What the ingester would publish for ``data`` arriving on ``spot.warning``."""
    return error_event(
        source="ingester", subject="spot.warning", data=data, error=rejected(data, m.SpotWarning)
    )


SPOT = samples()[m.SpotWarning]
SCALE = samples()[m.ScaleRequest]


# -- round trips --------------------------------------------------------------------------------------


def test_every_message_type_has_a_sample() -> None:
    assert set(samples()) == set(m.MESSAGE_TYPES)


@pytest.mark.parametrize("kind", m.MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_every_message_survives_encode_then_decode(kind: type[m.Message]) -> None:
    msg = samples()[kind]
    assert decode(encode(msg), kind) == msg


@pytest.mark.parametrize("kind", m.MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_every_message_is_told_apart_by_its_kind_in_the_bus_union(kind: type[m.Message]) -> None:
    msg = samples()[kind]
    assert decode(encode(msg), m.BusMessage) == msg


@pytest.mark.parametrize("kind", m.MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_every_message_carries_its_schema_version_and_job(kind: type[m.Message]) -> None:
    obj = json.loads(encode(samples()[kind]))
    assert obj["schema_version"] == m.SCHEMA_VERSION
    assert "job_id" in obj
    assert "event_id" in obj or "generation" in obj


def test_worker_commands_decode_to_their_own_kind() -> None:
    for kind in (m.Prepare, m.Switch, m.Abort):
        assert type(decode(encode(samples()[kind]), m.WorkerCommand)) is kind


def test_a_publisher_outside_liver_may_leave_out_the_kind_of_a_single_type_subject() -> None:
    assert decode(payload(SPOT, kind=None), m.SpotWarning) == SPOT


def test_a_deadline_in_another_timezone_means_the_same_instant() -> None:
    data = payload(SPOT, deadline="2026-01-02T05:04:05+02:00")
    assert decode(data, m.SpotWarning).deadline == NOW


# -- each kind of bad input names its field -------------------------------------------------------------


def test_malformed_json_is_rejected_at_the_root() -> None:
    error = rejected(b'{"job_id": "job-1",', m.SpotWarning)
    assert error.path == "$"
    assert "malformed JSON" in error.reason


def test_a_payload_that_is_not_an_object_is_rejected_at_the_root() -> None:
    error = rejected(b"[1, 2]", m.SpotWarning)
    assert (error.path, error.reason) == ("$", "Expected `object`, got `array`")


def test_a_wrong_type_names_the_field() -> None:
    error = rejected(payload(SPOT, node=7), m.SpotWarning)
    assert (error.path, error.reason) == ("$.node", "Expected `str`, got `int`")
    assert "$.node" in str(error)


def test_a_missing_field_names_the_field() -> None:
    error = rejected(payload(SPOT, node=None), m.SpotWarning)
    assert error.path == "$.node"
    assert "missing required field" in error.reason


def test_an_unknown_field_names_the_field() -> None:
    error = rejected(payload(SPOT, zone="us-east-1a"), m.SpotWarning)
    assert error.path == "$.zone"
    assert "unknown field" in error.reason


def test_an_unknown_field_inside_a_nested_value_names_its_full_path() -> None:
    data = payload(SCALE, add=[{"node": "node002", "devices": [0], "zone": "b"}])
    assert rejected(data, m.ScaleRequest).path == "$.add[0].zone"


def test_another_schema_version_is_refused_before_any_other_field() -> None:
    data = payload(SPOT, schema_version=m.SCHEMA_VERSION + 1, brand_new_field=True)
    error = rejected(data, m.SpotWarning)
    assert error.path == "$.schema_version"
    assert f"unsupported schema version {m.SCHEMA_VERSION + 1}" in error.reason


def test_a_version_1_message_is_read_as_the_current_version() -> None:
    decoded = decode(payload(SPOT, schema_version=1), m.SpotWarning)
    assert decoded.schema_version == m.SCHEMA_VERSION


def test_a_layout_with_experts_and_context_parallelism_travels_on_the_bus() -> None:
    layout = ParallelLayout.parse("TP2,PP1,DP4,CP2,EP4,ETP1")
    assert msgspec.json.decode(msgspec.json.encode(layout), type=ParallelLayout) == layout


def test_a_missing_schema_version_is_refused() -> None:
    assert rejected(payload(SPOT, schema_version=None), m.SpotWarning).path == "$.schema_version"


@pytest.mark.parametrize("bad", ["", "job 1", "job.1", "job*", "job>", "jöb", "j" * 129])
def test_an_id_that_is_not_token_safe_is_refused(bad: str) -> None:
    error = rejected(payload(SPOT, job_id=bad), m.SpotWarning)
    assert error.path == "$.job_id"
    assert "token-safe id" in error.reason


@pytest.mark.parametrize("field", ["job_id", "event_id", "node", "provider"])
def test_an_id_ending_in_a_newline_is_refused_at_its_field(field: str) -> None:
    # Python's `$` matches before a final newline; msgspec checks patterns with re.search.
    error = rejected(payload(SPOT, **{field: "fuzz\n"}), m.SpotWarning)
    assert error.path == f"$.{field}"


def test_json_nested_deeper_than_the_stack_is_malformed_json_at_the_root() -> None:
    deep = b'{"schema_version": 2, "job_id": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for data in (deep, b'{"a":' * 5000 + b"1" + b"}" * 5000):
        error = rejected(data, m.SpotWarning)
        assert (error.path, error.reason) == ("$", "malformed JSON: nested too deeply")
        event = rejection_event(data)
        assert event.field == "$" and event.job_id is None


@pytest.mark.parametrize("notice", [1e12, 1.79e308])
def test_a_notice_beyond_a_year_is_refused(notice: float) -> None:
    error = rejected(payload(SPOT, notice_s=notice), m.SpotWarning)
    assert error.path == "$.notice_s"


@pytest.mark.parametrize("index", [2**64, 65_536, 2**31])
def test_a_device_index_beyond_any_node_is_refused(index: int) -> None:
    data = payload(SCALE, add=[{"node": "node002", "devices": [0, index]}])
    assert rejected(data, m.ScaleRequest).path == "$.add[0].devices[1]"


def test_a_device_index_given_as_a_float_is_refused() -> None:
    data = payload(SCALE, add=[{"node": "node002", "devices": [1e23]}])
    assert rejected(data, m.ScaleRequest).path == "$.add[0].devices[0]"


def test_a_resize_on_an_internal_subject_with_an_absurd_device_index_is_refused() -> None:
    sample = samples()[m.ResizeRequested]
    data = payload(sample, add=[{"node": "node0", "index": 99999999999999999999999}])
    assert rejected(data, m.ResizeRequested).path == "$.add[0].index"


@pytest.mark.parametrize("target", [2**63 - 1, m.MAX_DEVICES + 1])
def test_a_target_beyond_any_job_is_refused(target: int) -> None:
    data = payload(SCALE, add=[], remove=[], target_devices=target)
    assert rejected(data, m.ScaleRequest).path == "$.target_devices"


def test_a_layout_beyond_any_world_is_refused() -> None:
    sample = samples()[m.TopologyRequest]
    bad = json.loads(encode(sample))
    bad["layout"]["dp"] = 2**40
    assert rejected(json.dumps(bad).encode(), m.TopologyRequest).path.startswith("$.layout")


def test_a_negative_notice_is_refused() -> None:
    error = rejected(payload(SPOT, notice_s=-1), m.SpotWarning)
    assert (error.path, error.reason) == ("$.notice_s", "Expected `float` >= 0.0")


def test_a_target_of_zero_devices_is_refused() -> None:
    data = payload(SCALE, add=[], remove=[], target_devices=0)
    assert rejected(data, m.ScaleRequest).path == "$.target_devices"


def test_a_deadline_without_a_timezone_is_refused() -> None:
    error = rejected(payload(SPOT, deadline="2026-01-02T03:04:05"), m.SpotWarning)
    assert error.path == "$.deadline"
    assert "timezone" in error.reason


def test_a_message_of_another_kind_is_refused_by_its_kind() -> None:
    assert rejected(encode(SCALE), m.SpotWarning).path == "$.kind"


def test_an_unknown_worker_command_is_refused_by_its_kind() -> None:
    data = payload(samples()[m.Switch], kind="reboot")
    error = rejected(data, m.WorkerCommand)
    assert error.path == "$.kind"
    assert error.expected == "Prepare | Switch | Abort"


def test_a_worker_command_without_its_kind_is_refused() -> None:
    assert rejected(payload(samples()[m.Switch], kind=None), m.WorkerCommand).path == "$.kind"


def test_an_impossible_nested_layout_names_the_layout() -> None:
    data = payload(samples()[m.Prepare], layout={"tp": 0, "pp": 1, "dp": 1})
    error = rejected(data, m.Prepare)
    assert error.path == "$.layout"
    assert "tp must be at least 1" in error.reason


# -- checks across fields ---------------------------------------------------------------------------


def test_a_prepare_whose_lost_device_is_not_in_the_old_world_is_refused() -> None:
    data = payload(samples()[m.Prepare], lost=[{"node": "node009", "index": 0}])
    error = rejected(data, m.Prepare)
    assert error.path == "$.lost[0]" and "not in the old world" in error.reason


def test_a_prepare_whose_lost_device_the_new_world_uses_is_refused() -> None:
    data = payload(samples()[m.Prepare], lost=[{"node": "node000", "index": 0}])
    assert rejected(data, m.Prepare).path == "$.lost[0]"


def test_a_prepare_with_a_slice_count_other_than_the_two_worlds_devices_is_refused() -> None:
    data = payload(
        samples()[m.Prepare], slices={"bucket": "liver-plans", "prefix": "job-1/1/s1-", "count": 6}
    )
    error = rejected(data, m.Prepare)
    assert error.path == "$.slices.count" and "8 devices" in error.reason


def test_a_slice_index_names_each_device_by_its_index() -> None:
    assert SLICES.name(0) == "job-1/1/s1-00000" and SLICES.names()[-1] == "job-1/1/s1-00007"
    with pytest.raises(ValueError, match="`index`"):
        SLICES.name(8)


def test_a_slice_is_a_key_value_entry_with_a_dotted_key_unless_listed_as_an_object() -> None:
    index = m.SliceIndex(
        bucket="liver-plans", prefix="job-1/3/s7-", count=4, kv_bucket="liver-slices", objects=(2,)
    )
    assert index.location(0) == m.SliceLocation("kv", "liver-slices", "job-1.3.s7.00000")
    assert index.location(2) == m.SliceLocation("object", "liver-plans", "job-1/3/s7-00002")
    assert index.object_names() == ("job-1/3/s7-00002",) and index.kv_keys_pattern() == "job-1.3.s7.*"
    assert SLICES.location(3).store == "object", "without a key-value bucket every slice is an object"


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        pytest.param({"prefix": "job-1//s7-"}, "$.slices.prefix", id="empty-key-token"),
        pytest.param({"objects": [3, 1]}, "$.slices.objects[1]", id="objects-out-of-order"),
        pytest.param({"objects": [8]}, "$.slices.objects[0]", id="object-index-past-the-count"),
        pytest.param({"kv_bucket": None, "objects": [1]}, "$.slices.objects", id="objects-without-a-bucket"),
    ],
)
def test_a_bad_slice_index_is_refused_naming_the_field(fields: dict[str, object], path: str) -> None:
    slices = {"bucket": "liver-plans", "prefix": "job-1/1/s1-", "count": 8, "kv_bucket": "liver-slices"}
    slices.update(fields)
    assert rejected(payload(samples()[m.Prepare], slices=slices), m.Prepare).path == path


def test_a_spot_warning_needs_a_notice_or_a_deadline() -> None:
    error = rejected(payload(SPOT, notice_s=None, deadline=None), m.SpotWarning)
    assert error.path == "$.notice_s"


def test_a_scale_request_gives_nodes_or_a_target_not_both() -> None:
    error = rejected(payload(SCALE, target_devices=8), m.ScaleRequest)
    assert error.path == "$.target_devices"
    assert "exactly one" in error.reason


def test_a_node_cannot_be_added_and_removed_at_once() -> None:
    data = payload(SCALE, remove=["node002"])
    assert rejected(data, m.ScaleRequest).path == "$.remove[0]"


def test_an_added_node_cannot_list_a_device_twice() -> None:
    data = payload(SCALE, add=[{"node": "node002", "devices": [0, 0]}])
    assert rejected(data, m.ScaleRequest).path == "$.add[0].devices"


def test_a_device_with_a_bad_node_id_names_its_position() -> None:
    resize = samples()[m.ResizeRequested]
    data = payload(resize, add=[{"node": "node 2", "index": 0}])
    error = rejected(data, m.ResizeRequested)
    assert error.path == "$.add[0].node"


def test_a_device_cannot_both_stay_and_go() -> None:
    resize = samples()[m.ResizeRequested]
    data = payload(resize, remove=[{"node": "node000", "index": 0}])
    assert rejected(data, m.ResizeRequested).path == "$.remove[0]"


def test_a_placement_must_fit_its_layout() -> None:
    committed = samples()[m.GenerationCommitted]
    data = payload(committed, placement={"devices": [{"node": "node000", "index": 0}]})
    error = rejected(data, m.GenerationCommitted)
    assert error.path == "$.placement"
    assert "needs 6 devices" in error.reason


def test_a_new_generation_must_come_after_the_old_one() -> None:
    data = payload(samples()[m.GenerationCommitted], generation=0)
    assert rejected(data, m.GenerationCommitted).path == "$.generation"


def test_a_failed_worker_must_say_what_failed() -> None:
    data = payload(samples()[m.WorkerStatus], phase="failed")
    assert rejected(data, m.WorkerStatus).path == "$.error"


def test_only_a_failed_worker_can_say_it_falls_back() -> None:
    data = payload(samples()[m.WorkerStatus], falling_back=True)
    assert rejected(data, m.WorkerStatus).path == "$.falling_back"


def test_keeping_the_old_world_names_no_checkpoint() -> None:
    data = payload(samples()[m.GenerationAborted], checkpoint="/ckpt/step-1000")
    assert rejected(data, m.GenerationAborted).path == "$.checkpoint"


def test_a_checkpoint_fallback_may_name_its_checkpoint() -> None:
    data = payload(
        samples()[m.GenerationAborted], outcome="checkpoint_fallback", checkpoint="/ckpt/step-1000"
    )
    assert decode(data, m.GenerationAborted).checkpoint == "/ckpt/step-1000"


def test_cross_field_checks_also_guard_construction_in_python() -> None:
    with pytest.raises(ValueError, match="notice_s"):
        m.SpotWarning(job_id="job-1", event_id="evt-1", node="n", provider="aws")


def test_decode_refuses_a_type_that_is_not_a_bus_message() -> None:
    with pytest.raises(TypeError):
        decode(b"{}", ParallelLayout)


# -- behaviour of individual messages -------------------------------------------------------------------


def test_the_earlier_of_notice_and_deadline_is_the_effective_deadline() -> None:
    warning = m.SpotWarning(
        job_id="job-1", event_id="evt-1", node="n", provider="gcp", notice_s=30, deadline=NOW
    )
    assert warning.effective_deadline(NOW - timedelta(seconds=60)) == NOW - timedelta(seconds=30)
    assert warning.effective_deadline(NOW) == NOW


def test_an_added_node_expands_to_its_devices() -> None:
    entry = m.NodeDevices(node="node002", devices=(0, 3))
    assert entry.as_devices() == (Device("node002", 0), Device("node002", 3))


def test_the_committed_generation_maps_ranks_to_devices() -> None:
    committed = samples()[m.GenerationCommitted]
    assert committed.rank_to_device()[5] == NEW_PLACEMENT.devices[5]


# -- error events for rejected input ----------------------------------------------------------------------


def test_an_error_event_names_the_field_and_keeps_a_text_payload_as_text() -> None:
    data = payload(SPOT, notice_s=-5)
    event = error_event(
        source="ingester", subject="spot.warning", data=data, error=rejected(data, m.SpotWarning)
    )
    assert (event.field, event.payload_encoding, event.payload) == ("$.notice_s", "utf-8", data.decode())
    assert (event.job_id, event.event_id) == ("job-1", "evt-1")
    assert decode(encode(event), m.ErrorEvent) == event


def test_an_error_event_keeps_a_binary_payload_as_base64() -> None:
    data = b"\xff\xfe\x00garbage"
    event = error_event(
        source="ingester", subject="spot.warning", data=data, error=rejected(data, m.SpotWarning)
    )
    assert event.payload_encoding == "base64"
    assert base64.b64decode(event.payload) == data
    assert event.job_id is None


def test_an_error_event_cuts_a_large_payload_and_says_so() -> None:
    data = b'{"job_id": "' + b"x" * (2 * ERROR_PAYLOAD_LIMIT) + b'"}'
    event = error_event(
        source="ingester", subject="spot.warning", data=data, error=rejected(data, m.SpotWarning)
    )
    assert event.payload_truncated
    assert event.payload_size == len(data)
    assert len(event.payload) == ERROR_PAYLOAD_LIMIT


def test_an_error_event_leaves_out_ids_that_are_not_token_safe() -> None:
    data = payload(SPOT, job_id="job 1")
    event = error_event(
        source="ingester", subject="spot.warning", data=data, error=rejected(data, m.SpotWarning)
    )
    assert event.job_id is None
    assert event.event_id == "evt-1"


def test_an_error_event_for_a_huge_unknown_field_name_stays_decodable() -> None:
    data = payload(SPOT, **{"z" * 5000: 1})
    event = error_event(
        source="ingester", subject="spot.warning", data=data, error=rejected(data, m.SpotWarning)
    )
    assert event.field.startswith("$.zzz")
    assert decode(encode(event), m.ErrorEvent) == event


# -- TopologyPlanned.lost: devices of the current world that are gone ---------------------------------

PLANNED = m.TopologyPlanned(
    job_id="job-1",
    event_id="evt-1",
    from_generation=0,
    generation=1,
    model=PRESETS["tiny-gpt"].geometry(),
    from_layout=OLD,
    from_placement=OLD_PLACEMENT,
    layout=NEW,
    placement=NEW_PLACEMENT,
    candidates=(m.Candidate(layout=NEW, score=1.0, fits=True),),
    explanation="node001:2 and node001:3 failed",
)
GONE = OLD_PLACEMENT.devices[6:]
"""Devices of the current world that the new placement (the first six) leaves out."""


def test_a_planned_topology_without_lost_devices_round_trips_and_loses_none() -> None:
    data = payload(PLANNED, lost=None)
    assert b'"lost"' not in data
    assert decode(data, m.TopologyPlanned).lost == ()


def test_a_planned_topology_with_lost_devices_round_trips() -> None:
    planned = msgspec.structs.replace(PLANNED, lost=GONE)
    assert decode(encode(planned), m.TopologyPlanned) == planned
    assert decode(encode(planned), m.TopologyPlanned).lost == GONE


def test_a_lost_device_must_belong_to_the_current_world() -> None:
    error = rejected(payload(PLANNED, lost=[{"node": "node009", "index": 0}]), m.TopologyPlanned)
    assert error.path == "$.lost[0]"
    assert "not in the current world" in str(error)


def test_a_lost_device_cannot_hold_a_rank_of_the_new_world() -> None:
    error = rejected(payload(PLANNED, lost=[{"node": "node000", "index": 1}]), m.TopologyPlanned)
    assert error.path == "$.lost[0]"
    assert "new placement uses it" in str(error)


def test_a_lost_device_with_a_bad_node_id_names_its_position() -> None:
    bad = [{"node": "node001", "index": 3}, {"node": "bad node", "index": 0}]
    assert rejected(payload(PLANNED, lost=bad), m.TopologyPlanned).path == "$.lost[1].node"


def test_a_lost_device_cannot_be_listed_twice() -> None:
    twice = [{"node": "node001", "index": 3}, {"node": "node001", "index": 3}]
    assert rejected(payload(PLANNED, lost=twice), m.TopologyPlanned).path == "$.lost[1]"


def test_a_world_whose_layout_its_own_model_cannot_use_is_refused_naming_the_geometry() -> None:
    tiny = PRESETS["tiny-gpt"].geometry()  # four heads: no TP of three
    world = m.WorldStarted(
        job_id="job-7",
        generation=0,
        layout=ParallelLayout(tp=3, pp=1, dp=1),
        placement=Placement(grid_devices(1, 3)),
    )
    data = msgspec.to_builtins(world) | {"geometry": msgspec.to_builtins(tiny)}
    with pytest.raises(MessageError) as info:
        decode(msgspec.json.encode(data), m.WorldStarted)
    assert info.value.path == "$.geometry"


def test_an_acks_details_are_exactly_the_worker_statuss_optional_fields() -> None:
    from liver.shared.messages import AckDetails, WorkerStatus

    addressing = {"schema_version", "job_id", "worker_id", "phase"}
    assert set(AckDetails.__annotations__) == set(WorkerStatus.__struct_fields__) - addressing
