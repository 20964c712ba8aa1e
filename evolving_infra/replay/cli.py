"""``evolving-infra replay``: the harness side, against a running cluster's router.

Nothing measured is thrown away: each answered request is appended to
``OUT/requests.partial-<run_id>.jsonl`` as it completes (:func:`~evolving_infra.out_folder.partial_records`: a
killed replay keeps them there); SIGINT (Ctrl-C) or SIGTERM stops sending,
cancels the requests in flight and writes ``OUT/report.json`` from what completed
(``meta.interrupted``); the report and the final ``requests.jsonl`` are written atomically, then the partial file
is removed. Every file of a run's output names already in ``OUT`` (an earlier run's, or the user's own
``report.html``) is moved to ``OUT/previous/`` once the replay has ended, just before its outputs are written, as
``simulate`` does: a replay that fails or is killed leaves them (and the older ``previous/``) in place.
``previous/`` keeps only the last run's (replaced each run), and one holding other files is never replaced: the
replay stops before its first request with an error, as it does while another run writes to ``OUT``
(:func:`hold_out`). Every report carries this run's ``meta.run_id``.

The branch and agent ids sent to the cluster are the trace's prefixed with
``<run_id>:`` (``--branch-prefix``; recorded as ``meta.branch_prefix``): the
router refuses a request for a branch that was ended (400 'X-Branch-Id ... names a branch that was ended'),
so replaying a trace a second time against the same cluster needs new ids. The
records and the report keep the trace's ids.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from evolving_infra.out_folder import LOCK, OUTPUTS_ELSEWHERE, PREVIOUS, OutFolderError, check_previous_run, drop_partial_records, hold_new_out, hold_out, note_leftover_partial_records, partial_records, set_aside_note, set_aside_or_elsewhere, set_aside_previous_run  # noqa: F401 - re-exported (the tests import them from here)
from evolving_infra.replay.core import Arrival, ReplayError
from evolving_infra.stdio_args import STDIO, folder, shown, stdin_file
from services.router.config import RouterConfig
from shared.log import setup_logging
from shared.signals import STOP_SIGNALS, LateStopSignals, ignore_stop_signals, process_claimed, run_then_ignore

if TYPE_CHECKING:
    from evolving_infra.traces.schema import TraceRequest


async def _replay(args: argparse.Namespace) -> int:
    with ExitStack() as held:  # OUT's lock (hold_out), once taken, until the report is written
        return await _replay_held(args, held)


async def _replay_held(args: argparse.Namespace, held: ExitStack) -> int:
    from evolving_infra.replay.live import LiveReplayer
    from evolving_infra.replay.retry import RetryPolicy
    from evolving_infra.report.write import build_report, print_summary, report_line, write_report
    from evolving_infra.traces.io import NO_REQUESTS, TraceError, read_trace, trace_identity
    from evolving_infra.report.ideal import annotate_ideal
    from shared.clock import SimClock

    if args.from_kind == "canonical" and len(args.input) > 1:  # the others were ignored: a run of the first alone
        print(f"error: {len(args.input)} canonical traces given ({', '.join(args.input[:3])}{', ...' if len(args.input) > 3 else ''}): "
              "replay takes one; replay each on its own (another --out), or give raw trace files with --from",
              file=sys.stderr)
        return 2
    if args.from_kind != "canonical" and STDIO in args.input:
        print(f"error: '-' (stdin) cannot be a --from {args.from_kind} input, which is read as named files and folders; "
              "save it to a file (./- for a file named '-')", file=sys.stderr)
        return 2
    if args.branch_prefix is not None and (bad := branch_prefix_problem(args.branch_prefix)):
        print(f"error: --branch-prefix {args.branch_prefix!r}: {bad}", file=sys.stderr)
        return 2
    if args.from_kind == "canonical":  # read before any cluster is looked for: a mistyped path or a raw trace given
        try:  # without --from is the error, not "no router answers" (nor, after an `up` started, the trace)
            trace = read_trace(Path(stdin_file(args.input[0])))
        except TraceError as e:
            print(f"error: {shown(str(e))}", file=sys.stderr)
            return 2
        except OSError as e:  # missing, or a stdin that is a terminal or closed
            print(f"error: {args.input[0]}: cannot read: {e}", file=sys.stderr)
            return 2
        if not trace.requests:  # before a request is sent or a folder made
            print(f"error: {args.input[0]}: {NO_REQUESTS}", file=sys.stderr)
            return 2
    try:
        vocab_size = _use_running_cluster(args)
    except SystemExit as e:  # UsageError: several clusters and no --router-url
        print(str(e), file=sys.stderr)
        return 2
    unreachable = await router_unreachable(args.router_url)
    if unreachable:  # fail now, not after every request of the trace has failed to connect
        print(f"error: {unreachable}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("EI_API_KEY") or None
    answers = await router_answers(args.router_url, api_key)  # each body once; the checks below read their fields
    refused = router_refuses_key(args.router_url, api_key, answers)
    if refused:  # every request would be a 401, each agent waiting its pauses (12 of 12 in 105 s wall)
        print(f"error: {refused}", file=sys.stderr)
        return 2
    served = router_speedup(answers)
    if served is not None and args.speedup_from == "default":  # a compose or Slurm stack: no state file to read it from
        args.speedup = served
        print(f"replay: --speedup {served:g}, the router's (GET /v1/cluster)", file=sys.stderr)
    elif served is not None and served != args.speedup:  # every TTFT / E2E of the report would be scaled wrongly
        given = "--speedup" if args.speedup_from == "flag" else "the running cluster's state file's speedup"
        print(f"error: {given} {args.speedup:g} differs from the router's {served:g} (GET /v1/cluster at {args.router_url}); "
              f"pass --speedup {served:g}, or leave it unset to take the router's", file=sys.stderr)
        return 2
    if args.from_kind != "canonical":  # converted after the router answers (a folder of raw traces takes seconds)
        from evolving_infra.traces.convert import convert_inputs

        trace = convert_inputs(args.from_kind, [Path(p) for p in args.input], progress=True)
    identity = trace_identity(trace.header, trace.requests)  # the trace read, before --sessions: report compare's input
    if args.max_requests_per_branch or args.sessions:
        from evolving_infra.traces.sample import sample_sessions

        trace = sample_sessions(trace, args.sessions or 10**9, seed=args.seed, max_requests_per_branch=args.max_requests_per_branch)
    if getattr(args, "model_from", "flag") == "default":  # no state file (compose, Slurm, --router-url): the router's name
        named = router_model(answers)  # (a torch router 404s the sim's evolving-infra-sim)
        if named is not None and named != args.model:
            args.model = named
            print(f"replay: --model {named}, the router's (GET /v1/models)", file=sys.stderr)
    if vocab_size is None:  # the router's vocabulary (a torch model's 512 ids: the trace's ids are up to 100,000)
        vocab_size = router_vocab_size(answers)
    max_model_len = router_max_model_len(answers)
    try:
        requests, token_block, note = fit_to_router(trace.requests, trace.header.block_size, max_model_len,
                                                    scale=args.scale_to_model, max_output=args.max_output)
    except SystemExit as e:  # UsageError: nothing fits, or --scale-to-model without a max_model_len
        print(str(e), file=sys.stderr)
        return 2
    if note:
        print(note, file=sys.stderr)
    if requests is not trace.requests:
        from evolving_infra.traces.io import Trace

        trace = Trace(trace.header, requests)
    try:
        arrival = Arrival(kind=args.arrival, concurrency=args.concurrency, rate_per_min=args.rate, cap=args.cap, seed=args.seed,
                          order=args.agent_order)
    except ReplayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:  # before any request is sent: a second run into OUT, or a previous/ of the user's, stops the replay here
        hold_new_out(held, out)  # OUT made and held; taken back after the lock's release when the run left it empty
        check_previous_run(out)  # its refusals now; the set-aside itself once the replay has ended
    except (OutFolderError, OSError) as e:
        print(f"error: --out {out}: {e}", file=sys.stderr)
        return 2
    note_leftover_partial_records(out, "replay")
    run_id = uuid.uuid4().hex[:12]
    prefix = f"{run_id}:" if args.branch_prefix is None else args.branch_prefix
    too_long = longest_sent_id(trace.requests, prefix)
    if too_long is not None:
        print(f"warning: the id {too_long!r} is sent {len(too_long)} characters long; a router refuses ids over its "
              f"max_id_len (default {ROUTER_MAX_ID_LEN}) with 400, so every request of that branch would fail"
              + (": pass a shorter --branch-prefix (or '' on a cluster this trace has not been replayed on)" if prefix else ""),
              file=sys.stderr)
    clock = SimClock(args.speedup)
    replayer = LiveReplayer(args.router_url, clock, block_size=token_block, model=args.model, vocab_size=vocab_size,
                            api_key=api_key, branch_prefix=prefix, retry=RetryPolicy(max_retries=args.max_retries))
    stop = asyncio.Event()
    signals: list[str] = []
    loop = asyncio.get_running_loop()
    late = LateStopSignals()  # those after the run: recorded while the report is written, none interrupts it
    on_signal = stop_signal_handler(loop, stop, signals, out, late=late)
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    from evolving_infra.replay.live import RecordAppender

    partial = partial_records(out, run_id)  # this run's own file: OUT's outputs stay the earlier run's until the end
    try:
        append = RecordAppender(partial)
    except OSError as e:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        print(f"error: --out {out}: cannot write {partial.name}: {e}", file=sys.stderr)
        return 2
    print(f"replay: run {run_id}: each answered request's record is appended to {partial} until the report is written",
          file=sys.stderr)
    wall0 = time.monotonic()
    ended = False
    try:
        result = await replayer.run(trace.requests, arrival, stop=stop, on_record=append)
        ended = True
    finally:
        append.close()
        if len(signals) >= 2:
            pass  # aborted: on_signal ignores them
        elif process_claimed():  # this process's replay: a signal from here is recorded (LateStopSignals), the report
            late.take_over(loop)  # written in full; the status stays 130 / 143 when the run was stopped, no -15
        else:  # an in-process call (a test's): back to the defaults, as before
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
            late.installed = True  # a callback of on_signal still queued on the loop changes nothing now
        if not ended:  # failed or aborted (a second signal): OUT as it was, but for the records answered before
            drop_partial_records(partial, only_empty=True)
    meta = {
        "command": "replay",
        "run_id": run_id,
        "argv": sys.argv[1:],
        "input": args.input,
        **identity,
        "branch_prefix": prefix,
        "router_url": args.router_url,
        "speedup": args.speedup,
        # what the replay served, in the keys and shapes `simulate` records (report compare's input check)
        "arrival": {"kind": args.arrival, "concurrency": args.concurrency if args.arrival == "closed" else None,
                    "rate_per_min": args.rate if args.arrival == "open" else None, "cap": args.cap if args.arrival == "open" else None},
        "agents": len({r.agent for r in trace.requests}),
        "trace_block_size": trace.header.block_size,
        "tile": 1,
        "max_pause_s": None,  # the trace's pauses as recorded (scaled by the speedup), none capped
        "duration_s": None,  # until every session is done (or the replay is stopped)
        "warmup_s": 0.0,  # every request is measured
        "seed": args.seed,
        "max_retries": args.max_retries,
        "branch_end_failures": result.branch_end_failures,
        "branch_ends_cancelled": result.branch_ends_cancelled,
        "wall_s": time.monotonic() - wall0,
        "notes": list(trace.header.meta.get("notes", []) or []),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.from_kind == "canonical":  # the file replayed, as `simulate` and `demo` record it (report compare's input check)
        meta["trace"] = STDIO if args.input[0] == STDIO else str(Path(args.input[0]).resolve())
    if args.cluster_block_size is not None:  # the running cluster's (its state file); unknown for a bare --router-url
        meta["block_size"] = args.cluster_block_size
    if args.scale_to_model:  # what the model was served instead of the trace's prompts (fit_to_router)
        meta["scaled_to_model"] = {"max_model_len": max_model_len, "context": max_model_len // 2 if max_model_len else None,
                                   "max_output": SCALE_MAX_OUTPUT if args.max_output is None else args.max_output,
                                   "token_block_size": token_block}
    if args.agent_order != "trace":  # as `simulate`, which records no agent_order for its default
        meta["agent_order"] = args.agent_order
    if not (args.sessions or args.max_requests_per_branch or args.arrival == "open" or args.agent_order == "shuffled"):
        meta["inputs_not_applicable"] = ["seed"]  # nothing sampled nor drawn
    if result.interrupted:
        meta["interrupted"] = {"signal": signals[0] if signals else "stop", "in_flight_cancelled": result.in_flight_at_stop}
        meta["notes"] = [*meta["notes"], f"interrupted by {meta['interrupted']['signal']}: {len(result.records)} requests "
                         f"answered, {result.in_flight_at_stop} in flight cancelled (not counted)"]
    ideal = annotate_ideal(result.records, {r.id: r for r in trace.requests}, token_block)
    # duration: the replay's own window (wall x speedup), also when stopped early, not the span of the answered requests
    report = build_report(result.records, meta=meta, ideal_kv_hit_rate=ideal, start=result.start, end=result.end)
    try:  # only now, before the first output: a replay that failed or was killed leaves the earlier one's in place;
        # refused now (previous/ held or the user's files put there meanwhile): this run's outputs to OUT/run-<run_id>/
        dest = set_aside_or_elsewhere(out, "replay", run_id)
    except OutFolderError as e:
        kept = f"its records are in {partial}" if partial.exists() else "it answered no request"
        print(f"error: --out {out}: {e}; this run's report was not written ({kept})", file=sys.stderr)
        drop_partial_records(partial, only_empty=True)
        return 2
    path = write_report(dest, report, sorted(result.records, key=lambda r: r.sent_at))
    drop_partial_records(partial)  # the same records, in requests.jsonl now
    print_summary(report)
    print(report_line(path))
    if result.interrupted:
        sig_name = signals[0] if signals else "SIGINT"
        return 128 + getattr(signal, sig_name).value
    if late.first is not None:  # came while the report was written (LateStopSignals): written in full, its status
        print(f"replay: {signal.Signals(late.first).name} after the run had ended: its report was written in full",
              file=sys.stderr)
        return 128 + late.first
    if dest != out:  # OUT/report.json is still the earlier run's: a script reading it must know
        return OUTPUTS_ELSEWHERE
    return 0 if report["requests_failed"] == 0 else 1


def stop_signal_handler(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, signals: list[str],
                        out: Path, late: LateStopSignals | None = None) -> Callable[[signal.Signals], None]:
    """The replay's handler of its stop signals during the run, for ``loop.add_signal_handler(sig, handler, sig)``.

    Each call appends the signal's name to ``signals``. The first sets ``stop`` (the replay stops and writes what
    completed to ``out``) and says so on stderr; the second aborts: the rest ignored from here
    (:func:`shared.signals.ignore_stop_signals`, no -15 nor traceback from one that lands while ``asyncio.run``
    closes the loop), then ``SystemExit(128 + n)``. Any later call does nothing: one of a burst that came with the
    second, already queued on ``loop``, raised ``SystemExit`` again while ``asyncio.run`` cancelled the tasks, and the
    loop closed with the replay's task still pending ("Task was destroyed but it is pending!" and a traceback).

    Args:
        loop: the running loop the handler is added to (main thread).
        stop: set by the first signal.
        signals: the names received, in order (the report's ``meta.interrupted``); filled by the handler.
        out: the replay's ``--out`` folder, named in the line on stderr.
        late: the handler of the signals after the run; once it is ``installed`` a call hands its signal there and
            does nothing else (its callback was queued on ``loop`` before the hand-over: raising the abort then, with
            the run over, raised it during ``asyncio.run``'s shutdown, which logged the replay's task's abort as
            "Task exception was never retrieved").
    """

    def on_signal(sig: signal.Signals) -> None:
        if late is not None and late.installed:
            late(int(sig), None)
            return
        signals.append(sig.name)
        if len(signals) == 1:
            stop.set()  # first: a print to a closed stderr (a dead tee, `2>&1 | head`) raises, and the stop was lost
            try:
                print(f"\nreplay: {sig.name}: stopping; writing what completed to {out} (again to abort at once)",
                      file=sys.stderr)
            except OSError as e:  # its reader is gone (a pipe's, a closed terminal's): what follows for stderr (the
                if isinstance(e, BrokenPipeError) or e.errno == errno.EIO:  # progress bar's close) to /dev/null, so
                    _stderr_to_devnull()  # that the report of what completed is still written; else the line is lost
        elif len(signals) == 2:  # the abort
            ignore_stop_signals(loop)
            raise SystemExit(128 + sig.value)

    return on_signal


def _stderr_to_devnull() -> None:
    """Point file descriptor 2 at ``/dev/null`` (the pipe stderr wrote to has no reader any more: a dead ``tee``,
    ``2>&1 | head``; or its terminal is gone: EIO), so that later writes to ``sys.stderr`` (and the objects holding
    it, as the progress bar does) succeed instead of raising BrokenPipeError mid-way through the report. Only when
    ``sys.stderr`` writes to descriptor 2 (the command's own stream): a caller that replaced it (a library, a
    test's capture) keeps its descriptor 2 as it was. Raises nothing."""
    try:
        if sys.stderr.fileno() != 2:
            return
    except (AttributeError, OSError, ValueError):  # not a file (io.StringIO: UnsupportedOperation), or closed
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(null, 2)
    except OSError:
        pass
    finally:
        os.close(null)


async def router_unreachable(router_url: str, timeout_s: float = 5.0) -> str | None:
    """Whether anything answers HTTP at ``router_url`` (``GET /health``; any status counts as an answer,
    so API keys or a cluster not yet routable do not stop the replay here).

    Args:
        router_url: the router's base URL.
        timeout_s: wall seconds for the connection and the answer.

    Returns:
        None when it answers, else the reason and what to do, for the user.
    """
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            await http.get(router_url.rstrip("/") + "/health")
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        return (f"no router answers at {router_url} ({type(e).__name__}: {e or 'no answer'}); start a cluster with "
                "`evolving-infra up`, or pass the router's --router-url")
    return None


@dataclass(frozen=True, slots=True)
class RouterAnswers:
    """What the router said at the replay's start: ``GET /v1/models`` and ``GET /v1/cluster``, each asked once
    (:func:`router_answers`); the replay's checks read their fields from here (:func:`router_refuses_key`,
    :func:`router_speedup`, :func:`router_model`, :func:`router_vocab_size`, :func:`router_max_model_len`)."""

    models_status: int | None  # HTTP status of GET /v1/models; None: no answer (timeout, refused connection, bad URL)
    models: Any  # its JSON body when the status was 200 and the body JSON, else None
    cluster_status: int | None  # HTTP status of GET /v1/cluster; None: no answer
    cluster: Any  # its JSON body when the status was 200 and the body JSON, else None


async def router_answers(router_url: str, api_key: str | None, timeout_s: float = 5.0,
                         transport: object = None) -> RouterAnswers:
    """Ask the router ``GET /v1/models`` and ``GET /v1/cluster`` once each, together (a bearer token sent when
    ``api_key`` is set). Each check of the replay's start reads its field from these two bodies: it asked each
    twice before, up to 4 x ``timeout_s`` of waiting on a router that does not answer.

    Args:
        router_url: the router's base URL.
        api_key: sent as a bearer token when set.
        timeout_s: wall seconds for each answer (the two are asked at once).
        transport: an httpx transport (tests).

    Returns:
        The statuses and JSON bodies; a body is None when there is none to read (no answer, a bad URL, a status
        other than 200, a body that is not JSON). Never raises for the router's answers.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def get(http: httpx.AsyncClient, path: str) -> tuple[int | None, Any]:
        try:
            reply = await http.get(router_url.rstrip("/") + path, headers=headers)
        except (httpx.HTTPError, httpx.InvalidURL):
            return None, None
        try:
            return reply.status_code, reply.json() if reply.status_code == 200 else None
        except ValueError:  # not JSON
            return reply.status_code, None

    async with httpx.AsyncClient(timeout=timeout_s, transport=transport) as http:  # type: ignore[arg-type]
        (ms, models), (cs, cluster) = await asyncio.gather(get(http, "/v1/models"), get(http, "/v1/cluster"))
    return RouterAnswers(ms, models, cs, cluster)


def router_refuses_key(router_url: str, api_key: str | None, answers: RouterAnswers) -> str | None:
    """Whether the router refuses this replay's API key (or its lack of one): ``GET /v1/models`` answered 401 or 403
    (a router run with ``EI_API_KEYS`` / ``--api-keys-file``). No answer, or any other status, is not a refusal.

    Args:
        router_url: the router's base URL (named in the message).
        api_key: the key sent, if any (named in the message).
        answers: the router's answers (:func:`router_answers`).

    Returns:
        None when not refused, else the reason and what to do, for the user.
    """
    if answers.models_status not in (401, 403):
        return None
    what = "refuses the API key given" if api_key else "needs an API key and none was given"
    return (f"the router at {router_url} {what} (GET /v1/models: HTTP {answers.models_status}); pass --api-key KEY or set "
            "EI_API_KEY to one of the router's keys (its EI_API_KEYS / --api-keys-file)")


def router_speedup(answers: RouterAnswers) -> float | None:
    """The router's ``speedup`` (simulated s per wall s: its ``--speedup`` / ``EI_SPEEDUP``) from ``GET /v1/cluster``.
    None when the router does not say (a router older than the field, an error status such as 401 without an
    API key, no answer, a value no clock has): the replay then keeps its ``--speedup`` (given, the state file's, or 1).
    """
    body = answers.cluster
    value = body.get("speedup") if isinstance(body, dict) else None  # not an object: says nothing
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        return None
    return float(value)


def router_max_model_len(answers: RouterAnswers) -> int | None:
    """The router's ``max_model_len`` (tokens: the longest prompt + ``max_tokens`` it serves) from ``GET /v1/models``
    (vLLM's ``ModelCard`` field; ``up --engine torch``'s router: the model's context lowered to a node's GPU KV memory).
    None when the router does not say (no field, an error status, no answer): the replay then checks nothing.
    """
    try:
        value = answers.models["data"][0].get("max_model_len")
    except (KeyError, IndexError, TypeError, AttributeError):  # no answer (None), not the shape of a model list
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def router_model(answers: RouterAnswers) -> str | None:
    """The model name the router serves: the first ``id`` of ``GET /v1/models`` (``up --served-model-name``'s first,
    a torch cluster's model folder name, the sim's ``evolving-infra-sim``). None when the router does not say.
    """
    try:
        value = answers.models["data"][0].get("id")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def router_vocab_size(answers: RouterAnswers) -> int | None:
    """The router's ``vocab_size`` (prompt token ids must be below it) from ``GET /v1/cluster``; None when it does not
    say (an older router, an error status, no answer): the replay then sends the trace's ids as they are (below
    100,000, the sim tokenizer's vocabulary).
    """
    body = answers.cluster
    value = body.get("vocab_size") if isinstance(body, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


SCALE_MAX_OUTPUT = 8
"""``replay --scale-to-model``'s output tokens per request at most unless ``--max-output``: ``demo --max-output``'s default."""


def fit_to_router(requests: list[TraceRequest], block_size: int, max_model_len: int | None, *, scale: bool,
                  max_output: int | None) -> tuple[list[TraceRequest], int, str | None]:
    """The requests to send and the tokens per trace block to send them at, given the router's ``max_model_len``.

    Without ``scale``: the trace as it is (``block_size``); when some requests ask for more than ``max_model_len``
    tokens (prompt + ``max_tokens``, which the router refuses with 400 "maximum context length"), a warning saying
    how many and the flag that fixes it; when none fits, a usage error (every request would fail: a Claude Code
    sample replayed against ``up --engine torch``'s 1,024-token tiny model failed all of them). With ``scale``
    (``--scale-to-model``): the trace scaled as ``demo --engine torch`` scales it
    (:func:`~evolving_infra.traces.sample.scale_trace_for_model`: one token per block, prompts cut to a prefix so
    that a request takes at most half of ``max_model_len``, two fitting a node's GPU KV together; outputs capped to
    ``max_output``, default 8) sent at one token per block, and the line saying so.

    Raises:
        UsageError: (status 2) no request fits; ``scale`` and the router said no ``max_model_len``, or one too small
            for ``max_output``; ``max_output`` without ``scale``.
    """
    from evolving_infra.cli import UsageError
    from evolving_infra.traces.sample import scale_description, scale_trace_for_model

    if not scale:
        if max_output is not None:
            raise UsageError("error: --max-output applies with --scale-to-model (the trace's own output lengths otherwise)")
        if not max_model_len:
            return requests, block_size, None
        over = [r.input_tokens + max(1, r.output_tokens) for r in requests if r.input_tokens + max(1, r.output_tokens) > max_model_len]
        if not over:
            return requests, block_size, None
        what = (f"{len(over)} of the {len(requests)} requests ask for more than the router's max_model_len {max_model_len} "
                f"tokens (prompt + max_tokens; up to {max(over)}) and would fail with 400; pass --scale-to-model to scale "
                "the trace to the model as demo --engine torch does (or serve a longer context: up --gpu-kv-tokens)")
        if len(over) == len(requests):
            raise UsageError(f"error: {what}")
        return requests, block_size, f"warning: {what}"
    if not max_model_len:
        raise UsageError("error: --scale-to-model: the router did not report its max_model_len (GET /v1/models); "
                         "it scales a trace to a router that does (evolving-infra up)")
    out = SCALE_MAX_OUTPUT if max_output is None else max_output
    try:
        scaled = scale_trace_for_model(list(requests), max_model_len // 2, out)
    except ValueError:
        raise UsageError(f"error: --max-output {out}: the router's max_model_len {max_model_len} leaves no room for a prompt "
                         f"in half of it; pass a --max-output below {max_model_len // 2 - 1}") from None
    return scaled, 1, (f"replay --scale-to-model: {scale_description(block_size, max_model_len // 2, out)} (half of the "
                       f"router's max_model_len {max_model_len})")


def branch_prefix_problem(prefix: str) -> str | None:
    """Why ``prefix`` cannot go in front of the ids sent as headers, or None when it can.

    Ids go in the headers as UTF-8 (``LiveReplayer._headers``), so any character can but those the router
    refuses in ids (control characters: C0, DEL, C1; a 400 on every request) and lone surrogates (an
    argument's bytes that were not UTF-8: no UTF-8 form, every request would fail in the client).
    """
    for ch in prefix:
        o = ord(ch)
        if o < 0x20 or 0x7F <= o <= 0x9F:
            return f"holds the control character {ch!r}; the router refuses ids with control characters (400)"
        if 0xD800 <= o <= 0xDFFF:
            return f"holds {ch!r}, which has no UTF-8 form (bytes that were not UTF-8?); the ids go in the headers as UTF-8"
    if len(prefix) >= ROUTER_MAX_ID_LEN:
        return f"is {len(prefix)} characters long; a router refuses ids over {ROUTER_MAX_ID_LEN} (its max_id_len default)"
    return None


def longest_sent_id(requests: Sequence[TraceRequest], prefix: str) -> str | None:
    """The longest branch, parent branch or agent id sent (``prefix`` + the trace's) when it is longer
    than :data:`ROUTER_MAX_ID_LEN`, else None."""
    longest = max((i for r in requests for i in (r.branch, r.agent, r.parent_branch or "")), key=len, default="")
    return prefix + longest if len(prefix) + len(longest) > ROUTER_MAX_ID_LEN else None


ROUTER_MAX_ID_LEN: int = next(f.default for f in msgspec.structs.fields(RouterConfig) if f.name == "max_id_len")
"""The longest X-Branch-Id / X-Parent-Branch-Id / X-Agent-Id a router accepts by default
(``services.router.config.RouterConfig.max_id_len``'s default, read from it; a router may be run with another)."""


def _use_running_cluster(args: argparse.Namespace) -> int | None:
    """Fill ``--router-url`` / ``--speedup`` left unset from the running ``up`` cluster's state file
    (:mod:`evolving_infra.state`), else (no cluster running) ``http://127.0.0.1:8000`` and 1 (``args.speedup_from``:
    ``flag``, ``state`` or ``default``; a ``default`` one is the router's when it reports one), ``--model`` likewise
    (``args.model_from``; a ``default`` one is the router's ``GET /v1/models`` name), and set ``args.cluster_block_size``
    (the cluster's tokens per KV block from the state file; None when not read from one); returns the
    router tokenizer's vocabulary size when it is not the sim one (the replayer takes prompt ids modulo it).

    Raises:
        UsageError: (status 2) no ``--router-url`` and several local clusters run (each listed, as ``split get`` lists them).
    """
    from evolving_infra.state import running_clusters

    info: dict[str, Any] = {}
    if args.router_url is None:
        found = running_clusters()
        if len(found) == 1:
            info = found[0]
            print(f"replaying against the running cluster: router {info.get('router_url')} (state {info.get('state_file')})",
                  file=sys.stderr)
        elif len(found) > 1:  # as `split get`: the default URL (port 8000) was neither of them, and every request failed
            from evolving_infra.cli import UsageError

            listed = "; ".join(f"router {c.get('router_url')} (pid {c.get('pid')}, state {c.get('state_file')})" for c in found)
            raise UsageError(f"error: {len(found)} local clusters are running: {listed}; pass --router-url to pick one")
        args.router_url = info.get("router_url") or "http://127.0.0.1:8000"
    if args.speedup is not None:
        args.speedup_from = "flag"
    elif info.get("speedup"):
        args.speedup, args.speedup_from = float(info["speedup"]), "state"
    else:  # the router's, when it says (`_replay`: GET /v1/cluster), else 1
        args.speedup, args.speedup_from = 1.0, "default"
    bs = info.get("block_size")
    args.cluster_block_size = bs if isinstance(bs, int) and not isinstance(bs, bool) else None
    if getattr(args, "model", None) is not None:
        args.model_from = "flag"
    elif info.get("model"):  # `up --engine torch --model DIR` serves DIR's name, not the sim's
        args.model, args.model_from = info["model"], "state"
    else:  # the router's, when it says (`_replay`: GET /v1/models), else the sim's
        args.model, args.model_from = DEFAULT_MODEL, "default"
    tokenizer = info.get("tokenizer") or "sim"
    if tokenizer == "sim":
        return None
    from shared.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer).vocab_size


DEFAULT_MODEL = "evolving-infra-sim"
"""The model name a sim-engine router serves (``ClusterSpec.model``)."""

def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (``--max-retries``). Raises argparse.ArgumentTypeError otherwise."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def cmd_replay(args: argparse.Namespace) -> int:
    """``evolving-infra replay``: run :func:`_replay` in its own event loop; returns its exit status. In the replay's
    own process (:func:`shared.signals.process_claimed`) SIGINT and SIGTERM are ignored once ``_replay`` has ended:
    Python's finalization puts a signal with a Python handler (:class:`shared.signals.LateStopSignals`, from the
    run's end on) back to its default, and the rest of a burst then killed the replay (-15) after its report."""
    setup_logging("console", "warning")
    return run_then_ignore(_replay(args))


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "replay",
        help="replay agent traces against a running router",
        description="Replay a canonical agent trace (or raw traces converted on the fly) against a running cluster: "
        "each request is sent after its predecessors complete plus the recorded pause, with branch headers; "
        "branches are ended; TTFT, E2E, tokens and cached tokens are recorded per request.",
    )
    p.add_argument("input", nargs="+", help="canonical trace file (one; - reads stdin), or raw trace files/folders with --from")
    p.add_argument(
        "--from",
        dest="from_kind",
        default="canonical",
        choices=["canonical", "claude-code-weka", "mooncake", "mini-swe-agent", "azure", "openai-chat"],
        help="input kind (default canonical)",
    )
    p.add_argument(
        "--router-url", default=None, help="router base URL (default: the running `up` cluster's, else http://127.0.0.1:8000; "
        "with several running, each is listed and this flag is required: exit 2)"
    )
    p.add_argument(
        "--speedup", type=float, default=None, help="the cluster's speedup, simulated s per wall s (default: the running `up` cluster's, else the router's "
        "from GET /v1/cluster, else 1); one the router reports otherwise is refused (exit 2), as every time in the "
        "report would be scaled wrongly"
    )
    p.add_argument("--model", default=None,
                   help="model name sent with requests (default: the running `up` cluster's served model, else the router's: "
                   "GET /v1/models' first id, else evolving-infra-sim)")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' to a router run with API keys (EI_API_KEYS or --api-keys-file; "
                   "401 without it: a router that refuses it, or its lack, ends the replay before any request, exit 2); default: "
                   "env EI_API_KEY, which keeps the key out of the process list (a KEY given here is in every local user's ps)")
    p.add_argument("--arrival", choices=["closed", "open", "trace"], default="closed", help="arrival process: closed (--concurrency agents at a time), open (Poisson --rate), trace (agents start at their recorded arrival_s) (default closed)")
    p.add_argument("--concurrency", type=int, default=16, help="closed loop: concurrent agents (default 16)")
    p.add_argument("--rate", type=float, default=10.0, help="open loop: agent arrivals per minute (default 10)")
    p.add_argument("--cap", type=int, default=0, help="open loop: most agents running at once, as simulate's --cap; a later arrival waits for admission "
                   "(its admission_wait_s in requests.jsonl) (0 = no cap)")
    p.add_argument("--sessions", type=int, default=0, help="replay at most this many agents (0 = all)")
    p.add_argument("--max-requests-per-branch", type=int, default=0, help="cap each branch to its first K requests (0 = no cap)")
    p.add_argument("--scale-to-model", action="store_true",
                   help="scale the trace to the router's model as demo --engine torch does: each trace block becomes one "
                   "token, prompts cut to a prefix so that a request takes at most half of the router's max_model_len "
                   "(GET /v1/models), outputs to --max-output; for a small real model (up --engine torch), whose context "
                   "the trace's prompts exceed. Without it the replay says up front how many requests do not fit")
    p.add_argument("--max-output", type=int, default=None, metavar="N",
                   help=f"with --scale-to-model: output tokens per request at most (default {SCALE_MAX_OUTPUT}, as demo's)")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling and open-loop arrivals (default 0)")
    p.add_argument("--agent-order", choices=("trace", "shuffled"), default="trace",
                   help="order in which agents enter (closed and open loops): as in the trace (default), or shuffled by --seed")
    p.add_argument("--branch-prefix", default=None, metavar="STR",
                   help="put STR in front of every branch and agent id sent to the cluster (X-Branch-Id, "
                   "X-Parent-Branch-Id, X-Agent-Id, branch ends); the router refuses a branch that was ended (400), "
                   "so each run needs ids of its own: default '<run id>:' (meta.run_id); '' sends the trace's ids "
                   f"as they are (once per cluster). No control characters (sent as UTF-8); a router refuses ids over {ROUTER_MAX_ID_LEN} characters (its "
                   "max_id_len), which the run warns of. Records and the report keep the trace's ids")
    p.add_argument("--max-retries", type=non_negative_int, default=2, metavar="N",
                   help="send a request again up to N times when it was refused before any answer, as agent harnesses "
                   "do (the OpenAI SDK's default is 2): a 429 / 503 (a draining router's 'retry on another router'), "
                   "waiting its Retry-After (at most 60 s; without one 0.5 s, doubling, at most 8 s), or a connection "
                   "refused or reset before the first byte (a router restarting). A stream that started is never "
                   "sent again (it would duplicate output): it fails. Each record's retries and the report's "
                   "requests_retried / retries count them. A branch end (POST /v1/branches/{id}/end) refused so is sent "
                   "again too, up to N times (the router answers a repeated end 200, and a 503 while it cannot ask the "
                   "KV directory about a branch another router served), its retries logged, not counted in "
                   "requests_retried / retries; 0 = never retry (default 2)")
    p.add_argument("--out", default="replay-out", type=folder, help=f"output directory for report.json, requests.jsonl, plots and report.html (default replay-out; removed again when a failed replay left it empty); each answered request's record is appended to OUT/requests.partial-RUNID.jsonl as it completes (a killed replay keeps them there; removed once requests.jsonl is written). Files of those names already there (an earlier run's, or your own) move to OUT/{PREVIOUS}/ once the replay has ended, just before its outputs are written, never overwritten (a replay that fails or is killed leaves them in place); OUT/{PREVIOUS}/ keeps only the last run's (replaced each run); when that move is refused at the end (OUT/{PREVIOUS} held by a 'report show', or your files put there meanwhile) the outputs go to a new OUT/run-RUNID/ instead, named on stderr, exit status {OUTPUTS_ELSEWHERE}. The replay stops before it starts when OUT/{PREVIOUS} holds other files, or while another run is writing to OUT (it holds OUT/{LOCK})")
    p.set_defaults(func=cmd_replay)
