"""One liveness time for the router and the planner (``up``/``demo --fence-after-s``; session 43).

Before, ``demo`` gave its router ``--fence-after-s 10`` (``DEMO_FENCE_S``: a worker starved of CPU on a
shared machine is slow, not dead) but left the planner at its ``--silent-after-s`` default of 3 s, so the
planner laid an operator's split over the "live" nodes and swapped a phase off a node the router still
routed to; ``up`` had no way to set either. Now ``up``/``demo --fence-after-s S`` gives the router its
``--fence-after-s S`` and the planner its ``--silent-after-s S`` (and ``deploy-args`` does so for compose
and Slurm); left out, ``up`` passes neither (both services' default, 3 s) and ``demo`` passes 10 to both.
"""

from __future__ import annotations

import pytest

from evolving_infra.cli import UsageError, build_parser
from evolving_infra.cluster import LocalCluster, service_flags
from evolving_infra.launcher import DEMO_FENCE_S, _spec
from services.planner.config import PlannerConfig
from services.router.config import RouterConfig
from shared.config import load_config


def _argv(command: str, tmp_path, *flags: str) -> dict[str, list[str]]:
    """Each child's service argv (after ``-m services.X``) as ``command`` would start it."""
    args = build_parser(command).parse_args([command, "--log-dir", str(tmp_path), *flags])
    return {k.name: k.argv[k.argv.index("-m") + 2 :] for k in LocalCluster(_spec(args))._plan_children()}


@pytest.mark.parametrize("command", ["up", "demo"])
def test_fence_after_s_reaches_the_planner_as_silent_after_s_and_the_router(command, tmp_path):
    kids = _argv(command, tmp_path, "--fence-after-s", "7.5")
    planner = load_config(PlannerConfig, kids["planner"], prog="planner", env={})
    router = load_config(RouterConfig, kids["router"], prog="router", env={})
    assert (planner.silent_after_s, router.fence_after_s) == (7.5, 7.5)
    assert kids["router"].count("--fence-after-s") == 1 and kids["planner"].count("--silent-after-s") == 1


def test_without_the_flag_up_keeps_the_services_defaults_and_demo_gives_both_its_10_s(tmp_path):
    up = _argv("up", tmp_path)
    assert not any("--fence-after-s" in a or "--silent-after-s" in a for a in up.values())
    demo = _argv("demo", tmp_path)
    planner = load_config(PlannerConfig, demo["planner"], prog="planner", env={})
    router = load_config(RouterConfig, demo["router"], prog="router", env={})
    assert planner.silent_after_s == router.fence_after_s == DEMO_FENCE_S == 10.0


def test_deploy_args_carry_it_too():
    spec = _spec(build_parser("up").parse_args(["up", "--fence-after-s", "5"]), one_host=False)
    planner, router = service_flags(spec, "planner"), service_flags(spec, "router")
    assert planner[planner.index("--silent-after-s") + 1] == "5.0"
    assert router[router.index("--fence-after-s") + 1] == "5.0"


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_up_refuses_a_fence_time_that_is_not_a_positive_number(value, tmp_path):
    args = build_parser("up").parse_args(["up", "--log-dir", str(tmp_path), "--fence-after-s", value])
    with pytest.raises(UsageError, match=f"--fence-after-s {value}: wall seconds, a number > 0"):
        _spec(args)


def test_up_help_says_it_feeds_both(capsys):
    with pytest.raises(SystemExit):
        build_parser("up").parse_args(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--fence-after-s S" in text and "--silent-after-s" in text and "default 3" in text
