"""Ctrl-C (SIGINT) in a ``trace`` command, as a user sends it to a real process: one line on
stderr, status 130, no traceback (``evolving_infra.cli.main``), and nothing of the output left
behind: no ``OUT.tmp``, no folder made for ``OUT`` (the writers' own clean-up on any exception).
Was: a KeyboardInterrupt traceback and the signal's death (status -2)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(120)


def _start(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "evolving_infra.cli", *argv],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _interrupt(proc: subprocess.Popen[str], until, what: str) -> tuple[int, str, str]:
    """SIGINT ``proc`` once ``until()`` holds (polled every 5 ms), then its status and output."""
    deadline = time.monotonic() + 60
    while not until():
        assert proc.poll() is None, f"ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within 60 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


def _one_line(err: str, command: str) -> None:
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip() == f"evolving-infra {command}: interrupted", err


def test_generate_interrupted_while_writing_leaves_nothing(tmp_path):
    out = tmp_path / "new" / "deeper" / "g.jsonl.gz"  # folders that do not exist yet: made for it, taken back
    tmp = out.with_name(out.name + ".tmp")
    proc = _start("trace", "generate", "claude-code", "--agents", "400", "--seed", "3", "-o", str(out))
    rc, _, err = _interrupt(proc, tmp.exists, f"{tmp.name} (the write under way)")
    assert rc == 130, err
    _one_line(err, "trace generate")
    assert list(tmp_path.iterdir()) == []


def test_generate_interrupted_before_writing(tmp_path):
    out = tmp_path / "g.jsonl"
    proc = _start("trace", "generate", "claude-code", "--agents", "400", "-o", str(out))
    time.sleep(1.0)  # importing and generating (~4 s for 400 agents)
    rc, _, err = _interrupt(proc, lambda: True, "start")
    assert rc == 130, err
    _one_line(err, "trace generate")
    assert list(tmp_path.iterdir()) == []


def test_convert_interrupted_while_writing_leaves_nothing(tmp_path):
    import json

    mc = tmp_path / "mc.jsonl"  # 150,000 mooncake rows: ~2 s to spool on this box, then the header and the copy
    with mc.open("w") as f:
        for i in range(150_000):
            f.write(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2 + i % 97, 10**6 + i]}) + "\n")
    out = tmp_path / "new" / "o.jsonl.gz"
    tmp = out.with_name(out.name + ".tmp")
    proc = _start("trace", "convert", "--from", "mooncake", str(mc), "-o", str(out), "--no-progress")
    rc, _, err = _interrupt(proc, tmp.exists, f"{tmp.name} (the copy under way)")
    assert rc == 130, err
    _one_line(err, "trace convert")
    assert [p.name for p in tmp_path.iterdir()] == ["mc.jsonl"]
