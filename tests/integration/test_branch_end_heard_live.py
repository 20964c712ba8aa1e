"""Two routers behind one address, live (real nats-server, the KV directory, a sim worker, routers A and B as
in-process services with their real shells and buses), after ``branch.query`` (an end through the router that did
not serve the branch is relayed):

* the router that served the branch hears the end another router relayed (its core subscription to
  ``branch.events``): its table ends the branch, so a request on it through A is refused as through B, its
  ``branches_active`` drops, and a restarted directory is not given the branch back by A's republish. Before, A
  kept it active (a request through A served 200, through B 400) and republished it to the restarted directory,
  which counted its blocks again until the TTL (1,800 s). A tool-call hint relayed through B holds the branch in
  A's table (its cap and TTL keep it, as the directory's do);
* a restarted directory answers ``branch.query`` ``synced=false`` until it has read the routers' republish: an end
  through B of a branch A holds, sent while the directory rebuilds its table, is a 503 the harness retries, then
  relayed, never a 404 (before, a 404: the end lost, the counts held until the TTL);
* a router restarted since the branch ended remembers the directory's ``ended`` answer: a request on the branch is
  then a 400 and a tool call a 410 (before, the request was served 200 and started the branch anew in its table,
  and a tool call on it was held, while the directory ignored both).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.kvdirectory.config import DirectoryConfig
from services.kvdirectory.service import DirectoryService
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from shared import messages as m
from shared.subjects import BRANCH_SYNC, SVC_HEARTBEAT
from tests.integration.live import Services, open_bus, router_factory
from tests.integration.polling import answering, until
from tests.integration.test_branch_end_elsewhere_live import _keep

pytestmark = pytest.mark.timeout(180)
BS = 4  # the tiny profile's block size
BODY = {"prompt": list(range(100, 140)), "max_tokens": 2}


@dataclass
class _Cluster:
    svcs: Services
    dcfg: DirectoryConfig
    dirs: list[DirectoryService]
    routers: dict[str, list[RouterService]]
    http: dict[str, httpx.AsyncClient]
    dir_task: asyncio.Task[None]
    router_tasks: dict[str, asyncio.Task[None]]
    origin: float
    nats_url: str
    tmp: Path

    async def start_router(self, stack: AsyncExitStack, name: str) -> None:
        """Serve router ``name`` (instance ``router-<name>``) and open its HTTP client."""
        port = self.tmp / f"router-{name}-{len(self.routers.setdefault(name, []))}.port"
        cfg = RouterConfig(nats_url=self.nats_url, clock_origin=self.origin, port=0, port_file=str(port), block_size=BS,
                           split_get_timeout_s=0.2, lookup_timeout_s=0.5, fence_after_s=10.0, request_timeout_s=60.0)  # fmt: skip
        held = self.routers[name]
        n = len(held)
        self.router_tasks[name] = self.svcs.start("router", cfg, router_factory(held), instance=f"router-{name}")
        await until(lambda: port.exists() and len(held) > n and held[-1].ready(), 30.0, f"router {name} ready")
        self.http[name] = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port.read_text().strip()}", timeout=30.0)
        stack.push_async_callback(self.http[name].aclose)

    async def restart_directory(self) -> DirectoryService:
        """Stop the directory (its branch table is lost) and start a new one; returns the new one."""
        self.svcs.stops[self.svcs.tasks.index(self.dir_task)].set()
        await self.dir_task
        n = len(self.dirs)
        self.dir_task = self.svcs.start("kvdirectory", self.dcfg, _keep(self.dirs, DirectoryService))
        await until(lambda: len(self.dirs) > n, 10.0, "the new directory")
        return self.dirs[-1]

    async def restart_router(self, stack: AsyncExitStack, name: str) -> RouterService:
        """Stop router ``name`` (its branch table is lost) and start it again under the same instance."""
        task = self.router_tasks[name]
        self.svcs.stops[self.svcs.tasks.index(task)].set()
        await task
        await self.start_router(stack, name)
        return self.routers[name][-1]


async def _cluster(stack: AsyncExitStack, nats_url: str, tmp: Path, **dir_kw: float) -> _Cluster:
    origin = time.time()
    bus = await open_bus(stack, nats_url)
    svcs = Services(stack)
    dirs: list[DirectoryService] = []
    dcfg = DirectoryConfig(nats_url=nats_url, block_size=BS, counts_flush_s=0.02, clock_origin=origin, **dir_kw)  # type: ignore[arg-type]
    t_dir = svcs.start("kvdirectory", dcfg, _keep(dirs, DirectoryService))
    t_w = svcs.start("worker", WorkerConfig(nats_url=nats_url, node="w0", profile="tiny", phase="both", host_eviction="branch-count",
                                            idle_state_interval_s=0.2, clock_origin=origin), _keep([], WorkerService), instance="worker-w0")  # fmt: skip
    for inst in ("kvdirectory", "worker-w0"):
        await answering(bus, inst, [t_dir, t_w])
    c = _Cluster(svcs, dcfg, dirs, {}, {}, t_dir, {}, origin, nats_url, tmp)
    for name in ("a", "b"):
        await c.start_router(stack, name)
    # both have answered the directory's branch.sync (sent again to a router heard after it; a test that restarts the
    # directory counts their next answer from here)
    await until(lambda: all(c.routers[n][0].counters["branch_sync.requests"] == 1 for n in ("a", "b")), 10.0, "routers answered the sync")
    await until(lambda: dirs[0].counters["branch_sync.markers"] == 2, 10.0, "the directory reads both markers")
    return c


async def test_the_router_that_served_a_branch_hears_its_end_relayed_through_another(nats_url, tmp_path: Path):
    async with AsyncExitStack() as stack:
        c = await _cluster(stack, nats_url, tmp_path)
        a, b = c.http["a"], c.http["b"]
        ra, rb = c.routers["a"][0], c.routers["b"][0]
        d = c.dirs[0].core
        heard0 = rb.bus.counters["received.branch.events"]  # the routers' markers (BranchSyncDone) B read
        for bid in ("t1", "t2"):
            r = await a.post("/v1/completions", json=BODY, headers={"X-Branch-Id": bid})
            assert r.status_code == 200, r.text
        await until(lambda: all(bid in d.branches.branches and d.branches.branches[bid].counted for bid in ("t1", "t2")),
                    10.0, "the directory counts t1 and t2")  # fmt: skip
        await until(lambda: rb.bus.counters["received.branch.events"] == heard0 + 2, 10.0, "B reads A's branch.events")
        path = list(d.branches.branches["t1"].path)
        assert ra.branches.active_count == 2

        e = await b.post("/v1/branches/t1/end")
        assert e.status_code == 200 and e.json() == {"branch_id": "t1", "ended": True}, e.text
        await until(lambda: "t1" in d.branches.ended, 10.0, "the directory ends t1")
        # A hears B's relayed end: ended in its table too (before: active for ever, until its TTL)
        await until(lambda: not ra.branches.is_active("t1"), 10.0, "router A ends t1 (it heard B's end)")
        assert ra.counters["branch_ends_heard"] == 1 and ra.branches.active_count == 1
        r = await a.post("/v1/completions", json={"prompt": list(range(100, 150)), "max_tokens": 2}, headers={"X-Branch-Id": "t1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Branch-Id", r.text  # as through B
        r = await b.post("/v1/completions", json=BODY, headers={"X-Branch-Id": "t1"})
        assert r.status_code == 400, r.text
        again = await a.post("/v1/branches/t1/end")  # the SDK's retry through A: `already`, nothing published
        assert again.status_code == 200 and again.json()["already"] is True, again.text
        assert rb.counters["branch_ends_heard"] == 0  # its own end's echo is not "heard"
        assert ra.counters["branches_ended"] == 0  # B's end, counted there (branch_ends_relayed)

        # the other way round: A ends t4, which B never saw; B hears it and refuses a request on it, as A does (before,
        # B served it 200 and started it anew in its table, its BranchStart refused by the directory)
        r = await a.post("/v1/completions", json=BODY, headers={"X-Branch-Id": "t4"})
        assert r.status_code == 200, r.text
        assert (await a.post("/v1/branches/t4/end")).status_code == 200
        await until(lambda: rb.counters["branch_ends_heard"] == 1, 10.0, "router B hears A's end of t4")
        r = await b.post("/v1/completions", json=BODY, headers={"X-Branch-Id": "t4"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Branch-Id", r.text
        assert ra.counters["branch_ends_heard"] == 1  # its own end's echo is not "heard"

        # a tool-call hint through B holds t2 in A's table too (A's cap and TTL keep it while the tool runs)
        tc = await b.post("/v1/branches/t2/tool-call", json={"expected_s": 600})
        assert tc.status_code == 200 and tc.json()["expected_s"] == 600.0, tc.text
        await until(lambda: ra.branches.hold_left("t2", ra.clock.local_now()) > 500, 10.0, "router A holds t2")
        assert ra.counters["branch_tool_calls_heard"] == 1 and rb.counters["branch_tool_calls_heard"] == 0

        # the directory restarts: A republishes t2 only; t1 is not counted again (before: counted until the TTL)
        d2 = (await c.restart_directory()).core
        await until(lambda: "t2" in d2.branches.branches and d2.branches.branches["t2"].counted, 20.0, "t2 republished")
        await asyncio.sleep(0.5)
        assert "t1" not in d2.branches.branches
        t2_path = set(d2.branches.branches["t2"].path)
        assert all(d2.count("w0", h) == (1 if h in t2_path else 0) for h in path)


async def test_an_end_through_another_router_while_a_restarted_directory_rebuilds_is_retried_not_lost(nats_url, tmp_path: Path):
    """Router A holds 20,000 branches (as many agents), ``late`` its newest: the restarted directory reads A's
    republish for a second or more, and ``late`` last. B's end of ``late`` in that window: 503 (no directory, then
    ``unknown`` unsynced) until the directory has read it, then relayed, 200."""
    async with AsyncExitStack() as stack:
        c = await _cluster(stack, nats_url, tmp_path)  # --branch-sync-settle-s 10 s
        a, b = c.http["a"], c.http["b"]
        ra = c.routers["a"][0]
        now = ra.clock.local_now()
        started = ra.clock.now() - 1.0  # their BranchStart.ts: each started before the directory's branch.sync
        for i in range(20_000):
            ra.branches.observe(f"syn-{i}", now, ts=started + i * 1e-6)
            ra.branches.done(f"syn-{i}", now)
        r = await a.post("/v1/completions", json=BODY, headers={"X-Branch-Id": "late"})
        assert r.status_code == 200, r.text
        await until(lambda: "late" in c.dirs[0].core.branches.branches, 10.0, "the directory has late")

        c.svcs.stops[c.svcs.tasks.index(c.dir_task)].set()
        await c.dir_task
        n = len(c.dirs)
        c.dir_task = c.svcs.start("kvdirectory", c.dcfg, _keep(c.dirs, DirectoryService))
        seen: list[tuple[int, str]] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            e = await b.post("/v1/branches/late/end")
            seen.append((e.status_code, e.json().get("error", {}).get("message", "")))
            if e.status_code != 503:
                break
            assert e.headers["retry-after"] == "1"
            await asyncio.sleep(0.02)
        assert seen[-1][0] == 200, seen[-3:]  # before: 404 "unknown branch 'late' ... the KV directory does not know it"
        d2 = c.dirs[n]
        await until(lambda: "late" in d2.core.branches.ended, 10.0, "the new directory ends late")
        await until(lambda: not ra.branches.is_active("late"), 10.0, "A heard the end")
        unsynced = [msg for s, msg in seen if "has not yet read the routers' republish" in msg]
        assert all(s in (200, 503) for s, _ in seen)
        assert unsynced == [] or c.routers["b"][0].counters["branch_queries_unsynced"] == len(unsynced)

        # an id nobody holds: 503 while the directory has not settled, 404 once it has
        if not d2.sync.synced(d2.clock.monotonic()):
            r = await b.post("/v1/branches/never-seen/end")
            assert r.status_code == 503 and "republish" in r.json()["error"]["message"], r.text
        await until(lambda: d2.sync.synced(d2.clock.monotonic()), 60.0, "the directory settles", every=0.1)
        assert d2.stats()[1]["branch_sync.synced"] == 1.0
        assert d2.sync.republished == 20_001 == d2.counters["branch_sync.republished"], (d2.sync.republished, seen[-3:])
        r = await b.post("/v1/branches/never-seen/end")
        assert r.status_code == 404 and "does not know it either" in r.json()["error"]["message"], r.text


async def test_a_router_stalled_past_settle_s_is_waited_for_and_an_end_elsewhere_is_not_lost(nats_url, tmp_path: Path, monkeypatch):
    """Router A holds ``s1``; the directory restarts while A is stalled (its answer to ``branch.sync`` 13 s late, past
    ``--branch-sync-settle-s``' 10 s, as a SIGSTOP or swap would make it). The directory knows A (its heartbeat) and
    stays unsettled until A's republish ends with its ``BranchSyncDone``: B's end of ``s1`` meanwhile is a 503 the
    harness retries, then relayed, 200. Before: the directory settled 10 s after its ``branch.sync`` (no republished
    start read), answered ``unknown`` synced, and B answered 404: the end lost, A's branch counted until the TTL."""
    real = RouterService._on_branch_sync
    stall_until = [0.0]

    async def stalled(self: RouterService, msg: m.BranchSync, subject: str) -> None:
        while self.bus.instance == "router-a" and time.monotonic() < stall_until[0]:
            await asyncio.sleep(0.05)
        await real(self, msg, subject)

    monkeypatch.setattr(RouterService, "_on_branch_sync", stalled)
    async with AsyncExitStack() as stack:
        c = await _cluster(stack, nats_url, tmp_path)  # --branch-sync-settle-s 10 s
        a, b = c.http["a"], c.http["b"]
        ra = c.routers["a"][0]
        r = await a.post("/v1/completions", json=BODY, headers={"X-Branch-Id": "s1"})
        assert r.status_code == 200, r.text
        await until(lambda: "s1" in c.dirs[0].core.branches.branches, 10.0, "the directory has s1")

        stall_until[0] = time.monotonic() + 13.0
        d2 = await c.restart_directory()
        t0 = time.monotonic()
        seen: list[tuple[float, int, str]] = []
        while time.monotonic() - t0 < 50:
            e = await b.post("/v1/branches/s1/end")
            seen.append((round(time.monotonic() - t0, 2), e.status_code, e.json().get("error", {}).get("message", "")))
            if e.status_code != 503:
                break
            assert e.headers["retry-after"] == "1"
            await asyncio.sleep(0.5)
        # before: 404 "unknown branch 's1' ... the KV directory does not know it either" about 10 s in
        assert seen[-1][1] == 200, seen[-3:]
        assert seen[-1][0] >= 11.0, seen[-3:]  # answered only once A had republished
        await until(lambda: "s1" in d2.core.branches.ended, 10.0, "the new directory ends s1")
        await until(lambda: not ra.branches.is_active("s1"), 10.0, "A heard the end")
        assert d2.sync.done.get("router-a") == 1 and d2.sync.done.get("router-b") == 0, d2.sync.done
        assert not d2.sync.timed_out and d2.counters["branch_sync.markers"] == 2
        assert ra.counters["branch_sync.requests"] == 2  # the first directory's, then the repeated one answered once
        assert ra.counters["branch_sync.repeated"] >= 1 and d2.counters["branch_sync.resent"] >= 3  # about one a second while A stalls


async def test_a_forged_router_heartbeat_does_not_hold_a_directory_given_routers_unsettled(nats_url, tmp_path: Path, monkeypatch):
    """A directory given ``--routers router-a,router-b`` (as up, compose and Slurm give theirs) hears heartbeats of
    ``router-ghost``, a router that does not exist (one router's credentials may beat under any instance), while A's
    answer is 3 s late: it settles on A's and B's markers, logging the ghost (``branch_sync.routers_unnamed``).
    Before, the ghost was waited for: unsettled until ``--branch-sync-max-s``, every end of a branch it lacked a 503
    all that while."""
    real = RouterService._on_branch_sync
    stall_until = [0.0]

    async def stalled(self: RouterService, msg: m.BranchSync, subject: str) -> None:
        while self.bus.instance == "router-a" and time.monotonic() < stall_until[0]:
            await asyncio.sleep(0.05)
        await real(self, msg, subject)

    monkeypatch.setattr(RouterService, "_on_branch_sync", stalled)
    async with AsyncExitStack() as stack:
        c = await _cluster(stack, nats_url, tmp_path, routers=["router-a", "router-b"], branch_sync_max_s=40.0)  # type: ignore[arg-type]
        forger = await open_bus(stack, nats_url, "router-ghost")
        beating = True

        async def beat() -> None:
            while beating:
                await forger.publish(SVC_HEARTBEAT, m.Heartbeat(service="router", instance="router-ghost"), service="router")
                await asyncio.sleep(0.2)

        task = asyncio.create_task(beat())
        try:
            await asyncio.sleep(0.5)
            stall_until[0] = time.monotonic() + 3.0
            d2 = await c.restart_directory()
            await until(lambda: d2.sync.settled_at is not None, 20.0, "the new directory settles")  # before: 40 s
            assert not d2.sync.timed_out and set(d2.sync.done) == {"router-a", "router-b"}, d2.sync.done
            assert d2.sync.settled_at - (d2.sync.sync_at or 0.0) >= 2.5  # on A's late marker
            assert d2.counters["branch_sync.routers_unnamed"] == 1 and d2.sync.unnamed == {"router-ghost"}
            assert d2.counters["branch_sync.routers_heard"] == 0
        finally:
            beating = False
            await task


async def test_a_restarted_router_remembers_the_directorys_ended_answer(nats_url, tmp_path: Path):
    async with AsyncExitStack() as stack:
        c = await _cluster(stack, nats_url, tmp_path)
        d = c.dirs[0].core
        r = await c.http["a"].post("/v1/completions", json=BODY, headers={"X-Branch-Id": "t3"})
        assert r.status_code == 200, r.text
        await until(lambda: "t3" in d.branches.branches, 10.0, "the directory has t3")
        e = await c.http["a"].post("/v1/branches/t3/end")
        assert e.status_code == 200, e.text
        await until(lambda: "t3" in d.branches.ended, 10.0, "the directory ends t3")

        ra2 = await c.restart_router(stack, "a")  # its table is in memory: t3 is unknown to it
        a = c.http["a"]
        e = await a.post("/v1/branches/t3/end")  # the harness's retry: the directory says ended
        assert e.status_code == 200 and e.json()["already"] is True, e.text
        r = await a.post("/v1/completions", json=BODY, headers={"X-Branch-Id": "t3"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Branch-Id", r.text  # before: 200
        assert not ra2.branches.is_active("t3")
        tc = await a.post("/v1/branches/t3/tool-call")
        assert tc.status_code == 410, tc.text
        assert ra2.counters["branch_queries.ended"] == 1  # remembered: the request and tool call asked nothing


async def test_a_router_republishing_20000_branches_yields_so_the_directory_reads_them_as_they_go(nats_url, tmp_path: Path):
    """A router's republish (its answer to a restarted directory's ``branch.sync``) gives the event loop back as it
    goes: the directory (in this process, on the same loop) reads republished starts while the router is still
    republishing, and the loop never stalls for the whole republish. Before, the router published all 20,000 at once
    (a publish does not wait): nothing else ran meanwhile (at 65,536 branches, 4.3 s), and the directory, which
    settles once the republish has gone quiet, read nothing until the router had done."""
    async with AsyncExitStack() as stack:
        c = await _cluster(stack, nats_url, tmp_path)
        ra = c.routers["a"][0]
        now = ra.clock.local_now()
        started = ra.clock.now() - 1.0
        for i in range(20_000):
            ra.branches.observe(f"syn-{i}", now, ts=started + i * 1e-6)
            ra.branches.done(f"syn-{i}", now)
        c.svcs.stops[c.svcs.tasks.index(c.dir_task)].set()
        await c.dir_task
        n = len(c.dirs)
        c.dir_task = c.svcs.start("kvdirectory", c.dcfg, _keep(c.dirs, DirectoryService))
        await until(lambda: len(c.dirs) > n, 10.0, "the new directory")
        d2 = c.dirs[n]
        read_while_republishing = 0
        ended_meanwhile = False
        while ra.counters["branch_sync.requests"] == 1:  # this loop runs only when the router yields (1: the first directory's)
            read_while_republishing = max(read_while_republishing, d2.sync.republished)
            if not ended_meanwhile:  # the last branch leaves the table (an end, or the cap's eviction) mid-republish:
                ra.branches.end("syn-19999", ra.clock.local_now())  # its start, listed before, must not go out after it
                ended_meanwhile = True
            await asyncio.sleep(0.001)
        assert ended_meanwhile and 0 < read_while_republishing < 20_000, read_while_republishing
        await until(lambda: d2.sync.republished == 19_999, 30.0, "every republished start read")
        await asyncio.sleep(0.3)
        assert d2.sync.republished == 19_999
        assert d2.core.branch_state("syn-19999", d2.clock.local_now()) == "unknown"
        assert d2.core.branch_state("syn-19998", d2.clock.local_now()) == "active"


async def test_a_republish_larger_than_the_resend_window_waits_for_room_and_keeps_every_message_in_it(nats_url, tmp_path: Path):
    """Router A holds 65,536 branches (``--max-active-branches``' default), each placed for prefill and decode: its
    answer to ``branch.sync`` is 196,608 reliable publishes. It waits for room in its bus's resend window (the
    publishes the server has not been seen to read, ``RESEND_MAX_MSGS``) as it goes, so none leaves the window
    unconfirmed. Before: at ~17,000 a second the window (the last 2-3 s) passed 50,000 and the oldest were dropped from
    it (``resend_window_dropped``; 27,579 of 131,072 measured): lost had the connection died then (a reconnect
    publishes the window again), so a directory read the last 50,000 and a few of such a republish."""
    async with AsyncExitStack() as stack:
        c = await _cluster(stack, nats_url, tmp_path)
        ra = c.routers["a"][0]
        now = ra.clock.local_now()
        started = ra.clock.now() - 1.0
        for i in range(65_536):
            bid = f"big-{i}"
            ra.branches.observe(bid, now, ts=started + i * 1e-6)
            ra.branches.done(bid, now)
            for phase in ("prefill", "decode"):
                ra.branches.note_placed(m.RoutePlaced(rid=f"r{i}", branch_id=bid, node="w0", phase=phase, block_hashes=list(range(16))))
        c.svcs.stops[c.svcs.tasks.index(c.dir_task)].set()  # no directory reads it: the router publishes at full speed
        await c.dir_task
        bus = await open_bus(stack, c.nats_url, instance="sync-sender")
        await bus.publish(BRANCH_SYNC, m.BranchSync(directory="test", ts=ra.clock.now(), sync_id="big-sync"))
        t0 = time.monotonic()
        await until(lambda: ra.counters["branch_sync.requests"] == 2, 180.0, "A republished", every=0.2)
        took = time.monotonic() - t0
        assert ra.counters["branch_sync.branches"] == 65_536  # (its answer to the first directory held none)
        assert ra.bus.counters["published.route.placed"] >= 131_072
        # before: resend_window_dropped > 0 (the oldest of the republish left the window unconfirmed)
        assert ra.bus.counters.get("resend_window_dropped", 0) == 0, (ra.bus.counters.get("resend_window_dropped"), took)
        assert ra.counters.get("branch_sync.window_full", 0) == 0, took
