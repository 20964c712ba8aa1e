"""A router that dies (SIGKILL) or restarts with requests in flight: the workers drop the work
nobody reads any more (``route.held``, ``services/worker/owners.py``). Real nats-server, every
service its own process (``evolving_infra.faultkit``), nothing supervised.

Before ``route.held``, a SIGKILLed router's requests ran on to ``max_tokens`` (a 90,000-token
prefill kept its node busy ~60 s wall at ``--speedup 0.05``, and a new request queued behind it
timed out) and other routers counted them until ``--request-timeout-s``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from pathlib import Path

import httpx
import pytest

from prometheus_client.parser import text_string_to_metric_families

from evolving_infra.faultkit import FaultCluster, FaultSpec
from tests.integration.polling import until

pytestmark = pytest.mark.timeout(120)

WORKERS = ("worker-w0", "worker-w1")
RIDS = ("lost-decode-1", "lost-prefill-1")
"""The ``X-Request-ID`` of :func:`_open_streams`' two streams (the router keeps a valid one as the request's id)."""
DROP_EVENT = "request dropped: its owning router no longer wants it (its stream is lost)"


def _prompt(n: int, base: int) -> list[int]:
    return [(base + i) % 90_000 for i in range(n)]


async def _open_streams(url: str) -> tuple[list[asyncio.Task[None]], list[int]]:
    """Two streams on the router at ``url``: a long decode (tokens flowing) and a long prefill."""
    got = [0, 0]

    async def stream(i: int, body: dict) -> None:
        hdr = {"X-Request-ID": RIDS[i]}
        async with httpx.AsyncClient(timeout=120) as c, c.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=hdr) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    got[i] += 1

    tasks = [
        asyncio.create_task(stream(0, {"prompt": _prompt(300, 11), "max_tokens": 20_000})),
        asyncio.create_task(stream(1, {"prompt": _prompt(60_000, 7), "max_tokens": 20_000})),
    ]
    await until(lambda: got[0] >= 3, 20.0, "tokens of the first stream")
    return tasks, got


async def _held(fc: FaultCluster) -> dict[str, tuple[float, float]]:
    """Per worker: (requests running + waiting, GPU blocks in use)."""
    out = {}
    for w in WORKERS:
        st = await fc.stats(w)
        assert st is not None, w
        out[w] = (st.gauges["running"] + st.gauges["waiting"], st.gauges["gpu_used_blocks"])
    return out


async def _counter(fc: FaultCluster, name: str) -> int:
    total = 0
    for w in WORKERS:
        st = await fc.stats(w)
        assert st is not None, w
        total += st.counters.get(name, 0)
    return total


async def _empty(fc: FaultCluster) -> bool:
    return all(v == (0.0, 0.0) for v in (await _held(fc)).values())


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t


def _free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now (bound to port 0 at once, then closed)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sk in socks:
            sk.bind(("127.0.0.1", 0))
        return [sk.getsockname()[1] for sk in socks]
    finally:
        for sk in socks:
            sk.close()


def _spec(gone_after_s: float) -> FaultSpec:
    # slowed 20x: the requests outlive the test by far unless something drops them; each worker serves /metrics
    ports = _free_ports(len(WORKERS))
    return FaultSpec(
        nodes=2, split="1P1D", speedup=0.05,
        extra={"worker": ["--owner-check-interval-s", "0.5", "--owner-gone-after-s", repr(gone_after_s)],
               **{w: ["--metrics-port", str(p)] for w, p in zip(WORKERS, ports)}},
    )  # fmt: skip


async def _dropped_metric(fc: FaultCluster) -> dict[str, float]:
    """``ei_node_requests_dropped_owner_gone_total`` by ``reason``, summed over the workers' ``/metrics``."""
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=5) as c:
        for w in WORKERS:
            argv = fc.procs[w].argv
            port = argv[argv.index("--metrics-port") + 1]
            text = (await c.get(f"http://127.0.0.1:{port}/metrics")).text
            for fam in text_string_to_metric_families(text):
                for smp in fam.samples:
                    if smp.name == "ei_node_requests_dropped_owner_gone_total":
                        out[smp.labels["reason"]] = out.get(smp.labels["reason"], 0.0) + smp.value
    return out


def _drop_lines(fc: FaultCluster) -> dict[str, dict]:
    """The workers' warnings of a request dropped by the owner check (``--log-format json``), by rid."""
    out: dict[str, dict] = {}
    for w in WORKERS:
        for line in fc.procs[w].log.read_text(errors="replace").splitlines():
            if DROP_EVENT in line:
                rec = json.loads(line)
                assert rec["event"] == DROP_EVENT and rec["rid"] not in out, (rec, out)
                out[rec["rid"]] = {**rec, "worker": w}
    return out


async def _assert_drops_traced(fc: FaultCluster, cause: str, got: list[int]) -> None:
    """Each of the two lost streams has one warning naming its rid, its router and the output tokens it had: the
    decode at least what its client received, the long prefill none. (A worker logs its drops after its check's
    last one: waited for, not read at once.)"""
    with contextlib.suppress(AssertionError):
        await until(lambda: len(_drop_lines(fc)) >= len(RIDS), 5.0, "the workers' drop warnings", every=0.1)
    lines = _drop_lines(fc)
    assert set(lines) == set(RIDS), (lines, fc.log_tail("worker-w0"), fc.log_tail("worker-w1"))
    for rec in lines.values():
        assert rec["level"] == "warning" and rec["router"] == "router" and rec["cause"] == cause, rec
    assert lines[RIDS[0]]["tokens_done"] >= got[0] >= 3 and lines[RIDS[1]]["tokens_done"] == 0, lines
    assert (lines[RIDS[0]]["worker"], lines[RIDS[1]]["worker"]) == ("worker-w1", "worker-w0"), lines


async def test_workers_drop_the_requests_of_a_sigkilled_router(tmp_path: Path) -> None:
    async with FaultCluster(_spec(1.0), tmp_path / "cluster") as fc:
        tasks, got = await _open_streams(fc.router_url())
        try:
            held = await _held(fc)
            assert sum(n for n, _ in held.values()) == 2 and all(b > 0 for _, b in held.values()), held
            assert await _dropped_metric(fc) == {"router_gone": 0.0, "not_in_flight": 0.0}  # exported from 0
            fc.signal("router", signal.SIGKILL)
            # interval 0.5 s + gone after 1 s of no responders: dropped within a few seconds, KV freed
            await until(lambda: _empty(fc), 10.0, "workers dropping the dead router's requests", every=0.25)
            assert await _counter(fc, "owners.router_gone") >= 1
            assert await _counter(fc, "owners.dropped") == 2
            # and the lost streams leave a trace the dead router cannot: a warning each, a counter on /metrics
            await _assert_drops_traced(fc, "router_gone", got)
            assert await _dropped_metric(fc) == {"router_gone": 2.0, "not_in_flight": 0.0}
        finally:
            await _cancel(tasks)


async def test_a_restarted_router_makes_the_workers_drop_its_predecessors_requests(tmp_path: Path) -> None:
    # no-responder grace far beyond the test: only the restarted router's answer can drop them
    async with FaultCluster(_spec(600.0), tmp_path / "cluster") as fc:
        tasks, got = await _open_streams(fc.router_url())
        try:
            fc.signal("router", signal.SIGKILL)
            (fc.workdir / "router.port").unlink()
            fc.restart("router")
            await fc.wait_healthy(30.0)
            await until(lambda: _empty(fc), 10.0, "workers dropping the old router's requests", every=0.25)
            assert await _counter(fc, "owners.dropped") == 2 and await _counter(fc, "owners.router_gone") == 0
            # the restarted router's counters start at 0; the workers' warnings and counter keep the lost streams
            await _assert_drops_traced(fc, "not_in_flight", got)
            assert await _dropped_metric(fc) == {"router_gone": 0.0, "not_in_flight": 2.0}
            st = await fc.stats("router")
            assert st is not None and st.counters.get("held.dropped", 0) >= 2, st
            # and the restarted router serves at once (the prefill node is not busy with dead work)
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(fc.router_url() + "/v1/completions", json={"prompt": _prompt(100, 5), "max_tokens": 4})
            assert r.status_code == 200, r.text
        finally:
            await _cancel(tasks)


async def test_a_retry_with_the_same_request_id_after_a_router_restart_is_not_served_the_old_requests_output(tmp_path: Path) -> None:
    """A client whose router was SIGKILLed retries with the same X-Request-ID on the restarted one
    before the nodes' next owner check. Before: the restarted router knew no earlier attempt of the
    id and dispatched the retry as attempt 0, the attempt the old request still ran at on the decode
    node: that node dropped the retry's hand-off as an old attempt, route.held called the old request
    in flight (same rid, same attempt), and its output (far past the retry's max_tokens) fed the
    retry, which never ended. The owner checks are made rare here so the retry surely comes first
    (with the default 2 s the window is up to 2 s after the restart)."""
    spec = FaultSpec(
        nodes=2, split="1P1D", speedup=0.05,
        extra={"worker": ["--owner-check-interval-s", "60", "--owner-gone-after-s", "600"]},
    )  # fmt: skip
    body = {"prompt": _prompt(300, 11), "max_tokens": 20_000, "stream": True}
    hdr = {"X-Request-ID": "keep-1"}
    async with FaultCluster(spec, tmp_path / "cluster") as fc:
        got = [0]

        async def stream() -> None:
            async with httpx.AsyncClient(timeout=120) as c, c.stream("POST", fc.router_url() + "/v1/completions", json=body, headers=hdr) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        got[0] += 1

        tasks = [asyncio.create_task(stream())]
        try:
            await until(lambda: got[0] >= 3, 20.0, "tokens of the first stream")
            fc.signal("router", signal.SIGKILL)
            (fc.workdir / "router.port").unlink()
            fc.restart("router")
            await fc.wait_healthy(30.0)
            async with httpx.AsyncClient(timeout=40) as c:
                r = await c.post(fc.router_url() + "/v1/completions", json={**body, "max_tokens": 4, "stream": False}, headers=hdr)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4, r.json()
            # the retry superseded the old request on the decode node; nothing of it is left running
            await until(lambda: _empty(fc), 10.0, "workers empty after the retry", every=0.25)
        finally:
            await _cancel(tasks)


async def test_a_sigstopped_router_does_not_stall_the_other_routers_requests_on_its_prefill_node(tmp_path: Path) -> None:
    """1P1D, two routers. router-1's request B waits on prefill node w0 behind router-0's long prompt A; router-1
    is SIGSTOPped; when w0 starts B, B's route.bind gets no reply. A (its prompt completes in the plan B's
    does) and C (router-0, sent meanwhile) are served as if nothing happened; B waits, its KV held, until
    router-1 goes on. Before, w0's step loop waited for B's binding: A and C were answered only when it gave up
    (up to ``owner_gone_after_s``; here ``--bind-timeout-s`` 10 s bounds it: A 11.8 s, C 11.6 s;
    with the defaults, 30 s: A 33.6 s at ``--speedup 0.5``)."""
    spec = FaultSpec(nodes=2, split="1P1D", routers=2, speedup=1.0, extra={"worker": ["--owner-gone-after-s", "8"]})

    async def post(url: str, prompt: list[int]) -> tuple[int, float]:
        async with httpx.AsyncClient(timeout=60) as c:
            t = asyncio.get_running_loop().time()
            r = await c.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4})
            return r.status_code, asyncio.get_running_loop().time() - t

    async def w0(gauge: str) -> float:
        st = await fc.stats("worker-w0")
        return st.gauges.get(gauge, 0.0) if st is not None else 0.0

    async with FaultCluster(spec, tmp_path / "cluster") as fc:
        u0, u1 = fc.router_url(0), fc.router_url(1)
        a = asyncio.create_task(post(u0, _prompt(60_000, 7)))  # ≈ 2 s of prefill on w0
        await until(lambda: w0("running"), 20.0, "A prefilling on w0", every=0.05)
        b = asyncio.create_task(post(u1, _prompt(300, 11)))
        await until(lambda: w0("waiting"), 20.0, "B queued on w0 behind A", every=0.05)
        fc.signal("router-1", signal.SIGSTOP)
        try:
            c = asyncio.create_task(post(u0, _prompt(300, 21)))
            (sa, ta), (sc, tc) = await a, await c
            assert sa == 200 and sc == 200, (sa, sc)
            assert ta < 6.0 and tc < 6.0, f"router-0's requests took {ta:.1f} s and {tc:.1f} s: w0 stalled on router-1's binding"
            st = await fc.stats("worker-w0")
            assert st is not None and st.counters.get("bind.failed", 0) == 0 and not b.done()
        finally:
            fc.signal("router-1", signal.SIGCONT)
        sb, _ = await b
        assert sb == 200
        st = await fc.stats("worker-w0")
        assert st is not None and st.counters["bind.after_prefill"] >= 1, st.counters
