"""Tell the routers that a worker's process exited: :class:`~shared.messages.NodeDown` on ``node.down.<node>``.

A router fences the node at once and re-dispatches its requests (``services/router/service.py`` ``_on_node_down``),
where otherwise they wait for ``--fence-after-s`` of the node's state silence. ``evolving-infra up`` announces each
worker exit its supervision pass sees (:func:`announce_downs`, from ``LocalCluster``); the Slurm job's worker
``supervise`` loop, on the worker's node, announces its worker's exit with ``python -m evolving_infra.nodedown``
(:func:`main`), with the job's launcher credentials (only the launcher identity may publish ``node.down.*``:
``shared.auth``). Before, nothing did under Slurm: a killed worker's requests waited for its silence.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence

import structlog

from shared import messages as m
from shared.auth import NatsAuth
from shared.bus import Bus, BusError
from shared.subjects import NODE_DOWN, Subjects

log = structlog.get_logger("cluster")

NODE_DOWN_PUBLISH_TIMEOUT_S = 1.0
"""Wall seconds one ``node.down`` publish may take (:func:`announce_downs`); it only queues the message in the client's
buffer as a rule."""

CONNECT_TIMEOUT_S = 5.0
"""Wall seconds :func:`main` waits for NATS (one connect attempt; the job's nats-server may be restarting)."""


async def announce_downs(bus: Bus, downs: Sequence[m.NodeDown]) -> dict[str, int]:
    """Publish each of ``downs`` on ``node.down.<node>`` (core NATS), each publish at most
    :data:`NODE_DOWN_PUBLISH_TIMEOUT_S`, then one :meth:`~shared.bus.Bus.flush` (at most as long) that confirms them and
    lets a refusal come: NATS answers a publish it refuses with an asynchronous "Permissions Violation", which raises
    nothing here. A refusal of ``node.down`` (credentials made by an ``evolving-infra auth gen`` from before
    ``node.down`` existed, or not the launcher's) is a warning saying to make them again; before, "told the routers"
    was logged at info for a notice the server had refused. One that cannot be published (the bus down) is logged and
    dropped: the routers fence the node after its silence then. Never raises.

    Returns:
        How many notices ended each way: ``told`` (published and confirmed), ``refused`` (Permissions Violation),
        ``unconfirmed`` (the flush timed out), ``failed`` (the publish raised or timed out).
    """
    out = {"told": 0, "refused": 0, "unconfirmed": 0, "failed": 0}
    if not downs:
        return out
    refusals = bus.counters["nats.permission_violations"]
    sent: list[m.NodeDown] = []
    for d in downs:
        try:
            await asyncio.wait_for(bus.publish(NODE_DOWN, d, node=d.node), NODE_DOWN_PUBLISH_TIMEOUT_S)
        except (BusError, asyncio.TimeoutError) as e:
            out["failed"] += 1
            log.warning("could not tell the routers that a worker exited (node.down); they fence it after "
                        "--fence-after-s of silence", node=d.node, pid=d.pid, error=repr(e)[:300])  # fmt: skip
        else:
            sent.append(d)
    if not sent:
        return out
    try:
        await bus.flush(NODE_DOWN_PUBLISH_TIMEOUT_S)
    except BusError as e:
        for d in sent:
            out["unconfirmed"] += 1
            log.warning("published that a worker exited (node.down), but NATS did not confirm it in time; the routers "
                        "fence it after --fence-after-s of silence if it did not reach them", node=d.node, pid=d.pid,
                        error=repr(e)[:300])  # fmt: skip
        return out
    # the launcher may publish node.down.* or none of it (shared.auth): the latest refusal naming a node.down subject
    # says this identity lacks it (nats-py lowercases the subject in the server's text)
    denied = bus.last_denied
    prefix = bus.subjects.format(NODE_DOWN, node=sent[0].node).lower().removesuffix(sent[0].node.lower())
    refused = (bus.counters["nats.permission_violations"] != refusals and denied is not None and denied[0] == "publish"
               and denied[1].lower().startswith(prefix))  # fmt: skip
    for d in sent:
        if refused:
            out["refused"] += 1
            log.warning("NATS refused the launcher's node.down (Permissions Violation): the routers fence the "
                        "worker only after --fence-after-s of silence; its credentials lack node.down.*, made by an "
                        "older 'evolving-infra auth gen': make them again with 'evolving-infra auth gen'",
                        node=d.node, pid=d.pid, identity=bus.identity)  # fmt: skip
        else:
            out["told"] += 1
            log.info("told the routers that a worker exited (node.down)", node=d.node, pid=d.pid, code=d.code)
    return out


def _say(text: str) -> None:
    """One line on stdout, as the job script's own (``[evolving-infra HH:MM:SS] ...``)."""
    print(f"[evolving-infra {time.strftime('%H:%M:%S')}] {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m evolving_infra.nodedown --node N --pid PID --code C [--creds FILE]``: announce one worker exit on the
    job's NATS (``EI_NATS_URL``, ``EI_PARTITION``) as the launcher identity (internal: the Slurm job's worker
    ``supervise`` loop runs it at its worker's exit). At most :data:`CONNECT_TIMEOUT_S` + 2 ×
    :data:`NODE_DOWN_PUBLISH_TIMEOUT_S` wall s. Prints one line saying whether the routers were told.

    Returns:
        0 told; 1 not told (no NATS in time, refused credentials or permission: the routers fence the node after its
        silence); 2 a bad argument (one line on stderr).
    """
    p = argparse.ArgumentParser(prog="python -m evolving_infra.nodedown",
                                description="Tell the routers that a worker's process exited (node.down; deploy/slurm).")  # fmt: skip
    p.add_argument("--node", required=True, help="the worker's node id (w0, w1, ...)")
    p.add_argument("--pid", type=int, required=True, help="the exited process's pid (the NodeState.pid it reported)")
    p.add_argument("--code", type=int, default=0, help="its exit status; negative: killed by that signal")
    p.add_argument("--exited-ns", type=int, default=0, help="wall ns of the exit (0: now)")
    p.add_argument("--creds", default="", help="the launcher's credentials file (empty: NATS runs open)")
    args = p.parse_args(argv)
    url = os.environ.get("EI_NATS_URL", "")
    if not url:
        print("error: no NATS server: set EI_NATS_URL", file=sys.stderr)
        return 2
    if args.pid < 0 or args.exited_ns < 0:
        print("error: --pid and --exited-ns must be >= 0", file=sys.stderr)
        return 2
    try:
        down = m.NodeDown(node=args.node, pid=args.pid, exited_ns=args.exited_ns or time.time_ns(), code=args.code)
        subjects = Subjects(os.environ.get("EI_PARTITION", "p0"))
        subjects.format(NODE_DOWN, node=down.node)  # a node id that is no NATS token: refused here, not by the router
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from shared.log import setup_logging

    setup_logging("console", "error")  # the bus client's own lines are not the job's output

    async def run() -> dict[str, int]:
        auth = NatsAuth.from_file(args.creds) if args.creds else None
        bus = await asyncio.wait_for(Bus.connect(url, subjects, service="launcher", instance="launcher", auth=auth,
                                                 allow_reconnect=False, connect_timeout=CONNECT_TIMEOUT_S),
                                     CONNECT_TIMEOUT_S + 1.0)  # fmt: skip
        try:
            return await announce_downs(bus, [down])
        finally:
            await bus.close()

    what = f"worker-{down.node} (pid {down.pid}) exited"
    try:
        got = asyncio.run(run())
    except Exception as e:  # no NATS in time, refused credentials, a bad creds file: one line, never a traceback
        _say(f"could not tell the routers that {what} (node.down): {e!r}"[:400] + "; they fence it after its silence")
        return 1
    if got["told"]:
        _say(f"published that {what} (node.down): a router fences it now if the pid is the one the node reports")
        return 0
    why = "NATS refused node.down to these credentials (make them again: evolving-infra auth gen)" if got["refused"] else "not confirmed by NATS"
    _say(f"could not tell the routers that {what} (node.down): {why}; they fence it after its silence")
    return 1


if __name__ == "__main__":
    sys.exit(main())
