"""``evolving-infra``: the one command users run.

Each feature area registers its own subcommands (``register(subparsers)`` in its
module), so this file only lists them. Every command that writes a report
takes ``--out DIR`` and leaves ``DIR/report.json`` there.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that contribute subcommands, in the order `--help` lists them.
COMMAND_MODULES = (
    "evolving_infra.launcher",  # up, demo
    "evolving_infra.replay.cli",  # replay
    "evolving_infra.traces.cli",  # trace validate|stats|convert|generate
    "evolving_infra.tap",  # tap
    "evolving_infra.report.cli",  # report show|compare
    "evolving_infra.split_cli",  # split get|set
    "evolving_infra.sim.cli",  # simulate, fidelity
    "evolving_infra.model_cli",  # model init (torch engine)
    "evolving_infra.auth_cli",  # auth gen
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evolving-infra",
        description="Agent-adaptive LLM serving on a prefill-decode disaggregated cluster.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
