"""``python -m services.router`` as a process: port 0 + --port-file, health, clean SIGTERM, startup errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_process_serves_on_port_zero_and_stops_on_sigterm(nats_url, tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.router", "--nats-url", nats_url, "--port", "0", "--port-file", str(port_file),
         "--model", "m1", "--split-get-timeout-s", "0.5", "--no-route-wait-s", "0.5", "--log-format", "json"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "router did not write its port file"
            time.sleep(0.05)
        port = int(port_file.read_text())
        assert port > 0
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            assert http.get("/v1/models").json()["data"][0]["id"] == "m1"
            hz = http.get("/healthz")
            assert hz.status_code == 503 and "no live prefill" in hz.json()["error"]["message"]
            r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
            assert r.status_code == 503
        time.sleep(1.0)  # past --split-get-timeout-s: the give-up line is logged
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
        assert '"router listening"' in out and f'"port": {port}' in out
        assert "planner did not answer split.get" in out
        assert not port_file.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--routing", "nope"], "unknown routing policy 'nope'"),
        (["--tokenizer", "bpe"], "unknown tokenizer"),
        (["--cache-threshold", "2"], "invalid configuration"),
    ],
)
def test_startup_errors_are_clear(args, message):
    out = subprocess.run([sys.executable, "-m", "services.router", *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert message in out.stderr


def test_port_in_use_is_a_clear_startup_error(nats_url):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "services.router", "--nats-url", nats_url, "--port", str(port), "--split-get-timeout-s", "0"],
            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=30,
        )
    assert out.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in out.stdout + out.stderr
