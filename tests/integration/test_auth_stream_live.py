"""``evolving-infra auth stream`` creates the partition's JetStream stream as the launcher, on a real
nats-server with ``auth gen``'s permissions: a deployment outside ``up`` (Slurm, compose) needs it,
as no service identity may create the stream there and each would wait for it at start. A service's credentials are refused (exit 1, one line); a missing file is a usage error (2)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared import messages as m
from shared.auth import generate
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import KV_EVENTS, REQ_OUT, Subjects

REPO = Path(__file__).resolve().parents[2]


def auth_stream(url: str, creds: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evolving_infra.cli", "auth", "stream", "--nats-url", url, "--partition", "p7",
         "--creds", creds, "--timeout", "10"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )


def test_auth_stream_creates_the_stream_the_services_then_find(tmp_path):
    creds = generate(tmp_path / "creds", ["planner", "kvdirectory", "router", "worker-w0"], partition="p7")
    server = EmbeddedNatsServer(auth_block=creds.server_block).start()
    try:
        r = auth_stream(server.url, str(creds.files["router"]))  # a service may not create it
        assert r.returncode == 1 and "no JetStream stream" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r

        r = auth_stream(server.url, str(creds.files["launcher"]))
        assert (r.returncode, r.stdout.strip()) == (0, f"JetStream stream EI_p7 on {server.url}"), r
        assert auth_stream(server.url, str(creds.files["launcher"])).returncode == 0  # idempotent

        async def router_finds_it() -> bool:
            bus = await Bus.connect(server.url, Subjects("p7"), service="router", instance="router", auth=creds.auth_for("router"))
            try:
                return await bus.ensure_stream()
            finally:
                await bus.close()

        assert asyncio.run(router_finds_it())

        r = auth_stream(server.url, str(tmp_path / "missing.nk"))
        assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r
    finally:
        server.stop()


def test_auth_stream_refuses_a_bad_partition_or_timeout_before_connecting(tmp_path):
    """A partition that is not one subject token, and a --timeout that is not a number of seconds > 0,
    are one 'error:' line and exit 2 (usage), before any connection. Before: --partition a.b was a
    ValueError traceback (exit 1); --timeout 0 said 'no connection to URL in 0 s' (exit 1, a server up)
    and --timeout nan waited on."""
    server = EmbeddedNatsServer().start()
    try:
        for args in (["--partition", "a.b"], ["--partition", ""], ["--timeout", "0"], ["--timeout", "-1"], ["--timeout", "nan"]):
            r = subprocess.run(
                [sys.executable, "-m", "evolving_infra.cli", "auth", "stream", "--nats-url", server.url, *args],
                cwd=REPO, capture_output=True, text=True, timeout=60,
            )
            assert r.returncode == 2, (args, r)
            assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1 and not r.stdout, (args, r)
    finally:
        server.stop()


def test_auth_stream_refuses_a_stream_that_does_not_take_every_reliable_subject(tmp_path):
    """A stream EI_<partition> already there (another version's, a persisted JetStream store, made by
    hand) that lacks some reliable subjects is exit 1 naming what it lacks: publishes there would not
    be kept, so the must-arrive guarantee is silently gone. Before: exit 0 ('JetStream stream EI_p7'),
    as 'found' was enough. A stream with every subject is still found (exit 0)."""
    from nats.js.api import StreamConfig

    server = EmbeddedNatsServer().start()
    try:

        async def make(subjects: list[str]) -> None:
            bus = await Bus.connect(server.url, Subjects("p7"), service="test", instance="test")
            try:
                await bus.nc.jetstream(timeout=5.0).add_stream(StreamConfig(name="EI_p7", subjects=subjects))
            finally:
                await bus.close()

        asyncio.run(make(["ei.p7.work.>"]))
        r = auth_stream(server.url, "")
        assert r.returncode == 1 and "EI_p7" in r.stderr and "lacks" in r.stderr, r
        assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout, r
    finally:
        server.stop()
    server = EmbeddedNatsServer().start()
    try:
        assert auth_stream(server.url, "").returncode == 0  # created with every subject
        assert auth_stream(server.url, "").returncode == 0  # then found
    finally:
        server.stop()


def test_covers_is_nats_subject_matching_of_patterns():
    from shared.bus import covers

    assert covers("ei.p0.>", "ei.p0.work.*.prefill") and covers("ei.p0.work.*.prefill", "ei.p0.work.*.prefill")
    assert covers("ei.*.work.*.prefill", "ei.p0.work.*.prefill") and covers("ei.p0.work.>", "ei.p0.work.*.prefill")
    assert not covers("ei.p0.work.w1.prefill", "ei.p0.work.*.prefill")  # one node's, not every node's
    assert not covers("ei.p0.work.*", "ei.p0.work.*.prefill") and not covers("ei.p0.work.*.prefill.>", "ei.p0.work.*.prefill")
    assert not covers("ei.p0.*", "ei.p0.>") and not covers("ei.p1.>", "ei.p0.work.*.prefill") and not covers("ei.p0.work.>", "ei.p0.work")


@pytest.mark.timeout(60)
async def test_a_service_started_before_the_stream_waits_for_it_then_consumes_through_jetstream(tmp_path):
    """A service that starts before the launcher made the stream (compose starts it beside the one-shot
    ``stream`` job; a nats-server back without its store) finds no stream and may not make it. Before, its
    first reliable subscription fell back to core NATS for the bus's whole life (one warning), so a message
    published while it was reconnecting was lost. Now it waits (a warning at once) and, once the launcher
    made the stream, consumes through JetStream: a chunk published while the router is still away after a
    nats-server SIGKILL and restart arrives once it is back."""
    creds = generate(tmp_path / "creds", ["router", "worker-w0"], partition="p7")
    with EmbeddedNatsServer(auth_block=creds.server_block) as srv:
        subj = Subjects("p7")
        router = await Bus.connect(srv.url, subj, service="router", instance="router", auth=creds.auth_for("router"))
        worker = await Bus.connect(srv.url, subj, service="worker", instance="worker-w0", auth=creds.auth_for("worker-w0"))
        launcher = None
        got: list[int] = []

        async def on_chunk(c: m.TokenChunk, _s: str) -> None:
            got.append(c.index)

        async def until(done, what: str, within_s: float = 8.0) -> None:
            end = time.monotonic() + within_s
            while not done():
                assert time.monotonic() < end, f"no {what} in {within_s} s: got {got}, router {dict(router.counters)}"
                await asyncio.sleep(0.05)

        try:
            subscribing = asyncio.create_task(router.subscribe(REQ_OUT, on_chunk))
            # a bus whose first reliable act is a publish waits a moment, then searches on in the background
            publishing = asyncio.create_task(worker.publish(KV_EVENTS, m.KvEventBatch(node="w0", seq=1), node="w0"))
            await asyncio.sleep(1.0)
            assert not subscribing.done()  # the router waits for the stream: its start is held back
            launcher = await Bus.connect(srv.url, subj, service="launcher", instance="launcher", auth=creds.auth_for("launcher"))
            assert await launcher.ensure_stream()
            await asyncio.wait_for(subscribing, 8.0)
            assert router.jetstream, "the router fell back to core NATS"
            assert router.counters["stream_missing_warnings"] == 1  # at once, then each STREAM_BACK_WAIT_S
            await asyncio.wait_for(publishing, 8.0)
            assert worker.jetstream, "the worker fell back to core NATS"
            await worker.publish(REQ_OUT, m.TokenChunk(rid="r", node="w0", index=0, token_ids=[0]), rid="r", node="w0")
            await until(lambda: got == [0], "first chunk")

            router.nc.options["reconnect_time_wait"] = 3.0  # the router comes back after the worker published
            os.kill(srv.pid, signal.SIGKILL)
            srv.proc.wait()
            await until(lambda: not router.nc.is_connected and not worker.nc.is_connected, "disconnect")
            await asyncio.sleep(0.3)  # each client's first reconnect attempt failed: the router's next is 3 s away
            srv.restart()
            await until(lambda: worker.nc.is_connected, "worker reconnect")
            for _ in range(50):  # JetStream reads its store a moment after the port opens
                try:
                    await worker.nc.jetstream(timeout=1.0).stream_info("EI_p7")
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            assert not router.nc.is_connected
            await worker.publish(REQ_OUT, m.TokenChunk(rid="r", node="w0", index=1, token_ids=[1]), rid="r", node="w0")
            await worker.flush()
            await until(lambda: len(got) >= 2, "the chunk published while the router was away")
            await asyncio.sleep(0.3)
            assert got == [0, 1], got
        finally:
            for bus in (router, worker, launcher):
                if bus is not None:
                    await bus.close()


# A server without JetStream (not a missing stream) falls back at once, without a wait warning:
# test_bus_stream_lookup_live.py::test_a_server_without_jetstream_still_makes_the_bus_fall_back_at_once.


async def test_a_create_the_server_refuses_for_overlapping_subjects_is_named_in_the_wait_warning():
    """A bus that may make the stream (here no auth; ``up``'s launcher) but whose create the server refuses
    because another stream already takes the partition's subjects waits like one that may not (a821ec1). Its
    warning said "until the launcher makes it" with ``error=BadRequestError()`` (nats-py's API errors have an
    empty repr): nothing named the overlap, and ``up`` (the launcher itself) hung on it. Now the warning
    names the server's reason and the fix, and the wait ends once the other stream is gone."""
    import structlog
    from nats.js.api import StreamConfig

    with EmbeddedNatsServer() as srv, structlog.testing.capture_logs() as logs:
        other = await Bus.connect(srv.url, Subjects("p7"), service="x", instance="x")
        bus = await Bus.connect(srv.url, Subjects("p7"), service="launcher", instance="launcher")
        try:
            await other.nc.jetstream(timeout=5.0).add_stream(StreamConfig(name="OTHER", subjects=["ei.p7.>"]))
            ensuring = asyncio.create_task(bus.ensure_stream())
            end = time.monotonic() + 5.0
            while not bus.counters["stream_missing_warnings"]:
                assert time.monotonic() < end and not ensuring.done(), dict(bus.counters)
                await asyncio.sleep(0.05)
            warned = [e for e in logs if e.get("log_level") == "warning" and e.get("stream") == "EI_p7"]
            assert len(warned) == 1, warned
            text = f"{warned[0]['event']} {warned[0]['error']}"
            assert "overlap" in text and "delete that stream or use another partition" in text, text
            assert "until the launcher makes it" not in text, text  # the launcher may: the server refuses the config
            await other.nc.jetstream(timeout=5.0).delete_stream("OTHER")
            assert await asyncio.wait_for(ensuring, 5.0) and bus.jetstream
        finally:
            await bus.close()
            await other.close()


def test_auth_stream_names_the_servers_reason_when_it_refuses_the_create(tmp_path):
    """A create the server answers with a refusal (here another stream already takes ei.p7.>: err_code 10065)
    is exit 1 with the server's reason and the fix. Before: 'no JetStream stream (JetStream off, or these
    credentials may not create it ...)', which sent one to the credentials, and the bus's warning showed
    the reason as BadRequestError() (nats-py's API errors have an empty repr)."""
    from nats.js.api import StreamConfig

    server = EmbeddedNatsServer().start()
    try:

        async def other() -> None:
            bus = await Bus.connect(server.url, Subjects("p7"), service="test", instance="test")
            try:
                await bus.nc.jetstream(timeout=5.0).add_stream(StreamConfig(name="OTHER", subjects=["ei.p7.>"]))
            finally:
                await bus.close()

        asyncio.run(other())
        r = auth_stream(server.url, "")
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and not r.stdout, r
        assert "EI_p7" in r.stderr and "overlap" in r.stderr and "err_code 10065" in r.stderr, r
        assert "delete that stream or use another partition" in r.stderr and "credentials" not in r.stderr, r
    finally:
        server.stop()


@pytest.mark.timeout(60)
async def test_a_service_waiting_for_the_stream_answers_liveness_and_says_why_it_is_not_ready():
    """While a service's start waits for the stream (here the server refuses the create: another stream takes
    ei.p7.>), its metrics port answers /healthz 200 (liveness) and /readyz 503 naming the stream, then /readyz
    200 once the start completed. Before, the port opened only after start: a liveness probe (Kubernetes)
    saw a dead service and would restart it in a loop."""
    import httpx
    from nats.js.api import StreamConfig

    from services.kvdirectory.config import DirectoryConfig
    from services.kvdirectory.service import DirectoryService
    from shared.service import serve_until_stopped

    with EmbeddedNatsServer() as srv:
        other = await Bus.connect(srv.url, Subjects("p7"), service="test", instance="test")
        stop = asyncio.Event()
        task = None
        try:
            await other.nc.jetstream(timeout=5.0).add_stream(StreamConfig(name="OTHER", subjects=["ei.p7.>"]))
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cfg = DirectoryConfig(nats_url=srv.url, partition="p7", metrics_port=port, metrics_host="127.0.0.1")
            task = asyncio.create_task(serve_until_stopped("kvdirectory", cfg, DirectoryService, instance="kvdirectory", stop_event=stop))
            async with httpx.AsyncClient(timeout=2.0) as http:
                url = f"http://127.0.0.1:{port}"
                end = time.monotonic() + 10.0
                while True:
                    assert time.monotonic() < end and not task.done(), "the metrics port did not open while start waited"
                    try:
                        live = await http.get(url + "/healthz")
                        break
                    except httpx.TransportError:
                        await asyncio.sleep(0.05)
                assert live.status_code == 200, live
                assert (await http.get(url + "/metrics")).status_code == 200  # its registry is read before start too
                ready = await http.get(url + "/readyz")
                assert ready.status_code == 503 and ready.json() == {
                    "status": "not ready", "reason": "waiting for the JetStream stream EI_p7"}, ready.text  # fmt: skip
                await other.nc.jetstream(timeout=5.0).delete_stream("OTHER")
                end = time.monotonic() + 10.0
                while (ready := await http.get(url + "/readyz")).status_code != 200:
                    assert time.monotonic() < end and not task.done(), ready.text
                    await asyncio.sleep(0.1)
                assert (await http.get(url + "/healthz")).status_code == 200
        finally:
            stop.set()
            if task is not None:
                await asyncio.wait_for(task, 10)
            await other.close()


async def test_auth_stream_says_the_server_did_not_answer_when_the_lookup_times_out(monkeypatch, capsys):
    """The stream lookup gets no answer in time (a hung or loaded JetStream: here a server without JetStream where a
    silent client takes the lookup, so nats-py waits, as it does for a SIGSTOPped server): ``auth stream`` says the
    server did not answer in N s (exit 1, as its --help documents for a stream that cannot be made). Before, it said
    'no JetStream stream (JetStream off, or these credentials may not create it: the launcher's may)', naming two
    causes that were not it; a service's log said reliable subjects fall back to core NATS."""
    import argparse

    from evolving_infra.auth_cli import cmd_stream

    monkeypatch.setattr("shared.bus.STREAM_LOOKUP_TIMEOUT_S", 0.5)  # the 5 s, shorter for the test
    monkeypatch.setattr("shared.log.setup_logging", lambda *a, **k: None)  # the command's, process-wide otherwise
    with EmbeddedNatsServer(jetstream=False) as srv:
        hung = await Bus.connect(srv.url, Subjects("p7"), service="test", instance="hung")
        try:

            async def silent(_msg: object) -> None:  # takes the lookup, never answers
                return None

            await hung.nc.subscribe("$JS.API.STREAM.INFO.EI_p7", cb=silent)
            await hung.flush()  # Bus.flush: nats-py's writes its PING ahead of the queued SUB
            args = argparse.Namespace(partition="p7", timeout=10.0, nats_url=srv.url, creds="", recreate=False)
            t0 = time.monotonic()
            rc = await asyncio.to_thread(cmd_stream, args)
            waited = time.monotonic() - t0
        finally:
            await hung.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, (rc, err)
    assert "did not answer" in err[0] and "0.5 s" in err[0] and "JetStream off" not in err[0], err
    assert waited < 5.0, waited
