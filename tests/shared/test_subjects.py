"""Subject names: one spelling for everyone, ids that cannot change a subject's meaning."""

from __future__ import annotations

import pytest

from liver.shared import subjects as s


def _matches(pattern: str, subject: str) -> bool:
    """NATS matching: ``*`` is one token, ``>`` the rest (at least one token)."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def test_public_subjects_are_the_documented_names() -> None:
    assert s.PUBLIC_SUBJECTS == (
        "spot.warning",
        "scale.request",
        "generation.committed",
        "generation.aborted",
    )


def test_internal_subjects_live_under_liver_and_end_with_the_job() -> None:
    for build in (
        s.resize_requested,
        s.topology_request,
        s.topology_planned,
        s.transfer_planned,
        s.planning_failed,
        s.world_started,
        s.worker_hello,
        s.worker_heartbeat,
        s.worker_status,
        s.worker_commands,
    ):
        subject = build("job-7")
        assert subject.startswith("liver.")
        assert subject.endswith(".job-7")


def test_a_worker_command_subject_names_job_and_worker() -> None:
    assert s.worker_command("job-7", "w-3") == "liver.worker.cmd.job-7.w-3"


def test_a_device_probe_is_not_caught_by_a_worker_probe_of_any_name() -> None:
    device = s.device_probe("job-7", "node003", 1)
    assert device == f"liver.worker.probe.job-7.device.{b'node003'.hex()}.1"
    assert not _matches(s.worker_probe("job-7", "device"), device)
    assert _matches("liver.worker.probe.>", device)  # the workers' permission covers it


def test_a_device_probe_takes_a_node_id_with_dots_and_slashes_as_one_token() -> None:
    subject = s.device_probe("job-7", "aws:///us-east-1a/i-0abc.internal", 0)
    assert len(subject.split(".")) == 7 and "/" not in subject and ":" not in subject


@pytest.mark.parametrize(
    ("node", "index", "field"), [("", 0, "node"), ("n" * 254, 0, "node"), ("node000", -1, "index")]
)
def test_a_device_probe_names_the_part_of_the_device_that_is_bad(node: str, index: int, field: str) -> None:
    with pytest.raises(s.SubjectError, match=field):
        s.device_probe("job-7", node, index)


def test_the_job_broadcast_is_not_caught_by_the_per_worker_pattern() -> None:
    assert not _matches(s.worker_commands_any("job-7"), s.worker_commands("job-7"))
    assert _matches(s.worker_commands_any("job-7"), s.worker_command("job-7", "w-3"))


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "*", ">", "a*", "tab\tid", "ü", "x" * 129])
def test_an_id_that_would_change_the_subject_is_refused(bad: str) -> None:
    with pytest.raises(s.SubjectError, match="job_id"):
        s.resize_requested(bad)


def test_a_bad_worker_id_is_named_as_such() -> None:
    with pytest.raises(s.SubjectError, match="worker_id"):
        s.worker_command("job-7", "w.3")


def test_every_subject_is_captured_by_exactly_one_stream_except_worker_traffic() -> None:
    captured = [
        s.SPOT_WARNING,
        s.SCALE_REQUEST,
        s.GENERATION_COMMITTED,
        s.GENERATION_ABORTED,
        s.resize_requested("j"),
        s.topology_request("j"),
        s.topology_planned("j"),
        s.transfer_planned("j"),
        s.planning_failed("j"),
        s.world_started("j"),
        s.errors("ingester"),
        s.dead_letters("ingester"),
    ]
    for subject in captured:
        owners = [spec.name for spec in s.STREAMS if any(_matches(p, subject) for p in spec.subjects)]
        assert len(owners) == 1, (subject, owners)
    for subject in (s.worker_status("j"), s.worker_heartbeat("j"), s.worker_command("j", "w")):
        assert not any(_matches(p, subject) for spec in s.STREAMS for p in spec.subjects), subject


def test_stream_bucket_and_store_names_are_tokens() -> None:
    for name in [spec.name for spec in s.STREAMS] + [
        s.KV_GENERATIONS,
        s.KV_EVENTS_SEEN,
        s.OBJECT_STORE_PLANS,
    ]:
        assert s.validate_token(name) == name


def test_the_advisory_for_exhausted_deliveries_names_stream_and_consumer() -> None:
    assert (
        s.max_deliveries_advisory("LIVER_INGEST", "ingester")
        == "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.LIVER_INGEST.ingester"
    )


def test_plan_objects_are_grouped_by_job_and_generation() -> None:
    assert s.plan_object_name("job-7", 3) == "job-7/3/plan"
    assert s.plan_object_name("job-7", 3, "w-0") == "job-7/3/w-0"
    with pytest.raises(s.SubjectError):
        s.plan_object_name("job-7", -1)


def test_a_generation_outcome_has_one_dedup_id_per_job_and_generation() -> None:
    assert s.generation_msg_id("job-7", 3) == s.generation_msg_id("job-7", 3)
    assert s.generation_msg_id("job-7", 3) != s.generation_msg_id("job-7", 4)
    assert s.generation_msg_id("job-7", 3) != s.generation_msg_id("job-8", 3)


def test_a_generations_slice_key_pattern_covers_the_keys_of_each_of_its_plans() -> None:
    from liver.shared.messages import SliceIndex

    index = SliceIndex(
        bucket=s.OBJECT_STORE_PLANS,
        prefix=s.plan_object_name("job-1", 3, "s7") + "-",
        count=2,
        kv_bucket=s.KV_PLAN_SLICES,
    )
    pattern = s.slice_keys_of_generation("job-1", 3)
    assert pattern == "job-1.3.>" and index.key(1).startswith(pattern[:-1])
    assert not index.key(1).startswith(s.slice_keys_of_generation("job-1", 33)[:-1])
