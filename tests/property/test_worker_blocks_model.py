"""Differential test: the run-based L1/L2 pools against the per-block model.

``services/worker/blocks.py`` stores runs of blocks (a radix tree in L1, LRU
runs in L2); ``tests/unit/worker/ref_blocks.py`` is the per-block
implementation they replaced. Both get the same random operation streams —
requests that match, admit (with L2 restores), compute chunks, release, take
decode reservations and fill whole prompts, peer fetches into L2, branch
counts — on small pools so that L1 and L2 evict all the time, and after every
operation:

* every return value is equal (matches, admissions, reservations, pages stored);
* the KV events are equal, in the same order (hashes, parents, tiers);
* the pools hold the same blocks, with the same refs and pinning, and both
  eviction queues list the same blocks in the same order;
* the run pools pass the full ``KvBlockManager.check`` (in one variant only at the end:
  ``check`` reads the branch-count pool's lazily filled queued-page set, so checking after
  every operation would hide what the lazy runs do until the set is next read).

Paths are chained (a hash names its prefix): a tree of fresh ids with shared
prefixes, forks and one-block paths. Seeds: ``EI_BLOCKS_DIFF_SEEDS`` (default
12 fixed seeds) and ``EI_BLOCKS_DIFF_OPS`` (default 400); the hypothesis test
draws more streams (``EI_BLOCKS_DIFF_EXAMPLES``, default 25).
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.worker.blocks import KvBlockManager
from tests.unit.worker import ref_blocks

SEEDS = [int(x) for x in os.environ.get("EI_BLOCKS_DIFF_SEEDS", ",".join(str(s) for s in range(1, 13))).split(",")]
OPS = int(os.environ.get("EI_BLOCKS_DIFF_OPS", "400"))
EXAMPLES = int(os.environ.get("EI_BLOCKS_DIFF_EXAMPLES", "25"))


class Divergence(AssertionError):
    pass


def _ev(events):
    out = []
    for e in events:
        d = {"type": type(e).__name__}
        for f in getattr(e, "__struct_fields__", ()):
            d[f] = getattr(e, f)
        out.append(d)
    return out


def _state(kv):
    g = {h: b.ref for h, b in kv.gpu.blocks.items()}
    h = {x: (b.pinned, kv.host.holds.get(x, 0)) for x, b in kv.host.blocks.items()}
    gq = [b.hash for b in kv.gpu.evictable.ordered()]
    hq = [(b.hash, b.group) for b in kv.host.evictable.ordered()]
    return g, h, dict(kv.host.broken), gq, hq, kv.gpu.reserved, kv.gpu.available, kv.host.used


class Pair:
    """The run pools and the model side by side; every call is made on both and compared."""

    def __init__(self, gpu: int, host: int, policy: str) -> None:
        self.new = KvBlockManager(gpu, host, 4, policy)
        self.ref = ref_blocks.KvBlockManager(gpu, host, 4, policy)
        self.ops = 0

    def call(self, name: str, *args):
        a = getattr(self.new, name)(*args)
        b = getattr(self.ref, name)(*args)
        self.ops += 1
        if a != b:
            raise Divergence(f"op {self.ops} {name}{args}: runs → {a!r}, per-block → {b!r}")
        ea, eb = _ev(self.new.take_events()), _ev(self.ref.take_events())
        if ea != eb:
            raise Divergence(f"op {self.ops} {name}{args}: events differ\nruns      {ea}\nper-block {eb}")
        return a

    def compare(self, holders, full: bool = True) -> None:
        """Compare the state; ``full`` also the snapshots and ``check`` (which read the
        branch-count pool's queued-page set, emptying its lazy list)."""
        sa, sb = _state(self.new), _state(self.ref)
        if sa != sb:
            names = ("gpu refs", "host pinned", "gpu queue", "host queue", "reserved", "available", "host used")
            bad = [n for n, x, y in zip(names, sa, sb) if x != y]
            raise Divergence(f"after op {self.ops}: state differs in {bad}")
        if not full:
            return
        ga, ha = self.new.snapshot()
        gb, hb = self.ref.snapshot()
        assert sorted(ga) == sorted(gb) and sorted(ha) == sorted(hb)
        ga, gpa, ha, hpa = self.new.snapshot_parents()
        gb, gpb, hb, hpb = self.ref.snapshot_parents()
        assert dict(zip(ga, gpa)) == dict(zip(gb, gpb)) and dict(zip(ha, hpa)) == dict(zip(hb, hpb))
        assert len(ga) == len(gpa) == len(set(ga)) and len(ha) == len(hpa) == len(set(ha))
        self.new.check(holders)


MIX = {"hold": 0.84, "unhold": 0.87, "counts": 0.90}
"""Upper bounds of the op draw's bands for holds, unholds and count messages."""
END_MIX = {"hold": 0.86, "unhold": 0.875, "counts": 0.98}
"""More holds and count messages, fewer bare lookups (for :func:`test_checked_only_at_the_end`)."""


def drive(
    seed: int, ops: int, policy: str | None = None, *, tight: bool = False, mix: dict[str, float] = MIX, check_each: bool = True
) -> dict[str, int]:
    """A random request stream on both implementations; returns counters (work done).
    ``tight``: L2 holds at most 3 pages more than L1 (write-throughs evict held pages);
    ``check_each`` False: the state is compared after every op, the snapshots and ``check``
    only at the end."""
    rng = random.Random(seed)
    policy = policy or rng.choice(["lru", "branch-count"])
    gpu = rng.randint(6, 40)
    host = gpu + rng.randint(0, 3 if tight else 3 * gpu)
    pair = Pair(gpu, host, policy)
    next_id = [1]
    paths: list[list[int]] = []

    def new_path() -> list[int]:
        if paths and rng.random() < 0.8:
            base = rng.choice(paths)
            cut = rng.randint(0, len(base))
            p = base[:cut]
        else:
            p = []
        for _ in range(rng.choice([0, 1, 1, 2, 3, 5, 8, 13])):
            p.append(next_id[0])
            next_id[0] += 1
        if not p:
            p = [next_id[0]]
            next_id[0] += 1
        paths.append(p)
        return p

    live: list[list] = []  # [path, held, reserved]
    open_holds: list[list[int]] = []  # hashes of each open hold
    stats = {"admitted": 0, "refused": 0, "filled": 0, "released": 0, "decode": 0, "fetched": 0, "counts": 0, "holds": 0}
    for _ in range(ops):
        op = rng.random()
        if op < 0.25:  # a prefill request: match, admit, restore from L2
            path = new_path() if rng.random() < 0.4 or not paths else rng.choice(paths)
            limit = rng.randint(max(0, len(path) - 1), len(path))
            n_gpu, n_host = pair.call("match", path, limit)
            footprint = len(path) + rng.randint(0, 3)
            if footprint > gpu:
                continue
            if pair.call("admit", path, n_gpu, footprint - n_gpu):
                held, res = n_gpu, footprint - n_gpu
                if n_host:
                    pair.call("fill", path, n_gpu, n_gpu + n_host)
                    held += n_host
                    res -= n_host
                live.append([path, held, res])
                stats["admitted"] += 1
            else:
                stats["refused"] += 1
        elif op < 0.45 and live:  # compute a chunk of a running request
            r = rng.choice(live)
            path, held, res = r
            if held < len(path) and res:
                k = rng.randint(1, min(len(path) - held, res))
                pair.call("fill", path, held, held + k)
                r[1] += k
                r[2] -= k
                stats["filled"] += 1
        elif op < 0.62 and live:  # a request leaves
            r = live.pop(rng.randrange(len(live)))
            pair.call("release", r[0], r[1], r[2])
            stats["released"] += 1
        elif op < 0.72:  # a decode hand-off: reserve the footprint, the whole prompt arrives
            path = rng.choice(paths) if paths and rng.random() < 0.7 else new_path()
            footprint = len(path) + rng.randint(0, 2)
            if footprint <= gpu and pair.call("reserve", footprint):
                pair.call("fill", path, 0, len(path))
                live.append([path, len(path), footprint - len(path)])
                stats["decode"] += 1
        elif op < 0.80 and paths:  # a peer fetch completes into L2
            path = rng.choice(paths)
            n_gpu, n_host = pair.call("match", path, len(path))
            lo = rng.choice([n_gpu + n_host, rng.randint(0, len(path))])
            hi = rng.randint(lo, len(path) + 1)
            stats["fetched"] += pair.call("store_fetched", path, lo, hi)
        elif op < mix["hold"] and paths:  # a queued request holds its L2 prefix (fetch completed)
            path = rng.choice(paths)
            open_holds.append(pair.call("hold", path, rng.randint(0, len(path))))
            stats["holds"] += 1
        elif op < mix["unhold"] and open_holds:  # ... and is admitted or leaves
            pair.call("unhold", open_holds.pop(rng.randrange(len(open_holds))))
        elif op < mix["counts"]:  # branch counts from the directory
            known = sorted(pair.ref.host.blocks) + [10**9]
            hs = rng.sample(known, min(len(known), rng.randint(1, 6)))
            if rng.random() < 0.3 and paths:  # a whole path, as the directory sends them
                hs = list(rng.choice(paths))
            pair.call("update_counts", hs, [rng.choice([0, 0, 1, 2]) for _ in hs])
            stats["counts"] += 1
        elif paths:  # a bare lookup
            path = rng.choice(paths)
            pair.call("match", path, rng.randint(0, len(path)))
        pair.compare([(p, h, r) for p, h, r in live], check_each)
    for p, h, r in live:
        pair.call("release", p, h, r)
    pair.compare([])
    return stats


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed={s}" for s in SEEDS])
@pytest.mark.parametrize("policy", ["lru", "branch-count"])
def test_runs_equal_per_block_model(seed, policy):
    stats = drive(seed, OPS, policy)
    assert stats["admitted"] > 10 and stats["released"] > 10 and stats["decode"] > 0 and stats["holds"] > 0, stats


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), ops=st.integers(20, 300))
def test_runs_equal_per_block_model_drawn(seed, ops):
    drive(seed, ops)


END_SEEDS = [*SEEDS, 151, 164, 295]


@pytest.mark.parametrize("seed", END_SEEDS, ids=[f"seed={s}" for s in END_SEEDS])
def test_checked_only_at_the_end(seed):
    """The branch-count pool fills its queued-page set lazily and ``check`` reads it (emptying
    the lazy list), so the per-op check hides what a lazy run does until the set is next read.
    Here the state is compared after each op and the pool checked only at the end, on a tight
    L2 with more holds and count messages. Seeds 151, 164 and 295 reach a lazy run evicted
    around a held page: without ``BranchRunHostPool._evict_holes``' flush they fail (the set
    out of sync at the end; a count message moving fewer pages)."""
    drive(seed, OPS, "branch-count", tight=True, mix=END_MIX, check_each=False)


def test_harness_catches_a_divergence(monkeypatch):
    """Self-test: a run pool that evicts in the wrong order must be caught."""
    from services.worker import blocks

    real = blocks.GpuBlockPool.release

    def reversed_release(self, path, n):  # newly released blocks jump to the head of the queue
        real(self, path, n)
        q = self.queue
        last = q.last()
        if last is not None and last is not q.first():
            q.unlink(last)
            q.insert_after(q.head, last)

    monkeypatch.setattr(blocks.GpuBlockPool, "release", reversed_release)
    with pytest.raises((Divergence, AssertionError)):
        for seed in SEEDS[:4]:
            drive(seed, OPS, "lru")


def test_a_page_stored_again_after_its_hold_broke_is_evicted_past_held_pages():
    """Seed 206 under branch-count reaches it: a write-through found every queued page held and
    broke the hold of page 32 (group 0, evicted first) but not of its child 33 (group 1); 32
    came back unheld between held 31 and 33 in one run. The next eviction must take 32 as the
    per-block pool does (it skips held pages one by one), not stop at the run's held deep end
    and break 33's hold."""
    drive(206, 600, "branch-count")
