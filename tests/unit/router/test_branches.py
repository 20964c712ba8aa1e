"""Branch table transitions."""

from __future__ import annotations

import pytest

from shared.messages import BranchEnd, BranchStart

from services.router.branches import BranchAlreadyEnded, BranchEnded, BranchTable, UnknownBranch


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
    t.observe("b", 0.0)
    t.end("b", 0.0)
    with pytest.raises(BranchAlreadyEnded) as e2:
        t.end("b", 0.0)
    assert e2.value.status == 409
    with pytest.raises(BranchEnded) as e3:
        t.observe("b", 0.0)
    assert e3.value.status == 409


def test_ended_ids_are_bounded():
    t = BranchTable(max_ended=2)
    for b in ("a", "b", "c"):
        t.observe(b, 0.0)
        t.end(b, 0.0)
    assert t.ended_count == 2
    with pytest.raises(UnknownBranch):  # "a" was forgotten
        t.end("a", 0.0)
    assert t.observe("a", 1.0) is not None
