"""Live replayer: drives a running cluster's router over HTTP, as an agent harness would.

Each request goes to ``POST /v1/completions`` with the prompt as token ids
(blocks of the trace turned into deterministic tokens), ``max_tokens`` = the
recorded output length, ``ignore_eos``, streaming with usage, and the agent
headers ``X-Branch-Id`` (+ ``X-Branch-Kind`` / ``X-Parent-Branch-Id`` on a
branch's first request, ``X-Agent-Id``). A branch's last request is followed
by ``POST /v1/branches/{id}/end``. Timing follows :class:`ReplayCore` on the
cluster's simulated clock; TTFT and E2E are measured at the client.

The core's timeline (arrivals, pauses, when to wake) and the TTFT / E2E durations run on the clock's
monotonic reading (:meth:`SimClock.local_now`), so a step of the wall clock (NTP, a VM resumed)
neither stalls the replay for the step's length nor sends the next requests early; the times that
go into the records and the report (``sent_at``, ``finished_at``, the result's ``start`` / ``end``)
stay on the wall-based :meth:`SimClock.now`, comparable with the services' times.

The ids the cluster sees are the trace's with ``branch_prefix`` in front (branch,
parent branch and agent alike): a router refuses a request for a branch that was
ended (400), so a second replay of a trace against the same cluster needs ids of
its own (``evolving-infra replay`` prefixes its run id). Records keep the trace's ids.

Each request carries an ``X-Request-ID`` made from ``branch_prefix`` + its record id
(:func:`request_id_for`), so the router keeps it as the request's ``rid`` in its logs and traces
(``ei.rid``); the record keeps the id sent (``x_request_id``) and the router's ``x-request-id``
response header (``request_id``), so ``requests.jsonl`` joins with the server's records.

A request refused before any answer (429 / 503, e.g. a draining router's; a connection refused or reset
before the first byte, e.g. a router restarting) is sent again, with the same ``X-Request-ID``, as an agent
harness would (:mod:`evolving_infra.replay.retry`: twice by default, waiting ``Retry-After``); one whose stream
started is never sent again (the record's ``retries`` counts the sends after the first).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import structlog
from tqdm import tqdm

from evolving_infra.replay.core import Arrival, EndBranch, ReplayCore, SendRequest
from evolving_infra.replay.retry import RETRY_STATUSES, RetryPolicy, parse_retry_after
from evolving_infra.report.records import RequestRecord
from evolving_infra.traces.schema import TraceRequest
from evolving_infra.traces.tokens import prompt_token_ids
from services.router.api import RID_MAX_LEN, request_rid
from shared.clock import SimClock
from shared.hashing import tokens_for_blocks, tokens_for_tail

log = structlog.get_logger("replay")

_JSON = msgspec.json.Encoder()
_DEC = msgspec.json.Decoder()

_RETRY_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""Transport errors sent again when no byte of the answer came (a router down or restarting: refused, reset, closed
before the status line); not a timeout, whose request the server may still be working on."""


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    start: float
    """Simulated time the replay started."""
    end: float
    wall_s: float
    agents: int
    branch_end_failures: int = 0
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False
    """The run was stopped (``stop`` set: SIGINT / SIGTERM) before the trace was done."""
    in_flight_at_stop: int = 0
    """Requests sent and cancelled unanswered at the stop (not in ``records``); branch ends are counted apart."""
    in_flight_ids: list[str] = field(default_factory=list)
    """The ``X-Request-ID`` (the router's rid) of each of the ``in_flight_at_stop`` requests, sorted: what to look for
    in the cluster's logs when a stopped run's requests never ended; empty without a stop."""
    branch_ends_cancelled: int = 0
    """Branch ends (``POST /v1/branches/{id}/end``) in flight at the stop, cancelled unanswered: the router may not
    have ended those branches (it ends an idle branch at its expiry). Neither failed (``branch_end_failures``) nor in
    ``in_flight_at_stop``; 0 without a stop."""


class RecordAppender:
    """Appends each answered request's record to a run's own records file as it completes (``LiveReplayer.run``'s
    ``on_record``; ``replay`` and ``demo``: ``OUT/requests.partial-<id>.jsonl``,
    :func:`~evolving_infra.out_folder.partial_records`): one JSON line per record, written and flushed to the OS as
    one ``write`` each, so a run SIGKILLed or OOM-killed keeps every record completed before it (each line whole
    JSON). The lines are in completion order; the run's final ``write_report`` writes ``requests.jsonl`` with the
    same records sorted by ``sent_at``, and the file is removed. A line has the fields the replay measured, not those set after it from every record:
    ``ideal_cached_tokens`` (``annotate_ideal``: the blocks of every request sent before, and one sent earlier may
    complete later) and, in ``demo``'s file, ``lost_reuse_cause`` (``annotate_lost_reuse``, from those) are only
    in the final file (absent from a killed run's lines).

    Args:
        path: the file, opened for appending (created if absent).

    Raises:
        OSError: the file cannot be opened (at construction); a write that fails raises from the call, which
            ``LiveReplayer.run`` logs (the record stays in the result and the final file).
    """

    def __init__(self, path: Path) -> None:
        self._file = open(path, "ab")  # noqa: SIM115 - held for the run, closed by close()

    def __call__(self, rec: RequestRecord) -> None:
        self._file.write(_JSON.encode(rec) + b"\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()


_NOT_IN_RID = re.compile(r"[^A-Za-z0-9_-]")


def request_id_for(record_id: str, used: set[str] | None = None) -> str:
    """The ``X-Request-ID`` sent for a request whose id (branch prefix + trace id) is ``record_id``.

    The router takes any 1 to 256 visible ASCII characters but keeps an id as its rid (``req.<rid>.out.<node>``,
    its logs and traces) only when it is 1 to ``RID_MAX_LEN`` (128) characters of ``[A-Za-z0-9_-]``
    (``services.router.api.request_rid`` maps the others), so for the id sent to be the rid of the
    server's records every other character becomes ``-``
    (``ab12cd34ef56:trace_0242:0`` → ``ab12cd34ef56-trace_0242-0``) and a longer id keeps its first 115
    characters + ``-`` + 12 hex digits of its SHA-256. An id ending like one the router maps (``--`` + 20
    lowercase hex digits: ``request_rid`` maps such a safe id too, so that no two ids share a rid) has its
    second ``-`` there made ``_`` (``s--0123…`` → ``s-_0123…``), so the router keeps it. ``used``: ids already
    sent in this run; an id that maps onto one of them (``a:b`` and ``a-b``) gets ``-2``, ``-3``, ... so each
    is unique, and is added.
    """
    rid = _NOT_IN_RID.sub("-", record_id) or "-"
    if len(rid) > RID_MAX_LEN:
        rid = rid[: RID_MAX_LEN - 13] + "-" + hashlib.sha256(record_id.encode()).hexdigest()[:12]
    if request_rid(rid) != rid:  # ends in '--' + 20 lowercase hex digits (the rest is safe and short here)
        rid = rid[:-21] + "_" + rid[-20:]
    if used is None:
        return rid
    base, n = rid, 1
    while rid in used:
        n += 1
        tail = f"-{n}"
        rid = base[: RID_MAX_LEN - len(tail)] + tail
    used.add(rid)
    return rid


def branch_path(branch_id: str) -> str:
    """``branch_id`` as one path segment of ``/v1/branches/{id}/end``: every character but letters,
    digits and ``_-~:`` percent-escaped (the router's path parameter is the decoded segment), so an
    id holding ``/``, ``?``, ``#``, ``%``, a space or ``.`` / ``..`` ends that branch, not another path."""
    return quote(branch_id, safe=":").replace(".", "%2E")


class _Progress:
    """The replay's progress bar (``tqdm`` on stderr; ``kwargs`` are its) that stops quietly, for the rest of the run,
    when a write to its stream fails (``OSError``: a closed pipe, ``replay ... 2>&1 | head``, a log reader gone;
    tqdm passes EPIPE on): the run goes on to its result, records and report. Before, the bar's next write (at the
    latest its close) raised BrokenPipeError out of the replay, which ended with no report."""

    def __init__(self, **kwargs: Any) -> None:
        self._bar: tqdm[Any] | None = None
        try:
            self._bar = tqdm(**kwargs)
        except OSError:  # its first draw failed: no bar
            pass

    def update(self, n: int = 1) -> None:
        """``n`` more done (a redraw when due)."""
        if self._bar is None:
            return
        try:
            self._bar.update(n)
        except OSError:
            self._stop()

    def close(self) -> None:
        """Its last draw; idempotent."""
        if self._bar is None:
            return
        try:
            self._bar.close()
        except OSError:
            self._stop()
        self._bar = None

    def _stop(self) -> None:
        """No more writes: the bar disabled (a disabled tqdm's close writes nothing) and closed."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.disable = True
            bar.close()


PROMPT_CACHE_BYTES = 64 << 20
"""Bytes of JSON text :class:`PromptJson` keeps for trace blocks (least recently used dropped first): about 170k
blocks of 64 tokens, more than the demo's 60 sessions hold (their 742 prompts, 103M tokens, share all but ~11%)."""


class PromptJson:
    """The JSON text of a trace request's prompt token ids (``[1,2,...]`` as msgspec writes
    ``prompt_token_ids(req, block_size) % vocab_size``), made of each full block's text, kept per block id.

    An agent's prompt is its previous prompt and a little more: the demo's prompts average 139k tokens (2,178
    blocks of 64), ~89% of them sent before. Turning every block into ids, the ids into a list of Python ints and
    the list into JSON again for each request cost the replay client ~6 ms a request (~20% of its CPU); the text of a
    block seen before is now looked up (``PROMPT_CACHE_BYTES`` bytes of it kept, least recently used dropped), the
    request's private tail (``tokens_for_tail``) made each time. The bytes are the same as before.

    Args:
        block_size: tokens per trace block id (> 0).
        vocab_size: ids are taken modulo it (None: as made, below ``SIM_VOCAB_SIZE``).
        max_bytes: text kept at most (bytes); 0 keeps none.
    """

    def __init__(self, block_size: int, vocab_size: int | None = None, max_bytes: int = PROMPT_CACHE_BYTES) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_bytes = max_bytes
        self._text: OrderedDict[int, bytes] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        """Blocks whose text was kept (counted for tests and benchmarks)."""
        self.misses = 0
        """Blocks whose text was made."""

    def _ids_text(self, ids: Any) -> bytes:
        """``ids`` (a uint32 array) as JSON list items without the brackets, modulo ``vocab_size``."""
        if self.vocab_size is not None:
            ids = ids % self.vocab_size
        return _JSON.encode(ids.tolist())[1:-1]

    def encode(self, req: TraceRequest) -> bytes:
        """``req``'s prompt ids as a JSON array (bytes).

        Raises:
            ValueError: ``len(req.blocks) != req.input_tokens // block_size`` (as :func:`prompt_token_ids`).
        """
        bs = self.block_size
        if len(req.blocks) != req.input_tokens // bs:
            prompt_token_ids(req, bs)  # raises its ValueError naming the request
        text = self._text
        parts: list[bytes] = []
        missing: dict[int, int] = {}  # block id -> its index in parts, made below
        for b in req.blocks:
            t = text.get(b)
            if t is None:
                if b not in missing:
                    missing[b] = len(parts)
                parts.append(b"")
            else:
                text.move_to_end(b)
                parts.append(t)
        self.hits += len(parts) - len(missing)
        if missing:
            self.misses += len(missing)
            grid = tokens_for_blocks(list(missing), bs).reshape(len(missing), bs)
            made = {b: self._ids_text(row) for b, row in zip(missing, grid)}
            for i, b in enumerate(req.blocks):
                if not parts[i]:
                    parts[i] = made[b]
            for b, t in made.items():
                if self.max_bytes:
                    text[b] = t
                    self._bytes += len(t)
            while self._bytes > self.max_bytes and text:
                self._bytes -= len(text.popitem(last=False)[1])
        tail_n = req.input_tokens % bs
        if tail_n:
            parts.append(self._ids_text(tokens_for_tail(req.id, tail_n)))
        return b"[" + b",".join(parts) + b"]"


class LiveReplayer:
    """Replays trace requests against ``router_url`` on ``clock``.

    Args:
        router_url: e.g. ``http://127.0.0.1:8000``.
        clock: the cluster's simulated clock (same speedup and origin as the services).
        block_size: tokens per trace block id.
        model: model name sent in requests.
        request_timeout_s: wall seconds before a request is abandoned (counted as failed).
        api_key: sent as ``Authorization: Bearer <key>`` with every request (a router run with
            API keys answers 401 without it); None = no header.
        branch_prefix: put in front of every branch, parent branch and agent id sent to the
            cluster (headers and branch-end calls); ``""`` = the trace's own ids.
        retry: when a request refused before any answer (429 / 503, connection refused or reset before
            the first byte) is sent again (:class:`~evolving_infra.replay.retry.RetryPolicy`; default: twice,
            as the OpenAI SDK); ``RetryPolicy(max_retries=0)``: never. A stream that started is never resent.
    """

    def __init__(
        self,
        router_url: str,
        clock: SimClock,
        *,
        block_size: int,
        model: str = "evolving-infra-sim",
        request_timeout_s: float = 600.0,
        progress: bool = True,
        max_connections: int = 512,
        vocab_size: int | None = None,
        api_key: str | None = None,
        branch_prefix: str = "",
        retry: RetryPolicy | None = None,
    ) -> None:
        self.branch_prefix = branch_prefix
        self.retry = RetryPolicy() if retry is None else retry
        self.router_url = router_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.vocab_size = vocab_size
        """The router's vocabulary when it is smaller than the trace's ids (a real tokenizer):
        prompt ids are taken modulo it (same blocks → same ids, so prefixes are still shared)."""
        self.clock = clock
        self.block_size = block_size
        self.model = model
        self.request_timeout_s = request_timeout_s
        self.progress = progress
        self.max_connections = max_connections
        self._branch_kind: dict[str, str] = {}
        self._rids: dict[str, str] = {}
        """Trace request id → the ``X-Request-ID`` sent for it (one per request, unique in the run)."""
        self._rids_used: set[str] = set()
        self._prompts = PromptJson(block_size, vocab_size)

    async def run(
        self,
        requests: Sequence[TraceRequest],
        arrival: Arrival,
        *,
        max_agents: int | None = None,
        stop: asyncio.Event | None = None,
        on_record: Callable[[RequestRecord], None] | None = None,
    ) -> ReplayResult:
        """Replay until every agent has finished; returns one record per request answered.

        Args:
            stop: when set, no new request is sent and the ones in flight are cancelled
                (not recorded; counted in ``in_flight_at_stop``), as are the branch ends in flight, also once every
                request was answered (counted in ``branch_ends_cancelled``); the result says ``interrupted``.
            on_record: called with each record as its request completes (e.g. to append it
                to the run's records file, :class:`RecordAppender`, so an interrupted or killed run keeps what it measured).
        """
        wall0 = time.monotonic()
        start = self.clock.now()
        local = self.clock.local_now  # the core's timeline: a wall-clock step does not move it
        core = ReplayCore(requests, arrival, start=local(), max_agents=max_agents)
        agents = set(list(dict.fromkeys(r.agent for r in requests))[:max_agents])
        total = sum(1 for r in requests if r.agent in agents)
        for r in requests:
            if r.kind is not None:
                self._branch_kind[r.branch] = r.kind
        records: list[RequestRecord] = []
        wake = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()
        sends: set[asyncio.Task[None]] = set()
        """The tasks in ``tasks`` that send a request (its record, once answered): those unfinished at a stop are the
        requests cancelled in flight, not the branch ends that ``tasks`` holds too."""
        sending: dict[str, str] = {}
        """Trace id -> ``X-Request-ID`` of each request sent and not answered yet (``in_flight_ids`` at a stop)."""
        end_failures = 0
        # on a terminal the bar redraws in place; in a log (CI, make demo > file) every redraw is a
        # new line, so there it updates every 10 s instead of every 0.1 s
        bar = _Progress(total=total, desc="replay", unit="req", disable=not self.progress, dynamic_ncols=True,
                        mininterval=0.1 if sys.stderr.isatty() else 10.0)
        limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections)
        async with httpx.AsyncClient(base_url=self.router_url, timeout=httpx.Timeout(self.request_timeout_s), limits=limits,
                                     headers=self.headers) as http:

            async def send(action: SendRequest) -> None:
                sending[action.req.id] = self._request_id(action.req.id)
                try:
                    rec = await self._send(http, action)
                except Exception as e:  # noqa: BLE001 - not httpx's (bad request data, a defect): this request fails,
                    # the replay goes on (a send that raised never reached on_complete and run() waited forever)
                    rec = self._record(action)
                    rec.ok = False
                    rec.error = f"{type(e).__name__}: {e}"
                    rec.finished_at = self.clock.now()
                    log.warning("request failed in the replayer", request=action.req.id, error=rec.error)
                sending.pop(action.req.id, None)
                records.append(rec)
                if on_record is not None:
                    try:
                        on_record(rec)
                    except Exception as e:  # noqa: BLE001 - the record stays in the result; the agent must go on
                        log.error("on_record failed", request=rec.id, error=f"{type(e).__name__}: {e}")
                bar.update(1)
                for follow in core.on_complete(action.req.agent, action.req.id, local(), ok=rec.ok):
                    if isinstance(follow, EndBranch):
                        spawn(end(follow))
                wake.set()

            async def end(action: EndBranch) -> None:
                """End the branch; sent again while :attr:`retry` allows when refused with 429 / 503 (a router that
                could not ask the KV directory about a branch it did not see answers 503 ``Retry-After: 1``) or the
                connection failed: an end is idempotent at the router (a repeat answers 200 ``"already"``), so a
                retry of one that did arrive is harmless. Before, one 503 lost the end (the directory kept the
                branch's counts until its TTL)."""
                nonlocal end_failures
                retries = 0
                while True:
                    retry_after: float | None = None
                    try:
                        resp = await http.post(f"/v1/branches/{branch_path(self.branch_prefix + action.branch)}/end")
                        if resp.status_code < 400:
                            return
                        failure = f"HTTP {resp.status_code}: {resp.text[:200]}"
                        retryable = resp.status_code in RETRY_STATUSES
                        if retryable:
                            retry_after = parse_retry_after(resp.headers.get("retry-after"), time.time())
                    except _RETRY_ERRORS as e:
                        failure, retryable = repr(e), True
                    except Exception as e:  # noqa: BLE001 - httpx's, or InvalidURL / UnicodeEncodeError for an id no URL holds
                        failure, retryable = repr(e), False
                    delay = self.retry.delay_s(retries, retry_after, random.random()) if retryable else None
                    if delay is None:
                        end_failures += 1
                        log.warning("branch end failed", branch=action.branch, error=failure, retries=retries)
                        return
                    retries += 1
                    log.info("branch end retried", branch=action.branch, error=failure, retry=retries, wait_s=round(delay, 3))
                    await asyncio.sleep(delay)

            closing = False

            def spawn(coro: Coroutine[object, object, None], *, request: bool = False) -> None:
                if closing:  # run() is unwinding: nothing new may start on a client about to close
                    coro.close()
                    return
                t = asyncio.create_task(coro)
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                if request:  # a request's send (the others are branch ends, not requests)
                    sends.add(t)
                    t.add_done_callback(sends.discard)

            stopped = False
            in_flight = 0
            in_flight_ids: list[str] = []
            ends_cancelled = 0
            try:
                while not core.done:
                    if stop is not None and stop.is_set():
                        stopped = True
                        break
                    for action in core.poll(local()):
                        if isinstance(action, SendRequest):
                            spawn(send(action), request=True)
                        else:
                            spawn(end(action))
                    nxt = core.next_time()
                    wake.clear()
                    timeout = None if nxt is None else max(0.0, self.clock.to_wall(nxt - local()))
                    if nxt is None and not tasks:
                        break  # nothing due and nothing in flight: the trace is exhausted
                    waiters = [asyncio.ensure_future(wake.wait())]
                    if stop is not None:
                        waiters.append(asyncio.ensure_future(stop.wait()))
                    try:
                        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for w in waiters:
                            w.cancel()
                while tasks and not stopped:  # the last branch ends (an answered send may spawn its branch's end)
                    if stop is not None and stop.is_set():
                        stopped = True
                        break
                    tail: list[asyncio.Future[Any]] = [asyncio.ensure_future(asyncio.wait(list(tasks)))]
                    if stop is not None:  # raced against the stop, as the loop above: a router whose bus is gone
                        # answers no branch end, and each would be waited for up to request_timeout_s
                        tail.append(asyncio.ensure_future(stop.wait()))
                    try:
                        await asyncio.wait(tail, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for f in tail:
                            f.cancel()
                if stop is not None and stop.is_set():
                    stopped = True
                if stopped:
                    in_flight = sum(1 for t in sends if not t.done())  # requests only, not branch ends
                    in_flight_ids = sorted(sending.values())
                    ends_cancelled = sum(1 for t in tasks if t not in sends and not t.done())
                    for t in list(tasks):
                        t.cancel()
                while tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                # no task outlives the client: run() cancelled (Ctrl-C on `demo`) while a send was answered,
                # its branch's end() met a closed client ('Task exception was never retrieved')
                closing = True
                for t in list(tasks):
                    t.cancel()
                while tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
                bar.close()
        return ReplayResult(
            records=records,
            start=start,
            end=self.clock.now(),
            wall_s=time.monotonic() - wall0,
            agents=core.agents_total,
            branch_end_failures=end_failures,
            interrupted=stopped,
            in_flight_at_stop=in_flight,
            in_flight_ids=in_flight_ids,
            branch_ends_cancelled=ends_cancelled,
        )

    def _headers(self, action: SendRequest) -> dict[bytes, bytes]:
        """The agent headers of ``action``'s request, each value the id's UTF-8 bytes: the router reads them as
        UTF-8 (``services.router.api.header_text``), the same id as the UTF-8 path of its end (:func:`branch_path`).
        httpx sends a str value as ASCII: a trace or prefix id such as ``zweig-ä`` failed every request in the
        client (``UnicodeEncodeError``) before.

        Raises:
            UnicodeEncodeError: an id holds a lone surrogate (no UTF-8 form; the request is counted failed).
        """
        req = action.req
        pre = self.branch_prefix
        h = {b"X-Branch-Id": (pre + req.branch).encode(), b"X-Agent-Id": (pre + req.agent).encode()}
        if action.new_branch:
            kind = req.kind or "main"
            if kind in ("fork", "subagent"):
                h[b"X-Branch-Kind"] = kind.encode()
            if req.parent_branch:
                h[b"X-Parent-Branch-Id"] = (pre + req.parent_branch).encode()
        return h

    def _request_id(self, trace_id: str) -> str:
        """The ``X-Request-ID`` of the trace's request ``trace_id`` (:func:`request_id_for`; the same on every call)."""
        rid = self._rids.get(trace_id)
        if rid is None:
            rid = self._rids[trace_id] = request_id_for(self.branch_prefix + trace_id, self._rids_used)
        return rid

    def _record(self, action: SendRequest) -> RequestRecord:
        """The request's record as it is sent (trace ids, ``sent_at`` now), before any answer."""
        req = action.req
        return RequestRecord(
            id=req.id,
            x_request_id=self._request_id(req.id),
            agent=req.agent,
            branch=req.branch,
            branch_kind=self._branch_kind.get(req.branch, "main"),
            sent_at=self.clock.now(),
            admission_wait_s=action.admission_wait_s,
            expected_prompt_tokens=req.input_tokens,
            expected_completion_tokens=req.output_tokens,
        )

    def request_body(self, req: TraceRequest) -> bytes:
        """The JSON body of ``req``'s ``POST /v1/completions``: ``model``, ``prompt`` (its token ids,
        :func:`prompt_token_ids` modulo ``vocab_size``), ``max_tokens`` (the recorded output, at least 1),
        ``ignore_eos``, ``stream`` with usage; the bytes msgspec writes for that object, the prompt's text
        from :class:`PromptJson`.

        Raises:
            ValueError: the request's blocks do not match its ``input_tokens`` (:func:`prompt_token_ids`).
        """
        rest = {"max_tokens": max(1, req.output_tokens), "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        return b"".join((_JSON.encode({"model": self.model})[:-1], b',"prompt":', self._prompts.encode(req), b",", _JSON.encode(rest)[1:]))

    async def _send(self, http: httpx.AsyncClient, action: SendRequest) -> RequestRecord:
        """Send ``action``'s request, again while :attr:`retry` allows when it was refused before any answer
        (:mod:`evolving_infra.replay.retry`); its record: TTFT and E2E from the first send, waits included."""
        req = action.req
        content = self.request_body(req)
        wait = action.admission_wait_s
        rec = self._record(action)
        t0 = self.clock.local_now()  # TTFT / E2E: local durations (a wall-clock step does not lengthen them)
        while True:
            first: float | None = None
            got_response = refused = retryable = False
            retry_after: float | None = None
            try:
                async with http.stream(
                    "POST",
                    "/v1/completions",
                    content=content,
                    headers={**self._headers(action), b"Content-Type": b"application/json",
                             b"X-Request-ID": (rec.x_request_id or "").encode()},  # fmt: skip
                ) as resp:
                    got_response = True
                    rec.status = resp.status_code
                    rec.request_id = resp.headers.get("x-request-id")
                    if resp.status_code != 200:
                        text = (await resp.aread()).decode(errors="replace")
                        rec.ok = False
                        rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                        refused = True
                        if resp.status_code in RETRY_STATUSES:
                            retryable = True
                            retry_after = parse_retry_after(resp.headers.get("retry-after"), time.time())
                    else:
                        first = await self._read_stream(resp, rec)
            except (httpx.HTTPError, msgspec.DecodeError) as e:
                rec.ok = False
                rec.error = f"{type(e).__name__}: {e}"
                # no byte of an answer yet (refused, reset before the status line): nothing reached the agent
                retryable = not got_response and isinstance(e, _RETRY_ERRORS)
            if retryable:
                delay = self.retry.delay_s(rec.retries, retry_after, random.random())
                if delay is not None:
                    log.info("request retried", request=req.id, error=rec.error, retry=rec.retries + 1, wait_s=round(delay, 3))
                    rec.retries += 1
                    await asyncio.sleep(delay)
                    rec.ok, rec.error, rec.status, rec.request_id = True, None, 200, None
                    rec.retry_wait_s = self.clock.local_now() - t0  # first send -> this one (not the control plane's)
                    continue
            break
        if refused:
            rec.finished_at = self.clock.now()
            return rec
        done = self.clock.local_now()
        rec.finished_at = self.clock.now()
        if rec.ok:
            if first is None:
                rec.ok = False
                rec.error = rec.error or "stream ended without tokens"
            else:
                rec.ttft_s = first - t0 + wait
                rec.e2e_s = done - t0 + wait
        return rec

    async def _read_stream(self, resp: httpx.Response, rec: RequestRecord) -> float | None:
        """Read a 200 answer's SSE stream into ``rec`` (nodes, queue, fetch, usage; ``ok`` / ``error`` on an
        error event, ``completion_tokens`` from the usage as it comes); returns the local time of the first token, None without one.

        Raises:
            httpx.HTTPError: the stream broke. msgspec.DecodeError: an event that is not JSON.
        """
        first: float | None = None
        rec.prefill_node = resp.headers.get("x-ei-prefill-node")
        rec.decode_node = resp.headers.get("x-ei-decode-node")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = _DEC.decode(data)
            if "error" in obj:
                rec.ok = False
                rec.error = str(obj["error"].get("message", obj["error"]) if isinstance(obj["error"], dict) else obj["error"])
                break
            for choice in obj.get("choices") or ():
                if choice.get("text") or choice.get("finish_reason"):
                    if first is None and choice.get("text"):
                        first = self.clock.local_now()
            ei = obj.get("ei")
            if ei:
                rec.prefill_node = ei.get("prefill_node") or rec.prefill_node
                rec.decode_node = ei.get("decode_node") or rec.decode_node
                if ei.get("queue_s") is not None:
                    rec.queue_s = float(ei["queue_s"])
                if ei.get("first_token_at") is not None:  # the prefill node's times (control plane)
                    rec.first_token_at = float(ei["first_token_at"])
                    if ei.get("arrived_at") is not None:
                        rec.node_arrived_at = float(ei["arrived_at"])
                if ei.get("predicted_ttft_s") is not None:
                    rec.predicted_ttft_s = float(ei["predicted_ttft_s"])
                if ei.get("fetch_s") is not None:  # a peer fetch (RequestRecord.fetch_*)
                    rec.fetch_s = float(ei["fetch_s"])
                    rec.exposed_fetch_s = float(ei.get("exposed_fetch_s") or 0.0)
                    rec.fetched_tokens = int(ei.get("fetched_tokens") or 0)
                    rec.fetch_sources = [str(n) for n in ei.get("fetch_sources") or ()]
            usage = obj.get("usage")
            if usage:
                rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
                rec.completion_tokens = int(usage.get("completion_tokens", 0))
                details = usage.get("prompt_tokens_details") or {}
                rec.cached_tokens = int(details.get("cached_tokens") or 0)
        return first
