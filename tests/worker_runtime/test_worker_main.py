"""The training worker's pieces that need no model: the bridge between companion and runtime, the stop
rule, the settings' checks and the metrics file."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.messages import Abort, ObjectRef, Prepare, SliceIndex, Switch
from liver.worker_runtime.companion.bridge import RuntimeBridge, store_address
from liver.worker_runtime.fallback import FallbackReport
from liver.worker_runtime.handoff import Role, SwitchReport
from liver.worker_runtime.metrics import MetricsLog, Step, Stopped, read_lines
from liver.worker_runtime.runtime import AbortReport, ReshardPhase, RuntimeEvent
from liver.worker_runtime.worker_main import DEMO_TRAIN, InitialWorld, StopRule, WorkerSettings
from liver.worker_runtime.world import StoreAddress

JOB = "job-1"
A, B = Device("n0", 0), Device("n0", 1)
LAYOUT = ParallelLayout(tp=1, pp=1, dp=1)
DEADLINE = datetime(2030, 1, 1, tzinfo=UTC)


class FakeRuntime:
    """Records what the bridge asks of the runtime."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def request_resize(self, *args: Any, **kwargs: Any) -> Role:
        self.calls.append(("request_resize", (args, kwargs)))
        return Role.STAY

    def allow_switch(self, generation: int) -> None:
        self.calls.append(("allow_switch", generation))

    def abort(self, generation: int, reason: str, *, fallback: bool = False) -> None:
        self.calls.append(("abort", (generation, reason, "fallback") if fallback else (generation, reason)))


class Acks:
    """Stands in for ``Companion.report``."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def __call__(self, phase: str, **fields: Any) -> None:
        self.sent.append({"phase": phase, **fields})


def bridge(grace_s: float = 30.0) -> tuple[RuntimeBridge, FakeRuntime, Acks]:
    runtime, acks = FakeRuntime(), Acks()
    b = RuntimeBridge(switch_grace_s=grace_s)
    b.attach(runtime, acks)
    return b, runtime, acks


def prepare(store: str | None = "10.0.0.7:29500") -> Prepare:
    return Prepare(
        job_id=JOB,
        event_id="evt-1",
        from_generation=3,
        generation=4,
        from_layout=LAYOUT,
        from_placement=Placement((A,)),
        layout=LAYOUT,
        placement=Placement((A,)),
        plan=ObjectRef(bucket="liver-plans", name="job-1/gen4/plan", size=10),
        slices=SliceIndex(bucket="liver-plans", prefix="job-1/gen4/s-", count=1),
        staging_bytes=1 << 20,
        deadline=DEADLINE,
        store=store,
    )


def report(generation: int = 4, **fields: Any) -> SwitchReport:
    base = {
        "generation": generation,
        "from_generation": generation - 1,
        "role": Role.STAY,
        "iteration": 17,
        "old_rank": 0,
        "new_rank": 0,
        "pause_s": 0.25,
        "switch_s": 0.05,
        "transfer_s": 0.1,
        "rebuild_s": 0.1,
        "commit_s": 0.01,
        "build_s": 0.05,
        "load_s": 0.05,
        "bytes_sent": 100,
        "bytes_received": 300,
    }
    base.update(fields)
    return SwitchReport(**base)


# -- the bridge: commands in --------------------------------------------------------------------------


def test_prepare_requests_the_resize_on_the_store_it_names_switching_only_when_allowed() -> None:
    b, runtime, _ = bridge(grace_s=30.0)
    plan = object()
    b.on_prepare(prepare(), plan)  # type: ignore[arg-type]
    [(name, (args, kwargs))] = runtime.calls
    assert name == "request_resize"
    generation, layout, placement, got_plan, store, deadline = args
    assert (generation, layout, placement, got_plan) == (4, LAYOUT, Placement((A,)), plan)
    assert store == StoreAddress("10.0.0.7", 29500)
    assert deadline == DEADLINE + timedelta(seconds=30)
    assert kwargs == {"from_generation": 3, "switch_when_ready": False, "lost": ()}


def test_prepare_without_a_store_is_refused_naming_the_field() -> None:
    b, runtime, _ = bridge()
    with pytest.raises(ValueError, match="`store`"):
        b.on_prepare(prepare(store=None), object())  # type: ignore[arg-type]
    assert runtime.calls == []


@pytest.mark.parametrize("text", ["nohost", ":29500", "host:", "host:port", "host:70000"])
def test_a_malformed_store_address_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="`store`"):
        store_address(text)


def test_switch_allows_the_switch_and_abort_aborts_the_generation() -> None:
    b, runtime, _ = bridge()
    b.on_switch(Switch(job_id=JOB, generation=4, deadline=DEADLINE))
    b.on_abort(Abort(job_id=JOB, generation=4, reason="node lost"))
    assert runtime.calls == [("allow_switch", 4), ("abort", (4, "node lost"))]


def test_an_abort_that_falls_back_to_the_checkpoint_says_so_to_the_runtime() -> None:
    b, runtime, _ = bridge()
    b.on_abort(Abort(job_id=JOB, generation=4, reason="no surviving source", fallback=True))
    assert runtime.calls == [("abort", (4, "no surviving source", "fallback"))]


def test_a_command_before_attach_raises_so_the_agent_reports_it_failed() -> None:
    with pytest.raises(RuntimeError, match="no runtime"):
        RuntimeBridge().on_switch(Switch(job_id=JOB, generation=4, deadline=DEADLINE))


# -- the bridge: events out ---------------------------------------------------------------------------


def test_ready_is_acked_ready() -> None:
    b, _, acks = bridge()
    b.on_event(RuntimeEvent(generation=4, phase=ReshardPhase.READY, iteration=9))
    assert acks.sent == [{"phase": "ready", "generation": 4}]


@pytest.mark.parametrize("phase", [ReshardPhase.SWITCHED, ReshardPhase.LEFT])
def test_a_switch_or_a_departure_is_acked_switched_with_cut_pause_and_bytes(phase: ReshardPhase) -> None:
    b, _, acks = bridge()
    b.on_event(RuntimeEvent(generation=4, phase=phase, iteration=17, report=report()))
    assert acks.sent == [
        {
            "phase": "switched",
            "generation": 4,
            "iteration": 17,
            "pause_s": 0.25,
            "bytes_sent": 100,
            "bytes_received": 300,
        }
    ]


def test_a_handoff_the_runtime_gave_up_on_its_own_is_acked_failed_with_stage_and_reason() -> None:
    b, _, acks = bridge()
    abort = AbortReport(generation=4, stage="prepare", reason="store unreachable", iteration=None)
    b.on_event(RuntimeEvent(generation=4, phase=ReshardPhase.ABORTED, abort=abort))
    assert acks.sent == [
        {"phase": "failed", "generation": 4, "error": "prepare: store unreachable", "falling_back": False}
    ]


def test_a_world_that_lost_a_peer_is_acked_peer_lost_with_its_generation() -> None:
    b, _, acks = bridge()
    b.on_event(RuntimeEvent(generation=3, phase=ReshardPhase.PEER_LOST, iteration=41))
    assert [(a["phase"], a["generation"]) for a in acks.sent] == [("peer_lost", 3)]


def test_a_handoff_the_coordinator_aborted_is_acked_aborted() -> None:
    b, _, acks = bridge()
    b.on_abort(Abort(job_id=JOB, generation=4, reason="deadline"))
    abort = AbortReport(
        generation=4, stage="cut", reason="aborted by request: deadline", iteration=12, by_request=True
    )
    b.on_event(RuntimeEvent(generation=4, phase=ReshardPhase.ABORTED, iteration=12, abort=abort))
    assert [a["phase"] for a in acks.sent] == ["aborted"]


def test_a_handoff_another_rank_failed_is_acked_failed_even_after_an_abort_arrived() -> None:
    b, _, acks = bridge()
    b.on_abort(Abort(job_id=JOB, generation=4, reason="deadline"))
    abort = AbortReport(generation=4, stage="cut", reason="generation 4 failed on another rank", iteration=12)
    b.on_event(RuntimeEvent(generation=4, phase=ReshardPhase.ABORTED, iteration=12, abort=abort))
    assert [a["phase"] for a in acks.sent] == ["failed"]


def test_the_open_generation_is_the_prepared_one_until_it_switches() -> None:
    b, _, _ = bridge()
    assert b.open_generation is None
    b.on_prepare(prepare(), object())  # type: ignore[arg-type]
    assert b.open_generation == 4
    b.on_event(RuntimeEvent(generation=4, phase=ReshardPhase.READY))
    assert b.open_generation == 4
    b.on_event(RuntimeEvent(generation=4, phase=ReshardPhase.SWITCHED, iteration=17, report=report()))
    assert b.open_generation is None


def test_a_fallback_to_the_checkpoint_is_acked_failed_at_once_saying_so() -> None:
    b, _, acks = bridge()
    b.on_prepare(prepare(), object())  # type: ignore[arg-type]
    abort = AbortReport(generation=4, stage="commit", reason="old rank 1 is gone", iteration=12)
    b.on_event(RuntimeEvent(generation=4, phase=ReshardPhase.FALLING_BACK, iteration=12, abort=abort))
    assert acks.sent == [
        {
            "phase": "failed",
            "generation": 4,
            "error": "commit: old rank 1 is gone; falling back to the last checkpoint",
            "falling_back": True,
        }
    ]
    assert b.open_generation is None


def test_the_restart_from_the_checkpoint_is_not_acked() -> None:
    b, _, acks = bridge()
    fallback = FallbackReport(
        failed_generation=4,
        generation=5,
        role=Role.STAY,
        rank=0,
        checkpoint="/ckpt/iter_0000010",
        iteration=10,
        reached_iteration=12,
        steps_lost=2,
        reason="old rank 1 is gone",
        seconds=3.0,
    )
    b.on_event(RuntimeEvent(generation=5, phase=ReshardPhase.FELL_BACK, iteration=10, fallback=fallback))
    assert acks.sent == []


def test_preparing_is_not_acked() -> None:
    b, _, acks = bridge()
    b.on_event(RuntimeEvent(generation=4, phase=ReshardPhase.PREPARING))
    assert acks.sent == []


# -- stopping -------------------------------------------------------------------------------------------


def test_the_stop_rule_stops_after_max_steps() -> None:
    rule = StopRule(max_steps=5, stop_file=None)
    assert [rule.why(i) for i in (4, 5)] == [None, "steps"]


def test_the_stop_rule_stops_at_the_iteration_in_the_stop_file(tmp_path: Path) -> None:
    path = tmp_path / "stop"
    rule = StopRule(max_steps=None, stop_file=str(path))
    assert rule.why(100) is None  # no file yet
    path.write_text("")
    assert rule.why(100) is None  # created, not yet written
    path.write_text("12\n")
    assert [rule.why(i) for i in (11, 12, 13)] == [None, "stop_file", "stop_file"]


def test_a_stop_file_that_holds_no_iteration_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "stop"
    path.write_text("soon")
    with pytest.raises(ValueError, match="`stop_file`"):
        StopRule(max_steps=None, stop_file=str(path)).why(1)


# -- settings -------------------------------------------------------------------------------------------


def first_world(**fields: Any) -> InitialWorld:
    base: dict[str, Any] = {
        "layout": ParallelLayout(tp=2, pp=1, dp=1),
        "placement": Placement((A, B)),
        "store": "127.0.0.1:29500",
    }
    base.update(fields)
    return InitialWorld(**base)


def test_a_worker_outside_its_initial_world_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`initial.placement`"):
        WorkerSettings(job_id=JOB, node="n9", device=0, initial=first_world())


def test_a_rank_other_than_0_needs_rank_0s_store() -> None:
    with pytest.raises(ValueError, match=r"`initial.store`"):
        WorkerSettings(job_id=JOB, node="n0", device=1, initial=first_world(store=None))
    assert WorkerSettings(job_id=JOB, node="n0", device=0, initial=first_world(store=None)).initial_rank == 0


def test_a_layout_the_batch_cannot_split_over_is_refused() -> None:
    wide = first_world(layout=ParallelLayout(tp=1, pp=1, dp=2))
    with pytest.raises(ValueError, match=r"`initial.layout`"):
        WorkerSettings(
            job_id=JOB,
            node="n0",
            device=0,
            initial=wide,
            train=msgspec.structs.replace(DEMO_TRAIN, global_batch_size=3),
        )


def test_an_unknown_model_is_refused_naming_the_presets() -> None:
    with pytest.raises(ValueError, match=r"`model`.*tiny-gpt"):
        WorkerSettings(job_id=JOB, node="n0", device=0, model="gpt-17")


def test_a_checkpoint_directory_gives_the_runtime_its_checkpoints_and_fallback() -> None:
    settings = WorkerSettings(
        job_id=JOB, node="n0", device=0, checkpoint_dir="/shared/ckpt", checkpoint_every=50, checkpoint_keep=3
    )
    checkpoint = settings.runtime_options().checkpoint
    assert checkpoint is not None
    assert (checkpoint.root, checkpoint.every, checkpoint.keep_last) == ("/shared/ckpt", 50, 3)
    assert checkpoint.resume  # a restarted job goes on from its latest checkpoint
    assert WorkerSettings(job_id=JOB, node="n0", device=0).runtime_options().checkpoint is None


def test_a_checkpoint_interval_without_a_directory_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="`checkpoint_every`"):
        WorkerSettings(job_id=JOB, node="n0", device=0, checkpoint_every=50)


def test_the_worker_id_defaults_to_node_and_device_as_a_subject_token() -> None:
    assert WorkerSettings(job_id=JOB, node="n0", device=1).name == "w-n0-1"
    assert WorkerSettings(job_id=JOB, node="ip-10-0-1-7.ec2:a/b", device=0).name == "w-ip-10-0-1-7_ec2_a_b-0"


# -- metrics --------------------------------------------------------------------------------------------


def test_metrics_lines_read_back_as_the_records_written(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path, "w-n0-0")
    log.write(
        Step, iteration=1, loss=6.5, grad_norm=1.0, generation=0, rank=0, layout="TP1,PP1,DP1", step_s=0.1
    )
    log.write(Stopped, why="steps", iteration=1)
    log.close()
    records = list(read_lines(path))
    assert [type(r) for r in records] == [Step, Stopped]
    assert records[0].loss == 6.5 and records[0].worker_id == "w-n0-0"


def test_a_torn_last_line_is_skipped_and_a_corrupt_one_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path, "w-n0-0")
    log.write(Stopped, why="steps", iteration=1)
    log.close()
    with path.open("ab") as fh:
        fh.write(b'{"kind":"step","t":1')
    assert len(list(read_lines(path))) == 1
    path.write_bytes(b'{"kind":"nonsense"}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:1"):
        list(read_lines(path))


# -- the command line -------------------------------------------------------------------------------------


def test_liver_worker_needs_the_jobs_nats_server(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from liver.cli import worker_cmd

    monkeypatch.delenv("NATS_URL", raising=False)
    assert worker_cmd.main(["--job", JOB, "--node", "n0", "--device", "0", "--standby"]) == 2
    assert "NATS_URL" in capsys.readouterr().err


def test_liver_worker_in_the_first_world_needs_the_placement(capsys: Any) -> None:
    from liver.cli import worker_cmd

    assert worker_cmd.main(["--job", JOB, "--node", "n0", "--device", "0", "--layout", "2,1,1"]) == 2
    assert "--placement" in capsys.readouterr().err


def test_liver_worker_arguments_become_the_settings() -> None:
    from liver.cli import worker_cmd

    parser = worker_cmd.argparse.ArgumentParser()
    worker_cmd.add_arguments(parser)
    first_world = ["--layout", "2,1,1", "--placement", "n0:0,n0:1", "--store", "127.0.0.1:29500"]
    args = parser.parse_args(
        [
            "--job",
            JOB,
            "--node",
            "n0",
            "--device",
            "1",
            *first_world,
            "--steps",
            "7",
            "--metrics",
            "/tmp/m.jsonl",
        ]
    )
    settings = worker_cmd.settings_from(args)
    assert settings.initial is not None and settings.initial_rank == 1
    assert settings.initial.placement == Placement((A, B)) and settings.initial.store == "127.0.0.1:29500"
    assert (settings.max_steps, settings.metrics, settings.name) == (7, "/tmp/m.jsonl", "w-n0-1")


def test_liver_worker_checkpoint_arguments_become_the_settings() -> None:
    from liver.cli import worker_cmd

    parser = worker_cmd.argparse.ArgumentParser()
    worker_cmd.add_arguments(parser)
    checkpoints = ["--checkpoint-dir", "/shared/ckpt", "--checkpoint-every", "50", "--checkpoint-keep", "3"]
    args = parser.parse_args(["--job", JOB, "--node", "n0", "--device", "0", "--standby", *checkpoints])
    settings = worker_cmd.settings_from(args)
    assert (settings.checkpoint_dir, settings.checkpoint_every, settings.checkpoint_keep) == (
        "/shared/ckpt",
        50,
        3,
    )
    assert settings.checkpoint_resume
    fresh = parser.parse_args(["--job", JOB, "--node", "n0", "--device", "0", "--standby", "--fresh-start"])
    assert not worker_cmd.settings_from(fresh).checkpoint_resume


def test_liver_worker_checkpoint_interval_without_a_directory_is_refused(capsys: Any) -> None:
    from liver.cli import worker_cmd

    argv = ["--job", JOB, "--node", "n0", "--device", "0", "--standby", "--checkpoint-every", "5"]
    assert worker_cmd.main(argv) == 2
    assert "--checkpoint-every: needs --checkpoint-dir" in capsys.readouterr().err


def test_liver_worker_errors_name_the_flag_not_the_settings_field(capsys: Any) -> None:
    from liver.cli import worker_cmd

    first_world = ["--layout", "1,1,2", "--placement", "n0:0,n0:1"]
    assert worker_cmd.main(["--job", JOB, "--node", "n0", "--device", "1", *first_world]) == 2
    err = capsys.readouterr().err
    assert "--store: needed by every rank but 0" in err and "initial.store" not in err


def test_liver_worker_refuses_a_preset_beside_a_job_factory(capsys: Any) -> None:
    from liver.cli import worker_cmd

    argv = ["--job", JOB, "--node", "n0", "--device", "0", "--standby"]
    assert worker_cmd.main([*argv, "--job-factory", "my_job.py:make_job", "--model", "tiny-gpt"]) == 2
    assert "--model: a --job-factory job brings its own model" in capsys.readouterr().err


def test_liver_worker_refuses_job_arguments_without_a_job_factory(capsys: Any) -> None:
    from liver.cli import worker_cmd

    argv = ["--job", JOB, "--node", "n0", "--device", "0", "--standby", "--job-arg", "data=/x"]
    assert worker_cmd.main(argv) == 2
    assert "--job-arg: arguments of a job factory, but no --job-factory is given" in capsys.readouterr().err


def test_liver_worker_distributed_optimizer_shards_the_presets_optimizer_state() -> None:
    from liver.cli import worker_cmd

    parser = worker_cmd.argparse.ArgumentParser()
    worker_cmd.add_arguments(parser)
    argv = ["--job", JOB, "--node", "n0", "--device", "0", "--standby"]
    settings = worker_cmd.settings_from(parser.parse_args([*argv, "--distributed-optimizer"]))
    assert settings.train.use_distributed_optimizer
    assert settings.make_job().model.distributed
    assert not worker_cmd.settings_from(parser.parse_args(argv)).train.use_distributed_optimizer


def test_liver_worker_refuses_the_distributed_optimizer_flag_beside_a_job_factory(capsys: Any) -> None:
    from liver.cli import worker_cmd

    argv = ["--job", JOB, "--node", "n0", "--device", "0", "--standby", "--distributed-optimizer"]
    assert worker_cmd.main([*argv, "--job-factory", "my_job.py:make_job"]) == 2
    err = capsys.readouterr().err
    assert "--distributed-optimizer: a --job-factory job brings its own TrainConfig" in err


def test_liver_worker_copies_go_back_keeps_the_processs_own_state_for_a_step_back() -> None:
    from liver.cli import worker_cmd

    parser = worker_cmd.argparse.ArgumentParser()
    worker_cmd.add_arguments(parser)
    argv = ["--job", JOB, "--node", "n0", "--device", "0", "--standby"]
    on = worker_cmd.settings_from(parser.parse_args([*argv, "--copies-go-back"])).runtime_options()
    off = worker_cmd.settings_from(parser.parse_args(argv)).runtime_options()
    assert on.copies is not None and on.copies.go_back
    assert off.copies is not None and not off.copies.go_back  # copies, without going back


def test_liver_worker_no_copies_keeps_none_and_says_so_in_its_world_announcement() -> None:
    from liver.cli import worker_cmd

    parser = worker_cmd.argparse.ArgumentParser()
    worker_cmd.add_arguments(parser)
    argv = ["--job", JOB, "--node", "n0", "--device", "0", "--standby", "--no-copies"]
    settings = worker_cmd.settings_from(parser.parse_args(argv))
    assert settings.runtime_options().copies is None and not settings.copies


def test_liver_worker_copies_host_bytes_is_the_copies_budget() -> None:
    from liver.cli import worker_cmd

    parser = worker_cmd.argparse.ArgumentParser()
    worker_cmd.add_arguments(parser)
    argv = ["--job", JOB, "--node", "n0", "--device", "0", "--standby", "--copies-host-bytes", "1000000"]
    copies = worker_cmd.settings_from(parser.parse_args(argv)).runtime_options().copies
    assert copies is not None and copies.host_budget_bytes == 1_000_000


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (
            ["--no-copies", "--copies-go-back"],
            "--copies-go-back: an option of the peer copies, which --no-copies",
        ),
        (["--no-copies", "--copies-host-bytes", "5"], "--copies-host-bytes: an option of the peer copies"),
        (["--copies-host-bytes", "-5"], "--copies-host-bytes: must not be negative"),
    ],
)
def test_liver_worker_refuses_copy_options_that_contradict_each_other(
    extra: list[str], named: str, capsys: Any
) -> None:
    from liver.cli import worker_cmd

    argv = ["--job", JOB, "--node", "n0", "--device", "0", "--standby", *extra]
    assert worker_cmd.main(argv) == 2
    assert named in capsys.readouterr().err


def test_liver_worker_optimizer_instances_shards_the_presets_state_within_each_instance() -> None:
    from liver.cli import worker_cmd

    parser = worker_cmd.argparse.ArgumentParser()
    worker_cmd.add_arguments(parser)
    argv = ["--job", JOB, "--node", "n0", "--device", "0", "--standby", "--distributed-optimizer"]
    settings = worker_cmd.settings_from(parser.parse_args([*argv, "--optimizer-instances", "2"]))
    assert settings.make_job().model.ddp.instances == 2


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--optimizer-instances", "2"], "--optimizer-instances: an option of the preset's --distributed"),
        (
            ["--distributed-optimizer", "--optimizer-instances", "0"],
            "--optimizer-instances: must be at least 1",
        ),
    ],
)
def test_liver_worker_refuses_optimizer_instances_it_cannot_use(
    extra: list[str], named: str, capsys: Any
) -> None:
    from liver.cli import worker_cmd

    argv = ["--job", JOB, "--node", "n0", "--device", "0", "--standby", *extra]
    assert worker_cmd.main(argv) == 2
    assert named in capsys.readouterr().err
