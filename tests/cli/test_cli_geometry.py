"""`liver geometry` derives a user's model's geometry from its provider; `liver plan` plans with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from repo_paths import EXAMPLES

from liver.cli.main import main
from liver.shared.geometry import ModelGeometry
from liver.shared.model import PRESETS, ModelError, ModelSpec, load_model_or_geometry

EXAMPLE = EXAMPLES / "your_own_job.py"


@pytest.fixture(scope="module")
def geometry_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("geometry") / "g.json"
    command = [sys.executable, "-m", "liver.cli.main", "geometry", "--provider", f"{EXAMPLE}:model_provider"]
    command += ["--name", "qk-norm-gpt", "--num-layers", "4", "--vocab-size", "258"]
    command += ["--make-vocab-size-divisible-by", "16"]
    done = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "digest" in done.stdout
    return out


@pytest.mark.slow
def test_the_geometry_of_the_users_own_model_is_written_from_its_provider(geometry_file: Path) -> None:
    geometry = msgspec.json.decode(geometry_file.read_bytes(), type=ModelGeometry)
    names = {p.name for p in geometry.parameters}
    assert "decoder.layers.{layer}.self_attention.q_layernorm.weight" in names
    assert geometry.vocab_size == 258 and geometry.num_layers == 4


@pytest.mark.slow
def test_liver_plan_plans_and_verifies_a_resize_of_the_users_model(geometry_file: Path, capsys) -> None:
    assert main(["plan", "--model", str(geometry_file), "--from", "2,2,1", "--to", "1,1,4", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"] == "qk-norm-gpt" and printed["verified"] is True


def test_a_provider_that_cannot_be_found_is_refused_in_one_line(capsys) -> None:
    assert (
        main(["geometry", "--provider", "no_such_module:provider", "--name", "x", "--num-layers", "2"]) == 2
    )
    assert main(["geometry", "--provider", "nocolon", "--name", "x", "--num-layers", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot import no_such_module" in err and "MODULE:FUNCTION" in err


def test_a_model_file_is_read_as_a_modelspec_or_a_geometry_by_its_fields(tmp_path: Path) -> None:
    spec_file, geometry_file, bad = tmp_path / "s.json", tmp_path / "g.json", tmp_path / "bad.json"
    spec_file.write_bytes(msgspec.json.encode(PRESETS["tiny-gpt"]))
    geometry_file.write_bytes(msgspec.json.encode(PRESETS["tiny-gpt"].geometry()))
    assert isinstance(load_model_or_geometry(str(spec_file)), ModelSpec)
    assert load_model_or_geometry(str(geometry_file)) == PRESETS["tiny-gpt"].geometry()
    data = msgspec.to_builtins(PRESETS["tiny-gpt"].geometry())
    data["num_layers"] = 0
    bad.write_bytes(msgspec.json.encode(data))
    with pytest.raises(ModelError, match="num_layers"):
        load_model_or_geometry(str(bad))
