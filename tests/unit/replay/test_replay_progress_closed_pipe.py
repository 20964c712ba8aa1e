"""The live replayer's progress bar on a stderr that closes during the run (``replay ... 2>&1 | head``, a log
reader gone): the bar's next write raised BrokenPipeError (tqdm passes EPIPE on), which ended the replay with no
result and so no report. Now the bar stops quietly and the run goes on to its result."""

from __future__ import annotations

import asyncio
import os
import sys

from evolving_infra.replay.core import Arrival
from evolving_infra.replay.live import LiveReplayer
from shared.clock import SimClock
from tests.unit.replay.stub_router import StubRouter
from tests.unit.replay.test_replay_live_stub import _trace


async def test_a_stderr_closed_mid_run_stops_the_progress_bar_not_the_replay(monkeypatch):
    r, w = os.pipe()
    os.set_blocking(r, False)
    err = os.fdopen(w, "w")
    monkeypatch.setattr(sys, "stderr", err)
    stub = StubRouter(hold=asyncio.Event())
    url = await stub.start()
    try:
        replayer = LiveReplayer(url, SimClock(1000.0), block_size=4, progress=True)
        run = asyncio.create_task(replayer.run(_trace(), Arrival(kind="closed", concurrency=1)))
        assert stub.received is not None and stub.hold is not None
        await asyncio.wait_for(stub.received.wait(), 10)  # the run is on: its bar drawn, its first request held
        assert b"replay" in os.read(r, 1 << 16)
        os.close(r)  # the reader goes: each write to stderr from now on is EPIPE
        stub.hold.set()
        res = await asyncio.wait_for(run, 10)
    finally:
        await stub.close()
        monkeypatch.undo()
        try:
            err.close()
        except BrokenPipeError:  # what the bar had buffered when it stopped
            pass
    assert [rec.ok for rec in res.records] == [True] * 3 and not res.interrupted
    assert res.branch_end_failures == 0
