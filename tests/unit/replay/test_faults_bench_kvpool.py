"""``bench/faults.py --kv-pool real`` (the fifth fault walk, session 46), sans-IO: the ``up`` command line it starts,
what it reads from the workers' logs and counters, the verdict's bound on a request's wait for its peer fetches, and
the table's extra columns."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.conftest import bench_faults


faults = bench_faults()


def test_up_argv_gives_the_pool_with_sim_slots_and_routing_options(tmp_path):
    argv = faults.up_argv(tmp_path, speedup=50, nodes=4, split="2P2D", kv_pool="real", routing="ttft",
                          routing_opts=("ttft_fetch_base_s=0.001", "ttft_fetch_min_tokens=64"))
    assert argv[argv.index("--routing") + 1] == "ttft"
    i = argv.index("--kv-pool")
    assert argv[i : i + 4] == ["--kv-pool", "real", "--kv-pool-slot-bytes", str(faults.SIM_POOL_SLOT_BYTES)]
    assert [argv[j + 1] for j, a in enumerate(argv) if a == "--routing-opt"] == ["ttft_fetch_base_s=0.001", "ttft_fetch_min_tokens=64"]
    torch = faults.up_argv(tmp_path, speedup=50, nodes=4, split="2P2D", model_dir=tmp_path / "m", kv_pool="real")
    assert "--kv-pool" in torch and "--kv-pool-slot-bytes" not in torch  # a torch worker's slot is its page
    off = faults.up_argv(tmp_path, speedup=50, nodes=4, split="2P2D")
    assert "--kv-pool" not in off and "--routing-opt" not in off and "--routing" not in off


def test_worker_log_problems_counts_levels_tracebacks_fetch_failures_not_mooncake_start_lines(tmp_path: Path):
    lines = [
        json.dumps({"event": "worker started", "level": "info"}),
        json.dumps({"event": "real-bytes fetch failed; the missing pages are recomputed", "level": "warning"}),
        json.dumps({"event": "task failed", "level": "error"}),
        "Traceback (most recent call last):",
        "E1206 00:30:37.616008 22112 transfer_metadata.cpp:1098] Local segment descriptor not found",  # every start
        "E1206 00:31:02.000000 22112 tcp_transport.cpp:77] connection refused",
        "W1206 00:32:06.025480 26241 tcp_transport_lane_impl.h:1330] TCP lane queue-full rejection count: 2",
    ]
    (tmp_path / "worker-w0.log").write_text("\n".join(lines) + "\n")
    (tmp_path / "worker-w3-twin.log").write_text(json.dumps({"event": "x", "level": "warning"}) + "\n")
    (tmp_path / "router.log").write_text(json.dumps({"event": "y", "level": "error"}) + "\n")  # not a worker's
    assert faults.worker_log_problems(tmp_path) == {"warning": 2, "error": 2, "traceback": 1, "fetch_failed": 1}


def _result(**kw):
    base = dict(fault="decode-worker-stop", sessions=8, sent=67, completed=67, up_alive=True, kv_pool="real",
                counters={"worker-w0": {"kvfetch.calls": 4, "kvfetch.blocks_fetched": 900, "kvfetch.errors": 1,
                                        "kvpool.fetch_failed.timeout": 1, "kvfetch.failed.timeout": 300,
                                        "kvfetch.wait_ms_max": 10_240},
                          "worker-w1": {"kvfetch.calls": 2, "kvfetch.blocks_fetched": 100, "kvfetch.blocks_mismatched": 3,
                                        "kvfetch.wait_ms_max": 80},
                          "router": {"kvfetch.calls": 99}})  # fmt: skip
    base.update(kw)
    return faults.FaultResult(**base)


def test_kv_fetch_summary_adds_the_workers_and_takes_the_longest_wait():
    assert faults.kv_fetch_summary(_result()) == {"calls": 6, "fetched": 1000, "errors": 1, "timeouts": 1, "mismatched": 3,
                                                  "wait_ms_max": 10_240}


def test_a_request_waiting_past_the_fetch_timeouts_fails_the_run():
    assert faults._passed(_result())  # a 10-s read timeout plus the locate: bounded
    late = _result(counters={"worker-w0": {"kvfetch.wait_ms_max": faults.FETCH_WAIT_BOUND_MS + 1}})
    assert not faults._passed(late)
    assert faults._passed(_result(kv_pool="off", counters={}))
    frozen = {"worker-w3": {"kvfetch.wait_ms_max": 42_418}, "worker-w0": {"kvfetch.wait_ms_max": 10_032}}
    assert not faults._passed(_result(counters=frozen))
    # w3's own 40-s freeze, not a peer's hold: allowed the bound plus its freeze
    assert faults._passed(_result(counters=frozen, frozen=["worker-w3"], frozen_s={"worker-w3": 40.0}))
    assert faults.kv_fetch_summary(_result(counters=frozen, frozen=["worker-w3"]))["wait_ms_max"] == 10_032


def test_the_table_has_the_pool_columns_only_with_kv_pool_real():
    args = argparse.Namespace(nodes=4, split="2P2D", speedup=50.0, policy="static:2P2D", engine="sim", sessions=8,
                              concurrency=8, max_requests_per_branch=8, max_pause=2.0, fault_at=3.0, kv_pool="real",
                              routing="ttft", routing_opt=["ttft_fetch_base_s=0.001"])  # fmt: skip
    r = _result(log_problems={"warning": 5, "error": 0, "traceback": 0, "fetch_failed": 1})
    text = faults._results_section([r], args)
    assert "--policy static:2P2D --kv-pool real --routing ttft --routing-opt ttft_fetch_base_s=0.001" in text
    row = next(line for line in text.splitlines() if line.startswith("| decode-worker-stop"))
    assert row.endswith("| 6 / 1000 / 1 (1) / 3 / 10240 | 5 / 0 / 0 |"), row
    plain = faults._results_section([_result(kv_pool="off")], argparse.Namespace(**dict(vars(args), kv_pool="off", routing=None, routing_opt=None)))
    assert "kv fetch" not in plain


def test_a_frozen_worker_is_allowed_the_bound_plus_its_freeze_not_any_wait():
    """A frozen worker's fetch wait is not exempt for the whole run (review of the fifth walk): 10,000 s fails."""
    stuck = {"worker-w3": {"kvfetch.wait_ms_max": 10**7}, "worker-w0": {"kvfetch.wait_ms_max": 100}}
    assert not faults._passed(_result(counters=stuck, frozen=["worker-w3"]))
    assert not faults._passed(_result(counters=stuck, frozen=["worker-w3"], frozen_s={"worker-w3": 40.0}))
    edge = faults.FETCH_WAIT_BOUND_MS + 8_000
    at = {"worker-w3": {"kvfetch.wait_ms_max": edge}}
    assert faults._passed(_result(counters=at, frozen=["worker-w3"], frozen_s={"worker-w3": 8.0}))
    at["worker-w3"]["kvfetch.wait_ms_max"] = edge + 1
    assert not faults._passed(_result(counters=at, frozen=["worker-w3"], frozen_s={"worker-w3": 8.0}))


def test_a_freeze_is_timed_from_sigstop_to_sigcont(monkeypatch):
    sent = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    clock = iter([100.0, 100.0, 108.5])
    monkeypatch.setattr(faults.time, "monotonic", lambda: next(clock))
    run = faults.FaultRun(proc=None, info={}, log_dir=Path("."))  # type: ignore[arg-type]
    monkeypatch.setattr(run, "pid", lambda service: 4242)
    run.kill("worker-w3", faults.signal.SIGSTOP)
    run.thaw("worker-w3", 4242)
    assert sent == [(4242, faults.signal.SIGSTOP), (4242, faults.signal.SIGCONT)]
    assert run.frozen == {"worker-w3"} and run.frozen_s == {"worker-w3": 8.5}


def test_hang_records_go_into_the_errors_a_watchdog_firing_always_a_long_wait_when_the_replay_timed_out(tmp_path: Path):
    """The workers' hang records (bench/faults.py ``worker_hangs``): a watchdog firing reaches ``FaultResult.errors``
    and fails the verdict; a long wait of new work for its previous attempt's step goes there only when the replay ran
    past its bound (it says where the request it names stuck)."""
    hung = {"event": "engine step hung past --watchdog-timeout-s; the node exits to be restarted", "level": "error",
            "node": "w0", "step": 7, "elapsed_s": 30.4, "rids": ["trace_0045-3"], "awaiting": "Task worker-w0-loop\n  File "
            "\"service.py\", line 2351, in _handoff_aside", "stacks": "Thread 0x1 (most recent call first):\n" + "x" * 20_000}
    wait = {"event": "new work waits long for its request's previous attempt on this node; later work of its "
            "subscription waits behind it", "level": "warning", "rid": "trace_0045-3", "attempt": 149,
            "waits_for": "engine step 7", "awaiting": "Task worker-w0-loop"}  # fmt: skip
    (tmp_path / "worker-w0.log").write_text("\n".join([json.dumps(wait), "not json {", json.dumps(hung)]) + "\n")
    hangs = faults.worker_hangs(tmp_path)
    assert [k for k, _ in hangs] == ["wait", "watchdog"]
    text = hangs[1][1]
    assert text.startswith("worker-w0.log: engine step hung") and "rids=['trace_0045-3']" in text
    assert "in _handoff_aside" in text and len(text) <= faults.HANG_TEXT_MAX
    assert faults.hang_errors(hangs, False) == [text]
    assert faults.hang_errors(hangs, True) == [hangs[0][1], text]
    ok = _result(counters={}, hangs=[hangs[0][1]])
    assert faults._passed(ok)
    assert not faults._passed(_result(counters={}, hangs=[t for _, t in hangs]))
