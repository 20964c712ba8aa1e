"""A demo whose cluster does not come up says why in one line and exits 1, as ``up`` does; it printed a
traceback ending in ``ClusterError: cluster not healthy after 0 s; waiting for [...]`` (measured: ``demo
--ready-timeout 0.5``, the case of a machine too loaded to start the services within the default 90 s),
and left the NATS seeds it generated in ``OUT/logs/nats-creds``."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_cluster_that_is_not_ready_in_time_is_one_line_and_leaves_no_seeds(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--ready-timeout", "0.2", "--sessions", "1", "--out", str(out)]
    env = {**os.environ, "EI_STATE_DIR": str(tmp_path / "state")}
    # an earlier demo's logs in OUT/logs: each service appends to its log, so a rerun's lines followed the old ones
    (out / "logs").mkdir(parents=True)
    for name in ("router.log", "worker-w0.log", "gone-node.log"):
        (out / "logs" / name).write_text("a line of an earlier demo\n")
    (out / "logs" / "notes.txt").write_text("not a log\n")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1, (p.stdout + p.stderr)[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith("error: cluster not healthy after"), p.stderr[-3000:]
    assert f"logs in {out / 'logs'}" in p.stderr
    assert list((out / "logs").glob("*.log")) and not list(out.rglob("*.nk"))
    assert not (out / "report.json").exists()
    assert not (out / "logs" / "gone-node.log").exists() and (out / "logs" / "notes.txt").exists()
    assert not any("earlier demo" in f.read_text() for f in (out / "logs").glob("*.log"))
