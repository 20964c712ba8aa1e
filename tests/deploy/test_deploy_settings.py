"""Compose and Slurm reach ``up``'s serving settings: KV sizes, served model name, dtype, request log, traces.

The entrypoint and the Slurm job passed deploy-args a fixed set of up's flags (policy, nodes, split, profile,
engine, model): ``--gpu-kv-tokens`` (a torch stack served only torch-tiny-cpu's 1024-token KV),
``--host-kv-tokens``, ``--served-model-name`` (a torch stack served the name "models", its mount point),
``--dtype``, ``--log-requests`` and ``--otlp-traces-endpoint`` had no way in. Now one variable each
(compose ``EI_GPU_KV_TOKENS``..., Slurm ``GPU_KV_TOKENS``..., as ``EI_POLICY`` / ``POLICY``) is passed to
deploy-args as up's flag, and a bad value ends the one-shot auth job (compose) or the job (Slurm) once.

The entrypoint runs with ``/bin/sh`` and a ``python`` shim that records the service's argv and environment
(``test_entrypoint_block_size._run``); the Slurm script's flag-building and service-argument functions run
alone with ``bash``, as ``test_slurm_supervision`` runs its ``supervise``.
"""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

from evolving_infra.deploy_cli import deploy_args
from shared.config import load_config
from tests.deploy.test_deploy_policy import _env, needs_compose
from tests.deploy.test_entrypoint_block_size import _run
from tests.deploy.test_prometheus_config import resolved_services

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "evolving-infra.sbatch"

CONFIGS = {
    "router": "services.router.config:RouterConfig",
    "worker": "services.worker.config:WorkerConfig",
}

SETTINGS = dict(EI_GPU_KV_TOKENS="2048", EI_HOST_KV_TOKENS="4096", EI_SERVED_MODEL_NAME="qwen,qwen-chat",
                EI_LOG_REQUESTS="True", EI_OTLP_TRACES_ENDPOINT="http://jaeger:4318")


def _started(tmp_path: Path, role: str, **env: str) -> tuple[list[str], dict[str, str]]:
    """``role``'s argv after ``-m services.ROLE`` and its environment, as the entrypoint starts it."""
    n = len(list(tmp_path.glob("args-*")))
    args, envf = tmp_path / f"args-{n}", tmp_path / f"env-{n}"
    r = _run(tmp_path, role, ARGS_OUT=str(args), ENV_OUT=str(envf), **env)
    assert r.returncode == 0 and r.stdout.startswith(f"started services.{role}"), (r.stdout, r.stderr)
    seen = dict(line.split("=", 1) for line in envf.read_text().splitlines() if re.match(r"^EI_\w+=", line))
    return args.read_text().splitlines(), seen


def _config(role: str, argv: list[str], env: dict[str, str]):
    """The service's own configuration from that argv and environment (as ``python -m services.ROLE`` reads them)."""
    mod, name = CONFIGS[role].split(":")
    return load_config(getattr(importlib.import_module(mod), name), argv, prog=role, env=env)


def test_compose_settings_reach_the_services_as_up_s_flags(tmp_path):
    router, renv = _started(tmp_path, "router", **SETTINGS)
    worker, wenv = _started(tmp_path, "worker", EI_REPLICA="1", **SETTINGS)
    r, w = _config("router", router, renv), _config("worker", worker, wenv)
    assert (r.model, list(r.model_names), r.model_aliases, r.log_requests) == ("qwen", ["qwen-chat"], [], True), router
    assert (w.gpu_kv_tokens, w.host_kv_tokens, w.log_requests) == (2048, 4096, True), worker
    assert r.otlp_traces_endpoint == w.otlp_traces_endpoint == "http://jaeger:4318"
    assert "--gpu-kv-tokens" in worker and "--served-model-name" not in router, (worker, router)


def test_compose_s_empty_settings_are_up_s_defaults_and_unset_for_the_services(tmp_path):
    """Compose passes an unset variable as empty: no flag, and the variable is not left empty for the
    service, which reads ``EI_<FIELD>`` itself (an empty number or boolean is an invalid value there)."""
    empty = {k: "" for k in (*SETTINGS, "EI_DTYPE")}
    worker, wenv = _started(tmp_path, "worker", EI_REPLICA="1", **empty)
    assert not set(empty) & set(wenv), wenv
    assert not {"--gpu-kv-tokens", "--log-requests", "--otlp-traces-endpoint", "--dtype"} & set(worker), worker
    w = _config("worker", worker, wenv)
    assert (w.gpu_kv_tokens, w.host_kv_tokens, w.log_requests, w.dtype) == (0, 0, False, "")


def test_a_bad_setting_ends_the_auth_job_before_anything_starts(tmp_path):
    creds = tmp_path / "creds"
    creds.mkdir()
    for env, frag in (
        ({"EI_GPU_KV_TOKENS": "8k"}, "argument --gpu-kv-tokens: invalid int value: '8k'"),
        ({"EI_LOG_REQUESTS": "maybe"}, "EI_LOG_REQUESTS=maybe: 1, true, yes or on"),
        ({"EI_DTYPE": "bfloat16"}, "--dtype needs --engine torch"),
    ):
        r = _run(tmp_path, "auth", EI_CREDS_DIR=str(creds), EI_CREDS_OUT=str(tmp_path / "out"), **env)
        assert r.returncode == 2 and r.stdout == "", (env, r.stdout, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and frag in r.stderr, (env, r.stderr)
        assert list(creds.iterdir()) == [], env


@needs_compose
def test_compose_gives_every_service_the_settings_from_one_place():
    services = resolved_services(_env(EI_GPU_KV_TOKENS="8192", EI_SERVED_MODEL_NAME="qwen"))
    for name in ("auth", "router", "planner", "kvdirectory", "worker"):
        assert re.search(r"^      EI_GPU_KV_TOKENS: ['\"]?8192['\"]?$", services[name], re.M), (name, services[name])
        assert re.search(r"^      EI_SERVED_MODEL_NAME: qwen$", services[name], re.M), (name, services[name])


@needs_compose
def test_compose_gives_the_router_ei_lookup_timeout_s(tmp_path):
    """The router's 'kv.lookup failed' warning names EI_LOOKUP_TIMEOUT_S, but the router's environment in
    docker-compose.yml is a list and lacked it: ``EI_LOOKUP_TIMEOUT_S=2 docker compose up`` left the router at
    0.5 s. Now it is passed (to the router only); unset, compose passes it empty and the entrypoint unsets it,
    so the router keeps its default (an empty float is an invalid value for the router's config)."""
    services = resolved_services(_env(EI_LOOKUP_TIMEOUT_S="2"))
    assert re.search(r"^      EI_LOOKUP_TIMEOUT_S: ['\"]?2['\"]?$", services["router"], re.M), services["router"]
    assert [n for n, text in services.items() if n != "router" and "EI_LOOKUP_TIMEOUT_S" in text] == []
    argv, env = _started(tmp_path, "router", EI_LOOKUP_TIMEOUT_S="")  # compose's value when it is not set
    assert "EI_LOOKUP_TIMEOUT_S" not in env and _config("router", argv, env).lookup_timeout_s == 0.5, env


@needs_compose
def test_compose_gives_the_router_its_drain_slow_client_and_branch_limits(tmp_path):
    """This session's router limits (--shutdown-grace-s, --max-buffered-output-tokens, --slow-client-grace-s,
    --stream-stall-timeout-s, --max-active-branches; --trust-request-chat-template) could not be set under compose without editing the file (the router's environment is
    a list). Now each is passed to the router only; unset, compose passes it empty and the entrypoint unsets it,
    so the router keeps its default."""
    limits = {"EI_SHUTDOWN_GRACE_S": ("5", "shutdown_grace_s", 5.0, 20.0),
              "EI_MAX_BUFFERED_OUTPUT_TOKENS": ("1024", "max_buffered_output_tokens", 1024, 65_536),
              "EI_SLOW_CLIENT_GRACE_S": ("3", "slow_client_grace_s", 3.0, 10.0),
              "EI_STREAM_STALL_TIMEOUT_S": ("30", "stream_stall_timeout_s", 30.0, 120.0),
              "EI_MAX_ACTIVE_BRANCHES": ("100", "max_active_branches", 100, 65_536),
              "EI_TRUST_REQUEST_CHAT_TEMPLATE": ("1", "trust_request_chat_template", True, False)}  # fmt: skip
    services = resolved_services(_env(**{k: v[0] for k, v in limits.items()}))
    for var, (value, field, parsed, default) in limits.items():
        assert re.search(rf"^      {var}: ['\"]?{value}['\"]?$", services["router"], re.M), (var, services["router"])
        assert [n for n, text in services.items() if n != "router" and var in text] == [], var
        argv, env = _started(tmp_path, "router", **{var: value})
        assert getattr(_config("router", argv, env), field) == parsed, (var, env)
        argv, env = _started(tmp_path, "router", **{var: ""})  # compose's value when it is not set
        assert var not in env and getattr(_config("router", argv, env), field) == default, (var, env)


def _sbatch(body: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``body`` run by ``bash`` after the Slurm script's ``log``, ``shown_url``, ``up_flags`` and ``service_args``
    functions."""
    text = SBATCH.read_text()
    funcs = [re.search(rf"^{name}\(\) \{{.*?^\}}\n" if name != "log" else rf"^{name}\(\) \{{.*?\}}\n", text, re.S | re.M)
             for name in ("log", "shown_url", "up_flags", "service_args")]
    assert all(funcs), "the sbatch lacks log(), shown_url(), up_flags() or service_args()"
    base = dict(POLICY="evolving", NWORKERS="2", PROFILE="gb300-glm52", ENGINE="sim", SPLIT="", ROUTING="",
                LOG_REQUESTS="", METRICS_PORT="9100", AUTH="nkeys", RUN="/run")
    script = "".join(f.group(0) for f in funcs) + body
    return subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin", **base, **env}, capture_output=True,
                          text=True, timeout=30)


def test_slurm_settings_reach_deploy_args_as_up_s_flags():
    r = _sbatch('up_flags || exit; printf "%s\\n" "${UP_FLAGS[@]}"', GPU_KV_TOKENS="2048", HOST_KV_TOKENS="4096",
                SERVED_MODEL_NAME="qwen,my model", DTYPE="bfloat16", LOG_REQUESTS="ON", OTLP_TRACES_ENDPOINT="http://c:4318")
    assert r.returncode == 0, r.stderr
    flags = r.stdout.splitlines()
    assert flags[flags.index("--served-model-name") + 1 :][:2] == ["qwen", "my model"], flags
    for flag, value in (("--gpu-kv-tokens", "2048"), ("--host-kv-tokens", "4096"), ("--dtype", "bfloat16"),
                        ("--otlp-traces-endpoint", "http://c:4318")):
        assert flags[flags.index(flag) + 1] == value, (flag, flags)
    assert "--log-requests" in flags
    # what the job's deploy-args calls then print (DTYPE aside: up refuses it with the sim engine)
    flags = flags[: flags.index("--dtype")] + flags[flags.index("--dtype") + 2 :]
    router, worker = deploy_args(flags, "router")[0], deploy_args(flags, "worker")[0]
    assert router[router.index("--model") + 1 :][:1] == ["qwen"] and "--log-requests" in router, router
    assert router[router.index("--model-names") + 1] == "my model" and "--model-aliases" not in router, router
    assert worker[worker.index("--gpu-kv-tokens") + 1] == "2048" and "--log-requests" in worker, worker
    r = _sbatch('up_flags || exit; printf "%s\\n" "${UP_FLAGS[@]}"')  # none set: up's defaults, no flag
    assert r.returncode == 0 and r.stdout.split() == "--policy evolving --nodes 2 --profile gb300-glm52 --engine sim".split()
    r = _sbatch('up_flags; echo "status $?"', LOG_REQUESTS="maybe")
    assert r.stdout.count("status 2") == 1 and "LOG_REQUESTS=maybe: 1, true, yes or on" in r.stdout, r.stdout


def test_slurm_service_arguments_keep_a_run_folder_with_spaces_whole():
    """``$(metrics 0) $(creds kvdirectory)`` were unquoted: ``--nats-creds /scratch/my run/creds/...`` reached the
    service as three words (and a ``*`` in the path was globbed)."""
    run = "/scratch/my run */job 1"
    r = _sbatch('service_args 2 router; printf "%s\\n" "${SVC_ARGS[@]}"', RUN=run)
    assert r.stdout.splitlines() == ["--metrics-port", "9102", "--metrics-host", "0.0.0.0", "--nats-creds",
                                     f"{run}/creds/router.nk"], r
    r = _sbatch('service_args 0 kvdirectory; printf "%s\\n" "${SVC_ARGS[@]}"', RUN=run, AUTH="off")
    assert r.stdout.splitlines() == ["--metrics-port", "9100", "--metrics-host", "0.0.0.0"], r


def test_slurm_job_log_shows_a_nats_url_without_its_password():
    """``NATS_URL=nats://ei:<password>@host:4222 sbatch ...`` (a shared NATS server with password auth): the job
    printed ``READY router ... nats nats://ei:<password>@host:4222 ...`` into its output file. Its ``shown_url``
    writes what ``shared.auth.redact_url`` writes (``***``), and the READY and FAILED lines use it."""
    from shared.auth import redact_url

    urls = ["nats://10.0.0.1:4222", "nats://ei:pw-71c3@10.0.0.1:4222", "tls://tok-9e2@head", "nats://a:p:with:colons@h",
            "nats://a:p@w0rd@h:1", "nats://a:p1@h1:1,nats://b:p2@h2:2,nats://h3:3", "ei:pw-71c3@head:4222", "nats://head",
            # a password with / or , (nats://ei:pw/1@h was printed whole, nats://ei:pw,1@h as nats://ei:pw,***@h)
            "nats://ei:pw/5c@h:1", "nats://ei:pw,5c@h:1", "nats://a:p,1@h1:1, tls://b:p/2@h2:2,wss://t,k@h3/ws",
            "u:p1@h1:1,v:p2@h2:2", "tok://en@h", "nats://h:1,x:y,z@h2", ""]
    r = _sbatch('while IFS= read -r url; do shown_url "$url"; done <<<"$URLS"', URLS="\n".join(urls))
    assert r.returncode == 0 and r.stdout.splitlines() == [redact_url(url) for url in urls], r
    text = SBATCH.read_text()
    assert re.search(r'log "READY router .* nats \$NATS_SHOWN ', text) and 'stream on $NATS_SHOWN"' in text
    assert 'NATS_SHOWN=$(shown_url "$NATS_URL")' in text
    assert not re.search(r'log "[^"\n]*\$\{?NATS_URL\b', text), "a log line prints NATS_URL whole"


def test_slurm_job_log_hides_the_password_of_a_nats_user_with_an_at_sign():
    """A NATS user named like an e-mail address (``nats://alice@corp.example:<password>@host``: nats-py, as
    ``urllib.parse``, takes the last ``@`` as the end of the user part, so the URL works unencoded): ``shown_url``
    matched the user only up to its ``@``, wrote ``nats://***@corp.example:<password>@host`` and the job log
    held the password."""
    for url in ("nats://alice@corp.example:pw-5e1d@head:4222", "nats://h:1,nats://alice@corp.example:pw-5e1d@h2:2"):
        r = _sbatch('shown_url "$URL"', URL=url)
        assert r.returncode == 0 and "pw-5e1d" not in r.stdout and r.stdout.count("***") >= 1, (url, r)


def test_compose_and_slurm_reach_up_s_liveness_time():
    """``up --fence-after-s S`` (8b468d5) gives the router its ``--fence-after-s`` and the planner its
    ``--silent-after-s`` through ``cluster.service_flags``, which deploy-args prints, but neither the entrypoint nor
    the Slurm job passed it to deploy-args: a compose or Slurm stack could set neither (a router given
    ``EI_FENCE_AFTER_S`` by hand would fence at S while its planner counted the node dead at 3 s). Now compose's
    ``EI_FENCE_AFTER_S`` and Slurm's ``FENCE_AFTER_S`` are up's flag, both services get the one time, and a bad
    value ends the auth job (compose) or the job (Slurm) once."""
    import tempfile

    CONFIGS.setdefault("planner", "services.planner.config:PlannerConfig")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        for role, field in (("router", "fence_after_s"), ("planner", "silent_after_s")):
            argv, env = _started(tmp_path, role, EI_FENCE_AFTER_S="7.5")
            assert getattr(_config(role, argv, env), field) == 7.5, (role, argv)
        argv, env = _started(tmp_path, "planner", EI_FENCE_AFTER_S="")  # compose's value when unset: the default
        assert "EI_FENCE_AFTER_S" not in env and "--silent-after-s" not in argv, (argv, env)
        creds = tmp_path / "creds"
        creds.mkdir()
        r = _run(tmp_path, "auth", EI_CREDS_DIR=str(creds), EI_CREDS_OUT=str(tmp_path / "out"), EI_FENCE_AFTER_S="0")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--fence-after-s 0" in r.stderr, r
    r = _sbatch('up_flags || exit; printf "%s\\n" "${UP_FLAGS[@]}"', FENCE_AFTER_S="7.5")
    assert r.returncode == 0, r.stderr
    flags = r.stdout.splitlines()
    assert flags[flags.index("--fence-after-s") + 1] == "7.5", flags
    assert "--silent-after-s" in deploy_args(flags, "planner")[0], flags
