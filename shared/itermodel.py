"""Iteration-time models of the paper (§5.1, Eq. 1–4), shared by engine, router and planner.

Symbols (paper Table 1): ``t_uc`` uncached prompt tokens of a request, ``t_c``
cached prompt tokens, ``t_rst`` tokens restored from host memory (L2 → L1),
``A = t_uc·t_c + t_uc·(t_uc+1)/2`` query–key pairs, ``B`` running decode
requests, ``t_fwd`` tokens each request feeds into a decode iteration,
``t_acc`` mean tokens accepted per decode iteration (speculative decoding).
All times are seconds.
"""

from __future__ import annotations

from msgspec import Struct


def qk_pairs(t_uc: int | float, t_c: int | float) -> float:
    """Query–key pairs of a prefill chunk: ``A = t_uc·t_c + t_uc·(t_uc+1)/2`` (paper §5.1)."""
    return t_uc * t_c + t_uc * (t_uc + 1) / 2.0


class PrefillModel(Struct, frozen=True, kw_only=True):
    """Eq. 1: ``T_P = c0 + c1·Σt_uc + c2·ΣA + c3·Σt_rst`` (s)."""

    c0: float
    """Fixed cost per iteration (s)."""
    c1: float
    """Per uncached token (s/token)."""
    c2: float
    """Per query–key pair (s/pair)."""
    c3: float
    """Per token restored from host memory (s/token)."""

    def iteration_time(self, sum_uncached: float, sum_qk: float, sum_restored: float = 0.0) -> float:
        """Duration of one prefill iteration (s), Eq. 1."""
        return self.c0 + self.c1 * sum_uncached + self.c2 * sum_qk + self.c3 * sum_restored

    def request_time(self, t_uc: float, t_c: float, *, mean_chunk_tokens: float, restored_share: float) -> float:
        """Prefill occupancy of one request (s), Eq. 3:
        ``c0·t_uc/t̄ + c1·t_uc + c2·A + c3·f·t_c``.

        Args:
            mean_chunk_tokens: t̄_n, mean uncached tokens per prefill iteration (> 0).
            restored_share: f_n, share of cached tokens restored from host memory.
        """
        t_bar = max(mean_chunk_tokens, 1.0)
        return self.c0 * t_uc / t_bar + self.c1 * t_uc + self.c2 * qk_pairs(t_uc, t_c) + self.c3 * restored_share * t_c


class DecodeModel(Struct, frozen=True, kw_only=True):
    """Eq. 2: ``T_D(B) = d0 + d1·φ(B) + d2·B`` with ``φ(B) = 1 − (1 − k/E)^(t_fwd·B)``.

    A dense model has ``experts == 0`` and φ = 1.
    """

    d0: float
    """Fixed cost per decode iteration (s): dense weights, launch."""
    d1: float
    """Cost of reading all routed experts (s), scaled by the covered share φ(B)."""
    d2: float
    """Per running request (s)."""
    active_experts: int = 0
    """k: routed experts per token (0 for a dense model)."""
    experts: int = 0
    """E: routed experts per MoE layer (0 for a dense model)."""
    tokens_per_forward: float = 1.0
    """t_fwd: tokens each running request feeds into an iteration (MTP: 1 + drafts)."""
    accepted_per_iteration: float = 1.0
    """t_acc: mean output tokens each request gains per iteration."""

    def expert_coverage(self, batch: float) -> float:
        """φ(B), the expected share of routed experts an iteration reads (paper App. B.3)."""
        if self.experts <= 0 or self.active_experts <= 0:
            return 1.0
        return 1.0 - (1.0 - self.active_experts / self.experts) ** (self.tokens_per_forward * batch)

    def iteration_time(self, batch: float) -> float:
        """Duration of one decode iteration with ``batch`` running requests (s), Eq. 2."""
        if batch <= 0:
            return 0.0
        return self.d0 + self.d1 * self.expert_coverage(batch) + self.d2 * batch

    def request_time(self, output_tokens: float, batch: float) -> float:
        """Decode occupancy of one request (s), Eq. 4: ``T_D(B)·t_out/(B·t_acc)``."""
        b = max(batch, 1.0)
        return self.iteration_time(b) * output_tokens / (b * self.accepted_per_iteration)
