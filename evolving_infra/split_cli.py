"""``evolving-infra split get|set``: show the live planner's PD split, or ask it to adopt one.

``split set 4P5D`` sends a ``SplitSetRequest`` on ``split.set``; the planner
validates it against its node list and, when it fits, publishes the split under
a new epoch on ``split.commands`` and replies with that command. ``split get``
asks ``split.get``. Without ``--nats-url`` (or ``EI_NATS_URL``) the NATS server is the one of the running
``evolving-infra up`` cluster (its state file, :mod:`evolving_infra.state`). A request nobody
serves yet (NATS "no responders": the planner is restarting, ~1.5 s under ``up``'s supervisor,
or not started), and a ``split set`` the planner refused for now (it is starting: it has not read the split
the nodes serve yet; nothing was applied), is asked again, after 0.05 s doubling to at most 0.5 s, until
``--timeout`` (counted from the connect; a refused ``split set`` only while 1.5 s of it are left: a starting planner
holds a try up to 1 s, :data:`shared.messages.ADOPTING_HOLD_S`, and applies it if it has started meanwhile, so a try
sent later could be applied after the CLI gave up on it); nothing else is asked again: a request that got no reply in its time
may have been received, and a set applied, so it is never sent again (the error says so; ``split get`` shows
whether it was). Exit status (:data:`EXIT_STATUSES`; ``split get``: :data:`GET_EXIT_STATUSES`):
0 on success; 1 when no planner answered within ``--timeout`` (absent, restarting or hung: try again),
or (``split set`` only) the planner was still starting (refused for now each time until too little of ``--timeout``
was left for another try: the same ``split set`` may succeed in a few seconds; nothing is left held); the error says what it waited on;
2 when the planner refused the split itself (it does not cover the cluster's nodes, 0 prefill
or decode nodes, or one live node left so a phase would be on dead nodes only: the user's error, as every usage error), the input is malformed, no cluster
is found, NATS refused the credentials (or wanted some and none were given), the identity may
not publish the request's subject, or the planner's reply was malformed. The reason is printed on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from shared import messages as m
from evolving_infra.auth_cli import CREDS_HINT, tool_auth
from shared.auth import AuthError, NatsAuth, redact_url
from shared.bus import Bus, BusError, NoCredentials, NoReply, NoResponders, PermissionDenied
from shared.split import split_name
from shared.subjects import SPLIT_GET, SPLIT_SET, Subject, Subjects

EXIT_STATUSES = (
    "exit status: 0 ok; 1 no planner answered within --timeout (asked again while none is subscribed: it may be "
    "restarting), or the planner refused for now (it is starting: asked again while 1.5 s of --timeout are left, as it "
    "holds a try up to 1 s); try again in a few "
    "seconds, but a last try that got no answer in its time is never sent again (the planner may still apply it: "
    "`split get` shows the split); 2 the planner "
    "refused the split (it does not cover the cluster's nodes, or only one node is live), a malformed SPLIT or --timeout, no running cluster "
    "or NATS server found, credentials refused or not allowed the subject"
)
"""``split set``'s (and ``split``'s) exit statuses, the end of their ``--help`` (and the module docstring's)."""
GET_EXIT_STATUSES = (
    "exit status: 0 ok; 1 no planner answered within --timeout (asked again while none is subscribed: it may be "
    "restarting; a starting planner answers once it has read the nodes' split); try again in a few seconds; 2 a "
    "malformed --timeout, no running cluster or NATS server found, credentials refused or not allowed the subject"
)
"""``split get``'s: it is never refused (a starting planner holds the question until it knows the split), so 1 only
when no planner answered."""

RETRY_FIRST_S = 0.05
"""Seconds before a request that found no responders is asked again; doubled each time up to :data:`RETRY_MAX_S`."""
RETRY_MAX_S = 0.5
HELD_MARGIN_S = 0.5
"""Seconds of ``--timeout`` beyond the planner's hold (:data:`shared.messages.ADOPTING_HOLD_S`) a ``split set``
needs left to be asked again after a refusal for now: the round trips and a planner slow on a loaded box."""


async def _ask(
    bus: Bus, subject: Subject, msg: msgspec.Struct, timeout: float, *, not_yet: Callable[[Any], bool] | None = None,
    not_yet_held_s: float = 0.0,
) -> tuple[Any, int, int]:
    """``bus.request`` until a reply, for at most ``timeout`` s, asked again while nobody serves ``subject``
    (:class:`NoResponders`: the planner restarting or not started) and while the reply says "not yet"
    (``not_yet(reply)``: a ``split set`` refused for now, the planner is starting: nothing was applied), after
    :data:`RETRY_FIRST_S` doubling to :data:`RETRY_MAX_S`. Returns (reply, tries, "not yet" replies): the reply
    may be a "not yet" one when too little time was left to ask again. Before, a "not yet" reply ended ``split set``
    at once (exit 1) with seconds of its ``--timeout`` left, though the planner would take the split a moment later.

    After a "not yet" reply the next try is sent only when, after the pause, at least ``not_yet_held_s`` s are left
    (the asker may hold a try that long, then act on it: a starting planner applies a held ``split set`` when its
    adoption ends, whether or not the asker still waits); else that reply is returned, and nothing is left held.
    Before, the last try went with what was left (down to 0.01 s), timed out at the CLI (exit 1, "no answer") and
    the planner applied it a moment later.

    Raises:
        _Unanswered: no reply within ``timeout`` (no responders the whole time, or a try timed out or lost the
            connection: not asked again, the planner may have received it and may apply it).
        BusError: refused (:class:`RequestRefused`), denied (:class:`PermissionDenied`) or a malformed reply.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pause, tries, refused = RETRY_FIRST_S, 0, 0
    while True:
        tries += 1
        try:
            reply = await bus.request(subject, msg, timeout=max(deadline - loop.time(), 0.01))
        except NoResponders as e:
            if (left := deadline - loop.time()) <= 0:
                raise _Unanswered(tries, e, refused) from e
        except NoReply as e:
            raise _Unanswered(tries, e, refused) from e
        else:
            if not_yet is None or not not_yet(reply):
                return reply, tries, refused
            refused += 1
            left = deadline - loop.time()
            if left <= 0 or left - min(pause, left) < not_yet_held_s:  # the next try could be held past the deadline
                return reply, tries, refused
        await asyncio.sleep(min(pause, left))
        pause = min(2 * pause, RETRY_MAX_S)


class _Unanswered(Exception):
    """No planner answered within ``--timeout`` after ``tries`` requests (exit 1: try again); ``refused`` of them
    were answered "refused for now" (the planner is starting); ``last`` is the last try's error
    (:class:`NoResponders`: nobody got it; else the planner may have received it)."""

    def __init__(self, tries: int, last: BusError, refused: int = 0) -> None:
        super().__init__(f"{tries} {'try' if tries == 1 else 'tries'}, the last: {last}")
        self.tries, self.last, self.refused = tries, last, refused


def _not_taken(tries: int, refused: int) -> str:
    """What a ``split set`` that ends refused for now (or unanswered after such refusals) waited on."""
    return f"refused for now {refused} {'time' if refused == 1 else 'times'} in {tries} {'try' if tries == 1 else 'tries'}"

_SPEC = re.compile(r"^\s*(\d+\s*[pP]\s*\d+\s*[dD]|collocated|both|agg|aggregated)\s*$", re.IGNORECASE)


def command_json(cmd: m.SplitCommand) -> dict[str, object]:
    """A split command as ``split get --json`` prints it (and ``status`` shows the planner's split): ``epoch``,
    ``split`` (``2P2D``), ``phases`` (node → phase), ``reason``, ``decided_at`` (simulated s)."""
    return {"epoch": cmd.epoch, "split": split_name(cmd.phases), "phases": cmd.phases, "reason": cmd.reason, "decided_at": cmd.decided_at}


async def connect_tool(nats_url: str, partition: str, instance: str, timeout: float, auth: NatsAuth) -> Bus:
    """A command-line tool's bus connection to ``nats_url``: one try (no reconnect, a connect timeout of
    ``min(timeout, 2)`` s), within ``timeout`` s in all; ``auth`` as :func:`~evolving_infra.auth_cli.tool_auth` gives it.

    Raises:
        asyncio.TimeoutError: no connection within ``timeout``; NoCredentials, BusError: as ``Bus.connect`` (an
            auth'd server and no credentials, refused credentials); OSError and the like: no server.
    """
    return await asyncio.wait_for(
        Bus.connect(
            nats_url,
            Subjects(partition),
            service="cli",
            instance=instance,
            connect_timeout=min(timeout, 2.0),
            max_reconnect_attempts=1,  # nats-py: 0 retries the first connect forever; 1 = two tries
            allow_reconnect=False,
            auth=auth,
        ),
        timeout=timeout,
    )


def _print_command(cmd: m.SplitCommand, as_json: bool) -> None:
    if as_json:
        print(json.dumps(command_json(cmd)))
    else:
        nodes = " ".join(f"{n}={p}" for n, p in cmd.phases.items())
        print(f"epoch {cmd.epoch}: {split_name(cmd.phases)} ({nodes}); reason: {cmd.reason}")


async def _run(args: argparse.Namespace) -> int:
    try:
        auth = tool_auth(args.nats_url, getattr(args, "nats_creds", ""), "nats_operator_creds")
    except AuthError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        bus = await connect_tool(args.nats_url, args.partition, "split-cli", args.timeout, auth)
    except NoCredentials as e:  # an auth'd server and no credentials given: say how to give them
        print(f"error: cannot connect: {e}; {CREDS_HINT}", file=sys.stderr)
        return 2
    except BusError as e:  # refused credentials
        print(f"error: cannot connect: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # no server: a clear message, not a traceback, within --timeout
        print(f"error: cannot connect to NATS at {redact_url(args.nats_url)}: no server answered ({e!r})", file=sys.stderr)
        return 2
    try:
        if args.split_command == "get":
            cmd, _, _ = await _ask(bus, SPLIT_GET, m.SplitQuery(), args.timeout)
            _print_command(cmd, args.json)
            return 0
        # a refusal for now (the planner is starting) is asked again; a refusal of the split itself is the answer
        ask = m.SplitSetRequest(split=args.split, reason=args.reason)
        reply, tries, refused = await _ask(bus, SPLIT_SET, ask, args.timeout, not_yet=lambda r: not r.ok and r.retry,
                                           not_yet_held_s=m.ADOPTING_HOLD_S + HELD_MARGIN_S)
    except _Unanswered as e:  # absent, restarting, starting or hung: not the user's error (1, try again)
        # a set whose last try got no answer in its time is not sent again: the planner may have it and apply it
        maybe = "" if args.split_command == "get" or isinstance(e.last, NoResponders) else (
            "; its last try was not sent again (the planner may still apply it: `evolving-infra split get` shows the split)")
        if e.refused:
            print(f"error: the planner on partition {args.partition!r} is starting: split {args.split!r} "
                  f"{_not_taken(e.tries, e.refused)} within {args.timeout:g} s, the last try got no "
                  f"answer ({e.last}){maybe}; try again in a few seconds", file=sys.stderr)  # fmt: skip
        elif down := _left_down(args.nats_url):
            print(f"error: no planner answered on partition {args.partition!r} within {args.timeout:g} s ({e}){maybe}; "
                  f"{down}", file=sys.stderr)  # fmt: skip
        else:
            print(f"error: no planner answered on partition {args.partition!r} within {args.timeout:g} s ({e}){maybe}; "
                  "try again once it is up (`up` restarts a dead one within seconds)", file=sys.stderr)
        return 1
    except PermissionDenied as e:  # the credentials, not the planner: name the subject and the identity
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BusError as e:  # refused as malformed, or a reply that does not decode
        print(f"error: the planner on partition {args.partition!r} did not answer usably ({e})", file=sys.stderr)
        return 2
    finally:
        await bus.close()
    if not reply.ok and reply.retry:  # still starting with too little --timeout left to ask again: 1, try again
        again = "" if "try again" in (reply.error or "") else "; try again in a few seconds"
        print(f"error: the planner on partition {args.partition!r} is starting: split {args.split!r} "
              f"{_not_taken(tries, refused)} within {args.timeout:g} s (not asked again with under "
              f"{m.ADOPTING_HOLD_S + HELD_MARGIN_S:g} s of it left: a starting planner holds a try up to "
              f"{m.ADOPTING_HOLD_S:g} s, then may apply it); its last answer: {reply.error}{again}", file=sys.stderr)
        return 1
    if not reply.ok or reply.command is None:  # the user's split (2, a usage error)
        print(f"error: planner refused split {args.split!r}: {reply.error}", file=sys.stderr)
        return 2
    _print_command(reply.command, args.json)
    return 0


def _left_down(nats_url: str) -> str:
    """Why no planner answers when the local ``up`` on ``nats_url`` left it down after a crash loop (its state file's
    ``left_down``): the words for the error line, naming its log; "" when no such cluster says so (it may be
    restarting: "try again" then stays true) or the state files cannot be read."""
    from evolving_infra.state import running_clusters

    try:
        found = running_clusters(remove_stale=False)
    except OSError:
        return ""
    for c in found:
        if c.get("nats_url") == nats_url and "planner" in (c.get("left_down") or ()):
            logs = c.get("log_dir") or "its log folder"
            return (f"`up` left the planner down after a crash loop (see {logs}/planner.log; up's output says when it "
                    "tries it again): the split stays as the workers serve it until then")
    return ""


def cmd_split(args: argparse.Namespace) -> int:
    if not 0 < args.timeout < math.inf:  # 0, negative or NaN read as 'cannot connect to NATS: no server answered'
        print(f"error: --timeout must be a number of seconds > 0, not {args.timeout:g}", file=sys.stderr)
        return 2
    if args.split_command == "set" and not _SPEC.match(args.split):
        print(f"error: split {args.split!r} must look like '4P5D' or 'collocated'", file=sys.stderr)
        return 2
    from evolving_infra.state import fill_nats_url
    from shared.log import setup_logging

    setup_logging("console", "warning")  # the bus client's debug lines are not this command's output
    if (missing := fill_nats_url(args)) is not None:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    return asyncio.run(_run(args))


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "split",
        help="get | set: show or set the PD split of the running cluster (operator override of the planner)",
        description="Ask the planner of a live cluster for its split (get) or to adopt one now (set). The planner checks "
        "the split against its nodes and publishes it under a new epoch; its policy then plans from that split "
        "(the evolving planner restarts its cooldown). A phase the split leaves on nodes that stop reporting "
        "(dead) is swapped with a live node of the other phase by the planner (services/planner/README.md).",
        epilog=EXIT_STATUSES,
    )
    ss = p.add_subparsers(dest="split_command", metavar="ACTION", required=True)
    for name, help_text in (("get", "print the current split and epoch"), ("set", "adopt a split now, e.g. `split set 4P5D`")):
        q = ss.add_parser(name, help=help_text, epilog=EXIT_STATUSES if name == "set" else GET_EXIT_STATUSES)
        if name == "set":
            q.add_argument(
                "split", metavar="SPLIT",
                help="xPyD (x prefill + y decode nodes = all nodes) or 'collocated'. The first x nodes serve prefill, "
                "live nodes first: a node with no node.state for more than the planner's --silent-after-s (3 s), or "
                "never heard, is placed after the live ones, and with x or fewer live nodes the last live one serves "
                "decode; with one live node left an xPyD is refused (exit 2) naming the silent nodes",
            )
            q.add_argument("--reason", default="operator", help="reason recorded with the decision (default 'operator')")
        q.add_argument(
            "--nats-url",
            default=None,
            help="NATS server (default: env EI_NATS_URL, which keeps a password in it out of the process list; else "
            "the running `evolving-infra up` cluster's, from the state file it writes)",
        )
        q.add_argument("--partition", default="p0", help="partition (default p0)")
        q.add_argument(
            "--nats-creds",
            default="",
            help="credentials of the operator identity; default: env EI_NATS_CREDS (or EI_NATS_USER/EI_NATS_PASSWORD), "
            "else the operator credentials of the local cluster `up` started",
        )
        q.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for NATS, then as long for the planner's answer, asked again while "
                       "no planner is subscribed (restarting)" + (" or it refuses for now (starting)" if name == "set" else "")
                       + "; none in that time: exit 1 (default 5)")  # fmt: skip
        q.add_argument("--json", action="store_true",
                       help="print the split the planner answered as one JSON object: epoch, split, phases (node: phase), "
                       "reason, decided_at (cluster-clock seconds: simulated under --speedup)")
    p.set_defaults(func=cmd_split)
