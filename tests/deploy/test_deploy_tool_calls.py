"""Compose's ``EI_TOOL_CALL_PARSER`` and Slurm's ``TOOL_CALL_PARSER`` reach the router as ``up``'s
``--enable-auto-tool-choice --tool-call-parser NAME`` (vLLM's flags); a name ``up`` does not know ends the auth job."""

from __future__ import annotations

from evolving_infra.deploy_cli import deploy_args
from tests.deploy.test_deploy_settings import _config, _sbatch, _started
from tests.deploy.test_entrypoint_block_size import _run


def test_compose_passes_the_tool_call_parser_to_the_router(tmp_path):
    router, renv = _started(tmp_path, "router", EI_TOOL_CALL_PARSER="hermes")
    r = _config("router", router, renv)
    assert (r.enable_auto_tool_choice, r.tool_call_parser) == (True, "hermes"), router
    router, renv = _started(tmp_path, "router", EI_TOOL_CALL_PARSER="")  # compose's unset: no flag, no variable
    assert "--enable-auto-tool-choice" not in router and "EI_TOOL_CALL_PARSER" not in renv
    assert _config("router", router, renv).enable_auto_tool_choice is False
    creds = tmp_path / "creds"
    creds.mkdir()
    r2 = _run(tmp_path, "auth", EI_CREDS_DIR=str(creds), EI_CREDS_OUT=str(tmp_path / "out"), EI_TOOL_CALL_PARSER="qwen3_xml")
    assert r2.returncode == 2 and "invalid choice: 'qwen3_xml' (choose from 'hermes')" in r2.stderr, r2.stderr


def test_slurm_passes_the_tool_call_parser_to_deploy_args():
    r = _sbatch('up_flags || exit; printf "%s\\n" "${UP_FLAGS[@]}"', TOOL_CALL_PARSER="hermes")
    assert r.returncode == 0, r.stderr
    flags = r.stdout.splitlines()
    assert flags[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], flags
    router = deploy_args(flags, "router")[0]
    assert "--enable-auto-tool-choice" in router and router[router.index("--tool-call-parser") + 1] == "hermes", router


def test_slurm_passes_the_trust_request_chat_template_flag_to_deploy_args():
    """Slurm's ``TRUST_REQUEST_CHAT_TEMPLATE=1`` reaches the router as ``--trust-request-chat-template`` (before, a
    Slurm job could not set it); 0/empty leaves it off; another value ends the job (status 2) naming the variable."""
    r = _sbatch('up_flags || exit; printf "%s\\n" "${UP_FLAGS[@]}"', TRUST_REQUEST_CHAT_TEMPLATE="true")
    assert r.returncode == 0, r.stderr
    assert "--trust-request-chat-template" in deploy_args(r.stdout.splitlines(), "router")[0]
    for off in ("", "0"):
        r = _sbatch('up_flags || exit; printf "%s\\n" "${UP_FLAGS[@]}"', TRUST_REQUEST_CHAT_TEMPLATE=off)
        assert r.returncode == 0 and "--trust-request-chat-template" not in r.stdout, (off, r.stdout)
    r = _sbatch('up_flags || exit; printf "%s\\n" "${UP_FLAGS[@]}"', TRUST_REQUEST_CHAT_TEMPLATE="maybe")
    assert r.returncode == 2 and "TRUST_REQUEST_CHAT_TEMPLATE=maybe" in r.stdout + r.stderr, (r.stdout, r.stderr)
