"""Per-request token sampling for one batch of logits (the ``torch`` engine's decode step).

:func:`sample` picks one token per row of a ``[rows, vocab]`` logits batch, each row with
its own request's :class:`~shared.messages.Sampling`:

* **greedy rows** (no sampling parameters, or ``temperature`` < 1e-5, vLLM's
  ``_SAMPLING_EPS``): ``logits.argmax(-1)`` over the whole batch, exactly the call the
  engine made before sampling existed (bit-identical tokens);
* **sampled rows**: logits / ``temperature`` (float32) → ``top_k`` (keep the k highest;
  0 = off) → ``top_p`` (keep the smallest set of highest-probability tokens whose mass
  reaches ``top_p``, at least one; 1 = off) → softmax → ``min_p`` (drop probabilities below
  ``min_p`` × the row's highest; 0 = off) → one draw by inverse CDF (one uniform per row:
  the token is drawn with probability ``p_i`` / kept mass; vLLM draws by the exponential race
  ``argmax(p / q)``, which needs a noise value per vocabulary entry: measured on one CPU
  thread, a row of a 152k vocabulary took 5.8 ms that way and 1.3–1.7 ms this way, 32 rows
  186 ms and 68–73 ms; medians of 7 on a shared box). Filters apply in vLLM's order
  (temperature, top-k, top-p, min-p); ties in the sort keep vocabulary order, so
  ``top_k=1`` or a tiny ``top_p`` returns the argmax (first maximum), like greedy.

Determinism. The uniform draw of the token at output position ``i`` (the client's
position: a re-dispatched request's ``output_offset`` counts) comes from a fresh
``torch.Generator`` on the engine's device seeded with :func:`position_seed` (``seed``,
``i``). So with a ``seed`` a token depends only on the request's own logits, its
parameters, the seed and the position: not on the batch it was sampled in, the other
requests in it, or which node (the prefill node samples position 0, a decode node the
rest, a re-dispatch continues at ``output_offset``). A row with ``top_k``/``top_p`` is drawn
in sorted order, any other in vocabulary order, decided per row (:func:`sample_rows` runs
the two groups apart): drawing a row in the batch's order instead changed a token in
``test_a_rows_token_does_not_depend_on_the_batch``. Two limits: the generator is the *device's* (CPU Mersenne Twister vs CUDA Philox), so nodes of
one deployment must share a device type to agree; and the logits themselves must agree,
which holds for one model, dtype and kernel path (a different batch shape may change
floating-point reductions on some GPUs; vLLM has the same caveat). Without a seed the
engine draws a random 64-bit one per request (``TorchEngine``), so unseeded requests
differ from run to run while still using this path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.messages import Sampling

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)."""

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of output position ``position`` of a request seeded ``seed``:
    SplitMix64's finaliser of ``seed·φ64 + position`` (φ64 = 0x9E3779B97F4A7C15), a
    64-bit value well spread over nearby positions and seeds (``torch.Generator.manual_seed``
    takes any 64-bit unsigned value). ``seed`` may be negative (taken mod 2^64)."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def is_greedy(sp: Sampling | None) -> bool:
    """True when ``sp`` asks for argmax decoding (None, or temperature below :data:`SAMPLING_EPS`)."""
    return sp is None or sp.temperature < SAMPLING_EPS


def sample(logits: torch.Tensor, params: Sequence[Sampling | None], seeds: Sequence[int], positions: Sequence[int]) -> list[int]:
    """One token per row.

    Args:
        logits: ``[R, V]`` float logits, one row per request to sample.
        params: ``R`` sampling parameters (None = greedy).
        seeds: ``R`` seeds (a row's ``Sampling.seed``, else the request's random seed);
            read for sampled rows only.
        positions: ``R`` output positions (the client's: ``output_offset`` + tokens before).

    Returns:
        ``R`` token ids in ``[0, V)``.
    """
    out = logits.argmax(dim=-1)
    rows = [i for i, sp in enumerate(params) if not is_greedy(sp)]
    if not rows:
        return out.tolist()
    picked = sample_rows(
        logits[rows], [params[i] for i in rows], [position_seed(seeds[i], positions[i]) for i in rows]  # type: ignore[misc]
    )
    res = out.tolist()
    for i, t in zip(rows, picked):
        res[i] = t
    return res


def sample_rows(logits: torch.Tensor, params: Sequence[Sampling], gen_seeds: Sequence[int]) -> list[int]:
    """Sample one token from each row of ``logits`` ``[r, V]`` (every row non-greedy) with its
    parameters and a generator seeded ``gen_seeds[row]`` (:func:`position_seed`).

    The draw is by inverse CDF: one uniform ``u`` per row from its generator, the token is the
    first whose cumulative probability exceeds ``u`` × the row's total (the kept mass: no
    renormalisation needed after top-p / min-p). Rows with ``top_k`` / ``top_p`` are sorted
    (stable, descending), filtered and drawn in sorted order; the others in vocabulary order.
    Which order a row is drawn in depends on its own parameters only (the two groups run
    apart), so the batch never changes a row's token. O(r·V log V) for sorted rows, else O(r·V).
    """
    V = logits.shape[-1]
    sort = [(0 < sp.top_k < V) or sp.top_p < 1.0 for sp in params]
    if all(sort) or not any(sort):
        return _draw(logits, params, gen_seeds, sort=sort[0] if sort else False)
    out = [0] * len(params)
    for flag in (True, False):
        rows = [i for i, f in enumerate(sort) if f == flag]
        got = _draw(logits[rows], [params[i] for i in rows], [gen_seeds[i] for i in rows], sort=flag)
        for i, t in zip(rows, got):
            out[i] = t
    return out


def _draw(logits: torch.Tensor, params: Sequence[Sampling], gen_seeds: Sequence[int], *, sort: bool) -> list[int]:
    """:func:`sample_rows` for rows that are all sorted (``sort``) or all drawn in vocabulary order."""
    dev = logits.device
    temp = torch.tensor([sp.temperature for sp in params], dtype=torch.float32, device=dev)
    x = logits.float() / temp[:, None]
    V = x.shape[-1]
    idx: torch.Tensor | None = None
    if sort:
        x, idx = x.sort(dim=-1, descending=True, stable=True)
        ks = [sp.top_k if 0 < sp.top_k < V else V for sp in params]
        if any(k < V for k in ks):
            rank = torch.arange(V, device=dev)[None, :]
            x = x.masked_fill(rank >= torch.tensor(ks, device=dev)[:, None], float("-inf"))
    prob = x.softmax(dim=-1)
    if sort and any(sp.top_p < 1.0 for sp in params):
        before = prob.cumsum(dim=-1) - prob  # mass of the tokens ranked above each one
        prob = prob.masked_fill(before > torch.tensor([sp.top_p for sp in params], device=dev)[:, None], 0.0)
    if any(sp.min_p > 0.0 for sp in params):
        mp = torch.tensor([sp.min_p for sp in params], dtype=torch.float32, device=dev)
        top = prob[:, :1] if sort else prob.max(dim=-1, keepdim=True).values
        prob = prob.masked_fill(prob < top * mp[:, None], 0.0)
    u = torch.empty((len(gen_seeds), 1), dtype=torch.float32, device=dev)
    for r, s in enumerate(gen_seeds):
        g = torch.Generator(device=dev)
        g.manual_seed(s)
        u[r].uniform_(generator=g)
    cdf = prob.cumsum(dim=-1)
    j = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    # u × total can round up to the total (u < 1): then the last token with a probability
    last = V - 1 - (prob > 0).flip(-1).to(torch.int8).argmax(dim=-1, keepdim=True)
    j = torch.minimum(j, last)
    if idx is not None:
        j = idx.gather(1, j)
    return j[:, 0].tolist()
