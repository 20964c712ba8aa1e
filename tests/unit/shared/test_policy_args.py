"""One policy vocabulary for up, demo and simulate (issue 21): defaults, overrides, the live mapping."""

from __future__ import annotations

import pytest

from evolving_infra.cli import build_parser
from evolving_infra.cluster import LocalCluster
from evolving_infra.launcher import (
    DEMO_PLANNER, _spec, planner_warmup_line, ready_info, split_plan, warmup_end_line, warmup_end_s,
)
from evolving_infra.sim.cli import config_from_args
from evolving_infra.sim.config import resolve


def _argv(child, flag):
    return child.argv[child.argv.index(flag) + 1]


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_and_demo_run_the_papers_system_by_default(command, tmp_path):
    args = build_parser().parse_args([command, "--log-dir", str(tmp_path)])
    spec = _spec(args)
    assert (spec.routing, spec.planner, spec.eviction, spec.decode_binding, spec.split) == (
        "ttft", "evolving", "branch-count", "prefill-start", "2P2D")
    assert spec.planner_args == (tuple(f"{k}={v}" for k, v in DEMO_PLANNER.items()) if command == "demo" else ())
    kids = {c.name: c for c in LocalCluster(spec)._plan_children()}
    assert _argv(kids["planner"], "--planner") == "evolving" and _argv(kids["router"], "--routing") == "ttft"
    assert _argv(kids["worker-w0"], "--host-eviction") == "branch-count"
    assert _argv(kids["router"], "--decode-binding") == "prefill-start"
    if command == "demo":
        assert _argv(kids["planner"], "--planner-args") == "t_learn_s=900.0"
        spec = _spec(args, fence_after_s=10.0)  # what _demo passes (DEMO_FENCE_S)
        assert _argv({c.name: c for c in LocalCluster(spec)._plan_children()}["router"], "--fence-after-s") == "10.0"
    else:
        assert "--fence-after-s" not in kids["router"].argv


def test_simulate_defaults_to_the_same_policy():
    args = build_parser().parse_args(["simulate", "--workload", "claude-code", "--out", "x"])
    ps = resolve(config_from_args(args)).policy
    assert (ps.name, ps.routing, ps.planner, ps.eviction, ps.decode_binding, ps.switch_mode) == (
        "evolving", "ttft", "evolving", "branch-count", "prefill-start", "decoupled")


def test_baselines_and_per_part_overrides(tmp_path):
    p = build_parser()
    spec = _spec(p.parse_args(["up", "--policy", "static:3P1D", "--log-dir", str(tmp_path)]))
    assert (spec.routing, spec.planner, spec.eviction, spec.decode_binding, spec.split) == (
        "cache-aware", "static", "lru", "dispatch", "3P1D")
    spec = _spec(p.parse_args(["up", "--routing", "cache-aware", "--planner", "static", "--eviction", "lru",
                               "--split", "1P3D", "--log-dir", str(tmp_path)]))
    assert (spec.routing, spec.planner, spec.eviction, spec.split, spec.planner_args) == ("cache-aware", "static", "lru", "1P3D", ())
    spec = _spec(p.parse_args(["up", "--planner-opt", "t_learn_s=60", "--planner-opt", "slo_guard=false", "--log-dir", str(tmp_path)]))
    assert spec.planner_args == ("t_learn_s=60", "slo_guard=false")
    sim = config_from_args(p.parse_args(["simulate", "--workload", "putnam", "--out", "x", "--policy", "static", "--routing", "ttft"]))
    assert resolve(sim).policy.routing == "ttft" and resolve(sim).policy.planner == "static"


def test_routing_options_reach_the_live_router_as_its_flags(tmp_path):
    """``--routing-opt K=V`` (the simulator's vocabulary) becomes the router's own flag: a live test or
    operator sets the ttft policy's fetch model (paper Eq. 7's τ(x) and its threshold) this way."""
    from services.router.config import RouterConfig
    from shared.config import load_config

    p = build_parser()
    args = p.parse_args(["up", "--routing", "ttft", "--routing-opt", "ttft_fetch_min_tokens=64", "--routing-opt", "ttft-fetch-base-s=0.02",
                         "--routing-opt", "ttft_copy_price_s_per_token=0", "--log-dir", str(tmp_path)])
    spec = _spec(args)
    assert spec.router_args == ("--ttft-fetch-base-s", "0.02", "--ttft-fetch-min-tokens", "64", "--ttft-copy-price-s-per-token", "0.0")
    assert "--ttft-fetch-min-tokens 64" in args.live_policy.describe()
    argv = {c.name: c for c in LocalCluster(spec)._plan_children()}["router"].argv
    cfg = load_config(RouterConfig, argv[argv.index("services.router") + 1 :], prog="router", env={})
    assert (cfg.ttft_fetch_min_tokens, cfg.ttft_fetch_base_s, cfg.ttft_copy_price_s_per_token, cfg.routing) == (64, 0.02, 0.0, "ttft")
    assert _spec(p.parse_args(["up", "--log-dir", str(tmp_path)])).router_args == ()
    sim = config_from_args(p.parse_args(["simulate", "--workload", "putnam", "--out", "x", "--routing-opt", "ttft_fetch_min_tokens=64"]))
    assert sim.routing_options == {"ttft_fetch_min_tokens": 64}


@pytest.mark.parametrize("argv, frag", [
    (["--policy", "nope"], "unknown policy set"),
    (["--routing", "nope"], "routing policy 'nope'"),
    (["--planner", "nope"], "planner 'nope'"),
    (["--planner-opt", "objective=e2e"], "objective"),
    (["--planner-opt", "novalue"], "key=value"),
    # the types of the planner's parameters: t_learn_s=abc failed as "'<' not supported between instances of 'str' and
    # 'int'" and slo_guard=maybe (a truthy str) ran the SLO guard
    (["--planner-opt", "t_learn_s=abc"], r"^error: --planner-opt t_learn_s=abc: Expected float, got str - at \$\.t_learn_s \(planner evolving\)$"),
    (["--planner-opt", "slo_guard=maybe"], r"^error: --planner-opt slo_guard=maybe: Expected bool, got str - at \$\.slo_guard \(planner evolving\)$"),
    (["--planner", "dynamo", "--planner-opt", "min_endpoint=x"], r"^error: --planner-opt min_endpoint=x: Expected int, got str .*\(planner dynamo\)$"),
    (["--planner", "static", "--planner-opt", "x=1"], "takes no parameters"),
    (["--routing-opt", "nope=1"], "not a routing policy option"),
    (["--routing-opt", "block_size=8"], "set it with --block-size"),
    # the router's own settings (README: they reach up's router through EI_*); the refusal said only "not a
    # routing policy option" with the list of those that are
    (["--routing-opt", "shutdown_grace_s=5"], r"^error: --routing-opt shutdown_grace_s: a router setting \(--shutdown-grace-s\), "
                                              r"not a routing policy option: .* EI_SHUTDOWN_GRACE_S=5 evolving-infra up; routing policy options: .*ttft_fetch_min_tokens"),
    (["--routing-opt", "speedup=5"], "a router setting, not a routing policy option: set it with --speedup;"),
    # up sets max_context_tokens only with --engine torch; it passes --listen-fd itself; it drops the NATS connection
    # settings from its services under the embedded server (the advice to export them was wrong for all three)
    (["--routing-opt", "max_context_tokens=64"], r"a router setting \(--max-context-tokens\), not a routing policy option: up and "
                                                 r"demo set it for their router from the model with --engine torch; with the "
                                                 r"simulated engine .* EI_MAX_CONTEXT_TOKENS=64 evolving-infra up;"),
    (["--routing-opt", "listen_fd=3"], "listen_fd: a router setting that up and demo set for their router themselves;"),
    (["--routing-opt", "nats_tls_ca=/ca.pem"], r"nats_tls_ca: a NATS connection setting of every service, not a routing policy "
                                               r"option: with the embedded nats-server up and demo drop EI_NATS_TLS_CA from "
                                               r"their services' environment .* EI_NATS_TLS_CA=/ca.pem evolving-infra up "
                                               r"--nats-url URL passes it on;"),
    (["--routing-opt", "nats_password=hunter2"], r"nats_password: .*drop EI_NATS_PASSWORD .* EI_NATS_PASSWORD=\.\.\. evolving-infra up --nats-url"),
    (["--routing-opt", "nats_user=bob"], r"EI_NATS_USER=bob evolving-infra up --nats-url URL"),
    (["--routing-opt", "ttft_fetch_min_tokens=-1"], ">= 0"),
    (["--routing-opt", "ttft_fetch_base_s=fast"], "ttft_fetch_base_s"),
    (["--nodes", "3", "--policy", "static:2P2D"], r"split '2P2D' covers 4 nodes but the cluster has 3; pass --split xPyD with x \+ y = 3"),  # a policy's split; --nodes 3 alone now defaults to 2P1D
    (["--profile", "nope"], "^error: --profile nope: profile 'nope' not found"),  # was blamed on "--planner evolving / --planner-opt"
])
def test_bad_policy_flags_fail_with_the_reason(argv, frag, tmp_path):
    args = build_parser().parse_args(["up", *argv, "--log-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match=frag):
        _spec(args)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["up"], "collocated for its 1800-s warm-up (1800 s wall from its first tick; it ends on a 60-s slice boundary, "
                 "`split get` says when), "
                 "fitting each node's iteration-time models; then 2P2D, re-planned every 600 s"),
        (["demo"], "collocated for its 900-s warm-up (18.0 s wall from its first tick;"),
        (["up", "--split", "collocated"], "then the split with the lowest predicted mean latency over the warm-up"),
        (["up", "--planner-opt", "initial_split=3P1D"], "then 3P1D, re-planned"),
        (["up", "--planner-opt", "window_s=300", "--planner-opt", "slices=5"], "on a 60-s slice boundary, `split get` says when), "
                                                                               "fitting each node's iteration-time models; then 2P2D, re-planned every 300 s"),
        (["up", "--nodes", "3", "--split", "2P1D", "--planner-opt", "t_learn_s=60", "--speedup", "2"], "60-s warm-up (30.0 s wall from"),
        (["up", "--planner-opt", "t_learn_s=0"], None),
        (["up", "--policy", "static:3P1D"], None),
        (["up", "--policy", "dynamo"], None),
    ],
)
def test_up_and_demo_say_that_the_evolving_planner_warms_up_collocated(argv, expected, tmp_path):
    """`up` printed only "split 2P2D" while every node served both phases for the first 1,800 s."""
    args = build_parser().parse_args([*argv, "--log-dir", str(tmp_path)])
    spec = _spec(args)
    line = planner_warmup_line(args.live_policy, spec.split, spec.speedup)
    assert (line is None) if expected is None else (expected in line), line


@pytest.mark.parametrize(
    "argv, expected",
    [
        # before: "initial split 2P2D" while every node served collocated for the warm-up (~31 min of wall time);
        # before the cluster runs (the demo's header) the warm-up's length from the planner's first tick, as the next
        # line gives it (it said "~19 s wall" there, "18 s wall" on the next line, and the planner ended at 24 s)
        (["up"], "serving collocated for the planner's 1800-s warm-up (1800 s wall from its first tick, to the next "
                 "60-s slice boundary), then split 2P2D; planner evolving adapts it"),
        (["up", "--speedup", "10"], "serving collocated for the planner's 1800-s warm-up (180 s wall from its first "
                                    "tick, to the next 60-s slice boundary), then split 2P2D; planner evolving adapts it"),
        (["up", "--split", "collocated"], "serving collocated for the planner's 1800-s warm-up (1800 s wall from its "
                                          "first tick, to the next 60-s slice boundary), then the split the warm-up "
                                          "predicts best; planner evolving adapts it"),
        (["demo"], "serving collocated for the planner's 900-s warm-up (18.0 s wall from its first tick, to the next "
                   "60-s slice boundary), then split 2P2D; planner evolving adapts it"),
        (["up", "--planner-opt", "t_learn_s=0"], "initial split 2P2D; planner evolving adapts it"),
        (["up", "--policy", "dynamo"], "initial split 2P2D; planner dynamo adapts it"),
        (["up", "--policy", "static:3P1D"], "split 3P1D"),
    ],
)
def test_the_ready_line_says_what_the_split_will_do(argv, expected, tmp_path):
    """`up`'s ready line said "split 2P2D" while the evolving planner switched every node to both ~0.2 s later, then
    "initial split 2P2D" while every node served collocated for the whole warm-up: it says when that ends now."""
    args = build_parser().parse_args([*argv, "--log-dir", str(tmp_path)])
    spec = _spec(args)
    assert split_plan(args.live_policy, spec.split, spec.speedup) == expected


@pytest.mark.parametrize(
    "argv, serving, end_s, end_wall_s, after",
    [
        (["up"], "collocated", 1860.0, 1860.0, "2P2D"),
        (["up", "--speedup", "10"], "collocated", 1860.0, 186.0, "2P2D"),
        (["up", "--split", "collocated"], "collocated", 1860.0, 1860.0, None),
        (["up", "--planner-opt", "initial_split=3P1D"], "collocated", 1860.0, 1860.0, "3P1D"),
        (["up", "--planner-opt", "t_learn_s=0"], "2P2D", 0.0, 0.0, "absent"),
        (["up", "--policy", "static:3P1D"], "3P1D", 0.0, 0.0, "absent"),
    ],
)
def test_the_ready_json_says_what_is_served_now(argv, serving, end_s, end_wall_s, after, tmp_path):
    """The READY JSON's ``"split"`` named the split served after the warm-up while a plain ``up`` served collocated
    until it ended: ``serving`` says what is served now, ``split`` is kept as it was (the launch split)."""
    args = build_parser().parse_args([*argv, "--log-dir", str(tmp_path)])
    spec = _spec(args)
    info = {"router_url": "http://127.0.0.1:1", "split": spec.split, "speedup": spec.speedup, "pids": {}}
    ready = ready_info(info, args.live_policy, spec.split, spec.speedup)
    assert {k: ready[k] for k in info} == info and list(ready)[:3] == ["router_url", "split", "serving"]
    assert (ready["serving"], ready["warmup_end_s"], ready["warmup_end_wall_s"]) == (serving, end_s, pytest.approx(end_wall_s))
    assert ready.get("split_after_warmup", "absent") == after


def test_the_ready_json_gives_the_announced_warmup_end_and_says_whence(tmp_path):
    """Review 55 M1: at ``--speedup 50`` READY said ``"warmup_end_s": 1860.0, "warmup_end_wall_s": 37.2`` while the
    planner (first tick when its adoption ended, ~3 wall s = 150 simulated s) announced 1980: READY gives the
    announced end (``up`` waits for it), says whether it is the planner's or an estimate, and from when the wall
    figure counts (``cluster_start_unix``)."""
    args = build_parser().parse_args(["up", "--nodes", "2", "--speedup", "50", "--log-dir", str(tmp_path)])
    spec = _spec(args)
    info = {"router_url": "http://127.0.0.1:1", "split": spec.split, "speedup": spec.speedup, "pids": {}}
    ready = ready_info(info, args.live_policy, spec.split, spec.speedup, end=(1980.0, True), clock_origin=1.7e9)
    assert {k: ready[k] for k in ("warmup_end_s", "warmup_end_wall_s", "cluster_start_unix", "warmup_end_source")} == {
        "warmup_end_s": 1980.0, "warmup_end_wall_s": pytest.approx(39.6), "cluster_start_unix": 1.7e9,
        "warmup_end_source": "planner"}
    guessed = ready_info(info, args.live_policy, spec.split, spec.speedup, end=(1920.0, False))
    assert (guessed["warmup_end_s"], guessed["warmup_end_source"]) == (1920.0, "estimate")
    assert ready_info(info, args.live_policy, spec.split, spec.speedup)["warmup_end_source"] == "estimate"
    static = build_parser().parse_args(["up", "--policy", "static:1P1D", "--nodes", "2", "--log-dir", str(tmp_path)])
    _spec(static)
    plain = ready_info(info, static.live_policy, "1P1D", 1.0, end=None)
    assert plain["warmup_end_s"] == 0.0 and "warmup_end_source" not in plain
    # the estimate for a later first tick: the first 60-s slice boundary at or after it + 1800 s
    assert [warmup_end_s(args.live_policy, first_tick_s=t) for t in (0.2, 60.0, 150.0, 181.0)] == [1860.0, 1860.0, 1980.0, 2040.0]
    line = split_plan(args.live_policy, spec.split, spec.speedup, 1980.0, announced=True)
    assert line == ("serving collocated until t=1980 s, the end of the planner's 1800-s warm-up (39.6 s wall after the "
                    "cluster's start, as the planner announced), then split 1P1D; planner evolving adapts it"), line
    assert "(~38.4 s wall after the cluster's start, an estimate" in split_plan(args.live_policy, spec.split, spec.speedup, 1920.0)
    demo = build_parser().parse_args(["demo", "--log-dir", str(tmp_path)])
    dspec = _spec(demo)  # sets live_policy
    assert warmup_end_line(demo.live_policy, dspec.split, dspec.speedup, 1200.0, announced=True) == (
        "planner warm-up: every node collocated until t=1200 s, the end of the planner's 900-s warm-up (24.0 s wall "
        "after the cluster's start, as the planner announced), then split 2P2D")
    assert warmup_end_line(static.live_policy, "1P1D", 1.0, 0.0, announced=False) is None


_SIM = "--profile gb300-glm52 --block-size 64 --model evolving-infra-sim --tokenizer sim"
_WORKER = "--profile gb300-glm52 --stream-interval 1 --tokenizer sim"


@pytest.mark.parametrize("up, nodes, router, planner, eviction, phases", [
    (["--policy", "evolving"], 4, "--routing ttft --decode-binding prefill-start --decode-routing least-loaded",
     "--split 2P2D --planner evolving", "branch-count", "BBBB"),
    (["--policy", "static:2P2D"], 4, "--routing cache-aware --decode-binding dispatch --decode-routing round-robin",
     "--split 2P2D --planner static", "lru", "PPDD"),
    (["--policy", "dynamo"], 3, "--routing cache-aware --decode-binding dispatch --decode-routing round-robin",
     "--split 2P1D --planner dynamo", "lru", "PPD"),
    (["--policy", "arrow"], 4, "--routing cache-aware --decode-binding prefill-start --decode-routing round-robin",
     "--split 2P2D --planner arrow", "lru", "PPDD"),
    (["--policy", "evolving", "--planner-opt", "t_learn_s=300", "--routing-opt", "sticky_ttl_s=5"], 4,
     "--routing ttft --decode-binding prefill-start --decode-routing least-loaded --sticky-ttl-s 5.0",
     "--split 2P2D --planner evolving --planner-args t_learn_s=300", "branch-count", "BBBB"),
    (["--policy", "evolving", "--planner-opt", "t_learn_s=0"], 4, "--routing ttft --decode-binding prefill-start "
     "--decode-routing least-loaded", "--split 2P2D --planner evolving --planner-args t_learn_s=0", "branch-count", "PPDD"),
])
def test_up_gives_each_service_the_flags_it_gave_before_service_flags_and_deploy_args_the_same(
        tmp_path, up, nodes, router, planner, eviction, phases):
    """Each child's service flags for every policy set, as ``LocalCluster._plan_children`` wrote them before
    they moved into ``cluster.service_flags`` (recorded from c96aa25; the flag order within a worker changed,
    and the router's ``--decode-routing`` came with session 58: round-robin for the baselines, as simulate runs
    them), and ``deploy-args`` (compose, Slurm) prints a run of each child's argv. The evolving planner's workers
    start ``both`` (B) for its collocated warm-up since session 59 (``cluster.launch_phases``), without one in the split."""
    from evolving_infra.deploy_cli import deploy_args

    argv_up = [*up, "--nodes", str(nodes)]
    kids = {c.name: c.argv for c in LocalCluster(_spec(build_parser("up").parse_args(["up", *argv_up, "--log-dir", str(tmp_path)])))._plan_children()}
    ids = ",".join(f"w{i}" for i in range(nodes))

    def flags(argv):  # the service's own flags (after the common ones), flag -> value; each flag once
        tail = argv[argv.index("json") + 1 :]
        pairs = list(zip(tail[::2], tail[1::2]))
        assert len({k for k, _ in pairs}) == len(pairs) and len(tail) % 2 == 0, tail
        return {k: v for k, v in pairs if k != "--port-file"}

    def want(text):
        items = text.split()
        return dict(zip(items[::2], items[1::2]))

    # --routers (session 54): the routers whose republish a (re)started directory waits for
    assert flags(kids["kvdirectory"]) == want(f"--block-size 64 --nodes {ids} --routers router")
    assert flags(kids["planner"]) == want(f"--nodes {ids} {planner} --profile gb300-glm52")
    assert flags(kids["router"]) == want(f"--host 127.0.0.1 --port 8000 {router} {_SIM}")
    for i, phase in enumerate(phases):
        phase = {"P": "prefill", "D": "decode", "B": "both"}[phase]
        assert flags(kids[f"worker-w{i}"]) == want(f"--node w{i} --phase {phase} {_WORKER} --host-eviction {eviction}")
    for service, child in (("kvdirectory", "kvdirectory"), ("planner", "planner"), ("router", "router"), ("worker", "worker-w0")):
        printed, _ = deploy_args(argv_up, service)
        argv = kids[child]
        assert any(argv[i : i + len(printed)] == printed for i in range(len(argv))), (service, printed, argv)
    # deploy-args (compose's entrypoint, the Slurm job: one router, `router`) gives the directory its --routers too:
    # compose's gave only --block-size, so a router stalled across a directory restart there was not waited for
    printed, _ = deploy_args(argv_up, "kvdirectory")
    assert printed == ["--block-size", "64", "--routers", "router"], printed


def test_the_baselines_bind_decode_round_robin_live_as_simulate_does(tmp_path):
    """``up --policy static:1P2D`` printed a note that simulate's round-robin decode routing was not the live
    router's (session 42: six requests one at a time all decoded on w1; cache-aware binds the least loaded, ties to
    the lowest id), so up's baseline was not the paper's (SGLang PD: decode round-robin). The router now gets
    ``--decode-routing round-robin`` for static, dynamo and arrow (no note), least-loaded for evolving;
    ``--decode-routing`` overrides the set's, as in simulate; the banner and the report's meta say it."""
    from evolving_infra.deploy_cli import deploy_args

    def live(*extra):
        args = build_parser().parse_args(["up", "--nodes", "3", *extra, "--log-dir", str(tmp_path)])
        spec = _spec(args)
        router = {c.name: c for c in LocalCluster(spec)._plan_children()}["router"]
        return args.live_policy, spec, _argv(router, "--decode-routing")

    for policy in ("static:1P2D", "dynamo", "arrow"):
        pol, spec, flag = live("--policy", policy)
        assert (pol.decode_routing, spec.decode_routing, flag) == ("round-robin", "round-robin", "round-robin"), policy
        assert not [n for n in pol.notes if "decode" in n], pol.notes
        assert ", decode routing round-robin," in pol.describe() and pol.meta()["decode_routing"] == "round-robin"
        printed, line = deploy_args(["--nodes", "3", "--policy", policy], "router")
        assert printed[printed.index("--decode-routing") + 1] == "round-robin" and "decode routing round-robin" in line
    pol, spec, flag = live("--policy", "evolving")
    assert (pol.decode_routing, flag) == ("least-loaded", "least-loaded") and "decode routing" not in pol.describe()
    pol, spec, flag = live("--policy", "static:1P2D", "--decode-routing", "least-loaded")
    assert (pol.decode_routing, flag) == ("least-loaded", "least-loaded")
    pol, spec, flag = live("--policy", "evolving", "--decode-routing", "round-robin")
    assert (pol.decode_routing, flag) == ("round-robin", "round-robin")


@pytest.mark.parametrize("command", ["up", "demo"])
def test_a_static_set_run_at_another_split_is_named_by_the_split_served(command, tmp_path):
    """`up --policy static:5P1D --split 3P1D` served 3P1D but its banner, deploy-args' EI_DEPLOY_POLICY and the demo
    report's meta.policy said static:5P1D. The set is now named by the split served (static:3P1D), with a note."""
    args = build_parser().parse_args([command, "--nodes", "4", "--policy", "static:5P1D", "--split", "3p1d",
                                      "--log-dir", str(tmp_path)])
    _spec(args)
    pol = args.live_policy
    assert (pol.name, pol.split, pol.meta()["name"]) == ("static:3P1D", "3P1D", "static:3P1D")
    assert pol.describe().startswith("policy static:3P1D: ")
    assert any("--split 3P1D overrides policy static:5P1D's split" in n for n in pol.notes), pol.notes
    same = build_parser().parse_args([command, "--policy", "static:2P2D", "--split", "2P2D", "--log-dir", str(tmp_path)])
    _spec(same)
    assert same.live_policy.name == "static:2P2D"  # the set's own split: as it was, without the note
    assert not any("overrides" in n for n in same.live_policy.notes), same.live_policy.notes
    free = build_parser().parse_args([command, "--policy", "dynamo", "--split", "3P1D", "--log-dir", str(tmp_path)])
    _spec(free)
    assert free.live_policy.name == "dynamo"  # an adaptive set's split is only its initial one


def test_simulate_names_a_static_set_by_the_split_it_serves():
    from evolving_infra.sim.sweep import sweep_items

    args = build_parser().parse_args(["simulate", "--workload", "claude-code", "--nodes", "4", "--policy", "static:5P1D",
                                      "--split", "3P1D", "--out", "x"])
    run = resolve(config_from_args(args))
    assert (run.split, run.policy.name, run.policy.split) == ("3P1D", "static:3P1D", "3P1D")
    args = build_parser().parse_args(["simulate", "--workload", "claude-code", "--nodes", "4", "--split", "3P1D",
                                      "--sweep", "policies", "static:5P1D,dynamo", "--out", "x"])
    assert [label for label, _ in sweep_items(config_from_args(args), args.sweep)] == ["static:3P1D", "dynamo"]


@pytest.mark.parametrize(("policy", "flag"), [("static:2P2D", None), ("evolving", "route"), ("evolving", "enqueue"),
                                              ("evolving", None)])
def test_the_banner_names_the_decode_binding_as_the_flag_takes_it(policy, flag, tmp_path):
    """The banner said "decode binding dispatch" (the router's name) for a static set: `up --decode-binding dispatch`,
    which a user copies from it, is an argparse error. It now names the flag's values that run that way."""
    argv = ["up", "--policy", policy, "--log-dir", str(tmp_path)] + (["--decode-binding", flag] if flag else [])
    args = build_parser().parse_args(argv)
    _spec(args)
    said = args.live_policy.describe().rsplit("decode binding ", 1)[1]
    choices = ("enqueue", "prefill-start", "route")
    assert said in choices or said == "at dispatch (enqueue / route)", said
    assert (said == "prefill-start") == (args.live_policy.decode_binding == "prefill-start")


def test_no_routing_or_planner_option_is_checked_by_resolving_annotations():
    """``simulate`` (and ``up``) with no ``--routing-opt`` / ``--planner-opt``: the router's config is its defaults, as
    resolving it from no value gives, and the checks compile no annotation text (each field's ``typing.ForwardRef``
    is a ``compile()``: ~45 M instructions of a 600-s run at 512-token blocks went to resolving the router config's
    fields for nothing). In a fresh process: msgspec keeps what it resolved once."""
    import subprocess
    import sys

    from services.router.config import RouterConfig
    from shared.config import resolve_config

    from evolving_infra.policy_args import resolve_routing_options
    from evolving_infra.sim.config import SIM_OWN_ROUTING_OPTIONS

    assert resolve_routing_options({}, SIM_OWN_ROUTING_OPTIONS) == resolve_config(RouterConfig, {}, env={}) == RouterConfig()
    code = (
        "import sys\n"
        "import services.planner.evolving\n"
        "from services.router.config import RouterConfig\n"
        "from evolving_infra.policy_args import check_planner_options, resolve_routing_options\n"
        "from evolving_infra.sim.config import SIM_OWN_ROUTING_OPTIONS\n"
        "compiled = []\n"
        "sys.addaudithook(lambda event, args: compiled.append(args[0]) if event == 'compile' else None)\n"
        "cfg = resolve_routing_options({}, SIM_OWN_ROUTING_OPTIONS)\n"
        "check_planner_options('evolving', {})\n"
        "print(len(compiled), type(cfg).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "RouterConfig"]
