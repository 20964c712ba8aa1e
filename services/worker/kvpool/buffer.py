"""``HostKvBuffer``: one host memory region cut into fixed-size block slots (the sans-IO core).

The buffer is a single ``numpy.uint8`` array of ``num_slots * slot_bytes``
bytes; the shell registers it once with Mooncake's transfer engine so peers
can read any slot by address. This class only does bookkeeping and memory
writes: it never does network I/O, never reads a clock (callers pass ``now``,
wall seconds from a monotonic clock, because leases protect real transfers)
and never logs.

Slot states (every slot is in exactly one)::

    free ──put / reserve / claim──▶ held / pending / claimed
    pending ──commit──▶ held        pending ──abort──▶ free
    claimed ──fill──▶ held          claimed ──fill without bytes──▶ free
    held ──evict──▶ free            (no lease left, not pinned)
    held ──evict──▶ released ──lease ends (next allocation)──▶ free
    held (pinned) / claimed ──evict──▶ let go ──last unpin / fill──▶ free or released
    claimed ──commit of the block's fetch──▶ let go (the fetched slot is held) ──fill──▶ free or released

* **held**: committed block, visible to ``has``/``locate``; its CRC-32 is kept.
* **pending**: reserved for a block being fetched from a peer; written by the
  transfer, invisible until ``commit`` (after the checksum matched).
* **claimed**: reserved for a block this node's engine writes (an external
  buffer's ``put`` in two steps, so the copy and its CRC can run off the event
  loop): invisible until ``fill``. The claim pins its slot. A fetch of the
  block that lands and verifies before the fill wins over the claim: its slot
  is held at once, the claim is cancelled (as by an evict) and its slot let go.
* **released**: evicted while a peer may still be reading it (``locate``
  granted a lease); reused only after the lease ends, so a peer never reads a
  slot that was rewritten under it within its lease. A read after the lease is
  caught by the checksum.
* **let go**: evicted (or a claim cancelled) while pinned: the slot is not
  reused until its last ``unpin``, so a copy out of a pinned slot (a fetched
  page the engine takes in another thread) or into a claimed one never meets
  another block's bytes. ``occupancy`` counts claimed slots as pending and
  let-go ones as released.

Operations (n = blocks in the call):

| operation | cost |
|---|---|
| ``put`` | O(slot_bytes) write + CRC (synthetic payload: + generation) |
| ``evict``, ``has``, ``reserve``, ``abort``, ``claim``, ``pin``, ``unpin`` | O(1) (+ O(log r) when a lease is pending, r = released slots) |
| ``commit``, ``fill`` | O(1) (the caller wrote the claimed slot and computed its CRC) |
| ``locate``, ``apply_kv_events``, ``claim_events`` | O(n) (+ a put's cost per stored block; none for a claim) |
| ``check`` | O(num_slots) |
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Literal

import numpy as np

from services.worker.kvpool.payload import checksum, fill_payload

PayloadKind = Literal["synthetic", "external"]

DEFAULT_CPU_SLOT_BYTES = 64 * 1024
"""Default bytes per block slot for CPU runs (tests, demo, sim workers).

A real GLM-5.2 block (64 tokens × 54.6 KB, ``shared/profiles/gb300-glm52.toml``)
is 3,494,400 B; a node's whole L2 at that size does not fit a CPU test box,
so CPU runs use 64 KiB slots unless ``slot_bytes`` is given (the benchmark uses
the real block size)."""

MIN_SLOT_BYTES = 64


class PoolFull(RuntimeError):
    """No free slot: every slot is held, pending (a fetch in flight), claimed (the engine's bytes being copied),
    let go while pinned (evicted, or its claim cancelled: freed at the last unpin), or evicted but still leased
    to a peer. The message counts each: ``all N slots in use (H held, P pending, C claimed, L let go while pinned[,
    R evicted but leased until >= T])``."""


class HostKvBuffer:
    """Fixed-size block slots in one contiguous host buffer, keyed by block hash.

    Args:
        num_slots: number of block slots (≥ 1).
        slot_bytes: bytes per slot (≥ 64); every block occupies one whole slot.
        payload: ``synthetic`` — ``put(h)`` writes the hash-derived payload of
            ``payload.fill_payload`` (any node can recompute it);
            ``external`` — ``put(h, data)`` copies the caller's bytes (real KV).

    Raises:
        ValueError: on a non-positive size or an unknown payload kind.
    """

    def __init__(self, num_slots: int, slot_bytes: int, *, payload: PayloadKind = "synthetic") -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if slot_bytes < MIN_SLOT_BYTES:
            raise ValueError(f"slot_bytes must be >= {MIN_SLOT_BYTES}, got {slot_bytes}")
        if payload not in ("synthetic", "external"):
            raise ValueError(f"payload must be 'synthetic' or 'external', got {payload!r}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.payload: PayloadKind = payload
        self.memory = np.zeros(num_slots * slot_bytes, dtype=np.uint8)
        """The region to register with the transfer engine (never reallocated)."""
        self._slot_of: dict[int, int] = {}
        self._pending: dict[int, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._released: list[tuple[float, int]] = []  # heap of (lease end, slot)
        self._checksum = np.zeros(num_slots, dtype=np.uint32)
        self._lease_until = np.zeros(num_slots, dtype=np.float64)
        self._claimed: dict[int, int] = {}
        """Claimed blocks (:meth:`claim`) → their slot, until :meth:`fill`."""
        self._pins: dict[int, int] = {}
        """Pinned slots (:meth:`pin`, and a claim's) → how many pins."""
        self._let_go: set[int] = set()
        """Pinned slots whose block was evicted (or whose claim was cancelled): freed at the last unpin."""
        self.counters: Counter[str] = Counter()

    # -- geometry --------------------------------------------------------- #

    @property
    def base_addr(self) -> int:
        """Virtual address of slot 0 in this process (what peers read relative to)."""
        return int(self.memory.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.memory.nbytes)

    def slot_view(self, slot: int) -> np.ndarray:
        """The ``slot_bytes`` bytes of ``slot`` (a writable view)."""
        start = slot * self.slot_bytes
        return self.memory[start : start + self.slot_bytes]

    # -- queries ---------------------------------------------------------- #

    def has(self, block_hash: int) -> bool:
        """True if the block is held (committed); pending fetches do not count."""
        return block_hash in self._slot_of

    def slot(self, block_hash: int) -> int | None:
        """Slot index of a held block, or None."""
        return self._slot_of.get(block_hash)

    def view(self, block_hash: int) -> np.ndarray:
        """The held block's bytes (a writable view of its slot).

        Raises:
            KeyError: if the block is not held.
        """
        return self.slot_view(self._slot_of[block_hash])

    def stored_checksum(self, block_hash: int) -> int:
        """CRC-32 recorded when the block was put or committed.

        Raises:
            KeyError: if the block is not held.
        """
        return int(self._checksum[self._slot_of[block_hash]])

    def verify(self, block_hash: int) -> bool:
        """Recompute the held block's CRC-32 and compare with the recorded one.

        Raises:
            KeyError: if the block is not held.
        """
        slot = self._slot_of[block_hash]
        return checksum(self.slot_view(slot)) == int(self._checksum[slot])

    def hashes(self) -> list[int]:
        """Held block hashes (in insertion order)."""
        return list(self._slot_of)

    @property
    def held(self) -> int:
        return len(self._slot_of)

    @property
    def pending(self) -> int:
        """Slots reserved for a fetch in flight or claimed for the engine's bytes."""
        return len(self._pending) + len(self._claimed)

    @property
    def free(self) -> int:
        """Slots immediately allocatable, not counting released slots whose lease ended."""
        return len(self._free)

    @property
    def released(self) -> int:
        """Slots evicted but not reusable yet: leased to a peer, or pinned."""
        return len(self._released) + len(self._let_go)

    # -- writes ----------------------------------------------------------- #

    def put(self, block_hash: int, now: float, data: bytes | bytearray | memoryview | np.ndarray | None = None) -> int:
        """Store a block (the node now holds it in L2) and return its slot.

        ``synthetic`` buffers take no ``data`` and write the hash-derived
        payload; ``external`` buffers copy ``data`` (at most ``slot_bytes``
        bytes, the rest of the slot is zeroed). The CRC-32 of the whole slot is
        recorded. A block already held is left as it is (counted ``put_existing``).

        Raises:
            PoolFull: no slot can be allocated at ``now``.
            ValueError: ``data`` given to a synthetic buffer, missing for an
                external one, or longer than ``slot_bytes``.
        """
        if self.payload == "synthetic" and data is not None:
            raise ValueError("a synthetic buffer generates its payload from the hash: put(h, now) takes no data")
        if self.payload == "external" and data is None:
            raise ValueError("an external buffer needs the block's bytes: put(h, now, data)")
        existing = self._slot_of.get(block_hash)
        if existing is not None:
            self.counters["put_existing"] += 1
            return existing
        src = None
        if data is not None:
            src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
            if src.shape[0] > self.slot_bytes:
                raise ValueError(f"block data is {src.shape[0]} B, larger than the {self.slot_bytes} B slot")
        slot = self._alloc(now)
        view = self.slot_view(slot)
        if src is None:
            fill_payload(view, block_hash)
        else:
            view[: src.shape[0]] = src
            view[src.shape[0] :] = 0
        self._checksum[slot] = checksum(view)
        self._slot_of[block_hash] = slot
        self.counters["put"] += 1
        return slot

    def evict(self, block_hash: int, now: float) -> bool:
        """Drop a held block (the node evicted it from L2). False if it was not held.

        The slot is free at once unless a peer holds a lease on it; then it is
        reused only after the lease ends. A pinned slot (:meth:`pin`) is let go
        instead: the block is invisible at once, the slot reused only after its
        last :meth:`unpin` (then free, or released while leased). A block that is
        claimed, not held (:meth:`claim`), returns False: its claim is cancelled
        (counted ``claim_cancelled``), its slot let go until :meth:`fill`.
        """
        slot = self._slot_of.pop(block_hash, None)
        if slot is None:
            slot = self._claimed.pop(block_hash, None)
            if slot is not None:  # not held yet: the claim is cancelled, its slot freed once written (fill)
                self._let_go.add(slot)
                self.counters["claim_cancelled"] += 1
            return False
        self.counters["evict"] += 1
        if slot in self._pins:
            self._let_go.add(slot)
        else:
            self._release(slot, now)
        return True

    def _release(self, slot: int, now: float) -> None:
        """``slot`` holds no block and is not pinned: free, or released until a peer's lease on it ends."""
        if self._lease_until[slot] > now:
            heapq.heappush(self._released, (float(self._lease_until[slot]), slot))
            self.counters["evict_leased"] += 1
        else:
            self._free.append(slot)

    def clear(self, now: float) -> int:
        """Evict every held block and cancel every claim (AllBlocksCleared of the host tier); returns how many
        blocks were held."""
        hashes = list(self._slot_of)
        for h in (*hashes, *self._claimed):
            self.evict(h, now)
        return len(hashes)

    def apply_kv_events(self, events: Iterable[object], now: float) -> int:
        """Mirror the host tier of a worker's KV events (``shared.messages`` ``KvEvent``s,
        e.g. ``EngineScheduler.take_kv_events()``): ``BlockStored(tier="host")`` →
        put (synthetic buffers only), ``BlockRemoved(tier="host")`` → evict,
        ``AllBlocksCleared`` of the host tier or of every tier → clear. GPU
        events are ignored. A put that finds no free slot is counted
        (``put_full``) and skipped. Returns the number of blocks put or evicted.

        Raises:
            ValueError: for an external buffer (its payloads come from the engine, not from events).
        """
        if self.payload != "synthetic":
            raise ValueError("only a synthetic buffer can follow KV events (an external one needs the bytes)")

        def put(h: int) -> int:
            if h in self._slot_of:
                return 0
            self.put(h, now)
            return 1

        return self._follow_host_events(events, now, put)

    def claim_events(self, events: Iterable[object], now: float) -> list[tuple[int, int]]:
        """The bookkeeping of an external buffer following a worker's KV events (as :meth:`apply_kv_events`
        for a synthetic one): ``BlockStored(tier="host")`` → :meth:`claim` (a block held or claimed already is
        skipped; no free slot: counted ``put_full``, skipped), ``BlockRemoved(tier="host")`` → evict (a claim is
        cancelled), ``AllBlocksCleared`` of the host tier or of every tier → clear. GPU events are ignored.
        Returns the claims made, ``(block hash, slot)`` in order: the caller writes each block's bytes into
        :meth:`slot_view` and calls :meth:`fill` (with the CRC-32, or None when it has no bytes) for every one.

        Raises:
            ValueError: for a synthetic buffer (it writes its payloads itself: :meth:`apply_kv_events`).
        """
        if self.payload != "external":
            raise ValueError("only an external buffer claims slots for the engine's bytes (a synthetic one: apply_kv_events)")
        claims: list[tuple[int, int]] = []

        def claim(h: int) -> int:
            slot = self.claim(h, now)
            if slot is not None:
                claims.append((h, slot))
            return 0

        self._follow_host_events(events, now, claim)
        return claims

    def _follow_host_events(self, events: Iterable[object], now: float, store: Callable[[int], int]) -> int:
        """The host tier of KV events, in order: ``store(h)`` for each block of a ``BlockStored(tier="host")``
        (one raising :class:`PoolFull` is counted ``put_full`` and skipped), evict for a ``BlockRemoved(tier="host")``,
        clear for ``AllBlocksCleared`` of the host tier or of every tier; GPU events ignored. What
        :meth:`apply_kv_events` (``store``: put) and :meth:`claim_events` (``store``: claim) share. Returns the
        blocks stored (``store``'s returns summed), evicted or cleared."""
        from shared.messages import AllBlocksCleared, BlockRemoved, BlockStored

        changed = 0
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.tier != "host":
                    continue
                for h in ev.block_hashes:
                    try:
                        changed += store(h)
                    except PoolFull:
                        self.counters["put_full"] += 1
            elif isinstance(ev, BlockRemoved):
                if ev.tier == "host":
                    changed += sum(self.evict(h, now) for h in ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                if ev.tier in (None, "host"):
                    changed += self.clear(now)
        return changed

    # -- peer side: what a holder answers --------------------------------- #

    def locate(self, hashes: Iterable[int], now: float, lease_s: float) -> list[tuple[int, int] | None]:
        """For each hash, ``(byte offset from base_addr, CRC-32)`` if held, else None.

        Every located slot gets a lease until ``now + lease_s``: if it is
        evicted before then, it is not reused until the lease ends.
        """
        out: list[tuple[int, int] | None] = []
        until = now + max(0.0, lease_s)
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is None:
                out.append(None)
                self.counters["locate_miss"] += 1
                continue
            if self._lease_until[slot] < until:
                self._lease_until[slot] = until
            out.append((slot * self.slot_bytes, int(self._checksum[slot])))
            self.counters["locate_hit"] += 1
        return out

    # -- puller side: slots for incoming blocks ---------------------------- #

    def reserve(self, block_hash: int, now: float) -> int | None:
        """Reserve a slot for a block about to be fetched; None if the block is
        already held or already being fetched.

        Raises:
            PoolFull: no slot can be allocated at ``now``.
        """
        if block_hash in self._slot_of or block_hash in self._pending or block_hash in self._claimed:
            return None
        slot = self._alloc(now)
        self._pending[block_hash] = slot
        return slot

    def commit(self, block_hash: int, crc: int) -> bool:
        """Make a fetched block held, recording its verified CRC-32.

        Returns False (and frees the reserved slot) if the block became held
        meanwhile through ``put`` (or a ``fill``): the local copy wins. A block
        only claimed meanwhile (:meth:`claim`, its bytes not written yet) is
        held from now on in the fetched slot, and the claim is cancelled
        (counted ``claim_superseded``; its slot let go until its :meth:`fill`):
        the verified bytes are usable at once (a caller pins them), where
        before they were thrown away for a claim that may still fill with none.

        Raises:
            KeyError: if the block was not reserved.
        """
        slot = self._pending.pop(block_hash)
        if block_hash in self._slot_of:
            self._free.append(slot)
            self.counters["commit_superseded"] += 1
            return False
        claimed = self._claimed.pop(block_hash, None)
        if claimed is not None:  # pinned by the claim: freed once its copy is done (fill)
            self._let_go.add(claimed)
            self.counters["claim_superseded"] += 1
        self._checksum[slot] = crc & 0xFFFF_FFFF
        self._lease_until[slot] = 0.0
        self._slot_of[block_hash] = slot
        self.counters["commit"] += 1
        return True

    def abort(self, block_hash: int) -> None:
        """Give back the slot reserved for a block whose fetch failed or did not verify.

        Raises:
            KeyError: if the block was not reserved.
        """
        slot = self._pending.pop(block_hash)
        self._free.append(slot)
        self.counters["abort"] += 1

    def pending_slot(self, block_hash: int) -> int:
        """Slot reserved for a block being fetched.

        Raises:
            KeyError: if the block was not reserved.
        """
        return self._pending[block_hash]

    # -- the engine's bytes, copied off the event loop --------------------- #

    def claim(self, block_hash: int, now: float) -> int | None:
        """Claim a slot for a block the caller writes itself (an external buffer's :meth:`put` in two steps:
        the copy and its CRC may run in another thread while this bookkeeping stays on the event loop). The
        block is invisible (``has``, ``locate``) until :meth:`fill`; its slot is pinned until then, so an evict
        meanwhile only cancels the claim. None if the block is held or claimed already. A fetch of the block
        in flight whose ``commit`` comes before the fill wins: its bytes are held, the claim is cancelled.

        Raises:
            PoolFull: no slot can be allocated at ``now``.
        """
        if block_hash in self._slot_of or block_hash in self._claimed:
            return None
        slot = self._alloc(now)
        self._claimed[block_hash] = slot
        self._pins[slot] = 1
        return slot

    def fill(self, block_hash: int, slot: int, crc: int | None, now: float) -> bool:
        """The claim of ``block_hash`` on ``slot`` (:meth:`claim`) was written: ``crc`` is the CRC-32 of the whole
        slot, or None when the caller had no bytes for it. The block is held from now on when it was written and
        its claim still stands (no evict, clear or committed fetch cancelled it, no ``put`` made it held); else
        the slot goes back. Returns whether it is held.

        Raises:
            KeyError: ``slot`` is not pinned (no claim made it).
        """
        held = False
        if self._claimed.get(block_hash) == slot:
            del self._claimed[block_hash]
            if crc is not None and block_hash not in self._slot_of:
                self._slot_of[block_hash] = slot
                self._checksum[slot] = crc & 0xFFFF_FFFF
                self._lease_until[slot] = 0.0
                self.counters["put"] += 1
                held = True
            else:
                self._let_go.add(slot)
                self.counters["claim_unfilled"] += 1
        self.unpin(slot, now)
        return held

    def pin(self, block_hash: int) -> int | None:
        """Pin the slot of a held block: its bytes stay as they are until :meth:`unpin` (an evict meanwhile
        makes the block invisible but does not reuse the slot). Returns the slot, or None if not held."""
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self._pins[slot] = self._pins.get(slot, 0) + 1
        return slot

    def unpin(self, slot: int, now: float) -> None:
        """Drop one pin of ``slot`` (:meth:`pin`); a slot let go while pinned is freed at its last one.

        Raises:
            KeyError: ``slot`` is not pinned.
        """
        n = self._pins[slot] - 1
        if n:
            self._pins[slot] = n
            return
        del self._pins[slot]
        if slot in self._let_go:
            self._let_go.discard(slot)
            self._release(slot, now)

    # -- internals -------------------------------------------------------- #

    def _alloc(self, now: float) -> int:
        while self._released and self._released[0][0] <= now:
            _, slot = heapq.heappop(self._released)
            self._free.append(slot)
        if not self._free:
            self.counters["pool_full"] += 1
            msg = (
                f"all {self.num_slots} slots in use ({len(self._slot_of)} held, {len(self._pending)} pending, "
                f"{len(self._claimed)} claimed, {len(self._let_go)} let go while pinned"
            )
            if self._released:
                msg += f", {len(self._released)} evicted but leased until >= {self._released[0][0]:.3f}"
            raise PoolFull(msg + ")")
        return self._free.pop()

    def check(self) -> None:
        """Verify the slot partition invariant (every slot in exactly one state).

        Raises:
            AssertionError: on a violation.
        """
        seen: list[int] = [
            *self._slot_of.values(), *self._pending.values(), *self._claimed.values(), *self._let_go, *self._free,
            *(s for _, s in self._released),
        ]  # fmt: skip
        assert len(seen) == self.num_slots, f"{len(seen)} slots accounted for, {self.num_slots} exist"
        assert sorted(seen) == list(range(self.num_slots)), "a slot is in two states or missing"
        held = set(self._slot_of.values())
        claimed = set(self._claimed.values())
        assert all(n > 0 and (s in held or s in self._let_go or s in claimed) for s, n in self._pins.items()), (
            "a pinned slot is free, released or pending"
        )
        assert self._let_go <= self._pins.keys(), "a let-go slot is not pinned"

    def occupancy(self) -> dict[str, int]:
        """Slots per state: held, pending (claimed too), free, released (let go while pinned too)."""
        return {"held": self.held, "pending": self.pending, "free": self.free, "released": self.released}

