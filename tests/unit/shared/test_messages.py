import msgspec
import pytest

from shared import messages as m
from shared.bus import decoder_for
from shared.subjects import ALL, KV_EVENTS, REQ_OUT, Subjects, check_token


def test_every_subject_roundtrips_a_message():
    samples = {
        "kv.events.{node}": m.KvEventBatch(node="w0", seq=1, events=[m.BlockStored(block_hashes=[1], block_size=64), m.AllBlocksCleared()]),
        "branch.events": m.BranchEnd(branch_id="b"),
    }
    for subj, msg in samples.items():
        s = next(x for x in ALL if x.template == subj)
        assert decoder_for(s.msg_type).decode(m.encode(msg)) == msg


def test_validation_rejects_bad_values():
    bad = msgspec.msgpack.encode({"node": "w0", "seq": 0})
    with pytest.raises(msgspec.ValidationError):
        decoder_for(m.KvEventBatch).decode(bad)


def test_subject_builder_and_match():
    s = Subjects("p1")
    full = s.format(KV_EVENTS, node="w3")
    assert full == "ei.p1.kv.events.w3"
    assert s.wildcard(KV_EVENTS) == "ei.p1.kv.events.*"
    assert s.match(full) == (KV_EVENTS, {"node": "w3"})
    assert s.match(s.format(REQ_OUT, rid="abc", node="w0")) == (REQ_OUT, {"rid": "abc", "node": "w0"})
    with pytest.raises(ValueError, match="needs its parameter 'node'"):
        s.format(REQ_OUT, rid="abc")
    assert s.match("ei.p2.kv.events.w3") is None
    with pytest.raises(ValueError):
        s.format(KV_EVENTS, node="a.b")
    with pytest.raises(ValueError):
        check_token("")
