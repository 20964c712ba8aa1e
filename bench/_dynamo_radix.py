"""Dynamo's ``RadixTree`` on the workloads of ``bench/kvdirectory_bench.py`` (run by that script
under the Python of a separate venv holding ``ai-dynamo-runtime``; stdlib + dynamo only).

    python _dynamo_radix.py IN.pickle OUT.json

IN (pickle, written by ``kvdirectory_bench.py``):

* ``ingest``: ``[(worker, tier, event_json_bytes), ...]`` — the same block events, one
  Dynamo event per ``BlockStored`` / ``BlockRemoved`` (``dynamo-measured.md``: store
  ``{"event_id", "data": {"stored": {"parent_hash", "blocks": [{"block_hash", "tokens_hash"}]}}}``,
  remove ``{"event_id", "data": {"removed": {"block_hashes": [...]}}}``); the JSON is built
  before timing (Dynamo's ingest figure excludes encoding, ours includes decoding nothing
  either: both get ready-made event objects);
* ``ingest_events``: block events in the stream; ``rounds``: ingest repetitions;
* ``lookup``: ``{scenario: (events, path, reps)}`` — events as for ingest (both tiers), the
  2,000-block path; one lookup = ``find_matches`` on the GPU tree and on the host tree
  (Dynamo keeps one tier per tree);
* ``memory``: ``(events, blocks)`` — GPU + host copies of ``blocks`` blocks.

OUT: ingest rates per round (block events / s of wall time and of process CPU time, all
threads), lookup p50 / p99 µs,
bytes per block (RSS delta of the two trees, ``/proc/self/statm``).
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import sys
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> int:
    from dynamo._core import RadixTree  # noqa: PLC0415 (only in Dynamo's venv)

    with open(sys.argv[1], "rb") as f:
        job = pickle.load(f)
    out: dict = {"ingest_eps": [], "ingest_cpu_eps": []}
    events = job.get("ingest", [])
    n = job.get("ingest_events", 0)
    for _ in range(job.get("rounds", 0)):
        trees = [RadixTree(), RadixTree()]
        gc.collect()
        t, c = time.perf_counter(), time.process_time()
        for w, tier, payload in events:
            trees[tier].apply_event(w, payload)
        c, t = time.process_time() - c, time.perf_counter() - t
        out["ingest_eps"].append(n / t)
        out["ingest_cpu_eps"].append(n / c)
        del trees
    out["lookup"] = {}
    for name, (evs, path, reps) in job.get("lookup", {}).items():
        trees = [RadixTree(), RadixTree()]
        for w, tier, payload in evs:
            trees[tier].apply_event(w, payload)
        ts = []
        for _ in range(reps):
            t = time.perf_counter_ns()
            trees[0].find_matches(path)
            trees[1].find_matches(path)
            ts.append(time.perf_counter_ns() - t)
        ts.sort()
        out["lookup"][name] = {"p50_us": ts[len(ts) // 2] / 1e3, "p99_us": ts[int(len(ts) * 0.99)] / 1e3}
    if "memory" in job:  # the events stay allocated: the RSS delta is the trees' alone
        evs, blocks = job["memory"]
        gc.collect()
        base = rss_bytes()
        trees = [RadixTree(), RadixTree()]
        for w, tier, payload in evs:
            trees[tier].apply_event(w, payload)
        out["bytes_per_block"] = (rss_bytes() - base) / blocks
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
