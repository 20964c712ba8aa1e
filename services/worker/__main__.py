"""``python -m services.worker --node w0 --profile gb300-glm52 --phase both --speedup 100 --nats-url ...``"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from shared.config import ConfigError, load_config
from shared.log import setup_logging
from shared.profile import ProfileError
from shared.signals import claim_process
from shared.service import run_service_main
from services.worker.config import WorkerConfig, worker_profile
from services.worker.service import WorkerService
from shared.tokenizer import TokenizerError, load_tokenizer, output_vocabulary


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the config, check the profile, run the worker until SIGINT/SIGTERM (0), or until its
    engine fails beyond repair (``EngineFatal``: stopped, 1; its supervisor restarts it)."""
    try:
        cfg = load_config(WorkerConfig, argv, prog="worker", description="Evolving Infra worker (symmetric engine host)")
        worker_profile(cfg)
    except (ConfigError, ProfileError) as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    try:
        vocab = output_vocabulary(load_tokenizer(cfg.tokenizer))
    except TokenizerError as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_format, cfg.log_level, service="worker")

    def factory(c, bus, clock):  # type: ignore[no-untyped-def]
        return WorkerService(c, bus, clock, vocab=vocab)

    return run_service_main("worker", cfg, factory, instance=cfg.instance or f"worker-{cfg.node}")


if __name__ == "__main__":
    claim_process()  # this process's own service (not a caller's main(...)): its stop signals ignored once it stops
    sys.exit(main())
