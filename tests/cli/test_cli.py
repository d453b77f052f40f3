"""The `liver` console script: lazy subcommands and one-line errors."""

import json

import pytest

from liver.cli.main import main


def test_plan_prints_one_json_object(capsys):
    assert main(["plan", "--model", "tiny-llama", "--from", "2,2,1", "--to", "1,1,2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["verified"] is True
    assert summary["bytes_moved"] + summary["bytes_local"] == summary["bytes_total"]


def test_a_pp_that_does_not_divide_the_layers_gets_the_topology_planners_balanced_split(capsys):
    assert main(["plan", "--model", "tiny-gpt", "--from", "1,2,1", "--to", "1,3,1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_layout"] == "TP1,PP3,DP1[1/2/1]"
    assert out["verified"] is True


def test_a_split_given_with_the_layout_is_kept(capsys):
    assert main(["plan", "--model", "tiny-gpt", "--from", "1,2,1", "--to", "1,3,1:2/1/1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_layout"] == "TP1,PP3,DP1[2/1/1]"


def test_an_unknown_preset_is_a_one_line_error(capsys):
    assert main(["plan", "--model", "gpt-9000", "--from", "1,1,1", "--to", "1,1,1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown model preset 'gpt-9000'" in err and "\n" not in err


def test_an_impossible_layout_names_the_reason(capsys):
    assert main(["plan", "--model", "tiny-gpt", "--from", "3,1,1", "--to", "1,1,1"]) == 2
    assert "num_attention_heads (4) is not divisible by tp=3" in capsys.readouterr().err


def test_a_malformed_layout_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "tiny-gpt", "--from", "2,2", "--to", "1,1,1"])
    assert exit_info.value.code == 2
    assert "expected TP,PP,DP" in capsys.readouterr().err


def test_a_moe_preset_plans_an_expert_parallel_move_to_a_file(tmp_path, capsys):
    from liver.reshard.plan_file import read_plan

    out = tmp_path / "moe.json"
    args = [
        "plan",
        "--model",
        "tiny-moe",
        "--from",
        "1,1,8,EP2",
        "--to",
        "TP1,PP1,DP4,EP4",
        "--per-node",
        "4",
    ]
    assert main([*args, "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verified"] is True
    plan = read_plan(str(out))
    assert plan.new.layout.ep == 4 and plan.model.num_experts == 4


def test_expert_parallelism_that_does_not_divide_the_experts_is_refused(capsys):
    assert main(["plan", "--model", "tiny-moe", "--from", "1,1,8,EP2", "--to", "1,1,8,EP8"]) == 2
    assert "num_experts (4) is not divisible by ep=8" in capsys.readouterr().err


def test_the_plan_file_is_written_and_reads_back(tmp_path):
    from liver.reshard.plan_file import read_plan

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny-gpt", "--from", "2,1,1", "--to", "1,2,1", "--out", str(out)]) == 0
    assert read_plan(str(out)).new.layout.pp == 2


def test_help_lists_every_command_without_importing_them(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("plan", "serve", "worker", "workers", "demo", "sim", "bench"):
        assert name in out


def test_plan_with_a_lost_replica_reads_everything_from_the_survivor(tmp_path, capsys):
    from liver.reshard.plan_file import read_plan

    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny-gpt", "--from", "1,1,2", "--to", "1,1,1", "--per-node", "1"]
    assert main([*argv, "--lost", "node001", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verified"] is True
    plan = read_plan(str(out))
    assert plan.new.placement.devices == plan.old.placement.devices[:1]
    assert {t.src for t in plan.tasks} == {0}


def test_plan_whose_state_was_only_on_lost_devices_says_the_job_falls_back(capsys):
    argv = ["plan", "--model", "tiny-gpt", "--from", "2,1,1", "--to", "1,1,1", "--per-node", "1"]
    assert main([*argv, "--lost", "node001:0"]) == 1
    err = capsys.readouterr().err
    assert "no live transfer is possible" in err and "node001:0" in err and "checkpoint" in err


def test_plan_refuses_a_lost_device_outside_the_old_world(capsys):
    argv = ["plan", "--model", "tiny-gpt", "--from", "2,1,1", "--to", "1,1,1"]
    assert main([*argv, "--lost", "node007:3"]) == 2
    assert "--lost: 'node007:3' is not a device" in capsys.readouterr().err


def test_a_distributed_optimizer_plan_is_written_with_its_ddp_settings(tmp_path, capsys):
    from liver.reshard.plan_file import read_plan

    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny-gpt", "--from", "1,1,2", "--to", "2,1,1", "--distributed-optimizer"]
    assert main([*argv, "--bucket-size", "5000", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verified"] is True
    plan = read_plan(str(out))
    assert plan.model.distributed and plan.model.ddp.bucket_size == 5000


def test_a_distributed_optimizer_whose_lost_owner_held_state_cannot_be_planned(capsys):
    argv = ["plan", "--model", "tiny-gpt", "--from", "1,1,2", "--to", "1,1,1", "--per-node", "1"]
    assert main([*argv, "--lost", "node001", "--distributed-optimizer"]) == 1
    assert "falls back to its last checkpoint" in capsys.readouterr().err


def test_a_bucket_size_without_the_distributed_optimizer_is_refused(capsys):
    argv = ["plan", "--model", "tiny-gpt", "--from", "1,1,2", "--to", "1,1,1", "--bucket-size", "10"]
    assert main(argv) == 2
    assert "--bucket-size" in capsys.readouterr().err
