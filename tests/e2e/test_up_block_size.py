"""The cluster's KV block size is the profile's: ``up --profile tiny`` (4-token blocks) without
``--block-size`` serves requests (it answered every one with 500 "block size mismatch: work has 64,
node w0 uses 4" when the router and directory kept 64), and a ``--block-size`` that differs from the
profile's is refused before anything starts (status 2, both sizes and the flag to pass named), by
``up`` and by ``demo`` (which leaves no --out folder)."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from tests.e2e._up import read_ready

pytestmark = pytest.mark.timeout(180)


def _cli(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "evolving_infra.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_up_with_the_tiny_profile_takes_its_block_size(tmp_path):
    proc = _cli("up", "--nodes", "2", "--split", "1P1D", "--profile", "tiny", "--speedup", "20",
                "--port", "0", "--log-dir", str(tmp_path / "logs"))  # fmt: skip
    try:
        info = read_ready(proc)
        for i in range(2):
            body = {"messages": [{"role": "user", "content": f"a prompt of several tiny blocks, take {i}"}], "max_tokens": 4}
            r = httpx.post(info["router_url"] + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        router_log = (tmp_path / "logs" / "router.log").read_text()
        assert "BLOCK SIZE MISMATCH" not in router_log
    finally:
        _stop(proc)


@pytest.mark.parametrize("command", ["up", "demo"])
def test_a_block_size_other_than_the_profiles_is_refused_before_anything_starts(tmp_path, command):
    out = tmp_path / "demo-out"
    extra = ["--out", str(out)] if command == "demo" else []
    proc = _cli(command, "--nodes", "2", "--split", "1P1D", "--profile", "tiny", "--block-size", "64",
                "--port", "0", "--log-dir", str(tmp_path / "logs"), *extra)  # fmt: skip
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise AssertionError(f"{command} --block-size 64 --profile tiny started instead of refusing") from None
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    assert rc == 2, (stdout, stderr)
    assert "READY" not in stdout
    line = stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert "--block-size 64" in line and "block size 4 of profile tiny" in line and "pass --block-size 4" in line, line
    assert not (tmp_path / "logs").exists()
    assert not out.exists()


def test_a_demo_on_a_profile_whose_l1_holds_none_of_the_prompts_is_refused(tmp_path):
    """``demo --profile tiny``: its L1 holds 256 tokens, the shipped trace's prompts thousands, so
    every request failed ('request needs 4202 KV blocks but node w0 has 64 in GPU memory': 742 of
    742 failed after 2 min 25 s). Refused before anything starts (status 2, one line), no --out."""
    out = tmp_path / "demo-out"
    proc = _cli("demo", "--profile", "tiny", "--out", str(out), "--log-dir", str(tmp_path / "logs"))
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise AssertionError("demo --profile tiny started instead of refusing") from None
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    assert rc == 2, (stdout, stderr)
    line = stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert "profile tiny" in line and "256" in line and "every request would fail" in line, line
    assert not out.exists() and not (tmp_path / "logs").exists()
