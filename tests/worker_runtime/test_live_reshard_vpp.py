"""A Megatron GPT trained with the interleaved pipeline schedule (virtual pipeline parallelism) reshards
live to and from it, through changes of VPP, of PP with VPP and of TP with VPP, and continues exactly as
a reload of its state (or a ``dist_checkpointing`` save and load) at the new layout.

The plain optimizer's job trains DeepSeek's shape with eight layers (multi-latent attention, a dense
first layer, then MoE layers with a shared expert and all-to-all dispatch, a multi-token prediction
layer on the last chunk); the distributed optimizer's a dense GPT of eight layers (GQA, SwiGLU,
RMSNorm, rope, an untied output layer). With ``VPP v`` each
stage holds ``v`` model chunks of ``8 / (pp * v)`` layers, chunk ``c`` of ``pp * v`` on stage
``c % pp``, as Megatron places them, each in a DDP of its own (the first bucketed); the distributed
optimizer shards every chunk's buffers over DP. One job of six processes runs:

    gen 0  TP1,PP2,DP2 on p0-p3                        1F1B, no virtual pipeline
    gen 1  TP1,PP2,VPP2,DP2 on p0-p3                   to VPP: layers 0-1, 4-5 on stage 0
    gen 2  TP2,PP2,VPP4,DP1 on p0-p3                   VPP 2 -> 4 with a TP and DP change
    gen 3  TP1,PP4,DP1:Et|t|t|t|tt|t|t|L on p0,p1,p4,p5  PP 2 -> 4 with VPP 2 (p2, p3 leave; p4, p5
                                                       join), uneven chunks as Megatron's pipeline
                                                       layout gives them, the last one the head alone
    gen 4  TP1,PP2,DP1 on p0,p1                        back to no VPP, scale-in

with the plain optimizer and with Megatron's distributed optimizer. Dropout is on. The tests read what
the live job and the baseline reported.
"""

from __future__ import annotations

import msgspec
import pytest
from live_chain import (
    OPTIMIZERS,
    Chain,
    Runs,
    Transition,
    bit_identical,
    live_trace,
    max_deviation,
    reports_of,
    run_chain,
)
from mp_helpers import World as Proc
from mp_helpers import run_world

from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS
from liver.worker_runtime.megatron.train_config import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

L = ParallelLayout.parse
MODEL = msgspec.structs.replace(PRESETS["tiny-llama"], name="tiny-llama-8", num_layers=8)
DEEPSEEK = msgspec.structs.replace(
    PRESETS["tiny-deepseek"], name="tiny-deepseek-8", num_layers=8, moe_layer_freq=(0, 1, 1, 1, 1, 1, 1, 1)
)
MODELS = {"plain": DEEPSEEK, "dist-opt": MODEL}
TRANSITIONS = {
    1: Transition("to VPP", L("TP1,PP2,VPP2,DP2"), (0, 1, 2, 3)),
    2: Transition("VPP 2 to 4 with TP and DP", L("TP2,PP2,VPP4,DP1"), (0, 1, 2, 3)),
    3: Transition("PP 2 to 4, uneven chunks", L("TP1,PP4,DP1:Et|t|t|t|tt|t|t|L"), (0, 1, 4, 5)),
    4: Transition("from VPP, scale-in", L("TP1,PP2,DP1"), (0, 1)),
}
SWITCHED = tuple(TRANSITIONS)
IDS = [TRANSITIONS[g].name for g in SWITCHED]


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    chain = Chain(
        job=f"vpp-{request.param}",
        model=MODELS[request.param],
        config=OPTIMIZERS[request.param],
        start=L("TP1,PP2,DP2"),
        start_processes=(0, 1, 2, 3),
        transitions=TRANSITIONS,
    )
    return run_chain(chain, str(tmp_path_factory.mktemp("checkpoints")))


@pytest.mark.parametrize("generation", SWITCHED, ids=IDS)
def test_every_process_switches_at_the_same_cut(runs: Runs, generation: int) -> None:
    reports = reports_of(runs, generation)
    assert {r["iteration"] for r in reports.values()} == {runs.cuts[generation]}


@pytest.mark.parametrize("generation", SWITCHED, ids=IDS)
def test_the_global_state_is_the_same_right_after_the_switch(runs: Runs, generation: int) -> None:
    before, after = runs.before[generation], runs.after[generation]
    assert len(before) == len(runs.plans[generation].model.tensors())
    assert max_deviation(before, after) == 0.0
    assert bit_identical(before, after)


@pytest.mark.parametrize("generation", SWITCHED, ids=IDS)
def test_the_trace_after_the_switch_equals_a_reload_of_the_cut_state_at_the_new_layout(
    runs: Runs, generation: int
) -> None:
    live = live_trace(runs, generation)
    assert len(live) >= 2
    assert live == runs.baseline[generation]


@pytest.mark.parametrize("generation", SWITCHED, ids=IDS)
def test_the_trace_after_the_switch_equals_a_dist_checkpointing_save_and_load(
    runs: Runs, generation: int
) -> None:
    assert live_trace(runs, generation) == runs.checkpoint[generation]


# -- the interleaved schedule computes what 1F1B computes ---------------------------------------------------

SCHEDULE_LAYOUTS = ("TP1,PP2,DP1", "TP1,PP2,VPP2,DP1", "TP1,PP2,VPP4,DP1")


def _from_one_checkpoint(proc: Proc, root: str) -> dict[str, list[tuple[float, float]]]:
    """Train a step at the first layout and save; then, at each layout, load that checkpoint and train."""
    from datetime import timedelta

    import torch

    from liver.shared.layout import Device, Placement
    from liver.shared.logs import configure_logging
    from liver.worker_runtime.megatron.build import groups_from_world
    from liver.worker_runtime.megatron.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from liver.worker_runtime.megatron.train import build_trainer
    from liver.worker_runtime.world import StoreAddress, WorldSpec, build_world

    configure_logging(level="WARNING")
    torch.set_num_threads(1)
    config = TrainConfig(global_batch_size=4, micro_batch_size=1, seq_length=16)
    out: dict[str, list[tuple[float, float]]] = {}
    for generation, text in enumerate((SCHEDULE_LAYOUTS[0], *SCHEDULE_LAYOUTS)):
        layout = L(text)
        devices = tuple(Device("n0", i) for i in range(layout.world_size))
        world = build_world(
            WorldSpec(job="schedules", generation=generation, layout=layout, placement=Placement(devices)),
            devices[proc.rank],
            StoreAddress("127.0.0.1", proc.store.port),
            timeout=timedelta(seconds=120),
        )
        try:
            world.adopt_as_default()
            trainer = build_trainer(MODEL, layout, config, groups=groups_from_world(world))
            if generation == 0:
                trainer.train_step()
                save_checkpoint(trainer, root)
            else:
                load_checkpoint(trainer, latest_checkpoint(root))
                out[text] = [(r.loss, r.grad_norm) for r in (trainer.train_step() for _ in range(3))]
            del trainer
        finally:
            world.release()
    return out


@pytest.fixture(scope="module")
def schedules(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[float, float]]]:
    root = str(tmp_path_factory.mktemp("schedules"))
    outcomes = run_world(_from_one_checkpoint, 2, (root,), timeout_s=300, group_timeout_s=120)
    return outcomes[0].unwrap()


@pytest.mark.parametrize("layout", SCHEDULE_LAYOUTS[1:])
def test_the_interleaved_schedule_trains_as_1f1b_does_from_the_same_state(
    schedules: dict[str, list[tuple[float, float]]], layout: str
) -> None:
    reference, interleaved = schedules[SCHEDULE_LAYOUTS[0]], schedules[layout]
    # The forward passes are the same computations: the first loss is bit for bit the same; the
    # gradients are summed in another order, so later steps agree to rounding.
    assert interleaved[0][0] == reference[0][0]
    for (loss, norm), (want_loss, want_norm) in zip(interleaved, reference, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-4)
