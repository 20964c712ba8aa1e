"""`evolving-infra up --tokenizer hf:<folder>` with a real (byte-level BPE) tokenizer, as a
benchmark client sees it: every streamed token is one SSE chunk, and the client's own count
of the streamed text (tokenizing it, as AIPerf and guidellm do) equals ``usage``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from shared.tokenizer import load_tokenizer  # noqa: E402
from tests.e2e._up import read_ready  # noqa: E402
from tests.unit.router.helpers import write_bpe_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _up(tmp_path, *extra: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "evolving_infra.cli", "up",
        "--nodes", "2", "--split", "1P1D", "--profile", "tiny", "--block-size", "4", "--speedup", "20",
        "--port", "0", "--log-dir", str(tmp_path / "logs"), *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_real_tokenizer_counts_match_usage_and_one_token_per_chunk(tmp_path):
    folder = write_bpe_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(f"hf:{folder}")
    proc = _up(tmp_path, "--tokenizer", f"hf:{folder}")
    try:
        url = read_ready(proc)["router_url"]
        for i in range(3):
            body = {
                "messages": [{"role": "user", "content": f"tell me about the router and the planner, take {i}"}],
                "max_tokens": 64,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            pieces = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
            pieces = [p for p in pieces if p]
            usage = events[-1]["usage"]
            assert usage["completion_tokens"] == 64
            text = "".join(pieces)
            assert len(tok._tok.encode(text, add_special_tokens=False).ids) == 64, text  # the client's count
            assert len(pieces) == 64  # --stream-interval 1 (the default): one token per chunk
            assert usage["prompt_tokens"] == len(tok.apply_chat_template(body["messages"]))
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_unusable_tokenizer_is_a_clear_error_before_anything_starts(tmp_path):
    t0 = time.monotonic()
    proc = _up(tmp_path, "--tokenizer", f"hf:{tmp_path / 'missing'}")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "no tokenizer.json" in out and "--tokenizer" in out, out
    assert time.monotonic() - t0 < 30


def test_demo_with_a_real_tokenizer_completes_every_request(tmp_path):
    """The replayed trace's token ids (up to 100K) are taken modulo the router's smaller vocabulary."""
    folder = write_bpe_tokenizer(tmp_path / "tok")
    cmd = [
        sys.executable, "-m", "evolving_infra.cli", "demo", "--sessions", "2", "--concurrency", "2", "--speedup", "100",
        "--tokenizer", f"hf:{folder}", "--out", str(tmp_path / "demo"),
    ]  # fmt: skip
    state = tmp_path / "state"  # the demo's state file lets `tap` / `split get` find it while it replays
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "EI_STATE_DIR": str(state)})
    seen: list[dict] = []
    deadline = time.monotonic() + 170
    while p.poll() is None and time.monotonic() < deadline:
        seen += [json.loads(f.read_text()) for f in state.glob("up-*.json")] if not seen else []
        time.sleep(0.2)
    out = p.communicate(timeout=10)[0]
    assert p.returncode == 0, out[-3000:]
    assert seen and seen[0]["pid"] == p.pid and seen[0]["router_url"].startswith("http://")
    assert not list(state.glob("up-*.json"))  # removed when the demo ends
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report["requests_failed"] == 0 and report["requests_completed"] == report["requests_sent"] > 0
