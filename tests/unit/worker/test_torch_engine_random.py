"""Randomized: the torch engine's greedy outputs equal a plain full-sequence forward.

Hypothesis draws a few requests (prompts sharing random-length prefixes of one base,
random output lengths and arrival steps), a node's L1/L2 sizes (down to a few pages, so
requests wait for room, cached pages are evicted and restored) and chunk budget (down to
9 tokens, so prompts span several chunks), and whether the requests run collocated or
prefill on one node and decode on another (hand-offs delivered as they are produced,
interleaved with the decode node's steps, or one at a time once the last has ended, so a
hand-off lands on pages an ended request freed). It found neither defect of session 37
(a decode row reusing an ended request's gathered keys, a queued hand-off's page bytes
dropped: both need exact lengths, see ``test_torch_engine.py``) in 150 examples; it guards
the paths as a whole. ``EngineScheduler`` + ``TorchEngine``
(``LocalNode``, full invariants after every step) must give each request the tokens and
logprobs (1e-4) of ``transformers``' forward over the whole sequence without a KV cache,
one token at a time. Needs the ``torch`` extra and ``transformers``; skipped without them.
"""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shared.messages import Sampling  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402
from services.worker.plan import WorkRejected  # noqa: E402
from tests.unit.worker.torch_tiny import BS, PROFILE, work  # noqa: E402


class FullForward:
    """Greedy continuation by ``transformers``' forward over the whole sequence each step
    (no KV cache): the token ids and the chosen tokens' log-probabilities, memoised."""

    def __init__(self, folder: str) -> None:
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.memo: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def gap(self, seq: list[int], want: int, got: int) -> float:
        """The full forward's logit of ``want`` less that of ``got`` for the token after ``seq``."""
        with torch.no_grad():
            logits = self.hf(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        return float(logits[want] - logits[got])

    def __call__(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        key = (*prompt, -n)
        if key not in self.memo:
            seq, out, lps = list(prompt), [], []
            with torch.no_grad():
                for _ in range(n):
                    logits = self.hf(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
                    t = int(logits.argmax())
                    out.append(t)
                    lps.append(float(torch.log_softmax(logits, -1)[t]))
                    seq.append(t)
            self.memo[key] = (out, lps)
        return self.memo[key]


NEAR_TIE = 1e-4
"""Logits closer than this (float32 noise of a different summation order) may swap a greedy choice."""


@pytest.fixture(scope="module")
def full_forward(tiny_llama):
    return FullForward(tiny_llama)


def sized(pages: int, host_pages: int, chunk: int):
    """``torch-tiny-cpu`` with ``pages`` L1 pages, ``host_pages`` L2 pages, a ``chunk``-token budget, 4 running."""
    return msgspec.structs.replace(
        PROFILE,
        memory=msgspec.structs.replace(PROFILE.memory, gpu_kv_tokens=pages * BS, host_kv_tokens=host_pages * BS),
        scheduler=msgspec.structs.replace(PROFILE.scheduler, chunk_tokens=chunk, max_running=4),
    )


request = st.tuples(
    st.one_of(st.sampled_from([0, 1, BS - 1, BS, BS + 1, 2 * BS, 3 * BS]), st.integers(0, 40)),  # tokens of the shared base it starts with
    st.integers(0, 12),  # its own tokens after them
    st.integers(1, 12),  # max_tokens
    st.integers(0, 12),  # arrival: steps after the previous request
    st.booleans(),  # asks for logprobs
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(seed=1525, reqs=[(16, 2, 11, 0, False), (22, 8, 11, 4, False), (0, 0, 10, 2, False), (7, 0, 3, 7, False)], pages=12,
         host_extra=0, chunk=9, pd=False, one_by_one=False)  # a near-tie at r1's 11th token (fresh-clone CI, session 55)
@given(
    seed=st.integers(0, 2**16),
    reqs=st.lists(request, min_size=1, max_size=6),
    pages=st.sampled_from([6, 8, 12, 128]),
    host_extra=st.sampled_from([0, 4, 64]),
    chunk=st.sampled_from([9, 16, 256]),
    pd=st.booleans(),
    one_by_one=st.booleans(),
)
def test_random_requests_equal_the_full_forward(tiny_llama, full_forward, seed, reqs, pages, host_extra, chunk, pd, one_by_one):
    rng = random.Random(seed)
    base = [rng.randrange(500) for _ in range(40)]
    prof = sized(pages, pages + host_extra, chunk)
    first = LocalNode("p" if pd else "a", prof, tiny_llama, phase="prefill" if pd else "both")
    second = LocalNode("d", prof, tiny_llama, phase="decode") if pd else None
    want: dict[str, tuple[list[int], int, bool]] = {}
    delivered = 0

    def step_all() -> bool:
        nonlocal delivered
        moved = first.step()
        if second is not None:
            for h in first.handoffs[delivered:]:
                if one_by_one and second.core.requests:  # the next only once the last has ended
                    break
                delivered += 1
                try:
                    second.add_decode(h.work)
                except WorkRejected:  # prompt + max_tokens larger than the decode node's L1
                    assert -(-(len(want[h.rid][0]) + want[h.rid][1]) // BS) > pages
                    del want[h.rid]
            moved = second.step() or moved
        return moved

    for i, (shared, own, n, wait, lp) in enumerate(reqs):
        for _ in range(wait):
            step_all()
        prompt = (base[:shared] + [rng.randrange(500) for _ in range(own)]) or [rng.randrange(500)]
        rid = f"r{i}"
        try:
            first.add_prefill(work(rid, prompt, Sampling(logprobs=1) if lp else None, "d" if pd else None, n=n))
        except WorkRejected:  # footprint larger than L1: refused at once, as it should be
            assert -(-(len(prompt) + (0 if pd else n)) // BS) > pages
            continue
        want[rid] = (prompt, n, lp)
    for _ in range(10_000):
        if step_all():
            continue
        due = [(node, node.core.next_deadline()) for node in (first, second) if node is not None]
        if all(t is None for _, t in due):
            break
        for node, t in due:  # a hand-off's KV due later: move that node's clock on
            if t is not None:
                node.now = max(node.now, t)
    for rid, (prompt, n, lp) in want.items():
        got = first.finished.get(rid) or (second.finished.get(rid) if second else None)
        assert got is not None, f"{rid} never finished"
        tokens, lps = full_forward(prompt, n)
        if got.tokens != tokens:
            # greedy decoding on a near-tie: the engine's chunked, paged attention sums in another order than the full
            # forward, so two logits within float noise may swap (seed 1525: 10.773426 vs 10.773420 at the 11th token);
            # both continuations are right from there on, so compare up to it. A defect moves logits by far more.
            i = next(k for k in range(min(len(got.tokens), len(tokens))) if got.tokens[k] != tokens[k])
            assert len(got.tokens) == len(tokens) and full_forward.gap(prompt + tokens[:i], tokens[i], got.tokens[i]) < NEAR_TIE, rid
            same = i
        else:
            same = n
        if lp:
            mine = dict(got.logprobs or {})
            if pd and n > 1:
                mine.update(first.handoff_logprobs.get(rid, {}))
            assert sorted(mine) == list(range(n)), rid
            for i in range(same):
                assert abs(mine[i][0] - lps[i]) < 1e-4, (rid, i)
