"""``python -m services.planner --nodes w0,w1,w2,w3 --split 2P2D``"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.planner.config import PlannerConfig
from services.planner.service import PlannerService
from shared.config import ConfigError, load_config
from shared.log import setup_logging
from shared.signals import claim_process
from shared.service import run_service_main


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the config (a bad one: one line on stderr, 2), run the planner; returns the exit status:
    0 after SIGINT/SIGTERM, 1 when a loop it needs ended (``ServiceFailed``: one line on stderr naming
    the task; the traceback is in the planner's log)."""
    try:
        cfg = load_config(PlannerConfig, argv, prog="planner", description="Evolving Infra planner: PD split, online iteration-time models and split policies")
    except ConfigError as e:
        print(f"planner: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_format, cfg.log_level, service="planner")
    return run_service_main("planner", cfg, PlannerService, instance=cfg.instance or "planner")


if __name__ == "__main__":
    claim_process()  # this process's own service (not a caller's main(...)): its stop signals ignored once it stops
    sys.exit(main())
