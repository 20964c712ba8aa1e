"""A Llama-family decoder over paged KV (Llama 2/3, Mistral, Qwen2, Qwen3), in PyTorch.

Loaded from a local Hugging Face folder: ``config.json`` + ``*.safetensors``
(weights through ``safetensors``). The math follows ``transformers``'
``modeling_llama.py`` / ``modeling_qwen3.py``: RMSNorm, rotary embeddings
(``rotate_half`` layout, ``rope_scaling`` ``linear``, ``dynamic`` is refused,
``llama3``), grouped-query attention, gated MLP ``down(act(gate(x)) * up(x))`` with
the config's ``hidden_act`` (SiLU: SwiGLU; :data:`ACT_FNS`), q/k/v biases (Qwen2;
Llama and Qwen3 with ``attention_bias``, which also gives ``o_proj`` one), MLP biases
(Llama's ``mlp_bias``), per-head q/k RMSNorm (Qwen3), tied or untied embeddings.
Loading is strict (:meth:`ModelConfig.check_tensors`): a checkpoint tensor the config
does not use, a missing one or one of another shape is an error naming it.

The KV cache is paged (vLLM's layout): per layer one K and one V tensor of
shape ``[pages, page_size, kv_heads, head_dim]``; a sequence's keys are found
through its block table (list of page indices, one per ``page_size`` tokens).
``forward`` runs one iteration over a mixed batch: prefill chunks (many query
tokens each) and decode requests (one query token each) in one pass over the
layers; the projections and MLP run on all tokens at once, attention in a few
SDPA calls per layer, each over exactly the keys its sequences need: consecutive
decode rows of similar context length in one call (the ``heads / kv_heads`` query
heads of a KV head as query rows of it; rows shorter than the group's longest
masked, that padding bounded by ``group_overhead_keys``), consecutive chunks that
start at position 0 with one length in one causal call over their own fresh K/V
(no gather), and each other chunk in its own call over its ``ctx + n`` keys. The
decode groups' keys come from one ``index_select`` per layer and tensor (the chunks'
from another); when the next forward's decode rows are the same sequences one token on
(same pages), their gathered keys are reused and only the new token written into
them (:attr:`SeqBatch.seq` names the sequences). Page indices, masks and RoPE rows are
built once per iteration for all layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from services.worker.engines.torch_engine.config import SUPPORTED_ARCHS, ModelConfig, ModelConfigError  # noqa: F401 (re-exported)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``NewGELUActivation`` (``gelu_new``), its expression as written there (``F.gelu``'s
    tanh form is the same function but rounds differently)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACT_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": _gelu_new,
    "relu": F.relu,
    "relu6": F.relu6,
    "leaky_relu": functools.partial(F.leaky_relu, negative_slope=0.01),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "linear": lambda x: x,
}
"""The MLP activation of each ``hidden_act`` (:data:`~services.worker.engines.torch_engine.config.ACTIVATIONS`),
the torch call ``transformers``' ``ACT2FN`` makes for it (5.x ``activations.py``); the same names."""


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32) with the config's scaling
    (transformers ``modeling_rope_utils``: default, ``linear``, ``llama3``)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if not s:
        return inv
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "linear":
        return inv / float(s["factor"])
    if kind == "llama3":
        factor = float(s["factor"])
        low = float(s["low_freq_factor"])
        high = float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, inv_l)
    return inv


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, consts: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """RMSNorm as transformers computes it (in float32, weight applied in ``x``'s dtype).
    ``consts`` (float32 models): ``{n: (n, eps)}`` as 0-dim float32 tensors, so the scalars
    are not wrapped into tensors on every call (the same float32 values: bit for bit)."""
    dt = x.dtype
    if dt == torch.float32 and consts is not None:  # mean = sum, then ÷ n: bit for bit
        n, e = consts[x.shape[-1]]
        return w * (x * x.pow(2).sum(-1, keepdim=True).div_(n).add_(e).rsqrt_())
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(dt)


def _linear(x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for a 2-D ``x`` given ``w_t = w.t()``: the ``mm`` / ``addmm``
    that ``F.linear`` calls (the same kernel on the same operands: bit for bit), without its
    dispatch through ``linear`` → ``matmul`` → ``t`` → ``mm`` per call."""
    return torch.mm(x, w_t) if b is None else torch.addmm(b, x, w_t)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' ``apply_rotary_pos_emb``) with the
    sign of ``rotate_half`` folded into ``sin_signed`` (first half negated) and its halves
    swapped by one ``roll``: the same products, bit for bit, in five ops fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def int64_tensor(xs: list[int], dev: torch.device) -> torch.Tensor:
    """``torch.tensor(xs, dtype=int64, device=dev)``, through numpy (a third of the time for short lists)."""
    return torch.from_numpy(np.array(xs, dtype=np.int64)).to(dev)


@dataclass(slots=True)
class SeqBatch:
    """One sequence's share of an iteration.

    ``n`` new tokens at positions ``[ctx, ctx + n)`` (their ids lie at
    ``[offset, offset + n)`` of the flat token tensor); its keys for positions
    ``[0, ctx + n)`` are in pages ``block_table[: ceil((ctx + n) / page_size)]``.
    """

    offset: int
    n: int
    ctx: int
    block_table: list[int]
    seq: int | None = None
    """The sequence's identity (the engine's serial of the request's registration). A decode
    row's gathered keys are reused by the next forward only when its decode rows are the same
    sequences (none None), on the same pages, one token on: the pages of a sequence that
    ended go back to the pool, and another sequence with the same block table one token
    longer (a hand-off sharing its prefix page, its partial page allocated from the freed
    one) holds other keys in them. None: never reused."""


DECODE_GROUP_OVERHEAD_KEYS = {"cpu": 96, "cuda": 8192}
"""Padded keys one more decode attention group must save to be worth its SDPA call
(:func:`_decode_runs`), by device type. On CPU (tiny model, decode batches of 8–30 rows
with contexts of 16–650 tokens) a forward took 0.77× the time of one padded call for any
value from 16 to 384 (differences within noise); on CUDA a launch costs far more than
keys do."""


def _decode_runs(ends: list[int], overhead: int) -> list[tuple[int, int]]:
    """Split consecutive decode rows (one query each, ``ends[b] = ctx + 1`` keys) into runs
    ``[(i, j)]`` attended by one SDPA call each, every run padded to its longest. A new run
    starts when adding the next row would make the run's padding (``len × max − Σ ends``
    keys) exceed ``overhead`` keys. O(B); fewest runs when the rows come sorted by length
    (the engine sorts them)."""
    runs: list[tuple[int, int]] = []
    i, mx, tot = 0, 0, 0
    for j, e in enumerate(ends):
        m2 = e if e > mx else mx
        if j > i and (j - i + 1) * m2 - (tot + e) > overhead:
            runs.append((i, j))
            i, m2, tot = j, e, 0
        mx = m2
        tot += e
    runs.append((i, len(ends)))
    return runs


@dataclass(slots=True)
class _Group:
    """Consecutive sequences attended by one SDPA call; their tokens are the rows
    ``[r0, r1)`` of the flat token tensor. One of three kinds:

    * ``fresh``: ``B`` prefill chunks from position 0, all of length ``Q``: causal
      attention over this iteration's own K/V; no gather, no mask;
    * ``decode``: ``B`` decode rows (one query each): keys gathered from ``npg`` pages
      each, the ``heads / kv_heads`` query heads of a KV head attended as that many
      query rows of it (no GQA expansion); rows shorter than the group's longest are
      masked (:func:`_decode_runs` keeps that padding small);
    * ``chunk``: one prefill chunk of ``Q`` tokens after ``Lk − Q`` keys of context:
      its keys gathered, causal from its position on (lower-right mask).
    """

    kind: str
    r0: int
    r1: int
    B: int
    Q: int
    Lk: int
    """Keys attended per sequence (the longest ``ctx + n`` of the group)."""
    p0: int = 0
    """First of its ``B·npg`` entries in its gathered pages (the decode rows' or the chunks')."""
    npg: int = 0
    mask: torch.Tensor | None = None
    """Additive mask (0 = seen, -inf = not): ``[B, 1, 1, Lk]`` (decode) or ``[1, 1, Q, Lk]`` (chunk); None: none needed."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kg: torch.Tensor | None, vg: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """This group's attention output, ``[r1 − r0, heads, D]`` (possibly a strided view).
        ``q``: ``[T, heads, D]``, ``k``/``v``: ``[T, kv_heads, D]`` (this iteration's, all
        tokens); ``kg``/``vg``: the gathered pages ``[P, page_size, kv_heads, D]`` of its kind
        (decode rows or chunks)."""
        B, Q, Lk = self.B, self.Q, self.Lk
        nh, D = q.shape[1], q.shape[2]
        nkv = k.shape[1]
        rows = slice(self.r0, self.r1)
        if self.kind == "fresh":
            qs = q[rows].view(B, Q, nh, D).transpose(1, 2)
            ks = k[rows].view(B, Q, nkv, D).transpose(1, 2)
            vs = v[rows].view(B, Q, nkv, D).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=nh != nkv)
            return o.transpose(1, 2).reshape(B * Q, nh, D)
        assert kg is not None and vg is not None
        pg = slice(self.p0, self.p0 + B * self.npg)
        ks = kg[pg].view(B, -1, nkv, D)[:, :Lk].transpose(1, 2)  # [B, nkv, Lk, D]
        vs = vg[pg].view(B, -1, nkv, D)[:, :Lk].transpose(1, 2)
        if self.kind == "decode":
            qs = q[rows].view(B, nkv, nh // nkv, D)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=self.mask, scale=scale)
            # CUDA's kernels may return [B, nkv, g, D] in another memory order than CPU's (contiguous):
            # reshape copies only then (a view raised on an H200: "view size is not compatible")
            return o.reshape(B, nh, D)
        qs = q[rows].view(1, Q, nh, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=self.mask, scale=scale, enable_gqa=nh != nkv)
        return o.transpose(1, 2)[0]


@dataclass(slots=True)
class _Plan:
    """An iteration's attention groups (in row order) and the pages they gather."""

    groups: list[_Group]
    dec_pages: list[int]
    """Pages every decode group reads, group after group, ``B·npg`` each (padding: page 0, masked)."""
    dec_ends: list[int]
    """Keys of each decode row (``ctx + 1``), in the order of ``dec_pages``."""
    dec_rows: list[int]
    """Token row of each decode row, same order."""
    dec_slots: list[int]
    """Where each decode row's new token lies in its group's gathered keys (token index in
    the ``[len(dec_pages)·page_size]`` flat view): ``(p0 + b·npg)·page_size + ctx``."""
    chunk_pages: list[int]
    """Pages every chunk group reads, chunk after chunk."""
    dec_seqs: list[int | None]
    """:attr:`SeqBatch.seq` of each decode row, in the order of ``dec_pages``."""


def _plan_groups(seqs: list[SeqBatch], ps: int, dtype: torch.dtype, dev: torch.device, overhead: int) -> _Plan:
    """The iteration's attention groups, in row order, and the flat page indices each
    kind reads (decode rows: ``dec_pages``; chunks after context: ``chunk_pages``;
    padding: page 0, masked), gathered once per layer and tensor (the decode rows'
    gather is reused across iterations, :meth:`PagedDecoder.forward`). Built once per
    iteration, used by every layer.

    No sequence attends a key it does not need except a decode row padded within its
    group (bounded by ``overhead`` keys per group): a prefill chunk attends its own
    ``ctx + n`` keys, not the longest chunk's.

    Raises:
        ValueError: the sequences do not tile the token rows in order (``offset`` of
            each = the sum of the ``n`` before it).
    """
    groups: list[_Group] = []
    flat: list[int] = []  # the pages the decode groups read, group after group
    cflat: list[int] = []  # the pages the chunk groups read
    d_ends: list[int] = []
    d_rows: list[int] = []
    d_slots: list[int] = []
    d_seqs: list[int | None] = []
    row = 0
    for sq in seqs:
        if sq.offset != row or sq.n < 1:
            raise ValueError(f"sequences must tile the token rows in order: offset {sq.offset} (n {sq.n}), expected {row}")
        row += sq.n
    i, S = 0, len(seqs)
    while i < S:
        sq = seqs[i]
        if sq.n == 1:  # a run of decode rows
            j = i
            while j < S and seqs[j].n == 1:
                j += 1
            ends = [s.ctx + 1 for s in seqs[i:j]]
            for a, b in _decode_runs(ends, overhead):
                run, e = seqs[i + a : i + b], ends[a:b]
                B, Lk = b - a, max(e)
                npg = -(-Lk // ps)
                p0 = len(flat)
                for r, s in enumerate(run):
                    kp = -(-e[r] // ps)
                    d_slots.append(len(flat) * ps + s.ctx)
                    d_rows.append(s.offset)
                    d_seqs.append(s.seq)
                    flat += s.block_table[:kp]
                    if kp < npg:
                        flat += [0] * (npg - kp)
                d_ends += e
                mask = None
                if min(e) != Lk:
                    seen = np.arange(Lk)[None, :] < np.asarray(e)[:, None]
                    mask = torch.zeros((B, 1, 1, Lk), dtype=dtype)
                    mask.view(B, Lk).masked_fill_(torch.from_numpy(~seen), float("-inf"))
                    mask = mask.to(dev)
                groups.append(_Group("decode", run[0].offset, run[-1].offset + 1, B, 1, Lk, p0, npg, mask))
            i = j
        elif sq.ctx == 0:  # fresh chunks of one length from position 0: one causal call
            j = i + 1
            while j < S and seqs[j].ctx == 0 and seqs[j].n == sq.n:
                j += 1
            groups.append(_Group("fresh", sq.offset, seqs[j - 1].offset + sq.n, j - i, sq.n, sq.n))
            i = j
        else:  # a chunk after context: its own keys, lower-right causal
            Q, Lk = sq.n, sq.ctx + sq.n
            npg = -(-Lk // ps)
            seen = np.arange(Lk)[None, :] <= np.arange(sq.ctx, Lk)[:, None]
            mask = torch.zeros((1, 1, Q, Lk), dtype=dtype)
            mask.view(Q, Lk).masked_fill_(torch.from_numpy(~seen), float("-inf"))
            groups.append(_Group("chunk", sq.offset, sq.offset + Q, 1, Q, Lk, len(cflat), npg, mask.to(dev)))
            cflat += sq.block_table[:npg]
            i += 1
    return _Plan(groups, flat, d_ends, d_rows, d_slots, cflat, d_seqs)


class PagedDecoder(torch.nn.Module):
    """The decoder's weights and its forward over paged KV.

    Args:
        cfg: the model's configuration.
        weights: tensors by Hugging Face name (``model.layers.0.self_attn.q_proj.weight`` …).
        dtype, device: where and how the weights live.
        group_overhead_keys: padding (keys) a decode attention group may carry before
            the next rows start a new group; None = by device
            (:data:`DECODE_GROUP_OVERHEAD_KEYS`).

    Raises:
        ModelConfigError: a weight the config implies is missing or has the wrong shape, or a
            weight is one the config does not use (:meth:`ModelConfig.check_tensors`).
    """

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
        group_overhead_keys: int | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = device

        cfg.check_tensors({n: tuple(t.shape) for n, t in weights.items()})
        self.act = ACT_FNS[cfg.hidden_act]

        def w(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = weights[name]  # present, of this shape: check_tensors
            assert tuple(t.shape) == shape, name
            return t.to(device=device, dtype=dtype).contiguous()

        H, D, nh, nkv, I = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        self.embed = w("model.embed_tokens.weight", (cfg.vocab_size, H))
        self.norm = w("model.norm.weight", (H,))
        if cfg.tie_word_embeddings and "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight", (cfg.vocab_size, H))
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            q = w(p + "self_attn.q_proj.weight", (nh * D, H))
            k = w(p + "self_attn.k_proj.weight", (nkv * D, H))
            v = w(p + "self_attn.v_proj.weight", (nkv * D, H))
            L: dict[str, torch.Tensor] = {
                "in_norm": w(p + "input_layernorm.weight", (H,)),
                "qkv": torch.cat([q, k, v], 0),
                "o": w(p + "self_attn.o_proj.weight", (H, nh * D)),
                "post_norm": w(p + "post_attention_layernorm.weight", (H,)),
                "gate_up": torch.cat([w(p + "mlp.gate_proj.weight", (I, H)), w(p + "mlp.up_proj.weight", (I, H))], 0),
                "down": w(p + "mlp.down_proj.weight", (H, I)),
            }
            if cfg.qkv_bias:
                L["qkv_b"] = torch.cat(
                    [
                        w(p + "self_attn.q_proj.bias", (nh * D,)),
                        w(p + "self_attn.k_proj.bias", (nkv * D,)),
                        w(p + "self_attn.v_proj.bias", (nkv * D,)),
                    ]
                )
            if cfg.o_bias:
                L["o_b"] = w(p + "self_attn.o_proj.bias", (H,))
            if cfg.mlp_bias:
                L["gate_up_b"] = torch.cat([w(p + "mlp.gate_proj.bias", (I,)), w(p + "mlp.up_proj.bias", (I,))])
                L["down_b"] = w(p + "mlp.down_proj.bias", (H,))
            if cfg.qk_norm:
                L["q_norm"] = w(p + "self_attn.q_norm.weight", (D,))
                L["k_norm"] = w(p + "self_attn.k_norm.weight", (D,))
            for name in ("qkv", "o", "gate_up", "down"):
                L[name + "_t"] = L[name].t()
            self.layers.append(L)
        self.lm_head_t = self.lm_head.t()
        f32 = torch.float32
        self._rms_consts = {
            n: (torch.tensor(float(n), dtype=f32, device=device), torch.tensor(cfg.rms_norm_eps, dtype=f32, device=device))
            for n in {H, D}
        }
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self._rope_tab = torch.empty(0, 2, D, dtype=dtype, device=device)
        self._dec_gathered: (
            tuple[torch.Tensor, list[int], list[int], list[torch.Tensor], list[torch.Tensor], list[int | None]] | None
        ) = None
        """The last forward's decode rows: (layer 0's K cache, pages, keys per row, gathered K
        and V per layer, sequence of each row), reused by the next forward when the rows are
        the same sequences on the same pages, one token on."""
        self.group_overhead_keys = (
            DECODE_GROUP_OVERHEAD_KEYS.get(device.type, DECODE_GROUP_OVERHEAD_KEYS["cuda"])
            if group_overhead_keys is None
            else group_overhead_keys
        )
        """Padding (keys) a decode attention group may carry before a new group starts
        (:func:`_decode_runs`); default by device (:data:`DECODE_GROUP_OVERHEAD_KEYS`)."""

    def _rope_table(self, n: int) -> torch.Tensor:
        """``[≥ n, 2, head_dim]`` in the model's dtype, by position: ``cos`` of ``[f, f]`` and
        ``sin_signed`` = ``[-sin f, sin f]`` with ``f = position · inv_freq`` (float32, as
        transformers computes it), for :func:`_rope`. Grown (doubling) as positions grow,
        so a forward only indexes it."""
        if self._rope_tab.shape[0] < n:
            m = max(n, 2 * self._rope_tab.shape[0], 256)
            freqs = torch.arange(m, dtype=torch.int64, device=self.device).float()[:, None] * self.inv_freq[None, :]
            sin = freqs.sin()
            cos = torch.cat((freqs, freqs), dim=-1).cos()
            self._rope_tab = torch.stack((cos, torch.cat((-sin, sin), dim=-1)), dim=1).to(self.dtype)
        return self._rope_tab

    @staticmethod
    def from_folder(folder: str | Path, dtype: torch.dtype, device: torch.device) -> PagedDecoder:
        """Load ``folder`` (config.json + ``*.safetensors``).

        Raises:
            ModelConfigError: missing/unsupported config, no safetensors file, or weights
                that do not match the config: missing, unused or mis-shaped, named
                (:meth:`ModelConfig.check_tensors`).
        """
        from safetensors.torch import load_file

        cfg = ModelConfig.load(folder)
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ModelConfigError(f"{folder}: no *.safetensors weights")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        cfg.check_tensors({n: tuple(t.shape) for n, t in weights.items()}, f"{folder}: *.safetensors")
        return PagedDecoder(cfg, weights, dtype, device)

    def new_cache(self, pages: int, page_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Empty paged KV: per layer K and V of shape ``[pages, page_size, kv_heads, head_dim]``."""
        c = self.cfg
        shape = (pages, page_size, c.num_kv_heads, c.head_dim)
        ks = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]
        vs = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]
        return ks, vs

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[SeqBatch],
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        logits_at: torch.Tensor | None,
    ) -> torch.Tensor:
        """One iteration: write the new tokens' K/V into their pages and return logits.

        Args:
            tokens: ``[T]`` int64 token ids of every sequence's new tokens, concatenated.
            positions: ``[T]`` int64 position of each token in its sequence.
            seqs: one :class:`SeqBatch` per sequence, tiling ``tokens`` in order;
                consecutive decode rows (``n == 1``) are attended in batched calls
                (fewest when sorted by context length), consecutive fresh chunks of one
                length in one causal call, any other chunk in its own call.
            k_cache, v_cache: per layer ``[pages, page_size, kv_heads, head_dim]``, written in place.
            logits_at: ``[S]`` indices into ``[0, T)`` whose logits are wanted; None: every token's (``S = T``).

        Returns:
            ``[S, vocab]`` float32 logits.

        Raises:
            ValueError: ``seqs`` do not tile the token rows in order.
        """
        c = self.cfg
        nh, nkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        ps = k_cache[0].shape[1]
        dev = self.device
        T = tokens.shape[0]
        # where each new token's K/V goes: flat slot = page * page_size + offset (one per token)
        slots_l: list[int] = []
        for sq in seqs:
            if sq.n == 1:
                slots_l.append(sq.block_table[sq.ctx // ps] * ps + sq.ctx % ps)
            else:
                p = np.arange(sq.ctx, sq.ctx + sq.n)
                slots_l.extend((np.asarray(sq.block_table, dtype=np.int64)[p // ps] * ps + p % ps).tolist())
        slots = int64_tensor(slots_l, dev)
        # attention groups (decode rows of similar length, fresh chunks, each chunk after
        # context) and the pages they gather: built once here, used by every layer
        plan = _plan_groups(seqs, ps, self.dtype, dev, self.group_overhead_keys)
        groups = plan.groups
        # the decode rows' gathered keys of the last forward hold every key they need but
        # the new token's when the rows are the same sequences (same pages) one token further
        # on (a computed token's K/V never changes while its sequence lives): write that token
        # instead of regathering. Same pages alone is not enough: a page freed by a sequence
        # that ended holds another sequence's keys once reallocated (SeqBatch.seq).
        prev = self._dec_gathered
        reuse = (
            prev is not None
            and prev[0] is k_cache[0]
            and None not in plan.dec_seqs
            and prev[5] == plan.dec_seqs
            and prev[1] == plan.dec_pages
            and len(prev[2]) == len(plan.dec_ends)
            and all(a + 1 == b for a, b in zip(prev[2], plan.dec_ends))
        )
        self._dec_gathered = None
        dec_pages = chunk_pages = dec_slots = dec_rows = None
        if plan.dec_pages and not reuse:
            dec_pages = int64_tensor(plan.dec_pages, dev)
        if reuse:
            dec_slots = int64_tensor(plan.dec_slots, dev)
            r0, n = plan.dec_rows[0], len(plan.dec_rows)
            contiguous = plan.dec_rows == list(range(r0, r0 + n))
            dec_rows = slice(r0, r0 + n) if contiguous else int64_tensor(plan.dec_rows, dev)
        if plan.chunk_pages:
            chunk_pages = int64_tensor(plan.chunk_pages, dev)
        kept_k: list[torch.Tensor] = []
        kept_v: list[torch.Tensor] = []
        rope = self._rope_table(max(sq.ctx + sq.n for sq in seqs)).index_select(0, positions.to(dev))
        cos, sin_signed = rope[:, 0:1], rope[:, 1:2]  # [T, 1, D] each
        x = F.embedding(tokens.to(dev), self.embed)
        scale = 1.0 / math.sqrt(D)
        I = c.intermediate_size
        for li, L in enumerate(self.layers):
            h = _rms(x, L["in_norm"], c.rms_norm_eps, self._rms_consts)
            qkv = _linear(h, L["qkv_t"], L.get("qkv_b"))
            v = qkv[:, (nh + nkv) * D :].view(T, nkv, D)
            if c.qk_norm:
                q = _rope(_rms(qkv[:, : nh * D].view(T, nh, D), L["q_norm"], c.rms_norm_eps, self._rms_consts), cos, sin_signed)
                k = _rope(_rms(qkv[:, nh * D : (nh + nkv) * D].view(T, nkv, D), L["k_norm"], c.rms_norm_eps, self._rms_consts), cos, sin_signed)
            else:  # q and k rotated in one pass
                qk = _rope(qkv[:, : (nh + nkv) * D].view(T, nh + nkv, D), cos, sin_signed)
                q, k = qk[:, :nh], qk[:, nh:]
            kc, vc = k_cache[li], v_cache[li]
            kc.view(-1, nkv, D).index_copy_(0, slots, k if k.dtype == kc.dtype else k.to(kc.dtype))
            vc.view(-1, nkv, D).index_copy_(0, slots, v if v.dtype == vc.dtype else v.to(vc.dtype))
            kd = vd = kch = vch = None
            if reuse and prev is not None:  # reuse implies prev: the test is for mypy
                kd, vd = prev[3][li], prev[4][li]
                ks_new = k[dec_rows] if isinstance(dec_rows, slice) else k.index_select(0, dec_rows)
                vs_new = v[dec_rows] if isinstance(dec_rows, slice) else v.index_select(0, dec_rows)
                kd.view(-1, nkv, D).index_copy_(0, dec_slots, ks_new.to(kd.dtype))
                vd.view(-1, nkv, D).index_copy_(0, dec_slots, vs_new.to(vd.dtype))
            elif dec_pages is not None:
                kd, vd = kc.index_select(0, dec_pages), vc.index_select(0, dec_pages)
            if kd is not None:
                kept_k.append(kd)
                kept_v.append(vd)
            if chunk_pages is not None:
                kch, vch = kc.index_select(0, chunk_pages), vc.index_select(0, chunk_pages)
            outs = [g.attend(q, k, v, kd, vd, scale) if g.kind == "decode" else g.attend(q, k, v, kch, vch, scale) for g in groups]
            attn = outs[0] if len(outs) == 1 else torch.cat(outs)
            if "o_b" in L:  # x + (b + attn·Woᵀ): transformers' o_proj, then the residual
                x = x + _linear(attn.reshape(T, nh * D), L["o_t"], L["o_b"])
            else:
                x = torch.addmm(x, attn.reshape(T, nh * D), L["o_t"])  # x + attn·Woᵀ in one op, bit for bit
            h = _rms(x, L["post_norm"], c.rms_norm_eps, self._rms_consts)
            gu = _linear(h, L["gate_up_t"], L.get("gate_up_b"))
            a = self.act(gu[:, :I]) * gu[:, I:]
            x = x + _linear(a, L["down_t"], L["down_b"]) if "down_b" in L else torch.addmm(x, a, L["down_t"])
        if kept_k:
            self._dec_gathered = (k_cache[0], plan.dec_pages, plan.dec_ends, kept_k, kept_v, plan.dec_seqs)
        if logits_at is not None:
            x = x.index_select(0, logits_at.to(dev))
        return _linear(_rms(x, self.norm, c.rms_norm_eps, self._rms_consts), self.lm_head_t).float()
