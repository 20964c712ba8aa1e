"""A peer that restarted on the Mooncake session its predecessor had is read with another transfer engine of this
process, or refused at once when no more may be made; never read with the engine that read its predecessor.

Mooncake 0.3.13 (P2PHANDSHAKE) keeps, per engine, the segment of the first process it read from on a session
(``ip:rpc_port``), and its Python binding has no call to drop it. Up's workers keep their port range across a restart,
so a restarted worker may take its predecessor's RPC port: that engine's read then goes to the dead process's data
port and blocks (measured with two processes: the read ran past ``fetch_timeout_s``, 10 s, its thread and slots held
on, the next fetch of those blocks ``busy``). The new process answers the locate with another buffer address
(``base_addr``) or ``instance``. Before, the pool refused every later fetch from that session (reason
``stale_session``, the pages recomputed) until this worker restarted; another engine of the same process reads the
new process (two real processes: the old engine's read -1, a new engine's read 0 with the new bytes), so the pool now
makes one, up to ``max_read_engines`` in all (Mooncake cannot shut one down), and refuses past that.
"""

from __future__ import annotations

import asyncio

import pytest

from services.worker.kvpool.payload import expected_checksum, fill_payload
from services.worker.kvpool.pool import READ_ENGINES_MAX, HostKvPool
from services.worker.kvpool.transport import TransferError
from shared import messages as m

SB = 256
OLD, NEW = 0x7F0000000000, 0x7F5500000000


class _Endpoint:
    """Mooncake stand-in: records the reads (which engine, session, how many) and writes each block's hash-derived
    payload where it lands. Engines made for restarted peers share the first one's record and landing."""

    protocol = "tcp"
    session = "127.0.0.1:1"

    def __init__(self, name: str = "e0", first: "_Endpoint | None" = None) -> None:
        self.name = name
        self.first = first or self
        self.reads: list[tuple[str, str, int]] = [] if first is None else first.reads
        self.registered: list[int] = []
        self.pool: HostKvPool | None = None
        self.landing: list[tuple[int, int]] = []

    def register(self, memory) -> int:
        self.registered.append(int(memory.ctypes.data))
        return self.registered[-1]

    def unregister(self, addr: int) -> None:
        self.registered.remove(addr)

    def read(self, session, local, remote, lengths) -> int:
        self.reads.append((self.name, session, len(local)))
        pool = self.first.pool
        assert pool is not None
        base = pool.buffer.base_addr
        for addr, (h, _) in zip(local, self.first.landing):
            fill_payload(pool.buffer.memory[addr - base : addr - base + SB], h)
        return 0


class _Clock:
    """The pool's ``clock``: seconds set by the test."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _pool(max_read_engines: int = READ_ENGINES_MAX, fail: bool = False, *, fail_starts: int = 0, fail_registers: int = 0,
          clock: _Clock | None = None, retry_s: float = 10.0) -> tuple[HostKvPool, _Endpoint]:
    """A pool whose engines for restarted peers are :class:`_Endpoint` s; ``fail``: none starts; ``fail_starts``: the
    first that many starts fail; ``fail_registers``: the first that many registrations of a made engine fail.
    ``ep.starts`` counts the starts tried."""
    ep = _Endpoint()
    made: list[_Endpoint] = []
    ep.starts = 0  # type: ignore[attr-defined]
    registers = [0]

    def read_engine() -> _Endpoint:
        ep.starts += 1  # type: ignore[attr-defined]
        if fail or ep.starts <= fail_starts:  # type: ignore[attr-defined]
            raise TransferError("TransferEngine.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp') returned -1")
        e = _Endpoint(f"e{len(made) + 1}", ep)
        plain = e.register

        def register(memory) -> int:  # type: ignore[no-untyped-def]
            registers[0] += 1
            if registers[0] <= fail_registers:
                raise TransferError("register_memory(0x7f00, 4096) returned -1")
            return plain(memory)

        e.register = register  # type: ignore[method-assign]
        made.append(e)
        return made[-1]

    pool = HostKvPool("b", None, num_slots=16, slot_bytes=SB, endpoint=ep, read_engine=read_engine,  # type: ignore[arg-type]
                      max_read_engines=max_read_engines, read_engine_retry_s=retry_s,
                      **({"clock": clock} if clock is not None else {}))  # fmt: skip
    ep.pool = pool
    return pool, ep


def _answer(pool: HostKvPool, ep: _Endpoint, hashes: list[int], base_addr: int, session: str = "127.0.0.1:27951",
            instance: str = ""):
    """``pool.locate`` answers as peer ``a`` (session, buffer at ``base_addr``) holding ``hashes``."""
    sums = [expected_checksum(h, SB) for h in hashes]
    ep.landing = [(h, i) for i, h in enumerate(hashes)]

    async def locate(peer, want):
        return m.PoolLocation(node=peer, session=session, base_addr=base_addr, slot_bytes=SB, block_hashes=list(want),
                              offsets=[i * SB for i in range(len(want))], checksums=sums[: len(want)],
                              instance=instance)  # fmt: skip

    pool.locate = locate  # type: ignore[method-assign]


def test_a_peer_restarted_on_the_same_session_is_read_with_another_engine():
    """Fail-before: the second fetch was refused (stale_session) until this worker restarted."""
    pool, ep = _pool()
    _answer(pool, ep, [11, 12], base_addr=OLD)
    first = asyncio.run(pool.fetch("a", [11, 12]))
    assert first.fetched == (11, 12) and first.error is None and ep.reads == [("e0", "127.0.0.1:27951", 2)]
    # a's process killed and restarted on port 27951 again: another buffer
    _answer(pool, ep, [13, 14], base_addr=NEW)
    second = asyncio.run(pool.fetch("a", [13, 14]))
    assert second.fetched == (13, 14) and second.error is None and second.reasons == {}
    assert ep.reads[1:] == [("e1", "127.0.0.1:27951", 2)]  # not with e0: it keeps the dead process's segment
    assert pool.counters["read_engines_made"] == 1 and pool.stats()[1]["kvpool.read_engines"] == 2.0
    assert pool.buffer.has(13) and pool.buffer.has(14)
    # the new process again: read with the engine that read it, no third engine; the old engine reads other peers
    _answer(pool, ep, [15], base_addr=NEW)
    assert asyncio.run(pool.fetch("a", [15])).fetched == (15,) and ep.reads[-1][0] == "e1"
    _answer(pool, ep, [16], base_addr=OLD, session="127.0.0.1:27960")
    assert asyncio.run(pool.fetch("a", [16])).fetched == (16,) and ep.reads[-1][0] == "e0"
    assert pool.counters["read_engines_made"] == 1
    # the new engine has this pool's buffer registered, and stop() unregisters it from every engine
    e1 = pool._readers[1].endpoint
    assert e1.registered == [pool.buffer.base_addr]  # type: ignore[attr-defined]
    asyncio.run(pool.stop())
    assert e1.registered == [] and ep.registered == []  # type: ignore[attr-defined]


def test_past_max_read_engines_a_restarted_peer_is_refused_without_a_read():
    pool, ep = _pool(max_read_engines=2)
    bases = [OLD, NEW, 0x7F6600000000]
    for i, base in enumerate(bases[:2]):  # the first process, then the first restart: read
        _answer(pool, ep, [100 + i], base_addr=base)
        assert asyncio.run(pool.fetch("a", [100 + i])).fetched == (100 + i,)
    _answer(pool, ep, [13, 14], base_addr=bases[2])  # a second restart on the same port: both engines are stale
    third = asyncio.run(pool.fetch("a", [13, 14]))
    assert len(ep.reads) == 2  # no read: it would block on a dead process's data port
    assert third.fetched == () and third.missing == (13, 14) and third.reasons == {"stale_session": 2}
    assert "a restarted on Mooncake session 127.0.0.1:27951" in (third.error or "")
    assert "no more are made (max_read_engines 2)" in (third.error or "")
    assert "each of this worker's 2 transfer engines keeps an old process's segment" in (third.error or "")
    assert "could not start" not in (third.error or "")
    assert pool.counters["fetch_failed.stale_session"] == 1 and pool.counters["read_engines_made"] == 1
    assert not pool.buffer.has(13) and pool.buffer.occupancy()["pending"] == 0  # nothing reserved, nothing held


def test_one_engine_only_refuses_as_before():
    pool, ep = _pool(max_read_engines=1)
    _answer(pool, ep, [11], base_addr=OLD)
    assert asyncio.run(pool.fetch("a", [11])).fetched == (11,)
    _answer(pool, ep, [12], base_addr=NEW)
    again = asyncio.run(pool.fetch("a", [12]))
    assert again.reasons == {"stale_session": 1} and len(ep.reads) == 1 and pool.counters["read_engines_made"] == 0
    assert "this worker's transfer engine keeps an old process's segment for it" in (again.error or "")
    assert "no more are made (max_read_engines 1)" in (again.error or "")


def test_an_engine_that_cannot_start_takes_no_place_under_the_bound_and_is_tried_again_later():
    """Fail-before: the failed start used one of the ``max_read_engines`` places for good: every later fetch from
    that session was refused ('no more are made') until this worker restarted, though the start failed for a
    passing cause (its ports in TIME_WAIT, launcher.KV_POOL_PORTS_PER_WORKER). Now it is tried again
    ``read_engine_retry_s`` later (the fetches meanwhile refused at once, no start tried), and then reads."""
    clock = _Clock()
    pool, ep = _pool(max_read_engines=2, fail_starts=1, clock=clock)
    _answer(pool, ep, [11], base_addr=OLD)
    assert asyncio.run(pool.fetch("a", [11])).fetched == (11,)
    _answer(pool, ep, [12], base_addr=NEW)
    r = asyncio.run(pool.fetch("a", [12]))
    assert r.reasons == {"stale_session": 1} and "could not start (TransferEngine.initialize(" in (r.error or "")
    assert "tried again on a fetch 10 s from now or later" in (r.error or ""), r.error
    assert pool.counters["read_engine_failed"] == 1 and len(ep.reads) == 1 and ep.starts == 1  # type: ignore[attr-defined]
    clock.t += 4
    r = asyncio.run(pool.fetch("a", [12]))  # within the wait: refused at once, no start tried
    assert r.reasons == {"stale_session": 1} and "could not start" in (r.error or "")
    assert "tried again in 6.0 s (read_engine_retry_s 10)" in (r.error or ""), r.error
    assert ep.starts == 1 and pool.counters["read_engine_failed"] == 1  # type: ignore[attr-defined]
    clock.t += 6
    r = asyncio.run(pool.fetch("a", [12]))
    assert r.fetched == (12,) and r.error is None, r.error
    assert ep.reads[-1] == ("e1", "127.0.0.1:27951", 1) and ep.starts == 2  # type: ignore[attr-defined]
    assert pool.counters["read_engines_made"] == 1 and pool.stats()[1]["kvpool.read_engines"] == 2.0
    # the bound is the same: 2 engines read, a second restart on that session is refused without a start
    _answer(pool, ep, [13], base_addr=0x7F6600000000)
    r = asyncio.run(pool.fetch("a", [13]))
    assert r.reasons == {"stale_session": 1} and "no more are made (max_read_engines 2)" in (r.error or "")
    assert "each of this worker's 2 transfer engines keeps an old process's segment" in (r.error or ""), r.error
    assert ep.starts == 2  # type: ignore[attr-defined]


def test_an_engine_that_never_starts_is_tried_once_per_retry_wait_and_refused_meanwhile():
    clock = _Clock()
    pool, ep = _pool(max_read_engines=2, fail=True, clock=clock, retry_s=5.0)
    _answer(pool, ep, [11], base_addr=OLD)
    assert asyncio.run(pool.fetch("a", [11])).fetched == (11,)
    _answer(pool, ep, [12], base_addr=NEW)
    for _ in range(3):  # three waits, a fetch every second: one start each
        for _ in range(5):
            r = asyncio.run(pool.fetch("a", [12]))
            assert r.reasons == {"stale_session": 1} and "could not start" in (r.error or ""), r.error
            clock.t += 1
    assert ep.starts == 3 and pool.counters["read_engine_failed"] == 3 and len(ep.reads) == 1  # type: ignore[attr-defined]
    assert pool.counters["read_engines_made"] == 0 and pool.stats()[1]["kvpool.read_engines"] == 1.0
    assert not pool.buffer.has(12) and pool.buffer.occupancy()["pending"] == 0


def test_an_engine_that_cannot_register_keeps_its_place_and_its_registration_is_tried_again():
    """An engine that started holds its ports and threads for the process's life (Mooncake has no shutdown): a failed
    registration of this pool's buffer does not make another one; the same engine registers on a later try."""
    clock = _Clock()
    pool, ep = _pool(max_read_engines=2, fail_registers=1, clock=clock)
    _answer(pool, ep, [11], base_addr=OLD)
    assert asyncio.run(pool.fetch("a", [11])).fetched == (11,)
    _answer(pool, ep, [12], base_addr=NEW)
    r = asyncio.run(pool.fetch("a", [12]))
    assert r.reasons == {"stale_session": 1} and "could not register this pool's buffer (register_memory(" in (r.error or "")
    assert pool.counters["read_engine_failed"] == 1 and ep.starts == 1  # type: ignore[attr-defined]
    clock.t += 10
    r = asyncio.run(pool.fetch("a", [12]))
    assert r.fetched == (12,) and r.error is None, r.error
    assert ep.starts == 1 and ep.reads[-1][0] == "e1"  # type: ignore[attr-defined]  # the same engine, registered now
    assert pool._readers[1].endpoint.registered == [pool.buffer.base_addr]  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_bad_read_engine_retry_is_refused(bad):
    with pytest.raises(ValueError, match="read_engine_retry_s"):
        HostKvPool("b", None, num_slots=4, slot_bytes=SB, endpoint=_Endpoint(), read_engine_retry_s=bad)  # type: ignore[arg-type]


def test_max_read_engines_below_one_is_refused():
    with pytest.raises(ValueError, match="max_read_engines"):
        HostKvPool("b", None, num_slots=4, slot_bytes=SB, endpoint=_Endpoint(), max_read_engines=0)  # type: ignore[arg-type]


def test_the_same_process_and_another_session_read_as_before():
    pool, ep = _pool()
    _answer(pool, ep, [21], base_addr=OLD)
    assert asyncio.run(pool.fetch("a", [21])).fetched == (21,)
    _answer(pool, ep, [22], base_addr=0x7F0000000000)  # the same holder process
    assert asyncio.run(pool.fetch("a", [22])).fetched == (22,)
    _answer(pool, ep, [23], base_addr=0x7F5500000000, session="127.0.0.1:27960")  # restarted on another port: a new segment
    assert asyncio.run(pool.fetch("a", [23])).fetched == (23,)
    assert len(ep.reads) == 3


def test_a_session_only_located_before_is_not_held_against_its_next_process():
    pool, ep = _pool()
    _answer(pool, ep, [], base_addr=0x7F0000000000)

    async def none_held(peer, want):
        return m.PoolLocation(node=peer, session="127.0.0.1:27951", base_addr=0x7F0000000000, slot_bytes=SB,
                              block_hashes=list(want), offsets=[-1] * len(want), checksums=[0] * len(want))  # fmt: skip

    pool.locate = none_held  # type: ignore[method-assign]
    assert asyncio.run(pool.fetch("a", [31])).reasons == {"not_held": 1}  # no read: Mooncake opened no segment
    _answer(pool, ep, [32], base_addr=0x7F5500000000)
    assert asyncio.run(pool.fetch("a", [32])).fetched == (32,)


def test_a_peer_restarted_at_the_same_buffer_address_is_told_by_its_instance():
    """ASLR off (setarch -R, randomize_va_space=0): the restarted holder's buffer lands at its predecessor's
    address, so only its ``instance`` nonce tells the two processes apart."""
    pool, ep = _pool()
    _answer(pool, ep, [41], base_addr=0x7F0000000000, instance="aaaa")
    assert asyncio.run(pool.fetch("a", [41])).fetched == (41,)
    _answer(pool, ep, [42], base_addr=0x7F0000000000, instance="aaaa")  # the same process
    assert asyncio.run(pool.fetch("a", [42])).fetched == (42,)
    _answer(pool, ep, [43], base_addr=0x7F0000000000, instance="bbbb")  # restarted, same port, same address
    again = asyncio.run(pool.fetch("a", [43]))
    assert again.fetched == (43,) and [r[0] for r in ep.reads] == ["e0", "e0", "e1"]  # another engine reads it
    one, ep1 = _pool(max_read_engines=1)
    _answer(one, ep1, [41], base_addr=0x7F0000000000, instance="aaaa")
    assert asyncio.run(one.fetch("a", [41])).fetched == (41,)
    _answer(one, ep1, [43], base_addr=0x7F0000000000, instance="bbbb")
    refused = asyncio.run(one.fetch("a", [43]))
    assert refused.reasons == {"stale_session": 1} and len(ep1.reads) == 1
    assert "instance aaaa; now 0x7f0000000000, bbbb" in (refused.error or "")


def test_a_holder_tells_its_instance_and_pools_differ():
    pool, _ = _pool()
    other, _ = _pool()
    assert len(pool.instance) == 16 and pool.instance != other.instance
    rep = asyncio.run(pool._on_locate(m.PoolLocate(node="b", block_hashes=[1]), "kv.pool.b"))
    assert rep.instance == pool.instance


def test_a_location_from_a_holder_without_instance_decodes():
    import msgspec

    old = msgspec.msgpack.encode({"node": "a", "session": "127.0.0.1:1", "base_addr": 4096, "slot_bytes": SB})
    loc = msgspec.msgpack.decode(old, type=m.PoolLocation)
    assert loc.instance == "" and loc.base_addr == 4096
