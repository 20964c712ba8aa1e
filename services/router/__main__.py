"""``python -m services.router``: run the router (HTTP ingress + routing) until SIGINT/SIGTERM.

Example::

    python -m services.router --host 127.0.0.1 --port 8000 --routing cache-aware \\
        --tokenizer sim --model my-model --nats-url nats://127.0.0.1:4222
"""

from __future__ import annotations

import contextlib
import signal
import sys

from shared.config import ConfigError, load_config
from shared.log import setup_logging
from shared.signals import claim_process
from shared.service import process_label, run_service_main

from services.router.config import RouterConfig
from services.router.ingress import set_key_id_salt
from services.router.service import RouterService
from shared.net import inherited_socket
from shared.tokenizer import TokenizerError, load_tokenizer


def main(argv: list[str] | None = None) -> int:
    """Parse the config, check policy, tokenizer and ``--listen-fd``, run the service; returns the exit status: 0 after
    SIGINT/SIGTERM, 2 on a bad configuration, 1 when a task the router needs ended (``ServiceFailed``:
    one line on stderr naming the task; the traceback is in the router's log). A line after the configuration is read
    names the instance where it is not ``router`` (``router router-2: --listen-fd 9 is not ...``, as every service's
    exit line, :func:`~shared.service.process_label`): ``up --routers N`` runs router, router-1, ...; each said
    ``router:``.

    SIGHUP is ignored from here on except while the service runs, when it reloads the API keys
    (:meth:`RouterService.reload_api_keys`): one that came during the start (``up``'s SIGUSR1 forwarded to a router
    it had just restarted) killed it (status 129, counted as a crash), and so did one during the stop. ``up`` starts
    its routers with SIGHUP ignored already (``LocalCluster``), which covers the interpreter's start before this. A
    router with ``--api-keys-reload-file`` reads it once when it sets its handler, so a SIGHUP ignored during the start
    loses no key change."""
    with contextlib.suppress(ValueError):  # not the main thread (a test): the caller's signals are its own
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        cfg = load_config(RouterConfig, argv, prog="router", description="Evolving Infra router: OpenAI-compatible HTTP ingress and PD routing")
    except ConfigError as e:
        print(f"router: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_format, cfg.log_level, service="router")
    if cfg.api_key_id_salt:  # the ids in its log lines agree with the other routers' of the cluster
        set_key_id_salt(cfg.api_key_id_salt)
    instance = cfg.instance or "router"
    label = process_label("router", instance)
    try:
        cfg.routing_policy()  # unknown policy, bad option or profile → exit 2
        tokenizer = load_tokenizer(cfg.tokenizer)
    except (ValueError, TokenizerError) as e:
        print(f"{label}: {e}", file=sys.stderr)
        return 2
    if cfg.listen_fd >= 0:
        try:  # before NATS and the services' start: a bad descriptor is one line and exit 2, not a traceback later
            inherited_socket(cfg.listen_fd).detach()
        except OSError as e:
            print(f"{label}: {e.strerror}", file=sys.stderr)
            return 2
    for note in getattr(tokenizer, "notes", []):
        print(f"{label}: note: {note}", file=sys.stderr)

    def factory(c, bus, clock):  # type: ignore[no-untyped-def]
        return RouterService(c, bus, clock, tokenizer=tokenizer)

    return run_service_main("router", cfg, factory, instance=instance)


if __name__ == "__main__":
    claim_process()  # this process's own service (not a caller's main(...)): its stop signals ignored once it stops
    sys.exit(main())
