"""Request logs and OTLP traces reachable from the command line (session 37 newcomer).

Tracing worked only through ``OTEL_EXPORTER_OTLP_ENDPOINT``, which no ``--help`` named; ``up`` had no
way to ask the router for per-request log lines. Now every service and ``up``/``demo`` take
``--otlp-traces-endpoint URL`` (vLLM's flag), ``up``/``demo --log-requests`` passes the router its
``--log-requests``, and the help texts name the standard variables.
"""

from __future__ import annotations

import importlib

import pytest

from evolving_infra.cli import UsageError, build_parser, main
from evolving_infra.cluster import LocalCluster
from evolving_infra.launcher import _spec
from shared import tracing
from shared.config import ConfigError, load_config

CONFIGS = {
    "router": "services.router.config:RouterConfig",
    "worker": "services.worker.config:WorkerConfig",
    "planner": "services.planner.config:PlannerConfig",
    "kvdirectory": "services.kvdirectory.config:DirectoryConfig",
}


def _config_class(service: str) -> type:
    mod, name = CONFIGS[service].split(":")
    return getattr(importlib.import_module(mod), name)


def _children(command: str, tmp_path, *flags: str):
    args = build_parser(command).parse_args([command, "--log-dir", str(tmp_path), *flags])
    return LocalCluster(_spec(args))._plan_children()


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_passes_the_otlp_endpoint_to_every_service_and_log_requests_to_the_router(command, tmp_path):
    url = "http://127.0.0.1:4318"
    kids = _children(command, tmp_path, "--otlp-traces-endpoint", url, "--log-requests")
    assert {k.name for k in kids} >= {"router", "planner", "kvdirectory", "worker-w0"}
    for kid in kids:
        argv = kid.argv
        i = argv.index("--otlp-traces-endpoint")
        assert argv[i + 1] == url, kid.name
        assert ("--log-requests" in argv) == (kid.name == "router" or kid.name.startswith("worker-")), kid.name
        # the service's own parser takes every flag up gives it
        service = argv[argv.index("-m") + 1].split(".")[1]
        cfg = load_config(_config_class(service), argv[argv.index("-m") + 2 :], prog=service, env={})
        assert cfg.otlp_traces_endpoint == url
        if service in ("router", "worker"):
            assert cfg.log_requests is True

    plain = _children(command, tmp_path)
    assert not any("--otlp-traces-endpoint" in k.argv or "--log-requests" in k.argv for k in plain)


def test_up_refuses_an_otlp_endpoint_that_is_not_a_url(tmp_path):
    args = build_parser("up").parse_args(["up", "--log-dir", str(tmp_path), "--otlp-traces-endpoint", "127.0.0.1:4318"])
    with pytest.raises(UsageError, match="--otlp-traces-endpoint '127.0.0.1:4318': an http:// or https:// URL"):
        _spec(args)


@pytest.mark.parametrize("service", sorted(CONFIGS))
def test_every_service_takes_the_endpoint_by_flag_or_environment_and_refuses_a_non_url(service):
    cls = _config_class(service)
    assert load_config(cls, ["--otlp-traces-endpoint", "https://otel.example/v1/traces"], env={}).otlp_traces_endpoint == (
        "https://otel.example/v1/traces"
    )
    assert load_config(cls, [], env={"EI_OTLP_TRACES_ENDPOINT": "http://c:4318"}).otlp_traces_endpoint == "http://c:4318"
    with pytest.raises(ConfigError, match="otlp_traces_endpoint"):
        load_config(cls, ["--otlp-traces-endpoint", "c:4318"], env={})


@pytest.mark.parametrize("service", sorted(CONFIGS))
def test_every_service_help_names_the_flag_and_the_standard_variables(service, capsys, monkeypatch):
    main_fn = importlib.import_module(f"services.{service}.__main__").main
    monkeypatch.setattr("sys.argv", [service, "--help"])
    with pytest.raises(SystemExit) as e:
        main_fn()
    assert e.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also at hyphens
    for word in ("--otlp-traces-endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME",
                 "EI_OTLP_TRACES_ENDPOINT"):  # fmt: skip
        assert word in text, word
    if service == "router":
        assert "--log-requests" in text and "EI_LOG_REQUESTS" in text


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_and_top_level_help_name_tracing_and_request_logs(command, capsys):
    sub = build_parser(command)._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    text = "".join(sub.format_help().split())
    for word in ("--otlp-traces-endpointURL", "OTEL_EXPORTER_OTLP_ENDPOINT", "--log-requests", "OTEL_SERVICE_NAME"):
        assert word in text, word
    with pytest.raises(SystemExit):
        main(["--help"])
    top = "".join(capsys.readouterr().out.split())
    assert "--otlp-traces-endpoint" in top and "OTEL_EXPORTER_OTLP_ENDPOINT" in top and "--log-requests" in top


def test_traces_url_follows_the_flag_then_the_otlp_variables():
    assert tracing.traces_url("", {}) is None
    assert tracing.traces_url("http://c:4318", {}) == "http://c:4318/v1/traces"
    assert tracing.traces_url("http://c:4318/", {}) == "http://c:4318/v1/traces"
    assert tracing.traces_url("http://c:4318/v1/traces", {}) == "http://c:4318/v1/traces"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318/"}
    assert tracing.traces_url("", env) == "http://a:4318/v1/traces"
    assert tracing.traces_url("http://c:4318", env) == "http://c:4318/v1/traces"  # the flag wins
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://b:9/custom"  # used as is (OTLP exporter spec)
    assert tracing.traces_url("", env) == "http://b:9/custom"
    assert tracing.traces_url("http://c:4318", {"OTEL_SDK_DISABLED": "true"}) is None
    assert tracing.wanted({}, "http://c:4318") and not tracing.wanted({})


def test_an_otlp_protocol_other_than_http_protobuf_is_named_in_a_warning():
    """``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` was silently ignored (spans still went over OTLP/HTTP)."""
    assert tracing.protocol_ignored({}) is None
    assert tracing.protocol_ignored({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) is None
    got = tracing.protocol_ignored({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert got is not None and got.startswith("OTEL_EXPORTER_OTLP_PROTOCOL=grpc ") and "http/protobuf" in got
    both = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}
    assert tracing.protocol_ignored(both).startswith("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json ")  # the signal's wins
    assert tracing.protocol_ignored({**both, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) is None


def test_deploy_args_gives_each_service_its_observability_flags_as_up_does():
    """``up --log-requests`` / ``--otlp-traces-endpoint`` were added by ``LocalCluster`` only, outside
    ``cluster.service_flags``: ``deploy-args`` (compose's entrypoint, the Slurm job) printed neither, so a
    deployment could not turn them on. Now each service gets them from ``service_flags``, as under ``up``."""
    from evolving_infra.deploy_cli import deploy_args

    url = "http://collector:4318"
    for service in ("kvdirectory", "planner", "router", "worker"):
        printed, _ = deploy_args(["--otlp-traces-endpoint", url, "--log-requests"], service)
        i = printed.index("--otlp-traces-endpoint")
        assert printed[i + 1] == url, (service, printed)
        assert ("--log-requests" in printed) == (service in ("router", "worker")), (service, printed)
        plain, _ = deploy_args([], service)
        assert "--otlp-traces-endpoint" not in plain and "--log-requests" not in plain, (service, plain)
