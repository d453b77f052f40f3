"""A worker's plan slice is found from the job-wide Prepare, read with errors that say what timed out,
decoded strictly and checked against the Prepare and its device."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import msgspec
import nats.errors
import pytest
from bus_helpers import WAIT_S, client
from companion_helpers import DEVICES, NEW_LAYOUT, prepare, slices
from nats.js import JetStreamContext

from liver.reshard.plan import Plan
from liver.services import bus as b
from liver.shared import subjects as s
from liver.shared.codec import MessageError
from liver.shared.layout import Device
from liver.shared.nats_server import NatsServer
from liver.worker_runtime.companion.slices import PlanFetcher, PlanFetchError, decode_slice, view_of

PREPARE = prepare("job", 1)
ME = DEVICES[0]


def stored(device: Device = ME, generation: int = 1) -> bytes:
    return msgspec.json.encode(slices()[device].stored(generation))


def raw() -> dict[str, Any]:
    return msgspec.json.decode(stored())


def refused(data: dict[str, Any] | bytes, device: Device = ME) -> MessageError:
    payload = data if isinstance(data, bytes) else msgspec.json.encode(data)
    with pytest.raises(MessageError) as caught:
        decode_slice(payload, PREPARE, device)
    assert caught.value.expected == "SliceFile"
    return caught.value


def test_a_valid_slice_becomes_the_plan_of_this_device_with_the_prepares_worlds() -> None:
    plan = decode_slice(stored(), PREPARE, ME)
    assert isinstance(plan, Plan)
    assert plan.tasks == slices()[ME].tasks
    assert plan.old == slices()[ME].old and plan.new == slices()[ME].new
    assert plan.new.layout == NEW_LAYOUT


def test_the_stored_slice_repeats_no_world() -> None:
    assert {"old", "new"}.isdisjoint(raw())
    assert len(stored()) < len(msgspec.json.encode(slices()[ME]))


def test_a_slice_of_another_device_is_refused() -> None:
    assert refused(raw(), device=DEVICES[1]).path == "$.device"


def test_a_slice_of_another_generation_is_refused() -> None:
    assert refused(stored(generation=2)).path == "$.generation"


def test_a_slice_of_the_first_format_is_refused_by_its_version() -> None:
    data = raw()
    data["schema_version"] = 1
    assert refused(data).path == "$.schema_version"


def test_every_participant_finds_its_slice_by_its_index_in_both_worlds() -> None:
    view = view_of(PREPARE)
    assert list(view.slice_of) == list(slices())  # the transfer service's order
    assert view.slice_name(PREPARE, DEVICES[3]) == PREPARE.slices.name(3)


def test_a_lost_device_and_a_device_of_neither_world_take_no_part() -> None:
    lost = prepare("job", 1, lost=(DEVICES[3],))
    assert not view_of(lost).participates(DEVICES[3])
    assert view_of(lost).participates(DEVICES[2])  # leaving, but alive: it sends
    assert not view_of(PREPARE).participates(Device("node009", 0))


def test_the_view_is_built_once_per_prepare() -> None:
    assert view_of(PREPARE) is view_of(PREPARE)


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
    return msgspec.json.decode(stored(device))


# -- reading ------------------------------------------------------------------------------------------------


class _StalledStream:
    """A JetStream context whose requests never answer (``hang``) or time out themselves (``timeout``)."""

    def __init__(self, how: str) -> None:
        self.how = how

    async def stream_info(self, stream: str) -> Any:
        return SimpleNamespace(config=SimpleNamespace(allow_direct=True))

    async def get_msg(self, *args: Any, **kwargs: Any) -> Any:
        if self.how == "timeout":
            raise nats.errors.TimeoutError
        await asyncio.sleep(60)


async def test_a_read_that_runs_out_of_its_time_says_which_object_how_long_and_where_it_stopped() -> None:
    fetcher = PlanFetcher(_StalledStream("hang"))  # type: ignore[arg-type]
    with pytest.raises(PlanFetchError) as caught:
        await fetcher.fetch_object("liver-plans", "job/1/s1-00002", 0.05)
    text = str(caught.value)
    assert "liver-plans/job/1/s1-00002" in text
    assert "not read within the 0.05 s allowed" in text and "the object's metadata" in text


async def test_a_request_lost_to_an_outage_is_sent_again_until_the_reads_time_runs_out() -> None:
    fetcher = PlanFetcher(_StalledStream("timeout"))  # type: ignore[arg-type]
    with pytest.raises(PlanFetchError) as caught:
        await fetcher.fetch_object("liver-plans", "job/1/s1-00002", 0.5)
    text = str(caught.value)
    assert "liver-plans/job/1/s1-00002" in text
    assert "not read within the 0.5 s allowed" in text and "tries lost to bus outages" in text


async def test_a_read_of_an_entry_that_runs_out_of_its_time_says_which_key_how_long_and_what_it_awaited() -> (
    None
):
    fetcher = PlanFetcher(_StalledStream("hang"))  # type: ignore[arg-type]
    with pytest.raises(PlanFetchError) as caught:
        await fetcher.fetch_entry("liver-slices", "job.1.s1.00002", 0.05)
    text = str(caught.value)
    assert "key-value entry liver-slices/job.1.s1.00002" in text
    assert "not read within the 0.05 s allowed" in text and "waiting for the entry" in text


async def test_an_entry_request_lost_to_an_outage_is_sent_again_until_the_reads_time_runs_out() -> None:
    fetcher = PlanFetcher(_StalledStream("timeout"))  # type: ignore[arg-type]
    with pytest.raises(PlanFetchError) as caught:
        await fetcher.fetch_entry("liver-slices", "job.1.s1.00002", 0.5)
    text = str(caught.value)
    assert "liver-slices/job.1.s1.00002" in text
    assert "not read within the 0.5 s allowed" in text and "tries lost to bus outages" in text


class _RestartingServer:
    """A JetStream context whose first requests go unanswered, as during a server's restart."""

    def __init__(self, lost: int) -> None:
        self.lost = lost
        self.requests = 0

    async def stream_info(self, stream: str) -> Any:
        return SimpleNamespace(config=SimpleNamespace(allow_direct=True))

    async def get_msg(self, stream: str, *, subject: str, direct: bool) -> Any:
        self.requests += 1
        if self.requests <= self.lost:
            raise nats.errors.TimeoutError
        return SimpleNamespace(headers=None, subject=subject, data=b"the slice")


async def test_an_entry_whose_first_requests_were_lost_in_a_server_restart_is_still_read() -> None:
    """A request sent just before the server died never gets its reply: one more request must be sent,
    not the whole read abandoned (the handoff would abort although the entry is there)."""
    stream = _RestartingServer(lost=3)
    fetcher = PlanFetcher(stream)  # type: ignore[arg-type]
    assert await fetcher.fetch_entry("liver-slices", "job.1.s1.00002", 30.0) == b"the slice"
    assert stream.requests == 4


@pytest.fixture
def server() -> Iterator[NatsServer]:
    with NatsServer() as srv:
        yield srv


@pytest.fixture
async def js(server: NatsServer) -> AsyncIterator[JetStreamContext]:
    async with client(server.url) as (_, js):
        await b.ensure_kv(js, s.KV_PLAN_SLICES, description="test", ttl_s=60.0)
        yield js


@pytest.mark.slow
async def test_a_missing_slice_entry_is_named_by_its_key_once_the_read_has_waited_its_time(
    js: JetStreamContext,
) -> None:
    # Long enough for the first read to come back on a busy machine: only a read that found nothing
    # says "no such entry".
    started = time.monotonic()
    with pytest.raises(PlanFetchError) as caught:
        await PlanFetcher(js).fetch_entry(s.KV_PLAN_SLICES, "job.1.s1.00002", 3.0)
    assert time.monotonic() - started >= 3.0, "a missing entry is looked for again until the time is up"
    text = str(caught.value)
    assert f"key-value entry {s.KV_PLAN_SLICES}/job.1.s1.00002: no such entry" in text
    assert "allowed 3 s" in text


@pytest.mark.slow
async def test_a_slice_entry_that_appears_while_the_worker_waits_is_read(js: JetStreamContext) -> None:
    kv = await js.key_value(s.KV_PLAN_SLICES)
    read = asyncio.create_task(PlanFetcher(js).fetch_entry(s.KV_PLAN_SLICES, "job.1.s1.00003", WAIT_S))
    await asyncio.sleep(0.1)  # the scenario: the entry comes later (the outcome is the same either way)
    await kv.put("job.1.s1.00003", b"late")
    assert await read == b"late"


@pytest.mark.slow
async def test_a_deleted_slice_entry_fails_at_once_saying_the_plan_was_released(js: JetStreamContext) -> None:
    kv = await js.key_value(s.KV_PLAN_SLICES)
    await kv.put("job.1.s1.00004", b"gone soon")
    await kv.delete("job.1.s1.00004")
    started = time.monotonic()
    with pytest.raises(PlanFetchError, match=r"liver-slices/job\.1\.s1\.00004: deleted .*released"):
        await PlanFetcher(js).fetch_entry(s.KV_PLAN_SLICES, "job.1.s1.00004", WAIT_S)
    # At once: a read that waited for the entry would take the whole WAIT_S.
    assert time.monotonic() - started < WAIT_S / 2


@pytest.mark.slow
async def test_a_slice_in_a_bucket_that_does_not_exist_is_refused_naming_the_bucket(
    js: JetStreamContext,
) -> None:
    with pytest.raises(PlanFetchError, match=r"entry no-such-bucket/k\.00001: the bucket does not exist"):
        await PlanFetcher(js).fetch_entry("no-such-bucket", "k.00001", WAIT_S)
