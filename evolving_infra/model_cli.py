"""``evolving-infra model init DIR``: write a tiny seeded random model for the ``torch`` engine.

The folder has the Hugging Face layout (config.json, model.safetensors,
tokenizer.json trained locally on a fixed text that ships with the package, so the same
arguments and seed give the same folder in any commit or install; tokenizer_config.json with a
ChatML template),
so ``--engine torch --model DIR`` and ``transformers`` both load it. Needs the
``torch`` extra (``pip install -e '.[torch]'``). Exit status 0; 1 with one line
on stderr when the extra is missing (a runtime failure, as ``up --engine torch``
without it), before any folder is made; 2 with one line when a size is invalid (checked
before the folder is made), the folder already holds files and ``--force`` is absent (nothing
is written), or the folder cannot be written. ``--force`` writes into a non-empty folder after
removing its weight files and shard indexes (an old ``model-00001-of-00002.safetensors`` left beside
the new ``model.safetensors`` would be loaded with it). Files get the umask's mode (0644 under 022).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from evolving_infra.cli import RUNTIME_FAILURE, USAGE_ERROR

from evolving_infra.stdio_args import folder


TORCH_EXTRA = ("torch", "safetensors", "tokenizers")
"""The modules of the ``torch`` extra that writing a checkpoint imports (``checkpoint.init_model``
imports them lazily, so a missing one surfaced as a traceback from inside it)."""


def missing_torch_extra(command: str) -> str | None:
    """The one-line error for ``command`` (``model init``) when a module of the ``torch`` extra
    (:data:`TORCH_EXTRA`) cannot be imported, in the words of ``up --engine torch``; None when all import."""
    for name in TORCH_EXTRA:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            from services.worker.engines.torch_engine.config import TORCH_EXTRA_INSTALL  # imports no torch

            return f"error: {command} needs the torch extra ({e.name or name} missing): {TORCH_EXTRA_INSTALL}"
    return None


def _init(args: argparse.Namespace) -> int:
    if missing := missing_torch_extra("model init"):
        print(missing, file=sys.stderr)
        return RUNTIME_FAILURE  # the install lacks a package, as `up --engine torch` without it; 2 is a usage error
    from services.worker.engines.torch_engine.checkpoint import FolderNotEmptyError, init_model

    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        print(f"error: {args.dir}: is a file; give a folder path (created)", file=sys.stderr)
        return USAGE_ERROR
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
            force=args.force,
        )
    except FolderNotEmptyError as e:
        print(f"error: {e}; pass --force to write the model into it (its weight files are removed)", file=sys.stderr)
        return USAGE_ERROR
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    except OSError as e:  # the folder cannot be made or written (under a missing or read-only folder, disk full)
        print(f"error: {args.dir}: cannot write: {e}", file=sys.stderr)
        return USAGE_ERROR
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
        "generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json). Same arguments and seed give the same folder. "
        "A folder that already holds files is refused (exit 2) unless --force.",
    )
    i.add_argument("dir", type=folder, help="output folder (created; must be empty unless --force)")
    i.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty folder: its *.safetensors, pytorch_model*.bin and shard index files are "
        "deleted first (an old shard would be loaded with the new weights); other files of the same name are replaced",
    )
    i.add_argument("--arch", choices=("llama", "qwen3"), default="llama", help="llama (Llama 3 RoPE scaling, untied; the default) or qwen3 (q/k norm, tied)")
    i.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    i.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    i.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    i.add_argument("--kv-heads", type=int, default=2, help="key/value heads, GQA (default 2)")
    i.add_argument("--vocab", type=int, default=512, help="vocabulary size of the model and its tokenizer, >= 300 (default 512); "
                   "the fixed training text gives at most 4496 BPE ids, the rest are special filler tokens <|extra_N|> "
                   "(skipped in output text, as vLLM's skip_special_tokens)")
    i.add_argument("--context", type=int, default=2048, help="max_position_embeddings in tokens (default 2048)")
    i.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    i.set_defaults(func=_init)
