"""Two processes under one node id: a worker restarted while its old process was frozen (SIGSTOP, a paused VM),
then the old one resumed. Both reported ``node.state`` with their own sequences, so every alternation read as a
restart of the node: measured on a 2P2D faultkit run (w3 SIGSTOPped, a second w3 started, the first SIGCONTed),
28 fences in 15 s, 14 requests re-dispatched (prompts computed again), 1,309 duplicate chunks, with no end.
``NodeState.boot`` orders the incarnations: the router skips the earlier one's states while the later one is
not fenced, and the earlier worker stops itself (``services/worker``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.router.nodes import NodeLoadView
from shared.messages import NodeState, boot_older, new_boot

OLD = new_boot(1_000_000_000_000_000_000, b"\xff\xff\xff\xff")
NEW = new_boot(1_000_000_000_500_000_000, b"\x00\x00\x00\x00")


def test_boot_ids_order_by_start_time_and_unknown_is_never_older():
    assert boot_older(OLD, NEW) and not boot_older(NEW, OLD) and not boot_older(OLD, OLD)
    assert not boot_older("", NEW) and not boot_older(OLD, "")
    assert boot_older(new_boot(9, b"\x00"), new_boot(10, b"\x00"))  # zero-padded: 9 < 10 as strings too


def _state(seq: int, boot: str) -> NodeState:
    return NodeState(node="w3", phase="decode", seq=seq, boot=boot, gpu_free_blocks=10, gpu_total_blocks=10)


def test_an_earlier_process_resumed_under_the_node_id_does_not_fence_the_later_one():
    view = NodeLoadView(fence_after=3.0)
    view.apply_state(_state(500, OLD), 0.0)
    view.apply_state(_state(1, NEW), 1.0)  # the restart: its sequence went back, fenced once (its requests are gone)
    assert [f.cause for f in view.check_fences(1.0)] == ["restarted"]
    assert view.apply_state(_state(2, NEW), 1.1)  # let back in
    fences = []
    for i in range(10):  # the old process resumed: both report, alternating
        view.apply_state(_state(501 + i, OLD), 1.2 + 0.1 * i)
        view.apply_state(_state(3 + i, NEW), 1.25 + 0.1 * i)
        fences += view.check_fences(1.28 + 0.1 * i)
    assert fences == []
    assert view.superseded_states == 10
    assert view.nodes["w3"].state.boot == NEW


def test_the_earlier_process_counts_again_once_the_later_one_is_fenced():
    """A restart on a host whose clock is behind looks earlier: it is let in after fence_after, not never."""
    view = NodeLoadView(fence_after=3.0)
    view.apply_state(_state(7, NEW), 0.0)
    assert [f.cause for f in view.check_fences(3.5)] == ["silent"]
    assert view.apply_state(_state(1, OLD), 3.6)  # let back in
    assert view.superseded_states == 0 and view.nodes["w3"].state.boot == OLD


def test_a_worker_that_sees_a_later_process_under_its_node_id_stops_and_drops_its_work():
    from services.worker.service import Superseded, WorkerService

    failed: list[BaseException] = []

    def fail(e: BaseException, where: str) -> None:
        shell.fatal_error = e
        failed.append(e)

    shell = SimpleNamespace(boot=OLD, node="w3", counters={"superseded": 0, "work.superseded": 0}, fatal_error=None, _fail=fail)
    # no bus: a worker's bus reads no heartbeats (shared.auth.BEAT_WATCHERS), node.state.<n> alone tells it
    for boot in (OLD, "", new_boot(1, b"\x00")):  # its own state, an older publisher's, an earlier process's
        asyncio.run(WorkerService._on_own_state(shell, _state(1, boot), "ei.p0.node.state.w3"))
    assert failed == [] and not WorkerService._superseded(shell, "r1")
    asyncio.run(WorkerService._on_own_state(shell, _state(1, NEW), "ei.p0.node.state.w3"))
    assert len(failed) == 1 and isinstance(failed[0], Superseded) and shell.counters["superseded"] == 1
    assert WorkerService._superseded(shell, "r1") and shell.counters["work.superseded"] == 1


def test_a_malformed_boot_is_refused_at_decode_not_taken_for_a_later_process():
    """The every-subject fuzz (worker w0's own credentials) sent ``node.state.w0`` with boot ``w-invented``: as a
    string it sorts after every real boot, so w0 took itself for superseded and exited (the full suite's
    test_fuzz_every_subject_live: no reply on svc.stats.worker-w0). A boot that is not :func:`new_boot`'s shape is
    now refused at decode, counted and dropped as any malformed message, in each message that carries one."""
    import msgspec

    from shared.messages import Heartbeat, SplitCommand

    good = new_boot(1_796_464_475_152_062_829, b"\x9b\xe0Y~")
    for typ, base in ((NodeState, {"node": "w0"}), (Heartbeat, {"service": "worker", "instance": "worker-w0"}),
                      (SplitCommand, {"epoch": 1, "phases": {"w0": "prefill"}})):  # fmt: skip
        for boot in ("", good):
            assert msgspec.msgpack.decode(msgspec.msgpack.encode({**base, "boot": boot}), type=typ).boot == boot
        for boot in ("w-invented", "x" * 5000, "a.b", "\x00\xff", good + "-", "9" * 21 + "-00"):
            with pytest.raises(msgspec.ValidationError, match="boot"):
                msgspec.msgpack.decode(msgspec.msgpack.encode({**base, "boot": boot}), type=typ)
