"""Stop signals at the edges of a process's life: before its event loop handles them, and once it is stopping.

Every entry point that stops on SIGTERM/SIGINT sets its handlers with ``loop.add_signal_handler`` (the services'
shell, ``shared.service``; ``up``; ``tap``; ``replay``; the Slurm liveness watch; the KV-pool demo). Two moments
were left to the signals' default action:

- The end. A plain ``scancel`` sends SIGTERM to every process of a job, the job's stop and its supervisors send more:
  several land within milliseconds. One that came while ``asyncio.run`` (or ``uvloop.run``) closed the loop printed
  "Exception ignored when trying to write to the signal wakeup fd ... OSError: [Errno 9] Bad file descriptor"
  (``loop.close()`` closes the self-pipe, the wakeup fd, and only then removes the handlers), and one just after
  killed the process by SIGTERM (status -15, not its own; under uvloop the handlers are never removed and Python's
  own finalization puts SIGTERM back to its default). :func:`ignore_stop_signals`, called on the loop once the
  process is stopping for good, ignores them from there to the exit (but for a moment of about 4 us in a process
  with other threads, :func:`hand_over_stop_signals`). A command whose run is over but for writing its outputs
  (``replay``, ``demo``) records them instead (:class:`LateStopSignals`) and exits with the first one's status once
  they are written: an abort raised from a handler there landed in a ``__del__`` or in the command's task.
- The start. ``evolving-infra up`` imports for about a second before its loop exists: a SIGTERM then killed it (-15)
  with no word. :func:`catch_early` records such a signal with a plain Python handler from the first line of the
  command's ``main``, and :func:`caught_early` hands it to the loop's handlers once they are set. A second one
  before then aborts at once (:func:`aborting`): a start-up stuck before its handlers are set (``up
  --api-keys-file`` a pipe nobody writes) is still stopped by a second Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # not imported at run time: `up` calls catch_early before its heavy imports
    import asyncio

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a process of this project (a supervisor's or Slurm's SIGTERM, Ctrl-C)."""


def ignore_stop_signals(loop: asyncio.AbstractEventLoop, signals: Iterable[int] = STOP_SIGNALS) -> None:
    """From here on ignore ``signals`` (the process is stopping for good and exits after this loop), and take them
    off ``loop`` while its self-pipe is still open: :func:`hand_over_stop_signals` with ``SIG_IGN``.

    Call it from a coroutine or callback running on ``loop`` in the main thread, after the process's own stop no
    longer needs them (a service's drain and stop are over, ``tap`` has stopped, ``replay`` aborts): a signal then is
    discarded, where before one that came during the loop's close printed the "signal wakeup fd" traceback and one
    just after killed the process (-15). A signal ``loop`` has no handler for is ignored all the same. The
    signals stay ignored until the process exits: only the entry point that owns the process calls this. In a
    process with other threads a signal can still meet its default during the hand-over itself (microseconds; see
    :func:`hand_over_stop_signals`).

    Args:
        loop: the running loop whose handlers (``loop.add_signal_handler``) are removed; asyncio's or uvloop's.
        signals: signal numbers (default :data:`STOP_SIGNALS`; ``up`` adds SIGHUP).

    Raises:
        ValueError: not called in the main thread (``signal.signal``'s).
    """
    hand_over_stop_signals(loop, signal.SIG_IGN, signals)


def run_then_ignore(main: Coroutine[Any, Any, int], signals: Iterable[int] = STOP_SIGNALS) -> int:
    """``asyncio.run(main)`` for a command's entry point; returns ``main``'s exit status. In the command's own process
    (:func:`process_claimed`) ``signals`` are ignored from the moment ``main`` has ended, on its loop
    (:func:`ignore_stop_signals`), to the exit: the process is stopping for good, and the rest of a burst (a plain
    ``scancel``) landing while ``asyncio.run`` closed the loop, or just after, killed it (-15; Python's finalization
    also puts a signal with a Python handler, :class:`LateStopSignals`, back to its default). A command called
    in-process (a test's ``main([...])``) leaves the caller's signals as asyncio leaves them. ``up``, ``demo`` and
    ``replay`` run through this.

    Raises:
        whatever ``main`` raises (``SystemExit`` and ``KeyboardInterrupt`` included).
    """
    import asyncio

    owned = process_claimed()
    sigs = tuple(signals)

    async def run() -> int:
        try:
            return await main
        finally:
            if owned:
                ignore_stop_signals(asyncio.get_running_loop(), sigs)

    return asyncio.run(run())


def hand_over_stop_signals(loop: asyncio.AbstractEventLoop, handler: signal.Handlers | Callable[[int, Any], Any],
                           signals: Iterable[int] = STOP_SIGNALS) -> None:
    """Take ``signals`` off ``loop`` and give them to ``handler`` (``SIG_IGN``, or a Python handler ``(signum,
    frame)``), with no moment at their default action in between for the calling thread.

    ``loop.remove_signal_handler`` puts a signal back to its default (SIG_DFL: a SIGTERM then kills) before it can be
    given to another handler: the signals are blocked meanwhile, and one that comes then is delivered to ``handler``
    once they are unblocked. The loop's self-pipe is still open then: asyncio's last ``remove_signal_handler`` clears
    the wakeup fd, so none is written to a closed one later. A signal ``loop`` has no handler for gets ``handler``
    all the same. From a coroutine or callback running on ``loop``, in the main thread.

    When that holds: ``pthread_sigmask`` blocks the signals in the calling thread only, and the kernel gives a
    signal sent to the process (``kill``, ``scancel``) to any thread that does not block it. So a process whose
    only thread is this one, or whose other threads all block ``signals`` (a thread starts with its creator's
    mask), has no such moment. A process with other threads that do not (the planner, the router and the workers
    run 2 to 4 threads) still has one, about 4 us a call, from ``remove_signal_handler``'s SIG_DFL to
    ``signal.signal``: a signal that lands in it gets its default there, a SIGTERM or SIGHUP kills the process (-15;
    143 under a shell), a SIGINT may raise ``KeyboardInterrupt`` in the main thread (Python's
    ``default_int_handler``). A burst of 4 SIGTERMs 2 ms apart hits it about 0.07% of the time (review rr-sig56).

    Args:
        loop: the running loop; asyncio's or uvloop's.
        handler: ``signal.SIG_IGN`` or a callable ``(signum: int, frame) -> None`` (it may raise, as
            ``KeyboardInterrupt`` or ``SystemExit`` to abort the process).
        signals: signal numbers (default :data:`STOP_SIGNALS`).

    Raises:
        ValueError: not called in the main thread (``signal.signal``'s).
    """
    sigs = tuple(signals)
    if handler == signal.SIG_IGN:
        _quiet_races_of(sigs)
    # blocked first: none is handled until every one is handed over (a handler that raises half-way would leave some
    # on the loop, whose close puts them back to their default); one already written to the loop's self-pipe finds no
    # handler there any more and is dropped
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        for sig in sigs:
            loop.remove_signal_handler(sig)  # asyncio's last one clears the wakeup fd (the self-pipe, still open)
            signal.signal(sig, handler)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)  # one that came meanwhile goes to ``handler`` now


_ignored_on_purpose: set[int] = set()
"""The signals :func:`hand_over_stop_signals` ignored (``SIG_IGN``) in this process."""


def _quiet_races_of(signals: Iterable[int]) -> None:
    """Let a signal that was already pending for a Python handler when ``signals`` became ignored be dropped without a
    word, as they are meant to be: CPython runs a Python handler at the main thread's next check, and one whose signal
    came (to any thread) just before ``signal.signal(sig, SIG_IGN)`` finds ``SIG_IGN`` there and is reported through
    ``sys.unraisablehook`` as "Exception ignored in: None ... OSError: Signal 15 ignored due to race condition", a
    traceback on stderr (``replay``'s burst test, once it recorded its late signals: 2 of 6 runs). Every other unraisable exception goes to
    the hook that was in place before; installed once per process."""
    import sys

    if not _ignored_on_purpose:
        before = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            exc = unraisable.exc_value
            if unraisable.object is None and isinstance(exc, OSError) and any(
                    str(exc) == f"Signal {n} ignored due to race condition" for n in _ignored_on_purpose):
                return
            before(unraisable)

        sys.unraisablehook = hook
    _ignored_on_purpose.update(int(s) for s in signals)


def aborting(signals: Iterable[int] = STOP_SIGNALS) -> Callable[[int, Any], None]:
    """A Python signal handler (for :func:`hand_over_stop_signals`) that aborts the process at the first of
    ``signals``: it ignores them all from there (the rest of a burst ends nothing more), then raises
    ``KeyboardInterrupt`` for SIGINT (``evolving_infra.cli``: "interrupted", status 130) or ``SystemExit(128 + n)``
    for signal n (SIGTERM 143, SIGHUP 129, as a shell reports them). Writers it interrupts remove what they had
    begun as either exception passes through them. For :func:`catch_early` (a start-up stuck before its loop's
    handlers); not for a command writing its outputs after its run: the exception then lands wherever the main
    thread is, a ``__del__`` or the command's task included (:class:`LateStopSignals` records them instead)."""
    sigs = tuple(signals)

    def abort(signum: int, frame: Any) -> None:
        _quiet_races_of(sigs)
        for sig in sigs:
            signal.signal(sig, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    return abort


class LateStopSignals:
    """A Python signal handler for the stop signals that come once a command's run is over and only its outputs are
    left to write (``replay``'s report once its run ended, ``demo``'s once its cluster stopped): each is recorded,
    none interrupts the writing; the command reads :attr:`first` when its outputs are written.

    Raising from a signal handler there (``SystemExit``, as :func:`aborting` does) lands wherever the main thread
    happens to be. In a ``__del__`` (an HTTP transport's, collected while the report is built) Python prints
    "Exception ignored in ..." with the traceback and drops the exception, so the abort is lost as well; in the
    command's asyncio task the exception is stored on the task, and a callback the loop had queued before the
    hand-over (the burst's previous signal) raising during ``asyncio.run``'s shutdown skipped the loop run that
    retrieves it: "Task exception was never retrieved" and a traceback. A burst of SIGTERMs into a replay stopped by
    its first showed one or the other in 10 of 15 runs (session 57; the project's CI failed on it). Recording never
    raises, so it is safe at any point, and the rest of a burst changes nothing; writing the outputs takes about a
    second, which a signal then waits for.

    Attributes:
        first: the first signal's number; None while none came.
        count: how many came (a burst's).
        installed: set by :meth:`take_over`; a loop callback of the run's own handler queued before it (a signal that
            came just before the hand-over) hands its signal here instead of acting on it.
    """

    __slots__ = ("first", "count", "installed")

    def __init__(self) -> None:
        self.first: int | None = None
        self.count = 0
        self.installed = False

    def __call__(self, signum: int, frame: Any) -> None:
        """Record ``signum`` (a Python signal handler's signature; ``frame`` unused)."""
        self.count += 1
        if self.first is None:
            self.first = signum

    def take_over(self, loop: asyncio.AbstractEventLoop, signals: Iterable[int] = STOP_SIGNALS) -> None:
        """Take ``signals`` off ``loop`` and record them from now on (:func:`hand_over_stop_signals`, no moment at
        their default for the calling thread), until the command's loop ends and :func:`run_then_ignore` ignores them
        (Python's finalization would put a Python handler back to SIG_DFL). From a coroutine or callback running on
        ``loop``, in the main thread.

        Raises:
            ValueError: not called in the main thread (``signal.signal``'s).
        """
        hand_over_stop_signals(loop, self, signals)
        self.installed = True


_claimed = False
"""Whether this process runs a command of its own command line (:func:`claim_process`)."""


def claim_process() -> None:
    """Mark this process as run by a command's entry point with the process's own arguments (``evolving-infra``'s
    ``main`` with no ``argv``): the command may then keep stop signals ignored (or aborting) from its stop to the
    process's exit. A command called in-process (a test's ``main([...])``) leaves the caller's signals as
    asyncio leaves them."""
    global _claimed
    _claimed = True


def process_claimed() -> bool:
    """Whether :func:`claim_process` (or :func:`catch_early`) was called in this process."""
    return _claimed or _caught is not None


_caught: list[int] | None = None
"""The signals :func:`catch_early`'s handler recorded, in order; None until it is installed."""
_early: tuple[int, ...] = ()
"""The signals :func:`catch_early` set its handler for (those not ignored then)."""


def _record(signum: int, frame: Any) -> None:
    """:func:`catch_early`'s handler: the first signal is recorded, a second one aborts (:func:`aborting`)."""
    assert _caught is not None
    if _caught:  # the second before the loop's handlers: the start-up may be stuck (a pipe nobody writes), or a burst
        aborting(_early)(signum, frame)  # raises: KeyboardInterrupt for SIGINT, else SystemExit(128 + n)
    _caught.append(signum)


def catch_early(signals: Iterable[int]) -> None:
    """Record ``signals`` (numbers) from now until the event loop's handlers replace these: a plain Python handler
    appends the first to :func:`caught_early`'s list and returns, so the imports and checks before the loop run on
    (the loop's handlers then stop the command cleanly). A second one before then aborts at once as
    :func:`aborting` does: the rest of them ignored, ``KeyboardInterrupt`` for SIGINT (``evolving_infra.cli``:
    "interrupted", 130), else ``SystemExit(128 + n)`` (SIGTERM 143, SIGHUP 129), raised where the main thread is
    (an import, a blocking ``open`` of a pipe nobody writes). Before, a start-up stuck before its loop's handlers
    were set only recorded every signal and was stopped by SIGKILL alone. A signal ignored now (SIGHUP under
    ``nohup``) stays ignored. For a process's entry point only (its ``main`` with the process's own arguments), in
    the main thread; calling it again keeps what was recorded.

    Raises:
        ValueError: not in the main thread (``signal.signal``'s).
    """
    global _caught, _early
    if _caught is None:
        _caught = []
    for sig in signals:
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, _record)
            _early = (*_early, sig) if sig not in _early else _early


def caught_early() -> list[int] | None:
    """The signal numbers recorded since :func:`catch_early`, oldest first (a copy); None when it was not called
    in this process (an in-process call of a command: the caller's signals are its own)."""
    return None if _caught is None else list(_caught)
