"""``min_tokens`` at the router's stops (``services/router/stops.py``), vLLM v1's semantics: no stop
token id and no stop string ends the output at or before its ``min_tokens``-th token; a stop string
is matched only in the text a later token adds (vLLM's detokenizer checks ``len(output) >
min_tokens`` and searches the new text), so one completed under ``min_tokens`` is never matched
later (vLLM's ``tests/detokenizer/test_min_tokens.py``: ``min_tokens`` 5, stop ``e``)."""

from __future__ import annotations

from services.router.stops import OutputText


class CharTok:
    """One character per id: ``chr(id)``."""

    name = "char"
    vocab_size = 0x110000

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


TOK = CharTok()


def run(text: str, min_tokens: int, stop=(), stop_ids=(), chunk: int = 1) -> OutputText:
    out = OutputText(TOK, stop, stop_ids, min_tokens)
    ids = TOK.encode(text)
    for i in range(0, len(ids), chunk):
        out.push(ids[i : i + chunk])
        if out.stopped:
            break
    out.finish()
    return out


def test_stop_strings_wait_for_min_tokens():
    assert run("is Lee, a student", 0, ["e"]).text == "is L"
    for chunk in (1, 3, 100):
        got = run("is Lee, a student", 5, ["e"], chunk=chunk)
        # tokens 1..5 ("is Le") cannot stop; "e" at token 6 completes it there
        assert (got.text, got.stop_reason, got.tokens) == ("is Le", "e", 6), chunk
    # a stop string completed under min_tokens is not matched later; a later one is
    got = run("abXYcdXYef", 4, ["XY"])
    assert (got.text, got.tokens) == ("abXYcd", 8)
    # one that straddles the bound: completed by a token after it, matched
    got = run("abcXYd", 4, ["XY"])
    assert (got.text, got.tokens) == ("abc", 5)
    assert run("abXYcd", 10, ["XY"]).stop_reason is None


def test_stop_token_ids_wait_for_min_tokens():
    got = run("abcabc", 2, stop_ids=[ord("b")])
    assert (got.text, got.stop_reason, got.tokens) == ("abca", ord("b"), 5)
    got = run("abcabc", 1, stop_ids=[ord("b")])
    assert (got.text, got.tokens) == ("a", 2)
    assert run("abcabc", 6, stop_ids=[ord("b")]).stop_reason is None


class ByteTok:
    """Each id a byte string (``PIECES``); the text is their concatenation decoded with replacement."""

    name = "bytes"
    PIECES = [b"st", b"op\xe4", b"\xb8\xad", b"x"]
    vocab_size = len(PIECES)

    def encode(self, text):
        raise NotImplementedError

    def decode(self, ids):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_text_held_for_an_incomplete_character_is_not_matched_at_the_end_under_min_tokens():
    # the last token ("op" + half a character) ends the output at min_tokens: its text is held
    # until the end, and a stop string it completes ("stop") must not cut it there (vLLM checks
    # no stop string while the output has at most min_tokens tokens)
    out = OutputText(ByteTok(), ["stop"], (), 2)
    out.push([0])
    out.push([1])
    out.finish()
    assert (out.text, out.stop_reason) == ("stop\ufffd", None)
    # past min_tokens it is matched, at the end as before
    out = OutputText(ByteTok(), ["stop"], (), 1)
    out.push([0])
    out.push([1])
    out.finish()
    assert (out.text, out.stop_reason) == ("", "stop")
