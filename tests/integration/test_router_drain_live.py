"""A SIGTERMed router drains (``--shutdown-grace-s``): the streams it took finish, a new request gets 503.

``python -m services.router`` runs as a process (the signals are its shell's, ``shared.service``) over a real
nats-server; :class:`~tests.integration.test_router_live.FakeCluster` on the test's own NATS connection plays a
collocated node that sends each request's first token and then waits for the test to send the rest. Before, a
SIGTERM failed every open stream at once ("router shutting down"): a rolling restart of the only router lost 49
of its 67 requests in flight (bench/faults.py's walk). SIGINT (Ctrl-C; ``up``'s stop), a second signal during the
drain and ``--shutdown-grace-s 0`` keep that immediate stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import messages as m
from shared.bus import Bus
from shared.subjects import REQ_OUT, ROUTE_BIND, SVC_HEARTBEAT, Subjects
from tests.integration.test_router_live import FakeCluster, output_token, sse_events

REPO = Path(__file__).resolve().parents[2]
STREAMS = 3
MAX_TOKENS = 4

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def _router(
    nats_url: str, tmp_path: Path, *args: str, pd: bool = False
) -> AsyncIterator[tuple[subprocess.Popen[bytes], httpx.AsyncClient, FakeCluster]]:
    """A router process over a fake collocated node c0 (``pd``: prefill node p0 and decode node d0, the decode node
    bound at the prefill's start, ``route.bind``) whose first node stalls every stream after its first token."""
    bus = await Bus.connect(nats_url, Subjects("p0"), service="fake", instance="fake-cluster")
    phases = {"p0": "prefill", "d0": "decode"} if pd else {"c0": "both"}
    cluster = FakeCluster(bus=bus, phases=phases, stall_after_first={next(iter(phases))})
    await cluster.start()
    port_file = tmp_path / "router.port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_")}
    env["PYTHONPATH"] = str(REPO)
    log = tmp_path / "router.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.router", "--nats-url", nats_url, "--port", "0", "--port-file", str(port_file),
         "--model", "m1", "--fence-after-s", "1.5", "--decode-binding", "prefill-start" if pd else "dispatch",
         "--log-format", "json", *args],
        cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "router did not write its port file"
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{int(port_file.read_text())}", timeout=10) as http:
            while (await http.get("/healthz")).status_code != 200:
                assert time.monotonic() < deadline, "router never ready"
                await asyncio.sleep(0.05)
            yield proc, http, cluster
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await cluster.stop()
        await bus.close()


async def _open_streams(http: httpx.AsyncClient, cluster: FakeCluster) -> list[asyncio.Task[str]]:
    """``STREAMS`` streamed completions, returned once each has its first token (then they wait)."""

    async def one(i: int) -> str:
        body = {"prompt": f"hello {i}", "max_tokens": MAX_TOKENS, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            return (await r.aread()).decode()

    tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
    deadline = time.monotonic() + 10
    while len(cluster.stalled) < STREAMS:
        assert time.monotonic() < deadline, f"{len(cluster.stalled)} of {STREAMS} streams opened"
        await asyncio.sleep(0.02)
    return tasks


async def _finish(cluster: FakeCluster, node: str = "c0") -> None:
    """Send every stalled request's remaining tokens, as its (decode) ``node`` would."""
    for w in cluster.works:
        ids = [output_token(i) for i in range(1, MAX_TOKENS)]
        chunk = m.TokenChunk(rid=w.rid, node=node, index=1, token_ids=ids, finished=True, finish_reason="length", attempt=w.attempt)
        await cluster.bus.publish(REQ_OUT, chunk, rid=w.rid)


async def _exited(proc: subprocess.Popen[bytes], within_s: float) -> float:
    """Wall seconds until ``proc`` exits (fails past ``within_s``)."""
    t0 = time.monotonic()
    while proc.poll() is None:
        assert time.monotonic() - t0 < within_s, f"router still running {within_s} s later"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def test_sigterm_drains_open_streams_and_refuses_new_requests(nats_url, tmp_path):
    async with _router(nats_url, tmp_path, "--shutdown-grace-s", "20", pd=True) as (proc, http, cluster):
        beats: list[tuple[float, bool]] = []

        async def on_beat(hb: m.Heartbeat, _subject: str) -> None:
            if hb.service == "router":
                beats.append((time.monotonic(), hb.ready))

        await cluster.bus.subscribe(SVC_HEARTBEAT, on_beat)
        streams = await _open_streams(http, cluster)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        deadline = time.monotonic() + 10
        while (hz := await http.get("/healthz")).status_code == 200:
            assert time.monotonic() < deadline, "healthz still 200 after SIGTERM"
            await asyncio.sleep(0.02)
        assert hz.status_code == 503 and hz.json()["error"]["message"] == "router draining"
        r = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert r.status_code == 503 and "router draining" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
        # Prometheus sees the drain's refusal (before: only /v1/stats' JSON had it), and the other counters this
        # session added, at 0 (nothing of theirs happened here)
        scraped = {s.name: s.value for f in text_string_to_metric_families((await http.get("/metrics")).text) for s in f.samples}
        assert scraped["ei_router_drain_refused_total"] == 1.0, sorted(k for k in scraped if k.startswith("ei_router_"))
        for name in ("ei_router_gone_before_dispatch_total", "ei_router_gate_disconnects_total", "ei_router_branches_active",
                     "ei_router_branches_expired_total", "ei_router_branches_evicted_total", "ei_router_branches_resumed_total",
                     "ei_bus_stream_held_dropped_total", "ei_bus_stream_lookup_retries_total", "ei_nats_permission_violations_total"):
            assert scraped[name] == 0.0, name
        # the router answers route.bind for its requests (their prefill node binding their decode node) meanwhile
        for w in cluster.works:
            assert w.decode_node is None  # bound at the prefill's start
            bind = m.DecodeBindRequest(rid=w.rid, prefill_node="p0", prompt_tokens=w.prompt_tokens, max_tokens=w.max_tokens,
                                       attempt=w.attempt)  # fmt: skip
            reply = await cluster.bus.request(ROUTE_BIND, bind, timeout=5.0, router="router")
            assert reply.rid == w.rid and reply.decode_node == "d0", reply
        deadline = time.monotonic() + 5
        while not any(t > signalled + 1.0 for t, _ in beats):  # heartbeats go on (once a second): not taken for dead
            assert time.monotonic() < deadline, f"no router heartbeat in the drain: {beats} (signal at {signalled})"
            await asyncio.sleep(0.05)
        # ... saying not ready, as /healthz does (before: ready=True through the drain)
        assert not any(ready for t, ready in beats if t > signalled + 1.0), (beats, signalled)
        assert proc.poll() is None and not any(t.done() for t in streams), "the drain ended the open streams"
        await _finish(cluster, "d0")
        bodies = await asyncio.wait_for(asyncio.gather(*streams), 10)
        for body in bodies:
            events = sse_events(body)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), body
            assert events[-2]["choices"][0]["finish_reason"] == "length", body
        assert await _exited(proc, 10) < 10
        assert proc.returncode == 0
        assert not cluster.aborts  # nothing was aborted on the node
    out = (tmp_path / "router.log").read_text()
    assert '"router draining"' in out and '"all done"' in out, out[-3000:]


@pytest.mark.parametrize(
    ("args", "signals"),
    [
        (("--shutdown-grace-s", "20"), (signal.SIGTERM, signal.SIGTERM)),  # a second signal during the drain
        (("--shutdown-grace-s", "20"), (signal.SIGINT,)),  # Ctrl-C, up's stop: no drain
        (("--shutdown-grace-s", "0"), (signal.SIGTERM,)),  # grace 0: today's immediate stop
    ],
    ids=["second-sigterm", "sigint", "grace-0"],
)
async def test_immediate_stop_fails_open_streams(nats_url, tmp_path, args, signals):
    async with _router(nats_url, tmp_path, *args) as (proc, http, cluster):
        streams = await _open_streams(http, cluster)
        for sig in signals:
            proc.send_signal(sig)
            await asyncio.sleep(0.2)
        assert await _exited(proc, 8) < 8
        assert proc.returncode == 0
        for body in await asyncio.wait_for(asyncio.gather(*streams), 10):
            assert "router shutting down" in body, body
        assert {a.rid for _node, a in cluster.aborts} == {w.rid for w in cluster.works}  # their work aborted on the node
