"""``evolving-infra model init DIR``: write a tiny seeded random model for the ``torch`` engine.

The folder has the Hugging Face layout (config.json, model.safetensors,
tokenizer.json trained locally, tokenizer_config.json with a ChatML template),
so ``--engine torch --model DIR`` and ``transformers`` both load it. Needs the
``torch`` extra (``pip install -e '.[torch]'``). Exit status 0, or 2 with a
message when the extra is missing or a size is invalid.
"""

from __future__ import annotations

import argparse
import sys

from evolving_infra.stdio_args import folder


def _init(args: argparse.Namespace) -> int:
    try:
        from services.worker.engines.torch_engine.checkpoint import init_model
    except ModuleNotFoundError as e:
        print(f"error: {e.name} is not installed; install the torch extra: pip install -e '.[torch]'", file=sys.stderr)
        return 1  # a runtime failure (the install lacks a package), as `up --engine torch` without it; 2 is a usage error
    try:
        folder = init_model(
            args.dir,
            arch=args.arch,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            vocab=args.vocab,
            context=args.context,
            seed=args.seed,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.arch} model ({args.layers} layers, hidden {args.hidden}) to {folder}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``model init`` to the CLI."""
    p = sub.add_parser("model", help="make a local model folder for the torch engine")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    i = msub.add_parser(
        "init",
        help="write a seeded random Llama/Qwen3 checkpoint with a locally trained byte-level BPE tokenizer",
        description="Write a seeded random checkpoint in the Hugging Face folder layout (config.json, "
        "model.safetensors, tokenizer.json, tokenizer_config.json). Same arguments and seed give the same folder.",
    )
    i.add_argument("dir", type=folder, help="output folder (created)")
    i.add_argument("--arch", choices=("llama", "qwen3"), default="llama", help="llama (Llama 3 RoPE scaling, untied) or qwen3 (q/k norm, tied)")
    i.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    i.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    i.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    i.add_argument("--kv-heads", type=int, default=2, help="key/value heads, GQA (default 2)")
    i.add_argument("--vocab", type=int, default=512, help="BPE vocabulary size, >= 300 (default 512)")
    i.add_argument("--context", type=int, default=2048, help="max_position_embeddings in tokens (default 2048)")
    i.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    i.set_defaults(func=_init)
