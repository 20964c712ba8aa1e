"""Seeded random operation streams against the scheduler of a prefill node and a
decode node, with the full invariant check after every operation (STYLE §6).

Seeds: ``EI_WORKER_FUZZ_SEEDS`` (comma list) and ``EI_WORKER_FUZZ_OPS`` override
the defaults; a failure names its seed in the test id.
"""

from __future__ import annotations

import os
import random

import msgspec
import pytest

from shared.messages import FetchRange
from services.worker.blocks import KvBlockManager, KvInvariantError
from services.worker.plan import HandOff, SchedulerError, TokensOut, WorkRejected

SEEDS = [int(x) for x in os.environ.get("EI_WORKER_FUZZ_SEEDS", "1,2,3,4,5,6").split(",")]
OPS = int(os.environ.get("EI_WORKER_FUZZ_OPS", "600"))


def drive(b, seed: int, ops: int) -> dict[str, int]:
    """Run ``ops`` random operations; returns counters so the test can tell work happened."""
    rng = random.Random(seed)
    prof = b.profile()
    nodes = {
        "w0": b.sched(prof, phase="both", node="w0", host_eviction=rng.choice(["lru", "branch-count"]),
                      external_fetch=rng.random() < 0.5),
        "w1": b.sched(prof, phase="decode", node="w1"),
    }
    inflight = {n: None for n in nodes}
    now = 0.0
    stems = [[rng.randrange(10_000) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    live: dict[str, str] = {}  # rid -> node
    transfers: list = []  # FetchStarted not yet reported (external_fetch)
    produced: dict[str, int] = {}
    stats = {"finished": 0, "handoffs": 0, "aborts": 0, "rejected": 0, "folded": 0, "fetch_plans": 0, "parked": 0}
    next_id = 0
    unbound: set[str] = set()  # decode_later requests not bound yet (route.bind under way)

    def check_all():
        for s in nodes.values():
            s.check()

    def take(outs, now):
        for o in outs:
            if isinstance(o, TokensOut):
                assert o.index == produced.get(o.rid, 0), "output positions are contiguous"
                produced[o.rid] = o.index + o.count
                if o.finished:
                    live.pop(o.rid, None)
                    stats["finished"] += 1
            elif isinstance(o, HandOff):
                stats["handoffs"] += 1
                try:
                    nodes[o.decode_node].add_decode(o.work, now)
                    live[o.rid] = o.decode_node
                except WorkRejected:
                    live.pop(o.rid, None)
                    stats["rejected"] += 1

    for _ in range(ops):
        op = rng.random()
        if op < 0.25:  # a new prefill request on w0, sharing a prefix with earlier ones
            stem = rng.choice(stems)
            ids = stem[: rng.randint(0, len(stem))] + [rng.randrange(10_000) for _ in range(rng.randint(0, 6))]
            rid = f"r{next_id}"
            next_id += 1
            target = rng.choice([None, "w1", "later"])  # later: bound at its prefill start or after (parked)
            w = b.prefill(rid, ids, tail=rng.randint(0 if ids else 1, 3), max_tokens=rng.randint(1, 30),
                          decode_node=target if target != "later" else None)
            if ids and rng.random() < 0.3:  # the router's fetch plan: the prefix from a peer's L2
                cut = rng.randint(0, len(ids))
                w = msgspec.structs.replace(
                    w, fetch=[FetchRange(node="w9", start=0, end=cut), FetchRange(node="w8", start=cut, end=len(ids))]
                )
                stats["fetch_plans"] += 1
            try:
                nodes["w0"].add_prefill(w, now, decode_later=target == "later")
                live[rid] = "w0"
                if target == "later":
                    unbound.add(rid)
            except WorkRejected:
                stats["rejected"] += 1
            transfers.extend(nodes["w0"].take_fetch_starts())
        elif op < 0.27 and transfers:  # real-bytes mode: a transfer reports, some blocks missing
            fs = transfers.pop(rng.randrange(len(transfers)))
            hashes = [h for _, hs in fs.sources for h in hs]
            missing = rng.sample(hashes, rng.randint(0, min(2, len(hashes))))
            nodes["w0"].fetch_done(fs.rid, missing, now)
        elif op < 0.32 and live:  # abort anywhere, possibly while in flight
            rid = rng.choice(sorted(live))
            assert nodes[live.pop(rid)].abort(rid, now)
            unbound.discard(rid)
            stats["aborts"] += 1
        elif op < 0.36:  # branch counts from the directory
            host = nodes["w0"].kv.host.blocks
            if host:
                hs = rng.sample(sorted(host), min(len(host), 5))
                nodes["w0"].update_counts(hs, [rng.choice([0, 0, 1, 2]) for _ in hs])
        elif op < 0.40 and unbound:  # a decode_later request's route.bind answers: waiting, prefilling or parked
            rid = rng.choice(sorted(unbound))
            unbound.discard(rid)
            if rid in nodes["w0"].requests:
                stats["parked"] += rid in nodes["w0"].parked
                take(nodes["w0"].bind_decode(rid, "w1", now), now)
        else:  # advance one node
            name = rng.choice(sorted(nodes))
            s = nodes[name]
            plan = inflight[name]
            if plan is None:
                horizon = rng.choice([None, now + rng.random() * 0.05, 1e9])
                plan = s.schedule(now, horizon)
                if plan is None:
                    d = s.next_deadline()
                    if d is not None:
                        now = max(now, d)
                    else:
                        now += rng.random() * 0.01
                else:
                    stats["folded"] += plan.iterations > 1
                    inflight[name] = plan
            else:
                inflight[name] = None
                now = max(now, plan.end)
                take(s.finish_iteration(plan, now), now)
                unbound.intersection_update(nodes["w0"].requests)  # finished at its prefill (one token): nothing to bind
        check_all()
        for s in nodes.values():
            s.take_kv_events()
    stats["fetched"] = nodes["w0"].fetch_counters.get("completed", 0)
    return stats


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed={s}" for s in SEEDS])
def test_random_operations_keep_invariants(b, seed):
    stats = drive(b, seed, OPS)
    assert stats["finished"] > 10 and stats["handoffs"] > 0 and stats["aborts"] > 0 and stats["parked"] > 0, stats
    assert stats["fetched"] > 0, stats


def test_harness_catches_a_core_that_leaks_releases(b, monkeypatch):
    """Self-test: a block manager whose release forgets the last page must fail the check."""
    real = KvBlockManager.release

    def leaky(self, path, n_held, reserved):
        real(self, path, max(0, n_held - 1), reserved)

    monkeypatch.setattr(KvBlockManager, "release", leaky)
    with pytest.raises((KvInvariantError, SchedulerError)):
        drive(b, SEEDS[0], OPS)
