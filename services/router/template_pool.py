"""Request chat templates rendered in child processes, with a deadline and a memory cap.

With ``--trust-request-chat-template`` a request may carry its own Jinja chat template (``chat_template``). Jinja's
sandbox stops a template from reaching Python internals, but not from looping or allocating: 181 bytes of nested
``range`` loops held the router's event loop 26 s, 207 bytes grew it until ``up``'s liveness watch killed it, and
a template rendered in a worker thread could not be stopped at all. So a request's template (only a request's:
the model's own template is the operator's and renders in the router) is compiled and rendered here, in one of
:data:`POOL_SIZE` persistent child processes (``python -m services.router.template_pool``), each with an address
space of at most :data:`CHILD_MEMORY_BYTES` (``RLIMIT_AS``); a render that takes longer than
:data:`RENDER_DEADLINE_S` seconds gets its child killed and replaced, and the request a 400. The router's event
loop only awaits pipes.

The wire: each message is an 8-byte big-endian length then that many bytes of JSON, parent → child a job
``{"source", "messages", "tools", "add_generation_prompt", "continue_final_message", "special", "kwargs",
"max_chars"}``, child → parent ``{"ok": text}`` or ``{"error": reason}``. JSON both ways (never pickle): what a
child says is data, even from a child a template has subverted. The child's first message says it is ready
(``{"ready": true}``) or why it cannot render at all (``{"error": ...}``: jinja2 missing or too old).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import structlog

POOL_SIZE = 2
"""Child processes rendering request templates at once (the others wait, at most :data:`RENDER_DEADLINE_S`)."""
RENDER_DEADLINE_S = 2.0
"""Seconds a request template may take to compile and render (its wait for a free child aside); past it the child
is killed and the request gets a 400 naming ``chat_template``."""
QUEUE_DEADLINE_S = 2.0
"""Seconds a request template waits for a free child before the request gets a 503 (every child busy)."""
CHILD_MEMORY_BYTES = 1024 * 1024 * 1024
"""A child's address-space limit (``RLIMIT_AS``, bytes): a child with ``jinja2`` and ``numpy`` loaded maps ~150 MB;
a template that allocates past the limit gets a ``MemoryError`` (a 400), never the router's memory."""
MAX_TEMPLATE_CHARS = 64 * 1024
"""Longest request ``chat_template`` (characters): a model's template is a few KB (Llama 3.1's 4.7 KB, Qwen3's
4.1 KB); a 683 KB one took 10 s to compile."""
CHILD_CPU_S = RENDER_DEADLINE_S + 3.0
"""CPU seconds one render may use before the kernel ends its child (``RLIMIT_CPU``, SIGXCPU): the router kills it
at :data:`RENDER_DEADLINE_S` of wall time, but a router that is itself killed (``up``'s liveness watch, the OOM
killer) leaves its children behind, and one rendering a template that never ends would spin forever."""
RESPAWN_FIRST_S = 1.0
RESPAWN_MAX_S = 30.0
"""A replacement child that fails to start is tried again after 1 s, doubling to at most 30 s, each failure logged:
before, the pool shrank silently and, every child lost, each request template got a 503 until the router restarted."""
START_TIMEOUT_S = 60.0
"""Seconds a new child may take to start (import ``jinja2`` and this package) and say it is ready."""

_HEADER = struct.Struct(">Q")
_CHILD_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "SYSTEMROOT")
"""The router's environment variables a child gets (and ``PYTHONPATH``): the locale and time zone a template's
``strftime_now`` reads, nothing of the router's settings."""


class TemplateRenderError(Exception):
    """A request template that could not be rendered; ``str(e)`` says why (the template's own error, its time or
    memory, its rendered length), ``status`` is the HTTP status to answer (400; 503 when every child is busy)."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.status = status


class TemplatePoolError(RuntimeError):
    """The pool cannot start: a child could not render any template (``jinja2`` missing or too old) or did not
    start in :data:`START_TIMEOUT_S` seconds."""


class _Child:
    """One child process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self.stdin: asyncio.StreamWriter = proc.stdin
        self.stdout: asyncio.StreamReader = proc.stdout

    async def send(self, msg: Any) -> None:
        data = json.dumps(msg).encode()  # ASCII: a lone surrogate a JSON body may carry (\ud800) travels escaped
        self.stdin.write(_HEADER.pack(len(data)) + data)
        await self.stdin.drain()

    async def recv(self) -> Any:
        (n,) = _HEADER.unpack(await self.stdout.readexactly(_HEADER.size))
        return json.loads(await self.stdout.readexactly(n))

    async def kill(self) -> None:
        """Kill the child, reap it and close its pipes (read to their end: what a killed child had written)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()
        self.stdin.close()
        with contextlib.suppress(Exception):
            await self.stdin.wait_closed()
        with contextlib.suppress(Exception):
            while await asyncio.wait_for(self.stdout.read(1 << 16), 1.0):
                pass


class RequestTemplatePool:
    """:data:`POOL_SIZE` children that render request chat templates (module docstring); one per render at a time.

    Args:
        size: children.
        deadline_s: seconds one compile + render may take (:data:`RENDER_DEADLINE_S`).
        queue_s: seconds a render waits for a free child (:data:`QUEUE_DEADLINE_S`).
        memory_bytes: each child's ``RLIMIT_AS`` (:data:`CHILD_MEMORY_BYTES`).
        cpu_s: CPU seconds a render may use before the kernel ends its child (:data:`CHILD_CPU_S`).
    """

    def __init__(
        self, size: int = POOL_SIZE, *, deadline_s: float = RENDER_DEADLINE_S, queue_s: float = QUEUE_DEADLINE_S,
        memory_bytes: int = CHILD_MEMORY_BYTES, cpu_s: float = CHILD_CPU_S,
    ) -> None:
        self.size = size
        self.deadline_s = deadline_s
        self.queue_s = queue_s
        self.memory_bytes = memory_bytes
        self.cpu_s = cpu_s
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        self._all: set[_Child] = set()
        self._replacing: set[asyncio.Task[None]] = set()
        self._closed = False
        self._closing = asyncio.Event()
        self.killed = 0
        """Children killed at the deadline (or dead on their own) and replaced."""
        self.spawn_failures = 0
        """Replacement children that failed to start (each tried again: :data:`RESPAWN_FIRST_S`)."""

    async def start(self) -> None:
        """Start every child and wait until each is ready.

        Raises:
            TemplatePoolError: a child cannot render templates (its reason: jinja2 missing or too old) or did not
                start in :data:`START_TIMEOUT_S` seconds.
        """
        children = await asyncio.gather(*(self._spawn() for _ in range(self.size)), return_exceptions=True)
        failed = [c for c in children if isinstance(c, BaseException)]
        for c in children:
            if isinstance(c, _Child):
                self._idle.put_nowait(c)
        if failed:
            await self.close()
            raise TemplatePoolError(str(failed[0])) from failed[0]

    async def _spawn(self) -> _Child:
        """A new child, ready (its first message read)."""
        root = str(Path(__file__).resolve().parents[2])  # the folder holding services/ and shared/
        # not the router's environment (its settings, a NATS URL, secrets a template that escaped the sandbox would read)
        env = {k: v for k, v in os.environ.items() if k in _CHILD_ENV}
        env.update(PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.router.template_pool", str(self.memory_bytes), str(self.cpu_s),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )
        child = _Child(proc)
        self._all.add(child)
        try:
            hello = await asyncio.wait_for(child.recv(), START_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            self._all.discard(child)
            await child.kill()
            raise TemplatePoolError(f"a chat template child process did not start (exit code {proc.returncode}): {e!r}") from e
        if not (isinstance(hello, dict) and hello.get("ready") is True):
            self._all.discard(child)
            await child.kill()
            reason = hello.get("error") if isinstance(hello, dict) else hello
            raise TemplatePoolError(f"request chat templates cannot be rendered: {reason}")
        return child

    def _replace(self, child: _Child) -> None:
        """Kill ``child`` and start another in its place, in the background."""
        self.killed += 1
        self._all.discard(child)
        with contextlib.suppress(ProcessLookupError):
            child.proc.kill()  # now: it may be burning a core

        async def run() -> None:
            await child.kill()
            if self._closed:
                return
            wait_s = RESPAWN_FIRST_S
            while True:
                try:
                    new = await self._spawn()
                    break
                except TemplatePoolError as e:  # renders wait for the children left (a 503 when none) meanwhile
                    self.spawn_failures += 1
                    structlog.get_logger("router").warning(
                        "a chat template child could not be started; trying again", error=str(e), retry_in_s=wait_s,
                        children_left=len(self._all))
                    with contextlib.suppress(TimeoutError):  # the backoff, cut short by a close
                        await asyncio.wait_for(self._closing.wait(), wait_s)
                    wait_s = min(wait_s * 2, RESPAWN_MAX_S)
                    if self._closed:
                        return
            if self._closed:
                await new.kill()
            else:
                self._idle.put_nowait(new)

        task = asyncio.get_running_loop().create_task(run())
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def render(
        self, source: str, messages: list[dict[str, Any]], tools: list[Any] | None, *, add_generation_prompt: bool,
        continue_final_message: bool, special: dict[str, str], kwargs: dict[str, Any], max_chars: int,
    ) -> str:
        """``source`` compiled and rendered in a child as ``shared.tokenizer``'s ``_render_template`` renders it
        (transformers' environment and variables).

        Args:
            source: the request's template, at most :data:`MAX_TEMPLATE_CHARS` characters (the caller checks).
            messages / tools / add_generation_prompt / continue_final_message / kwargs: as
                ``Tokenizer.render_chat`` takes them (JSON values).
            special: the model's special tokens (``bos_token``...: text) the template sees.
            max_chars: longest rendered text accepted (characters).

        Returns:
            the rendered prompt text.

        Raises:
            TemplateRenderError: the template's own error (compile, ``raise_exception``, sandbox, conversation),
                a render past :data:`RENDER_DEADLINE_S` (the child killed), out of the child's memory, a text over
                ``max_chars``, a child that died; 503 when no child was free within :data:`QUEUE_DEADLINE_S`.
        """
        if self._closed:
            raise TemplateRenderError("the router is stopping", 503)
        try:
            child = await asyncio.wait_for(self._idle.get(), self.queue_s)
        except TimeoutError:
            raise TemplateRenderError(f"every chat template renderer was busy for {self.queue_s:g} s; retry later", 503) from None
        job = {"source": source, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message, "special": special, "kwargs": kwargs, "max_chars": max_chars}
        try:
            reply = await asyncio.wait_for(self._exchange(child, job), self.deadline_s)
        except TimeoutError:
            self._replace(child)
            raise TemplateRenderError(f"took longer than {self.deadline_s:g} s to render") from None
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            self._replace(child)
            raise TemplateRenderError(f"its renderer process ended while rendering it ({type(e).__name__})") from None
        except BaseException:  # cancelled (the client went): the child may be mid-render, so it is not reused
            self._replace(child)
            raise
        if isinstance(reply, dict) and reply.get("fatal"):
            self._replace(child)
        else:
            self._idle.put_nowait(child)
        if isinstance(reply, dict) and isinstance(reply.get("ok"), str):
            return str(reply["ok"])
        reason = reply.get("error") if isinstance(reply, dict) else None
        raise TemplateRenderError(str(reason) if reason else "its renderer gave no answer")

    @staticmethod
    async def _exchange(child: _Child, job: dict[str, Any]) -> Any:
        await child.send(job)
        return await child.recv()

    async def close(self) -> None:
        """Kill every child, the replacements being started too (awaited, not cancelled: a start cancelled inside
        ``create_subprocess_exec`` leaves a child no one holds; each sees the pool closed and kills its own)."""
        self._closed = True
        self._closing.set()
        for task in list(self._replacing):
            with contextlib.suppress(BaseException):
                await task
        for child in list(self._all):
            await child.kill()
        self._all.clear()


def _child_main(memory_bytes: int, cpu_s: float) -> None:
    """A child's loop: read a job, answer it, until the parent closes the pipe (module docstring). Each render
    may use ``cpu_s`` CPU seconds more than the child has used so far (``RLIMIT_CPU``'s soft limit, moved per job:
    past it the kernel's SIGXCPU ends the child, orphaned or not)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)[1]

    def cpu_budget() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(usage.ru_utime + usage.ru_stime + cpu_s) + 1
        if cpu_hard != resource.RLIM_INFINITY:
            soft = min(soft, cpu_hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_hard))
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the pipe

    def send(msg: Any) -> None:
        data = json.dumps(msg).encode()  # ASCII: a lone surrogate a JSON body may carry (\ud800) travels escaped
        out.write(_HEADER.pack(len(data)) + data)
        out.flush()

    try:
        from shared.tokenizer import TokenizerError, _render_template, chat_template_env, compile_chat_template

        chat_template_env()
    except Exception as e:  # TokenizerError (jinja2 missing or too old), or an import that fails
        send({"error": str(e)})
        return
    send({"ready": True})
    while True:
        head = inp.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return
        (n,) = _HEADER.unpack(head)
        try:
            job = json.loads(inp.read(n))
            cpu_budget()
            text = _render_template(
                compile_chat_template(job["source"]), job["messages"], job["tools"], bool(job["add_generation_prompt"]),
                bool(job["continue_final_message"]), job["special"], job["kwargs"],
            )
        except MemoryError:
            send({"error": f"ran out of memory rendering it (a renderer may map {memory_bytes} bytes)", "fatal": True})
            continue
        except RecursionError:
            send({"error": "nests too deeply to compile or render (Python's recursion limit)", "fatal": True})
            continue
        except TokenizerError as e:  # "invalid chat template: ..."
            send({"error": str(e)})
            continue
        except Exception as e:  # the template's own error (raise_exception, a sandbox refusal, a bad value)
            send({"error": f"cannot render it: {type(e).__name__}: {e}"})
            continue
        max_chars = int(job["max_chars"])
        if len(text) > max_chars:
            send({"error": f"rendered to {len(text)} characters; at most {max_chars} are accepted (the router's --max-body-bytes)"})
        else:
            send({"ok": text})


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), float(sys.argv[2]))
