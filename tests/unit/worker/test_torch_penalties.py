"""Penalties and ``min_tokens`` in the torch engine (``torch_engine/sampling.py``: :func:`token_stats`,
:func:`penalize`, :func:`sample`; ``TorchEngine``), vLLM's semantics
(``vllm/model_executor/layers/utils.py`` ``apply_penalties``, the v1 ``MinTokensLogitsProcessor``).

Sampler: each penalty against a hand computation on a 6-token vocabulary; rows without one are
untouched (greedy rows stay the same argmax, also with a penalized row beside them); penalties
that are off leave the logits as they were; ``min_tokens`` masks EOS and ``stop_token_ids``
until the output reaches it; a re-dispatch's earlier output (the prompt's last ``output_offset``
tokens) counts as output; :meth:`TokenStats.add` keeps the counts of every token added.

Engine (tiny random model, ``LocalNode``): a penalized request gives the same tokens collocated,
split over prefill and decode nodes, and continued after a re-dispatch (prompt + first k tokens,
``output_offset`` k); penalties change a greedy sequence; ``min_tokens`` keeps a stop token id
from ending the request before it.
"""

from __future__ import annotations

import functools

import msgspec
import pytest

torch = pytest.importorskip("torch")

from shared.messages import Sampling  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402
from services.worker.engines.torch_engine.sampling import penalize, sample, token_stats  # noqa: E402
from tests.unit.worker import torch_tiny  # noqa: E402
from tests.unit.worker.torch_tiny import PROFILE  # noqa: E402

ROW = [2.0, -1.0, 0.5, -3.0, 1.0, 0.0]


def _pen(sp, prompt, out=(), offset=0, eos=(), pos=None):
    st = token_stats(sp, prompt, list(out), offset, eos, len(ROW), "cpu")
    x = torch.tensor([ROW])
    return penalize(x, [st], [sp], [len(out) + offset if pos is None else pos])[0].tolist(), st


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens():
    got, _ = _pen(Sampling(repetition_penalty=2.0), prompt=[0, 1], out=[3, 5])
    # seen: 0 (prompt), 1 (prompt), 3 (output), 5 (output; logit 0 is not > 0: 0 * 2)
    assert got == [1.0, -2.0, 0.5, -6.0, 1.0, 0.0]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    sp = Sampling(frequency_penalty=0.5, presence_penalty=0.25)
    got, _ = _pen(sp, prompt=[1, 2], out=[0, 0, 0, 4])
    # token 0: 2 - 0.5*3 - 0.25 = 0.25; token 4: 1 - 0.5 - 0.25 = 0.25; prompt tokens untouched
    assert got == [0.25, -1.0, 0.5, -3.0, 0.25, 0.0]
    neg, _ = _pen(Sampling(frequency_penalty=-1.0, presence_penalty=-2.0), prompt=[], out=[3, 3])
    assert neg == [2.0, -1.0, 0.5, -3.0 + 2.0 + 2.0, 1.0, 0.0]


def test_all_three_in_vllms_order():
    sp = Sampling(repetition_penalty=4.0, frequency_penalty=1.0, presence_penalty=0.5)
    got, _ = _pen(sp, prompt=[2], out=[0, 0])
    # token 0: 2/4 - 1*2 - 0.5 = -2.0; token 2 (prompt): 0.5/4 = 0.125
    assert got == [-2.0, -1.0, 0.125, -3.0, 1.0, 0.0]


def test_redispatch_output_in_the_prompt_counts_as_output():
    """Prompt [1, 2] + earlier output [0, 0] sent as the prompt with output_offset 2, then 1 new token."""
    sp = Sampling(frequency_penalty=1.0, presence_penalty=0.5)
    cont, st = _pen(sp, prompt=[1, 2, 0, 0], out=[4], offset=2)
    whole, _ = _pen(sp, prompt=[1, 2], out=[0, 0, 4])
    assert cont == whole == [2.0 - 2.0 - 0.5, -1.0, 0.5, -3.0, 1.0 - 1.5, 0.0]
    assert st.counts.tolist() == [2, 0, 0, 0, 1, 0]


def test_off_is_identical_and_untouched_rows_keep_their_argmax():
    assert token_stats(Sampling(temperature=0.7, top_k=3), [1, 2], [], 0, [5], 6, "cpu") is None
    assert token_stats(None, [1, 2], [], 0, [5], 6, "cpu") is None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 50, generator=g).to(torch.bfloat16)
    ref = x.argmax(-1).tolist()
    strong = Sampling(repetition_penalty=50.0)
    st = token_stats(strong, [ref[1]], [], 0, [], 50, "cpu")
    got = sample(x, [None, strong, Sampling(), None], [0] * 4, [0] * 4, [None, st, None, None])
    assert [got[i] for i in (0, 2, 3)] == [ref[i] for i in (0, 2, 3)]
    assert got[1] != ref[1]  # its argmax was in the prompt and divided by 50
    y = penalize(x, [None, st, None, None], [None, strong, None, None], [0] * 4)
    assert torch.equal(y[[0, 2, 3]], x[[0, 2, 3]].float())
    # a penalty that is explicitly neutral next to one that is on changes nothing of its own
    neutral = Sampling(frequency_penalty=0.1, presence_penalty=0.0, repetition_penalty=1.0)
    st0 = token_stats(neutral, [0, 1, 2], [], 0, [], 50, "cpu")
    assert torch.equal(penalize(x, [st0], [neutral], [0])[0], x[0].float())


def test_min_tokens_masks_eos_and_stop_token_ids_until_the_output_reaches_it():
    sp = Sampling(min_tokens=3, stop_token_ids=[4])
    eos = [0]
    for n_out in range(5):
        got, _ = _pen(sp, prompt=[1], out=[2] * n_out, eos=eos)
        if n_out < 3:
            assert got[0] == got[4] == float("-inf") and got[1:4] == ROW[1:4] and got[5] == ROW[5]
        else:
            assert got == ROW
    # the client's position counts: a re-dispatch with output_offset 3 is past min_tokens
    got, _ = _pen(sp, prompt=[1, 2, 2, 2], out=[], offset=3, eos=eos)
    assert got == ROW
    # greedy picks the masked EOS (logit 2.0, the max) only from position 3
    x = torch.tensor([ROW])
    st = token_stats(sp, [1], [], 0, eos, len(ROW), "cpu")
    assert [sample(x, [sp], [0], [p], [st])[0] for p in range(5)] == [2, 2, 2, 0, 0]


def test_token_stats_add_counts_incrementally():
    sp = Sampling(frequency_penalty=1.0)
    st = token_stats(sp, [3], [1], 0, [], 6, "cpu")
    for t in (1, 5, 1):
        st.add(t)
    assert st.counts.tolist() == [0, 3, 0, 0, 0, 1]
    assert st.seen.tolist() == [False, True, False, True, False, True]


# --------------------------------------------------------------------------- #
# engine
# --------------------------------------------------------------------------- #

N = 14
work = functools.partial(torch_tiny.work, n=N)
_prompt = torch_tiny.prompt


def _run(node, *works):
    for w in works:
        node.add_prefill(w)
    node.run()
    return node


def test_penalized_request_same_collocated_split_and_continued(tiny_llama):
    prompt = _prompt(11)
    greedy = _run(LocalNode("g", PROFILE, tiny_llama), work("g", prompt, None)).finished["g"].tokens
    sp = Sampling(frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=1.5)
    ref = _run(LocalNode("a", PROFILE, tiny_llama), work("r", prompt, sp), work("x", _prompt(12, 40), None)).finished["r"].tokens
    assert len(ref) == N and ref != greedy
    assert len(set(ref)) == N  # penalties of this size never repeat a token of this random model
    # prefill node samples the first token, decode node the rest
    p = LocalNode("p", PROFILE, tiny_llama, phase="prefill")
    d = LocalNode("d", PROFILE, tiny_llama, phase="decode")
    _run(p, work("r", prompt, sp, decode_node="d"))
    assert [h.work.sampling for h in p.handoffs] == [sp]
    d.add_decode(p.handoffs[0].work)
    d.run()
    assert d.finished["r"].tokens == ref
    # re-dispatch: prompt + first k tokens, output_offset k; the earlier output still counts
    for k in (1, 6):
        w = msgspec.structs.replace(work("r", prompt + ref[:k], sp, n=N - k), output_offset=k)
        assert _run(LocalNode("c", PROFILE, tiny_llama), w).finished["r"].tokens == ref[k:], k
    # the engine's counts are the output's, kept incrementally
    node = LocalNode("s", PROFILE, tiny_llama)
    node.add_prefill(work("r", prompt, sp, n=N))
    for _ in range(4):
        node.step()
    s = node.engine.seqs["r"]
    assert s.stats.counts.tolist() == torch.bincount(torch.tensor(s.out), minlength=512).float().tolist()


def test_min_tokens_keeps_a_stop_token_id_from_ending_the_request_before_it(tiny_llama):
    prompt = _prompt(6)
    ref = _run(LocalNode("g", PROFILE, tiny_llama), work("g", prompt, None)).finished["g"].tokens
    j = next(i for i in range(1, N - 4) if ref.index(ref[i]) == i)
    stop = ref[j]
    plain = _run(LocalNode("a", PROFILE, tiny_llama), work("s", prompt, Sampling(stop_token_ids=[stop]))).finished["s"]
    assert plain.tokens == ref[: j + 1] and plain.finish_reason == "stop"
    m = j + 3
    got = _run(LocalNode("b", PROFILE, tiny_llama), work("m", prompt, Sampling(stop_token_ids=[stop], min_tokens=m))).finished["m"]
    assert got.tokens[:j] == ref[:j]
    assert stop not in got.tokens[:m] and len(got.tokens) > m - 1
    assert got.finish_reason == ("stop" if stop in got.tokens else "length")


def test_a_queued_penalized_request_holds_no_device_counts_until_it_is_first_sampled(tiny_llama):
    # 5 bytes x vocabulary each (0.76 MB at 152k): only requests the engine samples hold them,
    # not every request waiting in the queue; built from the packed prompt (numpy, not a list)
    import numpy as np

    node = LocalNode("q", PROFILE, tiny_llama)
    sp = Sampling(repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=3)
    for i in range(3):
        node.add_prefill(work(f"q{i}", _prompt(20 + i), sp))
    node.add_prefill(work("plain", _prompt(30), None))
    assert all(s.stats is None for s in node.engine.seqs.values())
    node.step()
    sampled = [rid for rid, s in node.engine.seqs.items() if s.out]
    assert sampled and all(node.engine.seqs[r].stats is not None for r in sampled if r != "plain")
    assert node.engine.seqs["plain"].stats is None
    p = _prompt(21)
    a, b = token_stats(sp, p, [7, 7], 2, [1], 512, "cpu"), token_stats(sp, np.asarray(p, dtype="<u4"), [7, 7], 2, [1], 512, "cpu")
    assert torch.equal(a.counts, b.counts) and torch.equal(a.seen, b.seen) and torch.equal(a.min_stop, b.min_stop)
