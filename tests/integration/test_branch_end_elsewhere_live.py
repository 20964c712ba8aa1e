"""A branch ended through a router that did not serve it (two routers behind one address; or the same after a
restart, whose table is in memory), live: real nats-server, the KV directory, a sim worker and two routers as
in-process services (their real shells and buses). Router A serves the branch's request; the directory counts its
blocks on the worker; the harness ends it through router B, whose table never saw it: B asks the directory
(``branch.query``), relays the ``BranchEnd``, answers 200, and the directory releases the branch's counts at once.
Before: B answered 404 and published nothing; the counts stayed (the blocks pinned in host KV against eviction)
until the directory's TTL expired the branch. A tool-call hint through B holds a branch A served; an id no router
ever saw is still a 404."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.kvdirectory.config import DirectoryConfig
from services.kvdirectory.service import DirectoryService
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from tests.integration.live import Services, open_bus, router_factory
from tests.integration.polling import answering, until

pytestmark = pytest.mark.timeout(90)
BS = 4  # the tiny profile's block size


def _keep(held: list[Any], cls: Any) -> Any:
    def make(c: Any, b: Any, clock: Any) -> Any:
        held.append(cls(c, b, clock))
        return held[-1]

    return make


async def test_a_branch_ended_through_a_router_that_never_saw_it_releases_its_counts(nats_url, tmp_path: Path):
    origin = time.time()
    async with AsyncExitStack() as stack:
        bus = await open_bus(stack, nats_url)
        svcs = Services(stack)
        dirs: list[DirectoryService] = []
        workers: list[WorkerService] = []
        routers: dict[str, list[RouterService]] = {"a": [], "b": []}
        tasks = [svcs.start("kvdirectory", DirectoryConfig(nats_url=nats_url, block_size=BS, counts_flush_s=0.02, clock_origin=origin,
                                                            # waits for both routers' republish markers, however late they
                                                            # start (without --routers it settled branch_sync_settle_s after its
                                                            # branch.sync with done == {} when the routers came up later: a
                                                            # loaded host's slow JetStream stream creation, CI run of 82308139)
                                                            routers=["router-a", "router-b"]),
                            _keep(dirs, DirectoryService)),
                 svcs.start("worker", WorkerConfig(nats_url=nats_url, node="w0", profile="tiny", phase="both", host_eviction="branch-count",
                                                   idle_state_interval_s=0.2, clock_origin=origin),
                            _keep(workers, WorkerService), instance="worker-w0")]  # fmt: skip
        for inst in ("kvdirectory", "worker-w0"):
            await answering(bus, inst, tasks)
        ports = {}
        for name in ("a", "b"):
            ports[name] = tmp_path / f"router-{name}.port"
            cfg = RouterConfig(nats_url=nats_url, clock_origin=origin, port=0, port_file=str(ports[name]), block_size=BS,
                               split_get_timeout_s=0.2, lookup_timeout_s=0.5, fence_after_s=10.0, request_timeout_s=60.0)  # fmt: skip
            svcs.start("router", cfg, router_factory(routers[name]), instance=f"router-{name}")
        for name in ("a", "b"):
            await until(lambda: ports[name].exists() and bool(routers[name]) and routers[name][0].ready(), 20.0, f"router {name} ready")
        d = dirs[0].core
        a = httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports['a'].read_text().strip()}", timeout=30.0)
        b = httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports['b'].read_text().strip()}", timeout=30.0)
        stack.push_async_callback(a.aclose)
        stack.push_async_callback(b.aclose)

        for bid in ("task-7", "task-8"):
            r = await a.post("/v1/completions", json={"prompt": list(range(100, 140)), "max_tokens": 2}, headers={"X-Branch-Id": bid})
            assert r.status_code == 200, r.text
        await until(lambda: all(bid in d.branches.branches and d.branches.branches[bid].counted for bid in ("task-7", "task-8")),
                    10.0, "the directory counts both branches on w0")  # fmt: skip
        path = list(d.branches.branches["task-7"].path)
        assert len(path) == 10 and all(d.count("w0", h) == 2 for h in path)  # both branches share the prompt
        assert not routers["b"][0].branches.is_active("task-7")  # B never saw it

        end = await b.post("/v1/branches/task-7/end")
        assert end.status_code == 200 and end.json() == {"branch_id": "task-7", "ended": True}, end.text
        await until(lambda: "task-7" in d.branches.ended and all(d.count("w0", h) == 1 for h in path), 10.0,
                    "the directory ends task-7 and releases its counts")  # fmt: skip
        assert d.counters["branch.ended"] == 1 and "task-7" not in d.branches.branches
        rb = routers["b"][0]
        assert rb.counters["branch_ends_relayed"] == 1 and rb.counters["branches_ended"] == 1
        assert dirs[0].counters["branch_queries.active"] == 1
        # the SDK's retry of that end through B: 200 already, nothing published (B remembers it)
        again = await b.post("/v1/branches/task-7/end")
        assert again.status_code == 200 and again.json()["already"] is True, again.text
        # through A, which served task-7: A heard B's relayed end (branch.events), so `already`, nothing published
        # (tests/integration/test_branch_end_heard_live.py; before, A still held it active and published a second
        # end, a duplicate at the directory)
        await until(lambda: not routers["a"][0].branches.is_active("task-7"), 10.0, "A heard the end")
        via_a = await a.post("/v1/branches/task-7/end")
        assert via_a.status_code == 200 and via_a.json() == {"branch_id": "task-7", "ended": True, "already": True}, via_a.text
        await asyncio.sleep(0.2)
        assert d.counters.get("branch.duplicate_end", 0) == 0
        assert all(d.count("w0", h) == 1 for h in path) and d.counters["branch.ended"] == 1

        # a tool-call hint through B holds task-8 at the directory
        holds = d.counters["branch.holds"]
        tc = await b.post("/v1/branches/task-8/tool-call", json={"expected_s": 60})
        assert tc.status_code == 200 and tc.json() == {"branch_id": "task-8", "outstanding": True, "expected_s": 60.0}, tc.text
        await until(lambda: d.counters["branch.holds"] == holds + 1, 10.0, "the directory holds task-8")
        assert d.branches.branches["task-8"].hold_until > 0

        # an id no router ever saw: 404 (once the directory has read both routers' answers to its branch.sync:
        # before that a 503, services/kvdirectory/settle.py), nothing published
        await until(lambda: dirs[0].sync.synced(dirs[0].clock.monotonic()), 10.0, "the directory settles")
        assert set(dirs[0].sync.done) == {"router-a", "router-b"} and not dirs[0].sync.timed_out, dirs[0].sync.done
        never = await b.post("/v1/branches/never-seen/end")
        assert never.status_code == 404 and "the KV directory does not know it" in never.json()["error"]["message"], never.text
        assert "never-seen" not in d.branches.ended and d.counters.get("branch.unknown_end", 0) == 0
        assert dirs[0].counters["branch_queries.unknown"] == 1
