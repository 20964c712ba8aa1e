"""The ``sim`` engine: a simulated GPU whose iteration times come from a profile (DESIGN §5).

Every scheduling decision (batching, chunking, paged blocks, eviction) is made
by the real scheduler core; only the time an iteration takes is computed, by
paper Eq. 1/2 with the profile's coefficients, instead of measured. Output
token ids are a deterministic function of (rid, position), so two runs (or the
live stack and the simulator) stream identical tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from shared.hashing import SIM_VOCAB_SIZE
from shared.messages import DecodeWork, PrefillWork, Sampling
from shared.profile import Profile
from services.worker.engines.base import Engine
from services.worker.plan import IterationPlan

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def sim_output_tokens(rid: str, start: int, count: int, vocab: Sequence[int] | None = None) -> list[int]:
    """Deterministic output token ids of ``rid`` at positions ``[start, start + count)``.

    Draw ``j`` is ``x_j = splitmix64(seed(rid) + j·φ64)`` with ``seed`` the first 8 bytes
    of SHA-256(rid). Without ``vocab`` the token is ``x_j mod SIM_VOCAB_SIZE`` (the sim
    tokenizer's ids); with ``vocab`` (the ids of a real tokenizer that a client can count
    from the text, :func:`shared.tokenizer.output_vocabulary`) it is
    ``vocab[x_j mod len(vocab)]``, so every id lies inside that tokenizer's vocabulary.

    Raises:
        ValueError: if ``start`` or ``count`` is negative, or ``vocab`` is empty.
    """
    if start < 0 or count < 0:
        raise ValueError(f"start and count must be >= 0, got {start}, {count}")
    seed = int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "little")
    draws = (_splitmix64((seed + j * _GOLDEN) & _MASK) for j in range(start, start + count))
    if vocab is None:
        return [x % SIM_VOCAB_SIZE for x in draws]
    if not vocab:
        raise ValueError("vocab is empty")
    n = len(vocab)
    return [vocab[x % n] for x in draws]


class SimEngine(Engine):
    """Executes a plan by returning its profile duration (Eq. 1/2, computed by the scheduler)."""

    name = "sim"
    simulated = True

    def __init__(self, profile: Profile, vocab: Sequence[int] | None = None) -> None:
        self.profile = profile
        self.vocab = vocab
        """Output ids to draw from (a real tokenizer's whole words); None = the sim tokenizer's."""

    def execute(self, plan: IterationPlan) -> float:
        """Duration of ``plan`` in simulated seconds: ``iterations × iteration_s``."""
        return plan.iterations * plan.iteration_s

    def output_tokens(self, rid: str, start: int, count: int) -> list[int]:
        return sim_output_tokens(rid, start, count, self.vocab)

    def accept_prefill(self, work: PrefillWork) -> None:
        """Refuse a work that asks for log-probabilities or a ``logit_bias``: the sim engine has no
        model, so no distribution to report or bias (the router refuses such a request with a 400
        before it is dispatched to a sim node; one that gets here anyway is an engine error)."""
        _refuse_model_only(work.sampling)

    def accept_decode(self, work: DecodeWork) -> None:
        """As :meth:`accept_prefill`."""
        _refuse_model_only(work.sampling)


def _refuse_model_only(sp: Sampling | None) -> None:
    """Raises ValueError if ``sp`` asks for ``logprobs`` or a ``logit_bias`` (the sim engine has no model)."""
    if sp is not None and sp.logprobs is not None:
        raise ValueError("logprobs are not supported by the sim engine (no model, no token distribution); serve a torch engine")
    if sp is not None and sp.logit_bias:
        raise ValueError("logit_bias is not supported by the sim engine (no model, no logits to bias); serve a torch engine")
