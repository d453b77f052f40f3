"""The synthetic training state ``liver bench stream`` reshards, and how a process knows what it must get.

Every element's value is a function of its tensor and global index, so each process computes the
checksum its new shards must have without any other process's data: bit-exactness is checked
without gathering the state anywhere. Sizes and layouts are chosen so that every reshape the
benchmark offers divides the model evenly.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import torch

from liver.reshard.holdings import Holding, packed, pieces_of
from liver.reshard.plan import Plan
from liver.reshard.views import Shard
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import Device, ParallelLayout
from liver.shared.model import ModelSpec, TensorSpec
from liver.worker_runtime.stream.executor import TORCH_DTYPES, GroupRanks, LocalTensor

MIB = 1 << 20
KIB = 1 << 10
JOB = "bench-stream"
LAYERS = 12  # divisible by every pipeline size the reshapes use (2, 3, 4)
HEADS = 12  # divisible by every tensor-parallel size (2, 3, 4)
HIDDEN_STEP = 48  # hidden sizes are multiples of it: 4 x hidden stays divisible by 2, 3 and 4
MAX_MESSAGE_BYTES = 32 * MIB
RESHAPES = ("tp-to-dp", "dp-to-tp", "pp-to-tp")


# -- the synthetic model and reshape -------------------------------------------------------------------


def _spec(hidden: int, vocab: int) -> ModelSpec:
    return ModelSpec(
        name="synthetic",
        num_layers=LAYERS,
        hidden_size=hidden,
        ffn_hidden_size=4 * hidden,
        num_attention_heads=HEADS,
        vocab_size=vocab,
        max_sequence_length=1024,
    )


def state_bytes(model: ModelSpec | ModelGeometry) -> int:
    """The whole training state: parameters plus fp32 master weights, both Adam moments and the step."""
    return sum(t.nbytes for t in model.tensors(optimizer=True))


def synthetic_model(target_bytes: int) -> ModelSpec:
    """A GPT-like model whose training state is ``target_bytes`` to within one vocabulary row.

    The widest hidden size (a multiple of 48) whose layers fit under the target, then a vocabulary that
    fills the rest: the state is mostly decoder layers, as in a real model, and hits the size exactly.
    """
    smallest = state_bytes(_spec(HIDDEN_STEP, 1))
    if target_bytes < smallest:
        raise ValueError(
            f"--size-mib: {target_bytes / MIB:g} MiB is below the smallest synthetic model "
            f"({smallest / MIB:.2f} MiB)"
        )
    hidden = HIDDEN_STEP
    while state_bytes(_spec(hidden + HIDDEN_STEP, 1)) <= target_bytes:
        hidden += HIDDEN_STEP
    base = state_bytes(_spec(hidden, 1))
    per_row = state_bytes(_spec(hidden, 2)) - base
    return _spec(hidden, 1 + (target_bytes - base) // per_row)


def reshape_layouts(reshape: str, procs: int) -> tuple[ParallelLayout, ParallelLayout]:
    """``tp-to-dp``: TP n -> TP n/2 x DP 2 (n even); ``dp-to-tp`` the other way (the old state is what
    the distributed optimizer shards); ``pp-to-tp``: PP n -> TP n; all on the same n processes in rank
    order."""
    if not 2 <= procs <= 4:
        raise ValueError(f"--procs: between 2 and 4 local processes, got {procs}")
    if reshape == "tp-to-dp":
        if procs % 2:
            raise ValueError(f"--procs: tp-to-dp needs an even number of processes, got {procs}")
        return ParallelLayout(tp=procs, pp=1, dp=1), ParallelLayout(tp=procs // 2, pp=1, dp=2)
    if reshape == "dp-to-tp":
        if procs % 2:
            raise ValueError(f"--procs: dp-to-tp needs an even number of processes, got {procs}")
        return ParallelLayout(tp=procs // 2, pp=1, dp=2), ParallelLayout(tp=procs, pp=1, dp=1)
    if reshape == "pp-to-tp":
        return ParallelLayout(tp=1, pp=procs, dp=1), ParallelLayout(tp=procs, pp=1, dp=1)
    raise ValueError(f"--reshape: one of {', '.join(RESHAPES)}, got {reshape!r}")


def local_devices(n: int) -> tuple[Device, ...]:
    return tuple(Device("node000", i) for i in range(n))


def message_split(budget_bytes: int) -> tuple[int, int]:
    """``B`` -> (send-copy budget, message bytes): pieces of an eighth of ``B``, two of them in flight.
    The executor keeps both inside its one buffer of at most ``B`` (the plan's budget)."""
    if budget_bytes < 64 * KIB:
        raise ValueError(f"--budget-mib: at least 64 KiB, got {budget_bytes / MIB:g} MiB")
    message = min(MAX_MESSAGE_BYTES, budget_bytes // 8) // 8 * 8
    return 2 * message, message


# -- synthetic content: every element is a function of (tensor, global index) ------------------------

_MIX = 0x9E3779B1  # odd: the map from index to value is a bijection before masking
_VALUE_BITS = {"float32": 24, "bfloat16": 8, "float16": 11, "int64": 62}  # integers the dtype holds exactly


def box_content(ti: int, spec: TensorSpec, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The values of ``spec``'s global ``box``: integers mixed from the global flat index, exact in the
    dtype, so a process can compute any other process's slice without its data."""
    extent = tuple(hi - lo for lo, hi in box)
    index = torch.zeros(extent, dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(box))):
        lo, hi = box[d]
        shape = [1] * len(box)
        shape[d] = hi - lo
        index += (torch.arange(lo, hi, dtype=torch.int64) * stride).view(shape)
        stride *= spec.shape[d]
    mixed = index.mul_(_MIX).add_((ti + 1) * 40503)
    mixed = mixed.bitwise_xor_(mixed >> 17).bitwise_and_((1 << _VALUE_BITS[spec.dtype]) - 1)
    return mixed.to(TORCH_DTYPES[spec.dtype])


def shard_content(plan: Plan, ti: int, shard: Shard) -> torch.Tensor:
    """A rank's whole local tensor: its box of the global tensor, zero padding after (vocabulary)."""
    spec = plan.tensors[ti]
    out = torch.zeros(shard.local_shape, dtype=TORCH_DTYPES[spec.dtype])
    if shard.box is not None:
        out[tuple(slice(0, hi - lo) for lo, hi in shard.box)] = box_content(ti, spec, shard.box)
    return out


def holding_content(plan: Plan, ti: int, pieces: Holding) -> LocalTensor:
    """A rank's local tensor(s) of one holding: one per piece for DP-sharded optimizer state."""
    return packed(plan.tensors[ti], plan.model, [shard_content(plan, ti, piece) for piece in pieces])


def empty_holding(plan: Plan, ti: int, pieces: Holding) -> LocalTensor:
    """Uninitialised storage for one holding, shaped as the executor wants it (``into``)."""
    dtype = TORCH_DTYPES[plan.tensors[ti].dtype]
    return packed(plan.tensors[ti], plan.model, [torch.empty(p.local_shape, dtype=dtype) for p in pieces])


def checksum(value: LocalTensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in pieces_of(value):
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def state_digest(sums: dict[int, str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for ti in sorted(sums):
        h.update(f"{ti}:{sums[ti]};".encode())
    return h.hexdigest()


def pair_bytes(plan: Plan) -> tuple[tuple[int, int, int], ...]:
    """Bytes the plan sends from each process to each other one (group ranks of the stream group)."""
    ranks = GroupRanks.by_device(plan)
    out: dict[tuple[int, int], int] = defaultdict(int)
    for task in plan.tasks:
        if not task.local:
            out[(ranks.old[task.src], ranks.new[task.dst])] += task.nbytes
    return tuple((s, d, n) for (s, d), n in sorted(out.items()))
