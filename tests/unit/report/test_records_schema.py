"""``requests.jsonl`` writes every counter an analyst averages, 0 included (the simulator's and the live
replay's records alike: one ``RequestRecord``), and leaves unknown (None) measurements out."""

from __future__ import annotations

import json
from pathlib import Path

from evolving_infra.report.records import RequestRecord, read_records, write_records

COUNTERS = ("ok", "status", "branch_kind", "admission_wait_s", "prompt_tokens", "completion_tokens", "cached_tokens",
            "expected_prompt_tokens", "expected_completion_tokens", "fetched_tokens", "retries", "retry_wait_s")


def test_requests_jsonl_writes_counters_at_zero_and_leaves_unknowns_out(tmp_path: Path):
    """A request served with no cache hit: ``cached_tokens`` 0 was left out of its line, so a mean over the file
    (pandas) skipped it and overstated the hit rate. Counters are now always written; None (unknown) fields are not."""
    recs = [
        RequestRecord(id="r0", agent="a", branch="b", sent_at=0.0, ttft_s=0.5, e2e_s=1.0, prompt_tokens=100,
                      completion_tokens=5, cached_tokens=0),
        RequestRecord(id="r1", agent="a", branch="b", sent_at=1.0, ttft_s=0.2, e2e_s=0.7, prompt_tokens=120,
                      completion_tokens=5, cached_tokens=100, fetched_tokens=64, fetch_sources=["w1"], fetch_s=0.01),
    ]
    path = tmp_path / "requests.jsonl"
    write_records(path, recs)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        assert set(COUNTERS) <= set(row), set(COUNTERS) - set(row)
    assert rows[0]["cached_tokens"] == 0 and rows[0]["fetched_tokens"] == 0
    assert sum(r["cached_tokens"] for r in rows) / len(rows) == 50.0  # the mean over every request
    assert "fetch_s" not in rows[0] and "fetch_sources" not in rows[0] and "queue_s" not in rows[0]
    assert rows[1]["fetch_sources"] == ["w1"] and rows[1]["fetch_s"] == 0.01
    assert read_records(path) == recs
    # an older file without the counters still reads, at their defaults
    path.write_text('{"id":"x","agent":"a","branch":"b","sent_at":2.0}\n')
    (old,) = read_records(path)
    assert (old.cached_tokens, old.ok, old.status, old.branch_kind) == (0, True, 200, "main")
