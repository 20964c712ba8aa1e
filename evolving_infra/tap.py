"""``evolving-infra tap``: print decoded messages of a live cluster (how users trace it).

Subscribes to subjects of a partition (all of them by default, or the given
subjects / wildcards) and prints one line per message: wall time, subject,
message type and its fields as JSON. Long lists (block hashes, token ids) are
abbreviated unless ``--full``. ``--json`` prints one JSON object per line
instead (``ts`` epoch s, ``subject``, ``type``, ``msg``, and ``traceparent``
when the message carries one), for ``jq`` and scripts. Without ``--nats-url`` (or ``EI_NATS_URL``) it
taps the running ``evolving-infra up`` cluster (its state file,
:mod:`evolving_infra.state`). It fails within seconds when no server answers and stops
when the connection is lost (no endless reconnecting). A subject its credentials may not
read (only ``admin`` reads everything) is one line on stderr naming the identity and the
subjects, and exit 2: the server refuses such a subscription with an error the client
otherwise only logs, and tap printed nothing, forever, as if the cluster were idle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from evolving_infra.auth_cli import CREDS_HINT, tool_auth
from shared.auth import AuthError, client_options, redact_url
from shared.bus import decoder_for, denied_subject
from shared.cancel import cancel_until_done
from shared.signals import STOP_SIGNALS, ignore_stop_signals, process_claimed
from shared.subjects import ALL, Subjects

TAP_DRAIN_S = 2.0
"""Seconds a stopping tap drains its subscriptions (the messages already received are printed) before it closes."""


def _abbrev(value: Any, limit: int) -> Any:
    if isinstance(value, list):
        items = [_abbrev(v, limit) for v in value[:limit]]
        if len(value) > limit:
            items.append(f"... +{len(value) - limit}")
        return items
    if isinstance(value, dict):
        return {k: _abbrev(v, limit) for k, v in value.items()}
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return value


def render_json(subjects: Subjects, subject: str, data: bytes, headers: dict[str, str] | None = None, *, full: bool = False) -> str:
    """One JSON line for a raw message: ``{"ts", "subject", "type", "msg"}`` (+ ``traceparent``; ``error`` when
    the subject is unknown or the payload does not decode)."""
    out: dict[str, Any] = {"ts": round(time.time(), 6), "subject": subject}
    if headers and "traceparent" in headers:
        out["traceparent"] = headers["traceparent"]
    match = subjects.match(subject)
    if match is None:
        out.update(type=None, error="unknown subject", size=len(data))
        return json.dumps(out, separators=(",", ":"))
    subj, _ = match
    try:
        msg = decoder_for(subj.msg_type).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        out.update(type=None, error=f"malformed {subj.template}: {e}", size=len(data))
        return json.dumps(out, separators=(",", ":"))
    body = msgspec.to_builtins(msg, enc_hook=lambda b: f"<{len(b)} bytes>" if isinstance(b, bytes) else str(b))
    out.update(type=type(msg).__name__, msg=body if full else _abbrev(body, 8))
    return json.dumps(out, separators=(",", ":"), default=str)


def render(subjects: Subjects, subject: str, data: bytes, *, full: bool = False) -> str:
    """One printable line for a raw message (decoded with its subject's type)."""
    match = subjects.match(subject)
    stamp = time.strftime("%H:%M:%S") + f".{int(time.time() * 1000) % 1000:03d}"
    if match is None:
        return f"{stamp} {subject} <unknown subject> {len(data)} bytes"
    subj, _ = match
    try:
        msg = decoder_for(subj.msg_type).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return f"{stamp} {subject} <malformed {subj.template}: {e}>"
    body = msgspec.to_builtins(msg, enc_hook=lambda b: f"<{len(b)} bytes>" if isinstance(b, bytes) else str(b))
    if not full:
        body = _abbrev(body, 8)
    return f"{stamp} {subject} {type(msg).__name__} {json.dumps(body, separators=(',', ':'), default=str)}"


async def _tap(args: argparse.Namespace) -> int:
    subjects = Subjects(args.partition)
    templates = {s.template.split(".")[0] for s in ALL}
    patterns = args.subjects or [subjects.all_wildcard()]
    patterns = [p if p.startswith("ei.") else subjects.prefix + p for p in patterns]
    excluded = [subjects.prefix + e for e in args.exclude]
    stop = asyncio.Event()
    lost: list[str] = []

    async def closed_cb() -> None:
        if not stop.is_set():
            lost.append("connection to NATS lost (the cluster stopped?)")
            stop.set()

    refused: set[str] = set()

    async def on_error(e: Exception) -> None:  # a connect failure is reported once, below
        found = denied_subject(str(e))
        if found is not None and found[0] == "subscription":
            refused.add(found[1].lower())  # nats-py passes the server's error text lower-cased

    try:
        auth = tool_auth(args.nats_url, getattr(args, "nats_creds", ""), "nats_admin_creds")
        opts = client_options(args.nats_url, auth)  # a URL list's servers, its credentials percent-decoded
    except AuthError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                name="tap", connect_timeout=2, max_reconnect_attempts=1, allow_reconnect=False, closed_cb=closed_cb,
                error_cb=on_error, **opts,
            ), timeout=5
        )
    except Exception as e:  # no server: a clear message within seconds, not a traceback
        if "authorization violation" in str(e).lower():  # refused credentials, or none given to a server that wants them
            why = (
                f"refused the credentials of {auth.name!r}" if auth.enabled
                else "refused the credentials in the URL" if "@" in args.nats_url
                else "requires credentials and none were given; " + CREDS_HINT
            )
            print(f"error: NATS at {redact_url(args.nats_url)} {why} (Authorization Violation)", file=sys.stderr)
            return 2
        print(f"error: cannot connect to NATS at {redact_url(args.nats_url)}: no server answered ({e!r})", file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        count = 0
        reader_gone: list[BrokenPipeError] = []

        async def cb(msg: Msg) -> None:
            nonlocal count
            if reader_gone or any(msg.subject.startswith(e.rstrip(">*")) for e in excluded):
                return
            if args.max and count >= args.max:
                # --max reached: the drain still hands this callback every message already received (a burst); before,
                # each was printed (2,000 published, --max 1 printed 2,000 lines: tests/integration/test_tap_max_live.py)
                return
            try:
                if args.json:
                    print(render_json(subjects, msg.subject, msg.data, msg.headers, full=args.full), flush=True)
                else:
                    print(render(subjects, msg.subject, msg.data, full=args.full), flush=True)
            except BrokenPipeError as e:  # raised in nats' callback task it would be dropped, and tap | head run on
                reader_gone.append(e)
                stop.set()
                return
            count += 1
            if args.max and count >= args.max:
                stop.set()

        subs = [await nc.subscribe(p, cb=cb) for p in patterns]
        try:  # the server answers a SUB it refuses with -ERR, ahead of the PONG to a later PING
            # nats-py writes a flush's PING straight to the socket, ahead of SUBs still in its pending buffer
            # (its flusher task writes them): one flush's PONG came before the -ERR about 1 time in 20; by the
            # end of the first round trip the flusher has written them, so the second PING follows them
            await nc.flush(timeout=5)
            await nc.flush(timeout=5)
        except Exception as e:
            print(f"error: NATS at {redact_url(args.nats_url)} did not answer after subscribing ({e!r})", file=sys.stderr)
            await nc.close()
            return 1
        if denied := [p for p in patterns if p.lower() in refused]:
            who = f"identity {auth.name!r}" if auth.enabled else "a client without credentials"
            print(
                f"error: NATS refused {who} permission to subscribe to {', '.join(denied)} (Permissions Violation): "
                "its credentials may not read these subjects; tap with the admin credentials (they read everything)",
                file=sys.stderr,
            )
            await nc.close()
            return 2
        print(f"tapping {', '.join(patterns)} on {redact_url(args.nats_url)} (known roots: {', '.join(sorted(templates))}); Ctrl-C to stop", file=sys.stderr)
        await stop.wait()
        if reader_gone:  # stdout's reader stopped (| head): evolving_infra.cli.main ends quietly with 141
            await nc.close()
            raise reader_gone[0]
        if lost:
            print(f"error: {lost[0]}", file=sys.stderr)
            return 1
        await _drain_and_close(nc, subs)
        return 0
    finally:  # the process exits after this: the rest of a burst of stop signals is discarded (no -15, no
        if process_claimed():  # "signal wakeup fd" traceback from one that lands while the loop closes)
            ignore_stop_signals(loop)


async def _drain_and_close(nc: NatsClient, subs: list[Subscription], limit_s: float = TAP_DRAIN_S) -> None:
    """Drain ``subs`` (nats-py ``Subscription.drain``: UNSUB, a PING round trip, then the messages already received
    are printed) for at most ``limit_s`` seconds, then close ``nc``. Every drain's outcome is retrieved; one cut
    short is cancelled until it ends (``shared.cancel``).

    Not nats-py's ``Client.drain``: each subscription's drain there waits 10 s for its PONG (nats-py's flush timeout)
    and the drain then flushes again: a server that stopped answering held tap's stop about 20 s and ended it in a
    ``FlushTimeoutError`` traceback (``tests/integration/test_tap_stop_silent_nats_live.py``), and cancelled inside
    its ``wait_for`` the gather of the drains is left with an exception nobody retrieves."""
    drains = [asyncio.ensure_future(sub.drain()) for sub in subs]
    try:
        await asyncio.wait(drains, timeout=limit_s)
    finally:
        running = [d for d in drains if not d.done()]
        if running:
            await cancel_until_done(running, limit_s=1.0)
        for d in drains:  # retrieved: a drain that failed (the connection closed meanwhile) ends only itself
            if d.done() and not d.cancelled():
                d.exception()
        with contextlib.suppress(Exception):  # the server gone meanwhile: nothing left to send it
            await nc.close()


def cmd_tap(args: argparse.Namespace) -> int:
    if args.max < 0:  # -1 read as 'stop after one message' (count >= -1)
        print(f"error: --max must be a count of messages >= 0 (0 = never stop), not {args.max}", file=sys.stderr)
        return 2
    from evolving_infra.state import fill_nats_url
    from shared.log import setup_logging

    setup_logging("console", "warning")  # the bus client's debug lines are not this command's output
    if (missing := fill_nats_url(args)) is not None:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    return asyncio.run(_tap(args))


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "tap",
        help="print decoded messages of the running cluster (up's, or --nats-url)",
        description="Subscribe to subjects of a partition and print decoded messages live. SUBJECT may be relative to "
        "the partition (e.g. 'kv.events.*', 'node.state.>', 'split.>') or absolute ('ei.p0.>').",
    )
    p.add_argument("subjects", nargs="*", metavar="SUBJECT", help="subjects or wildcards (default: everything)")
    p.add_argument(
        "--nats-url", default=None, help="NATS server (default: env EI_NATS_URL, which keeps a password in it out of the process "
        "list; else the running `evolving-infra up` cluster's, from the state file it writes)"
    )
    p.add_argument("--partition", default="p0", help="partition (default p0)")
    p.add_argument(
        "--nats-creds",
        default="",
        help="credentials (admin reads everything); default: env EI_NATS_CREDS (or EI_NATS_USER/EI_NATS_PASSWORD), "
        "else the admin credentials of the local cluster `up` started",
    )
    p.add_argument("--exclude", action="append", default=[], metavar="PREFIX", help="skip subjects under this relative prefix (repeatable), e.g. req.")
    p.add_argument("--full", action="store_true", help="print long lists in full")
    p.add_argument("--json", action="store_true", help="one JSON object per line: ts, subject, type, msg (+ traceparent)")
    p.add_argument("--max", type=int, default=0, help="stop after this many messages (0 = never)")
    p.set_defaults(func=cmd_tap)
