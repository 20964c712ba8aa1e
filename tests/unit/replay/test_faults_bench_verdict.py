"""``bench/faults.py``'s verdict on a run (sans-IO: no cluster): a run passes only when nothing was lost (a lossy
fault: the replay ended), ``up`` is alive, no completed request's token count is off, no worker still holds
parked, queued or running work after the replay, and a SIGTERMed service exited within compose's 30-s grace."""

from __future__ import annotations

from tests.conftest import bench_faults


faults = bench_faults()
IDLE = {"parked": 0.0, "queue_depth": 0.0, "running_batch": 0.0, "decoding": 0.0, "kv_l1_used_blocks": 12.0}


def _result(**kw):
    base = dict(fault="parked-prefill-kill", sessions=8, sent=67, completed=67, lost=0, up_alive=True,
                leftover={"w0": dict(IDLE), "w1": dict(IDLE)})  # fmt: skip
    base.update(kw)
    return faults.FaultResult(**base)


def test_a_clean_run_passes_and_cached_l1_blocks_do_not_count():
    assert faults._passed(_result())
    assert faults._passed(_result(leftover={}))  # not read (--leftover-after < 0)


def test_a_request_left_parked_or_queued_in_a_worker_fails_the_run():
    assert not faults._passed(_result(leftover={"w0": dict(IDLE, parked=1.0), "w1": dict(IDLE)}))
    assert not faults._passed(_result(leftover={"w0": dict(IDLE), "w1": dict(IDLE, queue_depth=2.0)}))
    assert faults._left_in_workers(_result(leftover={"w0": dict(IDLE, parked=1.0, decoding=2.0)})) == 3.0


def test_lost_requests_token_mismatch_and_slow_sigterm_exits_fail():
    assert not faults._passed(_result(lost=1, completed=66))
    assert faults._passed(_result(fault="router-term", lost=40, completed=27))  # lossy by design: it ended
    assert not faults._passed(_result(fault="router-term", lost=-1))  # the replay did not end
    assert not faults._passed(_result(token_mismatch=1))
    assert faults._passed(_result(fault="router-term", notes={"exit_s": 3.8}))
    assert faults._passed(_result(fault="router-term", notes={"exit_s": 40.0}))  # its drain: compose gives it 50 s
    assert not faults._passed(_result(fault="router-term", notes={"exit_s": 51.0}))
    assert not faults._passed(_result(fault="planner-term", notes={"exit_s": 31.0}))
    assert not faults._passed(_result(fault="planner-term", notes={"exit_s": -1}))  # still running after 35 s


def test_gauges_reads_prometheus_samples_by_name():
    page = '# HELP ei_node_parked x\n# TYPE ei_node_parked gauge\nei_node_parked{node="w0"} 2.0\nei_node_decoding{node="w0"} 0\n'
    assert faults._gauges(page) == {"ei_node_parked": 2.0, "ei_node_decoding": 0.0}
