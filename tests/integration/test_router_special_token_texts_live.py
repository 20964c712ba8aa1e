"""Special tokens' texts where vLLM shows them: a logprob entry's ``token`` (chat ``logprobs.content[i].token`` and
``top_logprobs``, completions ``tokens`` / ``top_logprobs`` keys) is the id decoded alone with special tokens shown
(vLLM's ``convert_ids_list_to_tokens``: ``decode([id])`` at the tokenizer's default), and ``/tokenize``'s
``token_strs`` are the vocabulary's pieces (vLLM's ``convert_ids_to_tokens``). Before, every id was decoded as output
text, special tokens skipped: an ``<|im_end|>`` the model chose was listed as ``""``. The output text still skips them.

Real router over a real nats-server with a byte-level BPE tokenizer (``hf:``); the node (``FakeCluster`` of
``test_router_live``, a torch engine so that logprobs are served) is played by handing chunks to the router."""

from __future__ import annotations

import asyncio

import pytest

from shared import messages as m
from shared.tokenizer import load_tokenizer
from tests.integration.test_router_chunk_logprobs_live import _torch
from tests.integration.test_router_live import _wait_for, router_env, sse_events

pytestmark = pytest.mark.timeout(60)

USER = [{"role": "user", "content": "hello there"}]


def _folder(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tests.unit.router.helpers import write_bpe_tokenizer

    return write_bpe_tokenizer(tmp_path / "tok")


async def _sent(env, path: str, body: dict) -> tuple[asyncio.Task, m.PrefillWork]:
    """``body`` posted to ``path`` (the fake cluster answers nothing); the response task and its work."""
    env.cluster.answering.clear()
    n = len(env.cluster.works)
    req = asyncio.create_task(env.http.post(path, json=body))
    await _wait_for(lambda: len(env.cluster.works) == n + 1, what="work dispatched")
    return req, env.cluster.works[-1]


def _chunk(w: m.PrefillWork, i: int, token: int, top: list[int], *, last: bool) -> m.TokenChunk:
    return m.TokenChunk(rid=w.rid, node="c0", index=i, token_ids=[token], prompt_tokens=3 if i == 0 else 0, finished=last,
                        finish_reason="length" if last else None, attempt=w.attempt, logprobs=[-0.25],
                        top_ids=[top], top_logprobs=[[-0.25 - j for j in range(len(top))]])  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_logprob_entries_show_special_tokens_as_vllm(nats_url, tmp_path, stream):
    folder = _folder(tmp_path)
    tok = load_tokenizer(f"hf:{folder}")
    vocab = tok._tok.get_vocab()  # type: ignore[attr-defined]
    start, end, word = vocab["<|im_start|>"], vocab["<|im_end|>"], tok.encode(" the", add_special_tokens=False)[0]
    assert tok.decode([end]) == "" and tok.decode([end], skip_special_tokens=False) == "<|im_end|>"
    async with router_env(nats_url, tmp_path, {"c0": "both"}, tokenizer=f"hf:{folder}") as env:
        await _torch(env)
        svc = env.service
        for path, body in (
            ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 2, "stream": stream}),
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 2, "stream": stream}),
        ):
            req, w = await _sent(env, path, body)
            await svc._on_chunk(_chunk(w, 0, word, [word, end], last=False), "")
            await svc._on_chunk(_chunk(w, 1, end, [end, start], last=True), "")
            r = await asyncio.wait_for(req, 10)
            assert r.status_code == 200, r.text
            if stream:
                choices = [e["choices"][0] for e in sse_events(r.text) if isinstance(e, dict) and e.get("choices")]
            else:
                choices = [r.json()["choices"][0]]
            lps = [c["logprobs"] for c in choices if c.get("logprobs")]
            if path == "/v1/completions":
                text = "".join(c["text"] for c in choices)
                tokens = [t for lp in lps for t in lp["tokens"]]
                tops = [t for lp in lps for t in lp["top_logprobs"]]
                offsets = [o for lp in lps for o in lp["text_offset"]]
                assert tokens == [" the", "<|im_end|>"], lps
                assert [sorted(t) for t in tops] == [sorted([" the", "<|im_end|>"]), sorted(["<|im_end|>", "<|im_start|>"])], tops
                assert offsets == [0, 4], offsets  # the tokens' texts, the special one's included (vLLM's)
            else:
                text = "".join(c.get("delta", c.get("message", {})).get("content") or "" for c in choices)
                content = [e for lp in lps for e in lp["content"]]
                assert [e["token"] for e in content] == [" the", "<|im_end|>"], content
                assert content[1]["bytes"] == list(b"<|im_end|>")
                assert [[t["token"] for t in e["top_logprobs"]] for e in content] == [[" the", "<|im_end|>"], ["<|im_end|>", "<|im_start|>"]]
            assert text == " the", (path, text)  # the output text skips it, as before (skip_special_tokens)


async def test_tokenize_token_strs_are_the_vocabulary_pieces_as_vllm(nats_url, tmp_path):
    folder = _folder(tmp_path)
    tok = load_tokenizer(f"hf:{folder}")
    prompt = "<|im_start|>user hello there<|im_end|>"
    async with router_env(nats_url, tmp_path, {"c0": "both"}, tokenizer=f"hf:{folder}") as env:
        r = await env.http.post("/tokenize", json={"prompt": prompt, "return_token_strs": True, "add_special_tokens": False})
        assert r.status_code == 200, r.text
        body = r.json()
        ids = tok.encode(prompt, add_special_tokens=False)
        assert body["tokens"] == ids
        strs = body["token_strs"]
        assert strs[0] == "<|im_start|>" and strs[-1] == "<|im_end|>", strs  # were ""
        assert any(s.startswith("Ġ") for s in strs), strs  # byte-level pieces (a space is Ġ), as vLLM's
        assert strs == [tok._tok.id_to_token(i) for i in ids]  # type: ignore[attr-defined]
        r = await env.http.post("/tokenize", json={"messages": USER, "return_token_strs": True})
        chat = r.json()
        assert chat["token_strs"][0] == "<|im_start|>" and "<|im_end|>" in chat["token_strs"], chat["token_strs"]
