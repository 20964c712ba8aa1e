"""Branch counts end to end in the simulator: placements and branch events reach the KV
directory (Alg. E.1/E.2), its counts reach the engines, and ``branch-count`` host eviction
keeps what active branches still reference while ``lru`` drops it (paper §4.3, §5.3, C.1).

Crafted scenarios on the ``tiny`` profile (4-token blocks, L1 64 blocks), 1P1D, host memory
cut to 128 blocks so that other traffic overflows it while one branch waits for a tool.
"""

from __future__ import annotations

import pytest

from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.run import simulate
from evolving_infra.traces.schema import TraceRequest
from services.worker.scheduler import EngineScheduler

from .conftest import BS

HOST_TOKENS = 128 * BS
WAIT_BLOCKS = 12


def _req(rid: str, agent: str, branch: str, blocks: list[int], *, after: str | None = None, pause: float = 0.0,
         kind: str | None = None, parent: str | None = None, ends: bool = False, compaction: bool = False) -> TraceRequest:
    return TraceRequest(
        id=rid, agent=agent, branch=branch, input_tokens=len(blocks) * BS + 1, output_tokens=2, blocks=blocks,
        kind=kind, parent_branch=parent, after=[after] if after else [], pause_s=pause, ends_branch=ends,
        compaction=compaction,
    )


def waiter(pause: float = 1.0) -> list[TraceRequest]:
    """One branch: a request, a tool call of ``pause`` s, then a request extending the first."""
    first = list(range(1_000, 1_000 + WAIT_BLOCKS))
    return [
        _req("w-r0", "w", "w-main", first, kind="main"),
        _req("w-r1", "w", "w-main", first + [1_100, 1_101], after="w-r0", pause=pause, ends=True),
    ]


def churn(n: int = 12, blocks: int = 12) -> list[TraceRequest]:
    """``n`` one-request agents with private prompts; each branch ends with its request."""
    return [
        _req(f"c{i}-r0", f"c{i}", f"c{i}-main", list(range(10_000 * (i + 1), 10_000 * (i + 1) + blocks)), kind="main", ends=True)
        for i in range(n)
    ]


def compactor(rounds: int = 6, blocks: int = 24) -> list[TraceRequest]:
    """One branch whose every request after the first rewrites its context (compaction): the
    old history leaves the path, so Alg. E.1 bumps the version and releases it."""
    out = []
    for i in range(rounds):
        path = list(range(500_000 + 1_000 * i, 500_000 + 1_000 * i + blocks))
        out.append(_req(f"k-r{i}", "k", "k-main", path, kind="main" if i == 0 else None, after=f"k-r{i - 1}" if i else None,
                        pause=0.01 if i else 0.0, ends=i == rounds - 1, compaction=i > 0))
    return out


def run(reqs: list[TraceRequest], eviction: str, concurrency: int = 2):
    cfg = SimConfig(nodes=2, profile="tiny", policy="static:1P1D", concurrency=concurrency, eviction=eviction,
                    host_capacity_tokens=HOST_TOKENS, seed=1)
    return simulate(cfg, reqs, BS)


def record(res, rid: str):
    return next(r for r in res.records if r.id == rid)


@pytest.fixture
def pushed(monkeypatch):
    """Every count list an engine's host pool receives: (node, {hash: count}).

    Spied on each engine's own host pool (``sched.kv.host.update_counts``), the method that
    applies the counts: the simulator hands them there directly, not through
    :meth:`EngineScheduler.update_counts` (a wrapper frame it skips), so a spy on the wrapper
    would see nothing while the counts still arrive."""
    calls: list[tuple[str, dict[int, int]]] = []
    orig_init = EngineScheduler.__init__

    def init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        host, node = self.kv.host, self.node
        orig = host.update_counts

        def spy(hashes, counts, chains=None):
            calls.append((node, dict(zip(hashes, counts))))
            return orig(hashes, counts, chains)

        host.update_counts = spy

    monkeypatch.setattr(EngineScheduler, "__init__", init)
    return calls


def test_a_branch_waiting_for_a_tool_keeps_its_blocks_under_branch_count_and_loses_them_under_lru(pushed):
    reqs = waiter() + churn()
    lru = run(reqs, "lru")
    assert not pushed, "lru engines do not read counts: none are sent"
    bc = run(reqs, "branch-count")
    full = WAIT_BLOCKS * BS
    assert record(bc, "w-r1").cached_tokens == full, "the waiting branch's prefix survived the overflow"
    assert record(lru, "w-r1").cached_tokens < full, "LRU evicted the oldest blocks: the waiting branch's"
    assert record(bc, "w-r1").ideal_cached_tokens == record(lru, "w-r1").ideal_cached_tokens == full
    # C.1 attribution: same prefill node as the branch's previous request -> eviction
    assert record(lru, "w-r1").lost_reuse_cause == "eviction"
    assert record(bc, "w-r1").lost_reuse_cause == "none"
    assert all(record(lru, f"c{i}-r0").lost_reuse_cause == "none" for i in range(12)), "private prompts: nothing to lose"
    assert lru.report["lost_kv_reuse"] > 0 and lru.report["lost_kv_reuse_eviction_share"] == 1.0
    assert bc.report["lost_kv_reuse"] == 0 and bc.report["lost_kv_reuse_eviction_share"] == 0.0
    # the directory classified the L2 evictions of the prefill node by the block's count there
    assert lru.report["host_evictions"]["prefill.positive_count"] >= WAIT_BLOCKS - 1
    assert bc.report["host_evictions"].get("prefill.positive_count", 0) == 0
    assert bc.report["host_evictions"]["prefill.zero_count"] > 0
    assert bc.report["kv_directory"]["branch.ended"] == 13 and bc.report["kv_directory"]["branch.started"] == 13
    # counts reached the prefill engine: +1 when the waiter was placed, 0 once a churn branch ended
    to_w0 = [c for node, c in pushed if node == "w0"]
    assert any(c.get(1_000) == 1 for c in to_w0)
    assert any(c.get(10_000) == 0 for c in to_w0)
    r1_placed = next(i for i, c in enumerate(to_w0) if 1_100 in c)
    assert all(c.get(1_000, 1) >= 1 for c in to_w0[:r1_placed]), "the waiter's count stays positive while it waits"


def test_compaction_releases_the_dropped_history_which_branch_count_evicts_first():
    reqs = waiter() + compactor()
    lru = run(reqs, "lru")
    bc = run(reqs, "branch-count")
    assert bc.report["kv_directory"]["branch.version_bumps"] == 5, "each compaction is a version bump (Alg. E.1)"
    full = WAIT_BLOCKS * BS
    assert record(bc, "w-r1").cached_tokens == full
    assert record(lru, "w-r1").cached_tokens < full
    assert bc.report["host_evictions"].get("prefill.positive_count", 0) == 0
    assert lru.report["host_evictions"]["prefill.positive_count"] > 0


def test_a_forks_first_request_is_attributed_against_its_parents_prefill_node():
    parent = list(range(2_000, 2_000 + WAIT_BLOCKS))
    reqs = [
        _req("p-r0", "p", "p-main", parent, kind="main"),
        _req("f-r0", "p", "p-fork", parent + [2_100], kind="fork", parent="p-main", after="p-r0", pause=1.0, ends=True),
        _req("p-r1", "p", "p-main", parent + [2_200], after="f-r0", ends=True),
    ] + churn()
    lru = run(reqs, "lru")
    fork = record(lru, "f-r0")
    assert fork.ideal_cached_tokens == WAIT_BLOCKS * BS and fork.cached_tokens < fork.ideal_cached_tokens
    assert fork.lost_reuse_cause == "eviction", "the fork continues its parent's context on the same node"
    bc = run(reqs, "branch-count")
    assert record(bc, "f-r0").cached_tokens == WAIT_BLOCKS * BS, "the parent's count kept the shared prefix"


def test_silent_branches_expire_in_the_simulator_as_in_the_live_directory(monkeypatch):
    from services.kvdirectory import core

    orig = core.KvDirectory.__init__

    def short_ttl(self, block_size, **kw):
        kw["branch_ttl_s"] = 0.5
        orig(self, block_size, **kw)

    monkeypatch.setattr(core.KvDirectory, "__init__", short_ttl)
    reqs = waiter(pause=1.0) + churn()
    bc = run(reqs, "branch-count")
    assert bc.report["kv_directory"]["branch.expired"] >= 1
    # the expired waiter lost its counts; its next placement is a resume, served (issue 21), not refused
    assert bc.report["kv_directory"].get("place.ended_branch", 0) == 0
    assert bc.report["kv_directory"]["branch.resumed"] >= 1
    assert bc.report["requests_completed"] == len(reqs) and bc.report["requests_failed"] == 0
