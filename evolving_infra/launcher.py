"""``evolving-infra up`` and ``evolving-infra demo``.

``up`` starts an embedded nats-server (unless ``--nats-url``) and every service
as its own OS process, waits until all are healthy, prints where the router
listens, and stops everything cleanly on Ctrl-C / SIGTERM (also during start-up,
e.g. while ``--nats-url`` is unreachable; and the embedded nats-server and the
services die with it if it is killed outright). It supervises: a
service that exits is restarted (exponential backoff, a log line, a restart
counter in ``LOG_DIR/cluster.json``), a dead nats-server is started again on the
same port; ``--no-restart`` stops the whole cluster on the first exit instead.
Its stop is a fast one: the router gets SIGINT (no ``--shutdown-grace-s`` drain: what is open
fails with "router shutting down"), but when ``--no-restart`` stops the cluster because a service exited (nobody asked
for a quick stop) the routers get SIGTERM and drain first, the other services serving meanwhile (not when the nats-server is what exited: no stream finishes without it); a SIGTERM sent to the router process alone drains it, and
the supervisor restarts it once it has exited (at once: a clean exit has no backoff). ``up`` holds the
router's listening socket (``LocalCluster.router_socket``, the router's ``--listen-fd``), so clients that
connect while the router drains, exits and starts again wait for the next one instead of being refused
(not with ``--no-restart``: no next router comes, so the router binds its port and answers 503 while it drains).
``--routers N`` runs N router processes (``router``, ``router-1``, ...) on that one held socket: the kernel hands
each connection to one of them, so while one drains, exits or is restarted the others serve (no gap); a SIGKILLed one
loses only the streams it held.

``demo`` does the same, replays real Claude Code sessions through the router
(closed loop, N concurrent agents), writes ``OUT/report.json`` plus
``OUT/requests.jsonl`` and prints a summary (each answered request's record is appended to
``OUT/requests.partial-<id>.jsonl`` as it completes, as ``replay`` does, so a SIGKILLed or OOM-killed demo keeps them
there; files of a run's output names already in ``OUT`` are moved to ``OUT/previous/`` once the replay has ended,
just before the report is written (a demo that fails or is killed leaves them in place), which keeps only the last
run's; ``OUT`` is held for the whole demo: a second run into it stops before its cluster starts); SIGINT / SIGTERM / SIGHUP stop it as
they stop ``up`` (cluster, nats-server store and state file gone; one line on
stderr; status 128 + the signal); during the replay they stop it (no new request; those in flight cancelled) and the
demo writes and prints the report of what was answered, headed ``PARTIAL REPORT: the replay was stopped by SIGINT ...``
(``meta.partial`` with the signal, and ``meta.interrupted`` as ``replay`` writes it); during start-up no report. Once
its cluster has stopped one ends it at once (Ctrl-C while the report is written: "interrupted", status 130; SIGTERM
143, SIGHUP 129; the writers remove what they had begun) and the rest of a burst is ignored; once the demo has
ended (its report written) they are all ignored until it exits (a demo called in-process, ``main([...])``: their
defaults from its cluster's stop on).
A cluster that ends for good during the replay (``--no-restart``: a service or the nats-server exited; else a
service whose restarts gave up) stops the replay at once (no new request; those in flight cancelled) and the
cluster; the demo then writes and prints the report of what was answered, headed ``PARTIAL REPORT: ...`` (the
service, how it ended, the requests sent, cancelled and never sent: ``meta.partial``), and exits as ``up`` does
(3 for a clean exit, else 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import os
import re
import secrets
import shlex
import signal
import socket
import sys
import time
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from evolving_infra.cli import UP_STOP_SIGNALS, UsageError, command_name
from evolving_infra.policy_args import LivePolicy, add_policy_args, live_policy
from evolving_infra.stdio_args import folder, shown, stdin_file
from evolving_infra.cluster import (
    LIVENESS_MIN_S, THREAD_ENV, WILDCARD_HOSTS, ClusterConfigError, ClusterError, ClusterSpec, LocalCluster, ServiceStopped, worker_placement, write_json,
)
from evolving_infra.replay.retry import RetryPolicy
from shared.auth import redact_argv, redact_url
from shared.log import setup_logging
from shared.profile import ProfileError, available_profiles
from shared.service import until_stopped
from shared.signals import LateStopSignals, caught_early, process_claimed, run_then_ignore
from shared.split import SplitError, parse_split
from services.router.toolcalls import KNOWN_PARSERS as TOOL_CALL_PARSERS

DEMO_TRACE = "claude-code-sample.jsonl.gz"

DEFAULT_PROFILE = "gb300-glm52"
"""``up``'s and ``demo``'s node profile unless ``--profile`` (``--engine sim``)."""

TORCH_PROFILE = "torch-tiny-cpu"
"""The profile ``--engine torch`` uses when ``--profile`` is left at :data:`DEFAULT_PROFILE`."""


def demo_trace_path() -> Path:
    """The Claude Code sample shipped with the package (see evolving_infra/data/SOURCE.md)."""
    return Path(str(resources.files("evolving_infra") / "data" / DEMO_TRACE))


def tcp_port(text: str) -> int:
    """``--port``'s argparse type: a TCP port, 0-65535 (0 = any free one).

    Raises:
        argparse.ArgumentTypeError: not an integer, or out of range. Before, ``up --port 99999`` started NATS and
            every service, then failed (exit 1) on the router's "Expected `int` <= 65535 - at `$.port`".
    """
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: give 0-65535 (0 = any free port)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port: give 0-65535 (0 = any free port)")
    return port

def _add_cluster_args(
    p: argparse.ArgumentParser, *, nodes: int, split: str, speedup: float, port: int = 8000, log_dir: str = "a temp dir",
    warmup: str = "1800 s of simulated time, the paper's", fence_after_s: float | None = None,
) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=int, default=nodes, help=f"worker nodes, one process each (default {nodes})")
    g.add_argument(
        "--split",
        default=None,
        help=f"initial PD split: 'collocated' or xPyD with x+y = nodes (default: a static:xPyD policy's; another one given "
        f"is served and names the set: static:5P1D --split 3P1D is static:3P1D; else {split} on "
        f"the default {nodes} nodes and, for another --nodes, round(2N/3) prefill nodes as simulate's (3 nodes: 2P1D, "
        "2: 1P1D, 1: collocated). The default policy's evolving planner serves every node collocated for its warm-up "
        f"first (t_learn_s: {warmup}; the paper's policy fits each node's models collocated) and this split only "
        "after it, then re-plans; for this split at once: --policy static:xPyD (fixed); --planner-opt t_learn_s=60 "
        "shortens the warm-up to 60 s of served traffic (on an idle cluster it is extended while no model can be fitted: "
        "a node needs 8 iterations with a prefill part and 8 with a decode part)",
    )
    p.set_defaults(default_split=split, default_nodes=nodes)
    g.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"node profile: a shipped name ({', '.join(available_profiles()) or 'none found'}) or a TOML path "
        f"(default {DEFAULT_PROFILE}: simulated GB300 nodes serving GLM-5.2; --engine torch: {TORCH_PROFILE})",
    )
    g.add_argument("--speedup", type=float, default=speedup, help=f"simulated seconds per wall second (default {speedup:g}); "
                   "--engine torch: every time reported, the workers' iteration records too, is N x the wall time")
    g.add_argument("--host", default="127.0.0.1", help="router HTTP bind address (default 127.0.0.1)")
    g.add_argument("--port", type=tcp_port, default=port, help=f"router HTTP port; 0 = any free port (default {port})")
    g.add_argument(
        "--routers", type=int, default=1, metavar="N",
        help="router processes (router, router-1, ...) all serving --port (up holds the one listening socket, each "
        "router gets it as --listen-fd): the kernel hands each connection to one of them, so while one drains "
        "(SIGTERM), exits or is restarted the others keep accepting and serving, with no gap; a SIGKILLed router loses "
        "only the streams open on it. Each is supervised and restarted on its own, has its own NATS identity and its "
        "own log (LOG_DIR/router-K.log); up is ready when every one is (default 1)",
    )  # fmt: skip
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (default: the profile's block_size, e.g. 64 for gb300-glm52, 4 for tiny; the workers "
        "always use the profile's, so another size is refused)",
    )
    g.add_argument(
        "--engine",
        choices=("sim", "torch"),
        default="sim",
        help="worker engine: sim (profile-timed simulated GPU; the default) or torch (a real model from --model DIR; "
        "the torch extra)",
    )
    g.add_argument(
        "--model",
        dest="model_dir",
        default="",
        help="--engine torch: local Hugging Face model folder (config.json, *.safetensors, tokenizer.json); "
        "`evolving-infra model init DIR` writes a tiny one",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name(s) the router serves, as vLLM's: /v1/models lists every one, a request may give any, "
        "and every response's model is the first (default: --engine torch: the --model folder's name, and a request "
        "may also give the folder path as typed, not listed; sim: evolving-infra-sim)",
    )
    g.add_argument(
        "--device",
        default="",
        help="--engine torch: cpu, cuda or cuda:N for every worker (default: with CUDA present worker i runs on "
        "cuda:{i %% visible devices}, as does plain cuda; else cpu); the ready banner lists each worker's",
    )
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="",
        help="--engine torch: weights and KV dtype of every worker (default float32 on CPU, bfloat16 on CUDA)",
    )
    g.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        metavar="N",
        help="--engine torch: intra-op CPU threads of each worker's torch (default: OMP_NUM_THREADS / MKL_NUM_THREADS / "
        "EI_TORCH_THREADS when set, else each CPU worker max(1, cores // CPU workers), so workers do not compete "
        "for every core; CUDA workers torch's default)",
    )
    g.add_argument(
        "--gpu-kv-tokens",
        type=int,
        default=0,
        metavar="N",
        help="tokens of KV each worker keeps in GPU memory (L1), over the profile's memory.gpu_kv_tokens (torch-tiny-cpu: "
        "1024); a multiple of the profile's block size. The longest request (prompt + max_tokens) a node can hold: the "
        "router's max_model_len is the model's context lowered to it, so set it to the context you want served "
        "(like vLLM's KV cache size); 0 = the profile's",
    )
    g.add_argument(
        "--host-kv-tokens",
        type=int,
        default=0,
        metavar="N",
        help="tokens of KV each worker keeps in host memory (L2, the prefix cache behind L1), over the profile's "
        "memory.host_kv_tokens; a multiple of the block size, at least --gpu-kv-tokens; 0 = the profile's (raised to "
        "--gpu-kv-tokens when that is more)",
    )
    g.add_argument(
        "--kv-pool",
        choices=("off", "real"),
        default="off",
        help="workers' host KV pool: off (L2 is bookkeeping only; the default) or real (every L2 block has bytes in a "
        "Mooncake-registered host buffer and peer fetches pull them over TCP, verified by CRC-32; needs "
        "scripts/install-mooncake.sh). up gives each worker its own range of 32 Mooncake ports (--kv-pool-ports), the "
        "same after a restart; the pool mirrors the whole L2, at most 1 GiB per worker (EI_KV_POOL_MAX_BYTES, "
        "which the workers inherit, raises it; checked before the start with --engine sim, a torch worker checks "
        "its own at start): gb300 profiles need --kv-pool-slot-bytes 4096 (or a smaller --host-kv-tokens). "
        "deploy-args does not support it",
    )
    g.add_argument(
        "--kv-pool-slot-bytes",
        type=int,
        default=0,
        metavar="N",
        help="--kv-pool real: bytes per block slot; 0 = the profile's block bytes up to 64 KiB (--engine torch: its "
        "page size, the only one it takes); refused without --kv-pool real",
    )
    g.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help="API keys the router accepts, one per line (# comments), with EI_API_KEYS's: every request then needs "
        "'Authorization: Bearer <key>' (401 otherwise) except /livez, /healthz, /health, /ping, /metrics (default: EI_API_KEYS_FILE, "
        "EI_API_KEYS; neither = open)",
    )
    g.add_argument("--partition", default="p0", help="partition name; subjects live under ei.<partition>. (default p0)")
    g.add_argument(
        "--nats-url",
        default=None,
        help="use this NATS server instead of starting an embedded one. A password in it (nats://user:pass@host) is on "
        "this command line, which every local user sees in ps: give the URL without one, and the credentials with "
        "--nats-creds-dir (auth gen --mode password writes user:password files, mode 0600)",
    )
    g.add_argument(
        "--nats-auth",
        choices=("nkeys", "password", "off"),
        default="nkeys",
        help="embedded NATS: nkeys (default) / password = each service its own identity with least-privilege permissions, "
        "credentials in <log-dir>/nats-creds; off = open server on loopback (any local process may publish anything)",
    )
    g.add_argument(
        "--nats-creds-dir",
        default=None,
        help="with --nats-url: folder of per-instance credentials (<instance>.nk|.creds|.pass, see 'evolving-infra auth gen')",
    )
    g.add_argument("--log-dir", default=None, type=folder, help=f"directory for each service's log (default: {log_dir}); held by one cluster at a time: "
                   "a second up or demo given a folder in use exits 2, naming the pid that holds it")
    g.add_argument("--log-level", default="info", help="service log level (default info)")
    g.add_argument(
        "--log-requests",
        action="store_true",
        help="the router logs one info line per request accepted and one per request finished (rid = the client's "
        "X-Request-ID, or its NATS-safe form with client_request_id = the id as sent; status, finish reason, prompt/cached/output tokens, ttft_s and e2e_s in "
        "simulated seconds = wall x --speedup, nodes), each worker one per request "
        "received, handed off, finished or aborted (rid), as vLLM's --enable-log-requests",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="the routers serve tool_choice 'auto' (and tools sent without tool_choice) as vLLM's flag does: the "
        "model's calls in its output are answered as message.tool_calls / delta.tool_calls, finish_reason "
        "'tool_calls'; needs --tool-call-parser. Without it such a request gets vLLM's 400; tool_choice 'none' is "
        "served either way (router --enable-auto-tool-choice)",
    )
    g.add_argument(
        "--tool-call-parser",
        default="",
        choices=TOOL_CALL_PARSERS,
        help="the tool-call format the model writes, for --enable-auto-tool-choice: hermes = <tool_call>{\"name\": "
        "..., \"arguments\": {...}}</tool_call> (Qwen2.5/Qwen3, Hermes); vLLM's name (router --tool-call-parser)",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="the routers render a request's own Jinja chat template (chat_template, or chat_template_kwargs."
        "chat_template) in the model template's sandbox, as vLLM's flag does; without it such a request gets vLLM's "
        "400. A template is code the router runs for the client: in 2 child processes, 1 GiB and 2 s a render each; Jinja's "
        "sandbox is still trusted (router --trust-request-chat-template)",
    )
    g.add_argument(
        "--otlp-traces-endpoint",
        default="",
        metavar="URL",
        help="every service exports OpenTelemetry traces (OTLP/HTTP) to this collector, e.g. http://127.0.0.1:4318 "
        "(/v1/traces appended); default: the services inherit OTEL_EXPORTER_OTLP_ENDPOINT / "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (and OTEL_TRACES_SAMPLER...) from this environment, unset = no traces; "
        "each process is service.name evolving-infra-<service> (OTEL_SERVICE_NAME is ignored)",
    )
    g.add_argument("--stream-interval", type=int, default=1, help="output tokens per streamed chunk (default 1)")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="sim (built in) or hf:<local tokenizer.json or model folder> (needs the hf extra: pip install -e '.[hf]'); "
        "with hf the sim engines emit whole words of that vocabulary, so clients can count tokens from the text "
        "(default sim; --engine torch: the --model folder's own, hf:MODEL_DIR, and sim is refused: its ids are not "
        "the model's)",
    )
    g.add_argument(
        "--fence-after-s",
        type=float,
        default=fence_after_s,
        metavar="S",
        help="wall seconds without a node's state after which the router fences the node (routes nothing to it and "
        "re-dispatches what it held: its --fence-after-s) and the planner counts it dead (its --silent-after-s: an "
        "operator's split set lays the phases over the live nodes, and a phase left on dead nodes only moves to a "
        "live one); one time for both, so the planner never moves work off a node the router still routes to "
        + (f"(default {fence_after_s:g}: on one shared machine a worker starved of CPU for a few seconds is slow, not dead)"
           if fence_after_s else "(default 3, both services' own)"),
    )
    g.add_argument(
        "--ready-timeout", type=float, default=90.0,
        help="wall seconds to wait for NATS (its connect, then the JetStream stream: each given up after this long), "
        "then for all services to be healthy (default 90)",
    )  # fmt: skip
    g.add_argument(
        "--metrics",
        action="store_true",
        help="give every service a Prometheus /metrics port (free ports on --metrics-host, listed in the READY line) and write "
        "LOG_DIR/prometheus-targets.json (a Prometheus file_sd list; [] once stopped); the router also serves /metrics "
        "on its HTTP port",
    )
    g.add_argument(
        "--metrics-host",
        default=None,
        metavar="ADDR",
        help="with --metrics / --metrics-base-port (refused without one): the address every service's metrics port binds "
        "(its /metrics and /readyz, served without authentication); default 127.0.0.1 whatever --host is; 0.0.0.0 for "
        "a Prometheus on another machine (the ready banner warns)",
    )
    g.add_argument(
        "--metrics-base-port",
        type=int,
        default=None,
        metavar="PORT",
        help="--metrics on fixed ports, as the Slurm job's: the KV directory on PORT, the planner on PORT+1, the router "
        "on PORT+2, worker wN on PORT+3+N, and with --routers N the other routers after the workers (router-K on "
        "PORT+3+NODES+K-1); all within 1024-65535 (0 is refused: --metrics alone gives free ports) (EI_METRICS_PORT is "
        "one service's port: up refuses it)",
    )
    g.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="stop the whole cluster when any service (or nats-server) exits, instead of restarting it (exit status 3 when "
        "the service exited 0, e.g. after a SIGTERM sent to it, not to up; else 1; demo then stops its replay and writes "
        "a partial report of what was answered; the router then binds "
        "its port itself: up holds it only for a next router, and a client connecting while a SIGTERMed router drains gets 503; "
        "with --routers N > 1 up still holds it, and the other routers serve such a client until the drained one exits "
        "and the cluster stops)",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=10,
        help="restarts of one service (or nats-server) within --restart-window-s before the cluster gives up, as systemd's "
        "StartLimitBurst within StartLimitIntervalSec (default 10): a crash, a liveness kill or a quick clean exit counts; "
        "a clean exit (code 0, a SIGTERM's stop: a rolling restart) after 60 s up does not. With the defaults up gives "
        "up on a service exiting more than 10 times in 10 min (more often than about once a minute) when serving would "
        "stop without it: nats-server, the last router or worker whose process runs, the planner while the running "
        "workers leave prefill or decode without a node (the error says why); a service serving survives is left down "
        "instead, tried again --restart-window-s later ('left_down' in LOG_DIR/cluster.json and the state file, one "
        "line saying what no longer adapts): a worker while another serves (the routers fenced it), a router while "
        "another serves the port, the planner (the split stays frozen), the KV directory (routing without cache "
        "information); a slower crash "
        "loop is restarted on, and from its 5th counted exit within an hour one warning line says '<service> has "
        "restarted K times in the last hour (crash loop)', again every 10 min while it lasts (and --metrics' "
        "process_start_time_seconds feeds the EIServiceCrashLoop alert of deploy/prometheus/alerts.yml)",
    )
    g.add_argument(
        "--restart-window-s",
        type=float,
        default=600.0,
        metavar="S",
        help="the window over which --max-restarts counts a service's restarts (wall s; default 600)",
    )
    g.add_argument(
        "--liveness-timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="a service whose process is stopped (SIGSTOP) or whose event loop is blocked is SIGKILLed and restarted as "
        "after a crash once it has been silent this long (wall s; default 30; 0 = off; else at least "
        f"{LIVENESS_MIN_S:g}; not with --no-restart): a service's sign of life is its heartbeat over NATS, sent every "
        "second by its own asyncio task (judged only while up's own NATS connection answers a PING), nats-server's the "
        "INFO line it sends a new connection on its port (judged up to up's latest probe that came to an end). A hang "
        "that leaves the event loop running is not seen: a handler awaiting a lock, a wedged HTTP server, a hung engine "
        "thread (a worker's own 300-s step watchdog covers that one). A process that has not answered since its start "
        "gets --ready-timeout if that is longer; after a pause of up itself (Ctrl-Z, a paused VM) every process gets a "
        "full timeout again; one warning line names it, its pid and its silence",
    )
    add_policy_args(p, live=True)


DEMO_PLANNER = {"t_learn_s": 900.0}
"""The demo's evolving planner: a 900-s collocated warm-up (18 s of wall time at speed-up 50) instead
of the paper's 1,800 s, so that most of the demo's ~6,700 simulated seconds run after it and the
planner's 600-s windows get to decide (``--planner-opt t_learn_s=...`` overrides)."""


DEMO_TORCH_PLANNER = {"t_learn_s": 240.0}
"""``demo --engine torch``'s evolving planner: a 240-s collocated warm-up (4.8 s of wall time at speed-up 50).
Its 4 scaled sessions last ~480-500 simulated seconds (2 busy cores, 2026-12-04). The warm-up counts from the planner's
first tick, ~300-360 s of cluster clock into the start-up (7-9 wall s at speed-up 50), and the replay starts at
~355-470 s: with :data:`DEMO_PLANNER`'s 900 s it ended at t=1260 s, after the replay (~840-965 s), so the demo said the
planner would move nodes and served collocated throughout; with 120 s it ended (t=480 s) before the first request,
found no iteration records and was extended by a window (to t=1080 s). 240 s ends it at t≈600 s, after ~130-250 s of
the replay's requests, and the rest is served at the split; ``--planner-opt t_learn_s=...`` overrides. On a busier
machine (load 10-12, 2026-12-05) the workers serve only ~20-23 wall s in (first record t≈1000-1240 s; the planner's
first tick t≈480-604 s): the warm-up ends with no record, and the planner restarts it at the first one (240 s from
it), so the models are still fitted partway through the replay."""


DEMO_FENCE_S = 10.0
"""The demo's router fences a node, and its planner counts it dead, after 10 wall seconds without its state (``up``:
3 s, the services' default; ``--fence-after-s`` sets both): the demo
shows the policies on one shared machine, where a worker process starved of CPU for a few seconds
(load averages of 10+ on 2 cores were seen) is slow, not dead; with one prefill node (a 1P3D the
planner may pick) a fence would fail the requests that arrive meanwhile."""


CLUSTER_STOP_GRACE_S = 15.0
"""Seconds ``up``/``demo`` let a start cancelled by a signal run its clean-up (``LocalCluster.stop`` of what it
started: up to 10 s for the services to exit, then SIGKILL, then NATS) before ``until_stopped`` cancels it again."""


def default_split_for(nodes: int, *, default_nodes: int, default_split: str) -> str:
    """The initial split of ``up``/``demo`` when neither ``--split`` nor the policy names one: ``default_split``
    (2P2D) on the default node count, else simulate's rule for ``nodes`` (round(2N/3) prefill nodes, at least
    one of each; one node collocated: :func:`evolving_infra.sim.policies.default_split`). 2P2D was the default
    for any ``--nodes``, so ``up --nodes 2`` was refused ("split '2P2D' covers 4 nodes but the cluster has 2");
    on 4 nodes simulate's rule gives 3P1D, so the 4-node default stays 2P2D.

    Args:
        nodes: ``--nodes``.
        default_nodes: the command's default ``--nodes`` (4).
        default_split: the command's split on that many nodes (``2P2D``).
    """
    if nodes == default_nodes:
        return default_split
    from evolving_infra.sim.policies import default_split as simulate_default

    return simulate_default(nodes)


def _policy(args: argparse.Namespace) -> LivePolicy:
    """The live policy of ``args``, its split applied to ``args.split``; planner options checked
    by building the planner once (a bad option fails here, not in the planner's log)."""
    from services.planner.policy import make_planner, parse_planner_args
    from shared.profile import ProfileError, load_profile

    demo_planner = DEMO_TORCH_PLANNER if args.engine == "torch" else DEMO_PLANNER
    pol = live_policy(args, planner_defaults=demo_planner if args.command == "demo" else None)
    if not hasattr(args, "split_given"):  # split_deferred_line: what the user asked for, not the default filled in
        args.split_given = args.split is not None
    if args.split is None:
        args.split = pol.split or default_split_for(args.nodes, default_nodes=args.default_nodes, default_split=args.default_split)
    try:
        profile = load_profile(args.profile)
    except ProfileError as e:  # not the planner's fault: say which flag
        raise UsageError(f"error: --profile {args.profile}: {e}") from None
    try:
        make_planner(pol.planner, [f"w{i}" for i in range(max(args.nodes, 1))], profile, **parse_planner_args(list(pol.planner_args)))
    except (ValueError, TypeError, ProfileError) as e:
        raise UsageError(f"error: --planner {pol.planner} / --planner-opt: {e}") from None
    return pol


def profile_block_size(args: argparse.Namespace) -> int:
    """The cluster's KV block size in tokens: the profile's ``block_size`` (64 for ``gb300-glm52``, 4 for
    ``tiny``, the page size of ``torch-tiny-cpu``), which every worker uses whatever the router's and the
    directory's are; ``--block-size`` may only repeat it.

    A router at another size hashes every prompt into blocks that no worker accepts: the cluster would
    start and then answer every request with 500 ("block size mismatch"), so a conflict is refused here,
    before anything starts, with status 2 (a usage error, as argparse's).

    Raises:
        UsageError: (status 2) ``--block-size`` differs from the profile's (both named, with the flag to pass),
            or the profile cannot be read.
    """
    from shared.profile import ProfileError, load_profile

    try:
        page = load_profile(args.profile).block_size
    except ProfileError as e:
        raise UsageError(f"error: --profile {args.profile}: {e}") from None
    if args.block_size is not None and args.block_size != page:
        what = "torch engine's page size" if args.engine == "torch" else "block size"
        raise UsageError(
            f"error: --block-size {args.block_size} differs from the {what} {page} of profile {args.profile}; "
            f"the router, directory and workers must use one block size: pass --block-size {page} (or leave it out) "
            "or a --profile whose block_size is the size you want"
        )
    return page


def _torch_values(args: argparse.Namespace) -> dict[str, object]:
    """Cluster fields for ``--engine``: the block size is the profile's (:func:`profile_block_size`);
    with ``torch``, check the model folder here (a clear error at start-up, not in every worker's
    log), default the profile to ``torch-tiny-cpu``, the tokenizer to the model's own, and the
    served model name to the folder's name (:func:`served_from_folder`); ``--served-model-name`` sets it for
    either engine."""
    names = list(args.served_model_name or [])
    if bad := [n for n in names if not n or "," in n or n != n.strip()]:
        raise UsageError(f"error: --served-model-name {bad[0]!r}: a name without commas or surrounding spaces")
    served = {"model": names[0], "model_names": tuple(dict.fromkeys(n for n in names[1:] if n != names[0]))} if names else {}
    if args.engine == "sim":
        if args.tokenizer is None:
            args.tokenizer = "sim"
        if args.model_dir:
            raise UsageError("error: --model needs --engine torch")
        for flag, value in (("--device", args.device), ("--dtype", args.dtype), ("--torch-threads", args.torch_threads)):
            if value:
                raise UsageError(f"error: {flag} needs --engine torch (the sim engine runs no model)")
        return {"block_size": profile_block_size(args), **served}
    if not args.model_dir:
        raise UsageError("error: --engine torch needs --model DIR (evolving-infra model init DIR writes a tiny one)")
    from services.worker.engines.torch_engine.config import (  # no torch: a bad --model is exit 2 either way
        TORCH_EXTRA_INSTALL,
        ModelConfig,
        ModelConfigError,
    )

    try:
        model_cfg = ModelConfig.load(args.model_dir)
        context = model_cfg.max_position_embeddings
    except ModelConfigError as e:
        raise UsageError(f"error: --model {args.model_dir}: {e}") from None
    try:
        import services.worker.engines.torch_engine.model  # noqa: F401 (torch: what every worker imports)
    except ModuleNotFoundError as e:  # a runtime failure (status 1): the options are right, the install lacks a package
        raise SystemExit(f"error: --engine torch needs the torch extra ({e.name} missing): {TORCH_EXTRA_INSTALL}") from None
    if args.profile == DEFAULT_PROFILE:  # the sim default: a GLM-5.2 node is not this model
        args.profile = TORCH_PROFILE
    page = profile_block_size(args)
    if args.tokenizer == "sim":  # it was the default, silently replaced by the model's: a typed flag not obeyed
        raise UsageError(
            "error: --tokenizer sim: the built-in sim tokenizer's ids are not this model's; leave --tokenizer out "
            "(the model folder's own tokenizer) or give hf:<tokenizer.json or folder>"
        )
    if args.tokenizer is None:
        args.tokenizer = f"hf:{args.model_dir}"
        args.tokenizer_of_model = True  # an error names --model: no --tokenizer was given
    try:
        placement = worker_placement(max(args.nodes, 1), args.device, cuda_count=cuda_device_count(), cores=cpu_cores(),
                                     torch_threads=args.torch_threads)
    except ValueError as e:
        raise UsageError(f"error: {e}") from None
    return {
        "engine": "torch",
        "dtype": args.dtype,
        "placement": tuple(placement),
        "model_dir": str(Path(args.model_dir).resolve()),
        "profile": args.profile,
        "block_size": page,
        "tokenizer": args.tokenizer,
        "max_context_tokens": context,
        "model_vocab_size": model_cfg.vocab_size,
        **(served or served_from_folder(args.model_dir)),
    }


def served_from_folder(model_dir: str) -> dict[str, object]:
    """The served name of ``up --engine torch --model DIR`` without ``--served-model-name``: the folder's name,
    and as other names a request may give (vLLM serves its model path when no name is set) the path as typed and
    resolved (one holding a comma is left out: the router's ``--model-aliases`` is comma-separated)."""
    resolved = Path(model_dir).resolve()
    aliases = [a for a in dict.fromkeys((model_dir, str(resolved), model_dir.rstrip("/") or model_dir))
               if a != resolved.name and "," not in a and a]
    return {"model": resolved.name, "model_aliases": tuple(aliases)}


def cuda_device_count() -> int:
    """CUDA devices torch sees (``CUDA_VISIBLE_DEVICES`` applies); 0 without CUDA. Imports torch: call it only
    for ``--engine torch`` (``up`` runs without the torch extra otherwise)."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity: ``taskset``, a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def placement_line(spec: ClusterSpec) -> str | None:
    """``up``'s ready-banner line saying where each torch worker runs and with how many torch threads
    (:func:`~evolving_infra.cluster.worker_placement`); None for the sim engine."""
    if not spec.placement:
        return None
    parts = [f"{node} {device}" + (f" ({threads} torch thread{'s' if threads > 1 else ''})" if threads else "")
             for node, (device, threads) in zip(spec.node_ids(), spec.placement)]
    env = next((k for k in THREAD_ENV if os.environ.get(k)), None)
    note = f"; torch threads from {env}" if env and not any(t for _, t in spec.placement) else ""
    return "workers on " + ", ".join(parts) + (f", dtype {spec.dtype}" if spec.dtype else "") + note


def router_api_keys(args: argparse.Namespace) -> frozenset[str]:
    """The API keys the cluster's router will accept, read as the router reads them: the file of
    ``--api-keys-file`` (which wins over env ``EI_API_KEYS_FILE``, as a router flag wins over the
    environment) and the comma-separated env ``EI_API_KEYS``; empty = the router is open.

    Read once, before anything starts, so that a missing or empty file is one line, not a router that dies at
    start; the router gets these keys in its environment (:func:`_spec`), so a pipe (``<(pass show key)``) works
    and a file deleted later does not fail a router restart.

    Raises:
        UsageError: (status 2) the file is unreadable or holds no key, or a key holds a comma (naming the flag or
            variable).
    """
    path = args.api_keys_file or os.environ.get("EI_API_KEYS_FILE", "")
    inline = os.environ.get("EI_API_KEYS", "")
    if not path and not inline.strip():
        return frozenset()
    from services.router.ingress import ApiKeyError, load_api_keys

    where = "--api-keys-file" if args.api_keys_file else "EI_API_KEYS_FILE"
    try:
        keys = load_api_keys(path, inline)
    except ApiKeyError as e:
        raise UsageError(f"error: {where}: {e}") from None
    if comma := sum("," in k for k in keys):  # they reach the router as EI_API_KEYS, comma-separated
        raise UsageError(f"error: {where}: {comma} of its keys hold a comma, which the router's EI_API_KEYS "
                         "cannot carry; use keys without commas")
    return keys


def reloadable_keys_file(args: argparse.Namespace) -> str:
    """The absolute path of the API keys file (``--api-keys-file``, else env ``EI_API_KEYS_FILE``) when it is a regular
    file, which the routers can read again on a reload (``up``: SIGUSR1, :func:`reload_router_keys`); "" for none, or
    for a pipe or device (``<(pass show key)``: read once, its keys go to the routers in their environment).

    The path as given, made absolute, with its symbolic links kept: a reload follows them again, so a secret whose
    link is swapped to a new file (a Kubernetes Secret volume's ``..data``) is read at its new target, where a path
    resolved at start kept reading the old one (or nothing once it was removed)."""
    path = args.api_keys_file or os.environ.get("EI_API_KEYS_FILE", "")
    if not path:
        return ""
    try:  # is_file: after links, a regular file (no pipe, no /dev/fd/N)
        return os.path.abspath(path) if Path(path).is_file() else ""
    except OSError:
        return ""


def router_keys_env(keys: frozenset[str], reload_file: str, id_salt: str = "") -> tuple[tuple[str, str], ...]:
    """The router's environment for its API keys under ``up``/``demo`` (:attr:`ClusterSpec.router_env`): the keys
    ``up`` checked, in ``EI_API_KEYS``, which a router reads at each start (a restart after the file was deleted serves
    the same keys; no key or path on a command line), and with a regular keys file ``reload_file`` its path in
    ``EI_API_KEYS_RELOAD_FILE`` (with ``up``'s own ``EI_API_KEYS`` in ``EI_API_KEYS_RELOAD_KEYS``), which only the
    router's SIGHUP reload reads. ``EI_API_KEYS_FILE`` is emptied: the router never reads a path at its start.
    ``id_salt`` (``EI_API_KEY_ID_SALT``, the cluster's one, :func:`_spec`): the salt of the key ids in the routers'
    logs (``services.router.ingress.key_id``). () for an open router (no keys)."""
    if not keys:
        return ()
    return (("EI_API_KEYS", ",".join(sorted(keys))), ("EI_API_KEYS_FILE", ""), ("EI_API_KEYS_RELOAD_FILE", reload_file),
            ("EI_API_KEYS_RELOAD_KEYS", os.environ.get("EI_API_KEYS", "") if reload_file else ""),
            ("EI_API_KEY_ID_SALT", id_salt))


def answer_sigusr1(args: argparse.Namespace, cluster: LocalCluster, ready: bool) -> None:
    """``up``'s SIGUSR1 handler: :func:`reload_router_keys` once ``ready`` (the cluster started; before, nothing is
    done), and its line printed to stdout. A closed stdout (a pipe whose reader went: ``OSError``) drops the line: the
    reload was done all the same and ``up`` runs on. Before, the print raised inside the handler (asyncio's
    "Exception in callback" on stderr). Never raises for the print."""
    said = reload_router_keys(args, cluster) if ready else "SIGUSR1: the cluster is still starting; send it again once ready"
    try:
        print(said, flush=True)
    except OSError:
        pass


def reload_router_keys(args: argparse.Namespace, cluster: LocalCluster) -> str:
    """``up``'s SIGUSR1: check the API keys file, keep its keys for the routers ``up`` restarts from now on (their
    ``EI_API_KEYS``, :meth:`LocalCluster.set_router_env`), then send SIGHUP to every running router, which reads the
    file again (``RouterService.reload_api_keys``: a key taken out is refused from its next request on, one added
    accepted, requests in flight go on). Returns the line ``up`` prints: how many keys and routers, or why nothing was
    sent (no keys file to read again: keys from a pipe or ``EI_API_KEYS`` only, or an open router; the file unreadable,
    holding no key or a key with a comma: the routers keep their keys)."""
    from services.router.ingress import ApiKeyError, load_api_keys

    path = getattr(args, "reloadable_keys_file", "")
    if not path:
        why = ("the router is open (no API keys)" if not getattr(args, "router_api_keys", None)
               else "its keys were read once (a pipe, or EI_API_KEYS): restart up to change them")
        return f"SIGUSR1: no API keys file to reload: {why}"
    try:
        keys = load_api_keys(path, os.environ.get("EI_API_KEYS", ""))
    except ApiKeyError as e:
        return f"SIGUSR1: API keys NOT reloaded, the routers keep theirs: {e}"
    if comma := sum("," in k for k in keys):  # a restarted router gets them in EI_API_KEYS, comma-separated
        return (f"SIGUSR1: API keys NOT reloaded, the routers keep theirs: {comma} of the keys in {path} hold a comma, "
                "which the router's EI_API_KEYS cannot carry")
    args.router_api_keys = keys
    cluster.set_router_env(dict(router_keys_env(keys, path, getattr(args, "key_id_salt", ""))))  # before the signal: a router restarted now starts with them
    sent = cluster.signal_routers(signal.SIGHUP)
    return (f"SIGUSR1: {path} holds {len(keys)} keys; SIGHUP sent to {len(sent)} router{'' if len(sent) == 1 else 's'}"
            f" ({', '.join(sent) or 'none running'}); each logs 'API keys reloaded' and counts "
            "ei_router_api_key_reloads_total{result}; a router restarted from now on starts with these keys")


def routers_line(spec: ClusterSpec) -> str | None:
    """``up``/``demo``'s ready-banner line for ``--routers N`` > 1: the router processes, that they share the one
    port, and what that buys; None for one router."""
    if spec.routers <= 1:
        return None
    names = spec.router_names()
    shown = ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"
    how = ("each restarted on its own, so one draining, exiting or restarting leaves the others serving"
           if spec.restart else "--no-restart: the cluster stops when one exits; while one drains the others serve")
    return f"{spec.routers} routers ({shown}) on one port: each connection goes to one of them; {how}"


def context_line(spec: ClusterSpec) -> str | None:
    """``up``'s ready-banner line with the served model and its ``max_model_len`` (tokens), for a cluster with a
    model context (``--engine torch``); None without one. ``max_model_len`` is what the router serves: the model's
    context lowered to what a node's GPU KV memory holds (``--gpu-kv-tokens`` or the profile's, in whole blocks),
    as vLLM lowers its own to its KV cache; when lowered the line says so and how to serve the whole context.

    Raises:
        ProfileError: the profile cannot be loaded (``_spec`` has checked it).
    """
    ctx = spec.max_context_tokens
    if not ctx:
        return None
    profile = spec.node_profile()
    kv = profile.gpu_blocks * profile.block_size
    if kv >= ctx:
        return f"model {spec.model!r}: max_model_len {ctx} (the model's context; a node's GPU KV holds {kv} tokens)"
    source = "--gpu-kv-tokens" if spec.gpu_kv_tokens else f"profile {spec.profile}'s memory.gpu_kv_tokens"
    need = -(-ctx // profile.block_size) * profile.block_size
    return (f"model {spec.model!r}: max_model_len {kv}, LOWERED from the model's context {ctx}: a node's GPU KV memory "
            f"holds {kv} tokens ({source}); longer requests get 400; pass --gpu-kv-tokens {need} to serve the whole context")


def nats_auth_line(mode: str, info: dict[str, object]) -> str:
    """``up``'s banner line on its generated NATS identities: ``mode`` is ``--nats-auth``, ``info`` the cluster's
    :meth:`LocalCluster.describe`, whose credentials paths are absolute (the line named ``rel/nats-creds/operator.nk``
    under a relative ``--log-dir``, which worked only from up's own folder)."""
    return (f"NATS auth {mode}: each service its own identity; split and tap on this machine find the operator / admin "
            f"credentials through the state file; elsewhere: EI_NATS_CREDS={info['nats_operator_creds']}")


def api_keys_line(args: argparse.Namespace, port: int | None = None) -> str | None:
    """``up``'s ready-banner line saying that the router requires API keys (how many, from where), or, when it is
    open and ``--host`` is not a loopback address, that anyone who reaches the port may send requests (``up --host
    0.0.0.0`` said nothing of it; compose's README warns of the same); None when open on loopback only. The public
    paths it names are those the router will serve without a key: its default, or ``EI_API_KEY_PUBLIC_PATHS`` of
    this environment, which the router inherits (the line said "unless --api-key-public-paths", a router flag
    that ``up`` refuses as an unrecognized argument). ``port``: the router's bound port (``--port 0``: the one
    chosen; the line said ``0.0.0.0:0``), else ``--port``."""
    keys: frozenset[str] = getattr(args, "router_api_keys", frozenset())
    if not keys:
        host = str(getattr(args, "host", "127.0.0.1"))
        if _loopback(host):
            return None
        return (f"API keys OFF and the router listens on {host}:{args.port if port is None else port}: anyone who reaches that port may send "
                "requests; --api-keys-file FILE (or EI_API_KEYS=k1,k2) makes every request need a key")
    where = " and ".join(w for w, on in ((f"--api-keys-file {args.api_keys_file}", bool(args.api_keys_file)),
                                          ("EI_API_KEYS_FILE", not args.api_keys_file and bool(os.environ.get("EI_API_KEYS_FILE"))),
                                          ("EI_API_KEYS", bool(os.environ.get("EI_API_KEYS", "").strip()))) if on)  # fmt: skip
    env_paths = os.environ.get("EI_API_KEY_PUBLIC_PATHS")
    if env_paths is None:
        public = "/livez, /healthz, /health, /ping, /metrics; EI_API_KEY_PUBLIC_PATHS=P1,P2 sets others"
    else:
        paths = [q for q in (p.strip() for p in env_paths.split(",")) if q]
        public = (", ".join(paths) or "none") + " from EI_API_KEY_PUBLIC_PATHS"
    reload = (f"; to rotate, edit {args.reloadable_keys_file} and send up SIGUSR1 (kill -USR1 {os.getpid()})"
              if getattr(args, "reloadable_keys_file", "") else "")
    return (f"API keys ON ({len(keys)} from {where}): every request needs 'Authorization: Bearer <key>' (401 without one) "
            f"except the router's public paths ({public}){reload}")


KEY_ID_SALT_FILE = "api-key-id.salt"
"""``up``'s file in its log folder (mode 0600, kept at the stop) with the salt of the API key ids in its routers' logs
(``services.router.ingress.key_id``), when keys are on. A later ``up`` on the same ``--log-dir`` keeps a valid one
(:func:`kept_key_id_salt`), so the key ids of every run's log lines there map to keys with one salt."""

_SALT_TEXT = re.compile(r"([0-9a-f]{32,128})\n?")
"""A salt file's content as ``up`` writes it (``secrets.token_hex(16)`` and a newline; longer hex accepted)."""


def _own_file_here(folder: Path) -> tuple[int, int] | None:
    """``(uid, mode bits)`` a file this process makes in ``folder`` with mode 0600 gets there (a new empty file,
    removed at once): not this process's euid on an NFS export with root_squash (root's files are ``nobody``'s),
    nor mode 600 on a file system that keeps no POSIX mode (a vfat or SMB mount gives every file its mount's mode), nor
    where the ``chmod`` is refused (the mode the file was made with). None when no file can be made there. Never
    raises."""
    import stat
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".api-key-id.probe-", dir=folder)
    except OSError:
        return None
    try:
        try:
            os.fchmod(fd, 0o600)
        except OSError:
            pass  # refused (a server that refuses chmod): the mode the file got is what up's salt gets there too
        st = os.fstat(fd)
        return st.st_uid, stat.S_IMODE(st.st_mode)
    except OSError:
        return None
    finally:
        os.close(fd)
        try:
            os.unlink(name)
        except OSError:
            pass


def kept_key_id_salt(path: Path) -> tuple[str | None, str | None]:
    """The salt an earlier ``up`` left in ``path`` (its log folder's :data:`KEY_ID_SALT_FILE`), for this one to keep.

    Valid is what ``up`` writes: a plain file (not a symlink), owned as this process's files are there, mode 0600
    or narrower (no group or other bit: :func:`shared.auth.write_private`'s mode), holding one line of 32 to 128
    lowercase hex digits. "Owned as this process's files are" and "0600" are as a file this process makes in that
    folder gets them (:func:`_own_file_here`, asked only when the file's owner is not this euid or its mode is wider):
    on an NFS export with root_squash a root ``up``'s files are ``nobody``'s, and a file system that keeps no mode
    gives every file the same one, so a salt ``up`` wrote there is kept, not rejected at every run.

    Returns:
        ``(salt, None)`` for a valid file; ``(None, why)`` for one that is there but not valid (``why`` a phrase
        naming the rule that failed, e.g. ``"is open to others (mode 644, not 600)"``); ``(None, None)`` when there
        is none. Never raises.
    """
    import errno
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, "is a symlink" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror or e})"
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode):
            return None, "is not a plain file"
        here = _own_file_here(path.parent) if st.st_uid != os.geteuid() or mode & 0o077 else None
        if st.st_uid != os.geteuid() and (here is None or st.st_uid != here[0]):
            return None, (f"is another user's (uid {st.st_uid}, not {os.geteuid()}"
                          + (f" nor {here[0]}, the owner this process's files get there" if here and here[0] != os.geteuid() else "")
                          + ")")
        if mode & 0o077 and (here is None or mode & ~here[1]):
            return None, (f"is open to others (mode {mode:o}, not 600"
                          + (f" nor {here[1]:o}, the mode a 600 file gets there" if here and here[1] != 0o600 else "")
                          + ")")
        m = _SALT_TEXT.fullmatch(os.read(fd, 256).decode("ascii", errors="replace"))
        if m is None:
            return None, "does not hold a salt as up writes it (one line of 32 hex digits)"
        return m.group(1), None
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    finally:
        os.close(fd)


def write_key_id_salt(path: Path, salt: str, invalid: str | None) -> list[str]:
    """Write ``salt`` to ``path`` (mode 0600, as :func:`shared.auth.write_private`), when :func:`kept_key_id_salt` kept
    none. A file there that was not valid (``invalid``, its reason) is first moved aside, not written over nor
    through (a symlink): its owner may still map older log lines with it. Aside is ``<path>.invalid``, or, that
    taken by an earlier rejection (kept: it maps still older lines), the first free ``<path>.invalid.N``.

    Where the file's mode cannot be made 0600 (a file system that keeps no POSIX mode, a vfat or SMB mount giving
    every file its mount's mode; an export whose server refuses the ``chmod``), the salt is written all the same
    (the key ids need it), and one warning line names the path and its mode: others can read it there.

    Returns:
        The warning lines to show (empty when none): an invalid file put aside; a mode that could not be set to 0600.

    Raises:
        OSError: the file cannot be moved or written (also when ``.invalid`` to ``.invalid.999`` are all taken).
    """
    import errno
    import stat

    aside = path.with_name(path.name + ".invalid")
    if invalid:
        for n in range(1000):
            aside = path.with_name(path.name + ".invalid" + (f".{n}" if n else ""))
            if not os.path.lexists(aside):
                break
        else:
            raise FileExistsError(errno.EEXIST, f"{path.name}.invalid to .invalid.999 all exist", str(aside))
        os.rename(path, aside)
    said: list[str] = []
    if invalid:
        said.append(f"warning: {path} {invalid}: not used; a new salt is written there (the old file is {aside.name}): "
                    "key ids in the log lines before this run were made with the old one")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        try:
            os.fchmod(fd, 0o600)
        except OSError:
            pass  # refused by the file system: its mode is checked below
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        f.write((salt + "\n").encode())
    if mode & 0o077:
        who = "readable by others" if mode & 0o044 else "open to others"
        said.append(f"warning: {path}: its mode cannot be set to 600 on this file system (it is {mode:o}: no POSIX modes "
                    f"there, or the server refused the chmod): the salt is {who}, and with it the API key ids in the "
                    "router logs can be matched to guessed keys; keep --log-dir on a file system with modes, or "
                    "restrict who can read the folder")
    return said


def key_id_salt_main(argv: list[str]) -> int:
    """``python -c 'import sys; from evolving_infra.launcher import key_id_salt_main; sys.exit(key_id_salt_main(sys.argv[1:]))' FILE``:
    the Slurm job's salt (deploy/slurm), by ``up``'s rule: ``FILE``'s when valid (:func:`kept_key_id_salt`), else a
    new one written there (:func:`write_key_id_salt`). Prints the salt on stdout, what it did on stderr; 1 when it
    cannot be written."""
    path = Path(argv[0])
    salt, invalid = kept_key_id_salt(path)
    if salt is not None:
        print(f"API key ids: the salt in {path} is kept (an earlier run's)", file=sys.stderr)
    else:
        salt = secrets.token_hex(16)
        try:
            for line in write_key_id_salt(path, salt, invalid):
                print(line, file=sys.stderr)
        except OSError as e:
            print(f"error: cannot write {path} ({e.strerror or e})", file=sys.stderr)
            return 1
    print(salt)
    return 0

DEFAULT_METRICS_HOST = "127.0.0.1"
"""``up --metrics``' metrics address without ``--metrics-host``, whatever the router's ``--host``."""


def metrics_host_line(spec: ClusterSpec) -> str | None:
    """``up``'s ready-banner line on where the services' metrics ports (``--metrics``) listen: a ``WARNING:`` when on an
    address other than loopback (``--metrics-host 0.0.0.0``): their ``/metrics`` and ``/readyz`` have no
    authentication; a note when they stay on loopback under a router reachable from elsewhere (``--host 0.0.0.0``: a
    remote Prometheus cannot reach them, and nothing said so). None when metrics are off, or both on loopback."""
    if not spec.metrics:
        return None
    if _loopback(spec.metrics_host):
        if _loopback(spec.host):
            return None
        return f"metrics on {spec.metrics_host} (--metrics-host 0.0.0.0 for a remote Prometheus)"
    return (f"WARNING: metrics ports listen on {spec.metrics_host} with no authentication: anyone who reaches them reads "
            f"every service's /metrics and /readyz (--metrics-host {DEFAULT_METRICS_HOST}, the default, keeps them on "
            "this machine)")


def _loopback(host: str) -> bool:
    """Whether the bind address ``host`` (an IP address or a name) reaches this machine only: 127.0.0.0/8, ::1,
    ``localhost``. A name that is not ``localhost`` counts as reachable from elsewhere (it is not resolved)."""
    if host.lower() in ("localhost", "localhost.", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


KV_POOL_PORTS_PER_WORKER = 32
"""``--kv-pool real``: ports in each worker's Mooncake range (``--kv-pool-ports``; Mooncake takes its RPC and its TCP data
port in it at random). With two, a worker SIGKILLed while a peer read from it could not start again: its ports were
in TIME_WAIT and ``TransferEngine.initialize`` returned -1, restart after restart (the fifth fault walk: w1 restarted
4 times in 31 s; two processes: 6 tries of 6 failed). With 32 a restart finds free ones, and takes its predecessor's
RPC port 1 time in 31: a peer's transfer engine that read the dead process keeps its segment, so the peer reads the
new process with another engine it makes (``kvpool.pool.READ_ENGINES_MAX``: 4 in all, each keeping 2 ports of the
peer's own range); past that bound the fetch is refused (``stale_session``) and the pages recomputed, and so while an
engine that could not start waits to be tried again (it takes no place under the bound)."""


def kv_pool_max_bytes(environ: Mapping[str, str]) -> int:
    """The real pool's size limit (bytes) that the workers ``up`` starts apply: their ``kv_pool_max_bytes``, which
    ``up`` gives them only through the environment they inherit (``EI_KV_POOL_MAX_BYTES`` in ``environ``), read by
    the worker's own config (:func:`~shared.config.field_from_text` on ``WorkerConfig``): the same accepted values
    and value; unset, the worker's default.

    Raises:
        UsageError: a value every worker would refuse (exit 2), with the worker's message.
    """
    from services.worker.config import WorkerConfig
    from services.worker.kvpool.config import DEFAULT_MAX_POOL_BYTES
    from shared.config import ConfigError, env_name, field_from_text

    name = env_name("kv_pool_max_bytes")
    text = environ.get(name)
    if text is None:
        return DEFAULT_MAX_POOL_BYTES  # WorkerConfig's default
    try:
        return int(field_from_text(WorkerConfig, "kv_pool_max_bytes", text))
    except ConfigError as e:
        raise UsageError(f"error: {name}={text!r}: {e} (every worker inherits it)") from None


def kv_liveness_times(environ: Mapping[str, str]) -> tuple[float, float]:
    """The KV directory's ``--kv-stale-after-s`` and the workers' ``--kv-alive-interval-s`` (wall s) in the cluster
    ``up`` starts: ``up`` sets neither flag, so each service reads its own from the environment it inherits
    (``EI_KV_STALE_AFTER_S``, ``EI_KV_ALIVE_INTERVAL_S`` in ``environ``) with its own config
    (:func:`~shared.config.field_from_text`); unset, the service's default (10 s, 1 s).

    A serving worker that stores no block (a long decode) sends an empty KV batch every ``--kv-alive-interval-s``
    and nothing between: with ``--kv-stale-after-s`` at or below that, the directory called a healthy decoding
    node's view stale between two of them (left out of lookups, a needless resync). Nothing checked the relation.
    An infinite ``stale_after_s`` (``EI_KV_STALE_AFTER_S=inf``: the directory calls no view stale) is taken whatever
    the interval (``inf`` too: alive batches off as well).

    Returns:
        (stale_after_s, alive_interval_s).

    Raises:
        UsageError: a value the service would refuse (with its message), or a finite ``stale_after_s <=
            alive_interval_s``: one line naming both flags and their variables.
    """
    import msgspec

    from services.kvdirectory.config import DirectoryConfig
    from services.worker.config import WorkerConfig
    from shared.config import ConfigError, env_name, field_from_text

    def default(cls: Any, name: str) -> float:
        return float(next(f.default for f in msgspec.structs.fields(cls) if f.name == name))

    def read(cls: Any, name: str, who: str) -> float:
        text = environ.get(env_name(name))
        if text is None:
            return default(cls, name)
        try:
            return float(field_from_text(cls, name, text))
        except ConfigError as e:
            raise UsageError(f"error: {env_name(name)}={text!r}: {e} ({who} inherits it)") from None

    stale = read(DirectoryConfig, "kv_stale_after_s", "the KV directory")
    alive = read(WorkerConfig, "kv_alive_interval_s", "every worker")
    if stale <= alive and not math.isinf(stale):  # inf: staleness off, nothing to be stale between two batches
        stale_var, alive_var = env_name("kv_stale_after_s"), env_name("kv_alive_interval_s")
        raise UsageError(  # up and demo have neither flag: the fix is named by the variables they pass on
            f"error: the KV directory's --kv-stale-after-s ({stale_var}) is {stale:g} s, not more than "
            f"the workers' --kv-alive-interval-s ({alive_var}) {alive:g} s: a healthy decoding "
            "node sends a KV batch only every --kv-alive-interval-s and would be called stale between two; set "
            f"{stale_var} to a few times {alive_var} (defaults {default(DirectoryConfig, 'kv_stale_after_s'):g} and "
            f"{default(WorkerConfig, 'kv_alive_interval_s'):g})"
        )
    return stale, alive


def _kv_pool_values(args: argparse.Namespace, sized: ClusterSpec, *, one_host: bool) -> dict[str, object]:
    """Cluster fields for ``--kv-pool real``: every worker's ``--kv-pool real`` (and ``--kv-pool-slot-bytes``), and,
    each worker its own range of :data:`KV_POOL_PORTS_PER_WORKER` Mooncake ports (``--kv-pool-ports``: two workers
    drawing from Mooncake's 15000-17000 at random may take the same port), free now, sharing no port
    (:func:`~services.worker.kvpool.transport.pick_port_ranges`) and kept across restarts. ``sized``: a spec with the
    profile and KV sizes the workers run. Empty for ``--kv-pool off``.

    Raises:
        UsageError: ``--kv-pool-slot-bytes`` without ``--kv-pool real``; with ``one_host`` (``up``, ``demo``), with
            or without the pool, an ``EI_KV_POOL_MAX_BYTES`` every worker would refuse (:func:`kv_pool_max_bytes`: every
            worker reads it from the environment it inherits, and exited 2 at start); ``one_host`` False (``deploy-args``: its
            flags carry no worker extras), said before anything is checked on this host; Mooncake not installed; the
            pool would not fit (``pool_geometry``, ``--engine sim`` only: a torch worker's slot is its model's page,
            checked by the worker); not enough free port ranges on this host.
    """
    slot = int(getattr(args, "kv_pool_slot_bytes", 0) or 0)
    if getattr(args, "kv_pool", "off") != "real":
        if slot:  # it would be dropped without a word
            raise UsageError(f"error: --kv-pool-slot-bytes {slot} sizes the real-bytes pool: give --kv-pool real too")
        if one_host:  # every worker reads it from the environment it inherits, pool or not: a bad one kills each at start
            kv_pool_max_bytes(os.environ)
        return {}
    if not one_host:  # deploy-args prints service_flags, which carry no worker_args: refused, not dropped
        raise UsageError("error: deploy-args does not support --kv-pool real (up's and demo's: one host, a range of "
                         f"{KV_POOL_PORTS_PER_WORKER} ports per worker); in a deployment give each worker --kv-pool real "
                         "and its own --kv-pool-ports")
    import importlib.util

    from services.worker.kvpool.config import pool_geometry
    from services.worker.kvpool.transport import TransferError, pick_port_ranges
    from shared.config import env_name

    if importlib.util.find_spec("mooncake") is None:
        raise UsageError("error: --kv-pool real needs Mooncake's transfer engine: scripts/install-mooncake.sh (VENV=<venv>)")
    if slot < 0:
        raise UsageError(f"error: --kv-pool-slot-bytes {slot}: bytes, 0 or more")
    limit = kv_pool_max_bytes(os.environ)
    if args.engine == "sim":  # a torch worker's slot is its page (checked by the worker against its model)
        try:
            pool_geometry(sized.node_profile(), slot, limit)
        except ValueError as e:
            raise UsageError(f"error: --kv-pool real: {e} (--kv-pool-slot-bytes N, a smaller --host-kv-tokens, "
                             f"or {env_name('kv_pool_max_bytes')}, which every worker inherits)") from None
    worker = ("--kv-pool", "real") + (("--kv-pool-slot-bytes", str(slot)) if slot else ())
    try:
        ranges = pick_port_ranges(args.nodes, width=KV_POOL_PORTS_PER_WORKER)
    except TransferError as e:
        raise UsageError(f"error: --kv-pool real with --nodes {args.nodes}: each worker needs {KV_POOL_PORTS_PER_WORKER} "
                         f"Mooncake ports of its own, and {e}; run fewer workers on this host") from None
    return {"worker_args": worker, "node_args": {f"w{i}": ("--kv-pool-ports", f"{lo}-{hi}") for i, (lo, hi) in enumerate(ranges)}}


def _spec(args: argparse.Namespace, *, one_host: bool = True, **overrides: object) -> ClusterSpec:
    """The :class:`ClusterSpec` for ``up``'s parsed flags ``args`` (``overrides`` replace its fields).

    ``one_host``: ``up`` starts every service on this host, so one ``EI_METRICS_PORT`` for all of them is
    refused; ``deploy-args`` (compose, Slurm) passes False: there each service has its own host or container.

    Raises:
        UsageError: (status 2) flags ``up`` refuses: a split that does not fit the nodes, a bad metrics port,
            trace endpoint, tokenizer, model folder or KV size; with ``one_host``, an ``EI_KV_POOL_MAX_BYTES`` the workers
            would refuse, or a KV directory ``--kv-stale-after-s`` not above the workers' ``--kv-alive-interval-s``
            (:func:`kv_liveness_times`); with ``one_host`` False, ``--routers`` other than 1.
    """
    if args.nodes < 1:  # before the default split (collocated for any N < 2) and the planner check (sized >= 1)
        raise UsageError(f"error: --nodes {args.nodes}: a cluster needs at least one worker node")
    routers = getattr(args, "routers", 1)
    if routers < 1:
        raise UsageError(f"error: --routers {routers}: a cluster needs at least one router process")
    if not one_host and routers != 1:  # deploy-args prints one router service's flags: refused, not ignored
        raise UsageError(f"error: deploy-args does not support --routers {routers} (up's and demo's: N router processes "
                         "on the one socket up holds); in a deployment run more router services, each with its own "
                         "--instance (and NATS identity), behind one load balancer")
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", ""):
        raise UsageError(f"error: --enable-auto-tool-choice requires --tool-call-parser (known: {', '.join(TOOL_CALL_PARSERS)})")
    pol = args.live_policy if getattr(args, "live_policy", None) else _policy(args)
    args.live_policy = pol
    try:
        parse_split(args.split, args.nodes)
    except SplitError as e:  # the split may be a policy's (static:2P2D) the user did not size: say what to change
        raise UsageError(f"error: {e}; pass --split xPyD with x + y = {args.nodes} (or 'collocated'), or --nodes") from None
    env_port = os.environ.get("EI_METRICS_PORT", "").strip()
    if one_host and env_port not in ("", "0"):  # every service would take it: the second to bind it exited 1 and the cluster stopped
        raise UsageError(
            f"error: EI_METRICS_PORT={env_port} is one service's metrics port, and up starts {args.nodes + 2 + routers} services; "
            f"unset it and pass --metrics (free ports, in the READY line and LOG_DIR/prometheus-targets.json) or "
            f"--metrics-base-port {env_port} (the KV directory on {env_port}, planner +1, router +2, worker wN +3+N)"
        )
    fence = getattr(args, "fence_after_s", None)
    if fence is not None and not (math.isfinite(fence) and fence > 0):  # the router and planner would exit 2 after the cluster started
        raise UsageError(f"error: --fence-after-s {fence:g}: wall seconds, a number > 0")
    for flag, value, least in (("--liveness-timeout-s", getattr(args, "liveness_timeout_s", 30.0), 0.0),
                               ("--restart-window-s", getattr(args, "restart_window_s", 600.0), None)):
        if not math.isfinite(value) or (value < least if least is not None else value <= 0):
            raise UsageError(f"error: {flag} {value:g}: wall seconds, a number {'>= 0 (0 = off)' if least is not None else '> 0'}")
    liveness = getattr(args, "liveness_timeout_s", 30.0)
    if 0 < liveness < LIVENESS_MIN_S:  # healthy processes would be SIGKILLed: their signs of life come that slowly
        raise UsageError(
            f"error: --liveness-timeout-s {liveness:g}: 0 (off) or at least {LIVENESS_MIN_S:g} wall s: a service beats "
            "every second, a round of up's probes (nats-server's INFO line, a PING) takes up to ~7 s under load and a "
            "service's NATS drain at a stop up to 5 s, so a shorter timeout kills healthy processes"
        )
    base = getattr(args, "metrics_base_port", None)
    if getattr(args, "metrics_host", None) is not None and not args.metrics and base is None:
        # no metrics port listens without them: the flag did nothing, silently
        raise UsageError(f"error: --metrics-host {args.metrics_host} needs --metrics or --metrics-base-port: without them no "
                         "service has a metrics port")
    if base is not None and not 1024 <= base <= 65535 - (args.nodes + 1 + routers):
        # 0 too: it read as "no base port" and silently turned metrics off while 80 was refused (newcomer walk)
        free = "; --metrics alone gives every service a free port" if base == 0 else ""
        raise UsageError(f"error: --metrics-base-port {base}: {args.nodes + 2 + routers} ports from it must lie within 1024-65535{free}")
    base = base or 0
    port = getattr(args, "port", 0)
    last = base + args.nodes + 1 + routers
    if one_host and base and port and base <= port <= last:
        # up binds --port for the routers, then the metrics ports: one of them was taken by its own router socket and
        # that service exited 1 ("cannot listen for metrics ... Address already in use"); the Slurm job's job_ports
        # refuses the same overlap up front
        offset = port - base
        if offset < 3:
            owner = ("the KV directory", "the planner", "the router")[offset]
        elif offset < 3 + args.nodes:
            owner = f"worker w{offset - 3}"
        else:
            owner = f"router-{offset - 2 - args.nodes}"
        raise UsageError(
            f"error: --port {port} is {owner}'s metrics port under --metrics-base-port {base} (the KV directory on {base}, "
            f"planner +1, router +2, worker wN +3+N, router-K +3+NODES+K-1: {base}-{last}); pick a --port outside that "
            "range or another --metrics-base-port"
        )
    otlp = getattr(args, "otlp_traces_endpoint", "")
    if otlp and not re.fullmatch(r"https?://\S+", otlp):  # each service would refuse it (exit 2) after the cluster started
        raise UsageError(f"error: --otlp-traces-endpoint {otlp!r}: an http:// or https:// URL of an OTLP/HTTP collector (e.g. http://127.0.0.1:4318)")
    if one_host:  # both read from the environment every service inherits (deploy-args: each host's own)
        kv_liveness_times(os.environ)
    torch_values = _torch_values(args)
    args.router_api_keys = router_api_keys(args)
    args.reloadable_keys_file = reloadable_keys_file(args)
    # one secret per cluster for the key ids in the routers' logs: the same id in every router and restart, and none
    # that identifies a short key offline (an unsalted SHA-256 prefix did); up keeps it in LOG_DIR/api-key-id.salt
    args.key_id_salt = getattr(args, "kept_key_id_salt", None) or secrets.token_hex(16)  # up: an earlier up's, kept
    router_env = router_keys_env(args.router_api_keys, args.reloadable_keys_file, args.key_id_salt)
    if args.tokenizer != "sim":  # fail here, with the reason, not in every service's log
        from shared.tokenizer import TokenizerError, load_tokenizer, output_vocabulary

        try:
            tok = load_tokenizer(args.tokenizer)
            output_vocabulary(tok)
            args.tokenizer_notes = tuple(getattr(tok, "notes", ()))  # up's banner says them: the router's log alone hid them
        except TokenizerError as e:
            if getattr(args, "tokenizer_of_model", False):  # the user gave --model only: say so, not a flag they never passed
                raise UsageError(
                    f"error: --model {args.model_dir}: {e} (the model folder's tokenizer is the default; pass "
                    "--tokenizer hf:FOLDER to take one from another folder)"
                ) from None
            raise UsageError(f"error: --tokenizer {args.tokenizer}: {e}") from None
        model_vocab = int(torch_values.get("model_vocab_size", 0))  # type: ignore[call-overload]
        if model_vocab and tok.vocab_size > model_vocab:
            # its ids past the model's would reach the engine (a 500 per request); vLLM's 400s need ids the model has
            raise UsageError(
                f"error: --tokenizer {args.tokenizer}: its vocabulary has {tok.vocab_size} tokens but the model "
                f"{args.model_dir} has {model_vocab} (config.json vocab_size): a prompt or output token past "
                f"{model_vocab - 1} would not exist in the model; use the model's own tokenizer (leave --tokenizer out) "
                "or one of at most its vocabulary"
            )
    kv = dict(gpu_kv_tokens=args.gpu_kv_tokens, host_kv_tokens=args.host_kv_tokens)
    try:  # every worker applies them to its profile (and refuses a bad size, exit 2): refused here, before anything starts
        ClusterSpec(profile=str(torch_values.get("profile", args.profile)), **kv).node_profile()
    except ProfileError as e:
        raise UsageError(f"error: {e}") from None
    values = dict(
        **_kv_pool_values(args, ClusterSpec(profile=str(torch_values.get("profile", args.profile)), **kv), one_host=one_host),
        nodes=args.nodes,
        split=args.split,
        profile=args.profile,
        speedup=args.speedup,
        host=args.host,
        port=args.port,
        routers=routers,
        routing=pol.routing,
        planner=pol.planner,
        planner_args=pol.planner_args,
        eviction=pol.eviction,
        decode_binding=pol.decode_binding,
        decode_routing=pol.decode_routing,
        router_args=pol.router_args,
        router_env=router_env,
        block_size=args.block_size,
        partition=args.partition,
        nats_url=args.nats_url,
        nats_auth=args.nats_auth,
        nats_creds_dir=args.nats_creds_dir,
        log_dir=args.log_dir,
        log_level=args.log_level,
        log_requests=args.log_requests,
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", ""),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        stream_interval=args.stream_interval,
        ready_timeout_s=args.ready_timeout,
        metrics=args.metrics or getattr(args, "metrics_base_port", None) is not None,
        metrics_base_port=getattr(args, "metrics_base_port", None) or 0,
        metrics_host=DEFAULT_METRICS_HOST if getattr(args, "metrics_host", None) is None else args.metrics_host,
        tokenizer=args.tokenizer,
        restart=args.restart,
        max_restarts=args.max_restarts,
        restart_window_s=getattr(args, "restart_window_s", 600.0),
        liveness_timeout_s=getattr(args, "liveness_timeout_s", 30.0),
        fence_after_s=fence or 0.0,
        **kv,
    )
    values.update(torch_values)
    values.update(overrides)
    return ClusterSpec(**values)


# ----------------------------------------------------------------------------- up


def port_unavailable(host: str, port: int) -> str | None:
    """Why the router could not listen on ``host:port`` (in use, address not on this machine), or None
    when it can (port 0, any free one, always can). Checked before anything starts, so that a busy
    ``--port`` is one line, not the router's traceback after NATS and every service started."""
    if not port:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the router's server does
            s.bind(infos[0][4])
    except OSError as e:
        return f"the router cannot listen on {host}:{port}: {e.strerror or e}"
    return None


SERVICE_STOPPED_STATUS = 3
"""``up``'s and ``demo``'s exit status when, under ``--no-restart``, a service exited 0 on its own (a SIGTERM sent
to it, not to ``up``): no crash (one calm line, no "error:"), but not the stop that was asked of ``up`` (status 0)."""


async def _up(args: argparse.Namespace) -> int:
    # the key ids' salt of an earlier up on this --log-dir, kept: its log lines' ids map to keys as this run's do
    args.kept_key_id_salt, salt_invalid = kept_key_id_salt(Path(args.log_dir) / KEY_ID_SALT_FILE) if args.log_dir else (None, None)
    spec = _spec(args)  # usage errors (status 2) before the port's state (a runtime failure, status 1)
    if unavailable := port_unavailable(args.host, args.port):
        print(f"error: {unavailable}; stop what listens there or pick another --port (0 = any free port)", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    # SIGHUP (the terminal closed): a clean stop too, unless ignored (`nohup evolving-infra up` keeps running)
    _stop_on_signals(stop)
    cluster = LocalCluster(spec)
    ready = False

    def on_usr1() -> None:  # a key rotation: the routers read their keys file again
        answer_sigusr1(args, cluster, ready)

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, on_usr1)

    async def start() -> bool:
        await cluster.start()
        return True

    try:  # a signal during start-up (e.g. --nats-url unreachable) cancels it; start() stops what it started
        # discard: a start that finished despite its cancel (lost in a nats-py wait_for) is stopped, not left running
        if await until_stopped(start(), stop, grace_s=CLUSTER_STOP_GRACE_S, discard=lambda _: cluster.stop()) is None:
            cluster.remove_generated_creds()
            print("stopped during start-up", flush=True)
            return 0
    except ClusterError as e:
        cluster.remove_generated_creds()
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ClusterConfigError) else 1  # credentials refused the stream: a configuration error
    ready = True
    if args.router_api_keys:  # the key ids' salt, for an operator who maps a key to its log lines (README Security)
        salt_path = cluster.log_dir / KEY_ID_SALT_FILE
        if args.kept_key_id_salt:
            print(f"API key ids: the salt in {salt_path} is kept (an earlier up's): the ids in every log line there "
                  "map to keys with it", flush=True)
        else:
            try:
                for warning in write_key_id_salt(salt_path, args.key_id_salt, salt_invalid):
                    print(warning, file=sys.stderr, flush=True)
            except OSError as e:
                print(f"warning: cannot write {salt_path} ({e.strerror or e}): the key ids in the "
                      "router logs cannot be matched to keys", file=sys.stderr)
    # the warm-up's end as the planner announced it (its first tick, when its start-up adoption ends): at --speedup 50
    # that came 2-4 wall s after the start, 100-200 simulated s, and READY's estimate said 1860 where it said 1980
    end = await announced_end(cluster, args.live_policy, stop)
    info = cluster.describe()
    write_json(cluster.log_dir / "cluster.json", _shown(info))
    fields = _state_fields(cluster.spec, policy=args.live_policy.name, started_unix=cluster.clock_origin)
    state = _write_state({**info, **fields})  # the URL whole: split and tap connect with it (0600)
    try:
        listening = (f" (listening on all interfaces, {info['router_listen']})" if cluster.spec.host in WILDCARD_HOSTS else "")
        plan = split_plan(args.live_policy, cluster.spec.split, cluster.spec.speedup, end[0] if end else None,
                          announced=end is not None and end[1])
        print(f"cluster ready: router {cluster.router_url}{listening}  ({plan}; "
              f"{args.nodes} worker{'' if args.nodes == 1 else 's'}, profile {cluster.spec.profile}, speedup {args.speedup:g})")
        print(f"  {args.live_policy.describe()}" + "".join(f"\n  note: {n}" for n in args.live_policy.notes))
        warmup = planner_warmup_line(args.live_policy, cluster.spec.split, cluster.spec.speedup)
        if warmup:  # the split above is served only after it; /v1/cluster and `split get` show the warm-up meanwhile
            print(f"  {warmup}")
        if deferred := split_deferred_line(args.live_policy, cluster.spec.split, given=args.split_given):
            print(f"  {deferred}")
        cli = command_name()
        print(f"  NATS {redact_url(cluster.nats_url)}   logs {cluster.log_dir}   look with: {cli} status   trace with: {cli} tap (or split get)")
        if cluster.creds is not None:
            print(f"  {nats_auth_line(args.nats_auth, info)}")
        elif not args.nats_url:
            print("  NATS is OPEN (--nats-auth off): any local process can publish and read every subject (loopback only)")
        for line in (routers_line(cluster.spec), context_line(cluster.spec), placement_line(cluster.spec)):
            if line:
                print(f"  {line}")
        if keys_line := api_keys_line(args, cluster.router_port):
            print(f"  {keys_line}")
        if metrics_line := metrics_host_line(cluster.spec):
            print(f"  {metrics_line}")
        for line in tokenizer_lines(args):
            print(f"  {line}")
        print("READY " + json.dumps(_shown(ready_info(info, args.live_policy, cluster.spec.split, cluster.spec.speedup, end=end,
                                                      clock_origin=cluster.clock_origin))),
              flush=True)

        def described() -> None:
            # new pids, restart counts and services left down, for operators and for fault tests
            now = cluster.describe()
            write_json(cluster.log_dir / "cluster.json", _shown(now))
            if state is not None:  # the state file lists the process ids too (README): rewritten, atomically
                _write_state({**now, **fields})

        def restarted(name: str) -> None:
            described()
            print(f"restarted {name} (restarts: {cluster.restarts().get(name, 0)})", flush=True)

        def left_down(name: str) -> None:
            described()
            print(f"left {name} down after a crash loop (over --max-restarts {cluster.spec.max_restarts} exits within "
                  f"--restart-window-s {cluster.spec.restart_window_s:g}); {cluster.down_effect(name)}; trying it again "
                  f"in {cluster.spec.restart_window_s:g} s", flush=True)

        cluster.on_restart = restarted
        cluster.on_down = left_down
        status = 0  # up's own stop was asked (Ctrl-C, SIGTERM, SIGHUP)
        stopped = asyncio.ensure_future(stop.wait())
        failed = asyncio.ensure_future(cluster.wait_failed())
        await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if failed.done():
            ended = failed.result()
            if not isinstance(ended, ServiceStopped):
                print(f"error: {ended}", file=sys.stderr, flush=True)
                status = 1  # stopped as below (stdout says so, as on any stop); the other routers' open streams finish
            else:
                # --no-restart: a service that exited 0 stopped on a SIGTERM that reached it (after its drain), no crash:
                # said on stdout, no "error:"; the cluster stops with it, but up was not asked to stop, so its status says
                # the cluster ended on its own (a supervisor restarting on failure, a CI step, can tell)
                print(f"{ended}; --no-restart: stopping the cluster", flush=True)
                status = SERVICE_STOPPED_STATUS
        failed.cancel()
        if down := cluster.left_down():  # up's own stop is no failure (status 0), but say what was not serving
            print(f"stopping with {', '.join(down)} left down after a crash loop (see its log)", flush=True)
        print("stopping ...", flush=True)
        await cluster.stop(drain_routers=status != 0, interrupt=stop)  # stopped on its own (not Ctrl-C: no quick stop): the routers drain
        # the logs stay for the user to read; credentials up generated into its own temp folder do not
        # (secrets, useless once the nats-server that trusted them is gone)
        removed = cluster.remove_generated_creds()
        print(f"stopped; logs in {cluster.log_dir}" + (" (its generated NATS credentials removed)" if removed else ""), flush=True)
        return status
    finally:  # also when a print failed (up | head: BrokenPipeError): the nats-server's store goes with it
        await cluster.stop()  # a second stop does nothing
        cluster.remove_generated_creds()
        if state is not None:
            state.unlink(missing_ok=True)


def _state_fields(spec: ClusterSpec, *, policy: str = "", started_unix: float = 0.0) -> dict[str, object]:
    """What the state file adds to :meth:`LocalCluster.describe` for the tools that find the cluster through it:
    the partition (``split``, ``tap``), the router's tokenizer, served model name and tokens per KV block (``replay``);
    the policy set's name (``policy``), engine, profile, node and router counts, the cluster's start (unix s, its
    clock's origin) and the restart limits (``status``)."""
    return {"partition": spec.partition, "tokenizer": spec.tokenizer, "model": spec.model, "block_size": spec.block_size,
            "policy": policy, "engine": spec.engine, "profile": spec.profile, "nodes": spec.nodes, "routers": spec.routers,
            "started_unix": round(started_unix, 3), "max_restarts": spec.max_restarts,
            "restart_window_s": spec.restart_window_s}


def _evolving_params(pol: LivePolicy) -> Any:
    """The :class:`~services.planner.evolving.EvolvingParams` the planner service builds from ``pol``'s
    ``--planner-opt`` items (its defaults where none is given; checked by :func:`_policy`)."""
    from services.planner.evolving import EvolvingParams
    from services.planner.policy import params_from, parse_planner_args

    return params_from(EvolvingParams, parse_planner_args(list(pol.planner_args)), "evolving")


WARMUP_FIRST_TICK_S = 0.2
"""Simulated seconds after the cluster's start of the evolving planner's first tick in :func:`warmup_end_s`'s
estimate before the cluster runs (the simulator's; a live planner ticks first when its start-up adoption ends)."""

WARMUP_ANNOUNCE_WAIT_S = 5.0
"""Wall seconds ``up`` and ``demo`` wait, once the cluster is ready, for the planner to announce its warm-up's end
(:meth:`~evolving_infra.cluster.LocalCluster.announced_warmup_end`): it does at its first tick, when its start-up
adoption ends (at most ``--adopt-grace-s``, 3 wall s, after the planner started, before the cluster is ready; earlier
once every node has reported). Without an announcement by then, READY gives an estimate and says so."""


def _wall(seconds: float) -> str:
    """Wall seconds as the warm-up lines print them: one decimal under 100 s (``39.6``), whole above (``1860``)."""
    return f"{seconds:.1f}" if seconds < 100 else f"{seconds:.0f}"


def _after_warmup(pol: LivePolicy, split: str) -> str:
    """What the evolving planner serves after its warm-up, for :func:`split_plan` and :func:`warmup_end_line`."""
    p = _evolving_params(pol)
    return f"split {p.initial_split or split}" if p.initial_split or split != "collocated" else \
        "the split the warm-up predicts best"


def split_plan(pol: LivePolicy, split: str, speedup: float, end_s: float | None = None, *, announced: bool = False) -> str:
    """What the cluster's split is and will be, for ``up``'s ready line and the demo's first line: ``split 2P2D`` for
    the static planner; for the evolving planner with a warm-up, that every node serves collocated until it ends and
    what comes then: its first tick switches every node to ``both``, and the line said ``initial split 1P1D`` for the
    half hour ``up`` served collocated. For the other planners, the split the nodes start in and that the planner
    adapts it.

    With ``end_s`` (``up``, once the cluster is ready): ``serving collocated until t=1980 s, the end of the planner's
    1800-s warm-up (39.6 s wall after the cluster's start, as the planner announced), then split 2P2D; ...``, or, not
    ``announced``, ``~`` and "an estimate". Without (``demo``'s header, before the cluster starts): the warm-up's
    length in wall s from the planner's first tick, as :func:`planner_warmup_line` gives it. Before, the header
    said "~19 s wall" for an end the planner put at t=1200 (24 s wall at ``--speedup 50``: its first tick comes when
    its start-up adoption ends, seconds of wall time, each 50 simulated s, after the start).

    Args:
        pol: the live policy (its ``planner`` and ``planner_args``).
        split: the cluster's split (``--split`` or the policy's; after an evolving warm-up, which serves collocated).
        speedup: simulated seconds per wall second (> 0).
        end_s: when the warm-up ends, simulated s from the cluster's start; None: not known yet.
        announced: ``end_s`` is the planner's announcement (else an estimate).
    """
    if pol.planner == "static":
        return f"split {split}"
    if pol.planner == "evolving" and (p := _evolving_params(pol)).t_learn_s > 0:
        after = _after_warmup(pol, split)
        if end_s is None:
            return (f"serving collocated for the planner's {p.t_learn_s:.0f}-s warm-up ({_wall(p.t_learn_s / speedup)} s "
                    f"wall from its first tick, to the next {p.window_s / p.slices:.0f}-s slice boundary), then {after}; "
                    "planner evolving adapts it")
        return f"serving collocated until {_end_words(p.t_learn_s, end_s, speedup, announced)}, then {after}; planner evolving adapts it"
    return f"initial split {split}; planner {pol.planner} adapts it"


def _end_words(t_learn_s: float, end_s: float, speedup: float, announced: bool) -> str:
    """``t=1980 s, the end of the planner's 1800-s warm-up (39.6 s wall after the cluster's start, as the planner
    announced)``; not ``announced``: ``~`` before the wall figure and "an estimate" instead."""
    how = "as the planner announced" if announced else "an estimate: the planner had not announced it yet"
    return (f"t={end_s:.0f} s, the end of the planner's {t_learn_s:.0f}-s warm-up ({'' if announced else '~'}"
            f"{_wall(end_s / speedup)} s wall after the cluster's start, {how})")


def warmup_end_line(pol: LivePolicy, split: str, speedup: float, end_s: float, *, announced: bool) -> str | None:
    """``demo``'s line once the cluster is ready: ``planner warm-up: every node collocated until t=1200 s, the end of
    the planner's 900-s warm-up (24.0 s wall after the cluster's start, as the planner announced), then split 2P2D``.
    None without an evolving warm-up. Args as :func:`split_plan`'s (``end_s`` simulated s from the cluster's start)."""
    if pol.planner != "evolving" or (p := _evolving_params(pol)).t_learn_s <= 0:
        return None
    return f"planner warm-up: every node collocated until {_end_words(p.t_learn_s, end_s, speedup, announced)}, then {_after_warmup(pol, split)}"


async def announced_end(cluster: Any, pol: LivePolicy, stop: asyncio.Event) -> tuple[float, bool] | None:
    """The evolving planner's warm-up end for ``up``'s READY and ``demo``'s line: ``(end_s, True)`` as the planner
    announced it (:meth:`~evolving_infra.cluster.LocalCluster.announced_warmup_end`, waited for at most
    :data:`WARMUP_ANNOUNCE_WAIT_S` wall s, or until ``stop`` is set), else ``(estimate, False)``
    (:func:`warmup_end_s` for a first tick now: ``cluster.cluster_time()``); None without a warm-up (no wait).
    Simulated seconds from the cluster's start. Raises nothing beyond :func:`_evolving_params`'s."""
    if warmup_end_s(pol) <= 0:
        return None
    waiter = asyncio.ensure_future(cluster.announced_warmup_end(WARMUP_ANNOUNCE_WAIT_S))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    waiter.cancel()
    end = cluster.planner_warmup_end
    if end is not None:
        return float(end), True
    return warmup_end_s(pol, first_tick_s=max(cluster.cluster_time(), WARMUP_FIRST_TICK_S)), False


def ready_info(info: Mapping[str, Any], pol: LivePolicy, split: str, speedup: float, *, end: tuple[float, bool] | None = None,
               clock_origin: float | None = None) -> dict[str, Any]:
    """``up``'s READY JSON: ``info`` (:meth:`Cluster.describe`) with, after its ``split``, what is served at READY.

    * ``split`` (kept as it was): the cluster's split (the workers start collocated: ``cluster.launch_phases``), served only after
      its warm-up (``--split`` or the policy's);
    * ``serving``: the split served now, ``"collocated"`` (every node ``both``) during the evolving planner's warm-up
      (from its first tick), else ``split``. Before, a plain ``up`` printed ``"split": "2P2D"`` and served
      collocated for its first 1,860 simulated seconds;
    * ``warmup_end_s``: when the warm-up ends, simulated seconds from the cluster's start (0.0 without one): ``end``'s
      (:func:`announced_end`), else :func:`warmup_end_s`'s estimate; ``warmup_end_wall_s`` the same in wall seconds
      after the cluster's start (over ``speedup``, > 0); ``cluster_start_unix``: that start (``clock_origin``, unix s:
      t=0 of the cluster clock), when given. Before, ``warmup_end_s`` was always the estimate for a first tick at
      0.2 s: 1860 at ``--speedup 50``, where the planner announced 1980 (its first tick 2-4 wall s, 100-200
      simulated s, after the start);
    * ``warmup_end_source`` (with a warm-up): ``"planner"``, the planner's announcement (what ``split get`` says), or
      ``"estimate"`` (none came within :data:`WARMUP_ANNOUNCE_WAIT_S`, or ``end`` not given);
    * ``split_after_warmup``: the split the planner goes to when the warm-up ends (its ``initial_split`` when given,
      else ``split``), None when ``split`` is ``collocated`` and the warm-up's records choose it; absent without a
      warm-up.

    The other keys are ``info``'s, unchanged. Raises nothing beyond :func:`_evolving_params`'s."""
    estimate = warmup_end_s(pol)
    end_s, announced = (end if end is not None and estimate > 0 else (estimate, False))
    out: dict[str, Any] = {}
    for k, v in info.items():
        out[k] = v
        if k == "split":
            out["serving"] = "collocated" if end_s > 0 else split
            out["warmup_end_s"] = end_s
            out["warmup_end_wall_s"] = end_s / speedup
            if clock_origin is not None:
                out["cluster_start_unix"] = clock_origin
            if end_s > 0:
                out["warmup_end_source"] = "planner" if announced else "estimate"
                p = _evolving_params(pol)
                out["split_after_warmup"] = p.initial_split or (split if split != "collocated" else None)
    return out


def warmup_end_s(pol: LivePolicy, first_tick_s: float = WARMUP_FIRST_TICK_S) -> float:
    """When the evolving planner's warm-up ends, in simulated seconds from the cluster's start, for a first tick at
    ``first_tick_s`` (simulated s; the simulator's 0.2 s by default): the first slice boundary (``window_s /
    slices``) at or after ``first_tick_s + t_learn_s``, as the planner ends it (1,800 s with 60-s slices: 1,860,
    ``split get``'s "until t=1860s" for a first tick in the first minute; "until t=1980s" for one at t=150, 3 wall s
    at ``--speedup 50``). An estimate: the live planner announces the real one (:func:`announced_end`). 0 for the
    other planners or without a warm-up. Raises nothing beyond :func:`_evolving_params`'s."""
    if pol.planner != "evolving":
        return 0.0
    p = _evolving_params(pol)
    if p.t_learn_s <= 0:
        return 0.0
    slice_s = p.window_s / p.slices if p.slices > 0 else 0.0
    t = first_tick_s + p.t_learn_s
    return max(first_tick_s, math.ceil(t / slice_s - 1e-9) * slice_s) if slice_s > 0 else t


def planner_warmup_line(pol: LivePolicy, split: str, speedup: float) -> str | None:
    """One line saying that the evolving planner serves every node collocated (phase ``both``) for its
    warm-up (``t_learn_s``, paper: 1,800 s) and which split it serves after it; None for the other planners
    or without a warm-up (``t_learn_s=0``). The figures are the planner's parameters
    (``services.planner.evolving.EvolvingParams`` with the ``--planner-opt`` items), not copies.

    The warm-up ends on the first slice boundary (a multiple of ``window_s / slices``, 60 s, of simulated
    time) at or after its first tick + ``t_learn_s``: ``split get`` says "until t=1860s" for a first tick
    just after t=0 (services/planner/README.md). After it the planner goes to ``initial_split`` when given,
    else to the split it found at its first tick (``split``), or, when that is collocated, to the split the
    warm-up's records predict best (``objective``).

    Args:
        pol: the live policy (its ``planner`` and ``planner_args``, ``key=value`` items).
        split: the cluster's split (``2P2D``; served after the warm-up).
        speedup: simulated seconds per wall second (for the warm-up's wall time).
    """
    if pol.planner != "evolving":
        return None
    p = _evolving_params(pol)
    if p.t_learn_s <= 0:
        return None
    slice_s = p.window_s / p.slices
    if p.initial_split:
        after = p.initial_split
    elif split == "collocated":
        after = ("the split with the lowest predicted mean latency over the warm-up" if p.objective == "latency"
                 else "the split with the best mean predicted throughput over the warm-up")
    else:
        after = split
    return (f"planner evolving: every node collocated for its {p.t_learn_s:.0f}-s warm-up ({_wall(p.t_learn_s / speedup)} s wall "
            "from its first tick; "
            f"it ends on a {slice_s:.0f}-s slice boundary, `split get` says when), fitting each node's iteration-time "
            f"models; then {after}, re-planned every {p.window_s:.0f} s of simulated time when a candidate is "
            f"significantly better (objective {p.objective})")


def tokenizer_lines(args: argparse.Namespace) -> list[str]:
    """``up``'s banner lines for what loading ``--tokenizer`` noted (``_spec`` keeps ``HFTokenizer.notes``):
    a model folder without a chat template was served chat requests in ChatML, said only in the router's log,
    where vLLM refuses them (session 42). Empty for the sim tokenizer or a tokenizer with nothing to say."""
    return [f"note: tokenizer {args.tokenizer}: {n} (vLLM refuses chat requests without a template: add "
            "tokenizer_config.json's chat_template or chat_template.jinja to the folder)" if "chat_template" in n
            else f"note: tokenizer {args.tokenizer}: {n}" for n in getattr(args, "tokenizer_notes", ())]


def split_deferred_line(pol: LivePolicy, split: str, *, given: bool) -> str | None:
    """One line for ``up`` / ``demo`` when the user passed ``--split`` and the evolving planner's collocated warm-up
    (``t_learn_s`` > 0) serves something else first: every node collocated until the warm-up ends, the split only
    after it. ``up --engine torch --split 1P1D`` answered every request with ``"decode_node": null`` for 30 minutes
    and only the banner's warm-up line hinted why. The warm-up stays (paper §5.1: each node's Eq. 1/2 models are fitted
    while it serves both phases; a prefill-only node never measures decode); the line names the two ways to the split
    at once. None when ``--split`` was not given, is ``collocated``, or the policy has no warm-up.

    Args:
        pol: the live policy (its ``planner`` and ``planner_args``).
        split: the cluster's split (``--split``).
        given: whether the user passed ``--split`` (``args.split_given``).
    """
    if not given or split == "collocated" or pol.planner != "evolving":
        return None
    p = _evolving_params(pol)
    if p.t_learn_s <= 0:
        return None
    after = p.initial_split or split
    # a warm-up already this short was told to pass --planner-opt t_learn_s=60, the flag it was started with
    shorter = (", or a short warm-up: --planner-opt t_learn_s=60 (it ends only once the nodes have served requests: "
               "an idle cluster's is extended while no model can be fitted)" if p.t_learn_s > 60 else
               f" (the warm-up ends on a {p.window_s / p.slices:.0f}-s slice boundary: `split get` says when)")
    return (f"note: --split {split} is not served yet: the evolving planner (policy {pol.name}) serves every node collocated "
            f"(\"decode_node\": null) for its {p.t_learn_s:.0f}-s warm-up, then {after}; for {split} at once pass "
            f"--policy static:{split} (a fixed split){shorter}")


def _shown(info: dict[str, object]) -> dict[str, object]:
    """``cluster.describe()`` as printed (READY) and written to ``LOG_DIR/cluster.json``: a password or token
    in ``--nats-url`` replaced by ``***`` (the 0600 state file keeps it for ``split`` / ``tap``)."""
    return {**info, "nats_url": redact_url(str(info["nats_url"]))}


def _write_state(info: dict[str, object]) -> Path | None:
    """The state file that lets `split` and `tap` find this cluster (evolving_infra.state); None if unwritable."""
    from evolving_infra.state import write_state

    try:
        return write_state(info)
    except OSError as e:
        print(f"warning: cannot write the cluster state file ({e}); give `split`/`tap` --nats-url", file=sys.stderr)
        return None


def cmd_up(args: argparse.Namespace) -> int:
    """``evolving-infra up``: run :func:`_up` in its own event loop; returns its exit status.

    SIGUSR1 (a key reload, :func:`reload_router_keys`) is ignored until ``_up`` sets its handler (the checks and a
    tokenizer's load before it take seconds) and again once the loop closed, which put it back to its default:
    one sent then killed ``up`` (status 138) and left its cluster to die with it. In ``up``'s own process
    (:func:`shared.signals.process_claimed`; its stop signals caught from its first line:
    :func:`evolving_infra.cli.catch_up_stop_signals`) SIGINT, SIGTERM and
    SIGHUP are ignored once ``_up`` has ended (its cluster stopped): the rest of a burst of them (a plain
    ``scancel``) then ends nothing, and ``up`` exits with its own status, not -15."""
    setup_logging("console", "warning")
    ignoring = contextlib.suppress(ValueError)  # not the main thread (a test's): the caller's signals are its own
    with ignoring:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        return run_then_ignore(_up(args), UP_STOP_SIGNALS)
    finally:
        with ignoring:
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)


# ----------------------------------------------------------------------------- demo


async def _demo(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as held:  # OUT's lock (hold_out), once taken, until the report is written
        return await _demo_held(args, held)


async def _demo_held(args: argparse.Namespace, held: contextlib.ExitStack) -> int:
    from evolving_infra.replay.core import Arrival
    from evolving_infra.out_folder import (LOCK, OUTPUTS_ELSEWHERE, OutFolderError, check_previous_run, drop_partial_records, folder_holder,
                                           hold_out, note_leftover_partial_records, partial_records,
                                           set_aside_or_elsewhere)
    from evolving_infra.replay.live import LiveReplayer, RecordAppender
    from evolving_infra.report.ideal import annotate_ideal, annotate_lost_reuse
    from evolving_infra.report.write import build_report, print_summary, report_line, write_report
    from evolving_infra.traces.io import NO_REQUESTS, TraceError, read_trace, trace_identity
    from evolving_infra.traces.sample import scale_description, scale_trace_for_model
    from shared.clock import SimClock

    from shared.profile import load_profile

    torch_engine = args.engine == "torch"
    if args.sessions is None:
        args.sessions = 4 if torch_engine else 60
    if args.concurrency is None:
        args.concurrency = 4 if torch_engine else 16
    try:
        trace_path = Path(stdin_file(args.trace)) if args.trace else demo_trace_path()
        trace = read_trace(trace_path)
    except TraceError as e:  # every bad line; before a service is started or a folder made
        print(f"error: --trace: {shown(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: --trace: {args.trace or demo_trace_path()}: cannot read: {e}", file=sys.stderr)
        return 2
    trace_name = shown(str(trace_path))  # '-' for stdin, not its temporary copy
    if not trace.requests:  # before a service is started or a folder made, as a bad trace
        print(f"error: --trace: {trace_name}: {NO_REQUESTS}", file=sys.stderr)
        return 2
    agents = list(dict.fromkeys(r.agent for r in trace.requests))[: args.sessions]
    keep = set(agents)
    requests = [r for r in trace.requests if r.agent in keep]
    out = Path(args.out)
    log_dir = Path(args.log_dir) if args.log_dir else out / "logs"
    if torch_engine:  # the engine's page size (and the model's context) rule; the trace is scaled to fit
        spec = _spec(args, log_dir=str(log_dir))
        # prompts cut so that two requests fit the node's L1 together (and the model's context)
        limit = min(spec.max_context_tokens, spec.node_profile().memory.gpu_kv_tokens // 2)
        requests = scale_trace_for_model(requests, limit, args.max_output)
        token_block = 1
        print(f"demo --engine torch: {scale_description(trace.header.block_size, limit, args.max_output)} (half of L1, "
              "within the model's context)", flush=True)
    else:
        # the cluster's blocks are the profile's (the workers'); each trace block is sent as trace.header.block_size
        # tokens, so equal block prefixes stay equal token prefixes at any cluster block size
        spec = _spec(args, log_dir=str(log_dir))
        token_block = trace.header.block_size
        # a node refuses a request whose prompt alone exceeds its L1 (WorkRejected: 'request needs N KV blocks
        # but node has M in GPU memory'): with none that fits (demo --profile tiny: 256 tokens, prompts of
        # thousands) every request fails after a full replay; refused here instead
        l1 = spec.node_profile().memory.gpu_kv_tokens
        shortest = min((len(r.blocks) * token_block for r in requests), default=0)
        if requests and shortest > l1:
            print(f"error: --profile {spec.profile}: a node's GPU KV memory holds {l1} tokens (memory.gpu_kv_tokens, "
                  "--gpu-kv-tokens) "
                  f"and the shortest of the {len(requests)} prompts to replay has {shortest}: every request would fail; "
                  "use a profile with more KV memory (the default gb300-glm52) or --engine torch, which scales the "
                  "trace to its node", file=sys.stderr)  # fmt: skip
            return 2
    made = not out.exists()
    try:  # before the cluster starts: a second run into OUT, or an OUT/previous of the user's, stops the demo here
        held.enter_context(hold_out(out))  # makes OUT; held until the report is written (its logs too: OUT/logs)
        check_previous_run(out)
    except (OutFolderError, OSError) as e:
        held.close()  # the lock file removed
        if made and out.is_dir() and not any(out.iterdir()):  # after the checks of _spec: a refused demo leaves no folder
            out.rmdir()
        print(f"error: --out {out}: {e}", file=sys.stderr)
        return 2
    if holder := folder_holder(log_dir):  # an `up --log-dir` there: its logs are not cleared (its cluster refuses ours too)
        held.close()
        print(f"error: --log-dir {log_dir} is in use: {holder} is writing to it (it holds {log_dir / LOCK}); a second "
              "cluster there would overwrite its NATS credentials and state files: stop it, or choose another --log-dir",
              file=sys.stderr)
        if made and out.is_dir() and not any(out.iterdir()):  # a refused demo leaves no folder
            out.rmdir()
        return 2
    note_leftover_partial_records(out, "demo")
    if not args.log_dir:  # OUT/logs belongs to this run, as OUT/report.json does: an earlier demo's lines go
        clear_run_logs(log_dir)
    pol: LivePolicy = args.live_policy
    print(
        f"demo: {len(agents)} Claude Code sessions, {len(requests)} requests from {Path(trace_name).name}; "
        f"{spec.nodes} workers ({spec.profile}), {split_plan(pol, spec.split, spec.speedup)}; speedup {spec.speedup:g}, {args.concurrency} concurrent agents",
        flush=True,
    )
    print(f"  {pol.describe()}" + "".join(f"\n  note: {n}" for n in pol.notes), flush=True)
    warmup = planner_warmup_line(pol, spec.split, spec.speedup)
    if warmup:
        print(f"  {warmup} ({demo_outlook(spec.split, spec.nodes, torch=torch_engine)})", flush=True)
    if deferred := split_deferred_line(pol, spec.split, given=args.split_given):
        print(f"  {deferred}", flush=True)
    api_key = demo_client_key(args)
    run_id = secrets.token_hex(6)  # the report's meta.run_id; names this run's records file (and OUT/run-<id>/)
    records_file = partial_records(out, run_id)  # this run's records as they complete
    print(f"  run {run_id}: each answered request's record is appended to {records_file} until the report is written",
          flush=True)
    wall0 = time.monotonic()
    stop = asyncio.Event()
    signals = _stop_on_signals(stop)
    cluster = LocalCluster(spec)

    async def start() -> bool:
        await cluster.start()  # on cancellation it stops what it started
        return True

    own_logs = not args.log_dir  # OUT/logs: the report's folder, shared with it; its NATS seeds go when the cluster stops
    try:
        started = await until_stopped(start(), stop, grace_s=CLUSTER_STOP_GRACE_S, discard=lambda _: cluster.stop())
    except ClusterError as e:  # as up's: one line, not a traceback (e.g. not healthy within --ready-timeout)
        cluster.remove_generated_creds(own_log_dir=own_logs)
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ClusterConfigError) else 1
    if started is None:
        cluster.remove_generated_creds(own_log_dir=own_logs)
        return _demo_interrupted(signals, Path(log_dir))
    state: Path | None = None
    replayed = False  # the replay ended and its timeline was read: the report follows
    late_stop: LateStopSignals | None = None  # the stop signals after the cluster stopped (this process's demo)
    ended: ClusterError | None = None  # the cluster ended during the replay (--no-restart: a service exited)
    retry = RetryPolicy()  # the OpenAI SDK's default, as `replay` without --max-retries; recorded in the meta
    try:
        print(f"cluster ready in {time.monotonic() - wall0:.1f} s: router {cluster.router_url}, profile {spec.profile}, "
              f"logs {cluster.log_dir}", flush=True)
        for line in (routers_line(spec), context_line(spec), placement_line(spec)):
            if line:
                print(f"  {line}", flush=True)
        if (end := await announced_end(cluster, pol, stop)) is not None:  # the header's figure was the warm-up's length
            print(f"  {warmup_end_line(pol, spec.split, spec.speedup, end[0], announced=end[1])}", flush=True)
        clock = SimClock(spec.speedup, cluster.clock_origin)
        replayer = LiveReplayer(
            cluster.router_url, clock, block_size=token_block, model=spec.model, vocab_size=_vocab_size(spec.tokenizer),
            api_key=api_key, retry=retry,
        )
        fields = _state_fields(spec, policy=pol.name, started_unix=cluster.clock_origin)
        state = _write_state({**cluster.describe(), **fields})  # tap, split get, replay

        def restarted(name: str) -> None:  # the state file lists the process ids: keep them current
            if state is not None:
                _write_state({**cluster.describe(), **fields})

        cluster.on_restart = restarted
        cluster.on_down = restarted  # a service left down after a crash loop: its pid leaves the state file

        # each answered request's record appended to OUT/requests.partial-<id>.jsonl as it completes, as `replay`
        # does: a demo SIGKILLed or OOM-killed keeps them there, and OUT's outputs stay the earlier run's (set aside
        # once the replay has ended, just before the report is written; write_report writes requests.jsonl, sorted)
        try:
            append = RecordAppender(records_file)
        except OSError as e:
            print(f"error: --out {out}: cannot write {records_file.name}: {e}", file=sys.stderr, flush=True)
            return 1
        # a cluster that ends for good stops the replay: nothing serves the rest
        watcher = asyncio.create_task(watch_cluster(cluster, stop))
        try:
            result = await replayer.run(requests, Arrival(kind="closed", concurrency=args.concurrency), stop=stop,
                                        on_record=append)
        finally:
            append.close()
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        if not watcher.cancelled():
            ended = watcher.result()  # watch_cluster raises nothing but its cancellation
        if not signals and ended is None:
            try:
                cluster.check_alive()  # an end within the watcher's last poll (0.2 s)
            except ClusterError as e:  # as up's: one line (and a crash's log tail), not a traceback
                ended = e
        timeline = cluster.timeline()
        replayed = True
    finally:
        if state is not None:
            state.unlink(missing_ok=True)
        await cluster.stop()
        cluster.remove_generated_creds(own_log_dir=own_logs)
        late_stop = _default_signals()  # nothing left to stop: a signal while the report is written is recorded
        if not replayed:  # failed before the replay ended: OUT as it was, but for the records answered before
            drop_partial_records(records_file, only_empty=True)
    if ended is not None and not signals:  # its line first (and a crash's log tail), then the partial report of what the replay got
        _demo_ended_line(ended)
    by_id = {r.id: r for r in requests}
    ideal = annotate_ideal(result.records, by_id, token_block)
    annotate_lost_reuse(result.records, by_id)
    notes = list(trace.header.meta.get("notes", [])) if isinstance(trace.header.meta.get("notes"), list) else []
    sample = trace.header.meta.get("sample") or {}
    cap = sample.get("max_requests_per_branch") if isinstance(sample, dict) else None
    if cap:
        notes.append(f"sessions capped to the first {cap} requests of each branch (replayed trace: {Path(trace_name).name})")
    meta = {
        "command": "demo",
        "run_id": run_id,
        "argv": redact_argv(sys.argv[1:]),  # the report folder is for sharing: no --nats-url password
        "trace": trace_name,
        **trace_identity(trace.header, trace.requests),  # the file's requests, before --sessions: report compare's input
        "cluster": {"nodes": spec.nodes, "split": spec.split, "profile": spec.profile, "routing": spec.routing},
        "policy": pol.meta(),
        "speedup": spec.speedup,
        **demo_input_meta(concurrency=args.concurrency, agents=len(agents), block_size=load_profile(spec.profile).block_size,
                          trace_block_size=trace.header.block_size, max_retries=retry.max_retries),
        "wall_s": time.monotonic() - wall0,
        "replay_wall_s": result.wall_s,
        "branch_end_failures": result.branch_end_failures,
        "branch_ends_cancelled": result.branch_ends_cancelled,
        "notes": notes,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    # a signal stopped the replay (or the cluster ended under it): the report of what was answered, marked partial
    cause: ClusterError | signal.Signals | None = signal.Signals(signals[0]) if signals and result.interrupted else ended
    partial = None if cause is None else demo_partial(cause, total=len(requests), answered=len(result.records),
                                                      in_flight=result.in_flight_at_stop)
    if partial is not None:
        meta["partial"] = partial
        notes.append(f"partial report: {partial_line(partial)}")
    if isinstance(cause, signal.Signals):  # as `replay` marks its interrupted report
        meta["interrupted"] = {"signal": cause.name, "in_flight_cancelled": partial["in_flight_cancelled"] if partial else 0}
    # duration: the replay's own window (wall x speedup), not the span of the answered requests
    report = build_report(result.records, meta=meta, ideal_kv_hit_rate=ideal, timeline=timeline, start=result.start, end=result.end)
    try:  # only now, before the first output: a demo that failed or was killed leaves the earlier run's in place;
        # refused now (previous/ held or the user's files put there meanwhile): this run's outputs to OUT/run-<run_id>/
        dest = set_aside_or_elsewhere(out, "demo", run_id, file=sys.stdout)
    except OutFolderError as e:  # neither the set-aside nor OUT/run-<run_id>/ (OUT not writable any more)
        kept = f"its records are in {records_file}" if records_file.exists() else "it answered no request"
        print(f"error: --out {out}: {e}; this run's report was not written ({kept})", file=sys.stderr, flush=True)
        drop_partial_records(records_file, only_empty=True)
        return 1
    path = write_report(dest, report, sorted(result.records, key=lambda r: r.sent_at))
    drop_partial_records(records_file)  # the same records, in requests.jsonl now
    if partial is not None:
        print(f"PARTIAL REPORT: {partial_line(partial)}", flush=True)
    print_summary(report)
    if not signals and late_stop is not None and late_stop.first is not None:  # came while the report was written
        signals = [late_stop.first]  # the report in full, the signal's status
    if signals:  # the signal's status, as before; the report is what was answered until it came
        print(report_line(path))
        written = "partial report written" if partial is not None else "report written (the replay had ended)"
        print(f"demo: {signal.Signals(signals[0]).name}: stopped the replay and the cluster (its state file and NATS store "
              f"removed); {written}; logs in {log_dir}", file=sys.stderr, flush=True)
        return 128 + signals[0]
    if ended is not None:
        print(report_line(path))
        print(f"demo: partial report written (the cluster ended during the replay: {ended.reason}); logs in {log_dir}",
              file=sys.stderr, flush=True)
        return SERVICE_STOPPED_STATUS if isinstance(ended, ServiceStopped) else 1
    if late := warmup_outlasted_note(pol, spec.split, str(report.get("final_split") or "")):
        print(late)
    print(report_line(path))
    print(_baseline_line(args, dest))  # the folder this run's report is in (OUT/run-<id>/ when OUT/previous was held)
    if dest != out:  # OUT/report.json is still the earlier run's: a script reading it must know
        return OUTPUTS_ELSEWHERE
    ok = report["requests_failed"] == 0 and report["requests_completed"] == report["requests_sent"]
    return 0 if ok else 1


def demo_outlook(split: str, nodes: int, *, torch: bool) -> str:
    """What the demo's planner will show within the run, after its warm-up line: the sim demo (~6,700 simulated s)
    re-plans several 600-s windows; the torch demo's few scaled sessions (~480 simulated s) see the warm-up end and
    the split served, and no re-plan (with 2 nodes 1P1D is the only PD split: ``candidate_masks`` tries 1..N-1
    prefill nodes). The torch demo said "expect it to move nodes between phases" and ended collocated.

    Args:
        split: the split served after the warm-up.
        nodes: worker nodes.
        torch: ``--engine torch``.
    """
    if not torch:
        return "these Claude Code sessions are prefill-heavy and bursty: expect it to move nodes between phases"
    only = f"; with {nodes} nodes {split} is its only PD split" if nodes == 2 and split != "collocated" else ""
    return (f"the torch demo's few short sessions last ~500 s of simulated time: expect the warm-up to end partway through the "
            f"replay and {split} to serve the rest, with no re-plan within the run{only}")


def warmup_outlasted_note(pol: LivePolicy, split: str, final_split: str) -> str | None:
    """The demo's line after its summary when the evolving planner was still in its collocated warm-up at the end
    (the report's ``final_split`` collocated though the cluster was launched at a PD split): the run never left the
    warm-up, so the summary's "PD split final collocated" is the warm-up's, not an adaptation. None otherwise.

    Args:
        pol: the live policy.
        split: the split the workers were launched in.
        final_split: the report's ``final_split``.
    """
    if pol.planner != "evolving" or split == "collocated" or final_split != "collocated":
        return None
    t_learn = _evolving_params(pol).t_learn_s
    if t_learn <= 0:
        return None
    return (f"note       the replay ended within the planner's {t_learn:.0f}-s collocated warm-up: every node served both "
            f"phases throughout and {split} was never served; a shorter warm-up (--planner-opt t_learn_s=60) or more "
            f"--sessions shows it adapt, --policy static:{split} serves {split} from the start")


def demo_client_key(args: argparse.Namespace) -> str | None:
    """The key the demo's replay sends: ``EI_API_KEY`` when set, else one of the keys its router got
    (``args.router_api_keys``, read once by :func:`_spec`: a second read of a ``--api-keys-file`` pipe is empty);
    None when the router is open (:func:`services.router.ingress.local_client_key`)."""
    from services.router.ingress import local_client_key

    return local_client_key(keys=args.router_api_keys)


def _stop_on_signals(stop: asyncio.Event) -> list[int]:
    """Make SIGINT, SIGTERM and SIGHUP (unless ignored: ``nohup``) set ``stop`` (``up``'s run and the demo's
    start-up and replay end on it), so that the demo stops every service and the embedded nats-server (whose JetStream store,
    ``/tmp/ei-nats-*``, reached 196 MB) and removes its state file; the default SIGTERM action killed the demo
    with none of that. A signal ``up`` caught before its loop existed (:func:`shared.signals.caught_early`) sets
    ``stop`` at once. Returns the list that receives the first signal's number."""
    loop = asyncio.get_running_loop()
    got: list[int] = []

    def on_signal(sig: int) -> None:
        if not got:  # a second signal while stopping changes nothing (the stop has its own timeouts)
            got.append(sig)
        stop.set()

    hup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    for sig in (signal.SIGINT, signal.SIGTERM, *hup):
        loop.add_signal_handler(sig, on_signal, int(sig))
    for sig in caught_early() or ():  # `up`'s, sent before this loop existed (evolving_infra.cli.catch_up_stop_signals)
        on_signal(sig)
    return got


def _default_signals() -> LateStopSignals | None:
    """Undo :func:`_stop_on_signals` once the demo's cluster has stopped, instead of setting a stop event that nothing
    waits for any more (a Ctrl-C while the plots were drawn was swallowed: status 0). In the demo's own process
    (:func:`shared.signals.process_claimed`) SIGINT, SIGTERM and SIGHUP (unless ignored: ``nohup``) are then
    recorded, not acted on (:class:`shared.signals.LateStopSignals`, returned): the report is written in full (about a
    second) and the demo exits with the first one's status, 130 / 143 / 129, the rest of a burst changing nothing.
    Before, SIGTERM's default action killed it (-15), also when the signal was only the rest of the burst whose first
    stopped the demo (a plain ``scancel``), its partial report then lost; an abort raised from the handler landed
    wherever the main thread was (a ``__del__``: "Exception ignored", the abort lost; the demo's task: "Task
    exception was never retrieved"). In-process (a test's call) SIGINT raises ``KeyboardInterrupt`` again and
    SIGTERM / SIGHUP end the process (their defaults); returns None then."""
    loop = asyncio.get_running_loop()
    if process_claimed():
        hup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)  # nohup: stays ignored
        late = LateStopSignals()
        late.take_over(loop, (signal.SIGINT, signal.SIGTERM, *hup))
        return late
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.remove_signal_handler(sig)  # False (nothing done) for one not installed: SIGHUP under nohup
    return None


def _demo_interrupted(signals: list[int], log_dir: Path) -> int:
    """The line and status of a demo a signal stopped during its start-up (its cluster already stopped; a signal during
    the replay gets a partial report instead, :func:`demo_partial`): 130 for Ctrl-C
    (:data:`evolving_infra.cli.INTERRUPTED`), 143 for SIGTERM, 129 for SIGHUP, as a shell reports them. The line
    names ``log_dir``, the services' logs, which stay (a newcomer found ``demo-out/`` holding only ``logs/``)."""
    name = signal.Signals(signals[0]).name
    print(f"demo: {name}: stopped the cluster (its state file and NATS store removed); no report written; "
          f"logs in {log_dir}", file=sys.stderr, flush=True)
    return 128 + signals[0]


async def watch_cluster(cluster: LocalCluster, stop: asyncio.Event) -> ClusterError | None:
    """The demo's watcher during its replay: wait until ``cluster`` ends for good (:meth:`LocalCluster.wait_failed`),
    then set ``stop`` (the replay sends no new request; those in flight are cancelled, their services going, and
    counted apart) and return why it ended. Run it as a task and cancel it once the replay is over.

    Returns None, after a ``warning:`` line on stderr, when the wait raised anything else (a defect): the replay goes
    on unwatched (the demo's check after it still finds a cluster that ended). Before, ``gather(...,
    return_exceptions=True)`` swallowed such an error without a word.

    Raises:
        asyncio.CancelledError: cancelled (the replay ended first).
    """
    try:
        ended = await cluster.wait_failed()
    except Exception as e:  # noqa: BLE001 - not ClusterError (wait_failed returns those): said, and the replay goes on
        print(f"warning: the demo's cluster watcher failed ({type(e).__name__}: {e}); the replay goes on and a service that "
              "exits is found only after it", file=sys.stderr, flush=True)
        return None
    stop.set()
    return ended


def _demo_ended_line(ended: ClusterError) -> None:
    """The line of a demo whose cluster ended during the replay (its cluster already stopped), before its partial
    report: as ``up``'s, a service that exited 0 on its own under ``--no-restart`` (:class:`ServiceStopped`) is one
    line on stdout (the demo then exits :data:`SERVICE_STOPPED_STATUS`, 3); a crash (or a supervisor that gave up, or
    nats-server that exited) is "error: ..." on stderr with the log's tail (status 1)."""
    if isinstance(ended, ServiceStopped):
        print(f"{ended}; --no-restart: stopped the cluster", flush=True)
    else:
        print(f"error: {ended}", file=sys.stderr, flush=True)


def demo_partial(ended: ClusterError | signal.Signals, *, total: int, answered: int, in_flight: int) -> dict[str, object]:
    """``meta.partial`` of a demo whose cluster ended during the replay, or that a signal (Ctrl-C, SIGTERM, SIGHUP)
    stopped during it: the replay stopped there (no new request; those in flight cancelled), so the report covers
    what was answered before. A
    benchmark client's figures when its server dies (vLLM's ``benchmark_serving``, genai-perf): what was answered
    (completed or failed: the report's own ``requests_sent``), cancelled in flight and never sent, and why the run
    stopped.

    Never raises on its counts: this is the report of a run that already went wrong, and a traceback here lost it.
    Counts that do not add up (a defect) are clamped, with a warning on stderr: none below 0, and in flight at most
    the requests not answered; ``answered`` (the report's records) is kept.

    Args:
        ended: why the cluster ended (:meth:`LocalCluster.wait_failed`; its ``service`` and ``reason``), or the
            signal that stopped the replay.
        total: requests the demo meant to replay (>= 0).
        answered: records the replay returned (its requests answered, completed or failed; <= ``total``).
        in_flight: requests sent and cancelled unanswered at the stop (``ReplayResult.in_flight_at_stop``; not in
            the records; <= ``total - answered``).

    Returns:
        ``service`` (None for no one service: a crashed supervisor, or a signal), ``reason``, ``clean`` (the service
        exited 0: ``--no-restart`` status 3; False for a signal), ``signal`` (its name, e.g. ``SIGINT``; only for a
        signal), ``requests_total``, ``requests_answered`` (the report's ``requests_sent``),
        ``in_flight_cancelled``, ``requests_not_sent`` (``total - answered - in_flight``, the three adding up to
        ``total`` when the counts are consistent).
    """
    t, a, f = max(0, total), max(0, answered), max(0, min(in_flight, total - answered))
    if (t, a, f) != (total, answered, in_flight) or answered > total:
        print(f"warning: partial report counts do not add up ({answered} answered + {in_flight} in flight of {total} "
              f"requests): taken as {a} answered + {f} in flight of {t}", file=sys.stderr, flush=True)
    why: dict[str, object] = (
        {"service": None, "reason": f"stopped by {ended.name}", "clean": False, "signal": ended.name}
        if isinstance(ended, signal.Signals)
        else {"service": ended.service, "reason": ended.reason, "clean": isinstance(ended, ServiceStopped)}
    )
    return {
        **why,
        "requests_total": t,
        "requests_answered": a,
        "in_flight_cancelled": f,
        "requests_not_sent": max(0, t - a - f),
    }


def partial_line(partial: Mapping[str, Any]) -> str:
    """One line for :func:`demo_partial`'s dict: how the cluster ended (naming the service), then the requests
    answered (the summary's ``requests   sent``), those cancelled in flight (not in the report's counts) and those
    never sent, of the total; the report's ``note`` and the line above the demo's summary (``PARTIAL REPORT: ...``).
    A signal's stop says "the replay was stopped by SIGINT" instead of how the cluster ended."""
    why = (f"the replay was stopped by {partial['signal']}" if partial.get("signal")
           else f"the cluster ended during the replay ({partial['reason']})")
    return (f"{why}: {partial['requests_answered']} answered + "
            f"{partial['in_flight_cancelled']} cancelled in flight (not in the counts) of {partial['requests_total']} "
            f"requests; {partial['requests_not_sent']} never sent")


def demo_input_meta(*, concurrency: int, agents: int, block_size: int, trace_block_size: int,
                    max_retries: int = RetryPolicy().max_retries) -> dict[str, object]:
    """The ``meta`` keys of a demo's report that say what it served, in the keys and shapes
    ``simulate`` records, so that ``report compare`` (``compare.INPUT_KEYS``) checks a demo against
    a simulation of the same input and warns only about what differs.

    Args:
        concurrency: agents running at once (closed loop).
        agents: sessions replayed.
        block_size: the cluster's tokens per KV block: the profile's (the workers').
        trace_block_size: tokens per block of the replayed trace.
        max_retries: sends after the first of a request refused before any answer (the demo's
            replayer's :class:`~evolving_infra.replay.retry.RetryPolicy`: the OpenAI SDK's default, 2),
            as ``replay --max-retries`` records it.

    Returns:
        ``arrival`` (closed, ``rate_per_min`` and ``cap`` None as in ``simulate``), ``agents``,
        ``block_size``, ``trace_block_size``, ``max_retries``, ``tile`` 1, ``max_pause_s`` None (the trace's pauses
        as recorded, scaled by the speedup, none capped), ``duration_s`` None (until every session
        is done), ``warmup_s`` 0.0 (every request is measured), and ``inputs_not_applicable``
        ``["seed"]`` (agents enter in trace order on a closed loop: nothing is drawn, so no seed
        applies). No ``agent_order``: ``simulate`` records none for its default, trace order.
    """
    return {
        "arrival": {"kind": "closed", "concurrency": concurrency, "rate_per_min": None, "cap": None},
        "agents": agents,
        "block_size": block_size,
        "trace_block_size": trace_block_size,
        "max_retries": max_retries,
        "tile": 1,
        "max_pause_s": None,
        "duration_s": None,
        "warmup_s": 0.0,
        "inputs_not_applicable": ["seed"],
    }


def _vocab_size(tokenizer: str) -> int | None:
    """The router tokenizer's vocabulary size for the replayer's prompt ids; None for ``sim`` (the trace's own ids)."""
    if tokenizer == "sim":
        return None
    from shared.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer).vocab_size



def clear_run_logs(log_dir: Path) -> list[Path]:
    """Remove the service logs (``*.log``) an earlier run left in ``log_dir``, a folder the run owns
    (``demo``'s ``OUT/logs``): each service opens its log for appending, so a second run's lines were
    written after the first's. Other files and folders stay. Returns the removed paths; a missing
    folder removes nothing.

    Raises:
        OSError: a log that exists cannot be removed.
    """
    if not log_dir.is_dir():
        return []
    gone = sorted(f for f in log_dir.glob("*.log") if f.is_file())
    for f in gone:
        f.unlink()
    return gone


def demo_input_flags(args: argparse.Namespace) -> list[str]:
    """The demo flags that define what it serves (the sessions, how they arrive, the trace and its scaling), on what
    nodes (count, profile, engine, model, KV sizes, device, a real-bytes KV pool) and how they serve it apart from the policy (the speed-up,
    ``--fence-after-s``, ``--stream-interval``, a ``--tokenizer`` given): a comparison command must repeat all of
    them, or it compares another input or another cluster (``report compare`` warns about the input). The static
    demo's comparison line was ``demo --out demo-out``, which dropped ``--engine torch --model DIR --nodes 2
    --sessions 4``: a 60-session sim run against a 4-session real-model one; and the baseline line dropped
    ``--fence-after-s 3``, so the comparison ran at the demo's 10 s. The policy's own flags (``--routing``,
    ``--planner-opt`` ...) are what the comparison changes, and flags that change no serving (ports, logs, NATS,
    served names, restarts) are not repeated."""
    same = [f"--sessions {args.sessions}", f"--concurrency {args.concurrency}", f"--speedup {args.speedup:g}", f"--nodes {args.nodes}"]
    if args.trace:
        same.append(f"--trace {shlex.quote(str(args.trace))}")
    if args.engine == "torch":  # the same real model, scaled the same way (its profile is torch-tiny-cpu unless given)
        same.append(f"--engine torch --model {shlex.quote(str(args.model_dir))} --max-output {args.max_output}")
        same += [f"{flag} {shlex.quote(str(value))}" for flag, value in
                 (("--device", args.device), ("--dtype", args.dtype), ("--torch-threads", args.torch_threads)) if value]
    if args.profile != DEFAULT_PROFILE:  # the same nodes (a tiny demo against a GLM-5.2 baseline compares nothing)
        same.append(f"--profile {shlex.quote(str(args.profile))}")
    # the KV sizes set the nodes' memory, and for --engine torch how far prompts are cut (half of L1)
    same += [f"{flag} {value}" for flag, value in (("--gpu-kv-tokens", args.gpu_kv_tokens), ("--host-kv-tokens", args.host_kv_tokens)) if value]
    # the real-bytes host KV pool: its peer fetches pull bytes over TCP on the wall clock (x the speed-up); without it
    # they move none, another cluster
    if getattr(args, "kv_pool", "off") == "real":
        same.append("--kv-pool real")
        if getattr(args, "kv_pool_slot_bytes", 0):
            same.append(f"--kv-pool-slot-bytes {args.kv_pool_slot_bytes}")
    # how the cluster serves it: the liveness time (a 3-s run against the demo's 10 s fences starved workers the
    # other does not), the streamed chunk size, a tokenizer given (the torch engine's default, the model's, is not)
    if args.fence_after_s is not None and args.fence_after_s != DEMO_FENCE_S:
        same.append(f"--fence-after-s {args.fence_after_s:g}")
    if args.stream_interval != 1:
        same.append(f"--stream-interval {args.stream_interval}")
    if args.tokenizer not in (None, "sim") and not getattr(args, "tokenizer_of_model", False):
        same.append(f"--tokenizer {shlex.quote(str(args.tokenizer))}")
    return same


def _baseline_line(args: argparse.Namespace, out: Path) -> str:
    """The demo's last line: the same input (:func:`demo_input_flags`) under the baseline (SGLang PD at the same
    split, cache-aware prefill routing, round-robin decode, no switches), or, after a static run, under the default policy starting from the same
    split, as a command to run and compare; the comparison goes to a folder next to ``out`` (``OUT-compare``; a
    bare ``report compare`` wrote ``./compare-out`` wherever the user stood). A static run whose evolving run is
    already there (``OUT`` without ``-static``, or ``OUT-evolving``, holds a ``report.json``: the baseline command
    printed by ``make demo`` was run) names the comparison of the two and its page instead: before (session 59),
    its line suggested the evolving demo again with ``--out demo-out``, which would move the first demo into
    ``demo-out/previous/``."""
    ei = command_name()  # `make demo` runs .venv/bin/evolving-infra, not on PATH until the venv is activated
    same = " ".join(demo_input_flags(args))
    if args.live_policy.name.startswith("static"):
        stem = str(out)[: -len("-static")] if str(out).endswith("-static") and len(str(out)) > len("-static") else None
        other = Path(stem) if stem else Path(f"{out}-evolving")
        compare = Path(f"{stem or out}-compare")
        if (other / "report.json").is_file():
            # the demo's baseline command ran this one beside the run in OTHER: the line points at the comparison it
            # goes on to write, not at a re-run into OTHER (which moved that run to OTHER/previous/)
            return (f"baseline: this run is the static baseline of {shlex.quote(str(other))} (its report.json is there); "
                    f"the comparison: {ei} report compare --out {shlex.quote(str(compare))} {shlex.quote(str(other))} "
                    f"{shlex.quote(str(out))} (the baseline command runs it next), then open "
                    f"{shlex.quote(str(compare / 'compare.html'))}")
        return (f"baseline: this run is the static baseline; the default policy (evolving, from {args.split}) on the same "
                f"input: {ei} demo --split {args.split} {same} --out {shlex.quote(str(other))} && "
                f"{ei} report compare --out {shlex.quote(str(compare))} {shlex.quote(str(other))} {shlex.quote(str(out))}")
    base_out = Path(f"{out}-static")
    compare = Path(f"{out}-compare")
    return (f"baseline (same input, SGLang PD at {args.split}, cache-aware prefill routing, round-robin decode, no switches): "
            f"{ei} demo --policy static:{args.split} {same} --out {shlex.quote(str(base_out))} && "
            f"{ei} report compare --out {shlex.quote(str(compare))} {shlex.quote(str(out))} {shlex.quote(str(base_out))}")


def cmd_demo(args: argparse.Namespace) -> int:
    """``evolving-infra demo``: run :func:`_demo` in its own event loop; returns its exit status. In the demo's own
    process (:func:`shared.signals.process_claimed`) SIGINT, SIGTERM and SIGHUP are ignored once ``_demo`` has ended
    (its report written): one then, the rest of a burst, ends nothing, and the demo exits with its own status where
    one landing while ``asyncio.run`` closed the loop, or just after, killed it (-15)."""
    setup_logging("console", "warning")
    return run_then_ignore(_demo(args), UP_STOP_SIGNALS)


# ----------------------------------------------------------------------------- registration


UP_EXIT_STATUSES = (
    "exit status: 0 stopped as asked (Ctrl-C, SIGTERM, SIGHUP to up; also during start-up; a second one before up's "
    "handlers are set, while it imports and checks its options, aborts at once: 130 for Ctrl-C, 128 + the signal "
    "else); 1 runtime failure: --port "
    "taken, a service died (with --no-restart: exited non-zero or by a signal, or nats-server exited; else its restarts "
    "gave up), a service exited during start-up (any code), the cluster not healthy within --ready-timeout, NATS refused the "
    "launcher's connection (its credentials), a NATS server whose JetStream did not answer the stream lookup (or "
    "whose create did not succeed) within --ready-timeout; 2 usage or configuration error: a bad option, no NATS "
    "server answered at --nats-url within --ready-timeout, the server denies the launcher's identity the JetStream "
    "stream's lookup or create (grant it, or make the stream first with `evolving-infra auth stream`); 3 with "
    "--no-restart, a service exited 0 on its own (e.g. a SIGTERM sent to it, not to up): the cluster stopped, no crash. "
    "One line on stderr says why (for 3: on stdout)."
)
"""The epilog of ``up --help``: the statuses :func:`_up` returns."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "up",
        help="start NATS and every service as its own process; Ctrl-C stops all",
        description="Start an embedded nats-server (unless --nats-url) and the directory, planner, workers and router, "
        "each as its own OS process; wait until all are healthy; Ctrl-C stops everything cleanly.",
        epilog=UP_EXIT_STATUSES,
    )
    _add_cluster_args(
        p, nodes=4, split="2P2D", speedup=1.0,
        log_dir="a new $TMPDIR/ei-logs-* folder, kept after a stop; the NATS credentials up generates in it are deleted then",
    )  # fmt: skip
    p.set_defaults(func=cmd_up)

    d = sub.add_parser(
        "demo",
        help="up + replay real Claude Code sessions + report",
        description="Start a local cluster, replay real Claude Code sessions (shipped sample) closed-loop through the "
        "router, and write OUT/report.json, OUT/requests.jsonl, the plots (OUT/*.png) with OUT/report.html that shows "
        "them, and the services' logs under OUT/logs. Ctrl-C, SIGTERM or SIGHUP during the replay stops it and the "
        "cluster and writes the report of what was answered, marked partial (PARTIAL REPORT: ..., meta.partial and "
        "meta.interrupted), then exits 128 + the signal (130 for Ctrl-C); during start-up it writes no report.",
    )
    _add_cluster_args(d, nodes=4, split="2P2D", speedup=50.0, port=0, log_dir="OUT/logs, whose *.log files a new demo replaces; the NATS credentials the demo generates in it are deleted when it stops",
                      warmup="900 s of simulated time in the demo, --engine torch 240 s", fence_after_s=DEMO_FENCE_S)
    d.add_argument("--out", default="demo-out", type=folder, help="output directory for report.json, requests.jsonl, plots, report.html and logs/ (default demo-out); each answered request's record is appended to OUT/requests.partial-ID.jsonl as it completes (a killed demo keeps them there; removed once requests.jsonl is written). Files of those names already there (an earlier run's, or your own) move to OUT/previous/ once the replay has ended, just before the report is written, never overwritten (a demo that fails or is killed leaves them in place); OUT/previous/ keeps only the last run's (replaced each run); when that move is refused at the end (OUT/previous held by a 'report show', or your files put there meanwhile) the report goes to a new OUT/run-ID/ instead, named on stderr, exit status 4. The demo stops before its cluster starts when OUT/previous holds other files, or while another run is writing to OUT (it holds OUT/.evolving-infra.lock)")
    d.add_argument("--trace", default=None, help="canonical trace to replay instead of the shipped Claude Code sample (- reads stdin)")
    d.add_argument("--sessions", type=int, default=None, help="sessions (agents) to replay (default 60; --engine torch: 4)")
    d.add_argument("--concurrency", type=int, default=None, help="concurrent agents, closed loop (default 16; --engine torch: 4)")
    d.add_argument(
        "--max-output", type=int, default=8, help="--engine torch: output tokens per request at most (default 8)"
    )
    d.set_defaults(func=cmd_demo, port=0)
