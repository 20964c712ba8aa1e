"""Fuzz every subject of a live cluster with auth on (issue 18 must-show, CI size).

For each subject, random bytes, truncated and mutated valid messages and
valid-shaped hostile values (NaN, 1e300, negative, huge lists, invented
nodes, sequence jumps, forged splits and chunks, count beacons and directory
epochs; the workers run branch-count host eviction, so they read kv.counts) are published by the identity
that may publish there, while a client keeps sending normal requests; then the
workers' own kv.countsync requests get hostile replies. Every
service stays alive and serving, every bad payload a service received is
counted as dropped (exactly: the test decodes and validates each payload
itself), no resync storm, memory bounded. ``bench/fuzz_bench.py`` runs the same
with 10^5 messages per subject.
"""

from __future__ import annotations

from evolving_infra.fuzzcheck import run

PER_SUBJECT = 120


async def test_fuzz_every_subject_live(tmp_path):
    rep = await run(PER_SUBJECT, log_dir=str(tmp_path / "logs"), rate=3000.0, big=300_000, max_huge=2)
    assert rep["alive"] and rep["requests_after_ok"] == 5
    assert rep["requests_ok"] >= 1 and rep["requests_failed"] <= rep["requests_ok"] // 10, rep
    assert len(rep["subjects"]) >= 22
    for template, entry in rep["subjects"].items():
        assert entry["sent"] == PER_SUBJECT and all(entry["kinds"].values()), (template, entry)
        assert rep["counted"][template]["dropped"] == entry["expected_drops"], (template, rep["counted"][template], entry)
    # the workers read kv.counts (the fuzz cluster runs branch-count host eviction, the evolving
    # set's; lru workers subscribe to no kv.counts since 7ea823c): the flood reached their count
    # handling, every malformed message was counted and dropped by the bus, the valid-shaped ones
    # (forged seq, beacon, epoch) reached CountStream and made the worker sync on kv.countsync
    counts = rep["subjects"]["kv.counts.{node}"]
    w0 = rep["worker_counts"]["worker-w0"]
    assert counts["expected_drops"].get("worker-w0", 0) > 0, counts
    assert w0.get("dropped.kv.counts.{node}", 0) == counts["expected_drops"]["worker-w0"], w0
    assert w0.get("received.kv.counts.{node}", 0) > 0 and w0.get("counts.sync.started", 0) >= 1, w0
    assert w0.get("counts.sync.pieces", 0) >= 1 and rep["directory_countsync"].get("countsync.pieces", 0) >= 1, rep["directory_countsync"]
    # the workers' own kv.countsync requests got hostile CountSnapshot replies (directory stopped
    # meanwhile): every undecodable or invalid one counted as a dropped reply, exactly
    cs = rep["countsync_replies"]
    assert all(cs["replies"].values()) and sum(cs["expected_drops"].values()) > 0, cs
    for inst, c in rep["worker_counts"].items():
        assert c.get("dropped_reply.kv.countsync.{node}", 0) == cs["expected_drops"].get(inst, 0), (inst, c, cs)
    # one forged sequence jump per kind of payload at most one resync per node per second
    assert rep["resync_requests"] <= 2 * (rep["wall_s"] + rep["drain_s"] + 1), rep["resync_requests"]
    # logs survive the flood: the first few drops per subject and 10 s, then one summary line
    # (one line per drop would be > 5,000 lines here)
    sent = sum(e["sent"] for e in rep["subjects"].values())
    assert sum(rep["log_lines"].values()) < sent // 2, rep["log_lines"]
    for name, rss in rep["rss_after"].items():
        assert rss < 1.5 * 2**30 and rss - rep["rss_before"][name] < 512 * 2**20, (name, rss, rep["rss_before"][name])
