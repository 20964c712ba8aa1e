"""The evolving planner's warm-up when the nodes serve only after it ended (``demo --engine torch``).

Seen (2026-12-05, ``demo --engine torch --model DIR``, speed-up 50, 4 nodes, ``t_learn_s`` 240): the planner
ticked first at cluster t≈604 s, so its warm-up ran to t=900 s; the torch workers, importing torch and
loading the model on a busy 2-core machine, started serving only at t≈1165 s (their first log line 23 wall s
after the cluster's start) and the replay ran t≈1219-1812 s. At t=900 the planner had not one iteration
record ("no data: ... (0 usable iteration records)") and extended the warm-up by ``no_data_retry_s`` from
then, to t=1500 s: a timer that began before any node served, so the fit got whatever part of the replay
fell before it (none, in a run whose replay ended earlier: "warm-up extended to t=1260s" and the run ended
first). Now the first record after a warm-up without any restarts it: ``t_learn_s`` from that record.
"""

from __future__ import annotations

import numpy as np

from shared.messages import IterationRecord
from shared.profile import load_profile
from shared.split import split_name, split_phases
from services.planner.evolving import EvolvingPlanner
from services.planner.policy import make_planner

TORCH = load_profile("torch-tiny-cpu")
NODES = ["w0", "w1", "w2", "w3"]
SPEEDUP = 50.0


def torch_records(t0: float, n: int, *, seed: int) -> list[IterationRecord]:
    """``n`` records as a collocated torch worker publishes them (services/worker/scheduler.py): short
    agent prompts (prefill chunks of 100-400 uncached tokens, mixed when a decode batch runs beside them),
    decode batches of 1-4, durations and starts in cluster seconds (wall seconds of a CPU forward × speed-up)."""
    rng = np.random.default_rng(seed)
    out = []
    t = t0
    for kind in rng.choice(["prefill", "decode", "mixed"], size=n, p=[0.2, 0.5, 0.3]):
        uc = int(rng.integers(100, 400)) if kind != "decode" else 0
        b = int(rng.integers(1, 5)) if kind != "prefill" else 0
        wall = 0.0
        if kind != "decode":
            wall += TORCH.prefill.iteration_time(uc, uc * (uc + 1) // 2, 0)
        if kind != "prefill":
            wall += TORCH.decode.iteration_time(b)
        if kind == "mixed":
            wall -= min(TORCH.prefill.c0, TORCH.decode.d0)
        dur = wall * SPEEDUP * float(np.exp(rng.normal(0.0, 0.1)))
        out.append(IterationRecord(
            start=t, duration_s=dur, phase=str(kind), prefill_requests=int(kind != "decode"),  # type: ignore[arg-type]
            sum_uncached=uc, sum_qk_pairs=uc * (uc + 1) // 2, decode_batch=b,
        ))
        t += dur
    return out


def test_the_first_record_after_a_warmup_without_any_restarts_it():
    pl = make_planner("evolving", NODES, TORCH, t_learn_s=240.0, sample_interval_s=0.0)
    assert isinstance(pl, EvolvingPlanner)
    both = pl.tick(604.0, split_phases("2P2D", NODES), set()).phases  # first tick as in the demo
    assert pl.next_tick() == 900.0
    assert pl.tick(900.0, both, set()) is None  # the workers are still loading: nothing arrived
    ev = pl.take_decisions()[-1]
    assert ev.reason.startswith("no data") and "0 usable iteration records: no node has published one yet" in ev.reason, ev.reason
    assert "restarts at the first record (240 s from it)" in ev.reason, ev.reason
    assert pl.next_tick() == 1500.0  # no record ever: the retry
    for k, n in enumerate(NODES):  # the workers serve from t=1000: 240 s from then ends at the slice boundary t=1260
        pl.on_iterations(n, torch_records(1000.0 + k, 40, seed=k), 1000.0 + k)
    assert pl.next_tick() == 1260.0
    ev = pl.take_decisions()[-1]
    assert ev.action == "warmup" and "warm-up restarted" in ev.reason and "until t=1260s" in ev.reason, ev.reason
    assert "restarted at the first iteration record" in (pl.take_split_note() or "")
    d = pl.tick(1260.0, both, set())
    assert d is not None and split_name(d.phases) == "2P2D" and pl.frozen
    ev = pl.take_decisions()[-1]
    assert ev.action == "switch" and ev.metrics["nodes_fitted"] == 4.0, ev


def test_no_data_says_how_many_records_a_node_needs_and_has():
    pl = make_planner("evolving", NODES, TORCH, t_learn_s=240.0, sample_interval_s=0.0)
    both = pl.tick(0.0, split_phases("2P2D", NODES), set()).phases
    pl.on_iterations("w0", torch_records(10.0, 5, seed=1), 10.0)  # too few on every node
    assert pl.tick(240.0, both, set()) is None
    ev = pl.take_decisions()[-1]
    assert "5 usable iteration records; a node needs 8 with a prefill part and 8 with a decode part (min_fit_samples)" in ev.reason, ev.reason
    assert "restarts" not in ev.reason and pl.next_tick() == 840.0  # records came: the plain retry
    pl.on_iterations("w1", torch_records(300.0, 5, seed=2), 300.0)
    assert pl.next_tick() == 840.0
