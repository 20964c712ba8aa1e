"""A Hugging Face model folder's ``config.json``, as the torch engine reads it (:class:`ModelConfig`).

Imports no torch: ``up`` / ``demo --engine torch`` check the ``--model`` folder with it (a usage error, exit 2)
whether or not the ``torch`` extra is installed; ``model.py`` (the decoder) re-exports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
"""``config.json`` ``architectures[0]`` values this module implements."""


TORCH_EXTRA_INSTALL = (
    "pip install -e '.[torch]' (without a GPU, first pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cpu: PyPI's Linux torch is the CUDA build, several GB)"
)
"""How to install the ``torch`` extra, for the one line of ``up`` / ``model init`` / a worker that lacks it
(README, Engines): the bare install alone took a CPU machine to the multi-GB CUDA build."""


ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "relu6", "leaky_relu", "sigmoid",
               "tanh", "mish", "hardswish", "linear")
"""``hidden_act`` values the decoder computes (``model.py`` ``ACT_FNS``), each as ``transformers``'
``ACT2FN`` does for it (5.x ``activations.py``): one torch call each (``silu``/``swish`` ``F.silu``,
``gelu`` ``F.gelu``, ``gelu_pytorch_tanh`` ``F.gelu(approximate="tanh")``, ``relu``, ``relu6``,
``leaky_relu`` (slope 0.01), ``sigmoid``, ``tanh``, ``mish``, ``hardswish``; ``linear`` is the identity),
and ``gelu_new``, transformers' own tanh expression (not ``F.gelu``'s, which rounds differently). Any
other value (``quick_gelu``, ``gelu_fast``, ``relu2``, ``prelu``, ``xielu``, ...) is refused at load."""

ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048, "sliding_window": None},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768, "sliding_window": 4096},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768, "sliding_window": 4096},
}
"""What ``transformers``' config class of each architecture (5.x ``LlamaConfig``, ``MistralConfig``,
``Qwen2Config``, ``Qwen3Config``) takes for a key that ``config.json`` leaves out, where the classes differ
(None: ``num_attention_heads`` for the KV heads, ``hidden_size // num_attention_heads`` for ``head_dim``).
The same in all four: ``hidden_act`` ``silu``, ``rms_norm_eps`` 1e-6, ``rope_theta`` 10000,
``tie_word_embeddings`` false, ``attention_bias`` / ``mlp_bias`` false (Llama; Qwen3's attention_bias).
A Mistral's ``sliding_window`` applies unless it is null; a Qwen's only with ``use_sliding_window``
(default false) and on its layers from ``max_window_layers`` (default 28) on, or as ``layer_types`` says."""

ALLOWED_UNUSED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
"""Checkpoint tensors the decoder may leave unused (names ending so): RoPE tables old ``transformers``
versions saved, which the decoder computes from the config (vLLM's Llama loader skips the same three).
Any other tensor the decoder does not use is an error at load (:meth:`ModelConfig.check_tensors`)."""


class ModelConfigError(ValueError):
    """A model folder that cannot be served: missing file, unsupported architecture or setting."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The fields of a Hugging Face ``config.json`` this decoder uses, as ``transformers``' class of the
    architecture reads them (its defaults for absent keys: :data:`ARCH_DEFAULTS`)."""

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
    """The RoPE parameters when the type is not ``default`` (``linear``: ``factor``; ``llama3``: ``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``); None: plain RoPE."""
    max_position_embeddings: int
    """Context length (tokens): prompt + output may not exceed it."""
    tie_word_embeddings: bool
    qkv_bias: bool
    """q/k/v projections carry biases: Qwen2 always; Llama and Qwen3 when ``attention_bias``; Mistral never."""
    o_bias: bool
    """The output projection ``o_proj`` carries a bias: Llama and Qwen3 when ``attention_bias``
    (transformers' ``LlamaAttention`` / ``Qwen3Attention``); Qwen2 and Mistral never."""
    mlp_bias: bool
    """gate/up/down projections carry biases: Llama when ``mlp_bias``; the others never."""
    hidden_act: str
    """The MLP's activation (one of :data:`ACTIVATIONS`): ``down(act(gate(x)) * up(x))``."""
    qk_norm: bool
    """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
    eos_token_id: list[int]

    @staticmethod
    def load(folder: str | Path) -> ModelConfig:
        """Read ``folder/config.json``.

        Raises:
            ModelConfigError: no config.json, malformed JSON, an architecture not in
                :data:`SUPPORTED_ARCHS`, or an unsupported setting (see :meth:`from_dict`).
        """
        path = Path(folder) / "config.json"
        if not Path(folder).exists():
            # vLLM users pass a hub id (--model Qwen/Qwen3-0.6B); nothing is downloaded here
            hub = (f"; a Hugging Face hub id is not downloaded: fetch it first (huggingface-cli download {folder} "
                   f"--local-dir DIR) and pass DIR" if str(folder).count("/") == 1 and not str(folder).startswith((".", "/", "~")) else "")
            raise ModelConfigError(f"{folder}: no such folder (--model takes a local Hugging Face model folder{hub}; "
                                   f"evolving-infra model init DIR writes a tiny one)")
        if not path.is_file():
            raise ModelConfigError(f"{folder}: no config.json (not a Hugging Face model folder)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{path}: unreadable config: {e}") from e
        return ModelConfig.from_dict(raw, str(path))

    @staticmethod
    def from_dict(raw: dict[str, Any], where: str = "config") -> ModelConfig:
        """Build from a parsed ``config.json``, reading each key as ``transformers`` 5.x reads it for the
        architecture (``modeling_llama.py``, ``modeling_mistral.py``, ``modeling_qwen2.py``,
        ``modeling_qwen3.py`` and their config classes): absent keys take :data:`ARCH_DEFAULTS`; the RoPE
        parameters are ``rope_scaling`` or else ``rope_parameters`` (transformers >= 5), their
        ``rope_theta`` before the top-level one; biases by architecture (:attr:`qkv_bias`, :attr:`o_bias`,
        :attr:`mlp_bias`: a key the architecture's class ignores is ignored here too).

        Raises:
            ModelConfigError: an architecture not in :data:`SUPPORTED_ARCHS`, a missing or malformed
                required field (``vocab_size``, ``hidden_size``, ``intermediate_size``,
                ``num_hidden_layers``, ``num_attention_heads``), a ``hidden_act`` not in
                :data:`ACTIVATIONS`, a RoPE type other than default/linear/llama3 or one missing its
                parameters or given per layer type, a ``partial_rotary_factor`` other than 1, or sliding-window attention
                that takes effect within the context.
        """
        archs = raw.get("architectures") or []
        arch = SUPPORTED_ARCHS.get(archs[0]) if archs else None
        if arch is None:
            raise ModelConfigError(
                f"{where}: architectures {archs!r} not supported; one of {sorted(SUPPORTED_ARCHS)} is needed"
            )
        dflt = ARCH_DEFAULTS[arch]

        def get(key: str, default: Any) -> Any:
            """``raw[key]``, or ``default`` when absent or null (as the config classes take None)."""
            v = raw.get(key)
            return default if v is None else v

        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            context = int(get("max_position_embeddings", dflt["max_position_embeddings"]))
            # transformers' convert_rope_params_to_dict: rope_scaling, else rope_parameters (>= 5), as one
            # dict; its rope_theta first, then the top-level one, then 10000
            rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
            if nested := [k for k, v in rope.items() if isinstance(v, dict)]:
                raise ModelConfigError(f"{where}: RoPE parameters per layer type ({', '.join(nested)}) not supported")
            theta = float(rope.get("rope_theta") or get("rope_theta", 10000.0))
            kind = rope.get("rope_type", rope.get("type", "default"))
            scaling: dict[str, Any] | None = None
            if kind not in ("default", "linear", "llama3"):
                raise ModelConfigError(f"{where}: rope_scaling type {kind!r} not supported (default, linear, llama3)")
            partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
            if partial is not None and float(partial) != 1.0:
                raise ModelConfigError(f"{where}: partial_rotary_factor {partial} not supported (RoPE over the whole head_dim only)")
            if kind != "default":
                need = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
                if lacking := [k for k in need if rope.get(k) is None]:
                    raise ModelConfigError(f"{where}: rope_scaling type {kind!r} needs {', '.join(lacking)}")
                scaling = {"rope_type": kind, **{k: float(rope[k]) for k in need}}
                if kind == "llama3":  # transformers' standardize_rope_params: the context when absent
                    scaling["original_max_position_embeddings"] = float(rope.get("original_max_position_embeddings") or context)
            act = get("hidden_act", "silu")
            if act not in ACTIVATIONS:
                raise ModelConfigError(f"{where}: hidden_act {act!r} not supported (one of {', '.join(ACTIVATIONS)})")
            if arch == "mistral":  # MistralConfig: every layer slides unless sliding_window is null
                window = raw.get("sliding_window", dflt["sliding_window"])
            elif arch in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
                window = get("sliding_window", dflt["sliding_window"])
                start = int(get("max_window_layers", 28))
                kinds = raw.get("layer_types") or ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
                window = window if "sliding_attention" in kinds else None
            else:  # Llama has no sliding window; a Qwen's is off without use_sliding_window
                window = None
            if window is not None and int(window) < context:
                raise ModelConfigError(f"{where}: sliding-window attention is not supported (sliding_window {window} "
                                       f"< max_position_embeddings {context})")
            eos = raw.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(x) for x in eos])
            attention_bias = bool(raw.get("attention_bias", False))
            return ModelConfig(
                arch=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(get("num_key_value_heads", dflt["num_key_value_heads"] or heads)),
                head_dim=int(get("head_dim", dflt["head_dim"] or hidden // heads)),
                rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=context,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "qwen2" or (arch in ("llama", "qwen3") and attention_bias),
                o_bias=arch in ("llama", "qwen3") and attention_bias,
                mlp_bias=arch == "llama" and bool(raw.get("mlp_bias", False)),
                hidden_act=act,
                qk_norm=arch == "qwen3",
                eos_token_id=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ModelConfigError):
                raise
            raise ModelConfigError(f"{where}: missing or malformed field: {e!r}") from e

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the decoder reads from the checkpoint, by Hugging Face name, with its shape
        (elements): embeddings ``[vocab, hidden]``, per layer the norms, q/k/v/o, gate/up/down (and their
        biases when :attr:`qkv_bias` / :attr:`o_bias` / :attr:`mlp_bias`), Qwen3's q/k norms ``[head_dim]``,
        the final norm, and ``lm_head.weight`` unless the embeddings are tied (a tied model's
        ``lm_head.weight``, when present, is used instead of the embeddings, as transformers 5 does when
        the two differ; :meth:`check_tensors` takes it)."""
        H, D, nh, nkv, I = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, self.intermediate_size
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, H), "model.norm.weight": (H,)}
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, H)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (H,)
            out[p + "post_attention_layernorm.weight"] = (H,)
            for name, rows in (("q", nh * D), ("k", nkv * D), ("v", nkv * D)):
                out[p + f"self_attn.{name}_proj.weight"] = (rows, H)
                if self.qkv_bias:
                    out[p + f"self_attn.{name}_proj.bias"] = (rows,)
            out[p + "self_attn.o_proj.weight"] = (H, nh * D)
            if self.o_bias:
                out[p + "self_attn.o_proj.bias"] = (H,)
            for name, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
                out[p + f"mlp.{name}_proj.weight"] = shape
                if self.mlp_bias:
                    out[p + f"mlp.{name}_proj.bias"] = (shape[0],)
            if self.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (D,)
                out[p + "self_attn.k_norm.weight"] = (D,)
        return out

    def check_tensors(self, found: dict[str, tuple[int, ...]], where: str = "checkpoint") -> None:
        """Strict load: the checkpoint's tensors (name → shape) are exactly :meth:`tensor_shapes`, but for
        a tied model's ``lm_head.weight`` and the RoPE tables of :data:`ALLOWED_UNUSED_SUFFIXES`.

        Raises:
            ModelConfigError: naming the missing tensors, those the decoder would not use (with the
                config key that would use them where there is one: an ``o_proj.bias`` of a Llama
                without ``attention_bias``), and those of another shape (found vs implied), up to 8
                names of each.
        """
        want = self.tensor_shapes()
        missing = [n for n in want if n not in found]
        unused = [n for n in found if n not in want and not n.endswith(ALLOWED_UNUSED_SUFFIXES)
                  and not (n == "lm_head.weight" and self.tie_word_embeddings)]
        if self.tie_word_embeddings and "lm_head.weight" in found:
            want = {**want, "lm_head.weight": (self.vocab_size, self.hidden_size)}
        wrong = [f"{n} {tuple(found[n])} (config implies {want[n]})" for n in want if n in found and tuple(found[n]) != want[n]]
        if not (missing or unused or wrong):
            return

        def names(xs: list[str]) -> str:
            return ", ".join(xs[:8]) + (f", ... ({len(xs)} in all)" if len(xs) > 8 else "")

        parts = []
        if missing:
            parts.append(f"missing: {names(missing)}")
        if unused:
            hint = _unused_hint(self, unused)
            parts.append(f"not used by this config ({self.arch}{hint}): {names(unused)}")
        if wrong:
            parts.append(f"wrong shape: {names(wrong)}")
        raise ModelConfigError(f"{where}: tensors do not match config.json; " + "; ".join(parts))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def _unused_hint(cfg: ModelConfig, unused: list[str]) -> str:
    """The config key that would make ``unused`` tensors used, as a clause (or ``""``): biases on an
    architecture or setting without them."""
    keys = []
    if any(n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")) for n in unused):
        keys.append("attention biases need attention_bias: true" if cfg.arch in ("llama", "qwen3")
                    else f"{cfg.arch} has no {'o_proj' if cfg.arch == 'qwen2' else 'attention'} biases")
    if any(n.startswith("model.layers.") and ".mlp." in n and n.endswith(".bias") for n in unused):
        keys.append("MLP biases need mlp_bias: true" if cfg.arch == "llama" else f"{cfg.arch} has no MLP biases")
    layer = [n.split(".")[2] for n in unused if n.startswith("model.layers.")]
    if any(i.isdigit() and int(i) >= cfg.num_layers for i in layer):
        keys.append(f"num_hidden_layers is {cfg.num_layers}")
    return "; " + "; ".join(keys) if keys else ""
