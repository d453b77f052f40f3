"""Megatron's own data pipeline as a LiveR corpus: ``GPTDataset`` over indexed ``.bin``/``.idx`` files.

A job that reshards must resume its data exactly where it stopped, on any number of DP ranks.
Megatron's ``GPTDataset`` is addressed by sample index (its document, sample and shuffle indices are a
pure function of the files, the sequence length and the seed), so, as for the synthetic corpus, the
whole data position is ``consumed_samples`` and a global batch is the fixed range of sample indices
``[consumed, consumed + global_batch)``: DP rank ``d`` reads the ``d``-th contiguous slice of it, as
Megatron's pretraining sampler does. Changing DP changes who reads which part of a batch, never which
samples form it, so no sample is skipped or seen twice across a switch.

:class:`MegatronCorpus` builds the dataset once per process through Megatron's
``BlendedMegatronDatasetBuilder`` (a blend of one or more prefixes) and keeps it for every world the
process trains in. With ``torch.distributed`` initialised the builder runs collectives on the default
world (rank 0 first, a barrier, then the rest), so every process of that world builds its corpus at
the same point, or builds it before joining any world. The indices are built in memory (no cache
directory to race for); ``path_to_cache`` can name a shared cache instead.

:class:`ByteTokenizer` needs no download (bytes are tokens; 256 is end-of-document) and
:func:`prepare_corpus` (``liver data prepare``) turns a text file into Megatron's indexed format with it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from liver.shared.errors import InputError
from liver.worker_runtime.megatron.data import Batch, micro_batch_starts

__all__ = ["ByteTokenizer", "CorpusError", "MegatronCorpus", "prepare_corpus"]


class CorpusError(InputError):
    """A corpus that cannot be built or read (the message names the file or the setting)."""


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, end-of-document 256, padding 257: no vocabulary file to fetch.

    Has what Megatron's dataset code asks of a tokenizer (``vocab_size``, ``eod``, ``pad``)."""

    vocab_size = 258
    eod = 256
    eos = 256
    pad = 257
    unique_identifiers: ClassVar[dict[str, object]] = {"class": "liver.ByteTokenizer", "vocab_size": 258}
    """Megatron names a dataset's cached indices after its config, the tokenizer's identity included."""

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def prepare_corpus(
    text_file: str | os.PathLike[str], output_prefix: str | os.PathLike[str]
) -> tuple[int, int]:
    """Write ``output_prefix.bin`` / ``.idx`` from ``text_file``: one document per paragraph (blank-line
    separated), each ending in end-of-document. Returns (documents, tokens)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    source = Path(text_file)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise CorpusError(f"cannot read {source}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{source} is not UTF-8 text: {exc}") from None
    documents = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not documents:
        raise CorpusError(f"{source} holds no text")
    tokenizer = ByteTokenizer()
    prefix = str(output_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    tokens = 0
    for document in documents:
        ids = [*tokenizer.tokenize(document), tokenizer.eod]
        builder.add_document(np.array(ids, dtype=np.int64), [len(ids)])
        tokens += len(ids)
    builder.finalize(f"{prefix}.idx")
    return len(documents), tokens


class MegatronCorpus:
    """Samples of Megatron's ``GPTDataset`` by index, in LiveR's corpus interface (see the docstring).

    ``prefixes``: the indexed datasets' paths without ``.bin``/``.idx`` (a blend with ``weights``);
    ``num_samples``: how many samples the job may draw (the dataset repeats epochs to reach it).
    ``record=True`` keeps the sample indices this process reads, for tests and audits.
    """

    def __init__(
        self,
        prefixes: Sequence[str | os.PathLike[str]],
        *,
        seq_length: int,
        num_samples: int,
        seed: int = 1234,
        weights: Sequence[float] | None = None,
        tokenizer: object | None = None,
        path_to_cache: str | None = "",
        record: bool = False,
    ) -> None:
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        if seq_length < 1:
            raise CorpusError(f"seq_length must be at least 1, got {seq_length}")
        if num_samples < 1:
            raise CorpusError(f"num_samples must be at least 1, got {num_samples}")
        paths = [str(p) for p in prefixes]
        if not paths:
            raise CorpusError("prefixes: name at least one indexed dataset")
        for path in paths:
            for suffix in (".bin", ".idx"):
                if not os.path.isfile(path + suffix):
                    raise CorpusError(f"prefixes: {path}{suffix} does not exist (see `liver data prepare`)")
        if weights is not None and len(weights) != len(paths):
            raise CorpusError(f"weights: {len(weights)} weights for {len(paths)} datasets")
        self.tokenizer = tokenizer or ByteTokenizer()
        self.vocab_size = int(self.tokenizer.vocab_size)  # type: ignore[attr-defined]
        self.seq_length = seq_length
        config = GPTDatasetConfig(
            random_seed=seed,
            sequence_length=seq_length,
            blend=(paths, list(weights) if weights is not None else None),
            split="100,0,0",
            tokenizer=self.tokenizer,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            path_to_cache=path_to_cache,
            mmap_bin_files=False,
        )
        try:
            train, _, _ = BlendedMegatronDatasetBuilder(
                GPTDataset, [num_samples, 0, 0], lambda: True, config
            ).build()
        except (AssertionError, ValueError, OSError) as exc:
            raise CorpusError(f"Megatron could not build the dataset from {paths}: {exc}") from None
        if train is None or len(train) < num_samples:
            raise CorpusError(f"the dataset from {paths} gives {0 if train is None else len(train)} samples")
        self.dataset = train
        self.num_samples = num_samples
        self.read: list[int] | None = [] if record else None

    def batch(self, first_sample: int, size: int) -> Batch:
        """Samples ``first_sample .. first_sample + size - 1`` as one micro-batch."""
        if first_sample < 0 or first_sample + size > self.num_samples:
            raise CorpusError(
                f"samples {first_sample}..{first_sample + size - 1} are past the {self.num_samples} the "
                "corpus was built for (num_samples)"
            )
        rows = [self.dataset[first_sample + i] for i in range(size)]
        if self.read is not None:
            self.read.extend(range(first_sample, first_sample + size))
        return Batch(
            torch.stack([r["tokens"] for r in rows]),
            torch.stack([r["labels"] for r in rows]),
            torch.stack([r["loss_mask"] for r in rows]).float(),
            torch.stack([r["position_ids"] for r in rows]),
        )

    def micro_batches(
        self,
        consumed_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> Iterator[Batch]:
        """This DP rank's micro-batches of the global batch that starts at ``consumed_samples``."""
        try:
            starts = micro_batch_starts(
                consumed_samples, global_batch_size, micro_batch_size, dp_rank, dp_size
            )
        except ValueError as exc:
            raise CorpusError(str(exc)) from None
        for first in starts:
            yield self.batch(first, micro_batch_size)
