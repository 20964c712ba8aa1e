"""``evolving-infra auth gen``: NATS credentials and server permissions for an external deployment.

``up`` generates these itself for its embedded server. For compose, Slurm or
any external nats-server, ``auth gen`` writes one credentials file per instance
(``<instance>.nk`` nkey seeds, or ``.pass`` with ``--mode password``; mode 0600)
plus ``nats-auth.conf``, the ``authorization { ... }`` block to ``include`` in
the server's config (mode 0600 too: with ``--mode password`` it holds every
identity's password, ``admin``'s included). Each service then gets its file with ``--nats-creds`` (or
``EI_NATS_CREDS``); see ``shared/auth.py`` for the permission table.
"""

from __future__ import annotations

import argparse
import sys

from evolving_infra.stdio_args import folder
from shared.auth import AuthError, NatsAuth, auth_from_env, generate, write_private


def cmd_auth(args: argparse.Namespace) -> int:
    nodes = [n for n in args.nodes.split(",") if n]
    names = ["planner", "kvdirectory", *args.routers.split(","), *(f"worker-{n}" for n in nodes)]
    try:
        creds = generate(args.dir, [n for n in names if n], partition=args.partition, mode=args.mode)
    except AuthError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    conf = creds.directory / "nats-auth.conf"
    write_private(conf, creds.server_block.encode())
    for name, path in creds.files.items():
        print(f"{name:16s} {path}")
    print(f"server: add `include {conf.name}` (copy it next to the server config) to nats-server's config")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "auth",
        help="generate NATS credentials and least-privilege permissions for an external deployment",
        description="Write one credentials file per service instance (plus operator, launcher and admin) and the "
        "server's authorization block (nats-auth.conf, mode 0600: with --mode password it holds the passwords). "
        "Services read their file from --nats-creds / EI_NATS_CREDS.",
    )
    ss = p.add_subparsers(dest="auth_command", metavar="ACTION", required=True)
    g = ss.add_parser("gen", help="generate credentials into a folder")
    g.add_argument("--dir", required=True, type=folder, help="output folder (created, mode 0700)")
    g.add_argument("--nodes", required=True, help="worker node ids, comma-separated, each [A-Za-z0-9_-]+ (e.g. w0,w1,w2,w3)")
    g.add_argument("--routers", default="router", help="router instance names, comma-separated (default router)")
    g.add_argument("--partition", default="p0", help="partition the permissions cover (default p0)")
    g.add_argument("--mode", choices=("nkeys", "password"), default="nkeys", help="nkeys (default) or user/password")
    p.set_defaults(func=cmd_auth)


def tool_auth(nats_url: str, creds: str, key: str) -> NatsAuth:
    """Credentials of a CLI tool (``split``, ``tap``): ``--nats-creds``, else ``EI_NATS_*``, else
    the file the state of the local cluster at ``nats_url`` names under ``key``
    (``nats_operator_creds`` / ``nats_admin_creds``, written by ``up``), else none.

    Raises:
        AuthError: an unreadable credentials file.
    """
    if creds:
        return NatsAuth.from_file(creds)
    env = auth_from_env()
    if env.enabled:
        return env
    from evolving_infra.state import running_clusters

    for c in running_clusters(remove_stale=False):
        if c.get("nats_url") == nats_url and c.get(key):
            return NatsAuth.from_file(str(c[key]))
    return env
