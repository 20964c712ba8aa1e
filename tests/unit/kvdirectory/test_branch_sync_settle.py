"""``BranchSyncSettle``: when a (re)started directory answers ``branch.query`` as settled (``BranchQueryReply.synced``):
``settle_s`` after its ``branch.sync`` and after the last republished ``BranchStart`` (one stamped before the
``branch.sync``), ``max_s`` after the ``branch.sync`` at the latest, never before the ``branch.sync`` went out."""

from __future__ import annotations

import pytest

from services.kvdirectory.settle import SETTLE_MAX_S, BranchSyncSettle


def test_settled_a_quiet_settle_s_after_the_sync():
    s = BranchSyncSettle(3.0)
    assert not s.synced(0.0) and not s.synced(1e9)  # no branch.sync out yet: not settled, however long
    s.sent(100.0, ts=5000.0)
    assert not s.synced(100.0) and not s.synced(102.9)
    assert s.synced(103.0)


def test_each_republished_start_keeps_it_unsettled_a_settle_s_longer():
    s = BranchSyncSettle(3.0)
    s.sent(100.0, ts=5000.0)
    assert s.start(4990.0, 102.0)  # started before the branch.sync: a router's republish
    assert not s.start(5000.5, 102.5)  # a new branch (stamped after the sync): not republish, changes nothing
    assert not s.synced(104.0) and s.synced(105.0)
    assert s.start(4000.0, 106.0) and not s.synced(108.9) and s.synced(109.0)
    assert s.republished == 2


def test_settled_max_s_after_the_sync_whatever_it_reads():
    """A router whose clock runs behind stamps its new branches before the sync: they look republished for ever."""
    s = BranchSyncSettle(3.0, max_s=20.0)
    s.sent(0.0, ts=5000.0)
    t = 0.0
    while t < 20.0:
        s.start(4999.0, t)
        assert not s.synced(t)
        t += 0.5
    assert s.synced(20.0)
    assert BranchSyncSettle(3.0).max_s == SETTLE_MAX_S == 120.0


def test_a_start_before_the_sync_went_out_is_not_counted():
    s = BranchSyncSettle(1.0)
    assert not s.start(10.0, 0.0) and s.republished == 0


def test_bad_periods_are_refused():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="settle_s"):
            BranchSyncSettle(bad)
    with pytest.raises(ValueError, match="max_s"):
        BranchSyncSettle(5.0, max_s=4.0)
