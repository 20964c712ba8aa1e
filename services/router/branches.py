"""Branch table: which agent branches the router has announced, and which ended.

Zero I/O. The shell turns the harness's headers into :meth:`BranchTable.observe`
calls and ``POST /v1/branches/{id}/end`` into :meth:`BranchTable.end`, and
publishes the returned ``BranchStart``/``BranchEnd`` on ``branch.events``.

Transitions (one branch id)::

    unknown --observe--> active   (emits BranchStart once)
    active  --observe--> active   (no event)
    active  --end------> ended    (emits BranchEnd)
    ended   --observe--> error BranchEnded        (HTTP 409)
    ended   --end------> error BranchAlreadyEnded (HTTP 409)
    unknown --end------> error UnknownBranch      (HTTP 404)

Ended ids are remembered up to ``max_ended`` (oldest forgotten first), so an
id ended long ago behaves as unknown again. Active branches are kept until
they end (the harness owns their lifetime).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.messages import BranchEnd, BranchKind, BranchStart


class BranchError(Exception):
    """A branch operation the client got wrong; ``status`` is the HTTP status to answer."""

    status = 400

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnknownBranch(BranchError):
    status = 404


class BranchAlreadyEnded(BranchError):
    status = 409


class BranchEnded(BranchError):
    """A request arrived for a branch that was ended."""

    status = 409


@dataclass(slots=True)
class _Branch:
    kind: BranchKind
    parent: str | None
    agent_id: str | None
    started_at: float
    requests: int = 0


class BranchTable:
    """Active and recently ended branches (sans-IO).

    Args:
        max_ended: how many ended branch ids to remember (>= 0).
    """

    def __init__(self, max_ended: int = 100_000) -> None:
        if max_ended < 0:
            raise ValueError(f"max_ended must be >= 0, got {max_ended}")
        self.max_ended = max_ended
        self._active: dict[str, _Branch] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()

    def observe(
        self,
        branch_id: str,
        now: float,
        *,
        kind: BranchKind = "main",
        parent: str | None = None,
        agent_id: str | None = None,
    ) -> BranchStart | None:
        """Note a request of ``branch_id``.

        Returns:
            The ``BranchStart`` to publish when the branch is new, else None
            (kind/parent/agent of later requests are ignored).

        Raises:
            BranchEnded: if the branch was ended.
        """
        b = self._active.get(branch_id)
        if b is not None:
            b.requests += 1
            return None
        if branch_id in self._ended:
            raise BranchEnded(f"branch {branch_id!r} was ended; start a new branch id")
        self._active[branch_id] = _Branch(kind, parent, agent_id, now, 1)
        return BranchStart(branch_id=branch_id, kind=kind, parent_branch_id=parent, agent_id=agent_id, ts=now)

    def end(self, branch_id: str, now: float) -> BranchEnd:
        """End ``branch_id``.

        Returns:
            The ``BranchEnd`` to publish.

        Raises:
            BranchAlreadyEnded: if it was ended before.
            UnknownBranch: if no request of it was seen.
        """
        if branch_id in self._ended:
            raise BranchAlreadyEnded(f"branch {branch_id!r} already ended")
        if self._active.pop(branch_id, None) is None:
            raise UnknownBranch(f"unknown branch {branch_id!r}: no request with X-Branch-Id {branch_id!r} was seen")
        if self.max_ended:
            self._ended[branch_id] = now
            while len(self._ended) > self.max_ended:
                self._ended.popitem(last=False)
        return BranchEnd(branch_id=branch_id, ts=now)

    def is_active(self, branch_id: str) -> bool:
        return branch_id in self._active

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def ended_count(self) -> int:
        return len(self._ended)
