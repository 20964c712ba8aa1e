"""WEKA kv-cache-tester Claude Code traces → canonical trace (spec: docs/trace-format.md §7.1).

Input: ``trace_NNNN.json[.gz]``, one Claude Code session per file (format in
``../shared/traces/claude-code-weka/SOURCE.md``): main-agent requests (``type``
``n``/``s``) and sub-agent markers (``type`` ``subagent``) with nested requests.

Rules (each checked on the 530 shared sessions; see docs/trace-format.md):

* **Agent** = one file (``agent`` = the file's ``id``). Its requests come in two
  kinds of *streams*: the main stream (top-level requests, file order) and one
  stream per sub-agent marker (its nested requests).
* **Branches inside a stream.** Each stream is split into *chains* by its block
  paths: a request continues a chain when it extends the chain's last path
  (``lcp == len(last)``) or keeps more than the shared tool + system prefix and
  at least half of it (``lcp > K and 2·lcp ≥ len(last)``, K = ⌊(tool_tokens +
  system_tokens)/64⌋; small tail rewrites of the last few blocks are common);
  the longest match wins. A request that continues no chain starts a new chain
  (a *prefix break*). A new chain whose creating chain is used again later is an
  interleaved side call: it becomes a ``fork`` branch of the creating chain's
  branch. Otherwise the creating chain was abandoned: the new chain is the same
  branch with a rewritten context, and its first request gets ``compaction``
  (true compactions, where the input drops, and same-size rewrites such as a
  resumed session with a changed system prompt; the header counts both). A
  one-request chain that replaced an abandoned chain and is itself replaced by
  the next request (Claude Code's compaction summary call: history in,
  summary out) is a side call too, and the next request is the rewrite of the
  original branch.
* **Sub-agents** (timing rule in SOURCE.md, checked on all sub-agents): the
  marker's ``t`` is the completion time in the parent's clock, the sub-agent
  started at ``t − duration_ms/1000``, and nested ``t`` values count from that
  start. Its first request goes ``after`` the last main-stream request before the
  marker that was sent by the start (1 s tolerance: top-level ``t`` values are
  whole seconds); the first main-stream request after the marker (the first sent
  after ``t`` in every shared session) also goes ``after`` the sub-agent's last
  request (a join; parallel sub-agents all join). A *background* sub-agent
  (``duration_ms`` null or absent: launched, its duration and totals unknown
  then) starts at the marker's ``t`` and nobody joins it.
* **Order of requests and after.** Within a stream each request goes ``after``
  the previous request of that stream (the recorded stream is sequential: side
  calls and rewrites included). Requests are written in send order in the
  parent's clock (``t_s``); ties keep stream order, and a request never precedes
  what it waits for.
* **Pauses.** ``think_time`` (client delay since the previous response of the
  same stream completed) where present and the request waits only on its
  stream predecessor; otherwise the recorded gap: send time minus the latest
  completion among its ``after`` requests (their send time plus ``api_time``
  when known), clipped at 0. An agent's first request pauses for its own ``t``.
* **Block ids.** Local ids are made distinct across files: ``file_number ·
  10**6 + local_id`` (file number from the session id, e.g. ``trace_0042`` →
  42). With the shared-prefix option (default on), the leading blocks of a
  request that equal its stream's canonical prefix (the first
  ⌊(tool_tokens + system_tokens)/64⌋ blocks of the most common first path),
  map to ids shared by every session: ``namespace · 10**4 + position``, with
  namespace 0 for main agents and one per sub-agent type. This models the
  tool-definition + system prompt that all Claude Code sessions share.
* **Lengths.** ``input_tokens`` = ``in``, ``output_tokens`` = ``out``, 0 kept as recorded
  (23 of the shared requests record 0 output tokens; the header counts them as
  ``output_tokens_zero``; replayers ask for at least 1 token).
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from evolving_infra.traces.convert.common import (
    MAX_HEADER_NAMES,
    Conversion,
    ConvertError,
    Skipped,
    expand_inputs,
    inputs_meta,
    lcp,
    make_header,
    progress_iter,
    read_input,
)
from evolving_infra.traces.schema import TraceRequest
from evolving_infra.traces.tokens import PrivateIds, rechunk_blocks

KIND = "claude-code-weka"
PATTERNS = ("*.json.gz", "*.json")
SOURCE_BLOCK_SIZE = 64
FILE_ID_STRIDE = 10**6
"""Global id of a local id: file_number * FILE_ID_STRIDE + local id (local ids must be < FILE_ID_STRIDE)."""
SHARED_NS_STRIDE = 10**4
"""Shared prefix id: namespace * SHARED_NS_STRIDE + position (< FILE_ID_STRIDE, so below every file's ids)."""
FIXED_NAMESPACES = {"main": 0, "Explore": 1, "general-purpose": 2, "Plan": 3}
TIME_TOLERANCE_S = 1.0
"""Top-level ``t`` values are whole seconds: a request counts as sent before a sub-agent start within this tolerance."""
ORIGIN = {
    "repository": "github.com/callanjfox/kv-cache-tester",
    "folder": "traces/ (curated v8 set)",
    "commit": "c9b3da54fc2f555942720527b86c1979fcae9bb2",
    "license": "Apache-2.0",
    "format_spec": "github.com/callanjfox/agentic-coding-analysis docs/TRACE_FORMAT.md",
}


class _Entry(msgspec.Struct, rename={"in_": "in"}):
    type: str
    t: float
    model: str = ""
    in_: int = -1
    out: int = -1
    hash_ids: list[int] = []
    input_types: list[str] = []
    api_time: float | None = None
    think_time: float | None = None
    agent_id: str = ""
    subagent_type: str = ""
    duration_ms: float | None = None
    """Sub-agent run time; null/absent for a background sub-agent (launched, not waited for)."""
    tool_tokens: int = 0
    system_tokens: int = 0
    requests: list[_Entry] | None = None
    """A sub-agent's nested requests (null or absent: none recorded, e.g. one still running)."""


class _Session(msgspec.Struct):
    requests: list[_Entry]
    id: str = ""
    block_size: int = SOURCE_BLOCK_SIZE
    tool_tokens: int = 0
    system_tokens: int = 0


_DECODER = msgspec.json.Decoder(_Session)


@dataclass(slots=True)
class Options:
    """Converter options (recorded in the header's ``meta.options``)."""

    shared_prefix: bool = True
    """Map the tool + system prefix to ids shared by all sessions (per agent type)."""
    block_size: int = SOURCE_BLOCK_SIZE
    """Output block size in tokens (64 = the source's; other sizes are converted, see tokens.rechunk_blocks)."""


@dataclass(slots=True)
class _Req:
    key: str
    stream: int
    idx: int
    e: _Entry
    t_abs: float
    after: list[str] = field(default_factory=list)
    prev_in_chain: int = -1
    lcp: int = 0
    blocks: list[int] = field(default_factory=list)
    n_shared: int = 0
    pause: float = 0.0
    branch: str = ""
    kind: str | None = None
    parent: str | None = None
    compaction: bool = False


@dataclass(slots=True)
class _Chain:
    last: list[int]
    reqs: list[int]
    creator: int | None
    created: int


def _continues(path: list[int], last: list[int], k: int) -> int:
    """lcp when ``path`` continues a chain whose last path is ``last``, else -1."""
    n = len(last)
    L = lcp(path, last)
    if L == n or (L > k and 2 * L >= n):
        return L
    return -1


def split_stream(paths: Sequence[list[int]], k: int) -> tuple[list[int], list[int | None], list[int]]:
    """Chains of one stream (module docstring).

    Returns:
        (chain index of each request, creator chain of each chain, index of each chain's first request)
    """
    chain_of, creators, created, _, _ = _split_stream(paths, k)
    return chain_of, creators, created


def _split_stream(paths: Sequence[list[int]], k: int) -> tuple[list[int], list[int | None], list[int], list[int], list[int]]:
    """:func:`split_stream` plus, per request, the previous request of its chain (-1) and their lcp."""
    chains: list[_Chain] = []
    of: list[int] = []
    prev_of: list[int] = []
    lcp_of: list[int] = []
    cur: int | None = None
    for i, path in enumerate(paths):
        best, best_l = -1, -1
        for ci, ch in enumerate(chains):
            L = _continues(path, ch.last, k)
            if L > best_l or (L == best_l and L >= 0 and ci == cur):
                best, best_l = ci, L
        if best < 0:
            chains.append(_Chain(path, [i], cur, i))
            best = len(chains) - 1
            prev_of.append(-1)
            lcp_of.append(0)
        else:
            prev_of.append(chains[best].reqs[-1])
            lcp_of.append(best_l)
            chains[best].last = path
            chains[best].reqs.append(i)
        of.append(best)
        cur = best
    return of, [c.creator for c in chains], [c.created for c in chains], prev_of, lcp_of


def _resolve_branches(
    chain_of: list[int], creators: list[int | None], created: list[int], root: str, prefix: str
) -> tuple[list[str], dict[str, str], set[int]]:
    """Branch id per request, parent of each fork branch, and indices of requests flagged compaction."""
    used_after: dict[int, int] = {}  # chain -> last request index using it
    for i, c in enumerate(chain_of):
        used_after[c] = i
    size: Counter[int] = Counter(chain_of)
    creators = list(creators)
    one_off: set[int] = set()
    for c, creator in enumerate(creators):
        # A one-request chain that replaced an abandoned chain and was itself
        # replaced right away (e.g. Claude Code's compaction summary call): a
        # side call; the next chain rewrites the original branch.
        if creator is None or used_after[creator] > created[c] or size[c] != 1:
            continue
        nxt = c + 1
        if nxt < len(creators) and creators[nxt] == c and created[nxt] == created[c] + 1:
            one_off.add(c)
            creators[nxt] = creator
    branch_of_chain: dict[int, str] = {}
    fork_parent: dict[str, str] = {}
    compactions: set[int] = set()
    n_side = 0
    for c, creator in enumerate(creators):
        if creator is None:
            branch_of_chain[c] = root if c == 0 else f"{prefix}side{c}"
            continue
        if c in one_off or used_after[creator] > created[c]:
            n_side += 1
            b = f"{prefix}side{n_side}"
            branch_of_chain[c] = b
            fork_parent[b] = branch_of_chain[creator]
        else:
            branch_of_chain[c] = branch_of_chain[creator]
            compactions.add(created[c])
    return [branch_of_chain[c] for c in chain_of], fork_parent, compactions


def _file_number(sess_id: str, path: Path) -> int | None:
    for s in (sess_id, path.name):
        m = re.search(r"(\d+)", s)
        if m and int(m.group(1)) > 0:
            return int(m.group(1))
    return None


class _Converter:
    def __init__(self, files: list[Path], opts: Options):
        self.files = files
        self.opts = opts
        self.namespaces: dict[str, int] = dict(FIXED_NAMESPACES)
        self.counts: Counter[str] = Counter()
        self.used_numbers: dict[int, str] = {}
        self.fallback_numbers: dict[str, int] = {}
        self.agents_seen: set[str] = set()
        self.private = PrivateIds()

    def _namespace(self, name: str) -> int:
        ns = self.namespaces.get(name)
        if ns is None:
            ns = len(self.namespaces)
            if ns >= FILE_ID_STRIDE // SHARED_NS_STRIDE:
                raise ConvertError(f"too many sub-agent types for shared prefix namespaces ({ns})")
            self.namespaces[name] = ns
        return ns

    def _load(self, path: Path) -> _Session:
        raw = read_input(path)
        try:
            return _DECODER.decode(raw)
        except msgspec.DecodeError as e:
            raise ConvertError(f"{path}: not a WEKA Claude Code trace: {e}") from None
        except RecursionError:  # msgspec's decode of JSON nested too deeply
            raise ConvertError(f"{path}: not a WEKA Claude Code trace: JSON nested too deeply") from None

    def convert_file(self, fi: int, path: Path) -> list[TraceRequest]:
        sess = self._load(path)
        agent = sess.id or path.name.split(".")[0]
        if agent in self.agents_seen:
            k = 2
            while f"{agent}#{k}" in self.agents_seen:
                k += 1
            agent = f"{agent}#{k}"
        self.agents_seen.add(agent)
        num = _file_number(sess.id, path)
        if num is None or num in self.used_numbers or num * FILE_ID_STRIDE >= (1 << 47):
            num = 10**5 + fi
            while num in self.used_numbers:
                num += 1
            self.fallback_numbers[agent] = num
        self.used_numbers[num] = agent
        base = num * FILE_ID_STRIDE
        src_bs = sess.block_size or SOURCE_BLOCK_SIZE

        # ---- streams
        main_entries: list[tuple[int, _Entry]] = []
        markers: list[tuple[int, _Entry]] = []
        for pos, e in enumerate(sess.requests):
            if e.type == "subagent":
                markers.append((pos, e))
            else:
                main_entries.append((pos, e))
        if not main_entries:
            raise ConvertError(f"{path}: session has no top-level requests")
        for _pos, e in main_entries + [(p, q) for _, m in markers for p, q in enumerate(m.requests or ())]:
            if e.in_ < 0 or e.out < 0:
                raise ConvertError(f"{path}: request at t={e.t} lacks 'in' or 'out'")
            if len(e.hash_ids) != e.in_ // src_bs:
                raise ConvertError(f"{path}: request at t={e.t}: {len(e.hash_ids)} hash_ids but in // {src_bs} = {e.in_ // src_bs}")

        reqs: list[_Req] = []
        main: list[_Req] = []
        streams: list[list[_Req]] = [main]
        root = f"{agent}:main"
        for i, (_, e) in enumerate(main_entries):
            r = _Req(f"{agent}:{i}", 0, i, e, float(e.t))
            main.append(r)
            reqs.append(r)
        k_main = (sess.tool_tokens + sess.system_tokens) // src_bs
        self._assign(main, k_main, root, f"{agent}:", "main", None)
        self._chain_pauses(main)
        main[0].pause = max(0.0, main[0].t_abs)

        # ---- shared prefix map (local id -> shared id), main stream first
        shared: dict[int, int] = {}
        if self.opts.shared_prefix:
            self._add_canonical(shared, [e for _, e in main_entries], k_main, self._namespace("main"))

        sub_ids: Counter[str] = Counter(m.agent_id or "sub" for _, m in markers)
        seen_sub: Counter[str] = Counter()
        main_pos = [p for p, _ in main_entries]
        for mi, (mpos, m) in enumerate(markers):
            name = m.agent_id or "sub"
            seen_sub[name] += 1
            if sub_ids[name] > 1:
                name = f"{name}-{seen_sub[name]}"
            if not m.requests:
                self.counts["subagents_without_requests"] += 1
                continue
            self.counts["subagents"] += 1
            background = m.duration_ms is None
            if m.duration_ms is None:  # background; tested on the field, which mypy narrows, not on the flag
                # a background sub-agent: its duration and totals are unknown at launch; the marker's
                # t is its launch, nested t count from it, and the parent does not wait for it
                self.counts["subagents_background"] += 1
                start = float(m.t)
            else:
                start = float(m.t) - m.duration_ms / 1000.0
            sub = [_Req(f"{agent}:{name}:{j}", mi + 1, j, q, start + float(q.t)) for j, q in enumerate(m.requests)]
            reqs.extend(sub)
            streams.append(sub)
            # the last main request before the marker sent by the start
            pred: _Req | None = None
            for r in main:
                if main_pos[r.idx] > mpos:
                    break
                if r.t_abs <= start + TIME_TOLERANCE_S:
                    pred = r
            parent_branch = pred.branch if pred is not None else root
            k_sub = (m.tool_tokens + m.system_tokens) // src_bs
            self._assign(sub, k_sub, f"{agent}:{name}", f"{agent}:{name}:", "subagent", parent_branch)
            self._chain_pauses(sub)
            if pred is not None:
                sub[0].after = [pred.key]
                sub[0].pause = max(0.0, sub[0].t_abs - _completion(pred))
            else:
                sub[0].pause = max(0.0, sub[0].t_abs)
            # join: the first main request after the marker waits for the sub-agent's last request
            nxt = None if background else next((r for r in main if main_pos[r.idx] > mpos), None)
            if nxt is not None:
                nxt.after.append(sub[-1].key)
                nxt.pause = max(0.0, nxt.t_abs - max(_completion(_by_key(reqs, a)) for a in nxt.after))
                self.counts["joins"] += 1
            if self.opts.shared_prefix:
                self._add_canonical(shared, list(m.requests), k_sub, self._namespace(m.subagent_type or "subagent"))

        # ---- global block ids, per stream in stream order (a request reuses its chain predecessor's mapped prefix)
        for stream in streams:
            self._map_stream(stream, shared, base, path)

        # ---- order: send time, never before a dependency
        by_key = {r.key: r for r in reqs}
        ordered = _topo_by_time(reqs, by_key)
        last_of_branch: dict[str, str] = {}
        for r in ordered:
            last_of_branch[r.branch] = r.key
        out: list[TraceRequest] = []
        bs = self.opts.block_size
        for r in ordered:
            e = r.e
            blocks = r.blocks
            if bs != src_bs:
                blocks = rechunk_blocks(blocks, e.in_, src_bs, bs, private=self.private)
            out_tokens = e.out
            if out_tokens < 1:
                self.counts["output_tokens_zero"] += 1
            in_tokens = e.in_
            if in_tokens < 1:
                in_tokens = 1
                self.counts["input_tokens_clipped"] += 1
            if r.compaction:
                self.counts["compactions"] += 1
            if r.kind == "fork":
                self.counts["side_branches"] += 1
            out.append(
                TraceRequest(
                    id=r.key,
                    agent=agent,
                    branch=r.branch,
                    input_tokens=in_tokens,
                    output_tokens=out_tokens,
                    blocks=blocks,
                    kind=r.kind,  # type: ignore[arg-type]
                    parent_branch=r.parent,
                    after=r.after,
                    pause_s=round(r.pause, 6),
                    ends_branch=last_of_branch[r.branch] == r.key,
                    t_s=round(r.t_abs, 6),
                    compaction=r.compaction,
                    model=e.model or None,
                )
            )
        self.counts["sessions"] += 1
        self.counts["requests"] += len(out)
        return out

    def _assign(self, stream: list[_Req], k: int, root: str, prefix: str, kind: str, parent: str | None) -> None:
        chain_of, creators, created, prev_of, lcp_of = _split_stream([r.e.hash_ids for r in stream], k)
        branches, fork_parent, compactions = _resolve_branches(chain_of, creators, created, root, prefix)
        started: set[str] = set()
        for i, r in enumerate(stream):
            b = branches[i]
            r.branch = b
            r.prev_in_chain, r.lcp = prev_of[i], lcp_of[i]
            if b not in started:
                started.add(b)
                if b == root:
                    r.kind, r.parent = kind, parent
                else:
                    r.kind, r.parent = "fork", fork_parent[b]
            r.compaction = i in compactions

    @staticmethod
    def _chain_pauses(stream: list[_Req]) -> None:
        for prev, r in zip(stream, stream[1:]):
            r.after = [prev.key]
            tt = r.e.think_time
            r.pause = max(0.0, float(tt)) if tt is not None else max(0.0, r.t_abs - _completion(prev))

    @staticmethod
    def _add_canonical(shared: dict[int, int], entries: list[_Entry], k: int, ns: int) -> None:
        if k <= 0:
            return
        firsts = Counter(e.hash_ids[0] for e in entries if e.hash_ids)
        if not firsts:
            return
        top = firsts.most_common(1)[0][0]
        canon = max((e.hash_ids[:k] for e in entries if e.hash_ids and e.hash_ids[0] == top), key=len)
        if len(canon) > SHARED_NS_STRIDE:
            raise ConvertError(f"shared prefix of {len(canon)} blocks exceeds {SHARED_NS_STRIDE}")
        nsbase = ns * SHARED_NS_STRIDE
        for j, x in enumerate(canon):
            shared.setdefault(x, nsbase + j)

    @staticmethod
    def _map_stream(stream: list[_Req], shared: dict[int, int], base: int, path: Path) -> None:
        """Global ids of every request of a stream (module docstring, Block ids).

        A request continuing a chain copies its predecessor's mapped prefix of
        ``lcp`` blocks and maps only the rest, so the work per request is
        proportional to its new blocks.
        """
        for r in stream:
            ids = r.e.hash_ids
            if r.prev_in_chain >= 0:
                p = stream[r.prev_in_chain]
                start = r.lcp
                head = p.blocks[:start]
                ns = p.n_shared if start > p.n_shared else start
                walk = start <= p.n_shared  # the mapped prefix was all shared: shared ids may continue
            else:
                start, head, ns, walk = 0, [], 0, True
            rest = ids[start:]
            if rest and (min(rest) < 0 or max(rest) >= FILE_ID_STRIDE):
                raise ConvertError(f"{path}: local hash id out of [0, {FILE_ID_STRIDE})")
            j = 0
            if walk and shared:
                # a shared id stands for its namespace's canonical prefix up to its position, so it
                # continues the path only at that position and after the same namespace's ids (a raw
                # id can recur after another prefix: session 256 of the Weka set reuses one of its main
                # prefix's ids in a sub-agent's); ids stay chained (docs/trace-format.md)
                get = shared.get
                prev_ns = head[-1] // SHARED_NS_STRIDE if head else -1
                pos = start
                for x in rest:
                    sid = get(x)
                    if sid is None or sid % SHARED_NS_STRIDE != pos or (prev_ns >= 0 and sid // SHARED_NS_STRIDE != prev_ns):
                        break
                    prev_ns = sid // SHARED_NS_STRIDE
                    pos += 1
                    j += 1
            if j:
                head = head + [shared[x] for x in rest[:j]]
                ns = start + j
            r.blocks = head + [x + base for x in rest[j:]] if j < len(rest) else head
            r.n_shared = ns

    def meta(self) -> dict[str, Any]:
        return {
            "converter": KIND,
            "origin": ORIGIN,
            "options": {"shared_prefix": self.opts.shared_prefix, "block_size": self.opts.block_size},
            "files": len(self.files),
            **inputs_meta([p.name for p in self.files]),
            "block_ids": {
                "source_block_size": SOURCE_BLOCK_SIZE,
                "file_local": f"file_number * {FILE_ID_STRIDE} + local hash id",
                "shared_prefix": f"namespace * {SHARED_NS_STRIDE} + position" if self.opts.shared_prefix else None,
                "namespaces": self.namespaces if self.opts.shared_prefix else {},
                # agent -> file number for the agents whose number did not come from the file's
                # name; the first MAX_HEADER_NAMES (one per file could pass the readers' 8 MiB bound
                # on line 1), all counted when more; an agent's number is also its ids // FILE_ID_STRIDE
                "file_number_fallbacks": dict(itertools.islice(self.fallback_numbers.items(), MAX_HEADER_NAMES)),
                **({"file_number_fallbacks_count": len(self.fallback_numbers)} if len(self.fallback_numbers) > MAX_HEADER_NAMES else {}),
            },
            "rules": {
                "chain_continues": "lcp == len(last) or (lcp > K and 2*lcp >= len(last)), K = (tool_tokens+system_tokens)//64",
                "prefix_break": "side call (fork branch) if the previous chain is used again later, else compaction of the same branch",
                "subagent_start": "t_marker - duration_ms/1000; first request after the last parent request sent by then (1 s tolerance)",
                "subagent_join": "first parent request after the marker waits for the sub-agent's last request",
                "pause": "think_time when waiting only on the stream predecessor, else send time - latest completion of after (send + api_time), clipped at 0",
            },
            "counts": dict(sorted(self.counts.items())),
        }


def _completion(r: _Req) -> float:
    return r.t_abs + (float(r.e.api_time) if r.e.api_time is not None else 0.0)


def _by_key(reqs: list[_Req], key: str) -> _Req:
    for r in reqs:
        if r.key == key:
            return r
    raise KeyError(key)


def _topo_by_time(reqs: list[_Req], by_key: dict[str, _Req]) -> list[_Req]:
    """Requests by (send time, stream, index), never before anything in their ``after``."""
    waiting: dict[str, int] = {}
    children: dict[str, list[_Req]] = {}
    heap: list[tuple[float, int, int, str]] = []
    for r in reqs:
        n = 0
        for a in r.after:
            children.setdefault(a, []).append(r)
            n += 1
        waiting[r.key] = n
        if n == 0:
            heapq.heappush(heap, (r.t_abs, r.stream, r.idx, r.key))
    out: list[_Req] = []
    while heap:
        _, _, _, key = heapq.heappop(heap)
        r = by_key[key]
        out.append(r)
        for c in children.get(key, ()):
            waiting[c.key] -= 1
            if waiting[c.key] == 0:
                heapq.heappush(heap, (c.t_abs, c.stream, c.idx, c.key))
    if len(out) != len(reqs):
        raise ConvertError("dependency cycle among requests")
    return out


def convert(
    inputs: Sequence[str | Path],
    *,
    progress: bool = False,
    shared_prefix: bool = True,
    block_size: int = SOURCE_BLOCK_SIZE,
    strict: bool = False,
) -> Conversion:
    """Convert Claude Code session files (or folders of them) to a canonical trace, streamed.

    Args:
        inputs: files and/or folders (folders: every ``*.json.gz`` / ``*.json`` below, sorted).
        progress: show a tqdm bar on stderr.
        shared_prefix: map the shared tool + system prefix to common ids (default on).
        block_size: output block size in tokens (64 native; 512 etc. converted).
        strict: stop at the first file that cannot be converted instead of skipping it
            (skipped files are named on stderr and listed in ``meta.skipped``).

    Returns:
        A :class:`Conversion`: sessions in input order, each session's requests in send order.

    Raises:
        ConvertError: a path is missing; with ``strict``, a file is not a valid WEKA trace.
    """
    files = expand_inputs(inputs, PATTERNS)
    conv = _Converter(files, Options(shared_prefix=shared_prefix, block_size=block_size))
    skipped = Skipped(strict)

    def gen() -> Iterator[TraceRequest]:
        n = 0
        for fi, path in enumerate(progress_iter(files, enabled=progress, desc=KIND)):
            reqs = skipped.call(path, lambda: conv.convert_file(fi, path)) or ()
            n += len(reqs)
            yield from reqs
        if not n:
            skipped.none_converted()

    def meta() -> dict[str, Any]:
        return {**conv.meta(), "skipped": skipped.meta()}

    src = ", ".join(str(p) for p in inputs[:3]) + (f" (+{len(inputs) - 3} more)" if len(inputs) > 3 else "")
    return Conversion(
        gen(),
        lambda: make_header(
            block_size=block_size,
            source=f"{KIND}: {src}",
            description="Real Claude Code sessions (WEKA kv-cache-tester traces) with sub-agents, side calls and compactions",
            meta=meta(),
        ),
    )
