"""Branch table transitions."""

from __future__ import annotations

import pytest

from shared.messages import BranchEnd, BranchStart, BranchToolCall

from services.router.branches import BranchAlreadyEnded, BranchCycle, BranchEnded, BranchError, BranchTable, UnknownBranch


def _evicted(t: BranchTable) -> list[str]:
    """The ids :meth:`BranchTable.take_evicted` hands out (without their rids)."""
    return [bid for bid, _rid in t.take_evicted()]


def test_start_once_then_end():
    t = BranchTable()
    s = t.observe("b1", 1.0, kind="fork", parent="b0", agent_id="a")
    assert s == BranchStart(branch_id="b1", kind="fork", parent_branch_id="b0", agent_id="a", ts=1.0)
    assert t.observe("b1", 2.0, kind="subagent") is None
    assert t.active_count == 1
    assert t.end("b1", 3.0) == BranchEnd(branch_id="b1", ts=3.0)
    assert t.active_count == 0 and t.ended_count == 1


def test_errors_with_http_status():
    t = BranchTable()
    with pytest.raises(UnknownBranch) as e:
        t.end("nope", 0.0)
    assert e.value.status == 404
    with pytest.raises(UnknownBranch):
        t.check_end("nope")
    t.observe("b", 0.0)
    t.check_end("b")  # changes nothing: the router publishes the BranchEnd, then ends it here
    assert t.is_active("b")
    t.end("b", 0.0)
    with pytest.raises(BranchAlreadyEnded):
        t.check_end("b")
    with pytest.raises(BranchAlreadyEnded) as e2:
        t.end("b", 0.0)
    assert e2.value.status == 410  # the path names the branch, and it is gone
    with pytest.raises(BranchAlreadyEnded) as e4:
        t.tool_call("b", 0.0)
    assert e4.value.status == 410
    with pytest.raises(BranchEnded) as e3:
        t.observe("b", 0.0)
    assert (e3.value.status, e3.value.param) == (400, "X-Branch-Id") and "X-Branch-Id 'b'" in e3.value.reason


def test_no_branch_refusal_is_a_status_the_openai_sdk_retries():
    """The OpenAI Python SDK (``openai._base_client._should_retry``) retries 408, 409, 429 and 5xx (twice, with
    backoff): an ended branch answered 409 cost a harness 3 requests and a second or more for the same answer, since
    the id stays ended while remembered. Every refusal of the table is one a retry gets again: none may be one of
    those statuses."""
    sdk_retries = {408, 409, 429} | set(range(500, 600))
    t = BranchTable()
    t.observe("b", 0.0)
    t.end("b", 0.0)
    t.observe("x", 0.0, kind="fork", parent="y")
    refusals = []
    for op in (lambda: t.end("b", 0.0), lambda: t.tool_call("b", 0.0), lambda: t.observe("b", 0.0),
               lambda: t.end("never", 0.0), lambda: t.tool_call("never", 0.0),
               lambda: t.observe("y", 0.0, kind="fork", parent="x")):
        try:
            op()
        except BranchError as e:
            refusals.append(e.status)
    assert len(refusals) == 6 and not sdk_retries & set(refusals), refusals


def test_ended_ids_are_bounded():
    t = BranchTable(max_ended=2)
    for b in ("a", "b", "c"):
        t.observe(b, 0.0)
        t.end(b, 0.0)
    assert t.ended_count == 2
    with pytest.raises(UnknownBranch):  # "a" was forgotten
        t.end("a", 0.0)
    assert t.observe("a", 1.0) is not None


def test_idle_branches_expire_and_a_later_request_is_a_resume():
    """Issue 21: the router's table expires idle branches as the directory does; a request of an
    expired branch is accepted (a resume, counted) and re-announced with its remembered kind."""
    t = BranchTable(ttl_s=100.0)
    t.observe("main", 0.0, agent_id="a")
    t.done("main")
    t.observe("sub", 10.0, kind="subagent", parent="main", agent_id="a")
    t.observe("sub", 90.0)  # the sub-agent's activity keeps its waiting parent alive
    t.done("sub")
    t.done("sub")
    assert t.expire(150.0) == [] and t.is_active("main")
    assert sorted(t.expire(190.0)) == ["main", "sub"] and t.active_count == 0 and t.expired == 2
    s = t.observe("sub", 5000.0, kind="main")  # back after a long pause: accepted, not 409
    assert s == BranchStart(branch_id="sub", kind="subagent", parent_branch_id="main", agent_id="a", ts=5000.0)
    assert t.resumed == 1 and t.is_active("sub")
    assert t.end("main", 5001.0) == BranchEnd(branch_id="main", ts=5001.0)  # an expired branch can be ended
    with pytest.raises(BranchEnded):
        t.observe("main", 5002.0)


def test_a_branch_with_a_request_in_flight_never_expires_and_its_silence_starts_when_the_request_ends():
    """A request streamed (or parked) longer than the TTL: before, the fence loop's expire dropped its branch (its
    placement, the active gauge; its next request a resume) while it ran. Now it and its waiting parent are kept, as
    the --max-active-branches cap keeps it; once done, the branch expires a TTL after the request ended."""
    t = BranchTable(ttl_s=100.0)
    t.observe("main", 0.0)
    t.done("main", 1.0)
    t.observe("sub", 2.0, kind="subagent", parent="main")  # streams for 1,000 s
    t.observe("idle", 2.0)
    t.done("idle", 3.0)
    assert t.expire(150.0) == ["idle"] and t.is_active("sub") and t.is_active("main")
    assert t.expire(1000.0) == [] and t.is_active("sub") and t.is_active("main")
    t.done("sub", 1002.0)
    assert t.expire(1101.0) == [] and t.is_active("sub")
    assert sorted(t.expire(1102.0)) == ["main", "sub"] and t.in_flight_count == 0
    t.observe("sub", 1200.0)  # a resume, with one request in flight again
    assert t.resumed == 1 and t.in_flight_count == 1
    t.done("sub")  # no now: the silence still counts from the request's start
    assert t.expire(1300.0) == ["sub"]


def test_a_tool_call_hint_keeps_the_branch_until_it_returns():
    t = BranchTable(ttl_s=100.0, max_hold_s=1000.0)
    t.observe("b", 0.0)
    t.done("b")  # the model's answer asked for a tool
    ev = t.tool_call("b", 50.0, expected_s=400.0)
    assert ev == BranchToolCall(branch_id="b", outstanding=True, expected_s=400.0, ts=50.0)
    assert t.expire(300.0) == [] and t.is_active("b")
    assert t.observe("b", 460.0) is None  # the tool returned: the hold ends, the TTL runs again
    t.done("b")
    assert t.expire(561.0) == ["b"]
    with pytest.raises(UnknownBranch):
        t.tool_call("nope", 600.0)
    with pytest.raises(ValueError):
        t.tool_call("b", 600.0, expected_s=-1.0)


def test_republish_gives_a_restarted_directory_the_active_branches_and_latest_placements():
    from shared.messages import BranchStart, RoutePlaced

    t = BranchTable()
    t.observe("root", 1.0)
    t.observe("fork", 2.0, kind="fork", parent="root")
    t.note_placed(RoutePlaced(rid="r1", branch_id="root", node="p0", phase="prefill", block_hashes=[1]))
    t.note_placed(RoutePlaced(rid="r2", branch_id="root", node="p1", phase="prefill", block_hashes=[1, 2]))  # a newer request
    t.note_placed(RoutePlaced(rid="r2", branch_id="root", node="d0", phase="decode", block_hashes=[1, 2]))  # its decode binding
    t.note_placed(RoutePlaced(rid="x", branch_id="unknown", node="p0", phase="prefill"))  # not active: ignored
    out = t.republish()
    assert [type(e).__name__ for e in out] == ["BranchStart", "RoutePlaced", "RoutePlaced", "BranchStart"]
    assert isinstance(out[0], BranchStart) and out[0].branch_id == "root"
    assert [(p.rid, p.node, p.phase) for p in out[1:3]] == [("r2", "p1", "prefill"), ("r2", "d0", "decode")]
    assert out[3].branch_id == "fork" and out[3].kind == "fork" and out[3].parent_branch_id == "root"
    t.end("fork", 3.0)
    assert [e.branch_id for e in t.republish() if isinstance(e, BranchStart)] == ["root"]


def test_the_ttl_runs_on_the_callers_clock_and_messages_carry_the_ts_given():
    """The live router passes its monotonic reading as ``now`` (TTL, holds) and the wall-based
    cluster time as ``ts``: every message, a republished BranchStart too, carries ``ts``."""
    t = BranchTable(ttl_s=100.0)
    start = t.observe("b", 5.0, ts=1_000_000.0)
    assert start is not None and start.ts == 1_000_000.0
    assert t.observe("b", 90.0, ts=2_000_000.0) is None  # within the TTL on ``now``, whatever ``ts`` says
    assert t.tool_call("b", 95.0, expected_s=10.0, ts=2_000_001.0).ts == 2_000_001.0
    assert t.expire(150.0) == []  # 90 + 100 > 150
    [again] = [x for x in t.republish() if isinstance(x, BranchStart)]
    assert again.ts == 1_000_000.0
    assert t.end("b", 160.0, ts=2_000_002.0).ts == 2_000_002.0


def test_the_active_table_is_capped_keeping_branches_with_a_request_in_flight():
    """A client minting a new branch id per request: the table stays at ``max_active``, the least
    recently active idle branch goes first (expired, resumable, handed out for the directory), and
    a branch with a request in flight is never evicted however old."""
    t = BranchTable(max_active=3, ttl_s=1e9)  # the cap alone (no TTL expiry in this test)
    t.observe("busy", 0.0)  # its request runs on (no done)
    t.observe("idle", 1.0)
    t.done("idle")
    for i in range(1000):
        t.observe(f"u{i}", 2.0 + i)
        t.done(f"u{i}")
        assert t.active_count <= 3
    assert t.is_active("busy") and not t.is_active("idle")
    assert t.evicted == 999 and t.in_flight_count == 1
    out = _evicted(t)
    assert out[:2] == ["idle", "u0"] and len(out) == 999 and _evicted(t) == []
    assert t.observe("idle", 2000.0) is not None and t.resumed == 1  # a resume: re-announced
    assert _evicted(t) == ["u998"]
    t.done("busy")
    t.observe("n", 2001.0)
    assert _evicted(t) == ["busy"]  # idle now: the least recently active
    with pytest.raises(ValueError):
        BranchTable(max_active=0)


def test_a_cap_full_of_requests_in_flight_holds_them_all():
    t = BranchTable(max_active=1)
    t.observe("a", 0.0)
    t.observe("b", 1.0)
    assert t.active_count == 2 and _evicted(t) == []
    t.done("a")
    t.done("a")  # a second done is no underflow
    t.observe("c", 2.0)
    assert _evicted(t) == ["a"] and t.active_count == 2  # b still running
    t.done("b")
    t.done("c")
    t.observe("d", 3.0)
    assert sorted(_evicted(t)) == ["b", "c"] and t.active_count == 1


def test_the_cap_evicts_a_branch_waiting_for_a_tool_only_when_no_other_idle_branch_is_left():
    """A tool-call hold keeps a branch's KV for the agent that waits on the tool (as the TTL keeps
    it): the cap evicts idle branches without a hold first. Before, the held branch, idle the
    longest, was the least recently active and went first: the directory released its counts while
    its agent waited."""
    t = BranchTable(max_active=2, ttl_s=1e9)
    t.observe("agent", 0.0)
    t.done("agent")
    t.tool_call("agent", 1.0, expected_s=600.0)  # waits up to 600 s for its tool
    t.observe("u0", 2.0)
    t.done("u0")
    t.observe("u1", 3.0)  # past the cap: u0 (no hold) goes, not the held agent
    assert _evicted(t) == ["u0"] and t.is_active("agent")
    t.done("u1")
    for i in range(2, 50):  # a flood of minted ids: the held branch stays, each passes once
        t.observe(f"u{i}", 2.0 + i)
        t.done(f"u{i}")
        assert _evicted(t) == [f"u{i - 1}"]
    assert t.is_active("agent") and t.active_count == 2
    t.observe("v", 700.0)  # the hold is over (1 + 600 s): an idle branch like the others
    assert _evicted(t) == ["agent"]


def test_a_tool_call_never_evicts_its_own_branch():
    """A tool call resuming an evicted branch while every other active branch has a request in
    flight: the cap is held over (as for a table full of requests), the branch the call is for stays.
    Before, the resumed branch was the only idle one and was evicted by its own tool call: the
    directory got the hold, then ``BranchEnd(expired=True)``, which dropped it, while the client was
    told its hold was kept."""
    t = BranchTable(max_active=2, ttl_s=1e9)
    t.observe("x", 0.0)
    t.done("x")
    t.observe("a", 1.0)
    t.observe("b", 2.0)  # a and b run on: x (idle) is evicted
    assert _evicted(t) == ["x"]
    t.tool_call("x", 3.0, expected_s=60.0)  # resumed by the hint
    assert _evicted(t) == [] and t.is_active("x") and t.resumed == 1


def test_an_evicted_branch_is_handed_out_with_its_latest_placed_rid():
    """The shell publishes ``BranchEnd(expired=True, rid=...)``: the directory ignores an eviction
    whose rid is not its latest placement (another router placed the branch since). A branch never
    placed here goes with ``""``."""
    from shared.messages import RoutePlaced

    t = BranchTable(max_active=1, ttl_s=1e9)
    t.observe("a", 0.0)
    t.note_placed(RoutePlaced(rid="r1", branch_id="a", node="p0", phase="prefill"))
    t.note_placed(RoutePlaced(rid="r2", branch_id="a", node="p0", phase="prefill"))
    t.done("a")
    t.observe("b", 1.0)
    t.done("b")
    t.observe("c", 2.0)
    assert t.take_evicted() == [("a", "r2"), ("b", "")]


def test_a_new_branch_whose_parent_is_unknown_or_ended_is_counted_once_and_queued():
    """A fork or sub-agent whose parent this table never saw, or ended, is still started (the parent may be
    another router's) but counted by state and queued once for the shell's warning; a known, active or
    expired parent is not; a resume or a later request of the branch is not counted again."""
    t = BranchTable(ttl_s=10.0)
    t.observe("m", 0.0)
    assert t.observe("f", 1.0, kind="fork", parent="m") is not None
    assert t.observe("s", 1.0, kind="subagent", parent="ghost") is not None
    t.observe("s", 2.0, kind="subagent", parent="ghost")  # a later request: ignored
    t.end("m", 3.0)
    t.observe("g", 4.0, kind="fork", parent="m")
    assert t.parents_missing == {"unknown": 1, "ended": 1}
    assert t.take_parents_missing() == [("s", "ghost", "unknown"), ("g", "m", "ended")]
    assert t.take_parents_missing() == []
    for b in ("f", "s", "s", "g"):
        t.done(b)
    t.expire(100.0)  # every branch expires
    assert t.parent_state("f") == "expired" and t.parent_state("m") == "ended" and t.parent_state("zz") == "unknown"
    t.observe("s", 101.0)  # a resume of the orphan: not counted again
    t.observe("h", 101.0, kind="fork", parent="f")  # an expired parent is known (resumable)
    assert t.parents_missing == {"unknown": 1, "ended": 1} and t.take_parents_missing() == []
    assert t.parent_state("s") == "active"


def test_a_new_branch_whose_parents_lead_back_to_it_is_refused_with_a_400_naming_the_parent_header():
    """a (parent b, unknown yet) then b (parent a): a→b→a. Before, it was served silently, each branch keeping the
    other alive; now the new branch is refused and not started: a 400 naming X-Parent-Branch-Id, as a self-parent is
    at the header parser (a 409, as it first was, the OpenAI SDKs retry 3 times for the same answer). A parent chain
    that ends (unknown, or no parent) is served."""
    t = BranchTable(ttl_s=10.0)
    t.observe("a", 0.0, kind="fork", parent="b")
    with pytest.raises(BranchCycle, match=r"cycle of parents \('b' -> 'a' -> 'b'\)") as e:
        t.observe("b", 1.0, kind="subagent", parent="a")
    assert (e.value.status, e.value.param) == (400, "X-Parent-Branch-Id") and not t.is_active("b")
    assert BranchEnded("x").param == "X-Branch-Id"
    t.observe("c", 1.0, kind="fork", parent="a")  # c → a → b (unknown): no cycle
    with pytest.raises(BranchCycle):
        t.observe("b", 2.0, kind="fork", parent="c")  # b → c → a → b
    t.done("a")
    t.done("c")
    assert sorted(t.expire(100.0)) == ["a", "c"]  # expired parents are still followed (they are resumable)
    with pytest.raises(BranchCycle):
        t.observe("b", 101.0, kind="fork", parent="c")
    assert t.observe("b", 102.0) is not None  # a main branch b: no parent, served
    assert t.parents_missing == {"unknown": 1, "ended": 0}  # a's parent b; the refused ones counted nothing


def test_hold_left_is_the_hold_the_branch_holds():
    """What the tool-call endpoint echoes: a release holds 0 (``{"outstanding": false, "expected_s": 30}`` echoed 30),
    and a shorter hint after a longer one leaves the longer one running (its new, shorter span was echoed)."""
    t = BranchTable(max_hold_s=14400.0)
    t.observe("b", 1000.0)
    t.tool_call("b", 1000.0, expected_s=1e12)
    assert t.hold_left("b", 1000.0) == 14400.0
    t.tool_call("b", 1000.5, expected_s=100.0)
    assert t.hold_left("b", 1000.5) == 14399.5
    t.tool_call("b", 1001.0, outstanding=False, expected_s=30.0)
    assert t.hold_left("b", 1001.0) == 0.0 and t.hold_left("nope", 1001.0) == 0.0
    t.tool_call("b", 1002.0, expected_s=120.0)
    assert t.hold_left("b", 1002.0) == 120.0 and t.hold_left("b", 1200.0) == 0.0


def test_the_hold_span_is_the_hold_a_tool_call_gets():
    """What the tool-call endpoint echoes: the hold the branch got, capped at max_hold_s as the directory caps it
    (1e12 was echoed back as asked)."""
    t = BranchTable(max_hold_s=100.0)
    assert [t.hold_span(x) for x in (30.0, 100.0, 1e12, 0.0)] == [30.0, 100.0, 100.0, 100.0]


def test_at_the_cap_a_sub_agent_in_flight_keeps_its_parent_past_the_ttl() -> None:
    # the cap's eviction moved the new sub-agent after its parent (same last_seen): expire met the idle parent first
    # and expired it while the sub-agent's request still ran
    t = BranchTable(ttl_s=100.0, max_active=2)
    t.observe("x", 0.0)
    t.done("x", 0.5)  # idle: the cap's victim
    t.observe("P", 1.0)
    t.done("P", 1.5)  # the main agent, answered, waits for its sub-agent
    t.observe("C", 2.0, kind="subagent", parent="P")  # in flight for long
    assert [bid for bid, _ in t.take_evicted()] == ["x"]
    assert t.expire(102.0) == []
    assert t.is_active("P") and t.is_active("C")
    t.done("C", 150.0)
    assert t.expire(249.0) == [] and sorted(t.expire(251.0)) == ["C", "P"]


def test_expire_ends_when_the_ttl_is_below_the_clocks_float_step() -> None:
    # now + ttl_s == now: a branch kept (in flight, or held) and moved to the end came round again for ever
    import subprocess
    import sys

    code = ("from services.router.branches import BranchTable\n"
            "t = BranchTable(ttl_s=1e-12)\n"
            "t.observe('a', 1e5)\n"
            "t.observe('b', 1e5)\n"
            "t.done('b', 1e5)\n"
            "t.tool_call('b', 1e5)\n"
            "print(t.expire(1e5 + 1), t.is_active('a'), t.is_active('b'))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True).stdout
    except subprocess.TimeoutExpired:
        raise AssertionError("expire() did not return") from None
    assert out.strip() == "[] True True"


def test_the_verdict_on_a_branch_the_table_never_saw_follows_the_directory():
    """``branch.query``'s answer → what the router does with an end or tool call of an id its table does not hold:
    relay it (active, expired), answer it ended (ended), 404 (unknown), 503 (no answer: never a 404 for "cannot tell")."""
    from services.router.branches import unseen_verdict

    assert [unseen_verdict(s) for s in ("active", "expired", "ended", "unknown", None)] == [
        "relay", "relay", "ended", "unknown", "unanswered"]  # fmt: skip
    # a directory not settled since its restart (BranchQueryReply.synced false): its `unknown` is no answer (503)
    assert [unseen_verdict(s, False) for s in ("active", "expired", "ended", "unknown", None)] == [
        "relay", "relay", "ended", "unsynced", "unanswered"]  # fmt: skip


def test_a_tool_call_another_router_relayed_holds_the_branch_this_table_holds():
    """``heard_tool_call``: the router that served the branch holds it as its own tool call would (its cap then
    passes it over, its TTL keeps it), resumes an expired one as the directory does, and leaves alone an id it holds
    ended or never saw (it lacks the kind and parents to take it in)."""
    t = BranchTable(ttl_s=10.0, max_hold_s=100.0, max_active=2)
    t.observe("served", 0.0)
    t.done("served", 0.0)
    assert t.heard_tool_call("served", 1.0, expected_s=50.0)
    assert t.hold_left("served", 1.0) == 50.0
    t.observe("b", 2.0)
    t.done("b", 2.0)
    t.observe("c", 3.0)  # past the cap of 2: the idle `b` goes, not the held `served` (older)
    t.done("c", 3.0)
    assert _evicted(t) == ["b"] and t.is_active("served")
    assert t.expire(40.0) == ["c"] and t.is_active("served")  # held past its TTL
    assert t.heard_tool_call("served", 41.0, outstanding=False) and t.hold_left("served", 41.0) == 0.0
    assert t.expire(52.0) == ["served"]
    assert t.heard_tool_call("served", 53.0, expected_s=5.0) and t.is_active("served") and t.resumed == 1  # resumed
    t.end("served", 54.0)
    assert not t.heard_tool_call("served", 55.0) and not t.heard_tool_call("never", 55.0)
    assert not t.is_active("never") and t.resumed == 1
    assert not t.heard_tool_call("c", 56.0, expected_s=float("inf"))  # a bad hint changes nothing
    assert not t.is_active("c")


def test_an_end_relayed_for_an_unseen_branch_is_remembered_ended():
    t = BranchTable(max_ended=2)
    assert t.end_unseen("elsewhere", 1.0, ts=5.0) == BranchEnd(branch_id="elsewhere", ts=5.0)
    with pytest.raises(BranchAlreadyEnded):
        t.check_end("elsewhere")  # a repeated end answers `already`
    with pytest.raises(BranchEnded):
        t.observe("elsewhere", 2.0)  # a request on it is refused, as on an end of its own
    with pytest.raises(BranchAlreadyEnded):
        t.end_unseen("elsewhere", 2.0)  # a second relayed end at once: `already`
    # a request of it came here while the directory was asked: ended here too
    t.observe("raced", 3.0)
    t.end_unseen("raced", 4.0)
    assert not t.is_active("raced") and t.active_count == 0 and t.ended_count == 2
    t.end_unseen("third", 5.0)  # at most max_ended remembered, oldest first out
    assert t.ended_count == 2
    with pytest.raises(UnknownBranch):
        t.check_end("elsewhere")
