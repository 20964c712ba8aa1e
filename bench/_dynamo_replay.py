"""NVIDIA Dynamo's offline replay on an ``agentic_mooncake`` trace (run by ``bench/sim_speed.py``
under the Python of a separate venv holding Dynamo; stdlib + dynamo only).

    python _dynamo_replay.py JOB.json OUT.json

JOB: ``trace`` (path of the ``agentic_mooncake`` v2 file ``sim_speed.py`` wrote), ``block_size``
(engine block size, tokens), ``prefill`` / ``decode`` (worker counts), ``lanes`` (agentic lanes:
concurrent plays), ``duration_s`` (simulated seconds, ``max_sim_time_ms``), ``engine`` (the
``engine`` section of each worker's mocker config: KV blocks, batch limits, speed-up ratio).
Router: ``kv_router``. Timing: the mocker's default ``polynomial`` model (needs no
``aisimulate``, which cannot be installed here: ``pip install --no-deps ai-dynamo``).

OUT: ``wall_s`` (the ``run_trace_replay`` call, trace parsing included), ``replay_wall_s``
(Dynamo's own ``wall_time_ms``: runtime construction and execution), ``process_wall_s`` (this
process up to the report, imports included) and the report's summary counts (completed requests,
input / output tokens, simulated duration).
"""

from __future__ import annotations

import json
import sys
import time

T0 = time.perf_counter()


def main() -> int:
    from dynamo.replay import run_trace_replay  # noqa: PLC0415 (only in Dynamo's venv)

    with open(sys.argv[1]) as f:
        job = json.load(f)
    engine = {"block_size": job["block_size"], **job.get("engine", {})}
    t = time.perf_counter()
    rep = run_trace_replay(
        job["trace"],
        trace_format="agentic_mooncake",
        trace_block_size=job["block_size"],
        execution_model=job.get("model", "evolving-infra-bench"),
        agentic_lanes=job["lanes"],
        num_prefill_workers=job["prefill"],
        num_decode_workers=job["decode"],
        prefill_engine_args={"engine": {**engine, "worker_type": "prefill"}},
        decode_engine_args={"engine": {**engine, "worker_type": "decode"}},
        router_mode="kv_router",
        max_sim_time_ms=job["duration_s"] * 1000.0,
    )
    wall = time.perf_counter() - t
    s = rep.summary
    keys = ("num_requests", "completed_requests", "total_input_tokens", "total_output_tokens", "duration_ms",
            "wall_time_ms", "prefix_cache_reused_ratio", "request_throughput_rps", "completed_trajectories",
            "total_trajectories")
    out = {k: s.get(k) for k in keys}
    out.update(wall_s=wall, replay_wall_s=(s.get("wall_time_ms") or 0.0) / 1000.0, process_wall_s=time.perf_counter() - T0)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
