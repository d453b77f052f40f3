"""``liver data prepare``: a text file into Megatron's indexed format (``.bin``/``.idx``).

One document per paragraph (blank-line separated); tokens are UTF-8 bytes (``ByteTokenizer``: no
vocabulary to download), each document ending in end-of-document. The result is what Megatron's
``GPTDataset`` reads, and what ``MegatronCorpus`` (and ``examples/your_own_job.py``) train on.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare training data in Megatron's indexed format")
    data_sub = p.add_subparsers(dest="data", required=True)
    prepare = data_sub.add_parser("prepare", help="a UTF-8 text file into PREFIX.bin and PREFIX.idx")
    prepare.add_argument(
        "--input", required=True, metavar="TEXT_FILE", help="UTF-8 text, paragraphs are documents"
    )
    prepare.add_argument(
        "--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX.bin, PREFIX.idx"
    )
    prepare.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from liver.worker_runtime.megatron.datasets import prepare_corpus

    documents, tokens = prepare_corpus(args.input, args.output_prefix)
    print(
        f"{args.output_prefix}.bin/.idx: {documents} documents, {tokens} tokens "
        "(byte tokenizer, vocabulary 258)"
    )
    return 0
