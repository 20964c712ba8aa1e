"""``evolving-infra auth stream`` creates the partition's JetStream stream as the launcher, on a real
nats-server with ``auth gen``'s permissions: a deployment outside ``up`` (Slurm, compose) needs it,
as no service identity may create the stream there and each would fall back to core NATS (at most
once). A service's credentials are refused (exit 1, one line); a missing file is a usage error (2)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from shared.auth import generate
from shared.bus import Bus
from shared.natsserver import EmbeddedNatsServer
from shared.subjects import Subjects

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
    from evolving_infra.auth_cli import covers

    assert covers("ei.p0.>", "ei.p0.work.*.prefill") and covers("ei.p0.work.*.prefill", "ei.p0.work.*.prefill")
    assert covers("ei.*.work.*.prefill", "ei.p0.work.*.prefill") and covers("ei.p0.work.>", "ei.p0.work.*.prefill")
    assert not covers("ei.p0.work.w1.prefill", "ei.p0.work.*.prefill")  # one node's, not every node's
    assert not covers("ei.p0.work.*", "ei.p0.work.*.prefill") and not covers("ei.p0.work.*.prefill.>", "ei.p0.work.*.prefill")
    assert not covers("ei.p0.*", "ei.p0.>") and not covers("ei.p1.>", "ei.p0.work.*.prefill") and not covers("ei.p0.work.>", "ei.p0.work")
