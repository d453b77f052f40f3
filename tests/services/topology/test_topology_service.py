"""The topology service: its configuration, its work on one request, and the service on a real
nats-server (topology request in, planned topology or planning failure out)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest
from bus_helpers import Collector, client, error_events, eventually, running, stored
from nats.aio.client import Client
from nats.js import JetStreamContext

from liver.reshard.plan import WorldConfig
from liver.reshard.planner import NoSurvivingSource
from liver.reshard.verifier import verify_plan
from liver.services.topology import choose_topology
from liver.services.topology.core import answer, device_pool
from liver.services.topology.memory import CPU_SMALL, HardwareProfile, TrainingSetup
from liver.services.topology.service import TopologyService, create_service
from liver.services.topology.settings import (
    CONFIG_ENV,
    GLOBAL_BATCH_ENV,
    HARDWARE_ENV,
    MODEL_ENV,
    SEQUENCE_LENGTH_ENV,
    JobProfile,
    TopologyConfigError,
    TopologySettings,
)
from liver.services.transfer.core import plan_transfer, planning_failed
from liver.shared import subjects as s
from liver.shared.codec import MessageError, decode, encode
from liver.shared.geometry import ParamGeometry, TpDivisor
from liver.shared.layout import Device, ParallelLayout, Placement, grid_devices
from liver.shared.messages import PlanningFailed, TopologyPlanned, TopologyRequest
from liver.shared.model import PRESETS
from liver.shared.nats_server import NatsServer

MiB = 1 << 20
MODEL = PRESETS["tiny-gpt"]
SETUP = TrainingSetup(global_batch_size=12, sequence_length=64)
ROOMY = HardwareProfile(
    name="roomy",
    memory_bytes=1024 * MiB,
    peak_flops=50e9,
    achievable_fraction=0.5,
    intra_node_bandwidth=5e9,
    inter_node_bandwidth=1.25e9,
    memory_margin=0.0,
    reserved_bytes=0,
)
"""No margin and no reserve, so a reported device memory is exactly what training may use."""
PROFILE = JobProfile(model=MODEL, setup=SETUP, hardware=ROOMY)
SETTINGS = TopologySettings(
    default=PROFILE, staging_bytes=0, ack_wait_s=30.0, progress_every_s=1.0, retry_delay_s=0.1
)
WORLD = grid_devices(2, 2)
"""node000:0-1 and node001:0-1 run generation 0 as TP2 x DP2."""
LAYOUT = ParallelLayout(tp=2, pp=1, dp=2)
SPARES = grid_devices(3, 2)[4:]
NOW = datetime(2026, 1, 2, 12, 0, tzinfo=UTC)


def ask(job: str = "job-a", **changes: object) -> TopologyRequest:
    fields: dict[str, object] = {
        "job_id": job,
        "event_id": "evt-1",
        "event_ids": ("evt-1",),
        "from_generation": 0,
        "generation": 1,
        "layout": LAYOUT,
        "placement": Placement(WORLD),
        "remove": WORLD[2:],
        "deadline": datetime.now(UTC) + timedelta(minutes=2),
    }
    fields.update(changes)
    return TopologyRequest(**fields)  # type: ignore[arg-type]


# -- the request's contract ---------------------------------------------------------------------------


def test_a_request_cannot_remove_a_device_outside_the_live_world() -> None:
    data = json.loads(encode(ask()))
    data["remove"] = [{"node": "node009", "index": 0}]
    with pytest.raises(MessageError) as info:
        decode(json.dumps(data), TopologyRequest)
    assert info.value.path == "$.remove[0]"


def test_a_request_cannot_offer_a_device_the_live_world_has() -> None:
    with pytest.raises(ValueError, match="add\\[0\\]"):
        ask(remove=(), add=(WORLD[0],))


def test_a_request_must_plan_a_later_generation() -> None:
    with pytest.raises(ValueError, match="generation"):
        ask(generation=0)


# -- which devices may be used --------------------------------------------------------------------------


def test_the_pool_is_the_live_world_less_what_leaves_plus_what_is_offered() -> None:
    pool = device_pool(ask(remove=(WORLD[3],), lost=(WORLD[2],), add=SPARES))
    assert pool == (*WORLD[:2], *SPARES)


def test_a_smaller_target_keeps_the_nodes_that_hold_state() -> None:
    pool = device_pool(ask(remove=(), add=SPARES, target_devices=4))
    assert pool == WORLD


def test_a_target_prefers_state_holding_devices_on_a_partly_new_node() -> None:
    mixed = (Device("node001", 2), Device("node001", 3))
    pool = device_pool(ask(remove=(WORLD[0], WORLD[1]), add=mixed, target_devices=3))
    assert pool == (*WORLD[2:], mixed[0])


def test_a_target_above_the_pool_fails_naming_the_field() -> None:
    out = answer(ask(remove=(), target_devices=9), PROFILE, SETTINGS, NOW)
    assert isinstance(out.message, PlanningFailed)
    assert out.message.reason.startswith("target_devices: 9 devices asked for, but only 4")


# -- the answer -----------------------------------------------------------------------------------------


def test_the_answer_is_the_choosers_decision_with_its_candidates_and_explanation() -> None:
    out = answer(ask(), PROFILE, SETTINGS, NOW)
    expected = choose_topology(
        MODEL, SETUP, ROOMY, WorldConfig(LAYOUT, Placement(WORLD)), WORLD[:2], staging_bytes=0
    )
    planned = out.message
    assert isinstance(planned, TopologyPlanned)
    assert (planned.layout, planned.placement) == (expected.layout, expected.placement)
    assert planned.candidates == expected.message_candidates()
    assert planned.explanation == expected.explanation
    assert (planned.from_layout, planned.from_placement, planned.model) == (
        LAYOUT,
        Placement(WORLD),
        MODEL.geometry(),
    )


def test_the_memory_the_workers_report_replaces_the_profiles() -> None:
    roomy = answer(ask(remove=()), PROFILE, SETTINGS, NOW).message
    assert isinstance(roomy, TopologyPlanned)
    chosen = next(c for c in roomy.candidates if c.layout == roomy.layout)
    assert chosen.memory_bytes is not None
    tight = chosen.memory_bytes - 1
    out = answer(ask(remove=(), device_memory_bytes=tight), PROFILE, SETTINGS, NOW).message
    assert isinstance(out, TopologyPlanned)
    assert out.layout != roomy.layout
    fits = [c for c in out.candidates if c.fits]
    assert fits and all(c.memory_bytes is not None and c.memory_bytes <= tight for c in fits)
    assert f"Device memory {tight} bytes as the workers reported" in out.explanation


def test_no_layout_that_fits_is_a_planning_failure_with_the_reason() -> None:
    out = answer(ask(device_memory_bytes=64 * 1024), PROFILE, SETTINGS, NOW).message
    assert isinstance(out, PlanningFailed)
    assert (out.stage, out.generation, out.event_id) == ("topology", 1, "evt-1")
    assert out.reason.startswith("no layout of tiny-gpt fits 2 devices or any fewer")
    assert "out of memory" in out.reason


def test_a_request_past_its_deadline_fails_without_planning() -> None:
    out = answer(ask(deadline=NOW - timedelta(seconds=1)), PROFILE, SETTINGS, NOW).message
    assert isinstance(out, PlanningFailed)
    assert "deadline" in out.reason and "passed before planning" in out.reason


def test_a_live_layout_the_model_cannot_use_is_a_planning_failure() -> None:
    odd = ParallelLayout(tp=3, pp=1, dp=1)  # tiny-gpt's 4 heads do not split 3 ways
    out = answer(ask(layout=odd, placement=Placement(WORLD[:3]), remove=()), PROFILE, SETTINGS, NOW).message
    assert isinstance(out, PlanningFailed)
    assert out.reason.startswith("current.layout:")


ENV = {MODEL_ENV: "tiny-gpt", HARDWARE_ENV: "cpu-small", GLOBAL_BATCH_ENV: "8", SEQUENCE_LENGTH_ENV: "32"}
"""A complete default profile in the environment."""

# -- lost devices: the answer leaves them out and passes them on to the transfer planner ---------------


def test_lost_devices_hold_no_rank_and_travel_on_in_the_answer() -> None:
    planned = answer(ask(remove=(), lost=(WORLD[3],)), PROFILE, SETTINGS, NOW).message
    assert isinstance(planned, TopologyPlanned)
    assert WORLD[3] not in planned.placement.devices
    assert planned.lost == (WORLD[3],)
    assert decode(encode(planned), TopologyPlanned).lost == (WORLD[3],)


def test_whether_the_job_keeps_peer_copies_travels_on_in_the_answer() -> None:
    for kept in (True, False):
        planned = answer(ask(remove=(), lost=(WORLD[3],), peer_copies=kept), PROFILE, SETTINGS, NOW).message
        assert isinstance(planned, TopologyPlanned)
        assert decode(encode(planned), TopologyPlanned).peer_copies is kept


def test_a_lost_device_with_a_surviving_replica_is_planned_around_from_the_answer_alone() -> None:
    # WORLD[3] ran TP rank 1 of replica 1; WORLD[1] holds the same shard.
    planned = answer(ask(remove=(), lost=(WORLD[3],)), PROFILE, SETTINGS, NOW).message
    assert isinstance(planned, TopologyPlanned)
    transfer = plan_transfer(planned, budget_bytes=1 << 20)
    assert verify_plan(transfer.plan, lost=planned.lost).ok
    assert WORLD[3] not in {transfer.plan.old.placement.devices[t.src] for t in transfer.plan.tasks}


def test_state_lost_with_every_replica_passes_the_topology_planner_and_fails_the_transfer_planner() -> None:
    # Every layout needs all the state, so only the transfer planner, which finds the tensor that
    # survives nowhere, can say what is missing; the coordinator aborts on either stage's failure.
    request = ask(remove=(), lost=(WORLD[1], WORLD[3]))  # both replicas of TP rank 1
    planned = answer(request, PROFILE, SETTINGS, NOW).message
    assert isinstance(planned, TopologyPlanned)
    with pytest.raises(NoSurvivingSource) as info:
        plan_transfer(planned, budget_bytes=1 << 20)
    failed = planning_failed(planned, info.value)
    assert (failed.stage, failed.generation, failed.event_id) == ("transfer", 1, "evt-1")
    assert (
        info.value.tensor in failed.reason and "node000:1" in failed.reason and "node001:1" in failed.reason
    )


# -- configuration --------------------------------------------------------------------------------------


def test_environment_variables_make_the_default_profile() -> None:
    settings = TopologySettings.from_env(ENV | {MODEL_ENV: "tiny-llama"})
    profile = settings.profile_for("any-job")
    assert profile == JobProfile(
        model=PRESETS["tiny-llama"],
        setup=TrainingSetup(global_batch_size=8, sequence_length=32),
        hardware=CPU_SMALL,
    )


def test_a_config_file_gives_jobs_their_own_profiles_and_variables_override_its_default(
    tmp_path: Path,
) -> None:
    custom = msgspec.to_builtins(ROOMY)
    config = {
        "default": {
            "model": "tiny-gpt",
            "hardware": "cpu-small",
            "setup": {"global_batch_size": 4, "sequence_length": 16},
        },
        "jobs": {
            "job-7": {
                "model": msgspec.to_builtins(PRESETS["tiny-llama"]),
                "hardware": custom,
                "setup": {"global_batch_size": 2, "sequence_length": 8},
            }
        },
        "top": 3,
    }
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(config))
    settings = TopologySettings.from_env({CONFIG_ENV: str(path), GLOBAL_BATCH_ENV: "16"})
    assert settings.top == 3
    default = settings.profile_for("job-1")
    assert default is not None
    assert (default.model, default.hardware) == (MODEL, CPU_SMALL)
    assert default.setup == TrainingSetup(global_batch_size=16, sequence_length=16)
    own = settings.profile_for("job-7")
    assert own is not None and own.hardware == ROOMY and own.model == PRESETS["tiny-llama"]


def test_a_bad_field_in_the_config_file_is_named_by_its_path(tmp_path: Path) -> None:
    path = tmp_path / "topology.json"
    path.write_text(
        json.dumps(
            {
                "default": {
                    "model": "tiny-gpt",
                    "hardware": "cpu-small",
                    "setup": {"global_batch_size": 0, "sequence_length": 8},
                }
            }
        )
    )
    with pytest.raises(TopologyConfigError, match=r"\$\.default\.setup\.global_batch_size"):
        TopologySettings.from_env({CONFIG_ENV: str(path)})


def test_an_unknown_preset_in_the_environment_is_named_with_its_variable() -> None:
    env = ENV | {MODEL_ENV: "gpt-5"}
    with pytest.raises(TopologyConfigError, match=f"^{MODEL_ENV}: unknown model preset 'gpt-5'"):
        TopologySettings.from_env(env)


def test_a_partial_environment_names_the_missing_variable() -> None:
    with pytest.raises(TopologyConfigError, match=f"^{HARDWARE_ENV}: needed"):
        TopologySettings.from_env({k: v for k, v in ENV.items() if k != HARDWARE_ENV})


def test_sequences_longer_than_the_models_positions_are_refused() -> None:
    env = ENV | {SEQUENCE_LENGTH_ENV: "65"}
    with pytest.raises(TopologyConfigError, match=r"`default\.setup`: sequence_length \(65\) exceeds"):
        TopologySettings.from_env(env)


def test_a_service_without_any_profile_refuses_to_start() -> None:
    with pytest.raises(TopologyConfigError, match=f"set {CONFIG_ENV}"):
        create_service({})


# -- on the bus -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[NatsServer]:
    """One server for this module (LiveR's real stream names); every test uses its own job id."""
    with NatsServer() as srv:
        yield srv


@dataclass
class Rig:
    nc: Client
    js: JetStreamContext
    service: TopologyService
    planned: Collector
    failed: Collector
    errors: Collector

    async def publish(self, payload: bytes | TopologyRequest, job: str) -> int:
        data = payload if isinstance(payload, bytes) else encode(payload)
        return (await self.js.publish(s.topology_request(job), data)).seq

    async def settled(self) -> bool:
        info = await self.js.consumer_info(s.STREAM_CONTROL.name, SETTINGS.durable)
        return info.num_pending == 0 and info.num_ack_pending == 0


@pytest.fixture
def job(request: pytest.FixtureRequest) -> str:
    """A job id of the test's own, so tests sharing the server never see each other's answers."""
    return request.node.name.replace("_", "-")[:100]


@pytest.fixture
async def rig(server: NatsServer, job: str) -> AsyncIterator[Rig]:
    service = TopologyService(SETTINGS)
    async with client(server.url) as (nc, js), running(service, server.url):
        yield Rig(
            nc=nc,
            js=js,
            service=service,
            planned=await Collector.on(nc, s.topology_planned(job)),
            failed=await Collector.on(nc, s.planning_failed(job)),
            errors=await Collector.on(nc, s.errors("topology")),
        )


@pytest.mark.slow
async def test_a_request_is_answered_with_the_planned_topology_and_acknowledged(rig: Rig, job: str) -> None:
    await rig.publish(ask(job), job)
    out = await rig.planned.one(TopologyPlanned)
    assert (out.job_id, out.event_id, out.generation) == (job, "evt-1", 1)
    assert set(out.placement.devices) <= set(WORLD[:2])
    assert out.candidates and out.explanation
    await eventually(rig.settled, what="the request is acknowledged")
    assert rig.service.counts["planned"] == 1


@pytest.mark.slow
async def test_an_unplannable_request_is_answered_with_a_planning_failure(rig: Rig, job: str) -> None:
    await rig.publish(ask(job, device_memory_bytes=64 * 1024), job)
    out = await rig.failed.one(PlanningFailed)
    assert (out.job_id, out.generation, out.stage) == (job, 1, "topology")
    assert "out of memory" in out.reason
    assert not rig.planned.messages


@pytest.mark.slow
async def test_a_job_without_a_profile_gets_a_planning_failure_that_says_so(
    server: NatsServer, job: str
) -> None:
    only_other = TopologySettings(jobs={"other-job": PROFILE}, ack_wait_s=30.0, progress_every_s=1.0)
    async with client(server.url) as (nc, js), running(TopologyService(only_other), server.url):
        failed = await Collector.on(nc, s.planning_failed(job))
        await js.publish(s.topology_request(job), encode(ask(job)))
        out = await failed.one(PlanningFailed)
    assert out.reason == f"the topology service has no model configured for job {job!r}"


@pytest.mark.slow
async def test_a_malformed_request_is_reported_by_field_kept_as_a_dead_letter_and_the_next_one_served(
    rig: Rig, job: str
) -> None:
    bad = json.loads(encode(ask(job)))
    bad["generation"] = -1
    seq = await rig.publish(json.dumps(bad).encode(), job)
    await rig.publish(ask(job), job)
    await rig.planned.wait_for(1)
    (error,) = [e for e in error_events(rig.errors) if e.job_id == job]
    assert (error.field, error.stream_sequence) == ("$.generation", seq)
    dead = await stored(rig.js, s.STREAM_DEAD_LETTERS.name, s.dead_letters("topology"))
    assert any(d.headers and d.headers[s.HEADER_ORIGINAL_SEQUENCE] == str(seq) for d in dead)


@pytest.mark.slow
async def test_a_request_on_another_jobs_subject_is_rejected_naming_the_job(rig: Rig, job: str) -> None:
    await rig.publish(ask("somebody-else"), job)
    await rig.errors.wait_for(1)
    (error,) = [e for e in error_events(rig.errors) if e.job_id == "somebody-else"]
    assert error.field == "$.job_id"
    assert "arrived on the subject of job" in error.message
    assert not rig.planned.messages and not rig.failed.messages


# -- the job's own model geometry -------------------------------------------------------------------------


def test_the_jobs_own_geometry_decides_which_layouts_suit_it_and_is_what_the_plan_moves() -> None:
    # The job's own model splits its heads at most two ways (the configured preset allows four), and
    # this cluster's nodes are large enough for TP4.
    own = msgspec.structs.replace(
        MODEL.geometry(), name="own-model", tp_divisible=(TpDivisor("num_attention_heads", 2),)
    )
    one_node = grid_devices(1, 4)
    request = ask(layout=ParallelLayout(tp=2, pp=1, dp=2), placement=Placement(one_node), remove=())
    plain = answer(request, PROFILE, SETTINGS, NOW).message
    planned = answer(msgspec.structs.replace(request, geometry=own), PROFILE, SETTINGS, NOW).message
    assert isinstance(plain, TopologyPlanned) and isinstance(planned, TopologyPlanned)
    assert any(c.layout.tp == 4 and c.fits for c in plain.candidates)
    assert all(c.layout.tp <= 2 for c in planned.candidates if c.fits)
    assert any("the job's model" in c.note for c in planned.candidates if c.layout.tp == 4)
    assert planned.model == own
    transfer = plan_transfer(planned, budget_bytes=1 << 20)
    assert transfer.plan.model == own and verify_plan(transfer.plan).ok


def test_a_job_model_deeper_or_shallower_than_the_configured_one_fails_planning_naming_both() -> None:
    preset = MODEL.geometry()
    own = msgspec.structs.replace(
        preset,
        name="own-model",
        num_layers=3,
        parameters=tuple(
            msgspec.structs.replace(p, layers=(0, 3)) if p.layers else p for p in preset.parameters
        ),
    )
    failed = answer(ask(geometry=own), PROFILE, SETTINGS, NOW).message
    assert isinstance(failed, PlanningFailed)
    assert "3 decoder layers" in failed.reason and "4" in failed.reason


def test_the_memory_estimate_counts_the_state_of_the_jobs_own_model_tensor_for_tensor() -> None:
    preset = MODEL.geometry()
    head = ParamGeometry(
        name="value_head.weight", shape=(4096, 64), dtype="float32", rule="column", home="last"
    )
    own = msgspec.structs.replace(preset, name="own-model", parameters=(*preset.parameters, head))
    request = ask(remove=())
    plain = answer(request, PROFILE, SETTINGS, NOW).message
    planned = answer(msgspec.structs.replace(request, geometry=own), PROFILE, SETTINGS, NOW).message
    assert isinstance(plain, TopologyPlanned) and isinstance(planned, TopologyPlanned)
    layout = ParallelLayout(tp=2, pp=1, dp=2)
    before = next(c.memory_bytes for c in plain.candidates if c.layout == layout)
    after = next(c.memory_bytes for c in planned.candidates if c.layout == layout)
    # Half the head per TP rank: fp32 weight and two Adam moments, and its fp32 gradient.
    assert after - before == (4096 * 64 // 2) * 4 * (3 + 1)


def test_node_redundancy_comes_from_its_variable_and_a_bad_value_is_named() -> None:
    from liver.services.topology.settings import REDUNDANCY_ENV

    assert TopologySettings.from_env(ENV).redundancy == "none"
    assert TopologySettings.from_env(ENV | {REDUNDANCY_ENV: "node"}).redundancy == "node"
    with pytest.raises(TopologyConfigError, match=f"^{REDUNDANCY_ENV}: 'rack' is neither"):
        TopologySettings.from_env(ENV | {REDUNDANCY_ENV: "rack"})
