"""Pluggable tokenizers: ``sim`` (built in, deterministic) and ``hf:<local path>``.

Interface (:class:`Tokenizer`)::

    tok = load_tokenizer("sim")                 # or "hf:/models/Qwen3-8B"
    ids = tok.encode("Hello, world!")           # list[int]
    text = tok.decode(ids)                      # str
    ids = tok.apply_chat_template(messages)     # list[int], generation prompt included
    ids = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)  # last message left open
    tok.vocab_size                              # token ids are in [0, vocab_size)

``sim``: words (``\\w+``) and single punctuation characters become token ids by
BLAKE2b (never Python's salted ``hash()``), so the same text gives the same ids
in every process. Ids lie in ``[0, shared.hashing.SIM_VOCAB_SIZE)``. ``decode``
spells every id as a pronounceable three-syllable placeholder word
(``"kadobe"``), and ``encode`` maps such a word back to its id, so text the
sim engine generated re-encodes to the very same ids (a later turn that
quotes an earlier answer hits the same KV blocks). Its chat template is
ChatML (``<|im_start|>role ... <|im_end|>``), with tools and tool calls
rendered as JSON.

``hf:<path>``: a Hugging Face ``tokenizer.json`` (``path`` is the file or the
model folder holding it) loaded with the ``tokenizers`` package, imported
lazily — it is not a core dependency. The chat template is the
``chat_template`` of the folder's ``tokenizer_config.json`` rendered with
``jinja2`` (also imported lazily, as transformers does); a folder without a
template falls back to ChatML with a warning in :attr:`HFTokenizer.notes`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from shared.hashing import SIM_VOCAB_SIZE


class TokenizerError(RuntimeError):
    """A tokenizer cannot be loaded (missing package, missing file, bad spec)."""


class Tokenizer(Protocol):
    """What the router needs from a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (completion prompts; special tokens as the model adds them unless
        ``add_special_tokens`` is False, as vLLM's ``add_special_tokens``)."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (BOS, EOS, chat markers) are left out unless
        ``skip_special_tokens`` is False (output text skips them, as vLLM's default
        ``skip_special_tokens``; an echoed token-id prompt keeps them, as vLLM's)."""
        ...

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary piece as the vocabulary spells it (byte-level BPE's ``Ġhello``, special tokens
        shown), as transformers' ``convert_ids_to_tokens`` (vLLM's ``/tokenize`` ``token_strs``); an id outside the
        vocabulary gives ``""``."""
        ...

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, *,
        add_generation_prompt: bool = True, continue_final_message: bool = False,
    ) -> str:
        """The chat template's text of a chat, the very string :meth:`apply_chat_template` encodes (flags as
        there).

        Raises:
            ValueError: as :meth:`apply_chat_template`.
        """
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, *,
        add_generation_prompt: bool = True, continue_final_message: bool = False, add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of a chat (``encode(render_chat(...), add_special_tokens=add_special_tokens)``), ending with the assistant generation prompt (``add_generation_prompt``, the
        default) or after the last message's end of turn (False), or inside the last message
        (``continue_final_message``: its text left open, no end of turn, as transformers' / vLLM's);
        ``add_special_tokens`` adds the model's special tokens (BOS) on top of the template's.

        Raises:
            ValueError: ``continue_final_message`` with ``add_generation_prompt``, or a final message
                without text (content None) or whose text the rendered chat does not hold (:func:`tag_final`,
                :func:`continue_final`).
        """
        ...


# --------------------------------------------------------------------------- #
# sim
# --------------------------------------------------------------------------- #

_CONSONANTS = "bdfghjklmnprstvz"  # 16
_VOWELS = "aeiou"  # 5
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]  # 80; 80**3 = 512000 >= SIM_VOCAB_SIZE
_SYL_INDEX = {s: i for i, s in enumerate(_SYLLABLES)}
_NSYL = len(_SYLLABLES)
_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)
_NON_WORD = re.compile(r"\W", re.UNICODE)
_SIM_CHUNK_CHARS = 65_536
"""Characters of a text above which :meth:`SimTokenizer.encode` splits it into pieces of about this size:
one ``findall`` is one C call that holds the GIL for the whole text (a 60 MB prompt of 30M words: 12.5 s
here, during which the router's event loop, every stream, stopped although the call ran in a worker thread);
a piece takes ~10 ms, and the GIL is handed over between pieces."""
_SIM_WORD = re.compile(r"^(?:[bdfghjklmnprstvz][aeiou]){3}$")


def _render_chatml(
    messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool = True, continue_final_message: bool = False,
) -> str:
    """ChatML rendering used by the sim tokenizer (and HF folders without a template); ``continue_final_message``
    leaves the last message open: cut right after its text (no ``<|im_end|>``, no tool calls rendered after the
    text), as transformers cuts a template's (:func:`continue_final`); ``add_generation_prompt`` appends ``<|im_start|>assistant``."""
    return _render_chat(lambda msgs, gen: _chatml(msgs, tools, gen), messages, add_generation_prompt, continue_final_message)


def _render_chat(
    render: Callable[[list[dict[str, Any]], bool], str], messages: list[dict[str, Any]], add_generation_prompt: bool,
    continue_final_message: bool,
) -> str:
    """``render(messages, add_generation_prompt)`` (a chat template) with transformers' ``continue_final_message``
    on top: the flags checked (:func:`_check_chat_flags`), the final message tagged (:func:`tag_final`) and the
    rendering cut after its text (:func:`continue_final`).

    Raises:
        ValueError: both flags true, or a final message that cannot be continued.
    """
    _check_chat_flags(add_generation_prompt, continue_final_message)
    if not continue_final_message:
        return render(messages, add_generation_prompt)
    tagged, final_text = tag_final(messages)
    return continue_final(render(tagged, False), final_text)


def _chatml(messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool) -> str:
    """ChatML text of ``messages`` (+ ``tools``), ``<|im_start|>assistant`` appended with ``add_generation_prompt``."""
    parts: list[str] = []
    if tools:
        parts.append("<|im_start|>system\n# Tools\n" + json.dumps(tools, sort_keys=True, separators=(",", ":")) + "<|im_end|>\n")
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text") or "") for p in content if isinstance(p, dict))  # as vLLM joins text parts
        text = content or ""
        if msg.get("tool_calls"):
            text += "\n<tool_call>" + json.dumps(msg["tool_calls"], sort_keys=True, separators=(",", ":")) + "</tool_call>"
        role = msg.get("role", "user")
        if msg.get("name"):
            role = f"{role} name={msg['name']}"
        if msg.get("tool_call_id"):
            role = f"{role} id={msg['tool_call_id']}"
        parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _check_chat_flags(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if add_generation_prompt and continue_final_message:  # transformers' apply_chat_template refuses the pair too
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""transformers' ``continue_final_message_tag`` (``render_jinja_template``): put after the final message's text
before rendering, so the cut is where the template put that text's end, not wherever the text occurs last."""


def tag_final(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """``messages`` with :data:`_CONTINUE_TAG` after the final message's text (a copy; the caller's are not
    changed) and that text: transformers' ``continue_final_message`` preparation (a list content's last
    ``text`` part is the one tagged).

    Raises:
        ValueError: no messages, or a final message without text to continue (content None, or a list
            with no ``text`` part), as transformers'.
    """
    if not messages:
        raise ValueError("continue_final_message is set but the conversation is empty")
    last = dict(messages[-1])
    content = last.get("content")
    if content is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue')
    if isinstance(content, list):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                final_text = str(part["text"])
                part["text"] = final_text + _CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message is set but the final message has no text to continue")
        last["content"] = parts
    else:
        final_text = str(content)
        last["content"] = final_text + _CONTINUE_TAG
    return [*messages[:-1], last], final_text


def continue_final(rendered: str, final_text: str) -> str:
    """``rendered`` (a chat rendered without the generation prompt from :func:`tag_final`'s messages) cut
    where the final message's text ends, so the model continues that message: transformers'
    ``continue_final_message`` (``render_jinja_template``, which vLLM's ``apply_hf_chat_template`` calls):
    cut at the last tag; when the template trimmed the space after it (it trimmed the message), the
    whitespace before the cut goes too. An empty final text leaves the turn's header open.

    Raises:
        ValueError: the text or the tag is not in ``rendered`` (a template that rewrites the message).
    """
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message: the final message's text is not in the chat the template renders")
    loc = rendered.rindex(tag)
    if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()


class SimTokenizer:
    """Deterministic built-in tokenizer for the sim engine (see module docstring).

    Args:
        vocab_size: ids are in ``[0, vocab_size)``; at most 80**3.
    """

    name = "sim"

    def __init__(self, vocab_size: int = SIM_VOCAB_SIZE) -> None:
        if not 0 < vocab_size <= _NSYL**3:
            raise ValueError(f"sim vocab_size must be in (0, {_NSYL**3}], got {vocab_size}")
        self.vocab_size = vocab_size
        self._cache: dict[str, int] = {}

    def word(self, token_id: int) -> str:
        """Placeholder word of one id (ids outside the vocab print as ``<id>``)."""
        if not 0 <= token_id < self.vocab_size:
            return f"<{token_id}>"
        a, rest = divmod(token_id, _NSYL * _NSYL)
        b, c = divmod(rest, _NSYL)
        return _SYLLABLES[a] + _SYLLABLES[b] + _SYLLABLES[c]

    def token_id(self, piece: str) -> int:
        """Id of one word or punctuation character."""
        tid = self._cache.get(piece)
        if tid is not None:
            return tid
        if _SIM_WORD.match(piece):
            tid = (_SYL_INDEX[piece[0:2]] * _NSYL + _SYL_INDEX[piece[2:4]]) * _NSYL + _SYL_INDEX[piece[4:6]]
            if tid >= self.vocab_size:
                tid = None
        if tid is None:
            digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
            tid = int.from_bytes(digest, "little") % self.vocab_size
        if len(self._cache) < 1_000_000:
            self._cache[piece] = tid
        return tid

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids of the words and punctuation of ``text`` (whitespace is dropped; the sim vocabulary has no
        special tokens: ``add_special_tokens`` changes nothing). A text over ``_SIM_CHUNK_CHARS`` characters
        is scanned in pieces cut between tokens (the same ids), so that a caller's other threads run meanwhile."""
        tid = self.token_id
        if len(text) <= _SIM_CHUNK_CHARS:
            return [tid(m) for m in _WORD.findall(text)]
        ids: list[int] = []
        start, n = 0, len(text)
        while start < n:
            # cut just after a non-word character (a space, in no token; or punctuation, a token of its own),
            # so that no word is split: the pieces' tokens are the whole text's
            cut = _NON_WORD.search(text, min(start + _SIM_CHUNK_CHARS, n))
            end = cut.end() if cut is not None else n
            ids.extend([tid(m) for m in _WORD.findall(text, start, end)])
            start = end
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Placeholder words joined by single spaces (the sim vocabulary has no special tokens:
        ``skip_special_tokens`` changes nothing)."""
        w = self.word
        return " ".join(w(int(i)) for i in ids)

    def special_tokens(self) -> dict[int, str]:
        """The tokens :meth:`decode` leaves out by default: none in the sim vocabulary (``{}``)."""
        return {}

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Each id's placeholder word (:meth:`word`; the sim vocabulary has no other spelling); ``""`` for an id
        outside the vocabulary, as transformers' (which gives None, and vLLM "")."""
        w, n = self.word, self.vocab_size
        return [w(i) if 0 <= i < n else "" for i in map(int, ids)]

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, *,
        add_generation_prompt: bool = True, continue_final_message: bool = False,
    ) -> str:
        """ChatML rendering of ``messages`` (+ tools) (flags: :class:`Tokenizer`). Raises ValueError for both flags
        true."""
        return _render_chatml(messages, tools, add_generation_prompt, continue_final_message)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, *,
        add_generation_prompt: bool = True, continue_final_message: bool = False, add_special_tokens: bool = False,
    ) -> list[int]:
        """:meth:`render_chat` encoded with :meth:`encode` (flags: :class:`Tokenizer`; ``add_special_tokens``
        changes nothing here). Raises ValueError for both flags true."""
        return self.encode(self.render_chat(messages, tools, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message))


# --------------------------------------------------------------------------- #
# hf:<path>
# --------------------------------------------------------------------------- #


_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"})
"""Pre-tokenizers that cut a text without dropping a character (``Split`` and ``Punctuation`` only with a
behaviour other than ``Removed``; ``Whitespace`` / ``WhitespaceSplit`` / ``BertPreTokenizer`` /
``CharDelimiterSplit`` drop characters)."""


def _keeps_characters(pre: Any) -> bool:
    """True when the ``pre_tokenizer`` of a ``tokenizer.json`` (None, one, or a ``Sequence``) keeps every
    character: each is in :data:`_KEEPING_PRE_TOKENIZERS` and none has ``behavior: "Removed"`` (it drops what its
    pattern matches: ``Split``'s, ``Punctuation``'s)."""
    if pre is None:
        return True
    if not isinstance(pre, dict):
        return False
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in pre.get("pretokenizers") or ())
    return kind in _KEEPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def _has_byte_level(pre: Any) -> bool:
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre.get("pretokenizers") or ())
    return bool(pre.get("type") == "ByteLevel")


def max_token_chars(spec: dict[str, Any]) -> int | None:
    """The most characters of a text one token of a ``tokenizer.json`` (``spec``, its parsed JSON) can stand
    for, when that is bounded: a text of ``c`` characters then encodes to at least ``ceil(c / max)`` tokens
    (:func:`min_prompt_tokens`), which lets the router refuse an oversized prompt before it tokenizes it. None
    where no such bound holds for every text, so that the bound never refuses a prompt that would fit:

    * the model must be BPE (``type`` given: ``tokenizers`` loads a model without one as whichever kind its
      fields fit, WordPiece too), with no ``continuing_subword_prefix`` / ``end_of_word_suffix``, and cover every
      character: a byte-level pre-tokenizer with all 256 byte symbols in
      the vocabulary (GPT-2, Llama 3, Qwen), or ``byte_fallback`` with all 256 ``<0xNN>`` tokens (Llama 2,
      Mistral); a BPE that skips an unknown character, or fuses a run of them into one unknown token, and
      WordPiece / Unigram / WordLevel (one ``[UNK]`` for a whole word) have no bound;
    * no normalizer, or only ``Prepend`` / ``Replace`` of a string with one at least as long (SentencePiece's
      space to ``▁``): NFC / NFKC compose several characters into one and lowercasing may shorten a text;
    * a pre-tokenizer that drops no character (:data:`_KEEPING_PRE_TOKENIZERS`), no added token that strips
      the spaces around it (``lstrip`` / ``rstrip``: it covers any run of them) and no truncation.

    The count is in characters as the model sees them: a byte-level model sees one per UTF-8 byte (at least
    one per character of the text), a ``<0xNN>`` token or a ``▁`` stands for at most one character; so the
    longest vocabulary or added token in characters is an upper bound on what one token covers.
    """
    if spec.get("truncation") is not None:
        return None
    norm = spec.get("normalizer")
    norms = (norm.get("normalizers") or []) if isinstance(norm, dict) and norm.get("type") == "Sequence" else [norm] if norm else []
    for n in norms:
        if not isinstance(n, dict):
            return None
        if n.get("type") == "Prepend":
            continue
        pattern = n.get("pattern")
        if n.get("type") == "Replace" and isinstance(pattern, dict) and isinstance(pattern.get("String"), str):
            if len(str(n.get("content", ""))) >= len(pattern["String"]) > 0:
                continue
        return None
    pre = spec.get("pre_tokenizer")
    if not _keeps_characters(pre):
        return None
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        # a piece past a word's first needs the prefixed (or suffixed) symbol, which a vocabulary may lack: BPE
        # then drops the piece (1,000 characters were 1 token with '##' and no '##x' symbols)
        return None
    vocab: dict[str, Any] = model["vocab"]
    if _has_byte_level(pre):
        from tokenizers.pre_tokenizers import ByteLevel  # the 256 symbols GPT-2's byte-level maps bytes to

        if not all(ch in vocab for ch in ByteLevel.alphabet()):
            return None
    elif not (model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256))):
        return None
    added = spec.get("added_tokens") or []
    if any(not isinstance(t, dict) or t.get("lstrip") or t.get("rstrip") or not isinstance(t.get("content"), str) for t in added):
        return None
    longest = max((len(t) for t in vocab), default=0)
    return max([longest, *(len(t["content"]) for t in added)]) or None


def min_prompt_tokens(tok: Any, text: str) -> int:
    """A lower bound on the number of tokens ``tok`` encodes ``text`` to, in O(1): ``ceil(len(text) /
    tok.max_token_chars)`` (:func:`max_token_chars`), 0 when the tokenizer has no such bound (``sim``, or an
    ``hf`` one :func:`max_token_chars` finds none for). Special tokens the model adds only add to the count."""
    most = getattr(tok, "max_token_chars", None)
    if not most:
        return 0
    return -(-len(text) // most)


_GIL_FREE_CHARS = 1024
"""Characters of a text (or ids of a sequence) above which :class:`HFTokenizer` encodes (decodes) through
the ``tokenizers`` batch call that releases the GIL; at or below, the plain call, a few microseconds
cheaper (measured: 20 characters, ``encode`` 9.7 us, ``encode_batch_fast([text])`` 12.9 us; 2000
characters 593 us and 472 us)."""


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` via the ``tokenizers`` package (lazy import).

    Args:
        path: ``tokenizer.json`` itself or a folder holding it (and optionally
            ``tokenizer_config.json`` with ``chat_template``, ``bos_token``, ``eos_token``).

    Raises:
        TokenizerError: if ``tokenizers`` (or, for a folder with a chat
            template, ``jinja2``) is not installed, or the files are missing or invalid.
    """

    name = "hf"

    def __init__(self, path: str | Path) -> None:
        try:
            import tokenizers
        except ImportError as e:
            raise TokenizerError(
                "the hf tokenizer needs the 'tokenizers' package (the project's 'hf' extra; `make install` does "
                "not install it): pip install -e '.[hf]'  (or: pip install tokenizers jinja2)"
            ) from e
        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise TokenizerError(f"no tokenizer.json at {file}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise TokenizerError(f"cannot load {file}: {e}") from e
        self.path = file
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        try:  # the loaded tokenizer as tokenizers writes it: every field present (a model's type too), defaults filled in
            spec = json.loads(self._tok.to_str())
        except Exception:  # tokenizers raises a bare Exception; no bound then (it only lets a prompt be refused sooner)
            spec = None
        self.max_token_chars: int | None = max_token_chars(spec) if isinstance(spec, dict) else None
        """The most characters one token stands for (:func:`max_token_chars`); None: no bound holds."""
        self.notes: list[str] = []
        self._template: Any = None
        self._special: dict[str, str] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        template: str | None = None
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except (OSError, ValueError) as e:
                raise TokenizerError(f"cannot read {cfg_file}: {e}") from e
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                val = cfg.get(key)
                if isinstance(val, dict):
                    val = val.get("content")
                if isinstance(val, str):
                    self._special[key] = val
            raw = cfg.get("chat_template")
            if isinstance(raw, list):  # named templates: take "default"
                raw = next((t.get("template") for t in raw if isinstance(t, dict) and t.get("name") == "default"), None)
            template = raw if isinstance(raw, str) else None
        if template is None:
            jinja_file = file.parent / "chat_template.jinja"
            if jinja_file.is_file():
                template = jinja_file.read_text()
        if template is not None:
            self._template = _compile_template(template)
        else:
            self.notes.append(f"no chat_template next to {file}; chat requests use ChatML")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text`` with the model's special tokens (e.g. BOS) added unless ``add_special_tokens`` is
        False, as vLLM does for completions. A text over ``_GIL_FREE_CHARS`` characters is encoded without
        holding the GIL (:meth:`_encode`)."""
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Ids of ``text``; over ``_GIL_FREE_CHARS`` characters through ``encode_batch_fast([text])``
        (``encode_batch`` before ``tokenizers`` 0.21), which releases the GIL while it encodes, so a caller's
        worker thread no longer stops the event loop: ``Tokenizer.encode`` holds it for the whole call (a 6 MB
        text, toy byte-level BPE of ``tests.unit.router.helpers.write_bpe_tokenizer``, 1.73M ids: 6.9 s
        encode, loop stopped 6.6 s; ``encode_batch_fast`` 4.2 s, largest loop gap 0.11 s, what is left being
        the list of ids made under the GIL; 1 ms asyncio ticker, ``asyncio.to_thread``). Same ids (the batch of
        one is post-processed, truncated and padded as one ``encode``; ``_fast`` only leaves the offsets,
        unused here, zero). Short texts stay on ``encode``: for 20 characters the batch call costs 10.6-12.9 us
        to ``encode``'s 9.7 us."""
        if len(text) <= _GIL_FREE_CHARS:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        batch = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, special tokens skipped unless ``skip_special_tokens`` is False. Over
        ``_GIL_FREE_CHARS`` ids through ``decode_batch([ids])``, which releases the GIL (``decode`` holds it:
        1.73M ids, 0.50 s, loop stopped 0.50 s; ``decode_batch`` 0.43 s, largest loop gap 27 ms; same text)."""
        seq = list(ids)
        if len(seq) <= _GIL_FREE_CHARS:
            return str(self._tok.decode(seq, skip_special_tokens=skip_special_tokens))
        return str(self._tok.decode_batch([seq], skip_special_tokens=skip_special_tokens)[0])

    def special_tokens(self) -> dict[int, str]:
        """The tokens :meth:`decode` leaves out by default: ``tokenizer.json``'s added tokens marked ``special``
        (id → text; what ``tokenizers`` skips with ``skip_special_tokens``, as transformers' fast tokenizers and so
        vLLM)."""
        return {int(i): str(t.content) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary piece (``tokenizers``' ``id_to_token``: ``Ġhello`` in byte-level BPE, ``▁hello`` in
        SentencePiece, special tokens as written), as transformers' ``convert_ids_to_tokens``; ``""`` for an id
        outside the vocabulary (transformers gives None; vLLM replaces it with "")."""
        piece = self._tok.id_to_token
        return [piece(int(i)) or "" for i in ids]

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, *,
        add_generation_prompt: bool = True, continue_final_message: bool = False,
    ) -> str:
        """The model's chat template rendered (ChatML without one; flags: :class:`Tokenizer`;
        ``continue_final_message`` cuts the rendering as transformers does, :func:`continue_final`).

        Raises:
            ValueError: both flags true, or a final message that cannot be continued.
        """
        if self._template is None:
            return _render_chatml(messages, tools, add_generation_prompt, continue_final_message)
        template = self._template
        return _render_chat(
            lambda msgs, gen: template.render(messages=msgs, tools=tools, add_generation_prompt=gen, **self._special),
            messages, add_generation_prompt, continue_final_message,
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, *,
        add_generation_prompt: bool = True, continue_final_message: bool = False, add_special_tokens: bool = False,
    ) -> list[int]:
        """:meth:`render_chat` encoded, the model's special tokens added only with ``add_special_tokens`` (flags:
        :class:`Tokenizer`).

        Raises:
            ValueError: both flags true, or a final message that cannot be continued.
        """
        text = self.render_chat(messages, tools, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
        return self._encode(text, add_special_tokens)

    def output_ids(self) -> list[int]:
        """Ids a simulated engine may emit so that a client can count them from the text.

        A token qualifies when its text is one word of 2–16 ASCII letters and that word
        after a space encodes to exactly this token (``Ġword`` in byte-level BPE, ``▁word``
        in SentencePiece, a whole word in word-level vocabularies). Any sequence of them
        decodes to space-separated words that re-encode to the same ids, so a client that
        tokenizes the streamed text (AIPerf, guidellm) counts what ``usage`` says.

        Returns:
            sorted ids (deterministic for a given ``tokenizer.json``).

        Raises:
            TokenizerError: if the vocabulary has no such token.
        """
        candidates: list[tuple[int, str]] = []
        pieces = self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=True)
        for i, piece in enumerate(pieces):
            if _OUT_WORD.fullmatch(piece):
                candidates.append((i, piece.strip()))
        encoded = self._tok.encode_batch([" " + w for _, w in candidates], add_special_tokens=False)
        ids = [i for (i, _), enc in zip(candidates, encoded) if enc.ids == [i]]
        if not ids:
            raise TokenizerError(f"{self.path}: no token is a whole word that re-encodes to itself; cannot simulate output")
        return ids


_OUT_WORD = re.compile(r" ?[A-Za-z]{2,16}")


def _compile_template(source: str) -> Any:
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise TokenizerError("this model's chat template needs the 'jinja2' package: pip install jinja2") from e

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(f"invalid chat template: {e}") from e


# --------------------------------------------------------------------------- #
# loading and incremental decoding
# --------------------------------------------------------------------------- #


def output_vocabulary(tok: Tokenizer) -> list[int] | None:
    """The ids a sim engine draws its output from when the router uses ``tok``.

    ``None`` for the sim tokenizer (every id in ``[0, SIM_VOCAB_SIZE)`` decodes to a word
    that re-encodes to it); for ``hf:`` the whole-word ids of :meth:`HFTokenizer.output_ids`.

    Raises:
        TokenizerError: if ``tok`` has no usable output ids.
    """
    if isinstance(tok, HFTokenizer):
        return tok.output_ids()
    return None


def load_tokenizer(spec: str) -> Tokenizer:
    """Build a tokenizer from its spec: ``sim`` or ``hf:<path>``.

    Raises:
        TokenizerError: on an unknown spec or a tokenizer that cannot load.
    """
    if spec == "sim":
        return SimTokenizer()
    if spec.startswith("hf:"):
        path = spec[3:]
        if not path:
            raise TokenizerError("hf tokenizer needs a path: --tokenizer hf:/path/to/model")
        return HFTokenizer(path)
    raise TokenizerError(f"unknown tokenizer {spec!r}: use 'sim' or 'hf:<local path>'")


class IncrementalDecoder:
    """Turns a growing token list into text deltas (vLLM's prefix/read-offset scheme).

    Each :meth:`push` decodes a short window of the latest ids and returns the
    text it adds; a delta ending in U+FFFD (an incomplete UTF-8 sequence) is
    held back until the next ids complete it. Concatenated deltas equal
    ``decode(all ids)`` for tokenizers whose decoding is prefix-stable.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids`` and return the new text (may be empty)."""
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        full = self.tok.decode(self.ids[self._prefix :])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back (at the end of the stream)."""
        prefix_text = self.tok.decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        full = self.tok.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return full[len(prefix_text) :] if len(full) > len(prefix_text) else ""
