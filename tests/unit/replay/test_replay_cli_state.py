"""`replay` without --router-url / --speedup takes them (and the tokenizer) from the running `up` cluster."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from evolving_infra.replay.cli import DEFAULT_MODEL, _use_running_cluster
from evolving_infra.state import write_state


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"router_url": None, "speedup": None, "model": None, **kw})


def test_defaults_without_a_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path))
    a = _args()
    assert _use_running_cluster(a) is None
    assert (a.router_url, a.speedup, a.model) == ("http://127.0.0.1:8000", 1.0, DEFAULT_MODEL)


def test_the_running_cluster_fills_what_is_unset(tmp_path, monkeypatch):
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path))
    write_state({"router_url": "http://127.0.0.1:43210", "nats_url": "nats://x", "speedup": 50.0, "tokenizer": "sim"}, pid=os.getpid())
    a = _args()
    assert _use_running_cluster(a) is None
    assert (a.router_url, a.speedup) == ("http://127.0.0.1:43210", 50.0)
    assert a.cluster_block_size is None  # an older `up`'s state file: no block size to record
    b = _args(router_url="http://elsewhere:1", speedup=2.0)  # given flags win, and nothing is read
    assert _use_running_cluster(b) is None and (b.router_url, b.speedup) == ("http://elsewhere:1", 2.0)


def test_the_running_clusters_block_size_is_kept_for_the_report(tmp_path, monkeypatch):
    """`report compare` said 'block_size: ... not recorded' for every replay."""
    from evolving_infra.cluster import ClusterSpec
    from evolving_infra.launcher import _state_fields

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path))
    fields = _state_fields(ClusterSpec(block_size=16))
    assert fields["block_size"] == 16
    write_state({"router_url": "http://127.0.0.1:43210", "speedup": 1.0, **fields}, pid=os.getpid())
    a = _args()
    _use_running_cluster(a)
    assert a.cluster_block_size == 16


def test_a_real_tokenizer_gives_the_vocabulary_size(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    from tests.unit.router.helpers import write_bpe_tokenizer

    folder = write_bpe_tokenizer(tmp_path / "tok", vocab_size=1500)
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    path = write_state({"router_url": "http://127.0.0.1:1", "speedup": 20.0, "tokenizer": f"hf:{folder}"}, pid=os.getpid())
    assert json.loads(path.read_text())["tokenizer"] == f"hf:{folder}"
    a = _args()
    assert _use_running_cluster(a) == 1500 and a.speedup == 20.0


def test_the_running_clusters_served_model_is_sent(tmp_path, monkeypatch):
    """`up --engine torch --model /tmp/tiny` serves the model `tiny`; a replay sending the sim's name
    got 404 on every request."""
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path))
    write_state({"router_url": "http://127.0.0.1:43210", "speedup": 1.0, "tokenizer": "sim", "model": "tiny"}, pid=os.getpid())
    a = _args()
    _use_running_cluster(a)
    assert a.model == "tiny"
    b = _args(model="mine")  # --model wins
    _use_running_cluster(b)
    assert b.model == "mine"


def test_two_running_clusters_are_listed_and_replay_asks_for_router_url(tmp_path, monkeypatch, capsys):
    """With two local clusters `replay` said 'using --router-url's default' and failed every request at port 8000;
    `split get` lists them and asks for --nats-url: replay now does the same for --router-url, exit 2."""
    from evolving_infra.cli import main

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path))
    for pid, port in ((os.getpid(), 43210), (os.getppid(), 43211)):
        write_state({"router_url": f"http://127.0.0.1:{port}", "nats_url": "nats://x", "speedup": 1.0}, pid=pid)
    sample = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"
    assert main(["replay", str(sample), "--out", str(tmp_path / "out")]) == 2  # a trace that reads (it is read first)
    err = capsys.readouterr().err
    assert "2 local clusters are running" in err and "pass --router-url to pick one" in err, err
    assert "http://127.0.0.1:43210" in err and "http://127.0.0.1:43211" in err, err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
    a = _args(router_url="http://127.0.0.1:43211")  # --router-url picks one: nothing to ask
    _use_running_cluster(a)
    assert a.router_url == "http://127.0.0.1:43211"


def test_the_trace_is_read_before_any_cluster_is_looked_for(tmp_path, monkeypatch, capsys):
    """`replay missing.jsonl` with no cluster running said "no router answers at http://127.0.0.1:8000 ...
    start a cluster with `evolving-infra up`": a newcomer started one only to learn the path was wrong (and a raw
    trace given without --from, the same). The input is read first now; no router is asked."""
    from evolving_infra.cli import main

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["replay", "missing.jsonl", "--router-url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: missing.jsonl: cannot read: ") and "no router answers" not in err, err
    (tmp_path / "raw.jsonl").write_text('{"timestamp": 0, "input_length": 10}\n')
    assert main(["replay", "raw.jsonl", "--router-url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "not a canonical trace" in err and "no router answers" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.jsonl"]  # no replay-out made
