"""Converters keep going past a file they cannot read, and what they write always validates
(issue 22, part 8): skip + name + count (``--strict`` stops), background sub-agents of the WEKA
Claude Code format, mini-swe-agent task ids repeated across run folders."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evolving_infra.traces.convert import ConvertError, convert_inputs, convert_to_file
from evolving_infra.traces.io import read_trace, validate_requests
from tests.conftest import shared_traces_or_skip


def _weka(tmp_path: Path, names=("trace_0001", "trace_0003")) -> list[Path]:
    folder = shared_traces_or_skip("claude-code-weka")
    out = []
    for n in names:
        dst = tmp_path / f"{n}.json.gz"
        shutil.copy(folder / f"{n}.json.gz", dst)
        out.append(dst)
    return out


def test_unreadable_claude_code_file_is_named_skipped_and_counted(tmp_path, capsys):
    good = _weka(tmp_path)
    (tmp_path / "trace_9998.json.gz").write_bytes(b"\x1f\x8bnot gzip at all")
    (tmp_path / "trace_9999.json").write_text('{"id": "x", "requests": "not a list"}')
    t = convert_inputs("claude-code-weka", [tmp_path])
    err = capsys.readouterr().err
    assert "skipped" in err and "trace_9998.json.gz" in err and "trace_9999.json" in err
    sk = t.header.meta["skipped"]
    assert sk["count"] == 2 and {Path(f["file"]).name for f in sk["files"]} == {"trace_9998.json.gz", "trace_9999.json"}
    assert all(f["reason"] for f in sk["files"])
    assert len({r.agent for r in t.requests}) == len(good)
    assert validate_requests(t.header, t.requests) == []
    with pytest.raises(ConvertError, match="trace_9998"):
        convert_inputs("claude-code-weka", [tmp_path], strict=True)


def test_cli_convert_reports_skips_and_strict_stops(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    _weka(src, ("trace_0001",))
    (src / "trace_9999.json").write_text("{ truncated")
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "evolving_infra.cli", "trace", "convert", "--from", "claude-code-weka", str(src), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "skipped 1 file" in r.stderr and "trace_9999.json" in r.stderr
    v = subprocess.run([sys.executable, "-m", "evolving_infra.cli", "trace", "validate", str(out)], capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr
    r = subprocess.run(cmd + ["--strict"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "trace_9999.json" in r.stderr


def test_background_subagent_with_unknown_duration_converts_without_a_join(tmp_path):
    folder = shared_traces_or_skip("claude-code-weka")
    d = json.load(gzip.open(folder / "trace_0003.json.gz"))
    markers = [i for i, r in enumerate(d["requests"]) if r.get("type") == "subagent"]
    assert markers
    m = d["requests"][markers[0]]
    # as recorded for a sub-agent launched in the background: nothing known about its end yet
    m.update(duration_ms=None, total_tokens=None, tool_use_count=None, status="async_launched")
    path = tmp_path / "trace_0003.json"
    path.write_text(json.dumps(d))
    t = convert_inputs("claude-code-weka", [path], strict=True)
    assert t.header.meta["counts"]["subagents_background"] == 1
    assert validate_requests(t.header, t.requests) == []
    sub_name = m["agent_id"]
    sub = [r for r in t.requests if f":{sub_name}" in r.id]
    assert sub, "the background sub-agent's requests are converted"
    last_sub = max(sub, key=lambda r: r.t_s).id
    assert not any(last_sub in r.after for r in t.requests if r.kind != "subagent" and ":main" in r.branch)  # nobody waits for it
    # launched at the marker's t: its first request is not earlier than the marker
    assert min(r.t_s for r in sub) >= float(m["t"]) - 1e-6
    # one launched so late that nothing of it was recorded: requests null, counted, not an error
    if len(markers) > 1:
        d["requests"][markers[1]].update(duration_ms=None, requests=None, status="async_launched")
    else:
        d["requests"].append({"t": 1.0, "type": "subagent", "agent_id": "late", "duration_ms": None, "requests": None})
    path.write_text(json.dumps(d))
    t = convert_inputs("claude-code-weka", [path], strict=True)
    assert t.header.meta["counts"]["subagents_without_requests"] == 1
    assert validate_requests(t.header, t.requests) == []


def test_mini_swe_agent_repeated_task_ids_get_unique_ids(tmp_path):
    folder = shared_traces_or_skip("mini-swe-agent")
    files = sorted(folder.rglob("*.traj.json.gz"))[:2]
    for run in ("run1", "run2"):  # two runs of the same tasks, as a folder of runs holds them
        (tmp_path / run).mkdir()
        for f in files:
            shutil.copy(f, tmp_path / run / f.name)
    out = tmp_path / "out.jsonl"
    header, n = convert_to_file("mini-swe-agent", [tmp_path], out)
    t = read_trace(out)
    assert validate_requests(t.header, t.requests) == []
    assert len({r.agent for r in t.requests}) == 4
    assert header.meta["counts"]["agents_renamed_duplicate_task_id"] == 2
    assert sorted(a for a in {r.agent for r in t.requests} if "#" in a) == sorted(a + "#2" for a in {r.agent for r in t.requests} if "#" not in a)


def test_the_conversion_spool_has_no_name(tmp_path, monkeypatch):
    """``write_conversion`` spools the requests before the header: the spool has no name in the
    output's folder nor (``-o -``) in $TMPDIR while it is written, so a conversion ended by
    SIGTERM or SIGKILL leaves no copy of the trace behind; the bytes are as before."""
    import io
    import os
    import tempfile

    from evolving_infra.traces.convert import convert
    from evolving_infra.traces.convert.common import Conversion, write_conversion

    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2 + i]}) + "\n"
                          for i in range(3)))
    out_dir, tmpd = tmp_path / "out", tmp_path / "tmp"
    out_dir.mkdir()
    tmpd.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpd))
    seen: list[list[str]] = []

    def spied() -> Conversion:
        real = convert("mooncake", [mc])

        def requests():  # type: ignore[no-untyped-def]
            for i, r in enumerate(real.requests()):
                if i == 2:  # two requests spooled
                    seen.append(sorted(set(os.listdir(out_dir)) - {"o.jsonl"}) + sorted(os.listdir(tmpd)))
                yield r

        return Conversion(requests(), lambda: real.header)

    write_conversion(spied(), out_dir / "o.jsonl")
    buf = io.BytesIO()
    write_conversion(spied(), buf)
    assert seen == [[], []]
    assert sorted(os.listdir(out_dir)) == ["o.jsonl"] and os.listdir(tmpd) == []
    assert buf.getvalue() == (out_dir / "o.jsonl").read_bytes()
    convert_to_file("mooncake", [mc], tmp_path / "ref.jsonl")
    assert buf.getvalue() == (tmp_path / "ref.jsonl").read_bytes()


def test_a_skipped_file_is_named_once(tmp_path, capsys):
    """``warning: skipped F: F: not a WEKA Claude Code trace: ...`` named the file twice (the ConvertError
    names it for --strict's one line); the warning and meta.skipped's reason now name it once."""
    from evolving_infra.traces.convert.common import Skipped

    bad = tmp_path / "trace_9999.json"

    def fail() -> None:
        raise ConvertError(f"{bad}: not a WEKA Claude Code trace: Input data was truncated")

    sk = Skipped()
    assert sk.call(bad, fail) is None
    err = capsys.readouterr().err
    assert err == f"warning: skipped {bad}: not a WEKA Claude Code trace: Input data was truncated\n", err
    assert sk.files == [{"file": str(bad), "reason": "not a WEKA Claude Code trace: Input data was truncated"}]
    with pytest.raises(ConvertError, match="trace_9999.json: not a WEKA"):
        Skipped(strict=True).call(bad, fail)


def test_convert_progress_is_whole_lines_when_stderr_is_not_a_terminal(capsys):
    """``trace convert`` of the 530 WEKA files (34 s on 2 busy cores) printed nothing into a log or a pipe:
    its bar was on only on a terminal. It now writes a whole line every few seconds there, as ``simulate``."""
    from evolving_infra.traces.convert.common import progress_iter

    items = list(range(4))
    assert list(progress_iter(items, enabled=True, desc="claude-code-weka", every_s=0.0)) == items
    err = capsys.readouterr().err  # capsys's stderr is no terminal
    assert err.splitlines()[0].startswith("claude-code-weka: 0 of 4 files, ") and "\r" not in err, err
    assert len(err.splitlines()) == 4
    assert progress_iter(items, enabled=False, desc="x") is items


@pytest.mark.parametrize("kind,name", [("mooncake", "m.jsonl.gz"), ("azure", "a.csv.gz"), ("openai-chat", "o.jsonl.gz"),
                                       ("claude-code-weka", "trace_1.json.gz"), ("mini-swe-agent", "x.traj.json.gz")])
def test_a_corrupt_gzip_stream_is_a_named_skip_not_a_traceback(tmp_path, kind, name):
    """A .gz whose deflate stream is damaged raises ``zlib.error``, which is no ``BadGzipFile``: every converter let
    it out as a traceback (``error: Error -3 while decompressing data``) instead of skipping and naming the file."""
    raw = bytearray(gzip.compress(b'{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n' * 2000))
    raw[30:60] = b"\xff" * 30  # inside the deflate stream: the header still reads as gzip
    bad = tmp_path / name
    bad.write_bytes(bytes(raw))
    with pytest.raises(ConvertError, match=rf"{name}: cannot read: .*decompressing data"):
        convert_inputs(kind, [bad])
