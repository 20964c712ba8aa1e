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
differently and the live TTFT halved (sim +92%). At 1P1D the simulator's
TTFT was 7.1% / 7.5% below the live one at a 2.5× speed-up (each millisecond of
the live control plane counts 2.5×, and one prefill node queues more) and 5.4%
below at 2× (throughput +2.2%, E2E −6.5%).
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
    rel = res["relative_difference"]
    assert abs(rel["throughput_rps"]) <= 0.10, rel
    assert abs(rel["ttft_mean_s"]) <= 0.10, rel
    assert abs(rel["e2e_mean_s"]) <= 0.20, rel
    assert (tmp_path / "fidelity.json").is_file() and (tmp_path / "live" / "report.json").is_file()
