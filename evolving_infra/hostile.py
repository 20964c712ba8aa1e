"""Hostile input for every bus subject: what the fuzz test and ``bench/fuzz_bench.py`` send.

For each subject of ``shared.subjects.ALL`` :func:`samples` builds well-formed
messages (what an honest publisher sends), and :func:`payloads` derives from
them a stream of hostile payloads of four kinds, in rotation:

* ``random``: random bytes (0 – 256 of them);
* ``truncated``: a valid message cut short;
* ``mutated``: a valid message with 1 – 8 random bytes flipped (may still decode);
* ``hostile``: a valid-shaped message with one field set to a hostile value —
  NaN, ±inf, ±1e300, negative or 2^62 integers, huge strings and lists, an
  invented node, a sequence jump, a split with no prefill node, a finished token
  chunk from another node (``hostile_variants``).

Everything is deterministic for a given ``random.Random`` seed. No I/O.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Iterator
from typing import Any

import msgspec

from shared import messages as m
from shared.natsserver import MAX_PAYLOAD_BYTES
from shared.itermodel import DecodeModel, PrefillModel
from shared.subjects import (
    ALL,
    BRANCH_EVENTS,
    BRANCH_QUERY,
    KV_COUNTS,
    KV_COUNT_SYNC,
    KV_EVENTS,
    KV_LOOKUP,
    KV_POOL,
    KV_RESYNC,
    NODE_DOWN,
    NODE_ITERS,
    NODE_STATE,
    PLANNER_DECISIONS,
    PLANNER_MODELS,
    REQ_OUT,
    ROUTE_BIND,
    ROUTE_HELD,
    ROUTE_PLACED,
    ROUTE_SENT,
    KV_LIVENESS,
    BRANCH_SYNC,
    SPLIT_APPLIED,
    SPLIT_COMMANDS,
    SPLIT_GET,
    SPLIT_SET,
    SVC_HEARTBEAT,
    SVC_STATS,
    WORK_ABORT,
    WORK_DECODE,
    WORK_KV,
    WORK_KV_CANCEL,
    WORK_PREFILL,
    WORK_REQUEUE,
    Subject,
)
from shared.validate import MAX_KV_BATCH_HASHES

KINDS = ("random", "truncated", "mutated", "hostile")

_BS = 64


def _prefill(rid: str = "fz-1", decode_node: str | None = None) -> m.PrefillWork:
    return m.PrefillWork(
        rid=rid, prompt_tokens=256, max_tokens=4, block_size=_BS, block_hashes=[11, 12, 13, 14], decode_node=decode_node, sent_at=1.0
    )


def _decode(rid: str = "fz-1", prefill_node: str = "w0") -> m.DecodeWork:
    return m.DecodeWork(
        rid=rid, prompt_tokens=256, max_tokens=4, block_size=_BS, block_hashes=[11, 12, 13, 14], prefill_node=prefill_node, kv_ready_at=1.0
    )


def samples(nodes: tuple[str, ...] = ("w0", "w1")) -> dict[str, tuple[dict[str, str], msgspec.Struct]]:
    """One well-formed message per subject template, with the subject parameters to publish it under.

    Args:
        nodes: node ids of the target cluster (the first names the publisher, the
            second a peer); at least two.

    Returns:
        ``{template: (params, message)}`` covering every subject of ``ALL``.
    """
    a, b = nodes[0], nodes[1]
    phases: dict[str, m.Phase] = {a: "prefill", b: "decode"}
    out: dict[str, tuple[dict[str, str], msgspec.Struct]] = {
        KV_EVENTS.template: (
            {"node": a},
            m.KvEventBatch(node=a, seq=1, ts=1.0, events=[m.BlockStored(block_hashes=[1, 2], block_size=_BS), m.BlockRemoved(block_hashes=[3])]),
        ),
        KV_RESYNC.template: ({"node": a}, m.KvResyncRequest(node=a, reason="fuzz", expected_seq=2)),
        KV_LOOKUP.template: ({}, m.KvLookupRequest(block_hashes=[1, 2, 3], block_size=_BS)),
        KV_COUNTS.template: ({"node": a}, m.CountUpdates(node=a, seq=1, hashes=[1, 2], counts=[1, 0])),
        KV_COUNT_SYNC.template: ({"node": a}, m.CountSyncRequest(node=a, reason="fuzz", epoch="fz-epoch", last_seq=1)),
        KV_POOL.template: ({"node": a}, m.PoolLocate(node=a, block_hashes=[1, 2], lease_s=1.0)),
        BRANCH_EVENTS.template: ({}, m.BranchStart(branch_id="fz-branch", kind="fork", parent_branch_id="fz-root", ts=1.0)),
        BRANCH_QUERY.template: ({}, m.BranchQuery(branch_id="fz-branch")),
        ROUTE_PLACED.template: ({}, m.RoutePlaced(rid="fz-1", branch_id="fz-branch", node=a, phase="prefill", block_hashes=[1, 2], ts=1.0)),
        BRANCH_SYNC.template: ({}, m.BranchSync(directory="fz-dir", ts=1.0)),
        KV_LIVENESS.template: ({}, m.KvLiveness(nodes=[m.NodeKvLiveness(node=a, silent_s=1.0, last_batch_s=2.0)], stale_after_s=10.0)),
        ROUTE_SENT.template: ({}, m.RouteSent(router="fz-router", rid="fz-1", prefill_node=a, prompt_tokens=8, max_tokens=2)),
        NODE_STATE.template: (
            {"node": a},
            m.NodeState(
                node=a, seq=1, ts=1.0, phase="prefill", epoch=1, block_size=_BS, running=1, waiting=1, remaining_s=0.01,
                queue=[m.QueuedWork(rid="fz-q", uncached_tokens=64)], gpu_free_blocks=10, gpu_total_blocks=100,
            ),
        ),
        # an exit seen before any real process started (exited_ns 1): a router fences no live node for it
        NODE_DOWN.template: ({"node": a}, m.NodeDown(node=a, pid=1, exited_ns=1, code=-9)),
        NODE_ITERS.template: (
            {"node": a},
            m.IterationRecords(node=a, records=[m.IterationRecord(start=1.0, duration_s=0.01, phase="prefill", prefill_requests=1, sum_uncached=64)]),
        ),
        SPLIT_COMMANDS.template: ({}, m.SplitCommand(epoch=1, phases=phases, reason="fuzz", decided_at=1.0)),
        SPLIT_APPLIED.template: ({}, m.SplitApplied(epoch=1, node=a, phase="prefill", status="serving", decided_at=1.0, applied_at=1.1)),
        SPLIT_GET.template: ({}, m.SplitQuery()),
        PLANNER_DECISIONS.template: ({}, m.PlannerDecision(seq=1, ts=1.0, policy="static", split_before="1P1D", split_after="1P1D")),
        SPLIT_SET.template: ({}, m.SplitSetRequest(split="1P1D", reason="fuzz")),
        WORK_PREFILL.template: ({"node": a}, _prefill()),
        WORK_DECODE.template: ({"node": b}, _decode()),
        WORK_KV.template: (
            {"node": b},
            m.KvChunk(transfer="fz-t1", rid="fz-1", index=0, count=2, offset=0, total=8, crc32=zlib.crc32(b"\x01" * 4), data=b"\x01" * 4),
        ),
        WORK_KV_CANCEL.template: ({"node": b}, m.KvCancel(transfer="fz-t1", rid="fz-1", reason="fuzz")),
        WORK_ABORT.template: ({"node": a}, m.RequestAbort(rid="fz-1", reason="fuzz")),
        REQ_OUT.template: ({"rid": "fz-1", "node": a}, m.TokenChunk(rid="fz-1", node=a, index=0, token_ids=[5], ts=1.0)),
        SVC_HEARTBEAT.template: ({"service": "worker"}, m.Heartbeat(service="worker", instance=f"worker-{a}", pid=1, wall_ts=1.0)),
        SVC_STATS.template: ({"instance": "router"}, m.StatsRequest()),
        PLANNER_MODELS.template: (
            {},
            m.PlannerModels(
                models=[m.NodeModels(node=a, prefill=PrefillModel(c0=0.01, c1=1e-5, c2=1e-9, c3=1e-6), decode=DecodeModel(d0=0.01, d1=0.0, d2=1e-4))],
                fitted_at=1.0,
            ),
        ),
        ROUTE_BIND.template: ({"router": "router"}, m.DecodeBindRequest(rid="fz-1", prefill_node=a, prompt_tokens=256, max_tokens=4)),
        ROUTE_HELD.template: ({"router": "router"}, m.HeldQuery(node=a, rids=["fz-1"], attempts=[0])),
        WORK_REQUEUE.template: ({"router": "router"}, m.WorkRequeue(rid="fz-1", node=a, reason="fuzz", prefill=_prefill())),
    }
    missing = {s.template for s in ALL} - set(out)
    assert not missing, f"no sample for {missing}"
    return out


def count_snapshot_sample(node: str) -> m.CountSnapshot:
    """A well-formed ``kv.countsync.<node>`` reply (what an honest directory answers a worker's
    first ``CountSyncRequest``): the whole snapshot in one piece, of epoch :data:`COUNTSYNC_EPOCH`
    (the epoch :func:`flood_count_sync_replies` announces to the workers)."""
    return m.CountSnapshot(node=node, epoch=COUNTSYNC_EPOCH, seq=1, snapshot="fz-snap", offset=0, total=2, hashes=[1, 2], counts=[1, 1])


COUNTSYNC_EPOCH = "fz-countsync"
"""The directory epoch the reply flood's ``kv.counts`` triggers and well-formed replies carry."""

_BAD_FLOATS = (math.nan, math.inf, -math.inf, 1e300, -1e300)
_BAD_INTS = (2**62, 10**15, 2**53 + 1, 2**31)
_NEG_INTS = (-1, -(2**62))


def _bad_value(value: Any, rng: random.Random, big: int) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, float):
        return rng.choice(_BAD_FLOATS)
    if isinstance(value, int):
        return rng.choice(_BAD_INTS + _NEG_INTS)
    if isinstance(value, str):
        return rng.choice(("", "x" * 5000, "a.b", "w-invented", "\x00\xff"))
    if isinstance(value, bytes):
        return rng.randbytes(rng.randint(1, 64))
    if isinstance(value, list):
        if value and isinstance(value[0], int):
            return list(range(big))
        return value * max(1, big // max(1, len(value))) if value else [0] * big
    if isinstance(value, dict):
        return {f"n{i}": "decode" for i in range(min(big, 10_000))}
    if value is None:
        return rng.choice((math.nan, 1e300, -1, "x" * 100))
    return None


def hostile_variants(template: str, params: dict[str, str], msg: msgspec.Struct, rng: random.Random, *, big: int = 300_000) -> list[tuple[dict[str, str], msgspec.Struct]]:
    """Valid-shaped hostile versions of ``msg``: one field hostile each, plus the attacks of issue 18.

    Args:
        template / params / msg: one entry of :func:`samples`.
        rng: source of the choices.
        big: length of the huge lists (ints), entries.

    Returns:
        ``[(params, message)]``; params may name another node (an invented one).
    """
    out: list[tuple[dict[str, str], msgspec.Struct]] = []
    for f in msgspec.structs.fields(msg):
        if f.name in ("v", "src"):
            continue
        bad = _bad_value(getattr(msg, f.name), rng, big)
        if bad is not None:
            out.append((params, msgspec.structs.replace(msg, **{f.name: bad})))
    node = params.get("node")
    if node is not None and hasattr(msg, "node"):
        inv = f"x{rng.randrange(10**9)}"
        out.append(({**params, "node": inv}, msgspec.structs.replace(msg, node=inv)))  # invented node
        out.append(({**params, "node": "w1" if node != "w1" else "w0"}, msg))  # another node's subject (spoof)
    if isinstance(msg, m.KvEventBatch):
        out.append((params, msgspec.structs.replace(msg, seq=10**12)))  # sequence jump
        out.append((params, msgspec.structs.replace(msg, events=[m.BlockStored(block_hashes=list(range(big)), block_size=_BS)])))
    if isinstance(msg, m.CountUpdates):  # kv.counts (a worker under branch-count host eviction): its seq/epoch rules
        out.append((params, msgspec.structs.replace(msg, seq=10**12)))  # sequence jump: a gap, the worker syncs
        out.append((params, msgspec.structs.replace(msg, beacon=True, seq=10**12, hashes=[], counts=[])))  # beacon past the numbering
        out.append((params, msgspec.structs.replace(msg, epoch=f"fz-forged-{rng.randrange(10**9)}", seq=10**12)))  # forged restart
        n = min(big, MAX_KV_BATCH_HASHES)  # the largest batch the edge lets through, every block counted
        out.append((params, msgspec.structs.replace(msg, hashes=list(range(n)), counts=[1] * n)))
    if isinstance(msg, m.CountSnapshot):  # a kv.countsync reply: the worker's own checks past the edge
        out.append((params, msgspec.structs.replace(msg, total=2**31)))  # past what a worker fetches (2^30): the sync ends
        out.append((params, msgspec.structs.replace(msg, total=10**6, hashes=[1], counts=[1])))  # first of many pieces: it asks the next
        out.append((params, msgspec.structs.replace(msg, error="snapshot expired")))
        out.append((params, msgspec.structs.replace(msg, offset=1, total=3)))  # not a first piece
    if isinstance(msg, m.SplitCommand):
        out.append((params, msgspec.structs.replace(msg, epoch=10**15, phases={k: "decode" for k in msg.phases})))
        out.append((params, msgspec.structs.replace(msg, epoch=10**15)))
        out.append((params, msgspec.structs.replace(msg, phases={**msg.phases, "ghost": "prefill"})))
    if isinstance(msg, m.DecodeWork):
        out.append((params, msgspec.structs.replace(msg, kv_ready_at=1e300)))
        out.append((params, msgspec.structs.replace(msg, kv_ready_at=math.nan)))
        out.append((params, msgspec.structs.replace(msg, kv_ready_at=1e9)))  # finite, far future: clamped
    if isinstance(msg, m.TokenChunk):
        out.append((params, msgspec.structs.replace(msg, finished=True, finish_reason="stop", node="w1")))
    return out


HUGE_BYTES = 64 * 1024
"""Payloads larger than this count against ``max_huge``."""


def payloads(
    subject: Subject, params: dict[str, str], msg: msgspec.Struct, rng: random.Random, count: int, *, big: int = 300_000, max_huge: int = 16
) -> Iterator[tuple[str, dict[str, str], bytes]]:
    """``count`` hostile payloads for one subject: ``(kind, params, bytes)``, kinds in rotation.

    Args:
        subject: the subject (its template names the kind of message).
        params / msg: the subject's sample (:func:`samples`).
        rng: source of randomness (seed it for a reproducible run).
        count: payloads to produce.
        big: length of huge lists in ``hostile`` payloads.
        max_huge: at most this many payloads above :data:`HUGE_BYTES` (megabytes
            each); afterwards the rotation skips them.
    """
    valid = m.encode(msg)
    variants = hostile_variants(subject.template, params, msg, rng, big=big)
    encoded = [(p, raw) for p, raw in ((p, m.encode(v)) for p, v in variants) if len(raw) < MAX_PAYLOAD_BYTES - 4096]
    if not encoded:  # a message without fields: an unknown field with a huge value (skipped by the decoder)
        encoded = [(params, msgspec.msgpack.encode({"v": 1, "junk": list(range(big))}))]
    small = [e for e in encoded if len(e[1]) <= HUGE_BYTES]
    if not small:  # every variant is huge (a message without fields): the same attack under HUGE_BYTES
        small = [(params, msgspec.msgpack.encode({"v": 1, "junk": list(range(HUGE_BYTES // 8))}))]
    huge_sent = 0
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        if kind == "random":
            yield kind, params, rng.randbytes(rng.randint(0, 256))
        elif kind == "truncated":
            yield kind, params, valid[: rng.randrange(len(valid))]
        elif kind == "mutated":
            b = bytearray(valid)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            yield kind, params, bytes(b)
        else:
            p, raw = encoded[(i // len(KINDS)) % len(encoded)]
            if len(raw) > HUGE_BYTES:
                if huge_sent >= max_huge:
                    p, raw = small[(i // len(KINDS)) % len(small)]
                else:
                    huge_sent += 1
            yield kind, p, raw


# --------------------------------------------------------------------------- #
# flood a live cluster (the fuzz test and bench/fuzz_bench.py)
# --------------------------------------------------------------------------- #

SUBSCRIBERS = ("router", "planner", "kvdirectory", "worker-w0", "worker-w1", "launcher")
"""Instances whose bus counters the flood reads (the launcher is ``LocalCluster``'s own bus)."""


def expected_drop(subject: Subject, params: dict[str, str], raw: bytes, nodes: frozenset[str] | None, prefix: str) -> bool:
    """Whether a subscriber whose bus knows ``nodes`` drops ``raw`` (undecodable or refused by
    ``shared.validate``): the flood's exact accounting of what every bus must count."""
    return _drops(subject, params, raw, (nodes,))[0]


def _drops(subject: Subject, params: dict[str, str], raw: bytes, node_sets: tuple[frozenset[str] | None, ...]) -> tuple[bool, ...]:
    """:func:`expected_drop` for several node sets at once: ``raw`` is decoded once."""
    from shared.bus import decoder_for
    from shared.validate import check

    try:
        msg = decoder_for(subject.msg_type).decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return (True,) * len(node_sets)
    return tuple(check(msg, params, ns) is not None for ns in node_sets)


class DropAccount:
    """Which subscribers of one subject must drop a payload: the flood's expected drops, fast.

    Equal to calling :func:`expected_drop` for every subscriber the permission table lets
    receive the payload (and only when the publisher may publish it), but each payload is
    decoded once for all subscribers, permission matches are computed once per concrete
    subject, and the repeated ``hostile`` payloads (the same bytes objects in rotation,
    :func:`payloads`) are decoded and validated once per (payload, subject parameters).

    Args:
        subject: the subject flooded.
        publish_perms: the publisher's permissions (``shared.auth.permissions``).
        subscribers: ``{instance: (permissions, known node set or None)}``.
    """

    def __init__(self, subject: Subject, publish_perms: dict[str, Any],
                 subscribers: dict[str, tuple[dict[str, Any], frozenset[str] | None]]) -> None:
        self.subject = subject
        self.publish_perms = publish_perms
        self.subscribers = subscribers
        self._routes: dict[str, tuple[bool, tuple[str, ...], tuple[frozenset[str] | None, ...]]] = {}
        self._memo: dict[tuple[bytes, str], tuple[bool, ...]] = {}

    def _route(self, full: str) -> tuple[bool, tuple[str, ...], tuple[frozenset[str] | None, ...]]:
        r = self._routes.get(full)
        if r is None:
            from shared.auth import allowed

            pub = allowed(self.publish_perms, "publish", full)
            subs = tuple(s for s, (sp, _) in self.subscribers.items() if pub and allowed(sp, "subscribe", full))
            r = self._routes[full] = (pub, subs, tuple(self.subscribers[s][1] for s in subs))
        return r

    def account(self, kind: str, params: dict[str, str], full: str, raw: bytes) -> tuple[bool, list[str]]:
        """``(publisher allowed, [subscribers that must count a drop])`` for one payload on ``full``."""
        pub, subs, node_sets = self._route(full)
        if not subs:
            return pub, []
        if kind == "hostile":
            key = (raw, full)
            drops = self._memo.get(key)
            if drops is None:
                drops = self._memo[key] = _drops(self.subject, params, raw, node_sets)
        else:
            drops = _drops(self.subject, params, raw, node_sets)
        return pub, [s for s, d in zip(subs, drops) if d]


async def flood(cluster: Any, count: int, *, seed: int = 18, rate: float = 20_000.0, big: int = 300_000, max_huge: int = 16,
                request: Any = None, skip: tuple[str, ...] = ("kv.pool.{node}",), progress: Any = None) -> dict[str, Any]:
    """Send ``count`` hostile payloads per subject to a running ``LocalCluster`` (2 nodes, auth on).

    Each subject's payloads are published by the identity the permission table lets
    publish it (``shared.auth``): a compromised service, not an anonymous client.
    Payloads whose subject that identity may not publish are refused by the server
    (counted from the client's permission violations). ``request`` (an async callable
    returning True on success) runs in a loop during the flood.

    Args:
        cluster: a started ``evolving_infra.cluster.LocalCluster`` with nodes w0, w1.
        count: payloads per subject.
        seed: RNG seed.
        rate: messages per second at most (services must keep up; NATS drops a slow consumer's messages).
        big / max_huge: see :func:`payloads`.
        request: ``async () -> bool``, a normal request.
        skip: subject templates not flooded (``kv.pool`` is served only with ``--kv-pool real``).

    Returns:
        Per subject: sent, refused by the server, expected drops per subscriber; requests ok/failed
        during the flood; wall seconds.
    """
    import asyncio
    import time

    from shared.auth import allowed, identity, permissions
    from shared.bus import Bus
    from shared.subjects import Subjects

    rng = random.Random(seed)
    subj = Subjects(cluster.spec.partition)
    nodes = frozenset(cluster.spec.node_ids())
    known = {"planner": nodes, "kvdirectory": nodes}
    perms = {n: permissions(identity(n), cluster.spec.partition) for n in ("planner", "router", "kvdirectory", "worker-w0", "worker-w1", "operator", "launcher")}
    sub_perm = {n: perms[n] for n in SUBSCRIBERS}
    # workers subscribe to kv.counts.<node> only under branch-count host eviction (lru reads no count)
    counts_read = getattr(cluster.spec, "eviction", "lru") == "branch-count"
    buses: dict[str, Bus] = {}
    report: dict[str, Any] = {"subjects": {}, "requests_ok": 0, "requests_failed": 0}
    stop = asyncio.Event()

    async def request_loop() -> None:
        while not stop.is_set():
            try:
                ok = await request()
            except Exception:
                ok = False
            report["requests_ok" if ok else "requests_failed"] += 1
            await asyncio.sleep(0.05)

    loop_task = asyncio.create_task(request_loop()) if request is not None else None
    t0 = time.monotonic()
    sent_total = 0
    try:
        for template, (params, msg) in samples(tuple(sorted(nodes))).items():
            if template in skip:
                continue
            subject = next(s for s in ALL if s.template == template)
            full = subj.prefix + template.format(**params)
            who = next(n for n, p in perms.items() if allowed(p, "publish", full))
            if who not in buses:
                buses[who] = await Bus.connect(
                    cluster.nats_url, subj, service=who.split("-")[0], instance=f"fuzz-{who}", auth=cluster.client_auth(who)
                )
            bus = buses[who]
            entry: dict[str, Any] = {"publisher": who, "sent": 0, "refused_by_server": 0, "kinds": {k: 0 for k in KINDS}, "expected_drops": {}}
            exp: dict[str, int] = {}
            acct = DropAccount(subject, perms[who], {svc: (sp, known.get(svc)) for svc, sp in sub_perm.items()
                                                     if counts_read or subject is not KV_COUNTS or not svc.startswith("worker-")})  # fmt: skip
            full_of: dict[tuple[tuple[str, str], ...], str] = {}
            for kind, p, raw in payloads(subject, params, msg, rng, count, big=big, max_huge=max_huge):
                pkey = tuple(p.items())
                full_p = full_of.get(pkey)
                if full_p is None:
                    full_p = full_of[pkey] = subj.prefix + template.format(**p)
                entry["kinds"][kind] += 1
                entry["sent"] += 1
                pub_ok, dropping = acct.account(kind, p, full_p, raw)
                if not pub_ok:
                    entry["refused_by_server"] += 1
                for svc in dropping:
                    exp[svc] = exp.get(svc, 0) + 1
                await bus.publish_raw(full_p, raw)
                sent_total += 1
                if sent_total % 500 == 0:
                    await bus.nc.flush(timeout=30)
                    ahead = sent_total / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
            await bus.nc.flush(timeout=30)
            entry["expected_drops"] = exp
            report["subjects"][template] = entry
            if progress is not None:
                progress(template, entry, time.monotonic() - t0, report)
    finally:
        stop.set()
        if loop_task is not None:
            await loop_task
        report["wall_s"] = time.monotonic() - t0
        report["permission_violations"] = sum(b.counters.get("nats.permission_violations", 0) for b in buses.values())
        for b in buses.values():
            await b.close()
    return report


async def flood_count_sync_replies(cluster: Any, count: int, *, seed: int = 19, big: int = 300_000, max_huge: int = 16,
                                   duration_s: float = 6.0, tick_s: float = 1.0) -> dict[str, Any]:
    """Answer the workers' ``kv.countsync.<node>`` requests with hostile ``CountSnapshot`` replies.

    A reply goes to the requester alone, so the subject flood (:func:`flood`) cannot reach a
    worker's count-sync client. Here the directory process is stopped (SIGSTOP; SIGCONT at the end,
    whatever happens), a bus with the ``kvdirectory`` identity answers every request on
    ``kv.countsync.*`` with the next payload (around :func:`count_snapshot_sample` of the
    requesting node: the hostile variants that pass the edge, one in two while they last, between
    the four kinds of :func:`payloads`), and every ``tick_s`` it publishes on
    ``kv.counts.<node>`` a message of epoch :data:`COUNTSYNC_EPOCH` whose ``seq`` skips one (a gap:
    a worker that is not syncing starts a sync; a new epoch when a node asked nothing since the
    last tick, e.g. after a too-large snapshot ended its sync for the epoch). While the directory is
    stopped every reply a worker gets is one of these, so its bus must count exactly the
    undecodable and invalid ones (``dropped_reply.kv.countsync.{node}``; the directory's own
    replies are valid); the valid-shaped ones reach the worker's sync (``counts.sync.*``).

    A worker asks at most once per ``--count-sync-min-interval-s`` (1 s) and backs off after a
    failed sync (up to ``--count-sync-backoff-max-s``, 5 s), except for the next piece of a
    snapshot, so ``count`` replies per node are a cap, ``duration_s`` (wall seconds) the limit.

    Args:
        cluster: a started ``LocalCluster`` with nodes w0, w1 whose workers run ``branch-count``
            host eviction (others read no ``kv.counts`` and never sync).
        count: replies per node at most.
        seed / big / max_huge: see :func:`payloads`.
        duration_s: wall seconds of the phase.
        tick_s: wall seconds between two ``kv.counts`` triggers of a node.

    Returns:
        ``{"replies": {node: sent}, "kinds": {kind: sent}, "expected_drops": {"worker-<node>": n},
        "triggers": n, "wall_s": s}``.
    """
    import asyncio
    import os
    import signal
    import time

    from shared.bus import Bus, decoder_for
    from shared.subjects import Subjects
    from shared.validate import check

    rng = random.Random(seed)
    subj = Subjects(cluster.spec.partition)
    nodes = sorted(cluster.spec.node_ids())
    def replies(i: int, node: str) -> Iterator[tuple[str, dict[str, str], bytes]]:
        # the worker asks about once a second: the variants that pass the edge (they reach the
        # worker's own rules) alternate with the rotation of payloads(), each node starting at
        # another variant so that the nodes together reach more of them in a short run
        params, sample = {"node": node}, count_snapshot_sample(node)
        passing = [m.encode(v) for _, v in hostile_variants(KV_COUNT_SYNC.template, params, sample, rng, big=big) if check(v) is None]
        passing = passing[i * len(passing) // len(nodes):] + passing[: i * len(passing) // len(nodes)]
        rotation = payloads(KV_COUNT_SYNC, params, sample, rng, count, big=big, max_huge=max_huge)
        for k in range(count):
            if k % 2 == 0 and k // 2 < len(passing):
                yield "hostile", params, passing[k // 2]
            else:
                nxt = next(rotation, None)
                if nxt is None:
                    return
                yield nxt

    gens = {n: replies(i, n) for i, n in enumerate(nodes)}
    rep: dict[str, Any] = {"replies": {n: 0 for n in nodes}, "kinds": {k: 0 for k in KINDS}, "expected_drops": {}, "triggers": 0}
    asked = {n: 0 for n in nodes}
    decoder = decoder_for(KV_COUNT_SYNC.reply_type)
    bus = await Bus.connect(cluster.nats_url, subj, service="kvdirectory", instance="fuzz-countsync", auth=cluster.client_auth("kvdirectory"))
    directory = cluster.pids()["kvdirectory"]

    async def answer(raw: Any) -> None:
        node = raw.subject.rsplit(".", 1)[-1]
        if not raw.reply or node not in gens:
            return
        asked[node] += 1
        nxt = next(gens[node], None)
        if nxt is None:
            return  # the cap: the request times out (counted by the worker as request_failed)
        kind, _p, data = nxt
        try:
            bad = check(decoder.decode(data), None, None) is not None
        except (msgspec.DecodeError, msgspec.ValidationError):
            bad = True
        if bad:
            key = f"worker-{node}"
            rep["expected_drops"][key] = rep["expected_drops"].get(key, 0) + 1
        rep["replies"][node] += 1
        rep["kinds"][kind] += 1
        await bus.nc.publish(raw.reply, data)

    t0 = time.monotonic()
    os.kill(directory, signal.SIGSTOP)
    try:
        sub = await bus.nc.subscribe(subj.prefix + KV_COUNT_SYNC.template.format(node="*"), cb=answer)
        await bus.nc.flush(timeout=10)
        epoch = {n: 1 for n in nodes}
        seq = {n: 1 for n in nodes}
        seen = {n: -1 for n in nodes}
        while time.monotonic() - t0 < duration_s and any(r < count for r in rep["replies"].values()):
            for n in nodes:
                if asked[n] == seen[n]:  # nothing asked since the last tick: a new epoch (a gap there)
                    epoch[n] += 1
                    seq[n] = 1
                seen[n] = asked[n]
                seq[n] += 2
                ep = COUNTSYNC_EPOCH if epoch[n] == 1 else f"{COUNTSYNC_EPOCH}-{epoch[n]}"
                await bus.publish_raw(subj.prefix + KV_COUNTS.template.format(node=n), m.encode(m.CountUpdates(node=n, seq=seq[n], epoch=ep)))
                rep["triggers"] += 1
            await bus.nc.flush(timeout=10)
            await asyncio.sleep(tick_s)
        await sub.unsubscribe()
        await bus.nc.flush(timeout=10)
        await asyncio.sleep(0.2)  # answers being written finish before the directory resumes
    finally:
        os.kill(directory, signal.SIGCONT)
        await bus.close()
    rep["wall_s"] = time.monotonic() - t0
    return rep
