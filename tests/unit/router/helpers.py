"""Small builders for router core tests (only the knobs under test)."""

from __future__ import annotations

from pathlib import Path

from shared.messages import KvLookupReply, NodePrefix, NodeState

from services.router.nodes import NodeLoad


def load(node: str, inflight: int = 0, phase: str = "prefill", running: int = 0, waiting: int = 0) -> NodeLoad:
    return NodeLoad(node=node, phase=phase, inflight=inflight, running=running, waiting=waiting)  # type: ignore[arg-type]


def state(node: str, phase: str = "prefill", **kw: object) -> NodeState:
    return NodeState(node=node, phase=phase, **kw)  # type: ignore[arg-type]


def lookup(block_size: int = 64, **local_blocks: int) -> KvLookupReply:
    nodes = [NodePrefix(node=n, local_blocks=b, gpu_blocks=b) for n, b in local_blocks.items()]
    return KvLookupReply(block_size=block_size, nodes=nodes, longest_any=max(local_blocks.values(), default=0))


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_bpe_tokenizer(folder: Path, vocab_size: int = 2000) -> Path:
    """A real byte-level BPE tokenizer (GPT-2 / Qwen style), trained on this repository's
    README and architecture doc: ``tokenizer.json`` + ``tokenizer_config.json`` (ChatML
    template, ``PreTrainedTokenizerFast``) in ``folder``, loadable by ``hf:<folder>``, by
    ``transformers.AutoTokenizer`` and so by AIPerf. Deterministic; ~0.1 s. Needs ``tokenizers``.

    Returns:
        ``folder``.
    """
    import json


    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    repo = Path(__file__).resolve().parents[3]
    texts = [(repo / p).read_text() for p in ("README.md", "docs/architecture.md")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 1_000_000,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder
