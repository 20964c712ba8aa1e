"""``evolving-infra model init``: a seeded random Llama/Qwen3 checkpoint in the Hugging Face layout.

Writes ``config.json``, ``model.safetensors``, ``tokenizer.json`` (a byte-level
BPE trained here by ``tokenizers`` on :data:`CORPUS_FILE`, a fixed text that ships with
the package, so the same arguments and seed give the same files in any commit and any
install; padded with special filler tokens ``<|extra_N|>`` up to the model's vocabulary
when the text gives fewer ids, :func:`train_tokenizer`), ``tokenizer_config.json``
(ChatML chat template, eos ``<|im_end|>``) and ``generation_config.json``.
``transformers``' ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` load the folder as
it is, and so does :class:`~services.worker.engines.torch_engine.model.PagedDecoder`.

Weights are drawn so that the untrained model is *sensitive* to its context
(untied embeddings N(0, 1), tied N(0, 0.05²), projections N(0, 1/fan_in), norms near 1): greedy outputs
change when any K/V page is wrong, which the engine's correctness tests rely on.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS_FILE = "tokenizer_corpus.txt"
"""The tokenizer's training text, package data beside this module (pyproject
``[tool.setuptools.package-data]``): 63 KB of this repository's own README, architecture doc
and two Python modules, copied once (2026-12-04, commit f2aec31) and never changed since, so
later doc edits do not change the tokenizer. Its header (up to the first ``==> PATH <==``
line) is not trained on."""


def corpus() -> list[str]:
    """Training text for the tokenizer: the documents of :data:`CORPUS_FILE` (each starts
    after a ``==> PATH <==`` line; the header before the first is left out), read as UTF-8 with
    CRLF taken as LF, so a checkout that rewrites line ends trains the same tokenizer. Reads
    nothing else: not the repository's docs, not the working directory.

    Raises:
        FileNotFoundError: the file is not installed beside this module (a package built
            without its package data).
        ValueError: the file holds no ``==> PATH <==`` document.
    """
    ref = resources.files(__package__).joinpath(CORPUS_FILE)
    try:
        text = ref.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{CORPUS_FILE} is missing beside {__name__} (package data not installed); "
            "reinstall evolving-infra from a complete sdist or wheel"
        ) from None
    text = text.replace("\r\n", "\n")
    docs: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith("==> ") and line.rstrip("\n").endswith(" <=="):
            docs.append("")
        elif docs:
            docs[-1] += line
    if not docs:
        raise ValueError(f"{CORPUS_FILE}: no '==> PATH <==' document in it")
    return docs


MIN_VOCAB = 300
"""The smallest BPE vocabulary :func:`train_tokenizer` trains: the 256 byte symbols, the special tokens and some merges."""

EXTRA_TOKEN = "<|extra_{}|>"
"""Name of filler token N (``<|extra_0|>`` first), as Qwen's tokenizer names its reserved ids. Filler
tokens are *special* added tokens: every id in ``[0, vocab_size)`` exists in the tokenizer, decoding
skips them (``skip_special_tokens``, vLLM's default for output text; the untrained model may emit them)
or spells them ``<|extra_N|>`` (``skip_special_tokens=False``), and that text encodes back to the id."""


def check_vocab(vocab: int) -> None:
    """Raises ValueError if ``vocab`` < :data:`MIN_VOCAB` (no room for the bytes and merges)."""
    if vocab < MIN_VOCAB:
        raise ValueError(f"--vocab must be >= {MIN_VOCAB} (256 bytes + specials + merges), got {vocab}")


def train_tokenizer(vocab: int, out: Path) -> int:
    """Train a byte-level BPE of ``vocab`` ids on :func:`corpus` and write ``out/tokenizer.json``.
    Returns the tokenizer's vocabulary size, always ``vocab``: the 256 byte symbols and the special
    tokens are always in it, then merges; the fixed corpus allows only 4,496 ids (measured,
    ``tokenizers`` 0.23.3), so a larger ``vocab`` is filled up with special added tokens
    :data:`EXTRA_TOKEN` (ids 4496 .. ``vocab`` - 1), as the model's vocabulary has ``vocab`` ids and
    the router must be able to decode every id the model emits (an id the tokenizer lacks decoded to
    nothing, silently). A ``vocab`` the corpus reaches is written without filler, as before.
    The same ``vocab`` and the same ``tokenizers`` version give the same tokenizer.

    Raises:
        ValueError: if ``vocab`` < 300 (no room for the bytes and merges).
        FileNotFoundError: the corpus is not installed (see :func:`corpus`).
        RuntimeError: the ``tokenizers`` version gave the filler tokens other ids than the next free
            ones (the tokenizer would not match the model's vocabulary; nothing is written).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab(vocab)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    trained = tok.get_vocab_size(with_added_tokens=True)
    if trained < vocab:  # added tokens take the next free ids: trained, trained + 1, ...
        from tokenizers import AddedToken

        tok.add_special_tokens([AddedToken(EXTRA_TOKEN.format(n), special=True, normalized=False)
                                for n in range(vocab - trained)])
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab or (trained < vocab and tok.token_to_id(EXTRA_TOKEN.format(vocab - trained - 1)) != vocab - 1):
        raise RuntimeError(f"tokenizer of {size} ids for --vocab {vocab} ({trained} trained): filler ids misplaced")
    tok.save(str(out / "tokenizer.json"))
    return size


def model_config(
    arch: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, context: int, eos_id: int
) -> dict[str, Any]:
    """``config.json`` content for ``arch`` (``llama`` or ``qwen3``).

    ``llama`` uses Llama 3's ``rope_scaling`` (``rope_type: llama3``, factor 8,
    original context ``context // 4``, so the scaling changes frequencies within the
    context) and untied embeddings; ``qwen3`` ties them and has q/k norms.

    Raises:
        ValueError: unknown arch, a size below 1, ``hidden`` not divisible by ``heads``, or ``heads``
            not divisible by ``kv_heads``.
    """
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"--arch must be llama or qwen3, got {arch!r}")
    for flag, size in (("--layers", layers), ("--hidden", hidden), ("--heads", heads), ("--kv-heads", kv_heads),
                       ("--context", context)):
        if size < 1:  # 0 heads was a ZeroDivisionError, hidden -64 a torch error, layers 0 a model of no layers
            raise ValueError(f"{flag} must be >= 1, got {size}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden {hidden} must divide by heads {heads}, heads by kv_heads {kv_heads}")
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "eos_token_id": eos_id,
        "bos_token_id": None,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "llama":
        common.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            tie_word_embeddings=False,
            mlp_bias=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": max(16, context // 4),
            },
        )
    else:
        common.update(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
            rope_scaling=None,
        )
    return common


WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json")
"""Weight files and shard indexes of a Hugging Face folder. The engine loads *every* ``*.safetensors``
in a folder and ``transformers`` follows an index, so an old shard left beside a new
``model.safetensors`` makes a mixed, broken model: ``init_model(force=True)`` removes these."""


class FolderNotEmptyError(ValueError):
    """``init_model`` was given a folder that already holds files, without ``force``.

    Attributes:
        folder: the folder.
        names: the names in it, sorted.
    """

    def __init__(self, folder: Path, names: list[str]) -> None:
        self.folder = folder
        self.names = names
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} entries)" if len(names) > 4 else "")
        super().__init__(f"{folder}: folder is not empty ({shown})")


def _umask_mode() -> int:
    """The permission bits ``open()`` gives a new file: 0o666 without the process umask (0o644 under
    umask 022). Python < 3.13 can only read the umask by setting it, so it is set and put back at once."""
    mask = os.umask(0o077)
    os.umask(mask)
    return 0o666 & ~mask


def init_model(
    out: str | Path,
    *,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    context: int = 2048,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Write a seeded random checkpoint folder (see module docstring); returns its path.

    Same arguments and seed → the same weights and tokenizer, in any commit and any install
    (the tokenizer is trained on the fixed :data:`CORPUS_FILE`; the weights are drawn from a
    ``torch.Generator`` seeded with ``seed``; both given the same ``tokenizers`` and ``torch``
    versions). config.json's ``vocab_size`` is ``vocab`` and the tokenizer has exactly as many ids
    (filler tokens past what the corpus gives, :func:`train_tokenizer`), so ``up`` accepts the pair and
    every id the model emits decodes. Every file is written with the
    process umask, as ``open()`` would (0o644 under umask 022), so other users, such as a container's
    ``USER ei`` on a read-only mount, can read the folder.

    Args:
        force: write into a folder that already holds files; its weight files and shard indexes
            (:data:`WEIGHT_PATTERNS`) are removed first, so no old shard is loaded with the new
            weights. Without it such a folder is refused before anything is written.

    Raises:
        ValueError: bad sizes (see :func:`model_config`, :func:`train_tokenizer`).
        FolderNotEmptyError: ``out`` holds files and ``force`` is false.
        OSError: the folder cannot be made or written.
    """
    import torch
    from safetensors.torch import save_file

    check_vocab(vocab)  # the size checks, before the folder is made (a refused size left an empty folder)
    model_config(arch, layers, hidden, heads, kv_heads, vocab, context, 0)
    folder = Path(out)
    if folder.is_dir() and (names := sorted(p.name for p in folder.iterdir())):
        if not force:
            raise FolderNotEmptyError(folder, names)
        for pattern in WEIGHT_PATTERNS:
            for old in folder.glob(pattern):
                old.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    n_vocab = train_tokenizer(vocab, folder)  # == vocab (padded): the tokenizer has every id the model has
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|im_end|>")
    if eos is None:  # SPECIAL_TOKENS has it: train_tokenizer wrote some other tokenizer
        raise RuntimeError(f"{folder / 'tokenizer.json'}: no <|im_end|> token (the eos)")
    cfg = model_config(arch, layers, hidden, heads, kv_heads, n_vocab, context, eos)
    g = torch.Generator().manual_seed(seed)
    D = cfg["head_dim"]
    V, H, I = cfg["vocab_size"], hidden, cfg["intermediate_size"]

    def lin(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=g) / i**0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    # tied embeddings (qwen3): small, so the residual stream is not dominated by the
    # input token's own embedding (which would make the untrained model echo its input)
    emb_std = 0.05 if cfg["tie_word_embeddings"] else 1.0
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": emb_std * torch.randn(V, H, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "self_attn.q_proj.weight"] = lin(heads * D, H)
        w[p + "self_attn.k_proj.weight"] = lin(kv_heads * D, H)
        w[p + "self_attn.v_proj.weight"] = lin(kv_heads * D, H)
        w[p + "self_attn.o_proj.weight"] = lin(H, heads * D)
        w[p + "mlp.gate_proj.weight"] = lin(I, H)
        w[p + "mlp.up_proj.weight"] = lin(I, H)
        w[p + "mlp.down_proj.weight"] = lin(H, I)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(D)
            w[p + "self_attn.k_norm.weight"] = norm(D)
    w["model.norm.weight"] = norm(H)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = lin(V, H) * 4.0
    weights = folder / "model.safetensors"
    save_file({k: v.contiguous() for k, v in w.items()}, str(weights), metadata={"format": "pt"})
    # safetensors >= 0.8 writes a tempfile (mode 0600 whatever the umask) and renames it into place
    # (safetensors#782), so the weights alone were unreadable to anyone else: give them the umask's mode
    weights.chmod(_umask_mode())
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}, indent=2) + "\n")
    tok_cfg: dict[str, Any] = {
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": context,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return folder
