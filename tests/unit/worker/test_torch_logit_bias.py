"""``logit_bias`` in the torch engine's sampler (``torch_engine/sampling.py``: :func:`token_stats`,
:func:`penalize`, :func:`sample`), vLLM's semantics (v1 ``LogitBiasLogitsProcessor``: the bias is
added to the float32 logits before the penalties, temperature and the filters, on greedy and
sampled rows). It was accepted by the router and dropped: ``{"284": -100}`` still produced 284.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shared.messages import Sampling  # noqa: E402
from services.worker.engines.torch_engine.sampling import check_logit_bias, penalize, sample, token_stats  # noqa: E402

V = 50


def _logits(rows: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return 5.0 * torch.randn(rows, V, generator=g)


def _stats(sps):
    return [token_stats(sp, [1, 2], [], 0, [], V, "cpu") for sp in sps]


def test_minus_100_bans_the_argmax_token_and_plus_100_forces_one_greedy_and_sampled():
    x = _logits()
    ref = x.argmax(-1).tolist()
    low = int(x[2].argmin())
    sps = [
        Sampling(logit_bias={ref[0]: -100.0}),  # greedy: the argmax is banned
        Sampling(logit_bias={ref[1]: -100.0}, temperature=1.0, seed=3),  # sampled: never drawn
        Sampling(logit_bias={low: 100.0}, temperature=1.0, seed=3),  # the least likely token, forced
        None,  # no bias: untouched
    ]
    for seed in range(20):  # many draws of the sampled rows
        got = sample(x, sps, [seed] * 4, [seed] * 4, _stats(sps))
        assert got[0] != ref[0] and got[0] == int(x[0].clone().index_fill_(0, torch.tensor([ref[0]]), -1e9).argmax())
        assert got[1] != ref[1]
        assert got[2] == low
        assert got[3] == ref[3]


def test_bias_is_added_in_float32_first_and_rows_without_it_are_untouched():
    x = _logits(3).to(torch.bfloat16)
    sp = Sampling(logit_bias={0: 2.5, 7: -1.25}, repetition_penalty=2.0)
    st = token_stats(sp, [7], [], 0, [], V, "cpu")
    got = penalize(x, [None, st, None], [None, sp, None], [0, 0, 0])
    want = x[1].float().clone()
    want[0] += 2.5
    want[7] -= 1.25
    # then vLLM's repetition penalty on the biased logit of the prompt token 7
    want[7] = want[7] / 2.0 if want[7] > 0 else want[7] * 2.0
    assert got.dtype == torch.float32
    assert torch.equal(got[1], want)
    assert torch.equal(got[0], x[0].float()) and torch.equal(got[2], x[2].float())


def test_no_bias_needs_no_stats_and_an_id_outside_the_vocabulary_is_refused():
    assert token_stats(Sampling(temperature=0.5), [1], [], 0, [], V, "cpu") is None
    assert token_stats(Sampling(logit_bias={3: 1.0}), [1], [], 0, [], V, "cpu") is not None
    check_logit_bias(Sampling(logit_bias={V - 1: 1.0}), V)
    with pytest.raises(ValueError, match=f"logit_bias token id {V} is outside the model's vocabulary"):
        check_logit_bias(Sampling(logit_bias={1: 1.0, V: 1.0, V + 5: 1.0}), V)


# --------------------------------------------------------------------------- #
# engine (tiny random llama, LocalNode)
# --------------------------------------------------------------------------- #


def _run(node, *works):
    for w in works:
        node.add_prefill(w)
    node.run()
    return node


def test_engine_applies_the_bias_collocated_and_split_and_refuses_an_id_past_the_model(tiny_llama):
    from services.worker.engines.torch_engine.local import LocalNode
    from tests.unit.worker import torch_tiny
    from tests.unit.worker.torch_tiny import PROFILE

    n = 8
    prompt = torch_tiny.prompt(11)
    greedy = _run(LocalNode("g", PROFILE, tiny_llama), torch_tiny.work("g", prompt, None, n=n)).finished["g"].tokens
    sp = Sampling(logit_bias={t: -100.0 for t in greedy})  # every token greedy chose, banned
    got = _run(LocalNode("a", PROFILE, tiny_llama), torch_tiny.work("b", prompt, sp, n=n)).finished["b"].tokens
    assert len(got) == n and not set(got) & set(greedy), (got, greedy)
    # the prefill node samples the first token, the decode node the rest: both apply it
    p = LocalNode("p", PROFILE, tiny_llama, phase="prefill")
    d = LocalNode("d", PROFILE, tiny_llama, phase="decode")
    _run(p, torch_tiny.work("b", prompt, sp, decode_node="d", n=n))
    d.add_decode(p.handoffs[0].work)
    d.run()
    assert d.finished["b"].tokens == got
    forced = Sampling(logit_bias={5: 100.0}, temperature=1.0, seed=1)
    assert _run(LocalNode("f", PROFILE, tiny_llama), torch_tiny.work("f", prompt, forced, n=n)).finished["f"].tokens == [5] * n
    node = LocalNode("v", PROFILE, tiny_llama)
    with pytest.raises(ValueError, match="logit_bias token id 512 is outside the model's vocabulary"):
        node.engine.accept_prefill(torch_tiny.work("v", prompt, Sampling(logit_bias={512: 1.0}), n=n))
