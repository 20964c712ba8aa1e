"""The live replayer's progress bar on a stderr that closes during the run (``replay ... 2>&1 | head``, a log
reader gone): the bar's next write raised BrokenPipeError (tqdm passes EPIPE on): at its close, which ended the
replay with no result and so no report; at a redraw due on a request's answer (every 0.1 s on a terminal, 10 s in
a log), which killed that request's task, so the run waited forever for it (a `replay` of 43 s did not end in
120 s). Now the bar stops quietly and the run goes on to its result."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from evolving_infra.replay.core import Arrival
from evolving_infra.replay.live import LiveReplayer
from shared.clock import SimClock
from tests.unit.replay.stub_router import StubRouter
from tests.unit.replay.test_replay_live_stub import _trace


@pytest.mark.parametrize("tty", [False, True], ids=["log", "terminal"])
async def test_a_stderr_closed_mid_run_stops_the_progress_bar_not_the_replay(monkeypatch, tty):
    """``tty``: stderr says it is a terminal, so the bar redraws every 0.1 s: on the held request's answer too."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    err = os.fdopen(w, "w")
    err.isatty = lambda: tty  # type: ignore[method-assign]
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
        await asyncio.sleep(0.2)  # a terminal's redraw is due at the next answer
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
