"""Log-probabilities of sampled tokens (OpenAI / vLLM ``logprobs``) for the ``torch`` engine.

:func:`token_logprobs` takes the logits batch a step sampled from and, for the rows whose
request asked (``Sampling.logprobs`` not None), returns the chosen token's log-probability
and the ``k`` most likely tokens with theirs. The distribution is the *raw* model one:
``torch.log_softmax`` of the logits in float32, before penalties, ``min_tokens`` masks, temperature, top-k/top-p/min-p
(vLLM's default ``logprobs_mode`` ``raw_logprobs``, ``vllm/config/model.py``), so a
request's logprobs do not depend on its sampling parameters. Rows that did not ask cost
nothing: the function is not called when no row asked, and otherwise only the asking rows
are gathered (``index_select``) and normalised. One host copy of the results per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TokenLogprob = tuple[float, list[int], list[float]]
"""(chosen token's logprob, top ids most likely first, their logprobs)."""


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], chosen: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """Log-probabilities of the chosen tokens of ``rows`` of ``logits`` and their top ``ks``.

    Args:
        logits: ``[batch, vocab]`` logits the step sampled from (any float dtype, any device).
        rows: the batch rows whose request asked, in the order the results are wanted.
        chosen: the token id sampled at each of ``rows``.
        ks: how many top tokens each of ``rows`` wants (0..vocab).

    Returns:
        One ``(logprob, top_ids, top_logprobs)`` per row of ``rows``: natural-log probabilities
        under ``log_softmax`` of the row's float32 logits; the top list sorted most likely
        first (``torch.topk``, ties in its order), of length ``k``.
    """
    if not rows:
        return []
    dev = logits.device
    idx = torch.tensor(list(rows), dtype=torch.int64, device=dev)
    lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
    tok = torch.tensor(list(chosen), dtype=torch.int64, device=dev)
    picked = lp.gather(1, tok.unsqueeze(1)).squeeze(1).tolist()
    kmax = min(max(ks), lp.shape[-1])
    if kmax > 0:
        top_v, top_i = torch.topk(lp, kmax, dim=-1, sorted=True)
        tv, ti = top_v.tolist(), top_i.tolist()
    else:
        tv = ti = [[] for _ in rows]
    return [(picked[j], ti[j][:k], tv[j][:k]) for j, k in enumerate(ks)]
