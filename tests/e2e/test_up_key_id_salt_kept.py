"""A later ``evolving-infra up`` on the same ``--log-dir`` wrote a new ``api-key-id.salt`` over the earlier one: the
key ids in the older log lines there (``key=<id>``, an HMAC of the key under that salt) could no longer be mapped to
keys. Now ``up`` keeps a valid salt file (a plain 0600 file of the user's holding one hex line: what it writes) and
its routers use it; one that is not valid is put aside to ``api-key-id.salt.invalid`` and a new one written, with a
warning; absent, one is made as before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.e2e._up import read_ready

ROOT = Path(__file__).resolve().parents[2]


def _up(tmp_path: Path, logs: Path) -> tuple[str, str]:
    """Run ``up`` (keys on) until READY, read its router's EI_API_KEY_ID_SALT, stop it; returns (that, its output)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {
        "EI_API_KEYS": "k-one", "EI_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "1", "--profile", "tiny", "--port", "0",
           "--log-dir", str(logs)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        info = read_ready(proc, lines, timeout_s=90)
        environ = Path(f"/proc/{info['pids']['router']}/environ").read_bytes().split(b"\0")
        used = next(v for v in environ if v.startswith(b"EI_API_KEY_ID_SALT=")).split(b"=", 1)[1].decode()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return used, "".join(lines) + rest


def test_a_later_up_on_the_same_log_dir_keeps_the_salt(tmp_path):
    logs = tmp_path / "logs"
    salt_file = logs / "api-key-id.salt"
    first, out = _up(tmp_path, logs)  # none there: made, 0600, the router's
    assert salt_file.read_text() == first + "\n" and len(first) == 32
    assert salt_file.stat().st_mode & 0o777 == 0o600
    assert "is kept" not in out and "warning" not in out
    second, out = _up(tmp_path, logs)
    assert second == first, out  # before: a new salt, the first run's log lines' ids unmappable
    assert salt_file.read_text() == first + "\n"
    assert f"API key ids: the salt in {salt_file} is kept (an earlier up's)" in out, out
    salt_file.chmod(0o644)  # open to others: not kept, put aside, a new one made
    third, out = _up(tmp_path, logs)
    assert third != first and salt_file.read_text() == third + "\n"
    assert salt_file.stat().st_mode & 0o777 == 0o600
    assert (logs / "api-key-id.salt.invalid").read_text() == first + "\n"
    assert f"warning: {salt_file} is open to others (mode 644, not 600): not used; a new salt is written there" in out, out
