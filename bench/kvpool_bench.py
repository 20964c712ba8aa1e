"""Real-bytes KV pool benchmark: Mooncake TCP pulls on loopback vs a plain memory copy.

    .venv/bin/python bench/kvpool_bench.py --quick     # 64 MiB, 3 repetitions (~20 s)
    .venv/bin/python bench/kvpool_bench.py             # 256 MiB, 5 repetitions

Needs Mooncake (``scripts/install-mooncake.sh``). Two processes: a holder
(``python -m services.worker.kvpool.demo hold``) with N blocks of
``--block-bytes`` (default 3,494,400 B = one GLM-5.2 block of 64 tokens ×
54.6 KB) in its registered buffer, and this process, which pulls them. Measured
(median and range over the repetitions, wall clock):

* **memcpy**: ``numpy.copyto`` of the same total size between two warm arrays
  (one thread): the baseline.
* **Mooncake batch read**: one ``batch_transfer_sync_read`` of the N slots
  into this process's registered buffer (TCP transport, P2PHANDSHAKE). The
  ratio to memcpy is the headline number.
* **Mooncake single read**: the same bytes as one contiguous transfer.
* **HostKvPool.fetch**: the whole pull as the worker would call it — NATS
  locate, batch read, CRC-32 of every block, hash-derived identity check,
  commit — after evicting the local copies.
* checksum and payload-generation cost per byte (CRC-32, BLAKE2b-64, SFC64).

Appends the command, date, commit, machine and a results table to
``bench/RESULTS-history.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from _common import commit_label  # noqa: E402

from services.worker.kvpool.payload import checksum, fill_payload  # noqa: E402
from services.worker.kvpool.transport import (  # noqa: E402
    MooncakeUnavailable,
    load_mooncake,
    pick_port_range,
    set_port_range,
)
from shared.bus import Bus  # noqa: E402
from shared.log import setup_logging  # noqa: E402
from shared.natsserver import EmbeddedNatsServer  # noqa: E402
from shared.subjects import Subjects  # noqa: E402

RESULTS = REPO / "bench" / "RESULTS-history.md"
GLM_BLOCK_BYTES = 64 * 54_600


def _stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def _timeit(fn, reps: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def bench_hashing(block_bytes: int, reps: int) -> dict[str, float]:
    """GB/s of CRC-32, BLAKE2b-64 and payload generation over one block."""
    buf = np.empty(block_bytes, dtype=np.uint8)
    fill_payload(buf, 1)
    mv = memoryview(buf)
    r = {}
    for name, fn in (
        ("crc32", lambda: checksum(buf)),
        ("blake2b8", lambda: hashlib.blake2b(mv, digest_size=8).digest()),
        ("payload", lambda: fill_payload(buf, 7)),
    ):
        ts = _timeit(fn, max(5, reps * 3))
        r[name] = block_bytes / statistics.median(ts) / 1e9
    return r


async def bench_transfer(nblocks: int, block_bytes: int, reps: int) -> dict[str, object]:
    from services.worker.kvpool.pool import HostKvPool

    total = nblocks * block_bytes
    res: dict[str, object] = {"blocks": nblocks, "block_bytes": block_bytes, "total": total}
    with EmbeddedNatsServer(jetstream=False) as srv:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        holder = subprocess.Popen(
            [sys.executable, "-m", "services.worker.kvpool.demo", "hold", "--nats-url", srv.url, "--node", "bench-src",
             "--blocks", str(nblocks), "--slot-bytes", str(block_bytes)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        try:
            line = holder.stdout.readline() if holder.stdout else ""
            if not line:
                raise RuntimeError(f"holder exited with {holder.wait()} before it was ready")
            ready = json.loads(line)
            bus = await Bus.connect(srv.url, Subjects("p0"), service="bench", instance="bench-dst")
            try:
                pool = HostKvPool("bench-dst", bus, num_slots=nblocks, slot_bytes=block_bytes)
                await pool.start()
                hashes = ready["hashes"]
                loc = await pool.locate("bench-src", hashes)
                ep, base = pool.endpoint, pool.buffer.base_addr
                local = [base + i * block_bytes for i in range(nblocks)]
                remote = [loc.base_addr + off for off in loc.offsets]
                lens = [block_bytes] * nblocks

                def batch() -> None:
                    if ep.read(loc.session, local, remote, lens) != 0:
                        raise RuntimeError("batch read failed")

                contiguous = sorted(loc.offsets) == [i * block_bytes for i in range(nblocks)]

                def single() -> None:
                    if ep.read(loc.session, [base], [loc.base_addr], [total]) != 0:
                        raise RuntimeError("single read failed")

                res["batch_s"] = _timeit(batch, reps)
                res["single_s"] = _timeit(single, reps) if contiguous else []
                fetches = []
                for _ in range(reps + 1):
                    for h in hashes:
                        pool.evict(h)
                    fr = await pool.fetch("bench-src", hashes)
                    if fr.error or len(fr.fetched) != nblocks or not fr.verified:
                        raise RuntimeError(f"fetch incomplete: {fr}")
                    fetches.append(fr)
                fetches = fetches[1:]  # first = warm-up (identity CRCs not yet memoised)
                res["fetch_s"] = [f.seconds for f in fetches]
                res["fetch_locate_s"] = [f.locate_s for f in fetches]
                res["fetch_transfer_s"] = [f.transfer_s for f in fetches]
                res["fetch_verify_s"] = [f.verify_s for f in fetches]
                await pool.stop()
            finally:
                await bus.close()
        finally:
            holder.terminate()
            try:
                holder.wait(timeout=20)
            except subprocess.TimeoutExpired:
                holder.kill()
    src = np.empty(total, dtype=np.uint8)
    fill_payload(src, 3)
    dst = np.empty_like(src)
    res["memcpy_s"] = _timeit(lambda: np.copyto(dst, src), reps)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB, 3 repetitions")
    ap.add_argument("--mib", type=int, default=0, help="total MiB to move (default 64 quick / 256 full)")
    ap.add_argument("--block-bytes", type=int, default=GLM_BLOCK_BYTES, help="bytes per block (default one GLM-5.2 block)")
    ap.add_argument("--reps", type=int, default=0, help="repetitions (default 3 quick / 5 full)")
    ap.add_argument("--no-write", action="store_true", help="print only, do not append to bench/RESULTS-history.md")
    args = ap.parse_args(argv)
    mib = args.mib or (64 if args.quick else 256)
    reps = args.reps or (3 if args.quick else 5)
    nblocks = max(1, -(-mib * 2**20 // args.block_bytes))
    setup_logging("console", "warning")  # library logs to stderr; stdout is the report
    try:
        set_port_range(*pick_port_range())
        load_mooncake()
    except MooncakeUnavailable as e:
        print(f"kvpool_bench: {e}", file=sys.stderr)
        return 3
    hashing = bench_hashing(args.block_bytes, reps)
    r = asyncio.run(bench_transfer(nblocks, args.block_bytes, reps))
    total = int(r["total"])  # type: ignore[arg-type]

    def gbps(key: str) -> tuple[float, float, float]:
        ts = r[key]  # type: ignore[index]
        med, lo, hi = _stats(ts)  # type: ignore[arg-type]
        return total / med / 1e9, total / hi / 1e9, total / lo / 1e9

    mem = gbps("memcpy_s")
    rows = [("memcpy (numpy.copyto, 1 thread), GB/s", mem, "1.00", "baseline, same total size, warm pages")]
    batch = gbps("batch_s")
    rows.append(
        (f"Mooncake TCP batch read ({nblocks} × {args.block_bytes:,} B), GB/s", batch, f"{batch[0] / mem[0]:.3f}",
         "batch_transfer_sync_read, loopback, P2PHANDSHAKE, 2 processes")
    )  # fmt: skip
    if r["single_s"]:
        single = gbps("single_s")
        rows.append(("Mooncake TCP single read (1 × total), GB/s", single, f"{single[0] / mem[0]:.3f}", "the same bytes as one transfer"))
    fetch = gbps("fetch_s")
    lm = statistics.median(r["fetch_locate_s"]) * 1e3  # type: ignore[arg-type]
    tm = statistics.median(r["fetch_transfer_s"]) * 1e3  # type: ignore[arg-type]
    vm = statistics.median(r["fetch_verify_s"]) * 1e3  # type: ignore[arg-type]
    rows.append(
        ("HostKvPool.fetch end to end, GB/s", fetch, f"{fetch[0] / mem[0]:.3f}",
         f"locate {lm:.1f} ms + transfer {tm:.1f} ms + CRC check {vm:.1f} ms (medians; hash-derived CRCs memoised after the warm-up fetch)")
    )  # fmt: skip
    table = ["| metric | median | min–max | ratio to memcpy | notes |", "|---|---|---|---|---|"]
    for name, (med, lo, hi), ratio, note in rows:
        table.append(f"| {name} | {med:.2f} | {lo:.2f}–{hi:.2f} | {ratio} | {note} |")
    table.append(f"| CRC-32 (zlib), GB/s | {hashing['crc32']:.2f} |  |  | per-block checksum used by the pool |")
    table.append(f"| BLAKE2b-64 (hashlib), GB/s | {hashing['blake2b8']:.2f} |  |  | alternative checksum, not used |")
    table.append(f"| synthetic payload (SFC64), GB/s | {hashing['payload']:.2f} |  |  | hash-derived bytes, put and identity check |")
    cmd = "python bench/kvpool_bench.py" + (" --quick" if args.quick else "")
    if args.mib:
        cmd += f" --mib {args.mib}"
    if args.block_bytes != GLM_BLOCK_BYTES:
        cmd += f" --block-bytes {args.block_bytes}"
    if args.reps:
        cmd += f" --reps {args.reps}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    mod = load_mooncake()
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}, "
        f"load average {load:.1f} at the end of the run"
    )
    section = "\n".join(
        [
            "",
            f"## kvpool real bytes ({'quick' if args.quick else 'full'}) — {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            "",
            f"- command: `{cmd}`",
            f"- commit: {commit_label(REPO)}",
            f"- machine: {machine} (shared VM: holder, puller and other jobs share the cores)",
            f"- Mooncake: mooncake-transfer-engine-non-cuda 0.3.13.post1 (`{Path(getattr(mod, '__file__', '?')).name}`), "
            f"TCP transport, {total / 2**20:.0f} MiB per repetition, {reps} repetitions",
            "",
            *table,
            "",
        ]
    )
    print(section)
    if not args.no_write:
        if not RESULTS.exists():
            RESULTS.write_text("# Benchmark results: history\n")
        with RESULTS.open("a") as f:
            f.write(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
