"""``evolving-infra status`` against a live ``up`` (2 nodes, profile tiny, speedup 20, ``--max-restarts 1``): the text
and ``--json`` name the nodes, the split they serve and the planner's (its warm-up's end), and every service running;
after the planner is SIGKILLed past ``--max-restarts`` it lists the planner LEFT DOWN (since when, what no longer
adapts) and still exits 0 (the router answers). Before session 59 there was no ``status`` command (exit 2, "invalid
choice"): the same facts were spread over ``split get``, ``GET /v1/cluster``, the state file and ``cluster.json``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.e2e._up import read_ready
from tests.e2e._up import stop as _stop

pytestmark = pytest.mark.timeout(240)


def _status(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "evolving_infra.cli", "status", "--timeout", "5", *extra], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_status_shows_the_live_cluster_and_a_planner_left_down(tmp_path):
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "2", "--profile", "tiny", "--port", "0",
           "--speedup", "20", "--log-dir", str(logs), "--max-restarts", "1", "--restart-window-s", "300"]  # fmt: skip
    env = {**os.environ, "EI_STATE_DIR": str(tmp_path / "state")}
    env.pop("EI_NATS_URL", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader: threading.Thread | None = None
    try:
        try:
            ready = read_ready(proc, lines)
        except AssertionError as e:
            pytest.fail(f"up never READY: {e}")
        out = proc.stdout
        assert out is not None
        reader = threading.Thread(target=lambda: [lines.append(x) for x in out], daemon=True)
        reader.start()
        url = str(ready["router_url"])
        assert re.search(r"   look with: .+ status   trace with: ", "".join(lines)), "".join(lines)  # the banner says so

        got = _status(env)
        assert got.returncode == 0, got.stdout + got.stderr
        text = got.stdout
        assert re.match(rf"cluster: up pid {proc.pid}, up [0-9.ms ]+\(cluster clock t=\d+ s\); policy evolving, speedup 20, "
                        r"engine sim, profile tiny, 2 nodes, partition p0\n", text), text  # fmt: skip
        assert f"router {url}" in text and f"logs {logs.resolve()}" in text
        assert "split: serving collocated (w0=both w1=both); router epoch " in text, text
        # the planner's split, as `split get` says it: the warm-up's end
        assert re.search(r"  planner: epoch \d+: collocated \(w0=both w1=both\); reason: warm-up: .*until t=\d+s", text), text
        assert re.search(r"\n  w0  both +ok +state [0-9.]+ s ago", text) and re.search(r"\n  w1  both +ok ", text), text
        assert "services (6):" in text, text
        for name in ("nats-server", "router", "kvdirectory", "planner", "worker-w0", "worker-w1"):
            assert re.search(rf"\n  {name} +running \(pid {ready['pids'][name]}\)", text), (name, text)
        assert len(text.splitlines()) <= 25, text

        got = _status(env, "--json")
        assert got.returncode == 0, got.stderr
        s = json.loads(got.stdout)
        assert s["cluster"]["launcher_pid"] == proc.pid and s["cluster"]["profile"] == "tiny" and s["cluster"]["speedup"] == 20
        assert [(n["node"], n["phase"], n["fenced"]) for n in s["nodes"]] == [("w0", "both", False), ("w1", "both", False)]
        assert s["split"]["serving"] == "collocated" and s["split"]["planner"]["split"] == "collocated"
        assert "until t=" in s["split"]["planner"]["reason"] and s["split"]["heard_s"] is not None
        assert {x["name"]: x["state"] for x in s["services"]} == dict.fromkeys(ready["pids"], "running")

        def cluster() -> dict:
            return json.loads((logs / "cluster.json").read_text()) if (logs / "cluster.json").exists() else {}

        def wait(what: str, cond, within_s: float = 30.0) -> None:
            deadline = time.monotonic() + within_s
            while not cond():
                assert proc.poll() is None, f"up exited ({proc.returncode}) waiting for {what}:\n{''.join(lines)[-3000:]}"
                assert time.monotonic() < deadline, f"no {what} within {within_s:g} s:\n{''.join(lines)[-3000:]}"
                time.sleep(0.1)

        first = int(ready["pids"]["planner"])  # SIGKILL twice: its second exit is past --max-restarts 1
        os.kill(first, signal.SIGKILL)
        wait("planner restarted", lambda: cluster().get("pids", {}).get("planner") not in (None, first))
        os.kill(int(cluster()["pids"]["planner"]), signal.SIGKILL)
        wait("planner left down", lambda: "planner" in cluster().get("left_down", []))

        got = _status(env)
        assert got.returncode == 0, got.stdout + got.stderr  # the router answers: serving goes on
        text = got.stdout
        assert "services (6, 1 LEFT DOWN):" in text, text
        assert re.search(r"\n  planner +LEFT DOWN after a crash loop [0-9.ms ]+ ago, 1 restart; tried again in [0-9hms. ]+; "
                         r"the split is frozen at collocated", text), text  # fmt: skip
        assert "  planner: LEFT DOWN by up after a crash loop" in text, text
        assert "split: serving collocated (w0=both w1=both)" in text, text
        s = json.loads(_status(env, "--json").stdout)
        planner = next(x for x in s["services"] if x["name"] == "planner")
        assert planner["state"] == "left_down" and planner["restarts"] == 1 and planner["pid"] is None
        assert planner["since_unix"] <= time.time() < planner["retry_at_unix"]
        assert "split is frozen" in planner["effect"]
        assert proc.poll() is None
    finally:
        _stop(proc)
    if reader is not None:
        reader.join(10.0)
    assert proc.returncode == 0
    got = _status(env)  # up stopped: its state file is gone
    assert got.returncode == 1 and "no running local cluster found" in got.stderr, got.stderr
