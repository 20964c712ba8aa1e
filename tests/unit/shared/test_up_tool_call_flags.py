"""``up``/``demo``/``deploy-args`` pass vLLM's tool-call flags to the router (``--enable-auto-tool-choice``,
``--tool-call-parser hermes``): without them a tool-using agent on an ``up`` cluster got vLLM's 400 for
``tool_choice`` ``auto`` and no way to turn the parser on but starting the router by hand."""

from __future__ import annotations

import pytest

from evolving_infra.cli import UsageError, build_parser
from evolving_infra.cluster import LocalCluster
from evolving_infra.launcher import _spec
from services.router.config import RouterConfig
from shared.config import ConfigError, load_config


def _router_argv(command: str, tmp_path, *flags: str) -> list[str]:
    args = build_parser(command).parse_args([command, "--log-dir", str(tmp_path), *flags])
    (router,) = [k for k in LocalCluster(_spec(args))._plan_children() if k.name == "router"]
    return router.argv[router.argv.index("-m") + 2 :]


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_passes_the_tool_call_flags_to_the_router(command, tmp_path):
    argv = _router_argv(command, tmp_path, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    cfg = load_config(RouterConfig, argv, prog="router", env={})  # the router's own parser takes them
    assert cfg.enable_auto_tool_choice is True and cfg.tool_call_parser == "hermes"
    plain = _router_argv(command, tmp_path)
    assert "--enable-auto-tool-choice" not in plain and "--tool-call-parser" not in plain


def test_up_refuses_a_parser_it_does_not_know_and_the_flag_without_a_parser(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser("up").parse_args(["up", "--tool-call-parser", "qwen3_xml"])
    assert "invalid choice: 'qwen3_xml' (choose from 'hermes')" in capsys.readouterr().err
    args = build_parser("up").parse_args(["up", "--log-dir", str(tmp_path), "--enable-auto-tool-choice"])
    with pytest.raises(UsageError, match=r"--enable-auto-tool-choice requires --tool-call-parser \(known: hermes\)"):
        _spec(args)


def test_the_router_refuses_the_same_at_start():
    with pytest.raises(ConfigError, match="--tool-call-parser 'qwen3_xml' is not known; known: hermes"):
        load_config(RouterConfig, ["--tool-call-parser", "qwen3_xml"], prog="router", env={})
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        load_config(RouterConfig, ["--enable-auto-tool-choice"], prog="router", env={})


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_passes_trust_request_chat_template_to_the_router(command, tmp_path):
    """vLLM's ``--trust-request-chat-template``: without a way to set it from ``up``, a request's own
    ``chat_template`` could only get the router's 400."""
    argv = _router_argv(command, tmp_path, "--trust-request-chat-template")
    assert load_config(RouterConfig, argv, prog="router", env={}).trust_request_chat_template is True
    plain = _router_argv(command, tmp_path)
    assert "--trust-request-chat-template" not in plain
    assert load_config(RouterConfig, plain, prog="router", env={}).trust_request_chat_template is False
