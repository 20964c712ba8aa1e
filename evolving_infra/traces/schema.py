"""Canonical agent trace format, version 1 (DESIGN §6; spec: docs/trace-format.md).

A trace is JSON Lines: line 1 is a :class:`TraceHeader`, every further line a
:class:`TraceRequest`. Requests of one agent form branches; a request is sent
when every request in its ``after`` list has completed, plus ``pause_s``
(tool / think time). The first request of an agent has an empty ``after`` and
is sent when the arrival process starts the agent (closed loop, open loop, or
the recorded ``arrival_s``), plus ``pause_s``.

Block ids: ``blocks`` lists the ids of the input's *full* blocks of
``block_size`` tokens (``len(blocks) == input_tokens // block_size``). Ids are
chained: equal ids at equal positions mean an equal prefix. Replayers turn ids
into token ids with ``shared.hashing.tokens_for_blocks`` and the partial tail
into request-private tokens with ``shared.hashing.tokens_for_tail``
(``evolving_infra.traces.tokens.prompt_token_ids``). Ids lie in
[0, :data:`MAX_BLOCK_ID`].

Reading, validation and writing: ``evolving_infra.traces.io``.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from msgspec import Meta, Struct

FORMAT: Final = "evolving-infra-trace"  # Final: its type is the Literal TraceHeader.format takes
VERSION = 1

MAX_BLOCK_ID = (1 << 48) - 1
"""Block ids lie in [0, MAX_BLOCK_ID]: ``shared.hashing.tokens_for_blocks`` turns
``(id << 16) + j`` into token ``j`` of block ``id``, which is distinct for every
(id, j) only below 2**48. Ids from 2**47 up are reserved for request-private ids
(``evolving_infra.traces.tokens.PrivateIds``)."""

BranchKind = Literal["main", "fork", "subagent"]


class TraceHeader(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """First line of a trace file."""

    format: Literal["evolving-infra-trace"]
    version: Annotated[int, Meta(ge=1)] = VERSION
    block_size: Annotated[int, Meta(gt=0)]
    """Tokens per block id."""
    source: str = ""
    """Where the requests came from (converter kind and input, or generator and seed)."""
    description: str = ""
    meta: dict[str, Any] = {}
    """Free-form provenance: converter options, licence, calibration targets, caps applied."""


class TraceRequest(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One LLM request of an agent."""

    id: str
    """Unique within the file."""
    agent: str
    """Agent (session) id; every branch of one agent shares it."""
    branch: str
    """Branch id, unique within the file: one context and its sequence of requests."""
    input_tokens: Annotated[int, Meta(ge=1)]
    output_tokens: Annotated[int, Meta(ge=0)]
    """Recorded output length. 0 occurs in real traces (a response with no
    tokens); replayers and the simulator then ask for 1 token, the least an
    OpenAI-compatible server generates."""
    blocks: list[Annotated[int, Meta(ge=0, le=MAX_BLOCK_ID)]] = []
    """Ids of the input's full blocks (``len == input_tokens // block_size``); decoding checks
    each is in [0, MAX_BLOCK_ID] (constructing a request does not)."""
    kind: BranchKind | None = None
    """Set on a branch's first request: ``main``, ``fork`` or ``subagent``."""
    parent_branch: str | None = None
    """Set on the first request of a fork or sub-agent branch."""
    after: list[str] = []
    """Requests (of the same agent, earlier in the file) that must complete before this one is sent."""
    pause_s: Annotated[float, Meta(ge=0)] = 0.0
    """Delay (s) after the last of ``after`` completes (or after the agent starts)."""
    ends_branch: bool = False
    """True on the last request of its branch: the replayer then ends the branch."""
    t_s: float | None = None
    """Recorded send time (s) relative to the agent's start, when the source has one."""
    arrival_s: float | None = None
    """Recorded absolute arrival time (s) of the agent's first request in the trace clock, if any."""
    compaction: bool = False
    """The converter detected a rewritten context (path no longer extends the branch's previous path)."""
    model: str | None = None
