"""The paged decoder's logits equal transformers' on each supported architecture and setting.

Tiny random models made by transformers itself (``save_pretrained``: config.json +
model.safetensors) for Mistral, Qwen2 (q/k/v biases), Qwen3, Llama 2 (no RoPE scaling,
untied) and Llama with ``linear`` scaling, attention / MLP biases, other activations, an explicit
``head_dim``, ``rms_norm_eps``, ``rope_theta`` and tied embeddings; a prompt is run in two chunks over
scattered pages, then greedy decoding, token by token, against transformers' greedy tokens and
logprobs. The config keys are read as transformers' config class of each architecture reads them
(defaults included), and the checkpoint's tensors are exactly those transformers' model has: a
tensor the config does not use, a missing one or one of another shape is refused at load, named.
Unsupported settings (sliding window, other RoPE types, other activations) are refused with the
reason. Needs the ``torch`` extra.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from services.worker.engines.torch_engine.config import ACTIVATIONS  # noqa: E402
from services.worker.engines.torch_engine.model import ACT_FNS, ModelConfig, ModelConfigError, PagedDecoder, SeqBatch  # noqa: E402

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


def _greedy(dec: PagedDecoder, prompt: torch.Tensor, n: int) -> tuple[torch.Tensor, list[int], list[float]]:
    """The prompt's logits (two chunks over scattered pages), then ``n`` greedy tokens decoded one per
    forward, with the logprob of each."""
    kc, vc = dec.new_cache(32, 8)
    table = [17, 3, 29, 8, 11, 0, 5, 30]  # scattered pages: 64 positions
    L = prompt.shape[0]
    a = dec(prompt[:21], torch.arange(21), [SeqBatch(0, 21, 0, table, seq=1)], kc, vc, torch.arange(21))
    b = dec(prompt[21:], torch.arange(21, L), [SeqBatch(0, L - 21, 21, table, seq=1)], kc, vc, torch.arange(L - 21))
    logits = torch.cat([a, b])
    last, toks, lps = logits[-1], [], []
    for pos in range(L, L + n):
        t = int(last.argmax())
        toks.append(t)
        lps.append(float(torch.log_softmax(last, -1)[t]))
        last = dec(torch.tensor([t]), torch.tensor([pos]), [SeqBatch(0, 1, pos, table, seq=1)], kc, vc, None)[0]
    return logits, toks, lps


def _hf_greedy(hf, prompt: torch.Tensor, n: int) -> tuple[torch.Tensor, list[int], list[float]]:
    """transformers' prompt logits and greedy tokens (a full forward per token, no cache) with their logprobs."""
    ids, toks, lps = prompt[None], [], []
    with torch.no_grad():
        logits = hf(ids).logits[0]
        last = logits[-1]
        for _ in range(n):
            t = int(last.argmax())
            toks.append(t)
            lps.append(float(torch.log_softmax(last, -1)[t]))
            ids = torch.cat([ids, torch.tensor([[t]])], 1)
            last = hf(ids).logits[0, -1]
    return logits, toks, lps


LLAMA = ("LlamaForCausalLM", "LlamaConfig")


@pytest.mark.parametrize(
    "cls_name,cfg_name,extra",
    [
        ("MistralForCausalLM", "MistralConfig", {"sliding_window": None}),
        ("Qwen2ForCausalLM", "Qwen2Config", {"use_sliding_window": False}),
        ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 16}),
        ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 16, "attention_bias": True}),  # q/k/v and o_proj biases
        (*LLAMA, {}),
        (*LLAMA, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
        (*LLAMA, {"attention_bias": True}),  # q/k/v and o_proj biases: o_proj's was dropped (walk: 5/5 mismatch)
        (*LLAMA, {"mlp_bias": True}),  # gate/up/down biases: all dropped before
        (*LLAMA, {"hidden_act": "gelu"}),  # computed as SiLU before
        (*LLAMA, {"hidden_act": "gelu_pytorch_tanh"}),
        (*LLAMA, {"hidden_act": "gelu_new"}),
        (*LLAMA, {"hidden_act": "relu"}),
        (*LLAMA, {"head_dim": 32, "rms_norm_eps": 1e-2, "rope_theta": 500000.0, "tie_word_embeddings": True}),
        ("MistralForCausalLM", "MistralConfig", {"sliding_window": None, "hidden_act": "gelu", "head_dim": 8}),
    ],
)
def test_logits_and_greedy_decode_match_transformers(tmp_path, cls_name, cfg_name, extra):
    hf = _make(tmp_path, cls_name, cfg_name, **extra)
    dec = PagedDecoder.from_folder(tmp_path, torch.float32, torch.device("cpu"))
    if cls_name == "Qwen2ForCausalLM":
        assert dec.cfg.qkv_bias and not dec.cfg.o_bias
    if extra.get("attention_bias"):
        assert dec.cfg.qkv_bias and dec.cfg.o_bias
    assert dec.cfg.hidden_act == extra.get("hidden_act", "silu") and dec.cfg.mlp_bias == extra.get("mlp_bias", False)
    prompt = torch.randint(0, 300, (45,), generator=torch.Generator().manual_seed(1))
    ref, ref_toks, ref_lps = _hf_greedy(hf, prompt, 8)
    got, toks, lps = _greedy(dec, prompt, 8)
    assert torch.allclose(got, ref, atol=2e-4, rtol=1e-4), (got - ref).abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert toks == ref_toks
    assert max(abs(x - y) for x, y in zip(lps, ref_lps)) < 1e-4, (lps, ref_lps)


def test_every_activation_is_transformers_own(tmp_path):
    """Each ``hidden_act`` the config takes is computed as transformers' ``ACT2FN`` computes it, bit for bit
    (float32), and a value outside them is refused naming it."""
    from transformers.activations import ACT2FN

    assert set(ACT_FNS) == set(ACTIVATIONS)
    x = torch.linspace(-8, 8, 4001)
    for name, fn in ACT_FNS.items():
        assert torch.equal(fn(x), ACT2FN[name](x)), name
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
            "intermediate_size": 8, "num_hidden_layers": 1}  # fmt: skip
    for bad in ("quick_gelu", "gelu_fast", "prelu", "xielu", "nonsense"):
        with pytest.raises(ModelConfigError, match=f"hidden_act '{bad}' not supported"):
            ModelConfig.from_dict({**base, "hidden_act": bad})


ARCH_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("arch", sorted(ARCH_CLASSES))
@pytest.mark.parametrize(
    "keys",
    [
        {},  # every optional key left out: the config class's defaults
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
        {"head_dim": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "hidden_act": "gelu",
         "max_position_embeddings": 1000},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}, "rope_theta": 7.0},
        {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 3e4},
    ],
)
def test_config_keys_and_tensors_as_transformers_reads_them(arch, keys):
    """The fields the decoder reads are those transformers' config class of the architecture gives
    (its defaults for absent keys; a key its model ignores, such as a Mistral's attention_bias, ignored),
    and the tensors it expects are exactly the model's (``state_dict``, names and shapes)."""
    raw = {"architectures": [ARCH_CLASSES[arch]], "model_type": arch, "vocab_size": 300, "hidden_size": 64,
           "num_attention_heads": 4, "intermediate_size": 96, "num_hidden_layers": 2, **keys}  # fmt: skip
    if arch == "mistral":
        raw.setdefault("sliding_window", None)
    hf_cfg = transformers.AutoConfig.for_model(**raw)
    ours = ModelConfig.from_dict(raw)
    head_dim = getattr(hf_cfg, "head_dim", 64 // 4)  # as the attention classes read it (Qwen2Config has none)
    assert (ours.num_kv_heads, ours.head_dim, ours.max_position_embeddings, ours.rms_norm_eps, ours.hidden_act,
            ours.tie_word_embeddings) == (hf_cfg.num_key_value_heads, head_dim, hf_cfg.max_position_embeddings,
                                          hf_cfg.rms_norm_eps, hf_cfg.hidden_act, hf_cfg.tie_word_embeddings)  # fmt: skip
    assert ours.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    kind = hf_cfg.rope_parameters["rope_type"]
    assert (ours.rope_scaling or {"rope_type": "default"})["rope_type"] == kind
    if kind != "default":
        assert ours.rope_scaling["factor"] == hf_cfg.rope_parameters["factor"]
    if ours.num_kv_heads * ours.head_dim > 4096:  # Qwen's default 32 KV heads x 128: too big to build here
        return
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if hf_cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    assert ours.tensor_shapes() == shapes
    ours.check_tensors(shapes)


def _save(folder, cfg_edit=None, drop=(), add=None):
    """Rewrite a saved model folder: config.json keys set (``cfg_edit``), tensors dropped or added."""
    if cfg_edit:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **cfg_edit}))
    w = load_file(str(folder / "model.safetensors"))
    for n in drop:
        del w[n]
    w.update(add or {})
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _load(folder):
    return PagedDecoder.from_folder(folder, torch.float32, torch.device("cpu"))


def test_strict_load_refuses_unused_missing_and_misshaped_tensors(tmp_path):
    """A checkpoint tensor the config does not use is an error naming it and the key that would use it
    (before, a Llama's o_proj biases, MLP biases and a deeper checkpoint's extra layers were dropped
    without a word and the model computed something else); a missing or mis-shaped one is named too;
    RoPE tables of old checkpoints (``rotary_emb.inv_freq``) are the known unused ones and pass."""
    _make(tmp_path / "bias", *LLAMA, attention_bias=True, mlp_bias=True)
    _save(tmp_path / "bias", {"attention_bias": False, "mlp_bias": False})
    with pytest.raises(ModelConfigError) as e:
        _load(tmp_path / "bias")
    msg = str(e.value)
    assert "tensors do not match config.json; not used by this config (llama; attention biases need attention_bias: true; " \
           "MLP biases need mlp_bias: true)" in msg and str(tmp_path / "bias") in msg, msg
    for n in ("self_attn.q_proj.bias", "self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.down_proj.bias"):
        assert f"model.layers.0.{n}" in msg, (n, msg)
    assert "(14 in all)" in msg, msg  # 2 layers x 7 biases: 8 names shown, and the count of all

    _make(tmp_path / "mistral", "MistralForCausalLM", "MistralConfig", sliding_window=None)
    _save(tmp_path / "mistral", {"attention_bias": True}, add={"model.layers.1.self_attn.o_proj.bias": torch.zeros(64)})
    with pytest.raises(ModelConfigError, match=r"not used by this config \(mistral; mistral has no attention biases\): "
                                               r"model.layers.1.self_attn.o_proj.bias$"):
        _load(tmp_path / "mistral")

    _make(tmp_path / "deep", *LLAMA)
    _save(tmp_path / "deep", {"num_hidden_layers": 1})
    with pytest.raises(ModelConfigError, match=r"num_hidden_layers is 1\): model.layers.1.input_layernorm.weight"):
        _load(tmp_path / "deep")

    _make(tmp_path / "miss", *LLAMA)
    _save(tmp_path / "miss", drop=["model.layers.1.mlp.up_proj.weight"],
          add={"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 95)})
    with pytest.raises(ModelConfigError) as e:
        _load(tmp_path / "miss")
    assert str(e.value).endswith("tensors do not match config.json; missing: model.layers.1.mlp.up_proj.weight; wrong shape: "
                                 "model.layers.0.mlp.down_proj.weight (64, 95) (config implies (64, 96))"), e.value

    _make(tmp_path / "rot", *LLAMA)  # the known unused: RoPE tables
    _save(tmp_path / "rot", add={f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)})
    assert _load(tmp_path / "rot").cfg.num_layers == 2


def test_unsupported_settings_refused(tmp_path):
    base = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
            "intermediate_size": 8, "num_hidden_layers": 1, "max_position_embeddings": 32768}  # fmt: skip
    with pytest.raises(ModelConfigError, match="sliding-window"):
        ModelConfig.from_dict({**base, "sliding_window": 4096})
    with pytest.raises(ModelConfigError, match="rope_scaling type 'yarn'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ModelConfigError, match="missing or malformed"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"]})
    # a Mistral config without the key slides at MistralConfig's 4096; one with a window as long as the context does not
    with pytest.raises(ModelConfigError, match="sliding_window 4096 < max_position_embeddings 32768"):
        ModelConfig.from_dict(base)
    assert ModelConfig.from_dict({**base, "sliding_window": 32768}).arch == "mistral"
    # a Qwen's window applies with use_sliding_window, on layers from max_window_layers on (or as layer_types says)
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "sliding_window": 4096}
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False, "max_window_layers": 0}).arch == "qwen2"
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 4}).arch == "qwen2"
    with pytest.raises(ModelConfigError, match="sliding-window"):
        ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 3})
    with pytest.raises(ModelConfigError, match="sliding-window"):
        ModelConfig.from_dict({**qwen, "use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"] * 2})
    llama = {**base, "architectures": ["LlamaForCausalLM"]}
    assert ModelConfig.from_dict({**llama, "sliding_window": 16}).arch == "llama"  # LlamaAttention has none
    with pytest.raises(ModelConfigError, match=r"RoPE parameters per layer type \(full_attention\) not supported"):
        ModelConfig.from_dict({**llama, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}})
    with pytest.raises(ModelConfigError, match="partial_rotary_factor 0.5 not supported"):
        ModelConfig.from_dict({**llama, "partial_rotary_factor": 0.5})
    with pytest.raises(ModelConfigError, match="rope_scaling type 'llama3' needs low_freq_factor, high_freq_factor"):
        ModelConfig.from_dict({**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    l3 = ModelConfig.from_dict({**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1,
                                                          "high_freq_factor": 4}})  # fmt: skip
    assert l3.rope_scaling is not None and l3.rope_scaling["original_max_position_embeddings"] == 32768  # the context
    (tmp_path / "config.json").write_text(json.dumps({**base, "sliding_window": None}))
    with pytest.raises(ModelConfigError, match="no \\*.safetensors"):
        PagedDecoder.from_folder(tmp_path, torch.float32, torch.device("cpu"))
