"""``demo`` stopped by Ctrl-C (SIGINT) during its replay writes and prints the report of what was answered, marked
partial and interrupted (``meta.partial`` with the signal, ``meta.interrupted`` as ``replay`` writes it), stops its
cluster as before and exits 130. Before, it stopped the cluster and wrote no report ("no report written"): a benchmark
user lost the figures of everything that had completed, where ``replay`` keeps them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from evolving_infra.launcher import demo_trace_path
from evolving_infra.traces.io import read_trace
from tests.e2e._up import demo_answering

pytestmark = pytest.mark.timeout(300)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def test_ctrl_c_during_the_replay_writes_the_partial_report_stops_the_cluster_and_exits_130(tmp_path):
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {"EI_STATE_DIR": str(state_dir)}
    out_dir = tmp_path / "demo"
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--sessions", "2", "--concurrency", "2",
           "--speedup", "25", "--nodes", "1", "--out", str(out_dir)]  # fmt: skip
    # speed-up 25: the replay takes ~15 wall s; Ctrl-C once 2 requests are done, so some are answered and some not sent
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        state = demo_answering(proc, state_dir)  # its cluster ready, 2 requests answered (120 s)
        # the router's finished count leads the client's last chunk: wait for those answers' records (before, a fixed
        # 1-s sleep, which a loaded host's replay client can outlast)
        deadline = time.monotonic() + 30
        while sum(len(p.read_text().splitlines()) for p in out_dir.glob("requests.partial-*.jsonl")) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, (proc.poll(), sorted(out_dir.glob("*")))
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    logs = out_dir / "logs"
    report = json.loads((out_dir / "report.json").read_text())
    partial = report["meta"]["partial"]
    assert partial["signal"] == "SIGINT" and partial["service"] is None and partial["clean"] is False, partial
    assert report["meta"]["interrupted"] == {"signal": "SIGINT", "in_flight_cancelled": partial["in_flight_cancelled"]}
    trace = read_trace(demo_trace_path())
    agents = set(list(dict.fromkeys(r.agent for r in trace.requests))[:2])
    total = sum(r.agent in agents for r in trace.requests)
    rows = [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines()]
    # the branch ends the stop cancelled unanswered, counted apart from the requests (counted nowhere before): an end
    # is sent only once a branch's last request is answered, so at most one per such answered request (how many of
    # those were still in flight at the stop is a race; the unit tests count exact cases)
    ends_sent = sum(next(r for r in trace.requests if r.id == row["id"]).ends_branch for row in rows)
    meta = report["meta"]
    assert f"run {meta['run_id']}: each answered request's record is appended to " in out, out[-2000:]  # its id
    assert not list(out_dir.glob("requests.partial-*")), sorted(p.name for p in out_dir.iterdir())
    assert 0 <= meta["branch_ends_cancelled"] <= ends_sent - meta["branch_end_failures"], (meta, ends_sent)
    assert (partial["requests_total"], partial["requests_answered"]) == (total, len(rows)), (partial, total, len(rows))
    assert partial["requests_answered"] + partial["in_flight_cancelled"] + partial["requests_not_sent"] == total, partial
    assert partial["requests_not_sent"] > 0, partial
    assert report["requests_sent"] == len(rows) and report["requests_completed"] >= 2
    assert report["ttft_mean_s"] > 0 and report["e2e_mean_s"] > 0, report
    head = [line for line in out.splitlines() if line.startswith("PARTIAL REPORT: ")]
    assert len(head) == 1 and head[0].startswith(f"PARTIAL REPORT: the replay was stopped by SIGINT: {len(rows)} answered + "), out
    assert f"requests   sent {report['requests_sent']}  completed {report['requests_completed']}" in out
    assert f"report: {out_dir / 'report.json'}" in out
    assert err.splitlines()[-1] == ("demo: SIGINT: stopped the replay and the cluster (its state file and NATS store removed); "
                                    f"partial report written; logs in {logs}"), err  # fmt: skip
    # the cluster is gone: its state file and every process it listed
    assert not list(state_dir.glob("up-*.json"))
    deadline = time.monotonic() + 10
    while any(_alive(int(p)) for p in state["pids"].values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [n for n, p in state["pids"].items() if _alive(int(p))], state["pids"]


def test_a_burst_of_sigterms_during_the_replay_stops_the_demo_with_143_and_no_traceback(tmp_path):
    """A plain ``scancel`` of a job running ``demo`` SIGTERMs it with every process of the job, and the job's stop
    sends more: bursts of 4, 2 ms apart (:func:`tests.stop_burst.send_stop_bursts`). The first stops the replay and
    the cluster; one after the cluster stopped aborts the report (``shared.signals.aborting``), the rest are ignored:
    status 143 either way (README), no traceback, the state file removed. Before, one that landed after the cluster
    stopped killed the demo by SIGTERM (-15), SIGTERM being back at its default."""
    from tests.stop_burst import send_stop_bursts

    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {"EI_STATE_DIR": str(state_dir)}
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--sessions", "2", "--concurrency", "2",
           "--speedup", "25", "--nodes", "1", "--out", str(tmp_path / "demo")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        demo_answering(proc, state_dir)  # its cluster ready, 2 requests answered (120 s)
        send_stop_bursts(proc, bursts=400)  # until it has exited: past the cluster's stop
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, (proc.returncode, out[-2000:], err[-3000:])
    for noise in ("Exception ignored", "Traceback", "never awaited", "never retrieved", "destroyed but it is pending"):
        assert noise not in err, (noise, err[-3000:])
    assert not list(state_dir.glob("*.json")), sorted(p.name for p in state_dir.iterdir())
