"""Observer: iteration records settled late give what adding them at once gives."""

import random

import pytest

from services.planner import observe
from services.planner.fit import FitSamples
from services.planner.observe import Observer
from shared.messages import IterationRecord

from .helpers import done


def _records(rng: random.Random, n: int) -> list[tuple[str, IterationRecord]]:
    out = []
    t = 0.0
    for _ in range(n):
        t += rng.uniform(0.0, 7.0)
        phase = rng.choice(["prefill", "decode", "mixed"])
        rec = IterationRecord(
            start=t,
            duration_s=rng.uniform(0.01, 2.0),
            phase=phase,
            prefill_requests=0 if phase == "decode" else 1,
            sum_uncached=0 if phase == "decode" else rng.randint(1, 8192),
            sum_restored=0 if phase == "decode" else rng.randint(0, 4096),
            decode_batch=0 if phase == "prefill" else rng.randint(1, 64),
            repeat=rng.randint(1, 40) if phase == "decode" else 1,
        )
        out.append((rng.choice(["a", "b"]), rec))
    return out


def _eager(records: list[tuple[str, IterationRecord]], size: float, k0: int, k1: int, node: str) -> tuple:
    """The sums the queries read, added record by record (what the Observer did before)."""
    it = unc = rst = dit = dtime = 0.0
    for n, r in records:
        k = int((r.start // size))
        if n != node or not k0 <= k < k1:
            continue
        if r.phase != "decode":
            it += 1
            unc += r.sum_uncached
            rst += r.sum_restored
        if r.phase != "prefill":
            dit += r.repeat
            dtime += r.duration_s * r.repeat
    return it, unc, rst, dit, dtime


def test_pending_records_are_settled_before_a_query():
    rng = random.Random(11)
    recs = _records(rng, 400)
    obs = Observer(["a", "b"], 60.0, keep_buckets=1000)
    for i, (node, r) in enumerate(recs):
        obs.on_iterations(node, [r], r.start + r.duration_s)
        if i % 50 == 0:  # completions in between make their own buckets, as before
            obs.on_request_done(done(f"r{i}", r.start, prompt=5000, cached=1000, node=node), r.start + r.duration_s)
    assert obs._pending  # nothing has read the sums yet
    last = int(recs[-1][1].start // 60.0) + 1
    for node in ("a", "b"):
        it, unc, rst, dit, dtime = _eager(recs, 60.0, 0, last, node)
        assert obs.mean_chunk_tokens(node, 0, last) == pytest.approx(unc / it, rel=1e-12)
        assert not obs._pending
        assert obs.tpot(node, 0, last, 1.0) == pytest.approx(dtime / dit, rel=1e-12)
        cached = sum(b.cached_by_node.get(node, 0.0) for b in obs.buckets.values())
        assert obs.restored_share(node, 0, last) == pytest.approx(min(1.0, rst / cached), rel=1e-12)


def test_a_records_bucket_is_made_when_the_record_arrives(monkeypatch):
    monkeypatch.setattr(observe, "_SETTLE_AT", 3)
    obs = Observer(["a"], 10.0)
    r = IterationRecord(start=25.0, duration_s=1.0, phase="prefill", prefill_requests=1, sum_uncached=100)
    obs.on_iterations("a", [r], 26.0)
    assert 2 in obs.buckets and obs.buckets[2].prefill_iters == {}  # made now, summed later
    obs.on_iterations("a", [r, r], 26.0)  # the third pending record settles them all
    assert obs.buckets[2].prefill_iters == {"a": 3} and obs.buckets[2].prefill_uncached == {"a": 300.0}


def test_fit_samples_rows_are_made_from_the_kept_records():
    s = FitSamples(cap=2, seed=3)
    recs = [IterationRecord(start=float(i), duration_s=0.5 + i, phase="mixed", sum_uncached=i, sum_qk_pairs=3 * i, sum_restored=i // 2, decode_batch=4, repeat=1) for i in range(5)]
    s.add(recs)
    assert s.seen == 5 and len(s) == 2 and all(r in recs for r in s.kept)
    assert s.rows == [(2, float(r.sum_uncached), float(r.sum_qk_pairs), float(r.sum_restored), 4.0, r.duration_s, 1.0) for r in s.kept]
    s.clear()
    assert len(s) == 0 and s.rows == [] and s.seen == 5
