"""``evolving-infra deploy-args``: the flags compose's entrypoint and the Slurm job give each service."""

from __future__ import annotations

import pytest

from evolving_infra.cli import main


@pytest.mark.parametrize("argv", [["deploy-args", "router", "--help"], ["deploy-args", "worker", "--nodes", "2", "-h"]])
def test_help_after_the_service_is_deploy_args_own(argv, capsys):
    """Everything after SERVICE is argparse's REMAINDER, handed to up's parser: ``deploy-args router --help``
    printed ``usage: evolving-infra up ...`` (up's help, which says nothing of deploy-args or its env line)."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: evolving-infra deploy-args"), out[:200]
    assert "UP_FLAGS" in out and "EI_DEPLOY_SPLIT" in out, out


@pytest.mark.parametrize("service", ["env", "router", "worker"])
def test_each_service_s_own_ei_metrics_port_is_not_refused(service, monkeypatch, capsys):
    """Compose sets EI_METRICS_PORT=9100 for every container (each its own network namespace) and the
    Slurm job one per service; ``up``'s refusal of one port for all its local services broke the compose
    stack: the auth job's ``deploy-args env`` exited 2 and nats never started."""
    monkeypatch.setenv("EI_METRICS_PORT", "9100")
    assert main(["deploy-args", service, "--nodes", "2", "--split", "1P1D"]) == 0, capsys.readouterr().err


def test_without_a_service_the_error_names_only_the_service(capsys):
    """``deploy-args`` alone said "the following arguments are required: service, UP_FLAGS", but UP_FLAGS
    may be empty (``deploy-args router`` runs): argparse counts a REMAINDER positional as required."""
    with pytest.raises(SystemExit) as e:
        main(["deploy-args"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "evolving-infra deploy-args: error: the following arguments are required: service (see 'evolving-infra deploy-args --help')\n", err
    assert main(["deploy-args", "kvdirectory"]) == 0


@pytest.mark.parametrize("service", ["env", "router", "worker"])
def test_routers_other_than_one_is_refused_not_ignored(service, capsys):
    """``deploy-args`` took ``--routers 2`` and printed one router's flags as for 1 (compose and the Slurm job run one
    router service): refused with a line naming what to do instead, as ``--kv-pool real`` is; ``--routers 1`` is fine."""
    assert main(["deploy-args", service, "--nodes", "2", "--routers", "1"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["deploy-args", service, "--nodes", "2", "--routers", "2"]) == 2
    err = capsys.readouterr().err
    assert "deploy-args does not support --routers 2" in err and "own --instance" in err, err


@pytest.mark.parametrize(
    "flags, split, launch",
    [
        (["--split", "2P2D"], "2P2D", "collocated"),  # the evolving planner's warm-up serves every node both first
        (["--split", "2P2D", "--planner-opt", "t_learn_s=0"], "2P2D", "2P2D"),  # no warm-up: the split at once
        (["--policy", "static:1P3D"], "1P3D", "1P3D"),
        (["--policy", "dynamo", "--split", "2P2D"], "2P2D", "2P2D"),
    ],
)
def test_env_names_the_split_the_workers_start_in(flags, split, launch, capsys):
    """Session 59: compose's entrypoint and the Slurm job started each worker in EI_DEPLOY_SPLIT's phase, and the
    evolving planner's first tick switched them all to both for its warm-up. EI_DEPLOY_LAUNCH_SPLIT is the split the
    workers start in, as `up` launches them (cluster.launch_phases); EI_DEPLOY_SPLIT stays the one served after."""
    assert main(["deploy-args", "env", "--nodes", "4", *flags]) == 0, capsys.readouterr().err
    lines = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert (lines["EI_DEPLOY_SPLIT"], lines["EI_DEPLOY_LAUNCH_SPLIT"]) == (split, launch)
