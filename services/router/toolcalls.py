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
  it is a JSON object with a non-empty string ``name`` and an ``arguments`` key, whose value may be any JSON
  value (vLLM's whole-response parser reads ``call["arguments"]``; without the key, as with ``parameters``
  instead, it keeps the text);
* a body that is not (invalid JSON or nested too deep for the decoder, no name, no arguments) stays in ``content`` as it was written, tags included. vLLM's
  whole-response parser leaves *all* the text as content when any body fails; here only that call is text,
  so that a stream, which cannot take back a call it sent, and a whole response agree;
* the whitespace right after a parsed call (the newline between two calls) is dropped; text before the first
  call is kept as written (vLLM keeps it). vLLM's whole response keeps only the text before the first call;
  its stream sends the text after a call too, as this does (both modes here).

Tokenizers that mark the tags special tokens (Hermes-2-Pro / Hermes-3) would lose them in the usual decode, which
skips special tokens: the router decodes such a request through :func:`keep_tags` (vLLM's hermes parser turns
``skip_special_tokens`` off for it).

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
    """The call that ``body`` (the text between the tags) holds, or None when it is not one: invalid JSON (nested
    past the JSON decoder's recursion limit, ~1,000 levels, too), not an object, no non-empty string ``name``, no
    ``arguments`` key (vLLM's whole-response parser reads ``call["arguments"]``: a KeyError keeps the text as
    content; a body with ``parameters`` instead is not a call with its parameters dropped). ``arguments`` is
    ``json.dumps`` of the body's (any JSON value, ``null`` too; ``ensure_ascii=False``, as vLLM's). Never raises."""
    try:
        obj = json.loads(body)
        if not isinstance(obj, dict) or "arguments" not in obj:
            return None
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return None
        return ToolCall(tool_call_id(), name, json.dumps(obj["arguments"], ensure_ascii=False))
    except (ValueError, RecursionError):  # JSONDecodeError, a lone surrogate's UnicodeDecodeError; too deep (vLLM
        return None  # catches any Exception there and keeps the text)


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
    :attr:`calls` counts the calls returned so far (the next call's ``index``).

    Linear in the text: a call's body is kept as its pieces and each push searches only its own text and the
    body's last ``len("</tool_call>") - 1`` characters (where the tag may have begun); outside a call at most
    ``len("<tool_call>") - 1`` characters are held. (Joining and searching the whole body at each push was
    quadratic: 17.9 s of CPU for a 100k-token call in 4-character pieces.)"""

    _TAIL = len(END) - 1

    def __init__(self) -> None:
        self._held = ""  # outside a call: the end of the text that may begin <tool_call>
        self._body: list[str] = []  # inside a call: its body so far, as pushed
        self._tail = ""  # inside a call: the body's last _TAIL characters
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
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._inside:
                seen = self._tail + text
                j = seen.find(END)
                if j < 0:  # the body's earlier text held no </tool_call>: none can end before the tail
                    self._body.append(text)
                    self._tail = seen[-self._TAIL:]
                    break
                cut = j - len(self._tail)  # where </tool_call> starts in text (< 0: in the body's tail)
                body = "".join(self._body)
                body = body[: len(body) + cut] if cut < 0 else body + text[:cut]
                self._body, self._tail, self._inside = [], "", False
                self._close(body, True, out, calls)
                text = text[cut + len(END):]
            else:
                buf = self._held + text
                i = buf.find(START)
                if i < 0:
                    keep = _held_prefix(buf, START)
                    self._text(out, buf[: len(buf) - keep])
                    self._held = buf[len(buf) - keep:]
                    break
                self._text(out, buf[:i])
                self._held = ""
                text = buf[i + len(START):]
                self._inside = True
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the output: what is still held (an unclosed call's body is parsed as a call, as vLLM's)."""
        out: list[str] = []
        calls: list[ToolCall] = []
        if self._inside:
            body = "".join(self._body)
            self._body, self._tail, self._inside = [], "", False
            self._close(body, False, out, calls)
        else:
            held, self._held = self._held, ""
            self._text(out, held)
        return "".join(out), calls


class TagKeepingTokenizer:
    """A view of a tokenizer (``shared.tokenizer``'s) whose :meth:`decode` by default skips every special token but
    the tool-call tags: for a request whose output is parsed, when the tokenizer marks ``<tool_call>`` /
    ``</tool_call>`` special (Hermes-2-Pro / Hermes-3 do; Qwen2.5 / Qwen3 do not), else the tags vanished before the
    parser. vLLM's hermes parser turns ``skip_special_tokens`` off for such a request (vllm-project/vllm#25281), which
    shows the other special tokens too (a ``<|im_start|>`` the model writes); here they stay out as in any other
    output (the ids are dropped before a decode that keeps the rest: what ``tokenizers`` does for
    ``skip_special_tokens``). Everything else is the tokenizer's.

    Args:
        tokenizer: the router's tokenizer.
        drop: the special token ids to leave out (all but the tags').
    """

    def __init__(self, tokenizer: Any, drop: frozenset[int]) -> None:
        self._tok = tokenizer
        self._drop = drop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def decode(self, ids: Any, *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``: special tokens but the tags left out (``skip_special_tokens`` True), or all shown."""
        if skip_special_tokens:
            drop = self._drop
            ids = [i for i in ids if i not in drop]
        return str(self._tok.decode(ids, skip_special_tokens=False))


def keep_tags(tokenizer: Any) -> TagKeepingTokenizer | None:
    """The :class:`TagKeepingTokenizer` of ``tokenizer`` when it marks a tool-call tag special (its
    ``special_tokens()``: id → text; a tokenizer without that method has none), else None (the tags are plain text:
    decode as for any request)."""
    listed = getattr(tokenizer, "special_tokens", None)
    special: dict[int, str] = listed() if listed is not None else {}
    if not any(text in (START, END) for text in special.values()):
        return None
    return TagKeepingTokenizer(tokenizer, frozenset(i for i, text in special.items() if text not in (START, END)))


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
