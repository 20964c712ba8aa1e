"""`replay` against a small real model: it says up front how many requests exceed the router's max_model_len and
scales the trace as `demo --engine torch` does with --scale-to-model. `replay claude-code-sample.jsonl.gz --sessions 1`
against `up --engine torch` failed every request (400 maximum context length)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from evolving_infra.cli import UsageError, build_parser
from evolving_infra.replay.cli import fit_to_router, router_answers, router_max_model_len
from evolving_infra.traces.sample import scale_trace_for_model
from evolving_infra.traces.schema import TraceRequest


def _req(i: int, blocks: int, out: int = 100) -> TraceRequest:
    return TraceRequest(id=f"r{i}", agent="a", branch="b", input_tokens=64 * blocks, output_tokens=out,
                        blocks=list(range(10, 10 + blocks)))


def test_the_router_says_its_max_model_len():
    def answer(body, status=200):
        transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body))
        return asyncio.run(router_answers("http://r", None, transport=transport))

    ok = {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 1024}]}
    assert router_max_model_len(answer(ok)) == 1024
    assert router_max_model_len(answer({"data": [{"id": "sim"}]})) is None
    assert router_max_model_len(answer({"error": "no"}, 401)) is None


def test_requests_over_the_context_are_counted_up_front_with_the_flag_that_fixes_them():
    reqs = [_req(0, 4), _req(1, 40), _req(2, 300)]  # 356, 2660, 19300 tokens with their outputs
    same, block, note = fit_to_router(reqs, 64, 1024, scale=False, max_output=None)
    assert same is reqs and block == 64
    assert note is not None and "2 of the 3 requests" in note and "max_model_len 1024" in note and "up to 19300" in note
    assert "--scale-to-model" in note
    assert fit_to_router(reqs, 64, 100_000, scale=False, max_output=None) == (reqs, 64, None)
    assert fit_to_router(reqs, 64, None, scale=False, max_output=None) == (reqs, 64, None)  # the router did not say
    with pytest.raises(UsageError, match="3 of the 3 requests .*--scale-to-model"):
        fit_to_router(reqs[1:] + [_req(3, 20)], 64, 1024, scale=False, max_output=None)
    with pytest.raises(UsageError, match="--max-output applies with --scale-to-model"):
        fit_to_router(reqs, 64, 1024, scale=False, max_output=4)


def test_scale_to_model_is_the_demos_scaling_at_half_the_routers_context():
    reqs = [_req(0, 4), _req(1, 40), _req(2, 900)]
    scaled, block, note = fit_to_router(reqs, 64, 1024, scale=True, max_output=None)
    assert block == 1 and scaled == scale_trace_for_model(reqs, 512, 8)  # demo --engine torch's code and limit
    assert all(r.input_tokens + r.output_tokens <= 512 for r in scaled)
    assert note is not None and "prompts cut to 503 tokens, at most 8 output tokens" in note
    assert fit_to_router(reqs, 64, 1024, scale=True, max_output=3)[0][0].output_tokens == 3
    with pytest.raises(UsageError, match="did not report its max_model_len"):
        fit_to_router(reqs, 64, None, scale=True, max_output=None)
    with pytest.raises(UsageError, match="--max-output 600"):
        fit_to_router(reqs, 64, 1024, scale=True, max_output=600)


def test_replay_takes_the_flags():
    args = build_parser("replay").parse_args(["replay", "t.jsonl", "--scale-to-model", "--max-output", "4"])
    assert (args.scale_to_model, args.max_output) == (True, 4)
