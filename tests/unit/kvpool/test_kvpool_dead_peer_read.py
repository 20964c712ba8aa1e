"""A Mooncake read that never returns (its peer died mid-read) holds only a thread of its own (fifth fault walk).

Measured with two processes (holder SIGKILLed 0.4 s into a 6,000-block read): the read ran past ``fetch_timeout_s``
(10 s, the fetch failed ``timeout`` and the pages were recomputed, as designed) but never returned: Mooncake 0.3.13's
TCP lane reconnects to the dead data port with backoff, 6,000 slots still pending 26 s later. The read ran in
``asyncio.to_thread``, so each such read kept a thread of the loop's default executor (min(32, cores + 4): 6 on 2
cores) for good; past that every later read waited behind them (a timeout each, nothing ever fetched again) and so
did the loop's ``getaddrinfo`` (a NATS reconnect). Now each read has a thread of its own: 40 reads stuck at once
leave the default executor free, each fetch still fails at its timeout, their slots stay reserved until they return,
and ``kvpool.reads_in_flight`` counts them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from services.worker.kvpool.payload import expected_checksum
from services.worker.kvpool.pool import READ_BATCH, STUCK_READS_WARN, HostKvPool
from shared import messages as m

SB = 128
STUCK = 40
"""More than the default executor's threads on any machine (at most 32)."""


class _DeadPeer:
    """Mooncake stand-in whose reads block until ``release`` is set (a peer that died mid-read)."""

    protocol = "tcp"
    session = "127.0.0.1:1"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = 0

    def register(self, memory: object) -> None:
        pass

    def unregister(self, addr: int) -> None:
        pass

    def read(self, session, local, remote, lengths) -> int:
        self.started += 1
        self.release.wait(30)
        return -1

    def read_one(self, session, local, remote, length) -> int:
        return -1


async def _locate(peer, want):
    return m.PoolLocation(node=peer, session="127.0.0.1:27951", base_addr=0x7F0000000000, slot_bytes=SB,
                          block_hashes=list(want), offsets=[i * SB for i in range(len(want))],
                          checksums=[expected_checksum(h, SB) for h in want])  # fmt: skip


def test_reads_stuck_on_a_dead_peer_leave_the_default_executor_free():
    ep = _DeadPeer()
    pool = HostKvPool("b", None, num_slots=4 * STUCK, slot_bytes=SB, endpoint=ep, fetch_timeout_s=0.3)  # type: ignore[arg-type]
    pool.locate = _locate  # type: ignore[method-assign]

    async def main() -> None:
        try:
            results = await asyncio.gather(*(pool.fetch("a", [1000 + i]) for i in range(STUCK)))
            assert all(r.reasons == {"timeout": 1} for r in results)  # each bounded by fetch_timeout_s
            assert ep.started == STUCK and pool.stats()[1]["kvpool.reads_in_flight"] == STUCK
            assert pool.stats()[1]["kvpool.reads_stuck"] == STUCK
            assert pool.buffer.occupancy()["pending"] == STUCK  # still the stuck reads' targets
            # the loop's default executor (getaddrinfo, to_thread) still runs at once
            assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 2.0) == "free"
            assert (await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo("127.0.0.1", 4222), 2.0))
        finally:
            ep.release.set()
        for _ in range(200):  # the reads return (failed): their threads end, their slots are freed
            if pool.stats()[1]["kvpool.reads_in_flight"] == 0:
                break
            await asyncio.sleep(0.02)
        assert pool.stats()[1]["kvpool.reads_in_flight"] == 0 and pool.stats()[1]["kvpool.reads_stuck"] == 0
        assert pool.buffer.occupancy()["pending"] == 0

    asyncio.run(main())


def test_a_read_thread_that_cannot_start_fails_the_fetch_and_frees_its_slots(monkeypatch):
    """``Thread.start`` raises ``RuntimeError`` (the process's thread limit) after the plan reserved slots: the fetch
    fails (``no_thread``), counted, its slots freed and ``kvpool.reads_in_flight`` back to 0; nothing escapes."""
    ep = _DeadPeer()
    ep.release.set()
    pool = HostKvPool("b", None, num_slots=8, slot_bytes=SB, endpoint=ep, fetch_timeout_s=0.3)  # type: ignore[arg-type]
    pool.locate = _locate  # type: ignore[method-assign]

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    r = asyncio.run(pool.fetch("a", [1, 2, 3]))
    assert r.reasons == {"no_thread": 3} and r.missing == (1, 2, 3) and "can't start new thread" in (r.error or "")
    assert pool.counters["fetch_failed.no_thread"] == 1 and pool.counters["fetch_errors"] == 1
    assert pool.buffer.occupancy()["pending"] == 0 and pool.stats()[1]["kvpool.reads_in_flight"] == 0
    assert ep.started == 0
    assert pool._readers[0].read_from == {}  # no read was issued: the session is not marked as read from


class _SlowBatches(_DeadPeer):
    """Each batch read takes ``delay`` s and succeeds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def read(self, session, local, remote, lengths) -> int:
        self.started += 1
        time.sleep(self.delay)
        return 0


def test_a_timed_out_read_starts_no_further_batch():
    ep = _SlowBatches(0.2)
    pool = HostKvPool("b", None, num_slots=4 * READ_BATCH, slot_bytes=SB, endpoint=ep, fetch_timeout_s=0.1)  # type: ignore[arg-type]
    pool.locate = _locate  # type: ignore[method-assign]

    async def main() -> None:
        r = await pool.fetch("a", list(range(1, 4 * READ_BATCH + 1)))
        assert r.reasons == {"timeout": 4 * READ_BATCH}
        for _ in range(200):
            if pool.stats()[1]["kvpool.reads_in_flight"] == 0:
                break
            await asyncio.sleep(0.02)
        assert pool.stats()[1]["kvpool.reads_in_flight"] == 0 and pool.buffer.occupancy()["pending"] == 0

    asyncio.run(main())
    assert ep.started == 1  # the batch under way when the fetch gave up, not the other three


def test_reads_stuck_past_the_threshold_are_logged_once(caplog):
    ep = _DeadPeer()
    pool = HostKvPool("b", None, num_slots=64, slot_bytes=SB, endpoint=ep, fetch_timeout_s=0.05)  # type: ignore[arg-type]
    pool.locate = _locate  # type: ignore[method-assign]

    async def main() -> None:
        try:
            for i in range(STUCK_READS_WARN + 2):
                await pool.fetch("a", [500 + i])
        finally:
            ep.release.set()

    with caplog.at_level(logging.WARNING, logger="services.worker.kvpool.pool"):
        asyncio.run(main())
    warned = [r for r in caplog.records if "kvpool.reads_stuck" in r.getMessage()]
    assert len(warned) == 1 and f"{STUCK_READS_WARN} Mooncake reads past fetch_timeout_s" in warned[0].getMessage()


def test_reads_in_flight_that_are_not_stuck_are_not_warned_of(caplog):
    """Concurrent reads that return within the timeout are load, not stuck reads: no warning, ``reads_stuck`` 0."""
    ep = _SlowBatches(0.05)
    pool = HostKvPool("b", None, num_slots=64, slot_bytes=SB, endpoint=ep, fetch_timeout_s=5.0)  # type: ignore[arg-type]
    pool.locate = _locate  # type: ignore[method-assign]

    async def main() -> None:
        seen = []

        async def watch() -> None:
            for _ in range(20):
                seen.append(pool.stats()[1]["kvpool.reads_in_flight"])
                await asyncio.sleep(0.005)

        await asyncio.gather(watch(), *(pool.fetch("a", [700 + i]) for i in range(2 * STUCK_READS_WARN)))
        assert max(seen) >= STUCK_READS_WARN and pool.stats()[1]["kvpool.reads_stuck"] == 0

    with caplog.at_level(logging.WARNING, logger="services.worker.kvpool.pool"):
        asyncio.run(main())
    assert not [r for r in caplog.records if "kvpool.reads_stuck" in r.getMessage()]
