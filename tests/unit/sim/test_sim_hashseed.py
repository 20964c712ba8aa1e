"""``simulate`` gives the same report in every process: the string hashing ``PYTHONHASHSEED``
salts (a new salt per process by default) must decide no order that reaches an output.

A set of branch-id strings once decided the order in which a decode→prefill reset released a
node's branches (fixed in fa9e4dd): the count messages then reached the worker's L2 in another
order, its branch-count eviction kept other pages, and a run with decode→prefill switches under
L2 pressure gave another report under another seed. The run below is small but has what that
needed (forced D↔P switches every 10 s, forks, sub-agents, compactions, L2 evictions of counted
pages) and fails on the code before that fix (24 report keys and requests.jsonl differed between
seeds 1 and 2). Both processes run at once: ~2 s CPU each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evolving_infra.launcher import demo_trace_path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import sim_ab  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SMALL = {  # gb300-glm52 with 1/3 of its KV memory (L2 = 2 × L1) and a 10× faster prefill: L2 fills in a minute
    "name": '"hashseed-small"',
    "gpu_kv_tokens": "700000",  # the sample's longest prompt (651,035 tokens) still fits
    "host_kv_tokens": "1400000",
    "c1": "2.27e-6",
    "c2": "1.8e-11",
}


def _profile(path: Path) -> Path:
    text = (ROOT / "shared" / "profiles" / "gb300-glm52.toml").read_text()
    for key, value in SMALL.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
        assert n == 1, key
    path.write_text(text)
    return path


def test_simulate_gives_the_same_report_under_another_hash_seed(tmp_path):
    profile = _profile(tmp_path / "small.toml")
    args = [
        "--trace", str(demo_trace_path()), "--profile", str(profile), "--tile", "3", "--nodes", "4",
        "--concurrency", "90", "--max-pause", "5", "--block-size", "512", "--duration", "170",
        "--split", "2P2D", "--switch-every", "10", "--switch-to", "1P3D", "--no-plots",
    ]  # fmt: skip
    outs = [tmp_path / f"seed{s}" for s in (1, 2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "evolving_infra.cli", "simulate", *args, "--out", str(out)],
            cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": str(seed)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for seed, out in zip((1, 2), outs)
    ]
    for p in procs:
        _, err = p.communicate(timeout=100)
        assert p.returncode == 0, err[-2000:]
    rep = json.loads((outs[0] / "report.json").read_text())
    # the run has what a hash-ordered release needed to show: D→P resets of counted branches,
    # L2 evictions of counted pages on prefill nodes, forks and sub-agents
    assert rep["kv_directory"]["phase.reset_branches"] > 0
    assert rep["host_evictions"]["prefill.positive_count"] > 0
    assert rep["fork_branches"] > 0 and rep["subagent_branches"] > 0
    assert rep["requests_completed"] > 300
    assert sim_ab.differences(*outs) == []


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no thread pool on one core")
def test_sim_ab_child_starts_no_openblas_thread_pool(tmp_path):
    """sim_ab's child imports the simulator (numpy with it) before the CLI sets ``OPENBLAS_NUM_THREADS=1`` for
    simulate: it sets it first, or OpenBLAS's pool (a thread a core) spins in the CPU seconds it measures."""
    probe = sim_ab.LOOP_CPU.replace("from evolving_infra.cli import main",
                                    "print(len(os.listdir('/proc/self/task')), flush=True)\nfrom evolving_infra.cli import main")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    p = subprocess.run([sys.executable, "-c", probe, "--version"], capture_output=True, text=True, cwd=ROOT,
                       env={**env, "PYTHONPATH": str(ROOT), "SIM_AB_LOOP_CPU": str(tmp_path / "loop")})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[0] == "1"  # the main thread alone
