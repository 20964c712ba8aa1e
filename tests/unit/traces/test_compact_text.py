"""traces.compact reads a file without decoding the ids a request shares with its reference (their
JSON text is compared instead): the store it builds, and every problem it reports, must be exactly
what decoding every id gives (``read_trace`` then ``compact_requests``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from evolving_infra.traces import io as tio
from evolving_infra.traces.compact import KEYFRAME_DEPTH, compact_requests, read_trace_compact, shared_text_prefix
from evolving_infra.traces.io import TraceError, read_trace, write_trace
from evolving_infra.traces.schema import MAX_BLOCK_ID, TraceRequest
from tests.unit.traces.test_compact import BS, HEADER

def _random_requests(seed: int) -> list[TraceRequest]:
    """A valid trace (branch rules kept: kinds, parents, every branch ends) whose requests extend,
    cut back, rewrite or borrow other requests' ids; ids from a small range (often not chained)
    or of any length up to MAX_BLOCK_ID (the text of equal-prefix ids differs in length)."""
    rng = random.Random(seed)

    def fresh() -> int:
        return rng.randrange(40) if rng.random() < 0.7 else rng.choice((rng.randrange(10**6), MAX_BLOCK_ID - rng.randrange(9)))

    out: list[TraceRequest] = []
    open_: dict[str, list[str]] = {}  # agent -> open branches
    every: dict[str, list[str]] = {}  # agent -> every branch so far
    ctx: dict[str, list[int]] = {}
    for j in range(rng.randint(1, 60)):
        agent = f"a{rng.randrange(3)}"
        branches = open_.setdefault(agent, [])
        seen = every.setdefault(agent, [])
        kind = parent = None
        if not branches or rng.random() < 0.15:
            branch = f"{agent}:b{len(seen)}"
            if seen:
                kind, parent = rng.choice(("fork", "subagent")), rng.choice(seen)
            else:
                kind = "main"
            branches.append(branch)
            seen.append(branch)
            base = list(ctx.get(parent, [])) if parent else []
        else:
            branch = rng.choice(branches)
            base = ctx[branch]
        u = rng.random()
        if u < 0.6:
            blocks = base + [fresh() for _ in range(rng.randint(0, 5))]
        elif u < 0.8:
            blocks = base[: rng.randint(0, len(base))] + [fresh() for _ in range(rng.randint(0, 5))]
        else:
            other = rng.choice(list(ctx.values())) if ctx else []
            blocks = other[: rng.randint(0, len(other))] + [fresh() for _ in range(rng.randint(0, 3))]
        ctx[branch] = blocks
        ends = rng.random() < 0.2
        if ends:
            branches.remove(branch)
        out.append(TraceRequest(id=f"r{j}", agent=agent, branch=branch, input_tokens=len(blocks) * BS + rng.randrange(1, BS),
                                output_tokens=1, blocks=blocks, kind=kind, parent_branch=parent, ends_branch=ends))
    last = {r.branch: i for i, r in enumerate(out)}
    return [r if r.ends_branch or last[r.branch] != i else TraceRequest(**{**{f: getattr(r, f) for f in r.__struct_fields__},
                                                                          "ends_branch": True})
            for i, r in enumerate(out)]


STORE_ARRAYS = ("_flat", "_off", "_ref", "_k", "_depth", "_prev", "_branch")


def _same_store(a, b) -> bool:
    return all(list(getattr(a.store, f)) == list(getattr(b.store, f)) for f in STORE_ARRAYS)


@pytest.fixture(params=[1 << 20, 61], ids=["chunk_1MiB", "chunk_61B"])
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The file read (and inflated) in chunks of this many bytes: at 61 bytes most lines cross
    chunk ends (a line is then joined from pieces), and lines are held back 3 chunks only."""
    monkeypatch.setattr(tio, "_CHUNK", request.param)
    monkeypatch.setattr(tio, "_HOLD", min(3 * request.param, tio._HOLD))
    return request.param


def test_random_traces_give_the_store_that_decoding_every_id_gives(tmp_path: Path, chunk: int) -> None:
    for seed in range(300):
        reqs = _random_requests(seed)
        path = tmp_path / f"t{seed}.jsonl.gz"
        write_trace(path, HEADER, reqs)
        got = read_trace_compact(path)
        want = compact_requests(HEADER, read_trace(path).requests)
        assert got.header == want.header and got.requests == want.requests and got.index == want.index, seed
        assert _same_store(got, want), seed
        assert got.requests_with_blocks() == reqs, seed


def _spaced(line: str, rng: random.Random) -> str:
    """The same JSON with spaces after some commas and before some delimiters of the ids."""
    head, sep, rest = line.partition('"blocks":[')
    if not sep:
        return line
    ids, close, tail = rest.partition("]")
    parts = ids.split(",") if ids else []
    out = "".join(p + (" " if rng.random() < 0.3 else "") + ("," if i < len(parts) - 1 else "")
                  + (" " if rng.random() < 0.3 else "") for i, p in enumerate(parts))
    return head + sep + out + close + tail


def _written(path: Path, seed: int, edit) -> tuple[Path, list[TraceRequest]]:
    """Seed ``seed``'s random trace written to ``path``, then its lines rewritten by ``edit(lines, rng)``."""
    reqs = _random_requests(seed)
    write_trace(path, HEADER, reqs)
    lines = path.read_text().splitlines()
    edit(lines, random.Random(seed))
    path.write_text("\n".join(lines) + "\n")
    return path, reqs


def test_ids_written_with_spaces_rebuild_the_same_requests(tmp_path: Path) -> None:
    """Other writers may space the arrays differently per line: shared ids may then be found
    shorter than the longest common prefix, never wrong."""

    def spaced(lines: list[str], rng: random.Random) -> None:
        lines[1:] = [_spaced(x, rng) for x in lines[1:]]

    for seed in range(200):
        path, reqs = _written(tmp_path / f"s{seed}.jsonl", seed, spaced)
        assert read_trace_compact(path).requests_with_blocks() == read_trace(path).requests == reqs, seed


def _mutate(line: str, rng: random.Random) -> str:
    """A request line with one fault in (or next to) its ids' text, or elsewhere."""
    d = json.loads(line)
    blocks = d.setdefault("blocks", [])
    u = rng.randrange(9)
    if u == 0 and blocks:
        blocks[rng.randrange(len(blocks))] = MAX_BLOCK_ID + 1
    elif u == 1 and blocks:
        blocks[rng.randrange(len(blocks))] = -1
    elif u == 2:
        blocks.append(rng.randrange(40))  # one id too many
    elif u == 3 and blocks:
        blocks.pop()
    elif u == 4:  # a comma before the closing bracket
        return line.replace("]", ",]", 1) if '"blocks":[' in line else line[:-1]
    elif u == 5:
        return line.replace('"blocks":[', '"blocks":[[', 1) if '"blocks":[' in line else line + "x"
    elif u == 6:
        d["blocks"] = "1,2"
    elif u == 7 and blocks:
        return line.replace('"blocks":[', '"blocks":[1.5,', 1)
    else:
        d["input_tokens"] = 0
    return json.dumps(d, separators=(",", ":"))


def _reads_as_read_trace(path: Path, tag: object) -> bool:
    """``read_trace_compact`` gives ``read_trace``'s requests, or raises its problems; True if it raised."""
    try:
        want = read_trace(path)
    except TraceError as e:
        with pytest.raises(TraceError) as got:
            read_trace_compact(path)
        assert got.value.problems == e.problems, tag
        return True
    assert read_trace_compact(path).requests_with_blocks() == want.requests, tag
    return False


def test_bad_lines_are_reported_as_read_trace_reports_them(tmp_path: Path, chunk: int) -> None:
    def mutated(lines: list[str], rng: random.Random) -> None:
        for i in rng.sample(range(1, len(lines)), min(len(lines) - 1, rng.randint(1, 3))):
            lines[i] = _mutate(lines[i], rng)

    reported = 0
    for seed in range(300):
        path, _ = _written(tmp_path / f"b{seed}.jsonl", seed, mutated)
        reported += _reads_as_read_trace(path, seed)
    assert reported > 200


@pytest.mark.parametrize(
    ("ref", "new", "want"),
    [
        ([1, 2, 3], [1, 2, 3], (3, 6)),
        ([1, 2, 3], [1, 2, 3, 4], (3, 6)),
        ([1, 2, 3, 4], [1, 2, 3], (3, 6)),
        ([1, 2, 35], [1, 2, 34], (2, 4)),
        ([1, 2, 3, 5], [1, 2, 35], (2, 4)),
        ([1, 2], [1, 23], (1, 2)),
        ([1, 2, 3], [1, 2, 4], (2, 4)),
        ([1, 2], [3, 4], (0, -1)),
        ([], [3, 4], (0, -1)),
    ],
)
def test_shared_text_prefix(ref: list[int], new: list[int], want: tuple[int, int]) -> None:
    enc = lambda x: json.dumps(x, separators=(",", ":")).encode()  # noqa: E731
    assert shared_text_prefix(enc(ref)[:-1], len(ref), enc(new)) == want  # ref without its "]"
    assert shared_text_prefix(enc(ref)[:-1], len(ref), b"xy" + enc(new) + b"z", 2, 2 + len(enc(new))) == (want[0], want[1] + 2 * (want[1] >= 0))


def test_coarser_blocks_slice_the_store_that_converting_every_request_gives() -> None:
    """``at_block_size`` to coarser blocks takes the ids from the stored segments: the same
    requests as converting the full lists, and for chained ids the same store."""
    from evolving_infra.sim.run import convert_block_size
    from evolving_infra.traces.tokens import rechain_blocks

    for seed in range(200):
        reqs, _ = rechain_blocks(_random_requests(seed))
        ct = compact_requests(HEADER, reqs)
        for to in (2 * BS, 4 * BS):
            got = ct.at_block_size(to)
            want = compact_requests(got.header, convert_block_size(reqs, BS, to))
            assert got.requests == want.requests and got.index == want.index, (seed, to)
            assert _same_store(got, want), (seed, to)
            assert got.requests_with_blocks() == want.requests_with_blocks(), (seed, to)


def _odd_lines() -> list[str]:
    """Request lines on which finding ``"blocks":[`` in the text is not finding the ids: another
    object's ``blocks`` key, escapes, arrays holding more than ints, a comma before ``]``."""
    def line(rid: str, tail: str, blocks: str = '"blocks":[1,2]', kind: str = ',"kind":"main"') -> str:
        return f'{{"id":"{rid}","agent":"a","branch":"a:{rid}","input_tokens":9,"output_tokens":1,{blocks}{kind},"ends_branch":true{tail}}}'

    return [
        line("n1", ',"x":{"blocks":[1,2]}', blocks='"pause_s":0'),  # only a nested key: no ids (a fault: 2 expected)
        line("n2", ',"x":{"blocks":[7,8]}'),  # two "blocks" keys
        line("n3", ',"x":"q\\"blocks\\":[5]"'),  # an escaped quote
        line("n4", ',"x\\"blocks":[5,6]', blocks='"pause_s":0'),  # a key with an escape, no ids
        line("n5", "", blocks='"blocks":[[1],2]'),
        line("n6", "", blocks='"blocks":[1,"]"]'),
        line("n7", "", blocks='"blocks":[1,2,]'),
        line("n8", "", blocks='"blocks":[1, 2 ,]'),
        line("n9", "", blocks='"blocks":[1,2] ,"blocks":[3,4]'),  # a repeated key: the last one counts
        line("n10", "", blocks='"blocks" : [1,2]'),
        line("n11", ',"x":[1,"]"]'),
        line("n12", "", blocks='"blocks":[1,2]]'),
        line("n13", ',"bl\\u006fcks":[0]', blocks='"x\\"blocks":[1,2]'),  # the ids' key escaped, another unescaped
        line("n14", "", blocks='"blocks":[1,2],"blocks":[0]'),
        line("n15", "", blocks='"blocks":null'),  # the key not followed by ":["
        line("n16", "", blocks='"blocks":[1,\\u0032]'),  # an escape inside the array only
        line("n17", ',"x":"blocks"'),  # the token again as a value, after the ids
        line("n18", ',"x":"blocks"', blocks='"pause_s":0'),  # only as a value: no ids
        line("n19", "", blocks='"x":"blocks","blocks":[1,2]'),  # as a value before the key
        line("n20", "", blocks='"blocks""blocks":[1,2]'),  # two tokens sharing a quote
    ]


def test_lines_where_the_ids_are_not_where_the_text_says(tmp_path: Path) -> None:
    header = json.dumps({"format": "evolving-infra-trace", "block_size": BS})
    good = ('{"id":"g0","agent":"a","branch":"a:g","input_tokens":9,"output_tokens":1,"blocks":[1,2],'
            '"kind":"main","ends_branch":true}')
    for odd in _odd_lines():
        path = tmp_path / "odd.jsonl"
        path.write_text("\n".join([header, good, odd]) + "\n")  # g0 is the reference of the agent's next request
        _reads_as_read_trace(path, odd)


def test_coarsened_names_a_request_whose_id_count_is_not_the_one_given() -> None:
    reqs = _random_requests(5)
    ct = compact_requests(HEADER, reqs)
    lengths = [len(r.blocks) for r in reqs]
    assert ct.store.coarsened(2, lengths).stored_ids >= 0
    j = len(lengths) // 2
    with pytest.raises(ValueError, match=f"request {j} holds {lengths[j]} ids, not {lengths[j] + 1}"):
        ct.store.coarsened(2, lengths[:j] + [lengths[j] + 1] + lengths[j + 1 :])


def test_the_store_read_holds_its_tables_as_arrays(tmp_path: Path) -> None:
    """The reader appends to the per-request tables as lists (``BlockStore._as_lists``) and hands
    back arrays of the store's own types: what ``nbytes``, ``coarsened``, ``chained`` and the packer
    read with numpy."""
    reqs = _random_requests(7)
    path = tmp_path / "t.jsonl"
    write_trace(path, HEADER, reqs)
    got = read_trace_compact(path)
    want = compact_requests(HEADER, read_trace(path).requests)
    for name in STORE_ARRAYS[:-1]:
        a, b = getattr(got.store, name), getattr(want.store, name)
        assert type(a) is type(b) and a.typecode == b.typecode and a == b, name
    assert got.store.nbytes == want.store.nbytes
    assert got.store.chained() == want.store.chained()
    assert got.at_block_size(2 * BS).requests_with_blocks() == want.at_block_size(2 * BS).requests_with_blocks()


def test_a_keyframe_holds_every_id_its_reference_chain_gives(tmp_path: Path) -> None:
    """A request whose reference chain would reach KEYFRAME_DEPTH stores all its ids: those it shares
    are copied from the store (``BlockStore.prefix``), the rest decoded; the store equals the one
    decoding every id gives, keyframes and all."""
    n = 2 * KEYFRAME_DEPTH + 5
    reqs, blocks = [], []
    for j in range(n):
        blocks = blocks + [1000 * j + x for x in range(1 + j % 3)]
        if j % 7 == 6:  # no new id: the whole reference shared
            blocks = blocks[:-1] if j % 2 else blocks
        reqs.append(TraceRequest(id=f"r{j}", agent="a", branch="a:main", input_tokens=len(blocks) * BS + 1, output_tokens=1,
                                 blocks=list(blocks), kind="main" if j == 0 else None, after=[f"r{j - 1}"] if j else [],
                                 ends_branch=j == n - 1))
    path = tmp_path / "k.jsonl"
    write_trace(path, HEADER, reqs)
    got = read_trace_compact(path)
    want = compact_requests(HEADER, reqs)
    assert [i for i, d in enumerate(got.store._depth) if d == 0] == [0, KEYFRAME_DEPTH, 2 * KEYFRAME_DEPTH]
    assert _same_store(got, want)
    assert got.requests_with_blocks() == reqs
