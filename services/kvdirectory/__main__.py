"""``python -m services.kvdirectory --block-size 64 --nats-url nats://...``"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from shared.config import ConfigError, load_config
from shared.log import setup_logging
from shared.signals import claim_process
from shared.service import run_service_main

from .config import DirectoryConfig
from .service import DirectoryService


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the config (a bad one: one line on stderr, 2), run the KV directory; returns the exit
    status: 0 after SIGINT/SIGTERM, 1 when a loop it needs ended (``ServiceFailed``: one line on stderr
    naming the task; the traceback is in the directory's log)."""
    try:
        cfg = load_config(DirectoryConfig, argv, prog="kvdirectory", description="cluster-wide KV directory")
    except ConfigError as e:
        print(f"kvdirectory: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_format, cfg.log_level, service="kvdirectory")
    return run_service_main("kvdirectory", cfg, DirectoryService, instance=cfg.instance or "kvdirectory")


if __name__ == "__main__":
    claim_process()  # this process's own service (not a caller's main(...)): its stop signals ignored once it stops
    sys.exit(main())
