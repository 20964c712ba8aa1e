"""Per-request peer-fetch fields in the simulator's ``requests.jsonl`` (issue 23, deliverable 6):
the same ``fetch_sources`` / ``fetched_tokens`` / ``fetch_s`` / ``exposed_fetch_s`` the live
replayer takes from the router's ``ei`` object."""

from __future__ import annotations

import json

from evolving_infra.report.records import read_records, write_records
from evolving_infra.sim.run import simulate

from .conftest import BS
from .test_sim_decoupled import _pool_cfg, _switch_away_trace


def _lines(tmp_path, name, records):
    path = tmp_path / f"{name}.jsonl"
    write_records(path, records)
    return [json.loads(x) for x in path.read_text().splitlines()], read_records(path)


def test_a_peer_fetch_shows_its_sources_tokens_and_time_in_requests_jsonl(tmp_path):
    reqs = _switch_away_trace()
    res = simulate(_pool_cfg("decoupled"), reqs, BS)  # w0 leaves prefill: w1 reads w0's KV from the pool
    lines, recs = _lines(tmp_path, "decoupled", res.records)
    fetched = [(line, r) for line, r in zip(lines, recs) if r.fetch_s is not None]
    assert fetched, "the decoupled pool run fetches"
    for line, r in fetched:
        assert line["fetch_sources"] and r.prefill_node not in line["fetch_sources"], "peers, not the node itself"
        assert set(line["fetch_sources"]) <= {"w0", "w1", "w2"}
        assert line["fetched_tokens"] > 0 and line["fetched_tokens"] % BS == 0
        assert line["fetched_tokens"] <= r.cached_tokens, "fetched KV is part of the cached prompt"
        assert line["fetch_s"] > 0 and 0 <= line["exposed_fetch_s"] <= line["fetch_s"]
    assert "w0" in {n for line, _ in fetched for n in line["fetch_sources"]}, "the switched node's KV was read"
    for line, r in zip(lines, recs):
        if r.fetch_s is None:
            assert r.fetch_sources == [] and r.fetched_tokens == 0 and r.exposed_fetch_s is None
            assert not {"fetch_sources", "fetch_s", "exposed_fetch_s"} & set(line)
            assert line["fetched_tokens"] == 0  # a counter: always written, so that a mean counts every request


def test_a_run_without_fetches_shows_none(tmp_path):
    res = simulate(_pool_cfg("strand"), _switch_away_trace(), BS)  # local KV only: no fetch
    lines, recs = _lines(tmp_path, "strand", res.records)
    assert recs and all(r.ok for r in recs)
    assert all(r.fetch_sources == [] and r.fetched_tokens == 0 and r.fetch_s is None and r.exposed_fetch_s is None for r in recs)
    assert not any({"fetch_sources", "fetch_s", "exposed_fetch_s"} & set(line) for line in lines)
    assert all(line["fetched_tokens"] == 0 for line in lines)
