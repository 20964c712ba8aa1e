"""Randomized: peer fetches (``external_fetch``) on the real core + torch engine never break the page map.

Hypothesis draws a node's L1/L2 sizes (down to 6 pages, L2 = L1, so fetched pages are evicted
and fetches find no room) and chunk budget, and a sequence of: requests fetching 1-6 pages of one
of three prompts a peer computed (sharing prefixes, so fetches overlap), their transfers ending
in any order with a tail of pages missing (as the worker's ``_transfer``: bytes committed to a
pool, ``take_fetched``, ``fetch_done`` or its late path), aborts mid-fetch, re-dispatches of the
same rid while its old transfer runs (the worker's ``_newest_attempt``), and steps. Full
invariants after every step (``LocalNode``); every request left must get the tokens of
``transformers``' full forward and no fetched bytes may stay held. With fetches keyed by rid it
fails within a few hundred examples (an old transfer completing the re-dispatched request's fetch:
``KvMapError``). Needs the ``torch`` extra and ``transformers``; skipped without them.
"""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from shared.messages import FetchRange  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402
from services.worker.kvpool.pool import FetchResult  # noqa: E402
from services.worker.plan import WorkRejected  # noqa: E402
from tests.unit.worker.test_torch_engine_fetch import BufferPool, take_fetched  # noqa: E402
from tests.unit.worker.test_torch_engine_random import FullForward, sized  # noqa: E402
from tests.unit.worker.torch_tiny import BS, PROFILE, work  # noqa: E402


@pytest.fixture(scope="module")
def full_forward(tiny_llama):
    return FullForward(tiny_llama)


@pytest.fixture(scope="module")
def peer(tiny_llama):
    """Peer ``a`` with three prompts (two sharing 3 pages, one extending the first) in its L2."""
    rng = random.Random(99)
    base = [rng.randrange(500) for _ in range(6 * BS)]
    prompts = [base[: 5 * BS + 3], base[: 3 * BS] + [rng.randrange(500) for _ in range(2 * BS + 1)], base[: 6 * BS]]
    a = LocalNode("a", PROFILE, tiny_llama)
    for i, p in enumerate(prompts):
        a.add_prefill(work(f"w{i}", p, n=1))
    a.run()
    return a, prompts


op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 6), st.integers(1, 6)),  # prompt, max_tokens, pages fetched
    st.tuples(st.just("deliver"), st.integers(0, 5), st.integers(-1, 6)),  # which transfer, first missing page (-1: none)
    st.tuples(st.just("abort"), st.integers(0, 5)),
    st.tuples(st.just("redispatch"), st.integers(0, 5), st.integers(1, 6)),  # which request, pages the new attempt fetches
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
@given(
    ops=st.lists(op, min_size=8, max_size=40),
    pages=st.sampled_from([6, 8, 12, 64]),
    host_extra=st.sampled_from([0, 3, 64]),
    chunk=st.sampled_from([9, 16, 256]),
)
def test_random_fetches_keep_the_page_map(tiny_llama, full_forward, peer, ops, pages, host_extra, chunk):
    a, prompts = peer
    b = LocalNode("b", sized(pages, pages + host_extra, chunk), tiny_llama, external_fetch=True)
    pool = BufferPool(64, b.engine.pool_slot_bytes())
    transfers = []  # FetchStarted whose bytes are still moving
    live: dict[str, tuple[list[int], int]] = {}
    n_rids = 0

    def add(rid: str, pi: int, n: int, k: int) -> None:
        p = prompts[pi]
        try:
            b.add_prefill(msgspec.structs.replace(work(rid, p, n=n), fetch=[FetchRange(node="a", start=0, end=k)]))
        except WorkRejected:
            return
        live[rid] = (p, n)
        transfers.extend(b.core.take_fetch_starts())

    def deliver(i: int, first_missing: int) -> None:  # the worker's _transfer, the pool's fetch included
        fs = transfers.pop(i % len(transfers))
        hs = [h for _, x in fs.sources for h in x]
        missing = set(hs[first_missing:]) if 0 <= first_missing < len(hs) else set()
        fetched, already = [], []
        for h in hs:
            if h in missing:
                continue
            if pool.has(h):
                already.append(h)
            else:
                pool.buffer.put(h, b.now, a.engine.host_page(h).contiguous().view(torch.uint8).numpy())
                fetched.append(h)
        missing |= take_fetched(b.engine, pool, [FetchResult("a", len(hs), fetched=tuple(fetched), already=tuple(already))], fs.fetch_id)
        if not b.core.fetch_done(fs.rid, missing, b.now, fs.fetch_id):
            b.engine.drop_fetched(fs.fetch_id)
        for h in b.core.kv.host.absent(hs):  # pages L2 will not hold (yet): the pool lets them go
            pool.buffer.evict(h, b.now)

    for o in ops:
        if o[0] == "add":
            add(f"r{n_rids}", o[1], o[2], o[3])
            n_rids += 1
        elif o[0] == "deliver" and transfers:
            deliver(o[1], o[2])
        elif o[0] == "abort" and live:
            rid = sorted(live)[o[1] % len(live)]
            if b.core.abort(rid, b.now):
                b._drain()
            del live[rid]
        elif o[0] == "redispatch" and live:
            rid = sorted(live)[o[1] % len(live)]
            p, n = live.pop(rid)
            if rid in b.core.requests:  # a newer attempt: the held one is aborted, the new one served
                b.core.abort(rid, b.now)
                b._drain()
                add(rid, prompts.index(p), n, o[2])
            else:
                b.finished.pop(rid, None)
        elif o[0] == "step":
            for _ in range(o[1]):
                if not b.step():
                    b.now += 0.01
    while transfers:
        deliver(0, -1)
    b.run()
    for rid, (p, n) in live.items():
        assert b.finished[rid].tokens == full_forward(p, n)[0], rid
    assert not b.engine._fetched and not b.core.fetching
