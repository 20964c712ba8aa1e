"""A non-streamed response whose client never reads its body holds no request state, and one behind it on the same
keep-alive connection is reset after ``--stream-stall-timeout-s``, live (session 52's checks).

A stream has a send watch (``--stream-stall-timeout-s``) because its request stays pending while its sends wait.
A non-streamed response is made whole once its output is in, and its request is forgotten (``_forget``: its branch's
request done, its unread output released) before the body is handed to the HTTP server, whose one body send writes
it to the connection's buffer without waiting for the client (uvicorn waits for the drain before it writes a
message, not after). So a client that never reads holds no pending request, no branch in flight and no unread
output; the body's bytes wait in the connection's write buffer (bounded by the response's size) until it reads or
goes. But the NEXT response on that keep-alive connection (a pipelined request) waits in its first send for that
drain: before, with no timeout, holding its ASGI task and its body until the client read or left (session 52's
review: after 8 s a task still in ``run_asgi``). Now every response's sends are timed as a stream's: a generation
request's stalled response is aborted as too slow (``slow_client_aborts``, ``finish.abort``), any other response's
connection is reset (``http.send_stall_resets``). Real nats-server and router; workers played by ``FakeCluster``."""
from __future__ import annotations

import asyncio
import socket

import msgspec
import pytest

from tests.integration.test_router_live import _wait_for, router_env

ECHO_TOKENS = 40_000
"""Prompt tokens of the first, echoed response: a ~280 KB body, far past uvicorn's 64 KiB write-buffer mark."""

pytestmark = pytest.mark.timeout(60)

TOKENS = 20_000
"""max_tokens of the unread response: ~140 KB of JSON (measured: 140,524 bytes), far past what a 4 KiB read window takes (~6 KB read)."""


async def test_a_client_that_never_reads_a_big_non_streamed_body_leaves_nothing_pending(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service
        env.cluster.gpu_blocks = {"c0": 1000}
        await env.cluster.publish_states()
        await _wait_for(lambda: svc.core.view.nodes["c0"].state.gpu_total_blocks == 1000, what="states applied")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", svc.port))
        body = msgspec.json.encode({"prompt": [1, 2, 3], "max_tokens": TOKENS})
        head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                f"x-request-id: unread-body\r\nx-branch-id: unread-branch\r\ncontent-length: {len(body)}\r\n\r\n")  # fmt: skip
        await asyncio.get_running_loop().sock_sendall(sock, head.encode() + body)
        try:
            await _wait_for(lambda: svc.counters["finished.length"] == 1, what="the request finished")
            await _wait_for(lambda: "unread-body" not in svc._pending, what="the request forgotten")
            # nothing of it is held but the body's bytes in the connection: the branch has no request in flight
            # (its TTL runs), no unread output counts toward --max-buffered-output-tokens
            b = svc.branches._active["unread-branch"]
            assert b.in_flight == 0 and svc.buffered_output_tokens == 0
            assert svc.counters["slow_client_aborts"] == 0
            # the client did not read its body: most of it still waits (a 4 KiB read window)
            got = sock.recv(1 << 20)
            size = int(got.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            assert size > 4 * len(got), (size, len(got))
        finally:
            sock.close()


@pytest.mark.parametrize("second", ["completion", "metrics"])
async def test_a_response_behind_an_unread_body_on_a_keep_alive_connection_is_reset_after_the_stall_timeout(
    nats_url, tmp_path, second
):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, stream_stall_timeout_s=0.5) as env:
        svc = env.service
        env.cluster.gpu_blocks = {"c0": 100_000}
        await env.cluster.publish_states()
        await _wait_for(lambda: svc.core.view.nodes["c0"].state.gpu_total_blocks == 100_000, what="states applied")
        assert svc._server is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", svc.port))
        here = sock.getsockname()

        def server_end() -> socket.socket | None:
            for proto in svc._server.server_state.connections:  # type: ignore[union-attr]
                if proto.transport.get_extra_info("peername") == here:
                    return proto.transport.get_extra_info("socket")
            return None

        await _wait_for(lambda: server_end() is not None, what="connection accepted")
        server_end().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # type: ignore[union-attr]  # as test_router_slow_clients_live
        big = msgspec.json.encode({"prompt": [10 + k % 5000 for k in range(ECHO_TOKENS)], "max_tokens": 1, "echo": True})
        head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                f"x-request-id: big-body\r\ncontent-length: {len(big)}\r\n\r\n").encode() + big  # fmt: skip
        if second == "completion":
            small = msgspec.json.encode({"prompt": [4, 5], "max_tokens": 2})
            head += (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     f"x-request-id: behind\r\ncontent-length: {len(small)}\r\n\r\n").encode() + small  # fmt: skip
        else:
            head += b"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
        await asyncio.get_running_loop().sock_sendall(sock, head)
        try:
            await _wait_for(lambda: svc.counters["slow_client_resets"] == 1, what="the connection reset", timeout=10)
            await _wait_for(lambda: not svc._pending, what="nothing pending")
            # no response task is left waiting on the connection (before: one stayed in run_asgi until the client left)
            await _wait_for(lambda: all(t.done() for t in svc._server.server_state.tasks), what="the tasks ended")  # type: ignore[union-attr]
            c = dict(svc.counters)
            assert c.get("finished.length") == 1, c  # the big body's request: its one body send did not wait
            if second == "completion":  # its response never reached its client: a too-slow-client abort
                assert c.get("slow_client_aborts") == 1 and c.get("finish.abort") == 1, c
                assert "http.send_stall_resets" not in c, c
            else:
                assert c.get("http.send_stall_resets") == 1 and "slow_client_aborts" not in c, c
        finally:
            sock.close()
