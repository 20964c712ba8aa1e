"""``model init --vocab N`` past what the fixed corpus trains (4,496 ids): the tokenizer is padded to N.

config.json said ``vocab_size`` N while tokenizer.json had 4,496 ids, so the model could emit ids the
router's tokenizer lacked: measured before the fix (``init_model(vocab=6000)``), ``HFTokenizer.decode([5999])``
was ``''`` with or without ``skip_special_tokens`` (the id silently dropped from the text, still counted in
usage), and the router refused such ids in prompts (its vocabulary was min(4496, 6000)).

Needs the ``torch`` extra; skipped without it.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from services.worker.engines.torch_engine import checkpoint  # noqa: E402
from shared.tokenizer import HFTokenizer  # noqa: E402

TRAINED = 4496
"""Ids the fixed corpus gives (tokenizers 0.23.3): ``train_tokenizer(32000)`` trained this many before padding."""


def test_a_vocab_past_the_corpus_is_padded_with_special_filler_tokens(tmp_path):
    folder = checkpoint.init_model(tmp_path / "m", vocab=6000, layers=1, hidden=16, heads=2, kv_heads=1)
    cfg = json.loads((folder / "config.json").read_text())
    tok = HFTokenizer(folder)
    assert cfg["vocab_size"] == tok.vocab_size == 6000  # `up` refuses only a tokenizer larger than the model
    raw = tok._tok
    assert all(raw.id_to_token(i) is not None for i in range(6000))  # every id the model can emit exists
    assert raw.id_to_token(6000) is None
    assert raw.id_to_token(TRAINED - 1) != "<|extra_0|>" and raw.token_to_id("<|extra_0|>") == TRAINED
    # the top id: skipped in output text (a special token, vLLM's default), spelled out when kept, and re-encodes
    assert tok.decode([5999], skip_special_tokens=False) == "<|extra_1503|>"
    text = tok.encode("hello world", add_special_tokens=False)
    assert tok.decode([*text[:1], 5999, *text[1:]]) == tok.decode(text) == "hello world"
    assert tok.encode("<|extra_1503|>", add_special_tokens=False) == [5999]
    added = {t["id"]: t for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    assert all(added[i]["special"] for i in range(TRAINED, 6000))
    # the model's rows match: embedding and LM head have 6000 ids
    from safetensors.torch import load_file

    w = load_file(str(folder / "model.safetensors"))
    assert w["model.embed_tokens.weight"].shape[0] == w["lm_head.weight"].shape[0] == 6000


def test_a_vocab_the_corpus_reaches_has_no_filler(tmp_path):
    assert checkpoint.train_tokenizer(TRAINED, tmp_path) == TRAINED
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    assert [t["content"] for t in data["added_tokens"]] == checkpoint.SPECIAL_TOKENS
    assert len(data["model"]["vocab"]) == TRAINED
