"""``liver worker --job-factory FILE.py:FUNCTION``: how a user's own job is loaded, and what the worker
says when it cannot be (the flag named, nothing started)."""

from __future__ import annotations

from pathlib import Path

import pytest
from repo_paths import EXAMPLES

from liver.shared.errors import InputError
from liver.worker_runtime.megatron.job import MegatronJob, load_job
from liver.worker_runtime.worker_main import InitialWorld, WorkerSettings

EXAMPLE = EXAMPLES / "your_own_job.py"


def _write(tmp_path: Path, body: str) -> str:
    path = tmp_path / "my_job.py"
    path.write_text(body)
    return str(path)


def test_a_missing_file_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"--job-factory .*no such file"):
        load_job(f"{tmp_path}/nowhere.py:make_job")


def test_a_missing_function_is_refused_naming_it(tmp_path: Path) -> None:
    path = _write(tmp_path, "x = 1\n")
    with pytest.raises(InputError, match="has no function 'make_job'"):
        load_job(f"{path}:make_job")


def test_a_factory_that_returns_something_else_is_refused_saying_what(tmp_path: Path) -> None:
    path = _write(tmp_path, "def make_job():\n    return 42\n")
    with pytest.raises(InputError, match=r"returned int, not a liver\.MegatronJob"):
        load_job(f"{path}:make_job")


def test_arguments_the_factory_does_not_take_are_refused_naming_the_flag(tmp_path: Path) -> None:
    path = _write(tmp_path, "def make_job(data):\n    return data\n")
    with pytest.raises(InputError, match=r"--job-arg: .* does not take \['colour'\]"):
        load_job(f"{path}:make_job", {"colour": "red"})


def test_a_factory_that_raises_is_reported_with_its_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "def make_job(data):\n    raise FileNotFoundError(data)\n")
    with pytest.raises(InputError, match="raised FileNotFoundError: /no/corpus"):
        load_job(f"{path}:make_job", {"data": "/no/corpus"})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    from liver.worker_runtime.megatron.datasets import prepare_corpus

    prefix = tmp_path_factory.mktemp("corpus") / "corpus"
    prepare_corpus(EXAMPLE.parent / "data" / "corpus.txt", prefix)
    return str(prefix)


@pytest.mark.slow
def test_the_examples_job_loads_with_its_providers_reference_for_the_layout_check(corpus: str) -> None:
    job = load_job(f"{EXAMPLE}:make_job", {"data": corpus, "distributed_optimizer": "yes"})
    assert isinstance(job, MegatronJob)
    assert job.source.provider_ref == f"{EXAMPLE}:model_provider"
    assert job.model.ddp is not None  # the distributed optimizer's sharding is part of what plans move


@pytest.mark.slow
def test_a_first_layout_the_users_model_cannot_take_is_refused_naming_the_layout(corpus: str) -> None:
    from liver.shared.layout import Device, ParallelLayout, Placement

    devices = tuple(Device("n0", i) for i in range(8))
    settings = WorkerSettings(
        job_id="j",
        node="n0",
        device=0,
        job_factory=f"{EXAMPLE}:make_job",
        job_args={"data": corpus},
        initial=InitialWorld(layout=ParallelLayout(tp=8, pp=1, dp=1), placement=Placement(devices)),
    )
    with pytest.raises(ValueError, match=r"`initial\.layout`"):
        settings.make_job()


def test_the_megatron_job_implements_every_optional_part_of_the_job_contract() -> None:
    from liver.worker_runtime.contract import (
        BuildsForStream,
        Checkpoints,
        ChecksLayouts,
        FeedsPeerCopies,
        RecoversLive,
    )

    for protocol in (BuildsForStream, ChecksLayouts, RecoversLive, FeedsPeerCopies, Checkpoints):
        assert issubclass(MegatronJob, protocol), protocol.__name__
