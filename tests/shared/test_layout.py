"""Layouts: Megatron's rank order, pipeline splits, device specs."""

import msgspec
import pytest

from liver.shared.layout import (
    Device,
    LayoutError,
    ParallelLayout,
    Placement,
    default_devices,
    parse_devices,
)


def test_rank_order_is_tp_fastest_then_dp_then_pp():
    lay = ParallelLayout(tp=2, pp=2, dp=3)
    assert lay.rank_of(tp=1, dp=0, pp=0) == 1
    assert lay.rank_of(tp=0, dp=1, pp=0) == 2
    assert lay.rank_of(tp=0, dp=0, pp=1) == 6


def test_coords_invert_rank_of():
    lay = ParallelLayout(tp=2, pp=3, dp=2)
    for r in range(lay.world_size):
        c = lay.coords(r)
        assert lay.rank_of(c.tp, c.dp, c.pp) == r


def test_even_pipeline_split():
    assert ParallelLayout(1, 2, 1).stage_of_layers(4) == (0, 0, 1, 1)


def test_uneven_pipeline_split_follows_stage_layers():
    lay = ParallelLayout(1, 3, 1, stage_layers=(1, 3, 2))
    assert lay.stage_of_layers(6) == (0, 1, 1, 1, 2, 2)


def test_uneven_split_without_stage_layers_is_an_error():
    with pytest.raises(LayoutError, match="do not split evenly"):
        ParallelLayout(1, 3, 1).layers_per_stage(4)


def test_stage_layers_must_sum_to_the_model_layers():
    with pytest.raises(LayoutError, match="sum to"):
        ParallelLayout(1, 2, 1, stage_layers=(1, 2)).layers_per_stage(4)


@pytest.mark.parametrize("text", ["2,2", "a,b,c", "0,1,1", "2,2,1:1/x"])
def test_bad_layout_text_is_a_layout_error(text):
    with pytest.raises(LayoutError):
        ParallelLayout.parse(text)


def test_layout_text_with_uneven_stages():
    assert ParallelLayout.parse("tp2,pp2,dp1:3/1") == ParallelLayout(2, 2, 1, (3, 1))


def test_placement_rejects_a_device_used_twice():
    with pytest.raises(LayoutError, match="twice"):
        Placement((Device("n", 0), Device("n", 0)))


def test_drop_removes_whole_nodes():
    devs = default_devices(16, 8)
    assert parse_devices("drop:node001", devs) == devs[:8]


def test_add_appends_new_nodes_with_fresh_names():
    devs = default_devices(8, 8)
    new = parse_devices("add:1x8", devs)
    assert len(new) == 16 and new[8].node == "node001"


def test_unknown_node_in_drop_is_named():
    with pytest.raises(LayoutError, match="node042"):
        parse_devices("drop:node042", default_devices(8))


# -- virtual pipeline parallelism ------------------------------------------------------------------------


def test_a_vpp_layout_is_written_with_its_chunks_and_reads_back() -> None:
    layout = ParallelLayout.parse("TP8,PP16,VPP8,DP8")
    assert (layout.tp, layout.pp, layout.vpp, layout.dp) == (8, 16, 8, 8)
    assert layout.describe() == "TP8,PP16,VPP8,DP8"
    assert ParallelLayout.parse(layout.describe()) == layout
    assert ParallelLayout.parse("1,4,2,VPP2,EP2") == ParallelLayout(tp=1, pp=4, dp=2, ep=2, vpp=2)
    assert "vpp" not in msgspec.json.encode(ParallelLayout.parse("2,4,1")).decode()  # older readers


def test_vpp_deals_chunks_of_layers_to_the_stages_in_turn() -> None:
    layout = ParallelLayout.parse("TP1,PP2,VPP2,DP1")
    assert layout.stage_of_layers(8) == (0, 0, 1, 1, 0, 0, 1, 1)
    assert layout.chunk_layers(8, 1) == (range(2, 4), range(6, 8))
    assert layout.layers_per_stage(8) == (4, 4)


@pytest.mark.parametrize(
    ("text", "layers", "error"),
    [
        ("TP1,PP1,VPP2,DP2", 4, "needs pp of 2 or more"),
        ("TP1,PP2,VPP0,DP1", 4, "vpp must be at least 1"),
        ("TP1,PP2,VPP2,DP1:1/3", 4, "stage_layers has 2 entries but pp x vpp is 4"),
        ("TP1,PP2,VPP2,DP1", 6, "do not split into pp x vpp = 4 equal chunks"),
        ("TP1,PP2,VPP2,VPP3,DP1", 4, "VPPn given twice"),
    ],
)
def test_a_vpp_layout_megatron_could_not_build_is_refused_naming_why(
    text: str, layers: int, error: str
) -> None:
    with pytest.raises(LayoutError, match=error):
        ParallelLayout.parse(text).layers_per_stage(layers)


def test_uneven_model_chunks_are_listed_in_megatrons_order_of_virtual_stages() -> None:
    layout = ParallelLayout.parse("TP1,PP2,VPP2,DP1:1/3/1/1")
    assert layout.chunk_layers(6, 0) == (range(0, 1), range(4, 5))
    assert layout.chunk_layers(6, 1) == (range(1, 4), range(5, 6))
    assert layout.layers_per_stage(6) == (2, 4)
    assert ParallelLayout.parse(layout.describe()) == layout


@pytest.mark.parametrize(
    ("text", "described", "stages"),
    [
        ("TP1,PP2,DP2:Et|ttt|t|tmL", "TP1,PP2,VPP2,DP2[1/3/1/1]", ((0, 4), (1, 2, 3, 5))),
        ("TP1,PP2,DP1:Ettt|tL", "TP1,PP2,DP1[3/1]", ((0, 1, 2), (3,))),
        ("TP1,PP2,DP1:Et|t|t|tL", "TP1,PP2,VPP2,DP1", ((0, 2), (1, 3))),  # even chunks: no split kept
        ("TP1,PP2,VPP2,DP1:(Et|t|)*1,(t|)*1,tL", "TP1,PP2,VPP2,DP1", ((0, 2), (1, 3))),
    ],
)
def test_a_megatron_pipeline_layout_string_is_a_layout(text: str, described: str, stages: tuple) -> None:
    layout = ParallelLayout.parse(text)
    assert layout.describe() == described
    assert layout.layers_by_stage(sum(map(len, stages))) == stages


def test_a_layout_writes_the_pipeline_layout_megatron_reads() -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    layout = ParallelLayout.parse("TP1,PP2,VPP2,DP1:1/3/1/1")
    text = layout.pipeline_layout(6, mtp_num_layers=1)
    assert text == "Et|ttt|t|tmL"
    megatron = PipelineParallelLayerLayout(text, 2)
    assert megatron.virtual_pipeline_model_parallel_size == 2
    parallel_state.set_virtual_pipeline_model_parallel_world_size(2)  # as a VPP job's processes have it
    try:
        for stage in range(2):
            for v in range(2):
                ids = megatron.get_layer_id_list(vp_stage=v, pp_rank=stage)
                assert ids == list(layout.chunk_layers(6, stage)[v])
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("TP1,PP2,DP1:tE|tL", "the embedding \\(E\\) must open the first stage"),
        ("TP1,PP2,DP1:Et|tLt", "the loss \\(L\\) must close the last stage"),
        ("TP1,PP2,DP1:Et|tm|t|tL", "multi-token prediction layers \\(m\\) at the end of the last stage"),
        ("TP1,PP2,DP1:Et|tx", "'x' is not a layer"),
        ("TP1,PP2,DP1:Et|t|tL", "3 stages do not divide over pp=2"),
        ("TP1,PP2,VPP3,DP1:Et|t|t|tL", "VPP3, but the pipeline layout has 2"),
        ("TP1,PP2,DP1:E(t)*99999999|tL", "unrolls beyond"),
    ],
)
def test_a_pipeline_layout_liver_cannot_follow_is_refused_naming_why(text: str, error: str) -> None:
    with pytest.raises(LayoutError, match=error):
        ParallelLayout.parse(text)


def test_a_vpp_layout_balances_uneven_chunks_or_says_how_to_give_them() -> None:
    assert ParallelLayout.parse("TP1,PP2,VPP2,DP1").balanced(6).stage_layers == (1, 2, 2, 1)
    with pytest.raises(LayoutError, match="cannot fill pp x vpp = 8 model chunks"):
        ParallelLayout.parse("TP1,PP4,VPP2,DP1").balanced(6)


def test_the_interleaved_schedule_takes_micro_batches_only_in_groups_of_pp() -> None:
    ParallelLayout.parse("TP1,PP2,DP1").check_micro_batches(3)
    ParallelLayout.parse("TP1,PP2,VPP2,DP1").check_micro_batches(4)
    with pytest.raises(LayoutError, match=r"micro-batches per rank \(3\) to be a multiple of pp=2"):
        ParallelLayout.parse("TP1,PP2,VPP2,DP1").check_micro_batches(3)
