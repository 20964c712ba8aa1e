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
