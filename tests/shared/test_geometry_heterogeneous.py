"""Models whose decoder layers differ (dense and MoE layers in any pattern, as Megatron's
``moe_layer_freq`` builds them; with or without multi-latent attention and a multi-token prediction
layer) get their geometry from Megatron, and every rank of random layouts holds exactly what the view
function gives it.

Megatron files such a model's checkpoint per layer (``decoder.layers.<n>.<...>``, no layer axis), not
stacked; the derivation reads both. One spawned interpreter derives the geometries of random small
specs and builds every rank of random layouts on the meta device under the fake process group,
comparing Megatron's own ``sharded_state_dict()`` boxes with the views'.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from megatron_user_models import DIVISIBLE_BY, VOCAB_SIZE, MixedMoE
from mp_helpers import in_fresh_interpreter

from liver.shared.layout import LayoutError, ParallelLayout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CHILD_S = 600.0
SEEDS = range(6)
LAYOUTS_PER_SPEC = 2


def random_spec(seed: int) -> MixedMoE:
    rng = random.Random(seed)
    layers = rng.choice((3, 4, 5))
    if rng.random() < 0.25:
        freq: int | tuple[int, ...] = rng.choice((2, 3))
    else:
        freq = tuple(rng.choice((0, 1)) for _ in range(layers))
        if not any(freq):
            freq = (0,) * (layers - 1) + (1,)
    return MixedMoE(
        moe_layer_freq=freq,
        num_layers=layers,
        num_experts=rng.choice((2, 4)),
        swiglu=rng.random() < 0.5,
        shared_expert=(None, 32)[seed % 2],  # half of them with a shared expert
        latent_attention=seed % 3 != 0,  # two thirds with multi-latent attention,
        q_lora_rank=(32, 0)[(seed // 2) % 2],  # with or without a query latent
        mtp_num_layers=int(seed % 3 != 1),
    )


def random_layouts(seed: int, spec: MixedMoE, count: int) -> list[ParallelLayout]:
    """Layouts of up to four ranks with TP, uneven pipelines (empty stages too) and EP, seeded."""
    rng = random.Random(1000 + seed)
    out: list[ParallelLayout] = []
    while len(out) < count:
        tp = rng.choice((1, 2))
        pp = rng.choice([p for p in (1, 2, 3) if tp * p <= 4])
        dp = rng.choice([d for d in (1, 2) if tp * pp * d <= 4])
        ep = rng.choice([e for e in (1, 2) if (dp * tp) % e == 0])
        stages = None
        if pp > 1:
            cuts = sorted(rng.randint(0, spec.num_layers) for _ in range(pp - 1))
            bounds = [0, *cuts, spec.num_layers]
            stages = tuple(b - a for a, b in itertools.pairwise(bounds))
        try:
            layout = ParallelLayout(
                tp=tp, pp=pp, dp=dp, ep=ep, etp=1 if ep > 1 and tp > 1 else None, stage_layers=stages
            )
        except LayoutError:
            continue
        out.append(layout)
    return out


def child_main() -> dict[Any, Any]:
    import torch

    from liver.worker_runtime.megatron.build import groups_from_parallel_state
    from liver.worker_runtime.megatron.geometry import (
        _fake_world,
        derive_geometry,
        model_geometry_mismatches,
    )

    torch.set_num_threads(1)
    out: dict[int, Any] = {}
    for seed in SEEDS:
        spec = random_spec(seed)
        geometry = derive_geometry(
            spec,
            name=f"mixed-{seed}",
            num_layers=spec.num_layers,
            vocab_size=VOCAB_SIZE,
            make_vocab_size_divisible_by=DIVISIBLE_BY,
        )
        checked: dict[str, dict[int, list[str]]] = {}
        for layout in random_layouts(seed, spec, LAYOUTS_PER_SPEC):
            try:
                geometry.check_layout(layout)
            except LayoutError:
                continue
            ranks: dict[int, list[str]] = {}
            for rank in range(layout.world_size):
                with _fake_world(layout, rank), torch.device("meta"):
                    groups = groups_from_parallel_state(layout)
                    model = spec(layout, groups.collection())
                    metadata = {"dp_cp_group": groups.dp_cp}
                    ranks[rank] = model_geometry_mismatches(model, geometry, layout, rank, metadata=metadata)
            checked[layout.describe()] = ranks
        out[seed] = (spec, geometry, checked)
    return out


@pytest.fixture(scope="module")
def found() -> dict[int, Any]:
    return in_fresh_interpreter(child_main, CHILD_S)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_rank_of_random_layouts_holds_what_the_derived_geometry_gives_it(
    found: dict[int, Any], seed: int
) -> None:
    spec, _geometry, checked = found[seed]
    assert checked, f"{spec}: no random layout fits the model"
    for layout, ranks in checked.items():
        assert ranks == {r: [] for r in ranks}, (spec, layout)


@pytest.mark.parametrize("seed", SEEDS)
def test_each_run_of_the_derived_geometry_is_a_run_of_one_kind_of_layer(
    found: dict[int, Any], seed: int
) -> None:
    spec, geometry, _checked = found[seed]
    kinds = [bool(k) for k in _pattern(spec)]
    for p in geometry.parameters:
        if p.layers is None:
            continue
        first, stop = p.layers
        assert len(set(kinds[first:stop])) == 1, (p.name, p.layers, kinds)
        moe_only = "router" in p.name or "experts" in p.name
        assert not moe_only or kinds[first], (p.name, p.layers, kinds)
        assert "mlp.linear_fc1" not in p.name or not kinds[first], (p.name, kinds)


def _pattern(spec: MixedMoE) -> tuple[int, ...]:
    freq = spec.moe_layer_freq
    if isinstance(freq, int):
        return tuple(int(i % freq == 0) for i in range(spec.num_layers))
    return freq
