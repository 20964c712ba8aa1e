"""Router over a real nats-server: the worker, planner and directory side is played by the test.

The router runs in-process through the same shell as ``python -m services.router``
(``shared.service.serve_until_stopped``); a :class:`FakeCluster` on its own NATS
connection answers ``split.get``, ``kv.lookup`` and ``branch.query``, publishes ``NodeState``s,
consumes ``work.*.prefill`` and answers with ``TokenChunk``s on ``req.<rid>.out``.
HTTP is driven with httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog

from shared import messages as m
from shared.bus import Bus
from shared.clock import SimClock
from shared.hashing import block_hashes, unpack_tokens
from shared.subjects import (
    BRANCH_EVENTS,
    BRANCH_QUERY,
    KV_LIVENESS,
    KV_LOOKUP,
    NODE_STATE,
    REQ_OUT,
    ROUTE_PLACED,
    SPLIT_COMMANDS,
    SPLIT_GET,
    WORK_ABORT,
    WORK_PREFILL,
    Subjects,
)

from services.router.config import RouterConfig
from shared.tokenizer import SimTokenizer
from tests.integration.live import RouterEnv, cancelled, router_on_fake_cluster
from tests.integration.live import wait_for as _wait_for  # the name this file's importers use

pytestmark = pytest.mark.timeout(60)

BS = 64
HEARTBEAT_S = 0.1
FENCE_S = 1.5


def output_token(position: int) -> int:
    """The fake engine's output token at output position ``position`` (deterministic)."""
    return (7919 * (position + 1)) % 100_000


@dataclass
class FakeCluster:
    """Workers, planner and directory as seen on the bus."""

    bus: Bus
    phases: dict[str, str]
    alive: set[str] = field(default_factory=set)
    answering: set[str] = field(default_factory=set)
    """Nodes that answer prefill work; others only record it."""
    stall_after_first: set[str] = field(default_factory=set)
    """Nodes that send the first chunk of a request's first work (its first attempt: 0, or a client
    ``X-Request-ID``'s first attempt) and then nothing."""
    stalled: set[str] = field(default_factory=set)
    """rids whose first work was stalled (``stall_after_first``)."""
    error_nodes: set[str] = field(default_factory=set)
    abort_nodes: set[str] = field(default_factory=set)
    """Nodes that end work with an ``abort`` chunk, as a prefill node that found no decode node to bind
    within its ``--bind-timeout-s`` (``services/worker/service.py`` ``_bind``)."""
    engines: dict[str, str] = field(default_factory=dict)
    """node -> ``NodeState.engine`` it reports (default ``sim``); a sim node refuses work with logprobs as
    the real sim engine does (``services/worker/engines/sim.py``): an ``error`` chunk."""
    cached: dict[str, int] = field(default_factory=dict)
    """node -> local prefix blocks reported by kv.lookup (and cached tokens reported)."""
    gpu_blocks: dict[str, int] = field(default_factory=dict)
    """node -> ``NodeState.gpu_total_blocks`` it reports (default 100); like a worker's scheduler, a node
    refuses work whose KV footprint (prompt, + max_tokens where it decodes) is more: an ``error`` chunk."""
    script: list[int] | None = None
    """The output token ids of every work, in place of ``output_token``'s (a model that writes a given text): at
    most max_tokens of them; fewer end with ``finish_reason`` ``stop`` (the model's EOS), as many ``length``."""
    lookup_enabled: bool = True
    lookup_delay_s: float = 0.0
    """Wall seconds kv.lookup takes to answer (a slow directory)."""
    branch_states: dict[str, str | None] = field(default_factory=dict)
    """branch id -> its state answered to ``branch.query`` (absent: ``unknown``; ``None``: no answer)."""
    branch_queries: list[str] = field(default_factory=list)
    works: list[m.PrefillWork] = field(default_factory=list)
    aborts: list[tuple[str, m.RequestAbort]] = field(default_factory=list)
    branch_events: list[Any] = field(default_factory=list)
    placed: list[m.RoutePlaced] = field(default_factory=list)
    lookups: list[m.KvLookupRequest] = field(default_factory=list)
    split_gets: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        await self.bus.serve(SPLIT_GET, self._split_get)
        await self.bus.serve(KV_LOOKUP, self._lookup)
        await self.bus.serve(BRANCH_QUERY, self._branch_query)
        await self.bus.subscribe(WORK_PREFILL, self._work)
        await self.bus.subscribe(WORK_ABORT, self._abort)
        await self.bus.subscribe(BRANCH_EVENTS, self._record(self.branch_events))
        await self.bus.subscribe(ROUTE_PLACED, self._record(self.placed))
        self.alive = set(self.phases)
        self.answering = set(self.phases)
        await self.publish_states()
        self.tasks.append(asyncio.create_task(self._beat()))

    async def stop(self) -> None:
        await cancelled(self.tasks)

    def _record(self, sink: list[Any]):
        async def handler(msg: Any, _subject: str) -> None:
            sink.append(msg)

        return handler

    async def publish_states(self) -> None:
        for node in sorted(self.alive):
            blocks = self.gpu_blocks.get(node, 100)
            st = m.NodeState(node=node, phase=self.phases[node], epoch=1, block_size=BS, gpu_free_blocks=blocks, gpu_total_blocks=blocks,
                             engine=self.engines.get(node, "sim"))  # type: ignore[arg-type]
            await self.bus.publish(NODE_STATE, st, node=node)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self.publish_states()

    async def _split_get(self, _q: m.SplitQuery, _s: str) -> m.SplitCommand:
        self.split_gets += 1
        return m.SplitCommand(epoch=1, phases=dict(self.phases), reason="test")  # type: ignore[arg-type]

    async def _lookup(self, req: m.KvLookupRequest, _s: str) -> m.KvLookupReply | None:
        self.lookups.append(req)
        if self.lookup_delay_s:
            await asyncio.sleep(self.lookup_delay_s)
        if not self.lookup_enabled:
            return None
        n = len(req.block_hashes)
        nodes = [m.NodePrefix(node=k, local_blocks=min(v, n), gpu_blocks=min(v, n)) for k, v in self.cached.items() if v]
        return m.KvLookupReply(block_size=req.block_size, nodes=nodes, longest_any=max((p.local_blocks for p in nodes), default=0))

    async def _branch_query(self, q: m.BranchQuery, _s: str) -> m.BranchQueryReply | None:
        self.branch_queries.append(q.branch_id)
        state = self.branch_states.get(q.branch_id, "unknown")
        return None if state is None else m.BranchQueryReply(branch_id=q.branch_id, state=state)  # type: ignore[arg-type]

    async def _abort(self, msg: m.RequestAbort, subject: str) -> None:
        self.aborts.append((subject.split(".")[-2], msg))

    async def _work(self, w: m.PrefillWork, subject: str) -> None:
        node = subject.split(".")[-2]
        self.works.append(w)
        if node not in self.answering:
            return
        out = lambda c: self.bus.publish(REQ_OUT, c, rid=w.rid, node=c.node)  # noqa: E731
        cached = min(self.cached.get(node, 0), len(w.block_hashes)) * BS
        if node in self.abort_nodes:
            error = "no decode node for the request: no live decode (phase decode) or collocated (both) node: d9: fenced"
            await out(m.TokenChunk(rid=w.rid, node=node, finished=True, finish_reason="abort", error=error, attempt=w.attempt))
            return
        if node in self.error_nodes:
            await out(m.TokenChunk(rid=w.rid, node=node, finished=True, finish_reason="error", error="kv transfer failed", attempt=w.attempt))
            return
        footprint = -(-(w.prompt_tokens + (w.max_tokens if w.decode_node in (None, node) else 0)) // BS)
        if footprint > self.gpu_blocks.get(node, 100):  # services/worker/scheduler.py's _check_fits
            error = f"request needs {footprint} KV blocks but node {node} has {self.gpu_blocks.get(node, 100)} in GPU memory"
            await out(m.TokenChunk(rid=w.rid, node=node, finished=True, finish_reason="error", error=error, attempt=w.attempt))
            return
        if w.sampling is not None and w.sampling.logprobs is not None and self.engines.get(node, "sim") == "sim":
            error = "logprobs are not supported by the sim engine (no model, no token distribution); serve a torch engine"
            await out(m.TokenChunk(rid=w.rid, node=node, finished=True, finish_reason="error", error=error, attempt=w.attempt))
            return
        # like a worker: output positions from the work's output_offset, chunks stamped with its attempt
        off, att = w.output_offset, w.attempt
        if self.script is None:
            ids, end = [output_token(off + i) for i in range(w.max_tokens)], "length"
        else:
            ids = self.script[off : off + w.max_tokens]
            end = "length" if len(ids) == w.max_tokens else "stop"
        n = len(ids)
        decoder = w.decode_node or node
        first = m.TokenChunk(
            rid=w.rid, node=node, index=off, token_ids=ids[:1], prompt_tokens=w.prompt_tokens, cached_tokens=cached,
            finished=n == 1, finish_reason=end if n == 1 else None, attempt=att,
        )
        await out(first)
        if node in self.stall_after_first and w.rid not in self.stalled:
            self.stalled.add(w.rid)
            return
        for i in range(1, n, 3):
            part = ids[i : i + 3]
            last = i + len(part) >= n
            await out(m.TokenChunk(rid=w.rid, node=decoder, index=off + i, token_ids=part, finished=last,
                                   finish_reason=end if last else None, attempt=att))  # fmt: skip


Env = RouterEnv[FakeCluster]


@contextlib.asynccontextmanager
async def router_env(
    nats_url: str, tmp_path: Path, phases: dict[str, str], *, clock: SimClock | None = None, **cfg_kw: Any
) -> AsyncIterator[Env]:
    """The router in-process with a :class:`FakeCluster`; ``clock``: the router's clock instead of
    the one the shell makes (a test steps its wall clock)."""
    bus = await Bus.connect(nats_url, Subjects("p0"), service="fake", instance="fake-cluster")
    cluster = FakeCluster(bus=bus, phases=phases)
    await cluster.start()
    port_file = tmp_path / "router.port"
    settings: dict[str, Any] = {
        "nats_url": nats_url,
        "port": 0,
        "port_file": str(port_file),
        "fence_after_s": FENCE_S,
        "split_get_timeout_s": 5.0,
        "lookup_timeout_s": 0.5,
        "request_timeout_s": 20.0,
        "model": "test-model",
        "log_level": "debug",
        "decode_binding": "dispatch",  # the fake workers do not ask route.bind (test_dataplane_live covers it)
    }
    cfg = RouterConfig(**{**settings, **cfg_kw})
    async with router_on_fake_cluster(cluster, cfg, clock) as env:
        assert int(port_file.read_text()) == env.service.port
        yield env


def sse_events(body: str) -> list[Any]:
    """Parse an SSE body into decoded JSON objects and the literal '[DONE]'."""
    out: list[Any] = []
    for block in body.split("\n\n"):
        block = block.strip("\n")
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else msgspec.json.decode(data))
    return out


# --------------------------------------------------------------------------- #


async def test_completion_with_token_ids_non_streaming(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        env.cluster.cached = {"p0": 2}
        prompt = list(range(1000, 1200))  # 200 tokens = 3 full blocks
        r = await env.http.post("/v1/completions", json={"model": "test-model", "prompt": prompt, "max_tokens": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "test-model" and body["id"].startswith("cmpl-")
        assert isinstance(body["created"], int)
        ids = [(7919 * (i + 1)) % 100_000 for i in range(5)]
        assert body["choices"] == [{"index": 0, "text": SimTokenizer().decode(ids), "logprobs": None, "finish_reason": "length", "stop_reason": None}]
        assert body["usage"] == {
            "prompt_tokens": 200,
            "completion_tokens": 5,
            "total_tokens": 205,
            "prompt_tokens_details": {"cached_tokens": 128},
        }
        assert r.headers["x-ei-prefill-node"] == "p0" and r.headers["x-ei-decode-node"] == "d0"
        w = env.cluster.works[0]
        assert "cmpl-" + w.rid == body["id"] and w.prompt_tokens == 200 and w.max_tokens == 5 and w.block_size == BS
        assert list(unpack_tokens(w.token_ids)) == prompt
        assert w.block_hashes == block_hashes(prompt, BS) and len(w.block_hashes) == 3
        assert w.decode_node == "d0" and w.branch_id is None and w.epoch == 1
        assert env.cluster.lookups[-1].block_hashes == w.block_hashes
        assert env.service.core.view.inflight_total == 0
        # with a branch, both placements are published on route.placed
        r = await env.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}, headers={"X-Branch-Id": "b1"})
        assert r.status_code == 200
        await _wait_for(lambda: len(env.cluster.placed) == 2, what="route.placed")
        assert sorted((p.node, p.phase, p.branch_id, p.rid) for p in env.cluster.placed) == [
            ("d0", "decode", "b1", r.headers["x-request-id"]),
            ("p0", "prefill", "b1", r.headers["x-request-id"]),
        ]
        assert env.cluster.placed[0].block_hashes == block_hashes(prompt, BS)

        models = (await env.http.get("/v1/models")).json()
        assert models["object"] == "list" and [d["id"] for d in models["data"]] == ["test-model"]
        assert (await env.http.get("/healthz")).status_code == 200
        cl = (await env.http.get("/v1/cluster")).json()
        assert cl["epoch"] == 1 and cl["policy"] == "cache-aware" and cl["inflight"] == 0
        assert cl["speedup"] == 1.0  # its clock's: `replay` takes it, or refuses another --speedup
        assert {n["node"]: n["phase"] for n in cl["nodes"]} == {"d0": "decode", "p0": "prefill"}
        assert all(n["fenced"] is False and n["state_age_wall_s"] < FENCE_S for n in cl["nodes"])
        st = await env.stats()
        assert st.counters["routed.prefill.p0"] == 2 and st.counters["routed.decode.d0"] == 2
        assert st.counters["http_status.200"] >= 1 and st.gauges["inflight"] == 0
        assert st.gauges["live_nodes"] == 2


async def test_text_prompt_and_cache_aware_routing(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "p1": "prefill", "d0": "decode"}) as env:
        text = " ".join(f"word{i}" for i in range(300))
        expected_ids = SimTokenizer().encode(text)
        # no cache anywhere: min load, ties to the smallest node id
        r = await env.http.post("/v1/completions", json={"prompt": text})
        assert r.status_code == 200 and r.headers["x-ei-prefill-node"] == "p0"
        assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens
        assert list(unpack_tokens(env.cluster.works[-1].token_ids)) == expected_ids
        # p1 holds the whole prefix: cache hit
        env.cluster.cached = {"p1": 100}
        r = await env.http.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-ei-prefill-node"] == "p1"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(expected_ids) // BS) * BS
        st = await env.stats()
        assert st.counters["route_path.min_load"] == 1 and st.counters["route_path.cache_hit"] == 1


async def test_streaming_chat_collocated(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        env.cluster.cached = {"c0": 1}
        messages = [{"role": "system", "content": "you are terse " * 30}, {"role": "user", "content": "hello there"}]
        payload = {"model": "test-model", "messages": messages, "max_completion_tokens": 7, "stream": True, "stream_options": {"include_usage": True}}
        async with env.http.stream("POST", "/v1/chat/completions", json=payload) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            body = (await r.aread()).decode()
        events = sse_events(body)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        ids = [(7919 * (i + 1)) % 100_000 for i in range(7)]
        assert text == SimTokenizer().decode(ids)
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finals[-1] == "length" and all(f is None for f in finals[:-1])
        usage = chunks[-1]
        assert usage["choices"] == []
        prompt_tokens = len(SimTokenizer().apply_chat_template(messages))
        assert usage["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 7,
            "total_tokens": prompt_tokens + 7,
            "prompt_tokens_details": {"cached_tokens": 64},
        }
        (w,) = env.cluster.works
        assert w.decode_node is None and w.prompt_tokens == prompt_tokens
        # non-streaming chat
        r = await env.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
        assert r.status_code == 200
        b = r.json()
        assert b["object"] == "chat.completion" and b["choices"][0]["message"]["role"] == "assistant"
        assert b["choices"][0]["message"]["content"] == SimTokenizer().decode(ids[:3])
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


async def test_branch_headers_events_and_end_endpoint(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        h = {"X-Branch-Id": "agent7/branch:1", "X-Parent-Branch-Id": "agent7/main", "X-Branch-Kind": "fork", "X-Agent-Id": "agent7"}
        for _ in range(2):
            r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, headers=h)
            assert r.status_code == 200, r.text
        await _wait_for(lambda: len(env.cluster.placed) == 2, what="placements")
        starts = [e for e in env.cluster.branch_events if isinstance(e, m.BranchStart)]
        assert len(starts) == 1
        s = starts[0]
        assert (s.branch_id, s.kind, s.parent_branch_id, s.agent_id, s.src) == ("agent7/branch:1", "fork", "agent7/main", "agent7", "router")
        assert {p.branch_id for p in env.cluster.placed} == {"agent7/branch:1"}
        assert {w.branch_id for w in env.cluster.works} == {"agent7/branch:1"}
        # a sub-agent with default-less headers
        r = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Branch-Id": "sub1", "X-Branch-Kind": "subagent", "X-Parent-Branch-Id": "agent7/main"})
        assert r.status_code == 200
        await _wait_for(lambda: len(env.cluster.branch_events) == 2, what="second BranchStart")
        assert env.cluster.branch_events[1].kind == "subagent"

        end = await env.http.post("/v1/branches/agent7%2Fbranch:1/end")
        assert end.status_code == 200 and end.json() == {"branch_id": "agent7/branch:1", "ended": True}
        await _wait_for(lambda: any(isinstance(e, m.BranchEnd) for e in env.cluster.branch_events), what="BranchEnd")
        ends = [e for e in env.cluster.branch_events if isinstance(e, m.BranchEnd)]
        assert [e.branch_id for e in ends] == ["agent7/branch:1"]

        dup = await env.http.post("/v1/branches/agent7%2Fbranch:1/end")
        # idempotent: the SDK's retry of an end whose answer it missed succeeds (a 410 before; a 409 before that)
        assert dup.status_code == 200 and dup.json() == {"branch_id": "agent7/branch:1", "ended": True, "already": True}, dup.text
        gone = await env.http.post("/v1/branches/agent7%2Fbranch:1/tool-call", json={"expected_s": 5})
        assert gone.status_code == 410 and "was ended" in gone.json()["error"]["message"], gone.text
        unknown = await env.http.post("/v1/branches/never-seen/end")
        assert unknown.status_code == 404 and "unknown branch" in unknown.json()["error"]["message"]
        ctrl = await env.http.post("/v1/branches/bad%0Aid/end")
        assert ctrl.status_code == 400 and "control character" in ctrl.json()["error"]["message"]
        again = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Branch-Id": "agent7/branch:1"})
        err = again.json()["error"]
        assert again.status_code == 400 and "X-Branch-Id 'agent7/branch:1' names a branch that was ended" in err["message"]
        assert err["param"] == "X-Branch-Id"
        # a→b→a (sub1's parent is agent7/main): a 400 naming the parent header, as a self-parent is; a 409 the OpenAI
        # SDKs retry (3 tries, with backoff) for the same answer
        for bid, parent, frag in (("agent7/main", "sub1", "cycle of parents ('agent7/main' -> 'sub1' -> 'agent7/main')"),
                                  ("s", "s", "its own parent")):
            cyc = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1},
                                      headers={"X-Branch-Id": bid, "X-Parent-Branch-Id": parent, "X-Branch-Kind": "fork"})
            err = cyc.json()["error"]
            assert (cyc.status_code, err["param"]) == (400, "X-Parent-Branch-Id") and frag in err["message"], cyc.text

        for headers, frag in [
            ({"X-Branch-Id": "b", "X-Branch-Kind": "child"}, "X-Branch-Kind"),
            ({"X-Branch-Id": "x" * 300}, "at most 256"),
            ({"X-Branch-Kind": "fork"}, "need an X-Branch-Id"),
            ({"X-Branch-Id": "a\x01b"}, "control character"),
        ]:
            r = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers=headers)
            assert r.status_code == 400 and frag in r.json()["error"]["message"], (headers, r.text)
        st = await env.stats()
        assert st.counters["branches_started"] == 2 and st.counters["branches_ended"] == 1
        assert st.counters["http_status.400"] == 8 and st.counters["http_status.410"] == 1 and st.counters["http_status.404"] == 1
        assert "http_status.409" not in st.counters


async def test_non_ascii_branch_and_agent_ids_are_utf8_in_headers_and_paths(nats_url, tmp_path):
    """A newcomer's ``X-Branch-Id: zweig-ä`` was served as branch ``zweig-Ã¤`` (the header's bytes read as latin-1):
    ``POST /v1/branches/zweig-%C3%A4/end`` answered 404 and the branch lived until the TTL; ``X-Agent-Id:
    agent-ü`` was announced as ``agent-Ã¼``; ``X-Branch-Id: task…1`` was a 400 for a "control character
    (U+0080)". The header's UTF-8 text is now the id, the path's id the same string."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        h = {"X-Branch-Id": "zweig-ä".encode(), "X-Agent-Id": "agent-ü".encode(), "X-Branch-Kind": b"fork",
             "X-Parent-Branch-Id": "haupt-ß".encode()}
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, headers=h)
        assert r.status_code == 200, r.text
        await _wait_for(lambda: any(isinstance(e, m.BranchStart) for e in env.cluster.branch_events), what="BranchStart")
        s = next(e for e in env.cluster.branch_events if isinstance(e, m.BranchStart))
        assert (s.branch_id, s.agent_id, s.parent_branch_id) == ("zweig-ä", "agent-ü", "haupt-ß")
        await _wait_for(lambda: len(env.cluster.placed) == 1, what="placement")
        assert env.cluster.placed[0].branch_id == "zweig-ä"
        tc = await env.http.post("/v1/branches/zweig-%C3%A4/tool-call", json={"expected_s": 5})
        assert tc.status_code == 200 and tc.json()["branch_id"] == "zweig-ä", tc.text
        end = await env.http.post("/v1/branches/zweig-%C3%A4/end")
        assert end.status_code == 200 and end.json() == {"branch_id": "zweig-ä", "ended": True}, end.text
        await _wait_for(lambda: any(isinstance(e, m.BranchEnd) for e in env.cluster.branch_events), what="BranchEnd")
        assert [e.branch_id for e in env.cluster.branch_events if isinstance(e, m.BranchEnd)] == ["zweig-ä"]
        again = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Branch-Id": "zweig-ä".encode()})
        assert again.status_code == 400, again.text  # the header names the branch the path ended
        r = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Branch-Id": "task…1".encode()})
        assert r.status_code == 200, r.text
        for headers, frag, param in [
            ({"X-Branch-Id": b"a\xc2\x80b"}, "control character (U+0080)", "X-Branch-Id"),
            ({"X-Branch-Id": b"b", "X-Agent-Id": b"a\x85"}, "control character (U+0085)", "X-Agent-Id"),
        ]:
            r = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers=headers)
            err = r.json()["error"]
            assert r.status_code == 400 and frag in err["message"] and err["param"] == param, (headers, r.text)
        bad = await env.http.post("/v1/branches/zweig-%E4/end")
        assert bad.status_code == 400 and "not valid UTF-8" in bad.json()["error"]["message"], bad.text
        ctrl = await env.http.post("/v1/branches/a%C2%80b/tool-call")
        assert ctrl.status_code == 400 and "control character (U+0080)" in ctrl.json()["error"]["message"], ctrl.text


async def test_latin1_and_utf8_header_bytes_name_one_branch_that_the_utf8_path_ends(nats_url, tmp_path):
    """Python's ``requests`` / ``http.client`` and Node's ``fetch`` send ``X-Branch-Id: ast-ö`` as the latin-1 bytes
    ``ast-\\xf6`` (curl, aiohttp and Go as UTF-8) and build ``/v1/branches/ast-%C3%B6/end``. Those bytes were a 400
    "X-Branch-Id is not valid UTF-8 (byte 0xF6 ...)", so such a harness could not send the id at all. Now both byte
    forms name ``ast-ö``: one branch (started once), ended by the UTF-8 path, a 400 after in either form."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        body = {"prompt": [1, 2, 3], "max_tokens": 1}
        r = await env.http.post("/v1/completions", json=body, headers={"X-Branch-Id": "ast-ö".encode("latin-1"),
                                                                        "X-Agent-Id": "ägent".encode("latin-1")})  # fmt: skip
        assert r.status_code == 200, r.text
        r = await env.http.post("/v1/completions", json=body, headers={"X-Branch-Id": "ast-ö".encode()})
        assert r.status_code == 200, r.text
        await _wait_for(lambda: len(env.cluster.placed) == 2, what="two placements")
        await _wait_for(lambda: any(isinstance(e, m.BranchStart) for e in env.cluster.branch_events), what="BranchStart")
        assert [p.branch_id for p in env.cluster.placed] == ["ast-ö", "ast-ö"]
        starts = [e for e in env.cluster.branch_events if isinstance(e, m.BranchStart)]
        assert [(s.branch_id, s.agent_id) for s in starts] == [("ast-ö", "ägent")]
        end = await env.http.post("/v1/branches/ast-%C3%B6/end")
        assert end.status_code == 200 and end.json() == {"branch_id": "ast-ö", "ended": True}, end.text
        for enc in ("latin-1", "utf-8"):
            again = await env.http.post("/v1/completions", json=body, headers={"X-Branch-Id": "ast-ö".encode(enc)})
            assert again.status_code == 400 and "was ended" in again.json()["error"]["message"], (enc, again.text)
        st = await env.stats()
        assert st.counters["branches_started"] == 1 and st.counters["branches_ended"] == 1


async def test_minted_branch_ids_are_capped_keeping_the_one_in_flight(nats_url, tmp_path):
    """A client minting a new X-Branch-Id per request: the router's table stays at
    --max-active-branches, each evicted id published as BranchEnd(expired=True) (the directory
    releases its counts), a branch whose request is in flight kept; once that one is answered it
    is evicted in turn, and an evicted id's next request is a resume. Before, the table grew by
    one per request until the TTL (30 min)."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, max_active_branches=2) as env:
        env.cluster.answering.discard("c0")
        held = asyncio.create_task(
            env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, headers={"X-Branch-Id": "held"})
        )
        await _wait_for(lambda: len(env.cluster.works) == 1, what="the held request dispatched")
        w = env.cluster.works[0]
        env.cluster.answering.add("c0")
        for i in range(6):
            r = await env.http.post("/v1/completions", json={"prompt": [3, i], "max_tokens": 1}, headers={"X-Branch-Id": f"u{i}"})
            assert r.status_code == 200, r.text
        st = await env.stats()
        assert st.gauges["branches_active"] == 2.0 and st.gauges["branches_evicted"] == 5.0
        await _wait_for(lambda: sum(isinstance(e, m.BranchEnd) for e in env.cluster.branch_events) == 5, what="evictions")
        ends = [e for e in env.cluster.branch_events if isinstance(e, m.BranchEnd)]
        assert [(e.branch_id, e.expired) for e in ends] == [(f"u{i}", True) for i in range(5)]
        rid_of = {p.branch_id: p.rid for p in env.cluster.placed}  # each with its latest placed rid
        assert [e.rid for e in ends] == [rid_of[f"u{i}"] for i in range(5)]
        await env.bus.publish(
            REQ_OUT, m.TokenChunk(rid=w.rid, node="c0", index=0, token_ids=[5], prompt_tokens=2, finished=True,
                                  finish_reason="length", attempt=w.attempt), rid=w.rid, node="c0",
        )  # fmt: skip
        assert (await held).status_code == 200
        r = await env.http.post("/v1/completions", json={"prompt": [4], "max_tokens": 1}, headers={"X-Branch-Id": "u0"})
        assert r.status_code == 200, r.text  # an evicted id: a resume, not a 409
        # u5 goes, not held: held's request ended after u5's (BranchTable.done notes its end as activity)
        await _wait_for(lambda: sum(isinstance(e, m.BranchEnd) for e in env.cluster.branch_events) == 6, what="eviction of u5")
        assert env.cluster.branch_events[-1].branch_id == "u5"
        r = await env.http.post("/v1/completions", json={"prompt": [5], "max_tokens": 1}, headers={"X-Branch-Id": "u6"})
        assert r.status_code == 200, r.text
        await _wait_for(lambda: sum(isinstance(e, m.BranchEnd) for e in env.cluster.branch_events) == 7, what="eviction of held")
        assert env.cluster.branch_events[-1] == m.BranchEnd(branch_id="held", ts=env.cluster.branch_events[-1].ts, expired=True, src="router", rid=w.rid)
        st = await env.stats()
        assert st.gauges["branches_active"] == 2.0 and st.gauges["branches_resumed"] == 1.0
        r = await env.http.post("/v1/completions", json={"prompt": [4], "max_tokens": 1}, headers={"X-Branch-Id": "held"})
        assert r.status_code == 200, r.text  # the evicted held branch resumes too
        bad = await env.http.post("/v1/completions", json={"prompt": [4], "max_tokens": 0}, headers={"X-Branch-Id": "held"})
        assert bad.status_code == 400
        assert env.service.branches.in_flight_count == 0  # every observed request ended its count


async def test_branch_resumed_after_expiry_and_tool_call_hint(nats_url, tmp_path):
    """Issue 21: a branch idle longer than the TTL is expired by the router as by the directory;
    its next request is served (a resume, re-announced with BranchStart), never refused; the
    tool-call endpoint publishes the hint the directory holds the branch's counts with."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, branch_ttl_s=0.5) as env:
        h = {"X-Branch-Id": "sa1", "X-Branch-Kind": "subagent", "X-Parent-Branch-Id": "m1", "X-Agent-Id": "ag"}
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, headers=h)
        assert r.status_code == 200, r.text
        tc = await env.http.post("/v1/branches/sa1/tool-call", json={"expected_s": 30})
        assert tc.status_code == 200 and tc.json() == {"branch_id": "sa1", "outstanding": True, "expected_s": 30.0}
        await _wait_for(lambda: any(isinstance(e, m.BranchToolCall) for e in env.cluster.branch_events), what="BranchToolCall")
        ev = next(e for e in env.cluster.branch_events if isinstance(e, m.BranchToolCall))
        assert (ev.branch_id, ev.outstanding, ev.expected_s) == ("sa1", True, 30.0)
        bad = await env.http.post("/v1/branches/sa1/tool-call", json={"expected_s": -1})
        assert bad.status_code == 400 and "expected_s" in bad.json()["error"]["message"]
        assert (await env.http.post("/v1/branches/nobody/tool-call")).status_code == 404
        done = await env.http.post("/v1/branches/sa1/tool-call", json={"outstanding": False})
        assert done.status_code == 200
        # the next request (after the hold was released) clears nothing; silence past the TTL expires it
        await asyncio.sleep(1.2)
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 1}, headers={"X-Branch-Id": "sa1"})
        assert r.status_code == 200, r.text  # a resume, not 409
        await _wait_for(lambda: sum(isinstance(e, m.BranchStart) for e in env.cluster.branch_events) == 2, what="re-announcement")
        again = [e for e in env.cluster.branch_events if isinstance(e, m.BranchStart)][-1]
        assert (again.branch_id, again.kind, again.parent_branch_id, again.agent_id) == ("sa1", "subagent", "m1", "ag")
        st = await env.stats()
        assert st.gauges["branches_resumed"] == 1.0 and st.gauges["branches_expired"] >= 1.0


async def test_idle_branches_leave_the_active_gauge_with_no_request_and_a_hold_is_echoed_capped(nats_url, tmp_path):
    """Traffic stops: the branches silent past --branch-ttl-s leave ei_router_branches_active and /v1/cluster's
    branches_active at the router's next periodic round (before, expiry ran only at the next X-Branch-Id request:
    the gauge stayed at 2 for as long as no request came). A tool-call hint's echo is the hold the branch holds: 1e12 s is
    --max-tool-hold-s (before, 1e12 was echoed though the directory holds 4 h at most), a shorter hint leaves the
    longer hold running and a release holds 0 (before, each echoed its own expected_s)."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, branch_ttl_s=0.5) as env:
        for bid in ("idle-1", "idle-2"):
            r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, headers={"X-Branch-Id": bid})
            assert r.status_code == 200, r.text
        tc = await env.http.post("/v1/branches/idle-2/tool-call", json={"expected_s": 1e12})
        assert tc.status_code == 200 and tc.json() == {"branch_id": "idle-2", "outstanding": True, "expected_s": 14400.0}
        short = await env.http.post("/v1/branches/idle-2/tool-call", json={"expected_s": 10})  # the longer one runs on
        assert 14399.0 < short.json()["expected_s"] <= 14400.0, short.text
        off = await env.http.post("/v1/branches/idle-2/tool-call", json={"outstanding": False, "expected_s": 30})
        assert off.json()["expected_s"] == 0.0, off.text  # released: it holds 0 (30 was echoed)
        assert (await env.http.get("/v1/cluster")).json()["branches_active"] == 2

        async def active() -> tuple[str, int]:
            metrics = (await env.http.get("/metrics")).text
            line = next(ln for ln in metrics.splitlines() if ln.startswith("ei_router_branches_active "))
            return line, (await env.http.get("/v1/cluster")).json()["branches_active"]

        for _ in range(40):  # the TTL (0.5 s) plus a hold that ended 0.5 s ago, then a round (<= 0.5 s)
            if await active() == ("ei_router_branches_active 0.0", 0):
                break
            await asyncio.sleep(0.1)
        assert await active() == ("ei_router_branches_active 0.0", 0)
        assert (await env.stats()).gauges["branches_expired"] == 2.0


async def test_a_branch_whose_request_runs_past_the_ttl_is_kept_until_a_ttl_after_it_ends(nats_url, tmp_path):
    """A request answered after --branch-ttl-s (a long stream, or parked): before, the router's periodic round
    expired its branch while it ran (the active gauge dropped, its placement was forgotten, its next request was a
    resume). Now the branch stays active while its request runs and expires a TTL after the answer."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, branch_ttl_s=0.5) as env:
        env.cluster.answering.discard("c0")
        held = asyncio.create_task(
            env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, headers={"X-Branch-Id": "long"})
        )
        await _wait_for(lambda: len(env.cluster.works) == 1, what="the request dispatched")
        w = env.cluster.works[0]
        await asyncio.sleep(1.5)  # three TTLs, each with rounds of the fence loop (<= 0.5 s apart)
        st = await env.stats()
        assert (st.gauges["branches_active"], st.gauges["branches_expired"]) == (1.0, 0.0)
        await env.bus.publish(
            REQ_OUT, m.TokenChunk(rid=w.rid, node="c0", index=0, token_ids=[5], prompt_tokens=2, finished=True,
                                  finish_reason="length", attempt=w.attempt), rid=w.rid, node="c0",
        )  # fmt: skip
        assert (await held).status_code == 200
        st = await env.stats()
        assert (st.gauges["branches_active"], st.gauges["branches_expired"]) == (1.0, 0.0)  # silent from its answer
        for _ in range(30):
            if (await env.stats()).gauges["branches_expired"] == 1.0:
                break
            await asyncio.sleep(0.1)
        st = await env.stats()
        assert (st.gauges["branches_active"], st.gauges["branches_expired"]) == (0.0, 1.0)
        assert not any(isinstance(e, m.BranchEnd) for e in env.cluster.branch_events)  # the TTL publishes nothing


async def test_a_wall_clock_step_expires_no_branch_at_the_router(nats_url, tmp_path):
    """The wall clock steps past --branch-ttl-s: the router's branch TTL is a duration of its own,
    read on the monotonic clock as the directory's is, so the branch's next request is no resume
    (on the wall clock every branch expired at once: each next request counted a resume and sent
    the directory a second BranchStart for a branch it still held); the BranchStart's ts stays wall."""
    step = [0.0]
    clock = SimClock(wall=lambda: time.time() + step[0])
    async with router_env(nats_url, tmp_path, {"c0": "both"}, clock=clock, branch_ttl_s=60.0) as env:
        h = {"X-Branch-Id": "w1"}
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, headers=h)
        assert r.status_code == 200, r.text
        step[0] = 3600.0
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 1}, headers=h)
        assert r.status_code == 200, r.text
        st = await env.stats()
        assert st.gauges["branches_resumed"] == 0.0 and st.gauges["branches_expired"] == 0.0
        r = await env.http.post("/v1/completions", json={"prompt": [5], "max_tokens": 1}, headers={"X-Branch-Id": "w2"})
        assert r.status_code == 200, r.text
        await _wait_for(lambda: sum(isinstance(e, m.BranchStart) for e in env.cluster.branch_events) == 2, what="BranchStarts")
        assert [e.branch_id for e in env.cluster.branch_events if isinstance(e, m.BranchStart)] == ["w1", "w2"]
        w2 = env.cluster.branch_events[-1]
        assert abs(w2.ts - clock.now()) < 60.0  # the message's ts: the wall-based cluster time, stepped too


async def test_bad_requests_get_4xx_with_reasons(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, max_prompt_tokens=1000) as env:
        cases = [
            (b"{oops", 400, "JSON is malformed"),
            (b'{"prompt": [1, 2], "max_tokens": "many"}', 400, "$.max_tokens"),
            (b'{"prompt": [1, 100000]}', 400, "outside the vocabulary"),
            (b'{"prompt": [1, 99999999999]}', 400, "token id 99999999999 is outside the vocabulary"),  # was msgspec's `<= 4294967295`
            (b'{"prompt": [[-1]]}', 400, "token id -1 is outside the vocabulary"),
            (b'{"prompt": [7, 99999999999999999999999]}', 400, "token id 99999999999999999999999 is outside"),  # past int64: no 500
            (b'{"prompt": [7, ' + b"9" * 5000 + b"]}", 400, "Integer value out of range - at `$.prompt[1]`"),  # past msgspec: was a 500
            (b'{"prompt": [[7, null]]}', 400, "at `$.prompt[0][1]`"),
            (b'{"prompt": [[1], [2]]}', 400, "batched prompts"),
            (msgspec.json.encode({"prompt": list(range(1001))}), 400, "at most 1000"),
            (b'{"prompt": [1], "model": "gpt-4"}', 404, "not found"),
            (b'{"prompt": [1], "max_tokens": 10000000}', 400, "exceeds the limit"),
            (b'{"prompt": "   "}', 400, "no tokens"),
        ]
        for body, status, frag in cases:
            r = await env.http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == status and frag in r.json()["error"]["message"], (body[:40], r.text)
        r = await env.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
        assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
        r = await env.http.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        r = await env.http.get("/v1/completions")
        assert r.status_code == 405 and "method not allowed" in r.json()["error"]["message"]
        assert env.cluster.works == []  # nothing bad was dispatched
        r = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert r.status_code == 200


async def test_no_nodes_and_worker_error(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, no_route_wait_s=1.0) as env:
        env.cluster.error_nodes.add("c0")
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 500 and "kv transfer failed" in r.json()["error"]["message"]
        # a stream's status and headers go out at acceptance: the failure is an SSE error event
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": True})
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
        assert "kv transfer failed" in events[-2]["error"]["message"]
        env.cluster.error_nodes.clear()
        # the node goes away: healthz and requests answer 503 with the reason
        env.cluster.alive.clear()
        await _wait_for(lambda: not env.service.ready(), timeout=5, what="node fenced")
        hz = await env.http.get("/healthz")
        assert hz.status_code == 503 and "c0: fenced" in hz.json()["error"]["message"]
        t0 = asyncio.get_running_loop().time()
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 503 and "no live prefill" in r.json()["error"]["message"]
        assert asyncio.get_running_loop().time() - t0 >= 1.0  # it waited --no-route-wait-s for a node first
        # a request sent while no node is eligible waits for one: the node comes back, it is served
        waiting = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}))
        await asyncio.sleep(0.3)
        env.cluster.alive.add("c0")
        r = await waiting
        assert r.status_code == 200, r.text
        await _wait_for(lambda: env.service.ready(), timeout=5, what="node back")
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 200
        st = await env.stats()
        assert st.counters["finish.error"] == 2 and st.counters["no_route"] == 1 and st.counters["unfenced"] == 1
        assert st.counters["route_waits"] == 2 and st.counters["route_waits.recovered"] == 1


async def test_silent_prefill_node_is_fenced_and_its_request_redispatched(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "p1": "prefill", "d0": "decode"}) as env:
        env.cluster.answering.discard("p0")  # p0 takes work and never answers
        req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}))
        await _wait_for(lambda: len(env.cluster.works) == 1, what="work on p0")
        rid = env.cluster.works[0].rid
        assert env.service.core.view.placement(rid) == ("p0", "d0")
        assert env.cluster.works[0].attempt == 0 and env.cluster.works[0].router == "router"
        env.cluster.alive.discard("p0")  # ... and stops reporting
        r = await asyncio.wait_for(req, 10)
        # re-dispatched, not failed: the same request on p1, attempt 1
        assert r.status_code == 200, r.text
        assert r.headers["x-ei-prefill-node"] == "p1" and r.json()["ei"]["redispatches"] == 1
        again = [w for w in env.cluster.works if w.rid == rid]
        assert [(w.attempt, w.prompt_tokens, w.output_offset) for w in again] == [(0, 3, 0), (1, 3, 0)]
        await _wait_for(lambda: len(env.cluster.aborts) >= 2, what="aborts")
        assert sorted((n, a.rid, a.attempt, a.router) for n, a in env.cluster.aborts) == [("d0", rid, 0, "router"), ("p0", rid, 0, "router")]
        cl = (await env.http.get("/v1/cluster")).json()
        p0 = next(n for n in cl["nodes"] if n["node"] == "p0")
        assert p0["fenced"] is True and p0["eligible"] is False and p0["fence_events"] == 1
        st = await env.stats()
        assert st.counters["fenced"] == 1 and st.counters["redispatched"] == 1 and st.counters["redispatch.prefill"] == 1
        assert st.counters.get("fenced_requests_failed", 0) == 0
        assert st.gauges["fenced_nodes"] == 1
        # it reports again: let back in
        env.cluster.alive.add("p0")
        env.cluster.answering.add("p0")
        await _wait_for(lambda: len(env.service.core.view.prefill_candidates(env.service.clock.now())) == 2, what="p0 back")
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-ei-prefill-node"] == "p0"


async def test_a_wall_clock_step_fences_no_node(nats_url, tmp_path):
    """The wall clock steps an hour forward (NTP, a VM resumed) while the nodes' states are in the
    air: node-state ages are measured on the monotonic clock, so no node is fenced or forgotten
    (on the wall clock every node was fenced in the next round, and forgotten past
    --forget-node-after-s, at once)."""
    step = [0.0]
    clock = SimClock(wall=lambda: time.time() + step[0])
    async with router_env(nats_url, tmp_path, {"c0": "both", "c1": "both"}, clock=clock, forget_node_after_s=60.0) as env:
        env.cluster.alive.clear()  # no state arrives for a moment (well under FENCE_S)
        await asyncio.sleep(2 * HEARTBEAT_S)
        step[0] = 3600.0
        await asyncio.sleep(0.7)  # the fence loop wakes at least every 0.5 s
        st = await env.stats()
        assert st.counters.get("fenced", 0) == 0 and st.counters.get("nodes.forgotten", 0) == 0
        env.cluster.alive.update({"c0", "c1"})
        cl = (await env.http.get("/v1/cluster")).json()
        assert sorted(n["node"] for n in cl["nodes"] if not n["fenced"]) == ["c0", "c1"]
        assert all(n["state_age_wall_s"] < FENCE_S for n in cl["nodes"])
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200, r.text
        # a node that really stops is still fenced, on the monotonic clock
        env.cluster.alive.discard("c1")
        await _wait_for(lambda: env.service.counters["fenced"] == 1, what="c1 fenced")
        assert [n.node for n in env.service.core.view.prefill_candidates(clock.now())] == ["c0"]


async def test_a_forgotten_node_leaves_the_routed_metrics(nats_url, tmp_path):
    """A node the router forgets (fenced, silent past --forget-node-after-s) takes its
    ei_router_routed_total{node} series and routed.*.<node> stats counters with it: with node ids
    new at each restart they grew without end."""
    async with router_env(nats_url, tmp_path, {"c0": "both", "c1": "both"}, forget_node_after_s=0.3) as env:
        prompt = list(range(1000, 1200))  # 3 full blocks
        for node in ("c0", "c1"):  # each node holds the prefix in turn: each gets a placement
            env.cluster.cached = {node: 3}
            r = await env.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200 and r.headers["x-ei-prefill-node"] == node, r.text
        routed = lambda: {n for n in ("c0", "c1") if env.service.counters.get(f"routed.prefill.{n}")}  # noqa: E731
        assert routed() == {"c0", "c1"}
        assert 'ei_router_routed_total{node="c1",phase="prefill"}' in (await env.http.get("/metrics")).text
        env.cluster.alive.discard("c1")  # leaves for good
        await _wait_for(lambda: env.service.counters["nodes.forgotten"] == 1, what="c1 forgotten")
        assert routed() == {"c0"}
        text = (await env.http.get("/metrics")).text
        assert 'node="c1"' not in text and 'ei_router_routed_total{node="c0",phase="prefill"}' in text
        st = await env.stats()
        assert "routed.prefill.c1" not in st.counters and "routed.decode.c1" not in st.counters


async def test_a_stale_kv_view_is_a_warning_and_its_recovery_an_info_of_its_own(nats_url, tmp_path):
    """The directory's kv.liveness: a node newly stale is a warning naming it; the same node fresh again
    is an info line saying so (before: the same "not counted on" warning, with ``stale: []``)."""

    def liveness(**stale: bool) -> m.KvLiveness:
        return m.KvLiveness(nodes=[m.NodeKvLiveness(node=n, stale=s) for n, s in stale.items()], stale_after_s=10.0)

    with structlog.testing.capture_logs() as logs:
        async with router_env(nats_url, tmp_path, {"c0": "both", "c1": "both"}) as env:
            view = env.service.core.view
            await env.cluster.bus.publish(KV_LIVENESS, liveness(c0=True, c1=False))
            await _wait_for(lambda: view.kv_stale == {"c0"}, what="c0 stale")
            await env.cluster.bus.publish(KV_LIVENESS, liveness(c0=False, c1=False))
            await _wait_for(lambda: not view.kv_stale, what="c0 fresh again")
    kv = [(e["log_level"], e["event"], e.get("nodes")) for e in logs if "KV view" in e["event"]]
    assert kv == [
        ("warning", "KV views the directory calls stale; their caches are not counted on", ["c0"]),
        ("info", "KV views fresh again; their caches are counted on", ["c0"]),
    ], kv


async def test_a_stale_node_the_directory_forgets_is_not_announced_fresh_again(nats_url, tmp_path):
    """A stale node the directory forgets (SIGKILLed: silent past its forget threshold) drops out of
    kv.liveness: the router logs it as no longer reported, not as "fresh again" (before: a dead node
    was announced recovered). A node still reported and no longer stale is the only "fresh again"."""

    def liveness(**stale: bool) -> m.KvLiveness:
        return m.KvLiveness(nodes=[m.NodeKvLiveness(node=n, stale=s) for n, s in stale.items()], stale_after_s=10.0)

    with structlog.testing.capture_logs() as logs:
        async with router_env(nats_url, tmp_path, {"c0": "both", "c1": "both"}) as env:
            view = env.service.core.view
            await env.cluster.bus.publish(KV_LIVENESS, liveness(c0=True, c1=True))
            await _wait_for(lambda: view.kv_stale == {"c0", "c1"}, what="c0, c1 stale")
            await env.cluster.bus.publish(KV_LIVENESS, liveness(c1=False))  # c0 forgotten, c1 recovered
            await _wait_for(lambda: not view.kv_stale, what="c0 forgotten, c1 fresh again")
    kv = [(e["log_level"], e["event"], e.get("nodes")) for e in logs if "KV view" in e["event"]]
    assert kv == [
        ("warning", "KV views the directory calls stale; their caches are not counted on", ["c0", "c1"]),
        ("info", "KV views fresh again; their caches are counted on", ["c1"]),
        ("info", "stale KV views no longer reported (the directory forgot their nodes)", ["c0"]),
    ], kv


async def test_stale_attempt_output_is_dropped_and_its_node_told_to_stop(nats_url, tmp_path):
    """A fenced node that comes back and still sends output of the old attempt never reaches the client."""
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "p1": "prefill", "d0": "decode"}) as env:
        env.cluster.answering.clear()
        req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}))
        await _wait_for(lambda: len(env.cluster.works) == 1, what="work dispatched")
        first = env.cluster.works[0]
        node0 = env.service.core.view.placement(first.rid)[0]
        env.cluster.alive.discard(node0)
        await _wait_for(lambda: len(env.cluster.works) == 2, what="re-dispatch")
        assert env.cluster.works[1].attempt == 1
        env.cluster.alive.add(node0)  # back: it sends the old attempt's output
        await env.bus.publish(REQ_OUT, m.TokenChunk(rid=first.rid, node=node0, index=0, token_ids=[5, 6], attempt=0), rid=first.rid, node=node0)
        await _wait_for(lambda: any(a.attempt == 0 and n == node0 and "superseded" in a.reason for n, a in env.cluster.aborts), what="abort")
        assert {a.router for _, a in env.cluster.aborts} == {"router"}  # stamped: a node drops only a request this router owns
        other = env.service.core.view.placement(first.rid)[0]
        ids = [output_token(i) for i in range(4)]
        for i, t in enumerate(ids):
            await env.bus.publish(REQ_OUT, m.TokenChunk(rid=first.rid, node=other, index=i, token_ids=[t], attempt=1, finished=i == 3,
                                                        finish_reason="length" if i == 3 else None), rid=first.rid, node=other)  # fmt: skip
        r = await asyncio.wait_for(req, 10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == env.service.tokenizer.decode(ids)
        st = await env.stats()
        assert st.counters["chunks_stale_attempt"] == 1 and st.counters["aborts.superseded"] == 1


async def test_decode_node_dies_mid_stream_and_the_stream_continues(nats_url, tmp_path):
    """The decode node dies after the first token: prompt + that token are prefilled again
    elsewhere and the stream goes on from output position 1: no token repeated or lost."""
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode", "d1": "decode"}) as env:
        env.cluster.stall_after_first.add("p0")
        prompt = [5] * 70
        async with env.http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            first = await anext(lines)
            dead = env.cluster.works[0].decode_node
            env.cluster.alive.discard(dead)  # the decode node dies after the first token
            rest = "".join([line + "\n" async for line in lines])
        events = sse_events(first + "\n\n" + rest)
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == env.service.tokenizer.decode([output_token(i) for i in range(6)])
        again = env.cluster.works[1]
        assert again.attempt == 1 and again.output_offset == 1 and again.max_tokens == 5
        assert again.prompt_tokens == 71 and unpack_tokens(again.token_ids).tolist() == prompt + [output_token(0)]
        assert again.decode_node != dead and events[-2]["ei"]["redispatches"] == 1
        st = await env.stats()
        assert st.counters["redispatch.decode"] == 1 and st.counters.get("finish.error", 0) == 0


@pytest.mark.parametrize("binding", ["dispatch", "prefill-start"])
async def test_prefill_node_dies_between_first_token_and_hand_off_and_the_stream_continues(nats_url, tmp_path, binding):
    """The prefill node publishes the first token and dies before its hand-off reaches the
    decode node (no output from the decode node): when it is fenced, prompt + that token are
    prefilled again elsewhere (attempt 1, output position 1) instead of waiting for the
    request timeout; the decode node is told to drop attempt 0; no token repeated or lost.
    ``prefill-start``: the node dies with the request parked, its first token sent before its
    route.bind was answered (the fake node never asks): the same continuation, counted as a lost
    hand-off (it was counted ``redispatch.decode``: no decode node was bound)."""
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "p1": "prefill", "d0": "decode"}, decode_binding=binding) as env:
        env.cluster.stall_after_first.update({"p0", "p1"})  # attempt 0: first token, then nothing (no hand-off)
        prompt = [5] * 70
        async with env.http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            first = await asyncio.wait_for(anext(lines), 10)
            dead = env.service.core.view.placement(env.cluster.works[0].rid)[0]
            env.cluster.alive.discard(dead)  # the prefill node dies after the first token, before the hand-off
            rest = "".join([line + "\n" async for line in lines])  # request_timeout_s is 20 s: the read below is bounded by it
        events = sse_events(first + "\n\n" + rest)
        assert events[-1] == "[DONE]"
        assert "error" not in events[-2], events[-2]
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == env.service.tokenizer.decode([output_token(i) for i in range(6)])
        rid = env.cluster.works[0].rid
        again = env.cluster.works[1]
        assert again.rid == rid and again.attempt == 1 and again.output_offset == 1 and again.max_tokens == 5
        assert again.prompt_tokens == 71 and unpack_tokens(again.token_ids).tolist() == prompt + [output_token(0)]
        assert env.service.core.view.placement(rid) is None  # finished
        if binding == "dispatch":
            await _wait_for(lambda: ("d0", rid, 0) in {(n, a.rid, a.attempt) for n, a in env.cluster.aborts}, what="abort of attempt 0 on d0")
        assert events[-2]["ei"]["redispatches"] == 1
        st = await env.stats()
        assert st.counters["redispatch.handoff"] == 1 and st.counters["redispatched"] == 1
        assert st.counters.get("redispatch.decode", 0) == 0 and st.counters.get("finish.error", 0) == 0


async def test_collocated_node_dies_mid_stream_and_its_redispatch_counts_as_a_lost_decode(nats_url, tmp_path):
    """A collocated node (phase both) dies after the first token: it was decoding, so the re-dispatch lost a
    decode (``redispatch.decode``, ``ei_router_redispatches_total{lost="decode"}``), as for a decode node. It
    was counted ``handoff`` (the prefill node of a PD placement, before its hand-off): a collocated node is its
    request's prefill node too, and no decode node ever takes a hand-off from it."""
    async with router_env(nats_url, tmp_path, {"c0": "both", "c1": "both"}) as env:
        env.cluster.stall_after_first.update({"c0", "c1"})  # attempt 0: first token, then nothing
        async with env.http.stream("POST", "/v1/completions", json={"prompt": [5] * 70, "max_tokens": 6, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            first = await asyncio.wait_for(anext(lines), 10)
            rid = env.cluster.works[0].rid
            dead, decode = env.service.core.view.placement(rid)  # type: ignore[misc]
            assert decode is None  # collocated: no decode node of its own
            env.cluster.alive.discard(dead)  # the collocated node dies while decoding
            rest = "".join([line + "\n" async for line in lines])
        events = sse_events(first + "\n\n" + rest)
        assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2]
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == env.service.tokenizer.decode([output_token(i) for i in range(6)])
        again = env.cluster.works[1]
        assert again.attempt == 1 and again.output_offset == 1 and events[-2]["ei"]["redispatches"] == 1
        st = await env.stats()
        assert st.counters["redispatch.decode"] == 1 and st.counters.get("redispatch.handoff", 0) == 0, st.counters


async def test_decode_continuation_that_cannot_be_exact_ends_with_a_clear_error(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode", "d1": "decode"}, max_prompt_tokens=70) as env:
        env.cluster.stall_after_first.add("p0")
        async with env.http.stream("POST", "/v1/completions", json={"prompt": [5] * 70, "max_tokens": 6, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            await anext(lines)
            env.cluster.alive.discard(env.cluster.works[0].decode_node)
            rest = "".join([line + "\n" async for line in lines])
        events = sse_events(rest)
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["code"] == 503 and "cannot be continued exactly" in err["message"] and "max_prompt_tokens=70" in err["message"]
        st = await env.stats()
        assert st.counters["redispatch.decode_failed"] == 1


async def test_client_disconnect_publishes_aborts(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        env.cluster.answering.clear()
        for stream in (False, True):
            n = len(env.cluster.works)
            req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": stream}))
            await _wait_for(lambda n=n: len(env.cluster.works) == n + 1, what="work dispatched")
            rid = env.cluster.works[-1].rid
            req.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await req
            await _wait_for(lambda rid=rid: {x for x, a in env.cluster.aborts if a.rid == rid} == {"p0", "d0"}, what="aborts")
            assert {a.router for _, a in env.cluster.aborts if a.rid == rid} == {"router"}
            await _wait_for(lambda: env.service.core.view.inflight_total == 0, what="request forgotten")
        st = await env.stats()
        assert st.counters["aborts.client_disconnect"] == 2


async def test_a_client_disconnect_after_a_redispatch_aborts_the_current_attempt(nats_url, tmp_path):
    """The request was fenced off its prefill node and re-dispatched (attempt 1) when its client goes away: each
    node of attempt 1 is told to drop attempt 1, stamped with the router. A node drops attempts <= the abort's
    (``RequestAbort.attempt``): an abort left at attempt 0 would leave attempt 1 running on its new node."""
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "p1": "prefill", "d0": "decode"}) as env:
        env.cluster.answering.clear()  # nodes take work and never answer
        req = asyncio.create_task(env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}))
        await _wait_for(lambda: len(env.cluster.works) == 1, what="work dispatched")
        rid = env.cluster.works[0].rid
        node0 = env.service.core.view.placement(rid)[0]
        env.cluster.alive.discard(node0)  # ... and its prefill node stops reporting: fenced, re-dispatched
        await _wait_for(lambda: len(env.cluster.works) == 2, what="re-dispatch")
        again = env.cluster.works[1]
        node1 = env.service.core.view.placement(rid)[0]
        assert (again.rid, again.attempt, node1 != node0) == (rid, 1, True)
        await _wait_for(lambda: len(env.cluster.aborts) >= 2, what="aborts of attempt 0")
        assert sorted((n, a.attempt, a.router) for n, a in env.cluster.aborts) == sorted([(node0, 0, "router"), ("d0", 0, "router")])
        req.cancel()  # the client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await req
        await _wait_for(lambda: len(env.cluster.aborts) >= 4, what="aborts of attempt 1")
        assert sorted((n, a.rid, a.attempt, a.router) for n, a in env.cluster.aborts[2:]) == sorted([(node1, rid, 1, "router"), ("d0", rid, 1, "router")])
        st = await env.stats()
        assert st.counters["redispatched"] == 1 and st.counters["aborts.client_disconnect"] == 1


async def test_malformed_payloads_are_counted_and_router_keeps_serving(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        subj = Subjects("p0")
        await env.bus.publish_raw(subj.prefix + "req.cmpl-x.out.c0", b"\xc1garbage")
        await env.bus.publish_raw(subj.prefix + "node.state.c0", b"not msgpack")
        await env.bus.publish_raw(subj.prefix + "split.commands", msgspec.msgpack.encode({"epoch": -3, "phases": {}}))
        await env.bus.publish(REQ_OUT, m.TokenChunk(rid="cmpl-unknown", node="c0", finished=True), rid="cmpl-unknown", node="c0")
        await env.bus.publish(NODE_STATE, m.NodeState(node="bad.id"), node="c0")
        await env.bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=0, phases={"c0": "both"}))  # older epoch

        async def counters() -> dict[str, int]:
            return (await env.stats()).counters

        for _ in range(100):
            c = await counters()
            # req.*.out.* arrives through JetStream, the others through core NATS: wait for all
            if all(c.get(k) for k in ("splits_stale", "invalid.node.state.{node}", "dropped.split.commands", "dropped.req.{rid}.out.{node}", "chunks_unknown_rid")):
                break
            await asyncio.sleep(0.05)
        assert c["dropped.req.{rid}.out.{node}"] == 1
        # the state naming "bad.id" on node.state.c0 is dropped at the edge (shared.validate)
        assert c["dropped.node.state.{node}"] == 2 and c["invalid.node.state.{node}"] == 1
        assert c["dropped.split.commands"] == 1
        assert c["chunks_unknown_rid"] == 1
        assert c.get("states_bad_node_id", 0) == 0
        assert c["splits_stale"] == 1
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200
        assert env.service.core.view.epoch == 1


async def test_directory_down_routes_without_cache_and_counts(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"c0": "both"}, lookup_timeout_s=0.2) as env:
        env.cluster.lookup_enabled = False  # the directory receives but never answers
        r = await env.http.post("/v1/completions", json={"prompt": list(range(130)), "max_tokens": 2})
        assert r.status_code == 200
        short = await env.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})  # no full block: no lookup
        assert short.status_code == 200
        st = await env.stats()
        assert st.counters["lookups_failed"] == 1
        assert len(env.cluster.lookups) == 1


async def test_port_file_and_routing_by_name(nats_url, tmp_path):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "p1": "prefill", "d0": "decode"}, routing="round-robin") as env:
        assert int(env.port_file.read_text()) == env.service.port
        nodes = []
        for _ in range(4):
            r = await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
            assert r.status_code == 200
            nodes.append(r.headers["x-ei-prefill-node"])
        assert nodes == ["p0", "p1", "p0", "p1"]
        assert env.cluster.split_gets >= 1
    assert not env.port_file.exists()  # removed on stop


async def test_a_bus_failure_is_a_503_with_the_reason_not_a_bare_500(nats_url, tmp_path):
    """Issue #22: a NATS error while a request is handled (here: the router's connection is
    closed under it) reaches the client as a JSON 503 saying so, never a plain-text 500."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        await env.service.bus.nc.close()
        for path, body in (("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):  # fmt: skip
            r = await env.http.post(path, json=body, headers={"X-Branch-Id": f"b-{len(path)}"})
            assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
            assert "message bus unavailable" in r.json()["error"]["message"] and "ConnectionClosedError" in r.json()["error"]["message"]
        assert env.service.counters["bus_errors"] == 2
