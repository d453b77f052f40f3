"""A synthetic token corpus addressed by sample index, so the data position is one integer.

A training job that reshards must resume its data exactly where it stopped, on any number of DP ranks.
Every sample here is a pure function of ``(seed, sample index)``, and a global batch is a fixed range of
sample indices; so the whole data state is ``consumed_samples``, and a new layout only changes which DP
rank reads which part of the same global batch (the set of samples per step never changes).

The language is a sparse Markov chain: every token has ``branching`` possible successors, so the
best achievable loss is about ``log(branching)`` while an untrained model starts near
``log(vocab_size)``: a few steps of training visibly lower the loss, and ``tests`` can rely on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol

import msgspec
import torch


class Batch(NamedTuple):
    """One micro-batch as Megatron's GPT forward takes it (``[batch, seq]`` each)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor


class Corpus(Protocol):
    """What a trainer reads its data from: micro-batches by data position (``consumed_samples``).

    The synthetic corpus here and Megatron's own ``GPTDataset`` (:class:`.datasets.MegatronCorpus`)
    both are one; the trainer never asks for more."""

    seq_length: int

    @property
    def vocab_size(self) -> int: ...

    def micro_batches(
        self,
        consumed_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> Iterator[Batch]: ...


class CorpusSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The synthetic language: vocabulary, branching factor of the chain and its seed."""

    vocab_size: int
    branching: int = 4
    seed: int = 2024

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {self.vocab_size}")
        if not 1 <= self.branching <= self.vocab_size:
            raise ValueError(f"branching must be in [1, vocab_size], got {self.branching}")


class SyntheticCorpus:
    """Samples of ``seq_length + 1`` tokens (inputs and shifted labels), generated on demand."""

    def __init__(self, spec: CorpusSpec, seq_length: int) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be at least 1, got {seq_length}")
        self.spec = spec
        self.seq_length = seq_length
        table = torch.Generator().manual_seed(spec.seed)
        self._successors = torch.randint(
            spec.vocab_size, (spec.vocab_size, spec.branching), generator=table, dtype=torch.int64
        )

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def sample(self, index: int) -> torch.Tensor:
        """The ``seq_length + 1`` tokens of sample ``index`` (any non-negative integer)."""
        if index < 0:
            raise ValueError(f"sample index must not be negative, got {index}")
        gen = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + index + 1)
        choices = torch.randint(self.spec.branching, (self.seq_length,), generator=gen).tolist()
        token = int(torch.randint(self.spec.vocab_size, (1,), generator=gen))
        out = [token]
        successors = self._successors
        for c in choices:
            token = int(successors[token, c])
            out.append(token)
        return torch.tensor(out, dtype=torch.int64)

    def batch(self, first_sample: int, size: int) -> Batch:
        """Samples ``first_sample .. first_sample + size - 1`` as one micro-batch."""
        rows = torch.stack([self.sample(first_sample + i) for i in range(size)])
        tokens, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        positions = torch.arange(self.seq_length, dtype=torch.int64).expand(size, -1).contiguous()
        return Batch(tokens, labels, torch.ones(size, self.seq_length), positions)

    def micro_batches(
        self,
        consumed_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> Iterator[Batch]:
        """This DP rank's micro-batches of the global batch that starts at ``consumed_samples``.

        DP rank ``d`` reads the ``d``-th contiguous slice of the global batch, micro-batch by
        micro-batch, as Megatron's pretraining sampler does.
        """
        for first in micro_batch_starts(
            consumed_samples, global_batch_size, micro_batch_size, dp_rank, dp_size
        ):
            yield self.batch(first, micro_batch_size)


def micro_batch_starts(
    consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> range:
    """The first sample index of each of DP rank ``dp_rank``'s micro-batches of the global batch that
    starts at ``consumed_samples``: the ``dp_rank``-th contiguous slice of it, as Megatron's pretraining
    sampler gives it. The one rule every corpus follows, so changing DP never changes which samples
    form a batch."""
    per_rank, rest = divmod(global_batch_size, dp_size)
    if rest or per_rank % micro_batch_size:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size "
            f"{micro_batch_size} x dp {dp_size}"
        )
    start = consumed_samples + dp_rank * per_rank
    return range(start, start + per_rank, micro_batch_size)
