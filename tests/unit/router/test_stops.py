"""Stop strings and stop token ids where the router makes text (``services/router/stops.py``):
the text ends before a stop string (``finish_reason`` ``stop``, ``stop_reason`` the string),
the tokens up to the one that completed it count, a stream never carries text past it (also
when the stop string is split across two chunks), a stop token id counts but shows no text,
and without stops the text is the plain incremental decode."""

from __future__ import annotations

import random

import pytest

from shared.tokenizer import IncrementalDecoder, SimTokenizer
from services.router.stops import OutputText


class CharTok:
    """One character per id: ``chr(id)`` (enough to place a stop string anywhere)."""

    name = "char"
    vocab_size = 0x110000

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


TOK = CharTok()


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def stream(out: OutputText, chunks: list[list[int]]) -> tuple[list[str], str]:
    """Pieces a client would receive, and their concatenation (push each chunk, then finish)."""
    pieces = []
    for c in chunks:
        pieces.append(out.push(c))
        if out.stopped:
            break
    pieces.append(out.finish())
    return pieces, "".join(pieces)


def test_without_stops_the_text_is_the_incremental_decode():
    tok = SimTokenizer()
    seq = list(range(100, 140))
    ref = IncrementalDecoder(tok)
    out = OutputText(tok)
    for i in range(0, 40, 7):
        assert out.push(seq[i : i + 7]) == ref.push(seq[i : i + 7])
    assert out.finish() == ref.flush()
    assert out.tokens == 40 and not out.stopped


def test_stop_string_in_one_chunk_ends_the_text_before_it():
    out = OutputText(TOK, ["STOP"])
    _, text = stream(out, [ids("hello STOP and more")])
    assert text == "hello " and out.stop_reason == "STOP"
    assert out.tokens == len("hello STOP")  # the token that completed the stop string counts; later ones do not


def test_stop_string_split_across_two_streamed_chunks_is_never_sent():
    out = OutputText(TOK, ["</end>"])
    first = out.push(ids("abc</e"))
    assert "<" not in first  # "</e" could be the start of the stop string: held back
    assert first == "a"  # len("</end>") - 1 = 5 characters held back
    second = out.push(ids("nd> tail"))
    assert out.stopped and out.stop_reason == "</end>"
    assert first + second + out.finish() == "abc"
    assert out.tokens == len("abc</end>")


def test_held_back_text_is_released_when_no_stop_comes():
    out = OutputText(TOK, ["XYZ"])
    assert out.push(ids("abcdXY")) == "abcd"
    assert out.push(ids("Q")) == "X"  # always the last len("XYZ") - 1 = 2 characters held
    assert out.finish() == "YQ"
    assert not out.stopped and out.text == "abcdXYQ" and out.tokens == 7


def test_first_completed_stop_string_wins_and_stop_token_ids_show_no_text():
    out = OutputText(TOK, ["stop here", "op"])
    _, text = stream(out, [ids("a stop here")])
    assert text == "a st" and out.stop_reason == "op"  # "op" is completed first, inside "stop here"
    # both completed by one token: the first of the list, as vLLM's check_stop_strings (it was the
    # one starting first: ["User:", "\nUser:"] cut "hi\nUser:" to "hi" where vLLM gives "hi\n")
    for stop, want in ((["op", "long stop"], "a long st"), (["long stop", "op"], "a ")):
        out = OutputText(TOK, stop)
        _, text = stream(out, [ids("a long stop")])
        assert (text, out.stop_reason) == (want, stop[0]), stop
    out = OutputText(TOK, ["User:", "\nUser:"])
    _, text = stream(out, [ids("hi\nUser: x")])
    assert (text, out.stop_reason) == ("hi\n", "User:")
    out = OutputText(TOK, ["zz"], stop_token_ids=[ord("#")])
    _, text = stream(out, [ids("ab"), ids("c#de")])
    assert text == "abc" and out.stop_reason == ord("#") and out.tokens == 4


def test_include_stop_str_in_output_keeps_the_stop_and_holds_nothing_back():
    """vLLM's ``include_stop_str_in_output``: the text ends after the stop string (also one split
    across chunks and tokens, starting in text already sent), a stop token id's own text is shown,
    nothing is held back while streaming; ``stop_reason`` and the tokens that count are the same."""
    out = OutputText(TOK, ["STOP"], include_stop=True)
    _, text = stream(out, [ids("hello STOP and more")])
    assert text == "hello STOP" and out.stop_reason == "STOP" and out.tokens == len("hello STOP")
    out = OutputText(TOK, ["</end>"], include_stop=True)
    first = out.push(ids("abc</e"))
    assert first == "abc</e"  # nothing held back: the stop string is kept anyway
    assert out.push(ids("n")) == "n"
    second = out.push(ids("d> tail"))
    assert out.stopped and out.stop_reason == "</end>" and first + "n" + second + out.finish() == "abc</end>"
    assert out.tokens == len("abc</end>")
    out = OutputText(TOK, ["zz"], stop_token_ids=[ord("#")], include_stop=True)
    _, text = stream(out, [ids("ab"), ids("c#de")])
    assert text == "abc#" and out.stop_reason == ord("#") and out.tokens == 4
    # the first of the list completed still wins; under min_tokens nothing matches
    out = OutputText(TOK, ["long stop", "op"], include_stop=True)
    _, text = stream(out, [ids("a long stop!")])
    assert text == "a long stop" and out.stop_reason == "long stop"
    out = OutputText(TOK, ["b", "ab"], include_stop=True)  # the token "b" completes both
    _, text = stream(out, [ids("xab")])
    assert text == "xab" and out.stop_reason == "b"
    out = OutputText(TOK, ["ab"], min_tokens=2, include_stop=True)
    _, text = stream(out, [ids("abxab"), ids("ab")])
    assert text == "abxab" and out.stop_reason == "ab" and out.tokens == 5


@pytest.mark.parametrize("include", [False, True])
def test_random_streams_never_send_text_past_the_stop(include):
    rng = random.Random(7)
    alphabet = "ab<>/ "
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 3))]
        # reference: the text ends where the first stop string to be completed starts (of those
        # completed by the same token, the first of the list), or where it ends with include_stop
        done = [text.find(x) + len(x) for x in stops if x in text]
        ref = text
        if done:
            head = text[: min(done)]
            s = next(x for x in stops if x in head)
            k = head.find(s)
            ref = text[: k + len(s) if include else k]
        cut = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 5)))) if len(text) > 1 else []
        spans = list(zip([0, *cut], [*cut, len(text)]))
        out = OutputText(TOK, stops, include_stop=include)
        pieces, got = stream(out, [ids(text[a:b]) for a, b in spans])
        assert got == ref, (text, stops, spans)
        assert out.stopped == bool(done)
        assert out.tokens == (min(done) if done else len(text))
        sent = ""
        for p in pieces:
            sent += p
            assert ref.startswith(sent)
        if include and not done:  # nothing held back: every chunk's text is sent with it
            assert pieces[:-1] == [text[a:b] for a, b in spans]


def test_a_long_output_keeps_only_the_hold_back_unsent():
    """Each token costs O(its text + the longest stop string), not O(all text so far): text
    handed out is kept apart and only what a stop string may still cut is searched and copied
    (one string grown by ``+=`` took 9.0 s for a 128k-token stream with a stop string, 0.5 s
    without). The text is still the whole decode."""
    tok = SimTokenizer()
    seq = [(i * 7919) % tok.vocab_size for i in range(20_000)]
    out = OutputText(tok, ["never appears here"])
    sent = []
    for t in seq:
        sent.append(out.push([t]))
        assert len(out._pending) <= len("never appears here") - 1 + 16, len(out._pending)
    sent.append(out.finish())
    assert "".join(sent) == out.text == tok.decode(seq) and not out.stopped and out.tokens == len(seq)


# --------------------------------------------------------------------------- #
# min_tokens
# --------------------------------------------------------------------------- #
# ``min_tokens`` at the router's stops (``services/router/stops.py``), vLLM v1's semantics: no stop
# token id and no stop string ends the output at or before its ``min_tokens``-th token; a stop string
# is matched only in the text a later token adds (vLLM's detokenizer checks ``len(output) >
# min_tokens`` and searches the new text), so one completed under ``min_tokens`` is never matched
# later (vLLM's ``tests/detokenizer/test_min_tokens.py``: ``min_tokens`` 5, stop ``e``).


def run_min(text: str, min_tokens: int, stop=(), stop_ids=(), chunk: int = 1) -> OutputText:
    out = OutputText(TOK, stop, stop_ids, min_tokens)
    ids = TOK.encode(text)
    for i in range(0, len(ids), chunk):
        out.push(ids[i : i + chunk])
        if out.stopped:
            break
    out.finish()
    return out


def test_stop_strings_wait_for_min_tokens():
    assert run_min("is Lee, a student", 0, ["e"]).text == "is L"
    for chunk in (1, 3, 100):
        got = run_min("is Lee, a student", 5, ["e"], chunk=chunk)
        # tokens 1..5 ("is Le") cannot stop; "e" at token 6 completes it there
        assert (got.text, got.stop_reason, got.tokens) == ("is Le", "e", 6), chunk
    # a stop string completed under min_tokens is not matched later; a later one is
    got = run_min("abXYcdXYef", 4, ["XY"])
    assert (got.text, got.tokens) == ("abXYcd", 8)
    # one that straddles the bound: completed by a token after it, matched
    got = run_min("abcXYd", 4, ["XY"])
    assert (got.text, got.tokens) == ("abc", 5)
    assert run_min("abXYcd", 10, ["XY"]).stop_reason is None


def test_stop_token_ids_wait_for_min_tokens():
    got = run_min("abcabc", 2, stop_ids=[ord("b")])
    assert (got.text, got.stop_reason, got.tokens) == ("abca", ord("b"), 5)
    got = run_min("abcabc", 1, stop_ids=[ord("b")])
    assert (got.text, got.tokens) == ("a", 2)
    assert run_min("abcabc", 6, stop_ids=[ord("b")]).stop_reason is None


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


class SplitTok:
    """Byte pieces that split multi-byte characters (中 = e4 b8 ad, 😀 = f0 9f 98 80) across ids, an
    invalid byte and a real U+FFFD; the text is their concatenation decoded with replacement."""

    name = "split"
    PIECES = [b"a", b"b", b"ab", b"\xe4", b"\xb8", b"\xad", b"\xe4\xb8", b"\xad ", b"<", b"/>", b"\xf0\x9f", b"\x98\x80", b"x\xe4", b"\xef\xbf\xbd", b"\xff"]
    vocab_size = len(PIECES)

    def encode(self, text):
        raise NotImplementedError

    def decode(self, ids):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def _oracle(tok, ids: list[int], stop: list[str], stop_ids: set[int], min_tokens: int, include: bool) -> tuple[str, str | int | None, int]:
    """(text, stop_reason, tokens) from a whole decode after every token (vLLM's detokenizer, no
    windows): the text grows by what the decode of the ids so far adds, unless it ends in U+FFFD (an
    incomplete character, held); past ``min_tokens`` the first stop string completed by the new
    text ends it (the first of the list found), before it or, with ``include``, after it; a stop
    token id ends it with the text before it (held text flushed), its own text too with ``include``;
    at the end held text is flushed."""
    text, shown = "", ""

    def grow(upto: int, hold: bool) -> str:
        nonlocal shown
        full = tok.decode(ids[:upto])
        if len(full) <= len(shown) or (hold and full.endswith("\ufffd")):
            return ""
        new, shown = full[len(shown) :], full
        return new

    def add(new: str, match: bool) -> str | None:
        nonlocal text
        old, text = len(text), text + new
        found = [(text.find(s, max(0, old - len(s) + 1)), s) for s in stop] if new and match else []
        found = [(k, s) for k, s in found if k >= 0]
        if not found:
            return None
        k, s = found[0]  # the first of the list
        text = text[: k + len(s)] if include else text[:k]
        return s

    for n, t in enumerate(ids, 1):
        if n > min_tokens and t in stop_ids:
            s = add(grow(n, True), True) if include else None
            s = s or add(grow(n if include else n - 1, False), True)
            return text, s or t, n
        s = add(grow(n, True), n > min_tokens)
        if s:
            return text, s, n
    # the end: held text is flushed (a whole decode shows it) and may still complete a stop string
    s = add(grow(len(ids), False), len(ids) > min_tokens)
    return text, s, len(ids)


@pytest.mark.parametrize("include", [False, True])
def test_split_characters_stop_ids_and_min_tokens_give_one_text_for_any_chunking(include):
    """Property test, random outputs of :class:`SplitTok` (characters split across ids), random stop
    strings (multi-byte characters and U+FFFD among them), stop token ids and ``min_tokens``: the
    streamed pieces joined are the non-streamed text, no piece carries text past the stop, and one id
    per push, random chunks and one chunk give the same (text, stop_reason, tokens) as the oracle."""
    tok = SplitTok()
    rng = random.Random(36)
    alphabet = ["a", "b", "a", "b", "<", "/", ">", " ", "中", "\ufffd", "😀", "x"]  # stops spanning single-byte ids often
    for _ in range(3000):
        seq = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 14))]
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(0, 3))]
        stop_ids = set(rng.sample(range(tok.vocab_size), rng.randrange(0, 2)))
        min_tokens = rng.choice([0, 0, 1, 2, 4])
        want = _oracle(tok, seq, stop, stop_ids, min_tokens, include)
        cuts = sorted(rng.sample(range(1, len(seq)), rng.randrange(0, len(seq)))) if len(seq) > 1 else []
        for chunks in ([[t] for t in seq], [seq[a:b] for a, b in zip([0, *cuts], [*cuts, len(seq)])], [seq]):
            out = OutputText(tok, stop, stop_ids, min_tokens, include_stop=include)
            pieces, got = stream(out, chunks)
            case = (seq, stop, stop_ids, min_tokens, chunks)
            assert (got, out.stop_reason, out.tokens) == want, case
            assert out.text == got or not (stop or stop_ids), case  # without stops .text is not kept
            assert all(got.startswith("".join(pieces[:i])) for i in range(len(pieces))), case
