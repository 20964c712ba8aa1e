"""A stream ``EI_<partition>`` already on the server that lacks some reliable subjects (the previous version's took
``req.*.out``, not the per-node ``req.*.out.*``; a kept JetStream store; one made by hand), on a real nats-server
(reviewer rr-chunk on 70177aa). Before, only ``auth stream`` checked it: ``up --nats-url`` and the services took
any stream of that name, the request outputs were kept by no stream, the router's JetStream consumer never got them
and every request hung ``request_timeout_s`` (600 s) after READY, with no warning. Now ``up`` exits 1 naming what the
stream lacks and how to mend it, a service logs an error and its ``/readyz`` is 503 saying why (it stays up), and
``auth stream --recreate`` (credentials that may delete it) makes the stream anew."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
from nats.js.api import StreamConfig

from shared.auth import generate
from shared.bus import Bus, StreamLacksSubjects
from shared.natsserver import EmbeddedNatsServer
from shared.service import Readiness
from shared.subjects import ALL, Subjects

REPO = Path(__file__).resolve().parents[2]


def _old_subjects(partition: str) -> list[str]:
    """The previous version's stream subjects: every reliable subject, the outputs as ``req.*.out``."""
    return [Subjects(partition).wildcard(s).replace("req.*.out.*", "req.*.out") for s in ALL if s.reliable]


async def _make_old_stream(url: str, partition: str, auth=None) -> None:
    bus = await Bus.connect(url, Subjects(partition), service="test", instance="admin" if auth else "test", auth=auth)
    try:
        await bus.nc.jetstream(timeout=5.0).add_stream(StreamConfig(name=f"EI_{partition}", subjects=_old_subjects(partition)))
    finally:
        await bus.close()


def _cli(*args: str, tmp_path: Path, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evolving_infra.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
        env={**os.environ, "EI_STATE_DIR": str(tmp_path / "state")},
    )  # fmt: skip


@pytest.mark.timeout(60)
async def test_a_service_bus_finds_a_stream_lacking_subjects_and_says_so_and_the_launcher_refuses_it():
    with EmbeddedNatsServer() as srv:
        await _make_old_stream(srv.url, "p7")
        router = await Bus.connect(srv.url, Subjects("p7"), service="router", instance="router")
        launcher = await Bus.connect(srv.url, Subjects("p7"), service="launcher", instance="launcher")
        try:
            assert await asyncio.wait_for(router.ensure_stream(), 10)  # it goes on (stays up, visible)
            assert "EI_p7" in router.stream_lacking and "'ei.p7.req.*.out.*'" in router.stream_lacking, router.stream_lacking
            assert "--recreate" in router.stream_lacking
            ready = Readiness(srv.url)
            ready.bus, ready.phase = router, "serving"
            assert ready.state() == ("stream", router.stream_lacking)
            with pytest.raises(StreamLacksSubjects, match=r"lacks subjects \['ei\.p7\.req\.\*\.out\.\*'\]"):
                await asyncio.wait_for(launcher.ensure_stream(maker=True), 10)
        finally:
            await router.close()
            await launcher.close()
    with EmbeddedNatsServer() as srv:  # the stream it makes itself, then finds: nothing lacking
        for maker in (True, False):
            bus = await Bus.connect(srv.url, Subjects("p7"), service="launcher", instance="launcher")
            try:
                assert await asyncio.wait_for(bus.ensure_stream(maker=maker), 10) and bus.stream_lacking == ""
            finally:
                await bus.close()


@pytest.mark.timeout(90)
def test_up_with_nats_url_exits_1_on_a_stream_lacking_subjects_before_starting_services(tmp_path):
    with EmbeddedNatsServer() as srv:
        asyncio.run(_make_old_stream(srv.url, "p0"))
        r = _cli("up", "--nats-url", srv.url, "--ready-timeout", "20", "--nodes", "1", "--split", "collocated", "--profile",
                 "tiny", "--port", "0", "--log-dir", str(tmp_path / "logs"), tmp_path=tmp_path, timeout_s=60)  # fmt: skip
    err = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 1, r
    assert len(err) == 1 and "EI_p0 lacks subjects ['ei.p0.req.*.out.*']" in err[0], r.stderr
    assert f"--recreate --nats-url {srv.url}" in err[0], r.stderr
    assert "READY" not in r.stdout, r.stdout
    assert not (tmp_path / "logs" / "router.log").exists()  # nothing started


@pytest.mark.timeout(90)
def test_auth_stream_recreate_replaces_a_stream_lacking_subjects(tmp_path):
    """``auth stream`` names the stream's lack and the fix (exit 1); ``--recreate`` with the launcher's credentials
    (which may not delete it) is exit 1 naming admin.nk; with the admin's, exit 0, and the stream then takes every
    reliable subject (a plain ``auth stream`` and a service find it whole)."""
    creds = generate(tmp_path / "creds", ["router"], partition="p7")
    with EmbeddedNatsServer(auth_block=creds.server_block) as srv:
        asyncio.run(_make_old_stream(srv.url, "p7", creds.auth_for("admin")))
        base = ("auth", "stream", "--nats-url", srv.url, "--partition", "p7", "--timeout", "10")
        r = _cli(*base, "--creds", str(creds.files["launcher"]), tmp_path=tmp_path)
        assert r.returncode == 1 and "lacks subjects ['ei.p7.req.*.out.*']" in r.stderr and "--recreate" in r.stderr, r
        assert "nats stream rm" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r
        r = _cli(*base, "--creds", str(creds.files["launcher"]), "--recreate", tmp_path=tmp_path)
        assert r.returncode == 1 and "not deleted" in r.stderr and "admin.nk" in r.stderr, r
        r = _cli(*base, "--creds", str(creds.files["admin"]), "--recreate", tmp_path=tmp_path)
        assert (r.returncode, r.stdout.strip()) == (0, f"JetStream stream EI_p7 on {srv.url} (made anew)"), r
        r = _cli(*base, "--creds", str(creds.files["launcher"]), tmp_path=tmp_path)
        assert r.returncode == 0, r

        async def router_finds_it_whole() -> str:
            bus = await Bus.connect(srv.url, Subjects("p7"), service="router", instance="router", auth=creds.auth_for("router"))
            try:
                assert await asyncio.wait_for(bus.ensure_stream(), 10)
                return bus.stream_lacking
            finally:
                await bus.close()

        assert asyncio.run(router_finds_it_whole()) == ""


@pytest.mark.timeout(90)
async def test_a_stream_lacking_subjects_found_after_a_reconnect_is_said_as_at_start():
    """The stream was whole at the service's start; the nats-server then comes back (a restart, its store kept) with a
    stream of the same name lacking ``req.*.out.*`` (here deleted and made the old way before the restart; a store
    restored from an older version). The reconnect's stream check finds it anew and says so as the first lookup does:
    :attr:`Bus.stream_lacking` (``/readyz`` 503 with that reason) and one error line. Before, only a service's first
    stream lookup checked the subjects: the service stayed ready while every request's output reached no consumer.
    A second restart (the same stream, the same lack) keeps ``/readyz`` as it is and logs nothing again: one line,
    as documented; before, each reconnect that found the lacking stream logged it again (reviewer rr-sec)."""
    with EmbeddedNatsServer() as srv:
        with structlog.testing.capture_logs() as logs:
            router = await Bus.connect(srv.url, Subjects("p7"), service="router", instance="router")
            checks: list[bool] = []  # each subjects check's log flag: the test knows a reconnect's check ran
            check = router._check_subjects

            def counted(info, *, log: bool) -> bool:
                checks.append(log)
                return check(info, log=log)

            try:
                assert await asyncio.wait_for(router.ensure_stream(), 10) and router.stream_lacking == ""
                router._check_subjects = counted  # type: ignore[method-assign]
                admin = await Bus.connect(srv.url, Subjects("p7"), service="test", instance="test")
                try:
                    js = admin.nc.jetstream(timeout=5.0)
                    await js.delete_stream("EI_p7")
                    await js.add_stream(StreamConfig(name="EI_p7", subjects=_old_subjects("p7")))
                finally:
                    await admin.close()
                assert router.stream_lacking == ""  # nothing tells a connected bus (the test's premise)
                await asyncio.to_thread(srv.restart)
                for _ in range(1000):
                    if router.stream_lacking:
                        break
                    await asyncio.sleep(0.02)
                assert router.counters["nats.reconnects"] >= 1
                assert "EI_p7 lacks subjects ['ei.p7.req.*.out.*']" in router.stream_lacking, router.stream_lacking
                assert "--recreate" in router.stream_lacking
                ready = Readiness(srv.url)
                ready.bus, ready.phase = router, "serving"
                assert ready.state() == ("stream", router.stream_lacking)
                said, n = router.stream_lacking, len(checks)
                assert checks == [True], checks
                await asyncio.to_thread(srv.restart)  # the same lacking stream again
                for _ in range(1000):
                    if len(checks) > n:
                        break
                    await asyncio.sleep(0.02)
                assert checks == [True, True] and router.counters["nats.reconnects"] >= 2, (checks, dict(router.counters))
                assert router.stream_lacking == said and ready.state() == ("stream", said)
            finally:
                await router.close()
        lines = [e for e in logs if e.get("log_level") == "error" and "STREAM LACKS SUBJECTS" in str(e.get("event"))]
        assert len(lines) == 1 and router.stream_lacking in lines[0]["event"], lines
