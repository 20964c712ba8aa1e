"""Observer: inputs logged and applied when read give what applying each at once gives."""

import random

import pytest

from services.planner import observe
from services.planner.fit import FitSamples
from services.planner.observe import Observer
from shared.messages import IterationRecord

from .helpers import done, state

NODES = ["a", "b", "c"]


def _inputs(rng: random.Random, n: int) -> list[tuple]:
    """A random stream of the four inputs, in time order (records start before they arrive)."""
    out: list[tuple] = []
    t = 0.0
    for i in range(n):
        t += rng.uniform(0.0, 9.0)
        x = rng.random()
        node = rng.choice(NODES)
        if x < 0.5:
            phase = rng.choice(["prefill", "decode", "mixed"])
            rec = IterationRecord(
                start=max(0.0, t - rng.uniform(0.0, 30.0)),
                duration_s=rng.uniform(0.01, 2.0),
                phase=phase,
                prefill_requests=0 if phase == "decode" else 1,
                sum_uncached=0 if phase == "decode" else rng.randint(1, 8192),
                sum_restored=0 if phase == "decode" else rng.randint(0, 4096),
                decode_batch=0 if phase == "prefill" else rng.randint(1, 64),
                repeat=rng.randint(1, 40) if phase == "decode" else 1,
            )
            out.append(("iters", node, [rec], t))
        elif x < 0.8:
            cached = rng.randint(0, 90_000)
            out.append(("done", done(f"r{i}", t, prompt=cached + rng.randint(1, 20_000), cached=cached, node=node, ttft=rng.uniform(0.1, 200.0)), t))
        elif x < 0.95:
            ph = rng.choice(["prefill", "decode", "both"])
            out.append(("state", state(node, ph, decoding=rng.randint(0, 9), waiting=rng.randint(0, 3), queue=rng.randint(0, 4)), t))
        else:
            out.append(("advance", t))
    return out


def _feed(obs: Observer, item: tuple) -> None:
    kind = item[0]
    if kind == "iters":
        obs.on_iterations(item[1], item[2], item[3])
    elif kind == "done":
        obs.on_request_done(item[1], item[2])
    elif kind == "state":
        obs.on_node_state(item[1], item[2])
    else:
        obs.advance(item[1])


def _reads(obs: Observer, now: float) -> tuple:
    k1 = obs.index(now) + 1
    k0 = k1 - 6
    out = [obs.slices(k0, 6), obs.pooled(k0, k1), obs.arrival_rate(k0, k1), obs.requests_in(k0, k1), obs.decode_now, obs.queue_now]
    for n in NODES:
        out += [obs.mean_chunk_tokens(n, k0, k1), obs.restored_share(n, k0, k1), obs.tpot(n, k0, k1, 1.7)]
    out.append(dict(obs.buckets))
    return tuple(out)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_logged_inputs_read_as_inputs_applied_at_once(monkeypatch, seed):
    rng = random.Random(seed)
    stream = _inputs(rng, 3000)
    reads_at = set(rng.sample(range(len(stream)), 12)) | {len(stream) - 1}
    lazy = Observer(NODES, 60.0, keep_buckets=10)  # a short keep: buckets are dropped on the way
    got = []
    for i, item in enumerate(stream):
        _feed(lazy, item)
        if i in reads_at:
            got.append(_reads(lazy, item[-1]))
    monkeypatch.setattr(observe, "_REPLAY_LEN", 4)  # every input applied as it comes (4 log slots an input)
    eager = Observer(NODES, 60.0, keep_buckets=10)
    want = []
    for i, item in enumerate(stream):
        _feed(eager, item)
        assert not eager._log
        if i in reads_at:
            want.append(_reads(eager, item[-1]))
    assert got == want
    assert lazy.latest == eager.latest and lazy.latest_at == eager.latest_at


def test_inputs_wait_in_the_log_until_read():
    obs = Observer(NODES, 10.0)
    r = IterationRecord(start=25.0, duration_s=1.0, phase="prefill", prefill_requests=1, sum_uncached=100)
    obs.on_iterations("a", [r], 26.0)
    obs.on_request_done(done("r1", 27.0, node="a"), 27.0)
    obs.on_node_state(state("a", "decode", decoding=3), 28.0)
    assert len(obs._log) == 3 * 4 and not obs._buckets
    assert obs.latest["a"].decoding == 3 and obs.latest_at["a"] == 28.0  # set at once
    assert obs.mean_chunk_tokens("a", 0, 5) == 100.0
    assert not obs._log and obs.decode_now == 3.0
    assert obs.buckets[2].n_done == 1 and obs.buckets[2].prefill_iters == {"a": 1}


def test_a_full_log_is_applied(monkeypatch):
    monkeypatch.setattr(observe, "_REPLAY_LEN", 12)  # 3 inputs
    obs = Observer(NODES, 10.0)
    obs.advance(0.0)
    obs.advance(5.0)
    assert len(obs._log) == 2 * 4
    obs.advance(12.0)
    assert not obs._log and obs._buckets[0].covered_s == 10.0 and obs._buckets[1].covered_s == 2.0


def test_fit_samples_rows_are_made_from_the_kept_records():
    s = FitSamples(cap=2, seed=3)
    recs = [IterationRecord(start=float(i), duration_s=0.5 + i, phase="mixed", sum_uncached=i, sum_qk_pairs=3 * i, sum_restored=i // 2, decode_batch=4, repeat=1) for i in range(5)]
    s.add(recs)
    assert s.seen == 5 and len(s) == 2 and all(r in recs for r in s.kept)
    assert s.rows == [(2, float(r.sum_uncached), float(r.sum_qk_pairs), float(r.sum_restored), 4.0, r.duration_s, 1.0) for r in s.kept]
    s.clear()
    assert len(s) == 0 and s.rows == [] and s.seen == 5
