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

``logit_bias``, penalties and ``min_tokens`` (vLLM's ``logit_bias``, ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, ``min_tokens``). A request that sets any of them
gets a :class:`TokenStats` (``token_stats``; None otherwise) and :func:`sample` first rewrites the
rows that have one, in float32, in vLLM's order (v1 ``Sampler.forward``: the non-argmax-invariant
logits processors ``MinTokensLogitsProcessor`` and ``LogitBiasLogitsProcessor``, then
``apply_penalties``), before greedy's argmax and before temperature / top-k / top-p / min-p:

* ``logit_bias``: each listed token's bias is added to its logit (``LogitBiasLogitsProcessor``:
  ``logits[rows, ids] += biases``), first, so the penalties see the biased logit (a repetition
  penalty divides or multiplies it) and -100 effectively bans a token on greedy and sampled rows;
* ``min_tokens``: while the client's output is shorter (its output position < ``min_tokens``)
  the model's EOS ids and the request's ``stop_token_ids`` get -inf (vLLM masks its
  ``all_stop_token_ids``: EOS also under ``ignore_eos``, where it does not end the request anyway);
* ``repetition_penalty`` r: a token in the prompt or the output has its logit divided by r
  when positive, multiplied by r otherwise (vLLM's ``torch.where(logits > 0, logits / r,
  logits * r)``; its newer custom op multiplies by ``1 / r``, which can differ in the last bit);
* ``frequency_penalty`` f, ``presence_penalty`` p (OpenAI's definition): logit −= f × the
  token's count in the output, then −= p × (count > 0).

(The ``min_tokens`` mask is applied last here; vLLM applies it before the bias, the same result:
-inf plus a finite bias or under a penalty stays -inf.)

"The output" is the client's: a re-dispatched request (``output_offset`` k) carries its
first k output tokens as the last k tokens of its prompt, and they count as output, as they
would have on the node that died. The per-request counts (``[V]`` float32) and the
prompt-or-output mask (``[V]`` bool) live on the logits' device, built once when the request
is first sampled on a node (``TorchEngine``: a queued request holds none, so they are bounded by
the running batch, not by the queue) and updated by :meth:`TokenStats.add` with each new token
(2 indexed writes), not recomputed from the output: ~5 bytes × vocabulary per penalized running
request (0.76 MB at 152k).
Rows without a :class:`TokenStats` are not touched: their logits are the same values (a
float32 copy, exact), so a greedy row without penalties is still the same argmax.

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
row (:func:`sample_rows` runs the groups apart): drawing a row in the batch's order
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

from collections.abc import Collection, Sequence

import numpy as np
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


class TokenStats:
    """One request's token statistics for its penalties and ``min_tokens``, and its ``logit_bias``
    (see the module docstring), on the logits' device.

    Attributes:
        counts: ``[V]`` float32, each token's count in the client's output so far; None when
            the request sets no penalty (``min_tokens`` only).
        seen: ``[V]`` bool, the token is in the prompt or the output; None likewise.
        min_tokens: ``Sampling.min_tokens``.
        min_stop: ids masked while the output is shorter than ``min_tokens`` (EOS ids ∪
            ``stop_token_ids``, those inside the vocabulary), a ``[n]`` int64 tensor.
        bias_ids: ``[b]`` int64, the ``logit_bias`` token ids (distinct); None = no bias.
        bias: ``[b]`` float32, their biases.
    """

    __slots__ = ("counts", "seen", "min_tokens", "min_stop", "bias_ids", "bias")

    def __init__(
        self,
        counts: torch.Tensor | None,
        seen: torch.Tensor | None,
        min_tokens: int,
        min_stop: torch.Tensor,
        bias_ids: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        self.counts = counts
        self.seen = seen
        self.min_tokens = min_tokens
        self.min_stop = min_stop
        self.bias_ids = bias_ids
        self.bias = bias

    def add(self, token: int) -> None:
        """Count ``token`` as the request's next output token (O(1) on the device)."""
        if self.counts is not None and self.seen is not None:
            self.counts[token] += 1.0
            self.seen[token] = True


def token_stats(
    sp: Sampling | None,
    prompt: Sequence[int] | np.ndarray,
    out: Sequence[int],
    offset: int,
    eos: Collection[int],
    vocab: int,
    device: torch.device | str,
) -> TokenStats | None:
    """The :class:`TokenStats` of a request with ``prompt`` and output ``out`` so far (a
    hand-off's first token(s), or what this node sampled before it was built), ``offset`` = its
    ``output_offset`` (the last ``offset`` prompt tokens are earlier output of a re-dispatch);
    None when ``sp`` sets no penalty, no ``min_tokens`` and no ``logit_bias`` (nothing to do). ``eos``:
    the model's end-of-sequence ids. ``prompt`` may be a numpy array (the engine passes the packed
    ``<u4`` prompt as is: a 1M-token list took 150-400 ms through ``torch.tensor``, holding the
    GIL). O(prompt + out), once. ``logit_bias`` ids are in ``[0, vocab)``: the engine's accept
    hooks refused the work otherwise (:func:`check_logit_bias`)."""
    if not needs_stats(sp):
        return None
    assert sp is not None
    counts = seen = None
    if sp.penalized:
        ids = torch.from_numpy(np.asarray(prompt, dtype=np.int64)).to(device)
        outs = torch.cat([ids[len(ids) - offset :] if offset else ids[:0], torch.tensor(list(out), dtype=torch.int64, device=device)])
        counts = torch.bincount(outs, minlength=vocab).to(torch.float32) if outs.numel() else torch.zeros(vocab, dtype=torch.float32, device=device)
        seen = counts > 0
        if len(ids):
            seen[ids] = True
    stop = sorted(t for t in set(eos) | set(sp.stop_token_ids) if 0 <= t < vocab) if sp.min_tokens > 0 else []
    bias_ids = bias = None
    if sp.logit_bias:
        bias_ids = torch.tensor(list(sp.logit_bias), dtype=torch.int64, device=device)
        bias = torch.tensor(list(sp.logit_bias.values()), dtype=torch.float32, device=device)
    return TokenStats(counts, seen, sp.min_tokens, torch.tensor(stop, dtype=torch.int64, device=device), bias_ids, bias)


def needs_stats(sp: Sampling | None) -> bool:
    """Whether a request sampled with ``sp`` needs a :class:`TokenStats`: a penalty, ``min_tokens``
    or a ``logit_bias``."""
    return sp is not None and bool(sp.penalized or sp.min_tokens > 0 or sp.logit_bias)


def check_logit_bias(sp: Sampling | None, vocab: int) -> None:
    """Raises ValueError naming the first ``sp.logit_bias`` id outside the model's vocabulary
    ``[0, vocab)`` (the router checks its tokenizer's, which may be smaller or, paired with another
    model, larger; an id past the logits would fail the whole decode step). O(entries)."""
    if sp is None or not sp.logit_bias:
        return
    bad = [t for t in sp.logit_bias if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"logit_bias token id {min(bad)} is outside the model's vocabulary [0, {vocab})")


def penalize(logits: torch.Tensor, stats: Sequence[TokenStats | None], params: Sequence[Sampling | None], positions: Sequence[int]) -> torch.Tensor:
    """A float32 copy of ``logits`` ``[R, V]`` with each row that has a :class:`TokenStats`
    rewritten by its ``logit_bias``, penalties and ``min_tokens`` mask, in that order (module
    docstring); the other rows are the same values. ``positions``: the rows' client output
    positions (= output length so far)."""
    x = logits.to(torch.float32, copy=True)
    dev = x.device
    for i, st in enumerate(stats):
        if st is not None and st.bias_ids is not None and st.bias is not None:
            x[i, st.bias_ids] += st.bias  # ids are distinct (dict keys): no accumulation needed
    pen_stats = [(i, st) for i, st in enumerate(stats) if st is not None and st.counts is not None]
    pen = [i for i, _ in pen_stats]
    if pen:
        sps: list[Sampling] = [params[i] for i in pen]  # type: ignore[misc]
        whole = len(pen) == x.shape[0]
        sub = x if whole else x[pen]  # x is our copy: in place is fine
        # each term only when some row sets it (an unset one is exact no-op: / 1, - 0)
        if any(sp.repetition_penalty != 1.0 for sp in sps):
            seen = torch.stack([st.seen for _, st in pen_stats])
            rep = torch.tensor([sp.repetition_penalty for sp in sps], dtype=torch.float32, device=dev)[:, None]
            r = torch.where(seen, rep, 1.0)
            sub = torch.where(sub > 0, sub / r, sub * r)
        f_on = any(sp.frequency_penalty != 0.0 for sp in sps)
        p_on = any(sp.presence_penalty != 0.0 for sp in sps)
        if f_on or p_on:
            counts = torch.stack([st.counts for _, st in pen_stats])
            if f_on:
                freq = torch.tensor([sp.frequency_penalty for sp in sps], dtype=torch.float32, device=dev)[:, None]
                sub = sub.sub_(freq * counts)
            if p_on:
                pres = torch.tensor([sp.presence_penalty for sp in sps], dtype=torch.float32, device=dev)[:, None]
                sub = torch.where(counts > 0, sub - pres, sub)
        if whole:
            x = sub
        else:
            x[pen] = sub
    for i, st in enumerate(stats):
        if st is not None and positions[i] < st.min_tokens and st.min_stop.numel():
            x[i, st.min_stop] = float("-inf")
    return x


def sample(
    logits: torch.Tensor,
    params: Sequence[Sampling | None],
    seeds: Sequence[int],
    positions: Sequence[int],
    stats: Sequence[TokenStats | None] | None = None,
) -> list[int]:
    """One token per row.

    Args:
        logits: ``[R, V]`` float logits, one row per request to sample.
        params: ``R`` sampling parameters (None = greedy).
        seeds: ``R`` seeds (a row's ``Sampling.seed``, else the request's random seed);
            read for sampled rows only.
        positions: ``R`` output positions (the client's: ``output_offset`` + tokens before).
        stats: ``R`` :class:`TokenStats` (None for a row without penalties / ``min_tokens`` /
            ``logit_bias``), or None for none at all: those rows are rewritten first (:func:`penalize`).

    Returns:
        ``R`` token ids in ``[0, V)``.
    """
    if stats is not None and any(st is not None for st in stats):
        logits = penalize(logits, stats, params, positions)
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
    renormalisation needed after top-p / min-p). Rows with ``top_k`` / ``top_p`` are drawn in
    sorted order (descending, ties in vocabulary order: a stable sort), the others in vocabulary
    order. Which order a row is drawn in depends on its own parameters only (the groups run
    apart), so the batch never changes a row's token.

    On the CPU the sorted rows skip the stable ``[r, V]`` sort with its indices (O(V log V), ~15 ms
    a row of a 152k vocabulary on one thread): every step of the draw reads only the row's
    values in sorted order, which are the same floats without the indices, so a ``top_k`` row
    takes its k highest values (``torch.topk``, O(V)) followed by -inf (the filter the sorted row
    got), a ``top_p``-only row its values sorted alone (numpy, ~5 ms a row; not only its head:
    the softmax's float32 sum adds the whole row in that order, so another order can move the
    last bit of every probability), and the drawn rank ``j`` becomes
    a token as the stable sort would have placed it (:func:`_token_at_rank`): the same token,
    bit for bit (the exact softmax runs on the same ``[r, V]`` row). A row whose highest logit is
    not finite (NaN, ±inf) and every row on another device take the stable sort.
    """
    V = logits.shape[-1]
    cpu = logits.device.type == "cpu"
    order = [_order(sp, V, cpu) for sp in params]
    if len(set(order)) <= 1:
        return _draw(logits, params, u, order=order[0] if order else "vocab")
    out = [0] * len(params)
    for kind in sorted(set(order)):
        rows = [i for i, o in enumerate(order) if o == kind]
        got = _draw(logits[rows], [params[i] for i in rows], u[rows], order=kind)
        for i, t in zip(rows, got):
            out[i] = t
    return out


def _order(sp: Sampling, vocab: int, cpu: bool) -> str:
    """How :func:`sample_rows` draws a row: ``vocab`` (no top-k / top-p: vocabulary order),
    ``sorted`` (a stable sort), on the CPU ``top_k`` (the k highest values) or ``values`` (top-p
    only: the values sorted without indices)."""
    top_k = 0 < sp.top_k < vocab
    if not (top_k or sp.top_p < 1.0):
        return "vocab"
    if not cpu:
        return "sorted"
    return "top_k" if top_k else "values"


def _draw(logits: torch.Tensor, params: Sequence[Sampling], u: torch.Tensor, *, order: str) -> list[int]:
    """:func:`sample_rows` for rows that are all drawn the same way (``order``, :func:`_order`)."""
    dev = logits.device
    temp = torch.tensor([sp.temperature for sp in params], dtype=torch.float32, device=dev)
    x = logits.float() / temp[:, None]
    if order == "vocab":
        return _rank(x, params, u, sort=False)[:, 0].tolist()
    V = x.shape[-1]
    ks = [sp.top_k if 0 < sp.top_k < V else V for sp in params]
    if order == "top_k":
        head, head_idx = x.topk(max(ks), dim=-1, sorted=True)
        if bool(torch.isfinite(head[:, 0]).all()):
            vals = torch.full_like(x, float("-inf"))  # the sorted row cut to its top-k
            vals[:, : head.shape[1]] = _keep_top_k(head, ks)
            return _token_at_rank(x, vals, _rank(vals, params, u, sort=True), head, head_idx)
    elif order == "values":
        # .copy(): a new C-order array (ascontiguousarray kept the reversed view's -4 stride when
        # V = 1, which torch.from_numpy refuses)
        vals = torch.from_numpy(np.sort(x.detach().numpy(), axis=-1)[:, ::-1].copy())
        if bool(torch.isfinite(vals[:, 0]).all()):
            return _token_at_rank(x, vals, _rank(_keep_top_k(vals, ks), params, u, sort=True))
    vals, idx = x.sort(dim=-1, descending=True, stable=True)
    j = _rank(_keep_top_k(vals, ks), params, u, sort=True)
    return idx.gather(1, j)[:, 0].tolist()


def _keep_top_k(vals: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """``vals`` ``[r, n]`` (each row descending, its first ``n`` ranks) with rank ``ks[row]`` and
    above set to -inf."""
    n = vals.shape[-1]
    if all(k >= n for k in ks):
        return vals
    rank = torch.arange(n, device=vals.device)[None, :]
    return vals.masked_fill(rank >= torch.tensor(ks, device=vals.device)[:, None], float("-inf"))


def _rank(x: torch.Tensor, params: Sequence[Sampling], u: torch.Tensor, *, sort: bool) -> torch.Tensor:
    """The drawn position ``[r, 1]`` (int64) in each row of tempered logits ``x`` ``[r, V]``: rows in
    descending order already cut to their top-k (``sort``: top-p applies) or in vocabulary order."""
    V = x.shape[-1]
    dev = x.device
    prob = x.softmax(dim=-1)
    if sort and any(sp.top_p < 1.0 for sp in params):
        # mass of the tokens ranked above each one; a row without top-p (1.0) keeps them all: its
        # float32 running sum can pass 1.0 before the last kept token (which, cut, moved a draw
        # near u = 1 when such a row shared the step with a top-p row)
        before = prob.cumsum(dim=-1) - prob
        top_p = torch.tensor([sp.top_p if sp.top_p < 1.0 else float("inf") for sp in params], device=dev)
        prob = prob.masked_fill(before > top_p[:, None], 0.0)
    if any(sp.min_p > 0.0 for sp in params):
        mp = torch.tensor([sp.min_p for sp in params], dtype=torch.float32, device=dev)
        top = prob[:, :1] if sort else prob.max(dim=-1, keepdim=True).values
        prob = prob.masked_fill(prob < top * mp[:, None], 0.0)
    cdf = prob.cumsum(dim=-1)
    j = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    # u × total can round up to the total (u < 1): no cumulative probability exceeds it and j = V;
    # then the last token with a probability. Otherwise j is at most that token already (the
    # tokens after it add nothing, so their cdf equals its own), so the scan for it (a flip and
    # an argmax over [r, V]: ~12 ms of a 45-75 ms step at 32 rows x 152k on one CPU thread) runs
    # only in that case
    over = j >= V
    if bool(over.any()):
        last = V - 1 - (prob > 0).flip(-1).to(torch.int8).argmax(dim=-1, keepdim=True)
        j = torch.where(over, last, j)
    return j


def _token_at_rank(
    x: torch.Tensor, vals: torch.Tensor, j: torch.Tensor, head: torch.Tensor | None = None, head_idx: torch.Tensor | None = None
) -> list[int]:
    """The vocabulary id a stable descending sort of ``x`` ``[r, V]`` (finite maxima, no NaN
    drawn) puts at rank ``j[row]`` ``[r, 1]``, from the row's value there ``v`` = ``vals[row, j]``
    (a kept token: finite): the ranks above hold the ``g`` tokens greater than ``v``, then the
    tokens equal to ``v`` in vocabulary order, so it is the (``j`` − ``g``)-th token equal to ``v``
    (-0.0 and 0.0 are equal, as in the sort; ``g`` by a binary search of the sorted values, ascending
    once negated). With ``head``, ``head_idx`` (``torch.topk``'s values and ids, ``[r, k]``) a row
    whose ``v`` is above the k-th value has all its tokens equal to ``v`` among them; the other rows
    (and all without ``head``) look for them in ``x`` (two passes over the row)."""
    v = vals.gather(1, j)
    m = int(j.max()) + 1  # the ranks above j hold every value greater than v: g from them
    nth = (j - torch.searchsorted(vals[:, :m].neg(), v.neg()))[:, 0].tolist()
    out = [0] * len(nth)
    scan = list(range(len(nth)))
    if head is not None and head_idx is not None:
        inside = (v[:, 0] > head[:, -1]).tolist()
        eq_head = head == v
        first = torch.where(eq_head, head_idx, x.shape[-1]).min(dim=-1).values.tolist()
        scan = [r for r in scan if not inside[r]]
        for r in range(len(nth)):
            if inside[r]:
                out[r] = sorted(head_idx[r][eq_head[r]].tolist())[nth[r]] if nth[r] else first[r]
    if scan:
        eq = x[scan] == v[scan]
        firsts = eq.to(torch.int8).argmax(dim=-1).tolist()
        for i, r in enumerate(scan):
            out[r] = int(eq[i].nonzero()[nth[r], 0]) if nth[r] else firsts[i]
    return out
