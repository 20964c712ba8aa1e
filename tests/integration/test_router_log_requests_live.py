"""The router's request log (``--log-requests``, vLLM's ``--enable-log-requests``) and its split log, over a real nats-server.

A newcomer sent ``-H 'X-Request-ID: nc37-req-1'``: at the default info level no log line carried the
id and a successful request left no line at all; and the router logged ``split applied`` at info
every 5 s for the same epoch (the planner repeats its split as a beacon). With ``--log-requests``
each request has one ``request accepted`` and one ``request finished`` line carrying its id and
its accounting; off (the default), neither; a repeated split is logged at debug.
"""

from __future__ import annotations

import logging

import nats.errors
import pytest
import structlog

from services.router import api
from shared import messages as m
from shared.subjects import SPLIT_COMMANDS
from tests.integration.test_router_live import _wait_for, router_env, sse_events


@pytest.fixture
def logs():
    """Every structlog event of the test (all levels) as dicts; the configuration is restored after."""
    old = structlog.get_config()
    cap = structlog.testing.LogCapture()
    structlog.configure(processors=[cap], wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG), cache_logger_on_first_use=False)
    try:
        yield cap.entries
    finally:
        structlog.configure(**old)


def _events(logs, name):
    return [e for e in logs if e["event"] == name]


async def test_log_requests_gives_each_request_an_accepted_and_a_finished_line_with_its_id(nats_url, tmp_path, logs):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, log_requests=True, log_level="info") as env:
        env.cluster.cached = {"p0": 2}
        prompt = list(range(1000, 1200))  # 200 tokens, 3 full blocks
        r = await env.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5}, headers={"X-Request-ID": "nc37-req-1"})
        assert r.status_code == 200, r.text
        r = await env.http.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": True},
            headers={"X-Request-ID": "nc37-req-2", "X-Branch-Id": "b7"},
        )  # fmt: skip
        assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
        r = await env.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0}, headers={"X-Request-ID": "nc37-req-3"})
        assert r.status_code == 400
        await _wait_for(lambda: len(_events(logs, "request finished")) == 2, what="finished lines")

    acc = {e["rid"]: e for e in _events(logs, "request accepted")}
    assert set(acc) == {"nc37-req-1", "nc37-req-2"}
    assert all(e["log_level"] == "info" for e in acc.values())
    a1, a2 = acc["nc37-req-1"], acc["nc37-req-2"]
    assert (a1["branch"], a1["prompt_tokens"], a1["max_tokens"], a1["stream"], a1["api"]) == (None, 200, 5, False, "completions")
    assert (a2["branch"], a2["prompt_tokens"], a2["max_tokens"], a2["stream"]) == ("b7", 200, 4, True)

    fin = {e["rid"]: e for e in _events(logs, "request finished")}
    assert all(e["log_level"] == "info" for e in fin.values())
    f1, f2 = fin["nc37-req-1"], fin["nc37-req-2"]
    assert (f1["status"], f1["finish_reason"], f1["prompt_tokens"], f1["cached_tokens"], f1["output_tokens"]) == (200, "length", 200, 128, 5)
    assert (f1["prefill"], f1["decode"], f1["redispatches"]) == ("p0", "d0", 0)
    assert 0 < f1["ttft_s"] <= f1["e2e_s"] < 30
    assert (f2["status"], f2["finish_reason"], f2["output_tokens"], f2["prefill"]) == (200, "length", 4, "p0")
    assert 0 < f2["ttft_s"] <= f2["e2e_s"] < 30
    # the finish reason is the one ei_router_requests_finished_total counts
    assert env.service.counters["finished.length"] == 2

    (rej,) = _events(logs, "request rejected")
    assert rej["rid"] == "nc37-req-3" and rej["status"] == 400 and "max_tokens" in rej["error"]


async def test_a_request_cut_at_a_stop_string_logs_the_clients_token_count_and_stop(nats_url, tmp_path, logs):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, log_requests=True) as env:
        r = await env.http.post(
            "/v1/completions", json={"prompt": list(range(1, 100)), "max_tokens": 8, "stop_token_ids": [(7919 * 3) % 100_000]},
            headers={"X-Request-ID": "stop-1"},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        used = r.json()["usage"]["completion_tokens"]
        await _wait_for(lambda: _events(logs, "request finished"), what="finished line")
    (f,) = _events(logs, "request finished")
    assert (f["rid"], f["finish_reason"], f["output_tokens"]) == ("stop-1", "stop", used)


async def test_without_log_requests_no_request_lines_are_logged(nats_url, tmp_path, logs):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, log_level="info") as env:
        r = await env.http.post("/v1/completions", json={"prompt": list(range(1, 100)), "max_tokens": 3}, headers={"X-Request-ID": "q1"})
        assert r.status_code == 200
    names = {e["event"] for e in logs}
    assert not names & {"request accepted", "request finished", "request rejected"}


async def test_a_repeated_split_is_logged_at_debug_a_new_epoch_at_info(nats_url, tmp_path, logs):
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}) as env:
        same = m.SplitCommand(epoch=1, phases={"p0": "prefill", "d0": "decode"}, reason="test")
        for _ in range(3):  # the planner's beacon
            await env.bus.publish(SPLIT_COMMANDS, same)
        await _wait_for(lambda: env.service.counters["splits_applied"] == 4, what="beacons applied")
        await env.bus.publish(SPLIT_COMMANDS, m.SplitCommand(epoch=2, phases={"p0": "prefill", "d0": "decode"}, reason="next"))
        await _wait_for(lambda: env.service.counters["splits_applied"] == 5, what="epoch 2 applied")
    applied = [(e["epoch"], e["log_level"]) for e in _events(logs, "split applied")]
    assert applied == [(1, "info"), (1, "debug"), (1, "debug"), (1, "debug"), (2, "info")]


async def test_each_end_path_logs_one_finished_line_with_the_reason_the_counter_counts(nats_url, tmp_path, logs):
    """A client gone mid-stream, a timeout (answered 504, or as an SSE error event) and an engine error
    each give exactly one ``request finished`` line, with the finish reason counted in
    ``ei_router_requests_finished_total`` (``finish.abort`` / ``finish.error``) and the status sent."""
    async with router_env(nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, log_requests=True, request_timeout_s=1.0) as env:
        env.cluster.stall_after_first = {"p0"}  # first token, then nothing
        body = {"prompt": list(range(1, 100)), "max_tokens": 8}
        async with env.http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers={"X-Request-ID": "gone-1"}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break  # the client leaves after its first event
        await _wait_for(lambda: any(e["rid"] == "gone-1" for e in _events(logs, "request finished")), what="gone-1 finished")
        r = await env.http.post("/v1/completions", json=body, headers={"X-Request-ID": "slow-1"})
        assert r.status_code == 504, r.text
        r = await env.http.post("/v1/completions", json={**body, "stream": True}, headers={"X-Request-ID": "slow-2"})
        assert r.status_code == 200 and "request_timeout_s" in r.text
        env.cluster.stall_after_first, env.cluster.error_nodes = set(), {"p0"}
        r = await env.http.post("/v1/completions", json=body, headers={"X-Request-ID": "err-1"})
        assert r.status_code == 500
        await _wait_for(lambda: len(_events(logs, "request finished")) >= 4, what="4 finished lines")
        counted = {k: v for k, v in env.service.counters.items() if k.startswith(("finish.", "finished.")) and v}
    fin = sorted((e["rid"], e["status"], e["finish_reason"]) for e in _events(logs, "request finished"))
    assert fin == [("err-1", 500, "error"), ("gone-1", 200, "abort"), ("slow-1", 504, "error"), ("slow-2", 200, "error")]
    assert counted == {"finish.abort": 1, "finish.error": 3}


async def test_a_generation_request_refused_for_its_api_key_is_logged_rejected_without_the_key(nats_url, tmp_path, logs):
    """With API keys, a 401 (no or unknown key) or 429 (the key's requests in flight) of a generation
    request is refused before acceptance: ``request rejected`` (status, client rid, error), as the
    README says of every such refusal, and never the key. Before, the ingress guard answered them and
    no line was logged."""
    async with router_env(
        nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, log_requests=True, api_keys="good-key-1", api_key_max_inflight=1
    ) as env:
        body = {"prompt": list(range(1, 100)), "max_tokens": 3}
        good = {"Authorization": "Bearer good-key-1"}
        env.cluster.stall_after_first = {"p0"}  # holds the key's one request in flight
        async with env.http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers={**good, "X-Request-ID": "held-1"}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
            r2 = await env.http.post("/v1/completions", json=body, headers={**good, "X-Request-ID": "over-1"})
            assert r2.status_code == 429
        env.cluster.stall_after_first = set()
        await _wait_for(lambda: not env.service._pending, what="held-1 ended")
        r = await env.http.post("/v1/completions", json=body, headers={"X-Request-ID": "nokey-1", "Authorization": "Bearer wrong-key-xyz"})
        assert r.status_code == 401
        r = await env.http.get("/v1/models", headers={"X-Request-ID": "models-1"})  # another path: logged too, with its path
        assert r.status_code == 401
        r = await env.http.post("/v1/completions", json=body, headers={**good, "X-Request-ID": "ok-1"})
        assert r.status_code == 200
    rej = {e["rid"]: e for e in _events(logs, "request rejected")}
    assert sorted(rej) == ["models-1", "nokey-1", "over-1"]
    assert (rej["models-1"]["status"], rej["models-1"]["path"], rej["models-1"]["method"]) == (401, "/v1/models", "GET")
    assert "path" not in rej["nokey-1"]  # a generation request's line is as it was
    assert rej["nokey-1"]["status"] == 401 and "API key" in rej["nokey-1"]["error"]
    assert rej["over-1"]["status"] == 429 and "in flight" in rej["over-1"]["error"]
    text = repr(logs)
    assert "wrong-key-xyz" not in text and "good-key-1" not in text


async def test_every_response_carries_x_request_id_and_a_refusal_logs_that_id(nats_url, tmp_path, logs):
    """An operator finds a client's failed request in the log by the response's ``x-request-id``: errors carry
    it as successes do (OpenAI's API, vLLM's ``--enable-request-id-headers``), the client's valid id as sent
    or one the router made, and the ``request rejected`` line has that id. Before, only a success had the
    header: a 401, 429, 400, 404 or 503 had none, and a refusal without a client id was logged with ``rid=None``."""
    async with router_env(
        nats_url, tmp_path, {"p0": "prefill", "d0": "decode"}, log_requests=True, api_keys="good-key-1", api_key_max_inflight=1,
        no_route_wait_s=0.2,
    ) as env:
        body = {"prompt": list(range(1, 20)), "max_tokens": 2}
        good = {"Authorization": "Bearer good-key-1"}
        made: dict[str, int] = {}  # ids the router made -> status of the refused generation request

        def made_id(r) -> None:
            rid = r.headers["x-request-id"]
            assert len(rid) == 32 and int(rid, 16) >= 0, rid
            made[rid] = r.status_code

        r = await env.http.post("/v1/completions", json=body, headers={"X-Request-ID": "nokey-2"})
        assert r.status_code == 401 and r.headers["x-request-id"] == "nokey-2"
        r = await env.http.post("/v1/completions", json=body)
        assert r.status_code == 401
        made_id(r)
        r = await env.http.post("/v1/chat/completions", content=b"{", headers={**good, "content-type": "application/json"})
        assert r.status_code == 400
        made_id(r)
        r = await env.http.post("/v1/completions", json=body, headers={**good, "X-Request-ID": "x" * 300})  # invalid: not echoed
        assert r.status_code == 400 and "X-Request-ID" in r.json()["error"]["message"]
        made_id(r)
        r = await env.http.post("/v1/completions", json={**body, "max_tokens": -1}, headers={**good, "X-Request-ID": "gw/a:1"})
        assert r.status_code == 400 and r.headers["x-request-id"] == "gw/a:1"
        env.cluster.stall_after_first = {"p0"}  # holds the key's one request in flight
        async with env.http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=good) as held:
            assert held.status_code == 200
            held_id = held.headers["x-request-id"]
            async for line in held.aiter_lines():
                if line.startswith("data:"):
                    break
            r = await env.http.post("/v1/completions", json=body, headers=good)
            assert r.status_code == 429
            made_id(r)
        env.cluster.stall_after_first = set()
        await _wait_for(lambda: not env.service._pending, what="the held request ended")
        r = await env.http.get("/v1/no-such-path", headers=good)
        assert r.status_code == 404 and len(r.headers["x-request-id"]) == 32
        not_found_id = r.headers["x-request-id"]
        r = await env.http.get("/v1/models/other-model", headers={**good, "X-Request-ID": "m-1"})
        assert r.status_code == 404 and r.headers["x-request-id"] == "m-1"
        r = await env.http.post("/v1/completions", json=body, headers=good)
        assert r.status_code == 200
        ok_id = r.headers["x-request-id"]
        env.cluster.alive.clear()  # accepted, then no node to serve it: 503 with the id it is logged with
        await _wait_for(lambda: not env.service.ready(), what="nodes fenced")
        r = await env.http.post("/v1/completions", json=body, headers=good)
        assert r.status_code == 503 and "no live" in r.json()["error"]["message"]
        no_route_id = r.headers["x-request-id"]
    assert [e["rid"] for e in _events(logs, "no route")] == [no_route_id]
    assert {e["rid"]: e["status"] for e in _events(logs, "request finished")}[no_route_id] == 503
    rej = {e["rid"]: e for e in _events(logs, "request rejected")}
    assert set(rej) == {"nokey-2", *made, api.request_rid("gw/a:1"), not_found_id, "m-1"}, rej  # the 404s of other paths too
    assert {rid: rej[rid]["status"] for rid in made} == made
    assert rej[api.request_rid("gw/a:1")]["client_request_id"] == "gw/a:1"
    accepted = {e["rid"] for e in _events(logs, "request accepted")}
    assert {held_id, ok_id, no_route_id} <= accepted  # a success's header is the rid it is logged with


async def test_a_background_publish_that_fails_is_logged_with_its_traceback(nats_url, tmp_path, logs):
    """A publish the router runs in the background (``_spawn``: aborts, placements, parked retries) that raises is
    counted and logged with its traceback, so the line says where it raised. Before, only the exception's repr."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        svc = env.service

        async def failing() -> None:
            raise RuntimeError("publish refused")

        svc._spawn(failing())
        await _wait_for(lambda: svc.counters["publish_errors"] == 1, what="the failure counted")
    (line,) = _events(logs, "background publish failed")
    assert line["log_level"] == "warning" and line["error"] == "RuntimeError('publish refused')"
    exc = line["exc_info"]
    assert isinstance(exc, RuntimeError) and exc.__traceback__ is not None, line


async def test_the_x_request_id_header_is_read_once_per_request(nats_url, tmp_path, logs, monkeypatch):
    """The ``x-request-id`` middleware reads the header once; the generation handler, its ``request rejected``
    line and its spans use what it read (the id, the rid, or why the header is invalid: the same 400). Before,
    the handler parsed the header again, and a refused request's log line a third time."""
    calls: list[str | None] = []
    real = api.parse_request_id

    def counting(value: str | None) -> str | None:
        calls.append(value)
        return real(value)

    monkeypatch.setattr(api, "parse_request_id", counting)
    async with router_env(nats_url, tmp_path, {"c0": "both"}, log_requests=True) as env:
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        cases = (
            ({"X-Request-ID": "gw/a:1"}, body, 200),
            ({"X-Request-ID": "x" * 300}, body, 400),  # invalid: the handler's 400 names the header
            ({"X-Request-ID": "bad-max-1"}, {**body, "max_tokens": -1}, 400),  # refused: a request rejected line
        )
        for headers, sent, status in cases:
            calls.clear()
            r = await env.http.post("/v1/completions", json=sent, headers=headers)
            assert r.status_code == status, r.text
            assert calls == [headers["X-Request-ID"]], calls
            if len(headers["X-Request-ID"]) == 300:
                assert r.json()["error"]["message"] == "X-Request-ID is 300 characters long; at most 256 allowed", r.text
    rej = {e["rid"]: e for e in _events(logs, "request rejected")}
    assert "bad-max-1" in rej and len(rej) == 2
    (fin,) = _events(logs, "request finished")
    assert fin["rid"] == api.request_rid("gw/a:1") and fin["client_request_id"] == "gw/a:1"


async def test_a_401_or_404_on_another_path_is_logged_rejected_with_its_request_id(nats_url, tmp_path, logs):
    """With ``--log-requests``, a 401 (no or unknown API key) or a 404 (unknown path, model or branch) on a path
    other than ``/v1/completions`` and ``/v1/chat/completions`` logs ``request rejected`` as those paths' refusals
    do: the id of the response's ``x-request-id``, status, error, plus its path and method (a newline in the path
    shown escaped). Before, none of them was logged: an operator could not find a client's 401 or 404 by its id."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, log_requests=True, api_keys="k1") as env:
        key = {"Authorization": "Bearer k1"}
        r = await env.http.post("/tokenize", json={"prompt": "hi"}, headers={"X-Request-ID": "tok-401"})
        assert r.status_code == 401
        r = await env.http.get("/v1/models/other-model", headers={**key, "X-Request-ID": "model-404"})
        assert r.status_code == 404
        r = await env.http.get("/v1/nothing%0Ahere", headers=key)
        assert r.status_code == 404
        made = r.headers["x-request-id"]
        r = await env.http.post("/v1/branches/no-such/end", headers={**key, "X-Request-ID": "gw/b:2"})
        assert r.status_code == 404
        r = await env.http.get("/v1/models", headers={**key, "X-Request-ID": "ok-1"})  # a success: no line
        assert r.status_code == 200
    rej = {e["rid"]: e for e in _events(logs, "request rejected")}
    assert set(rej) == {"tok-401", "model-404", made, api.request_rid("gw/b:2")}, rej
    assert all(e["log_level"] == "info" for e in rej.values())
    e = rej["tok-401"]
    assert (e["status"], e["path"], e["method"]) == (401, "/tokenize", "POST") and "API key" in e["error"]
    e = rej["model-404"]
    assert (e["status"], e["path"]) == (404, "/v1/models/other-model") and "other-model" in e["error"]
    assert (rej[made]["status"], rej[made]["path"]) == (404, "/v1/nothing\\nhere") and rej[made]["error"].endswith(": not found")
    e = rej[api.request_rid("gw/b:2")]
    assert (e["status"], e["path"], e["method"], e["client_request_id"]) == (404, "/v1/branches/no-such/end", "POST", "gw/b:2"), e
    assert "no-such" in e["error"]


async def test_a_bus_failure_on_another_path_logs_the_rid_and_the_id_as_sent(nats_url, tmp_path, logs, monkeypatch):
    """A bus failure answered 503 by the app's handler (here the NATS client's own error, which
    ``POST /v1/branches/{id}/end`` does not catch) logs the request's
    rid and, when the client's id was mapped, ``client_request_id``, as every request line does. Before, ``rid``
    was the id as sent (``gw/e:5``), not the rid the rest of the logs carry."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, headers={"X-Branch-Id": "b1"})
        assert r.status_code == 200

        async def down(*_a, **_k):
            raise nats.errors.ConnectionClosedError

        monkeypatch.setattr(env.service.bus, "publish", down)
        r = await env.http.post("/v1/branches/b1/end", headers={"X-Request-ID": "gw/e:5"})
        assert r.status_code == 503 and r.headers["x-request-id"] == "gw/e:5", r.text
    (line,) = _events(logs, "bus error answered as 503")
    assert (line["rid"], line["client_request_id"], line["path"]) == (api.request_rid("gw/e:5"), "gw/e:5", "/v1/branches/b1/end"), line


async def test_an_unknown_or_ended_parent_is_served_counted_and_warned_once_and_accepted_lines_carry_the_hints(nats_url, tmp_path, logs):
    """A fork whose ``X-Parent-Branch-Id`` the router never saw, or had ended, was accepted silently: a harness
    sending a wrong parent id lost the sharing hint unnoticed. It is still served (the parent may be another
    router's) but counted (``ei_router_branch_parents_missing_total{reason}``) and warned once per branch. The
    ``request accepted`` line carried ``branch`` only: now also ``kind``, ``parent`` and ``agent`` when sent."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}, log_requests=True, log_level="info") as env:
        async def post(rid: str, **h: str) -> None:
            r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1},
                                    headers={"X-Request-ID": rid, **{k.replace("_", "-"): v for k, v in h.items()}})
            assert r.status_code == 200, r.text

        await post("r-main", X_Branch_Id="main-1", X_Agent_Id="ag")
        await post("r-fork", X_Branch_Id="fork-1", X_Branch_Kind="fork", X_Parent_Branch_Id="main-1", X_Agent_Id="ag")
        for i in range(2):  # the same orphan twice: one warning, one count
            await post(f"r-orphan-{i}", X_Branch_Id="sub-1", X_Branch_Kind="subagent", X_Parent_Branch_Id="nobody")
        assert (await env.http.post("/v1/branches/main-1/end")).status_code == 200
        await post("r-late", X_Branch_Id="fork-2", X_Branch_Kind="fork", X_Parent_Branch_Id="main-1")
        await post("r-plain")
        metrics = (await env.http.get("/metrics")).text

    warned = [e for e in logs if e["event"] in ("branch parent unknown", "branch parent ended")]
    assert [(e["event"], e["log_level"], e["branch"], e["parent"]) for e in warned] == [
        ("branch parent unknown", "warning", "sub-1", "nobody"), ("branch parent ended", "warning", "fork-2", "main-1"),
    ]
    assert 'ei_router_branch_parents_missing_total{reason="unknown"} 1.0' in metrics
    assert 'ei_router_branch_parents_missing_total{reason="ended"} 1.0' in metrics
    acc = {e["rid"]: e for e in _events(logs, "request accepted")}
    hints = {rid: {k: e[k] for k in ("branch", "kind", "parent", "agent") if k in e} for rid, e in acc.items()}
    assert hints == {
        "r-main": {"branch": "main-1", "kind": "main", "agent": "ag"},
        "r-fork": {"branch": "fork-1", "kind": "fork", "parent": "main-1", "agent": "ag"},
        "r-orphan-0": {"branch": "sub-1", "kind": "subagent", "parent": "nobody"},
        "r-orphan-1": {"branch": "sub-1", "kind": "subagent", "parent": "nobody"},
        "r-late": {"branch": "fork-2", "kind": "fork", "parent": "main-1"},
        "r-plain": {"branch": None},
    }


async def test_parent_missing_warnings_are_rate_limited_per_state_and_the_counts_stay_exact(nats_url, tmp_path, logs):
    """Behind 2+ routers most forks' parents are another router's: the warning was one line per new branch, at the
    agents' request rate. Now each state logs its first 5 branches of an interval (the 5th says more are
    suppressed), then one ``log lines suppressed`` line with the count; the metric counts every branch."""
    async with router_env(nats_url, tmp_path, {"c0": "both"}) as env:
        async def post(bid: str, parent: str) -> None:
            r = await env.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1},
                                    headers={"X-Branch-Id": bid, "X-Branch-Kind": "fork", "X-Parent-Branch-Id": parent})  # fmt: skip
            assert r.status_code == 200, r.text

        for i in range(8):
            await post(f"orphan-{i}", "elsewhere")  # another router's parent
        assert (await env.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"X-Branch-Id": "m"})).status_code == 200
        assert (await env.http.post("/v1/branches/m/end")).status_code == 200
        await post("late-0", "m")  # another state: its own quota
        metrics = (await env.http.get("/metrics")).text
        assert [e["branch"] for e in _events(logs, "branch parent unknown")] == [f"orphan-{i}" for i in range(5)]  # was 8 lines
        plog = env.service._parent_log
        now = plog.clock()
        plog.clock = lambda: now + plog.interval_s  # the interval ends; the fence loop's next round flushes it
        await _wait_for(lambda: _events(logs, "log lines suppressed"), what="the suppressed-lines summary")

    unknown = _events(logs, "branch parent unknown")
    assert [e["branch"] for e in unknown] == [f"orphan-{i}" for i in range(5)]
    assert unknown[-1]["more_suppressed_for_s"] == 10.0 and "more_suppressed_for_s" not in unknown[0]
    assert [e["branch"] for e in _events(logs, "branch parent ended")] == ["late-0"]
    (summary,) = _events(logs, "log lines suppressed")
    assert (summary["key"], summary["suppressed"], summary["log_level"]) == ("branch parent unknown", 3, "warning"), summary
    assert 'ei_router_branch_parents_missing_total{reason="unknown"} 8.0' in metrics
    assert 'ei_router_branch_parents_missing_total{reason="ended"} 1.0' in metrics


async def test_request_lines_name_the_client_address_and_the_keys_id_and_every_401_is_counted(nats_url, tmp_path, logs):
    """A newcomer's walk: a 401's ``request rejected`` line had no client address (who is guessing keys?), the
    accepted / finished lines did not say which key sent them, and ``ei_router_requests_total{code}`` counted no
    401 of ``GET /v1/models``, ``/version``, ``/docs``, ``/openapi.json``. Now every such line has ``client``
    (``host:port``), a request let through has ``key`` (its key_id: 8 hex of an HMAC-SHA256 under a secret salt, never the key), and
    ``ei_router_http_responses_total{endpoint,code}`` counts every response with a bounded endpoint label."""
    import re

    from services.router.ingress import key_id

    async with router_env(nats_url, tmp_path, {"c0": "both"}, log_requests=True, api_keys="good-key-1") as env:
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        r = await env.http.post("/v1/completions", json=body, headers={"X-Request-ID": "nokey-1"})
        assert r.status_code == 401
        for path in ("/v1/models", "/version", "/docs", "/openapi.json", "/v1/cluster", "/some/guess/1", "/some/guess/2"):
            assert (await env.http.get(path)).status_code == 401, path
        r = await env.http.post("/v1/completions", json=body, headers={"Authorization": "Bearer good-key-1", "X-Request-ID": "ok-1"})
        assert r.status_code == 200, r.text
        await _wait_for(lambda: _events(logs, "request finished"), what="finished line")
        metrics = (await env.http.get("/metrics")).text
    rej = {e["rid"]: e for e in _events(logs, "request rejected")}
    assert re.fullmatch(r"127\.0\.0\.1:\d+", rej["nokey-1"]["client"]), rej["nokey-1"]
    assert "key" not in rej["nokey-1"]
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", e["client"]) for e in rej.values()), rej
    (acc,) = _events(logs, "request accepted")
    (fin,) = _events(logs, "request finished")
    assert acc["key"] == fin["key"] == key_id("good-key-1") and re.fullmatch(r"[0-9a-f]{8}", acc["key"])
    assert re.fullmatch(r"127\.0\.0\.1:\d+", acc["client"]) and fin["client"] == acc["client"]
    assert "good-key-1" not in repr(logs)
    for endpoint, code, n in (("/v1/completions", 401, 1), ("/v1/completions", 200, 1), ("/v1/models", 401, 1), ("/version", 401, 1),
                              ("/docs", 401, 1), ("/openapi.json", 401, 1), ("/v1/cluster", 401, 1), ("other", 401, 2)):
        line = f'ei_router_http_responses_total{{code="{code}",endpoint="{endpoint}"}} {float(n)}'
        alt = f'ei_router_http_responses_total{{endpoint="{endpoint}",code="{code}"}} {float(n)}'
        assert line in metrics or alt in metrics, (line, [ln for ln in metrics.splitlines() if "http_responses" in ln])
