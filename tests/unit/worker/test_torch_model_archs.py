"""The paged decoder's logits equal transformers' on each supported architecture.

Tiny random models made by transformers itself (``save_pretrained``: config.json +
model.safetensors) for Mistral, Qwen2 (q/k/v biases) and Llama 2 (no RoPE scaling,
untied) and Llama with ``linear`` scaling; a prompt is run in two chunks over
scattered pages. Unsupported settings (sliding window, other RoPE types) are
refused with the reason. Needs the ``torch`` extra.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from services.worker.engines.torch_engine.model import ModelConfig, ModelConfigError, PagedDecoder, SeqBatch  # noqa: E402

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip


def _make(tmp_path, cls_name: str, cfg_name: str, **extra):
    cfg = getattr(transformers, cfg_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so attention matters
        for p in model.parameters():
            p.mul_(10.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    return model


@pytest.mark.parametrize(
    "cls_name,cfg_name,extra",
    [
        ("MistralForCausalLM", "MistralConfig", {"sliding_window": None}),
        ("Qwen2ForCausalLM", "Qwen2Config", {"use_sliding_window": False}),
        ("LlamaForCausalLM", "LlamaConfig", {}),
        ("LlamaForCausalLM", "LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ],
)
def test_logits_match_transformers(tmp_path, cls_name, cfg_name, extra):
    hf = _make(tmp_path, cls_name, cfg_name, **extra)
    dec = PagedDecoder.from_folder(tmp_path, torch.float32, torch.device("cpu"))
    if cls_name == "Qwen2ForCausalLM":
        assert dec.cfg.attention_bias
    ids = torch.randint(0, 300, (1, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    kc, vc = dec.new_cache(32, 8)
    table = [17, 3, 29, 8, 11, 0]  # scattered pages
    a = dec(ids[0, :21], torch.arange(21), [SeqBatch(0, 21, 0, table)], kc, vc, torch.arange(21))
    b = dec(ids[0, 21:], torch.arange(21, 45), [SeqBatch(0, 24, 21, table)], kc, vc, torch.arange(24))
    got = torch.cat([a, b])
    assert torch.allclose(got, ref, atol=2e-4, rtol=1e-4), (got - ref).abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_unsupported_settings_refused(tmp_path):
    base = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
            "intermediate_size": 8, "num_hidden_layers": 1, "max_position_embeddings": 32768}  # fmt: skip
    with pytest.raises(ModelConfigError, match="sliding-window"):
        ModelConfig.from_dict({**base, "sliding_window": 4096})
    with pytest.raises(ModelConfigError, match="rope_scaling type 'yarn'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ModelConfigError, match="missing or malformed"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"]})
    (tmp_path / "config.json").write_text(json.dumps({**base, "sliding_window": None}))
    with pytest.raises(ModelConfigError, match="no \\*.safetensors"):
        PagedDecoder.from_folder(tmp_path, torch.float32, torch.device("cpu"))
