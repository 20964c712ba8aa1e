"""``evolving-infra``: the one command users run.

Each feature area registers its own subcommands (``register(subparsers)`` in its
module), so this file only lists them. Every command that writes a report
takes ``--out DIR`` and leaves ``DIR/report.json`` there.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import re
import shlex
import shutil
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from evolving_infra.out_folder import OUTPUTS_ELSEWHERE
from evolving_infra.stdio_args import READER_GONE

# Modules that contribute subcommands, in the order `--help` lists them.
COMMAND_MODULES = (
    "evolving_infra.launcher",  # up, demo
    "evolving_infra.replay.cli",  # replay
    "evolving_infra.traces.cli",  # trace validate|stats|convert|generate
    "evolving_infra.tap",  # tap
    "evolving_infra.report.cli",  # report show|compare
    "evolving_infra.split_cli",  # split get|set
    "evolving_infra.status_cli",  # status
    "evolving_infra.sim.cli",  # simulate, fidelity
    "evolving_infra.model_cli",  # model init (torch engine)
    "evolving_infra.auth_cli",  # auth gen
    "evolving_infra.deploy_cli",  # deploy-args
)


COMMANDS = {
    "up": "evolving_infra.launcher",
    "demo": "evolving_infra.launcher",
    "replay": "evolving_infra.replay.cli",
    "trace": "evolving_infra.traces.cli",
    "tap": "evolving_infra.tap",
    "report": "evolving_infra.report.cli",
    "split": "evolving_infra.split_cli",
    "status": "evolving_infra.status_cli",
    "simulate": "evolving_infra.sim.cli",
    "fidelity": "evolving_infra.sim.cli",
    "model": "evolving_infra.model_cli",
    "auth": "evolving_infra.auth_cli",
    "deploy-args": "evolving_infra.deploy_cli",
}
"""The module that registers each command: running a command imports only its module (the
others pull in the live stack — NATS client, metrics, asyncio services — ~0.5 s of CPU that
``simulate`` does not use); ``--help`` or an unknown command imports them all. A module that
registers several commands may register one alone as ``register_<command>(subparsers)``: running
that command then builds (and imports) only its own parser (``simulate`` leaves ``fidelity``'s
module unimported)."""

COMMAND_ENV: dict[str, dict[str, str]] = {"simulate": {"OPENBLAS_NUM_THREADS": "1"}}
"""Environment defaults a command sets before its module is imported (a value the user set
wins). ``simulate`` is a Python event loop whose numpy work is element-wise or on arrays of a few
hundred elements, which OpenBLAS runs on one thread anyway; the thread pool it starts when numpy is
imported (one thread per core) only costs CPU: ~0.1 s of the ~2.5 s of user time of a 600 s,
9-node run at 512-token blocks on a 2-core box (its partition workers inherit the setting)."""


GC_PAUSED_COMMANDS = frozenset({"simulate"})
"""Commands that run with the cyclic GC paused from their parser's build to their return (it is
restored after). ``simulate`` pauses it around its setup anyway (``traces.io.paused_gc``) and runs
its loop under its own settings (``sim.run.quiet_gc``), but the imports before that, its parser's
and the simulator's (numpy: ~100 ms), ran under the default thresholds: ~45 collections that freed
almost nothing, ~10 ms of a ~0.35-s start-up (its output does not depend on them)."""


class _PackageVersion(argparse.Action):
    """``--version``: prints ``PROG VERSION`` on stdout and exits 0, as argparse's ``version`` action,
    but looks the version up (:func:`shared.package_version`: ``importlib.metadata``, ~35 ms of
    imports — email, zipfile, csv — and ~3 ms of reading the installed metadata) only when the flag
    is given, not each time a parser is built (every command, ``simulate`` included, paid it)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:  # noqa: A002 (argparse's name)
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from shared import package_version

        try:  # as argparse's version action: no stdout, or its reader gone (| head -0), is no error
            sys.stdout.write(f"{parser.prog} {package_version()}\n")
        except (AttributeError, OSError):
            pass
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line parser: only ``command``'s subcommand when it is a known command
    (:data:`COMMANDS`), else every module's."""
    parser = OneLineErrorParser(
        prog="evolving-infra",
        description="Agent-adaptive LLM serving on a prefill-decode disaggregated cluster.",
        epilog=OBSERVABILITY + " " + EXIT_STATUSES,
    )
    parser.add_argument("--version", action=_PackageVersion,
                        help="print the installed package's version (what a router's GET /version serves) and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    one = command is not None and command in COMMANDS
    for name in (COMMANDS[command],) if command is not None and one else COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        register = getattr(module, f"register_{command}", None) if one else None
        (register or module.register)(sub)
    return parser


class OneLineErrorParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr, as ``--help`` says of a usage error:
    ``evolving-infra up: error: argument --routers: invalid int value: 'x' (see 'evolving-infra up --help')``,
    exit status :data:`USAGE_ERROR`. argparse printed its whole usage block first (25 lines for ``up``), and an
    unknown flag of a subcommand (``up --bogus``) was reported by the top parser as ``evolving-infra: error:``;
    :meth:`parse_args` reports it as the subcommand's. Subparsers are of this class too (``add_subparsers``
    makes its parser's own class), so every subcommand, nested ones (``trace validate``) included, answers so.
    """

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (see 'PROG --help')`` and exit 2. Only the newlines in ``message`` (and the
        indentation after them) are folded: a user's value quoted in it keeps its own spaces."""
        text = _NEWLINES.sub(" ", message).strip()
        self.exit(USAGE_ERROR, f"{self.prog}: error: {text} (see '{self.prog} --help')\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None) -> argparse.Namespace:  # type: ignore[override]
        """As argparse's, but arguments no parser took are an error of the parser whose part of ``args`` they are in
        (:meth:`_owner`)."""
        argv = list(sys.argv[1:] if args is None else args)
        ns, extras = self.parse_known_args(argv, namespace)
        if extras:
            self._owner(argv, extras).error("unrecognized arguments: " + " ".join(extras))
        return ns

    def _owner(self, argv: Sequence[str], extras: Sequence[str]) -> argparse.ArgumentParser:
        """The parser whose part of ``argv`` holds ``extras``: ``argv`` splits at each subcommand it names (a token
        that is a choice of the current parser's subcommands descends into it); what comes before the first is
        ``self``'s (``evolving-infra --bogus up`` is the top parser's error, not ``up``'s). Extras spread over more
        than one part are ``self``'s. argparse returns the extras in ``argv`` order, so each is found at or after
        the previous one; one not found as a token (argparse rewrote it) counts in the deepest part."""
        starts: list[tuple[int, argparse.ArgumentParser]] = [(0, self)]  # (first index of the part, its parser)
        p: argparse.ArgumentParser = self
        for i, tok in enumerate(argv):
            subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
            if not subs:
                break
            if tok in subs[0].choices:
                p = subs[0].choices[tok]
                starts.append((i + 1, p))
        owners: list[argparse.ArgumentParser] = []
        at = 0
        for x in extras:
            found = next((j for j in range(at, len(argv)) if argv[j] == x), None)
            if found is None:
                owners.append(starts[-1][1])
                continue
            owners.append(next(q for first, q in reversed(starts) if first <= found))
            at = found + 1
        return owners[0] if all(o is owners[0] for o in owners) else self


_NEWLINES = re.compile(r"[ \t]*\n\s*")
"""A newline in an argparse message, with the blanks around it (its wrapped help text): folded to one space."""


RUNTIME_FAILURE = 1
"""Exit status of a command that was given valid options but failed (a service died, a report could not be
written, a missing optional package); a command prints why on stderr."""

USAGE_ERROR = 2
"""Exit status of a usage error (a bad option value, options that conflict), found before anything starts;
one line on stderr. argparse exits 2 for the errors it finds itself (an unknown flag, a missing argument),
as most Unix tools do; the commands' own checks raise :class:`UsageError` for the same status."""

INTERRUPTED = 130
"""Exit status of a command ended by Ctrl-C (SIGINT): 128 + 2, as a shell reports a process its
SIGINT killed, and as ``simulate`` returns."""

EXIT_STATUSES = (
    f"exit status: 0 ok; {RUNTIME_FAILURE} runtime failure (the options were right but the run failed: a service "
    f"died, requests failed, a package is missing; the reason on stderr); {USAGE_ERROR} usage error (a bad option "
    "value or options that conflict, one line on stderr, before anything starts; also an unreadable input or an "
    "unwritable output, and for split, tap and replay no running cluster or NATS server to talk to; status exits 1 "
    "for no running cluster, or its router not answering); "
    f"{INTERRUPTED} interrupted (Ctrl-C); 143 stopped by SIGTERM (demo and replay, which stop as for Ctrl-C; "
    f"demo 129 for SIGHUP; up and tap exit 0); 3 up or demo --no-restart: a service exited 0 on its own (no crash; "
    f"see up --help); {OUTPUTS_ELSEWHERE} simulate (a --sweep too), replay, demo and fidelity: the run ended but its outputs went to a new "
    "OUT/run-ID/ (an item's or side's to OUT/SUB/run-ID/; named on stderr), because the earlier run's could not be moved to "
    f"OUT/previous/ then (a 'report show' of it running, your files put there): OUT/report.json is still the earlier run's; "
    f"{READER_GONE} stdout's reader went away (| head)"
)
"""The epilog of ``evolving-infra --help``: the statuses :func:`main` returns."""

OBSERVABILITY = (
    "logs and traces: up/demo write each service's log under --log-dir (JSON lines; --log-level debug for routing "
    "decisions); up/demo --log-requests (router --log-requests, EI_LOG_REQUESTS=1) logs every request accepted and "
    "finished under its X-Request-ID; --otlp-traces-endpoint URL (up/demo and every service; or the standard "
    "OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_TRACES_SAMPLER) exports OpenTelemetry "
    "traces over OTLP/HTTP, one trace per request across the processes (service.name evolving-infra-<service>)."
)
"""The part of ``evolving-infra --help``'s epilog that says where logs and traces come from."""


class UsageError(SystemExit):
    """A usage error found by a command's own checks (a bad option value, options that conflict):
    :func:`main` prints the message (one line, ``error: ...``) on stderr and returns :data:`USAGE_ERROR`.

    A :class:`SystemExit` whose ``str()`` is the message, as the ``SystemExit("error: ...")`` it replaces
    (which exited 1, the status of a runtime failure); its ``code`` is :data:`USAGE_ERROR`, so that outside
    :func:`main` it still exits 2 (without the message: Python prints a SystemExit's code only when it is
    not an int).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = USAGE_ERROR


def command_name(cwd: str | os.PathLike[str] | None = None) -> str:
    """``evolving-infra`` as the user can type it in the shell they ran this one from, for the commands a
    command prints (the demo's baseline line): bare ``evolving-infra`` only when the ``evolving-infra`` on
    ``PATH`` is the one running; else the path of the running console script (``.venv/bin/evolving-infra``
    after ``make demo`` in a fresh clone, whose venv is not activated; relative to ``cwd`` when under it,
    else absolute); else, run as ``python -m evolving_infra.cli`` with no script beside the interpreter,
    that interpreter with ``-m evolving_infra.cli``.

    Args:
        cwd: the folder the shell is in (default: this process's).
    """
    cwd = os.path.abspath(cwd if cwd is not None else os.getcwd())

    def shown(path: str) -> str:
        rel = os.path.relpath(os.path.abspath(path), cwd)
        text = os.path.abspath(path) if rel.startswith(os.pardir) else rel
        return shlex.quote(text if os.sep in text else os.path.join(os.curdir, text))  # a bare name would be looked up on PATH

    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if os.path.basename(argv0) == "evolving-infra" and os.path.isfile(argv0):
        script = argv0
    else:
        script = os.path.join(os.path.dirname(sys.executable), "evolving-infra")
        if not os.path.isfile(script):
            return f"{shown(sys.executable)} -m evolving_infra.cli"
    found = shutil.which("evolving-infra")
    if found and os.path.realpath(found) == os.path.realpath(script):
        return "evolving-infra"
    return shown(script)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status.

    Ctrl-C (``KeyboardInterrupt``) anywhere in a command that does not handle it itself (``trace``,
    ``report``, ``fidelity``, ...; ``up`` and ``tap`` stop cleanly with status 0, ``demo`` stops its cluster and
    returns 130, ``replay`` writes what completed and returns 130, ``simulate`` prints its own line and returns 130)
    ends it with one line on stderr and status :data:`INTERRUPTED`, not a traceback; the
    writers it interrupts remove what they had begun (``OUT.tmp``, the folders made for it) as the
    exception passes through them. The statuses: :data:`EXIT_STATUSES` (``evolving-infra --help``'s epilog; 4,
    :data:`~evolving_infra.out_folder.OUTPUTS_ELSEWHERE`: a run's outputs written to ``OUT/run-ID/``).
    """
    if argv is None:  # this process's own command line (shared.signals.claim_process): before the imports
        from shared.signals import claim_process

        claim_process()
        if sys.argv[1:2] == ["up"]:
            catch_up_stop_signals()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        if sys.stderr is not None:  # on a line of its own after the terminal's ^C; stdout may carry a trace (-o -)
            command = " ".join(argv[:2] if argv[:1] == ["trace"] else argv[:1]) if argv and argv[0] in COMMANDS else ""
            print(f"\nevolving-infra{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return INTERRUPTED


UP_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that stop ``up`` (SIGHUP: the terminal closed; kept ignored under ``nohup``)."""


def catch_up_stop_signals() -> None:
    """``up``'s stop signals from the first line of its process on (:func:`shared.signals.catch_early`): one sent while
    it imports (about a second of CPU, more on a loaded box) and checks its options stops it as one sent later does,
    "stopped during start-up" and status 0 (``up --help``), once its loop's handlers are set
    (``evolving_infra.launcher._stop_on_signals`` takes what was caught). Before, such a SIGTERM killed it (-15)
    without a word. A second one before those handlers are set aborts at once (a start-up stuck there, an
    ``--api-keys-file`` pipe nobody writes, is not stuck for good): 130 and "interrupted" for Ctrl-C, 128 + the
    signal else (SIGTERM 143, SIGHUP 129). Only ``main`` called with the process's own arguments does this (a test's in-process ``main([...])``
    keeps its signals); in the main thread."""
    from shared.signals import catch_early

    catch_early(UP_STOP_SIGNALS)


def _main(argv: list[str]) -> int:
    if argv and argv[0] in GC_PAUSED_COMMANDS and gc.isenabled():
        gc.disable()
        try:
            return _run(argv)
        finally:
            gc.enable()
    return _run(argv)


def _run(argv: list[str]) -> int:
    for key, value in COMMAND_ENV.get(argv[0] if argv else "", {}).items():
        os.environ.setdefault(key, value)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:  # stdout's reader stopped early (| head): quiet, as cat's SIGPIPE
        from evolving_infra.stdio_args import reader_gone

        if not reader_gone():
            raise
        return READER_GONE
    return int(rc or 0)


if __name__ == "__main__":  # python -m evolving_infra.cli: run the module's main, not this __main__ copy's, so that
    # the UsageError the commands import from evolving_infra.cli is the class its main catches
    from evolving_infra.cli import main as module_main

    sys.exit(module_main())
