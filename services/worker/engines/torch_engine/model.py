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
layers; the projections and MLP run on all tokens at once, attention in two
batched SDPA calls over gathered pages (the decode requests; the prefill chunks,
padded to the longest).
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


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


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


@dataclass(slots=True)
class _Group:
    """Sequences attended in one batched SDPA call: their queries padded to ``Q``, their
    keys gathered from ``npg`` pages each (padding masked out)."""

    q_idx: torch.Tensor
    """[B, Q] indices of the queries in the flat token tensor (padding: any valid index)."""
    valid: torch.Tensor
    """[B, Q] bool: a real query."""
    q_flat: torch.Tensor
    """[Σn] the flat indices of the real queries, in ``valid``'s row-major order."""
    table: torch.Tensor
    """[B, npg] pages (padding: page 0, masked)."""
    mask: torch.Tensor
    """[B, 1, Q, npg·page_size] bool: query i of sequence b sees key j iff j ≤ ctx_b + i
    (padded query rows see key 0 only, so no row is empty)."""

    @staticmethod
    def build(seqs: list[SeqBatch], ps: int, dev: torch.device) -> _Group | None:
        if not seqs:
            return None
        B = len(seqs)
        Q = max(sq.n for sq in seqs)
        npg = max(-(-(sq.ctx + sq.n) // ps) for sq in seqs)
        q_idx = np.zeros((B, Q), dtype=np.int64)
        valid = np.zeros((B, Q), dtype=bool)
        table = np.zeros((B, npg), dtype=np.int64)
        last = np.zeros((B, Q), dtype=np.int64)  # last key position each query sees
        for b, sq in enumerate(seqs):
            q_idx[b, : sq.n] = np.arange(sq.offset, sq.offset + sq.n)
            q_idx[b, sq.n :] = sq.offset
            valid[b, : sq.n] = True
            k = -(-(sq.ctx + sq.n) // ps)
            table[b, :k] = sq.block_table[:k]
            last[b, : sq.n] = np.arange(sq.ctx, sq.ctx + sq.n)
        mask = np.arange(npg * ps)[None, None, :] <= last[:, :, None]
        return _Group(
            q_idx=torch.from_numpy(q_idx).to(dev),
            valid=torch.from_numpy(valid).to(dev),
            q_flat=torch.from_numpy(q_idx[valid]).to(dev),
            table=torch.from_numpy(table).to(dev),
            mask=torch.from_numpy(mask[:, None]).to(dev),
        )


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
            self.layers.append(L)
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
        # where each new token's K/V goes: flat slot = page * page_size + offset (numpy: no per-seq tensors)
        slots_np = np.empty(tokens.shape[0], dtype=np.int64)
        for sq in seqs:
            p = np.arange(sq.ctx, sq.ctx + sq.n)
            slots_np[sq.offset : sq.offset + sq.n] = np.asarray(sq.block_table, dtype=np.int64)[p // ps] * ps + p % ps
        slots = torch.from_numpy(slots_np).to(dev)
        # attention groups, each one batched SDPA over gathered pages: the decode requests
        # (one query each), and the prefill chunks (padded to the longest chunk)
        groups = [g for g in (_Group.build([q for q in seqs if q.n == 1], ps, dev), _Group.build([q for q in seqs if q.n > 1], ps, dev)) if g]
        cos_sin = positions.to(dev).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((cos_sin, cos_sin), dim=-1)
        cos = emb.cos().to(self.dtype)[:, None, :]
        sin = emb.sin().to(self.dtype)[:, None, :]
        x = F.embedding(tokens.to(dev), self.embed)
        T = x.shape[0]
        scale = 1.0 / math.sqrt(D)
        for li, L in enumerate(self.layers):
            h = _rms(x, L["in_norm"], c.rms_norm_eps)
            qkv = F.linear(h, L["qkv"], L.get("qkv_b"))
            q = qkv[:, : nh * D].view(T, nh, D)
            k = qkv[:, nh * D : (nh + nkv) * D].view(T, nkv, D)
            v = qkv[:, (nh + nkv) * D :].view(T, nkv, D)
            if c.qk_norm:
                q = _rms(q, L["q_norm"], c.rms_norm_eps)
                k = _rms(k, L["k_norm"], c.rms_norm_eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = k_cache[li], v_cache[li]
            kc.view(-1, nkv, D).index_copy_(0, slots, k.to(kc.dtype))
            vc.view(-1, nkv, D).index_copy_(0, slots, v.contiguous().to(vc.dtype))
            attn = torch.empty(T, nh, D, dtype=x.dtype, device=dev)
            for g in groups:
                B = g.table.shape[0]
                ks = kc[g.table].reshape(B, -1, nkv, D).transpose(1, 2)  # [B, nkv, L, D]
                vs = vc[g.table].reshape(B, -1, nkv, D).transpose(1, 2)
                qs = q[g.q_idx].transpose(1, 2)  # [B, nh, Q, D]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=g.mask, scale=scale, enable_gqa=nh != nkv)
                attn[g.q_flat] = o.transpose(1, 2)[g.valid]
            x = x + F.linear(attn.reshape(T, nh * D), L["o"])
            h = _rms(x, L["post_norm"], c.rms_norm_eps)
            gu = F.linear(h, L["gate_up"])
            I = c.intermediate_size
            x = x + F.linear(F.silu(gu[:, :I]) * gu[:, I:], L["down"])
        x = _rms(x[logits_at.to(dev)], self.norm, c.rms_norm_eps)
        return F.linear(x, self.lm_head).float()
