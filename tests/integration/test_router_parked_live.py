"""Work handed back to the router (a fenced node's re-dispatch, a phase switch's ``work.requeue``) that finds
no eligible node is parked at most ``--requeue-wait-s``, then the request fails with 503 naming what is missing
(real nats-server, the router's service; nodes played by ``FakeCluster`` of ``test_router_live``).

Before, a 1P1D cluster whose only decode node died (SIGKILL, not restarted) kept the client waiting for its next
output chunk until ``--request-timeout-s`` (600 s by default), then a 504, and the parked work stayed in the
router's ``parked`` gauge after the request ended."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import msgspec
import pytest

from services.router.nodes import NodeLoadView
from services.router.service import RouterService
from shared import messages as m
from shared.service import serve_until_stopped
from shared.subjects import REQ_OUT, ROUTE_BIND, WORK_REQUEUE
from tests.integration.test_router_live import _wait_for, output_token, router_env, sse_events

pytestmark = pytest.mark.timeout(60)

PD = {"p0": "prefill", "d0": "decode"}
KEY = {"Authorization": "Bearer k1"}
# request_timeout_s far above the bound: a request that is not failed by the bound hangs past the test's checks
SLOW = {"request_timeout_s": 30.0, "no_route_wait_s": 0.5, "api_keys": "k1", "api_key_max_inflight": 1}


def _clean(env) -> None:
    svc = env.service
    assert svc._parked == {} and svc._parked_since == {} and svc._pending == {}
    assert svc.core.view.inflight_total == 0 and svc.core.view.placement("x") is None


async def test_the_only_decode_node_dies_mid_stream_and_the_stream_ends_with_a_503_within_the_bound(nats_url, tmp_path):
    """Back within ``--requeue-wait-s`` (a supervisor restarted it): the parked work is placed on it and the
    stream completes. Not back: the stream ends with a 503 error event naming the missing decode node."""
    async with router_env(nats_url, tmp_path, PD, requeue_wait_s=1.0, **SLOW) as env:
        env.cluster.stall_after_first.add("p0")  # attempt 0: first token, then nothing (the decode node has it)
        async with env.http.stream("POST", "/v1/completions", json={"prompt": [5] * 70, "max_tokens": 6, "stream": True}, headers=KEY) as r:
            lines = r.aiter_lines()
            first = await anext(lines)
            env.cluster.alive.discard("d0")
            while not env.service._parked:  # fenced, re-dispatched, no decode node: parked
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            env.cluster.alive.add("d0")  # back within the bound: its next state places the parked work (attempt 1, served in full)
            rest = "".join([line + "\n" async for line in lines])
        events = sse_events(first + "\n\n" + rest)
        assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2]
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == env.service.tokenizer.decode([output_token(i) for i in range(6)])
        st = await env.stats()
        assert st.counters["requeue.parked"] == 1 and st.counters.get("requeue.parked_expired", 0) == 0
        assert st.counters["redispatch.placed"] == 1
        _clean(env)

        # now the decode node dies and is not restarted
        loop = asyncio.get_running_loop()
        async with env.http.stream("POST", "/v1/completions", json={"prompt": [6] * 70, "max_tokens": 6, "stream": True}, headers=KEY) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            first = await anext(lines)
            env.cluster.alive.discard("d0")
            t0 = loop.time()
            rest = "".join([line + "\n" async for line in lines])
            waited = loop.time() - t0
        events = sse_events(first + "\n\n" + rest)
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["code"] == 503 and "no live decode" in err["message"] and "requeue_wait_s" in err["message"], err
        # fenced after FENCE_S (1.5 s) of silence, then parked 1 s (+ the fence loop's 0.5 s tick); before: 504 after 30 s
        assert waited < 6.0, waited
        st = await env.stats()
        assert st.counters["requeue.parked"] == 2 and st.counters["requeue.parked_expired"] == 1 and st.gauges["parked"] == 0
        _clean(env)
        # the API key's in-flight slot was given back: its next request is not a 429 (no decode node: 503 after no_route_wait_s)
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, headers=KEY)
        assert r.status_code == 503 and "no live decode" in r.json()["error"]["message"], r.text


async def test_a_prefill_redispatch_with_no_prefill_node_left_is_a_503_within_the_bound(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, PD, requeue_wait_s=1.0, **SLOW) as env:
        env.cluster.answering.discard("p0")  # takes the work, never answers ...
        req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, headers=KEY))
        while not env.cluster.works:
            await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        env.cluster.alive.discard("p0")  # ... and dies: its re-dispatch finds no prefill node
        r = await asyncio.wait_for(req, 20)
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert "no live prefill" in msg and "requeue_wait_s" in msg, msg
        assert loop.time() - t0 < 6.0
        st = await env.stats()
        assert st.counters["redispatch.prefill"] == 1 and st.counters["requeue.parked_expired"] == 1
        _clean(env)


async def test_the_bound_does_not_run_while_nats_is_down_and_a_node_back_after_the_outage_takes_the_work(nats_server, tmp_path):
    """The decode node dies (the request parked), then nats-server is down longer than ``--requeue-wait-s``;
    the node reports again a while after the bus is back. The outage and the settling after it
    (``fence_after_s`` + 1 s: node states are silent because of the bus) do not count against the bound, so
    the parked work is placed on the node and the stream completes. Before, the time of the outage counted
    and the request failed with 503 the moment the bus settled (2.5 s after it was back), although a node
    restarted meanwhile could not have reported before."""
    async with router_env(nats_server.url, tmp_path, PD, requeue_wait_s=3.0, **SLOW) as env:
        svc = env.service
        env.cluster.stall_after_first.add("p0")
        loop = asyncio.get_running_loop()
        async with env.http.stream("POST", "/v1/completions", json={"prompt": [5] * 70, "max_tokens": 6, "stream": True}, headers=KEY) as r:
            lines = r.aiter_lines()
            first = await anext(lines)
            env.cluster.alive.discard("d0")
            while not svc._parked:  # fenced, re-dispatched, no decode node: parked
                await asyncio.sleep(0.02)
            os.kill(nats_server.pid, signal.SIGKILL)
            nats_server.proc.wait()
            await asyncio.sleep(4.0)  # longer than the bound
            nats_server.restart()
            while not (svc.bus.nc.is_connected and svc.bus.reconnected_at is not None):
                await asyncio.sleep(0.02)
            back = loop.time()
            await asyncio.sleep(4.0)  # settled 2.5 s after the reconnect; the node comes back 1.5 s later
            assert svc._parked, "the parked request failed before the bound ran out in bus-up time"
            # the fence loop slept through the outage and the settling (at most 0.5 s a round): 13 rounds
            # (measured); before, the due fence of d0 woke it every 0.01 s: 252 rounds
            rounds = svc.counters["fence_checks_skipped_bus_down"]
            assert rounds <= 30, f"{rounds} fence-loop rounds while NATS was down or settling (~7 s)"
            env.cluster.alive.add("d0")
            rest = "".join([line + "\n" async for line in lines])
            assert loop.time() - back < 7.0
        events = sse_events(first + "\n\n" + rest)
        assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2]
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == svc.tokenizer.decode([output_token(i) for i in range(6)])
        st = await env.stats()
        assert st.counters["requeue.parked"] == 1 and st.counters.get("requeue.parked_expired", 0) == 0
        _clean(env)


async def test_a_request_on_two_nodes_fenced_at_once_is_re_dispatched_once(nats_url, tmp_path):
    """Its prefill node and its decode node stop reporting together (one host lost): both are fenced in one
    check, and the request is in both nodes' lists. It is re-dispatched once (one new attempt, one work
    sent), served in full, and nothing is left in flight. Before, the second node's fence re-dispatched it
    again (attempt 2, a second round of aborts, ``redispatched`` 2): the first re-dispatch's work went out
    as attempt 2, and the second's routing raised "already in flight" in a background task
    (``publish_errors``, a warning); had the core not refused it, a double placement."""
    phases = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    async with router_env(nats_url, tmp_path, phases) as env:
        svc = env.service
        env.cluster.answering.clear()  # takes the work, never answers ...
        req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}))
        while not env.cluster.works:
            await asyncio.sleep(0.02)
        (p,) = svc._pending.values()
        dead = {p.prefill_node, p.decode_node}
        env.cluster.answering = set(phases) - dead
        env.cluster.alive -= dead  # ... and both its nodes go silent in the same heartbeat
        r = await asyncio.wait_for(req, 20)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == svc.tokenizer.decode([output_token(i) for i in range(4)])
        assert [w.attempt for w in env.cluster.works] == [0, 1], [(w.attempt, w.decode_node) for w in env.cluster.works]
        st = await env.stats()
        assert st.counters["fenced"] == 2 and st.counters["redispatched"] == 1, st.counters
        assert st.counters["redispatch.already"] == 1 and "publish_errors" not in st.counters, st.counters
        await asyncio.sleep(0.3)  # the aborts' and placements' background publishes
        assert st.gauges["inflight"] == 0 and svc.core.view.inflight_total == 0
        assert svc._parked == {} and svc._pending == {}


async def test_parked_work_of_a_request_that_ended_is_not_placed_under_a_retry_with_the_same_request_id(nats_url, tmp_path):
    """Two requests are parked (their decode node died). The node comes back: the retry round takes the list
    of parked work and places each in turn, each after a ``kv.lookup`` (here slow, 2.5 s). Meanwhile the
    client of the second request goes away and sends it again under the same ``X-Request-ID``, which is
    dispatched. When the round reaches the second request's old work it is skipped (``requeue.parked_gone``).
    Before, it was placed anyway for the new request: a prefill's routing failed "already in flight" in a
    background task (``publish_errors``); a parked ``DecodeWork`` was bound to a decode node under the new
    request's attempt, the old request's hand-off decoding into the new request's stream."""
    async with router_env(nats_url, tmp_path, PD, requeue_wait_s=20.0, request_timeout_s=30.0, lookup_timeout_s=5.0) as env:
        svc, cluster = env.service, env.cluster
        cluster.stall_after_first.add("p0")
        streams: dict[str, contextlib.AsyncExitStack] = {}
        lines = {}  # kept: a line iterator dropped closes its response (a client that went away)
        for rid, prompt in (("r1", [5] * 130), ("r2", [6] * 70)):
            stack = streams[rid] = contextlib.AsyncExitStack()
            body = {"prompt": prompt, "max_tokens": 6, "stream": True}
            r = await stack.enter_async_context(env.http.stream("POST", "/v1/completions", json=body, headers={"X-Request-ID": rid}))
            lines[rid] = r.aiter_lines()
            await anext(lines[rid])
        cluster.alive.discard("d0")
        while len(svc._parked) < 2:  # fenced, both re-dispatched, no decode node: parked
            await asyncio.sleep(0.02)
        _first, second = "r1", "r2"
        # every accepting state (p0's) starts a round while work is parked: wait for one at r1's lookup (its
        # continuation has 2 block hashes, r2's 1), so that r2 comes after it in that round
        n = len(cluster.lookups)
        cluster.lookup_delay_s = 2.5
        await _wait_for(lambda: any(len(q.block_hashes) == 2 for q in cluster.lookups[n:]), timeout=8.0, what="a round at r1's lookup")
        cluster.answering.discard("p0")  # what is dispatched from now on stays in flight
        cluster.alive.add("d0")  # back before r1's lookup returns: r1 is placed, then the round reaches r2's work
        await asyncio.sleep(0.3)
        await streams[second].aclose()  # the second's client goes away ...
        while second in svc._pending:
            await asyncio.sleep(0.02)
        # ... and sends it again (no block hashes: no lookup), dispatched while the round waits for the first's lookup
        again = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [6] * 10, "max_tokens": 6}, headers={"X-Request-ID": second}))
        while second not in svc._pending or svc.core.view.placement(second) is None:
            await asyncio.sleep(0.02)
        # the round: the first's lookup, then the old work skipped (before: its lookup and routing, "already in flight")
        await _wait_for(lambda: svc.counters.get("requeue.parked_gone", 0) == 1, timeout=8.0, what="the old work skipped")
        st = await env.stats()
        assert "publish_errors" not in st.counters, st.counters
        assert st.counters["requeue.parked_gone"] == 1, st.counters
        assert [w.prompt_tokens for w in cluster.works if w.rid == second][-1] == 10  # the retry's work is the last sent
        again.cancel()
        await streams[_first].aclose()
        await _wait_for(lambda: not svc._pending and not svc._parked, what="requests ended")
        assert svc.core.view.inflight_total == 0 and svc._parked_since == {}  # a parked request whose client went: nothing left


async def test_a_parked_request_that_fails_ends_in_the_other_routers_view_too(nats_url, tmp_path):
    """Router B counts router A's requests in its load view (``route.sent``) until their end reaches the bus
    (a node's last or abort chunk). A's request is handed back by its decode node (a phase switch) and
    parked: no node holds it, so when it fails (``--requeue-wait-s``) no node publishes its end. A publishes
    it (an ``abort`` chunk from the router) and B stops counting it at once. Before, B counted it on the
    nodes it had left until ``--request-timeout-s`` (600 s by default) after its last ``route.sent``."""
    async with router_env(nats_url, tmp_path, PD, requeue_wait_s=1.0, request_timeout_s=30.0) as env:
        svc = env.service
        holder: dict[str, RouterService] = {}

        def factory(c, b, clock):
            holder["b"] = RouterService(c, b, clock)
            return holder["b"]

        cfg_b = msgspec.structs.replace(svc.cfg, port_file=str(tmp_path / "b.port"))
        stop_b = asyncio.Event()
        task_b = asyncio.create_task(serve_until_stopped("router", cfg_b, factory, instance="router-b", stop_event=stop_b))
        try:
            await _wait_for(lambda: "b" in holder and holder["b"].ready() and holder["b"].core.view.epoch == 1, what="router B ready")
            b = holder["b"]
            env.cluster.stall_after_first.add("p0")  # the first token, then nothing: the decode node has it
            async with env.http.stream("POST", "/v1/completions", json={"prompt": [5] * 70, "max_tokens": 6, "stream": True}) as r:
                lines = r.aiter_lines()
                first = await anext(lines)
                (p,) = svc._pending.values()
                await _wait_for(lambda: len(b._remote) == 1, what="B counts A's request")
                work = m.DecodeWork(rid=p.rid, prompt_tokens=70, max_tokens=6, block_size=64, block_hashes=list(p.rreq.block_hashes),
                                    prefill_node="p0", attempt=p.attempt, router="router")
                back = m.WorkRequeue(rid=p.rid, node="d0", reason="phase switch", decode=work, attempt=p.attempt)
                rep = await env.bus.request(WORK_REQUEUE, back, timeout=2.0, router="router")
                assert rep.accepted, rep
                rest = "".join([line + "\n" async for line in lines])
            events = sse_events(first + "\n\n" + rest)
            assert events[-2]["error"]["code"] == 503 and "requeue_wait_s" in events[-2]["error"]["message"], events[-2]
            await _wait_for(lambda: len(b._remote) == 0 and b.core.view.inflight_total == 0, timeout=2.0, what="B stops counting it")
            assert b.counters["remote.ended"] == 1
        finally:
            stop_b.set()
            await asyncio.wait_for(task_b, 20)


async def test_a_router_started_while_a_request_is_parked_counts_it_as_its_owner_once_its_decode_node_is_bound(nats_url, tmp_path):
    """Router B starts after router A placed a request whose decode node is bound at prefill start. Its prefill
    node sends the first token at the prompt's end, before ``route.bind`` is answered (the request is parked
    there); B is not counting the request then (it never heard its placement), so that chunk is not its business.
    A's binding re-announces the placement (``route.sent``), now with ``first_token``: B counts the prefill as
    done and the decode node as loaded, as A does. Before, B counted the prefill afresh on p0 (its
    ``inflight_prefill`` 1, its policy charged with the prompt) until the decode node's first output. Both stop
    counting it at its end."""
    async with router_env(nats_url, tmp_path, PD, decode_binding="prefill-start") as env:
        svc = env.service
        env.cluster.answering.discard("p0")  # p0 records the work; the test plays its output
        task = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [5] * 70, "max_tokens": 3}))
        await _wait_for(lambda: env.cluster.works, what="the work dispatched")
        rid = env.cluster.works[-1].rid
        holder: dict[str, RouterService] = {}

        def factory(c, b, clock):
            holder["b"] = RouterService(c, b, clock)
            return holder["b"]

        cfg_b = msgspec.structs.replace(svc.cfg, port_file=str(tmp_path / "b.port"))
        stop_b = asyncio.Event()
        task_b = asyncio.create_task(serve_until_stopped("router", cfg_b, factory, instance="router-b", stop_event=stop_b))
        try:
            await _wait_for(lambda: "b" in holder and holder["b"].ready() and holder["b"].core.view.epoch == 1, what="router B ready")
            b = holder["b"]
            assert b.core.view.inflight_total == 0  # it never heard A's placement

            owner = env.cluster.works[-1].router
            assert owner == "router"  # A's instance id, as a real worker stamps its chunks (TokenChunk.router)

            async def out(node: str, i: int, finished: bool = False, of: str = rid, router: str = owner) -> None:
                chunk = m.TokenChunk(rid=of, node=node, index=i, token_ids=[output_token(i)], prompt_tokens=70, finished=finished,
                                     finish_reason="length" if finished else None, router=router)  # fmt: skip
                await env.cluster.bus.publish(REQ_OUT, chunk, rid=of, node=chunk.node)

            await out("p0", 0)  # the prompt's end on p0: its first token, before the binding
            # another router's request B never heard of: a peer's chunk, not an unknown id
            await _wait_for(lambda: svc.core.view.first_token_seen(rid) and b.counters["chunks_peer_rid"] == 1, what="first token seen")
            assert b.counters.get("chunks_unknown_rid", 0) == 0, b.counters
            await out("p0", 0, of="nobody-placed", router="")  # an id no router placed (a stray publisher): unknown
            await _wait_for(lambda: b.counters["chunks_unknown_rid"] == 1, what="the unknown id counted")
            assert b.counters["chunks_peer_rid"] == 1, b.counters
            bind = m.DecodeBindRequest(rid=rid, prefill_node="p0", prompt_tokens=70, max_tokens=3)
            assert (await env.cluster.bus.request(ROUTE_BIND, bind, timeout=2.0, router="router")).decode_node == "d0"
            await _wait_for(lambda: b.core.view.placement(rid) == ("p0", "d0"), what="B counts A's request")

            def counts(core) -> dict[str, tuple[int, int, int]]:
                return {n: (r.inflight, r.inflight_prefill, r.inflight_decode) for n, r in sorted(core.view.nodes.items())}

            assert counts(b.core) == counts(svc.core) == {"d0": (1, 0, 1), "p0": (1, 0, 0)}
            assert b._remote.first_token(rid)
            await out("d0", 1)
            await out("d0", 2, finished=True)
            r = await asyncio.wait_for(task, 10)
            assert r.status_code == 200, r.text
            await _wait_for(lambda: len(b._remote) == 0 and b.core.view.inflight_total == 0, timeout=2.0, what="B stops counting it")
            assert b.counters["remote.ended"] == 1 and svc.core.view.inflight_total == 0
        finally:
            if not task.done():
                task.cancel()
            stop_b.set()
            await asyncio.wait_for(task_b, 20)


async def _handed_back_prefill(env, prompt: list[int]) -> tuple[asyncio.Task, m.WorkRequeue]:
    """A request whose prefill work p0 records and does not answer, and p0's hand-back of it (a phase switch)."""
    env.cluster.answering.discard("p0")
    task = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}))
    await _wait_for(lambda: env.cluster.works, what="the work dispatched")
    work = env.cluster.works[-1]
    return task, m.WorkRequeue(rid=work.rid, node="p0", reason="phase switch", prefill=work, attempt=work.attempt)


async def test_a_hand_back_whose_bookkeeping_raises_is_taken_and_served(nats_url, tmp_path):
    """``RouterCore.requeue`` raising in the ``work.requeue`` handler (here: after it forgot the placement, as a
    policy hook failing would): the node's hand-back is still answered ``accepted`` and the request served
    elsewhere, the error counted and logged with its traceback. Before, the exception reached the bus, which sent
    no reply: the node's request timed out, and its repeat was refused ("not placed on p0"), so it dropped the
    work while the client waited ``request_timeout_s``."""
    async with router_env(nats_url, tmp_path, PD, request_timeout_s=10.0) as env:
        svc = env.service
        task, back = await _handed_back_prefill(env, [5] * 70)
        real = svc.core.requeue

        def failing(rid: str, now: float) -> bool:
            real(rid, now)
            raise RuntimeError("policy hook failed")

        svc.core.requeue = failing
        env.cluster.answering.add("p0")  # the work placed again is served
        rep = await env.bus.request(WORK_REQUEUE, back, timeout=2.0, router="router")  # the worker's timeout
        assert rep.accepted, rep
        r = await asyncio.wait_for(task, 5.0)
        assert r.status_code == 200, r.text
        assert svc.counters["requeue.bookkeeping_errors"] == 1 and svc.counters["requeue.rerouted"] == 1
        assert len(env.cluster.works) == 2 and svc._pending == {}


async def test_a_hand_back_the_router_fails_to_take_is_refused_and_its_request_fails_at_once(nats_url, tmp_path, monkeypatch):
    """Taking the work back raising before the router owns it (here the placement lookup): the node gets a
    refusal naming the error (it drops the work) and the client a 503 at once, nodes told to drop it. Before,
    no reply (the node timed out and retried) and the client waited ``request_timeout_s`` (10 s here)."""
    async with router_env(nats_url, tmp_path, PD, request_timeout_s=10.0) as env:
        svc = env.service
        task, back = await _handed_back_prefill(env, [6] * 70)

        def failing(self, rid: str):
            raise KeyError("view broken")

        monkeypatch.setattr(NodeLoadView, "placement", failing)
        rep = await env.bus.request(WORK_REQUEUE, back, timeout=2.0, router="router")  # the worker's timeout
        assert not rep.accepted and "failed to take the request back" in rep.reason and "view broken" in rep.reason, rep
        r = await asyncio.wait_for(task, 3.0)
        assert r.status_code == 503 and "failed to take it" in r.json()["error"]["message"], r.text
        assert svc.counters["requeue.errors"] == 1 and svc._pending == {}
