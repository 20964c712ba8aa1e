"""Router ingress under hostile HTTP clients (issue 18): API keys, deep JSON, stalled bodies and heads, per-key limit.

Real router (in-process uvicorn on a free port) over a real nats-server, with the
fake cluster of ``test_router_live`` answering on the bus.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from services.router import api
from tests.integration.test_router_live import _wait_for, router_env

BODY = {"prompt": [1, 2, 3], "max_tokens": 2}


async def test_api_keys_401_without_or_with_a_wrong_key(nats_url, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# router keys\nfile-key-1\n\n")
    async with router_env(nats_url, tmp_path, {"c0": "both"}, api_keys_file=str(keys), api_keys="env-key-2") as env:
        url = f"http://127.0.0.1:{env.service.port}"
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
            r = await http.post("/v1/completions", json=BODY)
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
            assert r.json()["error"]["code"] == "invalid_api_key"
            for bad in ("Bearer nope", "Basic file-key-1", "Bearer file-key-1x", "file-key-1"):
                assert (await http.post("/v1/completions", json=BODY, headers={"Authorization": bad})).status_code == 401, bad
            assert (await http.get("/v1/models")).status_code == 401
            for key in ("file-key-1", "env-key-2"):
                r = await http.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
            assert (await http.get("/healthz")).status_code == 200  # public by default
        assert env.service.counters["http.unauthorized"] == 6 and env.service.api_keys_on


async def test_two_different_authorization_headers_are_a_400_over_real_http(nats_url, tmp_path):
    """Live: a request with ``Authorization: Bearer k1`` and ``Authorization: Bearer k2`` (h11 and uvicorn pass
    both) was served as k1's; now a 400 naming the header, the connection closed. Once with the key: 200."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, api_keys="k1,k2") as env:
        url = f"http://127.0.0.1:{env.service.port}"
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
            r = await http.post("/v1/completions", json=BODY, headers=[("Authorization", "Bearer k1"), ("Authorization", "Bearer k2")])
            assert r.status_code == 400 and r.json()["error"]["param"] == "Authorization", r.text
            assert r.headers["connection"] == "close"
            r = await http.post("/v1/completions", json=BODY, headers=[("Authorization", "Bearer k1"), ("Authorization", "Bearer k1")])
            assert r.status_code == 200, r.text
        assert env.service.counters["http.auth_header_repeated"] == 1 and env.service.counters["http_status.400"] == 1


async def test_deep_json_is_400_never_500(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        deep = b"[" * 100_000 + b"]" * 100_000
        for path, body in (
            ("/v1/completions", b'{"prompt": ' + deep + b"}"),
            ("/v1/completions", b'{"prompt": "x", "tool_choice": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}"),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": ' + deep + b"}"),
            ("/v1/completions", deep),
        ):
            r = await env.http.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.status_code, r.text[:200])
            assert "error" in r.json()
        assert (await env.http.post("/v1/completions", json=BODY)).status_code == 200
        assert env.service.counters.get("http_status.500", 0) == 0


async def _stalled_body(port: int) -> tuple[bytes, float]:
    """Send a head announcing 1,000 body bytes, send 10, stall; return what came back and when the server closed."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), timeout=30.0)  # until EOF: the server closes
    writer.close()
    return data, time.monotonic() - t0


async def test_200_stalled_bodies_are_closed_after_the_read_timeout_and_service_goes_on(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, body_timeout_s=1.0) as env:
        port = env.service.port
        stalled = [asyncio.create_task(_stalled_body(port)) for _ in range(200)]
        await asyncio.sleep(0.3)
        r = await env.http.post("/v1/completions", json=BODY)  # served while 200 connections stall
        assert r.status_code == 200
        results = await asyncio.gather(*stalled)
        for data, took in results:
            assert data.startswith(b"HTTP/1.1 408"), data[:100]
            assert took < 15.0
        assert env.service.counters["http.body_timeouts"] == 200
        assert (await env.http.post("/v1/completions", json=BODY)).status_code == 200


async def test_client_closing_mid_body_is_a_499_never_a_500(nats_url, tmp_path):
    """A client that announces a body, sends part of it and closes: counted as a disconnect (499), not as a
    server error. Before, Starlette's ClientDisconnect escaped ``_read_body``: every such close was an
    ``http_status.500`` and an ``Exception in ASGI application`` traceback in the router's log."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        paths = (b"/v1/completions", b"/v1/chat/completions", b"/tokenize", b"/detokenize", b"/v1/branches/b1/tool-call")
        for path in paths:
            _reader, writer = await asyncio.open_connection("127.0.0.1", env.service.port)
            writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":")
            await writer.drain()
            await asyncio.sleep(0.2)  # the router is reading the body
            writer.close()
        await _wait_for(lambda: env.service.counters["http.body_disconnects"] == len(paths), what="every disconnect counted")
        assert env.service.counters.get("http_status.500", 0) == 0, dict(env.service.counters)
        assert env.service.counters["http_status.499"] == len(paths) and env.service.counters["requests.499"] == 2
        assert not env.service._pending
        assert (await env.http.post("/v1/completions", json=BODY)).status_code == 200


async def test_stalled_request_head_is_closed(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, header_timeout_s=1.0) as env:
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", env.service.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout=20.0)
        assert data == b"" and time.monotonic() - t0 < 10.0  # closed without an answer
        writer.close()
        # an idle connection after a response is closed the same way
        reader, writer = await asyncio.open_connection("127.0.0.1", env.service.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        first = await asyncio.wait_for(reader.read(65536), timeout=10.0)
        assert first.startswith(b"HTTP/1.1 200")
        writer.write(b"GET /healthz HTTP/1.1\r\nHost")  # a second head that never ends
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), timeout=20.0)
        assert rest == b""
        writer.close()
        assert env.service.counters["http.header_timeouts"] >= 2


async def test_per_key_concurrency_limit_429(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, api_keys="k1,k2", api_key_max_inflight=1) as env:
        env.cluster.answering.discard("c0")  # c0 records work and never answers: the first request stays in flight
        url = f"http://127.0.0.1:{env.service.port}"
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
            hold = asyncio.create_task(http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k1"}))
            await _wait_for(lambda: len(env.cluster.works) == 1, what="first request dispatched")
            r = await http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k1"})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            env.cluster.answering.add("c0")
            r = await http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k2"})  # another key is not limited
            assert r.status_code == 200
            hold.cancel()
            try:
                await hold
            except (asyncio.CancelledError, httpx.HTTPError):
                pass
            await _wait_for(lambda: not env.service.ingress.inflight, what="in-flight released")
            r = await http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k1"})
            assert r.status_code == 200
        assert env.service.counters["http.key_limited"] == 1


async def test_replay_sends_its_api_key(nats_url, tmp_path):
    """`replay` against a router run with API keys: every request was a 401 (it sent no key)."""
    from evolving_infra.replay.core import Arrival
    from evolving_infra.replay.live import LiveReplayer
    from shared.clock import SimClock
    from tests.unit.sim.conftest import BS, small_trace

    async with router_env(nats_url, tmp_path, {"c0": "both"}, api_keys="k1") as env:
        url = f"http://127.0.0.1:{env.service.port}"
        results = {}
        for key in (None, "k1"):
            rep = LiveReplayer(url, SimClock(1.0), block_size=BS, model="test-model", progress=False, api_key=key)
            results[key] = (await rep.run(small_trace(1, 2, pause=0.0), Arrival(kind="closed", concurrency=1))).records
    assert len(results[None]) == 2 and all("401" in (r.error or "") for r in results[None]), [r.error for r in results[None]]
    assert len(results["k1"]) == 2 and all(r.error is None for r in results["k1"]), [r.error for r in results["k1"]]


async def test_ping_answers_as_health_on_get_and_post_without_a_key(nats_url, tmp_path):
    """vLLM's server answers ``GET``/``POST /ping`` as its ``/health`` (SageMaker's container check, which sends
    no API key): the router had no ``/ping`` (404, or 401 with keys). Now it is ``/health``'s answer, 200 while a
    placement is possible and 503 with the reason when not, and public with keys on, as ``/health``."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, api_keys="k1") as env:
        url = f"http://127.0.0.1:{env.service.port}"
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
            assert (await http.get("/v1/models")).status_code == 401  # keys are on
            for method in ("GET", "POST"):
                r = await http.request(method, "/ping", content=b"{}")
                assert (r.status_code, r.json()) == (200, {"status": "ok"}), (method, r.text)
            env.cluster.alive.clear()
            await _wait_for(lambda: not env.service.ready(), timeout=5, what="node fenced")
            health = await http.get("/health")
            for method in ("GET", "POST"):
                r = await http.request(method, "/ping")
                assert r.status_code == health.status_code == 503, (method, r.text)
                # the same body as /health's but for the reason's "no state for X wall s", which is read at each call
                same = [re.sub(r"[0-9.]+ wall s", "N wall s", x.text) for x in (r, health)]
                assert same[0] == same[1] and "c0: fenced" in r.json()["error"]["message"], r.text
            assert (await http.put("/ping")).status_code == 405
        assert env.service.counters["http.unauthorized"] == 1


async def test_huge_bodies_are_parsed_two_at_a_time_and_small_ones_never_wait(nats_url, tmp_path):
    """Each huge body's parse and tokenization, in a worker thread, takes memory several times its size (a 60 MB
    prompt: ~360 MB); four sent at once took a live router from 70 MB to 1.5 GB, and asyncio's thread pool
    runs min(32, cores + 4) of them. Bodies over 4 MiB now go two at a time; a smaller body is not held behind them.
    The huge parses are held on an event (not a sleep: on a loaded box the small one could start only after they
    had ended) until all four asked for a slot and the small one was answered."""
    huge_at = 4 * 1024 * 1024

    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        gate, asked = env.service._big_gate, [0]  # the router's own gate (its size is what is tested), acquires counted
        acquire = gate.acquire

        async def counted_acquire() -> bool:
            asked[0] += 1
            return await acquire()

        gate.acquire = counted_acquire  # type: ignore[method-assign]
        inside: list[int] = []  # body sizes of the parses running now
        most = [0]
        small_saw_huge = []
        release = threading.Event()  # the huge parses are held until the small one is answered
        prepare = env.service._prepare_body

        def counted(body: bytes, chat: bool, ctx: int):
            inside.append(len(body))
            try:
                if len(body) > huge_at:
                    most[0] = max(most[0], sum(n > huge_at for n in inside))
                    assert release.wait(20.0)
                    raise api.ApiError(400, "huge")
                small_saw_huge.append(sum(n > huge_at for n in inside))
                return prepare(body, chat, ctx)
            finally:
                inside.remove(len(body))

        env.service._prepare_body = counted
        try:
            huge = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
            posts = [asyncio.create_task(env.http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}))
                     for _ in range(4)]
            # all four read and asking for a slot (or, with no gate, more than two parsing at once)
            await _wait_for(lambda: asked[0] == 4 or most[0] > 2, timeout=20.0, what="four huge bodies asking for a slot")
            await _wait_for(lambda: sum(n > huge_at for n in inside) >= 2, what="two huge parses inside")
            assert most[0] == 2, most[0]
            # 40 KB: off the loop, ungated; before the gate was bypassed for it, it would wait here for the held slots
            small = await asyncio.wait_for(env.http.post("/v1/completions", json={"prompt": "a " * 20_000, "max_tokens": 2}), 10.0)
            assert sum(n > huge_at for n in inside) == 2  # the other two still wait for a slot
            release.set()
            results = await asyncio.gather(*posts)
            assert [r.status_code for r in results] == [400] * 4 and small.status_code < 500, small.text
            assert most[0] == 2, most[0]
            assert small_saw_huge == [2], small_saw_huge  # it ran while both huge ones were inside
        finally:
            release.set()  # a failed check leaves no thread waiting


async def test_a_client_gone_while_its_huge_body_waits_for_a_parse_slot_leaves_the_line(nats_url, tmp_path):
    """A huge body waits for one of the router's two parse slots with its body read. A client that closed the
    connection meanwhile kept its place: once a slot was free its body was parsed and tokenized anyway (seconds,
    hundreds of MB for a 60 MB prompt, for nobody), ahead of the clients still waiting, and only after its
    dispatch to a node did the disconnect watcher abort it. Now it leaves the line when it goes (a 499,
    ``http.gate_disconnects``); the slots go to those still there."""
    huge_at = 4 * 1024 * 1024

    class Gate(asyncio.Semaphore):
        asked = 0

        async def acquire(self) -> bool:
            Gate.asked += 1
            return await super().acquire()

    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        env.service._big_gate = Gate(2)
        parsed: list[int] = []
        inside = [0]
        release = threading.Event()  # the two slots are held until the third client has gone
        prepare = env.service._prepare_body

        def counted(body: bytes, chat: bool, ctx: int):
            if len(body) <= huge_at:
                return prepare(body, chat, ctx)
            parsed.append(len(body))
            inside[0] += 1
            try:
                assert release.wait(20.0)
                raise api.ApiError(400, "huge")
            finally:
                inside[0] -= 1

        env.service._prepare_body = counted
        try:
            huge = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
            posts = [asyncio.create_task(env.http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}))
                     for _ in range(2)]
            await _wait_for(lambda: inside[0] == 2, what="both slots taken")
            # a third client sends its whole body, waits for a slot, and goes
            reader, writer = await asyncio.open_connection("127.0.0.1", env.service.port)
            gone = b'{"prompt": "' + b"b" * (5 * 1024 * 1024 + 7) + b'"}'  # its own size: a parse of it is told apart
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(gone) + gone)
            await writer.drain()
            await _wait_for(lambda: Gate.asked == 3, what="the third body waiting for a slot")
            writer.close()
            await writer.wait_closed()
            await _wait_for(lambda: env.service.counters["http.gate_disconnects"] == 1, what="the gone client leaving the line")
            assert inside[0] == 2  # it left while both slots were still taken
            release.set()
            results = await asyncio.gather(*posts)
            assert [r.status_code for r in results] == [400] * 2
            await asyncio.sleep(0.3)  # a slot is free: before, the gone client's body was parsed now
            assert len(gone) not in parsed and len(parsed) == 2, parsed
            assert not env.service._big_gate.locked()
        finally:
            release.set()  # a failed check leaves no thread waiting


@pytest.mark.parametrize("gone_in", ["parse", "route"])
async def test_a_client_gone_before_dispatch_is_never_dispatched(nats_url, tmp_path, gone_in):
    """A client that closes the connection while the router parses and tokenizes its body (or while its
    request waits for a route): before, the disconnect watcher started only after dispatch, so its work was
    sent to a node and then aborted (work for nobody). Now the router sees the disconnect before dispatch: a
    499 that is never read, counted (``http.gone_before_dispatch``), no work and no abort sent, and a request
    already placed is taken off its node's count."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        held_at, release = threading.Event(), threading.Event()
        prepare, route_new = env.service._prepare_body, env.service._route_new

        def held_parse(body: bytes, chat: bool, ctx: int):
            held_at.set()
            release.wait(10.0)  # in a worker thread (the body is over 32 KB): the loop goes on
            return prepare(body, chat, ctx)

        async def held_route(*a, **kw):
            out = await route_new(*a, **kw)
            held_at.set()
            while not release.is_set():  # placed: the node counts it in flight
                await asyncio.sleep(0.01)
            return out

        if gone_in == "parse":
            env.service._prepare_body = held_parse
        else:
            env.service._route_new = held_route
        body = b'{"prompt": [1, 2, 3], "max_tokens": 1' + b" " * 40_000 + b"}"
        reader, writer = await asyncio.open_connection("127.0.0.1", env.service.port)
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-branch-id: g1\r\n"
                         b"content-length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            await _wait_for(held_at.is_set, what=f"its request held in {gone_in}")
            if gone_in == "route":
                assert env.service.core.view.inflight_total == 1
            writer.close()
            await writer.wait_closed()
            await asyncio.sleep(0.05)  # loop turns in which the server reads the close (an EOF ready on its socket)
        finally:
            release.set()
        await _wait_for(lambda: env.service.counters["http.gone_before_dispatch"] == 1 or env.cluster.works, what="the outcome")
        await asyncio.sleep(0.1)
        assert env.cluster.works == [] and env.cluster.aborts == [], (env.cluster.works, env.cluster.aborts)
        assert env.service.counters["http.gone_before_dispatch"] == 1 and not env.service._pending
        assert env.service.core.view.inflight_total == 0
        assert env.service.branches.in_flight_count == 0  # its branch may be evicted (--max-active-branches)
        env.service._prepare_body, env.service._route_new = prepare, route_new
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
        assert r.status_code == 200, r.text  # the next client is served


async def test_sighup_reloads_the_api_keys_file_and_in_flight_requests_go_on(nats_url, tmp_path):
    """Keys could not be rotated or revoked without restarting the router (a newcomer's walk: a restarted router kept
    the keys read at start, and SIGHUP killed it). Now SIGHUP reads ``--api-keys-file`` again: a key taken out is
    refused from the next request on, one added is accepted, a request in flight under the removed key ends as
    served; a file that cannot be read (or holds no key) leaves the keys as they were."""
    import os
    import signal

    from services.router.ingress import key_id
    from shared.subjects import WORK_PREFILL, Subjects

    keys = tmp_path / "keys.txt"
    keys.write_text("k-old\nk-stay\n")
    async with router_env(nats_url, tmp_path, {"c0": "both"}, api_keys_file=str(keys)) as env:
        env.cluster.answering.discard("c0")  # the first request stays in flight until the test answers it
        url = f"http://127.0.0.1:{env.service.port}"
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
            held = asyncio.create_task(http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k-old"}))
            await _wait_for(lambda: len(env.cluster.works) == 1, what="first request dispatched")
            assert env.service.ingress.inflight == {key_id("k-old"): 1}
            keys.write_text("# rotated\nk-new\nk-stay\n")
            os.kill(os.getpid(), signal.SIGHUP)  # the router's handler (its loop runs in this main thread)
            await _wait_for(lambda: env.service.counters["api_keys.reloaded"] == 1, what="keys reloaded")
            assert (await http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k-old"})).status_code == 401
            env.cluster.answering.add("c0")
            for key in ("k-new", "k-stay"):
                r = await http.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, (key, r.text)
            await env.cluster._work(env.cluster.works[0], Subjects("p0").format(WORK_PREFILL, node="c0"))
            r = await held
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
            await _wait_for(lambda: not env.service.ingress.inflight, what="in-flight released")
            keys.write_text("# nothing\n")  # no key: refused, the keys in use stay
            os.kill(os.getpid(), signal.SIGHUP)
            await _wait_for(lambda: env.service.counters["api_keys.reload_failed"] == 1, what="reload refused")
            r = await http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k-new"})
            assert r.status_code == 200, r.text
            # not UTF-8: was a UnicodeDecodeError out of the handler (asyncio "Exception in callback"), not counted
            keys.write_bytes(b"k1\n\xff\xfe bad\n")
            os.kill(os.getpid(), signal.SIGHUP)
            await _wait_for(lambda: env.service.counters["api_keys.reload_failed"] == 2, what="non-UTF-8 reload refused")
            for key, code in (("k-new", 200), ("k1", 401)):
                r = await http.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == code, (key, r.text)
            metrics = (await http.get("/metrics")).text
            assert 'ei_router_api_key_reloads_total{result="ok"} 1.0' in metrics
            assert 'ei_router_api_key_reloads_total{result="failed"} 2.0' in metrics


async def test_sighup_reads_the_reload_file_not_the_start_keys_and_the_stop_leaves_sighup_as_it_found_it(nats_url, tmp_path):
    """``up`` gives its router the keys it checked in ``EI_API_KEYS`` (a restart needs no file: one deleted after the
    start failed every restart) and the file in ``EI_API_KEYS_RELOAD_FILE``, which only SIGHUP reads, with
    ``EI_API_KEYS_RELOAD_KEYS``: the keys at start are replaced, not kept beside the file's. The stop put SIGHUP back
    to its default (asyncio's remove_signal_handler): a SIGHUP while ``python -m services.router`` stopped killed it
    (129); it now puts back what was there before (its ``main``: ignored)."""
    import os
    import signal

    keys = tmp_path / "keys"
    keys.write_text("k-new\n")
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as the router's main leaves it
    try:
        async with router_env(nats_url, tmp_path, {"c0": "both"}, api_keys="k-start,k-gone", api_keys_reload_file=str(keys),
                              api_keys_reload_keys="k-extra") as env:  # fmt: skip
            assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_IGN, signal.SIG_DFL)  # the reload handler
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{env.service.port}", timeout=30.0) as http:
                os.kill(os.getpid(), signal.SIGHUP)
                await _wait_for(lambda: env.service.counters["api_keys.reloaded"] == 1, what="keys reloaded")
                for key, code in (("k-start", 401), ("k-gone", 401), ("k-new", 200), ("k-extra", 200)):
                    r = await http.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
                    assert r.status_code == code, (key, r.text)
                keys.unlink()  # the file gone: the reload fails, the keys in use stay
                os.kill(os.getpid(), signal.SIGHUP)
                await _wait_for(lambda: env.service.counters["api_keys.reload_failed"] == 1, what="reload refused")
                r = await http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k-new"})
                assert r.status_code == 200, r.text
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # was SIG_DFL: a SIGHUP in the stop killed the router
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.mark.parametrize("reload_file", ["k-kept\n", None, b"k-kept\n\xff bad\n"])
async def test_a_router_with_a_reload_file_reads_it_when_its_sighup_handler_is_set(nats_url, tmp_path, capfd, reload_file):
    """A router that ``up`` (re)started just before a SIGUSR1 ignored the SIGHUP it was sent while starting (its
    ``main`` ignores SIGHUP until the handler is set) and served its start keys (``EI_API_KEYS``): a key revoked from
    the file stayed accepted there (reviewer rr-sec2). It now reads ``EI_API_KEYS_RELOAD_FILE`` once when it sets the
    handler; a missing or bad file leaves the start keys, logged; that read is not counted as a SIGHUP reload."""
    import signal

    keys = tmp_path / "keys"
    if isinstance(reload_file, str):
        keys.write_text(reload_file)
    elif reload_file is not None:
        keys.write_bytes(reload_file)
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as the router's main leaves it
    try:
        async with router_env(nats_url, tmp_path, {"c0": "both"}, api_keys="k-kept,k-revoked",
                              api_keys_reload_file=str(keys)) as env:  # fmt: skip
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{env.service.port}", timeout=30.0) as http:
                revoked = 401 if reload_file == "k-kept\n" else 200
                for key, code in (("k-kept", 200), ("k-revoked", revoked)):
                    r = await http.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
                    assert r.status_code == code, (key, r.text)
            assert env.service.counters["api_keys.reloaded"] == env.service.counters["api_keys.reload_failed"] == 0
    finally:
        signal.signal(signal.SIGHUP, before)
    out = "".join(capfd.readouterr())
    if reload_file == "k-kept\n":
        assert "API keys read from the reload file at start" in out and "not read at start" not in out
    else:
        assert "API keys not read at start; the start keys stay" in out
        assert ("No such file" if reload_file is None else "is not UTF-8 text") in out


async def test_other_methods_on_a_generation_path_are_not_counted_as_generation_requests(nats_url, tmp_path):
    """``GET /v1/chat/completions`` (405) and a CORS preflight ``OPTIONS /v1/completions`` (200) were counted in
    ``ei_router_requests_total{code}``, whose HELP says "Generation requests": a 405 read as a refused generation,
    a preflight as a served one. Dynamo's ``dynamo_frontend_requests_total`` and vLLM's request counters count
    generation requests only; these responses are now in ``ei_router_http_responses_total{endpoint,code}`` only."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, allowed_origins=["*"]) as env:
        assert (await env.http.get("/v1/chat/completions")).status_code == 405
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        assert (await env.http.options("/v1/completions", headers=preflight)).status_code == 200
        assert (await env.http.post("/v1/completions", json=BODY)).status_code == 200
        text = (await env.http.get("/metrics")).text
    requests = dict(re.findall(r'^ei_router_requests_total\{code="(\d+)"\} (\S+)$', text, re.M))
    assert requests == {"200": "1.0"}, requests
    assert 'ei_router_http_responses_total{code="405",endpoint="/v1/chat/completions"} 1.0' in text
    assert 'ei_router_http_responses_total{code="200",endpoint="/v1/completions"} 2.0' in text
