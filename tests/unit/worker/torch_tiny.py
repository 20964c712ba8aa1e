"""Shared setup of the torch engine's unit tests (``test_torch_sampling``, ``test_torch_penalties``,
``test_torch_logprobs``, ``test_torch_eos``): the tiny random llama they all run (built once a
session by the ``tiny_llama`` fixture of ``conftest.py``), the ``torch-tiny-cpu`` profile, seeded
random prompts and the :class:`PrefillWork` of a request; and (``test_torch_accept_loop``,
``test_torch_handoff_loop``) a worker's KV drain and a step whose forward holds the engine's lock.

Importing it needs no torch (``init_model`` is imported when a folder is built), so a test module
can import it after its ``pytest.importorskip("torch")``."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Set
from pathlib import Path
from typing import TYPE_CHECKING

from shared.hashing import block_hashes, pack_tokens
from shared.messages import PrefillWork, Sampling
from shared.profile import load_profile

if TYPE_CHECKING:
    from services.worker.service import WorkerService

PROFILE = load_profile("torch-tiny-cpu")
BS = PROFILE.block_size

FORWARD_S = 0.4
"""How long :func:`slow_step`'s slowed forward holds the engine's lock (wall s)."""


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


def drain(svc: WorkerService, keep: Set[str]) -> None:
    """Apply the core's KV events to ``svc``'s engine, keeping the core's requests and ``keep`` registered."""
    svc.engine.on_kv_events(svc.core.take_kv_events(), set(svc.core.requests) | set(keep))


async def slow_step(svc: WorkerService, now: float, rid: str, keep: Set[str] = frozenset()) -> tuple[asyncio.Task, object]:
    """Start request ``rid``'s 200-token prefill (at ``now``, sim s) in ``svc``'s execute thread, its forward slowed
    by ``FORWARD_S`` under the engine's lock (KV drained keeping ``keep``); returns once that thread holds the lock:
    the step's task and its plan. Later forwards run at full speed."""
    svc.engine.accept_prefill(work(rid, prompt(2, 200), n=4))
    svc.core.add_prefill(work(rid, prompt(2, 200), n=4), now)
    plan = svc.core.schedule(now)
    drain(svc, keep)
    forward = svc.engine._forward

    def slow_forward(*args, **kw):
        time.sleep(FORWARD_S)
        return forward(*args, **kw)

    svc.engine._forward = slow_forward  # type: ignore[method-assign]
    step = asyncio.create_task(svc._in_thread(svc.engine.execute, plan))
    while svc.engine._lock.acquire(blocking=False):  # until the execute thread holds it
        svc.engine._lock.release()
        await asyncio.sleep(0.001)
    svc.engine._forward = forward  # type: ignore[method-assign]  # the plan's call already has the slow one
    return step, plan
