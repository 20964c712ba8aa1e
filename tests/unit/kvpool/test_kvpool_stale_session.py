"""A peer that restarted on the Mooncake session its predecessor had is refused at once, not read (fifth fault walk).

Mooncake 0.3.13 (P2PHANDSHAKE) keeps the segment of the first process it read from per session (``ip:rpc_port``), with
no call to drop it. Up's workers keep their port range across a restart, so a restarted worker may take its
predecessor's RPC port: a puller's read then retries the dead process's data port and blocks (measured with two
processes: the read ran past ``fetch_timeout_s``, 10 s, its thread and slots held on, the next fetch of those blocks
``busy``). The new process answers the locate with another buffer address (``base_addr``): the pool refuses the
fetch then (reason ``stale_session``, the pages recomputed) without a read. A first read, or a session seen before
with the same buffer, reads as before.
"""

from __future__ import annotations

import asyncio

from services.worker.kvpool.payload import expected_checksum, fill_payload
from services.worker.kvpool.pool import HostKvPool
from shared import messages as m

SB = 256


class _Endpoint:
    """Mooncake stand-in: records the reads and writes each block's hash-derived payload where it lands."""

    protocol = "tcp"
    session = "127.0.0.1:1"

    def __init__(self) -> None:
        self.reads: list[tuple[str, int]] = []
        self.pool: HostKvPool | None = None

    def register(self, memory: object) -> None:
        pass

    def unregister(self, addr: int) -> None:
        pass

    def read(self, session, local, remote, lengths) -> int:
        self.reads.append((session, len(local)))
        assert self.pool is not None
        base = self.pool.buffer.base_addr
        for addr, (h, _) in zip(local, self.landing):
            fill_payload(self.pool.buffer.memory[addr - base : addr - base + SB], h)
        return 0


def _pool() -> tuple[HostKvPool, _Endpoint]:
    ep = _Endpoint()
    pool = HostKvPool("b", None, num_slots=16, slot_bytes=SB, endpoint=ep)  # type: ignore[arg-type]
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


def test_a_peer_restarted_on_the_same_session_is_refused_without_a_read():
    pool, ep = _pool()
    _answer(pool, ep, [11, 12], base_addr=0x7F0000000000)
    first = asyncio.run(pool.fetch("a", [11, 12]))
    assert first.fetched == (11, 12) and first.error is None and len(ep.reads) == 1
    # a's process killed and restarted on port 27951 again: another buffer
    _answer(pool, ep, [13, 14], base_addr=0x7F5500000000)
    second = asyncio.run(pool.fetch("a", [13, 14]))
    assert len(ep.reads) == 1  # no read: it would block on the dead process's data port
    assert second.fetched == () and second.missing == (13, 14) and second.reasons == {"stale_session": 2}
    assert "restarted on Mooncake session 127.0.0.1:27951" in (second.error or "")
    assert pool.counters["fetch_failed.stale_session"] == 1
    assert not pool.buffer.has(13) and pool.buffer.occupancy()["pending"] == 0  # nothing reserved, nothing held


def test_the_same_process_and_another_session_read_as_before():
    pool, ep = _pool()
    _answer(pool, ep, [21], base_addr=0x7F0000000000)
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
    assert again.reasons == {"stale_session": 1} and len(ep.reads) == 2
    assert "instance aaaa; now 0x7f0000000000, bbbb" in (again.error or "")


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
