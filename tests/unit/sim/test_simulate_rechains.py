"""``simulate`` re-chains its input whatever the entry point (the CLI did; the Python API and
``fidelity`` passed lists as read), since ``ClusterSim``'s directory assumes chained ids."""

from __future__ import annotations

import msgspec

from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.run import simulate
from evolving_infra.traces.compact import compact_requests
from evolving_infra.traces.generate import generate
from evolving_infra.traces.tokens import rechain_blocks


def _unchained():
    trace = generate("claude-code", seed=3, agents=4, duration_s=120)
    reqs = list(trace.requests)
    # the last id of the longest request reappears as the last id of a request whose prefix differs
    src = max(reqs, key=lambda r: len(r.blocks))
    x, parent = src.blocks[-1], src.blocks[-2]
    i = next(i for i, r in enumerate(reqs) if len(r.blocks) >= 2 and r.blocks[-2] != parent and x not in r.blocks)
    reqs[i] = msgspec.structs.replace(reqs[i], blocks=[*reqs[i].blocks[:-1], x])
    assert rechain_blocks(reqs)[1] > 0
    return trace.header, reqs


def _cfg():
    return SimConfig(nodes=2, profile="tiny", policy="evolving", concurrency=4, seed=1)


def test_simulate_rechains_a_list_and_a_compact_trace_the_same_as_the_cli():
    header, reqs = _unchained()
    bs = header.block_size
    chained, n = rechain_blocks(reqs)
    want = simulate(_cfg(), chained, bs)
    from_list = simulate(_cfg(), reqs, bs)
    from_compact = simulate(_cfg(), compact_requests(header, reqs), bs)
    enc = msgspec.json.encode
    assert want.records and enc(from_list.records) == enc(want.records) == enc(from_compact.records)
    assert from_list.report["meta"]["block_ids_rechained"] == n
    assert "block_ids_rechained" not in want.report["meta"]
