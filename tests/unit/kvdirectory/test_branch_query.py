"""The directory's answer to ``branch.query`` (``KvDirectory.branch_state``): the state of a branch for a router that
never saw it (another router served it, or it restarted), each state from the transition that makes it, and what
the relayed ``BranchEnd`` / ``BranchToolCall`` then does (``services/kvdirectory/branches.py``)."""

from __future__ import annotations

from services.kvdirectory.core import KvDirectory
from tests.unit.kvdirectory.helpers import BS, H, drained

TTL = 10.0


def _dir() -> KvDirectory:
    d = KvDirectory(BS, branch_ttl_s=TTL, max_tool_hold_s=100.0)
    d.branch_start("b", 0.0)
    d.place("b", "p0", "prefill", H, 1.0)
    drained(d)
    return d


def test_each_state_as_its_transition_leaves_it():
    d = _dir()
    assert d.branch_state("b", 2.0) == "active"
    assert d.branch_state("never", 2.0) == "unknown"
    # silent past its TTL: expired already, before the sweep releases it (the sweep would at once)
    assert d.branch_state("b", 1.0 + TTL) == "expired" and "b" in d.branches.branches
    assert d.expire(1.0 + TTL) == ["b"] and d.branch_state("b", 1.0 + TTL) == "expired"
    assert drained(d) == [("p0", H, [0] * len(H))]  # its counts released by the expiry
    d.branch_start("c", 20.0)
    d.branch_end("c", 21.0)
    assert d.branch_state("c", 21.0) == "ended"
    d.expire(21.0 + TTL)  # an ended id is remembered a TTL after its end
    assert d.branch_state("c", 21.0 + TTL) == "unknown"


def test_a_hold_keeps_it_active_past_its_ttl():
    d = _dir()
    assert d.branch_hold("b", True, 50.0, 2.0) == "held"
    assert d.branch_state("b", 40.0) == "active"  # the hold runs to 52, the branch stays a TTL past it
    assert d.branch_state("b", 62.0) == "expired"


def test_an_evicted_branch_reads_expired():
    d = _dir()
    assert d.branch_evict("b", None) == "evicted"
    assert d.branch_state("b", 2.0) == "expired"


def test_the_relayed_end_of_an_active_or_expired_branch_releases_its_counts():
    """What the router does on ``active`` / ``expired``: it publishes a ``BranchEnd``; the directory ends the branch
    (counts released) and answers ``ended`` to the next router that asks."""
    d = _dir()
    assert d.branch_end("b", 2.0) == "ended"
    assert drained(d) == [("p0", H, [0] * len(H))]
    assert d.branch_state("b", 2.0) == "ended" and d.counters["branch.ended"] == 1
    e = _dir()
    e.expire(1.0 + TTL)
    drained(e)
    assert e.branch_end("b", 12.0) == "ended" and e.branch_state("b", 12.0) == "ended"
    assert e.counters["branch.ended_after_expiry"] == 1


def test_the_relayed_tool_call_of_an_expired_branch_resumes_it():
    d = _dir()
    d.expire(1.0 + TTL)
    assert d.branch_hold("b", True, 30.0, 12.0) == "held"
    assert d.branch_state("b", 12.0) == "active" and d.counters["branch.resumed"] == 1


def test_the_query_changes_nothing():
    d = _dir()
    before = (dict(d.branches.branches), dict(d.branches.ended), dict(d.branches.expired), dict(d.branches.counters))
    for bid in ("b", "never"):
        d.branch_state(bid, 1.0 + TTL)
    assert before == (dict(d.branches.branches), dict(d.branches.ended), dict(d.branches.expired), dict(d.branches.counters))
    assert drained(d) == []
