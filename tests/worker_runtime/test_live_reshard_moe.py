"""A Megatron GPT with mixture-of-experts layers reshards live through expert-parallel layouts, and
continues exactly as a reload of its state (or a ``dist_checkpointing`` save and load) at the new layout.

Both jobs train DeepSeek's shape (below); the plain optimizer's routes as ``tiny-moe`` does (softmax
top-2 with Megatron's aux loss, the default all-gather token dispatcher), the distributed optimizer's
as DeepSeek does. One job of six processes runs:

    gen 0  TP1,PP1,DP2,EP2 on p0,p1              two experts per rank
    gen 1  TP1,PP1,DP4,EP4 on p0-p3              scale-out and an EP change: experts move whole
    gen 2  TP2,PP1,DP2,EP2,ETP1 on p0-p3         EP with TP (sequence parallel): experts regrouped
    gen 3  TP1,PP1,DP4,EP2,ETP2 on p0,p1,p4,p5   expert-TP 2: every expert cut in two (p2, p3 leave)
    gen 4  TP1,PP2,DP2,EP2 [1/3] on p0,p1,p4,p5  EP with an uneven pipeline of MoE layers
    gen 5  TP1,PP2,DP1 [4/0] on p0,p1            scale-in, EP 2 -> 1: the last stage holds no decoder
                                                 layer (its head; and the MTP layer, whose final norm
                                                 stays with the last decoder layer on the first)

with the plain optimizer and with Megatron's distributed optimizer (dense state sharded over DP, the
experts' over expert-DP). The model is ``tiny-deepseek``, DeepSeek's shape: multi-latent
attention (queries and keys/values through low-rank latents with their norms), its first layer dense and
the other three MoE (Megatron checkpoints such a model per layer, not stacked), routed experts beside a
shared expert, all-to-all dispatch, SwiGLU, experts balanced without an aux loss (each router's
``expert_bias`` buffer, updated every step from the tokens each expert got, is state that moves too),
and a multi-token prediction layer (an MoE layer of its own on the last stage, which then keeps a replica
of the embedding); at ``1/3`` its first stage holds the dense layer alone.
Dropout is on. The tests read what the live job and the baseline reported.
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

from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

L = ParallelLayout.parse
TRANSITIONS = {
    1: Transition("EP change, scale-out", L("TP1,PP1,DP4,EP4"), (0, 1, 2, 3)),
    2: Transition("EP with TP", L("TP2,PP1,DP2,EP2,ETP1"), (0, 1, 2, 3)),
    3: Transition("expert-TP 2", L("TP1,PP1,DP4,EP2,ETP2"), (0, 1, 4, 5)),
    4: Transition("EP with an uneven pipeline", L("TP1,PP2,DP2,EP2:1/3"), (0, 1, 4, 5)),
    5: Transition("scale-in to EP 1, a last stage of no layer", L("TP1,PP2,DP1:4/0"), (0, 1)),
}
SWITCHED = tuple(TRANSITIONS)
IDS = [TRANSITIONS[g].name for g in SWITCHED]
# The plain optimizer's job: DeepSeek's shape routed as tiny-moe is (softmax scores with Megatron's
# aux loss, the all-gather dispatcher), so both dispatchers and both ways of balancing move live.
DEEPSEEK_ALLGATHER = msgspec.structs.replace(
    PRESETS["tiny-deepseek"],
    name="tiny-deepseek-allgather",
    moe_token_dispatcher="allgather",
    moe_router_enable_expert_bias=False,
)
MODELS = {"plain": DEEPSEEK_ALLGATHER, "dist-opt": PRESETS["tiny-deepseek"]}


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    chain = Chain(
        job=f"moe-{request.param}",
        model=MODELS[request.param],
        config=OPTIMIZERS[request.param],
        start=L("TP1,PP1,DP2,EP2"),
        start_processes=(0, 1),
        transitions=TRANSITIONS,
    )
    return run_chain(chain, str(tmp_path_factory.mktemp("checkpoints")))


@pytest.mark.parametrize("generation", SWITCHED, ids=IDS)
def test_every_process_switches_at_the_same_cut(runs: Runs, generation: int) -> None:
    reports = reports_of(runs, generation)
    assert {r["iteration"] for r in reports.values()} == {runs.cuts[generation]}


@pytest.mark.parametrize("generation", SWITCHED, ids=IDS)
def test_the_global_state_with_every_expert_is_the_same_right_after_the_switch(
    runs: Runs, generation: int
) -> None:
    before, after = runs.before[generation], runs.after[generation]
    tensors = runs.plans[generation].model.tensors()
    names = [t.name for t in tensors]
    biases = [i for i, t in enumerate(tensors) if t.role == "buffer"]
    if biases:  # the aux-loss-free job: its routers' expert_bias moved too
        assert all(i in before and before[i].any() for i in biases)
    assert {e for e in range(4) if any(f"local_experts.{e}." in names[i] for i in before)} == {0, 1, 2, 3}
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
