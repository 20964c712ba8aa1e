"""Live stack vs simulator on the same small trace (issue 4, fidelity check).

Runs ``evolving-infra fidelity``'s library path: the first sessions of the
shipped Claude Code sample through ``LocalCluster`` + ``LiveReplayer`` (real NATS,
every service a process, sim engines at a 2× speed-up) and through the
simulator with the live stack's settings. Throughput and mean TTFT must agree
within 10 % (bench/RESULTS.md has the measured numbers, with cache-aware routing).

The cluster here is one prefill and one decode node (1P1D), so that where a
request runs cannot differ between the two runs and the test compares what it
is for: the timing model. With two prefill nodes the mean TTFT depends on how
the three agents' branches are spread over them, and every policy that looks at
load (``cache-aware``'s ties, ``sticky``'s first placement by fewest in-flight)
sees the live router's counts a little late: a new branch routed while another
request's finish is still on its way lands elsewhere than in the simulator.
With ``sticky`` at 2P2D, 2 of 5 runs on this machine spread the sessions
differently and the live TTFT halved (sim +92%).

The simulator runs with the live run's control plane, measured per request
(``fidelity.control_plane``: send → work on the prefill node, fitted against the
prompt length, and first token → client), so that what is compared is the
engines' queueing and iteration times. Without it the simulator's TTFT was 9.6%
below the live one on a quiet machine and 12–19% below on a loaded one (each
wall millisecond of HTTP, prompt parsing, KV lookup and NATS counts 2× here;
≈ 0.1 s + 0.12 s per 100k prompt tokens of simulated time at load ≈ 5). With
it: +1.7…+6.6% over four runs at load 4–7 (bench/RESULTS.md); what is left is
mostly whether one agent's request arrives just behind a 608k-token prompt's
47-s prefill or the next one does (a 47-s or a 40-s wait).
"""

from __future__ import annotations

import pytest

from evolving_infra.sim.fidelity import FidelitySettings, fidelity, format_result


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_live_and_simulated_runs_agree(tmp_path):
    s = FidelitySettings(sessions=6, concurrency=3, speedup=2.0, max_pause_s=10.0, routing="sticky", nodes=2, split="1P1D")
    res = fidelity(s, tmp_path)
    print(format_result(res))
    assert res["live"]["requests_failed"] == 0 and res["sim"]["requests_failed"] == 0
    assert res["live"]["requests_completed"] == res["sim"]["requests_completed"] == res["requests"]
    cp = res["control_plane"]
    assert cp is not None and cp["requests"] == res["requests"] and cp["ingress_mean_s"] > 0 and cp["egress_s"] > 0
    rel = res["relative_difference"]
    assert abs(rel["throughput_rps"]) <= 0.10, rel
    assert abs(rel["ttft_mean_s"]) <= 0.10, rel
    assert abs(rel["e2e_mean_s"]) <= 0.20, rel
    assert (tmp_path / "fidelity.json").is_file() and (tmp_path / "live" / "report.json").is_file()
