"""``BranchSyncSettle``: when a (re)started directory answers ``branch.query`` as settled (``BranchQueryReply.synced``):
once every router it waits for (those ``--routers`` names; without it, those heard beating or republishing) has sent
its ``BranchSyncDone`` for the current ``sync_id``; without ``--routers`` no sooner than ``settle_s`` after the
``branch.sync``; ``max_s`` after the ``branch.sync`` at the latest; never before the ``branch.sync`` went out. Before: settled after ``settle_s`` with no
republished start read, so a router stalled that long was taken as having nothing to republish."""

from __future__ import annotations

import pytest

from services.kvdirectory.settle import SETTLE_MAX_S, SYNC_RESEND_S, UNNAMED_MAX, BranchSyncSettle


def test_a_stalled_router_holds_it_unsettled_past_settle_s_until_its_marker():
    s = BranchSyncSettle(3.0, max_s=60.0)
    s.sent(100.0, ts=5000.0, sync_id="s1")
    assert s.heard("router-a") and s.heard("router-b") and not s.heard("router-a")
    assert s.marker("router-b", "s1", 0)
    assert s.missing() == ["router-a"]
    assert not s.synced(103.0) and not s.synced(140.0)  # before: settled at 103.0 (no republished start read)
    assert s.start(4990.0, 141.0, "router-a")  # A resumes and republishes
    assert not s.synced(141.5)
    assert s.marker("router-a", "s1", 1)
    assert s.synced(141.6) and not s.timed_out and s.done == {"router-a": 1, "router-b": 0}


def test_without_configured_routers_it_settles_no_sooner_than_settle_s():
    s = BranchSyncSettle(3.0)
    assert not s.synced(0.0) and not s.synced(1e9)  # no branch.sync out yet: not settled, however long
    s.sent(100.0, ts=5000.0, sync_id="s1")
    s.heard("router")
    assert s.marker("router", "s1", 5)
    assert not s.synced(102.9)  # a router not heard yet may still beat
    assert s.synced(103.0)
    assert BranchSyncSettle(3.0).synced(1e9) is False


def test_no_router_at_all_settles_at_settle_s():
    s = BranchSyncSettle(3.0)
    s.sent(100.0, ts=5000.0, sync_id="s1")
    assert not s.synced(102.9) and s.synced(103.0)


def test_configured_routers_are_waited_for_unheard_and_settle_it_once_all_answered():
    s = BranchSyncSettle(10.0, max_s=60.0, routers=["router", "router-1"])
    s.sent(0.0, ts=5000.0, sync_id="s1")
    assert s.missing() == ["router", "router-1"]
    assert s.marker("router", "s1", 3)
    assert not s.synced(30.0)  # router-1 never heard (stalled since before the directory started): waited for
    assert s.marker("router-1", "s1", 0)
    assert s.synced(30.1)  # all configured ones answered: no floor
    s2 = BranchSyncSettle(10.0, routers=["router"])
    s2.sent(0.0, ts=5000.0, sync_id="x")
    s2.marker("router", "x", 0)
    assert s2.synced(0.2)


def test_without_configured_routers_a_router_heard_republishing_is_waited_for():
    s = BranchSyncSettle(1.0)
    s.sent(0.0, ts=5000.0, sync_id="s1")
    assert s.start(4000.0, 0.1, "router-x")  # not heard beating: its republish makes it known
    assert not s.start(5000.5, 0.2, "router-y")  # a new branch (stamped after the sync): not republish, not known
    assert not s.synced(5.0) and s.missing() == ["router-x"]
    s.marker("router-x", "s1", 1)
    assert s.synced(5.0) and s.republished == 1 and s.unnamed == set()


def test_with_configured_routers_only_those_are_waited_for_a_forged_heartbeat_holds_nothing_up():
    """A heartbeat with ``instance="router-ghost"`` (no such router) held a directory given ``--routers router``
    unsettled until ``--branch-sync-max-s`` (60 s of 503s for every end of a branch it does not hold): a router
    heard that ``--routers`` does not name is listed (``unnamed``), not waited for."""
    s = BranchSyncSettle(10.0, max_s=60.0, routers=["router"])
    assert not s.heard("router-ghost")  # before the sync too
    s.sent(0.0, ts=5000.0, sync_id="s1")
    assert not s.heard("router-ghost") and not s.resend_due(0.1)  # not waited for: no resend at once for it
    assert s.start(4000.0, 0.2, "router-x")  # a republished start with another src: counted, not waited for
    assert s.missing() == ["router"] and s.unnamed == {"router-ghost", "router-x"}
    assert s.marker("router", "s1", 3)
    assert s.synced(0.3) and not s.timed_out and s.missing() == []  # before: not until 60.0, router-ghost missing
    assert s.done == {"router": 3}


def test_an_unnamed_router_s_marker_is_recorded_not_waited_for_and_the_names_kept_are_bounded():
    s = BranchSyncSettle(10.0, routers=["router", "router-1"])
    s.sent(0.0, ts=5000.0, sync_id="s1")
    assert s.marker("router-9", "s1", 2)  # a router missing from --routers: its republish read, it is not waited for
    assert s.missing() == ["router", "router-1"] and s.done == {"router-9": 2} and s.unnamed == {"router-9"}
    for i in range(3 * UNNAMED_MAX):  # a flood of forged names keeps at most UNNAMED_MAX of them
        s.heard(f"ghost-{i}")
        s.marker(f"ghost-marker-{i}", "s1", 0)
    assert len(s.unnamed) == UNNAMED_MAX and len(s.done) <= UNNAMED_MAX and s.known == {"router", "router-1"}
    s.marker("router", "s1", 0)
    s.marker("router-1", "s1", 0)
    assert s.synced(1.0) and not s.timed_out


def test_a_marker_of_another_sync_changes_nothing():
    s = BranchSyncSettle(1.0, routers=["router"])
    assert not s.marker("router", "s0", 1)  # before the branch.sync
    s.sent(0.0, ts=5000.0, sync_id="s1")
    assert not s.marker("router", "s0", 1)  # an older directory's sync
    assert not s.marker("", "s1", 1) and not s.marker("router", "", 1)
    assert not s.synced(5.0)


def test_settled_max_s_after_the_sync_without_a_router_that_never_answers():
    s = BranchSyncSettle(3.0, max_s=20.0, routers=["dead"])
    s.sent(0.0, ts=5000.0, sync_id="s1")
    assert not s.synced(19.9)
    assert s.synced(20.0) and s.timed_out and s.missing() == ["dead"]
    assert BranchSyncSettle(3.0).max_s == SETTLE_MAX_S == 60.0


def test_settled_is_latched_a_router_heard_later_does_not_unsettle_it():
    s = BranchSyncSettle(1.0)
    s.sent(0.0, ts=5000.0, sync_id="s1")
    assert s.synced(1.0)
    assert not s.heard("router-new")  # started after: holds nothing to republish
    s.start(4000.0, 2.0, "router-late")
    assert s.synced(2.0) and s.missing() == []


def test_the_sync_is_resent_each_resend_s_until_settled():
    s = BranchSyncSettle(1.0, routers=["router"], resend_s=SYNC_RESEND_S)
    assert not s.resend_due(5.0)  # never sent
    s.sent(0.0, ts=5000.0, sync_id="s1")
    assert not s.resend_due(0.5) and s.resend_due(1.0) and not s.resend_due(1.5) and s.resend_due(2.0)
    s.marker("router", "s1", 0)
    assert not s.resend_due(10.0)  # settled


def test_bad_arguments_are_refused():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="settle_s"):
            BranchSyncSettle(bad)
        with pytest.raises(ValueError, match="resend_s"):
            BranchSyncSettle(1.0, resend_s=bad)
    with pytest.raises(ValueError, match="max_s"):
        BranchSyncSettle(5.0, max_s=4.0)
    with pytest.raises(ValueError, match="sync_id"):
        BranchSyncSettle(5.0).sent(0.0, 1.0, "")


def test_a_router_newly_heard_gets_the_sync_at_once():
    """A router beats only once it has subscribed to ``branch.sync``: one heard after the first send (it started
    since) is sent it at once, not up to ``resend_s`` later."""
    s = BranchSyncSettle(0.5)
    assert s.heard("router-early") and not s.resend_due(0.0)  # heard before any send: the first send reaches it
    s.sent(0.0, ts=5000.0, sync_id="s1")
    assert not s.resend_due(0.1)
    assert s.heard("router-a") and s.resend_due(0.2) and not s.resend_due(0.3)
    assert s.resend_due(1.2)
