"""Differential test: KvDirectory against a brute-force reference written from DESIGN.md.

The reference knows nothing of bitmasks, completeness or outboxes:

* presence is a plain set of (node, tier, block) per node, frozen while the
  directory cannot know it (a batch was lost and no snapshot came yet);
* lookups walk the path block by block for every node;
* counts R[b, n] are recomputed from scratch after every operation as
  Σ_β [b ∈ C_β,n], where C_β,n follows DESIGN §4 (Alg. E.1, E.2) literally;
* what workers would know (the CountUpdates drained so far) must equal R.

Random operations: stores of path segments, removals (leaves or holes),
clears, lost / reordered / duplicated batches and resync snapshots, block-size
mismatches, branch starts (main, fork, sub-agent), requests that extend or
compact a branch, placements for prefill or decode (moves and transfers),
phase switches, branch ends (also duplicate and unknown ones), expiry.

Environment: ``KVDIR_PROP_EXAMPLES`` (default 40), ``KVDIR_PROP_STEPS`` (default 40).
``test_broken_core_is_caught`` runs the same machine against a core that
ignores ``BlockRemoved`` and expects a failure.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.kvdirectory import lookup as lookup_mod
from services.kvdirectory.core import KvDirectory
from shared.messages import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, KvSnapshot

BS = 16
NODES = ["n0", "n1", "n2", "n3"]
TIERS = ("gpu", "host")
TTL = 500.0
EXAMPLES = int(os.environ.get("KVDIR_PROP_EXAMPLES", "40"))
STEPS = int(os.environ.get("KVDIR_PROP_STEPS", "50"))
PHASES = {"prefill": {"prefill"}, "decode": {"decode"}, "both": {"prefill", "decode"}}


class Reference:
    """Brute-force model of what the directory must know (DESIGN §4)."""

    def __init__(self) -> None:
        self.view: dict[str, set[tuple[str, int]]] = {n: set() for n in NODES}
        self.frozen: dict[str, bool] = {n: False for n in NODES}
        self.branches: dict[str, dict] = {}
        self.ended: dict[str, float] = {}
        self.expired: dict[str, str | None] = {}
        """Expired by the TTL (id → parent): a later start or placement resumes them."""
        """Ended ids, remembered for TTL after their end (then a placement restarts them)."""
        self.node_phase: dict[str, str] = {}
        self.placed_phase: dict[str, str] = {}

    # -- presence ---------------------------------------------------------- #

    def holds(self, node: str, b: int) -> bool:
        return (node, "gpu", b) in self._triples(node) or (node, "host", b) in self._triples(node)

    def _triples(self, node: str) -> set[tuple[str, str, int]]:
        return {(node, t, b) for t, b in self.view[node]}

    def prefix(self, node: str, path: list[int], tiers: tuple[str, ...]) -> int:
        k = 0
        for b in path:
            if not any((t, b) in self.view[node] for t in tiers):
                break
            k += 1
        return k

    def longest_any(self, path: list[int]) -> int:
        k = 0
        for b in path:
            if not any((t, b) in self.view[n] for n in NODES for t in TIERS):
                break
            k += 1
        return k

    # -- branches (DESIGN §4, Alg. E.1 / E.2) ------------------------------- #

    def phase_of(self, node: str) -> str | None:
        return self.node_phase.get(node) or self.placed_phase.get(node)

    def start(self, bid: str, now: float, parent: str | None = None) -> None:
        if bid in self.branches or bid in self.ended:
            return
        self.expired.pop(bid, None)  # an expired branch active again: a resume (issue 21)
        self.branches[bid] = dict(version=1, path=[], counted={}, pending={}, seen=now, parent=parent)
        self.touch_parents(bid, now)

    def touch_parents(self, bid: str, now: float) -> None:
        """A child's activity keeps its waiting parents alive (expiry)."""
        p = self.branches[bid].get("parent")
        while p is not None and p in self.branches:
            self.branches[p]["seen"] = max(self.branches[p]["seen"], now)
            p = self.branches[p].get("parent")

    def end(self, bid: str, now: float) -> None:
        self.branches.pop(bid, None)
        self.expired.pop(bid, None)
        if bid not in self.ended:
            self.ended[bid] = now

    def place(self, bid: str, node: str, phase: str, path: list[int], now: float) -> None:
        if bid in self.ended:
            return
        if bid not in self.branches:
            self.start(bid, now, self.expired.get(bid))  # a resumed branch keeps its parent
        br = self.branches[bid]
        br["seen"] = max(br["seen"], now)
        self.touch_parents(bid, now)
        old = br["path"]
        if old and path[: len(old)] != old:  # E.1: not a prefix → rewritten context
            br["version"] += 1
            for m in list(br["counted"]):
                br["counted"][m] = br["counted"][m] & set(path)
        br["path"] = list(path)
        self.placed_phase[node] = phase
        br["counted"][node] = set(path)  # Count(β, n, π_β)
        same = {
            m
            for m, c in br["counted"].items()
            if c and m != node and self.phase_of(m) is not None and PHASES[self.phase_of(m)] <= PHASES[phase]
        }
        for t in list(br["pending"]):
            if t in same or t == node:
                del br["pending"][t]
        if same:
            br["pending"][node] = same
        self.settle()

    def phase_change(self, node: str, old: str | None, new: str) -> None:
        self.node_phase[node] = new
        if old == "decode" and new == "prefill":
            for br in self.branches.values():
                if br["counted"].get(node):
                    br["counted"][node] = set()
                    br["pending"].pop(node, None)

    def expire(self, now: float) -> None:
        for bid in [b for b, br in self.branches.items() if br["seen"] + TTL <= now]:
            self.expired[bid] = self.branches.pop(bid).get("parent")  # resumable, not ended
        for bid in [b for b, t in self.ended.items() if t + TTL <= now]:
            del self.ended[bid]

    def settle(self) -> None:
        """Same-phase moves: release the sources once the target holds v_β."""
        for br in self.branches.values():
            for t in list(br["pending"]):
                if not br["path"] or self.holds(t, br["path"][-1]):
                    for m in br["pending"].pop(t):
                        if m != t:
                            br["counted"][m] = set()

    def counts(self) -> dict[str, dict[int, int]]:
        R: dict[str, dict[int, int]] = {n: defaultdict(int) for n in NODES}
        for br in self.branches.values():
            for n, c in br["counted"].items():
                for b in c:
                    R[n][b] += 1
        return {n: {b: v for b, v in r.items() if v} for n, r in R.items()}


class DirectoryMachine(RuleBasedStateMachine):
    """Drives the core and the reference with the same random operations."""

    core_factory = staticmethod(lambda: KvDirectory(BS, branch_ttl_s=TTL))

    def __init__(self) -> None:
        super().__init__()
        self.core = self.core_factory()
        for n in NODES:
            self.core.node_id(n)
        self.ref = Reference()
        self.truth: dict[str, set[tuple[str, int]]] = {n: set() for n in NODES}
        self.seq = {n: 0 for n in NODES}
        self.lost = {n: False for n in NODES}
        self.sent: dict[str, list[KvEventBatch]] = {n: [] for n in NODES}
        self.parent: dict[int, int | None] = {}
        self.paths: dict[str, list[int]] = {}
        self.next_block = 1000
        self.next_branch = 0
        self.now = 1.0
        self.worker_counts: dict[str, dict[int, int]] = {n: {} for n in NODES}

    # -- helpers ------------------------------------------------------------ #

    def fresh(self, k: int, after: list[int]) -> list[int]:
        out = []
        prev = after[-1] if after else None
        for _ in range(k):
            self.next_block += 1
            self.parent[self.next_block] = prev
            prev = self.next_block
            out.append(prev)
        return after + out

    def make_batch(self, node: str, events: list) -> KvEventBatch:
        self.seq[node] += 1
        return KvEventBatch(node=node, seq=self.seq[node], ts=self.now, events=events)

    def apply_truth(self, node: str, events: list) -> None:
        t = self.truth[node]
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.block_size == BS:
                    t.update((ev.tier, b) for b in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                t.difference_update((ev.tier, b) for b in ev.block_hashes)
            else:
                for tier in TIERS if ev.tier is None else (ev.tier,):
                    t.difference_update({x for x in t if x[0] == tier})

    def deliver(self, node: str, batch: KvEventBatch) -> None:
        res = self.core.apply_kv_batch(batch, self.now)
        assert res.status in ("applied", "gap", "buffered", "recovered"), res
        if self.lost[node]:
            self.ref.frozen[node] = True
        if not self.ref.frozen[node] and not self.lost[node]:
            self.ref.view[node] = set(self.truth[node])
        self.ref.settle()

    def emit(self, node: str, events: list, lose: bool = False) -> None:
        batch = self.make_batch(node, events)
        self.apply_truth(node, events)
        self.sent[node].append(batch)
        if lose:
            self.lost[node] = True
            return
        self.deliver(node, batch)

    def any_path(self, data) -> list[int]:
        known = sorted(b for b, p in self.paths.items() if p)
        if known and data.draw(st.booleans()):
            return self.paths[data.draw(st.sampled_from(known))]
        return self.fresh(data.draw(st.integers(1, 6)), [])

    # -- KV events ---------------------------------------------------------- #

    @rule(data=st.data(), node=st.sampled_from(NODES), tier=st.sampled_from(TIERS), lose=st.booleans())
    def store(self, data, node, tier, lose):
        if data.draw(st.integers(0, 9)) == 0:
            return self.mismatch(data, node)
        path = self.any_path(data)
        a = data.draw(st.integers(0, len(path) - 1))
        b = data.draw(st.integers(a + 1, len(path)))
        ev = BlockStored(block_hashes=path[a:b], parent_block_hash=path[a - 1] if a else None, tier=tier, block_size=BS)
        self.emit(node, [ev], lose=lose and data.draw(st.integers(0, 4)) == 0)

    @rule(data=st.data(), node=st.sampled_from(NODES))
    def remove(self, data, node):
        held = sorted(self.truth[node])
        counted = {b for p in self.paths.values() for b in p}
        if data.draw(st.booleans()):  # favour blocks that branches still count
            held = [x for x in held if x[1] in counted] or held
        if not held:
            return
        picks = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=4, unique=True))
        evs = [BlockRemoved(block_hashes=[b], tier=t) for t, b in picks]
        evs.append(BlockRemoved(block_hashes=[999_999], tier="gpu"))  # unknown: ignored
        self.emit(node, evs)

    @rule(node=st.sampled_from(NODES), tier=st.sampled_from([None, "gpu", "host"]))
    def clear(self, node, tier):
        self.emit(node, [AllBlocksCleared(tier=tier)])

    def mismatch(self, data, node):
        path = self.any_path(data)
        before = self.core.counters["kv.block_size_mismatch"]
        self.emit(node, [BlockStored(block_hashes=path, block_size=BS * 2)])
        if not self.lost[node]:
            assert self.core.counters["kv.block_size_mismatch"] == before + 1

    @rule(data=st.data(), node=st.sampled_from(NODES))
    def reorder(self, data, node):
        p1 = self.fresh(2, [])
        e1 = [BlockStored(block_hashes=p1, tier="host", block_size=BS)]
        b1 = self.make_batch(node, e1)
        self.apply_truth(node, e1)
        e2 = [BlockRemoved(block_hashes=p1[1:], tier="host")]
        b2 = self.make_batch(node, e2)
        self.apply_truth(node, e2)
        self.sent[node] += [b1, b2]
        was_clean = not (self.lost[node] or self.ref.frozen[node])
        self.core.apply_kv_batch(b2, self.now)
        self.core.apply_kv_batch(b1, self.now)
        if self.lost[node]:
            self.ref.frozen[node] = True
        if was_clean:
            assert not self.core.awaiting_resync(node)
            self.ref.view[node] = set(self.truth[node])
        self.ref.settle()

    @rule(data=st.data(), node=st.sampled_from(NODES))
    def duplicate(self, data, node):
        if self.sent[node]:
            old = data.draw(st.sampled_from(self.sent[node]))
            if old.seq < self.seq[node] and not self.lost[node]:
                res = self.core.apply_kv_batch(old, self.now)
                assert res.status in ("stale", "buffered", "recovered"), res

    @precondition(lambda self: any(self.ref.frozen.values()))
    @rule(data=st.data())
    def resync(self, data):
        node = data.draw(st.sampled_from([n for n in NODES if self.ref.frozen[n]]))
        t = self.truth[node]
        gpu = sorted(b for tier, b in t if tier == "gpu")
        host = sorted(b for tier, b in t if tier == "host")
        snap = KvSnapshot(
            node=node,
            seq=self.seq[node],
            block_size=BS,
            gpu=gpu,
            host=host,
            gpu_parents=[self.parent[b] for b in gpu],
            host_parents=[self.parent[b] for b in host],
        )
        res = self.core.apply_snapshot(snap, self.now)
        assert res.status == "resynced" and not res.need_resync, res
        self.lost[node] = False
        self.ref.frozen[node] = False
        self.ref.view[node] = set(t)
        self.ref.settle()

    # -- branches ------------------------------------------------------------ #

    def start(self, kind, data):
        self.next_branch += 1
        bid = f"b{self.next_branch}"
        parent = data.draw(st.sampled_from(sorted(self.paths))) if kind != "main" and self.paths else None
        self.core.branch_start(bid, self.now, kind=kind, parent=parent)
        self.ref.start(bid, self.now, parent)
        if kind == "fork" and parent:  # a fork continues from its parent's context
            self.paths[bid] = list(self.paths[parent])
        else:
            self.paths[bid] = []

    @rule(data=st.data(), node=st.sampled_from(NODES), phase=st.sampled_from(["prefill", "decode", "both"]))
    def request(self, data, node, phase):
        """A request of a branch: extend, compact (rewrite), or repeat; placed on node."""
        if not self.paths or data.draw(st.integers(0, 5)) == 0:
            self.start(data.draw(st.sampled_from(["main", "fork", "subagent"])), data)
        live = sorted(self.paths)
        bid = data.draw(st.sampled_from(live))
        old = self.paths[bid]
        how = data.draw(st.sampled_from(["extend", "extend", "compact", "same"]))
        if how == "extend" or not old:
            new = self.fresh(data.draw(st.integers(1, 3)), old)
        elif how == "compact":
            keep = data.draw(st.integers(0, len(old) - 1))
            new = self.fresh(data.draw(st.integers(1, 3)), old[:keep])
        else:
            new = old
        self.paths[bid] = new
        self.now += data.draw(st.floats(0, 50))
        self.core.place(bid, node, phase, new, self.now)
        self.ref.place(bid, node, phase, new, self.now)
        if new and data.draw(st.booleans()):  # the node prefills: its engine stores the path
            evs = [BlockStored(block_hashes=new, tier=t, block_size=BS) for t in TIERS]
            self.emit(node, evs, lose=data.draw(st.integers(0, 9)) == 0)

    @rule(data=st.data())
    def end(self, data):
        if not self.paths:
            return
        bid = data.draw(st.sampled_from(sorted(self.paths) + ["nope"]))
        self.core.branch_end(bid, self.now)
        self.ref.end(bid, self.now)

    @rule(node=st.sampled_from(NODES), new=st.sampled_from(["prefill", "decode"]))
    def phase_switch(self, node, new):
        old = self.core.node_phase(node)
        assert old == self.ref.phase_of(node)
        self.core.node_phase_changed(node, old, new, self.now)
        self.ref.phase_change(node, old, new)

    @rule(dt=st.floats(0, 400))
    def advance(self, dt):
        self.now += dt
        self.core.expire(self.now)
        self.ref.expire(self.now)

    @rule()
    def drain_counts(self):
        for cu in self.core.take_count_updates():
            wc = self.worker_counts[cu.node]
            for h, c in zip(cu.hashes, cu.counts):
                if c:
                    wc[h] = c
                else:
                    wc.pop(h, None)

    # -- invariants ---------------------------------------------------------- #

    @invariant()
    def counts_match(self):
        R = self.ref.counts()
        for n in NODES:
            got = {b: c for b, c in self.core.branches.R[self.core.node_id(n)].items()}
            assert got == R[n], (n, got, R[n])
            if not self.core.pending_count_updates():
                assert self.worker_counts[n] == R[n]

    @invariant()
    def resync_state_matches(self):
        for n in NODES:
            assert self.core.awaiting_resync(n) == self.ref.frozen[n]

    @invariant()
    def lookups_match(self):
        paths = list(self.paths.values())
        for path in paths:
            if not path:
                continue
            res = self.core.lookup(path)
            few, lookup_mod._FEW_DROPS = lookup_mod._FEW_DROPS, 0  # the per-bit decode gives the same answer
            try:
                assert self.core.lookup(path) == res
            finally:
                lookup_mod._FEW_DROPS = few
            la = self.ref.longest_any(path)
            assert res.longest_any == la, (path, res, la)
            for n in NODES:
                p = res.node(n)
                want = (
                    self.ref.prefix(n, path, ("gpu",)),
                    self.ref.prefix(n, path, ("host",)),
                    self.ref.prefix(n, path, TIERS),
                )
                assert (p.gpu_blocks, p.host_blocks, p.local_blocks) == want, (n, path, p, want)
            pos = 0
            for r in res.sources:  # contiguous cover of [0, t_c), each range held by its source
                assert r.start == pos and r.end > r.start
                for b in path[r.start : r.end]:
                    assert (r.tier, b) in self.ref.view[r.node]
                pos = r.end
            assert pos == la

    @invariant()
    def positive_count_copies_match(self):
        R = self.ref.counts()
        g = self.core.gauges()
        for tier in TIERS:
            want = sum(1 for n in NODES for t, b in self.ref.view[n] if t == tier and R[n].get(b, 0) > 0)
            assert g[f"copies.{tier}.positive_count"] == want


DirectoryMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestDirectoryAgainstReference = DirectoryMachine.TestCase


class KeptCopiesMachine(DirectoryMachine):
    """The same machine with the counted copies kept on every change (the live service's mode):
    its ``copies.<tier>.positive_count`` gauges must match the reference too."""

    core_factory = staticmethod(lambda: KvDirectory(BS, branch_ttl_s=TTL, keep_counted_copies=True))


KeptCopiesMachine.TestCase.settings = DirectoryMachine.TestCase.settings
TestKeptCopiesAgainstReference = KeptCopiesMachine.TestCase


class _IgnoresRemovals(KvDirectory):
    """A deliberately broken core: drops every BlockRemoved on the floor."""

    def apply_kv_batch(self, batch, now):
        events = [e for e in batch.events if not isinstance(e, BlockRemoved)]
        return super().apply_kv_batch(KvEventBatch(node=batch.node, seq=batch.seq, events=events), now)


def test_broken_core_is_caught():
    """The harness must fail on a core that ignores BlockRemoved (STYLE §6)."""

    class Broken(DirectoryMachine):
        core_factory = staticmethod(lambda: _IgnoresRemovals(BS, branch_ttl_s=TTL))

    Broken.TestCase.settings = settings(
        max_examples=200,
        stateful_step_count=STEPS,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],  # no shrinking: we only need to see it fail
        report_multiple_bugs=False,
        database=None,
    )
    with pytest.raises(AssertionError):
        Broken.TestCase().runTest()
