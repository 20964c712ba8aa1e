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
