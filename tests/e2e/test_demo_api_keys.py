"""``demo`` and ``fidelity`` start their own router, which reads ``EI_API_KEYS`` like any router:
their own replay must send one of the keys (it sent none: every request was a 401)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.router.ingress import ApiKeyError, local_client_key


def test_local_client_key_follows_the_routers_environment(tmp_path):
    assert local_client_key({}) is None  # open router: no header
    assert local_client_key({"EI_API_KEYS": " zz, aa ,"}) == "aa"
    assert local_client_key({"EI_API_KEYS": "zz", "EI_API_KEY": "mine"}) == "mine"
    f = tmp_path / "keys"
    f.write_text("# ops\nkf\n")
    assert local_client_key({"EI_API_KEYS_FILE": str(f)}) == "kf"
    with pytest.raises(ApiKeyError, match="cannot read"):
        local_client_key({"EI_API_KEYS_FILE": str(tmp_path / "missing")})


def test_demo_completes_every_request_with_api_keys_in_the_environment(tmp_path):
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--sessions", "2", "--concurrency", "2", "--speedup", "100",
           "--out", str(tmp_path / "demo")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")}
    env |= {"EI_API_KEYS": "k-demo-1,k-demo-2", "EI_STATE_DIR": str(tmp_path / "state")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report["requests_failed"] == 0 and report["requests_completed"] == report["requests_sent"] > 0
    assert report["meta"]["max_retries"] == 2  # its replayer's (the OpenAI SDK's default): report compare checks it
    # the report folder keeps the logs, not the stopped cluster's NATS seeds (demo-out/logs/nats-creds/*.nk, the
    # operator's and admin's included, stayed in the folder users share)
    assert list((tmp_path / "demo" / "logs").glob("*.log")) and not list((tmp_path / "demo").rglob("*.nk"))


def test_demo_with_an_unreadable_keys_file_says_so_before_starting(tmp_path):
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--sessions", "2", "--out", str(tmp_path / "demo")]
    env = {**os.environ, "EI_API_KEYS_FILE": str(tmp_path / "missing"), "EI_STATE_DIR": str(tmp_path / "state")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "cannot read API keys" in p.stderr, (p.stdout + p.stderr)[-3000:]
    assert "cluster ready" not in p.stdout
