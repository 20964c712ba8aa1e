"""``report compare`` of a ``demo`` or ``replay`` run against a ``simulate`` run of the same trace, one reading the
``.jsonl.gz`` and the other the ``.eipack`` packed from it, warned "the runs served different inputs — trace: ...":
``simulate`` records the trace's identity (``meta.trace_source``, ``trace_requests``, ``trace_block_size``;
ee5573a) and the live commands did not record ``trace_requests``, so the files' names, then bytes, were compared.
Both now record it (``evolving_infra.traces.io.trace_identity``): the count of the trace read, before ``--sessions``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evolving_infra.cli import main
from evolving_infra.launcher import demo_trace_path
from evolving_infra.traces.io import read_trace, write_trace
from evolving_infra.traces.sample import sample_sessions
from tests.unit.replay.stub_router import stub_router_thread

ROOT = Path(__file__).resolve().parents[2]


def _traces(tmp_path: Path) -> tuple[Path, Path, int]:
    """A small trace (2 sessions of at most 2 requests per branch) as ``.jsonl.gz`` and packed; its request count."""
    small = sample_sessions(read_trace(demo_trace_path()), 2, seed=0, max_requests_per_branch=2)
    plain, packed = tmp_path / "small.jsonl.gz", tmp_path / "small.eipack"
    write_trace(plain, small.header, small.requests)
    assert main(["trace", "pack", str(plain), str(packed)]) == 0
    return plain, packed, len(small.requests)


def _compare(tmp_path: Path, live: Path, sim: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    capsys.readouterr()
    assert main(["report", "compare", str(live), str(sim), "--out", str(tmp_path / "cmp")]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in json.loads((tmp_path / "cmp" / "compare.json").read_text())["input_differences"]
            if line.startswith("trace:")] + [line for line in err.splitlines() if "— trace:" in line]


def _meta(run: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((run / "report.json").read_text())["meta"]


def test_a_replay_of_the_jsonl_and_a_simulate_of_its_pack_are_one_input(tmp_path, monkeypatch, capsys):
    plain, packed, n = _traces(tmp_path)
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))  # no running cluster's state is read
    with stub_router_thread() as (url, _stub):
        assert main(["replay", str(plain), "--router-url", url, "--speedup", "1000", "--sessions", "1",
                     "--out", str(tmp_path / "rep")]) == 0
    assert main(["simulate", "--trace", str(packed), "--duration", "5", "--no-plots", "--out", str(tmp_path / "sim")]) == 0
    rep, sim = _meta(tmp_path / "rep"), _meta(tmp_path / "sim")
    assert rep["trace_requests"] == sim["trace_requests"] == n  # the file's, not the one session replayed
    assert rep["trace_source"] == sim["trace_source"] and rep["trace_block_size"] == sim["trace_block_size"]
    assert _compare(tmp_path, tmp_path / "rep", tmp_path / "sim", capsys) == []
    # another trace of the same source (the whole sample it was cut from) still warns, by content
    with stub_router_thread() as (url, _stub):
        assert main(["replay", str(demo_trace_path()), "--router-url", url, "--speedup", "1000", "--sessions", "1",
                     "--max-requests-per-branch", "1", "--out", str(tmp_path / "rep")]) == 0
    assert _meta(tmp_path / "rep")["trace_requests"] > n
    assert len(_compare(tmp_path, tmp_path / "rep", tmp_path / "sim", capsys)) == 2  # compare.json's and stderr's


def test_a_demo_of_the_jsonl_and_a_simulate_of_its_pack_are_one_input(tmp_path, capsys):
    plain, packed, n = _traces(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {
        "EI_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--trace", str(plain), "--sessions", "1",
           "--concurrency", "1", "--speedup", "100", "--nodes", "1", "--out", str(tmp_path / "demo")]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(["simulate", "--trace", str(packed), "--duration", "5", "--no-plots", "--out", str(tmp_path / "sim")]) == 0
    demo, sim = _meta(tmp_path / "demo"), _meta(tmp_path / "sim")
    assert demo["trace_requests"] == sim["trace_requests"] == n
    assert _compare(tmp_path, tmp_path / "demo", tmp_path / "sim", capsys) == []
