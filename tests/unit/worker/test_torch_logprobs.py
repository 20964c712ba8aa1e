"""Log-probabilities in the ``torch`` engine (``torch_engine.logprobs``, ``Sampling.logprobs``):
the values are ``torch.log_softmax`` of the raw logits, the top lists sorted and holding the
chosen token of a greedy row, computed on the prefill node's first token and every decode token
(equal across a hand-off), none for requests that did not ask; the sim engine refuses such work.
The engine tests run on the CPU in float32 (``device="cpu"``): equality to 1e-4 across batch shapes
is a float32 claim, not a bfloat16 GPU one."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from shared.messages import DecodeWork, PrefillWork, Sampling  # noqa: E402
from services.worker.engines.sim import SimEngine  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402
from services.worker.engines.torch_engine.logprobs import token_logprobs  # noqa: E402
from tests.unit.worker import torch_tiny  # noqa: E402
from tests.unit.worker.torch_tiny import PROFILE  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_are_log_softmax_and_top_k_is_sorted(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 300, generator=g) * 4).to(dtype)
    rows, chosen, ks = [4, 0, 2], [7, 299, 0], [3, 0, 20]
    out = token_logprobs(logits, rows, chosen, ks)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert len(out) == 3
    for (lp, ids, lps), r, t, k in zip(out, rows, chosen, ks):
        assert lp == pytest.approx(ref[r, t].item(), abs=1e-6)
        assert len(ids) == len(lps) == k
        assert lps == sorted(lps, reverse=True)
        assert ids == torch.topk(ref[r], k).indices.tolist() if k else ids == []
        for i, v in zip(ids, lps):
            assert v == pytest.approx(ref[r, i].item(), abs=1e-6)
    # the argmax token, chosen, is the top-1 entry with the same value
    am = int(ref[1].argmax())
    (lp, ids, lps), = token_logprobs(logits, [1], [am], [2])
    assert ids[0] == am and lps[0] == lp
    assert token_logprobs(logits, [], [], []) == []


N = 10
work = functools.partial(torch_tiny.work, n=N)
_prompt = torch_tiny.prompt


def test_engine_logprobs_every_token_only_when_asked_and_across_a_handoff(tiny_llama):
    prompt = _prompt(2)
    node = LocalNode("a", PROFILE, tiny_llama, device="cpu")
    node.add_prefill(work("plain", prompt, None))
    node.add_prefill(work("g", prompt, Sampling(logprobs=3)))
    node.add_prefill(work("t", _prompt(4), Sampling(temperature=1.2, seed=9, logprobs=0)))
    node.run()
    assert node.finished["plain"].logprobs is None
    f = node.finished["g"]
    assert f.tokens == node.finished["plain"].tokens  # asking changes no token
    assert sorted(f.logprobs) == list(range(N))
    for i, t in enumerate(f.tokens):
        lp, ids, lps = f.logprobs[i]
        assert ids[0] == t and lps[0] == lp and len(ids) == 3 and lp <= 0  # greedy: the chosen token is the top one
    ft = node.finished["t"]
    assert sorted(ft.logprobs) == list(range(N)) and all(v[1] == [] for v in ft.logprobs.values())
    # prefill node: position 0; decode node: the rest; the same values as collocated
    p = LocalNode("p", PROFILE, tiny_llama, phase="prefill", device="cpu")
    d = LocalNode("d", PROFILE, tiny_llama, phase="decode", device="cpu")
    p.add_prefill(work("g", prompt, Sampling(logprobs=3), decode_node="d"))
    p.run()
    assert p.handoffs[0].work.sampling == Sampling(logprobs=3)
    first = p.handoff_logprobs["g"]
    assert sorted(first) == [0]
    d.add_decode(p.handoffs[0].work)
    d.run()
    split = {0: first[0], **d.finished["g"].logprobs}
    assert d.finished["g"].tokens == f.tokens and sorted(split) == list(range(N))
    for i in range(N):
        assert split[i][0] == pytest.approx(f.logprobs[i][0], abs=1e-4)
        assert split[i][1] == f.logprobs[i][1]


def test_sim_engine_refuses_logprobs():
    eng = SimEngine(PROFILE)
    w = PrefillWork(rid="r", prompt_tokens=4, max_tokens=3, block_size=16, sampling=Sampling(logprobs=0))
    with pytest.raises(ValueError, match="logprobs are not supported by the sim engine"):
        eng.accept_prefill(w)
    with pytest.raises(ValueError, match="sim engine"):
        eng.accept_decode(DecodeWork(rid="r", prompt_tokens=4, max_tokens=3, block_size=16, sampling=Sampling(logprobs=2)))
    eng.accept_prefill(PrefillWork(rid="r", prompt_tokens=4, max_tokens=3, block_size=16, sampling=Sampling(top_k=3)))


def test_logprobs_are_the_raw_distribution_not_the_penalized_one(tiny_llama):
    """vLLM's ``raw_logprobs``: penalties (here ``repetition_penalty``, which already changes position 0:
    it applies to the prompt's tokens) and temperature do not change the reported values; at position 0
    the prompt is the same, so the top lists equal an unpenalized greedy request's."""
    prompt = _prompt(7)
    node = LocalNode("a", PROFILE, tiny_llama, device="cpu")
    node.add_prefill(work("g", prompt, Sampling(logprobs=5)))
    node.add_prefill(work("p", prompt, Sampling(temperature=0.7, seed=3, repetition_penalty=3.0, logprobs=5)))
    node.run()
    g0, p0 = node.finished["g"].logprobs[0], node.finished["p"].logprobs[0]
    assert p0[1] == g0[1] and p0[2] == pytest.approx(g0[2], abs=1e-5)
