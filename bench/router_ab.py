"""In-process A/B of the ``ttft`` routing policy: ``services/router/ttft.py`` at a git revision vs the working tree.

    .venv/bin/python bench/router_ab.py                  # HEAD vs the working tree, 64 nodes
    .venv/bin/python bench/router_ab.py --base HEAD~3 --nodes 16 --new-states 16

This VM's speed moves by up to 2× within minutes, so two benchmark runs minutes
apart cannot show a 5% change. This script times both versions on the *same*
decisions in one process, alternating which one goes first, each with its own
copies of every node state and lookup (decoded from the same bytes, so neither
finds the other's objects in cache). Every decision must pick the same node with
the same predicted TTFT (to 1 ns), or the script stops: a speed-up that changes
decisions is not a speed-up. The decision loop is ``router_bench``'s (a
2,000-block prompt, random prefixes and queues of 0–6 requests, one node state,
one dispatch and one first token between decisions). Prints p50 / p99 of
``choose_prefill`` per version and their ratio, per seed. Writes nothing.

Only ``ttft.py`` is taken from the base revision; the rest of the tree (router
core, messages) is the working tree's, so the two must share those interfaces.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import msgspec  # noqa: E402
import router_bench as rb  # noqa: E402

from shared.messages import KvLookupReply, NodeState  # noqa: E402
from shared.profile import load_profile  # noqa: E402

from services.router.core import RouterCore  # noqa: E402
from services.router.policy import RouteRequest  # noqa: E402

_ENC = msgspec.msgpack.Encoder()


def _copy(x: Any, t: type) -> Any:
    return msgspec.msgpack.decode(_ENC.encode(x), type=t)


def load_base(rev: str, tmp: Path) -> ModuleType:
    """``services/router/ttft.py`` at ``rev`` as module ``ttft_base``.

    Raises:
        SystemExit: if git cannot show the file at ``rev``.
    """
    r = subprocess.run(["git", "show", f"{rev}:services/router/ttft.py"], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"git show {rev}:services/router/ttft.py failed: {r.stderr.strip()}")
    path = tmp / "ttft_base.py"
    path.write_text(r.stdout)
    spec = importlib.util.spec_from_file_location("ttft_base", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ttft_base"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def _core(mod: ModuleType) -> RouterCore:
    prof = load_profile("gb300-glm52")
    pred = mod.TtftPredictor(mod.NodeCoefficients.from_profile(prof))
    return RouterCore(mod.TtftPolicy(pred, block_size=rb.BS), block_size=rb.BS, fence_after=1e9)


def run(mods: dict[str, ModuleType], seed: int, decisions: int, n_nodes: int, new_states: int) -> dict[str, tuple[float, float]]:
    """p50 / p99 µs of ``choose_prefill`` per version on the same decisions.

    Raises:
        AssertionError: if the versions choose differently.
    """
    cores = {k: _core(m) for k, m in mods.items()}
    rng = random.Random(seed)
    nodes = [f"p{i:02d}" for i in range(n_nodes)]
    now = 0.0
    first = [rb.random_state(rng, n, now) for n in nodes]
    decode = NodeState(node="d0", phase="decode", ts=now, gpu_free_blocks=100_000)
    for c in cores.values():
        for s in first:
            c.apply_state(_copy(s, NodeState), now)
        c.apply_state(decode, now)
    lookups0 = [rb.make_lookup(rng, nodes) for _ in range(16)]
    lookups = {k: [_copy(x, KvLookupReply) for x in lookups0] for k in cores}
    path = [rng.getrandbits(63) for _ in range(rb.BLOCKS)]
    prompt = rb.BLOCKS * rb.BS + 100
    times: dict[str, list[float]] = {k: [] for k in cores}
    recent: list[str] = []
    names = list(cores)
    gc.disable()
    try:
        for i in range(decisions):
            now += 0.01
            changed = nodes if new_states >= n_nodes else rng.sample(nodes, new_states)
            states = [rb.random_state(rng, n, now) for n in changed]
            chosen = {}
            for name in names if i % 2 else names[::-1]:
                core = cores[name]
                for s in states:
                    core.apply_state(_copy(s, NodeState), now)
                core.apply_state(NodeState(node="d0", phase="decode", ts=now, gpu_free_blocks=100_000), now)
                lookup = lookups[name][i % 16]
                req = RouteRequest(rid=f"r{i}", prompt_tokens=prompt, block_hashes=path, max_tokens=256)
                cands = core.view.prefill_candidates(now)
                t0 = time.perf_counter()
                ch = core.policy.choose_prefill(req, lookup, cands, now)
                times[name].append(time.perf_counter() - t0)
                chosen[name] = (ch.node, round(ch.predicted_ttft_s or 0.0, 9))
                core.route(RouteRequest(rid=f"R{i}", prompt_tokens=prompt, block_hashes=path, max_tokens=256), lookup, now)
            assert len(set(chosen.values())) == 1, f"decision {i}: the versions differ: {chosen}"
            recent.append(f"R{i}")
            if len(recent) > 32:
                old = recent.pop(0)
                for core in cores.values():
                    core.on_first_token(old, now)
                    core.finish(old, now)
    finally:
        gc.enable()
    out = {}
    for k, v in times.items():
        v = sorted(v[decisions // 10 :])
        out[k] = (rb.pct(v, 0.5) * 1e6, rb.pct(v, 0.99) * 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the base ttft.py (default HEAD)")
    ap.add_argument("--nodes", type=int, default=64, help="prefill nodes (default 64)")
    ap.add_argument("--new-states", type=int, default=1, help="node states that change between decisions (default 1)")
    ap.add_argument("--decisions", type=int, default=1500, help="decisions per seed (default 1500; the first 10%% are dropped)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds (default 3)")
    a = ap.parse_args(argv)
    import services.router.ttft as work

    with tempfile.TemporaryDirectory() as tmp:
        mods = {"base": load_base(a.base, Path(tmp)), "work": work}
        print(f"ttft.py at {a.base} (base) vs the working tree (work); {a.nodes} nodes, {a.new_states} new state(s) per decision")
        for seed in range(1, a.seeds + 1):
            r = run(mods, seed, a.decisions, a.nodes, a.new_states)
            (b50, b99), (w50, w99) = r["base"], r["work"]
            print(f"seed {seed}: base p50 {b50:.1f} / p99 {b99:.1f} µs | work p50 {w50:.1f} / p99 {w99:.1f} µs | "
                  f"work/base p50 {w50 / b50:.3f}, p99 {w99 / b99:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
