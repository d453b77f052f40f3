"""Membership: who the job's workers are, where they run, and when they count as lost."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from liver.services.coordinator.membership import Membership, MembershipError
from liver.shared.layout import Device
from liver.shared.messages import Heartbeat, Hello

NOW = datetime(2026, 1, 2, 12, 0, tzinfo=UTC)
JOB = "job-1"
GPU0 = Device("node000", 0)
GPU1 = Device("node000", 1)


def hello(worker: str, device: Device, **fields: object) -> Hello:
    return Hello(job_id=JOB, worker_id=worker, device=device, address="10.0.0.1:29500", **fields)


def beat(worker: str, device: Device, seq: int, **fields: object) -> Heartbeat:
    return Heartbeat(job_id=JOB, worker_id=worker, device=device, address="10.0.0.1:29500", seq=seq, **fields)


def later(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


@pytest.fixture
def members() -> Membership:
    return Membership(JOB, timeout_s=10.0)


def test_hello_registers_worker_with_node_device_address_and_generation(members: Membership) -> None:
    change = members.observe(hello("w0", GPU0, generation=3, rank=1, memory_bytes=80 << 30), NOW)
    assert change.kind == "joined"
    member = members.get("w0")
    assert member is not None
    assert (member.device, member.address, member.generation, member.rank) == (GPU0, "10.0.0.1:29500", 3, 1)
    assert member.memory_bytes == 80 << 30
    assert members.on_device(GPU0) is member


def test_heartbeat_from_an_unknown_worker_rebuilds_membership(members: Membership) -> None:
    change = members.observe(beat("w0", GPU0, seq=7, generation=2, rank=0, iteration=41), NOW)
    assert change.kind == "joined"
    member = members.get("w0")
    assert member is not None and (member.seq, member.iteration, member.generation) == (7, 41, 2)


def test_heartbeat_refreshes_liveness_and_progress(members: Membership) -> None:
    members.observe(hello("w0", GPU0), NOW)
    change = members.observe(beat("w0", GPU0, seq=1, generation=0, rank=0, iteration=5), later(8))
    assert change.kind == "updated"
    assert members.expire(later(15)).lost == ()
    member = members.get("w0")
    assert member is not None and member.iteration == 5 and member.generation == 0


def test_worker_silent_past_the_timeout_is_lost_and_forgotten(members: Membership) -> None:
    members.observe(hello("w0", GPU0), NOW)
    members.observe(hello("w1", GPU1), NOW)
    members.observe(beat("w1", GPU1, seq=1), later(6))
    expired = members.expire(later(10.5))
    assert [m.worker_id for m in expired.lost] == ["w0"]
    assert members.get("w0") is None and members.on_device(GPU0) is None
    assert members.get("w1") is not None


def test_worker_exactly_at_its_deadline_is_still_alive(members: Membership) -> None:
    members.observe(hello("w0", GPU0), NOW)
    assert members.expire(later(10)).lost == ()


def test_heartbeat_sequence_starting_over_means_the_process_restarted(members: Membership) -> None:
    members.observe(beat("w0", GPU0, seq=40), NOW)
    change = members.observe(beat("w0", GPU0, seq=0), later(1))
    assert change.kind == "restarted"
    assert change.previous is not None and change.previous.seq == 40
    member = members.get("w0")
    assert member is not None and member.seq == 0


def test_repeated_heartbeat_is_not_a_restart(members: Membership) -> None:
    members.observe(beat("w0", GPU0, seq=4), NOW)
    assert members.observe(beat("w0", GPU0, seq=4), later(1)).kind == "updated"


def test_hello_again_from_a_known_worker_is_a_reconnect(members: Membership) -> None:
    members.observe(beat("w0", GPU0, seq=4), NOW)
    assert members.observe(hello("w0", GPU0), later(1)).kind == "updated"


def test_new_process_saying_hello_on_an_occupied_device_replaces_the_old_one(members: Membership) -> None:
    members.observe(hello("w0", GPU0), NOW)
    change = members.observe(hello("w0b", GPU0), later(1))
    assert change.kind == "replaced"
    assert change.previous is not None and change.previous.worker_id == "w0"
    assert members.get("w0") is None
    member = members.on_device(GPU0)
    assert member is not None and member.worker_id == "w0b"


def test_heartbeat_claiming_another_workers_device_is_rejected_naming_device(members: Membership) -> None:
    members.observe(hello("w0", GPU0), NOW)
    with pytest.raises(MembershipError) as err:
        members.observe(beat("intruder", GPU0, seq=1), later(1))
    assert err.value.field == "device"
    member = members.on_device(GPU0)
    assert member is not None and member.worker_id == "w0"


def test_worker_moving_to_another_device_is_rejected_naming_device(members: Membership) -> None:
    members.observe(hello("w0", GPU0), NOW)
    with pytest.raises(MembershipError) as err:
        members.observe(beat("w0", GPU1, seq=1), later(1))
    assert err.value.field == "device"


def test_presence_of_another_job_is_rejected_naming_job_id(members: Membership) -> None:
    other = Hello(job_id="job-2", worker_id="w0", device=GPU0, address="10.0.0.1:29500")
    with pytest.raises(MembershipError) as err:
        members.observe(other, NOW)
    assert err.value.field == "job_id"
    assert len(members) == 0


def test_expected_device_that_stays_silent_is_reported_missing(members: Membership) -> None:
    members.expect(GPU0, NOW)
    members.expect(GPU1, NOW)
    members.observe(beat("w1", GPU1, seq=3), later(2))
    assert members.is_expected(GPU0, later(2)) and not members.is_expected(GPU1, later(2))
    assert not members.is_expected(GPU0, later(11))
    expired = members.expire(later(11))
    assert expired.missing == (GPU0,)
    assert not members.is_expected(GPU0, later(1))


def test_expecting_a_device_that_has_a_worker_changes_nothing(members: Membership) -> None:
    members.observe(hello("w0", GPU0), NOW)
    members.expect(GPU0, NOW)
    assert not members.is_expected(GPU0, NOW)


def test_next_deadline_is_the_earliest_heartbeat_or_expectation(members: Membership) -> None:
    assert members.next_deadline() is None
    members.observe(hello("w0", GPU0), later(3))
    members.expect(GPU1, NOW)
    assert members.next_deadline() == later(10)


def test_workers_on_nodes_resolve_a_node_to_its_workers(members: Membership) -> None:
    members.observe(hello("w1", GPU1), NOW)
    members.observe(hello("w0", GPU0), NOW)
    members.observe(hello("x0", Device("node001", 0)), NOW)
    assert [m.worker_id for m in members.on_nodes(["node000"])] == ["w0", "w1"]


def test_removed_worker_is_forgotten(members: Membership) -> None:
    members.observe(hello("w0", GPU0), NOW)
    removed = members.remove("w0")
    assert removed is not None and removed.device == GPU0
    assert members.on_device(GPU0) is None and members.remove("w0") is None


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        Membership(JOB, timeout_s=0)


def test_version_moves_when_workers_come_and_go_but_not_on_a_heartbeat(members: Membership) -> None:
    start = members.version
    members.observe(hello("w0", GPU0), NOW)
    joined = members.version
    members.observe(beat("w0", GPU0, seq=1), later(1))
    assert members.version == joined > start
    members.expire(later(20))
    assert members.version > joined


def test_a_suspected_member_is_lost_after_the_short_timeout_and_one_that_beats_stays(
    members: Membership,
) -> None:
    members.observe(beat("w0", GPU0, seq=1), NOW)
    members.observe(beat("w1", GPU1, seq=1), NOW)
    assert members.suspect([GPU0, GPU1], within_s=3.0) == 2
    assert members.next_deadline() == later(3.0)
    members.observe(beat("w1", GPU1, seq=2), later(2.0))
    expired = members.expire(later(3.5))
    assert [m.worker_id for m in expired.lost] == ["w0"]
    assert members.get("w1") is not None


def test_clearing_the_suspicion_gives_back_the_full_timeout(members: Membership) -> None:
    members.observe(beat("w0", GPU0, seq=1), NOW)
    members.suspect([GPU0], within_s=3.0)
    members.clear_suspicion()
    assert members.next_deadline() == later(10.0)
    assert members.expire(later(5.0)).lost == ()
