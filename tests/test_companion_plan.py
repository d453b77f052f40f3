"""A worker's plan slice is decoded strictly and checked against its Prepare and its device."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from companion_helpers import DEVICES, NEW_LAYOUT, prepare, slices

from liver.shared.codec import MessageError
from liver.shared.layout import Device, ParallelLayout
from liver.shared.messages import ObjectRef
from liver.shared.plan import Plan
from liver.worker_runtime.companion_plan import decode_slice

REF = ObjectRef(bucket="liver-plans", name="job/1/s1-00000", size=1)
PREPARE = prepare("job", 1, REF)
ME = DEVICES[0]


def raw() -> dict[str, Any]:
    return msgspec.json.decode(msgspec.json.encode(slices()[ME]))


def refused(data: dict[str, Any] | bytes, device: Device = ME) -> MessageError:
    payload = data if isinstance(data, bytes) else msgspec.json.encode(data)
    with pytest.raises(MessageError) as caught:
        decode_slice(payload, PREPARE, device)
    assert caught.value.expected == "PlanSlice"
    return caught.value


def test_a_valid_slice_becomes_the_plan_of_this_device() -> None:
    plan = decode_slice(msgspec.json.encode(slices()[ME]), PREPARE, ME)
    assert isinstance(plan, Plan)
    assert plan.tasks == slices()[ME].tasks
    assert plan.new.layout == NEW_LAYOUT


def test_a_slice_of_another_device_is_refused() -> None:
    assert refused(raw(), device=DEVICES[1]).path == "$.device"


def test_a_slice_for_another_target_layout_is_refused() -> None:
    other = prepare("job", 1, REF)
    other = msgspec.structs.replace(other, layout=ParallelLayout(tp=1, pp=2, dp=1))
    with pytest.raises(MessageError) as caught:
        decode_slice(msgspec.json.encode(slices()[ME]), other, ME)
    assert caught.value.path == "$.new.layout"


def test_malformed_json_is_refused_at_the_root() -> None:
    error = refused(b"{not json")
    assert error.path == "$" and "malformed JSON" in error.reason


def test_an_unknown_field_is_refused_by_name() -> None:
    data = raw()
    data["extra"] = 1
    assert "extra" in refused(data).reason


def test_a_wrong_type_is_refused_at_its_path() -> None:
    data = raw()
    data["budget_bytes"] = "lots"
    assert refused(data).path == "$.budget_bytes"


def test_a_task_to_a_rank_outside_the_new_world_is_refused() -> None:
    data = raw()
    data["tasks"][0][3] = 99  # tasks are arrays: [layer, round, src, dst, local, slices, nbytes]
    assert refused(data).path == "$.tasks[0].dst"


def test_a_task_whose_byte_count_disagrees_with_its_boxes_is_refused() -> None:
    data = raw()
    data["tasks"][0][6] += 4
    assert refused(data).path == "$.tasks[0].nbytes"


def test_a_box_outside_its_tensor_is_refused() -> None:
    data = raw()
    i, j, box = next(
        (i, j, box) for i, task in enumerate(data["tasks"]) for j, (_, box) in enumerate(task[5]) if box
    )
    box[0][1] = 10**9
    assert refused(data).path == f"$.tasks[{i}].slices[{j}]"


def test_a_task_that_does_not_involve_this_device_is_refused() -> None:
    data = raw()
    other = raw_of(DEVICES[3])
    foreign = next(t for t in other["tasks"] if t[2] == 3 and t[3] != 0)  # sent by node000:3
    data["tasks"].append(foreign)
    assert refused(data).path == f"$.tasks[{len(data['tasks']) - 1}]"


def raw_of(device: Device) -> dict[str, Any]:
    return msgspec.json.decode(msgspec.json.encode(slices()[device]))
