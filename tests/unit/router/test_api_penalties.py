"""``presence_penalty`` / ``frequency_penalty`` / ``repetition_penalty`` / ``min_tokens`` at the router
(``services/router/api.py``) and on the wire (``shared.messages.Sampling``, ``shared.validate``):
they reach the nodes' ``Sampling`` (off = the defaults, a request without any still sends nothing),
out-of-range values are 400s naming the field, ``min_tokens`` above ``max_tokens`` is a 400 (vLLM's
check), a work built from any accepted value passes the nodes' check, out-of-range ones do not, and
an old reader's / writer's ``Sampling`` (no new fields) still decodes."""

from __future__ import annotations

import msgspec
import pytest

from services.router import api
from shared import validate
from shared.messages import PrefillWork, Sampling


def parse(**kw):
    return api.parse_completion(msgspec.json.encode({"prompt": "x", **kw}))[0]


def chat(**kw):
    return api.parse_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "x"}], **kw}))


def param(fn=parse, **kw) -> str | None:
    with pytest.raises(api.ApiError) as ei:
        fn(**kw)
    assert ei.value.status == 400
    return ei.value.param


def _work(sp):
    return PrefillWork(rid="r1", prompt_tokens=1, max_tokens=8, block_size=16, block_hashes=[], sampling=sp)


def test_penalties_and_min_tokens_go_to_the_nodes():
    assert api.sampling(parse(presence_penalty=0, frequency_penalty=0, repetition_penalty=1, min_tokens=0)) is None
    sp = api.sampling(parse(presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.2, min_tokens=3, max_tokens=4))
    assert sp == Sampling(presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.2, min_tokens=3)
    assert sp.greedy and sp.penalized
    assert api.sampling(parse(min_tokens=2)) == Sampling(min_tokens=2)
    assert api.sampling(chat(repetition_penalty=0.9, temperature=1)) == Sampling(temperature=1.0, repetition_penalty=0.9)
    for s in (sp, Sampling(min_tokens=2), Sampling(repetition_penalty=api.MAX_REPETITION_PENALTY, presence_penalty=-2.0)):
        w = msgspec.msgpack.decode(msgspec.msgpack.encode(_work(s)), type=PrefillWork)
        assert w.sampling == s and validate.check(w) is None


def test_bad_values_are_400s_naming_the_field():
    assert param(presence_penalty=2.5) == "presence_penalty"
    assert param(frequency_penalty=-2.01) == "frequency_penalty"
    assert param(repetition_penalty=0) == "repetition_penalty"
    assert param(repetition_penalty=-1) == "repetition_penalty"
    assert param(repetition_penalty=api.MAX_REPETITION_PENALTY * 2) == "repetition_penalty"
    # a tiny one overflowed the float32 logits to +inf: NaN softmax, the draw fell to id V - 1
    assert param(repetition_penalty=1e-39) == "repetition_penalty"
    assert param(repetition_penalty=api.MIN_REPETITION_PENALTY * 0.99) == "repetition_penalty"
    assert api.MIN_REPETITION_PENALTY == validate.MIN_REPETITION_PENALTY
    assert parse(repetition_penalty=api.MIN_REPETITION_PENALTY).repetition_penalty == validate.MIN_REPETITION_PENALTY
    assert param(min_tokens=-1) == "min_tokens"
    assert param(min_tokens=1.5) == "min_tokens"
    assert param(min_tokens=5, max_tokens=4) == "min_tokens"
    assert param(chat, min_tokens=5, max_completion_tokens=4) == "min_tokens"
    assert param(chat, min_tokens=5, max_tokens=4) == "min_tokens"
    assert parse(min_tokens=4, max_tokens=4).min_tokens == 4


def test_the_nodes_check_bounds_and_old_messages_decode():
    for bad, name in (
        (Sampling(presence_penalty=float("nan")), "presence_penalty"),
        (Sampling(frequency_penalty=3.0), "frequency_penalty"),
        (Sampling(repetition_penalty=0.0), "repetition_penalty"),
        (Sampling(repetition_penalty=float("inf")), "repetition_penalty"),
        (Sampling(repetition_penalty=1e-39), "repetition_penalty"),
        (Sampling(min_tokens=2**40), "min_tokens"),
    ):
        reason = validate.check(_work(bad))
        assert reason is not None and name in reason, (bad, reason)
    # a Sampling without the new fields (an old writer) decodes to them off; defaults are not sent
    old = msgspec.msgpack.encode({"temperature": 0.5, "seed": 3})
    assert msgspec.msgpack.decode(old, type=Sampling) == Sampling(temperature=0.5, seed=3)
    assert msgspec.msgpack.encode(Sampling(temperature=0.5, seed=3)) == old
