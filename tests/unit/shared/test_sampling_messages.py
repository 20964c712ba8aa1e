"""Sampling parameters on the work messages (``shared.messages.Sampling``): they round-trip on
``PrefillWork`` and the hand-off ``DecodeWork``, a message without them (an old sender) decodes
as greedy, an old reader skips them, and the edge refuses out-of-range values."""

from __future__ import annotations

import math

import msgspec
import pytest

from shared import messages as m
from shared.bus import decoder_for
from shared.validate import check

SP = m.Sampling(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=-3, stop_token_ids=[2, 7])


def _prefill(**kw):
    return m.PrefillWork(rid="r", prompt_tokens=4, max_tokens=3, block_size=64, **kw)


def _decode(**kw):
    return m.DecodeWork(rid="r", prompt_tokens=4, max_tokens=3, block_size=64, **kw)


def test_sampling_round_trips_on_prefill_and_decode_work():
    for w in (_prefill(sampling=SP, output_offset=5), _decode(sampling=SP, output_offset=5)):
        back = decoder_for(type(w)).decode(m.encode(w))
        assert back == w and back.sampling == SP and back.output_offset == 5
        assert check(back, {}) is None


def test_default_is_greedy_and_compatible_both_ways():
    assert m.Sampling().greedy and not SP.greedy
    assert m.Sampling(temperature=1e-6).greedy
    # a sender without the field (old, or the simulator): decodes to None = greedy
    w = decoder_for(m.PrefillWork).decode(m.encode(_prefill()))
    assert w.sampling is None
    # omit_defaults: a default Sampling costs ~nothing on the wire
    assert msgspec.msgpack.encode(m.Sampling()) == msgspec.msgpack.encode({})

    # an old reader (a struct without ``sampling``) skips the field
    class OldPrefill(m.Msg, frozen=True, kw_only=True):
        rid: str
        prompt_tokens: int
        max_tokens: int
        block_size: int
        ignore_eos: bool = False

    old = msgspec.msgpack.Decoder(OldPrefill).decode(m.encode(_prefill(sampling=SP, ignore_eos=True)))
    assert old.rid == "r" and old.ignore_eos


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.5), ("min_p", -0.1)],
)
def test_decoder_refuses_out_of_range_fields(field, value):
    raw = msgspec.msgpack.encode({"rid": "r", "prompt_tokens": 4, "max_tokens": 3, "block_size": 64, "sampling": {field: value}})
    with pytest.raises(msgspec.ValidationError, match=field):
        decoder_for(m.PrefillWork).decode(raw)


def test_edge_refuses_what_types_cannot_say():
    for w in (_prefill(), _decode()):
        def bad(**kw):
            return check(msgspec.structs.replace(w, sampling=msgspec.structs.replace(SP, **kw)), {})

        assert bad() is None
        assert "temperature" in bad(temperature=math.inf)
        assert "temperature" in bad(temperature=1e9)
        assert "stop_token_ids" in bad(stop_token_ids=list(range(5000)))
        assert "stop_token_ids" in bad(stop_token_ids=[-1])
        assert "seed" in bad(seed=2**64)


def test_logprobs_ask_and_chunk_fields_round_trip_and_stay_compatible():
    """``Sampling.logprobs`` travels on both works; ``TokenChunk.logprobs`` / ``top_ids`` /
    ``top_logprobs`` round-trip, default empty (an old writer's chunk decodes, an old reader skips them)."""
    sp = m.Sampling(logprobs=3)
    for w in (_prefill(sampling=sp), _decode(sampling=sp)):
        back = decoder_for(type(w)).decode(m.encode(w))
        assert back.sampling.logprobs == 3 and check(back, {}) is None
    assert m.Sampling().logprobs is None and msgspec.msgpack.encode(m.Sampling()) == msgspec.msgpack.encode({})
    with pytest.raises(msgspec.ValidationError, match="logprobs"):
        decoder_for(m.PrefillWork).decode(msgspec.msgpack.encode({"rid": "r", "prompt_tokens": 4, "max_tokens": 3, "block_size": 64, "sampling": {"logprobs": 21}}))
    c = m.TokenChunk(rid="r", token_ids=[5, 6], logprobs=[-0.1, -math.inf], top_ids=[[5, 1], [2, 6]], top_logprobs=[[-0.1, -3.0], [-0.5, -math.inf]])
    back = decoder_for(m.TokenChunk).decode(m.encode(c))
    assert back == c and check(back, {"rid": "r"}) is None
    plain = decoder_for(m.TokenChunk).decode(m.encode(m.TokenChunk(rid="r", token_ids=[5])))
    assert plain.logprobs == [] and plain.top_ids == [] and check(plain, {"rid": "r"}) is None

    class OldChunk(m.Msg, frozen=True, kw_only=True):
        rid: str
        token_ids: list[int] = []

    assert msgspec.msgpack.Decoder(OldChunk).decode(m.encode(c)).token_ids == [5, 6]


def test_edge_refuses_bad_logprob_chunks():
    def bad(**kw):
        return check(m.TokenChunk(rid="r", token_ids=[5, 6], **kw), {"rid": "r"})

    assert "logprobs has 1 entries" in bad(logprobs=[-1.0])
    assert "log-probability" in bad(logprobs=[-1.0, 0.5])
    assert "log-probability" in bad(logprobs=[-1.0, math.nan])
    assert "top_ids/top_logprobs have" in bad(logprobs=[-1.0, -1.0], top_ids=[[1]], top_logprobs=[[-1.0]])
    assert "items" in bad(logprobs=[-1.0, -1.0], top_ids=[[1], [2, 3]], top_logprobs=[[-1.0], [-1.0]])
    assert "items" in bad(logprobs=[-1.0, -1.0], top_ids=[list(range(21))] * 2, top_logprobs=[[-1.0] * 21] * 2)
    assert "outside" in bad(logprobs=[-1.0, -1.0], top_ids=[[-1], [2]], top_logprobs=[[-1.0], [-1.0]])
    assert check(_prefill(sampling=msgspec.structs.replace(SP, logprobs=20)), {}) is None
