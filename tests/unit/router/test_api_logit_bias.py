"""``logit_bias`` at the router (``services/router/api.py``) and on the wire (``shared.messages.Sampling``,
``shared.validate``). It was accepted and dropped: ``{"abc": -100}``, ``{"99999": 5}`` and ``{"284": -1000}``
all got a 200, and the engine never saw a bias. Now: non-integer keys, ids outside the vocabulary and values
outside [-100, 100] are 400s naming ``logit_bias`` (OpenAI's / vLLM's checks); accepted ones reach the nodes'
``Sampling`` as int ids (a request without one still sends nothing); the nodes' check bounds them too, and an
old writer's ``Sampling`` (no ``logit_bias``) still decodes."""

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


def refused(fn=parse, **kw) -> api.ApiError:
    with pytest.raises(api.ApiError) as ei:
        fn(**kw)
    assert ei.value.status == 400 and ei.value.param == "logit_bias", ei.value.reason
    return ei.value


def _work(sp):
    return PrefillWork(rid="r1", prompt_tokens=1, max_tokens=8, block_size=16, block_hashes=[], sampling=sp)


def test_logit_bias_goes_to_the_nodes_as_int_ids():
    assert api.sampling(parse(logit_bias={})) is None and api.sampling(parse(logit_bias=None)) is None
    sp = api.sampling(parse(logit_bias={"284": -100, "7": 2.5}))
    assert sp == Sampling(logit_bias={284: -100.0, 7: 2.5}) and sp.greedy
    assert api.sampling(chat(logit_bias={"0": 100}, temperature=1)) == Sampling(temperature=1.0, logit_bias={0: 100.0})
    w = msgspec.msgpack.decode(msgspec.msgpack.encode(_work(sp)), type=PrefillWork)
    assert w.sampling == sp and validate.check(w) is None


def test_bad_keys_and_values_are_400s_naming_logit_bias():
    for fn in (parse, chat):
        assert "'abc' is not a token id" in refused(fn, logit_bias={"abc": -100}).reason
        for key in ("1.5", "1e3", " 5", "5\n", ""):
            refused(fn, logit_bias={key: 1})
        assert "outside [-100, 100]" in refused(fn, logit_bias={"284": -1000}).reason
        refused(fn, logit_bias={"284": 100.5})
    assert parse(logit_bias={"284": -100, "3": 100}).logit_bias == {"284": -100.0, "3": 100.0}


def test_ids_outside_the_vocabulary_are_400s():
    req = parse(logit_bias={"3": 1, "99999": 5})
    with pytest.raises(api.ApiError) as ei:
        api.check_logit_bias(req, 512)
    assert ei.value.status == 400 and ei.value.param == "logit_bias"
    assert ei.value.reason == "logit_bias token id 99999 is outside the vocabulary [0, 512)"
    with pytest.raises(api.ApiError, match="-1 is outside"):
        api.check_logit_bias(parse(logit_bias={"-1": 1}), 512)
    api.check_logit_bias(parse(logit_bias={"511": 1, "0": -1}), 512)


def test_the_nodes_check_bounds_and_old_messages_decode():
    for bad in (Sampling(logit_bias={2**32: 1.0}), Sampling(logit_bias={-1: 1.0}), Sampling(logit_bias={1: 101.0}),
                Sampling(logit_bias={1: float("nan")})):
        reason = validate.check(_work(bad))
        assert reason is not None and "logit_bias" in reason, (bad, reason)
    old = msgspec.msgpack.encode({"temperature": 0.5, "seed": 3})
    assert msgspec.msgpack.decode(old, type=Sampling) == Sampling(temperature=0.5, seed=3)
    assert msgspec.msgpack.encode(Sampling(temperature=0.5, seed=3)) == old  # off: not on the wire
