"""A forgotten node's resync ends even when its cancel is lost.

``DirectoryService._forget`` / ``_drop_marks`` cancel the node's resync task once and drop it from ``_resyncs``:
the node is gone, and its resync would otherwise retry forever (``awaiting_resync`` stays true for a forgotten
node: it is resynced when heard again). Python 3.11's ``asyncio.wait_for`` (nats-py's request) answers a cancel that
comes in the loop turn the request's answer came (a dead node: the server's "no responders") with that answer, so
the task took it for one more failure and retried, every ``resync_backoff_max_s``, for the directory's lifetime,
untracked (a later resync of the node, heard again, ran beside it). Here the answer and the cancel come in one turn
on purpose.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import structlog

from services.kvdirectory.service import DirectoryService
from shared.bus import NoResponders


class _Shell:
    """What ``DirectoryService._resync`` touches: a node awaiting a resync for good (forgotten), a bus whose
    request waits in ``asyncio.wait_for`` for an answer the test gives (:attr:`answer`)."""

    def __init__(self) -> None:
        self.cfg = SimpleNamespace(resync_min_interval_s=0.0, resync_timeout_s=3600.0, resync_backoff_max_s=0.02)
        self.counters: Counter[str] = Counter()
        self._stopping = False
        self._last_resync: dict[str, float] = {}
        self.log = structlog.get_logger()
        self.clock = SimpleNamespace(now=lambda: 0.0, local_now=lambda: 0.0)
        self.asking = asyncio.Event()
        self.answer: asyncio.Future | None = None
        shell = self

        class Core:
            def awaiting_resync(self, node: str) -> bool:
                return True

            def resync_request(self, node: str) -> Any:
                return SimpleNamespace(node=node)

        class Bus:
            async def request(self, subject: Any, req: Any, **kw: Any) -> Any:
                shell.answer = asyncio.get_running_loop().create_future()
                shell.asking.set()
                await asyncio.wait_for(shell.answer, kw["timeout"])  # nats-py's request
                shell.asking.clear()
                raise NoResponders(f"no reply on kv.resync.{req.node}: NoRespondersError")

        self.core, self.bus = Core(), Bus()

    async def _maybe_flush(self) -> None:
        pass


@pytest.mark.timeout(30)
async def test_a_resync_cancelled_as_its_no_responders_comes_ends():
    shell = _Shell()
    task = asyncio.ensure_future(DirectoryService._resync(shell, "w0"))  # type: ignore[arg-type]
    await shell.asking.wait()
    assert shell.answer is not None
    shell.answer.set_result(b"503")  # the server's no-responders status, read in this turn
    task.cancel()  # _forget: the node went silent for too long
    done, _ = await asyncio.wait({task}, timeout=2)
    task.cancel()
    retried = shell.counters["resync.failures"]
    await asyncio.wait({task}, timeout=2)
    assert task in done, f"the forgotten node's resync still runs 2 s after its cancel ({retried} failed tries)"
    assert task.cancelled()


@pytest.mark.timeout(30)
async def test_a_resync_cancelled_as_its_snapshot_comes_does_not_apply_it():
    """The cancel lost in the turn a real snapshot came: before, the round went on, applied it and flushed, so the
    forgotten node's KV blocks came back into the directory (/tmp/rr-h/b.py). Now the task ends with its cancel."""
    shell = _Shell()
    applied: list[str] = []

    async def request(subject: Any, req: Any, **kw: Any) -> Any:
        shell.answer = asyncio.get_running_loop().create_future()
        shell.asking.set()
        await asyncio.wait_for(shell.answer, kw["timeout"])  # nats-py's request
        return SimpleNamespace(node=req.node, seq=1, block_size=16)

    def apply_snapshot(snap: Any, now: float) -> Any:
        applied.append(snap.node)
        return SimpleNamespace(status="resynced", blocks_stored=5, blocks_removed=0)

    shell.bus.request = request  # type: ignore[method-assign]
    shell.core.apply_snapshot = apply_snapshot  # type: ignore[attr-defined]
    task = asyncio.ensure_future(DirectoryService._resync(shell, "w0"))  # type: ignore[arg-type]
    await shell.asking.wait()
    assert shell.answer is not None
    shell.answer.set_result(b"snapshot")  # the node's snapshot, read in this turn
    task.cancel()  # _forget
    done, _ = await asyncio.wait({task}, timeout=2)
    task.cancel()
    await asyncio.wait({task}, timeout=2)
    assert applied == [], "the forgotten node's snapshot was applied after its cancel"
    assert task in done and task.cancelled()
