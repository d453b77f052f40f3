"""Megatron's own data pipeline as a corpus: indexed files from text, samples by index, errors by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from repo_paths import EXAMPLES

from liver.cli.main import main
from liver.worker_runtime.megatron.datasets import ByteTokenizer, CorpusError, MegatronCorpus, prepare_corpus

CORPUS_TEXT = EXAMPLES / "data" / "corpus.txt"


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("corpus") / "corpus")
    prepare_corpus(CORPUS_TEXT, out)
    return out


def test_the_shipped_text_becomes_one_document_per_paragraph_in_megatrons_format(prefix: str) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    paragraphs = [p.strip() for p in CORPUS_TEXT.read_text().split("\n\n") if p.strip()]
    data = IndexedDataset(prefix)
    assert len(data) == len(paragraphs)
    first = data[0].tolist()
    assert first[-1] == ByteTokenizer.eod
    assert ByteTokenizer().detokenize(first[:-1]) == paragraphs[0]


def test_a_sample_is_a_function_of_its_index_and_the_seed(prefix: str) -> None:
    a = MegatronCorpus([prefix], seq_length=16, num_samples=100)
    b = MegatronCorpus([prefix], seq_length=16, num_samples=100)
    other = MegatronCorpus([prefix], seq_length=16, num_samples=100, seed=7)
    assert torch.equal(a.batch(10, 4).tokens, b.batch(10, 4).tokens)
    assert not torch.equal(a.batch(10, 4).tokens, other.batch(10, 4).tokens)
    batch = a.batch(0, 2)
    assert batch.tokens.shape == batch.labels.shape == batch.loss_mask.shape == (2, 16)
    assert torch.equal(batch.tokens[:, 1:], batch.labels[:, :-1])  # labels are the next tokens


def test_dp_ranks_read_disjoint_contiguous_slices_of_one_global_batch(prefix: str) -> None:
    corpus = MegatronCorpus([prefix], seq_length=8, num_samples=64, record=True)
    for rank in range(2):
        list(corpus.micro_batches(16, 8, 2, rank, 2))
    assert corpus.read == list(range(16, 24))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prefixes": ["/nonexistent/corpus"]}, "prefixes"),
        ({"prefixes": []}, "prefixes"),
        ({"seq_length": 0}, "seq_length"),
        ({"num_samples": 0}, "num_samples"),
        ({"weights": [0.5, 0.5]}, "weights"),
    ],
)
def test_a_corpus_that_cannot_be_built_is_refused_naming_the_setting(
    prefix: str, kwargs: dict, field: str
) -> None:
    settings = {"prefixes": [prefix], "seq_length": 8, "num_samples": 10} | kwargs
    with pytest.raises(CorpusError, match=field):
        MegatronCorpus(**settings)


def test_reading_past_the_samples_the_corpus_was_built_for_is_refused(prefix: str) -> None:
    corpus = MegatronCorpus([prefix], seq_length=8, num_samples=10)
    with pytest.raises(CorpusError, match="num_samples"):
        corpus.batch(8, 4)


def test_liver_data_prepare_writes_the_files_and_says_what_it_wrote(tmp_path: Path, capsys) -> None:
    out = tmp_path / "c"
    assert main(["data", "prepare", "--input", str(CORPUS_TEXT), "--output-prefix", str(out)]) == 0
    assert (tmp_path / "c.bin").stat().st_size > 0 and (tmp_path / "c.idx").exists()
    assert "documents" in capsys.readouterr().out


def test_liver_data_prepare_refuses_a_missing_or_empty_input_in_one_line(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["data", "prepare", "--input", str(tmp_path / "none.txt"), "--output-prefix", "x"]) == 2
    assert main(["data", "prepare", "--input", str(empty), "--output-prefix", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "holds no text" in err
