"""The ingester's pure decisions: parsing per subject, duplicate verdicts, and nodes resolved to devices."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from liver.services.ingester import core
from liver.shared import subjects as s
from liver.shared.codec import MessageError, encode
from liver.shared.layout import Device
from liver.shared.messages import (
    JobMembership,
    NodeDevices,
    ScaleRequest,
    SpotWarning,
    WarningKind,
    WorkerDevice,
)

PUBLISHED = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
A0, A1, B0, B1 = Device("node-a", 0), Device("node-a", 1), Device("node-b", 0), Device("node-b", 1)
MEMBERSHIP = JobMembership(
    job_id="job-1",
    generation=3,
    workers=tuple(WorkerDevice(worker_id=f"w{i}", device=d) for i, d in enumerate((A0, A1, B0, B1))),
)
WARNING = SpotWarning(job_id="job-1", event_id="evt-1", node="node-b", provider="aws", notice_s=120.0)


def scale(**fields: object) -> ScaleRequest:
    return ScaleRequest(job_id="job-1", event_id="evt-2", reason="operator", **fields)  # type: ignore[arg-type]


def rejected(event: core.IngestEvent, membership: JobMembership | None = MEMBERSHIP) -> MessageError:
    with pytest.raises(MessageError) as info:
        core.resolve(event, membership, PUBLISHED)
    return info.value


# -- parsing ------------------------------------------------------------------------------------------


def test_each_public_subject_decodes_its_own_kind() -> None:
    assert core.parse(s.SPOT_WARNING, encode(WARNING)) == WARNING
    request = scale(target_devices=2)
    assert core.parse(s.SCALE_REQUEST, encode(request)) == request


def test_a_scale_request_on_the_spot_warning_subject_is_rejected_at_its_kind() -> None:
    with pytest.raises(MessageError) as info:
        core.parse(s.SPOT_WARNING, encode(scale(target_devices=2)))
    assert info.value.path == "$.kind"


def test_a_subject_the_ingester_does_not_read_is_rejected() -> None:
    with pytest.raises(MessageError, match="does not read subject"):
        core.parse("generation.committed", encode(WARNING))


# -- duplicates ---------------------------------------------------------------------------------------


def seen(digest: str) -> core.Seen:
    return core.Seen(digest=digest, subject=s.SPOT_WARNING, stream_sequence=7, generation=3, at=PUBLISHED)


def test_an_event_never_seen_is_new() -> None:
    assert core.judge(None, core.digest(WARNING)) is core.Novelty.NEW


def test_the_same_event_again_is_a_duplicate_whatever_its_json_formatting() -> None:
    reordered = json.dumps(dict(reversed(list(json.loads(encode(WARNING)).items()))), indent=2).encode()
    again = core.parse(s.SPOT_WARNING, reordered)
    assert core.judge(seen(core.digest(WARNING)), core.digest(again)) is core.Novelty.DUPLICATE


def test_another_event_under_a_used_event_id_is_a_conflict() -> None:
    other = SpotWarning(job_id="job-1", event_id="evt-1", node="node-a", provider="aws", notice_s=120.0)
    assert core.judge(seen(core.digest(WARNING)), core.digest(other)) is core.Novelty.CONFLICT
    assert core.conflict_error(other, seen("x")).path == "$.event_id"


def test_event_ids_are_remembered_per_job() -> None:
    other_job = SpotWarning(job_id="job-2", event_id="evt-1", node="node-b", provider="aws", notice_s=1.0)
    assert core.seen_key(WARNING) != core.seen_key(other_job)
    assert core.resize_msg_id(WARNING) != core.resize_msg_id(other_job)


# -- resolution ---------------------------------------------------------------------------------------


def test_a_spot_warning_removes_every_device_of_its_node_and_keeps_the_rest() -> None:
    resize = core.resolve(WARNING, MEMBERSHIP, PUBLISHED)
    assert resize.trigger == "spot_warning"
    assert resize.generation == 3
    assert resize.remove == (B0, B1)
    assert resize.keep == (A0, A1)
    assert resize.add == ()
    assert (resize.job_id, resize.event_id) == ("job-1", "evt-1")


def test_a_spot_warning_deadline_counts_its_notice_from_publication() -> None:
    assert core.resolve(WARNING, MEMBERSHIP, PUBLISHED).deadline == PUBLISHED + timedelta(seconds=120)


def test_a_spot_warning_with_an_earlier_absolute_deadline_keeps_that_deadline() -> None:
    early = PUBLISHED + timedelta(seconds=30)
    warning = SpotWarning(
        job_id="job-1", event_id="evt-1", node="node-b", provider="gcp", notice_s=120.0, deadline=early
    )
    assert core.resolve(warning, MEMBERSHIP, PUBLISHED).deadline == early


def test_a_rebalance_recommendation_removes_its_node_without_a_deadline() -> None:
    warning = SpotWarning(
        job_id="job-1", event_id="evt-9", node="node-b", provider="aws", warning_kind=WarningKind.REBALANCE
    )
    resize = core.resolve(warning, MEMBERSHIP, PUBLISHED)
    assert (resize.trigger, resize.remove, resize.deadline) == ("rebalance", (B0, B1), None)
    assert "rebalance" in resize.reason


def test_an_interruption_without_notice_or_deadline_is_refused_at_notice_s() -> None:
    with pytest.raises(ValueError, match="`notice_s`"):
        SpotWarning(job_id="job-1", event_id="evt-9", node="node-b", provider="aws")


def test_a_scale_request_removes_nodes_and_adds_devices() -> None:
    request = scale(remove=("node-a",), add=(NodeDevices(node="node-c", devices=(0, 1, 2)),))
    resize = core.resolve(request, MEMBERSHIP, PUBLISHED)
    assert resize.trigger == "scale_request"
    assert resize.remove == (A0, A1)
    assert resize.keep == (B0, B1)
    assert resize.add == (Device("node-c", 0), Device("node-c", 1), Device("node-c", 2))
    assert resize.deadline is None
    assert resize.reason == "operator"


def test_a_scale_request_may_add_unused_devices_of_a_node_the_job_already_uses() -> None:
    resize = core.resolve(scale(add=(NodeDevices(node="node-a", devices=(2, 3)),)), MEMBERSHIP, PUBLISHED)
    assert resize.add == (Device("node-a", 2), Device("node-a", 3))
    assert resize.keep == (A0, A1, B0, B1)


def test_a_target_device_count_keeps_every_device_and_leaves_the_choice_to_the_planner() -> None:
    resize = core.resolve(scale(target_devices=2), MEMBERSHIP, PUBLISHED)
    assert resize.target_devices == 2
    assert resize.keep == (A0, A1, B0, B1)
    assert resize.remove == resize.add == ()


def test_an_unknown_job_is_rejected_at_the_job_id() -> None:
    error = rejected(WARNING, membership=None)
    assert error.path == "$.job_id"
    assert "unknown job 'job-1'" in error.reason


def test_a_spot_warning_for_a_node_without_workers_is_rejected_at_the_node() -> None:
    warning = SpotWarning(job_id="job-1", event_id="evt-1", node="node-z", provider="aws", notice_s=5.0)
    error = rejected(warning)
    assert error.path == "$.node"
    assert "'node-z' runs no worker of job 'job-1'" in error.reason


def test_removing_a_node_without_workers_is_rejected_at_its_index() -> None:
    assert rejected(scale(remove=("node-a", "node-z"))).path == "$.remove[1]"


def test_adding_a_device_that_already_runs_a_worker_is_rejected_at_that_device() -> None:
    error = rejected(
        scale(add=(NodeDevices(node="node-c", devices=(0,)), NodeDevices(node="node-b", devices=(2, 1))))
    )
    assert error.path == "$.add[1].devices[1]"


def test_a_target_equal_to_the_current_size_is_rejected_as_no_change() -> None:
    assert rejected(scale(target_devices=4)).path == "$.target_devices"
