"""Real-bytes host KV pool across two OS processes: a real nats-server, Mooncake's
transfer engine over TCP on loopback (P2PHANDSHAKE, no metadata server).

One process (``demo hold``) puts N blocks with hash-derived payloads into its
registered buffer and answers ``kv.pool.<node>``; another (``demo fetch``)
locates them over NATS, pulls them with ``batch_transfer_sync_read`` and
verifies every block's CRC-32. Skipped, with the reason, when
``mooncake.engine`` does not import (``scripts/install-mooncake.sh`` installs it),
unless ``EI_REQUIRE_MOONCAKE`` is set (CI): then they fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import sys
from pathlib import Path

import msgspec
import pytest

from services.worker.kvpool.demo import demo_hashes
from services.worker.kvpool.payload import expected_checksum
from shared import messages as m
from shared.bus import Bus, BusError
from shared.subjects import KV_POOL, Subjects

REPO = Path(__file__).resolve().parents[2]
SB = 64 * 1024
pytestmark = pytest.mark.timeout(120)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def mooncake_or_skip() -> None:
    """Probe the import in a child process (Mooncake's config is process-wide; keep it out of pytest)."""
    probe = subprocess.run(
        [sys.executable, "-c", "from services.worker.kvpool.transport import load_mooncake; load_mooncake()"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        if os.environ.get("EI_REQUIRE_MOONCAKE"):  # CI sets it: a missing install is a failure there
            pytest.fail(f"EI_REQUIRE_MOONCAKE is set but mooncake.engine does not import: {last}")
        pytest.skip(f"mooncake.engine does not import: {last}")


async def _demo(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.worker.kvpool.demo",
        *args,
        cwd=REPO,
        env=_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        limit=1 << 22,  # a fetch of thousands of blocks prints their hashes on one line (6,000: ~120 KB)
    )


async def _json_line(proc: asyncio.subprocess.Process, timeout: float = 60.0) -> dict:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    if not line:
        err = (await proc.stderr.read()).decode(errors="replace") if proc.stderr else ""
        raise AssertionError(f"demo exited ({await proc.wait()}) without output:\n{err[-3000:]}")
    return json.loads(line)


class Holder:
    """``demo hold`` in its own process; stop() sends SIGTERM and returns its final stats line."""

    def __init__(
        self, url: str, node: str, blocks: int, corrupt: int = 0, slot_bytes: int = SB, ready_timeout_s: float = 60.0
    ) -> None:
        self.args = ["hold", "--nats-url", url, "--node", node, "--blocks", str(blocks), "--slot-bytes", str(slot_bytes)]
        self.args += ["--corrupt", str(corrupt)]
        self.ready_timeout_s = ready_timeout_s
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: dict = {}

    async def __aenter__(self) -> "Holder":
        """Start ``demo hold`` and wait up to ``ready_timeout_s`` for its ready line; a start that fails (a timeout,
        another line, a cancel) kills and reaps the process before it raises (no ``__aexit__`` follows it)."""
        self.proc = await _demo(*self.args)
        try:
            self.ready = await _json_line(self.proc, timeout=self.ready_timeout_s)
            assert self.ready["event"] == "ready", self.ready
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def stop(self) -> dict:
        assert self.proc is not None
        self.proc.terminate()
        final = await _json_line(self.proc, timeout=30)
        assert await asyncio.wait_for(self.proc.wait(), 30) == 0
        return final

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def test_a_holder_that_never_gets_ready_leaves_no_process(monkeypatch):
    """A holder whose start fails (no ready line within its timeout; a start that raises) is killed and reaped,
    not left running behind the failed test: ``async with`` calls no ``__aexit__`` when ``__aenter__`` raised."""
    started: list[asyncio.subprocess.Process] = []

    async def never_ready(*_args: str) -> asyncio.subprocess.Process:
        started.append(await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; time.sleep(60)",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))  # fmt: skip
        return started[-1]

    monkeypatch.setitem(globals(), "_demo", never_ready)
    try:
        with pytest.raises(asyncio.TimeoutError):
            async with Holder("nats://127.0.0.1:1", "never", 1, ready_timeout_s=0.5):
                raise AssertionError("not ready: the body must not run")
        assert len(started) == 1 and started[0].returncode is not None  # killed and waited for
    finally:
        for proc in started:  # before the fix: this test's own process, not left behind either
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def _fetch(url: str, node: str, peer: str, blocks: int, slot_bytes: int = SB) -> tuple[int, dict]:
    proc = await _demo("fetch", "--nats-url", url, "--node", node, "--peer", peer, "--blocks", str(blocks), "--slot-bytes", str(slot_bytes))
    out = await _json_line(proc)
    return await asyncio.wait_for(proc.wait(), 30), out


async def test_two_processes_every_fetched_block_checksum_matches(nats_url, mooncake_or_skip):
    n = 96
    async with Holder(nats_url, "hold-a", n) as holder:
        assert holder.ready["hashes"] == demo_hashes(0, n)
        rc, res = await _fetch(nats_url, "fetch-b", "hold-a", n)
        final = await holder.stop()
    assert rc == 0, res
    assert res["error"] is None
    assert res["fetched"] == demo_hashes(0, n)  # all of them, in order
    assert res["missing"] == [] and res["mismatched"] == []
    assert res["verified"] is True
    assert res["local_verify_ok"] is True  # landed bytes re-checked against the hash-derived CRC
    assert res["bytes"] == n * SB
    assert res["counters"]["kvpool.fetch_blocks"] == n
    assert "kvpool.fetch_mismatch" not in res["counters"]
    assert final["counters"]["kvpool.locate_hit"] == n  # the holder served exactly one locate of n blocks


async def test_a_fetch_of_thousands_of_blocks_loses_none(nats_url, mooncake_or_skip):
    """A Claude Code prefix is thousands of blocks (100k tokens: 1,600 at 64 a block); the fifth fault walk's
    peer fetches moved up to 6,000 at once. Mooncake's TCP transport rejects what does not fit its lane queue
    (2,048): in one batch, 6,000 blocks from this live, idle peer came back with 581-1,377 missing (``transfer``)
    and their one-by-one retries failed in the same full queue. Read in batches of ``READ_BATCH``, none is lost."""
    n = 6000
    async with Holder(nats_url, "hold-many", n, slot_bytes=256) as holder:
        rc, res = await _fetch(nats_url, "fetch-many", "hold-many", n, slot_bytes=256)
        await holder.stop()
    assert rc == 0, res
    assert res["error"] is None
    assert res["reasons"] == {} and res["missing"] == [], (res["reasons"], len(res["missing"]))
    assert res["fetched"] == demo_hashes(0, n)
    assert res["local_verify_ok"] is True


PULLER = """
import asyncio, json, sys
from services.worker.kvpool.demo import demo_hashes
from services.worker.kvpool.transport import pick_port_range, set_port_range
from shared.bus import Bus
from shared.subjects import Subjects

async def main(url, peer, ports):
    set_port_range(*(tuple(map(int, ports.split("-"))) if ports else pick_port_range()))
    from services.worker.kvpool.pool import HostKvPool
    bus = await Bus.connect(url, Subjects("p0"), service="worker", instance="kvpool-puller")
    pool = HostKvPool("puller", bus, num_slots=256, slot_bytes=%d)
    await pool.start()
    for line in iter(sys.stdin.readline, ""):
        res = await pool.fetch(peer, demo_hashes(int(line), 32))
        print(json.dumps({"fetched": len(res.fetched), "reasons": res.reasons, "error": res.error,
                          "read_engines": pool.stats()[1]["kvpool.read_engines"]}), flush=True)
    await pool.stop()
    await bus.close()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""))
""" % SB
"""A pool that stays up and fetches 32 blocks of chain ``seed`` from ``peer`` for each ``seed`` line on its stdin
(its Mooncake connection to the peer stays open between fetches, as a worker's). Its Mooncake port range: the third
argument (``lo-hi``), else two free ports."""


async def test_a_holder_killed_mid_service_starts_again_in_the_port_range_up_gives_it(nats_url, mooncake_or_skip, tmp_path):
    """``up --kv-pool real`` keeps each worker's ``--kv-pool-ports`` across a restart. SIGKILLed while a peer's
    connection to it was open, the worker's ports stay in TIME_WAIT: in a two-port range (as up gave before) its
    next process could not initialise Mooncake (-1), restart after restart (the fifth fault walk: w1 restarted 4
    times in 31 s). In the range up gives now it starts at once, and the peer reads from it again."""
    import argparse

    from evolving_infra.launcher import _kv_pool_values
    from evolving_infra.cluster import ClusterSpec

    args = argparse.Namespace(kv_pool="real", kv_pool_slot_bytes=SB, engine="sim", nodes=1)
    ports = _kv_pool_values(args, ClusterSpec(profile="tiny"), one_host=True)["node_args"]["w0"][1]  # type: ignore[index]
    hold = ["hold", "--nats-url", nats_url, "--node", "hk", "--blocks", "32", "--slot-bytes", str(SB), "--ports", ports]
    first = await _demo(*hold)
    puller = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PULLER, nats_url, "hk", cwd=REPO, env=_env(),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)  # fmt: skip
    second = None
    try:
        assert (await _json_line(first))["event"] == "ready"
        assert puller.stdin is not None
        puller.stdin.write(b"0\n")
        got = await _json_line(puller)
        assert got["fetched"] == 32, got  # a connection open from the puller to the holder
        first.kill()
        await first.wait()
        second = await _demo(*hold[:-4], "--seed", "1", "--slot-bytes", str(SB), "--ports", ports)
        ready = await _json_line(second)  # before: the demo exited with TransferError (initialize returned -1)
        assert ready["event"] == "ready", ready
        puller.stdin.write(b"1\n")
        again = await _json_line(puller, timeout=30)
        # read from, or refused at once when the new process took its predecessor's RPC port (stale_session)
        assert again["fetched"] == 32 or again["reasons"] == {"stale_session": 32}, again
    finally:
        for proc in (first, second, puller):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_holder_restarted_on_its_predecessors_session_is_read_again_without_a_restart_here(nats_url, mooncake_or_skip):
    """A holder SIGKILLed and started again on its predecessor's RPC port (the Mooncake session the puller read from;
    up keeps a worker's port range, and the fifth fault walk saw a restart take the same port 1 time in 31). The
    puller's transfer engine keeps the dead process's segment for that session (Mooncake 0.3.13, no call to drop it):
    before, every later fetch from it was refused (``stale_session``, 32 blocks recomputed) until the puller restarted
    too. Now it reads the new process with another transfer engine of its own process. About 65 s, most of it waiting
    for the killed holder's RPC port to leave TIME_WAIT."""
    from services.worker.kvpool.transport import pick_port_range

    lo, _ = pick_port_range(width=4, low=20000, high=25999)

    async def hold(seed: int, ports: str) -> asyncio.subprocess.Process:
        return await _demo("hold", "--nats-url", nats_url, "--node", "hr", "--blocks", "32", "--slot-bytes", str(SB),
                           "--seed", str(seed), "--ports", ports)  # fmt: skip

    first = await hold(0, f"{lo + 1}-{lo + 2}")  # Mooncake takes the RPC port and the data port in it at random
    procs: list[asyncio.subprocess.Process] = [first]
    try:
        ready = await _json_line(first)
        assert ready["event"] == "ready", ready
        session = ready["session"]
        rpc = int(session.rsplit(":", 1)[1])
        # the next process's range holds the RPC port and a fresh one, not the data port. Both ports of the killed
        # process stay in TIME_WAIT for about 60 s (Linux), its RPC port too: no process starts on it before
        again_ports = f"{lo + 2}-{lo + 3}" if rpc == lo + 2 else f"{lo}-{lo + 1}"
        plo, phi = pick_port_range(width=8, low=26000)  # room for a second engine's two ports (up gives a worker 32)
        puller = await asyncio.create_subprocess_exec(
            sys.executable, "-c", PULLER, nats_url, "hr", f"{plo}-{phi}", cwd=REPO, env=_env(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)  # fmt: skip
        procs.append(puller)
        assert puller.stdin is not None
        puller.stdin.write(b"0\n")
        got = await _json_line(puller)
        assert got["fetched"] == 32 and got["read_engines"] == 1, got
        first.kill()
        await first.wait()
        deadline = time.monotonic() + 150
        while True:  # until a start takes its predecessor's RPC port (each takes either port of its range for it)
            if time.monotonic() > deadline:
                pytest.fail(f"no holder started again on session {session} in 150 s")
            second = await hold(1, again_ports)
            procs.append(second)
            try:
                ready2 = await _json_line(second)
            except AssertionError:  # initialize -1: the port is still in TIME_WAIT
                await asyncio.sleep(2.0)
                continue
            if ready2.get("session") == session:
                break
            second.kill()
            await second.wait()
        puller.stdin.write(b"1\n")
        again = await _json_line(puller, timeout=30)
        # before: {'fetched': 0, 'reasons': {'stale_session': 32}} until the puller restarted
        assert again["fetched"] == 32 and again["reasons"] == {} and again["read_engines"] == 2, again
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_corrupted_block_is_detected_and_not_used(nats_url, mooncake_or_skip):
    n = 48
    async with Holder(nats_url, "hold-c", n, corrupt=3) as holder:
        corrupted = holder.ready["corrupted"]
        assert len(corrupted) == 3
        rc, res = await _fetch(nats_url, "fetch-d", "hold-c", n + 8)  # 8 blocks the holder never had
        await holder.stop()
    hashes = demo_hashes(0, n + 8)
    assert rc == 0 and res["error"] is None
    assert sorted(res["mismatched"]) == sorted(corrupted)
    assert res["verified"] is False
    assert res["fetched"] == [h for h in hashes[:n] if h not in corrupted]
    assert sorted(res["missing"]) == sorted(corrupted + hashes[n:])
    assert res["reasons"] == {"mismatch": 3, "not_held": 8}
    assert res["counters"]["kvpool.fetch_mismatch"] == 3
    assert res["local_verify_ok"] is True


async def test_locate_protocol_and_bad_requests(nats_url, mooncake_or_skip):
    """The NATS side alone: offsets, CRCs, misses, refusals, and a malformed payload that changes nothing."""
    n = 16
    async with Holder(nats_url, "hold-e", n) as holder:
        hashes = holder.ready["hashes"]
        bus = await Bus.connect(nats_url, Subjects("p0"), service="test", instance="test")
        try:
            subj = Subjects("p0").format(KV_POOL, node="hold-e")
            await bus.publish_raw(subj, b"\xc1 not msgpack")
            await bus.publish_raw(subj, msgspec.msgpack.encode({"node": "hold-e", "block_hashes": "nope"}))
            rep = await bus.request(KV_POOL, m.PoolLocate(node="hold-e", block_hashes=[hashes[3], 12345, hashes[0]]), node="hold-e")
            assert rep.error is None
            assert rep.session == holder.ready["session"] and rep.base_addr == holder.ready["base_addr"]
            assert rep.slot_bytes == SB and rep.checksum_algo == "crc32" and rep.payload == "synthetic"
            assert rep.offsets[1] == -1 and rep.checksums[1] == 0
            assert rep.offsets[0] >= 0 and rep.offsets[0] % SB == 0 and rep.offsets[0] != rep.offsets[2]
            assert rep.checksums[0] == expected_checksum(hashes[3], SB)
            assert rep.checksums[2] == expected_checksum(hashes[0], SB)
            # A locate naming another node is refused at the bus edge, answered at once with the reason.
            t0 = time.monotonic()
            with pytest.raises(BusError, match="refused.*node"):
                await bus.request(KV_POOL, m.PoolLocate(node="someone-else", block_hashes=[1]), node="hold-e", timeout=10.0)
            assert time.monotonic() - t0 < 5.0
            big = await bus.request(KV_POOL, m.PoolLocate(node="hold-e", block_hashes=list(range(5000))), node="hold-e")
            assert big.error and "4096" in big.error
        finally:
            await bus.close()
        final = await holder.stop()
    assert final["counters"]["kvpool.locate"] == 1
    assert final["counters"]["kvpool.locate_refused"] == 1


async def test_fetch_from_an_absent_peer_reports_an_error(nats_url, mooncake_or_skip):
    rc, res = await _fetch(nats_url, "fetch-f", "nobody", 4)
    assert rc == 4
    assert res["error"] and "no reply" in res["error"]
    assert res["fetched"] == [] and len(res["missing"]) == 4 and res["reasons"] == {"error": 4}


def test_a_burst_of_stop_signals_ends_a_holder_with_0_and_no_traceback(mooncake_or_skip, nats_url, tmp_path):
    """``demo hold`` sent bursts of SIGTERM (:func:`tests.stop_burst.send_stop_bursts`: a plain ``scancel``, a
    script's kill loop): the first stops it, the rest are ignored: its ``stopped`` line, status 0, no traceback.
    Before, one that landed while ``asyncio.run`` closed the loop, or just after, killed it (-15 in 5 of 5)."""
    from tests.stop_burst import send_stop_bursts

    log = tmp_path / "hold.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.worker.kvpool.demo", "hold", "--nats-url", nats_url,
                                 "--node", "burst", "--blocks", "2"], cwd=REPO, env=_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while '"ready"' not in log.read_text():  # its handlers are set
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.02)
        send_stop_bursts(proc)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert rc == 0 and '"stopped"' in text and "Exception ignored" not in text and "Traceback" not in text, (rc, text[-2000:])
