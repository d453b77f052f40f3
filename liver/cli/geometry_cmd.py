"""``liver geometry``: derive your own Megatron-core model's shard geometry, once, as a JSON file.

The provider is your model provider, ``(layout, pg_collection) -> GPTModel`` (``MODULE:FUNCTION`` or
``path/to/file.py:FUNCTION``). It is built on the meta device at a few probe layouts under torch's fake
process group (no memory, no GPUs, seconds even for a 175B model) and Megatron's ``sharded_state_dict()``
is read (``docs/geometry.md``). The file plans what-if resizes for your model (``liver plan --model
FILE``) exactly as the services plan them for the running job.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("geometry", help="derive a Megatron-core model's shard geometry from its provider")
    p.add_argument("--provider", required=True, metavar="MODULE:FUNCTION", help="your model provider")
    p.add_argument("--name", required=True, help="the model's name (for messages)")
    p.add_argument("--num-layers", type=int, required=True, help="decoder layers")
    p.add_argument("--vocab-size", type=int, default=None, help="the tokenizer's real vocabulary")
    p.add_argument(
        "--make-vocab-size-divisible-by",
        "--divisible-by",  # the earlier spelling, still read
        dest="make_vocab_size_divisible_by",
        type=int,
        default=128,
        help="Megatron pads the vocabulary to a multiple of this times TP (its own flag's name; 128)",
    )
    p.add_argument("--out", default=None, help="write the geometry here (default: print it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import msgspec

    from liver.shared.logs import configure_logging
    from liver.worker_runtime.megatron.geometry import derive_geometry
    from liver.worker_runtime.megatron.source import load_provider

    configure_logging(level="WARNING")
    provider = load_provider(args.provider)
    geometry = derive_geometry(
        provider,
        name=args.name,
        num_layers=args.num_layers,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )
    data = msgspec.json.format(msgspec.json.encode(geometry), indent=2)
    if args.out:
        Path(args.out).write_bytes(data + b"\n")
        print(
            f"{args.out}: {geometry.name}, {len(geometry.tensors(optimizer=False))} parameters in "
            f"{len(geometry.parameters)} entries, {geometry.parameter_count():,} elements, "
            f"digest {geometry.digest()}"
        )
    else:
        sys.stdout.write(data.decode() + "\n")
    return 0
