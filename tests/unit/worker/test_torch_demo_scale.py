"""``demo --engine torch`` (and ``replay --scale-to-model``) scales the Claude Code trace to a small model: one token per block,
prompts cut to a prefix, outputs capped; shared prefixes stay shared."""

from __future__ import annotations

import pytest

from evolving_infra.traces.sample import scale_trace_for_model
from evolving_infra.traces.schema import TraceRequest
from evolving_infra.traces.tokens import prompt_token_ids


def _req(i: int, blocks: list[int], out: int) -> TraceRequest:
    return TraceRequest(id=f"r{i}", agent="a", branch="b", input_tokens=64 * len(blocks) + 5, output_tokens=out, blocks=blocks)


def test_scale_keeps_prefixes_and_fits():
    reqs = [_req(0, list(range(10, 40)), 500), _req(1, list(range(10, 50)), 3), _req(2, [], 9)]
    out = scale_trace_for_model(reqs, context=24, max_output=8)
    assert [r.input_tokens for r in out] == [15, 15, 1]
    assert [r.output_tokens for r in out] == [8, 3, 8]
    a, b, c = (prompt_token_ids(r, 1) for r in out)
    assert len(a) == 15 and (a == b).all()  # equal block prefixes → equal token prefixes
    assert len(c) == 1 and all(r.input_tokens + r.output_tokens < 24 for r in out)
    with pytest.raises(ValueError):
        scale_trace_for_model(reqs, context=8, max_output=8)
