"""Tool calls in a chat completion's text → OpenAI's ``tool_calls`` (vLLM's ``--tool-call-parser``), sans I/O.

With the router's ``--enable-auto-tool-choice --tool-call-parser hermes`` (vLLM's flags) a chat request whose
``tool_choice`` is ``auto`` (or that sends ``tools`` without ``tool_choice``: vLLM defaults it to ``auto``) has
its output text read for the calls of the Hermes format, which Qwen2.5 / Qwen3 and Hermes models write::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each call becomes ``{"id": "chatcmpl-tool-<32 hex>", "type": "function", "function": {"name": ...,
"arguments": <the arguments as JSON text>}}`` (vLLM's ids and shape: ``arguments`` is ``json.dumps`` of the
object, non-ASCII kept); ``content`` is the text outside the calls, ``None`` when none is left. The rules,
the same for a whole response (:func:`extract`) and a stream (:class:`HermesStream`, whose pieces join to
exactly what :func:`extract` returns, wherever the text is split):

* the body between ``<tool_call>`` and ``</tool_call>`` (or the end of the text, as vLLM's regex
  ``<tool_call>(.*)``: a model stopped by ``stop=["</tool_call>"]`` or its EOS before the tag) is a call when
  it is a JSON object with a non-empty string ``name``; its ``arguments`` may be any JSON value (missing:
  ``{}``, as vLLM's streamed parser sends for a call with none);
* a body that is not (invalid JSON, no name) stays in ``content`` as it was written, tags included. vLLM's
  whole-response parser leaves *all* the text as content when any body fails; here only that call is text,
  so that a stream, which cannot take back a call it sent, and a whole response agree;
* the whitespace right after a parsed call (the newline between two calls) is dropped; text before the first
  call is kept as written (vLLM keeps it). vLLM's whole response keeps only the text before the first call;
  its stream sends the text after a call too, as this does (both modes here).

A stream holds text back only while it may be a call: from a ``<`` that may start ``<tool_call>`` until it
does not, and from ``<tool_call>`` until ``</tool_call>`` (or the end); each call is sent whole, in one delta.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

START = "<tool_call>"
END = "</tool_call>"

KNOWN_PARSERS = ("hermes",)
"""The ``--tool-call-parser`` names this router knows (vLLM's names)."""


def check_parser(name: str) -> None:
    """``name`` is empty (no parser) or one of :data:`KNOWN_PARSERS`.

    Raises:
        ValueError: another name; the message lists the known ones.
    """
    if name and name not in KNOWN_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known; known: {', '.join(KNOWN_PARSERS)}")


def tool_call_id() -> str:
    """A new call id, vLLM's scheme: ``chatcmpl-tool-`` and 32 random hex digits."""
    return "chatcmpl-tool-" + secrets.token_hex(16)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``name`` (non-empty) and ``arguments`` (JSON text), its ``id`` (:func:`tool_call_id`)."""

    id: str
    name: str
    arguments: str

    def message(self) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls[i]``: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict[str, Any]:
        """A stream's ``delta.tool_calls[i]``: :meth:`message` with the call's ``index`` in the response (0-based)."""
        return {"index": index, **self.message()}


def parse_body(body: str) -> ToolCall | None:
    """The call that ``body`` (the text between the tags) holds, or None when it is not one (invalid JSON, not an
    object, no non-empty string ``name``). ``arguments`` is ``json.dumps`` of the body's (``ensure_ascii=False``,
    as vLLM's), ``"{}"`` when the body has none."""
    try:
        obj = json.loads(body)
    except ValueError:  # json.JSONDecodeError, and a lone surrogate's UnicodeDecodeError
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", {})
    return ToolCall(tool_call_id(), name, json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag`` (what may still become it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesStream:
    """The Hermes parser of one streamed output: :meth:`push` each new piece of text, :meth:`finish` once at the end;
    each returns ``(content, calls)``: the text to send now (``""``: none) and the calls completed in it, in order
    (all the content a push returns came before its calls or between them: see :func:`extract` for the rules).
    :attr:`calls` counts the calls returned so far (the next call's ``index``)."""

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False  # after a <tool_call> whose </tool_call> has not come
        self._after_call = False  # drop whitespace: nothing but whitespace since the last parsed call
        self.calls = 0

    def _text(self, out: list[str], text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        out.append(text)

    def _close(self, body: str, closed: bool, out: list[str], calls: list[ToolCall]) -> None:
        call = parse_body(body)
        if call is None:  # not a call: the text as the model wrote it
            self._text(out, START + body + (END if closed else ""))
            return
        calls.append(call)
        self.calls += 1
        self._after_call = True

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """Take the next piece of output text; returns what can be sent now (content, calls)."""
        buf = self._buf + text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._inside:
                j = buf.find(END)
                if j < 0:
                    break
                self._close(buf[:j], True, out, calls)
                buf = buf[j + len(END):]
                self._inside = False
            else:
                i = buf.find(START)
                if i < 0:
                    keep = _held_prefix(buf, START)
                    self._text(out, buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                self._text(out, buf[:i])
                buf = buf[i + len(START):]
                self._inside = True
        self._buf = buf
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the output: what is still held (an unclosed call's body is parsed as a call, as vLLM's)."""
        buf, self._buf = self._buf, ""
        out: list[str] = []
        calls: list[ToolCall] = []
        if self._inside:
            self._inside = False
            self._close(buf, False, out, calls)
        else:
            self._text(out, buf)
        return "".join(out), calls


def extract(text: str) -> tuple[str | None, list[ToolCall]]:
    """The calls in a whole response's ``text`` and its ``content``: ``text`` unchanged when no call parsed (vLLM);
    else the text outside the calls (see the module's rules), ``None`` when that is empty (vLLM's ``content if
    content else None``)."""
    parser = HermesStream()
    content, calls = parser.push(text)
    rest, more = parser.finish()
    calls += more
    if not calls:
        return text, []
    content += rest
    return (content or None), calls


def finish_reason(reason: str | None, calls: int) -> str | None:
    """The ``finish_reason`` a client sees: ``tool_calls`` when ``calls`` > 0 and the model stopped (``stop``);
    otherwise ``reason`` as it is. vLLM says ``tool_calls`` even when ``max_tokens`` cut the output; here a cut
    output stays ``length``, so a client knows its calls may be incomplete and that the model did not end its
    turn."""
    return "tool_calls" if calls and reason == "stop" else reason
