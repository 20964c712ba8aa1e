"""The live replayer's request body: the prompt's JSON text made from per-block text kept across requests
(``PromptJson``) is the same bytes as msgspec's encoding of the whole id list, as it was built before."""

from __future__ import annotations

import random

import msgspec
import pytest

from evolving_infra.replay.live import LiveReplayer, PromptJson
from evolving_infra.traces.schema import TraceRequest
from evolving_infra.traces.tokens import prompt_token_ids
from shared.clock import SimClock


def _old_body(req: TraceRequest, block_size: int, vocab_size: int | None, model: str) -> bytes:
    """The body as the replayer built it before PromptJson: the ids as a list, the whole object encoded at once."""
    tokens = prompt_token_ids(req, block_size)
    if vocab_size is not None:
        tokens = tokens % vocab_size
    body = {"model": model, "prompt": tokens.tolist(), "max_tokens": max(1, req.output_tokens), "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    return msgspec.json.encode(body)


def _requests(block_size: int, n: int, seed: int) -> list[TraceRequest]:
    """Agents' prompts growing by a few blocks a request (shared prefixes), with repeats, tails and none."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    blocks: list[int] = []
    for i in range(n):
        if rng.random() < 0.2:
            blocks = []  # a new agent
        blocks = blocks + [rng.randrange(1 << 40) for _ in range(rng.randrange(0, 4))]
        if blocks and rng.random() < 0.2:
            blocks.append(blocks[0])  # the same block id twice in one prompt
        tail = rng.randrange(block_size)
        if not blocks and not tail:
            tail = 1
        out.append(TraceRequest(id=f"r{i}", agent="a", branch="a:main", input_tokens=len(blocks) * block_size + tail,
                                output_tokens=rng.randrange(0, 5), blocks=list(blocks)))  # fmt: skip
    return out


@pytest.mark.parametrize("vocab_size", [None, 1000])
@pytest.mark.parametrize("max_bytes", [64 << 20, 2_000, 0])
def test_body_bytes_same_as_whole_list_encoding(vocab_size: int | None, max_bytes: int) -> None:
    bs = 16
    rep = LiveReplayer("http://127.0.0.1:1", SimClock(speedup=1.0), block_size=bs, model='m "x"', vocab_size=vocab_size, progress=False)
    rep._prompts = PromptJson(bs, vocab_size, max_bytes=max_bytes)
    reqs = _requests(bs, 200, seed=7)
    for req in reqs + reqs[:50]:
        assert rep.request_body(req) == _old_body(req, bs, vocab_size, 'm "x"'), req.id
    assert rep._prompts._bytes <= max_bytes
    if max_bytes > 10_000:
        assert rep._prompts.hits > rep._prompts.misses  # prefixes are shared: most blocks' text is kept


def test_mismatched_blocks_raise_as_prompt_token_ids() -> None:
    req = TraceRequest(id="bad", agent="a", branch="a:main", input_tokens=40, output_tokens=1, blocks=[1])
    with pytest.raises(ValueError, match="1 blocks but input_tokens // block_size = 2"):
        PromptJson(16).encode(req)
