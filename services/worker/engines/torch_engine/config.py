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
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize
