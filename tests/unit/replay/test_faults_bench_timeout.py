"""``bench/faults.py``'s :func:`run_fault` when the replay runs past ``replay_timeout_s``, without a cluster: ``up`` is a
process that has already exited and the router a :class:`tests.unit.replay.stub_router.StubRouter` that never answers a
completion (a request stuck in the cluster).

The result says what was sent and names the requests still open, so the cluster's logs can be searched for them.
Before, the replay was cancelled and the result read ``sent=0`` (session 57's CI run of the real-KV-pool fault test:
"replay did not finish within 180.0 s", ``sent=0``, read as "the replay never sent a request"), with no request named.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

from tests.conftest import bench_faults
from tests.unit.replay.stub_router import StubRouter

faults = bench_faults()


async def test_a_replay_past_its_bound_reports_what_it_sent_and_names_the_requests_still_open(tmp_path, monkeypatch):
    hold = asyncio.Event()  # never set: no completion is ever answered
    stub = StubRouter(hold=hold)
    url = await stub.start()
    up = subprocess.Popen([sys.executable, "-c", "pass"])  # `up`, gone already: no counters read, nothing to stop
    up.wait()
    monkeypatch.setattr(faults, "start_up", lambda log_dir, **kw: faults.FaultRun(up, {"router_url": url}, log_dir))

    async def nothing(run):  # type: ignore[no-untyped-def]
        return None

    async def not_recovered(run, victim, old_pid, timeout_s):  # type: ignore[no-untyped-def]
        return None

    monkeypatch.setitem(faults.FAULTS, "nothing", nothing)
    monkeypatch.setattr(faults, "_wait_recovered", not_recovered)
    try:  # each request's own bound past the replay's: at 0.5 s both (the default) the two raced, and a request's
        # timeout firing first left nothing open at the bound (a loaded CI run: in_flight_at_timeout == [])
        r = await asyncio.wait_for(faults.run_fault("nothing", log_dir=tmp_path, sessions=2, max_requests_per_branch=2,
                                                    concurrency=2, fault_at_s=0.05, replay_timeout_s=0.5,
                                                    request_timeout_s=60.0), 20)
    finally:
        await stub.close()
    assert stub.received is not None and stub.received.is_set()
    held = sorted(h["x-request-id"] for path, h in stub.seen if path == "/v1/completions")
    assert len(held) == 2, stub.seen  # one request of each agent, both held
    assert (r.sent, r.completed, r.lost) == (2, 0, -1), r  # was sent=0: nothing said the two had been sent
    assert r.in_flight_at_timeout == held
    assert r.errors[0].startswith("replay did not finish within 0.5 s: 2 requests unanswered then (")
    assert all(rid in r.errors[0] for rid in held), r.errors
    assert 0.5 <= r.replay_wall_s < 10.0  # stopped at the bound, not waited for
