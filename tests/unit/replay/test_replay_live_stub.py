"""The live replayer against a small HTTP server that keeps branches as the router does
(:mod:`tests.unit.replay.stub_router`, the router's own ``BranchTable``):

* the ids sent to the cluster carry a prefix, the records the trace's ids; `replay` run twice
  against the same cluster no longer fails every request of the second run with 409
  ('branch ... was ended');
* a replay cancelled while a request is answered (Ctrl-C on `demo`) leaves no task behind
  that uses the closed HTTP client.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time

import pytest

from evolving_infra.launcher import demo_trace_path
from evolving_infra.replay.core import Arrival
from evolving_infra.replay.live import LiveReplayer
from evolving_infra.traces.schema import TraceRequest
from shared.clock import SimClock
from tests.unit.replay.stub_router import StubRouter, stub_router_thread


def _trace() -> list[TraceRequest]:
    """One agent: a main branch of two requests and a fork of it, each ended."""
    return [
        TraceRequest(id="r1", agent="a1", branch="a1:main", input_tokens=4, output_tokens=1, blocks=[1], kind="main"),
        TraceRequest(id="r2", agent="a1", branch="a1:fork", input_tokens=4, output_tokens=1, blocks=[1], kind="fork",
                     parent_branch="a1:main", after=["r1"], ends_branch=True),
        TraceRequest(id="r3", agent="a1", branch="a1:main", input_tokens=8, output_tokens=1, blocks=[1, 2], after=["r1"],
                     ends_branch=True),
    ]


async def _replay_on_stub(trace: list[TraceRequest], *, branch_prefix: str = "", on_record=None, timeout_s: float = 10.0,  # type: ignore[no-untyped-def]
                          end_faults: list[str] | None = None):
    """Replay ``trace`` closed-loop (one agent at a time) against a fresh :class:`StubRouter` (``end_faults`` as its),
    within ``timeout_s``; returns ``(result, what the stub saw)`` (``(target, headers)`` per HTTP request)."""
    stub = StubRouter(end_faults=end_faults)
    url = await stub.start()
    try:
        replayer = LiveReplayer(url, SimClock(1000.0), block_size=4, progress=False, branch_prefix=branch_prefix)
        res = await asyncio.wait_for(replayer.run(trace, Arrival(kind="closed", concurrency=1), on_record=on_record), timeout_s)
    finally:
        await stub.close()
    return res, stub.seen


async def test_every_id_sent_carries_the_prefix_and_records_keep_the_trace_ids():
    res, seen = await _replay_on_stub(_trace(), branch_prefix="run7:")
    assert [r.ok for r in res.records] == [True] * 3 and res.branch_end_failures == 0
    assert {r.branch for r in res.records} == {"a1:main", "a1:fork"} and {r.agent for r in res.records} == {"a1"}
    sent = [h for target, h in seen if target == "/v1/completions"]
    assert {h["x-branch-id"] for h in sent} == {"run7:a1:main", "run7:a1:fork"}
    assert {h["x-agent-id"] for h in sent} == {"run7:a1"}
    assert [h["x-parent-branch-id"] for h in sent if "x-parent-branch-id" in h] == ["run7:a1:main"]
    ends = sorted(target for target, _ in seen if target.endswith("/end"))
    assert ends == ["/v1/branches/run7:a1:fork/end", "/v1/branches/run7:a1:main/end"]


def _replay_cli(url: str, out, *extra: str) -> tuple[int, dict]:
    from evolving_infra.cli import main

    rc = main(["replay", str(demo_trace_path()), "--router-url", url, "--speedup", "1000", "--sessions", "1",
               "--max-requests-per-branch", "2", "--out", str(out), *extra])
    return rc, json.loads((out / "report.json").read_text())


def test_replaying_twice_against_the_same_cluster_is_not_refused(tmp_path, monkeypatch):
    """The README's `replay` run twice against one `up` cluster: the first run ends its branches, and
    a router refuses an ended branch id (409), which failed every request of the second run."""
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))  # no running cluster's state is read
    with stub_router_thread() as (url, stub):
        rc1, first = _replay_cli(url, tmp_path / "a")
        rc2, second = _replay_cli(url, tmp_path / "b")
        assert (rc1, rc2) == (0, 0), second.get("meta")
        assert first["requests_sent"] == second["requests_sent"] > 0 and second["requests_failed"] == 0
        assert (first["meta"]["branch_end_failures"], first["meta"]["branch_ends_cancelled"]) == (0, 0)  # not stopped
        p1, p2 = first["meta"]["branch_prefix"], second["meta"]["branch_prefix"]
        assert p1 == first["meta"]["run_id"] + ":" and p2 == second["meta"]["run_id"] + ":" and p1 != p2
        # the file replayed, resolved (report compare's input check); no state file, so no block size known
        assert first["meta"]["trace"] == str(demo_trace_path().resolve()) and "block_size" not in first["meta"]
        rows = [json.loads(line) for line in (tmp_path / "b" / "requests.jsonl").read_text().splitlines()]
        assert rows and not any(r["branch"].startswith(p2) or r["agent"].startswith(p2) for r in rows)  # the trace's ids
        # '' sends the trace's own ids: once per cluster, as the option says
        rc3, exact = _replay_cli(url, tmp_path / "c", "--branch-prefix", "")
        rc4, again = _replay_cli(url, tmp_path / "d", "--branch-prefix", "")
        assert rc3 == 0 and exact["requests_failed"] == 0 and exact["meta"]["branch_prefix"] == ""
        assert rc4 == 1 and again["requests_failed"] == again["requests_sent"]
        refused = [json.loads(line) for line in (tmp_path / "d" / "requests.jsonl").read_text().splitlines()]
        assert all(r["status"] == 400 and "was ended" in r["error"] for r in refused)
        exact_ids = {r["branch"] for r in (json.loads(line) for line in (tmp_path / "c" / "requests.jsonl").read_text().splitlines())}
        assert exact_ids <= {h.get("x-branch-id") for _, h in stub.seen}


async def test_a_replay_cancelled_while_a_request_is_answered_leaves_no_task_behind():
    """Ctrl-C on `demo` cancels the replay: a request answered meanwhile spawned its branch's end
    after the HTTP client had closed ('Task exception was never retrieved', RuntimeError
    'Cannot send a request, as the client has been closed')."""
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    release = asyncio.Event()
    stub = StubRouter(hold=release)
    url = await stub.start()
    try:
        replayer = LiveReplayer(url, SimClock(1000.0), block_size=4, progress=False)
        trace = [TraceRequest(id="r1", agent="a1", branch="a1:main", input_tokens=4, output_tokens=1, blocks=[1], kind="main",
                              ends_branch=True),
                 TraceRequest(id="r2", agent="a2", branch="a2:main", input_tokens=4, output_tokens=1, blocks=[1], kind="main",
                              pause_s=1e6)]
        run = asyncio.ensure_future(replayer.run(trace, Arrival(kind="closed", concurrency=2)))
        assert stub.received is not None
        await asyncio.wait_for(stub.received.wait(), 10)
        run.cancel()  # Ctrl-C: asyncio.run cancels the main task ...
        release.set()  # ... while the router answers the request in flight
        await asyncio.wait([run], timeout=10)
        assert run.cancelled()
        for _ in range(20):
            await asyncio.sleep(0.01)
        left = [t for t in asyncio.all_tasks() if "LiveReplayer.run" in t.get_coro().__qualname__]
        assert left == []
        gc.collect()
        assert errors == []
    finally:
        release.set()
        await stub.close()
        loop.set_exception_handler(None)


async def test_a_request_whose_send_raises_is_counted_failed_and_the_replay_goes_on():
    """A send that raised something other than httpx's (here ``prompt_token_ids``' ValueError on a
    request whose blocks do not match its input_tokens) killed its task before ``on_complete``:
    its agent never went on and ``run`` waited forever. The same for an ``on_record`` that raised
    (``replay``'s appends to requests.jsonl on a full disk)."""
    trace = [
        TraceRequest(id="bad", agent="a1", branch="a1:main", input_tokens=400, output_tokens=1, blocks=[1], kind="main"),
        TraceRequest(id="next", agent="a1", branch="a1:main", input_tokens=4, output_tokens=1, blocks=[1], after=["bad"],
                     ends_branch=True),
        TraceRequest(id="other", agent="a2", branch="a2:main", input_tokens=4, output_tokens=1, blocks=[1], kind="main",
                     ends_branch=True),
    ]
    seen: list[str] = []

    def keep(rec) -> None:
        seen.append(rec.id)
        if rec.id == "other":
            raise OSError(28, "No space left on device")

    res, _seen = await _replay_on_stub(trace, on_record=keep)
    by_id = {r.id: r for r in res.records}
    assert sorted(by_id) == sorted(seen) == ["bad", "next", "other"]
    assert not by_id["bad"].ok and "ValueError" in by_id["bad"].error and "1 blocks but" in by_id["bad"].error
    assert by_id["bad"].finished_at is not None and by_id["bad"].agent == "a1" and by_id["bad"].branch == "a1:main"
    assert by_id["next"].ok and by_id["other"].ok and res.branch_end_failures == 0


async def test_a_branch_end_reaches_the_branch_whatever_characters_its_id_holds():
    """The end's path was the id as it is: '?' or '#' cut it (the router saw another path, 404), '%41'
    was read as 'A', '../' was folded away by the URL parser, and a tab raised httpx.InvalidURL out of
    the task (not counted, 'Task exception was never retrieved')."""
    from urllib.parse import unquote

    from evolving_infra.replay.live import branch_path

    for odd in ("a?b#c/%41 ..", "..", "."):
        assert unquote(branch_path(odd)) == odd and "/" not in branch_path(odd)
    for pre in ("r/1?#%41 :", "../", "tab\t:"):
        res, seen = await _replay_on_stub(_trace(), branch_prefix=pre)
        assert res.branch_end_failures == 0 and [r.ok for r in res.records] == [True] * 3, pre
        ends = sorted(unquote(t[len("/v1/branches/"):-len("/end")]) for t, _ in seen if t.endswith("/end"))
        assert ends == [pre + "a1:fork", pre + "a1:main"], pre


async def test_non_ascii_trace_and_prefix_ids_are_sent_as_utf8_and_their_ends_reach_them():
    """httpx sends a str header value as ASCII: a trace whose branch or agent ids hold 'ä' (or a prefix 'é:')
    failed every request in the client (UnicodeEncodeError, counted failed). The ids now go as their UTF-8
    bytes, which the router reads as the same text as the UTF-8 path of the branch's end."""
    from urllib.parse import unquote

    trace = [
        TraceRequest(id="r1", agent="agent-ü", branch="zweig-ä:main", input_tokens=4, output_tokens=1, blocks=[1]),
        TraceRequest(id="r2", agent="agent-ü", branch="枝:fork", input_tokens=4, output_tokens=1, blocks=[1], kind="fork",
                     parent_branch="zweig-ä:main", after=["r1"], ends_branch=True),
        TraceRequest(id="r3", agent="agent-ü", branch="zweig-ä:main", input_tokens=8, output_tokens=1, blocks=[1, 2],
                     after=["r1"], ends_branch=True),
    ]  # fmt: skip
    for pre in ("", "é:"):
        res, seen = await _replay_on_stub(trace, branch_prefix=pre)
        assert [r.ok for r in res.records] == [True] * 3 and res.branch_end_failures == 0, [r.error for r in res.records]
        sent = [h for target, h in seen if target == "/v1/completions"]  # the stub reads the header bytes as UTF-8
        assert {h["x-branch-id"] for h in sent} == {pre + "zweig-ä:main", pre + "枝:fork"}, sent
        assert {h["x-agent-id"] for h in sent} == {pre + "agent-ü"}
        assert [h["x-parent-branch-id"] for h in sent if "x-parent-branch-id" in h] == [pre + "zweig-ä:main"]
        ends = sorted(unquote(t[len("/v1/branches/"):-len("/end")]) for t, _ in seen if t.endswith("/end"))
        assert ends == sorted([pre + "zweig-ä:main", pre + "枝:fork"])


def test_a_prefix_no_header_can_hold_is_refused_and_one_making_ids_too_long_is_warned_of(tmp_path, monkeypatch, capsys):
    """A tab failed every request at the router (400, control character), as would a C1 control; a lone
    surrogate (an argument's bytes that were not UTF-8) has no UTF-8 form and failed every request in the
    client; a prefix that takes the ids over the router's 256 characters failed every request with 400 and
    nothing said why before the report. (A prefix such as 'é:' is sent as UTF-8: see the test above.)"""
    from evolving_infra.cli import main

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    with stub_router_thread() as (url, stub):
        for n, bad in enumerate(("tab\t:", "c1\x85:", "b\udce4:", "x" * 256)):
            rc = main(["replay", str(demo_trace_path()), "--router-url", url, "--out", str(tmp_path / f"bad{n}"),
                       "--branch-prefix", bad])
            err = capsys.readouterr().err
            assert rc == 2 and "error: --branch-prefix" in err, err
        assert not [t for t, _ in stub.seen if t == "/v1/completions"]
        rc, report = _replay_cli(url, tmp_path / "long", "--branch-prefix", "x" * 245)  # + "trace_0601:main"
        err = capsys.readouterr().err
        assert rc == 0 and "warning: the id 'xxxx" in err and "max_id_len (default 256)" in err, err
        rc, report = _replay_cli(url, tmp_path / "short")
        assert rc == 0 and "warning" not in capsys.readouterr().err


async def test_each_request_sends_an_x_request_id_from_its_record_id_and_records_the_servers():
    """requests.jsonl had ``"id": "r1"`` but the server's rid was random (no X-Request-ID sent): records could
    not be joined with the router's logs and traces. The id is the prefixed record id with ':' (refused by the
    router: the rid is a NATS subject token) as '-', unique in the run."""
    res, seen = await _replay_on_stub(_trace(), branch_prefix="run7:")
    assert [r.ok for r in res.records] == [True] * 3
    sent = sorted(h["x-request-id"] for target, h in seen if target == "/v1/completions")
    assert sent == ["run7-r1", "run7-r2", "run7-r3"]
    assert {r.id: (r.x_request_id, r.request_id) for r in res.records} == {
        f"r{i}": (f"run7-r{i}", f"run7-r{i}") for i in (1, 2, 3)}


def test_request_id_for_maps_characters_the_router_refuses_keeps_ids_unique_and_short():
    from evolving_infra.replay.live import request_id_for
    from services.router import api

    used: set[str] = set()
    assert request_id_for("ab12:trace_0242:0", used) == "ab12-trace_0242-0"
    assert request_id_for("ab12-trace_0242-0", used) == "ab12-trace_0242-0-2"  # maps onto the first: made unique
    assert request_id_for("ab12:trace_0242/0", used) == "ab12-trace_0242-0-3"
    long = request_id_for("x" * 300, used)
    assert len(long) == 128 and long != request_id_for("x" * 299 + "y")
    for rid in used | {request_id_for("é ü"), request_id_for("")}:
        assert api.parse_request_id(rid) == rid and api.request_rid(rid) == rid  # the router keeps every one as its rid


def test_request_id_for_never_sends_an_id_the_router_maps():
    """A trace id ending like a mapped rid (``--`` + 20 lowercase hex digits, ``api.request_rid``) gave an id the
    router does not keep as its rid (``t::0123456789abcdef0123`` → ``t--0123456789abcdef0123``, rid
    ``t--0123456789abcdef0123--5faa…``): the record's ``x_request_id`` no longer joined the server's logs and spans."""
    from evolving_infra.replay.live import request_id_for
    from services.router import api

    hexes = "0123456789abcdef0123"
    used: set[str] = set()
    for record_id in (f"t::{hexes}", f"run7-sess--{hexes}", f"sess--{hexes}", "y" * 106 + f"--{hexes}"):
        for rid in (request_id_for(record_id), request_id_for(record_id, used)):
            assert api.parse_request_id(rid) == rid and api.request_rid(rid) == rid, rid
    assert len(used) == 4


@pytest.mark.parametrize("step_s", [-3600.0, 3600.0])
async def test_a_wall_clock_step_neither_stalls_nor_hurries_the_replay(step_s):
    """The wall clock steps an hour (NTP, a VM resumed) while the replayer waits out a request's
    pause: the next request still goes out after its pause in wall time. Before, the wait was
    ``wall_at(next) - time.time()`` and the core ran on the wall-based clock: stepped back, it
    waited out the hour (here: the replay never finished); stepped forward, the next request went
    out as soon as anything woke the replayer (here: another agent's request, 0.2 s early). The records' ``sent_at`` / ``finished_at`` stay wall-based (the report compares them
    with the services' times); TTFT and E2E are local durations."""
    step = [0.0]
    clock = SimClock(1.0, wall=lambda: time.time() + step[0])
    done_at: dict[str, float] = {}

    def on_record(rec) -> None:  # type: ignore[no-untyped-def]
        done_at[rec.id] = time.monotonic()
        if rec.id == "r1":  # inside r2's 0.5-s pause
            asyncio.get_running_loop().call_later(0.1, step.__setitem__, 0, step_s)

    trace = [
        TraceRequest(id="r1", agent="a1", branch="a1:main", input_tokens=4, output_tokens=1, blocks=[1], kind="main"),
        TraceRequest(id="r2", agent="a1", branch="a1:main", input_tokens=4, output_tokens=1, blocks=[1], after=["r1"],
                     pause_s=0.5, ends_branch=True),
        # another agent's request due 0.3 s in wakes the replayer after the step, inside r2's pause
        TraceRequest(id="q1", agent="a2", branch="a2:main", input_tokens=4, output_tokens=1, blocks=[1], kind="main"),
        TraceRequest(id="q2", agent="a2", branch="a2:main", input_tokens=4, output_tokens=1, blocks=[1], after=["q1"],
                     pause_s=0.3, ends_branch=True),
    ]
    stub = StubRouter()
    url = await stub.start()
    try:
        replayer = LiveReplayer(url, clock, block_size=4, progress=False)
        res = await asyncio.wait_for(replayer.run(trace, Arrival(kind="closed", concurrency=2), on_record=on_record), 5)
    finally:
        await stub.close()
    assert [r.ok for r in res.records] == [True] * 4
    gap = done_at["r2"] - done_at["r1"]
    assert 0.5 <= gap < 1.5, gap  # the pause, in wall time, plus the stub's answer
    _, _, r1, r2 = sorted(res.records, key=lambda r: r.id)
    assert r2.sent_at - r1.finished_at == pytest.approx(0.5 + step_s, abs=0.3)  # wall-based: the step shows
    assert 0 < r2.ttft_s <= r2.e2e_s < 0.5  # local durations: the step does not


def test_without_a_state_file_the_routers_speedup_is_taken_and_another_refused(tmp_path, monkeypatch, capsys):
    """Against a compose or Slurm stack (no `up` state file) a replay whose --speedup was not the stack's
    scaled every TTFT / E2E of its report wrongly, unnoticed; the router now reports its speedup in /v1/cluster."""
    from evolving_infra.cli import main

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))  # no running cluster's state is read
    with stub_router_thread(speedup=1000.0) as (url, _):
        rc = main(["replay", str(demo_trace_path()), "--router-url", url, "--sessions", "1",
                   "--max-requests-per-branch", "2", "--out", str(tmp_path / "a")])
        err = capsys.readouterr().err
        assert rc == 0, err
        assert "replay: --speedup 1000, the router's (GET /v1/cluster)" in err, err
        assert json.loads((tmp_path / "a" / "report.json").read_text())["meta"]["speedup"] == 1000.0
        rc = main(["replay", str(demo_trace_path()), "--router-url", url, "--speedup", "50", "--out", str(tmp_path / "b")])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert "error: --speedup 50 differs from the router's 1000" in err and "pass --speedup 1000" in err, err
        assert not (tmp_path / "b").exists()  # refused before anything was sent or written


def test_router_speedup_is_none_when_the_router_does_not_say():
    """An older router (no `speedup` in /v1/cluster), an error status or a value no clock has: the replay keeps its --speedup."""
    import httpx

    from evolving_infra.replay.cli import router_answers, router_speedup

    def answer(body, status=200):
        transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body))
        return asyncio.run(router_answers("http://r", None, transport=transport))

    assert router_speedup(answer({"speedup": 50})) == 50.0
    for body, status in (({"policy": "x"}, 200), ({"speedup": 50}, 401), ({"speedup": True}, 200), ({"speedup": 0}, 200),
                         ({"speedup": "50"}, 200), ([50], 200)):
        assert router_speedup(answer(body, status)) is None, body


def test_replay_start_asks_the_router_each_of_its_answers_once(tmp_path, monkeypatch):
    """The start of a replay asked GET /v1/models three times (the key check, the model, max_model_len) and
    GET /v1/cluster twice (speedup, vocabulary): against a router that does not answer, each a wait of up to 5 s."""
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))  # no state file: the model and vocabulary are asked too
    with stub_router_thread(speedup=1000.0) as (url, stub):
        rc, report = _replay_cli(url, tmp_path / "a")
        assert rc == 0 and report["requests_failed"] == 0
        asked = [target for target, _ in stub.seen if target in ("/v1/models", "/v1/cluster")]
    assert sorted(asked) == ["/v1/cluster", "/v1/models"], asked


async def test_a_branch_end_refused_with_503_or_a_dropped_connection_is_sent_again():
    """A router asked to end a branch it did not see (restarted, or another router behind the address) asks the KV
    directory and answers 503 ``Retry-After: 1`` when that gets no answer; the replayer counted the end failed and
    never sent it again (the directory kept the branch's counts until its TTL). An end is idempotent, so it is now
    retried as a request is (429 / 503, a connection closed before an answer); a 500 is not retried."""
    res, seen = await _replay_on_stub(_trace(), end_faults=["503", "drop"])
    assert res.branch_end_failures == 0 and [r.ok for r in res.records] == [True] * 3
    ends = [t for t, _ in seen if t.endswith("/end")]
    assert len(ends) == 4 and len(set(ends)) == 2, ends  # two refused sends, then each of the two ends answered
    res, seen = await _replay_on_stub(_trace(), end_faults=["500"])
    assert res.branch_end_failures == 1 and len([t for t, _ in seen if t.endswith("/end")]) == 2
