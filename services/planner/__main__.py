"""``python -m services.planner --nodes w0,w1,w2,w3 --split 2P2D``"""

from services.planner.config import PlannerConfig
from services.planner.service import PlannerService
from shared.config import load_config
from shared.log import setup_logging
from shared.service import run_service


def main() -> None:
    cfg = load_config(PlannerConfig, prog="planner", description="Evolving Infra planner: PD split, online iteration-time models and split policies")
    setup_logging(cfg.log_format, cfg.log_level, service="planner")
    run_service("planner", cfg, PlannerService, instance=cfg.instance or "planner")


if __name__ == "__main__":
    main()
