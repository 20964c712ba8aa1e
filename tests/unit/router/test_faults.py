"""Pure re-dispatch helpers: lookups without unusable nodes, continuation requests, what depends on a node."""

from __future__ import annotations

import numpy as np

from shared.hashing import block_hashes_packed, unpack_tokens
from shared.messages import FetchRange, KvLookupReply, NodePrefix, NodeState

from services.router.faults import continuation, usable_lookup
from services.router.nodes import NodeLoadView
from services.router.policy import RouteRequest


def _reply() -> KvLookupReply:
    return KvLookupReply(
        block_size=4,
        nodes=[NodePrefix(node="a", host_blocks=2, local_blocks=2), NodePrefix(node="b", gpu_blocks=6, local_blocks=6),
               NodePrefix(node="c", host_blocks=4, local_blocks=4)],
        longest_any=8,
        sources=[FetchRange(node="a", start=0, end=2), FetchRange(node="c", start=2, end=4),
                 FetchRange(node="b", start=4, end=6, tier="gpu"), FetchRange(node="d", start=6, end=8)],
    )  # fmt: skip


def test_usable_lookup_keeps_an_answer_whose_nodes_are_all_usable():
    rep = _reply()
    assert usable_lookup(rep, lambda n: True) is rep
    assert usable_lookup(None, lambda n: False) is None


def test_usable_lookup_drops_a_fenced_node_and_keeps_a_contiguous_fetch_plan():
    out = usable_lookup(_reply(), lambda n: n != "c")
    assert out is not None
    assert [p.node for p in out.nodes] == ["a", "b"]
    # cut at c's range (block 2), then extended to b's local prefix (6 blocks, GPU)
    assert [(r.node, r.start, r.end, r.tier) for r in out.sources] == [("a", 0, 2, "host"), ("b", 2, 6, "gpu")]
    assert out.longest_any == 6


def test_usable_lookup_without_sources_counts_local_prefixes_only():
    rep = KvLookupReply(block_size=4, nodes=[NodePrefix(node="a", local_blocks=3), NodePrefix(node="b", local_blocks=5)], longest_any=5)
    out = usable_lookup(rep, lambda n: n == "a")
    assert out is not None and [p.node for p in out.nodes] == ["a"] and out.longest_any == 3 and out.sources == []


def test_continuation_is_prompt_plus_sent_tokens():
    prompt = list(range(10, 19))
    packed = np.asarray(prompt, dtype="<u4").tobytes()
    req = RouteRequest(rid="r1", prompt_tokens=9, block_hashes=block_hashes_packed(packed, 4), max_tokens=5, token_ids=packed, branch_id="b")
    cont = continuation(req, [7, 8], block_size=4, max_prompt_tokens=100)
    assert isinstance(cont, RouteRequest)
    assert cont.rid == "r1" and cont.branch_id == "b" and cont.prompt_tokens == 11 and cont.max_tokens == 3
    assert unpack_tokens(cont.token_ids).tolist() == prompt + [7, 8]
    assert list(cont.block_hashes) == block_hashes_packed(cont.token_ids, 4) and len(cont.block_hashes) == 2
    assert list(cont.block_hashes[:2]) == list(req.block_hashes[:2])  # the prompt's blocks keep their hashes
    too_long = continuation(req, [7, 8], block_size=4, max_prompt_tokens=10)
    assert isinstance(too_long, str) and "max_prompt_tokens=10" in too_long
    unknown = continuation(RouteRequest(rid="r2", prompt_tokens=9, max_tokens=5), [1], block_size=4, max_prompt_tokens=100)
    assert isinstance(unknown, str) and "not known" in unknown


def test_a_request_whose_prefill_finished_depends_on_its_decode_node_only():
    view = NodeLoadView(fence_after=1.0)
    for n, ph in (("p", "prefill"), ("d", "decode"), ("c", "both")):
        view.apply_state(NodeState(node=n, phase=ph), 0.0)  # type: ignore[arg-type]
    view.on_dispatch("r1", "p", "d")
    view.on_dispatch("r2", "p", "d")
    view.on_dispatch("r3", "c", None)
    view.on_first_token("r1")
    view.on_first_token("r3")
    assert view.on_handoff("r1", "d")  # d streamed r1's output: it holds the hand-off
    assert not view.on_handoff("r1", "d") and not view.on_handoff("r2", "p") and not view.on_handoff("r3", "c")
    assert view.requests_on("p") == ["r1", "r2"]
    assert view.requests_depending_on("p") == ["r2"]  # r1's hand-off reached d: it needs d only
    assert view.requests_depending_on("d") == ["r1", "r2"]
    assert view.requests_depending_on("c") == ["r3"]  # collocated: decodes there
    fenced = view.check_fences(5.0)
    assert {f.node: f.rids for f in fenced} == {"c": ("r3",), "d": ("r1", "r2"), "p": ("r2",)}
    assert not view.usable("p", 5.0) and view.usable("unknown", 5.0)


def test_a_first_token_without_the_hand_off_still_depends_on_the_prefill_node():
    """The prefill node published the first token and died before the hand-off (DecodeWork)
    reached the decode node: the request must be re-dispatched when the prefill node is fenced."""
    view = NodeLoadView(fence_after=1.0)
    view.apply_state(NodeState(node="p", phase="prefill"), 0.0)
    view.apply_state(NodeState(node="d", phase="decode"), 4.5)
    view.on_dispatch("r1", "p", "d")
    view.on_first_token("r1")
    assert view.requests_depending_on("p") == ["r1"]
    assert view.requests_depending_on("d") == ["r1"]
    assert {f.node: f.rids for f in view.check_fences(5.0)} == {"p": ("r1",)}
