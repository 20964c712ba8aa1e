"""``evolving-infra trace ...``: validate, stats, convert, generate, sample, pack (spec: docs/trace-format.md).

A trace to read may be ``-`` (stdin), a trace to write ``-`` (stdout, uncompressed); a raw
``convert`` input may not (:mod:`evolving_infra.stdio_args`).

Exit status: 0 success; 2 bad input or arguments (an unreadable file, a conversion error, a
malformed trace: ``validate`` finding problems and ``stats`` refusing the same file agree, as the
README's rule says of an unreadable input); 1 a runtime failure (an output that cannot be written).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import IO, Any

from evolving_infra.stdio_args import STDIO, STDOUT_CLOSED, not_stdin, shown, stdin_file, write_stdout

__all__ = ["register"]


def cmd_validate(args: argparse.Namespace) -> int:
    from evolving_infra.traces.io import iter_validate

    status = 0
    for path in args.files:
        try:
            problems = list(iter_validate(stdin_file(path), chained=True))
        except OSError as e:
            print(f"{path}: cannot read: {e}", file=sys.stderr)
            status = 2
            continue
        if problems:  # a malformed trace is an unreadable input: 2, as stats and simulate --trace say of it
            status = 2
            for p in problems:
                print(f"{path}:{p.line}: {p.reason}")
            print(f"{path}: {len(problems)} problem(s)", file=sys.stderr)
        elif not args.quiet:
            print(f"{path}: ok")
    return status


def cmd_stats(args: argparse.Namespace) -> int:
    from evolving_infra.traces.convert.common import progress_iter
    from evolving_infra.traces.io import TraceError
    from evolving_infra.traces.stats import format_stats, trace_stats_file

    results: dict[str, dict[str, Any]] = {}
    status = 0
    for path in args.files:  # a file that cannot be read is named and skipped; the others are still reported
        # on unless --no-progress: a bar on a terminal, else a line every 5 s, as trace convert (a 17-s run was silent)
        wrap = None if args.progress is False else partial(progress_iter, enabled=True, desc="stdin" if path == "-" else path, unit="request")
        try:
            results[path] = trace_stats_file(stdin_file(path), wrap)
        except TraceError as e:
            print(shown(str(e)), file=sys.stderr)
            status = 2
        except OSError as e:
            print(f"{path}: cannot read: {e}", file=sys.stderr)
            status = 2
    if not results:
        return status
    if args.json:
        obj = results[args.files[0]] if len(args.files) == 1 else results
        print(json.dumps(obj, indent=2))
    else:
        print("\n\n".join(format_stats(s) for s in results.values()))
    return status


def cmd_convert(args: argparse.Namespace) -> int:
    from evolving_infra.traces.convert import ConvertError, convert_to_file, input_files

    options: dict[str, object] = {}
    if args.block_size is not None:
        options["block_size"] = args.block_size
    if args.from_kind == "claude-code-weka":
        options["shared_prefix"] = not args.no_shared_prefix
    elif args.no_shared_prefix:
        print("error: --no-shared-prefix applies to claude-code-weka only", file=sys.stderr)
        return 2
    if args.from_kind == "mooncake":
        options["infer_sessions"] = args.infer_sessions
        options["min_shared_blocks"] = args.min_shared_blocks
    elif args.infer_sessions:
        print("error: --infer-sessions applies to mooncake only", file=sys.stderr)
        return 2
    if args.from_kind in SKIPPING_CONVERTERS:
        options["strict"] = args.strict
    if args.from_kind == "openai-chat":
        options["tokenizer"] = args.tokenizer or "sim"
    elif args.tokenizer is not None:
        print("error: --tokenizer applies to openai-chat only", file=sys.stderr)
        return 2
    try:  # an output that is a file of a folder named as input would replace it too
        files: Sequence[Any] = input_files(args.from_kind, args.inputs)
    except ConvertError:  # named by convert_to_file below, as before
        files = args.inputs
    if _bad_output(args.output, files):
        return 2
    progress = args.progress is not False  # on unless --no-progress: a bar on a terminal, else a line every 5 s (progress_iter)
    try:
        header, n = _write(args.output, lambda out: convert_to_file(args.from_kind, args.inputs, out, progress=progress, **options))
    except ConvertError as e:
        print(f"error: {e}" + (" (--strict)" if args.strict else ""), file=sys.stderr)
        return 2
    except OSError as e:
        return _write_failed(args.output, e)
    counts = header.meta.get("counts", {})
    extra = ", ".join(f"{k} {v}" for k, v in counts.items() if k != "requests")
    print(f"{args.output}: {n} requests" + (f" ({extra})" if extra else ""), file=sys.stderr)
    skipped = header.meta.get("skipped") or {}
    if skipped.get("count"):
        listed = "" if len(skipped.get("files", ())) >= skipped["count"] else f"the first {len(skipped['files'])} "
        print(f"{args.output}: skipped {skipped['count']} file(s) that could not be converted (named above; "
              f"{listed}listed in the header's meta.skipped; --strict stops at the first instead)", file=sys.stderr)
    if skipped.get("rows_count"):
        print(f"{args.output}: skipped {skipped['rows_count']} malformed row(s) (named above; the first "
              f"{len(skipped['rows'])} listed in the header's meta.skipped.rows; --strict stops at the first instead)",
              file=sys.stderr)
    return 0


SKIPPING_CONVERTERS = ("claude-code-weka", "mini-swe-agent", "mooncake", "azure", "openai-chat")
"""Converters that skip a file they cannot read, and (mooncake, azure) a malformed row, naming it
with the reason on stderr (``--strict``: stop at the first)."""


TARGETS_TESTED_WITH: dict[str, dict[str, int]] = {
    "putnam": {},
    "osworld": {},
    "claude-code": {"agents": 530, "block_size": 4096},
    "shift": {"agents": 16},
}
"""The ``generate`` options (seed 0) at which ``tests/unit/traces/test_generate.py`` checks each workload's
targets within their tolerance. Claude Code with as many agents as real sessions (rare events: ~0.08 % of
requests spawn sub-agents, so the default 90 agents see a handful) and 4096-token blocks (only h* depends on
the block size, and it is not a target; this keeps the test fast); shift at 16 first-hour agents."""


def _targets_off_line(args: argparse.Namespace, bad: int, agents: int, requests: int) -> str:
    """``trace generate --check``'s summary when ``bad`` targets are off: which options were given (they change
    what is expected) and at which options the targets are tested. At the defaults it blamed "non-default
    options" that were not given."""
    flags = {"agents": "--agents", "duration": "--duration", "requests_per_agent": "--requests-per-agent"}
    given = [f"{flag} {getattr(args, k):g}" for k, flag in flags.items() if getattr(args, k) is not None]
    if args.seed != 0:
        given.insert(0, f"--seed {args.seed}")
    tested = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in TARGETS_TESTED_WITH.get(args.kind, {}).items() if k != "block_size")
    line = (f"{bad} target(s) off by more than their tolerance in this trace ({agents} agents, {requests} requests); "
            f"tests/unit/traces/test_generate.py checks them for {args.kind} at --seed 0 "
            + (tested if tested else "and the default options") + (f" (given here: {' '.join(given)})" if given else "")
            + ": a smaller sample's statistics vary with the seed, rare events' (sub-agent spawns, compactions) most")
    if args.duration is not None or args.requests_per_agent is not None:
        line += "; --duration and --requests-per-agent also change what is expected (task lengths are not the fit's)"
    return line


def cmd_generate(args: argparse.Namespace) -> int:
    from evolving_infra.traces.generate import GENERATORS, GenerateError, generate
    from evolving_infra.traces.io import write_trace

    if args.duration is not None and args.requests_per_agent is not None:
        print("error: give --duration or --requests-per-agent, not both", file=sys.stderr)
        return 2
    if _bad_output(args.output):
        return 2
    try:
        trace = generate(
            args.kind,
            seed=args.seed,
            agents=args.agents,
            duration_s=args.duration,
            requests_per_agent=args.requests_per_agent,
            block_size=args.block_size,
        )
    except GenerateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        n = _write(args.output, lambda out: write_trace(out, trace.header, trace.requests))
    except OSError as e:
        return _write_failed(args.output, e)
    print(f"{args.output}: {n} requests, {len(trace.agents())} agents ({GENERATORS[args.kind]})", file=sys.stderr)
    if args.check:  # on stderr when stdout carries the trace
        report = sys.stderr if args.output == STDIO else sys.stdout
        from evolving_infra.traces.generate.common import check_trace_targets, targets_from_meta

        bad = 0
        for t, actual, ok in check_trace_targets(trace, targets_from_meta(trace.header.meta)):
            bad += not ok
            where = f" [{t.subset}]" if t.subset else ""
            print(f"  {'ok ' if ok else 'OFF'} {t.key}{where}: target {t.value:g}, got {actual:g}  ({t.source})", file=report)
        if bad:
            print(_targets_off_line(args, bad, len(trace.agents()), len(trace.requests)), file=sys.stderr)
    return 0


def _read(read: Callable[[str], Any], path: str) -> Any:
    """``read(path)`` (``-``: stdin), or None once the reason it cannot be read is printed (every
    bad line, or the OS error)."""
    from evolving_infra.traces.io import TraceError

    try:
        return read(stdin_file(path))
    except TraceError as e:
        print(shown(str(e)), file=sys.stderr)
    except OSError as e:
        print(f"{path}: cannot read: {e}", file=sys.stderr)
    return None


def _bad_output(path: str, inputs: Sequence[str] = ()) -> bool:
    """True once the reason ``path`` cannot be written is printed (checked before reading anything);
    ``-`` (stdout) can be written unless the command was started with it closed (``>&-``), and an
    input ``-`` (stdin) is no file it could replace."""
    from evolving_infra.traces.io import output_error

    if path == STDIO:
        if sys.stdout is None:
            print(f"error: -: cannot write: {STDOUT_CLOSED}", file=sys.stderr)
            return True
        return False
    why = output_error(path, inputs=[i for i in inputs if i != STDIO])
    if why:
        print(f"error: {why}", file=sys.stderr)
    return why is not None


def _write(path: str, write: Callable[[str | IO[bytes]], Any]) -> Any:
    """``write(path)``, or ``write(stdout)`` for ``-``."""
    return write_stdout(write) if path == STDIO else write(path)


def _write_failed(path: str, e: OSError) -> int:
    """Exit status 2 once a write that failed midway (disk full, ...) is named with its reason.

    Raises:
        BrokenPipeError: ``e``, for ``-``: stdout's reader stopped early (``| head``), which
            ``evolving_infra.cli.main`` ends quietly.
    """
    if path == STDIO and isinstance(e, BrokenPipeError):
        raise e
    print(f"error: {path}: cannot write: {e}", file=sys.stderr)
    return 2


def cmd_sample(args: argparse.Namespace) -> int:
    from evolving_infra.traces.io import read_trace, sample_sessions, write_trace

    for flag, value in (("--sessions", args.sessions), ("--max-requests-per-branch", args.max_requests_per_branch)):
        if value < 0:  # sample_sessions' ValueError was a traceback after the whole trace was read
            print(f"error: {flag} must be >= 0 (0 = no limit), not {value}", file=sys.stderr)
            return 2
    if _bad_output(args.output, [args.input]):
        return 2
    trace = _read(read_trace, args.input)
    if trace is None:
        return 2
    out = sample_sessions(trace, args.sessions or 10**12, seed=args.seed, max_requests_per_branch=args.max_requests_per_branch or None)
    try:
        n = _write(args.output, lambda f: write_trace(f, out.header, out.requests))
    except OSError as e:
        return _write_failed(args.output, e)
    print(f"{args.output}: {n} requests, {len(out.agents())} agents", file=sys.stderr)
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    """``trace pack IN OUT``: the trace read (and validated) once, written as a packed trace."""
    from evolving_infra.traces.compact import read_trace_compact
    from evolving_infra.traces.pack import write_packed

    if _bad_output(args.output, [args.input]):
        return 2
    trace = _read(read_trace_compact, args.input)
    if trace is None:
        return 2
    try:
        size = _write(args.output, lambda f: write_packed(f, trace))
    except OSError as e:
        return _write_failed(args.output, e)
    print(f"{args.output}: {len(trace.requests)} requests, {trace.store.stored_ids} block ids stored, {size:,} bytes",
          file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``trace`` command group to the top-level CLI."""
    from evolving_infra.traces.convert import CONVERTERS
    from evolving_infra.traces.generate import GENERATORS

    p = sub.add_parser(
        "trace",
        help="canonical agent traces: validate, stats, convert, generate, sample, pack",
        description="Work with canonical agent traces (docs/trace-format.md).",
    )
    tsub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)

    v = tsub.add_parser(
        "validate", help="check a trace (format invariants, then chained block ids); report every bad line with its number and reason"
    )
    v.add_argument("files", nargs="+", help="trace files (.jsonl or .jsonl.gz; - reads stdin; a packed .eipack is a problem: validate "
                   "the trace it was packed from); exit status 2 when "
                   "any has a problem or cannot be read (as stats and simulate --trace for the same file), 0 when all are valid")
    v.add_argument("-q", "--quiet", action="store_true", help="print nothing for valid files")
    v.set_defaults(func=cmd_validate)

    s = tsub.add_parser("stats", help="requests, sessions, branches, compactions, token and pause distributions, h*")
    s.add_argument("files", nargs="+", help="trace files (- reads stdin); one that cannot be read is named on stderr and "
                   "skipped, the others still reported (exit status 2)")
    s.add_argument("--json", action="store_true", help="print a JSON object (one file) or {file: object} (several; "
                   "the files read)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None, help="show progress on stderr (default): a bar on a terminal, else a line every 5 s")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress")
    s.set_defaults(func=cmd_stats)

    c = tsub.add_parser("convert", help="convert public traces into the canonical format")
    c.add_argument("--from", dest="from_kind", required=True, choices=sorted(CONVERTERS), help="input kind")
    c.add_argument("inputs", nargs="+", type=not_stdin, help="input files or folders (not stdin)")
    c.add_argument("-o", "--output", required=True, help="output trace (.jsonl, or .jsonl.gz to compress; - writes stdout, uncompressed)")
    c.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="output block size in tokens (default: the source's, 64 for claude-code-weka / mini-swe-agent / azure / openai-chat, "
        "512 for mooncake); conversion rule in docs/trace-format.md §4",
    )
    c.add_argument("--no-shared-prefix", action="store_true", help="claude-code-weka: keep the tool+system prefix per session")
    c.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first file (and, for mooncake / azure / openai-chat, the first row) that cannot be converted (default: "
        "name it with the reason, skip it, go on and report how many were skipped)",
    )
    c.add_argument("--infer-sessions", action="store_true", help="mooncake: link rows that extend an earlier row's path into agents")
    c.add_argument("--min-shared-blocks", type=int, default=2, help="mooncake: shortest earlier path a row may extend (default 2)")
    c.add_argument("--tokenizer", default=None, help="openai-chat: tokenizer of the rendered messages, sim (default) or "
                   "hf:<tokenizer.json or model folder> (docs/trace-format.md §7.5)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None, help="show progress on stderr (default): a bar on a terminal, else a line every 5 s")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress")
    c.set_defaults(func=cmd_convert)

    gen = tsub.add_parser("generate", help="generate a calibrated synthetic agent workload")
    gen.add_argument("kind", choices=sorted(GENERATORS), help="workload")
    gen.add_argument("--seed", type=int, default=0, help="RNG seed (same seed and options: byte-identical output)")
    gen.add_argument("-o", "--output", required=True, help="output trace (.jsonl or .jsonl.gz; - writes stdout, uncompressed)")
    gen.add_argument("--agents", type=int, default=None, help="agents to generate (default per workload)")
    gen.add_argument("--duration", type=float, default=None, help="each agent runs until its estimated busy time reaches this many seconds (default: a task length drawn from the workload's fit)")
    gen.add_argument("--requests-per-agent", type=int, default=None, help="main-branch requests per agent (instead of the fitted task length)")
    gen.add_argument("--block-size", type=int, default=64, help="tokens per block id (default 64)")
    gen.add_argument("--check", action="store_true", help="print the calibration targets against the generated trace's stats")
    gen.set_defaults(func=cmd_generate)

    sm = tsub.add_parser("sample", help="keep N agents and cap every branch (sample_sessions)")
    sm.add_argument("input", help="trace file (- reads stdin)")
    sm.add_argument("-o", "--output", required=True, help="output trace (- writes stdout, uncompressed)")
    sm.add_argument("--sessions", type=int, default=0, help="agents to keep (0 = all)")
    sm.add_argument("--max-requests-per-branch", type=int, default=0, help="keep each branch's first K requests (0 = no cap)")
    sm.add_argument("--seed", type=int, default=0, help="seed of the agent draw (default 0)")
    sm.set_defaults(func=cmd_sample)

    pk = tsub.add_parser(
        "pack",
        help="read a trace once (validated) and write it packed, for simulate --trace to load without parsing JSON",
        description="Write the trace as simulate holds it (request stubs and block ids as prefix differences) in one "
        "binary file (docs/trace-format.md §10). simulate --trace FILE.eipack runs exactly what simulate --trace "
        "of the input runs, and loads it ~10x faster; the other trace commands read the .jsonl[.gz].",
    )
    pk.add_argument("input", help="trace file (.jsonl or .jsonl.gz; - reads stdin)")
    pk.add_argument("output", help="packed trace to write (e.g. trace.eipack; - writes stdout)")
    pk.set_defaults(func=cmd_pack)


def main(argv: list[str] | None = None) -> int:
    """Run the ``trace`` group alone (``python -m evolving_infra.traces.cli ...``)."""
    from evolving_infra.cli import OneLineErrorParser  # its usage errors read as evolving-infra's: one line

    parser = OneLineErrorParser(prog="evolving-infra")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["trace", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

