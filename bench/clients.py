"""NVIDIA AIPerf against `evolving-infra up`, as a user benchmarks a server (optional; not in CI).

Starts `evolving-infra up` (2 simulated GB300 nodes, 1P1D, `--speedup 20`) with a real
local tokenizer (`--tokenizer hf:DIR`; by default a byte-level BPE trained on this repo's docs
by ``tests.unit.router.helpers.write_bpe_tokenizer``, written to ``OUT/tokenizer``), then runs

    aiperf profile -m evolving-infra-sim --tokenizer DIR --url ROUTER --endpoint-type chat
        --streaming --request-count 100 --concurrency 8 --synthetic-input-tokens-mean 200
        --output-tokens-mean 64 --output-tokens-stddev 0 --extra-inputs ignore_eos:true

and checks, from AIPerf's per-request export (``profile_export.jsonl``):

* 0 errors, 100 requests;
* AIPerf's own output-token count (it tokenizes the streamed text with the same tokenizer)
  equals the server's ``usage.completion_tokens`` for every request;
* every AIPerf ``X-Request-ID`` is a request id in the router's log (the router runs at
  debug level and logs one ``route`` line per request): client and server records join.

Needs AIPerf (``pip install aiperf``; it has many dependencies, so install it in its own venv,
e.g. ``python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf``) and the
project's ``hf`` extra (``pip install -e '.[hf]'``). Measured with aiperf 0.13.0 on the 2-core
VM (figures in ``bench/RESULTS.md``). Appends a section to ``bench/RESULTS-history.md``.

    .venv/bin/python bench/clients.py --aiperf /tmp/aiperf-venv/bin/aiperf
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._common import commit_label  # noqa: E402

RESULTS = REPO / "bench" / "RESULTS-history.md"
MODEL = "evolving-infra-sim"


def start_up(tokenizer: Path, log_dir: Path, speedup: float) -> tuple[subprocess.Popen[str], dict]:
    """`evolving-infra up` with ``--tokenizer hf:<tokenizer>``; returns the process and its READY info.

    Raises:
        RuntimeError: if it is not ready within 120 s (with its output).
    """
    cmd = [
        sys.executable, "-m", "evolving_infra.cli", "up", "--nodes", "2", "--split", "1P1D",
        "--speedup", str(speedup), "--port", "0", "--tokenizer", f"hf:{tokenizer}", "--log-dir", str(log_dir),
        "--log-level", "debug",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            break
        lines.append(line)
        if line.startswith("READY "):
            return proc, json.loads(line[len("READY ") :])
    proc.kill()
    raise RuntimeError("evolving-infra up did not get ready:\n" + "".join(lines))


def stop_up(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def router_rids(log: Path) -> set[str]:
    """Request ids of the router's ``route`` log lines (JSON lines at debug level)."""
    out: set[str] = set()
    for line in log.read_text(errors="replace").splitlines():
        if '"route"' not in line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if obj.get("event") == "route" and obj.get("rid"):
            out.add(obj["rid"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aiperf", default=shutil.which("aiperf") or "/tmp/aiperf-venv/bin/aiperf", help="the aiperf executable")
    ap.add_argument("--tokenizer", type=Path, default=None, help="local HF tokenizer folder (default: train one into OUT/tokenizer)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/ei-clients"), help="work folder (tokenizer, logs, AIPerf artifacts)")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--isl", type=int, default=200, help="AIPerf synthetic input tokens (mean, stddev 0)")
    ap.add_argument("--osl", type=int, default=64, help="output tokens per request (ignore_eos)")
    ap.add_argument("--speedup", type=float, default=20.0)
    ap.add_argument("--no-append", action="store_true", help="print only; do not append to bench/RESULTS-history.md")
    args = ap.parse_args(argv)
    if not Path(args.aiperf).exists():
        print(f"error: no aiperf at {args.aiperf}; install it (see this script's docstring) or pass --aiperf", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    tok = args.tokenizer
    if tok is None:
        from tests.unit.router.helpers import write_bpe_tokenizer

        tok = write_bpe_tokenizer(args.out / "tokenizer")
    version = subprocess.run([args.aiperf, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    art = args.out / "aiperf"
    shutil.rmtree(art, ignore_errors=True)
    logs = args.out / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    proc, info = start_up(tok, logs, args.speedup)
    cmd = [
        args.aiperf, "profile", "-m", MODEL, "--tokenizer", str(tok), "--url", info["router_url"],
        "--endpoint-type", "chat", "--streaming", "--request-count", str(args.requests),
        "--concurrency", str(args.concurrency), "--synthetic-input-tokens-mean", str(args.isl),
        "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--random-seed", "1", "--artifact-dir", str(art), "--ui", "none",
    ]  # fmt: skip
    t0 = time.monotonic()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    finally:
        up_rc = stop_up(proc)
    wall = time.monotonic() - t0
    (args.out / "aiperf.log").write_text(run.stdout + run.stderr)
    export = art / "profile_export.jsonl"
    if run.returncode != 0 or not export.exists():
        print(f"aiperf failed (exit {run.returncode}); output in {args.out / 'aiperf.log'}", file=sys.stderr)
        return 1
    recs = [json.loads(line) for line in export.read_text().splitlines() if line.strip()]
    errors = [r for r in recs if r.get("error")]
    ok = [r for r in recs if not r.get("error")]
    mism = [r for r in ok if r["metrics"]["output_sequence_length"]["value"] != r["metrics"]["usage_completion_tokens"]["value"]]
    client_rids = {r["metadata"]["x_request_id"] for r in recs}
    joined = client_rids & router_rids(logs / "router.log")
    summary = json.loads((art / "profile_export_aiperf.json").read_text())

    def stat(name: str, key: str) -> float:
        return float(summary[name][key])

    osl = [r["metrics"]["output_sequence_length"]["value"] for r in ok]
    use = [r["metrics"]["usage_completion_tokens"]["value"] for r in ok]
    passed = len(recs) == args.requests and not errors and not mism and len(joined) == len(client_rids)
    section = "\n".join(
        [
            "",
            f"## clients: NVIDIA AIPerf against `up` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            f"- command: `python bench/clients.py` (aiperf {version}: `{' '.join(cmd[1:]).replace(info['router_url'], 'ROUTER')}`)",
            f"- commit: {commit_label(REPO)}",
            f"- machine: {platform.machine()}, {os.cpu_count()} CPUs (shared VM), Python {platform.python_version()}",
            f"- cluster: `evolving-infra up --nodes 2 --split 1P1D --speedup {args.speedup:g} --tokenizer hf:<BPE, "
            f"vocab 2,000, trained on the repo's docs>`; `up` exited {up_rc}; wall {wall:.0f} s",
            "",
            "| figure | value | target | met |",
            "|---|---|---|---|",
            f"| requests / errors | {len(recs)} / {len(errors)} | {args.requests} / 0 | {'yes' if len(recs) == args.requests and not errors else 'no'} |",
            f"| requests whose AIPerf output count ≠ server usage | {len(mism)} (AIPerf {min(osl, default=0)}–{max(osl, default=0)}, "
            f"usage {min(use, default=0)}–{max(use, default=0)} tokens) | 0 | {'yes' if not mism else 'no'} |",
            f"| AIPerf X-Request-IDs found as rids in the router's log | {len(joined)} / {len(client_rids)} | all | "
            f"{'yes' if len(joined) == len(client_rids) else 'no'} |",
            f"| TTFT avg / p99 ms (wall; sim at {args.speedup:g}×) | {stat('time_to_first_token', 'avg'):.1f} / "
            f"{stat('time_to_first_token', 'p99'):.1f} | — | — |",
            f"| request throughput, req/s (wall) | {stat('request_throughput', 'avg'):.2f} | — | — |",
            "",
        ]
    )
    print(section)
    if not args.no_append:
        with open(RESULTS, "a") as f:
            f.write(section)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
