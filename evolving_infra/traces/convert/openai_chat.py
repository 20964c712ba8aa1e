"""OpenAI-chat request logs (JSONL) → canonical trace (spec: docs/trace-format.md §7.5).

Bring your own trace: one JSON object per line, one line per chat request as an agent
harness or an OpenAI-compatible proxy (e.g. LiteLLM's StandardLoggingPayload) logs it.
Fields (the first name found is used; ``a.b`` is a nested key; header names are matched
case-insensitively):

* the request body: ``request`` or ``body``, else the line itself: ``messages`` (required;
  Anthropic-format ``tool_use`` / ``tool_result`` / ``thinking`` blocks become text parts, a
  top-level ``system`` a first system message), ``tools`` (else ``model_parameters.tools``), ``model``;
* send time: ``timestamp``, ``start_time``, ``startTime``, ``created``, ``request_time``
  (unix seconds, or an ISO 8601 string; finite); optional ``end_time`` / ``endTime`` /
  ``completed_at`` (when the answer was complete);
* completion tokens of the answer: ``response.usage.completion_tokens``,
  ``usage.completion_tokens``, ``completion_tokens``, ``usage.output_tokens``, else
  ``max_tokens`` / ``max_completion_tokens`` of the request (or of ``model_parameters``;
  counted as ``output_tokens_from_max_tokens``); an integer in 0..2**31, else a bad row;
* a line with ``status`` ``failure`` (LiteLLM), ``error`` or ``failed`` is a failed call: not
  a request (counted ``failed_calls_skipped``);
* session (the trace's agent): ``session_id``, ``session``, ``conversation_id``,
  ``metadata.session_id``, ``trace_id`` (LiteLLM's, from ``litellm_session_id``), header
  ``X-Agent-Id``, ``user``, ``end_user`` (on the line, else in the stored request body); none,
  or an id on one line only (LiteLLM's random ``trace_id``): see "no session" below;
* the caller inside a session (a sub-agent has its own): ``agent_id``,
  ``metadata.agent_id``;
* branch headers where the harness sends them: ``X-Branch-Id``, ``X-Parent-Branch-Id``,
  ``X-Branch-Kind`` in ``headers`` (or ``request_headers``, ``metadata.headers``), or
  ``branch_id`` / ``parent_branch_id`` / ``branch_kind`` on the line.

Conversion (all lines of all inputs, in send order, so a session split across rotated files
stays one agent):

* **Tokens and blocks.** ``messages`` (+ ``tools``) are rendered with the tokenizer's chat
  template (``sim`` by default: ChatML, words hashed to ids; ``hf:<path>`` for a model's
  own) and the tokens hashed into chained ids with
  :func:`evolving_infra.traces.tokens.blocks_from_tokens`; ``input_tokens`` is the rendered
  length (the provider's ``prompt_tokens``, when logged, is summed in ``meta.counts``).
  A line the template cannot render (its ``raise_exception`` included) is a bad row.
* **Message identity** (for "extends"): role, content, name, tool calls, tool call id; a
  content part without ``cache_control`` (a text part: its type and text); a list of text parts
  only is its texts joined by newlines; content None, "" and [] are equal.
* **Branches** from headers when a line has ``X-Branch-Id``; otherwise inferred per session
  and caller (``agent_id``): a request whose messages start with all the messages of the
  last request of one of the caller's branches continues that branch (the longest such);
  the first request of a session opens its ``main`` branch; a request that extends an
  earlier (not the last) request (of more than one message) of the caller opens a ``fork``
  after it; one whose system prompt differs but whose later messages extend a branch's last
  request's later messages continues that branch; one that extends nothing, keeps the first
  (system) message of the caller's latest main/fork branch (else its latest branch), is shorter
  (in tokens) than that branch's last request, is sent after its logged end and is not followed
  by a line of the caller extending that request (look-ahead) is a **compaction** of that branch
  (``compaction: true``, same branch); anything else (another caller's first request
  included) opens a ``subagent`` branch whose parent is the latest main/fork branch of the
  session's main caller (the caller of its first request).
* **No session.** A line without a session id (and without branch headers) is its own
  agent (``FILE.N``, FILE = the file's name up to its first dot; a one-line session id is
  such a line and keeps its id) unless its messages start with all the messages of an
  earlier such request and go on (more messages): it then continues that request's branch,
  or forks after it when the branch went on. Branch-header lines without a session id are
  one session over all inputs.
* **Order.** ``after`` = the branch's previous request, plus (a join) the last request of
  every child branch of it that was opened since and has a request; a new fork / sub-agent
  branch waits on its parent branch's latest request (a fork: the request it extends).
  ``pause_s`` = send time − the latest end (``end_time``, else send time) of the ``after``
  requests, clipped at 0; ``t_s`` from the session's first request; ``arrival_s`` = that
  request's time. Lines are ordered by send time (file name, then line on ties);
  every branch's last request ends it.

Placement costs O(a request's messages): branches are indexed by the chained hash of their
last request's messages, forks by the hashes of all earlier requests. A placed line's
messages are dropped.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import math
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
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
    read_input,
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
_SESSION_KEYS = ("session_id", "session", "conversation_id", "metadata.session_id", "trace_id")
_USER_KEYS = ("user", "end_user")
_CALLER_KEYS = ("agent_id", "metadata.agent_id")
_FAILED = ("failure", "error", "failed")
_KINDS = ("main", "fork", "subagent")
#: send times above this look like milliseconds (1e11 s is the year 5138)
_MS_LIKE = 1e11


def _get(d: dict[str, Any], dotted: str) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _first(d: dict[str, Any], keys: Sequence[str]) -> Any:
    """The first of ``keys`` present with a value other than None or "" (0 counts)."""
    for k in keys:
        v = _get(d, k)
        if v is not None and v != "":
            return v
    return None


def _time(v: Any, what: str) -> float:
    """Unix seconds of ``v`` (a number, a numeric string or ISO 8601; no zone = UTC).

    Raises:
        ConvertError: not a time, or not finite (nan, inf).
    """
    if isinstance(v, bool):
        raise ConvertError(f"{what} {v!r} is not a time")
    t: float | None = None
    if isinstance(v, (int, float)):
        t = float(v)
    elif isinstance(v, str):
        try:
            t = float(v)
        except ValueError:
            try:
                d = _dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
            except ValueError:
                raise ConvertError(f"{what} {v!r} is neither unix seconds nor ISO 8601") from None
            if d.tzinfo is None:
                d = d.replace(tzinfo=_dt.timezone.utc)
            t = d.timestamp()
    if t is None:
        raise ConvertError(f"{what} {v!r} is not a time")
    if not math.isfinite(t):
        raise ConvertError(f"{what} {v!r} is not a finite time")
    return t


def _count_ok(v: Any) -> bool:
    """``v`` is a token count: an integer (or an integral float) in 0..2**31."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 2**31
            and (isinstance(v, int) or v.is_integer()))


def _headers(d: dict[str, Any]) -> dict[str, str]:
    for k in ("headers", "request_headers", "metadata.headers"):
        h = _get(d, k)
        if isinstance(h, dict):
            return {str(a).lower(): str(b) for a, b in h.items()}
    return {}


def _part(p: Any) -> Any:
    """A content part as a template renders it: a text part is its text; any other part
    keeps its fields but not ``cache_control`` (a provider hint no template renders)."""
    if not isinstance(p, dict):
        return p
    if p.get("type") == "text":
        return {"type": "text", "text": p.get("text")}
    return {k: v for k, v in p.items() if k != "cache_control"}


def _norm(m: Any) -> bytes:
    """A message's identity for prefix matching: what a chat template renders of it (role,
    content, name, tool calls, tool call id), with content parts reduced by :func:`_part`; a
    list of text parts only is its texts joined by newlines (as the ``sim`` template and vLLM
    render it: the same as that string), and ``None``, ``""`` and ``[]`` are no content."""
    if not isinstance(m, dict):
        raise ConvertError(f"a message is a {type(m).__name__}, not an object")
    keep = {k: m[k] for k in ("role", "name", "tool_calls", "tool_call_id") if m.get(k) is not None}
    c = m.get("content")
    if isinstance(c, list):
        parts = [_part(p) for p in c]
        if all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
            c = "\n".join(str(p.get("text") or "") for p in parts)
        else:
            c = parts
    if c is not None and c != "":
        keep["content"] = c
    return msgspec.json.encode(keep, order="sorted")


def _block_text(p: Any) -> str | None:
    """The text of an Anthropic content block that a chat template would not render (None for
    any other part): ``tool_use`` its name and input as JSON, ``tool_result`` its content's text,
    ``thinking`` its thinking text."""
    if not isinstance(p, dict):
        return None
    t = p.get("type")
    if t == "tool_use":
        return msgspec.json.encode({"name": p.get("name"), "input": p.get("input")}, order="sorted").decode()
    if t == "tool_result":
        c = p.get("content")
        if isinstance(c, list):
            return "\n".join(str(q.get("text") or "") if isinstance(q, dict) and q.get("type") == "text"
                             else (_block_text(q) or "") for q in c)
        return "" if c is None else str(c)
    if t == "thinking":
        return str(p.get("thinking") or "")
    return None


def _anthropic(msgs: list[Any], system: Any) -> list[Any]:
    """``msgs`` with Anthropic-format parts (``tool_use``, ``tool_result``, ``thinking``) as text
    parts a chat template renders, and a top-level ``system`` (a string or text blocks) as a first
    system message (``msgs`` unchanged: changed messages are copies)."""
    out: list[Any] = []
    for m in msgs:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, list) and any(_block_text(p) is not None for p in c):
            parts = []
            for p in c:
                bt = _block_text(p)
                parts.append({"type": "text", "text": bt} if bt is not None else p)
            m = {**m, "content": parts}
        out.append(m)
    if isinstance(system, list):
        system = "\n".join(str(q.get("text") or "") for q in system if isinstance(q, dict))
    if isinstance(system, str) and system and not (out and isinstance(out[0], dict) and out[0].get("role") == "system"):
        out.insert(0, {"role": "system", "content": system})
    return out


def _prefix_hashes(msgs: list[Any]) -> tuple[list[bytes], list[bytes]]:
    """``(h, t)``: ``h[k]`` = a 128-bit digest of messages ``0..k`` (chained: O(the messages' bytes));
    when message 0 is a system message, ``t[k]`` = the same of messages ``1..k+1`` (the history
    without the system prompt), else ``t`` is empty."""
    out: list[bytes] = []
    tail: list[bytes] = []
    h = t = b""
    sys0 = isinstance(msgs[0], dict) and msgs[0].get("role") == "system"
    for i, m in enumerate(msgs):
        n = _norm(m)
        ln = len(n).to_bytes(8, "little")
        h = hashlib.blake2b(h + ln + n, digest_size=16).digest()
        out.append(h)
        if sys0 and i:
            t = hashlib.blake2b(t + ln + n, digest_size=16).digest()
            tail.append(t)
    return out, tail


class _Line:
    __slots__ = ("branch_hdr", "caller", "end", "fi", "has_session", "kind_hdr", "line", "n_out", "n_prompt",
                 "parent_hdr", "path", "ph", "raw", "session", "t", "tools", "model", "tph")

    def __init__(self, d: dict[str, Any], path: Path, fi: int, line: int, default_session: str, hdr_session: str,
                 counts: Counter[str]) -> None:
        body: dict[str, Any] = d
        for k in ("request", "body"):
            if isinstance(d.get(k), dict):
                body = d[k]
                break
        mp = d.get("model_parameters")  # LiteLLM's StandardLoggingPayload: the request's other parameters
        params: dict[str, Any] = mp if isinstance(mp, dict) else {}
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ConvertError("no 'messages' list (in 'request', 'body' or the line itself)")
        self.raw = _anthropic(msgs, body.get("system"))
        self.ph, self.tph = _prefix_hashes(self.raw)
        tools = body.get("tools") or params.get("tools")
        self.tools = tools if isinstance(tools, list) and tools else None
        self.model = str(body.get("model") or d.get("model") or "") or None
        t = _first(d, _TIME_KEYS)
        if t is None:
            raise ConvertError(f"no send time (one of {', '.join(_TIME_KEYS)})")
        self.t = _time(t, "send time")
        if self.t > _MS_LIKE:
            counts["send_times_over_1e11"] += 1
        e = _first(d, _END_KEYS)
        self.end = _time(e, "end time") if e is not None else None
        out = _first(d, _OUT_KEYS)
        if out is None:
            out = _first(body, ("max_tokens", "max_completion_tokens")) if body is not d else None
            if out is None:
                out = _first(d, ("max_tokens", "max_completion_tokens", "model_parameters.max_tokens",
                                 "model_parameters.max_completion_tokens"))
            if out is not None:
                counts["output_tokens_from_max_tokens"] += 1
        if out is None:
            raise ConvertError(f"no completion token count ({', '.join(_OUT_KEYS)}, or the request's max_tokens)")
        if not _count_ok(out):
            raise ConvertError(f"completion token count {out!r} is not an integer in 0..2**31")
        self.n_out = int(out)
        p = _first(d, _PROMPT_KEYS)
        self.n_prompt = int(p) if _count_ok(p) else None
        h = _headers(d)
        inner = (d, body) if body is not d else (d,)  # a stored request body's `user` / `metadata` count too
        sess = next((v for x in inner if (v := _first(x, _SESSION_KEYS)) is not None), None)
        if sess is None:
            sess = h.get("x-agent-id") or next((v for x in inner if (v := _first(x, _USER_KEYS)) is not None), None)
        caller = next((v for x in inner if (v := _first(x, _CALLER_KEYS)) is not None), None)
        self.caller = str(caller) if caller is not None else ""
        self.branch_hdr = h.get("x-branch-id") or (str(d["branch_id"]) if d.get("branch_id") else None)
        self.parent_hdr = h.get("x-parent-branch-id") or (str(d["parent_branch_id"]) if d.get("parent_branch_id") else None)
        self.kind_hdr = h.get("x-branch-kind") or (str(d["branch_kind"]) if d.get("branch_kind") else None)
        if self.kind_hdr is not None and self.kind_hdr not in _KINDS:
            raise ConvertError(f"branch kind {self.kind_hdr!r} is not one of {', '.join(_KINDS)}")
        # a line with branch headers but no session id belongs to the inputs' one default session
        self.has_session = sess is not None or self.branch_hdr is not None
        self.session = str(sess) if sess is not None else hdr_session if self.branch_hdr is not None else default_session
        self.path = path
        self.fi = fi
        self.line = line


class _Branch:
    __slots__ = ("caller", "children", "first", "id", "kind", "last", "last_hash", "last_n", "last_tail", "last_tokens",
                 "parent")

    def __init__(self, bid: str, caller: str, parent: str | None, kind: BranchKind) -> None:
        self.id = bid
        self.caller = caller
        self.parent = parent
        self.kind = kind
        self.last: str | None = None  # id of its latest request
        self.last_hash = b""  # prefix hash of that request's messages
        self.last_n = 0  # its message count
        self.last_tail = b""  # hash of its messages after the system prompt (b"": none, or no system prompt)
        self.last_tokens = 0  # its rendered length
        self.first = b""  # hash of the first message of its latest request
        self.children: list[str] = []  # opened since this branch's last request, not joined yet


#: (branch, kind of a new branch or None, after, compaction)
_Place = tuple[_Branch, "BranchKind | None", list[str], bool]


class _Session:
    """One agent of the trace: its branches and the indexes that place a request in O(its messages)."""

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self.t0 = 0.0
        self.branches: dict[str, _Branch] = {}
        self.main_caller: str | None = None  # the caller of the session's first request
        self.caller_latest: dict[str, str] = {}  # caller -> its branch with the latest request
        self.caller_line: dict[str, str] = {}  # caller -> the same among its main / fork branches (not sub-agents)
        self.by_last: dict[tuple[str, bytes], str] = {}  # (caller, hash of a branch's last request) -> branch
        self.by_req: dict[tuple[str, bytes], tuple[str, str]] = {}  # (caller, hash of any request) -> (branch, request)
        self.by_tail: dict[tuple[str, bytes], str] = {}  # (caller, last_tail of a branch) -> branch
        self.n = 0
        self.done: dict[str, float] = {}  # request id -> end (or send) time
        self.ended: set[str] = set()  # requests whose end time is logged
        self.last_req: dict[str, TraceRequest] = {}  # branch -> its latest request (ends_branch set at the end)

    def main_latest(self) -> str | None:
        """The main / fork branch of the session's main caller that had the latest request (a new
        branch's default parent: sub-agents without their own ``agent_id`` share the caller)."""
        if self.main_caller is None:
            return None
        return self.caller_line.get(self.main_caller) or self.caller_latest.get(self.main_caller)

    def extension(self, ln: _Line, min_fork: int, top: int | None = None) -> _Place | None:
        """Continue the caller's branch whose last request's messages ``ln`` starts with (the longest);
        else fork after the caller's longest earlier request (≥ ``min_fork`` messages) that ``ln`` extends;
        only requests of at most ``top`` messages (default: all of ``ln``'s) count."""
        ph = ln.ph
        top = len(ph) if top is None else top
        for k in range(top, 0, -1):
            bid = self.by_last.get((ln.caller, ph[k - 1]))
            if bid is not None:
                return self.branches[bid], None, [], False
        for k in range(top, min_fork - 1, -1):
            hit = self.by_req.get((ln.caller, ph[k - 1]))
            if hit is not None:
                return self._open(self._new_id(), ln.caller, hit[0], "fork"), "fork", [hit[1]], False
        return None

    def place(self, ln: _Line, n_tokens: int, counts: Counter[str], later: dict[bytes, int] | None = None,
              pos: int = 0) -> _Place:
        """Where a line of a session goes (docs/trace-format.md §7.5, Branches); ``later`` maps a prefix
        hash of the caller's lines to the last position (in send order) of a line with it, ``pos`` is
        ``ln``'s (look-ahead: a branch extended after ``pos`` was not compacted by ``ln``).

        Raises:
            ConvertError: a header names a fork / sub-agent in a session without an earlier branch.
        """
        if ln.branch_hdr is not None:
            bid = f"{self.agent}:{ln.branch_hdr}"
            b = self.branches.get(bid)
            if b is not None:
                ext = b.last_n <= len(ln.ph) and ln.ph[b.last_n - 1] == b.last_hash
                return b, None, [], not ext
            parent = f"{self.agent}:{ln.parent_hdr}" if ln.parent_hdr else self.main_latest()
            if parent is not None and parent not in self.branches:
                counts["parent_branch_unknown"] += 1
                parent = self.main_latest()
            kind = cast(BranchKind, ln.kind_hdr or ("main" if parent is None else "subagent"))
            if kind == "main":
                parent = None
            elif parent is None:
                raise ConvertError(f"branch {ln.branch_hdr!r} is a {kind} but its session has no earlier branch")
            return self._open(bid, ln.caller, parent, kind), kind, [], False
        if not self.branches:
            return self._open(f"{self.agent}:main", ln.caller, None, "main"), "main", [], False
        got = self.extension(ln, 2)
        if got is not None:
            return got
        # a system prompt that changes every turn (a clock in it): the history after it extends a branch
        for k in range(len(ln.tph), 0, -1):
            tb = self.by_tail.get((ln.caller, ln.tph[k - 1]))
            if tb is not None:
                counts["system_prompt_changed"] += 1
                return self.branches[tb], None, [], False
        # a compaction: the caller's latest main / fork branch (else its latest) again, after its last
        # answer (its end logged), its first (system) message kept, shorter than that last request (the
        # harness summarised), and no later line of the caller extends that last request
        for cand in dict.fromkeys((self.caller_line.get(ln.caller), self.caller_latest.get(ln.caller))):
            if cand is None:
                continue
            lb = self.branches[cand]
            assert lb.last is not None
            if (ln.ph[0] == lb.first and n_tokens < lb.last_tokens and lb.last in self.ended
                    and ln.t >= self.done[lb.last] and (later or {}).get(lb.last_hash, -1) <= pos):
                return lb, None, [], True
        return self._open(self._new_id(), ln.caller, self.main_latest(), "subagent"), "subagent", [], False

    def record(self, ln: _Line, branch: _Branch, rid: str, n_tokens: int) -> None:
        """``rid`` (line ``ln``) is now ``branch``'s latest request."""
        if branch.last is not None and self.by_last.get((branch.caller, branch.last_hash)) == branch.id:
            del self.by_last[(branch.caller, branch.last_hash)]
        if branch.last_tail and self.by_tail.get((branch.caller, branch.last_tail)) == branch.id:
            del self.by_tail[(branch.caller, branch.last_tail)]
        branch.last_tail = ln.tph[-1] if ln.tph else b""
        if branch.last_tail:
            self.by_tail[(branch.caller, branch.last_tail)] = branch.id
        branch.last = rid
        branch.last_hash = ln.ph[-1]
        branch.last_n = len(ln.ph)
        branch.last_tokens = n_tokens
        branch.first = ln.ph[0]
        self.by_last[(branch.caller, branch.last_hash)] = branch.id
        self.by_req[(branch.caller, branch.last_hash)] = (branch.id, rid)
        self.caller_latest[ln.caller] = branch.id
        if branch.kind != "subagent":
            self.caller_line[ln.caller] = branch.id
        if self.main_caller is None:
            self.main_caller = ln.caller

    def _new_id(self) -> str:
        k = len(self.branches)
        while f"{self.agent}:b{k}" in self.branches:  # a header may have named one so
            k += 1
        return f"{self.agent}:b{k}"

    def _open(self, bid: str, caller: str, parent: str | None, kind: BranchKind) -> _Branch:
        b = _Branch(bid, caller, parent, kind)
        self.branches[bid] = b
        if parent is not None:
            self.branches[parent].children.append(bid)
        return b


def _read_file(path: Path, fi: int, counts: Counter[str], skipped: Skipped, lines: list[_Line], hdr_session: str) -> None:
    """Append the convertible lines of ``path`` to ``lines`` (bad ones named and skipped; failed calls counted).

    Raises:
        ConvertError: the file cannot be read; with ``skipped.strict``, a bad line.
    """
    raw = read_input(path)
    default = path.name.split(".")[0]
    for i, text in enumerate(io.BytesIO(raw), 1):  # one line at a time: no second copy of the file
        if not text.strip():
            continue
        try:
            d = msgspec.json.decode(text)
            if not isinstance(d, dict):
                raise ConvertError("not a JSON object")
            if d.get("status") in _FAILED:  # a failed call (LiteLLM: status "failure"): no answer, no request
                counts["failed_calls_skipped"] += 1
                continue
            lines.append(_Line(d, path, fi, i, default, hdr_session, counts))
        except (msgspec.DecodeError, ConvertError) as e:
            skipped.row(path, i, str(e))
        except RecursionError:  # msgspec's decode of a line nested too deeply
            skipped.row(path, i, "JSON nested too deeply")


def _template_errors() -> tuple[type[BaseException], ...]:
    """Exceptions of a chat template that mean "this line's messages cannot be rendered"."""
    errs: tuple[type[BaseException], ...] = (TypeError, ValueError, KeyError, IndexError)
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:
        return errs
    return (*errs, TemplateError)  # raise_exception(...) of a model's template, its sandbox's refusals


def _convert_lines(lines: list[_Line], tok: Any, bs: int, counts: Counter[str],
                   skipped: Skipped) -> tuple[list[TraceRequest], list[_Session]]:
    """Place every line (all files, in send order) and build its request."""
    errors = _template_errors()
    lines.sort(key=lambda ln: (ln.t, ln.path.name, str(ln.path), ln.line))
    taken = {ln.session for ln in lines if ln.has_session}
    n_lines = Counter(ln.session for ln in lines if ln.has_session and ln.branch_hdr is None)
    single = {k for k, c in n_lines.items() if c == 1}  # an id of one line is no session (LiteLLM's random trace_id)
    later: dict[tuple[str, str], dict[bytes, int]] = {}  # (session, caller) -> prefix hash -> its last line
    for pos, ln in enumerate(lines):
        if ln.has_session and ln.session not in single:
            idx = later.setdefault((ln.session, ln.caller), {})
            for h in ln.ph:
                idx[h] = pos
    sessions: dict[str, _Session] = {}
    loose: dict[bytes, _Session] = {}  # hash of a session-less request's messages -> its agent
    loose_n: Counter[str] = Counter()
    out: list[TraceRequest] = []
    for pos, ln in enumerate(lines):
        try:
            req = _place_line(ln, pos, tok, errors, bs, counts, skipped, sessions, later, single, loose, loose_n, taken)
        finally:  # placed: its messages are no longer needed
            del ln.raw, ln.ph, ln.tph, ln.tools
        if req is not None:
            out.append(req)
    live = [s for s in sessions.values() if s.n]
    counts["sessions"] += len(live)
    return out, live


def _place_line(ln: _Line, pos: int, tok: Any, errors: tuple[type[BaseException], ...], bs: int, counts: Counter[str],
                skipped: Skipped, sessions: dict[str, _Session], later: dict[tuple[str, str], dict[bytes, int]],
                single: set[str], loose: dict[bytes, _Session], loose_n: Counter[str], taken: set[str]) -> TraceRequest | None:
    """Place line ``ln`` (``pos`` in send order) and build its request (None: a bad row, named in ``skipped``)."""
    try:
        ids = tok.apply_chat_template(ln.raw, ln.tools)
    except errors as e:  # a message the chat template cannot render, or its raise_exception
        skipped.row(ln.path, ln.line, f"the chat template cannot render the messages: {type(e).__name__}: {e}")
        return None
    if not ids:
        skipped.row(ln.path, ln.line, "the messages render to no tokens")
        return None
    got: _Place | None = None
    if ln.has_session and ln.session not in single:
        s = sessions.get(ln.session)
        if s is None:
            s = sessions[ln.session] = _Session(ln.session)
        try:
            got = s.place(ln, len(ids), counts, later.get((ln.session, ln.caller)), pos)
        except ConvertError as e:
            skipped.row(ln.path, ln.line, str(e))
            return None
    else:  # no session id: its own agent, unless it extends (with more messages) an earlier session-less request
        earlier = next((loose[h] for h in reversed(ln.ph[:-1]) if h in loose), None)
        if earlier is not None:
            got = earlier.extension(ln, 1, len(ln.ph) - 1)
        if earlier is not None and got is not None:
            s = earlier
        else:
            if ln.has_session:  # the one line of its session id: named so
                name = ln.session
            else:
                k = loose_n[ln.session] + 1
                while f"{ln.session}.{k}" in taken:  # not a session id of the log
                    k += 1
                loose_n[ln.session] = k
                name = f"{ln.session}.{k}"
            s = sessions[name] = _Session(name)
            taken.add(name)
            got = s.place(ln, len(ids), counts)
        loose[ln.ph[-1]] = s
    branch, kind, after, compaction = got
    rid = f"{s.agent}:{s.n}"
    if kind is None:
        assert branch.last is not None
        after = [branch.last]
        for c in branch.children:  # a join: the sub-agents / forks opened since it went on
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
    if ln.end is not None:
        s.ended.add(rid)
    s.n += 1
    s.record(ln, branch, rid, len(ids))
    s.last_req[branch.id] = req
    return req


def convert(
    inputs: Sequence[str | Path], *, progress: bool = False, block_size: int = DEFAULT_BLOCK_SIZE, strict: bool = False,
    tokenizer: str = "sim",
) -> Conversion:
    """Convert OpenAI-chat request logs (JSONL files, or folders of ``*.jsonl[.gz]``) to a canonical trace.

    All lines of all inputs are read first (a session split across rotated files stays one
    agent), then taken in send order.

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

    def gen() -> Iterator[TraceRequest]:
        lines: list[_Line] = []
        hdr = min((p.name for p in files), default="").split(".")[0]  # lines with branch headers but no session id: one session
        for fi, p in enumerate(progress_iter(files, enabled=progress, desc=KIND)):
            skipped.call(p, lambda p=p, fi=fi: _read_file(p, fi, counts, skipped, lines, hdr))  # type: ignore[misc]
        if counts["send_times_over_1e11"]:
            print(f"warning: {counts['send_times_over_1e11']} send time(s) are over 1e11 s (after the year 5000): "
                  "milliseconds? the converter reads unix seconds", file=sys.stderr)
        reqs, sessions = _convert_lines(lines, tok, block_size, counts, skipped)
        for p in files:
            skipped.end_file(p)
        if not reqs:
            skipped.none_converted()
            raise ConvertError(f"no request in {', '.join(str(p) for p in files)}")
        ends = {id(r) for s in sessions for r in s.last_req.values()}
        for r in reqs:
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
