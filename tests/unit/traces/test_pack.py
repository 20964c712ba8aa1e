"""A packed trace (``trace pack``) reads back as exactly the compact trace of the file it was packed
from, and ``simulate --trace`` of it is the same run; a damaged or hand-made pack is rejected with a
reason, and its requests are held to every rule a trace's lines are."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import msgspec
import pytest

from evolving_infra.cli import main
from evolving_infra.traces import pack
from evolving_infra.traces.compact import read_trace_compact
from evolving_infra.traces.io import TraceError, _Validator, iter_requests, iter_validate, read_trace, write_trace
from evolving_infra.traces.schema import TraceRequest
from tests.unit.traces.test_compact import BS, HEADER
from tests.unit.traces.test_compact_text import STORE_ARRAYS, _random_requests


def _same(a, b) -> bool:
    """Equal compact traces: header, stubs, index, and every store array (typecode too)."""
    if (a.header, a.requests, a.index) != (b.header, b.requests, b.index):
        return False
    for f in STORE_ARRAYS:
        x, y = getattr(a.store, f), getattr(b.store, f)
        if type(x) is not type(y) or getattr(x, "typecode", None) != getattr(y, "typecode", None) or x != y:
            return False
    return True


def test_random_traces_pack_and_read_back_the_same(tmp_path: Path) -> None:
    for seed in range(150):
        reqs = _random_requests(seed)
        src = tmp_path / f"t{seed}.jsonl.gz"
        write_trace(src, HEADER, reqs)
        want = read_trace_compact(src)
        dst = tmp_path / f"t{seed}.eipack"
        pack.write_packed(dst, want)
        assert pack.is_packed(dst) and not pack.is_packed(src)
        got = read_trace_compact(dst)
        assert _same(got, want), seed
        assert _same(pack.read_packed(dst, trusted=True), want), seed  # the trace cache's read: the same trace
        assert got.requests_with_blocks() == reqs, seed
        assert got.rechained()[1] == want.rechained()[1], seed
        pack.write_packed(tmp_path / "again.eipack", got)  # bytes a pure function of the trace
        assert (tmp_path / "again.eipack").read_bytes() == dst.read_bytes(), seed


def _one_shot(trace) -> bytes:
    """The pack of ``trace`` as msgspec encodes the whole payload at once (what ``write_packed`` wrote before it
    wrote the payload in parts, the store's arrays uncopied): the format the parts must add up to, byte for byte."""
    st = trace.store
    payload = msgspec.msgpack.encode(pack._Payload(pack.PACK_VERSION, trace.header, trace.requests,
                                                   *(bytes(getattr(st, "_" + n)) for n in pack._ARRAYS)))
    return pack.MAGIC + len(payload).to_bytes(8, "little") + zlib.crc32(payload).to_bytes(4, "little") + payload


def test_the_pack_written_in_parts_is_the_one_shot_encoding(tmp_path: Path) -> None:
    # bin 8 (empty arrays, a one-request trace's offsets), bin 16 (the random traces), bin 32 (the shipped sample)
    sample = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"
    empty = tmp_path / "e.jsonl"
    write_trace(empty, HEADER, [])
    one = tmp_path / "one.jsonl"
    write_trace(one, HEADER, [msgspec.structs.replace(_random_requests(1)[0], ends_branch=True)])
    srcs = [empty, one, sample]
    for seed in range(20):
        srcs.append(tmp_path / f"t{seed}.jsonl")
        write_trace(srcs[-1], HEADER, _random_requests(seed))
    heads = set()
    for src in srcs:
        trace = read_trace_compact(src)
        dst = tmp_path / "p.eipack"
        n = pack.write_packed(dst, trace)
        want = _one_shot(trace)
        assert dst.read_bytes() == want and n == len(want), src
        heads |= {bytes(pack._bin_head(len(getattr(trace.store, "_" + a).tobytes())))[:1] for a in pack._ARRAYS}
    assert heads == {b"\xc4", b"\xc5", b"\xc6"}
    with pytest.raises(ValueError, match="does not fit a msgpack bin"):
        pack._bin_head(1 << 32)


def test_empty_trace_packs(tmp_path: Path) -> None:
    src = tmp_path / "e.jsonl"
    write_trace(src, HEADER, [])
    pack.write_packed(tmp_path / "e.eipack", read_trace_compact(src))
    assert _same(read_trace_compact(tmp_path / "e.eipack"), read_trace_compact(src))


def _packed(tmp_path: Path, seed: int = 3) -> tuple[Path, pack._Payload]:
    reqs = _random_requests(seed)
    src = tmp_path / "src.jsonl"
    write_trace(src, HEADER, reqs)
    dst = tmp_path / "p.eipack"
    pack.write_packed(dst, read_trace_compact(src))
    data = dst.read_bytes()
    return dst, msgspec.msgpack.decode(data[pack._PREFIX :], type=pack._Payload)


def _rewrite(path: Path, pl: pack._Payload) -> Path:
    """``pl`` written as a well-formed pack (right length and checksum): only its content is wrong."""
    payload = msgspec.msgpack.encode(pl)
    path.write_bytes(pack.MAGIC + len(payload).to_bytes(8, "little") + zlib.crc32(payload).to_bytes(4, "little") + payload)
    return path


def _reasons(path: Path, trusted: bool = False) -> list[str]:
    with pytest.raises(TraceError) as got:
        read_trace_compact(path) if not trusted else pack.read_packed(path, trusted=True)
    return [str(p) for p in got.value.problems]


@pytest.mark.parametrize("trusted", [False, True])
def test_damaged_packs_are_rejected_with_a_reason(tmp_path: Path, trusted: bool) -> None:
    # the trace cache's trusted read too: a damaged pack in the cache is a miss, not a run of garbage
    dst, _ = _packed(tmp_path)
    data = dst.read_bytes()
    i = len(data) // 2
    dst.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :])
    assert "checksum mismatch" in _reasons(dst, trusted)[0]
    dst.write_bytes(data[:-5])
    assert "truncated or extended" in _reasons(dst, trusted)[0]
    dst.write_bytes(data + b"x")
    assert "truncated or extended" in _reasons(dst, trusted)[0]
    dst.write_bytes(data[:10])
    assert "truncated or extended" in _reasons(dst, trusted)[0]


def _ints(raw: bytes) -> list[int]:
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _raw(xs: list[int]) -> bytes:
    return b"".join(x.to_bytes(8, "little", signed=True) for x in xs)


@pytest.mark.parametrize("trusted", [False, True])
def test_hand_made_stores_are_rejected(tmp_path: Path, trusted: bool) -> None:
    dst, pl = _packed(tmp_path)
    refs, ks, flat = _ints(pl.ref), _ints(pl.k), _ints(pl.flat)
    j = next(i for i, r in enumerate(refs) if r >= 0)  # a request stored against an earlier one
    cases = {
        "refers to itself or a later request": msgspec.structs.replace(pl, ref=_raw(refs[:j] + [j] + refs[j + 1 :])),
        "shared count does not match": msgspec.structs.replace(pl, k=_raw(ks[:j] + [0] + ks[j + 1 :])),
        "ids with request": msgspec.structs.replace(pl, k=_raw(ks[:j] + [10**6] + ks[j + 1 :])),
        "outside [0,": msgspec.structs.replace(pl, flat=_raw([-1] + flat[1:])),
        "offsets are not increasing": msgspec.structs.replace(pl, off=_raw([0, len(flat) + 1] + _ints(pl.off)[2:])),
        "references,": msgspec.structs.replace(pl, ref=pl.ref[:-8]),
        "whole number of int64s": msgspec.structs.replace(pl, flat=pl.flat + b"\0"),
        "layout version 9": msgspec.structs.replace(pl, version=9),
    }
    if trusted:  # the trace cache's read: its packs' ids were bounded when the trace was read
        del cases["outside [0,"]
    for want, bad in cases.items():
        reasons = _reasons(_rewrite(dst, bad), trusted)
        assert any(want in r for r in reasons), (want, reasons)


def test_pack_requests_are_held_to_the_trace_rules(tmp_path: Path) -> None:
    dst, pl = _packed(tmp_path)
    r0, r1 = pl.requests[0], pl.requests[1]
    dup = msgspec.structs.replace(pl, requests=[r0, msgspec.structs.replace(r1, id=r0.id), *pl.requests[2:]])
    assert any(r.startswith("line 3: duplicate request id") for r in _reasons(_rewrite(dst, dup)))
    tokens = msgspec.structs.replace(pl, requests=[msgspec.structs.replace(r0, input_tokens=r0.input_tokens + 5 * BS),
                                                   *pl.requests[1:]])
    assert any(r.startswith("line 2: len(blocks) =") for r in _reasons(_rewrite(dst, tokens)))
    held = msgspec.structs.replace(pl, requests=[msgspec.structs.replace(r0, blocks=[1]), *pl.requests[1:]])
    assert any("holds its block ids" in r for r in _reasons(_rewrite(dst, held)))
    # a trusted read (the trace cache's own packs, written from a trace this reader checked) does not check the rules again
    assert pack.read_packed(_rewrite(dst, dup), trusted=True).requests[1].id == r0.id
    bad_type = msgspec.msgpack.encode(pl).replace(b"input_tokens", b"input_tokenz", 1)
    dst.write_bytes(pack.MAGIC + len(bad_type).to_bytes(8, "little") + zlib.crc32(bad_type).to_bytes(4, "little") + bad_type)
    assert "undecodable payload" in _reasons(dst)[0]


def test_cli_pack_then_simulate_is_the_same_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.sim.test_sim_compact import _trace
    from tests.unit.sim.conftest import BS as SIM_BS
    from evolving_infra.traces.schema import FORMAT, TraceHeader

    src = tmp_path / "t.jsonl.gz"
    write_trace(src, TraceHeader(format=FORMAT, block_size=SIM_BS, source="test"), _trace())
    dst = tmp_path / "t.eipack"
    assert main(["trace", "pack", str(src), str(dst)]) == 0
    assert "requests" in capsys.readouterr().err
    sim = ["--profile", "tiny", "--nodes", "3", "--policy", "evolving", "--concurrency", "4", "--max-pause", "30", "--no-plots"]
    for name, path in (("gz", src), ("pk", dst)):
        assert main(["simulate", "--trace", str(path), "--out", str(tmp_path / name), *sim]) == 0
    from evolving_infra.sim.run import WALL_CLOCK_KEYS

    def report(name: str) -> dict:
        rep = json.loads((tmp_path / name / "report.json").read_text())
        rep["meta"] = {k: v for k, v in rep["meta"].items() if k not in ("date", "argv", "wall_s", "trace")}
        return {k: v for k, v in rep.items() if k not in WALL_CLOCK_KEYS}

    assert report("pk") == report("gz") and report("gz")["requests_completed"] > 0
    assert (tmp_path / "pk" / "requests.jsonl").read_text() == (tmp_path / "gz" / "requests.jsonl").read_text()


def test_cli_pack_of_a_bad_trace_names_its_line_and_the_line_readers_name_a_pack(tmp_path: Path, capsys) -> None:
    src = tmp_path / "bad.jsonl"
    lines = [json.dumps({"format": "evolving-infra-trace", "block_size": BS}), '{"id": "x"}']
    src.write_text("\n".join(lines) + "\n")
    assert main(["trace", "pack", str(src), str(tmp_path / "o.eipack")]) == 2
    assert "line 2: invalid request" in capsys.readouterr().err
    assert not (tmp_path / "o.eipack").exists()
    dst, _ = _packed(tmp_path)
    problems = list(iter_validate(dst))
    assert len(problems) == 1 and problems[0].line == 1 and "a packed trace (trace pack)" in problems[0].reason
    with pytest.raises(TraceError, match="a packed trace"):
        read_trace(dst)
    with pytest.raises(TraceError, match="a packed trace"):
        iter_requests(dst)


def test_cli_pack_to_a_path_it_cannot_write_says_so(tmp_path: Path, capsys) -> None:
    """An output that cannot be written (its folder is a file here) is an error with a reason and
    exit status 2, not a traceback, and leaves no partial ``.tmp`` behind."""
    src = tmp_path / "t.jsonl"
    write_trace(src, HEADER, _random_requests(3))
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["trace", "pack", str(src), str(blocker / "o.eipack")]) == 2
    assert f"{blocker / 'o.eipack'}: cannot write:" in capsys.readouterr().err
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "o.eipack").mkdir()  # the CLI refuses a folder up front; write_packed's rename fails
    assert main(["trace", "pack", str(src), str(dest / "o.eipack")]) == 2
    assert "is a folder" in capsys.readouterr().err
    with pytest.raises(OSError):  # ... and the .tmp written before it is removed
        pack.write_packed(dest / "o.eipack", read_trace_compact(src))
    assert sorted(p.name for p in dest.iterdir()) == ["o.eipack"]


def _mutated(seed: int) -> list[TraceRequest]:
    """A random trace (``_random_requests``) with about one request in four broken in one way a pack's
    requests can be: a repeated id, another agent, a kind or parent set mid-branch, ``after`` naming an
    unknown, repeated or other agent's request, a request after its branch ended."""
    rng = random.Random(seed)
    reqs = _random_requests(seed)
    out: list[TraceRequest] = []
    for r in reqs:
        if out and rng.random() < 0.25:
            prev = rng.choice(out)
            r = rng.choice((
                lambda: msgspec.structs.replace(r, id=prev.id),
                lambda: msgspec.structs.replace(r, agent=prev.agent if prev.agent != r.agent else r.agent + "x"),
                lambda: msgspec.structs.replace(r, kind="fork"),
                lambda: msgspec.structs.replace(r, parent_branch=prev.branch),
                lambda: msgspec.structs.replace(r, after=["nope"]),
                lambda: msgspec.structs.replace(r, after=[prev.id]),
                lambda: msgspec.structs.replace(r, after=[prev.id, prev.id]),
                lambda: msgspec.structs.replace(r, branch=prev.branch),
                lambda: msgspec.structs.replace(r, input_tokens=r.input_tokens + BS),
                lambda: msgspec.structs.replace(r, ends_branch=not r.ends_branch),
            ))()
        out.append(r)
    return out


def test_check_all_is_feed_checked_of_each_request() -> None:
    # read_packed's loop (Validator.check_all takes the usual request itself): the same problems,
    # and the same ids, lines and branches after, as feed_checked request by request
    broken = 0
    for seed in range(400):
        reqs = _mutated(seed)
        counts = [r.input_tokens // BS + (seed % 7 == 3 and i % 5 == 1) for i, r in enumerate(reqs)]
        one, all_ = _Validator(), _Validator()
        for v in (one, all_):
            v.header, v.block_size = HEADER, BS
        for i, (r, nb) in enumerate(zip(reqs, counts)):
            one.feed_checked(i + 2, r, nb)
        all_.check_all(reqs, counts)
        for v in (one, all_):
            v.finish(len(reqs) + 1)
        assert all_.problems == one.problems, seed
        assert (all_.ids, all_.id_line) == (one.ids, one.id_line), seed
        assert ({b: (x.agent, x.first_line, x.last_line, x.ended_line) for b, x in all_.branches.items()}
                == {b: (x.agent, x.first_line, x.last_line, x.ended_line) for b, x in one.branches.items()}), seed
        broken += bool(one.problems)
    assert 100 < broken < 400  # the mutations break many traces, not all
