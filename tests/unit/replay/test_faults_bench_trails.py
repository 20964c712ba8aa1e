"""``bench/faults.py``: a failed run names each request that failed or was still open at the replay's bound, and
carries the last log lines of the cluster that name it (its trail).

Session 59's CI run of the real-KV-pool fault test failed with ``['replay did not finish within 180.0 s: 0 requests
unanswered then', 'ReadTimeout: ']``: the one request that got no answer for the client's whole read timeout was not
named, and its logs were gone with pytest's rotated tmp dirs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import bench_faults
from tests.unit.replay.stub_router import StubRouter

faults = bench_faults()


def _line(ts: str, event: str, **kw: object) -> str:
    """One log line in the services' JSON format (``shared`` logging: fields, event, service, level, timestamp)."""
    return json.dumps({**kw, "event": event, "service": "x", "level": "info", "timestamp": f"2026-12-07T{ts}Z"})


async def test_a_request_failed_on_its_own_timeout_is_named_with_its_wait_and_its_trail_from_the_logs(tmp_path, monkeypatch):
    hold = asyncio.Event()  # never set: no completion is ever answered
    stub = StubRouter(hold=hold)
    url = await stub.start()
    up = subprocess.Popen([sys.executable, "-c", "pass"])  # `up`, gone already: no counters read, nothing to stop
    up.wait()
    monkeypatch.setattr(faults, "start_up", lambda log_dir, **kw: faults.FaultRun(up, {"router_url": url}, log_dir))
    logged: list[str] = []

    async def log_the_held(run):  # type: ignore[no-untyped-def]
        # the cluster's logs of the requests it holds, as the router and a worker write them (`up --log-requests`)
        for _ in range(500):  # the first completions reached the stub (a loaded box: not yet at fault_at_s)
            held = [h["x-request-id"] for path, h in stub.seen if path == "/v1/completions"]
            if len(held) >= 2:
                break
            await asyncio.sleep(0.01)
        logged.extend(held)
        (run.log_dir / "router.log").write_text("\n".join(
            [_line("20:00:01.000001", "request accepted", instance="router", rid=rid) for rid in held]
            + [_line("20:00:03.000000", "dispatched", instance="router", rid=rid, node="w0") for rid in held]) + "\n")
        (run.log_dir / "worker-w0.log").write_text("\n".join(
            [_line("20:00:02.000000", "request received", node="w0", rid=rid, role="prefill") for rid in held]
            + [_line("20:00:04.000000", faults.LONG_WAIT_EVENT + " (previous step)", node="w0", rid=held[0], waited_s=10.0)]) + "\n")
        return None

    async def not_recovered(run, victim, old_pid, timeout_s):  # type: ignore[no-untyped-def]
        return None

    monkeypatch.setitem(faults.FAULTS, "log-the-held", log_the_held)
    monkeypatch.setattr(faults, "_wait_recovered", not_recovered)
    try:  # each request's own bound below the replay's: each held request fails on its own, the replay ends in time
        r = await asyncio.wait_for(faults.run_fault("log-the-held", log_dir=tmp_path, sessions=2, max_requests_per_branch=2,
                                                    concurrency=2, fault_at_s=0.3, replay_timeout_s=20.0,
                                                    request_timeout_s=0.6), 30)
    finally:
        await stub.close()
    sent = [h["x-request-id"] for path, h in stub.seen if path == "/v1/completions"]
    assert r.in_flight_at_timeout == [] and r.sent == len(sent) and r.completed == 0, r
    failed = [e for e in r.errors if not e.startswith(("trail of ", "worker-"))]
    assert len(failed) == min(5, len(sent)), r.errors  # the first five, each naming its request
    named = [e.split(": ", 1)[0] for e in failed]
    assert set(named) <= set(sent) and len(set(named)) == len(named), (sent, r.errors)
    assert all(e.split(": ", 1)[1].startswith("ReadTimeout after ") for e in failed), failed
    assert all(e.endswith("(no response, 0 tokens)") for e in failed), failed  # was 'ReadTimeout: ', no rid
    assert list(r.trails) == named[: faults.TRAIL_RIDS] and len(logged) >= 2, (r.trails, logged)
    assert set(logged) <= set(named), (logged, named)
    # the worker's long wait goes into the errors though the replay ended in time: a request was lost (before, only
    # past the replay's bound, which a request failing on its own shorter bound no longer reaches)
    assert any(e.startswith(f"worker-w0.log: {faults.LONG_WAIT_EVENT}") and f"rid={logged[0]}" in e for e in r.errors), r.errors
    for rid in logged:  # held when the fault ran: named in the logs, in time order across the router's and the worker's
        assert [line.split(" ", 3)[:3] for line in r.trails[rid]] == [
            ["20:00:01.000001", "router.log", "info"], ["20:00:02.000000", "worker-w0.log", "info"],
            ["20:00:03.000000", "router.log", "info"]] + ([["20:00:04.000000", "worker-w0.log", "info"]] if rid == logged[0] else []), r.trails
        assert "dispatched node=w0" in r.trails[rid][2]
        assert f"trail of {rid} (last {len(r.trails[rid])} log lines naming it):\n" + "\n".join(r.trails[rid]) in r.errors
    for rid in set(named) - set(logged):  # sent after: no line names them
        assert r.trails[rid] == [] and f"trail of {rid}: no log line names it" in r.errors

def test_a_trail_is_the_last_lines_naming_the_rid_in_every_service_log_time_ordered(tmp_path: Path):
    rid = "trace_0049-7"
    router = [_line(f"20:00:{i:02d}.000000", "chunk", instance="router", rid=rid, n=i) for i in range(0, 38, 2)]
    router += [_line("20:00:05.500000", "accepted", rid="trace_0049-70"),  # another request: its rid begins with ours
               "not json " + rid, '["' + rid + '"]']
    (tmp_path / "router.log").write_text("\n".join(router) + "\n")
    (tmp_path / "router-2.log").write_text(_line("20:00:39.000000", "second router", rid=rid) + "\n")
    (tmp_path / "worker-w1.log").write_text(_line("20:00:33.000000", "engine step", step_rids=[rid, "x"]) + "\n")
    (tmp_path / "worker-w1-twin.log").write_text(_line("20:00:31.000000", "twin", rid=rid) + "\n")
    (tmp_path / "kvdirectory.log").write_text(_line("20:00:35.000000", "branch", rid=rid, note="y" * 500) + "\n")
    (tmp_path / "planner.log").write_text(_line("20:00:37.000000", "planner", rids=[rid]) + "\n")
    (tmp_path / "nats.log").write_text(_line("20:00:38.000000", "not a service log", rid=rid) + "\n")
    trails = faults.request_trails(tmp_path, [rid, "never-seen", rid])
    assert list(trails) == [rid, "never-seen"] and trails["never-seen"] == []
    got = trails[rid]
    assert len(got) == faults.TRAIL_LINES
    stamps = [line.split(" ", 1)[0] for line in got]
    assert stamps == sorted(stamps) and stamps[-1] == "20:00:39.000000" and "20:00:38.000000" not in stamps
    files = {line.split(" ")[1] for line in got}
    assert files == {"router.log", "router-2.log", "worker-w1.log", "worker-w1-twin.log", "kvdirectory.log", "planner.log"}
    assert all(len(line) <= faults.TRAIL_LINE_MAX for line in got)
    assert next(line for line in got if "kvdirectory.log" in line).endswith("...")
    assert not any("trace_0049-70" in line for line in got)
    assert faults.request_trails(tmp_path, []) == {}
