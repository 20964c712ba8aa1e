"""``bench/sim_ab.py``'s requests.jsonl comparison across 69a2a04 (the counters written at 0 since): a base before
it and a head after it read "every line differs" for identical runs. Both sides' lines are read with the head's
``RequestRecord`` defaults filled in, so only values differ."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import sim_ab  # noqa: E402

# a record as the base wrote it (counters and outcome left out at their defaults) and as the head writes it
OLD = {"id": "r1", "agent": "a", "branch": "b", "sent_at": 1.0, "prompt_tokens": 640, "completion_tokens": 12,
       "ttft_s": 0.5, "e2e_s": 0.9}
NEW = {**OLD, "branch_kind": "main", "ok": True, "status": 200, "admission_wait_s": 0.0, "cached_tokens": 0,
       "expected_prompt_tokens": 0, "expected_completion_tokens": 0, "fetched_tokens": 0, "retries": 0,
       "retry_wait_s": 0.0}


def _out(d: Path, lines: list[dict]) -> Path:
    d.mkdir()
    (d / "report.json").write_text(json.dumps({"requests_completed": len(lines)}))
    (d / "requests.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def test_counters_written_at_zero_are_no_difference(tmp_path: Path):
    base = _out(tmp_path / "base", [OLD, dict(OLD, id="r2")])
    head = _out(tmp_path / "head", [NEW, dict(NEW, id="r2")])
    fields = sim_ab.record_fields(ROOT)
    assert sim_ab.differences(base, head, fields) == []  # before: "requests.jsonl: 2 of 2 lines differ"
    assert sim_ab.differences(base, head, fields, defaults=sim_ab.record_defaults(ROOT)) == []
    assert sim_ab.differences(head, base, fields) == []  # either side may be the older
    moved = _out(tmp_path / "moved", [dict(NEW, cached_tokens=64), dict(NEW, id="r2")])
    assert sim_ab.differences(base, moved, fields) == ["requests.jsonl: 1 of 2 lines differ"]  # a value still counts
    failed = _out(tmp_path / "failed", [dict(NEW, ok=False, status=500), dict(NEW, id="r2")])
    assert sim_ab.differences(base, failed, fields) == ["requests.jsonl: 1 of 2 lines differ"]
