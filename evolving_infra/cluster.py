"""A local cluster: embedded nats-server + every service as its own OS process.

``LocalCluster`` is what ``evolving-infra up`` and ``demo`` run, and what the
end-to-end tests start. Each service is a separate ``python -m services.<x>``
process that talks to the others only over NATS. Children run in their own
session (a terminal Ctrl-C reaches only the launcher, which then stops them in
order) and, on Linux, receive SIGTERM if the launcher dies (PR_SET_PDEATHSIG),
so no process outlives the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

import httpx
import msgspec
import structlog

from shared import messages as m
from shared.cancel import cancel_until_done
from shared.auth import AuthError, Credentials, NatsAuth, generate, redact_url, router_names
from shared.bus import Bus, BusError, PermissionDenied, StreamLacksSubjects, stream_api_subject, stream_name
from shared.config import ENV_PREFIX, CommonConfig, ConfigError, field_from_text
from shared.natsserver import MAX_PAYLOAD_BYTES, EmbeddedNatsServer, NatsServerError, die_with_parent, exit_text, signal_text
from shared.net import http_url, listen_socket
from shared.profile import Profile, load_profile, with_kv_tokens
from evolving_infra.report.timeline import RunTimeline, TimelineRecorder
from shared.split import parse_split, split_name
from shared.subjects import PLANNER_DECISIONS, SPLIT_APPLIED, SVC_HEARTBEAT, Subjects
from evolving_infra.nodedown import announce_downs
from evolving_infra.liveness import (  # the liveness decisions, shared with the Slurm job's watcher
    LIVENESS_MIN_S as LIVENESS_MIN_S, SUPERVISE_GAP_S as SUPERVISE_GAP_S, ANSWERED, DEAF, BusProbe, bus_watch, count_exit,
    liveness_overdue, nats_info_probe, paused, probe_seen_until,
)

log = structlog.get_logger("cluster")


def _short_exit(code: int | None) -> str:
    """``code 1`` or ``killed by signal 9 (SIGKILL)``: one service's end in a list of those that ended with another."""
    if code is None:
        return "code unknown"
    return f"killed by {signal_text(-code)}" if code < 0 else f"code {code}"


class ClusterError(RuntimeError):
    """A service failed to start or died.

    Args:
        message: the error (may hold the log's tail after its first line).
        service: the service that ended the cluster (``nats-server`` for the embedded server), when one did; None
            for a failure of no one service (a start-up's configuration, a crashed supervisor).
        reason: how it ended, in a few words (``planner was killed by signal 9 (SIGKILL)``), for a line that names it
            (the demo's partial report); None: the message's first line.
    """

    def __init__(self, message: str, *, service: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.service = service
        self.reason = reason if reason is not None else message.split("\n", 1)[0]


class ServiceStopped(ClusterError):
    """Without supervision (``--no-restart``), a service exited with code 0 (every service that exited did): it stopped
    on a SIGTERM that reached it, after its drain, so the cluster ends without a crash (``up`` says so without
    "error:", and exits 3: nobody asked ``up`` to stop). During the start-up it is a failed start:
    :meth:`LocalCluster.start` raises a :class:`ClusterError` naming it, with the log's tail.

    Args:
        message: the line (the service, "exited cleanly (code 0)", its log).
        service: the service that exited (the first, where several did).
        log_path: its log.
        log_tail: the end of its log (:meth:`LocalCluster._log_tail`).
        reason: how the cluster ended, in a few words (:class:`ClusterError`); default ``SERVICE exited cleanly (code 0)``.
    """

    def __init__(self, message: str, *, service: str, log_path: Path, log_tail: str, reason: str | None = None) -> None:
        super().__init__(message, service=service, reason=reason if reason is not None else f"{service} exited cleanly (code 0)")
        self.log_path = log_path
        self.log_tail = log_tail


class ClusterConfigError(ClusterError):
    """The deployment ``up`` was given cannot work as configured, and waiting cannot mend it (``--nats-url``
    credentials the server refuses the JetStream stream): ``up`` exits 2, as for other configuration errors."""


class ClusterSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What to launch. Times are wall seconds unless named ``sim``."""

    nodes: int = 4
    """Worker nodes (one process each)."""
    split: str = "2P2D"
    """Initial PD split: ``collocated`` or ``xPyD`` with x + y == nodes."""
    profile: str = "gb300-glm52"
    speedup: float = 1.0
    """Simulated seconds per wall second for every sim engine and clock."""
    host: str = "127.0.0.1"
    port: int = 8000
    """Router HTTP port (0 = any free port)."""
    routers: int = 1
    """Router processes (``router``, ``router-1``, ...), all serving the one listening socket the cluster holds
    (:attr:`LocalCluster.router_socket`, each router's ``--listen-fd``): the kernel hands each connection to one of
    them, so while one drains, exits or is restarted the others accept and serve (no gap). Each is its own NATS
    identity (peer routers on one bus) and is supervised on its own. At least 1."""
    routing: str = "cache-aware"
    """Router ``--routing`` (``up``/``demo`` set it from ``--policy``, ``evolving_infra.policy_args``)."""
    planner: str = "static"
    """Planner ``--planner``: static, evolving, dynamo, arrow."""
    planner_args: tuple[str, ...] = ()
    """Planner ``--planner-args`` items (``key=value``)."""
    eviction: str = "lru"
    """Workers' ``--host-eviction``: lru or branch-count."""
    decode_binding: str = "prefill-start"
    """Router ``--decode-binding``: prefill-start or dispatch."""
    decode_routing: str = "least-loaded"
    """Router ``--decode-routing``: least-loaded (the routing policy's own rule) or round-robin (the baselines'
    decode binding, SGLang Model Gateway PD mode; ``up``/``demo`` set it from ``--policy``)."""
    router_env: tuple[tuple[str, str], ...] = ()
    """Environment variables set for the router process only, over the launcher's (``up``/``demo``: the API keys
    they read at start, ``EI_API_KEYS``, so that no key is on a command line and a restarted router serves the
    same keys without reading a file again; with a regular keys file, its path in ``EI_API_KEYS_RELOAD_FILE``, which
    only the router's SIGHUP reload reads; ``evolving_infra.launcher.router_keys_env``). ``up``'s SIGUSR1 replaces
    the keys for later restarts in the running cluster's children (:meth:`LocalCluster.set_router_env`), not here."""
    router_args: tuple[str, ...] = ()
    """Extra router flags, after the launcher's own (e.g. routing policy options: ``("--ttft-fetch-min-tokens",
    "64")``; ``up``/``demo`` make them from ``--routing-opt``, ``evolving_infra.policy_args``)."""
    block_size: int = 64
    partition: str = "p0"
    model: str = "evolving-infra-sim"
    model_names: tuple[str, ...] = ()
    """Router ``--model-names``: other served names, listed in ``/v1/models`` after ``model`` (``up
    --served-model-name``'s names after the first, as vLLM lists every one)."""
    model_aliases: tuple[str, ...] = ()
    """Router ``--model-aliases``: other names a request's ``model`` may give, not listed in ``/v1/models`` (the
    ``--model`` folder as given, and resolved, when no served name is set)."""
    nats_url: str | None = None
    """External NATS server; None starts an embedded one."""
    nats_max_payload: int = 0
    """Embedded NATS: the server's ``max_payload`` in bytes; 0 = ``shared.natsserver.MAX_PAYLOAD_BYTES`` (16 MiB, as
    compose and the Slurm job). Tests set less, so that a hand-off's K/V goes in many pieces."""
    log_dir: str | None = None
    """Where each service writes its log; None = a temp dir."""
    log_level: str = "info"
    stream_interval: int = 1
    """Output tokens per streamed chunk (SGLang --stream-interval semantics)."""
    ready_timeout_s: float = 60.0
    metrics: bool = False
    """Give every service a Prometheus ``--metrics-port`` (free ports on ``host``; see ``metrics_urls``), and write
    ``<log_dir>/prometheus-targets.json`` (:meth:`LocalCluster.prometheus_targets`)."""
    metrics_host: str = "127.0.0.1"
    """With ``metrics``: the address every service's metrics port (``/metrics``, ``/readyz``; no login) binds, passed
    to each as its ``--metrics-host``; loopback by default whatever ``host`` the router listens on."""
    metrics_base_port: int = 0
    """With ``metrics``: fixed metrics ports, as the Slurm job's: the KV directory on this port, the planner on +1,
    the router on +2, worker ``wN`` on +3+N, and with ``routers`` > 1 router ``router-K`` after the workers, on
    +3+nodes+(K-1); 0 = free ports chosen at start."""
    tokenizer: str = "sim"
    """Router tokenizer (``sim`` | ``hf:<local path>``); the workers draw output ids from its vocabulary."""
    nats_auth: str = "nkeys"
    """Embedded NATS: ``nkeys`` (default) or ``password`` = every service connects as its own
    identity with least-privilege permissions (``shared.auth``; credentials in
    ``<log_dir>/nats-creds``); ``off`` = open server on loopback (any local process may
    publish anything; a warning says so)."""
    nats_creds_dir: str | None = None
    """External NATS (``nats_url``): folder with one credentials file per instance
    (``<instance>.nk`` / ``.creds`` / ``.pass``, as ``evolving-infra auth gen`` writes);
    None = connect without credentials."""
    engine: str = "sim"
    """Worker engine: ``sim`` or ``torch`` (a real model, ``model_dir``)."""
    model_dir: str = ""
    """``torch`` engine: the local Hugging Face model folder every worker loads."""
    worker_args: tuple[str, ...] = ()
    """Extra worker flags (e.g. ``--check-invariants``, ``--kv-pool real``)."""
    node_args: dict[str, tuple[str, ...]] = {}
    """Extra flags of one worker by node id (e.g. its own ``--kv-pool-ports`` range)."""
    max_context_tokens: int = 0
    """Router: refuse (400) prompt + max_tokens above this (the torch model's context); 0 = no limit. The router
    lowers it to what the largest node's GPU KV memory holds (``max_model_len``)."""
    dtype: str = ""
    """``torch`` engine: every worker's ``--dtype`` (float32, bfloat16, float16); empty = the worker's default."""
    placement: tuple[tuple[str, int], ...] = ()
    """``torch`` engine: (``--device``, ``--torch-threads``) of each worker in node order (:func:`worker_placement`;
    an empty device or 0 threads: the flag is not passed); empty = none passed to any."""
    model_vocab_size: int = 0
    """Router ``--model-vocab-size`` (the torch model's vocabulary: prompt and logit_bias ids at or past it get 400);
    0 = the tokenizer's."""
    gpu_kv_tokens: int = 0
    """Every worker's ``--gpu-kv-tokens`` (L1 tokens over the profile's ``memory.gpu_kv_tokens``); 0 = the profile's."""
    host_kv_tokens: int = 0
    """Every worker's ``--host-kv-tokens`` (L2 tokens over the profile's ``memory.host_kv_tokens``); 0 = the profile's."""
    restart: bool = False
    """Supervise: restart a service (or the embedded nats-server) that exits instead of failing."""
    max_restarts: int = 10
    """Restarts of one service (or the embedded nats-server) within ``restart_window_s`` before the cluster gives up
    (systemd's ``StartLimitBurst`` within ``StartLimitIntervalSec``): its exit past that many in the window ends the
    cluster. Every exit counts (a crash, a liveness kill, a clean exit) except a clean exit (code 0: a SIGTERM's
    stop, a rolling restart) after ``stable_s`` of uptime, which is a deliberate stop of a healthy service. Exits are
    counted in the window, not as a streak that resets after ``stable_s`` up (which restarted a service crashing every
    ~61 s forever whatever the limit); with the defaults (10 in 600 s) such a loop, 9 or 10 exits in any 600 s, still
    goes on: from its 5th exit within an hour a "crash loop" warning line names it (:data:`CRASH_LOOP_WARN_AT`); a
    lower ``max_restarts`` (3: the 4th exit within 600 s) gives it up."""
    restart_window_s: float = 600.0
    """The window (wall s) over which ``max_restarts`` counts a service's restarts."""
    restart_backoff_s: float = 0.5
    """First restart delay (wall s) after a crash (an exit status other than 0); doubles per consecutive restart up to
    ``restart_backoff_max_s``. A clean exit (0, a SIGTERM's stop) is restarted at once, and backs off one step behind."""
    restart_backoff_max_s: float = 30.0
    stable_s: float = 60.0
    """Wall seconds of uptime after which a service's backoff streak resets (its next crash waits the first
    ``restart_backoff_s`` again), and after which a clean exit is not counted against ``max_restarts``."""
    liveness_timeout_s: float = 30.0
    """With ``restart``: wall seconds a running service (or the embedded nats-server) may stay silent before the
    supervisor SIGKILLs it and restarts it as after a crash (:func:`liveness_overdue`); 0 = off. A service's sign of
    life is its heartbeat (``svc.heartbeat``, every second, from the event loop that serves it; judged only while
    the launcher's own NATS connection answers a PING); the embedded nats-server's is the ``INFO`` line it sends a
    new TCP connection on its client port. Before its first sign of life after a start a process gets
    ``max(liveness_timeout_s, ready_timeout_s)``."""
    log_requests: bool = False
    """Router's and workers' ``--log-requests``: an info line per request accepted and finished (router), and
    received, handed off, finished or aborted (each worker), with its id."""
    enable_auto_tool_choice: bool = False
    """Router ``--enable-auto-tool-choice`` (vLLM's): serve ``tool_choice`` ``auto`` with ``tool_call_parser``."""
    tool_call_parser: str = ""
    """Router ``--tool-call-parser`` (vLLM's name, ``hermes``); empty = none."""
    trust_request_chat_template: bool = False
    """Router ``--trust-request-chat-template`` (vLLM's): render a request's own ``chat_template``."""
    otlp_traces_endpoint: str = ""
    """Every service's ``--otlp-traces-endpoint`` (OTLP/HTTP collector URL; empty = each process's own
    ``OTEL_EXPORTER_OTLP_*`` environment, inherited from the launcher)."""
    fence_after_s: float = 0.0
    """Router ``--fence-after-s`` and planner ``--silent-after-s`` (wall seconds without a node.state before the
    router fences a node out and the planner counts it dead: one time, so the planner never moves a phase off a
    node the router still routes to); 0 = the services' defaults (3 s both)."""

    def node_ids(self) -> list[str]:
        return [f"w{i}" for i in range(self.nodes)]

    def router_names(self) -> list[str]:
        """The router instances in order: ``router``, ``router-1``, ... (``routers`` of them; the names
        ``evolving_infra.faultkit`` and ``shared.auth.identity`` know)."""
        return router_names(self.routers)

    def holds_router_socket(self) -> bool:
        """Whether the cluster holds the routers' listening socket (:attr:`LocalCluster.router_socket`): with
        ``restart`` (a next router takes the accept queue of one that drains or exits) or several routers (the
        others take it); not for one router under ``--no-restart``, which binds its port itself."""
        return self.restart or self.routers > 1

    def node_profile(self) -> Profile:
        """The profile every worker runs: ``profile`` with ``gpu_kv_tokens`` / ``host_kv_tokens`` applied.

        Raises:
            ProfileError: the profile cannot be loaded or a KV size is invalid (``shared.profile.with_kv_tokens``).
        """
        return with_kv_tokens(load_profile(self.profile), self.gpu_kv_tokens, self.host_kv_tokens)


def is_router(name: str) -> bool:
    """Whether the service instance ``name`` is one of the cluster's routers (``router``, ``router-1``, ...)."""
    return name == "router" or (name.startswith("router-") and name[len("router-"):].isdigit())


PER_SERVICE_ENV = (
    "EI_METRICS_PORT", "EI_METRICS_FD", "EI_LISTEN_FD", "EI_PORT", "EI_PORT_FILE", "EI_INSTANCE", "EI_NODE", "EI_PHASE",
)
"""Variables that configure one process (a port it binds, its identity): never passed from the launcher's
environment to its children, where every service would take the same value (``EI_METRICS_PORT``: the second
one to bind it exited 1, Address already in use, and the cluster stopped). ``up`` refuses ``EI_METRICS_PORT``
itself (``--metrics-base-port`` is what gives fixed ports); ``EI_METRICS_FD`` and ``EI_LISTEN_FD`` name a descriptor
of the shell's process, not the child's (an exported ``EI_LISTEN_FD`` reached a ``--no-restart`` router, which binds
its port itself then, and it exited 2); the others it always sets per service on the command line."""

TARGETS_FILE = "prometheus-targets.json"
"""The Prometheus ``file_sd`` list ``LocalCluster`` writes in its log folder (the Slurm job's name and labels)."""


NATS_CONNECTION_ENV = tuple(
    ENV_PREFIX + name.upper() for name in CommonConfig.__struct_fields__ if name.startswith("nats_") and name != "nats_url"
)
"""How a service connects to its NATS server besides the URL (shared/config.py ``CommonConfig``, shared/auth.py):
``EI_NATS_CREDS``, ``EI_NATS_USER``, ``EI_NATS_PASSWORD``, ``EI_NATS_TLS_CA``, ``EI_NATS_TLS_CERT``,
``EI_NATS_TLS_KEY``. Exported in the shell for another server, they do not belong to the embedded nats-server
``up`` starts (its URL, and its credentials files as ``--nats-creds``, are the cluster's own): a TLS CA path of
another machine made every service exit 1 (``cannot load NATS TLS files``) and ``up`` fail in 10 s, measured.
``LocalCluster`` drops them from its children's environment then; with ``--nats-url`` (an external server) they
are the user's settings for that server and are kept."""


def child_env(
    env: dict[str, str] | None, base: "os._Environ[str] | dict[str, str] | None" = None, unset: tuple[str, ...] = ()
) -> dict[str, str]:
    """The environment of a service process: ``base`` (default: this process's) without :data:`PER_SERVICE_ENV`
    and ``unset`` (e.g. :data:`NATS_CONNECTION_ENV` under an embedded server), with ``env`` (the child's own
    variables, e.g. the router's ``EI_API_KEYS``) set over it."""
    drop = set(PER_SERVICE_ENV) | set(unset)
    out = {k: v for k, v in (os.environ if base is None else base).items() if k not in drop}
    out.update(env or {})
    return out


def _ignoring_sighup(preexec: Callable[[], None] | None) -> Callable[[], None]:
    """A ``preexec_fn`` that runs ``preexec`` and sets SIGHUP to ignored in the child before its exec, which keeps it
    (an ignored signal stays ignored across exec): a router started by the cluster then lives through a SIGHUP that
    comes before its key-reload handler is set (``up``'s SIGUSR1 sends every running router SIGHUP; one restarted a
    moment before was still starting its interpreter and died, status 129, counted as a crash)."""

    def preexec_ignoring() -> None:
        if preexec is not None:
            preexec()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    return preexec_ignoring


@dataclass
class _Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None
    restarts: int = 0
    """Restarts by the supervisor so far."""
    streak: int = 0
    """Consecutive restarts without a stable run in between (drives the backoff)."""
    started_at: float = 0.0
    """``time.monotonic()`` of the last start."""
    restart_at: float | None = None
    """``time.monotonic()`` at which the supervisor starts it again (None: not scheduled)."""
    exits: list[float] = field(default_factory=list)
    """``time.monotonic()`` of each exit counted against ``max_restarts`` (those within ``restart_window_s``)."""
    last_beat: float | None = None
    """``time.monotonic()`` of the latest heartbeat from the running process (its pid); None: none since its start."""
    killed: bool = False
    """The supervisor SIGKILLed the running process (silent too long) and waits, pass by pass, for it to exit."""
    left_down: bool = False
    """A service past ``max_restarts`` within ``restart_window_s`` whose absence serving survives (a worker while
    other workers serve, the planner, the KV directory, a router beside another: ``LocalCluster._absence``): not
    restarted until :attr:`restart_at` (``restart_window_s`` after its last exit); the routers fence a worker
    (``node.down``)."""
    down_effect: str = ""
    """While :attr:`left_down`: what serving does without it ("the split is frozen at 2P2D ...")."""
    down_since: float = 0.0
    """While :attr:`left_down`: ``time.time()`` (unix s) when it was left down (``describe()``'s ``left_down_info``)."""
    env: dict[str, str] | None = None
    """Variables set over the launcher's environment for this process (None: the launcher's as is)."""
    pass_fds: tuple[int, ...] = ()
    """File descriptors the process inherits (the router's listening socket, ``--listen-fd``)."""


SERVICES = ("kvdirectory", "planner", "router", "worker")
"""The services :func:`service_flags` knows."""


def node_phases(spec: ClusterSpec) -> list[str]:
    """Each worker node's ``--phase`` in node order (``spec.node_ids()``): ``both`` for a collocated split, else the
    split's ``x`` prefill nodes first, then its ``y`` decode nodes.

    Raises:
        SplitError: (``shared.split``) a split that is not ``collocated`` or ``xPyD`` with x + y = ``spec.nodes``.
    """
    pd = parse_split(spec.split, spec.nodes)
    return ["both"] * spec.nodes if pd is None else ["prefill"] * pd[0] + ["decode"] * pd[1]


def warms_up_collocated(planner: str, planner_args: Sequence[str]) -> bool:
    """Whether the planner serves every node ``both`` from the start: the evolving planner with a warm-up
    (``t_learn_s`` > 0 in ``planner_args``, ``key=value`` items; default 1,800 s), whose collocated warm-up fits
    each node's iteration-time models before it serves the split (``EvolvingPlanner.start_phases``; the simulator
    starts it so too). False for ``static``, ``dynamo``, ``arrow`` and ``t_learn_s=0``.

    Raises:
        ValueError: ``planner_args`` the evolving planner refuses (an unknown key, a bad value).
    """
    if planner != "evolving":
        return False
    from services.planner.evolving import EvolvingParams
    from services.planner.policy import params_from, parse_planner_args

    return bool(params_from(EvolvingParams, parse_planner_args(list(planner_args)), "evolving").t_learn_s > 0)


def launch_phases(spec: ClusterSpec) -> list[str]:
    """Each worker's ``--phase`` at launch in node order: ``both`` for every node when the planner begins with a
    collocated warm-up (:func:`warms_up_collocated`: the evolving planner's first command is then every node
    ``both``, ``PlannerCore._fresh_start``), else :func:`node_phases` (the split's). ``spec.split`` stays the split
    the planner serves after the warm-up (READY's ``split`` and ``split_after_warmup``). Before (session 59), the
    workers started in 2P2D and the planner's first tick switched them all to ``both``: the demo's split timeline
    began ``[0.0, "2P2D"]`` and half its node phase switches were that flip.

    Raises:
        SplitError: as :func:`node_phases`; ValueError: as :func:`warms_up_collocated`.
    """
    phases = node_phases(spec)
    return ["both"] * spec.nodes if warms_up_collocated(spec.planner, spec.planner_args) else phases


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "EI_TORCH_THREADS")
"""Variables that set a worker's torch intra-op threads when inherited (torch reads the first two at import, the
worker its ``--torch-threads`` from the last): with one set, :func:`worker_placement` leaves the count to it."""


def worker_placement(
    nodes: int, device: str, *, cuda_count: int, cores: int, torch_threads: int = 0, env: Mapping[str, str] | None = None
) -> list[tuple[str, int]]:
    """Where each of ``nodes`` torch workers runs and with how many intra-op CPU threads (sans-IO: the counts are
    given). A worker's torch defaulted to ``cuda`` (device 0) whenever CUDA is present, so ``up --nodes 4`` on a
    4-GPU box put every worker on one GPU; and on CPU each worker's torch used a thread per core, so workers
    competed for every core.

    Devices: no ``device`` or plain ``cuda`` with CUDA present: worker i gets ``cuda:{i % cuda_count}`` (round
    robin over the visible devices; ``CUDA_VISIBLE_DEVICES`` picks them); no ``device`` without CUDA, or ``cpu``:
    ``cpu``; ``cuda:N``: that device for every worker. Threads: ``torch_threads`` when given (every worker);
    else, when one of :data:`THREAD_ENV` is set in ``env``, 0 (the workers inherit it); else each CPU worker
    ``max(1, cores // (CPU workers))`` and a CUDA worker 0 (torch's default).

    Args:
        nodes: workers (>= 1).
        device: ``up --device``: ``""``, ``cpu``, ``cuda`` or ``cuda:N``.
        cuda_count: CUDA devices visible (``torch.cuda.device_count()``; 0 without CUDA).
        cores: CPU cores this process may use (``len(os.sched_getaffinity(0))``).
        torch_threads: ``up --torch-threads``; 0 = choose.
        env: the environment the workers inherit (default ``os.environ``).

    Returns:
        ``(device, threads)`` per worker in node order; threads 0 = not set.

    Raises:
        ValueError: a device that is not cpu / cuda / cuda:N, CUDA asked for but none visible, ``cuda:N`` beyond the
            visible devices, or negative threads.
    """
    env = os.environ if env is None else env
    if torch_threads < 0:
        raise ValueError(f"--torch-threads {torch_threads}: must be >= 0 (0 = one share of the cores per CPU worker)")
    kind, _, index = device.partition(":")
    if kind not in ("", "cpu", "cuda") or (kind != "cuda" and index) or (index and not index.isdigit()) or device.endswith(":"):
        raise ValueError(f"--device {device!r}: cpu, cuda or cuda:N")
    if kind == "cuda" and cuda_count < 1:
        raise ValueError(f"--device {device}: no CUDA device is visible (torch.cuda.device_count() is 0); use --device cpu")
    if index and int(index) >= cuda_count:
        raise ValueError(f"--device {device}: {cuda_count} CUDA device(s) visible (cuda:0 to cuda:{cuda_count - 1})")
    if index or kind == "cpu":
        devices = [device] * nodes
    elif cuda_count > 0:
        devices = [f"cuda:{i % cuda_count}" for i in range(nodes)]
    else:
        devices = ["cpu"] * nodes
    on_cpu = devices.count("cpu")
    if torch_threads:
        return [(d, torch_threads) for d in devices]
    if any(env.get(k) for k in THREAD_ENV):
        return [(d, 0) for d in devices]
    share = max(1, cores // on_cpu) if on_cpu else 0
    return [(d, share if d == "cpu" else 0) for d in devices]


def service_flags(spec: ClusterSpec, service: str) -> list[str]:
    """The flags of ``service`` that say which serving system and engine the cluster runs: its policy set's part
    (router ``--routing``/``--decode-binding``/``--decode-routing``/routing options, planner ``--planner``/``--planner-args``/``--split``,
    workers ``--host-eviction``), the KV directory's ``--routers`` (the routers it waits for after a restart), the
    profile (and the workers' KV sizes over it; for the torch engine the router's and planner's ``--profile-clock
    wall``, as the workers read it from ``--engine``), block size, tokenizer, served model name,
    the tool-call flags (``--enable-auto-tool-choice``, ``--tool-call-parser``), ``--trust-request-chat-template``, for the torch engine
    the model folder, dtype, context limit and vocabulary size, the liveness
    time (the router's ``--fence-after-s`` and the planner's ``--silent-after-s``, one value), and the
    observability flags (every service's ``--otlp-traces-endpoint``, the router's and workers' ``--log-requests``).
    ``up`` (:class:`LocalCluster`) and the deploy scripts (``evolving-infra deploy-args``: compose's entrypoint,
    the Slurm batch script) start each service with these, so that all three run one system for one ``--policy``;
    each adds its own addresses, ports, identity and credentials.

    Args:
        spec: the cluster (``evolving_infra.launcher._spec`` makes it from ``up``'s flags).
        service: one of :data:`SERVICES`.

    Returns:
        argv items, e.g. ``["--planner", "evolving", "--split", "2P2D", "--profile", "gb300-glm52"]``.

    Raises:
        ValueError: an unknown ``service``.
    """
    s = spec
    # observability: every service's trace exporter, the router's and workers' request log (they were added by
    # LocalCluster only, so deploy-args, and with it compose and Slurm, could not give them)
    traces = ["--otlp-traces-endpoint", s.otlp_traces_endpoint] if s.otlp_traces_endpoint else []
    requests = ["--log-requests"] if s.log_requests else []
    if service == "kvdirectory":
        # --routers: the routers whose republish a (re)started directory waits for (services/kvdirectory/settle.py);
        # compose and Slurm run one, `router` (deploy-args refuses another --routers), up and demo N
        return ["--block-size", str(s.block_size), "--routers", ",".join(s.router_names())] + traces
    # a real engine's profile holds wall seconds measured at speed-up 1: the router and planner put it on the cluster
    # clock (x --speedup) as each torch worker does (shared.profile.on_cluster_clock); a sim profile is simulated time
    clock = ["--profile-clock", "wall"] if s.engine == "torch" else []
    if service == "planner":
        return (["--nodes", ",".join(s.node_ids()), "--split", s.split, "--planner", s.planner, "--profile", s.profile]
                + clock
                + (["--planner-args", ",".join(s.planner_args)] if s.planner_args else [])
                + (["--silent-after-s", repr(s.fence_after_s)] if s.fence_after_s > 0 else []) + traces)
    if service == "worker":
        return (["--profile", s.profile, "--tokenizer", s.tokenizer, "--host-eviction", s.eviction]
                + (["--gpu-kv-tokens", str(s.gpu_kv_tokens)] if s.gpu_kv_tokens else [])
                + (["--host-kv-tokens", str(s.host_kv_tokens)] if s.host_kv_tokens else [])
                + (["--engine", s.engine, "--model", s.model_dir] if s.engine != "sim" else [])
                + (["--dtype", s.dtype] if s.dtype else []) + traces + requests)
    if service == "router":
        return (["--routing", s.routing, "--decode-binding", s.decode_binding, "--decode-routing", s.decode_routing,
                 "--profile", s.profile, "--block-size",
                 str(s.block_size), "--model", s.model, "--tokenizer", s.tokenizer]
                + clock
                + (["--model-names", ",".join(s.model_names)] if s.model_names else [])
                + (["--model-aliases", ",".join(s.model_aliases)] if s.model_aliases else [])
                + (["--max-context-tokens", str(s.max_context_tokens)] if s.max_context_tokens else [])
                + (["--model-vocab-size", str(s.model_vocab_size)] if s.model_vocab_size else [])
                + (["--fence-after-s", repr(s.fence_after_s)] if s.fence_after_s > 0 else [])
                + (["--enable-auto-tool-choice"] if s.enable_auto_tool_choice else [])
                + (["--tool-call-parser", s.tool_call_parser] if s.tool_call_parser else [])
                + (["--trust-request-chat-template"] if s.trust_request_chat_template else [])
                + list(s.router_args) + traces + requests)
    raise ValueError(f"unknown service {service!r}; known: {', '.join(SERVICES)}")


CRASH_LOOP_WINDOW_S = 3600.0
"""The hour over which :meth:`LocalCluster.supervise_once` counts a service's exits for its crash-loop warning."""

CRASH_LOOP_WARN_AT = 5
"""Exits of one service (or nats-server) within :data:`CRASH_LOOP_WINDOW_S` from which a "crash loop" warning line is
logged (again every :data:`CRASH_LOOP_WARN_EVERY_S` while it lasts): a loop too slow for ``max_restarts`` within
``restart_window_s`` to give up is still seen in ``up``'s output."""

CRASH_LOOP_WARN_EVERY_S = 600.0
"""Wall seconds between two crash-loop warning lines of one service."""


def restart_delay(streak: int, base_s: float, max_s: float) -> float:
    """Backoff before the ``streak``-th consecutive restart (1-based): ``min(max_s, base_s * 2**(streak-1))`` seconds."""
    return min(max_s, base_s * (2.0 ** max(0, streak - 1)))


@dataclass
class LocalCluster:
    """Start/stop a whole cluster on this machine.

    Usage::

        async with LocalCluster(ClusterSpec(nodes=4, split="2P2D", speedup=50)) as c:
            print(c.router_url)
    """

    spec: ClusterSpec
    clock_origin: float = 0.0
    nats: EmbeddedNatsServer | None = None
    nats_url: str = ""
    router_url: str = ""
    """Where a client on this machine reaches the router once ready (a wildcard ``host`` given as the loopback:
    :func:`reachable_host`); ``router_listen`` in :meth:`describe` is the address it is bound to."""
    router_port: int = 0
    """The router's bound port once ready (``port`` 0: the one the kernel chose)."""
    log_dir: Path = field(default_factory=Path)
    children: list[_Child] = field(default_factory=list)
    recorder: TimelineRecorder | None = None
    """Collects ``split.applied`` events into the run's PD-split timeline."""
    planner_warmup_end: float | None = None
    """When the planner's warm-up ends as it announced it (``metrics.warmup_end`` of its latest decision on
    ``planner.decisions`` that carries one: simulated s from the cluster's start, :attr:`clock_origin`); None until
    then (a planner without a warm-up never announces one). Read it with :meth:`announced_warmup_end`."""
    _warmup_announced: asyncio.Event = field(default_factory=asyncio.Event)
    metrics_urls: dict[str, str] = field(default_factory=dict)
    """instance (``router``, ``planner``, ``kvdirectory``, ``worker-w0`` ...) → its ``/metrics`` URL (``spec.metrics``)."""
    metrics_sockets: dict[str, socket.socket] = field(default_factory=dict)
    """instance → its metrics port's listening socket (``spec.metrics``), held from the plan to the stop and passed to
    every run of the service (``--metrics-fd``)."""
    nats_restarts: int = 0
    """Times the supervisor restarted the embedded nats-server."""
    on_restart: object = None
    """Optional ``callable(name: str) -> None`` called after the supervisor restarted a service; an exception it
    raises is logged (a warning) and supervision goes on."""
    on_down: object = None
    """Optional ``callable(name: str) -> None`` called when the supervisor leaves a crash-looping worker down
    (:meth:`_leave_down`); an exception it raises is logged (a warning) and supervision goes on."""
    _bus: Bus | None = None
    _downs: list[m.NodeDown] = field(default_factory=list)
    """Worker exits seen by the latest supervision pass, to be announced on ``node.down.<node>``
    (:meth:`_announce_downs`)."""
    creds: Credentials | None = None
    """Credentials generated for the embedded server (None when it runs open or NATS is external)."""
    router_socket: socket.socket | None = None
    """The router's listening socket, held by the cluster from its start until its stop and passed to every router process
    (``--listen-fd``): the port stays open while a router drains, exits and is restarted, so a client connecting
    meanwhile waits in its accept queue and is served by the next router. Before, it was refused for the whole gap
    (SIGTERM of the only router under load: 16-20 of 67 requests lost, the 2-6 s gap outlasting the OpenAI SDK's
    retries). With ``spec.routers`` > 1 every router serves on it (each its own ``--listen-fd`` copy): a router that
    drains or exits closes only its copy, and the others accept what comes meanwhile. None with one router and
    without ``spec.restart`` (``--no-restart``): no next router would take that queue (a client connecting during
    the drain waited it out and was then reset), so the router binds its port itself and answers such a client 503
    "router draining" at once. ``--no-restart`` with several routers holds it: the other routers take that queue
    while one drains (the cluster still stops when any service exits)."""
    made_log_dir: bool = False
    """``log_dir`` is a temporary folder (``ei-logs-*``) this cluster made, ``spec.log_dir`` being unset."""
    _log_lock: int | None = None
    """The descriptor holding ``log_dir``'s lock (``out_folder.lock_folder``) from the start to the end of :meth:`stop`;
    None before, after, and on a file system without ``flock``."""
    _log_dir_ours: bool = False
    """This cluster took ``log_dir`` (held it, or its file system gives no lock): :meth:`stop` may write its files.
    False when another cluster's lock refused it: its ``prometheus-targets.json`` is that cluster's."""
    _wrote_targets: bool = False
    """:meth:`write_targets` wrote this cluster's list: :meth:`stop` empties it (a refused cluster never wrote one,
    so it leaves the holder's alone)."""
    _supervisor: asyncio.Task[None] | None = None
    _failure: ClusterError | None = None
    _nats_restart_at: float | None = None
    _nats_streak: int = 0
    _nats_started: float = 0.0
    _nats_exits: list[float] = field(default_factory=list)
    _nats_last_ok: float | None = None
    """``time.monotonic()`` of nats-server's latest answered liveness probe (:func:`nats_info_probe`)."""
    _nats_tried_at: float | None = None
    """``time.monotonic()`` at the start of nats-server's latest liveness probe that has come to an end (answered or
    not): its silence is judged only up to then, never up to a moment no probe had the time to look at."""
    _nats_watch_from: float = 0.0
    """Since when nats-server's liveness has been watched without a gap (its start, or the end of a supervision gap)."""
    _nats_killed: bool = False
    """The supervisor SIGKILLed the running nats-server (silent too long) and waits, pass by pass, for it to exit."""
    _last_pass: float | None = None
    """When the previous :meth:`supervise_once` ended (its ``now`` plus the time it spent restarting nats-server): a
    longer gap than :data:`SUPERVISE_GAP_S` to the next one's ``now`` is a pause of the supervisor."""
    _late: bool = False
    """The previous pass came more than :data:`SUPERVISE_GAP_S` after the one before it."""
    _hour_exits: dict[str, list[float]] = field(default_factory=dict)
    """Service (or ``nats-server``) -> times of its exits counted within :data:`CRASH_LOOP_WINDOW_S`."""
    _loop_warned: dict[str, float] = field(default_factory=dict)
    """Service (or ``nats-server``) -> when its latest crash-loop warning line was logged."""
    _bus_last_ok: float | None = None
    """``time.monotonic()`` of the latest PING the launcher's NATS connection had answered."""
    _bus_ok_since: float | None = None
    """Since when the launcher's NATS connection has answered without a gap (the services' beats can be seen); None: not now."""
    _prober: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "LocalCluster":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ #

    def _common(self, instance: str) -> list[str]:
        s = self.spec
        extra: list[str] = []
        if s.metrics:
            # fixed ports in the Slurm job's order (kvdirectory, planner, router, w0, w1, ...), else free ones; bound and
            # listening here, held until the stop and passed to the service (--metrics-fd): a free port the service bound
            # itself moments later could be taken in between (it then exited 1 at its start and at every restart)
            port = s.metrics_base_port + self._metrics_index(instance) if s.metrics_base_port else 0
            try:
                held = listen_socket(s.metrics_host, port, backlog=128)
            except OSError as e:
                raise ClusterError(f"{instance}: cannot listen for metrics on {s.metrics_host}:{port}: {e.strerror or e}") from e
            self.metrics_sockets[instance] = held
            port = held.getsockname()[1]
            self.metrics_urls[instance] = http_url(reachable_host(s.metrics_host), port) + "/metrics"
            extra = ["--metrics-port", str(port), "--metrics-host", s.metrics_host, "--metrics-fd", str(held.fileno())]
        return extra + [  # no --nats-url: the URL goes through the environment (_wire_children)
            "--partition",
            s.partition,
            "--instance",
            instance,
            "--speedup",
            repr(s.speedup),
            "--clock-origin",
            repr(self.clock_origin),
            "--log-level",
            s.log_level,
            "--log-format",
            "json",
        ]

    def _metrics_index(self, instance: str) -> int:
        """Offset of ``instance``'s metrics port from ``metrics_base_port`` (the Slurm job's layout: the KV directory
        0, the planner 1, the router 2, worker ``wN`` 3+N; then the other routers, ``router-K`` at 3+nodes+(K-1))."""
        fixed = {"kvdirectory": 0, "planner": 1, "router": 2}
        if instance in fixed:
            return fixed[instance]
        if is_router(instance):
            return 3 + self.spec.nodes + self.spec.router_names().index(instance) - 1
        return 3 + self.spec.node_ids().index(instance.removeprefix("worker-"))

    def prometheus_targets(self) -> list[dict[str, object]]:
        """The services' metrics ports as a Prometheus ``file_sd`` list, with the Slurm job's labels: ``service``,
        and ``node`` for a worker (``deploy/slurm/evolving-infra.sbatch``); with several routers each is ``service``
        ``router`` with its instance as ``router`` (``router``, ``router-1``, ...); empty without ``metrics``. A wildcard
        ``host`` (0.0.0.0, ::) is listed as this machine's host name, which a Prometheus elsewhere can reach."""
        out: list[dict[str, object]] = []
        for instance, url in self.metrics_urls.items():
            hostport = url.removeprefix("http://").removesuffix("/metrics")
            host, port = hostport.rsplit(":", 1)
            if self.spec.metrics_host in WILDCARD_HOSTS:  # the URL gives the loopback (reachable_host): not for elsewhere
                host = socket.gethostname()
            if instance.startswith("worker-"):
                labels = {"service": "worker", "node": instance.removeprefix("worker-")}
            elif is_router(instance) and self.spec.routers > 1:
                labels = {"service": "router", "router": instance}
            else:
                labels = {"service": instance}
            out.append({"targets": [f"{host}:{port}"], "labels": labels})
        return out

    def write_targets(self, *, empty: bool = False) -> Path | None:
        """Write ``<log_dir>/prometheus-targets.json`` (atomically): :meth:`prometheus_targets`, or ``[]`` with
        ``empty`` (a stopped cluster: a ``file_sd`` glob over log folders stops scraping it, as the Slurm job's
        list is emptied when it stops). Nothing without ``metrics`` (None). An unwritable folder is a warning."""
        if not self.spec.metrics or not self.metrics_urls:
            return None
        path = self.log_dir / TARGETS_FILE
        try:
            write_json(path, [] if empty else self.prometheus_targets())
        except OSError as e:
            log.warning("cannot write the Prometheus targets file", path=str(path), error=str(e))
            return None
        self._wrote_targets = True
        return path

    def _plan_children(self) -> list[_Child]:
        s = self.spec
        nodes = s.node_ids()
        py = [sys.executable, "-m"]
        kids = [
            _Child(
                "kvdirectory",
                py + ["services.kvdirectory"] + self._common("kvdirectory") + service_flags(s, "kvdirectory")
                + ["--nodes", ",".join(nodes)],
                self.log_dir / "kvdirectory.log",
            ),
            _Child("planner", py + ["services.planner"] + self._common("planner") + service_flags(s, "planner"), self.log_dir / "planner.log"),
        ]
        placement = dict(zip(nodes, s.placement))
        for node, phase in zip(nodes, launch_phases(s)):
            device, threads = placement.get(node, ("", 0))
            kids.append(
                _Child(
                    f"worker-{node}",
                    py
                    + ["services.worker"]
                    + self._common(f"worker-{node}")
                    + ["--node", node, "--phase", phase, "--stream-interval", str(s.stream_interval)]
                    + service_flags(s, "worker")
                    + (["--device", device] if device else [])
                    + (["--torch-threads", str(threads)] if threads else [])
                    + list(s.worker_args)
                    + list(s.node_args.get(node, ())),
                    self.log_dir / f"worker-{node}.log",
                )
            )
        self._port_file = self.log_dir / "router.port"
        held = self.router_socket  # set by start(): the routers serve on the socket the cluster holds
        port, fds = (held.getsockname()[1], (held.fileno(),)) if held is not None else (s.port, ())
        for name in s.router_names():  # each writes its own port file once its HTTP server runs (_wait_ready reads them)
            kids.append(
                _Child(
                    name,
                    py
                    + ["services.router"]
                    + self._common(name)
                    + ["--host", s.host, "--port", str(port)]
                    + [a for fd in fds for a in ("--listen-fd", str(fd))]
                    + ["--port-file", str(self.log_dir / f"{name}.port")]
                    + service_flags(s, "router"),
                    self.log_dir / f"{name}.log",
                    env=dict(s.router_env) or None,
                    pass_fds=fds,
                )
            )
        for kid in kids:  # each service inherits its metrics socket (--metrics-fd)
            if (held := self.metrics_sockets.get(_flag(kid.argv, "--instance"))) is not None:
                kid.pass_fds = (*kid.pass_fds, held.fileno())
        return kids

    def _wire_children(self) -> None:
        """Point every planned child at ``nats_url`` and give it its credentials file (``--nats-creds``).

        The URL goes in the child's environment (``EI_NATS_URL``, which every service reads, shared/config.py),
        not on its command line: a URL may carry a password (``up --nats-url nats://user:pass@host``), and a
        command line is in every local user's ``ps``; the environment (``/proc/<pid>/environ``) only the owner
        reads. A restart reuses ``env`` and ``argv``, so a restarted service connects the same way.

        Under the embedded server (no ``spec.nats_url``) :meth:`_spawn` drops the launcher's
        :data:`NATS_CONNECTION_ENV` (another server's credentials or TLS files, left exported in the shell): the
        server ``up`` runs is reached with its URL and the ``--nats-creds`` it generated, nothing else. With ``spec.nats_url`` those
        variables are how the user reaches that server (TLS files, a user and password) and are inherited."""
        for c in self.children:
            c.env = {**(c.env or {}), "EI_NATS_URL": self.nats_url}
            path = self.creds_file(_flag(c.argv, "--instance"))
            if path:
                c.argv += ["--nats-creds", path]

    async def start(self) -> None:
        """Start NATS (unless external), then every service; wait until all are healthy.

        On any failure or cancellation on the way, what was started (NATS included) is stopped.

        Raises:
            ClusterError: if a service exits early (with code 0 too: "start-up failed: ...", with its log's tail)
                or is not healthy within ``ready_timeout_s``; the
                launcher's NATS connection is refused or its ``--nats-url`` is unusable (an empty server
                in the list). :class:`ClusterConfigError` when the server refuses the launcher's credentials
                the JetStream stream (its lookup or create: ``--nats-url`` with an identity not granted it).
                A ClusterError naming what it lacks and the fix when the stream found there lacks some reliable
                subjects (``shared.bus.StreamLacksSubjects``: another version's), before any service starts.
        """
        try:
            await self._start()
        except ServiceStopped as e:  # exited 0 before the cluster was ready: a failed start, not a stop (its log says why)
            await self.stop()
            raise ClusterError(f"start-up failed: {e.service} exited with code 0 before the cluster was ready; "
                               f"log {e.log_path}:\n{e.log_tail}") from e
        except BaseException:
            await self.stop()
            raise

    def _hold_log_dir(self) -> None:
        """Hold ``log_dir`` for this cluster's life (``out_folder.lock_folder``, released at the end of :meth:`stop`):
        a second cluster given the same folder (a second ``up --log-dir D``, a ``demo --log-dir D``) overwrote the
        first's NATS credentials, ``cluster.json``, ``router.port`` and ``prometheus-targets.json``; the first's
        restarted services and ``split``/``tap`` were then refused by its nats-server. A file system without
        ``flock`` holds nothing (a warning): the start goes on, as before.

        Raises:
            ClusterConfigError: another process holds it (its pid and the folder named): ``up`` exits 2.
            ClusterError: its lock file cannot be made.
        """
        from evolving_infra.out_folder import NoFlockError, OutFolderError, lock_folder

        try:
            self._log_lock = lock_folder(self.log_dir)
        except NoFlockError as e:
            log.warning("log folder not locked: a second cluster given it would not be refused", error=str(e))
        except OutFolderError as e:
            raise ClusterConfigError(f"--log-dir {self.log_dir} is in use: {e.reason}; a second cluster there would "
                                     "overwrite its NATS credentials and state files: stop it, or choose another --log-dir") from None
        except OSError as e:
            raise ClusterError(f"cannot lock --log-dir {self.log_dir}: {e.strerror or e}") from e
        self._log_dir_ours = True

    def _release_log_dir(self) -> None:
        """Release :meth:`_hold_log_dir`'s lock (if held). Raises nothing."""
        from evolving_infra.out_folder import unlock_folder

        if self._log_lock is not None:
            unlock_folder(self.log_dir, self._log_lock)
            self._log_lock = None

    async def _start(self) -> None:
        s = self.spec
        parse_split(s.split, s.nodes)  # fail fast on a bad split
        self.made_log_dir = not s.log_dir
        self.log_dir = Path(s.log_dir) if s.log_dir else Path(tempfile.mkdtemp(prefix="ei-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._hold_log_dir()
        self.clock_origin = time.time()
        self.nats_url = s.nats_url or ""
        if s.routers < 1:  # fail fast: no router, nothing serves
            raise ClusterError(f"routers {s.routers}: a cluster needs at least one router")
        # held for the next router, and for the other routers while one drains; one router without restarts binds its own
        if s.holds_router_socket():
            try:
                self.router_socket = listen_socket(s.host, s.port)
            except OSError as e:
                raise ClusterError(f"the router cannot listen on {s.host}:{s.port}: {e.strerror or e}") from e
        self.children = self._plan_children()
        instances = [_flag(c.argv, "--instance") for c in self.children]
        if s.nats_url and s.nats_creds_dir and self.creds_file("router") is not None:
            # routers beyond the first need their own identities (auth gen's default makes `router` only): without a
            # file one would connect with none, be refused by the server, and up wait out --ready-timeout for it
            if missing := [name for name in s.router_names() if self.creds_file(name) is None]:
                raise ClusterConfigError(
                    f"--nats-creds-dir {s.nats_creds_dir} has no credentials for {', '.join(missing)} (--routers {s.routers}): "
                    f"make them with `evolving-infra auth gen --routers {','.join(s.router_names())} ...`")
        if s.nats_url:
            self.creds = None
        elif s.nats_auth == "off":
            log.warning("embedded NATS runs OPEN on loopback: any local process may publish and read every subject (nats_auth=off)")
        else:
            if s.nats_auth not in ("nkeys", "password"):
                raise ClusterError(f"nats_auth must be nkeys, password or off, not {s.nats_auth!r}")
            self.creds = generate(self.log_dir / "nats-creds", instances, partition=s.partition, mode=s.nats_auth)  # type: ignore[arg-type]
        if not s.nats_url:
            # its own log (failed logins, permission violations) and config (whose key is whose) are kept beside the services'
            self.nats = EmbeddedNatsServer(auth_block=self.creds.server_block if self.creds else "", log_dir=self.log_dir,
                                           max_payload=s.nats_max_payload or MAX_PAYLOAD_BYTES).start()  # fmt: skip
            self.nats_url = self.nats.url
            if self.creds:
                log.info("embedded NATS with per-service credentials", mode=s.nats_auth, creds=str(self.creds.directory))
        self._wire_children()
        # the launcher gives up on NATS after ready_timeout_s (each of the connect and the stream); the services keep
        # retrying (supervised: compose, Slurm; their /readyz says why), Bus.connect and ensure_stream wait forever
        wait_s = s.ready_timeout_s
        try:
            self._bus = await asyncio.wait_for(Bus.connect(
                self.nats_url, Subjects(s.partition), service="launcher", instance="launcher", auth=self.client_auth("launcher")
            ), wait_s)  # fmt: skip
        except (AuthError, BusError) as e:  # a bad --nats-url list, refused credentials: one line, not a traceback
            raise ClusterError(f"cannot connect to NATS: {e}") from e
        except asyncio.TimeoutError as e:  # nothing listens there (Bus.connect retries forever): a wrong --nats-url
            raise (ClusterConfigError if s.nats_url else ClusterError)(
                f"no NATS server answered at {redact_url(self.nats_url)} within {wait_s:g} s (--ready-timeout): "
                + ("start it, or give --nats-url the address it listens on" if s.nats_url else "the embedded nats-server is not serving")
            ) from e
        try:  # the JetStream stream of must-arrive subjects (shared.bus), before any service; nobody else makes it
            await asyncio.wait_for(self._bus.ensure_stream(maker=True), wait_s)
        except PermissionDenied as e:  # the server refuses these credentials the stream: waiting cannot help
            raise ClusterConfigError(f"{e}") from e
        except StreamLacksSubjects as e:  # another version's stream there: its services would wait 600 s for output
            raise ClusterError(str(e).replace("--nats-url URL", f"--nats-url {redact_url(self.nats_url)}")) from e
        except asyncio.TimeoutError as e:  # a loaded or hung server: the lookup gets no answer, or the create fails
            raise ClusterError(self._stream_timeout(wait_s)) from e
        seen: dict[str, m.Heartbeat] = {}

        async def on_beat(hb: m.Heartbeat, _subject: str) -> None:
            seen[hb.instance] = hb
            self._on_beat(hb, time.monotonic())

        await self._bus.subscribe(SVC_HEARTBEAT, on_beat)
        self.recorder = TimelineRecorder(self.launched_phases(), t0=0.0)

        async def on_applied(msg: m.SplitApplied, _subject: str) -> None:
            assert self.recorder is not None
            self.recorder.on_applied(msg)

        await self._bus.subscribe(SPLIT_APPLIED, on_applied)
        # before any service starts: the planner's first warm-up decision (up's READY waits for it) is not missed
        await self._bus.subscribe(PLANNER_DECISIONS, self._on_decision)
        for child in self.children:
            self._spawn(child)
        await self._wait_ready(seen)
        self.write_targets()
        if s.restart:
            self._nats_started = time.monotonic()  # the liveness clock of the server started above (answered by now)
            self._supervisor = asyncio.create_task(self._supervise(), name="cluster-supervisor")
            if s.liveness_timeout_s > 0:
                self._prober = asyncio.create_task(self._probe(), name="cluster-liveness-probe")

    async def _on_decision(self, d: m.PlannerDecision, _subject: str) -> None:
        """Keep the warm-up end a planner decision announces (``metrics.warmup_end``, simulated s); a decision
        without one, or with a value that is not a finite number >= 0, changes nothing (the latter counted in
        ``bad_warmup_end`` of the bus's counters). Raises nothing."""
        end = d.metrics.get("warmup_end")
        if end is None:
            return
        if not (isinstance(end, (int, float)) and math.isfinite(end) and end >= 0):
            if self._bus is not None:
                self._bus.counters["bad_warmup_end"] += 1
            return
        self.planner_warmup_end = float(end)
        self._warmup_announced.set()

    async def announced_warmup_end(self, timeout_s: float) -> float | None:
        """The planner's warm-up end as it announced it (:attr:`planner_warmup_end`: simulated s from the cluster's
        start), waiting at most ``timeout_s`` wall s for its first announcement. The planner announces it at its
        first tick, when its start-up adoption ends (up to ``--adopt-grace-s``, 3 wall s, after it started: 150
        simulated s at ``--speedup 50``, which moves the end a slice or two past :func:`warmup_end_s`'s estimate).
        None when nothing was announced in that time (another planner, no warm-up, a planner still adopting).
        Raises nothing (a timeout is the None)."""
        if self.planner_warmup_end is None and timeout_s > 0:
            try:
                await asyncio.wait_for(self._warmup_announced.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.planner_warmup_end

    def cluster_time(self) -> float:
        """Now on the cluster clock: simulated s since :attr:`clock_origin` (wall s x ``spec.speedup``); 0 before
        the start. Raises nothing."""
        return max(0.0, time.time() - self.clock_origin) * self.spec.speedup if self.clock_origin else 0.0

    def _on_beat(self, hb: m.Heartbeat, now: float) -> None:
        """Note a heartbeat at ``now`` (monotonic) as a sign of life of the service's running process (its pid; a
        beat of a process that was replaced, still in flight, is not one)."""
        for c in self.children:
            if c.name == hb.instance and c.proc is not None and c.proc.pid == hb.pid:
                c.last_beat = now

    async def _probe(self, interval_s: float = 1.0) -> None:
        """Every ``interval_s``: probe the embedded nats-server (:func:`nats_info_probe`) and PING it through the
        launcher's own connection (a round trip, at most :data:`NATS_PROBE_TIMEOUT_S`); note when each answered,
        for :meth:`supervise_once`'s liveness decisions. The PING's round is the Slurm watcher's too
        (:class:`BusProbe`): never cancelled while nats-py holds it; a deaf launcher client (its read loop or flusher
        ended) is made to reconnect at once, and the services' clocks start again at its next answer (the beats it
        did not read are no silence of theirs)."""
        probe = BusProbe()
        try:
            while True:
                if self.nats is not None and self.nats.alive() and self.nats.port is not None:
                    tried = time.monotonic()
                    if await nats_info_probe(self.nats.port):
                        self._nats_last_ok = time.monotonic()
                    self._nats_tried_at = tried
                if self._bus is not None:
                    got = await probe.round(self._bus)
                    if got == ANSWERED:
                        self._bus_last_ok = time.monotonic()
                    elif got == DEAF:  # reconnected now: the beats it did not read are no silence of the services
                        self._bus_last_ok = self._bus_ok_since = None
                await asyncio.sleep(interval_s)
        finally:
            probe.close()

    def _spawn(self, child: _Child) -> None:
        if child.log_file is None:
            child.log_file = open(child.log_path, "ab")
        child.proc = subprocess.Popen(
            child.argv,
            stdin=subprocess.DEVNULL,
            # under the embedded server, another server's connection settings are not inherited (_wire_children)
            env=child_env(child.env, unset=() if self.spec.nats_url else NATS_CONNECTION_ENV),
            stdout=child.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_ignoring_sighup(die_with_parent()) if is_router(child.name) else die_with_parent(),
            pass_fds=child.pass_fds,
        )
        child.started_at = time.monotonic()
        child.restart_at = None
        child.last_beat = None
        child.killed = False

    def _log_tail(self, child: _Child, chars: int = 1500) -> str:
        """The end of ``child``'s log, at most ``chars`` characters, from the first whole line in them (a last line
        longer than that: its end, cut); "" when the log cannot be read."""
        try:
            text = child.log_path.read_text(errors="replace")
        except OSError:
            return ""
        tail = text[-chars:]
        if len(text) > chars and text[-chars - 1] != "\n":  # cut inside a line: start at the next one
            nl = tail.find("\n")
            if 0 <= nl < len(tail) - 1:
                tail = tail[nl + 1 :]
        return tail

    def supervise_once(self, now: float | None = None) -> list[str]:
        """One supervision pass: SIGKILL a running process that has been silent too long (``liveness_timeout_s``,
        :func:`liveness_overdue`; one warning line naming it, its pid and its silence), schedule restarts of exited
        services (a killed one included, in a later pass: counted and backed off as any crash), start those that are due.

        Nothing here waits: a killed process is reaped by a later pass (it was blocking ``up``'s event loop up to 5 s).
        A pass more than :data:`SUPERVISE_GAP_S` after the previous one (the supervisor itself was not running) starts
        every liveness clock again. nats-server's silence is counted only up to the start of its latest probe that came
        to an end (:meth:`_probe`), the services' only up to the latest PING the launcher's own connection had answered.
        A service's exit that counts against ``max_restarts`` (not a clean exit after ``stable_s`` up) also counts
        within :data:`CRASH_LOOP_WINDOW_S`: from :data:`CRASH_LOOP_WARN_AT` such exits on, a "crash loop" warning line
        (again every :data:`CRASH_LOOP_WARN_EVERY_S`) names it, a loop too slow to give up included.

        Args:
            now: ``time.monotonic()`` (defaults to the current one).

        Returns:
            Names of what was (re)started in this pass (``nats-server`` for the bus).

        Raises:
            ClusterError: a service (or nats-server) exited more than ``max_restarts`` times within
                ``restart_window_s`` and serving would stop without it (the reason in the message: the last worker or
                router whose process runs, the planner or a worker while no running worker would serve prefill or
                decode; the others are left down, :meth:`_absence`, :meth:`_leave_down`), or nats-server could not be
                started again within as many tries.
        """
        s = self.spec
        now = time.monotonic() if now is None else now
        started: list[str] = []
        window = f"{s.restart_window_s:g} s"
        gap = 0.0 if self._last_pass is None else now - self._last_pass
        if paused(self._last_pass, now, late=self._late, timeout_s=s.liveness_timeout_s):
            # nobody watched during the gap: the silences in it say nothing about the processes (up was stopped)
            log.warning(f"supervision paused {gap:.0f} s (up itself was stopped or blocked); liveness "
                        "clocks start again", gap_s=round(gap, 1))
            self._nats_watch_from = now
            self._bus_ok_since = None
        self._late = gap > SUPERVISE_GAP_S
        self._last_pass = now
        if self.nats is not None:
            if self.nats.alive():
                if self._nats_streak and now - self._nats_started > s.stable_s:
                    self._nats_streak = 0
                seen_until = probe_seen_until(now, self._nats_tried_at)
                silent = None if seen_until is None or self._nats_killed else liveness_overdue(
                    seen_until, started_at=self._nats_started, last_ok=self._nats_last_ok, watch_from=self._nats_watch_from,
                    timeout_s=s.liveness_timeout_s, start_timeout_s=s.ready_timeout_s)  # fmt: skip
                if silent is not None and self.nats.proc is not None:
                    log.warning(f"nats-server silent for {silent:.0f} s (no INFO on its port); killing it to restart",
                                service="nats-server", pid=self.nats.pid, silent_s=round(silent, 1))
                    self.nats.proc.kill()  # reaped by this or a later pass (alive() polls it)
                    self._nats_killed = True
            if not self.nats.alive() and self._nats_restart_at is None:
                self._nats_killed = False
                self._nats_streak += 1
                code = self.nats.returncode
                clean_after_stable = code == 0 and now - self._nats_started > s.stable_s
                n = len(self._nats_exits) if clean_after_stable else count_exit(self._nats_exits, now, s.restart_window_s)
                if n > s.max_restarts:
                    why = "every service talks over it: nothing is served without it"
                    raise ClusterError(f"nats-server exited {n} times in {window}; giving up ({why})", service="nats-server",
                                       reason=f"nats-server exited {n} times in {window} (restarts gave up) ({why})")
                if not clean_after_stable:
                    self._note_crash_loop("nats-server", now, "nats.log in the log folder")
                delay = restart_delay(self._nats_streak, 0.1, s.restart_backoff_max_s)
                self._nats_restart_at = now + delay
                log.warning("nats-server exited; restarting on the same port", code=code, port=self.nats.port,
                            exit=exit_text(code), restart=self.nats_restarts + 1, backoff_s=delay)
            elif self._nats_restart_at is not None and now >= self._nats_restart_at:
                began = time.monotonic()
                try:
                    self.nats.restart()  # waits for its port, up to 10 s: no pause of the supervision
                except NatsServerError as e:
                    log.warning("nats-server restart failed; will retry", error=str(e))
                    self._nats_restart_at = None  # counts as one more exit in the streak
                else:
                    self.nats_restarts += 1
                    self._nats_started = now
                    self._nats_restart_at = None
                    started.append("nats-server")
                    log.warning("nats-server restarted", port=self.nats.port, restarts=self.nats_restarts)
                finally:
                    self._last_pass = now + (time.monotonic() - began)  # the next gap counts from its end
        # the services' beats come over NATS: judged only while the launcher's own connection answers its PINGs (since
        # it answered again after a gap), and only up to its latest answer: a silence after it may be the bus's own
        self._bus_ok_since, seen_until = bus_watch(now, self._bus_last_ok, self._bus_ok_since)
        for c in self.children:
            if c.proc is None:
                continue
            if c.proc.poll() is None:
                if c.killed:  # SIGKILLed by an earlier pass, not reaped yet (uninterruptible I/O): a later pass sees it exit
                    continue
                if c.streak and now - c.started_at > s.stable_s:
                    c.streak = 0
                silent = liveness_overdue(seen_until, started_at=c.started_at, last_ok=c.last_beat, watch_from=self._bus_ok_since,
                                          timeout_s=s.liveness_timeout_s, start_timeout_s=s.ready_timeout_s)  # fmt: skip
                if silent is None:
                    continue
                log.warning(f"{c.name} silent for {silent:.0f} s (no heartbeat); killing it to restart", service=c.name,
                            pid=c.proc.pid, silent_s=round(silent, 1))
                c.proc.kill()  # a stopped (SIGSTOP) process dies of SIGKILL too
                c.killed = True
                if c.proc.poll() is None:  # not dead yet: a later pass reaps it (no wait here: up's event loop runs this)
                    continue
            if c.restart_at is None:
                if c.name.startswith("worker-"):  # the routers fence it now (node.down), not after its silence
                    self._downs.append(m.NodeDown(node=c.name.removeprefix("worker-"), pid=c.proc.pid, exited_ns=time.time_ns(),
                                                  code=c.proc.returncode or 0))  # fmt: skip
                c.streak += 1
                clean_after_stable = c.proc.returncode == 0 and now - c.started_at > s.stable_s
                n = len(c.exits) if clean_after_stable else count_exit(c.exits, now, s.restart_window_s)
                if n > s.max_restarts:
                    effect, why = self._absence(c)
                    if effect is not None:
                        self._leave_down(c, n, now, effect)
                        continue
                    last = _short_exit(c.proc.returncode)
                    because = f" ({why})" if why else ""
                    raise ClusterError(
                        f"{c.name} exited {n} times in {window} (last: {last}); giving up{because}; log {c.log_path}:\n"
                        f"{self._log_tail(c)}",
                        service=c.name,
                        reason=f"{c.name} exited {n} times in {window} (last: {last}; restarts gave up){because}",
                    )
                if not clean_after_stable:
                    self._note_crash_loop(c.name, now, str(c.log_path))
                # a clean exit (0: the service stopped on SIGTERM, e.g. a rolling restart's, after its drain) is no crash
                # to slow down: the first is restarted at once, in this pass (its clients wait for it: the router's 0.5 s
                # backoff was a quarter of its restart gap); one that comes again before a stable run backs off one step
                # behind a crash, so a service exiting 0 in a loop still gives up after max_restarts
                steps = c.streak - (1 if c.proc.returncode == 0 else 0)
                delay = restart_delay(steps, s.restart_backoff_s, s.restart_backoff_max_s) if steps else 0.0
                c.restart_at = now + delay
                log.warning("service exited; restarting", service=c.name, code=c.proc.returncode, exit=exit_text(c.proc.returncode),
                            restart=c.restarts + 1, backoff_s=delay, log=str(c.log_path))
            if c.restart_at is not None and now >= c.restart_at:
                if c.left_down:
                    c.left_down, c.down_effect = False, ""
                    log.warning(f"{c.name} was left down {s.restart_window_s:g} s; trying it again", service=c.name)
                self._phase_as_last_applied(c)
                self._spawn(c)
                c.restarts += 1
                started.append(c.name)
                log.warning("service restarted", service=c.name, pid=c.proc.pid, restarts=c.restarts)
        return started

    def _phase_as_last_applied(self, c: _Child) -> None:
        """Give worker ``c``, about to be restarted, the phase its node last applied (``split.applied``,
        :attr:`recorder`) as its ``--phase``: without the planner (left down, or not back yet) its ``split.get`` gets no
        answer and it serves ``--phase``. Before, that was its launch phase: a worker restarted while the planner was
        left down came back ``decode`` in a collocated warm-up (the frozen split changed under the routers). With the
        planner up its ``split.get`` answer is applied as before (no switch when the phases agree). Nothing for another
        service, a node the recorder has not heard of, or a command line without ``--phase``."""
        if self.recorder is None or not c.name.startswith("worker-") or "--phase" not in c.argv:
            return
        phase = self.recorder.phases().get(c.name.removeprefix("worker-"))
        i = c.argv.index("--phase") + 1
        if phase is not None and i < len(c.argv) and c.argv[i] != phase:
            log.info("restarting in the phase its node last applied", service=c.name, phase=phase, launch_phase=c.argv[i])
            c.argv = [*c.argv[:i], phase, *c.argv[i + 1 :]]

    def _running(self, c: _Child) -> bool:
        """Whether ``c``'s process runs (started, not exited, not SIGKILLed by the liveness watch)."""
        return c.proc is not None and c.proc.poll() is None and not c.killed

    def _uncovered_phases(self, without: _Child) -> list[str]:
        """The phases (``prefill``, ``decode``) no running worker but ``without`` serves now, by the phases the workers
        last applied (``split.applied``, :attr:`recorder`; the launch's split before it runs). A worker serving ``both``
        covers both. What a router could no longer place while nothing lays the split again (the planner down)."""
        phases = self.recorder.phases() if self.recorder is not None else self.launched_phases()
        served = {phases.get(o.name.removeprefix("worker-"), "both") for o in self.children
                  if o is not without and o.name.startswith("worker-") and self._running(o)}  # fmt: skip
        return [want for want, by in (("prefill", ("prefill", "both")), ("decode", ("decode", "both")))
                if not served.intersection(by)]  # fmt: skip

    def launched_phases(self) -> dict[str, m.Phase]:
        """node → the phase its worker is launched in (:func:`launch_phases`): what the split timeline starts from."""
        return {n: cast("m.Phase", ph) for n, ph in zip(self.spec.node_ids(), launch_phases(self.spec))}

    def _split_now(self) -> str:
        """The split the workers serve now (``2P2D``), as :meth:`_uncovered_phases` reads it."""
        return split_name(self.recorder.phases() if self.recorder is not None else self.launched_phases())

    def _absence(self, c: _Child) -> tuple[str | None, str]:
        """What ``c``'s absence does to serving, for a service past ``max_restarts``: ``(effect, "")`` when the data
        path serves on without it (``effect``: what no longer adapts, for the left-down line), ``(None, why)`` when
        serving would stop (``why``: the reason, for the error the cluster stops with).

        * a worker: serves on while another worker's process runs and, when the planner is left down (nothing lays
          the split over the nodes left; one in its restart backoff comes back within seconds), those workers still
          cover prefill and decode (:meth:`_uncovered_phases`);
        * a router: while another router's process runs (they serve the one socket ``up`` holds);
        * the planner: the routers route by the phases the workers report and a worker that starts without the planner
          serves its ``--phase`` (``split.get`` gives up after ``--split-get-timeout-s``): it serves on while the running
          workers cover prefill and decode; the split is frozen (``split set`` has no planner to apply it either);
        * the KV directory: each ``kv.lookup`` fails at once (no responders; ``--lookup-timeout-s``, 0.5 s, bounds a
          wait) and the router routes without cache information; it serves on;
        * anything else (an unknown name): serving stops.
        """
        name = c.name
        if name.startswith("worker-"):
            if not any(self._running(o) for o in self.children if o is not c and o.name.startswith("worker-")):
                return None, "no other worker process runs: nothing would serve"
            planner = next((o for o in self.children if o.name == "planner"), None)
            if planner is not None and planner.left_down:
                if lost := self._uncovered_phases(c):
                    return None, (f"no other running worker serves {' or '.join(lost)} and the planner is down, "
                                  "so nothing would lay the split over the workers left")
            return "the other workers serve on", ""
        if is_router(name):
            if not any(self._running(o) for o in self.children if o is not c and is_router(o.name)):
                return None, "no other router process runs: nothing would answer on the router port"
            return "the other routers serve on the same port", ""
        if name == "planner":
            if lost := self._uncovered_phases(c):
                return None, f"no running worker serves {' or '.join(lost)}, and only the planner would lay the split again"
            return (f"the split is frozen at {self._split_now()} (no split changes, nor when a worker is lost; `split set` "
                    "has nothing to apply it) while the routers and workers serve on"), ""
        if name == "kvdirectory":
            return ("the routers route without KV-cache information (each kv.lookup fails at once; prefix reuse across "
                    "nodes is not sought, ending a branch another router served answers 503) while serving goes on"), ""
        return None, ""

    def _leave_down(self, c: _Child, n: int, now: float, effect: str) -> None:
        """Leave ``c``, exited ``n`` times (past ``max_restarts``) within ``restart_window_s``, down while serving goes
        on without it (:meth:`_absence` gave ``effect``): no restart until ``restart_window_s`` from ``now`` (its exits
        then lie outside the window), one error line saying so and what no longer adapts (``effect``), the launcher's
        :attr:`on_down` called. A worker: the routers fenced it when it exited (``node.down``) and the planner lays its
        split over the nodes that report. Before, one worker's crash loop stopped the whole cluster (every service,
        the healthy workers' requests with it); before session 59 so did the planner's, the KV directory's, and with
        ``--routers N`` one router's.
        """
        s = self.spec
        c.left_down = True
        c.down_effect = effect
        c.down_since = time.time()
        c.restart_at = now + s.restart_window_s
        last = _short_exit(c.proc.returncode if c.proc is not None else None)
        log.error(f"{c.name} exited {n} times in {s.restart_window_s:g} s (last: {last}); left down, {effect}; trying it "
                  f"again in {s.restart_window_s:g} s; log {c.log_path}:\n{self._log_tail(c)}",
                  service=c.name, exits=n, retry_in_s=s.restart_window_s)
        if callable(self.on_down):
            try:  # up's rewrites cluster.json and prints: a full disk or a closed stdout must not end supervision
                self.on_down(c.name)
            except Exception as e:
                log.warning("left-down callback failed; supervision goes on", service=c.name, error=repr(e))

    def down_effect(self, name: str) -> str:
        """What serving does without ``name`` left down (the left-down line's words: "the other workers serve on",
        "the split is frozen at 2P2D ..."); "" when it is not left down."""
        return next((c.down_effect for c in self.children if c.name == name and c.left_down), "")

    def left_down(self) -> list[str]:
        """Services left down after a crash loop (:meth:`_leave_down`: workers, routers beside another, the planner,
        the KV directory), by name, until they are tried again."""
        return [c.name for c in self.children if c.left_down]

    def _note_crash_loop(self, name: str, now: float, log_at: str) -> None:
        """Count an exit of ``name`` at ``now`` within :data:`CRASH_LOOP_WINDOW_S`; from :data:`CRASH_LOOP_WARN_AT` of
        them on, log one "crash loop" warning line, again every :data:`CRASH_LOOP_WARN_EVERY_S` while it lasts."""
        k = count_exit(self._hour_exits.setdefault(name, []), now, CRASH_LOOP_WINDOW_S)
        last = self._loop_warned.get(name)
        if k >= CRASH_LOOP_WARN_AT and (last is None or now - last >= CRASH_LOOP_WARN_EVERY_S):
            self._loop_warned[name] = now
            s = self.spec
            log.warning(f"{name} has restarted {k} times in the last hour (crash loop); up gives up only past "
                        f"{s.max_restarts} exits within {s.restart_window_s:g} s; see {log_at}",
                        service=name, exits_last_hour=k)

    async def _supervise(self, interval_s: float = 0.2) -> None:
        while True:
            try:
                started = self.supervise_once()
            except ClusterError as e:
                self._failure = e
                log.error("supervisor gave up", error=str(e))
                return
            await self._announce_downs()
            if started:
                self.write_targets()  # the same ports (a restart reuses its argv): the file is current again
            if started and callable(self.on_restart):
                for name in started:
                    try:  # up's rewrites cluster.json and prints: a full disk or a closed stdout must not end supervision
                        self.on_restart(name)
                    except Exception as e:
                        log.warning("restart callback failed; supervision goes on", service=name, error=repr(e))
            await asyncio.sleep(interval_s)

    async def _announce_downs(self) -> None:
        """Tell the routers of each worker exit the latest supervision pass saw (:attr:`_downs`): a
        :class:`~shared.messages.NodeDown` on ``node.down.<node>`` (:func:`evolving_infra.nodedown.announce_downs`,
        which the Slurm job's worker loop uses too). A router fences the node at once and re-dispatches its requests;
        before, a ``kill -9`` of a worker stalled its requests until the router's ``--fence-after-s`` of state silence
        (or the restarted process's first state) although ``up`` saw the exit within a pass (0.2 s). Never raises."""
        downs, self._downs = self._downs, []
        if self._bus is not None and downs:
            await announce_downs(self._bus, downs)

    def restarts(self) -> dict[str, int]:
        """Supervisor restarts per service (and ``nats-server``) so far."""
        out = {c.name: c.restarts for c in self.children}
        if self.nats is not None:
            out["nats-server"] = self.nats_restarts
        return out

    async def wait_failed(self) -> ClusterError:
        """Wait until the cluster fails for good (without supervision: a service exits) and return why
        (:class:`ServiceStopped` when that service exited with code 0)."""
        while True:
            try:
                self.check_alive()
            except ClusterError as e:
                return e
            await asyncio.sleep(0.2)

    async def _wait_ready(self, seen: dict[str, m.Heartbeat]) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        expected = {c.name for c in self.children}
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                self.check_alive()
                # every router (they share one port, so /healthz there reaches any one of them): its heartbeat says ready,
                # which is /healthz's own test (RouterService.ready), and its port file says its HTTP server runs
                ready = {name for name, hb in seen.items() if hb.ready}
                ports = [self.log_dir / f"{name}.port" for name in self.spec.router_names()]
                if expected <= ready and all(p.exists() and p.read_text().strip() for p in ports):
                    self.router_port = int(self._port_file.read_text())
                    # the bound port (--port 0: a free one) at an address that connects (--host 0.0.0.0: 127.0.0.1)
                    self.router_url = http_url(reachable_host(self.spec.host), self.router_port)
                    try:
                        r = await http.get(self.router_url + "/healthz")
                        if r.status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                if time.monotonic() > deadline:
                    missing = sorted(expected - ready) or [f"{p.stem} port file" for p in ports if not p.exists()]
                    raise ClusterError(
                        f"cluster not healthy after {self.spec.ready_timeout_s:.0f} s; waiting for {missing or ['router /healthz']}"
                        f" (logs in {self.log_dir})"
                    )
                await asyncio.sleep(0.1)

    def _stream_timeout(self, wait_s: float) -> str:
        """The error line of a launcher that did not get the partition's JetStream stream within ``wait_s`` seconds:
        the URL, and what got no answer (the lookup) or did not succeed (the create; the bus logged why)."""
        assert self._bus is not None
        name = stream_name(self._bus.subjects)
        if self._bus.counters["stream_missing_warnings"]:  # the lookup answered "not found"; the create failed
            what = (f"the JetStream stream {name} is not there and its create ({stream_api_subject('CREATE', name)}) did not "
                    f"succeed within {wait_s:g} s (--ready-timeout); the warning above says why")
        else:
            what = (f"its JetStream did not answer the stream lookup ({stream_api_subject('INFO', name)}) within {wait_s:g} s "
                    "(--ready-timeout); a server without JetStream answers at once (the services then fall back to core "
                    "NATS): this one is loaded or hung")
        return f"NATS at {redact_url(self.nats_url)}: {what}"

    def creds_file(self, name: str) -> str | None:
        """Credentials file of identity ``name`` (generated, or from ``nats_creds_dir``), or None."""
        if self.creds is not None:
            path = self.creds.files.get(name)
            return str(path) if path else None
        if self.spec.nats_creds_dir:
            for ext in (".nk", ".creds", ".pass"):
                p = Path(self.spec.nats_creds_dir) / f"{name}{ext}"
                if p.exists():
                    return str(p)
        return None

    def client_auth(self, name: str = "admin") -> NatsAuth | None:
        """NATS client options of identity ``name`` (``admin``: everything; ``operator``:
        ``split set`` and stats) for tools and tests; None when NATS runs without credentials.

        Raises:
            AuthError: credentials exist but none for ``name``.
        """
        path = self.creds_file(name)
        if path is None:
            if self.creds is not None:
                raise AuthError(f"no NATS credentials for {name!r}")
            return None
        return NatsAuth.from_file(path)

    def check_alive(self) -> None:
        """Raise if the cluster is broken: without supervision, any service process or the embedded nats-server has
        exited; with it, the supervisor gave up on a service that kept dying.

        Every process that exited since the last poll counts: a clean exit (0) seen in the same poll as a crash does
        not hide the crash (before, the first in the list was reported, and a worker's 0 beside the router's 3 read as
        a clean stop).

        Raises:
            ClusterError: naming the first service that exited non-zero or by a signal, its exit code and its log's
                tail (and the others that exited); else the embedded nats-server that exited (nothing restarts it
                without supervision, and every service waits on it).
            ServiceStopped: without supervision, every service that exited exited with code 0 (naming them and
                the first one's log).
        """
        if self._failure is not None:
            raise self._failure
        if self._supervisor is not None:
            if self._supervisor.done() and not self._supervisor.cancelled() and self._supervisor.exception():
                raise ClusterError(f"supervisor crashed: {self._supervisor.exception()!r}")
            return
        dead = [c for c in self.children if c.proc is not None and c.proc.poll() is not None]
        nats_dead = self.nats is not None and not self.nats.alive()
        if not dead and not nats_dead:
            return
        nats_exit = [f"nats-server {_short_exit(self.nats.returncode)}"] if self.nats is not None and nats_dead else []
        crashed = [c for c in dead if c.proc is not None and c.proc.returncode != 0]
        if crashed:
            c = crashed[0]
            assert c.proc is not None
            also = [f"{o.name} {_short_exit(o.proc.returncode)}" for o in dead if o is not c and o.proc is not None] + nats_exit
            with_others = f" (also exited: {', '.join(also)})" if also else ""
            raise ClusterError(f"{c.name} {exit_text(c.proc.returncode)}{with_others}; log {c.log_path}:\n{self._log_tail(c)}",
                               service=c.name, reason=f"{c.name} {exit_text(c.proc.returncode)}{with_others}")
        if nats_dead:
            assert self.nats is not None
            also = [f"{c.name} code 0" for c in dead]
            with_others = f" (also exited: {', '.join(also)})" if also else ""
            raise ClusterError(f"nats-server {exit_text(self.nats.returncode)}{with_others}; without supervision "
                               "(--no-restart) nothing restarts it, and every service needs it", service="nats-server",
                               reason=f"nats-server {exit_text(self.nats.returncode)}{with_others}")
        c = dead[0]
        also = [o.name for o in dead[1:]]
        with_others = f" (also exited cleanly: {', '.join(also)})" if also else ""
        raise ServiceStopped(f"{c.name} exited cleanly (code 0){with_others}; log {c.log_path}", service=c.name,
                             log_path=c.log_path, log_tail=self._log_tail(c), reason=f"{c.name} exited cleanly (code 0){with_others}")

    def set_router_env(self, env: dict[str, str]) -> None:
        """Set ``env`` over every router's own environment for its next starts (a restart by the supervisor), not
        the running process's: ``up``'s key reload keeps the keys it checked (``EI_API_KEYS``) for routers restarted
        after it. :attr:`spec` keeps the environment the cluster started with."""
        for c in self.children:
            if is_router(c.name):
                c.env = {**(c.env or {}), **env}

    def signal_routers(self, sig: int) -> list[str]:
        """Send ``sig`` to every router process that runs now (``up``'s key reload: SIGHUP). Returns their names."""
        sent = []
        for c in self.children:
            if is_router(c.name) and c.proc is not None and c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(sig)
                    sent.append(c.name)
        return sent

    def timeline(self) -> RunTimeline | None:
        """The PD split over time as the workers reported it (``split.applied``)."""
        return self.recorder.timeline() if self.recorder else None

    def pids(self) -> dict[str, int]:
        """Process ids of every running service (and the embedded nats-server); one that exited and waits for its
        restart (backoff, or left down: :meth:`left_down`) is not listed (its pid was, until it came back)."""
        out = {c.name: c.proc.pid for c in self.children if c.proc and c.proc.poll() is None}
        if self.nats and self.nats.pid:
            out["nats-server"] = self.nats.pid
        return out

    async def stop(self, timeout_s: float = 10.0, *, drain_routers: bool = False, interrupt: asyncio.Event | None = None) -> None:
        """Stop supervising; signal every service (routers first, workers last), wait, SIGKILL stragglers, stop NATS.

        Each router gets SIGINT, its quick stop: what is in flight fails at once with "router shutting down" (Ctrl-C of
        ``up`` is a fast stop, within ``timeout_s``); its SIGTERM would first drain up to ``--shutdown-grace-s`` (20 s),
        past this 10-s wait. The other services get SIGTERM (SIGINT is the same stop for them).

        ``drain_routers``: the cluster stops on its own (``--no-restart``: a service exited), nobody asked for a quick
        stop: each router still running gets SIGTERM first and the others keep serving while they drain, up to the
        routers' ``--shutdown-grace-s`` (:meth:`router_grace_s`) + 5 s, so the streams open on them finish; then the
        rest stop as above (a router still draining gets SIGINT; so does every router at once when ``interrupt`` is set
        meanwhile: ``up``'s Ctrl-C during that drain is the quick stop). Before, they got SIGINT at once: with
        ``--routers 2`` and one router SIGTERMed, the other's open streams ended with 503 "router shutting down".
        No drain when the embedded nats-server is what exited (or exited meanwhile): without the bus no stream can
        finish, and the drain waited out the whole grace (21 s with the default 20 s; ~1 s before that drain)."""
        # cancelled until they have ended (shared/cancel.py): one cancel can be lost (Python 3.11's wait_for returns
        # the inner result when it completes as the cancel comes), and the liveness probe, looping on, then held this
        # stop forever at "stopping ..." (3 of the suite's `up` tests timed out in one run, 2 of 4 here in a loop)
        tasks = [t for t in (self._supervisor, self._prober) if t is not None]
        self._supervisor = self._prober = None
        if tasks:
            await cancel_until_done(tasks, limit_s=5.0)
        order = sorted(self.children, key=lambda c: 0 if is_router(c.name) else {"planner": 1, "kvdirectory": 2}.get(c.name, 3))
        bus_down = self.nats is not None and not self.nats.alive()
        if drain_routers and bus_down:
            log.info("nats-server exited: the routers stop without a drain (no stream can finish without the bus)")
        draining = [c for c in order if drain_routers and not bus_down and is_router(c.name) and c.proc and c.proc.poll() is None]
        for c in draining:
            assert c.proc is not None
            c.proc.send_signal(signal.SIGTERM)
        if draining:
            log.info("routers draining before the cluster stops", routers=[c.name for c in draining], grace_s=self.router_grace_s())
            deadline = time.monotonic() + self.router_grace_s() + 5.0
            while (any(c.proc is not None and c.proc.poll() is None for c in draining) and time.monotonic() < deadline
                   and not (interrupt is not None and interrupt.is_set())
                   and not (self.nats is not None and not self.nats.alive())):  # fmt: skip
                await asyncio.sleep(0.05)
        for c in order:
            if c.proc and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGINT if is_router(c.name) else signal.SIGTERM)
        if self.router_socket is not None:  # each stopping router holds its own copy: once they exited, a client is refused, not held
            self.router_socket.close()
            self.router_socket = None
        deadline = time.monotonic() + timeout_s
        for c in order:
            if c.proc is None:
                continue
            while c.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if c.proc.poll() is None:
                log.warning("service did not stop in time; killing", service=c.name)
                c.proc.kill()
                c.proc.wait()
            if c.log_file:
                c.log_file.close()
                c.log_file = None
        for held in self.metrics_sockets.values():  # every service has exited: nothing serves on them any more
            held.close()
        self.metrics_sockets.clear()
        if (self._log_dir_ours or self._wrote_targets) and (self.log_dir / TARGETS_FILE).exists():  # not another cluster's (refused)
            self.write_targets(empty=True)
        if self._bus is not None:
            await self._bus.close()
            self._bus = None
        if self.nats:
            self.nats.stop()
            self.nats = None
        self._release_log_dir()

    def router_grace_s(self) -> float:
        """The routers' ``--shutdown-grace-s`` (wall s): the last one in the spec's ``router_args``, else
        ``EI_SHUTDOWN_GRACE_S`` of this process's environment (the routers inherit it), else the router's default. A
        value that is not a number reads as the default (the router itself refuses it at its start)."""
        from services.router.config import RouterConfig

        default = float(next(f.default for f in msgspec.structs.fields(RouterConfig) if f.name == "shutdown_grace_s"))
        given = os.environ.get("EI_SHUTDOWN_GRACE_S")
        args = list(self.spec.router_args)
        for i, a in enumerate(args):
            if a == "--shutdown-grace-s" and i + 1 < len(args):
                given = args[i + 1]
            elif a.startswith("--shutdown-grace-s="):
                given = a.split("=", 1)[1]
        try:  # read as the router reads it (shared.config: its type and constraints), not a parser of our own
            value = float(field_from_text(RouterConfig, "shutdown_grace_s", given)) if given is not None else default
        except ConfigError:
            return default
        return value if math.isfinite(value) and value >= 0 else default

    def remove_generated_creds(self, *, own_log_dir: bool | None = None) -> Path | None:
        """Delete the NATS credentials this cluster generated (``<log_dir>/nats-creds``: every identity's
        nkey seed or password, the operator's and admin's included) when it generated them into the
        temporary log folder it made itself; the logs stay (users read them). Call it after :meth:`stop`:
        the nats-server that trusted them is gone, and a new cluster generates new ones. Nothing is removed
        when the caller chose ``log_dir`` (its folder, its files), gave credentials, or auth is off.

        Args:
            own_log_dir: whether ``log_dir`` is the calling command's own folder rather than the user's;
                None = whether this cluster made it (no ``spec.log_dir``). ``demo`` passes True for its
                default ``OUT/logs``: the report folder that users share kept every seed.

        Returns:
            The folder removed, or None when there was none to remove.
        """
        own = self.made_log_dir if own_log_dir is None else own_log_dir
        if self.creds is None or not own or not self.creds.directory.exists():
            return None
        shutil.rmtree(self.creds.directory, ignore_errors=True)
        return self.creds.directory

    def describe(self) -> dict[str, object]:
        """What is running, for humans and for the `up` ready line.

        Its paths (log folder, credentials, file_sd list) are absolute: the state file written from it is read by
        ``split``, ``tap`` and ``replay`` run from any folder (a relative ``--log-dir``, ``demo``'s ``demo-out/logs``,
        made ``split get`` from another folder fail on ``demo-out/logs/nats-creds/operator.nk``), and resolved
        (``Path.resolve``: no ``..``, symlinks followed): ``--log-dir ../logs`` run in ``work/`` was shown as
        ``/.../work/../logs``, a level deeper than the folder it names.
        """

        def absolute(path: str | Path | None) -> str | None:
            return str(Path(path).resolve()) if path else None

        return {
            "router_url": self.router_url,
            "router_listen": f"[{h}]:{self.router_port}" if ":" in (h := self.spec.host.strip("[]")) else f"{h}:{self.router_port}",
            "nats_url": self.nats_url,
            "nats_auth": self.spec.nats_auth if not self.spec.nats_url else ("creds" if self.spec.nats_creds_dir else "none"),
            "nats_operator_creds": absolute(self.creds_file("operator")),
            "nats_admin_creds": absolute(self.creds_file("admin")),
            "log_dir": absolute(self.log_dir),
            "split": self.spec.split,
            "speedup": self.spec.speedup,
            "pids": self.pids(),
            **({"metrics": dict(self.metrics_urls), "prometheus_targets": absolute(self.log_dir / TARGETS_FILE)} if self.metrics_urls else {}),
            "restarts": self.restarts(),
            **({"left_down": self.left_down(), "left_down_info": self.left_down_info()} if self.left_down() else {}),
        }

    def left_down_info(self) -> dict[str, dict[str, object]]:
        """Per service left down (:meth:`left_down`): ``since_unix`` (unix s it was left down), ``retry_at_unix`` (unix s
        the supervisor tries it again: ``restart_window_s`` after its last exit) and ``effect`` (what serving does
        without it, the left-down line's words); ``describe()``'s ``left_down_info``, read by ``evolving-infra status``."""
        now_wall, now = time.time(), time.monotonic()
        return {
            c.name: {"since_unix": round(c.down_since, 3),
                     "retry_at_unix": None if c.restart_at is None else round(now_wall + (c.restart_at - now), 3),
                     "effect": c.down_effect}
            for c in self.children if c.left_down
        }


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})
"""Bind addresses that listen on every interface of this machine."""


def reachable_host(host: str) -> str:
    """An address a client on this machine connects to for a socket bound on ``host``: the loopback for a wildcard
    (``0.0.0.0`` / ``""``: 127.0.0.1; ``::``: ::1), as vLLM's banner gives a usable URL; ``host`` itself otherwise."""
    if host in WILDCARD_HOSTS:
        return "::1" if host in ("::", "[::]") else "127.0.0.1"
    return host


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def write_json(path: Path, data: object) -> None:
    """Write ``data`` as JSON atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
