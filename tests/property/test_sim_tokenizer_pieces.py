"""Differential test: ``SimTokenizer.encode`` of a text scanned in pieces against one scan.

Since aedc621 a text over ``_SIM_CHUNK_CHARS`` characters is scanned in pieces cut just after a non-word
character, so that a worker thread's encode hands over the GIL between pieces. The ids must be those of one
``_WORD.findall`` over the whole text for every input. Here the piece size is cut to 1-8 characters so that
short drawn texts are cut everywhere: inside runs of word characters (ASCII, accented, CJK, digits of other
scripts, a combining mark that is not a word character), runs of punctuation and of every kind of whitespace
(NBSP, U+2028, U+0085, U+001C, ideographic space), and ChatML's special-token spelling (``<|im_start|>``).
Examples: ``EI_SIM_TOKENIZER_EXAMPLES`` (default 300 per test).
"""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from shared import tokenizer as tk

EXAMPLES = int(os.environ.get("EI_SIM_TOKENIZER_EXAMPLES", "300"))
_PIECES = ["a", "b", "_", "1", "\u0660", "\u00e9", "\u0301", "\u65e5", "\U0001f600", ",", ".", "!", "<|im_start|>", "<|im_end|>",
           " ", "\n", "\t", "\u00a0", "\u2028", "\x85", "\x1c", "\u3000"]


def _one_scan(tok: tk.SimTokenizer, text: str) -> list[int]:
    return [tok.token_id(m) for m in tk._WORD.findall(text)]


def _encode_in_pieces(tok: tk.SimTokenizer, text: str, chars: int) -> list[int]:
    """``tok.encode(text)`` with pieces of about ``chars`` characters."""
    saved = tk._SIM_CHUNK_CHARS
    tk._SIM_CHUNK_CHARS = chars
    try:
        return tok.encode(text)
    finally:
        tk._SIM_CHUNK_CHARS = saved


@settings(max_examples=EXAMPLES, deadline=None)
@given(text=st.lists(st.sampled_from(_PIECES), max_size=40).map("".join), chars=st.integers(1, 8))
def test_pieces_give_the_ids_of_one_scan(text, chars):
    tok = tk.SimTokenizer()
    assert _encode_in_pieces(tok, text, chars) == _one_scan(tok, text)


@settings(max_examples=EXAMPLES, deadline=None)
@given(text=st.text(max_size=40), chars=st.integers(1, 8))
def test_pieces_of_any_text_give_the_ids_of_one_scan(text, chars):
    tok = tk.SimTokenizer()
    assert _encode_in_pieces(tok, text, chars) == _one_scan(tok, text)
