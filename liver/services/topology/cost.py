"""The topology planner's throughput model: seconds per training step of a layout, and tokens/s.

Deliberately simple (``docs/topology-model.md`` has the derivation and what it leaves out): it only has
to rank layouts of one job against each other, not predict wall-clock time.

* **compute**: ``6 N`` FLOPs per token (``8 N`` with full recomputation), spread over every device, at
  ``peak_flops * achievable_fraction``; an uneven pipeline split runs at the pace of its largest stage.
* **tensor parallelism**: four all-reduces of a micro-batch's activations per layer (two forward, two
  backward; six with full recomputation), ring cost ``2 (t-1)/t`` of the bytes, over NVLink when a TP
  group sits on one node and over the network otherwise. Not overlapped with compute.
* **pipeline**: one activation forward and one gradient backward per micro-batch and stage boundary;
  the 1F1B bubble stretches the pipelined work by ``(m + pp - 1) / m`` with ``m`` micro-batches per DP
  rank, i.e. the bubble is ``(pp - 1) / (m + pp - 1)`` of the step.
* **data parallelism**: a ring all-reduce of the largest rank's gradients, ``2 (dp-1)/dp`` of the bytes
  over the slowest link of the group (the network as soon as the job spans nodes), over DP x CP ranks
  (context-parallel ranks reduce their gradients too). Not overlapped.
* **expert parallelism** (a mixture of experts): ``6 N_active`` FLOPs per token, where only the top-k
  of the experts count; per MoE layer and micro-batch four all-to-alls (dispatch and combine, forward
  and backward) of the rank's tokens' top-k copies, ``(ep-1)/ep`` of them leaving the rank, over
  NVLink when the EP group sits on one node; with expert-TP > 1 the dispatched copies are gathered
  and the experts' outputs reduce-scattered over it too (four more collectives on the TP links).
* **context parallelism**: ring attention passes each layer's K and V around the CP ranks, ``cp - 1``
  steps of the rank's share forward and twice that backward, over NVLink when the CP group sits on one
  node; every activation term above carries ``1/cp`` of the sequence.
"""

from __future__ import annotations

import functools
import math

import msgspec

from liver.shared.geometry import MTP_PREFIX
from liver.shared.layout import ParallelLayout
from liver.shared.model import DTYPE_BYTES, ModelSpec

from .memory import HardwareProfile, TrainingSetup, grad_bytes_per_rank, stage_layer_kinds


class StepCost(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Seconds per step, by term, for one layout."""

    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    dp_comm_s: float
    micro_batches: int
    tokens_per_step: int
    ep_comm_s: float = 0.0
    cp_comm_s: float = 0.0

    @property
    def step_s(self) -> float:
        return (
            self.compute_s
            + self.tp_comm_s
            + self.pp_comm_s
            + self.bubble_s
            + self.dp_comm_s
            + self.ep_comm_s
            + self.cp_comm_s
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def bubble_share(self) -> float:
        """The share of the step the pipeline idles."""
        return self.bubble_s / self.step_s


@functools.lru_cache(maxsize=64)
def _parameter_count(model: ModelSpec) -> int:
    """Parameters a token passes through: all of a dense model, the top-k experts' share of an MoE's."""
    g = model.geometry()
    total, experts = g.parameter_count(), g.expert_parameter_count()
    if not experts:
        return total
    return total - experts + experts * model.moe_router_topk // model.num_experts


@functools.lru_cache(maxsize=64)
def _layer_weights(model: ModelSpec) -> tuple[int, ...]:
    """Parameters a token passes through in each decoder layer (a dense layer's FFN, an MoE layer's
    top-k experts): what one layer costs to compute, relative to the others."""
    g = model.geometry()
    out = [0] * (model.num_layers + 1)  # the last: the multi-token prediction layers, on the last stage
    for p in g.parameters:
        size = math.prod(p.shape) * (model.moe_router_topk if p.expert else 1)
        if p.layers is not None:
            for layer in range(*p.layers):
                out[layer] += size
        elif p.name.startswith(MTP_PREFIX):
            out[-1] += size
    return tuple(out)


def stage_imbalance(model: ModelSpec, layout: ParallelLayout) -> float:
    """The busiest stage's share of the decoder's compute (multi-token prediction on the last stage),
    times ``pp``: 1 when the stages are even."""
    weights = _layer_weights(model)
    stages = [sum(weights[i] for i in layers) for layers in layout.layers_by_stage(model.num_layers)]
    stages[-1] += weights[-1]
    return max(stages) * layout.pp / sum(weights)


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """The share of 1F1B's pipelined time spent idle: ``(pp - 1) / (m + pp - 1)``."""
    return (pp - 1) / (micro_batches + pp - 1)


def ring_all_reduce_s(nbytes: float, ranks: int, bandwidth: float) -> float:
    """A bandwidth-bound ring all-reduce: each rank sends and receives ``2 (n-1)/n`` of the data."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth


def step_cost(
    model: ModelSpec,
    setup: TrainingSetup,
    hardware: HardwareProfile,
    layout: ParallelLayout,
    *,
    tp_within_node: bool,
    single_node: bool,
    ep_within_node: bool = False,
    cp_within_node: bool = False,
) -> StepCost:
    """The estimated step time of ``layout`` (see the module docstring).

    ``tp_within_node``: every TP group runs on one node; ``single_node``: the whole world does (then
    data- and pipeline-parallel traffic stays on the node's links too); ``ep_within_node`` and
    ``cp_within_node``: every EP (CP) group does.
    """
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    micro_batches = setup.global_batch_size // (dp * setup.micro_batch_size)
    tokens = setup.tokens_per_step
    flops_per_token = (8 if setup.recompute == "full" else 6) * _parameter_count(model)
    stage_layers = layout.layers_per_stage(model.num_layers)
    imbalance = stage_imbalance(model, layout)
    moe_layers = max(moe for _dense, moe in stage_layer_kinds(model, layout))
    rate = hardware.peak_flops * hardware.achievable_fraction
    compute = flops_per_token * tokens / layout.world_size / rate * imbalance

    e = DTYPE_BYTES[model.params_dtype]
    cp = layout.cp
    act_bytes = setup.tokens_per_micro_batch // cp * model.hidden_size * e
    tp_bw = hardware.intra_node_bandwidth if tp_within_node else hardware.inter_node_bandwidth
    net_bw = hardware.intra_node_bandwidth if single_node else hardware.inter_node_bandwidth
    reductions = 6 if setup.recompute == "full" else 4
    tp_comm = max(stage_layers) * micro_batches * reductions * ring_all_reduce_s(act_bytes, tp, tp_bw)

    pp_comm = 0.0
    if pp > 1:
        boundary = act_bytes / (tp if setup.sequence_parallel else 1)
        pp_comm = 2 * micro_batches * layout.vpp * boundary / net_bw  # every chunk hands on

    ep_comm = 0.0
    if model.num_experts and layout.ep > 1:
        ep_bw = (
            hardware.intra_node_bandwidth if ep_within_node or single_node else hardware.inter_node_bandwidth
        )
        leaving = act_bytes * model.moe_router_topk * (layout.ep - 1) / layout.ep
        ep_comm = moe_layers * micro_batches * 4 * leaving / ep_bw
    etp = layout.expert_tp
    if model.num_experts and etp > 1:
        # Expert-TP gathers the dispatched tokens over its group and reduce-scatters the experts'
        # outputs, forward and backward.
        routed = act_bytes * model.moe_router_topk * (etp - 1) / etp
        ep_comm += moe_layers * micro_batches * 4 * routed / tp_bw

    cp_comm = 0.0
    if cp > 1:
        cp_bw = (
            hardware.intra_node_bandwidth if cp_within_node or single_node else hardware.inter_node_bandwidth
        )
        kv = setup.tokens_per_micro_batch // cp * 2 * model.query_groups * model.head_dim * e / tp
        cp_comm = max(stage_layers) * micro_batches * 3 * (cp - 1) * kv / cp_bw

    pipelined = compute + tp_comm + pp_comm + ep_comm + cp_comm
    bubble = pipelined * (pp - 1) / (micro_batches * layout.vpp)  # interleaving shrinks it vpp-fold
    dp_comm = ring_all_reduce_s(grad_bytes_per_rank(model, setup, layout), dp * cp, net_bw)
    return StepCost(
        compute_s=compute,
        tp_comm_s=tp_comm,
        pp_comm_s=pp_comm,
        bubble_s=bubble,
        dp_comm_s=dp_comm,
        micro_batches=micro_batches,
        tokens_per_step=tokens,
        ep_comm_s=ep_comm,
        cp_comm_s=cp_comm,
    )
