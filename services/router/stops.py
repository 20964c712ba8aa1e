"""Output token ids → the client's text, ended at the request's stop strings / stop token ids
(vLLM's semantics), for both a streamed and a whole response.

The router is where text is made (the nodes produce token ids; ``shared.tokenizer``
detokenizes), so the ``stop`` strings are applied here, for every engine:

* a **stop string** ends the text *before* it (vLLM's default,
  ``include_stop_str_in_output=False``), ``finish_reason`` ``stop``, ``stop_reason`` = the
  string; the tokens up to and including the one that completed it count as output
  (``usage.completion_tokens``), later ones are dropped. Of several stop strings completed
  by the same token, the first in the request's ``stop`` list wins (vLLM's ``check_stop_strings``
  order: ``["User:", "\\nUser:"]`` ends ``"hi\\nUser:"`` at ``"hi\\n"`` with ``User:``);
* a **stop token id** (``stop_token_ids``) ends the output *at* that token: it counts as
  output, its text is not shown (vLLM), ``stop_reason`` = the id. The ``torch`` engine
  ends the request there itself; the ``sim`` engine does not, and the router's stop is
  what ends it;
* ``min_tokens`` (vLLM's extra): neither ends the output at or before its ``min_tokens``-th token
  (vLLM v1: the ``MinTokensLogitsProcessor`` masks stop token ids while the output is shorter,
  and the detokenizer checks stop strings only once ``len(output_token_ids) > min_tokens``,
  in the text the new token added, so a stop string completed earlier is never matched later);
  the ``torch`` engine masks the ids itself, this keeps the ``sim`` engine and stop strings alike;
* ``include_stop_str_in_output`` (vLLM's extra): the text ends *after* the stop string, and a
  stop token id's own text is shown (vLLM v1's detokenizer decodes the stopping token then);
  ``stop_reason`` and the tokens that count are the same;
* **streaming** never sends text a stop string may still cut: the last
  ``len(longest stop string) - 1`` characters are held back until more text shows they
  are not the start of a stop string, or the stream ends (vLLM's ``stop_buffer_length``);
  with ``include_stop_str_in_output`` nothing is held back (a stop string never cuts text
  before its end), as vLLM's ``stop_buffer_length`` 0.

The caller aborts the request on its nodes once :attr:`OutputText.stopped` (no node
decodes on for nobody). Without stops :meth:`OutputText.push` is the plain incremental
decode (``shared.tokenizer.IncrementalDecoder``), one call per chunk, as before.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from shared.tokenizer import IncrementalDecoder, Tokenizer


class OutputText:
    """The text of one request's output as its token ids arrive.

    Args:
        tokenizer: the router's tokenizer.
        stop: stop strings (non-empty; ``api.stop_strings``).
        stop_token_ids: token ids that end the output.
        min_tokens: no stop ends the output at or before this many tokens (vLLM's ``min_tokens``).
        include_stop: keep the matched stop string / the stop token id's text (vLLM's
            ``include_stop_str_in_output``).
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), stop_token_ids: Collection[int] = (), min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        self._dec = IncrementalDecoder(tokenizer)
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.stop = [s for s in stop if s]
        self.stop_ids = frozenset(stop_token_ids)
        self._longest = max((len(s) for s in self.stop), default=0)
        self._window = max(0, self._longest - 1)
        """Characters before new text that a stop string it completes may start in."""
        self._hold = 0 if include_stop else self._window
        """Characters of streamed text held back (the longest stop string's length - 1; none when
        the stop string is kept: a match then cuts only after its end, in the new text)."""
        self._seen = ""
        """With ``include_stop``: the last :attr:`_window` characters handed out (a stop string may
        start in them; without it they are still in :attr:`_pending`)."""
        self._keep = bool(self.stop or self.stop_ids)
        self._given: list[str] = []
        """Pieces handed out by :meth:`push` / :meth:`finish` (a stop string can no longer cut them)."""
        self._pending = ""
        """Text not handed out yet: the last :attr:`_hold` characters at least, unless the output ended.
        Kept apart so each token costs O(its text + the longest stop string), not O(all text so
        far): one string grown by ``+=`` took 9.0 s for 128k streamed tokens (0.5 s without stops)."""
        self.tokens = 0
        """Output tokens that count (with a stop: up to and including the one that ended it)."""
        self.stop_reason: str | int | None = None
        """The stop string or stop token id that ended the output; None while none has."""

    @property
    def text(self) -> str:
        """Text so far (with stops: all of it, cut at the stop once one matched)."""
        return "".join(self._given) + self._pending

    @property
    def stopped(self) -> bool:
        """A stop string or stop token id ended the output (later ids are ignored)."""
        return self.stop_reason is not None

    def push(self, ids: Sequence[int]) -> str:
        """Add the next output ids; return the text that may be sent now (may be empty).
        With stops, ids are decoded one at a time so the stopping token is known exactly."""
        if not self._keep:
            self.tokens += len(ids)
            return self._dec.push(ids)
        if self.stopped:
            return ""
        for t in ids:
            self.tokens += 1
            if self.tokens <= self.min_tokens:  # no stop yet: text only
                self._add(self._dec.push([t]), match=False)
                continue
            if t in self.stop_ids:
                # the text of the tokens before it (an incomplete character included, as a
                # whole decode would show it); the stop token's own text only with include_stop
                # (vLLM v1: a stop string that text completes is then the stop_reason)
                if self.include_stop:
                    self._add(self._dec.push([t]))
                if not self.stopped:
                    self._add(self._dec.flush())
                if not self.stopped:
                    self.stop_reason = t
                break
            if self._add(self._dec.push([t])):
                break
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """End of the output (the node finished it, or :attr:`stopped`): the text not sent yet."""
        if not self._keep:
            return self._dec.flush()
        if not self.stopped:
            # text held for an incomplete character: under min_tokens no stop string ends it here either
            self._add(self._dec.flush(), match=self.tokens > self.min_tokens)
        return self._take(final=True)

    def _add(self, delta: str, *, match: bool = True) -> bool:
        """Append ``delta``; cut :attr:`text` at the first stop string it completes (``match``;
        not while under ``min_tokens``): before it, or after it with :attr:`include_stop`.
        True if one did."""
        if not delta:
            return False
        # a stop string completed by ``delta`` starts at most len(s) - 1 characters before it,
        # all of them in _seen + _pending (_pending keeps _hold = longest - 1 characters until
        # the end; with include_stop _seen keeps them)
        old = len(self._pending)
        self._pending += delta
        if not match or not self.stop:
            return False
        base = len(self._seen)
        text = self._seen + self._pending if base else self._pending
        for s in self.stop:  # the first of the list found wins, as vLLM's check_stop_strings
            k = text.find(s, max(0, base + old - len(s) + 1))
            if k >= 0:
                break
        else:
            return False
        # kept, the stop string ends in delta (k + len(s) > base + old): no text handed out is cut
        self._pending = self._pending[: k + len(s) - base] if self.include_stop else self._pending[:k]
        self.stop_reason = s
        return True

    def _take(self, *, final: bool) -> str:
        end = len(self._pending) if final else len(self._pending) - self._hold
        if end <= 0:
            return ""
        out, self._pending = self._pending[:end], self._pending[end:]
        self._given.append(out)
        if self.include_stop and self._window:
            self._seen = (self._seen + out)[-self._window :]
        return out
