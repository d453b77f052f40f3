"""``liver geometry``: derive your own Megatron-core model's shard geometry, once, as a JSON file.

The provider is your model provider, ``(layout, pg_collection) -> GPTModel`` (``MODULE:FUNCTION`` or
``path/to/file.py:FUNCTION``). It is built on the meta device at a few probe layouts under torch's fake
process group (no memory, no GPUs, seconds even for a 175B model) and Megatron's ``sharded_state_dict()``
is read (``docs/geometry.md``). The file plans what-if resizes for your model (``liver plan --model
FILE``) exactly as the services plan them for the running job.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from liver.shared.errors import InputError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("geometry", help="derive a Megatron-core model's shard geometry from its provider")
    p.add_argument("--provider", required=True, metavar="MODULE:FUNCTION", help="your model provider")
    p.add_argument("--name", required=True, help="the model's name (for messages)")
    p.add_argument("--num-layers", type=int, required=True, help="decoder layers")
    p.add_argument("--vocab-size", type=int, default=None, help="the tokenizer's real vocabulary")
    p.add_argument("--divisible-by", type=int, default=128, help="make_vocab_size_divisible_by (128)")
    p.add_argument("--out", default=None, help="write the geometry here (default: print it)")
    p.set_defaults(func=run)


def load_provider(reference: str) -> Any:
    """``MODULE:FUNCTION`` or ``FILE.py:FUNCTION``; errors name what is missing."""
    where, _, name = reference.rpartition(":")
    if not where or not name:
        raise InputError(f"--provider {reference!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    try:
        if where.endswith(".py"):
            path = Path(where)
            spec = importlib.util.spec_from_file_location(f"liver_provider_{path.stem}", path)
            if spec is None or spec.loader is None or not path.is_file():
                raise InputError(f"--provider: no such file {where}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except InputError:
        raise
    except Exception as exc:  # the user's file: a syntax error, an import that fails, ...
        raise InputError(f"--provider: cannot import {where}: {type(exc).__name__}: {exc}") from None
    provider = getattr(module, name, None)
    if not callable(provider):
        raise InputError(f"--provider: {where} has no function {name!r}")
    return provider


def run(args: argparse.Namespace) -> int:
    import msgspec

    from liver.shared.logs import configure_logging
    from liver.worker_runtime.megatron.geometry import derive_geometry

    configure_logging(level="WARNING")
    provider = load_provider(args.provider)
    geometry = derive_geometry(
        provider,
        name=args.name,
        num_layers=args.num_layers,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=args.divisible_by,
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
