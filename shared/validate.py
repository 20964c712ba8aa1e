"""Edge validation of every bus message, after decoding and before any state changes.

msgspec checks types (and the few ``Meta`` bounds in ``shared.messages``) while
decoding; this module checks what a type cannot say: times that are finite and
in range, counts and sizes with upper bounds, sequence numbers and epochs that
fit a float exactly, lists of bounded length, node ids that are NATS tokens and
that match the subject they arrived on (``node.state.w0`` carries ``node="w0"``:
with per-identity publish permissions (``shared.auth``) that ties the payload to
the publisher), and, where a service knows its node set, known node ids.

:func:`check` is called by :class:`shared.bus.Bus` on every decoded message
and reply; a message it refuses is counted under ``dropped.<template>`` (and
``invalid.<template>``) and dropped like an undecodable one. It returns the
reason as text (None when the message is acceptable) and never raises.

The bounds are generous for honest traffic (module constants below, each with
its unit) and small enough that one message cannot make a service allocate or
loop without limit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from shared import messages as m

MAX_TIME_S = 1e12
"""Largest absolute simulated time (``*_at``, ``ts``), s (≈ 31,700 years)."""
MAX_DURATION_S = 1e9
"""Largest duration (``*_s``), s."""
MAX_SEQ = 2**53
"""Largest sequence number or epoch (exact in a float64)."""
MAX_EPOCH_STEP = 2**20
"""Largest jump of a split epoch over the epoch a node or router serves: the planner
raises the epoch by one per decision, so a larger jump is forged (it would make every
later planner command look stale)."""
MAX_TOKENS = 2**31 - 1
"""Largest token count of one request (prompt, max_tokens, generated, index)."""
MAX_BLOCK_SIZE = 2**20
"""Largest KV block (page) size, tokens."""
MAX_BLOCKS = 2**21
"""Longest block-hash path of one request or lookup (2M blocks)."""
MAX_KV_BATCH_HASHES = 2**18
"""Most block hashes in one ``KvEventBatch`` (all its events together)."""
MAX_KV_BATCH_EVENTS = 2**16
"""Most events in one ``KvEventBatch``."""
MAX_SNAPSHOT_BLOCKS = 2**23
"""Most blocks per tier in one ``KvSnapshot``. (Not the bound of a ``kv.countsync`` snapshot's
``total`` or offsets: a node may count more blocks than that, and the worker bounds what it
fetches itself, counted and without a retry, ``services.worker.countseq.SNAPSHOT_MAX_ENTRIES``;
here they are only integers exact in a float, :data:`MAX_SEQ`.)"""
MAX_NODES = 4096
"""Most nodes named in one message (split command, lookup reply, models)."""
MAX_LIST = 2**16
"""Most entries of other lists (queue, iteration records, candidates, fetch ranges, counters)."""
MAX_CHUNK_TOKENS = 2**20
"""Most token ids in one ``TokenChunk``."""
MAX_ID_LEN = 4096
"""Longest branch / agent id (and epoch), in characters (``len`` of the text, not its UTF-8 bytes: a
4,096-character id of CJK characters is 12,288 bytes); the router's ``max_id_len`` is at most this."""
MAX_TEXT = 4096
"""Longest free-text field (reason, error), characters."""
MAX_BIG = 2**62
"""Largest byte count or other non-token integer."""
MAX_BLOCK_COUNT = 2**40
"""Largest number of KV blocks a node reports (free, total, used)."""
MAX_TEMPERATURE = 100.0
"""Largest sampling temperature a work may carry (the router's API allows [0, 2]; vLLM has no bound)."""
MAX_STOP_TOKEN_IDS = 1024
"""Most ``Sampling.stop_token_ids`` of one request."""
MAX_REPETITION_PENALTY = 100.0
"""Largest ``Sampling.repetition_penalty`` a work may carry (vLLM: > 0, no upper bound; the
router's API takes [:data:`MIN_REPETITION_PENALTY`, this])."""
MIN_REPETITION_PENALTY = 1.0 / MAX_REPETITION_PENALTY
"""Smallest ``Sampling.repetition_penalty`` (vLLM: any > 0). Below ~3e-37 a positive logit of the
prompt or output divided by it overflows float32 to +inf (and under 1.4e-45 it is 0 in float32):
a sampled row's softmax is then NaN and the inverse-CDF draw falls to the last vocabulary id
(measured, 50-token vocabulary, whole vocabulary in the prompt, r = 1e-39, temperature 1, 8
seeds: id 49 each time, also when 49 is the EOS that ``min_tokens`` = 5 masks at position 0), a
greedy row takes the first +inf. 1/100 mirrors the upper bound."""
MAX_MIN_TOKENS = 2**32
"""Bound of ``Sampling.min_tokens`` (the router's API takes at most ``max_tokens``)."""
MAX_TOP_K = 2**32
"""Largest ``Sampling.top_k`` a work may carry (the router sends a larger one as 0, off)."""
MAX_TOP_LOGPROBS = 20
"""Most top log-probabilities per output token (``Sampling.logprobs``; OpenAI's and vLLM's chat limit)."""
MAX_LOGIT_BIAS = 2**18
"""Most ``Sampling.logit_bias`` entries (262,144: one per token of the largest common vocabularies,
Gemma's 256,000; the router sends at most its vocabulary's size, keys being distinct ids)."""
MAX_ABS_LOGIT_BIAS = 100.0
"""``Sampling.logit_bias`` values are in [-this, this] (OpenAI's range; the router's API refuses others)."""

_TOKEN = re.compile(r"[A-Za-z0-9_\-]{1,128}\Z")  # \Z: "$" would let a trailing newline through


class Invalid(Exception):
    """Raised inside a checker; :func:`check` turns it into the returned reason."""


def _tok(value: Any, what: str, *, optional: bool = False) -> None:
    if optional and (value is None or value == ""):
        return
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise Invalid(f"{what} {str(value)[:40]!r} is not a NATS token of at most 128 characters")


def _time(value: Any, what: str) -> None:
    if value is None:
        return
    if not (isinstance(value, (int, float)) and math.isfinite(value) and -MAX_TIME_S <= value <= MAX_TIME_S):
        raise Invalid(f"{what}={value!r} is not a finite time within ±{MAX_TIME_S:g} s")


def _dur(value: Any, what: str) -> None:
    if value is None:
        return
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= MAX_DURATION_S):
        raise Invalid(f"{what}={value!r} is not a finite duration in [0, {MAX_DURATION_S:g}] s")


def _finite(value: Any, what: str) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
        raise Invalid(f"{what}={value!r} is not finite")


def _int(value: int, what: str, hi: int, lo: int = 0) -> None:
    if not lo <= value <= hi:
        raise Invalid(f"{what}={value} outside [{lo}, {hi}]")


def _len(seq: Collection[Any], what: str, hi: int) -> None:
    if len(seq) > hi:
        raise Invalid(f"{what} has {len(seq)} entries; at most {hi}")


def _text(value: str | None, what: str, hi: int = MAX_TEXT) -> None:
    if value is not None and len(value) > hi:
        raise Invalid(f"{what} has {len(value)} characters; at most {hi}")


def _known(node: str, nodes: Collection[str] | None, what: str) -> None:
    if nodes is not None and node not in nodes:
        raise Invalid(f"{what} {node!r} is not a node of this cluster")


def _same(value: str, params: dict[str, str], key: str, what: str) -> None:
    expect = params.get(key)
    if expect is not None and expect != "*" and value != expect:
        raise Invalid(f"{what} {value!r} does not match the subject's {key} {expect!r}")


# --------------------------------------------------------------------------- #
# per type
# --------------------------------------------------------------------------- #

Checker = Callable[[Any, dict[str, str], "Collection[str] | None"], None]


def _kv_batch(b: m.KvEventBatch, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(b.node, "node")
    _same(b.node, p, "node", "node")
    _known(b.node, nodes, "node")
    _int(b.seq, "seq", MAX_SEQ, 1)
    _time(b.ts, "ts")
    _len(b.events, "events", MAX_KV_BATCH_EVENTS)
    total = 0
    for ev in b.events:
        if isinstance(ev, m.BlockStored):
            total += len(ev.block_hashes)
            _int(ev.block_size, "block_size", MAX_BLOCK_SIZE)
        elif isinstance(ev, m.BlockRemoved):
            total += len(ev.block_hashes)
    if total > MAX_KV_BATCH_HASHES:
        raise Invalid(f"batch carries {total} block hashes; at most {MAX_KV_BATCH_HASHES}")


def _resync_req(r: m.KvResyncRequest, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.node, "node")
    _same(r.node, p, "node", "node")
    _int(r.expected_seq, "expected_seq", MAX_SEQ)
    _text(r.reason, "reason")


def _snapshot(s: m.KvSnapshot, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(s.node, "node")
    _known(s.node, nodes, "node")
    _int(s.seq, "seq", MAX_SEQ)
    _int(s.block_size, "block_size", MAX_BLOCK_SIZE)
    for name in ("gpu", "host", "gpu_parents", "host_parents"):
        _len(getattr(s, name), name, MAX_SNAPSHOT_BLOCKS)


def _lookup_req(r: m.KvLookupRequest, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _len(r.block_hashes, "block_hashes", MAX_BLOCKS)
    _int(r.block_size, "block_size", MAX_BLOCK_SIZE)


def _lookup_reply(r: m.KvLookupReply, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _int(r.block_size, "block_size", MAX_BLOCK_SIZE)
    _len(r.nodes, "nodes", MAX_NODES)
    _len(r.sources, "sources", MAX_LIST)
    _int(r.longest_any, "longest_any", MAX_BLOCKS)
    for n in r.nodes:
        _tok(n.node, "nodes[].node")
        for f in (n.gpu_blocks, n.host_blocks, n.local_blocks):
            _int(f, "nodes[] blocks", MAX_BLOCKS)
    for s in r.sources:
        _fetch_range(s, MAX_BLOCKS)
    _text(r.error, "error")


def _fetch_range(f: m.FetchRange, path_len: int) -> None:
    _tok(f.node, "fetch[].node")
    if not f.start <= f.end <= path_len:
        raise Invalid(f"fetch range [{f.start}, {f.end}) outside the path of {path_len} blocks")


def _counts(c: m.CountUpdates, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(c.node, "node")
    _same(c.node, p, "node", "node")
    _int(c.seq, "seq", MAX_SEQ)
    _len(c.hashes, "hashes", MAX_KV_BATCH_HASHES)
    if len(c.counts) != len(c.hashes):
        raise Invalid(f"{len(c.counts)} counts for {len(c.hashes)} hashes")
    if c.counts and min(c.counts) < 0:  # R[b, n] counts branches; the worker's host pool reads 0 vs > 0
        raise Invalid("a count is negative")
    if c.beacon and c.hashes:  # a beacon only says how far the numbering went: counts in it would never apply
        raise Invalid("a seq beacon carries counts")
    _text(c.epoch, "epoch", MAX_ID_LEN)


def _count_sync_req(r: m.CountSyncRequest, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.node, "node")
    _same(r.node, p, "node", "node")
    _known(r.node, nodes, "node")
    _text(r.reason, "reason")
    _text(r.epoch, "epoch", MAX_ID_LEN)
    _int(r.last_seq, "last_seq", MAX_SEQ)
    _text(r.snapshot, "snapshot", 256)
    _int(r.offset, "offset", MAX_SEQ)  # the directory only slices its kept snapshot with it (past its end: refused)


def _count_snapshot(s: m.CountSnapshot, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(s.node, "node")
    _known(s.node, nodes, "node")
    _text(s.epoch, "epoch", MAX_ID_LEN)
    _int(s.seq, "seq", MAX_SEQ)
    _text(s.snapshot, "snapshot", 256)
    _int(s.total, "total", MAX_SEQ)  # the worker refuses a snapshot too large to fetch itself (counted, no retry loop)
    _len(s.hashes, "hashes", MAX_KV_BATCH_HASHES)
    if len(s.counts) != len(s.hashes):
        raise Invalid(f"{len(s.counts)} counts for {len(s.hashes)} hashes")
    if s.offset + len(s.hashes) > s.total:
        raise Invalid(f"piece [{s.offset}, {s.offset + len(s.hashes)}) past the snapshot's {s.total} entries")
    _text(s.error, "error")


def _pool_locate(r: m.PoolLocate, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.node, "node")
    _same(r.node, p, "node", "node")
    _len(r.block_hashes, "block_hashes", MAX_BLOCKS)
    _dur(r.lease_s, "lease_s")


def _pool_location(r: m.PoolLocation, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.node, "node")
    _len(r.block_hashes, "block_hashes", MAX_BLOCKS)
    if len(r.offsets) != len(r.block_hashes) or len(r.checksums) not in (0, len(r.block_hashes)):
        if r.error is None:
            raise Invalid("offsets / checksums do not match block_hashes")
    _text(r.error, "error")
    _text(r.session, "session", 256)
    _text(r.instance, "instance", 64)


def _branch(e: m.BranchStart | m.BranchEnd | m.BranchToolCall, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _text(e.branch_id, "branch_id", MAX_ID_LEN)
    if not e.branch_id:
        raise Invalid("empty branch_id")
    _time(e.ts, "ts")
    if isinstance(e, m.BranchStart):
        _text(e.parent_branch_id, "parent_branch_id", MAX_ID_LEN)
        _text(e.agent_id, "agent_id", MAX_ID_LEN)
    if isinstance(e, m.BranchToolCall):
        _dur(e.expected_s, "expected_s")
    if isinstance(e, m.BranchEnd):  # an eviction's latest placed rid (RoutePlaced.rid); "" or None: none
        _tok(e.rid, "rid", optional=True)


def _branch_query(q: m.BranchQuery | m.BranchQueryReply, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _text(q.branch_id, "branch_id", MAX_ID_LEN)
    if not q.branch_id:
        raise Invalid("empty branch_id")


def _placed(r: m.RoutePlaced, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.rid, "rid")
    _tok(r.node, "node")
    _known(r.node, nodes, "node")
    _text(r.branch_id, "branch_id", MAX_ID_LEN)
    _len(r.block_hashes, "block_hashes", MAX_BLOCKS)
    if len(set(r.block_hashes)) != len(r.block_hashes):  # chained hashes never repeat: the directory counts prefixes
        raise Invalid("block_hashes repeat a hash: not a chain of prefix hashes")
    _time(r.ts, "ts")


def _node_state(s: m.NodeState, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(s.node, "node")
    _same(s.node, p, "node", "node")
    _known(s.node, nodes, "node")
    _int(s.seq, "seq", MAX_SEQ)
    _int(s.epoch, "epoch", MAX_SEQ)
    _time(s.ts, "ts")
    _dur(s.remaining_s, "remaining_s")
    _int(s.block_size, "block_size", MAX_BLOCK_SIZE)
    for name in ("running", "waiting", "decoding"):
        _int(getattr(s, name), name, MAX_TOKENS)
    for name in ("gpu_free_blocks", "gpu_total_blocks", "host_used_blocks", "host_total_blocks"):
        _int(getattr(s, name), name, MAX_BLOCK_COUNT)
    if s.gpu_free_blocks > s.gpu_total_blocks:
        raise Invalid(f"gpu_free_blocks {s.gpu_free_blocks} > gpu_total_blocks {s.gpu_total_blocks}")
    _len(s.queue, "queue", MAX_LIST)
    for q in s.queue:
        _tok(q.rid, "queue[].rid")
        for f in (q.uncached_tokens, q.cached_tokens, q.restore_tokens):
            _int(f, "queue[] tokens", MAX_TOKENS)
    _text(s.engine, "engine", 64)
    _text(s.boot, "boot", 64)
    _int(s.pid, "pid", 2**32)


def _iters(r: m.IterationRecords, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.node, "node")
    _same(r.node, p, "node", "node")
    _known(r.node, nodes, "node")
    _len(r.records, "records", MAX_LIST)
    for rec in r.records:
        _time(rec.start, "records[].start")
        _dur(rec.duration_s, "records[].duration_s")
        for f in (rec.prefill_requests, rec.sum_uncached, rec.sum_restored, rec.sum_cached, rec.decode_batch, rec.repeat):
            _int(f, "records[] count", MAX_BIG)
        _int(rec.sum_qk_pairs, "records[].sum_qk_pairs", MAX_BIG)


def split_problem(phases: Mapping[str, str], nodes: Collection[str] | None = None) -> str | None:
    """Why a split's ``phases`` cannot be served, or None.

    A split must name between 1 and :data:`MAX_NODES` nodes (NATS tokens; known
    ones when ``nodes`` is given), at least one node that serves prefill
    (``prefill`` or ``both``) and at least one that serves decode (``decode``
    or ``both``): otherwise every request would fail.
    """
    if not phases:
        return "names no node"
    if len(phases) > MAX_NODES:
        return f"names {len(phases)} nodes; at most {MAX_NODES}"
    for node in phases:
        if not isinstance(node, str) or not _TOKEN.match(node):
            return f"node {str(node)[:40]!r} is not a NATS token"
        if nodes is not None and node not in nodes:
            return f"names unknown node {node!r}"
    values = set(phases.values())
    if not values & {"prefill", "both"}:
        return "has no prefill node"
    if not values & {"decode", "both"}:
        return "has no decode node"
    return None


def epoch_step_ok(current: int, new: int) -> bool:
    """True when a split command's epoch ``new`` is at most :data:`MAX_EPOCH_STEP` above
    ``current`` (the receiver's epoch; ≤ 0 before its first command)."""
    return new - max(current, 0) <= MAX_EPOCH_STEP


def _split(c: m.SplitCommand, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _int(c.epoch, "epoch", MAX_SEQ)
    why = split_problem(c.phases, nodes)
    if why:
        raise Invalid(f"split command {why}")
    _time(c.decided_at, "decided_at")
    _text(c.reason, "reason")
    _text(c.boot, "boot", 64)


def _applied(a: m.SplitApplied, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(a.node, "node")
    _known(a.node, nodes, "node")
    _int(a.epoch, "epoch", MAX_SEQ)
    for name in ("decided_at", "applied_at", "received_at", "drained_at"):
        _time(getattr(a, name), name)
    _dur(a.switch_s, "switch_s")
    _int(a.requeued, "requeued", MAX_BIG)


def _split_set(r: m.SplitSetRequest, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _text(r.split, "split", 64)
    _text(r.reason, "reason")


def _split_set_reply(r: m.SplitSetReply, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _text(r.error, "error")
    if r.command is not None:
        _split(r.command, {}, nodes)


def _decision(d: m.PlannerDecision, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _int(d.seq, "seq", MAX_SEQ)
    _int(d.epoch, "epoch", MAX_SEQ)
    _time(d.ts, "ts")
    _len(d.candidates, "candidates", MAX_LIST)
    _len(d.metrics, "metrics", MAX_LIST)
    _text(d.reason, "reason", 4 * MAX_TEXT)


def _request_common(rid: str, prompt_tokens: int, max_tokens: int, block_size: int, hashes: list[int], token_ids: bytes) -> None:
    _tok(rid, "rid")
    _int(prompt_tokens, "prompt_tokens", MAX_TOKENS, 1)
    _int(max_tokens, "max_tokens", MAX_TOKENS, 1)
    _int(block_size, "block_size", MAX_BLOCK_SIZE, 1)
    if len(hashes) != prompt_tokens // block_size:
        raise Invalid(f"{len(hashes)} block hashes for {prompt_tokens} prompt tokens of block size {block_size}")
    if token_ids and len(token_ids) != 4 * prompt_tokens:
        raise Invalid(f"token_ids has {len(token_ids)} bytes; expected 0 or 4 × {prompt_tokens}")


def _prefill(w: m.PrefillWork, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _request_common(w.rid, w.prompt_tokens, w.max_tokens, w.block_size, w.block_hashes, w.token_ids)
    _tok(w.decode_node, "decode_node", optional=True)
    if w.decode_node:
        _known(w.decode_node, nodes, "decode_node")
    _text(w.branch_id, "branch_id", MAX_ID_LEN)
    _time(w.sent_at, "sent_at")
    _int(w.epoch, "epoch", MAX_SEQ)
    _len(w.fetch, "fetch", MAX_LIST)
    for f in w.fetch:
        _fetch_range(f, len(w.block_hashes))
    _owner(w.attempt, w.output_offset, w.router)
    _sampling(w.sampling)


def _sampling(sp: m.Sampling | None) -> None:
    """A work's sampling parameters (``shared.messages.Sampling``; msgspec checked the signs
    and ``top_p`` ∈ (0, 1], ``min_p`` ∈ [0, 1])."""
    if sp is None:
        return
    if not (math.isfinite(sp.temperature) and sp.temperature <= MAX_TEMPERATURE):
        raise Invalid(f"sampling.temperature={sp.temperature!r} is not finite in [0, {MAX_TEMPERATURE:g}]")
    _int(sp.top_k, "sampling.top_k", MAX_TOP_K)
    if sp.seed is not None:
        _int(sp.seed, "sampling.seed", 2**64 - 1, -(2**63))
    _len(sp.stop_token_ids, "sampling.stop_token_ids", MAX_STOP_TOKEN_IDS)
    if sp.stop_token_ids and (min(sp.stop_token_ids) < 0 or max(sp.stop_token_ids) >= 2**32):
        raise Invalid("a sampling.stop_token_ids id is outside [0, 2^32)")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        if not (math.isfinite(v) and -2.0 <= v <= 2.0):
            raise Invalid(f"sampling.{name}={v!r} is not finite in [-2, 2]")
    if not (math.isfinite(sp.repetition_penalty) and MIN_REPETITION_PENALTY <= sp.repetition_penalty <= MAX_REPETITION_PENALTY):
        raise Invalid(
            f"sampling.repetition_penalty={sp.repetition_penalty!r} is not finite in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"
        )
    _int(sp.min_tokens, "sampling.min_tokens", MAX_MIN_TOKENS)
    if sp.logprobs is not None:
        _int(sp.logprobs, "sampling.logprobs", MAX_TOP_LOGPROBS)
    if sp.logit_bias:
        _len(sp.logit_bias, "sampling.logit_bias", MAX_LOGIT_BIAS)
        if min(sp.logit_bias) < 0 or max(sp.logit_bias) >= 2**32:
            raise Invalid("a sampling.logit_bias token id is outside [0, 2^32)")
        if not all(math.isfinite(v) and -MAX_ABS_LOGIT_BIAS <= v <= MAX_ABS_LOGIT_BIAS for v in sp.logit_bias.values()):
            raise Invalid(f"a sampling.logit_bias value is not finite in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")


def _owner(attempt: int, output_offset: int, router: str) -> None:
    """Fencing token, output offset and owning router of a work (issue #22)."""
    _int(attempt, "attempt", MAX_SEQ)
    _int(output_offset, "output_offset", MAX_TOKENS)
    _tok(router, "router", optional=True)


def _decode(w: m.DecodeWork, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _request_common(w.rid, w.prompt_tokens, w.max_tokens, w.block_size, w.block_hashes, w.token_ids)
    _int(w.generated, "generated", w.max_tokens)
    _tok(w.prefill_node, "prefill_node", optional=True)
    _text(w.branch_id, "branch_id", MAX_ID_LEN)
    _time(w.kv_ready_at, "kv_ready_at")
    _int(w.kv_bytes, "kv_bytes", MAX_BIG)
    _owner(w.attempt, w.output_offset, w.router)
    _len(w.output_ids, "output_ids", w.max_tokens)
    _sampling(w.sampling)
    _tok(w.kv_transfer, "kv_transfer", optional=True)
    _int(w.kv_chunks, "kv_chunks", w.kv_bytes)
    if bool(w.kv_transfer) != bool(w.kv_chunks) or (w.kv_chunks and w.kv):
        raise Invalid("kv_transfer and kv_chunks go together, and then kv is empty (the K/V came in pieces)")


def _kv_chunk(c: m.KvChunk, p: dict[str, str], nodes: Collection[str] | None) -> None:
    """A piece of a hand-off's K/V (``services/worker/handoffkv.py`` checks it against its transfer); one without
    ``data`` is a queued transfer's ask for its turn (``handoffkv.ask_of``)."""
    _tok(c.transfer, "transfer")
    _tok(c.rid, "rid")
    _int(c.total, "total", MAX_BIG, 1)
    _int(c.count, "count", c.total, 1)
    _int(c.index, "index", c.count - 1)
    _int(c.crc32, "crc32", 2**32 - 1)
    _int(c.attempt, "attempt", MAX_SEQ)
    _tok(c.router, "router", optional=True)
    if c.offset + len(c.data) > c.total or not c.data and c.offset >= c.total:  # no data: an ask for its turn
        raise Invalid(f"piece of {len(c.data)} B at offset {c.offset} does not fit a K/V of {c.total} B")


def _kv_chunk_ack(a: m.KvChunkAck, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(a.transfer, "transfer")
    _int(a.index, "index", MAX_BIG)
    _text(a.error, "error")
    _int(a.queued, "queued", MAX_BIG)


def _kv_cancel(c: m.KvCancel, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(c.transfer, "transfer")
    _tok(c.rid, "rid")
    _text(c.reason, "reason")


def _abort(a: m.RequestAbort, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(a.rid, "rid")
    _text(a.reason, "reason")
    _int(a.attempt, "attempt", MAX_SEQ)
    _tok(a.router, "router", optional=True)  # its sender, the request's owner ("": an older sender's)


def _chunk(c: m.TokenChunk, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(c.rid, "rid")
    _same(c.rid, p, "rid", "rid")
    _tok(c.node, "node", optional=True)
    _same(c.node, p, "node", "node")  # its publisher: each identity may publish only its own req.*.out.<n> (shared.auth)
    _int(c.index, "index", MAX_TOKENS)
    _len(c.token_ids, "token_ids", MAX_CHUNK_TOKENS)
    if c.token_ids and (min(c.token_ids) < 0 or max(c.token_ids) >= 2**32):
        raise Invalid("a token id is outside [0, 2^32)")
    _int(c.prompt_tokens, "prompt_tokens", MAX_TOKENS)
    _int(c.cached_tokens, "cached_tokens", MAX_TOKENS)
    _int(c.fetched_tokens, "fetched_tokens", MAX_TOKENS)
    _text(c.finish_reason, "finish_reason", 32)
    _text(c.error, "error")
    _time(c.ts, "ts")
    _dur(c.queue_s, "queue_s")
    _dur(c.fetch_s, "fetch_s")
    _dur(c.exposed_fetch_s, "exposed_fetch_s")
    _int(c.attempt, "attempt", MAX_SEQ)
    _tok(c.router, "router", optional=True)  # its owner, stamped by the worker ("": an older writer's)
    _chunk_logprobs(c)


def _chunk_logprobs(c: m.TokenChunk) -> None:
    """A chunk's log-probabilities: none, or one per token id (each ≤ 0, -inf allowed, NaN not),
    and the top lists one per token id, of at most :data:`MAX_TOP_LOGPROBS` equal-length items."""
    if not (c.logprobs or c.top_ids or c.top_logprobs):
        return
    n = len(c.token_ids)
    if len(c.logprobs) != n:
        raise Invalid(f"logprobs has {len(c.logprobs)} entries for {n} token ids")
    if c.top_ids or c.top_logprobs:
        if len(c.top_ids) != n or len(c.top_logprobs) != n:
            raise Invalid(f"top_ids/top_logprobs have {len(c.top_ids)}/{len(c.top_logprobs)} entries for {n} token ids")
        for ids, lps in zip(c.top_ids, c.top_logprobs):
            if len(ids) != len(lps) or len(ids) > MAX_TOP_LOGPROBS:
                raise Invalid(f"a top_ids/top_logprobs entry has {len(ids)}/{len(lps)} items (at most {MAX_TOP_LOGPROBS}, equal)")
            if ids and (min(ids) < 0 or max(ids) >= 2**32):
                raise Invalid("a top_ids id is outside [0, 2^32)")
            _logprobs(lps, "top_logprobs")
    _logprobs(c.logprobs, "logprobs")


def _logprobs(xs: list[float], name: str) -> None:
    """Natural-log probabilities: ≤ 0, -inf allowed (a token the model rules out), NaN not."""
    for x in xs:
        if not x <= 0.0:
            raise Invalid(f"a {name} value {x!r} is not a log-probability (<= 0)")


def _bind_req(r: m.DecodeBindRequest, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.rid, "rid")
    _tok(r.prefill_node, "prefill_node")
    _known(r.prefill_node, nodes, "prefill_node")
    _int(r.prompt_tokens, "prompt_tokens", MAX_TOKENS)
    _int(r.max_tokens, "max_tokens", MAX_TOKENS)
    _text(r.branch_id, "branch_id", MAX_ID_LEN)
    _int(r.attempt, "attempt", MAX_SEQ)


def _bind_reply(r: m.DecodeBindReply, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.rid, "rid")
    _tok(r.decode_node, "decode_node", optional=True)
    _text(r.reason, "reason")


def _held_query(q: m.HeldQuery, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(q.node, "node")
    _len(q.rids, "rids", MAX_LIST)
    if len(q.attempts) != len(q.rids):
        raise Invalid(f"{len(q.attempts)} attempts for {len(q.rids)} rids")
    for rid in q.rids:
        _tok(rid, "rid")
    for a in q.attempts:
        _int(a, "attempt", MAX_SEQ)


def _held_reply(r: m.HeldReply, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _len(r.dropped, "dropped", MAX_LIST)
    for rid in r.dropped:
        _tok(rid, "rid")


def _branch_sync(r: m.BranchSync, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.directory, "directory", optional=True)
    _time(r.ts, "ts")
    _tok(r.sync_id, "sync_id", optional=True)


def _branch_sync_done(r: m.BranchSyncDone, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.sync_id, "sync_id")
    _tok(r.directory, "directory", optional=True)
    _int(r.branches, "branches", MAX_SEQ)
    _int(r.placements, "placements", MAX_SEQ)


def _kv_liveness(r: m.KvLiveness, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _len(r.nodes, "nodes", MAX_LIST)
    for n in r.nodes:
        _tok(n.node, "node")
        _dur(n.silent_s, "silent_s")
        _dur(n.last_batch_s, "last_batch_s")
    _dur(r.stale_after_s, "stale_after_s")


def _route_sent(r: m.RouteSent, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.router, "router")
    _tok(r.rid, "rid")
    _tok(r.prefill_node, "prefill_node")
    _tok(r.decode_node, "decode_node", optional=True)
    _int(r.prompt_tokens, "prompt_tokens", MAX_TOKENS)
    _int(r.max_tokens, "max_tokens", MAX_TOKENS)
    _int(r.attempt, "attempt", MAX_SEQ)


def _requeue(r: m.WorkRequeue, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.rid, "rid")
    _tok(r.node, "node")
    _known(r.node, nodes, "node")
    _int(r.epoch, "epoch", MAX_SEQ)
    _text(r.reason, "reason")
    _int(r.attempt, "attempt", MAX_SEQ)
    if (r.prefill is None) == (r.decode is None):
        raise Invalid("exactly one of prefill / decode must be set")
    if r.prefill is not None:
        _prefill(r.prefill, {}, nodes)
        if r.prefill.rid != r.rid:
            raise Invalid("prefill.rid differs from rid")
    if r.decode is not None:
        _decode(r.decode, {}, nodes)
        if r.decode.rid != r.rid:
            raise Invalid("decode.rid differs from rid")


def _requeue_reply(r: m.WorkRequeueReply, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(r.rid, "rid")
    _text(r.reason, "reason")


def _node_down(d: m.NodeDown, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _tok(d.node, "node")
    _same(d.node, p, "node", "node")
    _known(d.node, nodes, "node")
    _int(d.pid, "pid", 2**32)
    # msgpack's uint64 (a larger value fails decoding): this bounds the type only; the router bounds it by its wall
    # clock (NodeLoadView.fence_exited's wall_ns). Before, 10**20-1 here, which no decoded value reaches
    _int(d.exited_ns, "exited_ns", 2**64 - 1)
    _int(d.code, "code", 255, lo=-128)


def _heartbeat(h: m.Heartbeat, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _text(h.service, "service", 128)
    _same(h.service, p, "service", "service")
    _text(h.instance, "instance", 256)
    _int(h.pid, "pid", 2**32)
    _time(h.wall_ts, "wall_ts")
    _text(h.boot, "boot", 64)


def _stats_reply(r: m.StatsReply, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _text(r.service, "service", 128)
    _text(r.instance, "instance", 256)
    _len(r.counters, "counters", MAX_LIST)
    _len(r.gauges, "gauges", MAX_LIST)


def _models(r: m.PlannerModels, p: dict[str, str], nodes: Collection[str] | None) -> None:
    _len(r.models, "models", MAX_NODES)
    _time(r.fitted_at, "fitted_at")
    for nm in r.models:
        _tok(nm.node, "models[].node")
        _known(nm.node, nodes, "models[].node")
        if nm.prefill is not None:
            for f in (nm.prefill.c0, nm.prefill.c1, nm.prefill.c2, nm.prefill.c3):
                _finite(f, "prefill coefficient")
        if nm.decode is not None:
            d = nm.decode
            for f in (d.d0, d.d1, d.d2):
                _finite(f, "decode coefficient")
            for f in (d.tokens_per_forward, d.accepted_per_iteration):
                _finite(f, "decode shape")
                if not 0.0 < f <= 1024.0:
                    raise Invalid(f"decode tokens per iteration {f} outside (0, 1024]")
            _int(d.active_experts, "active_experts", 2**20)
            _int(d.experts, "experts", 2**20)
        _dur(nm.mean_chunk_tokens, "mean_chunk_tokens")
        _finite(nm.restored_share, "restored_share")
        if not 0.0 <= nm.restored_share <= 1.0:
            raise Invalid(f"restored_share {nm.restored_share} outside [0, 1]")
        _dur(nm.fit_error, "fit_error")


def _empty(_msg: Any, p: dict[str, str], nodes: Collection[str] | None) -> None:
    return None


CHECKERS: dict[type, Checker] = {
    m.KvEventBatch: _kv_batch,
    m.KvResyncRequest: _resync_req,
    m.KvSnapshot: _snapshot,
    m.KvLookupRequest: _lookup_req,
    m.KvLookupReply: _lookup_reply,
    m.CountUpdates: _counts,
    m.CountSyncRequest: _count_sync_req,
    m.CountSnapshot: _count_snapshot,
    m.PoolLocate: _pool_locate,
    m.PoolLocation: _pool_location,
    m.BranchStart: _branch,
    m.BranchEnd: _branch,
    m.BranchToolCall: _branch,
    m.BranchSyncDone: _branch_sync_done,
    m.BranchQuery: _branch_query,
    m.BranchQueryReply: _branch_query,
    m.RoutePlaced: _placed,
    m.NodeState: _node_state,
    m.NodeDown: _node_down,
    m.IterationRecords: _iters,
    m.SplitCommand: _split,
    m.SplitApplied: _applied,
    m.SplitQuery: _empty,
    m.SplitSetRequest: _split_set,
    m.SplitSetReply: _split_set_reply,
    m.PlannerDecision: _decision,
    m.PrefillWork: _prefill,
    m.DecodeWork: _decode,
    m.KvChunk: _kv_chunk,
    m.KvChunkAck: _kv_chunk_ack,
    m.KvCancel: _kv_cancel,
    m.RequestAbort: _abort,
    m.TokenChunk: _chunk,
    m.DecodeBindRequest: _bind_req,
    m.DecodeBindReply: _bind_reply,
    m.WorkRequeue: _requeue,
    m.RouteSent: _route_sent,
    m.KvLiveness: _kv_liveness,
    m.BranchSync: _branch_sync,
    m.WorkRequeueReply: _requeue_reply,
    m.HeldQuery: _held_query,
    m.HeldReply: _held_reply,
    m.Heartbeat: _heartbeat,
    m.StatsRequest: _empty,
    m.StatsReply: _stats_reply,
    m.PlannerModels: _models,
}
"""One checker per message type (a Union subject dispatches on the decoded member's type)."""


def check(msg: Any, params: dict[str, str] | None = None, nodes: Collection[str] | None = None) -> str | None:
    """Why ``msg`` must be dropped, or None when every field is acceptable.

    Args:
        msg: a decoded message (any type of ``shared.messages``).
        params: the concrete subject's parameters (``{"node": "w0"}`` for
            ``kv.events.w0``): fields that name the publisher must equal them.
        nodes: node ids of the cluster when the caller knows them (None = any
            well-formed id).

    Returns:
        The reason (for the drop log) or None. A type without a checker passes.
    """
    fn = CHECKERS.get(type(msg))
    if fn is None:
        return None
    try:
        fn(msg, params or {}, nodes)
    except Invalid as e:
        return str(e)
    except (TypeError, ValueError, AttributeError, OverflowError) as e:  # a checker met a shape it did not expect
        return f"{type(e).__name__}: {e}"
    return None


_PLACES: dict[str, tuple[int, tuple[tuple[int, str], ...]]] = {}
"""A subject template's token count and its parameters' (position, name), parsed once (:func:`subject_params`)."""


def subject_params(template: str, prefix: str, full_subject: str) -> dict[str, str]:
    """Parameters of ``full_subject`` for ``template`` under ``prefix`` (``{}`` when the shape differs).

    ``subject_params("kv.events.{node}", "ei.p0.", "ei.p0.kv.events.w0") == {"node": "w0"}``.
    Every message a bus receives is checked with its subject's parameters: the template is split once per
    template (a few templates per process), not once per message.
    """
    if not full_subject.startswith(prefix):
        return {}
    places = _PLACES.get(template)
    if places is None:
        tmpl = template.split(".")
        places = _PLACES[template] = (len(tmpl), tuple((i, t[1:-1]) for i, t in enumerate(tmpl) if t.startswith("{")))
    toks = full_subject[len(prefix) :].split(".")
    if len(toks) != places[0]:
        return {}
    return {name: toks[i] for i, name in places[1]}


def all_checked_types() -> Iterable[type]:
    """Every type with a checker (tests assert every subject's types are covered)."""
    return CHECKERS.keys()
