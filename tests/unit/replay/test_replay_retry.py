"""The live replayer sends a request again, as agent harnesses do, only when it was refused before any
answer (``evolving_infra.replay.retry``), against a real HTTP server (:class:`StubRouter` with ``faults``):

* a 503 / 429 with ``Retry-After`` (a draining router), a 503 without it, a connection closed before the
  first byte, and a connection refused (a router restarting) are retried and the request completes,
  with ``retries`` in its record and the report;
* a stream that broke after its first token is not sent again (that would duplicate output): it fails;
* ``max_retries=0`` (``replay --max-retries 0``) keeps the behaviour before: the first refusal fails it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from evolving_infra.launcher import demo_trace_path
from evolving_infra.replay.core import Arrival
from evolving_infra.replay.live import LiveReplayer
from evolving_infra.replay.retry import RetryPolicy, parse_retry_after
from evolving_infra.report.metrics import summarize
from evolving_infra.report.records import RequestRecord
from evolving_infra.traces.schema import TraceRequest
from shared.clock import SimClock
from tests.unit.replay.stub_router import StubRouter, stub_router_thread

ONE = [TraceRequest(id="r1", agent="a1", branch="a1:main", input_tokens=4, output_tokens=1, blocks=[1], kind="main",
                    ends_branch=True)]
FAST = RetryPolicy(max_retries=2, initial_backoff_s=0.05, max_backoff_s=0.1)


async def _run(faults: list[str], retry: RetryPolicy = FAST):  # type: ignore[no-untyped-def]
    stub = StubRouter(faults=faults)
    url = await stub.start()
    try:
        replayer = LiveReplayer(url, SimClock(1000.0), block_size=4, progress=False, retry=retry)
        res = await asyncio.wait_for(replayer.run(ONE, Arrival(kind="closed", concurrency=1)), 10.0)
    finally:
        await stub.close()
    return res.records[0], sum(1 for t, _ in stub.seen if t == "/v1/completions")


@pytest.mark.parametrize("faults", [["503"], ["429", "503"], ["503-bare"], ["drop"], ["drop", "503"]])
async def test_a_request_refused_before_any_answer_is_sent_again_and_completes(faults):
    rec, sends = await _run(faults)
    assert rec.ok and rec.error is None and rec.status == 200, rec
    assert rec.retries == len(faults) and sends == len(faults) + 1
    assert rec.completion_tokens == 1 and rec.ttft_s is not None
    s = summarize([rec])
    assert (s["requests_failed"], s["requests_retried"], s["retries"]) == (0, 1, len(faults))


async def test_a_retried_requests_record_keeps_the_retry_wait_out_of_the_control_plane():
    """The 503's Retry-After (0.05 wall s, 50 s at --speedup 1000) and the refused send are the record's
    retry_wait_s, inside its TTFT; the report's control-plane share and TTFT prediction error leave it out.
    Before, they were none of the record's: a request that waited out a draining router's Retry-After: 1 at
    --speedup 50 added 50 s to ttft_control_plane_* and to the prediction error."""
    rec, _ = await _run(["503"])
    assert rec.ok and rec.retries == 1 and rec.ttft_s is not None
    assert 50.0 <= rec.retry_wait_s <= rec.ttft_s, rec
    plain, _ = await _run([])
    assert plain.ok and plain.retry_wait_s == 0.0
    # a request routed with a predicted TTFT of 8 s, 8 s on its node, 2 s of control plane, after 50 s of retries
    recs = [RequestRecord(id=f"r{i}", agent="a", branch="a:main", sent_at=0.0, ttft_s=60.0, e2e_s=61.0, retries=1,
                          retry_wait_s=50.0, predicted_ttft_s=8.0, node_arrived_at=100.0, first_token_at=108.0,
                          completion_tokens=2, prompt_tokens=4, finished_at=61.0) for i in range(2)]
    s = summarize(recs)
    assert s["ttft_control_plane_mean_s"] == pytest.approx(2.0) and s["ttft_node_mean_s"] == pytest.approx(8.0)
    assert s["ttft_prediction_abs_error_median_s"] == pytest.approx(2.0)  # the control plane, as without retries
    assert s["ttft_mean_s"] == pytest.approx(60.0)  # the client's TTFT keeps the wait: the agent waited


async def test_the_retries_stop_at_max_retries_and_the_request_fails_with_the_last_refusal():
    rec, sends = await _run(["503", "503", "503"])
    assert not rec.ok and rec.status == 503 and "draining" in (rec.error or "") and rec.retries == 2 and sends == 3


async def test_a_stream_that_broke_after_its_first_token_is_not_sent_again():
    rec, sends = await _run(["break"])
    assert not rec.ok and rec.retries == 0 and sends == 1, rec


async def test_max_retries_0_fails_the_first_refusal_as_before():
    rec, sends = await _run(["503"], RetryPolicy(max_retries=0))
    assert not rec.ok and rec.status == 503 and rec.retries == 0 and sends == 1
    rec, sends = await _run(["drop"], RetryPolicy(max_retries=0))
    assert not rec.ok and rec.retries == 0 and sends == 1


async def test_a_connection_refused_while_the_router_restarts_is_retried_until_it_listens():
    with socket.socket() as s:  # a free port nothing listens on yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stub = StubRouter()
    replayer = LiveReplayer(f"http://127.0.0.1:{port}", SimClock(1000.0), block_size=4, progress=False,
                            retry=RetryPolicy(max_retries=5, initial_backoff_s=0.1, max_backoff_s=0.2))
    run = asyncio.ensure_future(replayer.run(ONE, Arrival(kind="closed", concurrency=1)))
    await asyncio.sleep(0.15)  # the first send was refused (ConnectError)
    await stub.start(port)
    try:
        res = await asyncio.wait_for(run, 10.0)
    finally:
        await stub.close()
    rec = res.records[0]
    assert rec.ok and rec.retries >= 1, rec


def test_retry_after_is_honoured_capped_and_the_backoff_doubles_to_its_ceiling():
    p = RetryPolicy(max_retries=5, initial_backoff_s=0.5, max_backoff_s=8.0, max_retry_after_s=60.0)
    assert p.delay_s(0, 1.0, 0.9) == 1.0 and p.delay_s(0, 600.0, 0.0) == 60.0
    assert [p.delay_s(n, None, 0.0) for n in range(5)] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert p.delay_s(0, None, 1.0) == pytest.approx(0.375)  # jitter shortens by up to 25 %
    assert p.delay_s(5, 1.0, 0.0) is None and RetryPolicy(max_retries=0).delay_s(0, 1.0, 0.0) is None
    now = 1_000_000_000.0
    assert parse_retry_after("1", now) == 1.0 and parse_retry_after(" 0.5 ", now) == 0.5
    assert parse_retry_after(time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now + 30)), now) == pytest.approx(30.0)
    assert parse_retry_after(None, now) is None and parse_retry_after("-1", now) is None and parse_retry_after("soon", now) is None
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)


def test_replay_max_retries_flag_reaches_the_replayer(tmp_path, monkeypatch, capsys):
    from evolving_infra.cli import main

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    args = ["replay", str(demo_trace_path()), "--speedup", "1000", "--sessions", "1", "--max-requests-per-branch", "1"]
    with stub_router_thread(faults=["503"]) as (url, _):
        rc = main([*args, "--router-url", url, "--out", str(tmp_path / "a")])
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert rc == 0 and report["requests_failed"] == 0 and report["retries"] == 1 and report["meta"]["max_retries"] == 2
    assert "retried 1 (1 retries)" in capsys.readouterr().out
    with stub_router_thread(faults=["503"]) as (url, _):
        rc = main([*args, "--router-url", url, "--out", str(tmp_path / "b"), "--max-retries", "0"])
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert rc == 1 and report["requests_failed"] == 1 and report["retries"] == 0
    with pytest.raises(SystemExit):
        main([*args, "--max-retries", "-1"])
