"""Named policy sets: which routing, planner, eviction, decode binding and switch mode a run uses.

A *policy set* bundles the choices that make up one serving system, so that a
baseline is one name on the command line (``--policy dynamo``) and every
mechanism we add can be measured against the same baselines. Explicit flags
(``--routing``, ``--planner``, ...) override the set's choices.

Each set's docstring names its source. Components are looked up by name at
run time in the registries of the live services (``services.router.policy``,
``services.planner.policy``), so a set names only what those registries (or
the simulator's own built-ins: the ``static`` planner fallback, the decode
rules) provide; a missing component fails with a clear message
(:class:`PolicyError`), except in ``evolving``, which uses whatever of the
paper's mechanisms exist and records what it substituted.

Choices:

* ``routing``: prefill routing policy name in ``services.router.policy``
  (``cache-aware``, ``round-robin``, ``dynamo-kv``, ``sticky``, ``ttft``).
* ``decode_routing``: ``round-robin`` (SGLang Model Gateway PD mode, the
  paper's baselines §6.1) or ``least-loaded`` (the routing policy's own rule).
* ``planner``: planner name for ``services.planner.policy.make_planner``
  (``static``, ``dynamo``, ``arrow``, ``evolving``).
* ``eviction``: host (L2) eviction of the engines, ``lru`` or ``branch-count``.
* ``decode_binding``: when the decode node is chosen and its KV reserved:
  ``enqueue`` (at dispatch, reserved while the request queues for prefill:
  SGLang PD, paper D.1), ``prefill-start`` (chosen and reserved when the
  prefill starts: paper Eq. 7 / D.1), or ``route`` (chosen at dispatch,
  reserved when the hand-off arrives: what the live router + worker do today).
* ``switch_mode``: how a node changes phase, and which KV a prefill node can read:

  - ``decoupled`` (the paper's decoupled data plane, §4.1–§4.2): drain running
    requests in place, hand queued ones back for re-routing, serve the new phase
    after ``switch_control_s``; the node's L1/L2 stay and every node's L2 is one
    shared pool — a prefill node fetches, while the request queues, the part of
    the cluster's longest cached prefix that it lacks (the router's fetch plan
    with ``ttft``; otherwise the simulator builds one from the directory lookup,
    ``evolving_infra.sim.cluster.pool_fetch``). ``inplace`` is an alias kept for
    old command lines.
  - ``relaunch`` (Dynamo: drain, out of service ``relaunch_s``, L1 and L2 emptied),
  - ``strand`` (Arrow: drain, switch in place after ``switch_control_s``, KV
    stranded = emptied);
    both reuse only what the prefill node itself holds (fetch plans dropped).
  - ``none`` (no switches; the router's fetch plans, if any, are kept).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

ROUTING_DECODE = ("round-robin", "least-loaded")
DECODE_BINDINGS = ("enqueue", "prefill-start", "route")
SWITCH_MODES = ("decoupled", "relaunch", "strand", "inplace", "none")
SWITCH_MODE_ALIASES = {"inplace": "decoupled"}
"""Accepted names that mean another mode: ``inplace`` (the in-place switch keeping the node's
KV) is the decoupled plane's switch; since the shared pool it names ``decoupled``."""
SHARED_POOL_MODES = frozenset({"decoupled"})
"""Switch modes whose prefill nodes read peers' KV (fetch while queued)."""
LOCAL_KV_MODES = frozenset({"relaunch", "strand"})
"""Switch modes whose prefill nodes reuse only their own KV (a router's fetch plan is dropped)."""
EVICTIONS = ("lru", "branch-count")

DEFAULT_RELAUNCH_S = 750.0
"""Dynamo relaunch downtime (s): the paper measures 666–831 s per switch (DESIGN §5),
754 s on average over its §6.2 runs (Appendix C.1)."""


class PolicyError(ValueError):
    """An unknown policy set or component, or a combination that cannot run."""


@dataclass(frozen=True, slots=True)
class PolicySet:
    """One serving system's choices (see the module docstring for each field's values)."""

    name: str
    routing: str
    decode_routing: str
    planner: str
    eviction: str
    decode_binding: str
    switch_mode: str
    split: str | None
    """Initial split spec (``xPyD``/``collocated``); None = :func:`default_split` of the node count."""
    source: str
    """Where the behaviour comes from (paper section, upstream file)."""
    substitutions: tuple[str, ...] = ()
    """Components a set wanted but the tree does not provide, and what replaced them."""


def default_split(nodes: int) -> str:
    """The prefill-heavy start of the paper's adaptive runs: 6P3D on 9 nodes (§3, §6.1
    "Both start from the prefill-heavy split 6P3D"), i.e. round(2N/3) prefill nodes."""
    if nodes < 2:
        return "collocated"
    p = min(max(round(2 * nodes / 3), 1), nodes - 1)
    return f"{p}P{nodes - p}D"


def _static(split: str | None) -> PolicySet:
    """SGLang PD disaggregation at a fixed split (paper §6.1 "best static split", Figure 2a).

    SGLang Model Gateway with cache-aware prefill routing and round-robin decode
    routing (§6.1 "All baselines use the SGLang Model Gateway ..."), HiCache with
    LRU eviction, decode KV reserved for each request when it is dispatched and
    held while it queues for prefill (SGLang's decode pre-allocation, paper D.1),
    no phase switches.
    """
    return PolicySet(
        name=f"static:{split}" if split else "static",
        routing="cache-aware",
        decode_routing="round-robin",
        planner="static",
        eviction="lru",
        decode_binding="enqueue",
        switch_mode="none",
        split=split,
        source="SGLang PD disaggregation + SGLang Model Gateway cache-aware (paper §6.1, D.1)",
    )


def _dynamo() -> PolicySet:
    """NVIDIA Dynamo v1.5.1 as the paper runs it (§3, §6.1, Appendix C.1/C.2).

    Load-based planner on prefill queue depth and decode KV utilisation, ±1 node
    per decision (``research/anchor-dynamo.md`` §6.4); a switch relaunches the
    node's worker: out of service for ``relaunch_s`` (754 s mean in the paper)
    with its KV emptied. SGLang engines underneath: cache-aware prefill routing
    and round-robin decode routing through the SGLang Model Gateway, HiCache LRU,
    decode KV reserved at dispatch. Starts from 6P3D (§6.1).
    """
    return PolicySet(
        name="dynamo",
        routing="cache-aware",
        decode_routing="round-robin",
        planner="dynamo",
        eviction="lru",
        decode_binding="enqueue",
        switch_mode="relaunch",
        split=None,
        source="Dynamo v1.5.1 planner (load-based) + relaunch; SGLang gateway cache-aware (paper §3, §6.1)",
    )


def _arrow() -> PolicySet:
    """Arrow (arXiv 2505.11916) as the paper reimplements it on the symmetric engines (§3, Related work).

    Planner sizing the pools from TTFT predicted from the *full* input length
    (cached prefixes counted as work); nodes switch in place without a restart
    but the switched node's KV is stranded (emptied). Symmetric engines: the
    decode node is bound when the prefill starts. Same gateway routing and
    HiCache LRU as the other baselines. Starts from 6P3D (§3).
    """
    return PolicySet(
        name="arrow",
        routing="cache-aware",
        decode_routing="round-robin",
        planner="arrow",
        eviction="lru",
        decode_binding="prefill-start",
        switch_mode="strand",
        split=None,
        source="Arrow planner (TTFT from full input length), in-place switch stranding KV (paper §3, §8)",
    )


def _evolving() -> PolicySet:
    """Evolving Infra: whatever of the paper's mechanisms exist in this tree.

    Today: branch-count host eviction (§5.3), decode bound at prefill start
    (Eq. 7 / D.1), the decoupled data plane (§4.1–§4.2: in-place switches keeping
    the node's KV, fetches from peers' host memory), and — when
    registered — the ``ttft`` router (Eq. 7) and the ``evolving`` planner
    (Eq. 5/6); otherwise cache-aware routing and a static split, recorded in
    ``substitutions``. Grows with later issues.
    """
    return PolicySet(
        name="evolving",
        routing="ttft",
        decode_routing="least-loaded",
        planner="evolving",
        eviction="branch-count",
        decode_binding="prefill-start",
        switch_mode="decoupled",
        split=None,
        source="Evolving Infra (paper §4–§5): ttft router, evolving planner, branch-count eviction, decoupled data plane",
    )


_SPLIT_RE = re.compile(r"^\d+[pP]\d+[dD]$")

SET_NAMES = ("static:<x>P<y>D", "dynamo", "arrow", "evolving")
"""Names accepted by :func:`policy_set` (``static`` alone takes ``--split``)."""


def policy_set(name: str) -> PolicySet:
    """The policy set called ``name`` (``static:4P5D``, ``static``, ``dynamo``, ``arrow``, ``evolving``).

    Raises:
        PolicyError: for an unknown name or a malformed ``static:`` split.
    """
    key = name.strip()
    if key == "static":
        return _static(None)
    if key.startswith("static:"):
        split = key.split(":", 1)[1].strip()
        if not (_SPLIT_RE.match(split) or split == "collocated"):
            raise PolicyError(f"policy set {name!r}: the split must look like 4P5D")
        return _static(split.upper() if split != "collocated" else split)
    table = {"dynamo": _dynamo, "arrow": _arrow, "evolving": _evolving}
    fn = table.get(key)
    if fn is None:
        raise PolicyError(f"unknown policy set {name!r}; known: {', '.join(SET_NAMES)}")
    return fn()


def serving(ps: PolicySet, split: str) -> PolicySet:
    """``ps`` as it serves ``split`` (``--split``'s, or the set's own): a set that names its split
    (``static:5P1D``) run at another (``--split 3P1D``) is named and split by the one served
    (``static:3P1D``), so the label the commands print and the reports keep (``meta.policy``,
    ``simulate``'s ``label``) tells what ran; it said ``static:5P1D`` of a 3P1D run. Any other set
    (its split only the initial one, ``split`` None) is returned as it is, as is ``ps`` for a
    malformed ``split``, which the caller refuses (``shared.split.parse_split``).
    """
    from shared.split import SplitError, canonical_split

    if ps.split is None:
        return ps
    try:
        served = canonical_split(split)
    except SplitError:
        return ps
    if served == ps.split:
        return ps
    return replace(ps, name=f"{ps.name.partition(':')[0]}:{served}", split=served)


def with_overrides(ps: PolicySet, **over: str | None) -> PolicySet:
    """``ps`` with the non-None overrides applied (explicit flags win over the set).

    Raises:
        PolicyError: on a value outside the allowed choices.
    """
    clean: dict[str, Any] = {k: v for k, v in over.items() if v is not None}
    checks = {
        "decode_routing": ROUTING_DECODE,
        "decode_binding": DECODE_BINDINGS,
        "switch_mode": SWITCH_MODES,
        "eviction": EVICTIONS,
    }
    for k, allowed in checks.items():
        if k in clean and clean[k] not in allowed:
            raise PolicyError(f"--{k.replace('_', '-')} must be one of {', '.join(allowed)}, got {clean[k]!r}")
    if "switch_mode" in clean:
        clean["switch_mode"] = SWITCH_MODE_ALIASES.get(clean["switch_mode"], clean["switch_mode"])
    return replace(ps, **clean) if clean else ps
