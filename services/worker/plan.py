"""Plan and output types of the engine scheduler (internal, not wire messages).

Contains zero I/O. Slotted classes with a comment per field, as vLLM's
``SchedulerOutput`` (STYLE §1.3): :class:`shared.values.Value` subclasses, what
``dataclass(slots=True)`` would generate without its class creation at import; the three built
per plan (:class:`PrefillChunk`, :class:`IterationPlan`, :class:`TokensOut`) are
:class:`shared.values.StructValue` subclasses, built by C code. Times are
simulated seconds, counts are tokens unless a field says blocks.
"""

from __future__ import annotations

from typing import Any

from shared.messages import DecodeWork
import msgspec

from shared.values import StructValue, Value


class WorkRejected(ValueError):
    """Work this node cannot serve (bad input, wrong phase, never fits): answer it
    with an error, never crash. ``rid`` is the request, ``reason`` says why."""

    def __init__(self, rid: str, reason: str) -> None:
        super().__init__(f"{rid}: {reason}")
        self.rid = rid
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # picklable with its two arguments (the simulator runs in worker processes)
        return (type(self), (self.rid, self.reason))


class SchedulerError(RuntimeError):
    """The caller misused the scheduler (e.g. ``schedule()`` while a plan is in flight)."""


class PrefillChunk(StructValue):
    """One request's share of the prefill part of an iteration."""

    rid: str
    tokens: int
    """t_uc of this chunk: uncached prompt tokens computed in this iteration."""
    cached_before: int
    """t_c of this chunk: prompt tokens already in KV before it (cached prefix + earlier chunks)."""
    restored: int
    """t_rst: prompt tokens restored from L2 into L1 for this iteration (first chunk only)."""
    completes: bool
    """True if this chunk finishes the prompt; the iteration then produces the first output token."""


class IterationPlan(StructValue):
    """What the node computes from ``start`` to ``end``: ``iterations`` identical
    iterations of ``iteration_s`` each (more than one only for a skip-ahead
    pure-decode plan)."""

    start: float
    """Launch time (simulated s)."""
    iterations: int
    """k: identical consecutive iterations folded into this plan (1 in live mode)."""
    iteration_s: float
    """Duration of one iteration (s): Eq. 1 part + Eq. 2 part (mixed: minus the smaller fixed cost)."""
    end: float
    """``start + iterations * iteration_s``."""
    prefill: list[PrefillChunk]
    """Prefill chunks, running requests first, then newly admitted ones."""
    decode: list[str]
    """rids of the decoding requests (B = len(decode))."""
    prefill_s: float
    """Eq. 1 part of one iteration (0 without chunks)."""
    decode_s: float
    """Eq. 2 part of one iteration (0 without decoding requests)."""
    sum_uncached: int
    """Σ t_uc over the chunks."""
    sum_qk_pairs: int
    """Σ A over the chunks, A = qk_pairs(t_uc, t_c)."""
    sum_restored: int
    """Σ t_rst over the chunks."""
    sum_cached: int
    """Σ t_c (``cached_before``) over the chunks."""
    reqs: list[Any] = msgspec.field(default_factory=list)
    """Scheduler-internal request objects, prefill chunks first then decode (same order)."""
    admitted: list[str] = msgspec.field(default_factory=list)
    """rids whose prefill *starts* in this plan (first chunk admitted), in admission order.
    A caller that binds the decode node at prefill start (paper Eq. 7, DESIGN §4) binds
    these with ``EngineScheduler.bind_decode``; one whose prefill finishes first gives its
    first token then and waits, parked, for that call to be handed off (``EngineScheduler.parked``)."""

    _repr_skip = ("reqs",)  # scheduler-internal request objects (a dataclass's field(repr=False))

    @property
    def phase(self) -> str:
        """``prefill``, ``decode`` or ``mixed`` (the IterationRecord phase)."""
        if self.prefill and self.decode:
            return "mixed"
        return "prefill" if self.prefill else "decode"

    @property
    def duration_s(self) -> float:
        """Total simulated time of the plan (s)."""
        return self.end - self.start


class TokensOut(StructValue):
    """Output tokens of one request produced by a plan."""

    rid: str
    index: int
    """Output position of the first of these tokens (0 = the first token, from prefill)."""
    count: int
    """Tokens produced (≥ 1, except a final event of a request that produced none)."""
    finished: bool
    """True if the request is done on this node (max_tokens reached)."""
    finish_reason: str | None
    """``length`` when finished, else None."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens served from cache on this node (L1 hit + L2 restore) at admission."""
    at: float
    """Simulated time the tokens became available (end of the plan)."""
    queue_s: float | None = None
    """First token only: time from arrival on this node to the launch of its first prefill chunk (s)."""
    fetch_s: float | None = None
    """First token only, when the request fetched blocks from peers: fetch start (arrival) →
    blocks resident in this node's L2 (s)."""
    exposed_fetch_s: float | None = None
    """First token only, with a fetch: the part of the fetch that outlasted the queue wait —
    from the first ``schedule()`` that would have admitted the request but skipped it
    because its fetch was incomplete, to the fetch's completion (0 if never skipped) (s)."""
    fetched_tokens: int = 0
    """First token only: prompt tokens whose KV was fetched from peers into L2 and was
    still there when the request started (restored into L1, so part of ``cached_tokens``);
    pages fetched but not stored, or lost before admission, are not counted."""


class HandOff(Value):
    """Prefill done on this node; decode continues on ``decode_node`` (PD disaggregation)."""

    rid: str
    decode_node: str
    work: DecodeWork
    """What to publish on ``work.<decode_node>.decode`` (kv_ready_at set)."""
    at: float

    __slots__ = __match_args__ = ("rid", "decode_node", "work", "at")

    def __init__(self, rid: str, decode_node: str, work: DecodeWork, at: float) -> None:
        self.rid = rid
        self.decode_node = decode_node
        self.work = work
        self.at = at


OutputEvent = TokensOut | HandOff
