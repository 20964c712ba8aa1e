"""Tokenizers: sim determinism across processes, round trip, chat template; hf loading errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared.hashing import SIM_VOCAB_SIZE

from shared.tokenizer import HFTokenizer, IncrementalDecoder, SimTokenizer, TokenizerError, load_tokenizer

REPO = Path(__file__).resolve().parents[3]
TEXT = "Hello, world! The quick brown fox (v2.0) jumps; ünïcödé 42 times."


def test_sim_encode_is_stable_and_in_vocab():
    tok = SimTokenizer()
    ids = tok.encode(TEXT)
    assert ids == tok.encode(TEXT) == SimTokenizer().encode(TEXT)
    assert len(ids) == 19  # words and punctuation characters
    assert all(0 <= i < SIM_VOCAB_SIZE for i in ids)
    assert tok.encode("a  b\n\tc") == tok.encode("a b c")
    assert tok.encode("") == []


def test_sim_encode_is_the_same_in_another_process():
    """Ids must not depend on the process (no salted hash())."""
    code = (
        "import json; from shared.tokenizer import SimTokenizer; "
        f"print(json.dumps(SimTokenizer().encode({TEXT!r})))"
    )
    env = {"PYTHONHASHSEED": "12345", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == SimTokenizer().encode(TEXT)


def test_sim_decode_is_readable_and_round_trips():
    tok = SimTokenizer()
    ids = [0, 1, 79, 80, 6399, 6400, 99_999, 12_345]
    text = tok.decode(ids)
    words = text.split(" ")
    assert len(words) == len(ids) and all(w.isalpha() and len(w) == 6 for w in words)
    assert tok.encode(text) == ids
    assert tok.decode([SIM_VOCAB_SIZE + 5]) == f"<{SIM_VOCAB_SIZE + 5}>"


def test_sim_chat_template():
    tok = SimTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(msgs)
    assert ids == tok.encode("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # a longer conversation extends the shorter one's token prefix (prefix caching works across turns)
    longer = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}])
    assert longer[: len(ids) - 3] == ids[:-3]
    with_tools = tok.apply_chat_template(msgs, tools=[{"type": "function", "function": {"name": "ls"}}])
    assert with_tools != ids


def test_incremental_decoder_concatenates_to_full_decode():
    tok = SimTokenizer()
    ids = list(range(100, 130))
    dec = IncrementalDecoder(tok)
    parts = [dec.push(ids[i : i + k]) for i, k in ((0, 1), (1, 4), (5, 10), (15, 15))]
    parts.append(dec.flush())
    assert "".join(parts) == tok.decode(ids)
    assert dec.push([]) == ""


def test_load_tokenizer_specs():
    assert isinstance(load_tokenizer("sim"), SimTokenizer)
    with pytest.raises(TokenizerError, match="unknown tokenizer"):
        load_tokenizer("gpt2")
    with pytest.raises(TokenizerError, match="needs a path"):
        load_tokenizer("hf:")


def test_hf_without_the_package_says_how_to_install(tmp_path):
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(TokenizerError, match="pip install tokenizers"):
            load_tokenizer(f"hf:{tmp_path}")
    else:
        with pytest.raises(TokenizerError, match="no tokenizer.json"):
            load_tokenizer(f"hf:{tmp_path}")


def _write_wordlevel_tokenizer(folder: Path, template: str | None) -> None:
    import json

    vocab = {"[UNK]": 0, "<s>": 1, "hello": 2, "world": 3, "user": 4, "assistant": 5, ":": 6, "!": 7}
    tj = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 1, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    cfg: dict[str, object] = {"bos_token": "<s>"}
    if template is not None:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_hf_tokenizer_from_a_local_folder(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
    _write_wordlevel_tokenizer(tmp_path, template)
    tok = load_tokenizer(f"hf:{tmp_path}")
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 8
    assert tok.encode("hello world!") == [1, 2, 3, 7]
    assert tok.decode([1, 2, 3]) == "hello world"
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == [1, 4, 6, 2, 5, 6]
    # the file itself works as the path too
    assert load_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}").encode("world") == [1, 3]


def test_hf_tokenizer_without_template_falls_back_to_chatml(tmp_path):
    pytest.importorskip("tokenizers")
    _write_wordlevel_tokenizer(tmp_path, None)
    tok = load_tokenizer(f"hf:{tmp_path}")
    assert isinstance(tok, HFTokenizer) and tok.notes and "ChatML" in tok.notes[0]
    assert len(tok.apply_chat_template([{"role": "user", "content": "hello"}])) > 0


def test_output_vocabulary_of_a_byte_level_bpe_round_trips(tmp_path):
    """The sim engine's output ids under a real tokenizer: inside its vocabulary, and any
    sequence of them decodes to text that re-encodes to the same ids (clients count usage)."""
    pytest.importorskip("tokenizers")
    import random

    from shared.tokenizer import output_vocabulary
    from services.worker.engines.sim import sim_output_tokens
    from tests.unit.router.helpers import write_bpe_tokenizer

    tok = load_tokenizer(f"hf:{write_bpe_tokenizer(tmp_path)}")
    assert isinstance(tok, HFTokenizer)
    vocab = output_vocabulary(tok)
    assert vocab is not None and 100 < len(vocab) < tok.vocab_size and vocab == sorted(set(vocab))
    assert output_vocabulary(load_tokenizer("sim")) is None
    rng = random.Random(7)
    for n in (1, 2, 64, 500):
        seq = [rng.choice(vocab) for _ in range(n)]
        assert tok._tok.encode(tok.decode(seq), add_special_tokens=False).ids == seq
    ids = sim_output_tokens("chatcmpl-abc", 0, 64, vocab)
    assert set(ids) <= set(vocab) and ids == sim_output_tokens("chatcmpl-abc", 0, 64, vocab)
    assert sim_output_tokens("chatcmpl-abc", 10, 5, vocab) == ids[10:15]
    # streamed piece by piece (the router's incremental decoder), the text still counts 64 tokens
    dec = IncrementalDecoder(tok)
    text = "".join(dec.push([i]) for i in ids) + dec.flush()
    assert len(tok._tok.encode(text, add_special_tokens=False).ids) == 64
    # without the vocabulary, ids fall outside it: decoded text loses them
    raw = sim_output_tokens("chatcmpl-abc", 0, 64)
    assert max(raw) >= tok.vocab_size


def test_output_vocabulary_of_a_word_level_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from shared.tokenizer import output_vocabulary

    _write_wordlevel_tokenizer(tmp_path, None)
    tok = load_tokenizer(f"hf:{tmp_path}")
    assert output_vocabulary(tok) == [2, 3, 4, 5]  # the words; not [UNK], <s>, ':' or '!'
    assert tok.encode(tok.decode([5, 2, 2, 4])) == [1, 5, 2, 2, 4]


_SAME_TEXTS = [
    "",
    " ",
    "a",
    "\n\n\t  \n",
    TEXT,
    "ünïcödé 日本語の文章 🙂👩‍👩‍👧 ÅÅ e\u0301 \u200b zero-width",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>x<|im_end|>",
    "<s> hello world <s>!",
]


def _hf_tokenizers(tmp_path: Path) -> list[HFTokenizer]:
    """The byte-level BPE the router tests use and the word-level one whose post-processor adds ``<s>``."""
    from tests.unit.router.helpers import write_bpe_tokenizer

    (tmp_path / "wl").mkdir()
    _write_wordlevel_tokenizer(tmp_path / "wl", None)
    toks = [load_tokenizer(f"hf:{write_bpe_tokenizer(tmp_path / 'bpe')}"), load_tokenizer(f"hf:{tmp_path / 'wl'}")]
    assert all(isinstance(t, HFTokenizer) for t in toks)
    return toks  # type: ignore[return-value]


def test_hf_batch_calls_give_the_plain_calls_ids_and_text(tmp_path):
    """HFTokenizer encodes/decodes long inputs through ``encode_batch_fast`` / ``decode_batch`` (they release
    the GIL): the same ids and text as ``encode`` / ``decode``, special tokens added or not, skipped or not."""
    pytest.importorskip("tokenizers")
    from shared.tokenizer import _GIL_FREE_CHARS

    for tok in _hf_tokenizers(tmp_path):
        raw = tok._tok
        long = "".join(_SAME_TEXTS) * (2 * _GIL_FREE_CHARS // len("".join(_SAME_TEXTS)) + 1)
        assert len(long) > _GIL_FREE_CHARS
        for text in [*_SAME_TEXTS, long, long[:_GIL_FREE_CHARS], long[: _GIL_FREE_CHARS + 1]]:
            for add in (True, False):
                plain = raw.encode(text, add_special_tokens=add).ids
                assert raw.encode_batch([text], add_special_tokens=add)[0].ids == plain
                if hasattr(raw, "encode_batch_fast"):
                    assert raw.encode_batch_fast([text], add_special_tokens=add)[0].ids == plain
                assert tok._encode(text, add) == plain
            ids = raw.encode(text, add_special_tokens=True).ids
            assert tok.encode(text) == ids
            for skip in (True, False):
                assert raw.decode_batch([ids], skip_special_tokens=skip)[0] == raw.decode(ids, skip_special_tokens=skip)
            assert tok.decode(ids) == raw.decode(ids, skip_special_tokens=True)
            assert tok.decode(tuple(ids)) == tok.decode(ids)
            # kept when asked (an echoed token-id prompt, vLLM's), on the plain and the batch path
            assert tok.decode(ids, skip_special_tokens=False) == raw.decode(ids, skip_special_tokens=False)
        chat = [{"role": "user", "content": long}, {"role": "assistant", "content": "hello <|im_end|> world"}]
        assert len(tok.apply_chat_template(chat)) > 100
        if "<|im_start|>" in raw.get_vocab():  # the BPE's ChatML markers are special tokens
            marked = tok.apply_chat_template(chat)
            for ids in (marked[:50], marked):  # under and over _GIL_FREE_CHARS ids
                assert "<|im_start|>" in tok.decode(ids, skip_special_tokens=False) and "<|im_start|>" not in tok.decode(ids)


def _longest_stall_s(work, *args) -> tuple[float, float]:
    """``work(*args)`` in another thread while this one wakes every 1 ms: (longest wait between wakes, call's wall s)."""
    import threading
    import time

    done = threading.Event()
    wall = [0.0]

    def run() -> None:
        t0 = time.perf_counter()
        work(*args)
        wall[0] = time.perf_counter() - t0
        done.set()

    th = threading.Thread(target=run)
    last = time.perf_counter()
    longest = 0.0
    th.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
    th.join()
    return longest, wall[0]


def test_hf_encode_and_decode_of_a_big_text_let_other_threads_run(tmp_path):
    """The router encodes a big prompt in a worker thread so the event loop keeps serving streams; that only
    helps if the tokenizer releases the GIL. ``Tokenizer.encode`` / ``decode`` hold it for the whole call (the
    waker above waits the full call, ~1 s here); the batch calls do not (longest wait: tens of ms). Margins are
    wide for a loaded box: the longest wait must be under half the call."""
    pytest.importorskip("tokenizers")
    from tests.unit.router.helpers import write_bpe_tokenizer

    tok = load_tokenizer(f"hf:{write_bpe_tokenizer(tmp_path)}")
    base = (REPO / "README.md").read_text() + " ünïcödé 日本語 🙂 <|im_end|> "
    big = base * (1_500_000 // len(base) + 1)  # ~1.5M characters
    stall, wall = _longest_stall_s(tok.encode, big)
    assert wall > 0.05 and stall < 0.5 * wall, (stall, wall)
    ids = tok.encode(big) * 4  # ~1.7M ids
    stall, wall = _longest_stall_s(tok.decode, ids)
    assert wall > 0.05 and stall < 0.5 * wall, (stall, wall)


def test_hf_encode_falls_back_to_encode_batch_before_tokenizers_0_21(tmp_path):
    """``encode_batch_fast`` came in ``tokenizers`` 0.21 (the 'hf' extra allows >=0.15): without it, ``encode_batch``."""
    pytest.importorskip("tokenizers")
    from shared.tokenizer import _GIL_FREE_CHARS

    tok = _hf_tokenizers(tmp_path)[0]
    raw = tok._tok
    calls: list[str] = []

    class Old:
        def encode(self, *a, **k):
            calls.append("encode")
            return raw.encode(*a, **k)

        def encode_batch(self, *a, **k):
            calls.append("encode_batch")
            return raw.encode_batch(*a, **k)

    text = TEXT * (_GIL_FREE_CHARS // len(TEXT) + 1)
    tok._tok = Old()
    assert tok.encode(text) == raw.encode(text).ids and calls == ["encode_batch"]
    assert tok.encode(TEXT) == raw.encode(TEXT).ids and calls == ["encode_batch", "encode"]


CHAT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "The answer is "}]


def test_sim_chat_template_flags_end_the_chat_where_asked():
    """``add_generation_prompt`` false ends after the last turn; ``continue_final_message`` leaves the last
    message open (no ``<|im_end|>``, no new turn); both true is refused; ``add_special_tokens`` changes nothing
    (the sim vocabulary has none). The router ignored both chat flags before."""
    tok = SimTokenizer()
    turns = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nThe answer is <|im_end|>\n"
    assert tok.apply_chat_template(CHAT) == tok.encode(turns + "<|im_start|>assistant\n")
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == tok.encode(turns)
    opened = tok.apply_chat_template(CHAT, add_generation_prompt=False, continue_final_message=True)
    assert opened == tok.encode(turns[: -len("<|im_end|>\n")])
    assert tok.apply_chat_template(CHAT, add_special_tokens=True) == tok.apply_chat_template(CHAT)
    assert tok.encode("a b", add_special_tokens=False) == tok.encode("a b")
    with pytest.raises(ValueError, match="continue_final_message"):
        tok.apply_chat_template(CHAT, continue_final_message=True)


def test_hf_chat_template_flags_give_transformers_ids(tmp_path):
    """The hf tokenizer's ``add_generation_prompt`` / ``continue_final_message`` / ``add_special_tokens`` give
    the ids of transformers' ``apply_chat_template`` (what vLLM calls), trailing spaces of the final message
    included; a completion's ``add_special_tokens`` false drops the BOS."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    transformers = pytest.importorskip("transformers")
    from tests.unit.router.helpers import write_bpe_tokenizer

    folder = write_bpe_tokenizer(tmp_path / "bpe")
    tok = load_tokenizer(f"hf:{folder}")
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    for chat in (CHAT, [*CHAT[:1], {"role": "assistant", "content": "  Sure thing"}]):
        for flags in ({}, {"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}):
            want = ref.apply_chat_template(chat, tokenize=True, return_dict=False, **{"add_generation_prompt": True, **flags})
            assert tok.apply_chat_template(chat, **flags) == list(want), (chat, flags)
    assert tok.apply_chat_template(CHAT) != tok.apply_chat_template(CHAT, add_generation_prompt=False)
    # BOS: the word-level folder's post-processor adds <s> (id 1)
    (tmp_path / "wl").mkdir()
    _write_wordlevel_tokenizer(tmp_path / "wl", "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    wl = load_tokenizer(f"hf:{tmp_path / 'wl'}")
    assert wl.encode("hello world") == [1, 2, 3] and wl.encode("hello world", add_special_tokens=False) == [2, 3]
    assert wl.apply_chat_template([{"role": "user", "content": "hello"}]) == [2]
    assert wl.apply_chat_template([{"role": "user", "content": "hello"}], add_special_tokens=True) == [1, 2]


def test_hf_token_pieces_texts_and_chat_text_are_transformers(tmp_path):
    """What vLLM shows per token, with special tokens: ``convert_ids_to_tokens`` (its ``/tokenize`` ``token_strs``:
    the vocabulary's pieces, ``Ġ`` for a space) and ``decode([id])`` at transformers' default (its logprob entries'
    texts: ``skip_special_tokens`` False), for every id of a byte-level BPE; ``render_chat`` is transformers'
    ``apply_chat_template(tokenize=False)``, and ``apply_chat_template`` its encoding."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    transformers = pytest.importorskip("transformers")
    from tests.unit.router.helpers import write_bpe_tokenizer

    folder = write_bpe_tokenizer(tmp_path / "bpe")
    tok = load_tokenizer(f"hf:{folder}")
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = list(range(tok.vocab_size))
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert [tok.decode([i], skip_special_tokens=False) for i in ids] == [ref.decode([i]) for i in ids]
    special = tok._tok.token_to_id("<|im_end|>")  # type: ignore[attr-defined]
    assert tok.convert_ids_to_tokens([special, tok.vocab_size]) == ["<|im_end|>", ""]  # out of the vocabulary: "" (vLLM's)
    for flags in ({}, {"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}):
        want = ref.apply_chat_template(CHAT, tokenize=False, **{"add_generation_prompt": True, **flags})
        assert tok.render_chat(CHAT, **flags) == want, flags
        assert tok.apply_chat_template(CHAT, **flags) == tok.encode(want, add_special_tokens=False)
    sim = SimTokenizer()
    assert sim.convert_ids_to_tokens([5, 70_000, -1, SIM_VOCAB_SIZE]) == [sim.word(5), sim.word(70_000), "", ""]
    assert sim.apply_chat_template(CHAT) == sim.encode(sim.render_chat(CHAT))


TRIM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% for t in m.tool_calls or [] %}"
    "<tool_call>{{ t.function.name }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", [None, TRIM_TEMPLATE, TOOL_TEMPLATE])
def test_hf_continue_final_message_cuts_where_the_message_ends_as_transformers(tmp_path, template):
    """``continue_final_message`` cuts where the template put the final message's end (transformers 5's tag),
    not at the last occurrence of its text: a prefill ``<`` / ``end`` / ``d`` also occurs in ``<|im_end|>`` and a
    tool call's name after the content (the rindex cut left ``<<`` or ``d<|im_end`` in the prompt); an empty or
    whitespace-only prefill opens the turn (was a ValueError, a 400). Ids equal transformers' for each."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    transformers = pytest.importorskip("transformers")
    import json

    from tests.unit.router.helpers import write_bpe_tokenizer

    folder = write_bpe_tokenizer(tmp_path / "bpe")
    if template is not None:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(f"hf:{folder}")
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    call = [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]
    for final in (
        {"content": "<"}, {"content": "end"}, {"content": "d"}, {"content": ""}, {"content": "\n"}, {"content": " x \n"},
        {"content": "get", "tool_calls": call}, {"content": "", "tool_calls": call},
    ):
        chat = [{"role": "user", "content": "hello"}, {"role": "assistant", **final}]
        want = ref.apply_chat_template(chat, tokenize=True, return_dict=False, add_generation_prompt=False, continue_final_message=True)
        got = tok.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
        assert got == list(want), (final, ref.decode(got), ref.decode(want))
    with pytest.raises(ValueError, match="no \"content\""):
        tok.apply_chat_template([{"role": "assistant", "content": None}], add_generation_prompt=False, continue_final_message=True)


def test_sim_continue_final_message_cuts_after_the_text_before_tool_calls():
    """The sim ChatML cut is the one transformers makes in a template: right after the final message's text, so
    tool calls rendered after it are not in the prompt (they were, the turn left open after ``</tool_call>``)."""
    tok = SimTokenizer()
    call = [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Let me", "tool_calls": call}]
    opened = tok.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
    assert opened == tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nLet me")


def test_sim_chatml_joins_text_parts_by_newlines_as_vllm():
    """A list content's text parts are joined by newlines, as vLLM's conversation parsing joins them for a
    template that reads a string (``"".join`` made ``a`` + ``b`` the one word ``ab``)."""
    tok = SimTokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "a\nb"}])


def test_sim_encode_of_a_big_text_gives_the_same_ids_and_lets_other_threads_run():
    """The router encodes a big prompt in a worker thread so the event loop keeps serving; the sim tokenizer's
    one ``findall`` over the whole text held the GIL for all of it (a live router: a 60 MB prompt stopped every
    other request for 9 s). It now scans pieces cut between tokens: the same ids as one scan, and the longest
    wait of a thread waking every 1 ms is a small part of the call (before: most of it)."""
    import re

    tok = SimTokenizer()
    # words straddling every cut, punctuation runs, a word longer than a piece, non-ASCII word characters
    unit = "dabefi, ünïcödé 日本語!!?? " + "x" * 70_000 + " end.\n"
    text = unit * 3
    one_scan = [tok.token_id(m) for m in re.findall(r"\w+|[^\w\s]", text)]
    assert tok.encode(text) == one_scan and len(one_scan) == 3 * 11
    big = "ab cd, " * 600_000  # 4.2M characters, 1.8M tokens
    stall, wall = _longest_stall_s(tok.encode, big)
    assert wall > 0.05 and stall < 0.3 * wall, (stall, wall)


def _saved(tmp_path: Path, tok, name: str, edit=None) -> Path:
    """``tok`` saved as ``tmp_path/name/tokenizer.json`` (``edit``: applied to its JSON first)."""
    spec = json.loads(tok.to_str())
    if edit is not None:
        edit(spec)
    folder = tmp_path / name
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder / "tokenizer.json"


def test_the_prompt_bound_never_exceeds_the_count_of_tokenizers_that_drop_characters(tmp_path):
    """Review of the bound (shared.tokenizer.max_token_chars): each case had a bound above the real count, so that
    a prompt that fits was refused (a Punctuation pre-tokenizer that removes: 2 tokens, bound 1336), or a bound
    where none holds (a BPE with a continuing-subword prefix: 1,000 characters were 1 token, bound 84; a model
    without "type" loaded as WordPiece: 1 token, bound 200). Now: no bound for them, a bound for the plain one."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from shared.tokenizer import min_prompt_tokens

    syms = sorted(pre_tokenizers.ByteLevel.alphabet())  # GPT-2's byte-level symbols
    cases = {}
    punct = Tokenizer(models.BPE())
    punct.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Punctuation(behavior="removed"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    punct.train_from_iterator(["hello world " * 50], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    cases["punctuation removed"] = (_saved(tmp_path, punct, "punct"), "hello world" + "." * 8000)
    for name, kw in (("prefix", {"continuing_subword_prefix": "##"}), ("suffix", {"end_of_word_suffix": "</w>"}),
                     ("prefix fused unk", {"continuing_subword_prefix": "##", "unk_token": "[UNK]", "fuse_unk": True})):
        vocab = {s: i for i, s in enumerate(syms)} | {"[UNK]": 256, "xxxxxxxxxxxx": 257}
        bpe = Tokenizer(models.BPE(vocab=vocab, merges=[], **kw))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        cases[name] = (_saved(tmp_path, bpe, name.replace(" ", "_")), "abcdefghij" * 100)
    wp = Tokenizer(models.WordPiece(vocab={s: i for i, s in enumerate(syms)} | {"[UNK]": 256}, unk_token="[UNK]",
                                    max_input_chars_per_word=100))
    wp.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    cases["model without a type"] = (_saved(tmp_path, wp, "untyped", lambda s: s["model"].pop("type")), "a" * 1000)
    for name, (file, text) in cases.items():
        h = HFTokenizer(file)
        n = len(h.encode(text, add_special_tokens=False))
        assert min_prompt_tokens(h, text) <= n, (name, n, h.max_token_chars)
        assert h.max_token_chars is None, (name, h.max_token_chars)
    # the same byte-level BPE without a prefix or suffix keeps its bound (the longest token, 12 characters)
    plain = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(syms)} | {"xxxxxxxxxxxx": 256}, merges=[]))
    plain.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Punctuation(behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    h = HFTokenizer(_saved(tmp_path, plain, "plain"))
    text = "hello world" + "." * 8000
    assert h.max_token_chars == 12 and min_prompt_tokens(h, text) <= len(h.encode(text, add_special_tokens=False))
