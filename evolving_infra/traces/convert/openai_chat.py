"""OpenAI-chat request logs (JSONL) → canonical trace (spec: docs/trace-format.md §7.5).

Bring your own trace: one JSON object per line, one line per chat request as an agent
harness or an OpenAI-compatible proxy (LiteLLM, our router) logs it. Fields (the first
name found is used; ``a.b`` is a nested key; header names are matched case-insensitively):

* the request body: ``request`` or ``body``, else the line itself: ``messages`` (required),
  ``tools``, ``model``;
* send time: ``timestamp``, ``start_time``, ``startTime``, ``created``, ``request_time``
  (unix seconds, or an ISO 8601 string); optional ``end_time`` / ``endTime`` /
  ``completed_at`` (when the answer was complete);
* completion tokens of the answer: ``response.usage.completion_tokens``,
  ``usage.completion_tokens``, ``completion_tokens``, ``usage.output_tokens``, else
  ``max_tokens`` of the request (counted as ``output_tokens_from_max_tokens``);
* session (the trace's agent): ``session_id``, ``session``, ``conversation_id``,
  ``metadata.session_id``, header ``X-Agent-Id``, ``user``; none: the file's name;
* the caller inside a session (a sub-agent has its own): ``agent_id``,
  ``metadata.agent_id``;
* branch headers where the harness sends them: ``X-Branch-Id``, ``X-Parent-Branch-Id``,
  ``X-Branch-Kind`` in ``headers`` (or ``request_headers``, ``metadata.headers``), or
  ``branch_id`` / ``parent_branch_id`` / ``branch_kind`` on the line.

Conversion:

* **Tokens and blocks.** ``messages`` (+ ``tools``) are rendered with the tokenizer's chat
  template (``sim`` by default: ChatML, words hashed to ids; ``hf:<path>`` for a model's
  own) and the tokens hashed into chained ids with
  :func:`evolving_infra.traces.tokens.blocks_from_tokens`; ``input_tokens`` is the rendered
  length (the provider's ``prompt_tokens``, when logged, is summed in ``meta.counts``).
* **Branches** from headers when a line has ``X-Branch-Id``; otherwise inferred per session
  and caller (``agent_id``): a request whose messages start with all the messages of the
  last request of one of the caller's branches continues that branch (the longest such);
  the first request of a session opens its ``main`` branch; the first request of another
  caller opens a ``subagent`` branch whose parent is the branch of the session's previous
  request; a request that extends an earlier (not the last) request of a branch opens a
  ``fork`` of that branch; one that extends nothing but keeps the first (system) message of
  its caller's latest branch is a **compaction** of that branch (``compaction: true``, same
  branch); anything else opens a ``subagent`` branch.
* **Order.** ``after`` = the branch's previous request, plus (a join) the last request of
  every child branch of it that was opened since and whose last request came before; a new
  fork / sub-agent branch waits on its parent branch's latest request. ``pause_s`` = send
  time − the latest end (``end_time``, else send time) of the ``after`` requests, clipped
  at 0; ``t_s`` from the session's first request; ``arrival_s`` = that request's time.
  Lines are ordered by send time (file order on ties); every branch's last request ends it.
"""

from __future__ import annotations

import datetime as _dt
from collections import Counter
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

import msgspec

from evolving_infra.traces.convert.common import (
    Conversion,
    ConvertError,
    Skipped,
    expand_inputs,
    inputs_meta,
    make_header,
    progress_iter,
    source_line,
)
from evolving_infra.traces.schema import BranchKind, TraceRequest
from evolving_infra.traces.tokens import blocks_from_tokens

KIND = "openai-chat"
PATTERNS = ("*.jsonl", "*.jsonl.gz")
DEFAULT_BLOCK_SIZE = 64

_TIME_KEYS = ("timestamp", "start_time", "startTime", "created", "request_time")
_END_KEYS = ("end_time", "endTime", "completed_at")
_OUT_KEYS = ("response.usage.completion_tokens", "usage.completion_tokens", "completion_tokens", "usage.output_tokens")
_PROMPT_KEYS = ("response.usage.prompt_tokens", "usage.prompt_tokens", "prompt_tokens")
_SESSION_KEYS = ("session_id", "session", "conversation_id", "metadata.session_id")
_CALLER_KEYS = ("agent_id", "metadata.agent_id")
_KINDS = ("main", "fork", "subagent")


def _get(d: dict[str, Any], dotted: str) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _first(d: dict[str, Any], keys: Sequence[str]) -> Any:
    for k in keys:
        v = _get(d, k)
        if v is not None and v != "":
            return v
    return None


def _time(v: Any, what: str) -> float:
    if isinstance(v, bool):
        raise ConvertError(f"{what} {v!r} is not a time")
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
        try:
            t = _dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            raise ConvertError(f"{what} {v!r} is neither unix seconds nor ISO 8601") from None
        if t.tzinfo is None:
            t = t.replace(tzinfo=_dt.timezone.utc)
        return t.timestamp()
    raise ConvertError(f"{what} {v!r} is not a time")


def _headers(d: dict[str, Any]) -> dict[str, str]:
    for k in ("headers", "request_headers", "metadata.headers"):
        h = _get(d, k)
        if isinstance(h, dict):
            return {str(a).lower(): str(b) for a, b in h.items()}
    return {}


def _norm(m: Any) -> bytes:
    """A message's identity for prefix matching: its role, content and tool fields."""
    if not isinstance(m, dict):
        raise ConvertError(f"a message is a {type(m).__name__}, not an object")
    keep = {k: m[k] for k in ("role", "content", "name", "tool_calls", "tool_call_id") if m.get(k) is not None}
    return msgspec.json.encode(keep, order="sorted")


class _Line:
    __slots__ = ("branch_hdr", "caller", "end", "kind_hdr", "line", "msgs", "n_out", "n_prompt", "parent_hdr",
                 "raw", "session", "t", "tools", "model")

    def __init__(self, d: dict[str, Any], line: int, default_session: str, counts: Counter[str]) -> None:
        body: dict[str, Any] = d
        for k in ("request", "body"):
            if isinstance(d.get(k), dict):
                body = d[k]
                break
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ConvertError("no 'messages' list (in 'request', 'body' or the line itself)")
        self.raw = msgs
        self.msgs = [_norm(m) for m in msgs]
        tools = body.get("tools")
        self.tools = tools if isinstance(tools, list) and tools else None
        self.model = str(body.get("model") or d.get("model") or "") or None
        t = _first(d, _TIME_KEYS)
        if t is None:
            raise ConvertError(f"no send time (one of {', '.join(_TIME_KEYS)})")
        self.t = _time(t, "send time")
        e = _first(d, _END_KEYS)
        self.end = _time(e, "end time") if e is not None else None
        out = _first(d, _OUT_KEYS)
        if out is None and body.get("max_tokens") is not None:
            out = body.get("max_tokens")
            counts["output_tokens_from_max_tokens"] += 1
        if out is None or isinstance(out, bool) or not isinstance(out, (int, float)) or out < 0:
            raise ConvertError(f"no completion token count ({', '.join(_OUT_KEYS)}, or the request's max_tokens)")
        self.n_out = int(out)
        p = _first(d, _PROMPT_KEYS)
        self.n_prompt = int(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else None
        h = _headers(d)
        sess = _first(d, _SESSION_KEYS) or h.get("x-agent-id") or d.get("user") or default_session
        self.session = str(sess)
        caller = _first(d, _CALLER_KEYS)
        self.caller = str(caller) if caller is not None else ""
        self.branch_hdr = h.get("x-branch-id") or (str(d["branch_id"]) if d.get("branch_id") else None)
        self.parent_hdr = h.get("x-parent-branch-id") or (str(d["parent_branch_id"]) if d.get("parent_branch_id") else None)
        self.kind_hdr = h.get("x-branch-kind") or (str(d["branch_kind"]) if d.get("branch_kind") else None)
        if self.kind_hdr is not None and self.kind_hdr not in _KINDS:
            raise ConvertError(f"branch kind {self.kind_hdr!r} is not one of {', '.join(_KINDS)}")
        self.line = line


class _Branch:
    __slots__ = ("caller", "children", "first_msg", "id", "last", "last_msgs", "parent", "reqs")

    def __init__(self, bid: str, caller: str, parent: str | None) -> None:
        self.id = bid
        self.caller = caller
        self.parent = parent
        self.last: str | None = None
        self.last_msgs: list[bytes] = []
        self.first_msg: bytes | None = None
        self.children: list[str] = []  # opened since this branch's last request, not joined yet
        self.reqs: list[tuple[str, list[bytes]]] = []


def _extends(prefix: list[bytes], msgs: list[bytes]) -> bool:
    return len(prefix) <= len(msgs) and msgs[: len(prefix)] == prefix


class _Session:
    def __init__(self, agent: str, t0: float) -> None:
        self.agent = agent
        self.t0 = t0
        self.branches: dict[str, _Branch] = {}
        self.last_branch: str | None = None
        self.n = 0
        self.done: dict[str, float] = {}  # request id -> end (or send) time
        self.last_req: dict[str, TraceRequest] = {}  # branch -> its latest request (ends_branch set at the end)
        self.order: dict[str, int] = {}  # branch -> number of its latest request in the session

    def place(self, ln: _Line, counts: Counter[str]) -> tuple[_Branch, BranchKind | None, list[str], bool]:
        """(branch, kind of a new branch or None, after, compaction) of a line."""
        if ln.branch_hdr is not None:
            bid = f"{self.agent}:{ln.branch_hdr}"
            b = self.branches.get(bid)
            if b is not None:
                return b, None, [], not _extends(b.last_msgs, ln.msgs)
            parent = f"{self.agent}:{ln.parent_hdr}" if ln.parent_hdr else self.last_branch
            if parent is not None and parent not in self.branches:
                counts["parent_branch_unknown"] += 1
                parent = self.last_branch
            kind = cast(BranchKind, ln.kind_hdr or ("main" if parent is None else "subagent"))
            if kind == "main":
                parent = None
            elif parent is None:
                raise ConvertError(f"branch {ln.branch_hdr!r} is a {kind} but its session has no earlier branch")
            return self._open(bid, ln.caller, parent), kind, [], False
        mine = [b for b in self.branches.values() if b.caller == ln.caller]
        best: _Branch | None = None
        for b in mine:
            if _extends(b.last_msgs, ln.msgs) and (best is None or len(b.last_msgs) >= len(best.last_msgs)):
                best = b
        if best is not None:
            return best, None, [], False
        if not self.branches:
            return self._open(f"{self.agent}:main", ln.caller, None), "main", [], False
        if not mine:
            assert self.last_branch is not None
            return self._open(self._new_id(), ln.caller, self.last_branch), "subagent", [], False
        fork_of: tuple[_Branch, str, int] | None = None
        for b in mine:
            for rid, msgs in b.reqs[:-1]:
                if len(msgs) > 1 and _extends(msgs, ln.msgs) and (fork_of is None or len(msgs) > fork_of[2]):
                    fork_of = (b, rid, len(msgs))
        if fork_of is not None:
            return self._open(self._new_id(), ln.caller, fork_of[0].id), "fork", [fork_of[1]], False
        latest = max(mine, key=lambda b: self.order[b.id])
        if latest.first_msg is not None and ln.msgs[0] == latest.first_msg:
            return latest, None, [], True
        assert self.last_branch is not None
        return self._open(self._new_id(), ln.caller, self.last_branch), "subagent", [], False

    def _new_id(self) -> str:
        k = len(self.branches)
        while f"{self.agent}:b{k}" in self.branches:  # a header may have named one so
            k += 1
        return f"{self.agent}:b{k}"

    def _open(self, bid: str, caller: str, parent: str | None) -> _Branch:
        b = _Branch(bid, caller, parent)
        self.branches[bid] = b
        if parent is not None:
            self.branches[parent].children.append(bid)
        return b


def _convert_file(path: Path, tok: Any, bs: int, counts: Counter[str], skipped: Skipped,
                  taken: set[str]) -> list[tuple[float, int, TraceRequest, _Session]]:
    import gzip

    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise ConvertError(f"{path}: cannot read: {e}") from None
    default = path.name.split(".")[0]
    lines: list[_Line] = []
    for i, text in enumerate(raw.splitlines(), 1):
        if not text.strip():
            continue
        try:
            d = msgspec.json.decode(text)
            if not isinstance(d, dict):
                raise ConvertError("not a JSON object")
            lines.append(_Line(d, i, default, counts))
        except (msgspec.DecodeError, ConvertError) as e:
            skipped.row(path, i, str(e))
    skipped.end_file(path)
    lines.sort(key=lambda ln: ln.t)  # stable: file order on ties
    sessions: dict[str, _Session] = {}
    out: list[tuple[float, int, TraceRequest, _Session]] = []
    for ln in lines:
        s = sessions.get(ln.session)
        if s is None:
            agent = ln.session
            if agent in taken:  # the same session id in another file: ids must stay unique in one trace
                k = 2
                while f"{agent}#{k}" in taken:
                    k += 1
                agent = f"{agent}#{k}"
                counts["sessions_renamed_duplicate_id"] += 1
            taken.add(agent)
            s = sessions[ln.session] = _Session(agent, ln.t)
        try:
            ids = tok.apply_chat_template(ln.raw, ln.tools)
        except (TypeError, ValueError, KeyError) as e:  # a message the chat template cannot render
            skipped.row(path, ln.line, f"the chat template cannot render the messages: {e}")
            continue
        if not ids:
            skipped.row(path, ln.line, "the messages render to no tokens")
            continue
        try:
            branch, kind, after, compaction = s.place(ln, counts)
        except ConvertError as e:
            skipped.row(path, ln.line, str(e))
            continue
        rid = f"{s.agent}:{s.n}"
        if kind is None:
            assert branch.last is not None
            after = [branch.last]
            for c in branch.children:
                cb = s.branches[c]
                if cb.last is not None and cb.last != after[0]:
                    after.append(cb.last)
            branch.children = [c for c in branch.children if s.branches[c].last is None]
        elif kind != "main" and not after:
            parent = s.branches[branch.parent] if branch.parent else None
            if parent is not None and parent.last is not None:
                after = [parent.last]
        after = list(dict.fromkeys(after))
        if s.n == 0:  # the session starts at its first converted request
            s.t0 = ln.t
        ready = max((s.done[a] for a in after), default=s.t0)
        req = TraceRequest(
            id=rid, agent=s.agent, branch=branch.id, input_tokens=len(ids), output_tokens=ln.n_out,
            blocks=blocks_from_tokens(ids, bs), kind=kind, parent_branch=branch.parent if kind in ("fork", "subagent") else None,
            after=after, pause_s=round(max(0.0, ln.t - ready), 6) if after else 0.0,
            t_s=round(ln.t - s.t0, 6), arrival_s=s.t0 if s.n == 0 else None, compaction=compaction,
            model=ln.model,
        )
        counts["requests"] += 1
        counts["compactions"] += bool(compaction)
        if kind is not None:
            counts[f"branches_{kind}"] += 1
        if ln.n_prompt is not None:
            counts["provider_prompt_tokens"] += ln.n_prompt
        counts["input_tokens"] += len(ids)
        s.done[rid] = ln.end if ln.end is not None else ln.t
        s.order[branch.id] = s.n
        s.n += 1
        branch.last = rid
        branch.last_msgs = ln.msgs
        if branch.first_msg is None or compaction:
            branch.first_msg = ln.msgs[0]
        branch.reqs.append((rid, ln.msgs))
        s.last_branch = branch.id
        s.last_req[branch.id] = req
        out.append((ln.t, len(out), req, s))
    counts["sessions"] += len(sessions)
    return out


def convert(
    inputs: Sequence[str | Path], *, progress: bool = False, block_size: int = DEFAULT_BLOCK_SIZE, strict: bool = False,
    tokenizer: str = "sim",
) -> Conversion:
    """Convert OpenAI-chat request logs (JSONL files, or folders of ``*.jsonl[.gz]``) to a canonical trace.

    Args:
        block_size: tokens per block id (default 64).
        strict: stop at the first line that cannot be converted (default: name it on stderr,
            skip it, count it in ``meta.skipped``).
        tokenizer: ``sim`` (default) or ``hf:<path>`` (``shared.tokenizer.load_tokenizer``).

    Raises:
        ConvertError: missing input, an unloadable tokenizer; with ``strict``, a bad line.
    """
    if block_size < 1:
        raise ConvertError("block_size must be >= 1")
    from shared.tokenizer import TokenizerError, load_tokenizer

    try:
        tok = load_tokenizer(tokenizer)
    except (TokenizerError, ValueError) as e:
        raise ConvertError(f"--tokenizer {tokenizer}: {e}") from None
    files = expand_inputs(inputs, PATTERNS)
    counts: Counter[str] = Counter()
    skipped = Skipped(strict)
    taken: set[str] = set()

    def gen() -> Iterator[TraceRequest]:
        rows: list[tuple[float, int, int, TraceRequest, _Session]] = []
        for fi, p in enumerate(progress_iter(files, enabled=progress, desc=KIND)):
            got = skipped.call(p, partial(_convert_file, p, tok, block_size, counts, skipped, taken))
            rows.extend((t, fi, i, r, s) for t, i, r, s in got or [])
        if not rows:
            skipped.none_converted()
            raise ConvertError(f"no request in {', '.join(str(p) for p in files)}")
        ends = {id(r) for s in {id(s): s for *_, s in rows}.values() for r in s.last_req.values()}
        rows.sort(key=lambda x: (x[0], x[1], x[2]))  # send order across files (stable within one)
        for _, _, _, r, _ in rows:
            yield msgspec.structs.replace(r, ends_branch=True) if id(r) in ends else r

    def header():  # type: ignore[no-untyped-def]
        meta: dict[str, Any] = {
            "converter": KIND,
            "options": {"block_size": block_size, "tokenizer": tokenizer},
            **inputs_meta([p.name for p in files]),
            "block_ids": "traces.tokens.blocks_from_tokens of the chat template's tokens (chained BLAKE2b, 47 bits)",
            "clock": "arrival_s = the send time of a session's first request (the log's clock); t_s from it",
            "counts": dict(sorted(counts.items())),
            "skipped": skipped.meta(),
        }
        return make_header(
            block_size=block_size,
            source=source_line(KIND, inputs),
            description="OpenAI-chat request log: sessions, branches from headers or prefix extension",
            meta=meta,
        )

    return Conversion(gen(), header)
