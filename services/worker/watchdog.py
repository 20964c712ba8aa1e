"""The step watchdog: a worker whose engine step hangs ends, so its supervisor restarts it.

A model forward can hang without raising (a stuck CUDA kernel, a deadlocked collective, a torch
op waiting forever): the execute thread never returns, while the asyncio loop keeps the node's
``node.state`` heartbeat going, so the router keeps routing to it and its requests never finish.
SGLang's ``--watchdog-timeout`` (300 s) guards against it: a forward batch that takes longer dumps
the stacks and kills the server. :class:`StepWatchdog` is that guard for one worker: the step loop
marks each engine step's start and end (:meth:`StepWatchdog.begin` / :meth:`StepWatchdog.end`),
and a thread of its own (not the execute thread, not the event loop's: either may be the one that
hangs; the loop also blocks when a handler waits for the engine's lock held by a hung forward)
checks the step in flight every ``timeout_s / 8`` (at most 1 s). A step older than ``timeout_s``
calls ``on_hang`` once with a :class:`StepHung` naming the step and the Python stacks of every
thread (``faulthandler``); the watcher then waits for ``exit_ready`` (the service stopped) for at
most ``grace_s`` and ends the process with ``os._exit(1)``: a hung thread cannot be stopped, and
Python's exit joins the executor thread that runs it, so a normal exit would hang too.

The same thread watches the event loop between steps (:meth:`StepWatchdog.start` with the loop): a
handler that blocks the loop outside a step (a synchronous call that never returns, a CUDA copy of a
hand-off's pages with no step in flight) stops the heartbeat, so the router fences the node, but the
process lived on and its supervisor never restarted it. The watcher posts a tick to the loop
(``call_soon_threadsafe``) every poll; a loop that has run none for ``timeout_s`` while no step is
watched calls ``on_hang`` with a :class:`LoopBlocked` and exits the same way. A watched step covers
the loop itself (the step cannot end while the loop is blocked); a loop that is not running
(stopped between runs, closed) is not blocked.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass

from services.worker.plan import IterationPlan

EXIT_CODE = 1
"""Exit status of a worker the watchdog ended (as any other fatal failure: its supervisor restarts it)."""
GRACE_S = 5.0
"""Default wall seconds the watcher waits, after ``on_hang``, for the service to stop before it exits."""


@dataclass(frozen=True, slots=True)
class StepInfo:
    """What one engine step runs (for the watchdog's error line)."""

    seq: int
    """Engine steps started by this process, this one included (1-based)."""
    rids: tuple[str, ...]
    """Requests of the step: its prefill chunks', then its decode rows'."""
    prefill_tokens: int
    """Prompt tokens the step's prefill chunks compute."""
    decode_rows: int
    """Decode rows per iteration."""
    iterations: int
    """Iterations folded into the step (each decode row makes one token per iteration)."""

    @classmethod
    def of(cls, plan: IterationPlan, seq: int) -> "StepInfo":
        """The step that runs ``plan`` (the ``seq``-th of the process)."""
        rids = tuple(dict.fromkeys((*(c.rid for c in plan.prefill), *plan.decode)))
        return cls(seq, rids, sum(c.tokens for c in plan.prefill), len(plan.decode), plan.iterations)


class StepHung(RuntimeError):
    """An engine step ran past ``--watchdog-timeout-s`` (:class:`StepWatchdog`)."""

    def __init__(self, info: StepInfo, elapsed_s: float, timeout_s: float) -> None:
        super().__init__(
            f"engine step {info.seq} ({len(info.rids)} requests, {info.prefill_tokens} prefill tokens, "
            f"{info.decode_rows} decode rows × {info.iterations} iterations) has run {elapsed_s:.1f} s, "
            f"past --watchdog-timeout-s {timeout_s:g}"
        )
        self.info = info
        self.elapsed_s = elapsed_s


class LoopBlocked(RuntimeError):
    """The event loop ran nothing for ``--watchdog-timeout-s`` while no engine step was watched
    (:class:`StepWatchdog`): a handler blocks it."""

    def __init__(self, elapsed_s: float, timeout_s: float) -> None:
        super().__init__(
            f"the event loop has run nothing for {elapsed_s:.1f} s (no engine step in flight), past --watchdog-timeout-s {timeout_s:g}"
        )
        self.elapsed_s = elapsed_s


def thread_stacks() -> str:
    """The Python stacks of every thread of the process, as ``faulthandler`` writes them (C-level:
    it needs no lock a hung thread may hold) into a temporary file; where none can be made (a
    read-only root file system without a writable ``/tmp``, as a hardened container runs: ``OSError``),
    as :func:`frame_stacks` reads them instead. Before, that ``OSError`` skipped ``on_hang``: no error
    line, no ``accepting=False``, no stop; the process only exited after the grace."""
    try:
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            return f.read()
    except OSError as e:
        return f"(faulthandler needs a temporary file: {e!r}; the stacks as Python reads them)\n" + frame_stacks()


def frame_stacks() -> str:
    """The Python stacks of every thread (``sys._current_frames``), most recent call last, each headed
    ``Thread 0x<ident> (<name>)`` as ``faulthandler``'s. O(threads × frames); reads source lines."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"Thread 0x{ident:x} ({names.get(ident, '?')}), most recent call last:\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


AWAIT_CHAIN_MAX = 64
"""Links :func:`await_chain` follows at most (a cycle or a runaway chain is cut there)."""


def await_chain(task: "asyncio.Future[Any] | None") -> str:
    """Where the asyncio ``task`` waits now: its coroutine and each coroutine it awaits in turn (``cr_await``), one
    ``File "...", line N, in name`` line each, outermost first, then what the innermost awaits (a future, a task, an
    event's waiter), or how it ended. Thread stacks (:func:`thread_stacks`) cannot say it: a coroutine suspended at an
    ``await`` is on no thread's stack, so a step hung on an await (a hand-off's wait for send room, a wait for a peer)
    showed only the event loop idle in ``select``. Readable from another thread (the watchdog's): it only reads
    attributes, and a chain that changes meanwhile is read as it is then (never raises; at most
    :data:`AWAIT_CHAIN_MAX` links). ``None``: ``"(no task)"``."""
    if task is None:
        return "(no task)"
    try:
        if task.done():
            return f"(task {_name(task)} is done: {'cancelled' if task.cancelled() else repr(task.exception())})"
        get_coro = getattr(task, "get_coro", None)
        obj: object = get_coro() if get_coro is not None else task
        lines = [f"Task {_name(task)}, awaiting (outermost first):"]
        for _ in range(AWAIT_CHAIN_MAX):
            frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
            if frame is None and not hasattr(obj, "cr_await") and not hasattr(obj, "gi_yieldfrom"):
                lines.append(f"  awaits {_short(obj)}")
                break
            if frame is not None:
                code = frame.f_code
                lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
            nxt = getattr(obj, "cr_await", None)
            if nxt is None:
                nxt = getattr(obj, "gi_yieldfrom", None)
            if nxt is None:
                break
            obj = nxt
        return "\n".join(lines)
    except Exception as e:  # a diagnostic: never let it fail the report it goes into
        return f"(await chain unreadable: {e!r})"


def _name(task: object) -> str:
    get_name = getattr(task, "get_name", None)
    return str(get_name()) if get_name is not None else type(task).__name__


def _short(obj: object) -> str:
    """``obj`` (a future, a task, a future's iterator) in one line of at most 300 characters."""
    try:
        text = repr(obj)
    except Exception as e:
        text = f"<{type(obj).__name__}: repr failed: {e!r}>"
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


def overdue(since: float | None, now: float, timeout_s: float) -> bool:
    """True if a step that started at ``since`` (monotonic s; None: no step in flight) has run
    longer than ``timeout_s`` at ``now``."""
    return since is not None and now - since > timeout_s


class StepWatchdog:
    """Watches the engine step in flight from a thread of its own (module docstring).

    Args:
        timeout_s: wall seconds one step may run (> 0).
        on_hang: called once, on the watcher thread, with the :class:`StepHung` (or
            :class:`LoopBlocked`) and the threads' stacks (:func:`thread_stacks`); it should log,
            stop taking work and ask the service to stop. Its exceptions are printed and ignored:
            the exit follows anyway.
        grace_s: wall seconds to wait for :meth:`exit_ready` after ``on_hang`` before exiting.
        exit: ends the process (``os._exit``; tests pass a recorder). Called with :data:`EXIT_CODE`.
        clock: monotonic seconds.

    Raises:
        ValueError: ``timeout_s`` or ``grace_s`` not positive.
    """

    def __init__(
        self,
        timeout_s: float,
        on_hang: Callable[[StepHung | LoopBlocked, str], None],
        *,
        grace_s: float = GRACE_S,
        exit: Callable[[int], object] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not timeout_s > 0 or not grace_s > 0:
            raise ValueError(f"watchdog timeout and grace must be positive seconds, got {timeout_s!r}, {grace_s!r}")
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.poll_s = min(1.0, timeout_s / 8)
        self._on_hang = on_hang
        self._exit = exit
        self._clock = clock
        self._step: tuple[float, StepInfo] | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.fired: StepHung | LoopBlocked | None = None
        """The hang found (None until then)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticked = 0.0
        """When the loop last ran a tick (monotonic s; or was last seen not running)."""
        self._tick_posted = False
        """A tick is in the loop's queue (one at a time: a blocked loop does not pile them up)."""
        self._thread = threading.Thread(target=self._watch, name="worker-step-watchdog", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the watcher thread; with ``loop`` (the service's event loop), also end the process
        when that loop runs nothing for ``timeout_s`` with no step watched (module docstring)."""
        self._loop = loop
        self._ticked = self._clock()
        self._thread.start()

    def loop_idle_s(self) -> float:
        """Wall seconds since the watched loop last ran a tick (0 without a loop or while it is not
        running); normally under the poll interval."""
        loop = self._loop
        return 0.0 if loop is None or not loop.is_running() else max(0.0, self._clock() - self._ticked)

    def stop(self) -> None:
        """Stop watching once no step is in flight (the service stops). A step still in flight (a
        forward the stop could not interrupt) is watched until it ends or hangs past the timeout;
        a hang already found still ends the process."""
        self._stop.set()

    def begin(self, info: StepInfo) -> None:
        """A step starts now (one at a time: a step that begins replaces the one in flight). Called
        on the loop: it ran just now."""
        now = self._clock()
        self._ticked = now
        self._step = (now, info)

    def end(self) -> None:
        """The step in flight ended (a no-op when none is). Called on the loop (or, for a step a
        stop abandoned, by its thread): the loop ran just now."""
        self._ticked = self._clock()
        self._step = None

    def running_s(self) -> float:
        """Wall seconds the step in flight has run (0 when none)."""
        step = self._step
        return 0.0 if step is None else max(0.0, self._clock() - step[0])

    def exit_ready(self) -> None:
        """The service has stopped after a hang (its last messages are out): exit now."""
        self._ready.set()

    def _watch(self) -> None:
        while True:
            step = self._step  # one read: the loop thread may replace it meanwhile
            if step is None and self._stop.is_set():
                return
            if step is not None and overdue(step[0], self._clock(), self.timeout_s):
                self._fire(StepHung(step[1], self._clock() - step[0], self.timeout_s))
                return
            if step is None and self._loop is not None and not self._stop.is_set():
                blocked = self._check_loop()
                if blocked is not None:
                    self._fire(LoopBlocked(blocked, self.timeout_s))
                    return
            if self._stop.is_set():
                time.sleep(self.poll_s)
            else:
                self._stop.wait(self.poll_s)

    def _tick(self) -> None:
        """Run by the loop: it is alive now."""
        self._ticked = self._clock()
        self._tick_posted = False

    def _check_loop(self) -> float | None:
        """Wall seconds the running loop has run no tick, when past the timeout (else None); posts
        the next tick. A loop not running is not blocked; a closed one is no longer watched."""
        loop, now = self._loop, self._clock()
        if loop is None or not loop.is_running():
            self._ticked, self._tick_posted = now, False
            return None
        if overdue(self._ticked, now, self.timeout_s):
            return now - self._ticked
        if not self._tick_posted:
            self._tick_posted = True
            try:
                loop.call_soon_threadsafe(self._tick)
            except RuntimeError:  # closed meanwhile
                self._loop = None
        return None

    def _fire(self, hang: StepHung | LoopBlocked) -> None:
        self.fired = hang
        try:
            stacks = thread_stacks()
        except Exception as e:  # the hang is reported all the same
            stacks = f"(no stacks: {e!r})"
        try:
            self._on_hang(self.fired, stacks)
        except Exception as e:  # never let a logging failure keep a hung node alive
            print(f"worker: step watchdog: on_hang failed: {e!r}", file=sys.stderr)
        self._ready.wait(self.grace_s)
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        self._exit(EXIT_CODE)
