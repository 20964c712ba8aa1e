"""``demo --no-restart`` whose cluster ends during the replay (a service or nats-server exits: nothing restarts it)
says so as ``up`` does, stops the replay there and writes and prints the report of what was answered, marked
partial and naming the service (as a benchmark client does when its server dies: vLLM's ``benchmark_serving``,
genai-perf), with ``up``'s non-zero status. Before, the check after the replay raised its ``ClusterError`` out of
``demo`` (a Python traceback, status 1); then the demo replayed on to the end and discarded every figure (no report)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from evolving_infra.launcher import demo_trace_path
from evolving_infra.traces.io import read_trace
from tests.e2e._up import demo_answering

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(("service", "sig", "status"), [("planner", signal.SIGTERM, 3), ("planner", signal.SIGKILL, 1),
                                                        ("nats-server", signal.SIGKILL, 1)])  # fmt: skip
def test_a_service_that_exits_during_the_replay_ends_the_demo_with_a_partial_report(tmp_path, service, sig, status):
    """The planner SIGTERMed (it exits 0: no crash, status 3, a calm line on stdout, as ``up --no-restart``) or
    SIGKILLed (a crash: "error: planner was killed by signal 9 (SIGKILL) ..." and its log's tail, status 1), or the
    embedded nats-server SIGKILLed (status 1), once the replay has completed requests: the replay stops, the cluster
    stops, and the demo prints ``PARTIAL REPORT: ...`` naming the service, the summary of what was answered (its
    latencies), writes ``report.json`` with ``meta.partial``, and ends with one line naming the report and the logs."""
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {"EI_STATE_DIR": str(state_dir)}
    out_dir = tmp_path / "demo"
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--no-restart", "--sessions", "2", "--concurrency", "2",
           "--speedup", "25", "--nodes", "1", "--log-requests", "--out", str(out_dir)]  # fmt: skip
    # speed-up 25: the replay takes ~15 wall s (7 s at 50, measured quiet); the service dies once 2 requests are done
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        state = demo_answering(proc, state_dir)  # its cluster ready, 2 requests answered (120 s)
        os.kill(int(state["pids"][service]), sig)
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, (proc.returncode, out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    logs = out_dir / "logs"
    how = {signal.SIGTERM: "exited cleanly (code 0)", signal.SIGKILL: "was killed by signal 9 (SIGKILL)"}[sig]
    report = json.loads((out_dir / "report.json").read_text())
    partial = report["meta"]["partial"]
    assert partial["service"] == service and partial["reason"].startswith(f"{service} {how}"), partial
    assert partial["clean"] is (status == 3)
    assert err.splitlines()[-1] == (f"demo: partial report written (the cluster ended during the replay: {partial['reason']}); "
                                    f"logs in {logs}"), err  # fmt: skip
    head = [line for line in out.splitlines() if line.startswith("PARTIAL REPORT: ")]
    assert len(head) == 1 and head[0].startswith(f"PARTIAL REPORT: the cluster ended during the replay ({service} {how}"), out
    assert f"report: {out_dir / 'report.json'}" in out
    if status == 3:
        assert f"planner exited cleanly (code 0); log {logs / 'planner.log'}; --no-restart: stopped the cluster" in out
        assert "error:" not in err, err[-3000:]
    else:
        assert sum(line.startswith("error: ") for line in err.splitlines()) == 1, err[-3000:]
        assert f"error: {service} was killed by signal 9 (SIGKILL)" in err, err[-3000:]
    # what was answered (completed or failed), cancelled in flight and never sent, against figures the partial report's
    # code does not make: the trace's requests, the records written, and the requests the router accepted (its log)
    trace = read_trace(demo_trace_path())
    agents = set(list(dict.fromkeys(r.agent for r in trace.requests))[:2])
    total = sum(r.agent in agents for r in trace.requests)
    rows = [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines()]
    answered = {r["x_request_id"] for r in rows}
    accepted = {e["rid"] for e in map(json.loads, (logs / "router.log").read_text().splitlines()) if e.get("event") == "request accepted"}
    assert (partial["requests_total"], partial["requests_answered"]) == (total, len(rows)), (partial, total, len(rows))
    assert len(answered) == len(rows) and answered <= accepted, (answered - accepted)
    # a request the router accepted and the replay never got the answer of was cancelled in flight; one sent and not
    # yet accepted is in flight too, so at least these; and the figures add up to the trace's
    assert len(accepted - answered) <= partial["in_flight_cancelled"] <= total - len(rows), (partial, accepted - answered)
    assert partial["requests_answered"] + partial["in_flight_cancelled"] + partial["requests_not_sent"] == total, partial
    assert partial["requests_not_sent"] > 0, partial
    assert report["requests_sent"] == len(rows) and report["requests_completed"] >= 2
    assert report["requests_completed"] + report["requests_failed"] == report["requests_sent"]
    assert report["ttft_mean_s"] > 0 and report["e2e_mean_s"] > 0, report
    assert f"requests   sent {report['requests_sent']}  completed {report['requests_completed']}" in out
    assert f"{len(rows)} answered + {partial['in_flight_cancelled']} cancelled in flight (not in the counts) of {total} requests; " in head[0]
    assert not list(state_dir.glob("up-*.json"))
