"""`replay --router-url` with no `up` state file for it (compose, Slurm, or two local clusters) sent the sim's model
name and the trace's token ids as they are: against `up --engine torch --model tiny` every request was a 404 ('model
'evolving-infra-sim' not found; this router serves 'tiny''), 12 of 12 over 98 s. It now takes the router's model
(GET /v1/models) and vocabulary (GET /v1/cluster vocab_size), as it takes its speedup."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

import evolving_infra.replay.cli as replay_cli
import evolving_infra.replay.live as live
from evolving_infra.cli import main as top_main
from evolving_infra.replay.cli import RouterAnswers, router_answers, router_model, router_vocab_size

SAMPLE = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"


def _answer(body: object, status: int = 200) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(status, json=body))


def _answers(body: object, status: int = 200) -> RouterAnswers:
    """The router's answers when both GET /v1/models and GET /v1/cluster answer ``status`` with ``body``."""
    return asyncio.run(router_answers("http://r", None, transport=_answer(body, status)))


def test_the_router_says_its_model_and_vocabulary():
    models = {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 1024}]}
    assert router_model(_answers(models)) == "tiny"
    assert router_model(_answers({"data": []})) is None
    assert router_model(_answers({"error": "no"}, 401)) is None
    assert router_vocab_size(_answers({"speedup": 1.0, "vocab_size": 512})) == 512
    assert router_vocab_size(_answers({"speedup": 1.0})) is None  # an older router
    assert router_vocab_size(_answers({"vocab_size": 512}, 401)) is None


class _Sent(Exception):
    pass


def _run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str]) -> dict:
    seen: dict = {}

    async def nothing(*a: object, **k: object) -> None:
        return None

    async def answers(*a: object, **k: object) -> RouterAnswers:  # a router that says its model and vocabulary
        return RouterAnswers(200, {"data": [{"id": "tiny"}]}, 200, {"vocab_size": 512})

    def replayer(*a: object, **k: object) -> None:
        seen.update(k)
        raise _Sent

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(replay_cli, "router_unreachable", nothing)
    monkeypatch.setattr(replay_cli, "router_answers", answers)
    monkeypatch.setattr(live, "LiveReplayer", replayer)
    with pytest.raises(_Sent):
        top_main(["replay", str(SAMPLE), "--sessions", "1", "--router-url", "http://127.0.0.1:9", "--out", "r", *argv])
    return seen


def test_replay_without_a_state_file_sends_the_routers_model_and_vocabulary(monkeypatch, tmp_path, capsys):
    seen = _run(monkeypatch, tmp_path, [])
    assert seen["model"] == "tiny" and seen["vocab_size"] == 512
    assert "replay: --model tiny, the router's (GET /v1/models)" in capsys.readouterr().err


def test_a_given_model_wins(monkeypatch, tmp_path):
    assert _run(monkeypatch, tmp_path, ["--model", "mine"])["model"] == "mine"


def test_two_canonical_traces_are_a_usage_error_not_a_run_of_the_first(monkeypatch, tmp_path, capsys):
    """`replay a.jsonl b.jsonl` replayed a.jsonl and ignored b.jsonl without a word (nargs='+', only the first read)."""
    import shutil

    shutil.copy(SAMPLE, tmp_path / "b.jsonl.gz")
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)

    def replayer(*a: object, **k: object) -> None:
        raise _Sent

    monkeypatch.setattr(live, "LiveReplayer", replayer)
    assert top_main(["replay", str(SAMPLE), "b.jsonl.gz", "--router-url", "http://127.0.0.1:9", "--out", "r"]) == 2
    err = capsys.readouterr().err
    assert "2 canonical traces given" in err and "replay takes one" in err, err
    assert not (tmp_path / "r").exists()


def test_a_router_that_refuses_the_key_is_named_before_any_request(monkeypatch, tmp_path, capsys):
    """`up --api-keys-file` and a replay with no key: 12 of 12 requests were 401 over 105 s wall (each agent waited its
    recorded pauses, at speedup 1: the router's /v1/cluster, which said its speedup, also wanted the key)."""
    from evolving_infra.replay.cli import router_refuses_key

    def keyed(request: httpx.Request) -> httpx.Response:
        ok = request.headers.get("authorization") == "Bearer k1"
        return httpx.Response(200 if ok else 401, json={"data": [{"id": "evolving-infra-sim"}]} if ok else {"error": {}})

    def refuses(key: str | None, transport: httpx.MockTransport) -> str | None:
        return router_refuses_key("http://r", key, asyncio.run(router_answers("http://r", key, transport=transport)))

    t = httpx.MockTransport(keyed)
    assert refuses("k1", t) is None
    assert "needs an API key and none was given" in refuses(None, t)
    assert "refuses the API key given" in refuses("k2", t)
    assert refuses(None, _answer({}, 404)) is None

    async def nothing(*a: object, **k: object) -> None:
        return None

    async def refused(*a: object, **k: object) -> RouterAnswers:
        return RouterAnswers(401, None, 401, None)

    def replayer(*a: object, **k: object) -> None:
        raise _Sent

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("EI_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(replay_cli, "router_unreachable", nothing)
    monkeypatch.setattr(replay_cli, "router_answers", refused)
    monkeypatch.setattr(live, "LiveReplayer", replayer)
    assert top_main(["replay", str(SAMPLE), "--sessions", "1", "--router-url", "http://127.0.0.1:9", "--out", "r"]) == 2
    assert "needs an API key" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
