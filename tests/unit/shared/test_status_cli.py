"""``evolving-infra status``: one look at the running cluster, from the ``up`` state file, the router's
``GET /v1/cluster`` and the planner's ``split.get``. Before session 59 there was no such command (``status`` was an
invalid choice, exit 2): an operator pieced the state together from ``split get``, ``/v1/cluster``, the state file and
``LOG_DIR/cluster.json``.

Here: the text and JSON built from a captured ``/v1/cluster`` answer and state file (a planner left down, a fenced
node), the choice of the cluster among the state files, ``describe()``'s ``left_down_info`` on a real supervised
crash loop, and the command's exit statuses against a real HTTP server serving the captured answer (0), a router
that does not answer (1, the state file's part printed all the same), no cluster (1) and a bad ``--timeout`` (2).
The live run (``up``, then ``status`` and a planner left down) is ``tests/e2e/test_up_status.py``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from evolving_infra.cli import main
from evolving_infra.state import ClusterNotFound, write_state
from evolving_infra.status_cli import build_status, duration, format_status, pick_cluster

NOW = 1_796_672_000.0

CLUSTER = {  # a router's GET /v1/cluster of a 2-node `up --profile tiny --speedup 20`, w1 fenced (trimmed of nothing used)
    "policy": "ttft", "decode_routing": "least-loaded", "decode_rule": "least_loaded_kv_room", "block_size": 64,
    "speedup": 20.0, "vocab_size": 32000, "epoch": 2,
    "split_reason": "warm-up: every node serves both phases until t=1860s to fit the iteration-time models",
    "split_heard_s": 31.25, "fence_after_s": 3.0, "routable": True, "reason": "", "inflight": 1, "branches_active": 0,
    "router": "router", "remote_inflight": {},
    "nodes": [
        {"node": "w0", "phase": "both", "split_phase": "both", "reported_phase": "both", "eligible": True, "fenced": False,
         "fence_events": 0, "state_age_s": 4.0, "accepting": True, "epoch": 2, "engine": "sim", "running": 1, "waiting": 0,
         "decoding": 1, "queue_len": 0, "gpu_free_blocks": 48, "gpu_total_blocks": 64, "host_used_blocks": 0,
         "host_total_blocks": 256, "inflight": 1, "inflight_prefill": 0, "inflight_decode": 1, "kv_silent_s": 0.1,
         "kv_last_batch_s": 0.1, "kv_stale": False, "state_age_wall_s": 0.2},
        {"node": "w1", "phase": "both", "split_phase": "both", "reported_phase": "both", "eligible": False, "fenced": True,
         "fence_events": 1, "state_age_s": 140.0, "accepting": True, "epoch": 2, "engine": "sim", "running": 0, "waiting": 0,
         "decoding": 0, "queue_len": 0, "gpu_free_blocks": 64, "gpu_total_blocks": 64, "host_used_blocks": 0,
         "host_total_blocks": 256, "inflight": 0, "inflight_prefill": 0, "inflight_decode": 0, "kv_silent_s": 7.0,
         "kv_last_batch_s": 7.0, "kv_stale": True, "state_age_wall_s": 7.0},
    ],
}

STATE = {  # an `up` state file (describe() + _state_fields) with the planner left down after a crash loop
    "router_url": "http://127.0.0.1:8000", "router_listen": "127.0.0.1:8000", "nats_url": "nats://u:secret@127.0.0.1:4222",
    "nats_auth": "nkeys", "log_dir": "/tmp/logs", "split": "1P1D", "speedup": 20.0,
    "pids": {"kvdirectory": 101, "worker-w0": 103, "worker-w1": 104, "router": 105, "nats-server": 100},
    "restarts": {"kvdirectory": 0, "planner": 1, "worker-w0": 0, "worker-w1": 2, "router": 0, "nats-server": 0},
    "left_down": ["planner"],
    "left_down_info": {"planner": {"since_unix": NOW - 40.0, "retry_at_unix": NOW + 560.0,
                                   "effect": "the split is frozen at collocated (no split changes) while the routers and workers serve on"}},
    "metrics": {"router": "http://127.0.0.1:9100/metrics", "planner": "http://127.0.0.1:9101/metrics"},
    "partition": "p0", "tokenizer": "sim", "model": "evolving-infra-sim", "block_size": 64, "policy": "evolving",
    "engine": "sim", "profile": "tiny", "nodes": 2, "routers": 1, "started_unix": NOW - 125.0, "max_restarts": 1,
    "restart_window_s": 600.0, "pid": 99, "state_file": "/run/evolving-infra/up-99.json",
}


def _status(**kw):
    args = dict(router_url="http://127.0.0.1:8000", planner_error="LEFT DOWN by up after a crash loop", now_unix=NOW,
                alive=lambda pid: pid != 104)
    return build_status(STATE, CLUSTER, **{**args, **kw})


def test_the_text_says_cluster_split_nodes_and_services_in_a_screen():
    lines = format_status(_status(), now_unix=NOW)
    text = "\n".join(lines)
    assert 12 <= len(lines) <= 25, text
    assert lines[0] == ("cluster: up pid 99, up 2m05s (cluster clock t=2500 s); policy evolving, speedup 20, engine sim, "
                        "profile tiny, 2 nodes, partition p0")  # fmt: skip
    assert "router http://127.0.0.1:8000   NATS nats://u:***@127.0.0.1:4222   logs /tmp/logs" in text  # no password
    assert "secret" not in text
    assert "metrics: 2 endpoints (/metrics on ports 9100, 9101)" in text
    assert "router: answered (router), routable, 1 in flight" in text
    # served: the unfenced nodes' phases; the router's epoch and how long ago it heard the planner
    assert "split: serving collocated (w0=both); router epoch 2, heard the planner's split 31 s ago" in text
    assert "  planner: LEFT DOWN by up after a crash loop" in text
    assert "nodes (2):" in text
    w0 = next(x for x in lines if x.startswith("  w0"))
    assert "ok" in w0 and "state 0.2 s ago" in w0 and "running 1 waiting 0 queue 0" in w0 and "GPU KV 25% of 64 blocks" in w0
    w1 = next(x for x in lines if x.startswith("  w1"))
    assert "FENCED" in w1 and "state 7.0 s ago" in w1 and "(KV view stale)" in w1
    assert "services (6, 1 LEFT DOWN):" in text
    svc = {x.split()[0]: x for x in lines[lines.index("services (6, 1 LEFT DOWN):") + 1:]}
    assert list(svc) == ["nats-server", "router", "kvdirectory", "planner", "worker-w0", "worker-w1"]  # by kind
    assert svc["router"].endswith("running (pid 105)")
    assert svc["planner"].endswith("planner      LEFT DOWN after a crash loop 40 s ago, 1 restart; tried again in 9m20s; "
                                   "the split is frozen at collocated (no split changes) while the routers and workers serve on")  # fmt: skip
    assert svc["worker-w1"].endswith("NOT RUNNING (exited; up restarts it), 2 restarts")  # its pid is gone


def test_the_json_holds_the_same_for_scripts():
    s = json.loads(json.dumps(_status()))
    assert s["cluster"]["launcher_pid"] == 99 and s["cluster"]["uptime_s"] == 125.0 and s["cluster"]["policy"] == "evolving"
    assert s["cluster"]["nats_url"] == "nats://u:***@127.0.0.1:4222"
    assert s["router"] == {"url": "http://127.0.0.1:8000", "answered": True, "error": None, "instance": "router",
                           "routable": True, "reason": "", "inflight": 1}  # fmt: skip
    assert s["split"]["serving"] == "collocated" and s["split"]["phases"] == {"w0": "both"}
    assert s["split"]["heard_s"] == 31.25 and s["split"]["router_epoch"] == 2 and s["split"]["planner"] is None
    assert [(n["node"], n["fenced"], n["gpu_kv_used"]) for n in s["nodes"]] == [("w0", False, 0.25), ("w1", True, 0.0)]
    planner = next(x for x in s["services"] if x["name"] == "planner")
    assert planner["state"] == "left_down" and planner["since_unix"] == NOW - 40.0 and planner["retry_at_unix"] == NOW + 560.0
    assert planner["effect"].startswith("the split is frozen at collocated")
    assert {x["name"]: x["state"] for x in s["services"]}["worker-w1"] == "not_running"


def test_the_planners_answer_is_printed_as_split_get_prints_it():
    planner = {"epoch": 3, "split": "1P1D", "phases": {"w0": "prefill", "w1": "decode"}, "reason": "operator", "decided_at": 9.5}
    text = "\n".join(format_status(_status(planner=planner, planner_error=None), now_unix=NOW))
    assert "  planner: epoch 3: 1P1D (w0=prefill w1=decode); reason: operator" in text


def test_a_router_that_does_not_answer_leaves_the_state_files_part():
    s = build_status(STATE, None, router_url="http://127.0.0.1:8000", router_error="no answer within 3 s", now_unix=NOW,
                     alive=lambda pid: True)  # fmt: skip
    text = "\n".join(format_status(s, now_unix=NOW))
    assert "router: NO ANSWER from http://127.0.0.1:8000: no answer within 3 s: the split served and the nodes are unknown" in text
    assert "nodes (" not in text and s["nodes"] == [] and s["split"]["serving"] is None
    assert "services (6, 1 LEFT DOWN):" in text and s["router"]["answered"] is False


def test_without_a_state_file_the_router_alone_is_shown():
    s = build_status(None, CLUSTER, router_url="http://h:8000", now_unix=NOW)
    text = "\n".join(format_status(s, now_unix=NOW))
    assert text.startswith("cluster: no local state file (given by --router-url); policy ttft, speedup 20")
    assert "services: unknown (no state file" in text and s["services"] is None
    assert "planner: not asked" in text


def test_durations():
    assert [duration(x) for x in (None, -1.0, float("nan"), 0.44, 31.25, 125.0, 7260.0)] == [
        "?", "?", "?", "0.4 s", "31 s", "2m05s", "2h01m"]


def test_the_cluster_is_picked_by_router_url_or_nats_url_and_several_are_named():
    a = {"router_url": "http://127.0.0.1:8000", "nats_url": "nats://127.0.0.1:4222", "pid": 1, "partition": "p0"}
    b = {"router_url": "http://127.0.0.1:8001", "nats_url": "nats://x:pw@127.0.0.1:4223", "pid": 2, "partition": "p1"}
    assert pick_cluster([a], router_url=None, nats_url=None, partition=None) is a
    assert pick_cluster([a, b], router_url="http://127.0.0.1:8001/", nats_url=None, partition=None) is b
    assert pick_cluster([a, b], router_url=None, nats_url="nats://127.0.0.1:4222", partition=None) is a
    assert pick_cluster([a, b], router_url=None, nats_url=None, partition="p1") is b
    assert pick_cluster([a, b], router_url="http://elsewhere:8000", nats_url=None, partition=None) is None
    with pytest.raises(ClusterNotFound, match=r"2 local clusters are running: .*pid 1.*pid 2.*; pass --router-url") as e:
        pick_cluster([a, b], router_url=None, nats_url=None, partition=None)
    assert "pw" not in str(e.value)
    with pytest.raises(ClusterNotFound, match=r"no running local cluster found .*start one with `evolving-infra up`"):
        pick_cluster([], router_url=None, nats_url=None, partition=None)


def test_describe_says_since_when_and_until_when_a_service_is_left_down(tmp_path):
    from tests.unit.shared.test_supervise_control_plane import _close, _cluster, _crash_past_the_limit, _named

    c = _cluster(tmp_path, ["kvdirectory", "planner", "worker-w0", "worker-w1", "router"])
    try:
        assert "left_down_info" not in c.describe()
        svc = _named(c, "planner")
        t = _crash_past_the_limit(c, svc, svc.started_at)
        import time

        before = time.time()
        assert c.supervise_once(t) == [] and svc.left_down
        info = c.describe()["left_down_info"]
        assert list(info) == ["planner"]
        assert before - 1 <= info["planner"]["since_unix"] <= time.time() + 1
        # tried again restart_window_s (600 s) after its last exit, which the fake clock put at t
        assert info["planner"]["retry_at_unix"] == pytest.approx(time.time() + (t + 600.0 - time.monotonic()), abs=2.0)
        assert info["planner"]["effect"] == c.down_effect("planner") and "split is frozen" in info["planner"]["effect"]
    finally:
        _close(c)


class _Router(BaseHTTPRequestHandler):
    body = json.dumps(CLUSTER).encode()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        ok = self.path == "/v1/cluster"
        self.send_response(200 if ok else 404)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(self.body if ok else b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def router():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state_file(tmp_path, monkeypatch, router_url: str) -> None:
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("EI_NATS_URL", raising=False)
    info = {k: v for k, v in STATE.items() if k not in ("pid", "state_file")}
    info.update(router_url=router_url, nats_url=f"nats://127.0.0.1:{_closed_port()}", started_unix=__import__("time").time() - 5)
    info["pids"] = {k: os.getpid() for k in info["pids"]}
    write_state(info, pid=os.getpid())  # this process plays the launcher: its pid is alive


def test_status_finds_the_cluster_by_its_state_file_and_exits_0_when_its_router_answers(tmp_path, monkeypatch, capsys, router):
    _state_file(tmp_path, monkeypatch, router)
    assert main(["status", "--timeout", "2"]) == 0
    out = capsys.readouterr().out
    assert re.match(rf"cluster: up pid {os.getpid()}, up \d+(\.\d)? s \(cluster clock t=\d+ s\); policy evolving", out), out
    assert "split: serving collocated (w0=both)" in out and "FENCED" in out
    assert "planner: LEFT DOWN by up after a crash loop" in out  # not asked: up left it down
    assert main(["status", "--json", "--timeout", "2"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["router"]["answered"] and s["cluster"]["launcher_pid"] == os.getpid() and len(s["nodes"]) == 2


def test_a_planner_not_left_down_is_asked_within_the_timeout(tmp_path, monkeypatch, capsys, router):
    """No NATS server at the state file's URL: the planner's line says so; the router answered: exit 0."""
    _state_file(tmp_path, monkeypatch, router)
    path = next((tmp_path / "state").glob("up-*.json"))
    info = json.loads(path.read_text())
    del info["left_down"], info["left_down_info"]
    path.write_text(json.dumps(info))
    import time

    t0 = time.monotonic()
    assert main(["status", "--timeout", "1"]) == 0
    assert time.monotonic() - t0 < 5.0
    out = capsys.readouterr().out
    assert "  planner: not asked: cannot connect to NATS" in out, out


def test_a_router_that_does_not_answer_is_exit_1_with_the_state_files_part(tmp_path, monkeypatch, capsys):
    _state_file(tmp_path, monkeypatch, f"http://127.0.0.1:{_closed_port()}")
    assert main(["status", "--timeout", "1"]) == 1
    out = capsys.readouterr().out
    assert "router: NO ANSWER from http://127.0.0.1:" in out and "services (6, 1 LEFT DOWN):" in out
    assert main(["status", "--json", "--timeout", "1"]) == 1
    assert json.loads(capsys.readouterr().out)["router"]["answered"] is False


def test_no_cluster_is_exit_1_and_a_bad_timeout_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path / "none"))
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no running local cluster found (no live state file in ") and "--router-url" in err
    assert main(["status", "--timeout", "0"]) == 2
    assert "--timeout must be a number of seconds > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["status", "--bogus"])
    assert e.value.code == 2
