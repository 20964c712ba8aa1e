"""``demo`` SIGKILLed (or OOM-killed) during its replay keeps the record of every request answered before it: each is
appended to the run's own ``OUT/requests.partial-<id>.jsonl`` as it completes, one whole JSON line, as ``replay``
does. Before, the demo wrote ``requests.jsonl`` only at its end, so a killed demo left none (every per-request figure
lost). An earlier run's outputs in ``OUT`` (a run's own names only: the user's files stay) are moved to
``OUT/previous/`` only once the replay has ended, just before the report is written, so a killed demo leaves them
(and the older ``previous/``) as they were, never mixed with this run's lines.

A real cluster (``LocalCluster``: nats-server + every service as its own process, speed-up 25), as a user runs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evolving_infra.report.records import read_records
from tests.e2e._up import demo_answering

pytestmark = pytest.mark.timeout(300)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_sigkilled_demo_leaves_the_answered_requests_records_each_a_whole_json_line(tmp_path):
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {"EI_STATE_DIR": str(state_dir)}
    out_dir = tmp_path / "demo"
    out_dir.mkdir()
    (out_dir / "report.json").write_text('{"earlier": true}\n')  # an earlier run's outputs
    (out_dir / "requests.jsonl").write_text('{"id": "earlier"}\n')
    (out_dir / "holiday.png").write_text("mine\n")  # the user's own: stays where it is
    (out_dir / "previous").mkdir()  # an older run's outputs alone: replaced
    (out_dir / "previous" / "report.json").write_text('{"older": true}\n')
    (out_dir / "previous" / "ttft_cdf.png").write_text("older\n")
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--sessions", "2", "--concurrency", "2",
           "--speedup", "25", "--nodes", "1", "--out", str(out_dir)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    pids: dict[str, int] = {}

    def records() -> Path:
        found = list(out_dir.glob("requests.partial-*.jsonl"))
        return found[0] if len(found) == 1 else out_dir / "requests.partial-none.jsonl"
    try:
        state = demo_answering(proc, state_dir)  # its cluster ready, 2 requests answered (120 s)
        pids = {k: int(v) for k, v in state["pids"].items()}
        # the router's count leads the client's last chunk: give those answers 10 s to reach the file
        until = time.monotonic() + 10
        while len(_lines(records())) < 2 and time.monotonic() < until:
            time.sleep(0.05)
        assert proc.poll() is None, "the demo ended before it was killed: make its replay longer"
        proc.kill()  # SIGKILL: no handler, no final write
        text, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids.values():  # its services get SIGTERM from the kernel (PR_SET_PDEATHSIG); any left: killed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    lines = _lines(records())
    assert len(lines) >= 2, f"{len(lines)} records after a SIGKILL with 2+ requests answered:\n{text[-3000:]}"
    rows = [json.loads(line) for line in lines]  # each line whole JSON, even the last one written
    assert all(set(r) >= {"id", "agent", "branch", "sent_at", "finished_at", "e2e_s"} for r in rows), rows[0]
    # set after the replay from every record (the final file's alone): not in the appended lines (RecordAppender)
    assert not any({"ideal_cached_tokens", "lost_reuse_cause"} & set(r) for r in rows), rows[0]
    assert len({r["id"] for r in rows}) == len(rows) and "earlier" not in {r["id"] for r in rows}
    assert all(r["finished_at"] >= r["sent_at"] for r in rows)
    assert [r.id for r in read_records(records())] == [r["id"] for r in rows]  # the report's reader takes them as they are
    # the earlier run's outputs and the older previous/ as they were: set aside only once a run has ended
    assert (out_dir / "report.json").read_text() == '{"earlier": true}\n'
    assert (out_dir / "requests.jsonl").read_text() == '{"id": "earlier"}\n'
    assert (out_dir / "previous" / "report.json").read_text() == '{"older": true}\n'
    assert sorted(p.name for p in (out_dir / "previous").iterdir()) == ["report.json", "ttft_cdf.png"]
    assert (out_dir / "holiday.png").read_text() == "mine\n"
    assert "moved to" not in text, text[-3000:]
    assert f"is appended to {records()} until the report is written" in text, text[-3000:]  # named at the start


@pytest.mark.parametrize("theirs", ["folder", "file"])
def test_a_demo_into_a_folder_whose_previous_is_the_users_stops_before_the_cluster_starts(tmp_path, theirs):
    """``OUT/previous`` holding the user's files (or a plain file of theirs so named) is never replaced: the demo
    says so in one line and exits 2 before any service starts, every file as it was. Before, the earlier run's
    outputs replaced it once the cluster was ready (``shutil.rmtree``: the user's files gone; a plain file: a
    NotADirectoryError traceback with the cluster up)."""
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {"EI_STATE_DIR": str(state_dir)}
    out_dir = tmp_path / "g"
    out_dir.mkdir()
    (out_dir / "report.json").write_text('{"earlier": true}\n')  # an earlier run's outputs
    (out_dir / "holiday.png").write_text("mine\n")
    prev = out_dir / "previous"
    if theirs == "folder":
        prev.mkdir()
        (prev / "my-notes.txt").write_text("mine\n")
    else:
        prev.write_text("mine\n")
    before = sorted((str(p.relative_to(tmp_path)), p.is_dir()) for p in tmp_path.rglob("*"))
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--sessions", "1", "--concurrency", "1",
           "--speedup", "25", "--nodes", "1", "--out", str(out_dir)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    why = "holds files that are not a run's outputs (my-notes.txt)" if theirs == "folder" else "is not a folder"
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert f"error: --out {out_dir}: {prev} {why}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "cluster ready" not in proc.stdout, proc.stdout[-2000:]
    assert sorted((str(p.relative_to(tmp_path)), p.is_dir()) for p in tmp_path.rglob("*")) == before



def test_a_demo_into_an_out_another_run_is_writing_to_stops_before_the_cluster_starts(tmp_path):
    """Two runs into one ``--out`` at once (the default ``demo-out`` makes it easy): before, the second moved the
    first's records to ``previous/``, cleared its ``OUT/logs`` and both wrote the same files, two runs lost without a
    word. Now a run holds ``OUT`` (an exclusive ``flock``, :func:`~evolving_infra.replay.cli.hold_out`) for its
    whole run: the demo names the holder's pid and exits 2 before any service starts, every file as it was."""
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {"EI_STATE_DIR": str(state_dir)}
    out_dir = tmp_path / "g"
    out_dir.mkdir()
    (out_dir / "report.json").write_text('{"earlier": true}\n')  # the running one's, as far as the demo can tell
    holder = subprocess.Popen(  # another run holding OUT, as replay and demo hold it
        [sys.executable, "-c", "import sys; from pathlib import Path; from evolving_infra.replay.cli import hold_out\n"
         "with hold_out(Path(sys.argv[1])):\n    print('held', flush=True); sys.stdin.read()", str(out_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        before = sorted((str(p.relative_to(tmp_path)), p.is_dir()) for p in tmp_path.rglob("*"))
        cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--sessions", "1", "--concurrency", "1",
               "--speedup", "25", "--nodes", "1", "--out", str(out_dir)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        after = sorted((str(p.relative_to(tmp_path)), p.is_dir()) for p in tmp_path.rglob("*"))
    finally:
        with contextlib.suppress(OSError):
            holder.stdin.close()  # type: ignore[union-attr]
        holder.wait(30)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert f"error: --out {out_dir}: another run (pid {holder.pid}) is writing to it" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "cluster ready" not in proc.stdout, (proc.stdout[-2000:], proc.stderr)
    assert after == before
    assert holder.returncode == 0 and sorted(p.name for p in out_dir.iterdir()) == ["report.json"]  # its lock file gone


def test_a_demo_whose_set_aside_is_refused_at_its_end_writes_its_report_to_a_run_folder_and_exits_4(tmp_path):
    """Your files put in ``OUT/previous/`` during the demo: the set-aside is refused at its end, and the report goes to
    ``OUT/run-<run_id>/`` (review of e145905, rr-ops51b): exit 4, not 0 (``OUT/report.json`` is still the earlier
    run's), and the last line's baseline command names the folder this run's report is in, not ``OUT``."""
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EI_API_KEY")} | {"EI_STATE_DIR": str(state_dir)}
    out_dir = tmp_path / "g"
    out_dir.mkdir()
    (out_dir / "report.json").write_text('{"earlier": true}\n')  # an earlier run's outputs
    cmd = [sys.executable, "-m", "evolving_infra.cli", "demo", "--sessions", "1", "--concurrency", "1",
           "--speedup", "50", "--nodes", "1", "--out", str(out_dir)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # "run <id>: each answered request's record is appended ...": the replay starts
            lines.append(line)
            if "each answered request's record is appended to" in line:
                (out_dir / "previous").mkdir()
                (out_dir / "previous" / "my-notes.txt").write_text("mine\n")
                break
        rest, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines) + rest
    runs = [p for p in out_dir.iterdir() if p.name.startswith("run-")]
    assert proc.returncode == 4, (proc.returncode, text[-2000:], err[-2000:])
    assert len(runs) == 1, sorted(p.name for p in out_dir.iterdir())
    report = json.loads((runs[0] / "report.json").read_text())
    assert runs[0].name == f"run-{report['meta']['run_id']}" and (runs[0] / "requests.jsonl").is_file()
    assert (out_dir / "report.json").read_text() == '{"earlier": true}\n'
    assert (out_dir / "previous" / "my-notes.txt").read_text() == "mine\n"
    assert f"written to {runs[0]}/ instead" in err, err[-2000:]
    baseline = [line for line in text.splitlines() if line.startswith("baseline")]
    assert baseline and str(runs[0]) in baseline[-1] and f"{out_dir} " not in baseline[-1], text[-2000:]
    assert not list(out_dir.glob("requests.partial-*"))
