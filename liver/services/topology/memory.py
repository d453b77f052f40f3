"""The topology planner's memory model: what one device holds at the peak of a training step.

The numbers follow what Megatron-core allocates with the layout's view function, so they agree with
the transfer planner about which rank holds what (``docs/topology-model.md`` derives every term):

* **training state** per rank: every tensor of :meth:`ModelSpec.tensors` (parameters, fp32 master
  weights when the parameters are 16-bit, both Adam moments, the step counter) that the rank's pipeline
  stage holds, at its *allocated* TP shard size (vocabulary tensors include Megatron's padding rows);
* **gradients**: one buffer per parameter (Megatron's ``main_grad``), fp32 by default;
* **activations** of 1F1B: pipeline stage ``s`` of ``pp`` keeps ``min(pp - s, m)`` micro-batches
  in flight (the first stage the most), each holding its layers' saved activations; the last stage
  also holds one micro-batch's logits (16-bit) and their fp32 softmax for the loss;
* a **safety margin**: a fraction of device memory plus a fixed reserve (CUDA context, NCCL buffers,
  allocator fragmentation) and LiveR's transfer staging buffer are not available to training.

Data parallelism replicates everything (no distributed optimizer), as the view function does; under
the distributed optimizer a rank keeps its share of its buffers' optimizer state. For a mixture of
experts a rank holds ``1/EP`` of each layer's experts, cut by expert-TP, and keeps each token's top-k
dispatched copies and expert activations; context parallelism splits every activation's sequence.
"""

from __future__ import annotations

import functools
import math
from typing import Annotated, Literal, NamedTuple, get_args

import msgspec
from msgspec import Meta

from liver.reshard.dist_opt import buffer_layouts, shard_group
from liver.reshard.holdings import is_dp_sharded
from liver.reshard.views import home_stages, tp_shard
from liver.shared.errors import InputError
from liver.shared.geometry import Home, ModelGeometry
from liver.shared.layout import ParallelLayout
from liver.shared.model import DTYPE_BYTES, ModelSpec

GiB = 1024**3

Recompute = Literal["none", "selective", "full"]


class SetupError(InputError):
    """A training setup or hardware profile that the planner cannot reason about."""


class TrainingSetup(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How the job trains: batch geometry and the memory-saving options that change activations.

    The optimizer is Adam; its precision follows ``ModelSpec.params_dtype`` (16-bit parameters carry an
    fp32 master copy, fp32 parameters do not), exactly as :meth:`ModelSpec.tensors` lists the state.
    """

    global_batch_size: Annotated[int, Meta(ge=1)]
    micro_batch_size: Annotated[int, Meta(ge=1)] = 1
    sequence_length: Annotated[int, Meta(ge=1)]
    sequence_parallel: bool = True
    """Megatron's sequence parallelism: activations outside the TP-split matmuls are split over TP too."""
    recompute: Recompute = "selective"
    """``selective`` (or flash attention): no ``s x s`` attention scores are kept; ``full``: only each
    layer's input is kept and the layer is recomputed in the backward pass."""
    grad_reduce_in_fp32: bool = True
    """Megatron keeps and all-reduces gradients of 16-bit parameters in fp32 (``main_grad``)."""

    def __post_init__(self) -> None:
        for field in ("global_batch_size", "micro_batch_size", "sequence_length"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise SetupError(f"{field} must be an integer of at least 1, got {value!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise SetupError(f"recompute must be none, selective or full, got {self.recompute!r}")
        if self.global_batch_size % self.micro_batch_size:
            raise SetupError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )

    def check_model(self, model: ModelSpec) -> None:
        """Raise :class:`SetupError` when ``model`` cannot train on sequences of this length."""
        if (
            model.position_embedding == "learned_absolute"
            and self.sequence_length > model.max_sequence_length
        ):
            raise SetupError(
                f"sequence_length ({self.sequence_length}) exceeds the model's learned position "
                f"embeddings (max_sequence_length={model.max_sequence_length})"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.sequence_length

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.sequence_length


class HardwareProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One device type and its links. Bandwidths are effective bytes/s per device, per direction."""

    name: str
    memory_bytes: Annotated[int, Meta(ge=1)]
    peak_flops: Annotated[float, Meta(gt=0)]
    """Dense peak of the training dtype (bf16 tensor cores on a GPU)."""
    achievable_fraction: Annotated[float, Meta(gt=0, le=1)]
    """Model FLOP utilisation a well-tuned job reaches; compute time uses ``peak * fraction``."""
    intra_node_bandwidth: Annotated[float, Meta(gt=0)]
    inter_node_bandwidth: Annotated[float, Meta(gt=0)]
    memory_margin: Annotated[float, Meta(ge=0, lt=1)] = 0.1
    """Fraction of device memory kept free for allocator fragmentation and temporary buffers."""
    reserved_bytes: Annotated[int, Meta(ge=0)] = 0
    """Fixed memory training cannot use: CUDA context, NCCL communicators and workspaces."""
    copies_budget_bytes: Annotated[int, Meta(ge=0)] | None = None
    """Host memory the peer copies one process keeps may take (``CopyOptions.host_budget_bytes``): a
    layout whose copies need more survives a node's loss only from the checkpoint. None: not counted
    (each worker still checks its own host's available memory when it builds its copies)."""

    def __post_init__(self) -> None:
        checks = (
            ("memory_bytes", self.memory_bytes > 0),
            ("peak_flops", self.peak_flops > 0),
            ("achievable_fraction", 0 < self.achievable_fraction <= 1),
            ("intra_node_bandwidth", self.intra_node_bandwidth > 0),
            ("inter_node_bandwidth", self.inter_node_bandwidth > 0),
            ("memory_margin", 0 <= self.memory_margin < 1),
            ("reserved_bytes", self.reserved_bytes >= 0),
            ("copies_budget_bytes", self.copies_budget_bytes is None or self.copies_budget_bytes >= 0),
        )
        for field, ok in checks:
            if not ok:
                raise SetupError(f"{field} is out of range: {getattr(self, field)!r}")

    def usable_bytes(self, staging_bytes: int = 0) -> int:
        """Memory left for training state and activations after the margin, the reserve and LiveR's
        transfer staging buffer (I2: the one extra allocation a handoff makes)."""
        return int(self.memory_bytes * (1 - self.memory_margin)) - self.reserved_bytes - staging_bytes


H100_80GB = HardwareProfile(
    name="h100-80gb",
    memory_bytes=80 * GiB,
    peak_flops=989e12,  # H100 SXM dense BF16
    achievable_fraction=0.4,  # typical Megatron MFU for large GPT models
    intra_node_bandwidth=360e9,  # NVLink 4: 450 GB/s per direction, ~80% as NCCL bus bandwidth
    inter_node_bandwidth=45e9,  # one 400 Gb/s NDR port per GPU (50 GB/s), ~90% achieved
    memory_margin=0.1,
    reserved_bytes=2 * GiB,
    copies_budget_bytes=128 * GiB,  # half of a DGX H100's 2 TiB of host memory per GPU
)
"""A DGX-H100-like node: 8 GPUs on NVLink, one InfiniBand NIC per GPU."""

CPU_SMALL = HardwareProfile(
    name="cpu-small",
    memory_bytes=4 * GiB,
    peak_flops=50e9,  # a few AVX2 cores in fp32
    achievable_fraction=0.5,
    intra_node_bandwidth=5e9,  # gloo over loopback / shared memory
    inter_node_bandwidth=1.25e9,  # 10 GbE
    memory_margin=0.1,
    reserved_bytes=256 * 1024**2,
)
"""A gloo worker process on a CPU host: for tests and the demo."""

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (H100_80GB, CPU_SMALL)}


class StageMemory(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Peak bytes on one device of one pipeline stage (every TP rank and DP replica is alike)."""

    stage: int
    layers: int
    state_bytes: int  # parameters, master weights, Adam moments, step counter
    grad_bytes: int
    activation_bytes: int
    in_flight: int  # micro-batches whose activations are alive at the peak

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.grad_bytes + self.activation_bytes


class MemoryEstimate(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    stages: tuple[StageMemory, ...]
    usable_bytes: int

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: (s.total_bytes, -s.stage))

    @property
    def peak_bytes(self) -> int:
        return self.peak.total_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes


_HOMES: tuple[Home, ...] = tuple(h for h in get_args(Home) if h != "layer")
"""Where state outside the decoder layers lives (:func:`liver.reshard.views.home_stages`)."""


class _StateByHome(NamedTuple):
    """State and gradient bytes of one TP rank, split by where the pipeline keeps them."""

    layer_state: tuple[int, ...]  # per decoder layer
    layer_grad: tuple[int, ...]
    home_state: dict[Home, int]  # by home outside the decoder layers ("first", "last", ...)
    home_grad: dict[Home, int]
    layer_sharded: tuple[int, ...]  # the part of layer_state the distributed optimizer shards over DP
    home_sharded: dict[Home, int]


@functools.lru_cache(maxsize=256)
def _state_by_home(
    model: ModelSpec | ModelGeometry, tp: int, grad_reduce_in_fp32: bool, etp: int | None = None, ep: int = 1
) -> _StateByHome:
    """Bytes of every tensor at its allocated TP shard size (every TP rank allocates the same shape:
    vocabulary shards are padded, the others split evenly). A geometry gives the exact tensors of a
    user's own model; a parameter's gradient has its own dtype unless gradients reduce in fp32. An
    expert's tensors are cut by expert-TP (``etp``, TP unless given) and a rank holds ``1/ep`` of the
    experts."""
    L = model.num_layers
    layer = [[0] * L for _ in range(3)]  # state, grad, sharded
    experts = [[0] * L for _ in range(3)]  # the same for experts, before the 1/ep share
    home: list[dict[Home, int]] = [dict.fromkeys(_HOMES, 0) for _ in range(3)]
    for t in model.tensors(optimizer=True):
        expert = t.expert >= 0
        elems = math.prod(tp_shard(t, model, (etp or tp) if expert else tp, 0).local_shape)
        grad = elems * (4 if grad_reduce_in_fp32 else t.itemsize) if t.role == "param" else 0
        sharded = elems * t.itemsize if is_dp_sharded(t, model) else 0
        values = (elems * t.itemsize, grad, sharded)
        if t.home == "layer":
            into = experts if expert else layer
            for k, v in enumerate(values):
                into[k][t.layer - 1] += v
        else:  # an MTP layer's experts: a rank holds 1/ep of them too
            for k, v in enumerate(values):
                home[k][t.home] += v // ep if expert else v
    for k in range(3):
        for i in range(L):
            layer[k][i] += experts[k][i] // ep
    return _StateByHome(tuple(layer[0]), tuple(layer[1]), home[0], home[1], tuple(layer[2]), home[2])


def _owned_optimizer_bytes(model: ModelGeometry, layout: ParallelLayout, stage: int) -> int:
    """A rank's share of its stage's master weights and moments under the distributed optimizer: every
    bucket is cut into equal ranges over the group that shards it (DP x CP, or expert-DP for the
    expert buffers; ``1/k`` of it with ``k`` instances of the optimizer), so each rank owns
    ``numel / group`` of each buffer (padding included), in fp32,
    with a master copy when the buffer's parameters are 16-bit."""
    total = 0
    for buffer in buffer_layouts(model, layout, layout.rank_of(0, 0, stage)):
        numel = buffer.buckets[-1][1] if buffer.buckets else 0
        per_element = 4 * (2 if buffer.dtype == "float32" else 3)
        total += numel // shard_group(model, layout.grid(buffer.expert).replicas) * per_element
    return total


def stage_state_bytes(
    model: ModelSpec | ModelGeometry, setup: TrainingSetup, layout: ParallelLayout
) -> tuple[tuple[int, int], ...]:
    """``(state bytes, gradient bytes)`` of one rank of each pipeline stage (of the job's own model
    when ``model`` is its geometry). Under the distributed optimizer a rank keeps only its DP share of
    the stage's master weights and moments (:func:`_owned_optimizer_bytes`)."""
    by_home = _state_by_home(model, layout.tp, setup.grad_reduce_in_fp32, layout.etp, layout.ep)
    out = []
    kept = {h: home_stages(h, model.num_layers, layout) for h in _HOMES}
    for s, layers in enumerate(layout.layers_by_stage(model.num_layers)):
        homes = [h for h, stages in kept.items() if s in stages]
        state = sum(by_home.layer_state[i] for i in layers) + sum(by_home.home_state[h] for h in homes)
        sharded = sum(by_home.layer_sharded[i] for i in layers) + sum(by_home.home_sharded[h] for h in homes)
        if sharded:
            assert isinstance(model, ModelGeometry)
            state += _owned_optimizer_bytes(model, layout, s) - sharded
        grad = sum(by_home.layer_grad[i] for i in layers) + sum(by_home.home_grad[h] for h in homes)
        out.append((state, grad))
    return tuple(out)


def activation_bytes_per_token(
    model: ModelSpec, setup: TrainingSetup, tp: int, etp: int | None = None, moe: bool | None = None
) -> int:
    """Saved activations of one decoder layer for one token of one micro-batch, on one TP rank: an MoE
    layer's when ``moe`` (by default: whether the model has experts), a dense one's otherwise.

    Elements kept for the backward pass (Korthikanti et al. 2022, generalised to GQA and SwiGLU, without
    dropout masks): the inputs of the two norms and of the QKV and fc1 matmuls (``4h``, split over TP
    only with sequence parallelism), Q, K and V, the attention output, fc1's output and the activation's
    output. ``none`` also keeps the softmax output, its dropout output and the 1-byte dropout mask of the
    ``heads x s`` attention scores; ``full`` keeps only the layer's input.
    """
    e = DTYPE_BYTES[model.params_dtype]
    h, d = model.hidden_size, model.head_dim
    nq, nkv = model.num_attention_heads, model.query_groups
    sp_div = tp if setup.sequence_parallel else 1
    if setup.recompute == "full":
        return h * e // sp_div
    elems_split = (nq + 2 * nkv) * d + nq * d
    latent = 0
    if model.multi_latent_attention:
        # Q and K with their rotary part, V and the attention output per head; the latents (whole on
        # every TP rank, split by sequence parallelism) feed their norms and up-projections.
        q_head = model.qk_head_dim + model.qk_pos_emb_head_dim
        elems_split = 2 * nq * q_head + 2 * nq * model.v_head_dim
        latent = (model.q_lora_rank or 0) + model.kv_lora_rank + model.qk_pos_emb_head_dim
    expert_elems = 0
    if moe is None:
        moe = bool(model.num_experts)
    if moe:
        # Each token visits top-k experts: its dispatched copies (k x h, as many arrive as leave a rank
        # on average) and each expert's fc1 output and activation output, split by expert-TP; the
        # router's logits and probabilities (2 x experts, fp32).
        fe = model.expert_ffn
        k = model.moe_router_topk
        expert_elems = k * h + k * ((2 if model.swiglu else 1) * fe + fe) // (etp or tp)
        expert_elems += 2 * model.num_experts * 4 // e
        fs = model.moe_shared_expert_intermediate_size
        if fs:  # the shared experts: a dense, tensor-parallel MLP every token passes through
            elems_split += (2 if model.swiglu else 1) * fs + fs
    else:
        elems_split += (2 if model.swiglu else 1) * model.ffn_hidden_size + model.ffn_hidden_size
    per_token = ((4 * h + latent) // sp_div + elems_split // tp + expert_elems) * e
    if setup.recompute == "none":
        per_token += (nq // tp) * setup.sequence_length * (2 * e + 1)
    return per_token


def _selective_bytes_per_token(
    model: ModelSpec, setup: TrainingSetup, tp: int, etp: int | None, moe: bool
) -> int:
    selective = msgspec.structs.replace(setup, recompute="selective")
    return activation_bytes_per_token(model, selective, tp, etp, moe)


def stage_layer_kinds(model: ModelSpec, layout: ParallelLayout) -> list[tuple[int, int]]:
    """``(dense layers, MoE layers)`` each pipeline stage of ``layout`` holds (``ModelSpec.moe_layers``:
    a dense first layer costs and keeps what a dense model's does)."""
    kinds = model.moe_layers
    out = []
    for layers in layout.layers_by_stage(model.num_layers):
        moe = sum(kinds[i] for i in layers)
        out.append((len(layers) - moe, moe))
    return out


def in_flight_micro_batches(stage: int, pp: int, micro_batches: int) -> int:
    """1F1B: stage ``s`` runs ``pp - s`` forward passes before its first backward."""
    return min(pp - stage, micro_batches)


def in_flight_chunks(stage: int, pp: int, micro_batches: int, vpp: int) -> int:
    """Interleaved 1F1B (Megatron's, ``vpp`` model chunks per stage): stage ``s`` runs ``(pp - s - 1) * 2
    + (vpp - 1) * pp`` chunk forward passes before its first backward, then keeps one more alive; each
    holds one chunk's ``1 / vpp`` of the stage's layers."""
    total = micro_batches * vpp
    return min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, total)


def memory_estimate(
    model: ModelSpec,
    setup: TrainingSetup,
    hardware: HardwareProfile,
    layout: ParallelLayout,
    staging_bytes: int = 0,
    geometry: ModelGeometry | None = None,
) -> MemoryEstimate:
    """Peak memory of each pipeline stage of ``layout`` (see the module docstring). With the job's own
    ``geometry`` (of ``model``'s depth) the training state is that model's, tensor for tensor; the
    activations still follow ``model``."""
    tp, pp = layout.tp, layout.pp
    micro_batches = setup.global_batch_size // (layout.dp * setup.micro_batch_size)
    tokens = setup.tokens_per_micro_batch // layout.cp  # context parallelism splits the sequence
    etp = layout.expert_tp
    per_layer_act = {
        moe: activation_bytes_per_token(model, setup, tp, etp, moe) * tokens for moe in (False, True)
    }
    # Full recomputation rebuilds one layer's activations at a time during the backward pass.
    recompute_work = {
        moe: _selective_bytes_per_token(model, setup, tp, etp, moe) * tokens
        if setup.recompute == "full"
        else 0
        for moe in (False, True)
    }
    e = DTYPE_BYTES[model.params_dtype]
    logits = tokens * (model.padded_vocab(tp) // tp) * (e + 4)
    stages: list[StageMemory] = []
    per_stage = stage_state_bytes(geometry if geometry is not None else model, setup, layout)
    for s, (dense, moe) in enumerate(stage_layer_kinds(model, layout)):
        n = dense + moe
        layers_act = dense * per_layer_act[False] + moe * per_layer_act[True]
        if layout.vpp > 1:  # chunk forward passes alive, each of a chunk's share of the layers
            chunks = in_flight_chunks(s, pp, micro_batches, layout.vpp)
            act = chunks * layers_act // layout.vpp
            in_flight = -(-chunks // layout.vpp)
        else:
            in_flight = in_flight_micro_batches(s, pp, micro_batches)
            act = in_flight * layers_act
        act += max(recompute_work[False] if dense else 0, recompute_work[True] if moe else 0)
        if s == pp - 1:  # the logits, and each MTP layer's (a layer of the last kind) with its own
            mtp = model.mtp_num_layers
            act += logits * (1 + mtp) + mtp * in_flight * per_layer_act[model.moe_layers[-1]]
        stages.append(
            StageMemory(
                stage=s,
                layers=n,
                state_bytes=per_stage[s][0],
                grad_bytes=per_stage[s][1],
                activation_bytes=act,
                in_flight=in_flight,
            )
        )
    return MemoryEstimate(stages=tuple(stages), usable_bytes=hardware.usable_bytes(staging_bytes))


def grad_bytes_per_rank(model: ModelSpec, setup: TrainingSetup, layout: ParallelLayout) -> int:
    """The largest gradient buffer of any rank: what its data-parallel all-reduce carries."""
    return max(grad for _state, grad in stage_state_bytes(model, setup, layout))
