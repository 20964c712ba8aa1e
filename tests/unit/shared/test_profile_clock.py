"""A torch engine's profile (wall seconds measured at speed-up 1) on the cluster clock.

The torch engine's durations are wall x ``--speedup`` on the cluster clock (d0e723d); its profile's times
must be too, in every service that predicts from it: the router's TTFT prediction, the planner's priors, the
worker's transfer and fetch times. A sim engine's profile is simulated time already and stays as written.
"""

from __future__ import annotations

import msgspec
import pytest

from shared.config import load_config
from shared.profile import ProfileError, load_profile, on_cluster_clock

from evolving_infra.cluster import ClusterSpec, service_flags
from services.planner.config import PlannerConfig, planner_profile
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig, worker_profile

N = 20.0

TIMES = {"prefill": ("c0", "c1", "c2", "c3"), "decode": ("d0", "d1", "d2"), "links": ("gpu_to_gpu_latency_s", "peer_fetch_latency_s")}
"""Fields that are seconds (or seconds per unit): x speed-up."""
RATES = {"links": ("gpu_to_gpu_bytes_per_s", "peer_fetch_bytes_per_s", "host_to_gpu_bytes_per_s")}
"""Fields that are per second: / speed-up."""


def test_a_wall_profile_has_every_time_times_n_and_every_bandwidth_over_n_and_nothing_else_changes():
    wall = load_profile("torch-tiny-cpu")
    cl = on_cluster_clock(wall, "wall", N)
    for part in ("prefill", "decode", "links", "memory", "scheduler"):
        a, b = getattr(wall, part), getattr(cl, part)
        for f in a.__struct_fields__:  # every field of every part: a new time field must be listed above
            x, y = getattr(a, f), getattr(b, f)
            if f in TIMES.get(part, ()):
                assert y == pytest.approx(x * N), (part, f)
            elif f in RATES.get(part, ()):
                assert y == pytest.approx(x / N), (part, f)
            else:
                assert y == x, (part, f)
    assert msgspec.structs.replace(cl, prefill=wall.prefill, decode=wall.decode, links=wall.links) == wall
    assert cl.kv_transfer_s(1000) == pytest.approx(N * wall.kv_transfer_s(1000))
    assert cl.restore_s(1000) == pytest.approx(N * wall.restore_s(1000))
    assert cl.prefill.iteration_time(300, 45_150) == pytest.approx(N * wall.prefill.iteration_time(300, 45_150))


def test_a_cluster_profile_or_speedup_1_is_as_written_and_bad_values_are_refused():
    p = load_profile("gb300-glm52")
    assert on_cluster_clock(p, "cluster", N) is p
    assert on_cluster_clock(p, "wall", 1.0) is p
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ProfileError, match="positive finite"):
            on_cluster_clock(p, "wall", bad)
    with pytest.raises(ProfileError, match="'cluster' or 'wall'"):
        on_cluster_clock(p, "simulated", N)  # type: ignore[arg-type]


def _idle_ttft(cfg: RouterConfig) -> float:
    pol = cfg.routing_policy()
    return pol.predictor.estimate("w0", 0.0, uncached_tokens=300, cached_tokens=0).ttft_s


def test_router_predicts_n_times_the_speedup_1_ttft_from_a_torch_profile_at_speedup_n():
    """Before: a torch cluster's router read torch-tiny-cpu's wall seconds as cluster seconds, predicting
    1/N of the engine's time at --speedup N (demo, N = 50: the profile's prediction 50x too low)."""
    base = ["--routing", "ttft", "--profile", "torch-tiny-cpu", "--profile-clock", "wall"]
    t1 = _idle_ttft(load_config(RouterConfig, base + ["--speedup", "1"]))
    tn = _idle_ttft(load_config(RouterConfig, base + ["--speedup", str(N)]))
    assert t1 > 0 and tn == pytest.approx(N * t1)
    # a sim profile (the default clock) is simulated time: the same prediction at any speed-up
    sim = ["--routing", "ttft", "--profile", "torch-tiny-cpu"]
    assert _idle_ttft(load_config(RouterConfig, sim + ["--speedup", str(N)])) == pytest.approx(t1)


def test_planner_priors_and_torch_worker_profile_are_on_the_cluster_clock():
    wall = load_profile("torch-tiny-cpu")
    pl = planner_profile(load_config(PlannerConfig, ["--profile", "torch-tiny-cpu", "--profile-clock", "wall", "--speedup", str(N)]))
    assert pl.prefill.c0 == pytest.approx(N * wall.prefill.c0) and pl.decode.d0 == pytest.approx(N * wall.decode.d0)
    assert planner_profile(load_config(PlannerConfig, ["--profile", "torch-tiny-cpu", "--speedup", str(N)])) == wall
    w = worker_profile(load_config(WorkerConfig, ["--profile", "torch-tiny-cpu", "--engine", "torch", "--speedup", str(N)]))
    assert w.kv_transfer_s(512) == pytest.approx(N * wall.kv_transfer_s(512))
    assert w.links.peer_fetch_bytes_per_s == pytest.approx(wall.links.peer_fetch_bytes_per_s / N)
    # the sim engine's profile is simulated seconds: unchanged at any speed-up
    assert worker_profile(load_config(WorkerConfig, ["--profile", "torch-tiny-cpu", "--speedup", str(N)])) == wall


def test_up_gives_the_router_and_planner_a_wall_clock_for_the_torch_engine_only():
    torch = ClusterSpec(profile="torch-tiny-cpu", engine="torch", model_dir="/m", speedup=N)
    for svc, cls in (("router", RouterConfig), ("planner", PlannerConfig)):
        flags = service_flags(torch, svc)
        assert flags[flags.index("--profile-clock") + 1] == "wall"
        assert load_config(cls, flags).profile_clock == "wall"
        assert "--profile-clock" not in service_flags(ClusterSpec(speedup=N), svc)


def _fetch_estimate(cfg: RouterConfig):
    pol = cfg.routing_policy()
    return pol.predictor.estimate("w0", 0.0, uncached_tokens=300, cached_tokens=2048, fetch_tokens=2048)


def test_the_routers_fetch_model_and_copy_price_are_on_the_profiles_clock():
    """τ(x) (--ttft-fetch-base-s, --ttft-fetch-per-token-s) and κ (--ttft-copy-price-s-per-token) are seconds
    given as the profile's are: with a wall profile at --speedup N, x N like its Eq. 1/2 coefficients, so the
    whole score (prefill + exposed fetch + copy price) is N x the speed-up-1 one and the choice does not
    change. Before, they stayed cluster seconds: at N = 20 a fetch cost 1/20 of its wall time against the
    prefill's, and the router fetched where recomputing was cheaper."""
    base = ["--routing", "ttft", "--profile", "torch-tiny-cpu", "--profile-clock", "wall", "--ttft-fetch-base-s", "0.02"]
    e1 = _fetch_estimate(load_config(RouterConfig, base + ["--speedup", "1"]))
    en = _fetch_estimate(load_config(RouterConfig, base + ["--speedup", str(N)]))
    assert e1.fetch_s == pytest.approx(0.02 + 2048 * 1e-6) and e1.copy_s == pytest.approx(2048 * 1e-7)
    for f in ("score_s", "ttft_s", "fetch_s", "exposed_fetch_s", "copy_s"):
        assert getattr(en, f) == pytest.approx(N * getattr(e1, f)), f
    # a sim profile's (cluster clock) values are simulated seconds: as given at any speed-up
    sim = ["--routing", "ttft", "--profile", "torch-tiny-cpu", "--ttft-fetch-base-s", "0.02", "--speedup", str(N)]
    assert _fetch_estimate(load_config(RouterConfig, sim)) == e1


def test_a_hand_offs_kv_ready_slack_is_wall_time():
    """The slack past twice the transfer time that a received kv_ready_at keeps covers the hosts' clock offsets
    and the bus's delay, wall time: x --speedup on the cluster clock. Before, 1 cluster s: at speed-up 50 a
    hand-off whose prefill node's clock ran 0.1 wall s ahead (5 cluster s) was clamped, its decode started
    before its KV could have arrived."""
    from services.worker.service import kv_ready_bound

    assert kv_ready_bound(100.0, 2.0, 1.0) == pytest.approx(105.0)
    assert kv_ready_bound(100.0, 2.0, 50.0) == pytest.approx(154.0)
    assert 100.0 + 2.0 + 5.0 <= kv_ready_bound(100.0, 2.0, 50.0)  # 0.1 wall s ahead at speed-up 50: kept
