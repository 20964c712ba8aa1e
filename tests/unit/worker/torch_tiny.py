"""Shared setup of the torch engine's unit tests (``test_torch_sampling``, ``test_torch_penalties``,
``test_torch_logprobs``, ``test_torch_eos``): the tiny random llama they all run (built once a
session by the ``tiny_llama`` fixture of ``conftest.py``), the ``torch-tiny-cpu`` profile, seeded
random prompts and the :class:`PrefillWork` of a request.

Importing it needs no torch (``init_model`` is imported when a folder is built), so a test module
can import it after its ``pytest.importorskip("torch")``."""

from __future__ import annotations

import random
from pathlib import Path

from shared.hashing import block_hashes, pack_tokens
from shared.messages import PrefillWork, Sampling
from shared.profile import load_profile

PROFILE = load_profile("torch-tiny-cpu")
BS = PROFILE.block_size


def write_tiny_llama(folder: Path) -> str:
    """Write the tests' tiny random llama (2 layers, hidden 64, 4 heads / 2 KV heads, vocabulary
    512, context 1024, seed 5) into ``folder``; returns it as a string (``LocalNode``'s model)."""
    from services.worker.engines.torch_engine.checkpoint import init_model

    init_model(folder, arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, context=1024, seed=5)
    return str(folder)


def prompt(seed: int, n: int = 29) -> list[int]:
    """``n`` token ids in [0, 500) drawn by ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


def work(
    rid: str, tokens: list[int], sp: Sampling | None = None, decode_node: str | None = None, *, n: int, ignore_eos: bool = True
) -> PrefillWork:
    """The prefill work of request ``rid``: prompt ``tokens`` hashed in ``BS``-token blocks,
    ``n`` output tokens, sampling ``sp`` (None: greedy), handed off to ``decode_node`` if set."""
    return PrefillWork(
        rid=rid, prompt_tokens=len(tokens), max_tokens=n, block_size=BS, block_hashes=block_hashes(tokens, BS),
        token_ids=pack_tokens(tokens), decode_node=decode_node, ignore_eos=ignore_eos, sampling=sp,
    )  # fmt: skip
