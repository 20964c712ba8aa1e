"""OwnerLeases (services/worker/owners.py): queries grouped per owning router, and a router taken
for gone only after ``gone_after_s`` of consecutive no-responders answers."""

from __future__ import annotations

import pytest

from services.worker.owners import MAX_RIDS_PER_QUERY, OwnerLeases


def test_queries_group_by_router_in_order_and_split_long_lists():
    held = [("a", "router-1", 0), ("b", "router", 2), ("c", "router-1", 1)]
    assert OwnerLeases.queries(held) == [("router", ["b"], [2]), ("router-1", ["a", "c"], [0, 1])]
    many = [(f"r{i}", "router", i % 3) for i in range(MAX_RIDS_PER_QUERY + 5)]
    qs = OwnerLeases.queries(many)
    assert [len(q[1]) for q in qs] == [MAX_RIDS_PER_QUERY, 5]
    assert [r for q in qs for r in q[1]] == [r for r, _, _ in many] and [a for q in qs for a in q[2]] == [a for _, _, a in many]
    assert OwnerLeases.queries([]) == []


def test_gone_only_after_the_grace_and_an_answer_resets_the_streak():
    leases = OwnerLeases(gone_after_s=5.0)
    assert not leases.no_responders("router", 100.0)
    assert not leases.no_responders("router", 104.9)
    leases.answered("router")  # it answered (e.g. re-subscribed after a NATS restart): streak over
    assert not leases.no_responders("router", 105.0)
    assert not leases.no_responders("router", 109.0)
    assert leases.no_responders("router", 110.0)  # 5 s of silence since 105
    leases.forget([])  # its requests dropped, it owns nothing here: the streak ends
    assert leases.silent() == {}  # a router that comes back and gets new work starts afresh
    assert not leases.no_responders("router", 111.0)


def test_a_gone_router_is_gone_for_every_query_of_the_pass_until_it_answers():
    """A node holding more than MAX_RIDS_PER_QUERY requests of a dead router asks in several
    queries per check: every one of them is judged gone, not only the first (before, the verdict
    ended the streak, the next query started a new one, and the rest of the router's requests
    waited another gone_after_s each, 4096 at a time)."""
    leases = OwnerLeases(gone_after_s=5.0)
    assert not leases.no_responders("router", 100.0)
    assert leases.no_responders("router", 105.0)  # the pass's first query
    assert leases.no_responders("router", 105.01)  # its second query, same pass
    assert leases.no_responders("router", 107.0)  # new work of the dead router (a late hand-off): dropped at once
    leases.answered("router")  # it came back
    assert not leases.no_responders("router", 108.0)


def test_streaks_are_per_router_and_forgotten_when_it_owns_nothing_here():
    leases = OwnerLeases(gone_after_s=1.0)
    leases.no_responders("router", 0.0)
    leases.no_responders("router-1", 0.5)
    leases.forget(["router-1"])
    assert leases.silent() == {"router-1": 0.5}
    assert not leases.no_responders("router", 1.2)  # its streak was forgotten: starts again at 1.2
    assert leases.no_responders("router-1", 1.5)
    assert OwnerLeases(0.0).no_responders("x", 3.0)  # no grace: the first no-responders decides
    with pytest.raises(ValueError):
        OwnerLeases(-1.0)


def test_each_dropped_request_is_one_warning_and_a_mass_drop_one_summary_more():
    """A stream lost with its router leaves its rid, router and output tokens in the worker's log, one warning a
    request up to ``OWNER_DROP_LOG_EACH`` of one check; the rest of a router's thousands of streams is one summary
    line (their count and output tokens, the first ``OWNER_DROP_LOG_RIDS`` ids), not thousands of lines."""
    import structlog
    from structlog.testing import capture_logs

    from services.worker.service import OWNER_DROP_LOG_EACH, OWNER_DROP_LOG_RIDS, WorkerService

    holder = type("H", (), {"log": structlog.get_logger("worker")})()
    dropped = [(f"rid-{i}", 1, i) for i in range(OWNER_DROP_LOG_EACH + 50)]
    with capture_logs() as logs:
        WorkerService._log_owner_drops(holder, "router-1", "router_gone", "owning router router-1 is gone", dropped[:2])  # type: ignore[arg-type]
        WorkerService._log_owner_drops(holder, "router-1", "not_in_flight", "no longer in flight", [])  # type: ignore[arg-type]
    assert [(x["log_level"], x["rid"], x["router"], x["attempt"], x["tokens_done"], x["cause"]) for x in logs] == [
        ("warning", "rid-0", "router-1", 1, 0, "router_gone"), ("warning", "rid-1", "router-1", 1, 1, "router_gone")]
    with capture_logs() as logs:
        WorkerService._log_owner_drops(holder, "router", "not_in_flight", "no longer in flight", dropped)  # type: ignore[arg-type]
    each, (summary,) = logs[:-1], logs[-1:]
    assert [x["rid"] for x in each] == [f"rid-{i}" for i in range(OWNER_DROP_LOG_EACH)]
    assert all(x["log_level"] == "warning" and x["cause"] == "not_in_flight" for x in logs), logs
    assert summary["requests"] == 50 and summary["router"] == "router" and "rid" not in summary, summary
    assert summary["rids"] == [f"rid-{i}" for i in range(OWNER_DROP_LOG_EACH, OWNER_DROP_LOG_EACH + OWNER_DROP_LOG_RIDS)]
    assert summary["tokens_done"] == sum(range(OWNER_DROP_LOG_EACH, OWNER_DROP_LOG_EACH + 50)), summary
