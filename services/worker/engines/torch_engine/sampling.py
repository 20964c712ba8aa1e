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

Determinism. The token at output position ``i`` (the client's position: a re-dispatched
request's ``output_offset`` counts) is drawn with the uniform :func:`uniform` (``seed``, ``i``):
the ``i``-th output of SplitMix64 seeded ``seed``, computed on the host in plain Python
integers, the whole step's sampled rows at once, then moved to the logits' device as ONE
float32 tensor (:func:`uniforms`). No ``torch.Generator``: the uniform is the same bits on
every device, dtype and torch build. So with a ``seed`` a token depends only on the
request's own logits, its parameters, the seed and the position: not on the batch it was
sampled in, the other requests in it, or which node (the prefill node samples position 0,
a decode node the rest, a re-dispatch continues at ``output_offset``). A row with
``top_k``/``top_p`` is drawn in sorted order, any other in vocabulary order, decided per
row (:func:`sample_rows` runs the two groups apart): drawing a row in the batch's order
instead changed a token in ``test_a_rows_token_does_not_depend_on_the_batch``. The one
limit: the arithmetic must agree. The uniform is device-independent, but the token is the
first whose cumulative probability exceeds ``u`` × the kept mass, and the probabilities
come from the node's own logits, softmax and float32 running sum: a CPU and a CUDA node
(or two GPU kernels, or two batch shapes on some GPUs; vLLM has the same caveat) can
differ in their last bits, even for equal logits (other reduction orders), which moves a
token only when ``u`` × mass falls within that difference of a CDF step (rare, not never),
and from there the sequences part (the next positions see other prompts). For one model,
dtype and kernel path the tokens are bit-reproducible. Without a seed the engine draws a
random 64-bit one per request (``TorchEngine``), so unseeded requests differ from run to
run while still using this path.

Precision. ``u`` is the top 24 bits of the hash / 2^24 (a multiple of 2^-24 in [0, 1),
exact in float32 and float64: the grid of a float32 uniform) and the comparison
``cdf > u × total`` runs in float32, as the generator's float32 uniform did: so the
guarantees are today's (a token's chance is its float32 probability / the kept mass, to
float32 rounding of the running sum, ~6e-8 of the mass per step near the end of a row).
53 bits in float64 would only pay with a float64 CDF: ``cumsum(dtype=float64)`` of 32 rows
× 152,064 took 49 ms against 6.5 ms in float32 on one CPU thread (medians of 9), and the
whole 32-row step 103 ms against 77 ms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.messages import Sampling

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)."""

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
"""SplitMix64's increment, 2^64 / φ rounded to odd (the golden-ratio constant)."""


def splitmix64(seed: int, index: int) -> int:
    """The ``index``-th output (0-based) of SplitMix64 seeded ``seed``, a 64-bit unsigned int.

    SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number generators",
    OOPSLA 2014; Vigna's reference ``splitmix64.c``, prng.di.unimi.it) steps its state by
    γ = 0x9E3779B97F4A7C15 and returns a mix of the new state, so its ``index``-th output
    is counter-based, computed directly:

        z = (seed + (index + 1)·γ) mod 2^64
        z = (z ⊕ (z >> 30))·0xBF58476D1CE4E5B9 mod 2^64
        z = (z ⊕ (z >> 27))·0x94D049BB133111EB mod 2^64
        return z ⊕ (z >> 31)

    ``splitmix64(0, 0)`` = 0xE220A8397B1DCDAF, the reference's first output from state 0.
    ``seed`` may be negative or wider than 64 bits (taken mod 2^64)."""
    z = (seed + (index + 1) * _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) of output position ``position`` of a request seeded ``seed``:
    the top 24 bits of :func:`splitmix64` (``seed``, ``position``) / 2^24 (Vigna's
    ``(x >> 11) * 0x1.0p-53`` cut to float32's 24-bit significand), exact in float32;
    at most 1 − 2^-24."""
    return (splitmix64(seed, position) >> 40) * (1.0 / (1 << 24))


def uniforms(seeds: Sequence[int], positions: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """``[n, 1]`` float32 tensor on ``device`` of :func:`uniform` (``seeds[r]``, ``positions[r]``):
    computed on the host (plain Python, 1–1.6 µs a row measured) and moved in one copy. The values are
    the same on every device (float32 holds the 24 bits exactly)."""
    return torch.tensor([uniform(s, p) for s, p in zip(seeds, positions)], dtype=torch.float32, device=device)[:, None]


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
    u = uniforms([seeds[i] for i in rows], [positions[i] for i in rows], logits.device)
    picked = sample_rows(logits[rows], [params[i] for i in rows], u)  # type: ignore[misc]
    res = out.tolist()
    for i, t in zip(rows, picked):
        res[i] = t
    return res


def sample_rows(logits: torch.Tensor, params: Sequence[Sampling], u: torch.Tensor) -> list[int]:
    """Sample one token from each row of ``logits`` ``[r, V]`` (every row non-greedy) with its
    parameters and its uniform ``u[row]`` (``u``: ``[r, 1]`` float32 on the logits' device,
    :func:`uniforms`).

    The draw is by inverse CDF: the token is the first whose cumulative probability exceeds
    ``u`` × the row's total (the kept mass: no
    renormalisation needed after top-p / min-p). Rows with ``top_k`` / ``top_p`` are sorted
    (stable, descending), filtered and drawn in sorted order; the others in vocabulary order.
    Which order a row is drawn in depends on its own parameters only (the two groups run
    apart), so the batch never changes a row's token. O(r·V log V) for sorted rows, else O(r·V).
    """
    V = logits.shape[-1]
    sort = [(0 < sp.top_k < V) or sp.top_p < 1.0 for sp in params]
    if all(sort) or not any(sort):
        return _draw(logits, params, u, sort=sort[0] if sort else False)
    out = [0] * len(params)
    for flag in (True, False):
        rows = [i for i, f in enumerate(sort) if f == flag]
        got = _draw(logits[rows], [params[i] for i in rows], u[rows], sort=flag)
        for i, t in zip(rows, got):
            out[i] = t
    return out


def _draw(logits: torch.Tensor, params: Sequence[Sampling], u: torch.Tensor, *, sort: bool) -> list[int]:
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
    cdf = prob.cumsum(dim=-1)
    j = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    # u × total can round up to the total (u < 1): then the last token with a probability
    last = V - 1 - (prob > 0).flip(-1).to(torch.int8).argmax(dim=-1, keepdim=True)
    j = torch.minimum(j, last)
    if idx is not None:
        j = idx.gather(1, j)
    return j[:, 0].tolist()
