"""``evolving-infra status``: one look at the running cluster.

What an operator wants first, in ~15-25 lines (``--json``: one JSON object of the same, for scripts), from what
exists already, no new bus subject:

* the cluster: the state file ``up`` (or ``demo``) writes (:mod:`evolving_infra.state`): launcher pid and uptime,
  policy set, speedup, engine, profile, router URL, log folder, metrics endpoints, and each service's pid, restarts,
  or that ``up`` left it down after a crash loop (``left_down`` / ``left_down_info``: since when, when it is tried
  again, what no longer adapts);
* the split and the nodes: the router's ``GET /v1/cluster`` (the phases the nodes report, each node's fencing, state
  age, load and GPU KV use; ``split_heard_s``, how long ago the router heard the planner's split);
* the planner's split: ``split.get`` on NATS (epoch, split, reason: the warm-up's end "until t=... s"), as ``split get``
  asks it; not asked when ``up`` left the planner down.

Without ``--router-url`` / ``--nats-url`` the cluster is the one running local ``up`` cluster (its state file).
Every wait is bounded by ``--timeout`` (HTTP and NATS at once). Exit status: 0 the cluster was found and its router
answered; 1 no running cluster found (or several, and nothing says which), or its router did not answer (what the
state file says is printed all the same); 2 a bad argument.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

EXIT_STATUSES = (
    "exit status: 0 the cluster was found and its router answered (a planner that did not answer is a line, not a "
    "failure); 1 no running local cluster found (or several: pass --router-url), or its router did not answer within "
    "--timeout (what the state file says is printed all the same); 2 a bad argument"
)
"""``status``'s exit statuses, the end of its ``--help``."""

DEFAULT_TIMEOUT_S = 3.0
"""Default ``--timeout``: wall seconds for the router's answer and, at the same time, NATS's and the planner's."""

SERVICE_ORDER = {"nats-server": 0, "router": 1, "kvdirectory": 2, "planner": 3, "worker": 4}
"""How services are listed: by kind (a router ``router-1``, a worker ``worker-w0``), then by name."""


def _kind(name: str) -> int:
    return SERVICE_ORDER.get(name.split("-", 1)[0] if name != "nats-server" else name, 5)


def duration(seconds: float | None) -> str:
    """Wall seconds as status prints them: ``0.4 s`` under 10 s, ``42 s`` under a minute, ``3m05s``, ``2h07m``;
    ``?`` for None or a value that is not a finite number >= 0."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _pid_alive(pid: int) -> bool:
    from evolving_infra.state import _alive

    return pid > 0 and _alive(pid)


def build_status(state: Mapping[str, Any] | None, cluster: Mapping[str, Any] | None, *, router_url: str | None,
                 router_error: str | None = None, planner: Mapping[str, Any] | None = None, planner_error: str | None = None,
                 now_unix: float | None = None, alive: Any = _pid_alive) -> dict[str, Any]:
    """The status as one plain dict (what ``--json`` prints; :func:`format_status` writes it as text).

    Args:
        state: the ``up`` state file's JSON (:func:`evolving_infra.state.running_clusters`), None when no state file
            was found (a cluster given by ``--router-url`` only).
        cluster: the router's ``GET /v1/cluster`` JSON, None when it did not answer.
        router_url: the router asked.
        router_error: why the router did not answer (None when it did).
        planner: the planner's ``split.get`` answer as ``split get --json`` prints it (epoch, split, phases, reason,
            decided_at), None when not asked or no answer.
        planner_error: why there is no planner answer (left down, no answer within the timeout, no NATS URL).
        now_unix: the time (unix s) ages are counted to; default now.
        alive: ``alive(pid) -> bool``, whether a listed pid still runs (default: ``kill(pid, 0)``, no zombie).

    Returns:
        ``{"cluster": {...}, "router": {...}, "split": {...}, "nodes": [...], "services": [...] | None}``; every
        duration in wall seconds, every time in unix seconds.
    """
    from shared.auth import redact_url
    from shared.split import split_name

    now = time.time() if now_unix is None else now_unix
    st: Mapping[str, Any] = state or {}
    started = _num(st.get("started_unix"))
    speedup = _num(st.get("speedup")) or (_num(cluster.get("speedup")) if cluster else None)
    info: dict[str, Any] = {
        "launcher_pid": st.get("pid"),
        "state_file": st.get("state_file"),
        "started_unix": started or None,
        "uptime_s": round(now - started, 1) if started else None,
        "policy": st.get("policy") or (cluster.get("policy") if cluster else None),
        "speedup": speedup,
        "engine": st.get("engine"),
        "profile": st.get("profile"),
        "nodes": st.get("nodes"),
        "routers": st.get("routers"),
        "partition": st.get("partition"),
        "router_url": router_url,
        "nats_url": redact_url(str(st["nats_url"])) if st.get("nats_url") else None,
        "log_dir": st.get("log_dir"),
        "metrics": dict(st.get("metrics") or {}),
    }
    router: dict[str, Any] = {"url": router_url, "answered": cluster is not None, "error": router_error}
    nodes: list[dict[str, Any]] = []
    split: dict[str, Any] = {"serving": None, "phases": None, "router_epoch": None, "router_reason": None,
                             "heard_s": None, "planner": dict(planner) if planner else None, "planner_error": planner_error}
    if cluster is not None:
        router.update({"instance": cluster.get("router"), "routable": cluster.get("routable"), "reason": cluster.get("reason"),
                       "inflight": cluster.get("inflight")})
        phases: dict[str, Any] = {}
        for n in cluster.get("nodes") or []:
            if not isinstance(n, Mapping):
                continue
            phase = n.get("phase") or n.get("reported_phase")
            if phase and not n.get("fenced"):
                phases[str(n.get("node"))] = phase
            free, total = _num(n.get("gpu_free_blocks")), _num(n.get("gpu_total_blocks"))
            nodes.append({
                "node": n.get("node"), "phase": phase, "fenced": bool(n.get("fenced")), "eligible": n.get("eligible"),
                "state_age_wall_s": n.get("state_age_wall_s"), "running": n.get("running"), "waiting": n.get("waiting"),
                "queue_len": n.get("queue_len"), "inflight": n.get("inflight"),
                "gpu_kv_used": round((total - free) / total, 4) if free is not None and total else None,
                "gpu_total_blocks": n.get("gpu_total_blocks"), "kv_stale": n.get("kv_stale"),
            })
        split.update({"serving": split_name(phases) if phases else None, "phases": phases or None,
                      "router_epoch": cluster.get("epoch"), "router_reason": cluster.get("split_reason"),
                      "heard_s": cluster.get("split_heard_s")})
    services: list[dict[str, Any]] | None = None
    if state is not None:
        pids: Mapping[str, Any] = st.get("pids") or {}
        restarts: Mapping[str, Any] = st.get("restarts") or {}
        down = set(st.get("left_down") or ())
        down_info: Mapping[str, Any] = st.get("left_down_info") or {}
        services = []
        for name in sorted(set(pids) | set(restarts) | down, key=lambda x: (_kind(x), x)):
            row: dict[str, Any] = {"name": name, "pid": pids.get(name), "restarts": int(restarts.get(name) or 0)}
            if name in down:
                d = down_info.get(name) or {}
                row.update({"state": "left_down", "pid": None, "since_unix": d.get("since_unix"),
                            "retry_at_unix": d.get("retry_at_unix"), "effect": d.get("effect") or None})
            elif isinstance(row["pid"], int) and alive(row["pid"]):
                row["state"] = "running"
            else:  # exited and waiting for its restart (backoff), or gone since the state file was written
                row["state"] = "not_running"
            services.append(row)
    return {"cluster": info, "router": router, "split": split, "nodes": nodes, "services": services}


def _planner_line(split: Mapping[str, Any]) -> str:
    p = split.get("planner")
    if p:
        nodes = " ".join(f"{k}={v}" for k, v in (p.get("phases") or {}).items())
        return f"  planner: epoch {p.get('epoch')}: {p.get('split')} ({nodes}); reason: {p.get('reason')}"
    return f"  planner: {split.get('planner_error') or 'not asked'}"


def _node_line(n: Mapping[str, Any], width: int) -> str:
    fence = "FENCED" if n.get("fenced") else ("ok" if n.get("eligible") else "not eligible")
    parts = [f"  {str(n.get('node')):<{width}}  {str(n.get('phase') or '?'):<7}  {fence:<6}",
             f"state {duration(_num(n.get('state_age_wall_s')))} ago"]
    if n.get("running") is not None:
        parts.append(f"running {n.get('running')} waiting {n.get('waiting')} queue {n.get('queue_len')}")
    parts.append(f"in flight {n.get('inflight')}")
    if (used := _num(n.get("gpu_kv_used"))) is not None:
        parts.append(f"GPU KV {used:.0%} of {n.get('gpu_total_blocks')} blocks" + (" (KV view stale)" if n.get("kv_stale") else ""))
    return "   ".join(parts)


def _service_line(s: Mapping[str, Any], width: int, now: float) -> str:
    name = f"  {str(s.get('name')):<{width}}  "
    again = f", {s['restarts']} restart{'' if s['restarts'] == 1 else 's'}" if s.get("restarts") else ""
    if s.get("state") == "running":
        return f"{name}running (pid {s.get('pid')}){again}"
    if s.get("state") == "left_down":
        since, retry = _num(s.get("since_unix")), _num(s.get("retry_at_unix"))
        when = f" {duration(now - since)} ago" if since else ""
        tried = f"; tried again in {duration(max(0.0, retry - now))}" if retry else ""
        effect = f"; {s['effect']}" if s.get("effect") else ""
        return f"{name}LEFT DOWN after a crash loop{when}{again}{tried}{effect}"
    return f"{name}NOT RUNNING (exited; up restarts it){again}"


def format_status(status: Mapping[str, Any], now_unix: float | None = None) -> list[str]:
    """The lines ``status`` prints for :func:`build_status`'s dict (no trailing newlines).

    ``now_unix``: the time (unix s) the left-down services' ages and retries are counted to; default now."""
    now = time.time() if now_unix is None else now_unix
    c, r, sp = status["cluster"], status["router"], status["split"]
    out: list[str] = []
    if c.get("launcher_pid") is not None:
        up_s, speedup = _num(c.get("uptime_s")), _num(c.get("speedup"))
        clock = f" (cluster clock t={up_s * speedup:.0f} s)" if up_s is not None and speedup else ""
        head = f"cluster: up pid {c['launcher_pid']}, up {duration(up_s)}{clock}"
    else:
        head = "cluster: no local state file (given by --router-url)"
    facts = [f"policy {c['policy']}" if c.get("policy") else "",
             f"speedup {c['speedup']:g}" if c.get("speedup") is not None else "",
             f"engine {c['engine']}" if c.get("engine") else "", f"profile {c['profile']}" if c.get("profile") else "",
             f"{c['nodes']} nodes" if c.get("nodes") is not None else "",
             f"partition {c['partition']}" if c.get("partition") else ""]
    out.append(head + "; " + ", ".join(f for f in facts if f) if any(facts) else head)
    routers = f" ({c['routers']} routers on one port)" if (c.get("routers") or 1) > 1 else ""
    where = [f"  router {r.get('url')}{routers}"]
    if c.get("nats_url"):
        where.append(f"NATS {c['nats_url']}")
    if c.get("log_dir"):
        where.append(f"logs {c['log_dir']}")
    out.append("   ".join(where))
    if metrics := c.get("metrics"):
        ports = sorted(str(u).rsplit(":", 1)[-1].split("/", 1)[0] for u in metrics.values())
        out.append(f"  metrics: {len(metrics)} endpoints (/metrics on ports {', '.join(ports)})")
    if not r.get("answered"):
        out.append(f"router: NO ANSWER from {r.get('url')}: {r.get('error')}: the split served and the nodes are unknown")
    else:
        routable = "routable" if r.get("routable") else f"NOT routable: {r.get('reason')}"
        out.append(f"router: answered ({r.get('instance')}), {routable}, {r.get('inflight')} in flight")
        phases = " ".join(f"{k}={v}" for k, v in (sp.get("phases") or {}).items())
        heard = _num(sp.get("heard_s"))
        heard_text = (f"heard the planner's split {duration(heard)} ago" if heard is not None
                      else "has not heard the planner's split since it started")
        out.append(f"split: serving {sp.get('serving') or 'nothing'}" + (f" ({phases})" if phases else "")
                   + f"; router epoch {sp.get('router_epoch')}, {heard_text}")
    out.append(_planner_line(sp))
    if r.get("answered"):
        nodes = status["nodes"]
        out.append(f"nodes ({len(nodes)}):" if nodes else "nodes: none reported")
        width = max((len(str(n.get("node"))) for n in nodes), default=2)
        out.extend(_node_line(n, width) for n in nodes)
    services = status.get("services")
    if services is None:
        out.append("services: unknown (no state file: only the `up` that started the cluster writes one)")
    else:
        down = sum(1 for s in services if s.get("state") == "left_down")
        out.append(f"services ({len(services)}" + (f", {down} LEFT DOWN" if down else "") + "):")
        width = max((len(str(s.get("name"))) for s in services), default=8)
        out.extend(_service_line(s, width, now) for s in services)
    return out


def pick_cluster(found: list[dict[str, Any]], *, router_url: str | None, nats_url: str | None,
                 partition: str | None) -> dict[str, Any] | None:
    """The state of the cluster ``status`` shows among the running ones (``found``): the one whose router URL is
    ``router_url`` (or NATS URL ``nats_url``) when given, of ``partition`` when given; None when none matches and a
    URL was given (the cluster was started otherwise).

    Raises:
        ClusterNotFound: nothing given and none runs, or several match (each listed).
    """
    from evolving_infra.state import ClusterNotFound, not_found_message
    from shared.auth import redact_url

    cand = [c for c in found if partition is None or c.get("partition", "p0") == partition]
    if router_url is not None:
        cand = [c for c in cand if str(c.get("router_url", "")).rstrip("/") == router_url.rstrip("/")]
    elif nats_url is not None:
        cand = [c for c in cand if c.get("nats_url") == nats_url]
    if len(cand) > 1:
        listed = "; ".join(f"router {c.get('router_url')} (NATS {redact_url(str(c.get('nats_url')))}, pid {c.get('pid')})"
                           for c in cand)
        raise ClusterNotFound(f"{len(cand)} local clusters are running: {listed}; pass --router-url to pick one")
    if cand:
        return cand[0]
    if router_url is None:
        raise ClusterNotFound(not_found_message("pass --router-url (and --nats-url)"))
    return None


async def _router_cluster(url: str, timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    """``GET url/v1/cluster`` within ``timeout`` s (``Authorization: Bearer $EI_API_KEY`` when set): (its JSON, None),
    or (None, why not)."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if (key := os.environ.get("EI_API_KEY", "").strip()) else {}
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            r = await asyncio.wait_for(client.get(url.rstrip("/") + "/v1/cluster", headers=headers), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        return None, f"no answer within {timeout:g} s"
    except httpx.HTTPError as e:
        return None, f"cannot connect ({type(e).__name__}: {e})"
    if r.status_code == 401:
        return None, "401: it wants an API key (set EI_API_KEY to one of its keys)"
    if r.status_code != 200:
        return None, f"HTTP {r.status_code}: {r.text[:200]}"
    try:
        body = r.json()
    except ValueError:
        return None, "its /v1/cluster answer is not JSON"
    if not isinstance(body, dict):
        return None, "its /v1/cluster answer is not a JSON object"
    return body, None


async def _planner_split(nats_url: str, partition: str, creds: str, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """The planner's split (``split.get``, as ``split get``) within ``timeout`` s in all (connect included): (its
    ``split get --json`` dict, ""), or (None, why not)."""
    from evolving_infra.auth_cli import tool_auth
    from evolving_infra.split_cli import _ask, _Unanswered, command_json, connect_tool
    from shared import messages as m
    from shared.auth import AuthError
    from shared.bus import BusError
    from shared.subjects import SPLIT_GET

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        auth = tool_auth(nats_url, creds, "nats_operator_creds")
    except AuthError as e:
        return None, f"no answer: {e}"
    try:
        bus = await connect_tool(nats_url, partition, "status-cli", timeout, auth)
    except Exception as e:  # no server, refused credentials: a line, not a traceback
        return None, f"not asked: cannot connect to NATS ({type(e).__name__}: {e})"
    try:
        cmd, _, _ = await _ask(bus, SPLIT_GET, m.SplitQuery(), max(deadline - loop.time(), 0.05))
    except _Unanswered:
        return None, f"NO ANSWER within {timeout:g} s (restarting, or not running: see services)"
    except BusError as e:
        return None, f"no usable answer ({e})"
    finally:
        await bus.close()
    return command_json(cmd), ""


async def _gather(state: Mapping[str, Any] | None, router_url: str, nats_url: str | None, partition: str, creds: str,
                  timeout: float) -> dict[str, Any]:
    down = set((state or {}).get("left_down") or ())
    if "planner" in down:
        ask_planner = None
        planner_error = "LEFT DOWN by up after a crash loop: the split stays as the workers serve it (see services)"
    elif nats_url is None:
        ask_planner, planner_error = None, "not asked (no NATS URL: pass --nats-url)"
    else:
        ask_planner, planner_error = _planner_split(nats_url, partition, creds, timeout), ""
    router_task = _router_cluster(router_url, timeout)
    if ask_planner is not None:
        (cluster, router_error), (planner, planner_error) = await asyncio.gather(router_task, ask_planner)
    else:
        cluster, router_error = await router_task
        planner = None
    return build_status(state, cluster, router_url=router_url, router_error=router_error, planner=planner,
                        planner_error=planner_error or None)


def cmd_status(args: argparse.Namespace) -> int:
    """``evolving-infra status``: print the status (:func:`format_status`, or ``--json``); returns the exit status
    (:data:`EXIT_STATUSES`)."""
    from evolving_infra.state import ClusterNotFound, running_clusters
    from shared.log import setup_logging

    if not 0 < args.timeout < math.inf:
        print(f"error: --timeout must be a number of seconds > 0, not {args.timeout:g}", file=sys.stderr)
        return 2
    setup_logging("console", "warning")  # the bus client's debug lines are not this command's output
    try:
        state = pick_cluster(running_clusters(), router_url=args.router_url, nats_url=args.nats_url, partition=args.partition)
    except ClusterNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    router_url = args.router_url or str((state or {}).get("router_url") or "")
    if not router_url:  # a state file without one (not written by up): nothing to ask
        print(f"error: the state file {(state or {}).get('state_file')} names no router URL; pass --router-url",
              file=sys.stderr)
        return 1
    nats_url = args.nats_url or (state or {}).get("nats_url") or os.environ.get("EI_NATS_URL") or None
    partition = args.partition or str((state or {}).get("partition") or "p0")
    status = asyncio.run(_gather(state, router_url, nats_url, partition, args.nats_creds, args.timeout))
    if args.json:
        print(json.dumps(status, sort_keys=True))
    else:
        print("\n".join(format_status(status)))
    return 0 if status["router"]["answered"] else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``status`` to ``evolving-infra``'s subcommands."""
    p = sub.add_parser(
        "status",
        help="one look at the running cluster: launcher, split (served and the planner's), nodes, services",
        description="Print what the running cluster is doing, in ~20 lines: the launcher (pid, uptime, policy, speedup, "
        "engine, profile, router URL, logs, metrics ports), the split the nodes serve (the router's GET /v1/cluster) and "
        "the planner's (split.get, as `split get`: epoch, reason, the warm-up's end) with how long ago the router heard "
        "it, one line per node (phase, fenced, state age, queue, in flight, GPU KV use) and per service (pid, restarts, "
        "or LEFT DOWN after a crash loop: since when, when it is tried again, what no longer adapts). The cluster is the "
        "one running local `evolving-infra up` (its state file) unless --router-url / --nats-url name another.",
        epilog=EXIT_STATUSES,
    )
    p.add_argument("--router-url", default=None,
                   help="the router to ask (default: the running `up` cluster's, from its state file); a router with "
                   "API keys wants one in env EI_API_KEY")
    p.add_argument("--nats-url", default=None,
                   help="NATS server for the planner's split (default: the running `up` cluster's, else env EI_NATS_URL)")
    p.add_argument("--partition", default=None, help="partition (default: the running cluster's, else p0)")
    p.add_argument("--nats-creds", default="",
                   help="credentials to ask the planner with; default: env EI_NATS_CREDS (or EI_NATS_USER/EI_NATS_PASSWORD), "
                   "else the operator credentials of the local cluster `up` started")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to wait for the router's answer and, meanwhile, NATS's and the planner's (default "
                   f"{DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (cluster, router, split, nodes, services; wall seconds, unix times) for scripts")
    p.set_defaults(func=cmd_status)
