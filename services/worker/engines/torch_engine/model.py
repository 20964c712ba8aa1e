"""A Llama-family decoder over paged KV (Llama 2/3, Mistral, Qwen2, Qwen3), in PyTorch.

Loaded from a local Hugging Face folder: ``config.json`` + ``*.safetensors``
(weights through ``safetensors``). The math follows ``transformers``'
``modeling_llama.py`` / ``modeling_qwen3.py``: RMSNorm, rotary embeddings
(``rotate_half`` layout, ``rope_scaling`` ``linear``, ``dynamic`` is refused,
``llama3``), grouped-query attention, SwiGLU MLP, optional q/k/v biases
(Qwen2), per-head q/k RMSNorm (Qwen3), tied or untied embeddings.

The KV cache is paged (vLLM's layout): per layer one K and one V tensor of
shape ``[pages, page_size, kv_heads, head_dim]``; a sequence's keys are found
through its block table (list of page indices, one per ``page_size`` tokens).
``forward`` runs one iteration over a mixed batch: prefill chunks (many query
tokens each) and decode requests (one query token each) in one pass over the
layers; the projections and MLP run on all tokens at once, attention in at most
two batched SDPA calls per layer: the decode requests (keys gathered from their
pages by one ``index_select`` per tensor, no mask when all have the same length),
and the prefill chunks (padded to the longest, keys gathered, masked; chunks that
start at position 0 with one length attend causally over their own fresh K/V with
no gather). Page indices and masks are built once per iteration for all layers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
"""``config.json`` ``architectures[0]`` values this module implements."""


class ModelConfigError(ValueError):
    """A model folder that cannot be served: missing file, unsupported architecture or setting."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The fields of a Hugging Face ``config.json`` this decoder uses."""

    arch: str
    """``llama``, ``mistral``, ``qwen2`` or ``qwen3``."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    """Context length (tokens): prompt + output may not exceed it."""
    tie_word_embeddings: bool
    attention_bias: bool
    """q/k/v projections carry biases (Qwen2 always; Llama when ``attention_bias``)."""
    qk_norm: bool
    """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
    eos_token_id: list[int]

    @staticmethod
    def load(folder: str | Path) -> ModelConfig:
        """Read ``folder/config.json``.

        Raises:
            ModelConfigError: no config.json, malformed JSON, an architecture not in
                :data:`SUPPORTED_ARCHS`, or an unsupported ``rope_scaling`` type.
        """
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{folder}: no config.json (not a Hugging Face model folder)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{path}: unreadable config: {e}") from e
        return ModelConfig.from_dict(raw, str(path))

    @staticmethod
    def from_dict(raw: dict[str, Any], where: str = "config") -> ModelConfig:
        """Build from a parsed ``config.json`` (see :meth:`load` for the errors raised)."""
        archs = raw.get("architectures") or []
        arch = SUPPORTED_ARCHS.get(archs[0]) if archs else None
        if arch is None:
            raise ModelConfigError(
                f"{where}: architectures {archs!r} not supported; one of {sorted(SUPPORTED_ARCHS)} is needed"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            # transformers >= 5 writes ``rope_parameters`` (rope_type, factor, ..., rope_theta);
            # older configs ``rope_scaling`` + ``rope_theta``
            params = raw.get("rope_parameters") or {}
            scaling = raw.get("rope_scaling") or (dict(params) if params.get("rope_type", "default") != "default" else None)
            theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
            if scaling is not None:
                kind = scaling.get("rope_type", scaling.get("type", "default"))
                if kind not in ("default", "linear", "llama3"):
                    raise ModelConfigError(f"{where}: rope_scaling type {kind!r} not supported (default, linear, llama3)")
            if raw.get("sliding_window") and raw.get("use_sliding_window", arch == "mistral"):
                if int(raw["sliding_window"]) < int(raw.get("max_position_embeddings", 0)):
                    raise ModelConfigError(f"{where}: sliding-window attention is not supported")
            eos = raw.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(x) for x in eos])
            return ModelConfig(
                arch=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
                qk_norm=arch == "qwen3",
                eos_token_id=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ModelConfigError):
                raise
            raise ModelConfigError(f"{where}: missing or malformed field: {e!r}") from e

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


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
    sign of ``rotate_half`` folded into ``sin_signed`` (first half negated): the same
    products, bit for bit, in three ops fewer."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., h:], x[..., :h]), dim=-1) * sin_signed


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


def _pages_and_mask(
    seqs: list[SeqBatch], ps: int, dtype: torch.dtype, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """Pages to gather and the additive mask of a group: ``([B·npg] flat page indices
    (padding: page 0), [B, 1, Q, Lk] mask (0 = seen, -inf = not) or None, npg, Lk)``
    where ``Lk = max(ctx + n)`` keys are attended (of the ``npg·page_size`` gathered).
    Query i of sequence b sees key j iff j ≤ ctx_b + i; a padded query row (i ≥ n_b)
    sees key 0 only, so no row is empty. No mask (None) when every query sees every
    key (one query per sequence, all of the same length): adding zeros is exact, so
    the result is the same bit for bit. Built once per iteration, used by every layer."""
    B = len(seqs)
    Q = max(sq.n for sq in seqs)
    ends = [sq.ctx + sq.n for sq in seqs]
    Lk = max(ends)
    npg = -(-Lk // ps)
    table = np.zeros((B, npg), dtype=np.int64)
    for b, sq in enumerate(seqs):
        k = -(-ends[b] // ps)
        table[b, :k] = sq.block_table[:k]
    pages = torch.from_numpy(table.reshape(-1)).to(dev)
    if Q == 1 and min(ends) == Lk:
        return pages, None, npg, Lk
    last = np.zeros((B, Q), dtype=np.int64)  # last key position each query sees
    for b, sq in enumerate(seqs):
        last[b, : sq.n] = np.arange(sq.ctx, sq.ctx + sq.n)
    seen = np.arange(Lk)[None, None, :] <= last[:, :, None]
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(torch.from_numpy(~seen), float("-inf"))
    return pages, mask[:, None].to(dev), npg, Lk


@dataclass(slots=True)
class _Group:
    """Sequences attended in one batched attention call, in one of three ways:

    * *fresh*: prefill chunks from position 0, all of one length ``Q``, contiguous in
      the flat token tensor: causal attention over this iteration's own K/V, no
      gather, no mask (the pages are written all the same);
    * *decode rows*: one query per sequence, contiguous: keys gathered (one
      ``index_select`` per layer and tensor) from ``npg`` pages each;
    * otherwise: queries padded to ``Q`` (gathered by index), keys gathered from
      pages, padding masked out.
    """

    B: int
    Q: int
    Lk: int
    """Keys attended per sequence (``max(ctx + n)``)."""
    pages: torch.Tensor | None
    """[B·npg] flat page indices (padding: page 0, masked); None for *fresh*."""
    mask: torch.Tensor | None
    """[B, 1, Q, Lk] additive mask in the model's dtype (see :func:`_pages_and_mask`); None: none needed."""
    rows: slice | None
    """Queries contiguous in the flat token tensor (*fresh* and *decode rows*): their rows."""
    q_idx: torch.Tensor | None = None
    """[B·Q] indices of the queries in the flat token tensor (padding: the sequence's first token)."""
    q_flat: torch.Tensor | None = None
    """[Σn] flat indices of the real queries, in row-major (b, i) order."""
    valid: torch.Tensor | None = None
    """[Σn] positions of the real queries in the ``[B·Q]`` padded rows."""

    @staticmethod
    def build(seqs: list[SeqBatch], ps: int, dtype: torch.dtype, dev: torch.device) -> _Group | None:
        if not seqs:
            return None
        B = len(seqs)
        Q = max(sq.n for sq in seqs)
        first = seqs[0].offset
        contiguous = all(sq.offset == first + b * Q and sq.n == Q for b, sq in enumerate(seqs))
        if Q > 1 and contiguous and all(sq.ctx == 0 for sq in seqs):
            return _Group(B, Q, Q, None, None, slice(first, first + B * Q))
        pages, mask, _, Lk = _pages_and_mask(seqs, ps, dtype, dev)
        if Q == 1 and contiguous:
            return _Group(B, 1, Lk, pages, mask, slice(first, first + B))
        q_idx = np.empty((B, Q), dtype=np.int64)
        valid = np.zeros((B, Q), dtype=bool)
        for b, sq in enumerate(seqs):
            q_idx[b, : sq.n] = np.arange(sq.offset, sq.offset + sq.n)
            q_idx[b, sq.n :] = sq.offset
            valid[b, : sq.n] = True
        flat_valid = np.flatnonzero(valid.reshape(-1))
        return _Group(
            B, Q, Lk, pages, mask, None,
            torch.from_numpy(q_idx.reshape(-1)).to(dev),
            torch.from_numpy(q_idx.reshape(-1)[flat_valid]).to(dev),
            torch.from_numpy(flat_valid).to(dev),
        )  # fmt: skip

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
        out: torch.Tensor | None, scale: float,
    ) -> torch.Tensor | None:
        """Attention of this group's queries (``q``: ``[T, heads, D]``, all tokens; ``k``,
        ``v``: ``[T, kv_heads, D]``, this iteration's) over their keys in the pages of
        ``kc``/``vc`` (``[pages, page_size, kv_heads, D]``, already holding ``k``/``v``),
        written into their rows of ``out`` (``[T, heads, D]``); with ``out`` None (a group
        whose ``rows`` are all ``T`` tokens), returned as ``[T, heads, D]`` instead."""
        B, Q, Lk = self.B, self.Q, self.Lk
        nh, D = q.shape[1], q.shape[2]
        nkv = kc.shape[2]
        gqa = nh != nkv
        if self.pages is None:  # fresh prefill: this iteration's own K/V, causal
            rows = self.rows
            qs = q[rows].view(B, Q, nh, D).transpose(1, 2)
            ks = k[rows].view(B, Q, nkv, D).transpose(1, 2)
            vs = v[rows].view(B, Q, nkv, D).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
            o = o.transpose(1, 2).reshape(B * Q, nh, D)
            if out is None:
                return o
            out[rows] = o
            return None
        ks = kc.index_select(0, self.pages).view(B, -1, nkv, D)[:, :Lk].transpose(1, 2)  # [B, nkv, Lk, D]
        vs = vc.index_select(0, self.pages).view(B, -1, nkv, D)[:, :Lk].transpose(1, 2)
        if self.rows is not None:
            qs = q[self.rows].view(B, 1, nh, D).transpose(1, 2)  # [B, nh, 1, D]
        else:
            qs = q.index_select(0, self.q_idx).view(B, Q, nh, D).transpose(1, 2)  # [B, nh, Q, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=self.mask, scale=scale, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(B * Q, nh, D)
        if out is None:
            return o
        if self.rows is not None:
            out[self.rows] = o
        else:
            out.index_copy_(0, self.q_flat, o.index_select(0, self.valid))
        return None


class PagedDecoder(torch.nn.Module):
    """The decoder's weights and its forward over paged KV.

    Args:
        cfg: the model's configuration.
        weights: tensors by Hugging Face name (``model.layers.0.self_attn.q_proj.weight`` …).
        dtype, device: where and how the weights live.

    Raises:
        ModelConfigError: a weight the config implies is missing or has the wrong shape.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = device

        def w(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = weights.get(name)
            if t is None:
                raise ModelConfigError(f"weight {name} missing from the checkpoint")
            if tuple(t.shape) != shape:
                raise ModelConfigError(f"weight {name} has shape {tuple(t.shape)}, config implies {shape}")
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
            if cfg.attention_bias:
                L["qkv_b"] = torch.cat(
                    [
                        w(p + "self_attn.q_proj.bias", (nh * D,)),
                        w(p + "self_attn.k_proj.bias", (nkv * D,)),
                        w(p + "self_attn.v_proj.bias", (nkv * D,)),
                    ]
                )
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

    @staticmethod
    def from_folder(folder: str | Path, dtype: torch.dtype, device: torch.device) -> PagedDecoder:
        """Load ``folder`` (config.json + ``*.safetensors``).

        Raises:
            ModelConfigError: missing/unsupported config, no safetensors file, or weights
                that do not match the config.
        """
        from safetensors.torch import load_file

        cfg = ModelConfig.load(folder)
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ModelConfigError(f"{folder}: no *.safetensors weights")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        return PagedDecoder(cfg, weights, dtype, device)

    def new_cache(self, pages: int, page_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Empty paged KV: per layer K and V of shape ``[pages, page_size, kv_heads, head_dim]``."""
        c = self.cfg
        shape = (pages, page_size, c.num_kv_heads, c.head_dim)
        ks = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]
        vs = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]
        return ks, vs

    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[SeqBatch],
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        logits_at: torch.Tensor,
    ) -> torch.Tensor:
        """One iteration: write the new tokens' K/V into their pages and return logits.

        Args:
            tokens: ``[T]`` int64 token ids of every sequence's new tokens, concatenated.
            positions: ``[T]`` int64 position of each token in its sequence.
            seqs: one :class:`SeqBatch` per sequence, in the order of ``tokens``;
                sequences with ``n == 1`` (decode) are attended in one batched call.
            k_cache, v_cache: per layer ``[pages, page_size, kv_heads, head_dim]``, written in place.
            logits_at: ``[S]`` indices into ``[0, T)`` whose logits are wanted.

        Returns:
            ``[S, vocab]`` float32 logits.
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
        slots = torch.tensor(slots_l, dtype=torch.int64).to(dev)
        # attention groups, each one batched SDPA over gathered pages: the decode requests
        # (one query each), and the prefill chunks (padded to the longest chunk); their
        # page indices and masks are built once here and used by every layer
        groups = [
            g
            for g in (
                _Group.build([q for q in seqs if q.n == 1], ps, self.dtype, dev),
                _Group.build([q for q in seqs if q.n > 1], ps, self.dtype, dev),
            )
            if g
        ]
        freqs = positions.to(dev).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(self.dtype)[:, None, :]
        sin = freqs.sin()
        sin_signed = torch.cat((-sin, sin), dim=-1).to(self.dtype)[:, None, :]
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
            if len(groups) == 1 and groups[0].rows == slice(0, T):  # one group, every row: no copy
                attn = groups[0].attend(q, k, v, kc, vc, None, scale)
            else:
                attn = torch.empty(T, nh, D, dtype=x.dtype, device=dev)
                for g in groups:
                    g.attend(q, k, v, kc, vc, attn, scale)
            x = x + _linear(attn.reshape(T, nh * D), L["o_t"])
            h = _rms(x, L["post_norm"], c.rms_norm_eps, self._rms_consts)
            gu = _linear(h, L["gate_up_t"])
            x = x + _linear(F.silu(gu[:, :I]) * gu[:, I:], L["down_t"])
        x = _rms(x.index_select(0, logits_at.to(dev)), self.norm, c.rms_norm_eps, self._rms_consts)
        return _linear(x, self.lm_head_t).float()
