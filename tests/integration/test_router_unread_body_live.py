"""A non-streamed response whose client never reads its body holds no request state, live (session 52's check).

A stream has a send watch (``--stream-stall-timeout-s``) because its request stays pending while its sends wait.
A non-streamed response is made whole once its output is in, and its request is forgotten (``_forget``: its branch's
request done, its unread output released) before the body is handed to the HTTP server, whose one body send writes
it to the connection's buffer without waiting for the client. So a client that never reads holds no pending request,
no branch in flight and no unread output; the body's bytes wait in the connection's write buffer (bounded by the
response's size) until it reads or goes. Real nats-server and router; workers played by ``FakeCluster``."""

from __future__ import annotations

import asyncio
import socket

import msgspec
import pytest

from tests.integration.test_router_live import _wait_for, router_env

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
