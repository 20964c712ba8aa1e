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
``jinja2`` (also imported lazily) in the environment transformers'
``apply_chat_template`` gives it (:func:`compile_chat_template`); a folder without a
template falls back to ChatML with a warning in :attr:`HFTokenizer.notes`.

Both take a chat's extra template variables (vLLM's ``chat_template_kwargs``, e.g.
``{"enable_thinking": false}``: ``template_kwargs``, :func:`check_template_kwargs`) and a
template of the request's own (``chat_template``, rendered in the same sandbox); the
built-in ChatML reads no extra variable, so there they change nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
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
        template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None,
    ) -> str:
        """The chat template's text of a chat, the very string :meth:`apply_chat_template` encodes (arguments as
        there).

        Raises:
            ValueError: as :meth:`apply_chat_template`.
        """
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, *,
        add_generation_prompt: bool = True, continue_final_message: bool = False, add_special_tokens: bool = False,
        template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None,
    ) -> list[int]:
        """Token ids of a chat (``encode(render_chat(...), add_special_tokens=add_special_tokens)``), ending with the assistant generation prompt (``add_generation_prompt``, the
        default) or after the last message's end of turn (False), or inside the last message
        (``continue_final_message``: its text left open, no end of turn, as transformers' / vLLM's);
        ``add_special_tokens`` adds the model's special tokens (BOS) on top of the template's.
        ``template_kwargs``: more variables for the template (transformers' ``**kwargs``, vLLM's
        ``chat_template_kwargs``; they override the special-token variables such as ``bos_token``; ``documents``
        is the template's ``documents``); ``chat_template``: a Jinja template rendered instead of the
        tokenizer's own (:func:`compile_chat_template`), or the name of one of the model's named templates (a
        ``tokenizer_config.json`` ``chat_template`` list: transformers' ``get_chat_template``, which picks
        ``tool_use`` when ``tools`` is not None and ``default`` otherwise when none is named).

        Raises:
            ValueError: ``continue_final_message`` with ``add_generation_prompt``; named templates without
                ``default`` and none named or picked for tools (transformers' message); a final message
                without text (content None) or whose text the rendered chat does not hold (:func:`tag_final`,
                :func:`continue_final`); a ``template_kwargs`` key it may not set (:class:`TemplateKwargError`).
            TokenizerError: ``chat_template`` does not compile (or jinja2 is missing or too old).
            jinja2.TemplateError: the template refuses the chat (``raise_exception``) or breaks the sandbox.
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
        template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None,
    ) -> str:
        """ChatML rendering of ``messages`` (+ tools), or ``chat_template``'s with no special tokens (arguments and
        errors: :meth:`Tokenizer.apply_chat_template`; ChatML reads no ``template_kwargs``)."""
        kwargs = check_template_kwargs(template_kwargs)
        if chat_template is not None:
            return _render_template(compile_chat_template(chat_template), messages, tools, add_generation_prompt, continue_final_message, {}, kwargs)
        return _render_chatml(messages, tools, add_generation_prompt, continue_final_message)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, *,
        add_generation_prompt: bool = True, continue_final_message: bool = False, add_special_tokens: bool = False,
        template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None,
    ) -> list[int]:
        """:meth:`render_chat` encoded with :meth:`encode` (arguments and errors: :meth:`Tokenizer.apply_chat_template`;
        ``add_special_tokens`` changes nothing here)."""
        return self.encode(self.render_chat(
            messages, tools, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            template_kwargs=template_kwargs, chat_template=chat_template,
        ))


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
        self._named: dict[str, Any] = {}
        """Named templates (``tokenizer_config.json``'s ``chat_template`` as a list of ``{"name", "template"}``):
        name → compiled template, picked as transformers' ``get_chat_template`` picks (:meth:`_pick_template`)."""
        self._special: dict[str, str] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        template: str | None = None
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except (OSError, ValueError) as e:
                raise TokenizerError(f"cannot read {cfg_file}: {e}") from e
            for key in _SPECIAL_TOKEN_KEYS:
                val = cfg.get(key)
                if isinstance(val, dict):
                    val = val.get("content")
                if isinstance(val, str):
                    self._special[key] = val
            raw = cfg.get("chat_template")
            if isinstance(raw, list):  # named templates, kept as transformers keeps them (a dict by name)
                for entry in raw:
                    if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)):
                        raise TokenizerError(f"{cfg_file}: chat_template list entries must be {{'name': str, 'template': str}}, got {entry!r:.200}")
                    self._named[entry["name"]] = compile_chat_template(entry["template"])
            template = raw if isinstance(raw, str) else None
        if template is None and not self._named:
            jinja_file = file.parent / "chat_template.jinja"
            if jinja_file.is_file():
                template = jinja_file.read_text()
        if template is not None:
            self._template = compile_chat_template(template)
        elif not self._named:
            self.notes.append(f"no chat_template next to {file}; chat requests use ChatML")

    @property
    def chat_template_names(self) -> tuple[str, ...]:
        """The names of the model's named chat templates (``default``, ``tool_use``, ...; empty for one template):
        a request's ``chat_template`` that is one of them selects it, as transformers' ``get_chat_template``."""
        return tuple(self._named)

    def _pick_template(self, chat_template: str | None, tools: list[Any] | None) -> Any:
        """The compiled template a chat renders with, as transformers' ``get_chat_template``: with named templates,
        ``chat_template`` naming one selects it, none given → ``tool_use`` when ``tools`` is not None and the model
        has one, else ``default``; a ``chat_template`` that is no name is a template's source; else the model's
        template (None: ChatML).

        Raises:
            ValueError: named templates, no ``default``, none picked (transformers' message).
            TokenizerError: ``chat_template`` does not compile.
        """
        if self._named:
            if chat_template is not None and chat_template in self._named:
                return self._named[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in self._named:
                    return self._named["tool_use"]
                if "default" in self._named:
                    return self._named["default"]
                raise ValueError(
                    "This model has multiple chat templates with no default specified! Please either pass a chat "
                    "template or the name of the template you wish to use to the `chat_template` argument. Available "
                    f"template names are {sorted(self._named)}."
                )
        return compile_chat_template(chat_template) if chat_template is not None else self._template

    @property
    def special_token_texts(self) -> dict[str, str]:
        """``tokenizer_config.json``'s named special tokens (``bos_token``, ``eos_token``...: their text), the
        variables a chat template sees (a copy)."""
        return dict(self._special)

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
        template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None,
    ) -> str:
        """The model's chat template rendered (``chat_template`` instead when given; ChatML for a folder without
        one), with the model's special tokens as variables and ``template_kwargs`` over them, as transformers'
        ``apply_chat_template``; ``continue_final_message`` cuts the rendering as transformers does
        (:func:`continue_final`). Arguments and errors: :meth:`Tokenizer.apply_chat_template`."""
        kwargs = check_template_kwargs(template_kwargs)
        template = self._pick_template(chat_template, tools)
        if template is None:
            return _render_chatml(messages, tools, add_generation_prompt, continue_final_message)
        return _render_template(template, messages, tools, add_generation_prompt, continue_final_message, self._special, kwargs)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, *,
        add_generation_prompt: bool = True, continue_final_message: bool = False, add_special_tokens: bool = False,
        template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None,
    ) -> list[int]:
        """:meth:`render_chat` encoded, the model's special tokens added only with ``add_special_tokens`` (arguments
        and errors: :meth:`Tokenizer.apply_chat_template`)."""
        text = self.render_chat(
            messages, tools, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            template_kwargs=template_kwargs, chat_template=chat_template,
        )
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


# --------------------------------------------------------------------------- #
# chat templates: Jinja in transformers' environment
# --------------------------------------------------------------------------- #

JINJA_MIN_VERSION = (3, 1, 6)
"""Oldest jinja2 a chat template is rendered with, as transformers' ``_compile_jinja_template`` requires: older
sandboxes have known escapes (3.1.6 fixed CVE-2025-27516, ``|attr`` reaching ``str.format``), and a chat template
is code from elsewhere (a model's from the Hub; a request's with the router's ``--trust-request-chat-template``)."""

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""``tokenizer_config.json``'s named special tokens, each a template variable (transformers'
``SPECIAL_TOKENS_ATTRIBUTES``, whose ``special_tokens_map`` ``apply_chat_template`` passes to the template)."""

RESERVED_TEMPLATE_KWARGS: dict[str, str] = {
    "messages": "the conversation is the request's messages",
    "conversation": "the conversation is the request's messages",
    "tools": "send tools as the request's tools",
    "add_generation_prompt": "it is the request's add_generation_prompt",
    "continue_final_message": "it is the request's continue_final_message",
    "chat_template": "a template is the request's chat_template",
    "tokenize": "the template's text is always tokenized by the router",
}
"""Template variables a caller's ``template_kwargs`` may not set, and why: the ones the renderer sets itself (in
transformers' ``apply_chat_template`` a second value is a ``TypeError``; vLLM refuses ``chat_template`` and
``tokenize`` in ``chat_template_kwargs`` by name, ``resolve_chat_template_kwargs``)."""


class TemplateKwargError(ValueError):
    """A ``template_kwargs`` entry the renderer refuses; ``key`` names it."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(reason)
        self.key = key


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``kwargs`` as the template's extra variables (a copy; ``{}`` for None), checked.

    Raises:
        TemplateKwargError: a key of :data:`RESERVED_TEMPLATE_KWARGS`, a key that is not a string, or a
            ``documents`` that is not a list of objects (transformers' check: "Documents should be a list of dicts").
    """
    out = dict(kwargs or {})
    for key in out:
        if not isinstance(key, str):
            raise TemplateKwargError(str(key), f"a template variable's name must be a string, got {key!r}")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise TemplateKwargError(key, f"template variable {key!r} cannot be set here: {RESERVED_TEMPLATE_KWARGS[key]}")
    docs = out.get("documents")
    if docs is not None and not (isinstance(docs, list) and all(isinstance(d, dict) for d in docs)):
        raise TemplateKwargError("documents", "documents must be a list of objects (each with 'title' and 'text', as transformers asks)")
    return out


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"3.1.6"`` → ``(3, 1, 6)``; a suffix (``3.2.0rc1``) ends the number it is on (``(3, 2, 0)``)."""
    parts: list[int] = []
    for piece in version.split(".")[:3]:
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


@functools.lru_cache(maxsize=1)
def chat_template_env() -> Any:
    """The Jinja environment chat templates compile in: the one transformers' ``_compile_jinja_template`` builds
    (``transformers/utils/chat_template_utils.py``, 5.x), without importing transformers (an optional extra here).

    ``ImmutableSandboxedEnvironment`` (a template cannot call unsafe methods, read ``_``-attributes or change
    the messages) with ``trim_blocks`` / ``lstrip_blocks``; the ``loopcontrols`` extension (``{% break %}`` /
    ``{% continue %}``) and a ``{% generation %}`` ... ``{% endgeneration %}`` tag that renders its body
    (transformers tracks the assistant's spans with it, for ``return_assistant_tokens_mask``; the text is the
    same); ``tojson`` as ``json.dumps`` (non-ASCII kept, no HTML escaping, ``indent`` / ``separators`` /
    ``sort_keys``); the globals ``raise_exception(message)`` (a ``TemplateError``), ``strftime_now(format)`` (the
    local time now, ``datetime.now().strftime``: Llama 3.1's "Today Date"), and transformers' restricted ``dict``
    and ``namespace`` (a namespace refuses ``_``-prefixed attributes). One per process.

    Raises:
        TokenizerError: jinja2 is not installed, or older than :data:`JINJA_MIN_VERSION`.
    """
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.utils
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise TokenizerError("this model's chat template needs the 'jinja2' package: pip install 'jinja2>=3.1.6'") from e
    if _version_tuple(jinja2.__version__) < JINJA_MIN_VERSION:
        raise TokenizerError(
            f"chat templates need jinja2>={'.'.join(map(str, JINJA_MIN_VERSION))} (older sandboxes have known escapes; "
            f"transformers refuses them too), found {jinja2.__version__}: pip install -U jinja2"
        )

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: its body, as rendered (transformers' ``AssistantTracker``
        outside tracking)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        def _generation_support(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        """``dict(...)`` / ``dict.fromkeys(...)`` and nothing else of the type (no ``dict.__subclasses__``)."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """Jinja's ``namespace`` refusing ``_``-prefixed attribute names (no reach into CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: namespace(self=...) works
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> Any:
    """``source`` compiled in :func:`chat_template_env` (a ``jinja2.Template``); the last 16 templates are kept,
    so a model's template compiles once and a request's template (``chat_template``) once per distinct text.

    Raises:
        TokenizerError: the template does not compile ("invalid chat template: <jinja's reason>"; nested past
            Python's recursion limit or out of memory too), or jinja2 is missing or too old (:func:`chat_template_env`).
    """
    env = chat_template_env()
    from jinja2.exceptions import TemplateError

    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(f"invalid chat template: {e}") from e
    except RecursionError as e:  # Jinja's parser recurses per nested block: 5,000 nested {% if %} reach the limit
        raise TokenizerError("invalid chat template: it nests too deeply to compile (Python's recursion limit)") from e
    except MemoryError as e:
        raise TokenizerError("invalid chat template: out of memory compiling it") from e


def _render_template(
    template: Any, messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool,
    continue_final_message: bool, special: Mapping[str, str], kwargs: Mapping[str, Any],
) -> str:
    """``template`` rendered as transformers' ``apply_chat_template`` renders it: variables ``messages``,
    ``tools``, ``documents`` (None unless ``kwargs`` has them), ``add_generation_prompt``, the special tokens
    ``special`` and ``kwargs`` over them (checked by :func:`check_template_kwargs`); ``continue_final_message``
    as :func:`_render_chat`.

    Raises:
        ValueError: as :func:`_render_chat`.
        jinja2.TemplateError: what the template raises (``raise_exception``, a sandbox refusal).
    """
    variables = {**special, **kwargs}
    documents = variables.pop("documents", None)
    return _render_chat(
        # one dict, not keywords: a variable named "self" (render's own argument) is a variable too
        lambda msgs, gen: template.render({**variables, "messages": msgs, "tools": tools, "documents": documents, "add_generation_prompt": gen}),
        messages, add_generation_prompt, continue_final_message,
    )


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
