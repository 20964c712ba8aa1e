"""Per-request sampling in the torch engine (``torch_engine/sampling.py``, ``TorchEngine``).

Sampler: greedy rows are the argmax (bit-identical to the engine's old call, also inside a
mixed batch); temperature > 0 varies across seeds and is reproducible with one; ``top_k=1``
and a tiny ``top_p`` are the argmax; ``top_k`` / ``min_p`` never pick a filtered token; the
draws follow softmax(logits / T); a row's token does not depend on the batch around it.

Engine (tiny random model, ``LocalNode``): a seeded request gives the same tokens collocated,
in a batch with other requests, and split over a prefill node and a decode node (hand-off);
another seed gives other tokens; a re-dispatched continuation (prompt + the first k tokens,
``output_offset`` k) continues the same sequence; ``stop_token_ids`` end it with ``finish_reason`` ``stop``
(also with ``ignore_eos``); temperature 0 is the greedy reference.
"""

from __future__ import annotations

import functools
import math
import random

import msgspec
import pytest

torch = pytest.importorskip("torch")

from shared.messages import Sampling  # noqa: E402
from services.worker.engines.torch_engine.local import LocalNode  # noqa: E402
from services.worker.engines.torch_engine.sampling import _draw, sample, sample_rows, splitmix64, uniform, uniforms  # noqa: E402
from tests.unit.worker import torch_tiny  # noqa: E402
from tests.unit.worker.torch_tiny import PROFILE  # noqa: E402

V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 2.0


def test_greedy_rows_are_the_argmax_also_in_a_mixed_batch():
    x = _logits(6)
    ref = x.argmax(dim=-1).tolist()
    assert sample(x, [None] * 6, [0] * 6, list(range(6))) == ref
    assert sample(x, [Sampling()] * 6, [0] * 6, list(range(6))) == ref
    hot = Sampling(temperature=5.0)
    mixed = [None, hot, Sampling(temperature=0.0), hot, None, Sampling(temperature=1e-6)]
    got = sample(x, mixed, [1] * 6, list(range(6)))
    assert [got[i] for i in (0, 2, 4, 5)] == [ref[i] for i in (0, 2, 4, 5)]


def test_temperature_varies_across_seeds_and_is_reproducible_with_one():
    x = _logits(1)
    sp = Sampling(temperature=1.5)
    by_seed = [sample(x, [sp], [s], [0])[0] for s in range(40)]
    assert len(set(by_seed)) > 5
    assert by_seed == [sample(x, [sp], [s], [0])[0] for s in range(40)]
    # the position is part of the draw: one seed, many positions, many tokens
    assert len({sample(x, [sp], [7], [i])[0] for i in range(40)}) > 5


def test_top_k_1_and_tiny_top_p_are_greedy():
    x = _logits(8, seed=1)
    x[3, 10] = x[3, 20] = x[3].max() + 1.0  # a tie: the first maximum, as argmax
    ref = x.argmax(dim=-1).tolist()
    for sp in (Sampling(temperature=2.0, top_k=1), Sampling(temperature=2.0, top_p=1e-6)):
        for seed in range(5):
            assert sample(x, [sp] * 8, [seed] * 8, list(range(8))) == ref


def test_top_k_and_min_p_never_pick_a_filtered_token():
    x = _logits(1, seed=2)
    top3 = set(x[0].topk(3).indices.tolist())
    assert {sample(x, [Sampling(temperature=3.0, top_k=3)], [s], [0])[0] for s in range(200)} <= top3
    p = (x[0] / 3.0).softmax(-1)
    allowed = {i for i in range(V) if p[i] >= 0.5 * p.max()}
    got = {sample(x, [Sampling(temperature=3.0, min_p=0.5)], [s], [0])[0] for s in range(200)}
    assert got <= allowed and len(allowed) > 1
    # top_p: only the smallest head of the distribution with mass >= 0.5
    order = p.argsort(descending=True).tolist()
    mass, head = 0.0, set()
    for i in order:
        head.add(i)
        mass += float(p[i])
        if mass >= 0.5:
            break
    got = {sample(x, [Sampling(temperature=3.0, top_p=0.5)], [s], [0])[0] for s in range(300)}
    assert got <= head and len(head) > 1


def test_a_uniform_at_the_top_of_the_mass_draws_the_last_kept_token():
    """``u`` × the kept mass that reaches the total (a float32 rounding of ``u`` < 1; here ``u`` = 1)
    finds no cumulative probability above it: the draw is the last token with a probability, in
    the row's draw order (sorted rows: the k-th highest; others: the last kept in vocabulary order),
    never a filtered one or an index past the vocabulary."""
    x = torch.tensor([[0.5, 3.0, 1.0, 2.5, -1.0, 0.0]])
    one = torch.ones(1, 1)
    assert sample_rows(x, [Sampling(temperature=1.0, top_k=2)], one) == [3]  # sorted: 1 (3.0), then 3 (2.5)
    assert sample_rows(x, [Sampling(temperature=1.0, min_p=0.5)], one) == [3]  # vocabulary order: 1 and 3 kept
    assert sample_rows(x, [Sampling(temperature=1.0)], one) == [5]  # nothing filtered: the last id
    assert sample_rows(torch.cat([x, x]), [Sampling(temperature=1.0, top_k=2), Sampling(temperature=1.0, top_k=3)],
                       torch.tensor([[1.0], [0.0]])) == [3, 1]  # fmt: skip


def test_cpu_top_k_and_top_p_rows_draw_the_stable_sorts_token_also_with_ties():
    """The CPU draws of ``top_k`` rows (``torch.topk``) and ``top_p``-only rows (values sorted
    without indices) give the token the stable ``[r, V]`` sort gives (``_draw(order="sorted")``,
    the path before them and still the one of other devices), over random rows with many ties
    (logits on a grid of quarters, so also ties at the top-k boundary), -0.0 beside 0.0, -inf
    tokens (``min_tokens`` masks; rows with fewer finite tokens than k), rows that are all one
    value, and uniforms at 0, at the top of the grid and at 1 (the last kept token)."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    checked = 0
    for case in range(60):
        v = rng.choice([7, 16, 50, 301, 1000])
        r = rng.randint(1, 6)
        x = (torch.randint(-12, 12, (r, v), generator=g) / 4.0).float()
        if case % 3 == 0:
            x[x == 0] = -0.0 if case % 2 else 0.0  # a mix of -0.0 and 0.0 in the rows below
            x[:, ::5] = x[:, ::5].abs() * -0.0 + x[:, ::5].clamp(max=0) * 0  # zeros at every 5th id
        if case % 4 == 1:
            x[0, rng.sample(range(v), max(1, v - 3))] = float("-inf")  # fewer finite tokens than k
        if case % 4 == 2:
            x[:, rng.sample(range(v), 2)] = float("-inf")
        if case % 10 == 5:
            x[-1] = 0.5  # all tied
        params = []
        for _ in range(r):
            top_k = rng.choice([0, 1, 2, 3, 5, 17, 50, v - 1, v, v + 3])
            top_p = rng.choice([1.0, 1.0, 0.9, 0.5, 0.2, 1e-6])
            if top_k == 0 and top_p == 1.0:
                top_p = 0.7
            params.append(Sampling(temperature=rng.choice([0.3, 1.0, 1.7]), top_k=top_k, top_p=top_p, min_p=rng.choice([0.0, 0.0, 0.2])))
        orders = ["sorted" if 0 < sp.top_k < v or sp.top_p < 1.0 else "vocab" for sp in params]
        for u0 in (0.0, 1.0 - 2**-24, 1.0, rng.random()):
            u = torch.tensor([[u0 if i % 2 else rng.randrange(1 << 24) / (1 << 24)] for i in range(r)])
            got = sample_rows(x, params, u)
            want = [_draw(x[i : i + 1], [params[i]], u[i : i + 1], order=orders[i])[0] for i in range(r)]
            assert got == want, (case, u0, params)
            checked += orders.count("sorted")
    assert checked > 400
    # a row whose highest value is not finite takes the stable sort (the same ops, so the same token)
    bad = torch.tensor([[0.5, float("nan"), 1.0], [float("inf"), 1.0, 2.0]])
    for sp in (Sampling(temperature=1.0, top_k=2), Sampling(temperature=1.0, top_p=0.5)):
        want = [_draw(bad[i : i + 1], [sp], torch.zeros(1, 1), order="sorted")[0] for i in range(2)]
        assert sample_rows(bad, [sp, sp], torch.zeros(2, 1)) == want


def test_a_row_without_top_p_keeps_its_tail_beside_a_top_p_row():
    """A top-k row (``top_p`` 1.0) drawn at u = 1 takes its last kept token (rank 6 of 7: id 6) alone
    and beside a ``top_p`` row: its float32 running sum passes 1.0 before that token, which the
    top-p cut of the step (``before > top_p``, 1.0 for this row) dropped when a top-p row shared
    it (the draw became id 1)."""
    x = torch.tensor([[0.0, -2.0, 2.75, -2.5, -1.25, 0.0, -2.25]])
    a, b = Sampling(temperature=0.3, top_k=6), Sampling(temperature=1.0, top_p=0.5)
    assert sample_rows(x, [a], torch.ones(1, 1)) == [6]
    assert sample_rows(torch.cat([x, x]), [a, b], torch.ones(2, 1)) == [6, 2]


def test_draws_follow_the_tempered_softmax():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sp = Sampling(temperature=0.8)
    n = 4000
    counts = [0] * 4
    for s in range(n):
        counts[sample(x, [sp], [s], [0])[0]] += 1
    p = (x[0] / 0.8).softmax(-1).tolist()
    for c, q in zip(counts, p):
        assert abs(c / n - q) < 4 * math.sqrt(q * (1 - q) / n) + 1e-3, (counts, p)


def test_a_rows_token_does_not_depend_on_the_batch():
    x = _logits(5, seed=3)
    params = [Sampling(temperature=1.0, top_k=10), Sampling(temperature=0.7, top_p=0.8), None, Sampling(temperature=1.2), Sampling(temperature=1.0, min_p=0.1)]
    seeds, pos = [11, 12, 13, 14, 15], [0, 4, 9, 2, 7]
    whole = sample(x, params, seeds, pos)
    for i in range(5):
        assert sample(x[i : i + 1], [params[i]], [seeds[i]], [pos[i]]) == [whole[i]]
    perm = [4, 2, 0, 3, 1]
    shuffled = sample(x[perm], [params[i] for i in perm], [seeds[i] for i in perm], [pos[i] for i in perm])
    assert shuffled == [whole[i] for i in perm]


def test_splitmix64_and_uniform_match_the_reference_generator():
    """Outputs of Vigna's ``splitmix64.c`` ``next()`` (compiled and run from states 0, 1, 1234 and
    2^64-1: the i-th call's value); the uniform is its top 24 bits / 2^24 (0xE220A8 = 14819496)."""
    ref = {
        (0, 0): (0xE220A8397B1DCDAF, 14819496 / 2**24),
        (0, 1): (0x6E789E6AA1B965F4, 7239838 / 2**24),
        (0, 2): (0x06C45D188009454F, 443485 / 2**24),
        (1, 0): (0x910A2DEC89025CC1, 9505325 / 2**24),
        (1234, 2): (0x33BEFAE49BC025DA, 3391226 / 2**24),
        (2**64 - 1, 1): (0xE99FF867DBF682C9, 15310840 / 2**24),
    }
    for (seed, i), (z, u) in ref.items():
        assert splitmix64(seed, i) == z and uniform(seed, i) == u
    assert splitmix64(-1, 1) == splitmix64(2**64 - 1, 1) == splitmix64(2**65 - 1, 1)  # mod 2^64
    vals = {uniform(s, i) for s in range(-5, 5) for i in range(100)}
    assert len(vals) > 990 and all(0.0 <= v < 1.0 and v * 2**24 == int(v * 2**24) for v in vals)
    assert uniform(0, 0) == 0.8833107948303223 and float(torch.tensor(uniform(0, 0), dtype=torch.float32)) == uniform(0, 0)


def test_uniforms_are_the_same_bits_on_any_device_and_for_any_logits_dtype():
    seeds, pos = [0, 7, -3, 2**63 + 5, 1234], [0, 1, 99, 4, 2]
    want = [uniform(s, p) for s, p in zip(seeds, pos)]
    devices = [None, "cpu", torch.device("cpu")] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        u = uniforms(seeds, pos, dev)
        assert u.dtype == torch.float32 and tuple(u.shape) == (5, 1)
        assert u[:, 0].cpu().tolist() == want, dev
    assert tuple(uniforms([], [], "cpu").shape) == (0, 1)
    # logits exactly representable in bfloat16: every dtype gives the same float32 row, so the same tokens
    x = (torch.randint(-16, 16, (5, V), generator=torch.Generator().manual_seed(4)) / 4.0).float()
    params = [
        Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=8), Sampling(temperature=1.3, min_p=0.05),
        Sampling(temperature=1.0, top_p=0.9), None,
    ]  # fmt: skip
    ref = sample(x, params, seeds, pos)
    for dt in (torch.float64, torch.float16, torch.bfloat16):
        assert sample(x.to(dt), params, seeds, pos) == ref, dt


# --------------------------------------------------------------------------- #
# engine
# --------------------------------------------------------------------------- #

N = 12
work = functools.partial(torch_tiny.work, n=N)
_prompt = torch_tiny.prompt


def test_seeded_request_is_the_same_alone_batched_and_across_a_handoff(tiny_llama):
    prompt = _prompt(3)
    sp = Sampling(temperature=1.3, top_k=50, seed=1234)
    alone = LocalNode("a", PROFILE, tiny_llama)
    alone.add_prefill(work("r", prompt, sp))
    alone.run()
    ref = alone.finished["r"].tokens
    assert len(ref) == N
    # batched with other requests (greedy and sampled ones, other lengths)
    busy = LocalNode("b", PROFILE, tiny_llama)
    busy.add_prefill(work("x1", _prompt(4, 40), None))
    busy.add_prefill(work("r", prompt, sp))
    busy.add_prefill(work("x2", _prompt(5, 17), Sampling(temperature=0.9)))
    busy.run()
    assert busy.finished["r"].tokens == ref
    # prefill on one node (first token), decode on another after the hand-off
    p = LocalNode("p", PROFILE, tiny_llama, phase="prefill")
    d = LocalNode("d", PROFILE, tiny_llama, phase="decode")
    p.add_prefill(work("r", prompt, sp, decode_node="d"))
    p.run()
    assert [h.work.sampling for h in p.handoffs] == [sp]
    d.add_decode(p.handoffs[0].work)
    d.run()
    assert d.finished["r"].tokens == ref
    # another seed: other tokens; no seed: random per run
    other = LocalNode("o", PROFILE, tiny_llama)
    other.add_prefill(work("r2", prompt, Sampling(temperature=1.3, top_k=50, seed=99)))
    other.add_prefill(work("r3", prompt, Sampling(temperature=1.3, top_k=50)))
    other.add_prefill(work("r4", prompt, Sampling(temperature=1.3, top_k=50)))
    other.run()
    assert other.finished["r2"].tokens != ref
    assert other.finished["r3"].tokens != other.finished["r4"].tokens


def test_greedy_params_equal_no_params_and_stop_token_ids_end_the_request(tiny_llama):
    prompt = _prompt(6)
    node = LocalNode("a", PROFILE, tiny_llama)
    node.add_prefill(work("g0", prompt, None))
    node.add_prefill(work("g1", prompt, Sampling(temperature=0.0, top_k=3, seed=5)))
    node.run()
    ref = node.finished["g0"].tokens
    assert node.finished["g1"].tokens == ref
    j = next(i for i in range(3, N) if ref.index(ref[i]) == i)
    node.add_prefill(work("s", prompt, Sampling(stop_token_ids=[ref[j], 100_000]), ignore_eos=True))
    node.run()
    assert node.finished["s"].tokens == ref[: j + 1] and node.finished["s"].finish_reason == "stop"


def test_a_seeded_continuation_after_a_redispatch_continues_the_same_sequence(tiny_llama):
    """A re-dispatch after a dead decode node sends prompt + the k tokens the client has as the new
    prompt with ``output_offset`` k (``services/router/faults.continuation``): position k onward is
    drawn with the same (seed, position) uniforms, so the stream goes on as if nothing happened."""
    prompt = _prompt(8)
    sp = Sampling(temperature=1.1, top_p=0.95, seed=77)
    node = LocalNode("a", PROFILE, tiny_llama)
    node.add_prefill(work("r", prompt, sp))
    node.run()
    ref = node.finished["r"].tokens
    k = 5
    cont = prompt + ref[:k]
    again = LocalNode("b", PROFILE, tiny_llama)
    w = work("r", cont, sp, n=N - k)
    again.add_prefill(msgspec.structs.replace(w, output_offset=k))
    again.run()
    assert again.finished["r"].tokens == ref[k:]


def test_a_one_token_vocabulary_is_drawn_on_every_path():
    """V = 1 (the only token is 0): a ``top_p``-only row, a ``top_k`` one and a plain one, alone and
    together. Before, the ``top_p``-only CPU path raised ValueError (numpy kept the reversed sort's
    negative stride for a one-column array, which ``torch.from_numpy`` refuses)."""
    x = torch.tensor([[0.25], [-3.0], [0.0]])
    params = [Sampling(temperature=1.0, top_p=0.9), Sampling(temperature=0.5, top_k=1), Sampling(temperature=2.0)]
    for u0 in (0.0, 0.5, 1.0):
        assert sample_rows(x[:1], params[:1], torch.full((1, 1), u0)) == [0]
        assert sample_rows(x, params, torch.full((3, 1), u0)) == [0, 0, 0]
    assert sample(x, params, [1, 2, 3], [0, 0, 0]) == [0, 0, 0]
