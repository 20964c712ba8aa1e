"""``evolving-infra``: running a command imports only the module that registers it."""

from __future__ import annotations

import os
import subprocess
import sys

from evolving_infra.cli import COMMANDS, build_parser


def _choices(parser) -> set[str]:
    sub = next(a for a in parser._actions if a.dest == "command")
    return set(sub.choices)


def test_commands_table_names_every_command_and_its_module() -> None:
    assert set(COMMANDS) == _choices(build_parser())
    for cmd in COMMANDS:
        assert cmd in _choices(build_parser(cmd)), cmd


def test_simulate_imports_neither_the_live_stack_nor_scipy_nor_asyncio() -> None:
    # nor process pools (imported when a sweep or partitions make one)
    code = ("import sys; from evolving_infra.cli import build_parser; build_parser('simulate'); "
            "import evolving_infra.sim.run, evolving_infra.sim.sweep; print(' '.join(m for m in ('nats', 'scipy', 'asyncio', "
            "'evolving_infra.launcher', 'multiprocessing', 'concurrent.futures') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_simulate_runs_numpy_without_a_blas_thread_pool_unless_the_user_sets_one() -> None:
    # COMMAND_ENV: set before the command's module is imported, so before numpy (which the simulator
    # imports on its first use, shared.lazy_numpy: a run whose trace comes from the cache never does); a user's
    # value wins
    code = ("import os, sys; from evolving_infra.cli import main\n"
            "try:\n    main(['simulate', '--help'])\nexcept SystemExit:\n    pass\n"
            "before = 'numpy' in sys.modules\n"
            "import evolving_infra.sim.run\n"
            "print(os.environ.get('OPENBLAS_NUM_THREADS'), before, 'numpy' in sys.modules, file=sys.stderr)")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stderr.split()
    assert out == ["1", "False", "False"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(env, OPENBLAS_NUM_THREADS="3")).stderr.split()
    assert out == ["3", "False", "False"]


def test_a_command_leaves_the_package_version_unread_unless_asked() -> None:
    # --version looks the version up when given (importlib.metadata: ~35 ms of imports, email, zipfile,
    # csv, and a metadata read), not each time a parser is built: every command paid it, simulate too
    # (up, split, tap and deploy-args import the live stack, whose libraries read package metadata themselves)
    code = ("import sys; from evolving_infra.cli import build_parser\n"
            "for c in ('simulate', 'trace', 'report', 'replay', 'fidelity'): build_parser(c)\n"
            "print('importlib.metadata' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_simulate_builds_its_parser_and_imports_with_the_gc_paused_and_restores_it(monkeypatch) -> None:
    # GC_PAUSED_COMMANDS: no collection during simulate's parser build and imports (~45 of them, ~10 ms,
    # freed almost nothing); the state is restored when the command returns or raises; others untouched
    import gc

    import evolving_infra.sim.cli as sim_cli
    from evolving_infra.cli import main

    seen: list[bool] = []

    def fake(args) -> int:
        seen.append(gc.isenabled())
        if args.label == "boom":
            raise RuntimeError("boom")
        return 0

    monkeypatch.setattr(sim_cli, "cmd_simulate", fake)
    assert gc.isenabled()
    assert main(["simulate", "--workload", "claude-code", "--label", "ok"]) == 0
    assert gc.isenabled()
    try:
        main(["simulate", "--workload", "claude-code", "--label", "boom"])
    except RuntimeError:
        pass
    assert gc.isenabled()
    gc.disable()  # a caller's paused GC stays paused
    try:
        assert main(["simulate", "--workload", "claude-code", "--label", "ok"]) == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert seen == [False, False, False]
    code = ("import gc, sys; from evolving_infra.cli import main\n"
            "try:\n    main(['report', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == "True"


def test_a_router_config_without_a_tool_call_parser_does_not_import_the_parser_module() -> None:
    # simulate builds a RouterConfig per run and never parses tool calls: toolcalls pulls in secrets -> hmac ->
    # _hashlib (4-10 ms of each run); a parser named is still checked at once
    code = ("import sys; from services.router.config import RouterConfig; RouterConfig()\n"
            "print('services.router.toolcalls' in sys.modules)\n"
            "try:\n    RouterConfig(tool_call_parser='nope')\nexcept ValueError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["False", "--tool-call-parser 'nope' is not known; known: hermes"]
