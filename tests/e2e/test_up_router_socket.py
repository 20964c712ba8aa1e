"""`evolving-infra up` and its router's listening socket (``LocalCluster.router_socket``, the router's ``--listen-fd``).

Real processes: ``up`` with its embedded nats-server, workers on the simulated engine, the router. ``up`` holds the
router's socket so that a client connecting while a SIGTERMed router drains, exits and is started again waits in the
accept queue for the next router (``tests/e2e/test_faults_live.py``, router-term). These cases are where nothing
would take that queue, and the address the socket is bound to.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.conftest import ipv6_loopback
from tests.e2e._up import read_ready
from tests.e2e._up import stop as _stop

pytestmark = pytest.mark.timeout(240)


def _up(tmp_path: Path, *extra: str, lines: list[str] | None = None) -> tuple[subprocess.Popen[str], dict[str, object]]:
    """``up`` on a free port with ``extra`` flags, once it printed READY: the process and the READY line's JSON
    (``lines``: gets the lines up printed until then)."""
    cmd = [sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "2", "--split", "1P1D", "--profile", "tiny",
           "--port", "0", "--policy", "static", "--log-dir", str(tmp_path / "logs"), *extra]  # fmt: skip
    env = {**os.environ, "EI_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        ready = read_ready(proc, lines)
    except AssertionError as e:
        _stop(proc)
        pytest.fail(f"up never READY: {e}")
    assert proc.stdout is not None
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
    return proc, ready


def test_no_restart_router_drain_answers_a_new_connection_at_once(tmp_path):
    """``up --no-restart``: no router comes after a SIGTERMed one (the cluster stops when it exits), so ``up`` does
    not hold its socket and the router binds its own: a client connecting during the drain gets the router's 503
    "router draining" at once. Before, ``up`` held the socket whatever --no-restart said, the draining router stopped
    accepting for a next router that never came: the client waited out the whole drain (7 s here) and then had its
    connection reset when the cluster stopped."""
    proc, ready = _up(tmp_path, "--no-restart", "--speedup", "0.05")  # a slow clock: a 200-token stream runs ~7 s
    try:
        url = str(ready["router_url"])
        pid = int(ready["pids"]["router"])  # type: ignore[index]
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        first = threading.Event()
        streamed: list[str] = []

        def stream() -> None:
            body = {"model": model, "prompt": "a long one", "max_tokens": 200, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    streamed.append(line)
                    first.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert first.wait(20), "the stream never started"
        os.kill(pid, signal.SIGTERM)
        log = tmp_path / "logs" / "router.log"
        deadline = time.monotonic() + 10
        while '"router draining"' not in log.read_text():
            assert time.monotonic() < deadline, "no drain: " + log.read_text()[-2000:]
            time.sleep(0.02)
        t0 = time.monotonic()
        try:
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "late", "max_tokens": 2}, timeout=5)
        except httpx.HTTPError as e:
            pytest.fail(f"a connection made during the drain got {e!r} after {time.monotonic() - t0:.1f} s, not the 503")
        assert r.status_code == 503 and "router draining" in r.text, r.text
        t.join(30)
        assert "data: [DONE]" in streamed, streamed[-3:]  # the drain finished the open stream
    finally:
        _stop(proc)


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_up_on_an_ipv6_address_serves_at_a_bracketed_url(tmp_path):
    """``up --host ::1 --metrics --metrics-host ::1``: the router's socket is bound on the IPv6 loopback, and ``up`` reaches it at
    ``http://[::1]:PORT``; the metrics ports are found on that address too. Before, the URL was ``http://::1:PORT``:
    ``up`` died with a traceback (httpx.InvalidURL: Invalid port ':1:PORT') in its readiness wait, after NATS and
    every service had started; with ``--metrics`` it died sooner, its free-port probe binding ``::1`` on IPv4. The
    router's and the metrics endpoints' "listening" log lines bracket it too."""
    proc, ready = _up(tmp_path, "--host", "::1", "--metrics", "--metrics-host", "::1")  # metrics: 127.0.0.1 by default
    try:
        url = str(ready["router_url"])
        assert url.startswith("http://[::1]:"), url
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        metrics = str(ready["metrics"]["router"])  # type: ignore[index]
        assert metrics.startswith("http://[::1]:"), metrics
        assert httpx.get(metrics, timeout=10).status_code == 200
        # the "router listening" / "metrics listening" log lines give the same URLs (they were http://::1:PORT)
        logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log"))
        assert f'"{url}"' in logs and f'"{metrics}"' in logs, logs[-2000:]
        assert "http://::1:" not in logs
    finally:
        _stop(proc)


def test_up_on_every_interface_with_port_0_prints_the_bound_port_and_a_url_that_connects(tmp_path, monkeypatch):
    """``up --host 0.0.0.0 --port 0`` (newcomer walk): the banner's open-router warning said ``0.0.0.0:0`` (the port
    asked for, not the one bound) and the router URL in the banner and READY was ``http://0.0.0.0:PORT``, not one to
    paste into a client. Now the URL is the loopback's (as vLLM prints), the banner says the router listens on all
    interfaces, READY's ``router_listen`` gives the bound address, and the warning names the bound port."""
    monkeypatch.delenv("EI_API_KEYS", raising=False)
    monkeypatch.delenv("EI_API_KEYS_FILE", raising=False)
    lines: list[str] = []
    proc, ready = _up(tmp_path, "--host", "0.0.0.0", lines=lines)
    try:
        url = str(ready["router_url"])
        port = int(url.rsplit(":", 1)[1])
        assert url == f"http://127.0.0.1:{port}" and port > 0 and ready["router_listen"] == f"0.0.0.0:{port}", ready
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        banner = "".join(lines)
        assert f"cluster ready: router http://127.0.0.1:{port} (listening on all interfaces, 0.0.0.0:{port})" in banner, banner
        assert f"API keys OFF and the router listens on 0.0.0.0:{port}:" in banner and "0.0.0.0:0" not in banner, banner
    finally:
        _stop(proc)
