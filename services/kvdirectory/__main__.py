"""``python -m services.kvdirectory --block-size 64 --nats-url nats://...``"""

from __future__ import annotations

from shared.config import load_config
from shared.log import setup_logging
from shared.service import run_service

from .config import DirectoryConfig
from .service import DirectoryService


def main() -> None:
    cfg = load_config(DirectoryConfig, prog="kvdirectory", description="cluster-wide KV directory")
    setup_logging(cfg.log_format, cfg.log_level, service="kvdirectory")
    run_service("kvdirectory", cfg, DirectoryService, instance=cfg.instance or "kvdirectory")


if __name__ == "__main__":
    main()
