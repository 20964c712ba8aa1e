"""A 1P1D cluster whose only decode node is SIGKILLed (not restarted) with a stream decoding on it: the stream
ends with a 503 error event naming the missing decode node within ``--requeue-wait-s`` of the node's fencing,
not after ``--request-timeout-s``. Real nats-server, every service its own process
(``evolving_infra.faultkit``), nothing supervised.

Measured before the fix (``--request-timeout-s 20``): the client got ``no output for 20s`` (504) 20.0 s after
the kill, and the router's ``parked`` gauge still said 1 once the request had ended.

The planner is given ``--silent-after-s 30``: since the planner's outage rule (b5b7824) it puts the lone survivor w0
to serve both phases once w1 has been silent for ``--silent-after-s`` (the fault kit's 1.5 s, the router's fence), and
the parked request is then served there (tests/integration/test_planner_outage_live.py) — a race with the 2-s park
that made this test fail 1 time in a full run (the stream completed). Here the park's own bound is under test, so
the planner waits past it."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from evolving_infra.faultkit import FaultCluster, FaultSpec

pytestmark = pytest.mark.timeout(120)


async def test_a_stream_on_a_sigkilled_only_decode_node_ends_with_a_503_within_the_requeue_bound(tmp_path: Path) -> None:
    spec = FaultSpec(
        nodes=2, split="1P1D", speedup=1.0,
        extra={"router": ["--request-timeout-s", "20", "--requeue-wait-s", "2"], "planner": ["--silent-after-s", "30"]},
    )
    async with FaultCluster(spec, tmp_path / "cluster") as fc:
        events: list[bytes] = []
        t_kill = None
        body = {"prompt": list(range(1, 200)), "max_tokens": 3000, "stream": True}
        async with httpx.AsyncClient(timeout=60) as c, c.stream("POST", fc.router_url() + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):].encode())
                if len(events) == 3:
                    fc.signal("worker-w1", signal.SIGKILL)  # the decode node, mid-stream
                    t_kill = time.monotonic()
        assert t_kill is not None
        waited = time.monotonic() - t_kill
        assert events[-1] == b"[DONE]"
        err = msgspec.json.decode(events[-2])["error"]
        assert err["code"] == 503 and "no live decode" in err["message"] and "w1: fenced" in err["message"], err
        # fenced after 1.5 s of silence (FaultSpec.fence_after_s), then parked 2 s (+ up to 0.5 s): not 20 s
        assert waited < 8.0, waited
        st = await fc.stats("router")
        assert st is not None
        assert st.counters["requeue.parked_expired"] == 1 and st.gauges["parked"] == 0 and st.gauges["inflight"] == 0, st
        # counted once, as the error its client got (it was in no finish reason: ei_router_requests_finished_total)
        ended = {k: v for k, v in st.counters.items() if k.startswith(("finished.", "finish."))}
        assert ended == {"finish.error": 1}, ended
