"""``HostKvPool``: a node's real-bytes L2 pool — registered slots, ``kv.pool.<node>`` server, Mooncake pulls.

The asyncio shell around :class:`~services.worker.kvpool.buffer.HostKvBuffer`.
It registers the buffer with this process's Mooncake transfer engine, answers
``kv.pool.<node>`` (``PoolLocate → PoolLocation``) so peers learn the session,
base address and slot of each block, and pulls blocks from peers::

    puller                              holder (node h)
      │ PoolLocate(hashes, lease_s) ─────▶ buffer.locate(): offsets, CRC-32s, lease
      │ ◀──── PoolLocation(session, base_addr, slot_bytes, offsets, checksums)
      │ buffer.reserve() a local slot per located block
      │ Mooncake batch_transfer_sync_read(session, local slots, base_addr + offsets)   [thread]
      │ CRC-32 of every landed slot == advertised (and, synthetic payloads,
      │   == the CRC this node computes from the hash itself)                         [thread]
      │ commit() verified blocks; abort() the rest → FetchResult

What to fetch is the engine's decision (the router's fetch plan, DESIGN §4);
this class only moves and verifies bytes. A block whose checksum does not
match is counted (``fetch_mismatch``), its slot freed, and it is reported
missing: it is never used.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.aio.subscription import Subscription

from services.worker.kvpool.buffer import DEFAULT_CPU_SLOT_BYTES, HostKvBuffer, PayloadKind, PoolFull
from services.worker.kvpool.fetchcore import cancel_plan, plan_fetch, settle_fetch
from services.worker.kvpool.payload import CHECKSUM_ALGO, checksum, expected_checksum
from services.worker.kvpool.transport import MooncakeEndpoint, MooncakeUnavailable, TransferError
from shared import messages as m
from shared.bus import Bus, BusError
from shared.subjects import KV_POOL, check_token

log = logging.getLogger(__name__)

MAX_LOCATE_BLOCKS = 4096
"""Most hashes per PoolLocate (≈ 40 KB of msgpack each way); fetch splits longer lists."""

READ_BATCH = 256
"""Transfers per Mooncake batch read: a fetch of more blocks reads them in batches of this many, one after another.
Mooncake 0.3.13's TCP transport queues a batch's transfers on its lanes and rejects what does not fit (``TCP lane
queue-full rejection``, at 2,048 queued): one batch of 6,000 4-KiB blocks from a live, idle peer lost 242-1,377 of
them (``transfer``, recomputed), and their one-by-one retries ran into the same full queue; 2,048-block batches lost
none. Each read has a thread of its own (no pool caps how many run at once), so 256 per batch keeps about eight
concurrent fetches of one worker under 2,048 queued together; 6,000 blocks took 1.3 s in 256-block batches against
1.7 s in one (loopback)."""
READ_ENGINES_MAX = 4
"""Mooncake transfer engines one pool reads with, at most: its own and up to three more (:meth:`HostKvPool.fetch`).
Mooncake 0.3.13 keeps, per engine, the segment of the first process it read from on a session (``host:rpc_port``) and
its Python binding has no call to drop it (it closes a segment only when a submit fails and a probe of the peer fails
too; a peer restarted on its predecessor's RPC port answers the probe), so that engine's reads from the restarted peer
go to the dead process's data port. Another engine of this process has a segment cache of its own and reads the new
process (measured, two processes, the holder SIGKILLed and started again on its RPC port: the old engine's read -1,
or blocked past ``fetch_timeout_s`` as 822297f measured; a new engine's read 0 with the new process's bytes, its start
under 0.04 s on the event loop; ``tests/integration/test_kvpool_live.py``, the holder restarted on its predecessor's
session: 32 of 32 fetched, 32 ``stale_session`` before). Mooncake has no call to
shut an engine down either: each one made stays for the process's life (two ports of ``--kv-pool-ports``, two
threads), hence the bound. Past it, a fetch from a session every engine has read from another process is refused
(``stale_session``) until this worker restarts. An engine that could not start (``TransferEngine.initialize`` failed: e.g.
no free port in the range, its ports in TIME_WAIT) takes no place under the bound: it is tried again on a later fetch,
at most once per :data:`READ_ENGINE_RETRY_S`. One that started and could not register this pool's buffer keeps its
place (it holds its ports and threads all the same) and its registration is tried again, as often."""
READ_ENGINE_RETRY_S = 10.0
"""Wall seconds after a transfer engine for a restarted peer failed to start or register this pool's buffer before a
fetch tries again (:attr:`HostKvPool.read_engine_retry_s`); the fetches meanwhile are refused at once
(``stale_session``), not each paying an engine start that fails."""
STUCK_READS_WARN = 4
"""``kvpool.reads_stuck`` (reads past ``fetch_timeout_s`` that have not returned) at which the pool logs one warning:
they hold their thread and their slots until they return, which Mooncake 0.3.13 does not do for a peer that died
mid-read (the slots come back when this worker restarts; by design, services/worker/kvpool/README.md)."""
MAX_LEASE_S = 60.0
"""Longest lease a holder grants, whatever a peer asks."""


@dataclass(frozen=True, slots=True)
class FetchResult:
    """Outcome of :meth:`HostKvPool.fetch`. Hash lists keep the request order.

    Attributes:
        peer: node fetched from.
        requested: distinct hashes asked for.
        fetched: blocks now held locally, each checksum-verified.
        already: blocks that were held locally already (not transferred).
        missing: blocks not obtained: the peer lacks them, no local slot was
            free, the transfer failed, or their checksum did not match.
        mismatched: the subset of ``missing`` whose bytes failed the checksum.
        bytes: bytes the transfer engine moved (fetched + mismatched blocks).
        seconds: wall time of the whole call (locate + transfer + verify).
        locate_s, transfer_s, verify_s: its parts (wall seconds).
        error: why nothing was fetched (peer unreachable, refused, incompatible); None otherwise.
    """

    peer: str
    requested: int
    fetched: tuple[int, ...] = ()
    already: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()
    mismatched: tuple[int, ...] = ()
    bytes: int = 0
    seconds: float = 0.0
    locate_s: float = 0.0
    transfer_s: float = 0.0
    verify_s: float = 0.0
    error: str | None = None
    reasons: dict[str, int] = field(default_factory=dict)
    """Missing blocks per reason: ``not_held``, ``no_room``, ``busy``, ``transfer``, ``mismatch``, ``error``,
    ``timeout``, ``stale_session``, ``no_thread``."""

    @property
    def verified(self) -> bool:
        """True when no transferred block failed its checksum (every fetched block is verified)."""
        return not self.mismatched and self.error is None

    @property
    def transfer_gbps(self) -> float:
        """Transfer-engine throughput of this fetch, GB/s (10^9 B/s); 0 when nothing moved."""
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


@dataclass
class _Reader:
    """A transfer engine the pool reads with, and the holder process it first read from on each session."""

    endpoint: MooncakeEndpoint
    read_from: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Mooncake session -> the holder's ``(base_addr, instance)`` when this engine first read from it."""


class HostKvPool:
    """Real-bytes host KV pool of one node (issue 6 part 2).

    Args:
        node: this node's id (one NATS token); it answers ``kv.pool.<node>``.
        bus: the node's bus (a worker passes its own).
        num_slots: block slots (a worker: its profile's ``host_blocks``, so
            the pool mirrors L2 exactly).
        slot_bytes: bytes per block; default 64 KiB for CPU runs
            (``DEFAULT_CPU_SLOT_BYTES``), ``block_size × kv_bytes_per_token``
            for full-size blocks (3,494,400 B for GLM-5.2 at 64 tokens).
        payload: ``synthetic`` (hash-derived bytes) or ``external`` (real KV).
        host: address peers reach this process on (its Mooncake session host).
        lease_s: lease asked of holders per fetch (wall seconds).
        locate_timeout_s: NATS request timeout of PoolLocate (wall s).
        fetch_timeout_s: longest wall time of the Mooncake read of one fetch; past it
            :meth:`fetch` returns the blocks as missing (reason ``timeout``) at once, and the
            slots the read targets come back when the stuck read returns (issue #22).
        verify_identity: with synthetic payloads, also check each fetched
            block against the CRC this node computes from the hash (catches a
            holder storing wrong bytes under a hash), not only against the
            holder's advertised CRC.
        endpoint: an existing :class:`MooncakeEndpoint` (one per process).
        clock: wall clock for leases (monotonic seconds).
        read_engine: makes another transfer engine to read with, when a peer restarted on a session every engine
            read from before (:data:`READ_ENGINES_MAX`); default a :class:`MooncakeEndpoint` on ``host`` with the
            endpoint's protocol. It may raise :class:`TransferError` (no free port in the range): the fetch is then
            refused (``stale_session``), and it is tried again on a fetch ``read_engine_retry_s`` later or after:
            an engine that did not start takes no place under ``max_read_engines``.
        max_read_engines: transfer engines this pool reads with at most, its own included (>= 1; 1: none made).
        read_engine_retry_s: wall seconds (on ``clock``) after a failed start or registration of such an engine
            before another try (>= 0; :data:`READ_ENGINE_RETRY_S`).

    Raises:
        MooncakeUnavailable: Mooncake is not installed (names the install script).
        TransferError: the transfer engine failed to start or register the buffer.
        ValueError: bad node id or sizes, max_read_engines below 1, or read_engine_retry_s negative or not finite.
    """

    def __init__(
        self,
        node: str,
        bus: Bus,
        *,
        num_slots: int,
        slot_bytes: int = DEFAULT_CPU_SLOT_BYTES,
        payload: PayloadKind = "synthetic",
        host: str = "127.0.0.1",
        lease_s: float = 5.0,
        locate_timeout_s: float = 2.0,
        fetch_timeout_s: float = 10.0,
        verify_identity: bool = True,
        endpoint: MooncakeEndpoint | None = None,
        clock: Callable[[], float] = time.monotonic,
        read_engine: Callable[[], MooncakeEndpoint] | None = None,
        max_read_engines: int = READ_ENGINES_MAX,
        read_engine_retry_s: float = READ_ENGINE_RETRY_S,
    ) -> None:
        self.node = check_token(node, "node")
        if max_read_engines < 1:
            raise ValueError(f"max_read_engines must be >= 1 (the pool's own engine), got {max_read_engines}")
        if not (math.isfinite(read_engine_retry_s) and read_engine_retry_s >= 0):
            raise ValueError(f"read_engine_retry_s must be a finite number of seconds >= 0, got {read_engine_retry_s}")
        self.bus = bus
        self.buffer = HostKvBuffer(num_slots, slot_bytes, payload=payload)
        self.endpoint = endpoint if endpoint is not None else MooncakeEndpoint(host=host)
        self.endpoint.register(self.buffer.memory)
        self.lease_s = lease_s
        self.locate_timeout_s = locate_timeout_s
        self.fetch_timeout_s = fetch_timeout_s
        self.verify_identity = verify_identity and payload == "synthetic"
        self.clock = clock
        self.counters = self.buffer.counters
        self._sub: Subscription | None = None
        self._expected: dict[int, int] = {}
        self.instance = os.urandom(8).hex()
        """This pool's process, a random nonce told to pullers in every ``PoolLocation`` (``instance``): a restarted
        holder is another instance even where its buffer lands at its predecessor's address (ASLR off)."""
        self._readers: list[_Reader] = [_Reader(self.endpoint)]
        """The transfer engines this pool reads with: its own first, then those made for restarted peers (:meth:`_reader_for`)."""
        self._new_engine = read_engine or (lambda: MooncakeEndpoint(host=host, protocol=self.endpoint.protocol))
        self.max_read_engines = max_read_engines
        self._engines_made = 0
        """Engines started after the pool's own (registered or not); one whose start failed is not counted: it holds
        nothing (:data:`READ_ENGINES_MAX`)."""
        self.read_engine_retry_s = read_engine_retry_s
        self._unregistered: MooncakeEndpoint | None = None
        """An engine that started and could not register this pool's buffer: its registration is tried again before
        any other engine is made (it holds its ports and threads for the process's life)."""
        self._engine_failure: tuple[float, str] | None = None
        """The last failed start or registration of an engine for a restarted peer: when (``clock``), and what."""
        self._reads_in_flight = 0
        """Mooncake reads whose thread has not returned (:meth:`_in_own_thread`)."""
        self._reads_stuck = 0
        """Of those, the reads :meth:`fetch` gave up on (``fetch_timeout_s``)."""
        self._stuck_warned = False

    # -- lifecycle -------------------------------------------------------- #

    @property
    def session(self) -> str:
        """Mooncake session id peers read from (``host:rpc_port``)."""
        return self.endpoint.session

    async def start(self) -> None:
        """Answer ``kv.pool.<node>``."""
        self._sub = await self.bus.serve(KV_POOL, self._on_locate, node=self.node)

    async def stop(self) -> None:
        """Stop answering and unregister the buffer (in-flight pulls by peers then fail cleanly)."""
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # connection already closed: nothing left to stop
                pass
            self._sub = None
        for reader in self._readers:
            reader.endpoint.unregister(self.buffer.base_addr)

    def ready(self) -> bool:
        return self._sub is not None

    # -- residency (what the worker's L2 holds) --------------------------- #

    def put(self, block_hash: int, data: bytes | memoryview | None = None) -> bool:
        """The node now holds ``block_hash`` in L2: give it a slot and its payload.

        Returns False (counted ``put_full``) when no slot is free: the block
        then simply is not in the pool (peers asking for it are told so).

        Raises:
            ValueError: ``data`` does not fit the pool's payload kind or slot size.
        """
        try:
            self.buffer.put(block_hash, self.clock(), data)
        except PoolFull:
            self.counters["put_full"] += 1
            return False
        if self.verify_identity:
            self._remember_expected(block_hash, self.buffer.stored_checksum(block_hash))
        return True

    def evict(self, block_hash: int) -> bool:
        """The node dropped ``block_hash`` from L2. False if the pool did not hold it."""
        return self.buffer.evict(block_hash, self.clock())

    def has(self, block_hash: int) -> bool:
        return self.buffer.has(block_hash)

    def apply_kv_events(self, events: Iterable[m.BlockStored | m.BlockRemoved | m.AllBlocksCleared]) -> int:
        """Mirror the host tier of a worker's KV events (``EngineScheduler.take_kv_events()``):
        ``BlockStored(tier=host)`` → put, ``BlockRemoved(tier=host)`` → evict,
        ``AllBlocksCleared`` of the host tier (or of every tier) → clear; GPU
        events are ignored (:meth:`HostKvBuffer.apply_kv_events`). Returns the
        number of blocks changed. Synthetic pools only.

        Raises:
            ValueError: for an external-payload pool.
        """
        return self.buffer.apply_kv_events(events, self.clock())

    def claim_events(self, events: Iterable[m.BlockStored | m.BlockRemoved | m.AllBlocksCleared]) -> list[tuple[int, int]]:
        """An external-payload pool's bookkeeping of a worker's KV events (:meth:`HostKvBuffer.claim_events`): the
        evictions and clears done, a slot claimed for every page stored in L2 that the pool does not hold. Returns
        the claims ``(block hash, slot)``: the engine copies each page's bytes into ``buffer.slot_view(slot)``
        (outside the event loop if it likes), then :meth:`fill` makes it held.

        Raises:
            ValueError: for a synthetic-payload pool (:meth:`apply_kv_events`).
        """
        return self.buffer.claim_events(events, self.clock())

    def fill(self, block_hash: int, slot: int, crc: int | None) -> bool:
        """A claim of :meth:`claim_events` written (``crc``: the slot's CRC-32) or not (None): held from now on
        when written and still claimed (:meth:`HostKvBuffer.fill`). Returns whether it is held."""
        return self.buffer.fill(block_hash, slot, crc, self.clock())

    def unpin(self, slot: int) -> None:
        """Drop a pin of ``slot`` (:meth:`HostKvBuffer.pin`, :meth:`HostKvBuffer.unpin`)."""
        self.buffer.unpin(slot, self.clock())

    # -- holder side ------------------------------------------------------ #

    async def _on_locate(self, req: m.PoolLocate, _subject: str) -> m.PoolLocation:
        base: dict[str, Any] = dict(
            node=self.node,
            session=self.session,
            protocol=self.endpoint.protocol,
            base_addr=self.buffer.base_addr,
            slot_bytes=self.buffer.slot_bytes,
            checksum_algo=CHECKSUM_ALGO,
            payload=self.buffer.payload,
            instance=self.instance,
        )
        if req.node != self.node:
            self.counters["locate_refused"] += 1
            return m.PoolLocation(**base, error=f"this is node {self.node!r}, not {req.node!r}")
        if len(req.block_hashes) > MAX_LOCATE_BLOCKS:
            self.counters["locate_refused"] += 1
            return m.PoolLocation(**base, error=f"{len(req.block_hashes)} hashes > {MAX_LOCATE_BLOCKS} per request")
        self.counters["locate"] += 1
        locs = self.buffer.locate(req.block_hashes, self.clock(), min(req.lease_s, MAX_LEASE_S))
        return m.PoolLocation(
            **base,
            block_hashes=list(req.block_hashes),
            offsets=[-1 if loc is None else loc[0] for loc in locs],
            checksums=[0 if loc is None else loc[1] for loc in locs],
        )

    # -- puller side ------------------------------------------------------ #

    async def locate(self, peer: str, hashes: Sequence[int]) -> m.PoolLocation:
        """Ask ``peer`` where it holds ``hashes`` (one request per 4096 hashes, merged).

        Raises:
            BusError: no (decodable) reply in time.
            ValueError: the peer refused or sent an inconsistent answer.
        """
        replies: list[m.PoolLocation] = []
        for i in range(0, max(1, len(hashes)), MAX_LOCATE_BLOCKS):
            chunk = list(hashes[i : i + MAX_LOCATE_BLOCKS])
            rep = await self.bus.request(
                KV_POOL,
                m.PoolLocate(node=peer, block_hashes=chunk, lease_s=self.lease_s),
                timeout=self.locate_timeout_s,
                node=peer,
            )
            if rep.error:
                raise ValueError(f"peer {peer} refused: {rep.error}")
            if rep.block_hashes != chunk or len(rep.offsets) != len(chunk) or len(rep.checksums) != len(chunk):
                raise ValueError(f"peer {peer} answered for other blocks or with ragged lists")
            if replies and (rep.session, rep.base_addr, rep.slot_bytes, rep.instance) != (
                replies[0].session,
                replies[0].base_addr,
                replies[0].slot_bytes,
                replies[0].instance,
            ):
                raise ValueError(f"peer {peer} changed its transfer endpoint between requests")
            replies.append(rep)
        first = replies[0]
        if len(replies) == 1:
            return first
        return m.PoolLocation(
            node=first.node,
            session=first.session,
            protocol=first.protocol,
            base_addr=first.base_addr,
            slot_bytes=first.slot_bytes,
            block_hashes=[h for r in replies for h in r.block_hashes],
            offsets=[o for r in replies for o in r.offsets],
            checksums=[c for r in replies for c in r.checksums],
            checksum_algo=first.checksum_algo,
            payload=first.payload,
            instance=first.instance,
        )

    def _in_own_thread(self, fn: Callable[[], Any], name: str) -> asyncio.Future[Any]:
        """``fn()`` in a thread of its own (a daemon), as a future of the running loop; counted in
        ``kvpool.reads_in_flight`` until it returns.

        Not ``asyncio.to_thread``: a Mooncake read from a peer that died mid-read does not return (its TCP lane
        reconnects to the dead data port with backoff; measured: 6,000 slots still pending 26 s after the kill, no
        knob of Mooncake 0.3.13 ended it), and each one held a thread of the loop's default executor for good
        (min(32, cores + 4): 6 on 2 cores). Past that, every later read, and the loop's ``getaddrinfo`` (a NATS
        reconnect), waited behind them. A thread of its own costs only itself.

        Raises:
            RuntimeError: the thread could not start (``can't start new thread``); nothing is counted then."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            self._reads_in_flight -= 1
            if fut.cancelled():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        def run() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the future
                error = e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop closed meanwhile (the process is stopping): nobody waits
                pass

        thread = threading.Thread(target=run, name=name, daemon=True)
        self._reads_in_flight += 1
        try:
            thread.start()
        except BaseException:
            self._reads_in_flight -= 1
            raise
        return fut

    def _incompatible(self, loc: m.PoolLocation) -> str | None:
        if not loc.session:
            return "peer has no transfer endpoint"
        if loc.protocol != self.endpoint.protocol:
            return f"peer transport {loc.protocol!r} != ours {self.endpoint.protocol!r}"
        if loc.slot_bytes != self.buffer.slot_bytes:
            return f"peer slot_bytes {loc.slot_bytes} != ours {self.buffer.slot_bytes}"
        if loc.checksum_algo != CHECKSUM_ALGO:
            return f"peer checksum {loc.checksum_algo!r} != {CHECKSUM_ALGO!r}"
        if loc.payload != self.buffer.payload:
            return f"peer payload kind {loc.payload!r} != ours {self.buffer.payload!r}"
        return None

    async def fetch(self, peer: str, hashes: Sequence[int]) -> FetchResult:
        """Pull ``hashes`` from ``peer``'s pool into this one, verifying every block.

        Blocks already held here are skipped (``already``). Every transferred
        block's CRC-32 is checked against the holder's (and, for synthetic
        payloads with ``verify_identity``, against the one derived from its
        hash); a mismatch is counted and the block reported missing. Never
        raises for peer-side problems: they come back in ``error`` / ``missing``.

        Raises:
            ValueError: ``peer`` is not a valid node id or is this node.
        """
        check_token(peer, "peer")
        if peer == self.node:
            raise ValueError("a node cannot fetch from itself")
        t0 = time.perf_counter()
        uniq = list(dict.fromkeys(hashes))
        already = [h for h in uniq if self.buffer.has(h)]
        want = [h for h in uniq if not self.buffer.has(h)]
        self.counters["fetch_calls"] += 1
        if not want:
            return FetchResult(peer=peer, requested=len(uniq), already=tuple(already), seconds=time.perf_counter() - t0)

        def failed(err: str, locate_s: float, reason: str = "error") -> FetchResult:
            self.counters["fetch_errors"] += 1
            self.counters[f"fetch_failed.{reason}"] += 1
            self.counters["fetch_missing"] += len(want)
            return FetchResult(
                peer=peer,
                requested=len(uniq),
                already=tuple(already),
                missing=tuple(want),
                seconds=time.perf_counter() - t0,
                locate_s=locate_s,
                error=err,
                reasons={reason: len(want)},
            )

        try:
            loc = await self.locate(peer, want)
        except (BusError, ValueError) as e:
            return failed(str(e), time.perf_counter() - t0)
        locate_s = time.perf_counter() - t0
        bad = self._incompatible(loc)
        if bad:
            return failed(bad, locate_s)
        reader = self._reader_for(loc)
        if isinstance(reader, str):
            return failed(f"{peer} {reader}; the pages are recomputed", locate_s, "stale_session")

        plan = plan_fetch(self.buffer, want, loc.offsets, loc.checksums, self.clock())
        sb = self.buffer.slot_bytes
        base, peer_base, session, engine = self.buffer.base_addr, loc.base_addr, loc.session, reader.endpoint
        reads = plan.reads
        identity = self.verify_identity
        known = {r.block_hash: self._expected[r.block_hash] for r in reads if r.block_hash in self._expected}
        stop = threading.Event()  # set when the fetch gave up on the read (fetch_timeout_s): no further batch starts

        def transfer_and_verify() -> tuple[set[int], list[int], dict[int, int], float, float]:
            # Runs in a worker thread: Mooncake's sync read and zlib.crc32 release the GIL.
            t1 = time.perf_counter()
            local = [base + r.local_slot * sb for r in reads]
            remote = [peer_base + r.remote_offset for r in reads]
            failed_idx: set[int] = set()
            step = READ_BATCH
            for lo in range(0, len(reads), step):
                hi = min(lo + step, len(reads))
                if stop.is_set():  # nobody waits for the rest: the plan is cancelled when this returns
                    failed_idx.update(range(lo, len(reads)))
                    break
                if engine.read(session, local[lo:hi], remote[lo:hi], [sb] * (hi - lo)) != 0:
                    # The batch API does not say which transfer failed: retry one by one.
                    for i in range(lo, hi):
                        if engine.read_one(session, local[i], remote[i], sb) != 0:
                            failed_idx.add(i)
            t2 = time.perf_counter()
            crcs = [-1 if i in failed_idx else checksum(self.buffer.slot_view(r.local_slot)) for i, r in enumerate(reads)]
            expected: dict[int, int] = {}
            if identity:
                for i, r in enumerate(reads):
                    if i not in failed_idx:
                        h = r.block_hash
                        expected[h] = known[h] if h in known else expected_checksum(h, sb)
            return failed_idx, crcs, expected, t2 - t1, time.perf_counter() - t2

        failed_idx: set[int] = set()
        crcs: list[int] = []
        expected: dict[int, int] = {}
        transfer_s = verify_s = 0.0
        if reads:
            # bounded wait: a peer that stops answering mid-read must not hold the request
            # (issue #22). The thread cannot be interrupted: on timeout the plan's slots are
            # released only when the read returns (they are its target until then).
            try:
                read = self._in_own_thread(transfer_and_verify, f"kvpool-read-{peer}")
            except RuntimeError as e:  # no thread to be had (the process's limit): nothing was read
                cancel_plan(self.buffer, plan)
                return failed(f"no thread for a Mooncake read from {peer}: {e}", locate_s, "no_thread")
            reader.read_from.setdefault(loc.session, (loc.base_addr, loc.instance))  # Mooncake opens (and keeps) the segment now

            def release(_f: asyncio.Future[Any]) -> None:
                cancel_plan(self.buffer, plan)
                if not _f.cancelled():
                    _f.exception()  # retrieved: a late failure is not an unhandled one

            try:
                done, _ = await asyncio.wait({read}, timeout=self.fetch_timeout_s)
            except BaseException:
                read.add_done_callback(release)
                raise
            if not done:
                stop.set()
                self._reads_stuck += 1
                if self._reads_stuck >= STUCK_READS_WARN and not self._stuck_warned:
                    self._stuck_warned = True
                    log.warning(
                        "%s: %d Mooncake reads past fetch_timeout_s have not returned (kvpool.reads_stuck); a read "
                        "from a peer that died mid-read holds its thread and slots until this worker restarts "
                        "(logged once)",
                        self.node,
                        self._reads_stuck,
                    )

                def unstuck(_f: asyncio.Future[Any]) -> None:
                    self._reads_stuck -= 1

                read.add_done_callback(unstuck)
                read.add_done_callback(release)
                return failed(f"Mooncake read from {peer} took more than {self.fetch_timeout_s:g} s (fetch_timeout_s)", locate_s, "timeout")
            try:
                failed_idx, crcs, expected, transfer_s, verify_s = read.result()
            except BaseException:
                cancel_plan(self.buffer, plan)
                raise
        out = settle_fetch(self.buffer, plan, failed=failed_idx, crcs=crcs, expected=expected if identity else None)
        if identity:
            for h in out.fetched:
                self._remember_expected(h, expected[h])
        already.extend(out.superseded)  # a local put (or fill) made it held meanwhile: that copy stays, pinnable
        order = {h: i for i, h in enumerate(uniq)}
        return FetchResult(
            peer=peer,
            requested=len(uniq),
            fetched=tuple(out.fetched),
            already=tuple(sorted(already, key=order.__getitem__)),
            missing=tuple(sorted(out.missing, key=order.__getitem__)),
            mismatched=tuple(out.mismatched),
            bytes=out.bytes_moved,
            seconds=time.perf_counter() - t0,
            locate_s=locate_s,
            transfer_s=transfer_s,
            verify_s=verify_s,
            reasons=out.reasons,
        )

    def _reader_for(self, loc: m.PoolLocation) -> "_Reader | str":
        """The engine to read ``loc`` with: the first that has not read from its session, or read from it the same
        process (``base_addr`` and ``instance``); else a new one (:data:`READ_ENGINES_MAX`), or why none (a text
        that follows the peer's name).

        Another process answering on a session an engine read from is the peer restarted on its predecessor's RPC
        port: that engine keeps the old process's segment (its data port) and its read blocks on the dead port
        (measured before: past ``fetch_timeout_s``, its thread and slots held on, every later fetch of those blocks
        ``busy``); it is not used for that session again."""
        now = (loc.base_addr, loc.instance)
        for reader in self._readers:
            seen = reader.read_from.get(loc.session)
            if seen is None or seen == now:
                return reader
        first = self._readers[-1].read_from[loc.session]
        why = (
            f"restarted on Mooncake session {loc.session}, which this worker read from before (buffer at {first[0]:#x}, "
            f"instance {first[1] or '?'}; now {loc.base_addr:#x}, {loc.instance or '?'})"
        )
        if self._unregistered is None and 1 + self._engines_made >= self.max_read_engines:
            made = len(self._readers)
            stale = "this worker's transfer engine keeps" if made == 1 else f"each of this worker's {made} transfer engines keeps"
            return (
                f"{why}: {stale} an old process's segment for it; no more are made (max_read_engines "
                f"{self.max_read_engines}), so no read from this session can succeed until this worker restarts"
            )
        if self._engine_failure is not None:
            at, what = self._engine_failure
            wait = at + self.read_engine_retry_s - self.clock()
            if wait > 0:
                return f"{why}: {what}; tried again in {wait:.1f} s (read_engine_retry_s {self.read_engine_retry_s:g})"
        endpoint = self._unregistered
        if endpoint is None:
            try:
                endpoint = self._new_engine()
            except (TransferError, MooncakeUnavailable) as e:  # nothing started: no place under the bound taken
                return self._engine_failed(why, f"another transfer engine to read it with could not start ({e})")
            self._engines_made += 1
        try:
            endpoint.register(self.buffer.memory)
        except (TransferError, ValueError) as e:  # it started: it keeps its place, its registration is tried again
            self._unregistered = endpoint
            return self._engine_failed(why, f"another transfer engine to read it with could not register this pool's buffer ({e})")
        self._unregistered = None
        self._engine_failure = None
        reader = _Reader(endpoint)
        self._readers.append(reader)
        self.counters["read_engines_made"] += 1
        log.warning("%s: %s; reading it with another transfer engine (%d of at most %d)",
                    self.node, why, len(self._readers), self.max_read_engines)  # fmt: skip
        return reader

    def _engine_failed(self, why: str, what: str) -> str:
        """Count a failed start or registration of a transfer engine (``read_engine_failed``), note it for the
        retry wait (:attr:`read_engine_retry_s`) and return the refusal's text."""
        self.counters["read_engine_failed"] += 1
        self._engine_failure = (self.clock(), what)
        return f"{why}: {what}; tried again on a fetch {self.read_engine_retry_s:g} s from now or later"

    def _remember_expected(self, block_hash: int, crc: int) -> None:
        # Bounded memo of hash-derived CRCs (FIFO, at most one entry per slot).
        if len(self._expected) >= self.buffer.num_slots:
            self._expected.pop(next(iter(self._expected)))
        self._expected[block_hash] = crc

    # -- observability ---------------------------------------------------- #

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        """Counters (``kvpool.*``: puts, evictions, locates, fetched blocks/bytes,
        mismatches ...) and gauges (slot occupancy, pool bytes)."""
        counters = {f"kvpool.{k}": int(v) for k, v in self.counters.items()}
        gauges = {f"kvpool.slots_{k}": float(v) for k, v in self.buffer.occupancy().items()}
        gauges["kvpool.slot_bytes"] = float(self.buffer.slot_bytes)
        gauges["kvpool.reads_in_flight"] = float(self._reads_in_flight)
        gauges["kvpool.reads_stuck"] = float(self._reads_stuck)
        gauges["kvpool.read_engines"] = float(len(self._readers))
        gauges["kvpool.pool_bytes"] = float(self.buffer.nbytes)
        return counters, gauges
