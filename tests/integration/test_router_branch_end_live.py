"""Ending a branch (``POST /v1/branches/{id}/end``): a failed publish leaves it as it was, and an end is idempotent,
live (real nats-server and router; workers played by ``FakeCluster`` of ``test_router_live``).

Before (session 52's review): the router's table ended the branch before its ``BranchEnd`` was published, so a
publish that failed (``BusError``: a 503 the OpenAI SDK retries) left it ended with no ``BranchEnd`` sent: the retry
got 410 "already ended" and the directory kept the branch's counts until its TTL. And an end whose answer its client
missed (a timeout, retried by the SDK) got 410 on the retry, which the SDK raised. Now the ``BranchEnd`` goes out
first, and a repeated end answers 200 with ``"already": true``; a tool call on an ended branch stays 410.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared import messages as m
from shared.bus import BusError
from tests.integration.test_router_live import _wait_for, router_env

pytestmark = pytest.mark.timeout(60)


def _ends(env: Any) -> list[str]:
    return [e.branch_id for e in env.cluster.branch_events if isinstance(e, m.BranchEnd)]


async def _start(env: Any, bid: str) -> None:
    r = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Branch-Id": bid})
    assert r.status_code == 200, r.text


async def test_a_failed_branch_end_publish_leaves_the_branch_for_the_retry(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        await _start(env, "b1")
        publish = svc.bus.publish
        failed: list[Any] = []

        async def failing_once(subject: str, msg: Any, *args: Any, **kw: Any) -> Any:
            if isinstance(msg, m.BranchEnd) and not failed:
                failed.append(msg)
                raise BusError("nats outbound buffer full (the test's)")
            return await publish(subject, msg, *args, **kw)

        svc.bus.publish = failing_once  # type: ignore[method-assign]
        r = await env.http.post("/v1/branches/b1/end")
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert failed and svc.branches.is_active("b1")  # nothing ended: the retry ends it
        retry = await env.http.post("/v1/branches/b1/end")
        assert retry.status_code == 200 and retry.json() == {"branch_id": "b1", "ended": True}, retry.text
        await _wait_for(lambda: _ends(env) == ["b1"], what="the BranchEnd")
        assert svc.counters["branches_ended"] == 1 and not svc.branches.is_active("b1")


async def test_ending_a_branch_again_answers_200_already_and_publishes_nothing(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        await _start(env, "b2")
        first = await env.http.post("/v1/branches/b2/end")
        assert first.status_code == 200 and first.json() == {"branch_id": "b2", "ended": True}, first.text
        await _wait_for(lambda: _ends(env) == ["b2"], what="the BranchEnd")
        again = await env.http.post("/v1/branches/b2/end")
        assert again.status_code == 200 and again.json() == {"branch_id": "b2", "ended": True, "already": True}, again.text
        tool = await env.http.post("/v1/branches/b2/tool-call", json={"expected_s": 5})
        assert tool.status_code == 410 and "was ended" in tool.json()["error"]["message"], tool.text
        gen = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Branch-Id": "b2"})
        assert gen.status_code == 400 and gen.json()["error"]["param"] == "X-Branch-Id", gen.text
        await asyncio.sleep(0.2)
        assert _ends(env) == ["b2"]  # the repeat published nothing
        assert svc.counters["branches_ended"] == 1 and svc.counters["branch_ends_repeated"] == 1
        # two ends at once, the second checking while the first's BranchEnd is still being published (a slow publish
        # makes them overlap: without it the first is done before the second checks): both answer 200, exactly one
        # says `already`, both BranchEnds go out (the directory counts the second as a duplicate), the branch is
        # counted ended once
        await _start(env, "b3")
        publish = svc.bus.publish

        async def slow_end(subject: str, msg: Any, *args: Any, **kw: Any) -> Any:
            if isinstance(msg, m.BranchEnd):
                await asyncio.sleep(0.3)
            return await publish(subject, msg, *args, **kw)

        svc.bus.publish = slow_end  # type: ignore[method-assign]
        a, b = await asyncio.gather(env.http.post("/v1/branches/b3/end"), env.http.post("/v1/branches/b3/end"))
        svc.bus.publish = publish  # type: ignore[method-assign]
        assert {a.status_code, b.status_code} == {200}, (a.text, b.text)
        assert sorted(bool(x.json().get("already")) for x in (a, b)) == [False, True], (a.text, b.text)
        await _wait_for(lambda: _ends(env).count("b3") == 2, what="both BranchEnds")
        assert svc.counters["branches_ended"] == 2 and svc.counters["branch_ends_repeated"] == 2


async def test_an_end_of_a_branch_this_router_never_saw_follows_the_directorys_answer(nats_url, tmp_path):
    """Another router served the branch, or this one restarted since: the end asks the directory (``branch.query``,
    played by ``FakeCluster``) and is relayed for a branch it holds (active or expired), ``already`` for one it
    ended, a 404 for one it does not know, a 503 with ``Retry-After: 1`` when it does not answer. Before: 404 for each,
    nothing published, the directory's counts kept until its TTL."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        env.cluster.branch_states.update({"there": "active", "lapsed": "expired", "done": "ended", "mute": None})
        r = await env.http.post("/v1/branches/there/end")
        assert r.status_code == 200 and r.json() == {"branch_id": "there", "ended": True}, r.text
        await _wait_for(lambda: _ends(env) == ["there"], what="the relayed BranchEnd")
        again = await env.http.post("/v1/branches/there/end")  # remembered here: no second query, nothing published
        assert again.status_code == 200 and again.json()["already"] is True, again.text
        gen = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Branch-Id": "there"})
        assert gen.status_code == 400 and gen.json()["error"]["param"] == "X-Branch-Id", gen.text
        r = await env.http.post("/v1/branches/lapsed/end")
        assert r.status_code == 200 and r.json() == {"branch_id": "lapsed", "ended": True}, r.text
        r = await env.http.post("/v1/branches/done/end")
        assert r.status_code == 200 and r.json() == {"branch_id": "done", "ended": True, "already": True}, r.text
        r = await env.http.post("/v1/branches/never/end")
        msg = r.json()["error"]["message"]
        assert r.status_code == 404 and "unknown branch 'never'" in msg and "the KV directory does not know it" in msg, r.text
        r = await env.http.post("/v1/branches/mute/end")
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "did not answer" in r.json()["error"]["message"], r.text
        await _wait_for(lambda: _ends(env) == ["there", "lapsed"], what="both relayed BranchEnds")
        await asyncio.sleep(0.2)
        assert _ends(env) == ["there", "lapsed"]  # `already`, 404 and 503 published nothing
        assert env.cluster.branch_queries == ["there", "lapsed", "done", "never", "mute"]
        c = svc.counters
        assert (c["branch_ends_relayed"], c["branches_ended"], c["branch_ends_repeated"], c["branch_queries_failed"]) == (2, 2, 2, 1)


async def test_a_tool_call_on_a_branch_this_router_never_saw_follows_the_directorys_answer(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        env.cluster.branch_states.update({"held": "active", "lapsed": "expired", "done": "ended", "mute": None})
        r = await env.http.post("/v1/branches/held/tool-call", json={"expected_s": 30})
        assert r.status_code == 200 and r.json() == {"branch_id": "held", "outstanding": True, "expected_s": 30.0}, r.text
        r = await env.http.post("/v1/branches/lapsed/tool-call")  # no hint: held up to --max-tool-hold-s
        assert r.status_code == 200 and r.json()["expected_s"] == 14400.0, r.text
        r = await env.http.post("/v1/branches/held/tool-call", json={"outstanding": False})
        assert r.status_code == 200 and r.json() == {"branch_id": "held", "outstanding": False, "expected_s": 0.0}, r.text
        calls = lambda: [(e.branch_id, e.outstanding, e.expected_s) for e in env.cluster.branch_events if isinstance(e, m.BranchToolCall)]  # noqa: E731
        await _wait_for(lambda: len(calls()) == 3, what="the relayed BranchToolCalls")
        assert calls() == [("held", True, 30.0), ("lapsed", True, 0.0), ("held", False, 0.0)]
        r = await env.http.post("/v1/branches/done/tool-call")
        assert r.status_code == 410 and "was ended" in r.json()["error"]["message"], r.text
        assert (await env.http.post("/v1/branches/never/tool-call")).status_code == 404
        r = await env.http.post("/v1/branches/mute/tool-call")
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert not env.service.branches.is_active("held")  # relayed, not taken in: its next request here starts it
        assert env.service.counters["branch_tool_calls_relayed"] == 3 and env.service.counters["branch_tool_calls"] == 3
