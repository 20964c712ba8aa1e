"""A decode binding (``WorkerService._bind``) ends when its one cancel is lost.

An abort (``_drop``) or ``_forget`` cancels the binding's task once and drops it from ``_binds``. Python 3.11's
``asyncio.wait_for`` (nats-py's request) answers a cancel that comes in the loop turn the router's reply came with
that reply, so the task went on: with "no decode node" it retried until ``bind_timeout_s`` (``owner_gone_after_s``
for unanswered tries), untracked; with a reply that ends the loop it counted ``bind.after_end`` (the aborted request
is no longer in the core) for a request that did not end here. Here the reply and the cancel come in one turn on
purpose, as in tests/unit/kvdirectory/test_resync_lost_cancel.py.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from services.worker.service import WorkerService
from shared import messages as m


class _Shell:
    """What ``WorkerService._bind`` touches: a request the core no longer holds (the abort removed it), a bus whose
    request waits in ``asyncio.wait_for`` for a reply the test gives (:attr:`answer`)."""

    def __init__(self, reason: str) -> None:
        self.cfg = SimpleNamespace(bind_timeout_s=3600.0, owner_gone_after_s=3600.0)
        self.node = "w0"
        self.counters: Counter[str] = Counter()
        self._traces = None
        self._binds: dict[str, asyncio.Task[None]] = {}
        self._handing_off: dict[str, asyncio.Task[None]] = {}
        self._step_rids: set[str] = set()
        self.core = SimpleNamespace(parked={}, requests={})
        self.clock = SimpleNamespace(now=lambda: 0.0, local_now=lambda: 0.0)
        self.asking = asyncio.Event()
        self.answer: asyncio.Future | None = None
        shell = self

        class Bus:
            nc = SimpleNamespace(is_connected=True)

            async def request(self, subject: Any, req: Any, **kw: Any) -> Any:
                shell.answer = asyncio.get_running_loop().create_future()
                shell.asking.set()
                await asyncio.wait_for(shell.answer, kw["timeout"])  # nats-py's request
                shell.asking.clear()
                return m.DecodeBindReply(rid=req.rid, reason=reason)

        self.bus = Bus()

    def _input(self) -> None:  # the step loop's wake-up, at the binding's end
        pass


@pytest.mark.timeout(30)
@pytest.mark.parametrize("reason", ["no decode node with KV room", "not pending"])
async def test_a_binding_cancelled_as_its_reply_comes_ends_cancelled(reason: str):
    shell = _Shell(reason)
    work = m.PrefillWork(rid="r1", prompt_tokens=8, max_tokens=4, block_size=4)
    task = asyncio.ensure_future(WorkerService._bind(shell, work, 0.0))  # type: ignore[arg-type]
    await shell.asking.wait()
    assert shell.answer is not None
    shell.answer.set_result(b"reply")  # the router's reply, read in this turn
    task.cancel()  # _drop: the router aborted the request
    done, _ = await asyncio.wait({task}, timeout=2)
    task.cancel()
    retried = shell.counters["bind.retries"]
    await asyncio.wait({task}, timeout=2)
    assert task in done, f"the aborted request's binding still runs 2 s after its cancel ({retried} retries)"
    assert task.cancelled()
    assert shell.counters["bind.after_end"] == 0 and shell.counters["bind.failed"] == 0, shell.counters
