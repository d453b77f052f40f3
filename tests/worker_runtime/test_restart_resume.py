"""A job restarted by its launcher goes on from its latest checkpoint instead of starting over.

Two real Megatron processes train tiny-gpt at TP1,PP1,DP2 through ``LiveRuntime`` with checkpoints
every 2 steps, three times on the same shared root, as a launcher would start the job again after a
checkpoint fallback (each life a new generation, which the coordinator requires of a restarted world):

1. a first start (the root is empty): from iteration 0, five steps, checkpoints at 2 and 4;
2. a restart: the first world's trainer is the checkpoint of iteration 4 (a collective agreement on the
   latest checkpoint, then a load with reshape); its next two steps equal the first life's steps 5
   and 6, bit for bit (no dropout: nothing depends on the random streams, which a resume reseeds);
3. a restart with ``resume=False``: from iteration 0 again, its first step equal to the first life's.
"""

from __future__ import annotations

from typing import Any

import pytest
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LAYOUT = ParallelLayout(tp=1, pp=1, dp=2)
DEVICES = (Device("n0", 0), Device("n0", 1))
EVERY = 2
FIRST_LIFE = 5  # steps; the latest checkpoint is then iteration 4


def restart_process(proc: Proc, root: str) -> dict[str, Any]:
    from liver.shared.logs import configure_logging
    from liver.worker_runtime.megatron.job import MegatronJob
    from liver.worker_runtime.megatron.train_config import TrainConfig
    from liver.worker_runtime.runtime import CheckpointOptions, LiveRuntime, RuntimeOptions
    from liver.worker_runtime.world import StoreAddress, WorldSpec

    configure_logging(level="CRITICAL")
    config = TrainConfig(global_batch_size=4, micro_batch_size=1, seq_length=16)
    job = MegatronJob(PRESETS["tiny-gpt"], config)
    address = StoreAddress("127.0.0.1", proc.store.port)

    def life(generation: int, until: int, resume: bool = True) -> tuple[int, list[tuple[int, float, float]]]:
        world = WorldSpec(job="restart", generation=generation, layout=LAYOUT, placement=Placement(DEVICES))
        runtime = LiveRuntime(
            job,
            job="restart",
            device=DEVICES[proc.rank],
            store=address,
            initial=world,
            options=RuntimeOptions(
                control_timeout_s=120,
                build_timeout_s=120,
                checkpoint=CheckpointOptions(root=root, every=EVERY, resume=resume),
            ),
        )
        trainer = runtime.step()
        started_at = trainer.iteration
        trace = []
        while trainer.iteration < until:
            result = trainer.train_step()
            trace.append((result.iteration, result.loss, result.grad_norm))
            trainer = runtime.step()
        runtime.close()
        return started_at, trace

    first = life(0, FIRST_LIFE)
    resumed = life(1, FIRST_LIFE + 2)
    over = life(2, 1, resume=False)
    return {"first": first, "resumed": resumed, "over": over}


@pytest.fixture(scope="module")
def lives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("checkpoints"))
    outcomes = run_world(restart_process, 2, args=(root,), timeout_s=300, group_timeout_s=120)
    return outcomes[0].unwrap()


def test_a_first_start_with_an_empty_root_starts_from_iteration_0(lives: dict) -> None:
    started_at, trace = lives["first"]
    assert started_at == 0 and [it for it, _, _ in trace] == list(range(1, FIRST_LIFE + 1))


def test_a_restart_goes_on_from_the_latest_checkpoint(lives: dict) -> None:
    started_at, trace = lives["resumed"]
    latest = FIRST_LIFE - FIRST_LIFE % EVERY
    assert started_at == latest
    assert [it for it, _, _ in trace] == list(range(latest + 1, FIRST_LIFE + 3))


def test_the_steps_after_the_restart_equal_the_first_lifes_bit_for_bit(lives: dict) -> None:
    _, first = lives["first"]
    _, resumed = lives["resumed"]
    assert resumed[0] == first[-1]  # step 5 again, from the checkpoint of step 4


def test_a_restart_without_resume_starts_over(lives: dict) -> None:
    started_at, trace = lives["over"]
    assert started_at == 0 and trace == lives["first"][1][:1]
