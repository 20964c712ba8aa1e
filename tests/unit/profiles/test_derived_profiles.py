"""Profiles derived from gb300-glm52 (shared/profiles/): gb300-kimi-k26 and gb300-glm52-sglang; their derivations hold."""

from __future__ import annotations

import pytest

from services.worker.scheduler import EngineScheduler
from shared.itermodel import qk_pairs
from shared.profile import available_profiles, load_profile


def test_loads_and_suits_the_scheduler() -> None:
    assert "gb300-kimi-k26" in available_profiles()
    p = load_profile("gb300-kimi-k26")
    EngineScheduler("w0", p, "both")
    assert p.gpus_per_node == 4 and p.block_size == 64


def test_kv_per_token_and_capacity() -> None:
    p = load_profile("gb300-kimi-k26")
    assert p.kv_bytes_per_token == 576 * 61  # MLA latent + RoPE, 61 layers, FP8 (paper A.5: "about 35 KB")
    assert p.memory.host_kv_tokens == 4 * p.memory.gpu_kv_tokens  # paper §6.1
    glm = load_profile("gb300-glm52")
    # per GPU: 288 GB = weights + KV + the same non-KV rest as GLM (derivation in the profile)
    rest = 288e9 - glm.memory.gpu_kv_tokens * glm.kv_bytes_per_token - 744e9 * 4.5 / 8 / 4
    kv = 288e9 - rest - 1.04e12 * 4.5 / 8 / 4
    assert p.memory.gpu_kv_tokens == pytest.approx(kv / p.kv_bytes_per_token, rel=0.01)


def test_prefill_scaled_from_glm() -> None:
    k, g = load_profile("gb300-kimi-k26").prefill, load_profile("gb300-glm52").prefill
    assert k.c1 == pytest.approx(g.c1 * 32.6 / 40, rel=0.01)  # active parameters
    assert k.c2 == pytest.approx(2 * (192 + 128) * 64 * 61 / 4.8e15, rel=0.01)  # full MLA attention FLOPs per pair
    # full attention makes a long cached prefix cost more than GLM's sparse indexer
    a = qk_pairs(8192, 131072)
    assert k.iteration_time(8192, a) > g.iteration_time(8192, a)


def test_decode_scaled_from_glm() -> None:
    d, g = load_profile("gb300-kimi-k26").decode, load_profile("gb300-glm52").decode
    assert (d.active_experts, d.experts) == (8, 384)
    assert d.d1 == pytest.approx(g.d1 * 570 / 390, rel=0.01)  # routed-expert bytes
    assert d.d2 == pytest.approx(g.d2 * 32.6 / 40 + 35136 * 64_000 / 6.4e12, rel=0.01)
    for b in (1, 8, 16, 64):
        assert d.iteration_time(b) > g.iteration_time(b)


def test_sglang_variant_differs_only_in_the_load_back() -> None:
    import msgspec

    s, g = load_profile("gb300-glm52-sglang"), load_profile("gb300-glm52")
    a, b = msgspec.to_builtins(s), msgspec.to_builtins(g)
    for k in ("name", "description"):
        a.pop(k), b.pop(k)
    assert a["prefill"].pop("c3") == pytest.approx(0.3 / 100_000)  # D.6: ≈0.3 s per load-back iteration of ≈100K tokens
    b["prefill"].pop("c3")
    assert a == b
    # restoring a 100K-token prefix now costs ≈0.3 s of prefill, ≈190× the asynchronous load-back
    assert s.prefill.iteration_time(0, 0, 100_000) - s.prefill.c0 == pytest.approx(0.3)
