"""The sim engine: duration = plan duration; deterministic output tokens per (rid, position)."""

from __future__ import annotations

import pytest

from shared.hashing import SIM_VOCAB_SIZE
from services.worker.engines.sim import SimEngine, sim_output_tokens


def test_tokens_are_deterministic_per_position_and_in_vocab():
    a = sim_output_tokens("req-1", 0, 50)
    assert a == sim_output_tokens("req-1", 0, 50)
    assert a[10:20] == sim_output_tokens("req-1", 10, 10), "a range equals the slice of a longer run"
    assert a != sim_output_tokens("req-2", 0, 50)
    assert all(0 <= t < SIM_VOCAB_SIZE for t in a)
    assert len(set(a)) > 40
    assert sim_output_tokens("x", 5, 0) == []
    with pytest.raises(ValueError):
        sim_output_tokens("x", -1, 2)


def test_sim_engine_executes_a_plan_in_its_profile_duration(b):
    s = b.sched(phase="decode")
    s.add_decode(b.decode("r", [1, 2], max_tokens=100), 0.0)
    plan = s.schedule(0.0, horizon=0.1)
    eng = SimEngine(b.profile())
    assert plan.iterations > 1
    assert eng.execute(plan) == pytest.approx(plan.end - plan.start)
    assert eng.name == "sim" and eng.simulated


def test_sim_engine_refuses_logit_bias():
    """The sim engine has no logits to bias: a work with a ``logit_bias`` is refused (as one with
    ``logprobs``), not served with the bias silently dropped; an empty one is no bias."""
    from shared.messages import DecodeWork, PrefillWork, Sampling
    from shared.profile import load_profile

    eng = SimEngine(load_profile("tiny"))
    sp = Sampling(logit_bias={3: -100.0})
    with pytest.raises(ValueError, match="logit_bias is not supported by the sim engine"):
        eng.accept_prefill(PrefillWork(rid="r", prompt_tokens=4, max_tokens=3, block_size=16, sampling=sp))
    with pytest.raises(ValueError, match="logit_bias is not supported by the sim engine"):
        eng.accept_decode(DecodeWork(rid="r", prompt_tokens=4, max_tokens=3, block_size=16, sampling=sp))
    eng.accept_prefill(PrefillWork(rid="r", prompt_tokens=4, max_tokens=3, block_size=16, sampling=Sampling(logit_bias={})))
