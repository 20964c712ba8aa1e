"""Workloads the simulator replays: a trace as is, or a trace tiled into many more agents.

A large simulated cluster (paper D.2: 3,072 GPUs, ~30,720 concurrent agents)
needs far more agent sessions than a trace holds, and materialising them
would not fit in memory (a Claude Code request carries ~250 block ids even at
512-token blocks). :class:`TiledWorkload` replays every agent of a template
trace ``copies`` times as distinct agents:

* agent, branch and request ids get a ``~<copy>`` suffix (``after`` and
  ``parent_branch`` follow);
* block ids that more than one template agent uses (a shared system/tool
  prompt) stay shared by every copy; every other id ``b`` becomes
  ``b + copy·2**48`` (trace ids are below 2**48, so copies never collide), so a
  copy reuses its own history exactly like the template and shares nothing
  else;
* requests are *stubs* (no block list); the simulator asks
  :meth:`TiledWorkload.blocks_of` for the ids when it sends one, so only the
  template's lists live in memory;
* agents are ordered copy-major (every template agent of copy 0, then copy 1,
  ...), so the first N agents a closed loop starts are as varied as the
  template allows.

Each partition builds only the stubs of the agents bound to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from evolving_infra.traces.schema import TraceRequest

COPY_SHIFT = 48
"""Copy ``c`` offsets private block ids by ``c << 48`` (trace ids are < 2**48)."""
MAX_COPIES = (1 << 15) - 1
"""Keeps offset ids below 2**63 (signed int64 block hashes)."""
SEP = "~"


class WorkloadError(ValueError):
    """A workload that cannot be built as asked."""


class PlainWorkload:
    """A trace replayed as is.

    Args:
        requests: the requests, file order.
        blocks_of: the block ids of a request when its ``blocks`` are not stored in it
            (``evolving_infra.traces.compact.CompactTrace.blocks_of`` of stubs); None = ``req.blocks``.
    """

    def __init__(self, requests: Sequence[TraceRequest], blocks_of: Callable[[TraceRequest], Sequence[int]] | None = None) -> None:
        self.requests = list(requests)
        self.agents = list(dict.fromkeys(r.agent for r in self.requests))
        self.blocks_of = blocks_of

    def partition(self, part_of: Callable[[str], int], k: int, keep: set[str] | None = None) -> list[TraceRequest]:
        """Requests of the agents bound to partition ``k`` (file order), optionally only agents in ``keep``.

        ``part_of`` is asked once per agent, not once per request."""
        mine = {a for a in self.agents if part_of(a) == k and (keep is None or a in keep)}
        if len(mine) == len(self.agents):  # every agent (one partition, no cap): the whole input
            return list(self.requests)
        return [r for r in self.requests if r.agent in mine]


class TiledWorkload:
    """``copies`` copies of every agent of ``templates`` (module docstring).

    ``blocks_of``: the block ids of a template when its ``blocks`` are not stored in it
    (``CompactTrace.blocks_of`` of stubs); None = ``req.blocks``.

    Raises:
        WorkloadError: ``copies`` out of [1, MAX_COPIES].
    """

    def __init__(
        self,
        templates: Sequence[TraceRequest],
        copies: int,
        blocks_of: Callable[[TraceRequest], Sequence[int]] | None = None,
    ) -> None:
        if not 1 <= copies <= MAX_COPIES:
            raise WorkloadError(f"--tile must be in [1, {MAX_COPIES}], got {copies}")
        self.templates = list(templates)
        self.copies = copies
        self._tpl_blocks: Callable[[TraceRequest], Sequence[int]] = blocks_of or (lambda r: r.blocks)
        self.by_id = {r.id: r for r in self.templates}
        self._by_agent: dict[str, list[TraceRequest]] = {}
        for r in self.templates:
            self._by_agent.setdefault(r.agent, []).append(r)
        seen: set[int] = set()
        shared: set[int] = set()
        for reqs in self._by_agent.values():  # set algebra per agent (C speed): ids of >= 2 agents
            mine: set[int] = set()
            for r in reqs:
                mine.update(self._tpl_blocks(r))
            shared |= mine & seen
            seen |= mine
        self.shared = frozenset(shared)
        self.agents = [f"{a}{SEP}{c}" for c in range(copies) for a in self._by_agent]

    def partition(self, part_of: Callable[[str], int], k: int, keep: set[str] | None = None) -> list[TraceRequest]:
        """Stubs of the tiled agents bound to partition ``k``, agents copy-major."""
        out: list[TraceRequest] = []
        for agent in self.agents:
            if part_of(agent) != k or (keep is not None and agent not in keep):
                continue
            base, _, c = agent.rpartition(SEP)
            suffix = f"{SEP}{c}"
            for r in self._by_agent[base]:
                out.append(
                    msgspec.structs.replace(
                        r,
                        id=r.id + suffix,
                        agent=agent,
                        branch=r.branch + suffix,
                        blocks=[],
                        after=[a + suffix for a in r.after],
                        parent_branch=r.parent_branch + suffix if r.parent_branch else None,
                    )
                )
        return out

    def blocks_of(self, req: TraceRequest) -> Sequence[int]:
        """Block ids of a stub: the template's, private ones offset by its copy."""
        tid, _, c = req.id.rpartition(SEP)
        tpl = self.by_id[tid]
        off = int(c) << COPY_SHIFT
        blocks = self._tpl_blocks(tpl)
        if not off:
            return blocks
        shared = self.shared
        return [b if b in shared else b + off for b in blocks]
