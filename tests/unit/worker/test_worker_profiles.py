"""The shipped profiles: the gb300-glm52 numbers reproduce the paper's anchors."""

from __future__ import annotations

import pytest

from shared.profile import available_profiles, load_profile
from services.worker.scheduler import EngineScheduler


def test_shipped_profiles_load_and_suit_the_scheduler():
    assert {"gb300-glm52", "tiny"} <= set(available_profiles())
    for name in ("gb300-glm52", "tiny"):
        p = load_profile(name)
        EngineScheduler("w0", p, "both")
        assert p.host_blocks >= 4 * p.gpu_blocks - 1


def test_gb300_decode_iteration_17_to_45_ms_and_tpot_range():
    p = load_profile("gb300-glm52")
    d = p.decode
    assert (d.active_experts, d.experts) == (8, 256)
    assert d.iteration_time(8) == pytest.approx(0.017, abs=0.0005)
    assert d.iteration_time(64) == pytest.approx(0.045, abs=0.0005)
    tpot = [d.iteration_time(b) / d.accepted_per_iteration for b in range(4, 21)]
    # the paper's mean TPOT 4.4–7.9 ms lies inside the TPOT of 4–20 running requests
    assert min(tpot) < 0.0044 and max(tpot) > 0.0079


def test_gb300_prefill_matches_figure5_anchors():
    pf = load_profile("gb300-glm52").prefill
    from shared.itermodel import qk_pairs

    t_128k = pf.iteration_time(8192, qk_pairs(8192, 131072))
    t_1m = pf.iteration_time(8192, qk_pairs(8192, 1048576))
    assert t_128k == pytest.approx(0.40, rel=0.02)
    assert t_1m == pytest.approx(1.75, rel=0.02)


def test_gb300_kv_and_links():
    p = load_profile("gb300-glm52")
    assert p.kv_bytes_per_token == 54600 and p.block_size == 64
    assert p.memory.host_kv_tokens == 4 * p.memory.gpu_kv_tokens
    assert p.memory.gpu_kv_tokens == pytest.approx(2.06e6, rel=0.01)
    assert p.links.peer_fetch_bytes_per_s == 52e9
    # a 96K-token peer fetch at 52 GB/s ≈ 0.1 s (paper: 64K–128K fetches take 129 ms at the median)
    assert 96_000 * p.kv_bytes_per_token / p.links.peer_fetch_bytes_per_s == pytest.approx(0.10, rel=0.02)
    assert (p.scheduler.chunk_tokens, p.scheduler.max_running) == (8192, 64)
