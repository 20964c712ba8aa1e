"""Fuzz every subject of a live cluster with auth on (issue 18 must-show, CI size).

For each subject, random bytes, truncated and mutated valid messages and
valid-shaped hostile values (NaN, 1e300, negative, huge lists, invented
nodes, sequence jumps, forged splits and chunks) are published by the identity
that may publish there, while a client keeps sending normal requests. Every
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
    # one forged sequence jump per kind of payload at most one resync per node per second
    assert rep["resync_requests"] <= 2 * (rep["wall_s"] + rep["drain_s"] + 1), rep["resync_requests"]
    # logs survive the flood: the first few drops per subject and 10 s, then one summary line
    # (one line per drop would be > 5,000 lines here)
    sent = sum(e["sent"] for e in rep["subjects"].values())
    assert sum(rep["log_lines"].values()) < sent // 2, rep["log_lines"]
    for name, rss in rep["rss_after"].items():
        assert rss < 1.5 * 2**30 and rss - rep["rss_before"][name] < 512 * 2**20, (name, rss, rep["rss_before"][name])
