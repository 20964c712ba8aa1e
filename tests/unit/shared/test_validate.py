"""Edge validation (shared.validate), rate-limited drop logs (shared.ratelog) and the hostile samples."""

from __future__ import annotations

import math
import random
import typing

import msgspec
import pytest

from evolving_infra.hostile import count_snapshot_sample, hostile_variants, payloads, samples
from shared import messages as m
from shared.bus import decoder_for
from shared.ratelog import RateLimitedLog
from shared.subjects import ALL, KV_COUNT_SYNC, KV_COUNTS, KV_EVENTS, REQ_OUT, SPLIT_COMMANDS, Subjects
from shared.validate import CHECKERS, MAX_EPOCH_STEP, check, epoch_step_ok, split_problem, subject_params


def _members(tp: typing.Any) -> list[type]:
    if tp is None:
        return []
    args = typing.get_args(tp)
    return list(args) if args else [tp]


def test_every_message_type_of_every_subject_has_a_checker():
    for s in ALL:
        for t in _members(s.msg_type) + _members(s.reply_type):
            assert t in CHECKERS, (s.template, t)


def test_every_sample_passes_and_round_trips():
    for template, (params, msg) in samples().items():
        assert check(msg, params) is None, template
        s = next(x for x in ALL if x.template == template)
        assert check(decoder_for(s.msg_type).decode(m.encode(msg)), params) is None


def test_publisher_fields_must_match_the_subject():
    st = m.NodeState(node="w1")
    assert check(st, {"node": "w1"}) is None
    assert "does not match" in check(st, {"node": "w0"})  # w0's subject carrying w1's state: spoof
    batch = m.KvEventBatch(node="w0", seq=1)
    assert "does not match" in check(batch, {"node": "w9"})
    chunk = m.TokenChunk(rid="a", node="w0")
    assert "does not match" in check(chunk, {"rid": "b"})


def test_ids_used_as_subject_tokens_refuse_a_trailing_newline():
    # "$" in the token pattern matched before a final newline: a PrefillWork with rid "fz-1\n"
    # passed, and the worker's reply on req.<rid>.out then failed in nats-py (a handler error)
    work = samples()["work.{node}.prefill"][1]
    assert check(work, {"node": "w0"}) is None
    for bad in ("fz-1\n", "fz-1\r\n", "\n"):
        assert "NATS token" in check(msgspec.structs.replace(work, rid=bad), {"node": "w0"}), repr(bad)
    assert check(m.KvEventBatch(node="w0\n", seq=1), {}) is not None
    with pytest.raises(ValueError):
        Subjects("p0").format(REQ_OUT, rid="fz-1\n", node="w0")


def test_a_token_chunk_names_the_node_of_its_subject():
    """``req.<rid>.out.<node>``: each identity may publish only its own node's (``shared.auth``), so a chunk whose
    ``node`` is another (or none) was written by a node in another's name: with the one ``req.<rid>.out`` a worker
    ended a stream another node served with ``TokenChunk(node=<that node>, finished=True)``."""
    chunk = m.TokenChunk(rid="r-1", node="w0", index=5, finished=True, finish_reason="stop")
    assert check(chunk, {"rid": "r-1", "node": "w0"}) is None
    for sent_on in ("w1", "router"):
        assert "does not match the subject's node" in check(chunk, {"rid": "r-1", "node": sent_on}), sent_on
    assert "does not match the subject's node" in check(msgspec.structs.replace(chunk, node=""), {"rid": "r-1", "node": "w0"})
    assert "does not match the subject's rid" in check(chunk, {"rid": "r-2", "node": "w0"})


def test_a_branch_eviction_names_a_rid_as_a_route_placed_does():
    """``BranchEnd.rid`` (d250733: the evicting router's latest placed request, which the directory compares with
    its own) was not checked, while ``RoutePlaced.rid`` is: a 100 KB or non-token rid was kept by the directory."""
    ok = m.BranchEnd(branch_id="b", ts=1.0, expired=True, rid="r-1")
    assert check(ok) is None
    assert check(m.BranchEnd(branch_id="b", ts=1.0, expired=True, rid="")) is None  # it placed none
    assert check(m.BranchEnd(branch_id="b", ts=1.0)) is None  # an older router's: no rid
    for bad in ("x" * 100_000, "a b", "r\n"):
        assert "rid" in (check(m.BranchEnd(branch_id="b", ts=1.0, expired=True, rid=bad)) or ""), bad


def test_a_chunk_names_its_router_as_a_work_does():
    """``TokenChunk.router`` (f2afc83: the owning router, stamped by the worker; a router counts a peer's chunk
    by it) was not checked, while ``PrefillWork.router`` is: a 200 kB or non-token router passed."""
    chunk = m.TokenChunk(rid="a", node="w0", router="router-b")
    assert check(chunk, {"rid": "a"}) is None
    assert check(msgspec.structs.replace(chunk, router=""), {"rid": "a"}) is None  # an older writer's: none
    for bad in ("x" * 200_000, "\x00\xff", "a b", "r\n"):
        assert "router" in (check(msgspec.structs.replace(chunk, router=bad), {"rid": "a"}) or ""), repr(bad)


def test_an_abort_names_its_router_as_a_chunk_does():
    """``RequestAbort.router`` (its sender: a node drops only that router's request of the id) is a NATS token;
    an older sender's abort names none and is still taken."""
    abort = m.RequestAbort(rid="a", reason="gave way", attempt=3, router="router-b")
    assert check(abort) is None
    # an older sender's (msgpack without the field): decoded with no router, and taken
    old = decoder_for(m.RequestAbort).decode(msgspec.msgpack.encode({"rid": "a", "reason": "x", "attempt": 3}))
    assert old.router == "" and check(old) is None
    for bad in ("x" * 200_000, "\x00\xff", "a b", "r\n"):
        assert "router" in (check(msgspec.structs.replace(abort, router=bad)) or ""), repr(bad)


def test_known_nodes_are_enforced_when_given():
    batch = m.KvEventBatch(node="x123", seq=1)
    assert check(batch, {"node": "x123"}) is None
    assert "not a node of this cluster" in check(batch, {"node": "x123"}, frozenset({"w0", "w1"}))


def test_times_must_be_finite_and_in_range():
    base = samples()["work.{node}.decode"][1]
    for bad in (math.nan, math.inf, -math.inf, 1e300, -1e300):
        assert "kv_ready_at" in check(msgspec.structs.replace(base, kv_ready_at=bad)), bad
    st = samples()["node.state.{node}"][1]
    assert "remaining_s" in check(msgspec.structs.replace(st, remaining_s=math.nan))
    assert "ts" in check(msgspec.structs.replace(st, ts=math.inf))


def test_sizes_counts_and_lists_are_bounded():
    big = m.KvEventBatch(node="w0", seq=1, events=[m.BlockStored(block_hashes=list(range(1_000_000)), block_size=64)])
    assert "block hashes" in check(big)
    assert "seq" in check(m.KvEventBatch(node="w0", seq=2**60))
    w = samples()["work.{node}.prefill"][1]
    assert "block hashes" in check(msgspec.structs.replace(w, prompt_tokens=10**6))
    assert "token_ids" in check(msgspec.structs.replace(w, token_ids=b"\x00" * 3))
    assert "fetch range" in check(msgspec.structs.replace(w, fetch=[m.FetchRange(node="w1", start=0, end=99)]))
    assert "counts" in check(m.CountUpdates(node="w0", hashes=[1, 2], counts=[1]))
    assert "negative" in check(m.CountUpdates(node="w0", hashes=[1, 2], counts=[1, -1]))
    assert "beacon carries counts" in check(m.CountUpdates(node="w0", seq=3, beacon=True, hashes=[1], counts=[1]))
    assert check(m.CountUpdates(node="w0", seq=3, beacon=True)) is None
    assert "counts" in check(m.CountSnapshot(node="w0", total=2, hashes=[1, 2], counts=[1]))
    assert "past the snapshot" in check(m.CountSnapshot(node="w0", offset=1, total=2, hashes=[1, 2], counts=[1, 1]))
    assert check(m.CountSnapshot(node="w0", offset=1, total=3, hashes=[1, 2], counts=[1, 1])) is None
    assert "does not match" in check(m.CountSyncRequest(node="w1"), {"node": "w0"})  # a worker asks for its own counts only
    placed = m.RoutePlaced(rid="r", branch_id="b", node="w0", phase="prefill", block_hashes=[1, 2, 3])
    assert check(placed) is None
    assert "not a chain" in check(msgspec.structs.replace(placed, block_hashes=[1, 2, 1]))  # the directory counts prefixes
    st = samples()["node.state.{node}"][1]
    assert "queue" in check(msgspec.structs.replace(st, queue=[m.QueuedWork(rid="q")] * 70_000))
    assert "gpu_free_blocks" in check(msgspec.structs.replace(st, gpu_free_blocks=10**6))


def test_split_commands_need_prefill_and_decode_and_known_nodes():
    assert split_problem({"w0": "prefill", "w1": "decode"}) is None
    assert split_problem({"w0": "both"}) is None
    assert split_problem({}) == "names no node"
    assert split_problem({"w0": "decode", "w1": "decode"}) == "has no prefill node"
    assert split_problem({"w0": "prefill"}) == "has no decode node"
    assert "unknown node" in split_problem({"w0": "both", "ghost": "both"}, frozenset({"w0"}))
    assert "no prefill" in check(m.SplitCommand(epoch=10**15, phases={"w0": "decode", "w1": "decode"}))


def test_epoch_step():
    assert epoch_step_ok(-1, 1) and epoch_step_ok(0, MAX_EPOCH_STEP) and epoch_step_ok(5, 5 + MAX_EPOCH_STEP)
    assert not epoch_step_ok(-1, 10**15) and not epoch_step_ok(5, 6 + MAX_EPOCH_STEP)


def test_subject_params():
    s = Subjects("p0")
    assert subject_params(KV_EVENTS.template, s.prefix, s.format(KV_EVENTS, node="w3")) == {"node": "w3"}
    assert subject_params(KV_EVENTS.template, s.prefix, "ei.p1.kv.events.w3") == {}
    assert subject_params(KV_EVENTS.template, s.prefix, "ei.p0.kv.events") == {}
    assert subject_params(REQ_OUT.template, s.prefix, s.format(REQ_OUT, rid="r-1", node="w0")) == {"rid": "r-1", "node": "w0"}
    assert subject_params(REQ_OUT.template, s.prefix, "ei.p0.req.r-1.out.w0.x") == {}
    assert subject_params(SPLIT_COMMANDS.template, s.prefix, s.format(SPLIT_COMMANDS)) == {}


def test_every_hostile_variant_is_refused_or_harmless_and_check_never_raises():
    """Most hostile variants fail the checks; the rest are values the services handle
    (a far-future kv_ready_at is clamped by the worker, an epoch jump is refused by
    the receivers, a bool flip or an invented branch id is legal input)."""
    rng = random.Random(1)
    refused = 0
    total = 0
    for template, (params, msg) in samples().items():
        s = next(x for x in ALL if x.template == template)
        for p, v in hostile_variants(template, params, msg, rng, big=70_000):
            raw = m.encode(v)
            try:
                dec = decoder_for(s.msg_type).decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                refused += 1
                total += 1
                continue
            total += 1
            refused += check(dec, p) is not None
    assert total > 100 and refused / total > 0.6


def test_a_count_snapshot_past_2_23_entries_passes_the_edge():
    """A node with more than 2^23 blocks counted (R[b, n] > 0): its ``kv.countsync`` snapshot's
    ``total`` and the offsets of its later pieces used to be refused at the edge (the KvSnapshot
    bound), so the worker retried its sync for good. The worker bounds what it fetches itself
    (``countseq.SNAPSHOT_MAX_ENTRIES``: counted, no retry), so a larger ``total`` must reach it."""
    big = 2**23 + 1
    assert check(m.CountSnapshot(node="w0", offset=big - 1, total=big, hashes=[7], counts=[1])) is None
    assert check(m.CountSyncRequest(node="w0", snapshot="s1", offset=big - 1), {"node": "w0"}) is None
    assert check(m.CountSnapshot(node="w0", total=2**40)) is None  # past what a worker fetches: it refuses it itself
    assert "total" in check(m.CountSnapshot(node="w0", total=2**53 + 1))  # not an exact float: malformed
    assert "offset" in check(m.CountSyncRequest(node="w0", snapshot="s1", offset=2**53 + 1))


def test_count_sync_hostile_inputs_reach_the_worker_past_the_edge():
    """The kv.counts / kv.countsync variants meant for the worker's own rules (seq jump, beacon,
    forged epoch, a snapshot too large to fetch, a first piece of many, an error, a later piece)
    must pass the edge: refused there, they would never reach ``CountStream`` / ``_fetch_counts``."""
    rng = random.Random(4)
    params, msg = samples()[KV_COUNTS.template]
    ok = [v for p, v in hostile_variants(KV_COUNTS.template, params, msg, rng, big=300_000) if check(v, p) is None]
    assert any(v.beacon and v.seq == 10**12 for v in ok) and any(v.epoch.startswith("fz-forged") for v in ok)
    assert any(len(v.hashes) == 2**18 for v in ok) and any(v.seq == 10**12 and not v.beacon and v.epoch == msg.epoch for v in ok)
    snap = count_snapshot_sample("w1")
    assert snap.node == "w1" and check(snap) is None
    assert check(decoder_for(KV_COUNT_SYNC.reply_type).decode(m.encode(snap))) is None
    ok = [v for _, v in hostile_variants(KV_COUNT_SYNC.template, {"node": "w1"}, snap, rng, big=300_000) if check(v) is None]
    assert {2**31, 10**6} <= {v.total for v in ok} and any(v.error for v in ok) and any(v.offset == 1 for v in ok)


def test_payload_rotation_and_huge_cap():
    rng = random.Random(2)
    s = KV_EVENTS
    params, msg = samples()[s.template]
    out = list(payloads(s, params, msg, rng, 400, big=300_000, max_huge=2))
    assert {k for k, _, _ in out} == {"random", "truncated", "mutated", "hostile"}
    assert sum(len(raw) > 64 * 1024 for _, _, raw in out) == 2


def test_huge_cap_holds_on_every_subject_even_for_messages_without_fields():
    # split.get / svc.stats carry no fields: their only hostile variant is huge, and every
    # hostile payload used to be that 1.4-MB message whatever max_huge said
    rng = random.Random(3)
    for s in ALL:
        params, msg = samples()[s.template]
        out = list(payloads(s, params, msg, rng, 200, big=300_000, max_huge=2))
        assert sum(len(raw) > 64 * 1024 for _, _, raw in out) <= 2, s.template
        assert sum(k == "hostile" for k, _, _ in out) == 50, s.template


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw: object) -> None:
        self.lines.append((event, kw))


def test_rate_limited_log_writes_first_n_then_one_summary_per_interval():
    now = [0.0]
    log = _Log()
    rl = RateLimitedLog(log, first=3, interval_s=10.0, clock=lambda: now[0])
    for _ in range(100_000):
        rl.event("kv.events.{node}", "malformed message dropped")
    assert len(log.lines) == 3 and rl.suppressed_total == 99_997
    rl.flush()  # interval not over: nothing more
    assert len(log.lines) == 3
    now[0] = 10.5
    rl.flush()
    assert log.lines[-1][0] == "log lines suppressed" and log.lines[-1][1]["suppressed"] == 99_997
    rl.event("kv.events.{node}", "malformed message dropped")  # a new interval logs again
    assert len(log.lines) == 5 and rl.lines == 5
    rl.event("other", "x")
    assert len(log.lines) == 6


def test_a_rate_limited_event_s_summary_line_has_the_event_s_level():
    """The kvdirectory's info line per compaction: its ``log lines suppressed`` summary was a warning (a flood of
    expected events read as a problem); it now has the level of the events it counts, a warning by default."""
    now = [0.0]
    lines: list[tuple[str, str]] = []

    class Log:
        def info(self, event: str, **kw: object) -> None:
            lines.append(("info", event))

        def warning(self, event: str, **kw: object) -> None:
            lines.append(("warning", event))

    rl = RateLimitedLog(Log(), first=1, interval_s=10.0, clock=lambda: now[0])
    for _ in range(3):
        rl.event("compaction", "branch compacted", level="info")
        rl.event("drop", "malformed message dropped")
    now[0] = 10.5
    rl.flush()
    assert sorted(lines[-2:]) == [("info", "log lines suppressed"), ("warning", "log lines suppressed")], lines


def test_a_pool_location_instance_is_bounded():
    ok = m.PoolLocation(node="a", session="127.0.0.1:1", instance="0123456789abcdef")
    assert check(ok, {"node": "a"}) is None
    assert check(m.PoolLocation(node="a"), {"node": "a"}) is None  # a holder older than the field
    assert "instance" in (check(m.PoolLocation(node="a", instance="x" * 65), {"node": "a"}) or "")
