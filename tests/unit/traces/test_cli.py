"""`evolving-infra trace ...`: the interface used by the checks (convert, stats --json, validate, generate)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from evolving_infra.cli import main as top_main
from evolving_infra.traces.cli import main
from tests.conftest import shared_traces_or_skip

REQUIRED_KEYS = ("requests", "sessions", "subagent_branches", "compactions", "input_tokens_total", "output_tokens_total", "ideal_kv_hit_rate")


def test_convert_stats_validate_claude_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = shared_traces_or_skip("claude-code-weka")
    out = tmp_path / "cc.jsonl"
    inputs = [str(folder / "trace_0003.json.gz"), str(folder / "trace_0010.json.gz")]
    assert top_main(["trace", "convert", "--from", "claude-code-weka", *inputs, "-o", str(out), "--no-progress"]) == 0
    assert top_main(["trace", "validate", str(out)]) == 0
    capsys.readouterr()
    assert top_main(["trace", "stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    for k in REQUIRED_KEYS:
        assert k in stats
    assert stats["sessions"] == 2 and stats["subagent_branches"] == 6
    assert main(["stats", str(out)]) == 0
    table = capsys.readouterr().out
    assert "ideal KV hit rate h*" in table and "requests" in table


def test_validate_reports_line_numbers_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"format": "evolving-infra-trace", "block_size": 4}\n'
        '{"id": "a", "agent": "x", "branch": "x:m", "input_tokens": 4, "output_tokens": 1, "blocks": [1], "kind": "main"}\n'
        "not json\n"
        '{"id": "b", "agent": "x", "branch": "x:m", "input_tokens": -1, "output_tokens": 1, "after": ["a"]}\n'
        '{"id": "c", "agent": "x", "branch": "x:s", "input_tokens": 4, "output_tokens": 1, "blocks": [2], "kind": "subagent", '
        '"parent_branch": "x:none", "after": ["a"], "ends_branch": true}\n'
        '{"id": "d", "agent": "x", "branch": "x:m", "input_tokens": 4, "output_tokens": 1, "blocks": [1], "after": ["a"], "ends_branch": true}\n'
    )
    assert main(["validate", str(bad)]) == 2  # a malformed trace is an unreadable input (README): as stats says
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1] for line in out] == ["3", "4", "5"]
    assert "invalid JSON" in out[0] and "input_tokens" in out[1] and "x:none" in out[2]
    assert main(["stats", str(bad)]) == 2  # stats refuses a malformed trace, listing the lines
    assert "line 3:" in capsys.readouterr().err


def test_generate_and_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = tmp_path / "p.jsonl.gz"
    assert main(["generate", "putnam", "--seed", "2", "--agents", "12", "-o", str(g), "--check"]) == 0
    assert "pause_s.mean" in capsys.readouterr().out
    s = tmp_path / "s.jsonl"
    assert main(["sample", str(g), "-o", str(s), "--sessions", "5", "--max-requests-per-branch", "3"]) == 0
    assert main(["validate", "-q", str(s)]) == 0
    capsys.readouterr()
    assert main(["stats", str(s), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["sessions"] == 5 and st["requests"] <= 15


def test_convert_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "--from", "azure", str(tmp_path / "missing.csv"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["convert", "--from", "azure", str(tmp_path), "-o", str(tmp_path / "o.jsonl"), "--infer-sessions"]) == 2


def test_validate_reports_unchained_block_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    head = '{"format": "evolving-infra-trace", "block_size": 4}\n'

    def req(rid: str, blocks: list[int], first: bool = False) -> str:
        kind = ', "kind": "main"' if first else ""
        end = ', "ends_branch": true' if rid == "c" else ""
        after = "" if first else f', "after": ["{chr(ord(rid) - 1)}"]'
        return (f'{{"id": "{rid}", "agent": "x", "branch": "x:m", "input_tokens": {4 * len(blocks)}, "output_tokens": 1, '
                f'"blocks": {blocks}{kind}{after}{end}}}\n')

    good = tmp_path / "good.jsonl"
    good.write_text(head + req("a", [1, 2], True) + req("b", [1, 2, 3]) + req("c", [1, 4]))
    assert main(["validate", str(good)]) == 0
    bad = tmp_path / "bad.jsonl"  # id 2 follows id 1 on line 2, then starts the path on line 4
    bad.write_text(head + req("a", [1, 2], True) + req("b", [1, 2, 3]) + req("c", [2, 5]))
    assert main(["validate", str(bad)]) == 2
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].startswith(f"{bad}:4: block 0 (id 2) follows the path's start here but id 1 earlier")


def test_chain_problems_are_summarised_past_the_limit() -> None:
    from evolving_infra.traces.io import CHAIN_REPORT_LIMIT, iter_chain_problems
    from evolving_infra.traces.schema import TraceRequest

    reqs = [TraceRequest(id="r0", agent="x", branch="x:m", input_tokens=8, output_tokens=1, blocks=[1, 2], kind="main")]
    reqs += [TraceRequest(id=f"r{k}", agent="x", branch="x:m", input_tokens=8, output_tokens=1, blocks=[100 + k, 2]) for k in range(1, 26)]
    probs = list(iter_chain_problems(reqs))
    assert [p.line for p in probs[:CHAIN_REPORT_LIMIT]] == list(range(3, 3 + CHAIN_REPORT_LIMIT))
    assert len(probs) == CHAIN_REPORT_LIMIT + 1 and probs[-1].line == 27 and probs[-1].reason.startswith("25 requests in all")


def test_outputs_that_cannot_be_written_are_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``trace sample/pack/generate/convert -o`` and ``simulate --out`` check their output first:
    a path under a file, a folder where a file is asked, or the input itself is one error line
    with exit status 2 (no traceback), and the input is left as it was."""
    src = tmp_path / "t.jsonl"
    assert main(["generate", "claude-code", "--agents", "2", "--seed", "1", "-o", str(src)]) == 0
    before = src.read_bytes()
    capsys.readouterr()
    blocker = tmp_path / "file"
    blocker.write_text("")
    cases = [
        (["trace", "sample", str(src), "-o", str(blocker / "o.jsonl")], "cannot write"),
        (["trace", "sample", str(src), "-o", str(tmp_path)], "is a folder"),
        (["trace", "sample", str(src), "-o", str(src)], "is also the input"),
        (["trace", "pack", str(src), str(src)], "is also the input"),
        (["trace", "generate", "claude-code", "--agents", "1", "-o", str(blocker / "g.jsonl")], "cannot write"),
        (["simulate", "--trace", str(src), "--duration", "5", "--no-plots", "--out", str(blocker / "run")], "cannot write"),
    ]
    for argv, why in cases:
        assert top_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and why in err and "Traceback" not in err, (argv, err)
    assert src.read_bytes() == before


def test_stats_names_and_skips_a_bad_file_of_several(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``trace stats good bad good2``: the bad file's line is named on stderr, the two good files are
    still reported, exit 2. Before, the first bad file ended the command with no stats at all."""
    good = tmp_path / "good.jsonl"
    assert main(["generate", "claude-code", "--agents", "2", "--seed", "1", "-o", str(good)]) == 0
    lines = good.read_text().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:2]) + "{bad json\n" + "".join(lines[2:]))
    capsys.readouterr()
    assert top_main(["trace", "stats", "--json", str(good), str(bad), str(tmp_path / "missing.jsonl"), str(good)]) == 2
    cap = capsys.readouterr()
    assert list(json.loads(cap.out)) == [str(good)]
    assert "line 3: invalid JSON" in cap.err and "missing.jsonl: cannot read" in cap.err and "Traceback" not in cap.err, cap.err


def test_stats_shows_progress_like_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``trace stats`` of a large trace printed nothing for ~17 s; it now shows progress as ``trace convert``
    does (88a437e): whole lines every few seconds when stderr is no terminal, a redrawn bar on one, none with
    ``--no-progress``. The lines come every 0 s here (``PROGRESS_EVERY_S``)."""
    import io

    from evolving_infra.traces.convert import common

    good = tmp_path / "good.jsonl"
    assert main(["generate", "claude-code", "--agents", "2", "--seed", "1", "-o", str(good)]) == 0
    n = sum(1 for _ in good.open()) - 1
    capsys.readouterr()
    monkeypatch.setattr(common, "PROGRESS_EVERY_S", 0.0, raising=False)  # (not there before: no progress at all)
    assert top_main(["trace", "stats", str(good), "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["requests"] == n
    lines = cap.err.splitlines()
    assert len(lines) == n and lines[0].startswith(f"{good}: 0 requests, ") and "\r" not in cap.err, cap.err
    assert top_main(["trace", "stats", str(good), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    assert list(common.progress_iter(iter(range(3)), enabled=True, desc="t.jsonl", unit="request", stream=out)) == [0, 1, 2]
    assert "\r" in out.getvalue() and "t.jsonl: " in out.getvalue() and "request" in out.getvalue(), out.getvalue()


def test_sample_negative_counts_are_one_line_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``trace sample --sessions -1`` / ``--max-requests-per-branch -2``: exit 2 with one ``error:`` line and
    no output file (was sample_sessions' ValueError traceback, exit 1)."""
    src = tmp_path / "t.jsonl"
    assert main(["generate", "claude-code", "--agents", "2", "--seed", "1", "-o", str(src)]) == 0
    capsys.readouterr()
    for flag, value in (("--sessions", "-1"), ("--max-requests-per-branch", "-2")):
        out = tmp_path / "o.jsonl"
        assert top_main(["trace", "sample", str(src), "-o", str(out), flag, value]) == 2
        err = capsys.readouterr().err
        assert err == f"error: {flag} must be >= 0 (0 = no limit), not {value}\n", err
        assert not out.exists()


def test_convert_refuses_an_output_under_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = shared_traces_or_skip("claude-code-weka")
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "cc.jsonl"
    assert top_main(["trace", "convert", "--from", "claude-code-weka", str(folder / "trace_0003.json.gz"), "-o", str(out), "--no-progress"]) == 2
    assert f"error: {out}: cannot write" in capsys.readouterr().err


def test_convert_refuses_an_output_that_is_a_file_of_an_input_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``trace convert --from mooncake DIR -o DIR/a.jsonl``: DIR/a.jsonl is one of the files the
    conversion reads (the folder's ``*.jsonl``), so writing it would replace that input too."""
    folder = tmp_path / "mc"
    folder.mkdir()
    src = folder / "a.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}\n')
    before = src.read_bytes()
    assert top_main(["trace", "convert", "--from", "mooncake", str(folder), "-o", str(src), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {src}: is also the input") and src.read_bytes() == before, err
    out = folder / "out.jsonl.gz"  # a new file in the input folder (not one it reads) is fine
    assert top_main(["trace", "convert", "--from", "mooncake", str(folder), "-o", str(out), "--no-progress"]) == 0
    assert src.read_bytes() == before


def test_an_output_that_is_a_device_or_pipe_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The writers write ``OUT.tmp`` and rename it over ``OUT``: ``-o /dev/null`` (or
    ``/dev/stdout``) run as root replaced the device node with a regular file. A FIFO stands in
    for the device here (the same rename would replace it)."""
    import os
    import stat

    src = tmp_path / "t.jsonl"
    assert main(["generate", "claude-code", "--agents", "2", "--seed", "1", "-o", str(src)]) == 0
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    capsys.readouterr()
    for argv in (["trace", "sample", str(src), "-o", str(fifo)], ["trace", "pack", str(src), str(fifo)],
                 ["trace", "generate", "claude-code", "--agents", "1", "-o", str(fifo)]):  # fmt: skip
        assert top_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"error: {fifo}: is not a regular file"), (argv, err)
        assert stat.S_ISFIFO(fifo.stat().st_mode), argv


def test_a_command_that_fails_leaves_no_output_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The output's folders are checked before the work and created only to write it: a missing
    input, or a conversion stopped by ``--strict`` after its first rows, leaves nothing new."""
    mc = tmp_path / "mc.jsonl"
    mc.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}\nnot json\n')
    made = tmp_path / "made"
    made.mkdir()
    cases = [
        ["trace", "sample", str(tmp_path / "missing.jsonl"), "-o", str(made / "a" / "b" / "o.jsonl")],
        ["trace", "pack", str(tmp_path / "missing.jsonl"), str(made / "a" / "o.eipack")],
        ["trace", "convert", "--from", "mooncake", str(mc), "-o", str(made / "a" / "b" / "o.jsonl.gz"), "--strict", "--no-progress"],
        ["trace", "generate", "claude-code", "--duration", "5", "--requests-per-agent", "2", "-o", str(made / "a" / "g.jsonl")],
    ]
    for argv in cases:
        assert top_main(argv) == 2, argv
        assert "Traceback" not in capsys.readouterr().err
        assert list(made.iterdir()) == [], argv


def _cli(args: list[str], cwd: Path, stdin: bytes = b"") -> bytes:
    """``evolving-infra ARGS`` in a fresh process (real stdin and stdout); its stdout."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "evolving_infra.cli", *args], input=stdin, capture_output=True, cwd=cwd, env=env)
    assert done.returncode == 0, (args, done.stderr.decode())
    return done.stdout


def test_dash_reads_a_trace_from_stdin_and_writes_one_to_stdout(tmp_path: Path) -> None:
    """``-`` as a trace to read is stdin (plain or gzip), as a trace to write stdout (uncompressed,
    the status line on stderr): the bytes are those of the same command with files, and no file
    named ``-`` appears."""
    import gzip

    src = tmp_path / "t.jsonl"
    assert main(["generate", "claude-code", "--agents", "3", "--seed", "2", "-o", str(src)]) == 0
    trace = src.read_bytes()
    assert _cli(["trace", "generate", "claude-code", "--agents", "3", "--seed", "2", "-o", "-"], tmp_path) == trace
    assert _cli(["trace", "validate", "-"], tmp_path, gzip.compress(trace)) == b"-: ok\n"
    assert json.loads(_cli(["trace", "stats", "-", "--json"], tmp_path, trace)) == json.loads(
        _cli(["trace", "stats", str(src), "--json"], tmp_path))
    assert main(["sample", str(src), "--sessions", "2", "-o", str(tmp_path / "s.jsonl")]) == 0
    sampled = _cli(["trace", "sample", "-", "--sessions", "2", "-o", "-"], tmp_path, trace)
    assert sampled == (tmp_path / "s.jsonl").read_bytes()
    assert main(["pack", str(tmp_path / "s.jsonl"), str(tmp_path / "s.eipack")]) == 0
    assert _cli(["trace", "pack", "-", "-"], tmp_path, sampled) == (tmp_path / "s.eipack").read_bytes()
    mc = tmp_path / "mc.jsonl"
    mc.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}\n')
    _cli(["trace", "convert", "--from", "mooncake", "mc.jsonl", "-o", "c.jsonl", "--no-progress"], tmp_path)
    assert _cli(["trace", "convert", "--from", "mooncake", "mc.jsonl", "-o", "-", "--no-progress"], tmp_path) == (
        tmp_path / "c.jsonl").read_bytes()
    assert not (tmp_path / "-").exists()


def test_dash_is_a_usage_error_where_a_folder_or_a_raw_input_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output folder, a run folder or a raw ``convert`` input cannot be a stream: ``-`` there
    exits with status 2 and one line naming the command (and its --help), and no folder or file named ``-`` is made."""
    monkeypatch.chdir(tmp_path)
    cases = [
        ["simulate", "--workload", "putnam", "--out", "-"],
        ["report", "compare", "a", "b", "--out", "-"],
        ["report", "show", "-"],
        ["replay", "t.jsonl", "--out", "-"],
        ["demo", "--out", "-"],
        ["up", "--log-dir", "-"],
        ["fidelity", "--out", "-"],
        ["auth", "gen", "--dir", "-", "--nodes", "w0"],
        ["model", "init", "-"],
        ["trace", "convert", "--from", "mooncake", "-", "-o", "o.jsonl"],
    ]
    for argv in cases:
        with pytest.raises(SystemExit) as ei:
            top_main(argv)
        err = capsys.readouterr().err
        cmd = " ".join(argv[:2] if argv[0] in ("report", "auth", "model", "trace") else argv[:1])
        assert ei.value.code == 2 and err.startswith(f"evolving-infra {cmd}: error: ") and "'-' (stdin" in err, (argv, err)
        assert err.endswith(f" (see 'evolving-infra {cmd} --help')\n") and err.count("\n") == 1, (argv, err)
    assert list(tmp_path.iterdir()) == []


def _proc(args: list[str], cwd: Path, **popen: object):  # type: ignore[no-untyped-def]
    """``evolving-infra ARGS`` started in a fresh process (``popen``: its stdin, stdout, env...)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root), **popen.pop("env", {})}  # type: ignore[dict-item]
    return subprocess.Popen([sys.executable, "-m", "evolving_infra.cli", *args], cwd=cwd, env=env, **popen)  # type: ignore[call-overload]


def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path: Path) -> None:
    """``... -o - | head -1`` or ``trace stats ... | head -1``: the reader closes the pipe; the
    command stops without a message or a traceback, with status 141 (128 + SIGPIPE, what a
    shell shows for ``cat`` ended by the same reader)."""
    import subprocess

    src = tmp_path / "t.jsonl"
    assert main(["generate", "claude-code", "--agents", "3", "--seed", "2", "-o", str(src)]) == 0
    for args in (["trace", "generate", "claude-code", "--agents", "3", "-o", "-"], ["trace", "sample", str(src), "-o", "-"],
                 ["trace", "pack", str(src), "-"], ["trace", "stats", str(src)]):
        p = _proc(args, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.close()  # the reader is gone before the first byte
        err = p.stderr.read().decode()
        assert p.wait(timeout=60) == 141, (args, err)
        assert "rror" not in err and "Traceback" not in err, (args, err)


def test_pack_to_a_reader_that_stops_midway_is_not_reported_written(tmp_path: Path) -> None:
    """``trace pack IN - | head -c 10``: the reader takes the first bytes of a pack larger than a pipe
    (the shipped 1.2 MB sample) and goes; pack stops quietly with status 141. Before, the buffered
    stream's one large write returned the 64 KiB the pipe took without raising: pack printed
    '1,203,985 bytes' and exited 0 with most of the pack never written."""
    import os
    import subprocess

    sample = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"
    p = _proc(["trace", "pack", str(sample), "-"], tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(os.read(p.stdout.fileno(), 10)) == 10  # the writer is inside its write now
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert "bytes" not in err and "Traceback" not in err, err


def test_dash_refuses_a_stdin_that_is_a_terminal_or_closed(tmp_path: Path) -> None:
    """``trace stats -`` typed at a terminal would wait for a trace nobody types: it says so and
    exits with status 2 at once; a closed stdin is named, not a traceback."""
    import os
    import pty
    import subprocess

    master, slave = pty.openpty()
    try:
        p = _proc(["trace", "stats", "-"], tmp_path, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            pytest.fail("trace stats - waits on a terminal")
    finally:
        os.close(master)
        os.close(slave)
    assert p.returncode == 2 and err.decode().startswith("-: cannot read: stdin is a terminal"), err
    p = _proc(["trace", "validate", "-"], tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              preexec_fn=lambda: os.close(0))
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and err.decode().startswith("-: cannot read: stdin is closed") and b"Traceback" not in err, err


def test_the_copy_of_stdin_is_gone_however_the_command_ends(tmp_path: Path) -> None:
    """``-`` is read into a temporary file: nothing of it stays in $TMPDIR, not even when the
    command is ended by SIGTERM (``timeout``, a job scheduler) while it reads."""
    import os
    import signal
    import subprocess

    src = tmp_path / "t.jsonl"
    assert main(["generate", "claude-code", "--agents", "3", "--seed", "2", "-o", str(src)]) == 0
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = _proc(["trace", "stats", "-"], tmp_path, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
              env={"TMPDIR": str(tmp)})
    data = src.read_bytes()
    p.stdin.write(data * (1 + (1 << 18) // len(data)))  # more than a pipe holds: returns once the command reads
    p.stdin.flush()
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    p.stdin.close()
    assert p.returncode == -signal.SIGTERM and list(tmp.iterdir()) == []
    p = _proc(["trace", "stats", "-"], tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              env={"TMPDIR": str(tmp)})
    out, err = p.communicate(b"not a trace\n", timeout=60)
    assert p.returncode == 2 and err.decode().startswith("-: 1 problem(s)") and list(tmp.iterdir()) == [], err
    assert not os.listdir(tmp)


def test_demo_and_fidelity_name_a_bad_trace_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``demo/fidelity --trace -`` with a stdin that is no trace: one ``error: --trace: -: ...``
    line and status 2 (not a traceback naming the temporary copy), nothing started or written;
    a good one is recorded as ``-`` (fidelity.json's ``trace``), not as the copy's name."""
    import gzip
    import io
    import sys

    from evolving_infra.sim.fidelity import FidelitySettings, load_requests

    monkeypatch.chdir(tmp_path)
    for argv in (["demo", "--trace", "-", "--out", "d"], ["fidelity", "--trace", "-", "--out", "f"]):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"not a trace\n")))
        assert top_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: --trace: -: 1 problem(s)") and "Traceback" not in err, (argv, err)
    for argv in (["demo", "--trace", "missing.jsonl", "--out", "d"], ["fidelity", "--trace", "missing.jsonl", "--out", "f"],
                 ["simulate", "--trace", "missing.jsonl", "--out", "s"]):  # simulate said "--trace: [Errno 2] No such file ..."
        assert top_main(argv) == 2, argv
        assert capsys.readouterr().err.startswith("error: --trace: missing.jsonl: cannot read: "), argv
    assert list(tmp_path.iterdir()) == []
    src = tmp_path / "t.jsonl"
    assert main(["generate", "claude-code", "--agents", "2", "--seed", "2", "-o", str(src)]) == 0
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(gzip.compress(src.read_bytes()))))
    reqs, bs, name = load_requests(FidelitySettings(trace="-", sessions=2))
    assert name == "-" and len(reqs) > 0 and bs == 64


def test_dash_output_with_stdout_closed_is_named_before_the_work(tmp_path: Path) -> None:
    """``-o -`` run with stdout closed (``>&-``): ``error: -: cannot write: stdout is closed`` and
    status 2 before anything is read or generated, not an AttributeError traceback."""
    import os
    import subprocess

    src = tmp_path / "t.jsonl"
    assert main(["generate", "claude-code", "--agents", "2", "--seed", "2", "-o", str(src)]) == 0
    for args in (["trace", "generate", "claude-code", "--agents", "2", "-o", "-"], ["trace", "sample", str(src), "-o", "-"],
                 ["trace", "pack", str(src), "-"]):
        p = _proc(args, tmp_path, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1))
        _, err = p.communicate(timeout=60)
        assert p.returncode == 2 and err.decode().startswith("error: -: cannot write: stdout is closed"), (args, err)


def test_validate_and_stats_agree_on_the_exit_status_of_one_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A packed trace (which only simulate reads) and a malformed one: validate and stats both exit 2, an unreadable
    input by the README's rule (validate said 1 for the same file stats said 2 for)."""
    src = tmp_path / "p.jsonl"
    assert main(["generate", "putnam", "--seed", "2", "--agents", "3", "-o", str(src)]) == 0
    packed = tmp_path / "p.eipack"
    assert main(["pack", str(src), str(packed)]) == 0
    junk = tmp_path / "junk.jsonl"
    junk.write_text("junk\n")
    for path in (packed, junk):
        assert main(["validate", str(path)]) == main(["stats", str(path)]) == 2, path
    capsys.readouterr()


def test_a_file_that_is_no_trace_is_named_in_a_few_lines_not_one_per_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``simulate --trace README.md`` printed one 'line N: invalid JSON' for each of the file's 635
    lines as its error; the message now lists the first 20 problems and says how many more there
    are, and ``trace validate`` still lists every one (on stdout). (A file whose line 1 is no
    header stops there since: the lines here follow a valid header.)"""
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "notes.md"
    header = json.dumps({"format": "evolving-infra-trace", "version": 1, "block_size": 16})
    notes.write_text(header + "\n" + "".join(f"- note {i}: not JSON\n" for i in range(100)))
    for argv in (["simulate", "--trace", "notes.md", "--out", "o"], ["demo", "--trace", "notes.md", "--out", "d"]):
        assert top_main(argv) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert "notes.md: 100 problem(s)" in err[0] and err[1].startswith("line 2: invalid JSON"), (argv, err)
        assert len(err) == 22 and err[-1] == "... 80 more not shown (evolving-infra trace validate lists every one)", err
    assert main(["validate", "notes.md"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 100 and out[-1].startswith("notes.md:101: "), out[-3:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md"]


@pytest.mark.parametrize("gz", [False, True])
def test_a_file_that_is_no_trace_at_all_is_read_no_further_than_its_line_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], gz: bool
) -> None:
    """A file whose line 1 is neither a header nor a request (binary, text, other JSON) was read
    whole by simulate, demo, fidelity and replay before they failed: an 18 MB binary file given to
    ``simulate --trace`` took 1.4 s and ~60 MB, and its error counted 70,362 problems, while
    ``trace stats`` stopped at line 1. They stop there too now: one problem, the rest unread;
    ``trace validate`` still reports every line."""
    from evolving_infra.traces.compact import read_trace_compact
    from evolving_infra.traces.io import TraceError, read_trace

    monkeypatch.chdir(tmp_path)
    data = b"\x00\x01 not a trace\n" + bytes(range(256)) * 1024  # a newline every 256 bytes
    blob = tmp_path / ("blob.gz" if gz else "blob.bin")
    blob.write_bytes(gzip.compress(data) if gz else data)
    for argv in (["simulate", "--trace", blob.name, "--out", "o"], ["demo", "--trace", blob.name, "--out", "d"],
                 ["fidelity", "--trace", blob.name, "--out", "f"]):
        assert top_main(argv) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 2 and f"{blob.name}: 1 problem(s)" in err[0], (argv, err)
        assert err[1].startswith("line 1: invalid trace header: JSON is malformed") and "not a canonical trace" in err[1], err
    for read in (read_trace, read_trace_compact):  # replay reads with read_trace
        with pytest.raises(TraceError) as e:
            read(blob)
        assert [p.line for p in e.value.problems] == [1], read
    assert main(["validate", blob.name]) == 2
    assert len(capsys.readouterr().out.splitlines()) == 1026  # line 1, 1,024 runs of 256 bytes, and the tail
    assert sorted(p.name for p in tmp_path.iterdir()) == [blob.name]


def _bytes_read() -> int:
    """Bytes this process has read with read(2) so far (Linux ``/proc/self/io``'s ``rchar``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.parametrize("kind", ["plain", "gz", "gz2"])
def test_a_file_with_no_newline_is_named_at_line_1_after_a_bounded_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """A file with no newline at all (18 MB of zeros, a binary) was read whole, as its one line 1,
    by every trace reader before it failed ('invalid trace header: JSON is malformed'). They stop
    after MAX_FIRST_LINE bytes now and name why: plain, one gzip member (zlib's reader, and the
    thread simulate inflates on) and two members (``gzip``'s own reader)."""
    from evolving_infra.traces.compact import read_trace_compact
    from evolving_infra.traces.inflate import InflateAhead
    from evolving_infra.traces.io import CHUNK, MAX_FIRST_LINE, TraceError, read_header, read_trace

    monkeypatch.chdir(tmp_path)
    size = 18_000_000
    blob = tmp_path / ("zeros.gz" if kind != "plain" else "zeros.bin")
    if kind == "plain":
        with open(blob, "wb") as f:
            f.truncate(size)  # sparse: 18 MB of zeros, none written
    else:
        half = bytes(size // 2)
        blob.write_bytes(gzip.compress(half + half, mtime=0) if kind == "gz" else gzip.compress(half, mtime=0) * 2)
    want = f"line 1: not a trace (no newline in the first {MAX_FIRST_LINE:,} bytes); not a canonical trace"
    for argv in (["simulate", "--trace", blob.name, "--out", "o"], ["demo", "--trace", blob.name, "--out", "d"],
                 ["fidelity", "--trace", blob.name, "--out", "f"]):
        assert top_main(argv) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 2 and f"{blob.name}: 1 problem(s)" in err[0] and err[1].startswith(want), (argv, err)
    before = _bytes_read()
    reads = [read_trace, read_trace_compact, read_header]  # replay reads with read_trace, stats with read_header first
    if kind != "plain":
        reads.append(lambda p: read_trace_compact(p, ahead=InflateAhead.start(p)))
    for read in reads:
        with pytest.raises(TraceError) as e:
            read(blob)
        assert len(e.value.problems) == 1 and str(e.value).splitlines()[-1].startswith(want), (read, str(e.value))
    if kind == "plain":  # each read stopped within a chunk past the bound
        assert _bytes_read() - before <= len(reads) * (MAX_FIRST_LINE + CHUNK)
    assert main(["validate", blob.name]) == main(["stats", blob.name]) == 2
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and out.startswith(f"{blob.name}:1: {want[len('line 1: '):]}"), out
    assert want in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [blob.name]


@pytest.mark.parametrize("gz", [False, True])
def test_a_trace_of_no_request_is_refused_by_every_command_that_replays_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], gz: bool
) -> None:
    """A valid header and nothing after it: ``simulate`` wrote a report of 0 requests and exited 0.
    simulate, demo, fidelity and replay now stop with one line naming it, exit 2, nothing written
    (replay: before asking the router anything more); trace validate still passes it."""
    import evolving_infra.replay.cli as replay_cli
    from evolving_infra.traces.io import NO_REQUESTS, encode_line
    from evolving_infra.traces.schema import FORMAT, VERSION, TraceHeader

    monkeypatch.chdir(tmp_path)
    line = encode_line(TraceHeader(format=FORMAT, version=VERSION, block_size=64, source="s", description="d")) + b"\n"
    name = "empty.jsonl.gz" if gz else "empty.jsonl"
    (tmp_path / name).write_bytes(gzip.compress(line) if gz else line)

    async def nothing(*a: object, **k: object) -> None:
        return None

    async def silent(*a: object, **k: object) -> replay_cli.RouterAnswers:  # a router that says nothing
        return replay_cli.RouterAnswers(None, None, None, None)

    monkeypatch.setattr(replay_cli, "router_unreachable", nothing)
    monkeypatch.setattr(replay_cli, "router_answers", silent)
    for argv in (["simulate", "--trace", name, "--out", "o"], ["demo", "--trace", name, "--out", "d"],
                 ["fidelity", "--trace", name, "--out", "f"],
                 ["replay", name, "--router-url", "http://127.0.0.1:9", "--speedup", "1", "--out", "r"]):
        assert top_main(argv) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert err == [f"error: {'' if argv[0] == 'replay' else '--trace: '}{name}: {NO_REQUESTS}"], (argv, err)
    assert main(["validate", name]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_validate_help_does_not_offer_a_packed_trace(capsys: pytest.CaptureFixture[str]) -> None:
    """``trace validate --help`` listed '.jsonl, .jsonl.gz or .eipack' as its files, and validating an
    .eipack is a problem (exit 2: 'simulate --trace reads it; the other commands read the .jsonl[.gz]')."""
    with pytest.raises(SystemExit):
        top_main(["trace", "validate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "or .eipack" not in text and "a packed .eipack is a problem" in text, text
