"""Liveness of each node's KV view (issue #22): is a node that serves still reporting its KV?

Pure bookkeeping; no I/O; every call takes ``now`` in seconds (the directory passes
``time.monotonic()`` through its clock: durations of its own, which a step of the wall clock must
not move).
A node that runs requests stores and frees KV blocks, so it sends ``kv.events`` batches; while
it serves and stores none (a long decode: output tokens store no block) it sends an empty
*alive* batch every ``--kv-alive-interval-s`` (1 s, ``services/worker``; before, a healthy node
decoding past ``stale_after`` was called stale). One that serves and sends none has a broken
KV publisher (the failure of Dynamo #11984 and TensorRT-LLM #14882), and the directory's view
of it silently rots. Per node this keeps:

* ``silent_s(now)``: seconds it has *served* since its last KV batch — the time between
  consecutive ``node.state`` reports during which it had running or waiting requests
  (idle time does not count: an idle node rightly sends nothing);
* ``stale``: set by :meth:`KvLiveness.check` once ``silent_s`` exceeds ``stale_after``;
  cleared by the node's next batch. While stale, lookups leave the node out (no prefix
  credit, no fetch source) and the directory asks it for one resync per stale episode;
* ``last_heard``: when the node last sent anything the directory hears from it (a KV batch
  or a ``node.state``; a worker publishes a state at least every second while it runs).
  :meth:`KvLiveness.forget` marks *forgotten* every node unheard for longer than the
  directory's ``--forget-node-after-s`` (a worker SIGKILLed and never restarted), once; the
  directory then drops its KV. :meth:`KvLiveness.heard` clears the mark (the node is back).
  A forgotten node is left out of :meth:`KvLiveness.report` and :meth:`KvLiveness.check`, and
  :meth:`KvLiveness.drop` removes it once the directory gave its slot to another node (then it
  is gone for good: node ids that change on every restart do not pile up here).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Node:
    silent: float = 0.0
    """Serving seconds accumulated since the last batch, up to ``last_state``."""
    serving: bool = False
    """What the last state said."""
    last_state: float | None = None
    last_batch: float | None = None
    stale: bool = False
    last_heard: float | None = None
    """When the node's last KV batch or state arrived (:meth:`KvLiveness.heard`; the caller's clock)."""
    forgotten: bool = False
    """Unheard for longer than the forget limit (set by :meth:`KvLiveness.forget`)."""
    first_heard: float | None = None
    """When the node was first heard (:meth:`KvLiveness.heard`; the caller's clock)."""


class KvLiveness:
    """Per-node KV liveness.

    Args:
        stale_after: seconds a serving node may go without a KV batch before its view is stale (> 0).

    Raises:
        ValueError: ``stale_after`` <= 0.
    """

    def __init__(self, stale_after: float) -> None:
        if stale_after <= 0:
            raise ValueError(f"stale_after must be > 0, got {stale_after}")
        self.stale_after = stale_after
        self._nodes: dict[str, _Node] = {}

    def batch(self, node: str, now: float) -> bool:
        """A KV batch of ``node`` arrived. Returns True when the node was stale (fresh again)."""
        n = self._nodes.setdefault(node, _Node())
        was = n.stale
        n.silent, n.last_batch, n.stale = 0.0, now, False
        if n.last_state is not None:
            n.last_state = max(n.last_state, now)
        return was

    def state(self, node: str, serving: bool, now: float) -> None:
        """``node`` reported a state: ``serving`` = it has running or waiting requests. The time
        since its previous state counts as serving time when that state said it served."""
        n = self._nodes.setdefault(node, _Node())
        if n.serving and n.last_state is not None and now > n.last_state:
            n.silent += now - n.last_state
        n.serving, n.last_state = serving, now

    def heard(self, node: str, now: float) -> bool:
        """``node`` sent a KV batch or a state at ``now`` (s). Returns True when it was
        forgotten (it is back: its KV must come back whole, by a resync). O(1)."""
        n = self._nodes.setdefault(node, _Node())
        was = n.forgotten
        n.forgotten = False
        if n.last_heard is None or now > n.last_heard:
            n.last_heard = now
        if n.first_heard is None:
            n.first_heard = now
        return was

    def batchless(self, now: float, after: float) -> list[str]:
        """Nodes heard (a ``node.state``) more than ``after`` seconds before ``now`` of which no KV
        batch has been heard since, not forgotten; sorted. The directory asks those whose KV it
        has no view of for a snapshot (``DirectoryService``: an idle node sends no batch). O(nodes)."""
        return sorted(
            k for k, n in self._nodes.items()
            if n.last_batch is None and not n.forgotten and n.first_heard is not None and now - n.first_heard > after
        )  # fmt: skip

    def forget(self, now: float, after: float) -> list[str]:
        """Mark forgotten every node not :meth:`heard` for more than ``after`` seconds (> 0) before
        ``now``; returns those newly forgotten (sorted; once per silence). Nodes never heard are
        left alone. O(nodes)."""
        out = []
        for name, n in sorted(self._nodes.items()):
            if not n.forgotten and n.last_heard is not None and now - n.last_heard > after:
                n.forgotten = True
                out.append(name)
        return out

    def drop(self, node: str) -> bool:
        """Remove everything kept of ``node`` (gone for good: the directory gave its slot to
        another node); heard again, it is a new node. Returns whether it was kept. O(1)."""
        return self._nodes.pop(node, None) is not None

    def __len__(self) -> int:
        """Nodes kept, forgotten ones included."""
        return len(self._nodes)

    def is_forgotten(self, node: str) -> bool:
        n = self._nodes.get(node)
        return n is not None and n.forgotten

    def silent_s(self, node: str, now: float) -> float:
        """Seconds ``node`` has served without a KV batch (0 when unknown or just fresh)."""
        n = self._nodes.get(node)
        if n is None:
            return 0.0
        extra = now - n.last_state if n.serving and n.last_state is not None and now > n.last_state else 0.0
        return n.silent + extra

    def check(self, now: float) -> list[str]:
        """Mark stale every node silent for more than ``stale_after``; returns those newly stale
        (sorted). A forgotten node is not checked (its KV is dropped already; asking it for a
        resync would wait on a node that is gone)."""
        out = []
        for name, n in sorted(self._nodes.items()):
            if not n.stale and not n.forgotten and self.silent_s(name, now) > self.stale_after:
                n.stale = True
                out.append(name)
        return out

    def is_stale(self, node: str) -> bool:
        n = self._nodes.get(node)
        return n is not None and n.stale

    def stale_nodes(self) -> frozenset[str]:
        return frozenset(k for k, n in self._nodes.items() if n.stale)

    def report(self, now: float) -> list[tuple[str, float, float | None, bool]]:
        """``(node, silent_s, seconds since its last batch or None, stale)`` per node not
        forgotten (:meth:`forget`), sorted by node (seconds, on the clock of ``now``)."""
        return [
            (k, self.silent_s(k, now), None if n.last_batch is None else now - n.last_batch, n.stale)
            for k, n in sorted(self._nodes.items())
            if not n.forgotten
        ]
