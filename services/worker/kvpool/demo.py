"""Two-process exercise of the real-bytes pool: one process holds blocks, another pulls them.

    python -m services.worker.kvpool.demo hold  [--nats-url URL] --node a --blocks 64 [--corrupt 2]
    python -m services.worker.kvpool.demo fetch [--nats-url URL] --node b --peer a --blocks 64

The NATS server is ``--nats-url``, else env ``EI_NATS_URL`` (as the services read it; a URL with a
password is, as a flag, in every local user's ``ps``): one server or a comma-separated list.

Both sides derive the same ``--blocks`` chained SGLang block hashes from
``--seed`` (``shared.hashing``: deterministic tokens per block id). ``hold``
puts them (synthetic payloads), optionally flips one byte in ``--corrupt`` of
them *after* their checksum was recorded, prints one JSON line
``{"event": "ready", ...}`` and serves ``kv.pool.<node>`` until SIGINT/SIGTERM
(then prints ``{"event": "stopped", "stats": ...}``). ``fetch`` pulls the
blocks with Mooncake, re-verifies every landed slot locally and prints one
JSON line ``{"event": "fetched", ...}``. Exit status: 0 when the run finished
(whatever the checksums said), 2 on bad arguments, 3 when Mooncake is missing,
4 when the peer could not be reached; no NATS server given (neither ``--nats-url`` nor
``EI_NATS_URL``) is a bad argument.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from services.worker.kvpool.buffer import DEFAULT_CPU_SLOT_BYTES
from services.worker.kvpool.config import parse_port_range
from services.worker.kvpool.payload import expected_checksum
from services.worker.kvpool.transport import MooncakeUnavailable, pick_port_range, set_port_range
from shared.bus import Bus
from shared.hashing import block_hashes, tokens_for_blocks
from shared.log import setup_logging
from shared.signals import STOP_SIGNALS, claim_process, ignore_stop_signals, process_claimed
from shared.subjects import Subjects

DEMO_BLOCK_TOKENS = 16


def demo_hashes(seed: int, n: int) -> list[int]:
    """``n`` chained block hashes of a deterministic token sequence (same on every node)."""
    ids = list(range(seed * 1_000_003, seed * 1_000_003 + n))
    return block_hashes(tokens_for_blocks(ids, DEMO_BLOCK_TOKENS), DEMO_BLOCK_TOKENS)


def corrupt_indices(n: int, k: int) -> list[int]:
    """``k`` block positions spread over ``[0, n)`` (deterministic)."""
    if k <= 0 or n <= 0:
        return []
    k = min(k, n)
    return sorted({(i * n) // k + (n // (2 * k)) for i in range(k)})


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _configure_ports(spec: str) -> None:
    if spec == "auto":
        set_port_range(*pick_port_range())
    else:
        rng = parse_port_range(spec)
        if rng is not None:
            set_port_range(*rng)


async def _connect(args: argparse.Namespace) -> Bus:
    return await Bus.connect(args.nats_url, Subjects(args.partition), service="worker", instance=f"kvpool-{args.node}")


async def hold(args: argparse.Namespace) -> int:
    from services.worker.kvpool.pool import HostKvPool

    hashes = demo_hashes(args.seed, args.blocks)
    bus = await _connect(args)
    try:
        pool = HostKvPool(args.node, bus, num_slots=max(args.slots, args.blocks), slot_bytes=args.slot_bytes)
        for h in hashes:
            pool.put(h)
        corrupted = []
        for i in corrupt_indices(len(hashes), args.corrupt):
            view = pool.buffer.view(hashes[i])
            view[len(view) // 2] ^= 0xFF  # after put: the recorded CRC no longer matches
            corrupted.append(hashes[i])
        await pool.start()
        await bus.nc.flush()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        _emit(
            {
                "event": "ready",
                "node": args.node,
                "session": pool.session,
                "base_addr": pool.buffer.base_addr,
                "slot_bytes": pool.buffer.slot_bytes,
                "hashes": hashes,
                "corrupted": corrupted,
            }
        )
        await stop.wait()
        if process_claimed():  # stopping: the rest of a burst of stop signals is discarded (no -15, no traceback
            ignore_stop_signals(loop)  # from one that lands while asyncio.run closes the loop)
        counters, gauges = pool.stats()
        await pool.stop()
        _emit({"event": "stopped", "counters": counters, "gauges": gauges})
    finally:
        await bus.close()
    return 0


async def fetch(args: argparse.Namespace) -> int:
    from services.worker.kvpool.pool import HostKvPool

    hashes = demo_hashes(args.seed, args.blocks)
    bus = await _connect(args)
    try:
        pool = HostKvPool(args.node, bus, num_slots=max(args.slots, args.blocks), slot_bytes=args.slot_bytes)
        await pool.start()
        res = await pool.fetch(args.peer, hashes)
        # Independent local check of what landed: recorded CRC and hash-derived CRC.
        local_ok = all(
            pool.buffer.verify(h) and pool.buffer.stored_checksum(h) == expected_checksum(h, pool.buffer.slot_bytes)
            for h in res.fetched
        )
        counters, _ = pool.stats()
        await pool.stop()
        _emit(
            {
                "event": "fetched",
                "node": args.node,
                "peer": args.peer,
                "requested": res.requested,
                "fetched": list(res.fetched),
                "missing": list(res.missing),
                "mismatched": list(res.mismatched),
                "reasons": res.reasons,
                "verified": res.verified,
                "local_verify_ok": local_ok,
                "bytes": res.bytes,
                "seconds": res.seconds,
                "locate_s": res.locate_s,
                "transfer_s": res.transfer_s,
                "verify_s": res.verify_s,
                "transfer_gbps": res.transfer_gbps,
                "error": res.error,
                "counters": counters,
            }
        )
        return 4 if res.error else 0
    finally:
        await bus.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.worker.kvpool.demo", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("hold", "fetch"):
        s = sub.add_parser(name)
        s.add_argument(
            "--nats-url", default="", help="NATS server(s); default: env EI_NATS_URL, which keeps a password in it out of ps"
        )
        s.add_argument("--partition", default="p0")
        s.add_argument("--log-level", default="warning")
        s.add_argument("--node", required=True, help="this pool's node id")
        s.add_argument("--blocks", type=int, default=64, help="blocks to hold / fetch")
        s.add_argument("--slots", type=int, default=0, help="pool slots (default: --blocks)")
        s.add_argument("--slot-bytes", type=int, default=DEFAULT_CPU_SLOT_BYTES, help="bytes per block slot")
        s.add_argument("--seed", type=int, default=0, help="which deterministic block chain")
        s.add_argument(
            "--ports", default="auto", help="Mooncake port range 'lo-hi', 'auto' (two free ports), or '' (Mooncake default)"
        )
        if name == "hold":
            s.add_argument("--corrupt", type=int, default=0, help="flip one byte in this many blocks after put")
        else:
            s.add_argument("--peer", required=True, help="node to fetch from")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m services.worker.kvpool.demo hold|fetch``; returns the exit status: 0 done (``hold``: stopped by
    SIGTERM/SIGINT; the rest of a burst of them ignored from the first on, in the process's own run, ``argv`` None),
    2 usage error, 3 Mooncake unavailable (one line on stderr)."""
    if argv is None:  # this process's own command line: hold may keep stop signals ignored once it stops
        claim_process()
    args = build_parser().parse_args(argv)
    args.nats_url = args.nats_url or os.environ.get("EI_NATS_URL", "")
    if not args.nats_url:
        print("demo: no NATS server: pass --nats-url URL or set EI_NATS_URL", file=sys.stderr)
        return 2
    if args.blocks < 1:
        print("demo: --blocks must be >= 1", file=sys.stderr)
        return 2
    setup_logging("console", args.log_level, service="kvpool-demo")  # logs to stderr; stdout is JSON only
    try:
        _configure_ports(args.ports)
        return asyncio.run(hold(args) if args.cmd == "hold" else fetch(args))
    except MooncakeUnavailable as e:
        print(f"demo: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
