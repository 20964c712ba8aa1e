"""A router frozen (SIGSTOP) across a KV directory restart, as separate OS processes (``evolving_infra.faultkit``:
real nats-server, directory, planner, workers, two routers): the restarted directory waits for the frozen router's
republish (it is named in ``--routers``, as ``up`` names its routers) and answers ``branch.query`` unsettled until its
``BranchSyncDone``, so an end of its branch through the other router is a 503 the harness retries, then 200 once it
resumes 15 s later. Before: the directory settled 10 s after its ``branch.sync`` without that router's branches (no
republished start read), and the end was a 404: lost, the branch's counts held until the TTL."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from evolving_infra.faultkit import FaultCluster, FaultSpec

pytestmark = pytest.mark.timeout(240)


async def test_an_end_through_another_router_while_the_routers_owner_is_frozen_across_a_directory_restart_is_not_lost(tmp_path: Path):
    spec = FaultSpec(nodes=2, split="1P1D", routers=2)
    async with FaultCluster(spec, tmp_path / "cluster") as fc:
        owner, other = fc.router_names()[1], fc.router_names()[0]
        async with httpx.AsyncClient(base_url=fc.router_url(1), timeout=30) as a, httpx.AsyncClient(base_url=fc.router_url(0), timeout=30) as b:
            body = {"model": "evolving-infra-sim", "prompt": list(range(1, 200)), "max_tokens": 2}
            r = await a.post("/v1/completions", json=body, headers={"X-Branch-Id": "frozen-1"})
            assert r.status_code == 200, r.text
            await asyncio.sleep(1.0)  # the directory reads its start (branch.events)
            fc.signal(owner, signal.SIGSTOP)
            stopped = time.monotonic()
            fc.signal("kvdirectory", signal.SIGKILL)
            fc.restart("kvdirectory")
            seen: list[tuple[float, int]] = []
            resumed = False
            while time.monotonic() - stopped < 120:
                if not resumed and time.monotonic() - stopped >= 15.0:  # past --branch-sync-settle-s (10 s)
                    fc.signal(owner, signal.SIGCONT)
                    resumed = True
                e = await b.post("/v1/branches/frozen-1/end")
                seen.append((round(time.monotonic() - stopped, 1), e.status_code))
                if e.status_code != 503:
                    break
                assert e.headers["retry-after"] == "1"
                await asyncio.sleep(0.5)
            if not resumed:
                fc.signal(owner, signal.SIGCONT)
            assert seen[-1][1] == 200 and seen[-1][0] >= 15.0, (seen[-4:], other)  # before: 404 ~10 s after the restart
            d = await fc.stats("kvdirectory", 10.0)
            assert d is not None and d.counters.get("branch_sync.markers", 0) == 2 and not d.counters.get("branch_sync.timed_out")
            # the 200 comes before the end reaches the directory over the bus (session 55's final CI read 0 there once)
            until = time.monotonic() + 10.0
            while d.counters.get("branch.ended", 0) != 1 and time.monotonic() < until:
                await asyncio.sleep(0.2)
                d = await fc.stats("kvdirectory", 10.0) or d
            assert d.counters.get("branch.ended", 0) == 1, d.counters
