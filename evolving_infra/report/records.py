"""Per-request records: what a replay (live or simulated) measured for each request.

Times are simulated seconds (live: wall seconds × speedup on the cluster clock).
One record per line in ``requests.jsonl`` next to ``report.json``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice
from pathlib import Path
from typing import Any

import msgspec


def _always(factory: Callable[[], Any]) -> Any:
    """A field default that ``omit_defaults`` never leaves out: msgspec omits a field at its default
    only for defaults given by value (and empty-collection factories), so a field made by another
    factory is written whatever its value (``tests/unit/report/test_records_schema.py`` holds it)."""
    return msgspec.field(default_factory=factory)


class RequestRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Measurements of one request (send → first token → last token).

    One JSON object per line of ``requests.jsonl``, the same schema from the simulator and a live
    replay (``evolving_infra/report/README.md``, "requests.jsonl"): the outcome and the counters an
    analyst filters or averages (``ok``, ``status``, ``branch_kind``, ``admission_wait_s``, the token
    counts, ``cached_tokens``, ``fetched_tokens``, ``retries``, ``retry_wait_s``) are always written,
    0 included, so that a mean over the file counts every request; the optional measurements (None:
    not known, not measured) and an empty ``fetch_sources`` are left out, which a reader takes as
    missing (pandas: NaN), not as 0.
    """

    id: str
    """Trace request id."""
    x_request_id: str | None = None
    """The ``X-Request-ID`` the live replayer sent (``evolving_infra.replay.live.request_id_for``: the run's
    branch prefix + ``id``, characters other than ``[A-Za-z0-9_-]`` as ``-``); None: not sent (simulated)."""
    request_id: str | None = None
    """The server's ``x-request-id`` response header: the ``X-Request-ID`` as sent, which for the replayer's ids
    (1 to 128 characters of ``[A-Za-z0-9_-]``) is the request's ``rid`` in the router's and workers' logs and
    the ``ei.rid`` of its spans (``services.router.api.request_rid``); None when the response had none (a request refused before it
    was accepted: find it by ``x_request_id`` in the router's ``request rejected`` line)."""
    agent: str
    branch: str
    branch_kind: str = _always(lambda: "main")
    sent_at: float
    """Simulated time the request was sent."""
    ok: bool = _always(lambda: True)
    status: int = _always(lambda: 200)
    error: str | None = None
    ttft_s: float | None = None
    """Send → first token, plus the agent's admission wait on its first request."""
    e2e_s: float | None = None
    """Send → last token, plus the admission wait on the agent's first request."""
    admission_wait_s: float = _always(float)
    prompt_tokens: int = _always(int)
    completion_tokens: int = _always(int)
    cached_tokens: int = _always(int)
    """Prompt tokens served from KV cache (any tier), as reported in usage."""
    expected_prompt_tokens: int = _always(int)
    expected_completion_tokens: int = _always(int)
    prefill_node: str | None = None
    decode_node: str | None = None
    finished_at: float | None = None
    """Simulated time of the last token (or of the failure)."""
    queue_s: float | None = None
    """Time the request waited in its prefill node's queue (arrival → prefill start), when reported."""
    ideal_cached_tokens: int | None = None
    """Prompt tokens whose KV an earlier request of the run produced: this request's share of the
    ideal hit rate h* (unlimited cache shared by all nodes, no phase switches), when the producer
    knows it. Enables lost KV reuse per time window in the report."""
    predicted_ttft_s: float | None = None
    """The router's TTFT prediction for this request (``ttft`` routing, paper Eq. 7), when it made one."""
    first_token_at: float | None = None
    """Simulated time the first token was produced on the prefill node, when the producer knows it
    (the simulator; the live replayer from the router's ``ei.first_token_at``)."""
    node_arrived_at: float | None = None
    """Live: simulated time the request's work reached the prefill node that produced its first
    token (``ei.arrived_at``). With ``first_token_at`` it splits TTFT into the engine's part and the
    control plane's (``evolving_infra.sim.fidelity.control_plane``)."""
    lost_reuse_cause: str | None = None
    """Paper Appendix C.1 cause of this request's lost KV reuse (``ideal_cached_tokens −
    cached_tokens``): ``eviction`` (it ran on the same prefill node as the previous request of its
    branch — for a fork's first request, its parent's), ``routing`` (another node), ``unattributed``
    (no previous request), ``none`` (nothing lost); None when the producer does not attribute
    (``services.kvdirectory.reuse.attribute_lost_reuse``)."""
    fetch_sources: list[str] = []
    """Nodes the prefill node fetched this request's prefix KV from (peer fetch while queued,
    paper §4.2), sorted; empty when it fetched nothing. Live: the router's fetch plan for the
    attempt that produced the first token (``ei.fetch_sources``); simulated: the same plan."""
    fetched_tokens: int = _always(int)
    """Prompt tokens whose KV came from those peers and was used (part of ``cached_tokens``;
    ``TokenChunk.fetched_tokens`` / ``TokensOut.fetched_tokens``); 0 without a fetch."""
    fetch_s: float | None = None
    """Peer fetch time: fetch start → blocks in the prefill node's L2 (s), when it fetched."""
    exposed_fetch_s: float | None = None
    """The part of ``fetch_s`` that outlasted the queue wait (s), when it fetched."""
    retries: int = _always(int)
    """Live: times the replayer sent the request again after it was refused before any answer (429 / 503, a
    connection refused or reset before the first byte: ``evolving_infra.replay.retry``); ``ok`` and ``error`` are the
    last send's, ``sent_at``, TTFT and E2E count from the first (the waits included, as the agent waited). 0 when
    the first send was answered (or simulated)."""
    retry_wait_s: float = _always(float)
    """Live, a retried request: local s (simulated, as ``ttft_s``) from its first send to its last one, the refused
    sends and the waits between them (``Retry-After``, backoff), part of ``ttft_s`` and ``e2e_s`` (the agent waited) but
    neither the router's control plane nor its node's TTFT: the report's ``ttft_control_plane_*`` and TTFT
    prediction errors leave it out, as the admission wait. 0 when not retried."""

    @property
    def tpot_s(self) -> float | None:
        """(E2E − TTFT) / (completion tokens − 1), for requests with ≥ 2 tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


_ENC = msgspec.json.Encoder()
_DEC = msgspec.json.Decoder(RequestRecord)


_CHUNK = 4096
"""Records encoded per call of :func:`write_records` (bounds the bytes held at once: ~2 MB)."""


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    """Write records as JSON Lines, in the given order: ``Encoder.encode_lines`` on
    :data:`_CHUNK` records at a time, one write each (the same bytes as an ``encode`` and two
    writes per record, in ~60% of the time: 5 instead of 8 ms for a 600-s run's 4,000 records)."""
    it = iter(records)
    with open(path, "wb") as f:
        while chunk := list(islice(it, _CHUNK)):
            f.write(_ENC.encode_lines(chunk))


def read_records(path: Path) -> list[RequestRecord]:
    """Read a ``requests.jsonl`` file.

    Raises:
        ValueError: naming the line number of an undecodable line.
    """
    out: list[RequestRecord] = []
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_DEC.decode(line))
            except msgspec.DecodeError as e:
                raise ValueError(f"{path}: line {i}: {e}") from e
    return out
