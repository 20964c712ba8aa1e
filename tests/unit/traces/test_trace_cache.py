"""The trace cache (``evolving_infra.traces.cache``): ``simulate --trace FILE`` packs FILE into the cache on its first
run and reads the pack on later runs of the unchanged FILE: the same report whether the pack came from the cache,
was written now, or the cache is off. A changed FILE, a damaged pack or an unwritable cache is a miss, never a
failed run; the cache stays under its cap, least recently used packs evicted first."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from evolving_infra.cli import main
from evolving_infra.traces import cache
from evolving_infra.traces.compact import read_trace_compact
from evolving_infra.traces.io import write_trace
from evolving_infra.traces.schema import FORMAT, TraceHeader
from tests.unit.sim.conftest import BS, strip_wall

SAMPLE = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"
SIM = ["--nodes", "2", "--duration", "60", "--no-plots"]


@pytest.fixture
def cdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of this test (``EI_TRACE_CACHE_DIR``), not yet made."""
    d = tmp_path / "cache"
    monkeypatch.setenv(cache.ENV_DIR, str(d))
    monkeypatch.delenv(cache.ENV_MAX_BYTES, raising=False)
    return d


def _sim(trace: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    """(exit status, the summary line's trace-cache state or '', stderr) of one ``simulate`` in this process."""
    rc = main(["simulate", "--trace", str(trace), "--out", str(out), *SIM, *extra])
    got = capsys.readouterr()
    line = next((ln for ln in got.out.splitlines() if ln.startswith("simulated ")), "")
    return rc, line.partition(", trace cache ")[2], got.err


def _report(out: Path) -> tuple[dict, str]:
    rep = strip_wall(json.loads((out / "report.json").read_text()))
    return rep, (out / "requests.jsonl").read_text()


def _packs(d: Path) -> list[Path]:
    return sorted(d.glob("*" + cache.SUFFIX)) if d.exists() else []


def test_miss_then_hit_and_off_give_the_same_report(tmp_path: Path, cdir: Path, capsys, monkeypatch) -> None:
    src = tmp_path / "t.jsonl.gz"
    shutil.copy(SAMPLE, src)
    rc, state, _ = _sim(src, tmp_path / "miss", capsys)
    assert (rc, state) == (0, "miss")
    (pack,) = _packs(cdir)
    assert oct(cdir.stat().st_mode & 0o777) == "0o700" and oct(pack.stat().st_mode & 0o777) == "0o600"
    assert not [p for p in cdir.iterdir() if p != pack]  # no temporary file left
    # a hit neither parses FILE nor inflates it ahead
    import evolving_infra.traces.compact as compact
    import evolving_infra.traces.inflate as inflate

    def boom(*a, **k):
        raise AssertionError("FILE read on a hit")

    with monkeypatch.context() as mp:
        mp.setattr(compact, "read_trace_compact", boom)
        mp.setattr(inflate.InflateAhead, "start", classmethod(boom))
        rc, state, err = _sim(src, tmp_path / "hit", capsys)
    assert (rc, state, err.count("trace cache")) == (0, "hit", 0)
    assert _packs(cdir) == [pack]
    rc, state, _ = _sim(src, tmp_path / "flag", capsys, "--no-trace-cache")
    assert (rc, state) == (0, "off")
    monkeypatch.setenv(cache.ENV_DIR, "off")
    rc, state, _ = _sim(src, tmp_path / "env", capsys)
    assert (rc, state) == (0, "off")
    want = _report(tmp_path / "miss")
    assert want[0]["requests_completed"] > 0
    for name in ("hit", "flag", "env"):
        assert _report(tmp_path / name) == want, name


def test_a_hit_touches_its_pack_and_the_pack_is_the_trace_read(tmp_path: Path, cdir: Path, capsys) -> None:
    src = tmp_path / "t.jsonl.gz"
    shutil.copy(SAMPLE, src)
    assert _sim(src, tmp_path / "a", capsys)[:2] == (0, "miss")
    (pack,) = _packs(cdir)
    from tests.unit.traces.test_pack import _same

    assert _same(read_trace_compact(pack), read_trace_compact(src))
    os.utime(pack, ns=(10**9, 10**9))  # used long ago
    assert _sim(src, tmp_path / "b", capsys)[:2] == (0, "hit")
    assert pack.stat().st_mtime > time.time() - 600  # recently used now: the last to be evicted


def test_a_hit_does_not_check_the_rules_again(tmp_path: Path, cdir: Path, capsys, monkeypatch) -> None:
    # the pack under a key was written by this reader (the key hashes its sources) from the file as it read and checked
    # it: a hit checks the pack's checksum, layout and store, not the requests' rules (~20 ms of a 512-token run's ~50-ms
    # read); the same report
    src = tmp_path / "t.jsonl.gz"
    shutil.copy(SAMPLE, src)
    assert _sim(src, tmp_path / "a", capsys)[:2] == (0, "miss")
    from evolving_infra.traces.io import _Validator

    def not_again(*a, **k):
        raise AssertionError("a hit checked the requests' rules again")

    monkeypatch.setattr(_Validator, "check_all", not_again)
    monkeypatch.setattr(_Validator, "finish", not_again)
    assert _sim(src, tmp_path / "b", capsys)[:2] == (0, "hit")
    assert _report(tmp_path / "b") == _report(tmp_path / "a")


def _tiny(output: int) -> list:
    from tests.unit.sim.test_sim_compact import _trace

    return [msgspec.structs.replace(r, output_tokens=output) for r in _trace()]


TINY = ["--profile", "tiny", "--nodes", "3", "--policy", "evolving", "--concurrency", "4", "--max-pause", "30"]


def test_a_hit_imports_no_numpy(tmp_path: Path, cdir: Path) -> None:
    # a hit reads its pack without numpy (the store in Python; the ids taken as chained: only a chained trace's pack
    # is kept) and the report's means and percentiles are numpy's arithmetic in Python: a run at the trace's block size
    # imports no numpy (~65 ms of a 600-s run at 512-token blocks)
    src = tmp_path / "t.jsonl"
    write_trace(src, TraceHeader(format=FORMAT, block_size=BS, source="test"), _tiny(4))
    code = ("import sys; from evolving_infra.cli import main; "
            f"rc = main(['simulate', '--trace', {str(src)!r}, '--out', sys.argv[1], *{SIM + TINY!r}]); "
            "print('numpy imported', 'numpy' in sys.modules)")
    env = {**os.environ, cache.ENV_DIR: str(cdir)}
    out = [subprocess.run([sys.executable, "-c", code, str(tmp_path / d)], capture_output=True, text=True, env=env,
                          check=True).stdout for d in ("a", "b")]
    assert "trace cache miss" in out[0] and "trace cache hit" in out[1], out
    assert out[1].splitlines()[-1] == "numpy imported False", out[1]
    assert _report(tmp_path / "b") == _report(tmp_path / "a")


def test_an_unchained_trace_keeps_no_pack_and_is_read_every_run(tmp_path: Path, cdir: Path, capsys) -> None:
    # a hit takes its pack's ids as chained (no sort of them again): a trace whose ids must be remapped is not kept
    reqs = _tiny(4)
    i = next(j for j, r in enumerate(reqs) if r.blocks[:2] == [7, 8])
    reqs[i] = msgspec.structs.replace(reqs[i], blocks=[8, 7, *reqs[i].blocks[2:]])  # 7 after 8 here, first elsewhere
    src = tmp_path / "t.jsonl"
    write_trace(src, TraceHeader(format=FORMAT, block_size=BS, source="test"), reqs)
    for d in ("a", "b"):
        rc, state, err = _sim(src, tmp_path / d, capsys, *TINY)
        assert (rc, state) == (0, "miss"), err
        assert "block ids are not chained" in err and "its pack is not kept" in err, err
    assert _packs(cdir) == []
    assert _sim(src, tmp_path / "plain", capsys, *TINY, "--no-trace-cache")[:2] == (0, "off")
    assert _report(tmp_path / "b") == _report(tmp_path / "plain")
    assert _report(tmp_path / "b")[0]["meta"]["block_ids_rechained"] > 0


def test_a_rewritten_file_of_the_same_size_is_a_miss_and_its_new_content_is_simulated(tmp_path: Path, cdir: Path,
                                                                                     capsys) -> None:
    tiny = ["--profile", "tiny", "--nodes", "3", "--policy", "evolving", "--concurrency", "4", "--max-pause", "30"]
    header = TraceHeader(format=FORMAT, block_size=BS, source="test")
    src = tmp_path / "t.jsonl"
    write_trace(src, header, _tiny(4))
    assert _sim(src, tmp_path / "old", capsys, *tiny)[:2] == (0, "miss")
    before = os.stat(src)
    time.sleep(0.02)  # past the file system's timestamp tick
    with open(src, "r+b") as f:  # in place (same inode): 4 -> 5 output tokens, the same number of bytes
        text = f.read().replace(b'"output_tokens":4', b'"output_tokens":5')
        f.seek(0)
        f.write(text)
    after = os.stat(src)
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino) and after.st_mtime_ns != before.st_mtime_ns
    assert _sim(src, tmp_path / "new", capsys, *tiny)[:2] == (0, "miss")
    assert len(_packs(cdir)) == 2  # the old one stays until evicted: no run reads it again
    assert _sim(src, tmp_path / "plain", capsys, *tiny, "--no-trace-cache")[:2] == (0, "off")
    assert _report(tmp_path / "new") == _report(tmp_path / "plain")
    assert _report(tmp_path / "new")[0]["completion_tokens_total"] != _report(tmp_path / "old")[0]["completion_tokens_total"]
    assert _sim(src, tmp_path / "again", capsys, *tiny)[:2] == (0, "hit")
    assert _report(tmp_path / "again") == _report(tmp_path / "plain")


def test_a_file_changed_while_it_is_read_leaves_no_pack(tmp_path: Path, cdir: Path) -> None:
    src = tmp_path / "t.jsonl.gz"
    shutil.copy(SAMPLE, src)
    entry = cache.lookup(src)
    trace = read_trace_compact(src)
    time.sleep(0.02)
    src.write_bytes(src.read_bytes())  # rewritten (same bytes, a later mtime) after the look-up
    entry.store(trace)
    assert (entry.status, entry.stored, _packs(cdir)) == ("miss", False, [])
    again = cache.lookup(src)  # the next run: a new key, and a pack of what it reads
    again.store(read_trace_compact(src))
    assert again.stored and _packs(cdir) == [again.pack]


def test_a_damaged_pack_is_a_miss_with_one_note_and_is_replaced(tmp_path: Path, cdir: Path, capsys) -> None:
    src = tmp_path / "t.jsonl.gz"
    shutil.copy(SAMPLE, src)
    assert _sim(src, tmp_path / "a", capsys)[:2] == (0, "miss")
    (pack,) = _packs(cdir)
    good = pack.read_bytes()
    for bad in (good[: len(good) // 2], good[:100] + bytes([good[100] ^ 1]) + good[101:], b""):
        pack.write_bytes(bad)
        rc, state, err = _sim(src, tmp_path / "b", capsys)
        assert (rc, state) == (0, "miss")
        notes = [ln for ln in err.splitlines() if "trace cache" in ln]
        assert len(notes) == 1 and "did not read back" in notes[0] and "Traceback" not in err, err
        assert pack.read_bytes() == good  # packed again
        assert _report(tmp_path / "b") == _report(tmp_path / "a")
    assert _sim(src, tmp_path / "c", capsys)[:2] == (0, "hit")


def test_an_unwritable_cache_never_fails_the_run(tmp_path: Path, cdir: Path, capsys, monkeypatch) -> None:
    src = tmp_path / "t.jsonl.gz"
    shutil.copy(SAMPLE, src)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(cache.ENV_DIR, str(blocker / "cache"))  # its folder cannot be made (root ignores modes)
    rc, state, err = _sim(src, tmp_path / "a", capsys)
    assert (rc, state) == (0, "miss")
    notes = [ln for ln in err.splitlines() if "trace cache" in ln]
    assert len(notes) == 1 and f"cannot write {blocker / 'cache'}" in notes[0], err
    assert blocker.is_file()
    # disk full mid-write: the run goes on, no partial file left under any name
    monkeypatch.setenv(cache.ENV_DIR, str(cdir))
    import evolving_infra.traces.pack as pack

    def full(f, trace) -> int:
        f.write(b"\x93EITPACK partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pack, "write_packed", full)
    rc, state, err = _sim(src, tmp_path / "b", capsys)
    assert (rc, state) == (0, "miss")
    assert "No space left on device" in err and list(cdir.iterdir()) == []
    assert _report(tmp_path / "b") == _report(tmp_path / "a")


def _fake_pack(d: Path, name: str, size: int, mtime_s: float) -> Path:
    p = d / (name + cache.SUFFIX)
    p.write_bytes(b"x" * size)
    os.utime(p, (mtime_s, mtime_s))
    return p


def test_eviction_keeps_the_cache_under_its_cap_least_recently_used_first(tmp_path: Path, cdir: Path, capsys,
                                                                          monkeypatch) -> None:
    src = tmp_path / "t.jsonl.gz"
    shutil.copy(SAMPLE, src)
    cdir.mkdir()
    now = time.time()
    old, mid, new = (_fake_pack(cdir, n, 400_000, now - age) for n, age in (("old", 300), ("mid", 200), ("new", 100)))
    stale_tmp = cdir / "x.123.tmp"
    stale_tmp.write_bytes(b"partial")
    os.utime(stale_tmp, (now - 2 * cache.STALE_TMP_S, now - 2 * cache.STALE_TMP_S))
    fresh_tmp = cdir / "y.456.tmp"  # another run writing now
    fresh_tmp.write_bytes(b"partial")
    monkeypatch.setenv(cache.ENV_MAX_BYTES, str(2_000_000))
    assert _sim(src, tmp_path / "a", capsys)[:2] == (0, "miss")
    (written,) = [p for p in _packs(cdir) if p not in (old, mid, new)]
    size = written.stat().st_size
    assert size > 1_000_000  # so that the three fakes do not all fit beside it
    left = _packs(cdir)
    assert sum(p.stat().st_size for p in left) <= 2_000_000
    assert written in left and new in left and old not in left  # oldest first; never the one just written
    assert not stale_tmp.exists() and fresh_tmp.exists()
    # a pack larger than the cap is not kept, and evicts nothing
    monkeypatch.setenv(cache.ENV_MAX_BYTES, str(size - 1))
    written.unlink()
    before = _packs(cdir)
    rc, state, err = _sim(src, tmp_path / "b", capsys)
    assert (rc, state) == (0, "miss") and "larger than the cache's cap" in err
    assert _packs(cdir) == before and sorted(cdir.glob("*.tmp")) == [fresh_tmp]


def test_evict_removes_oldest_first_down_to_the_cap_and_skips_what_is_gone(tmp_path: Path) -> None:
    now = time.time()
    packs = [_fake_pack(tmp_path, f"p{i}", 100, now - 100 + i) for i in range(5)]  # p0 oldest
    (tmp_path / "other.txt").write_bytes(b"y" * 10_000)  # not a pack: neither counted nor removed
    assert cache.evict(tmp_path, 10_000) == []
    assert cache.evict(tmp_path, 250, keep=packs[0]) == packs[1:4]
    assert _packs(tmp_path) == [packs[0], packs[4]] and (tmp_path / "other.txt").exists()
    assert cache.evict(tmp_path, 0) == [packs[0], packs[4]]
    assert cache.evict(tmp_path / "absent", 0) == []


def test_what_the_cache_does_not_keep(tmp_path: Path, cdir: Path) -> None:
    src = tmp_path / "t.jsonl.gz"
    shutil.copy(SAMPLE, src)
    packed = tmp_path / "t.eipack"
    assert main(["trace", "pack", str(src), str(packed)]) == 0
    assert cache.lookup(packed) is None  # a pack is read as is
    assert cache.lookup(tmp_path / "absent.jsonl") is None  # the read says why
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(cache.lookup(fifo)), daemon=True)
    t.start()
    t.join(5)
    assert done == [None]  # not opened (that would wait for a writer): read once, as before
    got = cache.lookup(src)
    assert got is not None and got.pack.parent == cdir and not got.present and len(got.pack.stem) == 32
    assert not cdir.exists()  # a look-up writes nothing


def test_the_key_follows_the_file_and_the_readers_code(tmp_path: Path, cdir: Path, monkeypatch) -> None:
    src = tmp_path / "t.jsonl.gz"
    shutil.copy(SAMPLE, src)
    first = cache.lookup(src).pack
    assert cache.lookup(Path(os.path.relpath(src))).pack == first  # the resolved path
    moved = tmp_path / "u.jsonl.gz"
    shutil.copy(src, moved)
    assert cache.lookup(moved).pack != first
    monkeypatch.setattr(cache, "_reader_stamp", b"another release")
    assert cache.lookup(src).pack != first
    monkeypatch.setattr(cache, "_reader_stamp", None)  # computed again: this code's
    assert cache.lookup(src).pack == first


def test_where_and_how_big(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv(cache.ENV_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "evolving-infra" / "traces"
    monkeypatch.setenv(cache.ENV_DIR, "")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "evolving-infra" / "traces"
    monkeypatch.setenv(cache.ENV_DIR, "OFF")
    assert cache.cache_dir() is None
    monkeypatch.delenv(cache.ENV_MAX_BYTES, raising=False)
    assert cache.max_bytes() == cache.DEFAULT_MAX_BYTES == 4 << 30
    monkeypatch.setenv(cache.ENV_MAX_BYTES, "0")
    assert cache.max_bytes() == 0
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "c"))
    for bad in ("4G", "-1", "1.5"):
        monkeypatch.setenv(cache.ENV_MAX_BYTES, bad)
        with pytest.raises(cache.TraceCacheError, match="not a number of bytes"):
            cache.max_bytes()
        assert main(["simulate", "--trace", str(SAMPLE), "--out", str(tmp_path / "o"), *SIM]) == 2
        assert f"error: {cache.ENV_MAX_BYTES}={bad!r} is not a number of bytes" in capsys.readouterr().err
        assert not (tmp_path / "o").exists()
