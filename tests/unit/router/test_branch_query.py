"""The router's ``branch.query`` (``RouterService._unseen_branch``): the KV directory's answer about a branch the
router's table does not hold, turned into what the end or tool call does; no answer (a timeout, no responders, a
closed connection) is ``unanswered`` (a 503 the SDK retries), counted and logged, never an exception or a 404."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

from services.router.service import BRANCH_QUERY_TIMEOUT_S, RouterService
from shared import messages as m
from shared.bus import BusError, NoResponders
from shared.subjects import BRANCH_QUERY


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))


class _Bus:
    """Answers ``branch.query`` with ``answer`` (an exception is raised, as ``Bus.request`` raises it)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.asked: list[tuple[Any, m.BranchQuery, float]] = []

    async def request(self, subject: Any, msg: m.BranchQuery, *, timeout: float, **_kw: Any) -> Any:
        self.asked.append((subject, msg, timeout))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def _ask(answer: Any, branch_id: str = "b-1") -> tuple[str, Any]:
    shell = SimpleNamespace(bus=_Bus(answer), counters=Counter(), log=_Log())
    verdict = asyncio.run(RouterService._unseen_branch(shell, branch_id))  # type: ignore[arg-type]
    return verdict, shell


def test_each_answer_of_the_directory_gives_its_verdict():
    for state, verdict in (("active", "relay"), ("expired", "relay"), ("ended", "ended"), ("unknown", "unknown")):
        got, shell = _ask(m.BranchQueryReply(branch_id="b-1", state=state))  # type: ignore[arg-type]
        assert got == verdict, state
        ((subject, msg, timeout),) = shell.bus.asked
        assert subject is BRANCH_QUERY and msg == m.BranchQuery(branch_id="b-1") and timeout == BRANCH_QUERY_TIMEOUT_S == 2.0
        assert shell.counters == Counter({f"branch_queries.{state}": 1}) and not shell.log.lines


def test_no_answer_is_unanswered_counted_and_logged():
    for err in (BusError("no reply on ei.p0.branch.query: TimeoutError"), NoResponders("no reply on ei.p0.branch.query: NoRespondersError")):
        got, shell = _ask(err)
        assert got == "unanswered"
        assert shell.counters == Counter({"branch_queries_failed": 1})
        ((event, kw),) = shell.log.lines
        assert event.startswith("branch.query failed") and kw["branch"] == "b-1" and kw["timeout_s"] == 2.0 and str(err) == kw["error"]


def test_an_answer_about_another_branch_answers_nothing_and_is_counted_failed_and_logged():
    """Counted ``branch_queries_failed`` too (the README's "no answer"; before, only ``branch_queries.mismatched``)
    and logged (before, not)."""
    got, shell = _ask(m.BranchQueryReply(branch_id="other", state="active"))
    assert got == "unanswered"
    assert shell.counters == Counter({"branch_queries.mismatched": 1, "branch_queries_failed": 1})
    ((event, kw),) = shell.log.lines
    assert "another branch" in event and kw["branch"] == "b-1" and kw["answered"] == "other" and kw["state"] == "active"


def test_unknown_from_a_directory_not_settled_since_its_restart_is_unsynced():
    """``BranchQueryReply.synced`` false: the directory may not have read the routers' republish yet, so ``unknown``
    is no answer (503), not a 404 that loses the end; the other states are answers all the same."""
    got, shell = _ask(m.BranchQueryReply(branch_id="b-1", state="unknown", synced=False))
    assert got == "unsynced"
    assert shell.counters == Counter({"branch_queries.unknown": 1, "branch_queries_unsynced": 1}) and not shell.log.lines
    for state, verdict in (("active", "relay"), ("expired", "relay"), ("ended", "ended")):
        got, shell = _ask(m.BranchQueryReply(branch_id="b-1", state=state, synced=False))  # type: ignore[arg-type]
        assert got == verdict and shell.counters == Counter({f"branch_queries.{state}": 1}), state


def test_a_reply_without_synced_reads_synced():
    """A directory from before the field: its replies decode as synced (its ``unknown`` stays a 404)."""
    import msgspec

    old = msgspec.msgpack.encode({"v": 1, "src": "kvdirectory", "branch_id": "b-1", "state": "unknown"})
    rep = msgspec.msgpack.decode(old, type=m.BranchQueryReply)
    assert rep.synced is True and _ask(rep)[0] == "unknown"
