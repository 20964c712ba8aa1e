"""Clients that do not read their streams (``--max-buffered-output-tokens``), live.

Real nats-server and router; workers played by ``FakeCluster`` of ``test_router_live``, which sends a
request's whole output at once. A stream whose client does not read fills its socket and the HTTP
server's write buffer; the rest waited in the router's per-request queue with no bound across
requests (40 readers stalled 25 s on 8,000-token streams grew the router from 65 to 75 MB). Now the
router holds at most ``--max-buffered-output-tokens`` unread: beyond, the request with the most unread
tokens is aborted on its node, its client gets an error event when it reads on, or its connection is
reset after ``--slow-client-grace-s``; a client that reads is served whole. Under the cap, a send that waits
``--stream-stall-timeout-s`` for its client (one that reads nothing) aborts the request; a slow reader is served.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
import time
from typing import Any

import msgspec
import pytest
from shared import messages as m
from shared.subjects import REQ_OUT

from services.router.config import RouterConfig
from services.router.service import RouterService
from tests.integration.test_router_live import _wait_for, output_token, router_env, sse_events

pytestmark = pytest.mark.timeout(60)

CAP = 8_000
"""--max-buffered-output-tokens of the test's router."""
STALLED_TOKENS = 6_000
"""max_tokens of A and B, streams that are not read: one alone fits under CAP, two do not."""
BIG_TOKENS = 12_000
"""max_tokens of C, a stream that is not read: more than CAP alone."""
SSE_BYTES_PER_TOKEN = 74
"""Bytes a token of a stream of the test's router takes on the wire (measured: 60,497 for 819 tokens, 3 a chunk)."""
GRACE_S = 1.0
"""--slow-client-grace-s of the test's routers."""
STALL_S = 1.0
"""--stream-stall-timeout-s of the stalled-stream test's router (the cap test keeps the default, 120 s: a stall
watch bounded by GRACE_S raced its cap aborts, and aborted A first when B's request came a second late)."""


async def _stalled_stream(
    svc: RouterService, rid: str, max_tokens: int = STALLED_TOKENS, *, usage: bool = False, **extra: Any
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream request whose client does not read: a 4 KiB receive buffer, nothing read after the request
    (``usage``: the stream's last chunk has its ``usage``; ``extra``: more request fields).

    The router's end of its connection gets a 16 KiB send buffer: on loopback (64 KiB segments) the kernel's
    send-buffer autotuning took ~3.5 MB (57,000 of 60,000 tokens here) of a stalled stream before the
    router held any, which a test of a few seconds cannot outrun; elsewhere the kernel's part is as bounded
    (net.ipv4.tcp_wmem), and it is not the router's memory."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window it offers stays small
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", svc.port))
    here = sock.getsockname()
    assert svc._server is not None

    def server_end() -> Any:
        for proto in svc._server.server_state.connections:  # type: ignore[union-attr]
            if proto.transport.get_extra_info("peername") == here:
                return proto.transport.get_extra_info("socket")
        return None

    await _wait_for(lambda: server_end() is not None, what="connection accepted")
    server_end().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)  # it stops reading the socket at 2 KiB unread
    body = msgspec.json.encode({"prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True,
                                **({"stream_options": {"include_usage": True}} if usage else {}), **extra})  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"x-request-id: {rid}\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n")  # fmt: skip
    writer.write(head.encode() + body)
    await writer.drain()
    return reader, writer


async def _read_rest(reader: asyncio.StreamReader) -> tuple[bytes, bool]:
    """Everything until the connection ends: (bytes, True when it was reset rather than closed)."""
    out = bytearray()
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 16), timeout=10):
            out += chunk
    except ConnectionResetError:
        return bytes(out), True
    return bytes(out), False


async def test_stalled_streams_are_aborted_at_the_cap_and_a_reader_is_served_whole(nats_url, tmp_path):
    assert RouterConfig().stream_stall_timeout_s > 30 * GRACE_S  # the stall watch does not race the cap's aborts
    async with router_env(
        nats_url, tmp_path, {"c0": "both"}, max_buffered_output_tokens=CAP, slow_client_grace_s=GRACE_S
    ) as env:
        svc, cluster = env.service, env.cluster
        cluster.gpu_blocks = {"c0": 1000}  # 64,000 tokens: room for every request here
        await cluster.publish_states()
        await _wait_for(lambda: svc.core.view.nodes["c0"].state.gpu_total_blocks == 1000, what="states applied")
        most = 0

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, svc.buffered_output_tokens)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())

        def held(rid: str) -> int:
            """Unread output tokens of ``rid`` once its node ended it, else 0."""
            p = svc._pending.get(rid)
            return p.unread if p is not None and p.done else 0

        # A's whole output comes, most of it unread; then B's: past the cap A, the most unread, is aborted,
        # not B, whose chunk crossed it
        a = await _stalled_stream(svc, "stall-a")
        await _wait_for(lambda: held("stall-a") > STALLED_TOKENS // 2, what="A's output held")
        b = await _stalled_stream(svc, "stall-b")
        await _wait_for(lambda: svc.counters["slow_client_aborts"] == 1, what="A aborted")
        unread = {rid: q.unread for rid, q in svc._pending.items()}
        assert unread.get("stall-a", 0) == 0 and unread["stall-b"] > 0, unread
        # A reads on (within the grace): what its connection held, then the error event and the end
        raw, reset = await _read_rest(a[0])
        assert not reset and b"client too slow: " in raw and b"output tokens unread" in raw, raw[-400:]
        assert raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), raw[-400:]
        # C (more than the cap alone) and a reader at once: past the cap B (done, all unread) goes, then C,
        # still running, is aborted on its node; the reader is served whole
        await _wait_for(lambda: held("stall-b") > STALLED_TOKENS // 2, what="B's output held")
        c = await _stalled_stream(svc, "stall-c", max_tokens=BIG_TOKENS)
        t0 = time.monotonic()
        r = await env.http.post(
            "/v1/completions", json={"prompt": [4, 5], "max_tokens": 1000, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 1000, events[-3:]
        assert not any("error" in e for e in events[:-1])
        await _wait_for(lambda: svc.counters["slow_client_aborts"] == 3, what="B and C aborted")
        assert sorted(msg.rid for _, msg in cluster.aborts) == ["stall-c"]  # A and B had ended on their node
        assert cluster.aborts[0][1].reason == "client too slow"
        # B does not read within the grace: its connection is reset (what the kernel had taken, then the end)
        await asyncio.sleep(max(0.0, GRACE_S + 0.2 - (time.monotonic() - t0)))
        await _wait_for(lambda: svc.counters["slow_client_resets"] == 2, what="B and C reset")
        raw, _ = await _read_rest(b[0])
        assert b"client too slow" not in raw and b"[DONE]" not in raw
        watcher.cancel()
        # the cap held throughout, and every aborted request's output is let go
        assert most <= CAP and svc.buffered_output_tokens == 0, (most, svc.buffered_output_tokens)
        metrics = (await env.http.get("/metrics")).text
        assert "ei_router_slow_client_aborts_total 3.0" in metrics and "ei_router_buffered_output_tokens 0.0" in metrics
        # all three, as their clients saw them (an error event, or a reset): A and B too, which their node had ended
        # (counted served, length, before: their end was counted at their last chunk, not when their response ended)
        assert svc.counters["finish.abort"] == 3, dict(svc.counters)
        for _, w in (a, b, c):
            w.close()


@pytest.mark.parametrize("node_running", [False, True], ids=["node-done", "node-running"])
async def test_a_stalled_stream_under_the_cap_is_aborted_after_the_stall_timeout(nats_url, tmp_path, node_running):
    """A client that keeps its stream's connection open and stops reading, whose unread tail is far under
    ``--max-buffered-output-tokens``: the router's send to it waits for the socket to drain, which never happens.
    Before, nothing ended it: its request stayed pending (its branch never idle), its output held, for as long as
    the client kept the connection (measured: still pending 3 grace periods on, and the router's stop waited out
    uvicorn's 5 s). Now a send that makes no progress for ``--stream-stall-timeout-s`` (here STALL_S, the grace far
    longer: the stall bound is its own) aborts the request as too slow (counted once, ``finish.abort``; a node still
    producing it is told to drop it) and resets its connection.
    ``node_running``: its node has not ended it (the test sends its output, 3 tokens a chunk, and no end)."""
    async with router_env(
        nats_url, tmp_path, {"c0": "both"}, slow_client_grace_s=30.0, stream_stall_timeout_s=STALL_S
    ) as env:
        svc, cluster = env.service, env.cluster
        cluster.gpu_blocks = {"c0": 1000}
        if node_running:
            cluster.answering.clear()
        await cluster.publish_states()
        await _wait_for(lambda: svc.core.view.nodes["c0"].state.gpu_total_blocks == 1000, what="states applied")
        assert svc.cfg.max_buffered_output_tokens > STALLED_TOKENS  # the cap never acts here
        reader, writer = await _stalled_stream(svc, "stall-under")
        if node_running:
            await _wait_for(lambda: len(cluster.works) == 1, what="work dispatched")
            w = cluster.works[0]
            for i in range(0, STALLED_TOKENS, 3):
                ids = [output_token(i + k) for k in range(3)]
                await env.bus.publish(REQ_OUT, m.TokenChunk(rid=w.rid, node="c0", index=i, token_ids=ids, prompt_tokens=3,
                                                            attempt=w.attempt), rid=w.rid, node="c0")  # fmt: skip
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.startswith(b"HTTP/1.1 200"), head
        first = await asyncio.wait_for(reader.readuntil(b"\n\n"), timeout=10)  # one chunk read, then no more
        assert b"data: " in first, first

        def held() -> int:
            """Its unread output tokens once all came (its node's end, or the test's last chunk)."""
            p = svc._pending.get("stall-under")
            return p.unread if p is not None and p.out_tokens >= STALLED_TOKENS else 0

        await _wait_for(lambda: held() > STALLED_TOKENS // 2, what="the output held")
        stalled = svc._pending["stall-under"]
        assert stalled.done is not node_running
        t0 = time.monotonic()
        await _wait_for(lambda: "stall-under" not in svc._pending, what="the stalled request ended", timeout=3 * STALL_S + 2)
        waited = time.monotonic() - t0
        assert waited < 2 * STALL_S + 1, waited
        # its end is counted when its response's call returns (_close_stream), which may come just after it left _pending
        await _wait_for(lambda: svc.counters.get("finish.abort", 0) >= 1, what="its end counted", timeout=5)
        assert svc.counters["slow_client_aborts"] == 1 and svc.counters["slow_client_resets"] == 1, dict(svc.counters)
        assert svc.counters["finish.abort"] == 1 and svc.buffered_output_tokens == 0, dict(svc.counters)
        assert svc.counters["aborts.slow_client"] == int(node_running), dict(svc.counters)
        # a node still on it is told to drop it (its KV freed); one that had ended it is told nothing
        await _wait_for(lambda: len(cluster.aborts) == int(node_running), what="the node told")
        assert [(n, a.rid, a.reason) for n, a in cluster.aborts] == ([("c0", "stall-under", "client too slow")] if node_running else [])
        # its connection ends (what the kernel had taken, then the end; a read waits 10 s at most)
        raw, _ = await _read_rest(reader)
        assert b"[DONE]" not in raw, raw[-200:]
        # the router serves on
        cluster.answering.add("c0")
        r = await env.http.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 50, "stream": True})
        assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
        assert svc.counters["slow_client_aborts"] == 1 and svc.counters["finish.abort"] == 1
        # a request counted as it failed (this one, aborted) whose send waits again: its connection is reset,
        # nothing aborted or counted again
        resets: list[int] = []
        ended = dataclasses.replace(stalled, slow=False, reset=lambda: resets.append(1) is None)
        svc._send_stalled(ended)
        assert resets == [1] and svc.counters["slow_client_resets"] == 2
        assert svc.counters["slow_client_aborts"] == 1 and svc.counters["finish.abort"] == 1
        writer.close()


ECHO_TOKENS = 40_000
"""Prompt tokens of the echoed stream: its one data chunk (prompt text and finish) is ~280 KB, far past the 64 KiB
write buffer uvicorn pauses at, the 16 KiB send buffer and the 4 KiB window the client offers."""


@pytest.mark.parametrize("usage", [False, True], ids=["done-stalls", "usage-stalls"])
async def test_a_stall_after_the_finish_chunk_with_real_uvicorn_aborts_the_request_as_too_slow(nats_url, tmp_path, usage):
    """The review's recipe (session 52), real uvicorn: a completion with ``echo``, a large prompt and ``max_tokens``
    1, so its finish chunk is the one big data chunk, and a client that reads nothing. uvicorn writes that chunk
    into its buffer and pauses; the next send (the usage chunk, or ``[DONE]``) waits for the drain before it writes,
    past ``--stream-stall-timeout-s``; the reset drops the buffer: the client never gets the finish chunk nor
    ``[DONE]``. Before (2c62a96), the request was counted ``finished.length`` with no slow-client abort, as if its
    client had its end; now a too-slow-client abort (``slow_client_aborts`` 1, ``finish.abort`` 1)."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, slow_client_grace_s=30.0, stream_stall_timeout_s=0.5) as env:
        svc, cluster = env.service, env.cluster
        cluster.gpu_blocks = {"c0": 100_000}
        await cluster.publish_states()
        await _wait_for(lambda: svc.core.view.nodes["c0"].state.gpu_total_blocks == 100_000, what="states applied")
        prompt = [10 + (k % 5000) for k in range(ECHO_TOKENS)]
        reader, writer = await _stalled_stream(svc, "stall-echo", 1, usage=usage, prompt=prompt, echo=True)
        try:
            await _wait_for(lambda: svc.counters["slow_client_resets"] == 1, what="the connection reset", timeout=10)
            await _wait_for(lambda: "stall-echo" not in svc._pending, what="the request forgotten")
            # counted when its response's call returns (_close_stream), which may come just after it left _pending
            await _wait_for(lambda: svc.counters.get("finish.abort", 0) >= 1, what="its end counted", timeout=5)
            c = dict(svc.counters)
            assert c.get("slow_client_aborts") == 1 and c.get("finish.abort") == 1, c
            assert "finished.length" not in c and svc.buffered_output_tokens == 0, c
            raw, _ = await _read_rest(reader)  # what the kernel had taken, then the reset
            assert b"[DONE]" not in raw and b'"finish_reason":"length"' not in raw, raw[-200:]
        finally:
            writer.close()


@pytest.mark.parametrize(
    ("rate", "stall_s"), [(32_768, None), (65_536, 2.0)], ids=["32KiB/s-default-timeout", "64KiB/s-2s-timeout"]
)
async def test_a_slow_reader_is_served_whole(nats_url, tmp_path, rate, stall_s):
    """A client that reads its stream steadily at ``rate`` bytes/s, slower than the output comes. uvicorn pauses a
    send once its write buffer passes 64 KiB and resumes it under 16 KiB: each paused send waits while ~48 KiB drain
    (~1.5 s at 32 KiB/s, ~0.75 s at 64 KiB/s). Before, the stall watch was bounded by ``--slow-client-grace-s``
    (GRACE_S here, 1 s; the default 10 s cut a client reading 4 KB/s the same way): the 32 KiB/s reader was aborted
    and its connection reset mid-stream. Now the watch has its own bound, ``--stream-stall-timeout-s``: its default
    (120 s) and a 2-s one serve such readers whole, nothing aborted; the read takes ~5 s."""
    kw = {} if stall_s is None else {"stream_stall_timeout_s": stall_s}
    async with router_env(nats_url, tmp_path, {"c0": "both"}, slow_client_grace_s=GRACE_S, **kw) as env:
        svc, cluster = env.service, env.cluster
        cluster.gpu_blocks = {"c0": 1000}
        await cluster.publish_states()
        await _wait_for(lambda: svc.core.view.nodes["c0"].state.gpu_total_blocks == 1000, what="states applied")
        tokens = rate * 5 // SSE_BYTES_PER_TOKEN
        reader, writer = await _stalled_stream(svc, "slow-reader", max_tokens=tokens, usage=True)
        got = bytearray()
        t0 = time.monotonic()
        try:
            while chunk := await asyncio.wait_for(reader.read(4096), timeout=10):
                got += chunk
                ahead = t0 + len(got) / rate - time.monotonic()  # paced to `rate` bytes/s
                if ahead > 0:
                    await asyncio.sleep(ahead)
        except ConnectionResetError:
            pytest.fail(f"reset after {len(got)} bytes, {time.monotonic() - t0:.1f} s; counters {dict(svc.counters)}")
        took = time.monotonic() - t0
        writer.close()
        assert b"too slow" not in got and got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), got[-400:]
        assert re.findall(rb'"completion_tokens":(\d+)', got) == [str(tokens).encode()], got[-400:]  # served whole
        # it read slower than the output came, twice uvicorn's 64 KiB high-water mark and more: sends were paused on it
        assert took > 4.0 and len(got) > 2 * 65_536, (took, len(got))
        assert svc.counters["slow_client_aborts"] == 0 and svc.counters["slow_client_resets"] == 0, dict(svc.counters)


async def test_a_zero_stall_timeout_never_aborts_a_stalled_stream(nats_url, tmp_path):
    """``--stream-stall-timeout-s 0``: no send is timed; a stream whose client keeps the connection open and reads
    nothing stays pending (its output held) well past what STALL_S would allow, nothing aborted, until the client
    closes its connection; then it ends as a client disconnect does."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, slow_client_grace_s=GRACE_S, stream_stall_timeout_s=0.0) as env:
        svc, cluster = env.service, env.cluster
        cluster.gpu_blocks = {"c0": 1000}
        await cluster.publish_states()
        await _wait_for(lambda: svc.core.view.nodes["c0"].state.gpu_total_blocks == 1000, what="states applied")
        reader, writer = await _stalled_stream(svc, "stall-off")
        await _wait_for(lambda: (p := svc._pending.get("stall-off")) is not None and p.done, what="its output came")
        await asyncio.sleep(3 * STALL_S)
        p = svc._pending.get("stall-off")
        assert p is not None and p.unread > 0 and not p.slow, p
        assert svc.counters["slow_client_aborts"] == 0 and svc.counters["slow_client_resets"] == 0, dict(svc.counters)
        writer.close()
        await _wait_for(lambda: "stall-off" not in svc._pending, what="the stream ended with its connection", timeout=10)
        assert svc.counters["slow_client_aborts"] == 0 and svc.buffered_output_tokens == 0, dict(svc.counters)
