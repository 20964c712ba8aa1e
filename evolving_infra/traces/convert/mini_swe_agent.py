"""mini-swe-agent trajectories (``*.traj.json[.gz]``) → canonical trace (spec: docs/trace-format.md §7.3).

One trajectory = one agent with one ``main`` branch: the history is strictly
append-only (system, task, then assistant / tool turns), one request per
``assistant`` message.

* **Lengths** are the provider's: ``input_tokens`` = ``usage.prompt_tokens``,
  ``output_tokens`` = ``max(usage.completion_tokens, 1)``.
* **Block ids from content.** The converter rebuilds the prompt as one token
  stream and hashes it in chained blocks, so equal prefixes (the same messages
  with the same token counts) get equal ids, inside a trajectory and across
  trajectories (all share the system prompt and the task template's head).
  Without the provider's tokenizer, each message's tokens are approximated by a
  cl100k-style pre-tokenizer (one piece ≈ one token, a piece's token value =
  CRC-32 of its text), preceded by a role marker. The provider's counts fix
  where each message ends in the stream: call *i* adds ``P_i − P_{i−1}`` tokens
  (``P`` = prompt_tokens); the previous assistant message takes its
  ``completion_tokens`` of them, the following tool/user messages the rest (all
  but the last message of a group get their piece count, the last the
  remainder). The first call starts with the bash tool definitions the agent
  sends in the API's ``tools`` field (not recorded; :data:`TOOLS_TOKENS` fixed
  tokens, chosen so that tools + system prompt + the task template's head match
  the 320 cached tokens DeepSeek reports on every task's first call), then the
  system message gets its piece count and the task message the rest of ``P_0``. A message is truncated to, or padded up to, its
  span (padding tokens are derived from the message's digest and position). A
  block id is the first 47 bits of BLAKE2b(previous block digest ‖ the
  block's token values); request *i* takes the first ``P_i // block_size``.
* **Timing.** The pause before call *i* is the tool gap: the timestamp of the
  last tool (or user) message before it (when the next call was sent) minus the
  previous assistant message's timestamp (response received), clipped at 0.
  ``t_s`` is the send time from the trajectory's first call (``created`` of its
  response, whole seconds); ``arrival_s`` is that first send time in unix
  seconds (the author's batch run, not a production arrival process).
  Requests of all trajectories are written in send order.
"""

from __future__ import annotations

import hashlib
import heapq
import re
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from evolving_infra.traces.convert.common import Conversion, ConvertError, Skipped, expand_inputs, inputs_meta, make_header, progress_iter, read_input, source_line
from evolving_infra.traces.schema import TraceRequest
from evolving_infra.traces.tokens import PRIVATE_ID_BASE

KIND = "mini-swe-agent"
PATTERNS = ("*.traj.json.gz", "*.traj.json")
DEFAULT_BLOCK_SIZE = 64
ORIGIN = {
    "repository": "fork of github.com/SWE-agent/mini-swe-agent",
    "commit": "3c7d1d7f8fb8630b187744215f67470b6755f60c",
    "folders": "output/deepseek_bench1/, output/deepseek_bench_dev/, output/deepseek_lite_dev/",
    "license": "MIT (repository LICENSE.md); evaluation artifacts carry no separate license",
    "model": "deepseek/deepseek-chat (DeepSeek-V3), temperature 0",
}

_PIECE = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|_+|\s+(?!\S)|\s+|.", re.S)
_ID_MASK = (1 << 47) - 1
assert _ID_MASK < PRIVATE_ID_BASE


def pieces(text: str) -> list[str]:
    """cl100k-style pre-tokenization of ``text`` (covers every character)."""
    return _PIECE.findall(text)


def _message_text(m: dict[str, Any]) -> str:
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    text = str(content or "")
    calls = m.get("tool_calls") or []
    for c in calls:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        text += f"\n<tool_call>{fn.get('name', '')}{fn.get('arguments', '')}</tool_call>"
    return text


class _Message:
    __slots__ = ("digest", "role", "values")

    def __init__(self, m: dict[str, Any]):
        self.role = str(m.get("role", ""))
        text = _message_text(m)
        self.digest = hashlib.blake2b(f"{self.role}\x00{text}".encode(), digest_size=8).digest()
        ps = [f"<|{self.role}|>"] + pieces(text)
        self.values = [zlib.crc32(p.encode("utf-8", "surrogatepass")) for p in ps]

    def span(self, n: int) -> list[int]:
        """The message's token values truncated or padded to ``n`` tokens."""
        v = self.values
        if n <= len(v):
            return v[:n]
        base = int.from_bytes(self.digest[:4], "little")
        return v + [(base ^ (k * 0x9E3779B1)) & 0xFFFFFFFF for k in range(len(v), n)]


TOOLS_TOKENS = 300
"""Tokens of the bash tool definition that mini-swe-agent 2.x sends in the API's ``tools``
field: not in the trajectory, but part of every ``prompt_tokens``. DeepSeek reports 320
cached tokens on the first call of each new task (the part shared across tasks, counted in
64-token units); system prompt and the task template's head make ~30 of them."""


class _ToolsPrefix:
    """The unrecorded tool definitions: a fixed run of :data:`TOOLS_TOKENS` tokens, the same in every call."""

    role = "tools"
    values = [zlib.crc32(f"<tools>{k}".encode()) for k in range(TOOLS_TOKENS)]

    def span(self, n: int) -> list[int]:
        v = self.values
        return v[:n] if n <= len(v) else v + [zlib.crc32(f"<tools>{k}".encode()) for k in range(len(v), n)]


class _Stream:
    """The trajectory's prompt as one growing token stream and its chained block ids."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.tokens: list[int] = []
        self.blocks: list[int] = []
        self._digest = b""

    def append(self, values: list[int]) -> None:
        self.tokens.extend(values)

    def blocks_for(self, n_tokens: int) -> list[int]:
        want = n_tokens // self.bs
        if want > len(self.tokens) // self.bs:
            raise ConvertError(f"prompt of {n_tokens} tokens but only {len(self.tokens)} tokens rebuilt")
        while len(self.blocks) < want:
            j = len(self.blocks)
            chunk = np.asarray(self.tokens[j * self.bs : (j + 1) * self.bs], dtype="<u4").tobytes()
            self._digest = hashlib.blake2b(self._digest + chunk, digest_size=16).digest()
            self.blocks.append(int.from_bytes(self._digest[:8], "little") & _ID_MASK)
        return self.blocks[:want]


def _load(path: Path) -> dict[str, Any]:
    raw = read_input(path)
    try:
        d = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ConvertError(f"{path}: cannot read trajectory: {e}") from None
    except RecursionError:  # msgspec's decode of JSON nested too deeply
        raise ConvertError(f"{path}: cannot read trajectory: JSON nested too deeply") from None
    if not isinstance(d, dict) or not isinstance(d.get("messages"), list):
        raise ConvertError(f"{path}: not a mini-swe-agent trajectory (no 'messages' list)")
    return d


def _usage(m: dict[str, Any], path: Path, n: int) -> tuple[int, int, int, float, float]:
    extra = m.get("extra") or {}
    resp = extra.get("response") or {}
    usage = resp.get("usage") or {}
    try:
        p = int(usage["prompt_tokens"])
        c = int(usage["completion_tokens"])
    except (KeyError, TypeError, ValueError):
        raise ConvertError(f"{path}: assistant message {n} lacks extra.response.usage.prompt_tokens / extra.response.usage.completion_tokens (docs/trace-format.md §7.3)") from None
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or usage.get("prompt_cache_hit_tokens") or 0)
    ts = extra.get("timestamp")
    created = resp.get("created")
    if ts is None or created is None:
        raise ConvertError(f"{path}: assistant message {n} lacks extra.timestamp or extra.response.created (docs/trace-format.md §7.3)")
    return p, c, cached, float(created), float(ts)


def _convert_file(path: Path, bs: int, counts: Counter[str], agents: set[str]) -> list[tuple[float, TraceRequest]]:
    d = _load(path)
    agent = str(d.get("instance_id") or path.name.split(".")[0])
    if agent in agents:  # subfolders (runs) repeat task ids: ids must stay unique in one trace
        k = 2
        while f"{agent}#{k}" in agents:
            k += 1
        agent = f"{agent}#{k}"
        counts["agents_renamed_duplicate_task_id"] += 1
    msgs: list[dict[str, Any]] = [m for m in d["messages"] if isinstance(m, dict)]
    stream = _Stream(bs)
    pending: list[_Message | _ToolsPrefix] = [_ToolsPrefix()]  # messages since the last call
    prev_p = 0
    prev_c = 0
    prev_recv: float | None = None
    last_ts: float | None = None
    send0: float | None = None
    out: list[tuple[float, TraceRequest]] = []
    n_call = 0
    calls_total = sum(1 for m in msgs if m.get("role") == "assistant")
    for m in msgs:
        role = m.get("role")
        if role == "exit":
            continue
        if role != "assistant":
            pending.append(_Message(m))
            ts = (m.get("extra") or {}).get("timestamp")
            if ts is not None:
                last_ts = float(ts)
            continue
        p, c, cached, created, recv = _usage(m, path, n_call)
        delta = p - prev_p
        if delta < 0:
            raise ConvertError(f"{path}: call {n_call}: prompt_tokens fell from {prev_p} to {p} (history is append-only)")
        # place the pending messages into the stream: [assistant (prev completion)], others, last takes the rest
        spans: list[int] = []
        rest = delta
        group = pending
        if n_call > 0 and group and group[0].role == "assistant":
            a = min(prev_c, rest)
            spans.append(a)
            rest -= a
            group_rest = group[1:]
        else:
            group_rest = group
        for k, msg in enumerate(group_rest):
            if k == len(group_rest) - 1:
                spans.append(rest)
            else:
                s = min(len(msg.values), rest)
                spans.append(s)
                rest -= s
        if not group:
            raise ConvertError(f"{path}: call {n_call} follows no new message")
        if not group_rest:  # only the previous assistant message is new: it takes every added token
            spans[-1] += rest
        for msg, s in zip(group, spans):
            stream.append(msg.span(s))
        blocks = stream.blocks_for(p)
        if send0 is None:
            send0 = created
            send = created
            pause = 0.0
        else:
            send = last_ts if last_ts is not None else created
            pause = max(0.0, send - prev_recv) if prev_recv is not None else 0.0
        out_tokens = c
        if out_tokens < 1:
            counts["output_tokens_zero"] += 1
        req = TraceRequest(
            id=f"{agent}:{n_call}",
            agent=agent,
            branch=f"{agent}:main",
            input_tokens=p,
            output_tokens=out_tokens,
            blocks=blocks,
            kind="main" if n_call == 0 else None,
            after=[f"{agent}:{n_call - 1}"] if n_call else [],
            pause_s=round(pause, 6),
            ends_branch=n_call == calls_total - 1,
            t_s=round(max(0.0, send - send0), 6),
            arrival_s=send0 if n_call == 0 else None,
            model=str((m.get("extra") or {}).get("response", {}).get("model") or "") or None,
        )
        out.append((send, req))
        counts["provider_prompt_tokens"] += p
        counts["provider_cached_tokens"] += cached
        pending = [_Message(m)]
        prev_p, prev_c, prev_recv, last_ts = p, c, recv, None
        n_call += 1
    if not out:
        raise ConvertError(f"{path}: trajectory has no assistant calls")
    counts["agents"] += 1
    counts["requests"] += len(out)
    return out


def convert(
    inputs: Sequence[str | Path], *, progress: bool = False, block_size: int = DEFAULT_BLOCK_SIZE, strict: bool = False
) -> Conversion:
    """Convert mini-swe-agent trajectory files (or folders) to a canonical trace.

    A task id seen in an earlier file (folders of several runs repeat them) becomes
    ``<id>#2``, ``#3`` ... so the trace's agent and request ids stay unique.

    Args:
        block_size: tokens per block id (default 64).
        strict: stop at the first unreadable trajectory instead of skipping it (skipped
            files are named on stderr and listed in ``meta.skipped``).

    Raises:
        ConvertError: missing input; with ``strict``, a malformed trajectory.
    """
    if block_size < 1:
        raise ConvertError("block_size must be >= 1")
    files = expand_inputs(inputs, PATTERNS)
    counts: Counter[str] = Counter()
    skipped = Skipped(strict)
    agents: set[str] = set()

    def one(p: Path) -> list[tuple[float, TraceRequest]]:
        mine: Counter[str] = Counter()
        reqs = _convert_file(p, block_size, mine, agents)
        agents.add(reqs[0][1].agent)  # only a converted file claims its id and adds its counts
        counts.update(mine)
        return reqs

    def gen() -> Iterator[TraceRequest]:
        per_file = [r for p in progress_iter(files, enabled=progress, desc=KIND) if (r := skipped.call(p, partial(one, p)))]
        if not per_file:
            skipped.none_converted()
        # all trajectories share the unix clock: write requests in send order (stable per agent)
        merged = heapq.merge(*[[(t, fi, i, r) for i, (t, r) in enumerate(reqs)] for fi, reqs in enumerate(per_file)])
        for _, _, _, r in merged:
            yield r

    def header():  # type: ignore[no-untyped-def]
        meta: dict[str, Any] = {
            "converter": KIND,
            "origin": ORIGIN,
            "options": {"block_size": block_size},
            "tools_tokens": TOOLS_TOKENS,
            **inputs_meta([str(p.relative_to(p.parents[1])) if len(p.parents) > 1 else p.name for p in files]),
            "block_ids": "chained BLAKE2b of a content-derived token stream (module docstring); equal prefixes share ids",
            "clock": "arrival_s = unix time of the trajectory's first call; t_s from it",
            "counts": dict(sorted(counts.items())),
            "skipped": skipped.meta(),
        }
        if counts["provider_prompt_tokens"]:
            meta["provider_cached_share"] = counts["provider_cached_tokens"] / counts["provider_prompt_tokens"]
        return make_header(
            block_size=block_size,
            source=source_line(KIND, inputs),
            description="mini-swe-agent (DeepSeek-V3) SWE-bench trajectories: one append-only branch per task, tool gaps",
            meta=meta,
        )

    return Conversion(gen(), header)
