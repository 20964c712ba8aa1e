"""``evolving-infra auth gen``: NATS credentials and server permissions for an external deployment.

``up`` generates these itself for its embedded server. For compose, Slurm or
any external nats-server, ``auth gen`` writes one credentials file per instance
(``<instance>.nk`` nkey seeds, or ``.pass`` with ``--mode password``; mode 0600)
plus ``nats-auth.conf``, the ``authorization { ... }`` block to ``include`` in
the server's config (mode 0600 too; it holds the nkeys' public keys, or with ``--mode password``
the passwords' bcrypt hashes, never a clear password: nats-server compares a client's password with
its hash). Each service then gets its file with ``--nats-creds`` (or
``EI_NATS_CREDS``); see ``shared/auth.py`` for the permission table.

``auth stream`` creates the partition's JetStream stream of must-arrive subjects
(``shared.bus``) with the ``launcher`` credentials, as ``up``'s launcher does
before any service starts: under these permissions no service may create it, and
a service started before it waits for it (only a server without JetStream makes the
services fall back to core NATS). Its server is
``--nats-url`` or else ``EI_NATS_URL`` (as the services read it): a password in the URL
(``nats://user:pass@host``) stays out of the process list, and out of what it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import sys
from typing import Any

from evolving_infra.stdio_args import folder
from shared.auth import AuthError, NatsAuth, auth_from_env, generate, redact_url, router_names, write_private


async def make_stream(nats_url: str, partition: str, creds: str, timeout_s: float, *, recreate: bool = False) -> str:
    """Find or create ``partition``'s JetStream stream on ``nats_url`` as the ``launcher`` identity.

    Args:
        nats_url: the NATS server.
        partition: Evolving Infra partition (the stream is ``EI_<partition>``).
        creds: the launcher's credentials file (``auth gen``'s ``launcher.nk``); empty = none (open server).
            With ``recreate``, credentials that may delete the stream (``admin.nk``; the launcher's may not).
        timeout_s: wall seconds for the connection (Bus.connect retries until then).
        recreate: delete the stream of that name first, if there (its messages too: at most
            ``shared.bus.STREAM_MAX_AGE_S``, 120 s of them), then create it: the way to replace another version's
            stream that lacks some subjects. Services bound to the old stream are to be restarted after.

    Returns:
        The stream's name.

    Raises:
        AuthError: unreadable credentials; TimeoutError: no connection in ``timeout_s``;
        RuntimeError: the server has no JetStream or refused the stream (its reason when it gave one: another
            stream takes some of the subjects, ``shared.bus.stream_refusal``), did not answer the stream's lookup or
            create in ``shared.bus.STREAM_LOOKUP_TIMEOUT_S`` (5 s: a loaded or hung server), or the stream there does not
            take every reliable subject (made by another version or by hand: messages on what it lacks would reach
            no consumer, e.g. no request's output its router); with ``recreate``, the server did not delete it.
    """
    from shared.bus import Bus, stream_name
    from shared.subjects import Subjects

    auth = NatsAuth.from_settings(creds=creds, name="launcher")
    subjects = Subjects(partition)
    bus = await asyncio.wait_for(Bus.connect(nats_url, subjects, service="launcher", instance="launcher", auth=auth), timeout_s)
    try:
        name = stream_name(subjects)
        if recreate:
            await _delete_stream(bus, name)
        if not await bus.ensure_stream(wait=False):  # a service's credentials: refused at once, not waited on
            if bus.stream_refused:  # the server answered the create with its reason (e.g. subjects overlap another stream's)
                raise RuntimeError(f"no JetStream stream {name}: {bus.stream_refused}")
            if bus.stream_unanswered:  # silence is not "JetStream off": a loaded or hung server
                raise RuntimeError(f"the server did not answer {bus.stream_unanswered} (loaded or hung?); try again")
            raise RuntimeError("no JetStream stream (JetStream off, or these credentials may not create it: the launcher's may)")
        if bus.stream_lacking:  # found, not made: another version's (ensure_stream checks it as up's launcher does)
            raise RuntimeError(bus.stream_lacking.replace("--nats-url URL", f"--nats-url {redact_url(nats_url)}"))
    finally:
        await bus.close()
    return stream_name(subjects)


async def _delete_stream(bus: Any, name: str) -> None:
    """Delete stream ``name`` through ``bus`` (a :class:`shared.bus.Bus`), if there (5 s for the answer).

    Raises:
        RuntimeError: the server refused or did not answer (credentials that may not delete it: a permission
            violation leaves the request unanswered)."""
    import nats

    from shared.bus import STREAM_LOOKUP_TIMEOUT_S, stream_api_subject, stream_refusal

    try:
        await bus.nc.jetstream(timeout=STREAM_LOOKUP_TIMEOUT_S).delete_stream(name)
    except nats.js.errors.NotFoundError:
        return  # not there: nothing to delete
    except (nats.errors.Error, asyncio.TimeoutError) as e:
        why = stream_refusal(e).replace("refused to create it", "refused to delete it") or (
            f"no answer to {stream_api_subject('DELETE', name)} in {STREAM_LOOKUP_TIMEOUT_S:g} s: these credentials "
            "may not delete it (auth gen's admin.nk may), or the server is loaded or hung")
        raise RuntimeError(f"stream {name} not deleted: {why}") from e


def cmd_stream(args: argparse.Namespace) -> int:
    from shared.log import setup_logging
    from shared.subjects import check_token

    try:  # usage errors before any connection (as auth gen's partition check; split get's --timeout)
        check_token(args.partition, "partition")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (math.isfinite(args.timeout) and args.timeout > 0):  # NaN passes '<= 0'
        print("error: --timeout must be a number of seconds > 0", file=sys.stderr)
        return 2
    url = args.nats_url or os.environ.get("EI_NATS_URL", "")
    if not url:
        print("error: no NATS server: pass --nats-url URL or set EI_NATS_URL", file=sys.stderr)
        return 2
    shown = redact_url(url)  # a password in the URL is neither printed nor logged
    setup_logging("console", "error")  # the bus client's lines (and its fallback warning) are not this command's output
    try:
        name = asyncio.run(make_stream(url, args.partition, args.creds, args.timeout, recreate=args.recreate))
    except AuthError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, asyncio.TimeoutError):
        print(f"error: no connection to {shown} in {args.timeout:g} s", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"error: {shown}: {e}", file=sys.stderr)
        return 1
    print(f"JetStream stream {name} on {shown}" + (" (made anew)" if args.recreate else ""))
    return 0


MAX_ROUTER_COUNT = 1024
"""``auth gen --routers N``: the largest count taken (one identity per router; a typo such as 99999999999 would
otherwise build that many names before anything is written)."""


def cmd_auth(args: argparse.Namespace) -> int:
    if args.auth_command == "stream":
        return cmd_stream(args)
    nodes = [n for n in args.nodes.split(",") if n]
    routers = args.routers.split(",")
    # a count, as up's --routers N: up's names (router, router-1, ...); ASCII digits only (str.isdigit() took '²',
    # which int() refuses: a traceback)
    if re.fullmatch(r"[0-9]+", args.routers.strip()):
        count = int(args.routers[:12])  # a longer count is refused below without building it (e.g. 99999999999 names)
        if len(args.routers.strip()) > 4 or count > MAX_ROUTER_COUNT:
            print(f"error: --routers {args.routers}: at most {MAX_ROUTER_COUNT} routers by count (or name them, "
                  "comma-separated)", file=sys.stderr)  # fmt: skip
            return 2
        if count < 1:
            print(f"error: --routers {args.routers}: a count of at least 1 (up's names: router, router-1, ...) or "
                  "router instance names, comma-separated (e.g. router,router-1)", file=sys.stderr)  # fmt: skip
            return 2
        routers = router_names(count)
    names = ["planner", "kvdirectory", *routers, *(f"worker-{n}" for n in nodes)]
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
        "server's authorization block (nats-auth.conf, mode 0600: public keys, or with --mode password the passwords' "
        "bcrypt hashes). "
        "Services read their file from --nats-creds / EI_NATS_CREDS.",
    )
    ss = p.add_subparsers(dest="auth_command", metavar="ACTION", required=True)
    g = ss.add_parser("gen", help="generate credentials into a folder")
    g.add_argument("--dir", required=True, type=folder, help="output folder (created, mode 0700)")
    g.add_argument("--nodes", required=True, help="worker node ids, comma-separated, each [A-Za-z0-9_-]+ (e.g. w0,w1,w2,w3)")
    g.add_argument("--routers", default="router", help="router instance names, comma-separated (default router), or "
                   "a count N as up's --routers N: router, router-1, ..., router-{N-1}")
    g.add_argument("--partition", default="p0", help="partition the permissions cover (default p0)")
    g.add_argument("--mode", choices=("nkeys", "password"), default="nkeys", help="nkeys (default) or user/password")
    st = ss.add_parser(
        "stream", help="create the partition's JetStream stream with the launcher credentials (before the services)",
        description="Find or create the JetStream stream of the partition's must-arrive subjects (EI_<partition>), as up's "
        "launcher does; under auth gen's permissions no service may create it: a service started before it waits for it "
        "(its /readyz 503 'waiting for the JetStream stream EI_<partition>', a warning each minute), and only a server "
        "without JetStream makes them fall back to core NATS. Exit 0 when it is there; 1 when it cannot be made (no connection within --timeout, "
        "no answer to the stream's lookup or create in 5 s, credentials the server refuses, JetStream off or not allowed) or one of that name lacks some of those "
        "subjects; 2 for unreadable credentials, a partition that is not one subject token, a --timeout not > 0 or "
        "no server given (neither --nats-url nor EI_NATS_URL).",
    )
    st.add_argument(
        "--nats-url", default="", help="the NATS server, e.g. nats://head:4222; default: env EI_NATS_URL, which keeps a password in "
        "the URL out of the process list (one given here is in every local user's ps)",
    )
    st.add_argument("--creds", default="", help="the launcher's credentials file (auth gen's launcher.nk); empty = none")
    st.add_argument("--partition", default="p0", help="partition (default p0)")
    st.add_argument("--timeout", type=float, default=30.0, help="wall seconds to connect, > 0 (default 30)")
    st.add_argument(
        "--recreate", action="store_true", help="delete the stream of that name first (with its messages: at most 120 s of "
        "them), then create it: replaces another version's stream that lacks some subjects; needs credentials that may "
        "delete it (--creds auth gen's admin.nk; the launcher's may not); restart the services after",
    )
    p.set_defaults(func=cmd_auth)


CREDS_HINT = (
    "pass --nats-creds FILE (an nkey seed .nk, a .creds file or a user:password .pass file, as "
    "`evolving-infra auth gen` writes) or set EI_NATS_CREDS (or EI_NATS_USER and EI_NATS_PASSWORD)"
)
"""How a CLI tool is given NATS credentials: appended to the error of a server that requires them."""


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
