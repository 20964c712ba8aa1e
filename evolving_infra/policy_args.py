"""One policy vocabulary for ``up``, ``demo`` and ``simulate`` (issue 21).

``--policy SET`` names a serving system (``evolving_infra.sim.policies``: ``evolving`` — the
default: ttft routing, the evolving planner with its SLO guard, branch-count host eviction,
decode bound when the prefill starts, decoupled in-place switching — or the baselines
``static[:xPyD]``, ``dynamo``, ``arrow``); ``--routing``, ``--planner``, ``--eviction``,
``--decode-binding``, ``--decode-routing`` override one part of it, ``--planner-opt K=V`` sets a planner
parameter (``EvolvingParams`` / ``DynamoParams`` / ``ArrowParams`` fields) and
``--routing-opt K=V`` a routing policy knob (the router's options that
``RouterConfig.policy_options`` passes to its policy, e.g. ``ttft_fetch_min_tokens``; a live
router gets each as its flag, ``--ttft-fetch-min-tokens``). The simulator
reads the flags itself (``evolving_infra.sim.cli``); a live cluster gets them through
:func:`live_policy`, which maps a set onto the services' flags and says what a live
cluster cannot do as the set asks (the live workers always switch in place with their
KV kept — the decoupled plane). The decode routing reaches the router as its ``--decode-routing``
(the baselines' round-robin, as ``simulate`` runs them).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from evolving_infra.sim.policies import (
    DECODE_BINDINGS, EVICTIONS, ROUTING_DECODE, SET_NAMES, PolicyError, policy_set, serving, with_overrides,
)
from shared.config import parse_key_values
from shared.values import FrozenValue, set_field

if TYPE_CHECKING:
    from services.router.config import RouterConfig

DEFAULT_POLICY = "evolving"


def add_policy_args(p: argparse.ArgumentParser, *, live: bool, default: str = DEFAULT_POLICY) -> argparse._ArgumentGroup:
    """Add ``--policy``, ``--routing``, ``--planner``, ``--eviction``, ``--decode-binding``,
    ``--planner-opt``, ``--routing-opt`` and ``--decode-routing`` to ``p`` (the simulator adds its own extra switches to the returned group).
    ``live``: the help says how a live cluster maps each choice."""
    pol = p.add_argument_group("policies (--policy picks a serving system; the other flags override one part of it)")
    pol.add_argument(
        "--policy",
        default=default,
        help=f"policy set: {', '.join(SET_NAMES)} (default {default}: ttft routing, evolving planner with SLO guard, "
        "branch-count eviction, decode bound at prefill start, decoupled switching)",
    )
    pol.add_argument("--routing", default=None,
                     help="prefill routing policy: ttft, cache-aware, dynamo-kv, round-robin, sticky (default: the set's)")
    pol.add_argument("--planner", default=None, help="planner: static, evolving, dynamo, arrow (default: the set's)")
    pol.add_argument("--eviction", default=None, choices=EVICTIONS, help="host (L2) eviction (default: the set's)")
    pol.add_argument(
        "--decode-binding",
        default=None,
        choices=DECODE_BINDINGS,
        help="when the decode node is chosen: enqueue (at dispatch, KV reserved while queued: SGLang PD), prefill-start "
        "(when the prefill starts: paper Eq. 7), route (at dispatch, reserved at hand-off) (default: the set's: prefill-start "
        "for evolving and arrow, enqueue for static and dynamo)"
        + ("; live: enqueue and route = the router's dispatch binding" if live else ""),
    )
    pol.add_argument("--planner-opt", action="append", metavar="K=V",
                     help="planner parameter, repeatable (e.g. t_learn_s=900 window_s=600 slo_guard=false)")
    pol.add_argument("--routing-opt", action="append", metavar="K=V",
                     help="routing policy option, repeatable: a knob of the router's policies as `python -m services.router "
                     "--help` lists it, e.g. ttft_fetch_min_tokens=64 ttft_fetch_base_s=0.02 (paper Eq. 7's fetch model "
                     "τ(x)) cache_threshold=0.5"
                     + ("; units as the router's --help gives them (ttft_state_max_age_s: wall s x --speedup); profile "
                        "and block_size come from --profile and --block-size" if live
                        else "; *_s in simulated seconds; profile, block_size and seed come from --profile, --block-size "
                        "and --seed"))
    pol.add_argument("--decode-routing", default=None, choices=ROUTING_DECODE,
                     help="which decode node a request is bound to (not when: --decode-binding): round-robin (SGLang Model "
                     "Gateway's PD mode, the baselines') or least-loaded (the routing policy's own rule) (default: the "
                     "set's: least-loaded for evolving, round-robin for static, dynamo and arrow)"
                     + ("; live: the router's --decode-routing, each router keeping its own turn" if live else ""))
    return pol


class LivePolicy(FrozenValue):
    """What a live cluster runs for a policy set with overrides (the services' flags)."""

    name: str
    routing: str
    planner: str
    planner_args: tuple[str, ...]
    """``key=value`` items for the planner's ``--planner-args``."""
    eviction: str
    decode_binding: str
    """The router's ``--decode-binding``: ``prefill-start`` or ``dispatch``."""
    decode_routing: str
    """(default ``least-loaded``) The router's ``--decode-routing``: ``least-loaded`` (the routing policy's own
    rule) or ``round-robin`` (the baselines', ``services.router.policy.RoundRobinDecode``)."""
    split: str | None
    """The set's split (``static:4P5D``), None = the command's ``--split``."""
    router_args: tuple[str, ...]
    """(default ``()``) The router's flags for ``--routing-opt`` (e.g. ``("--ttft-fetch-min-tokens", "64")``)."""
    notes: tuple[str, ...]
    """(default ``()``) Where the live cluster differs from what the set asks."""

    __slots__ = __match_args__ = (
        "name", "routing", "planner", "planner_args", "eviction", "decode_binding", "split", "router_args", "notes",
        "decode_routing",
    )

    def __init__(
        self, name: str, routing: str, planner: str, planner_args: tuple[str, ...], eviction: str,
        decode_binding: str, split: str | None, router_args: tuple[str, ...] = (), notes: tuple[str, ...] = (),
        decode_routing: str = "least-loaded",
    ) -> None:
        set_field(self, "name", name)
        set_field(self, "routing", routing)
        set_field(self, "planner", planner)
        set_field(self, "planner_args", planner_args)
        set_field(self, "eviction", eviction)
        set_field(self, "decode_binding", decode_binding)
        set_field(self, "split", split)
        set_field(self, "router_args", router_args)
        set_field(self, "notes", notes)
        set_field(self, "decode_routing", decode_routing)

    def describe(self) -> str:
        """One line for the command's output. The binding is named as ``--decode-binding`` takes it: the router's
        ``dispatch`` is what ``enqueue`` and ``route`` both run live (printed bare, a user passing it back got an
        argparse error). A round-robin decode routing is named after the routing (the routing policy's own rule,
        least-loaded, is not)."""
        opts = f" ({', '.join(self.planner_args)})" if self.planner_args else ""
        ropts = f" ({' '.join(self.router_args)})" if self.router_args else ""
        if self.decode_routing != "least-loaded":
            ropts += f", decode routing {self.decode_routing}"
        binding = "at dispatch (enqueue / route)" if self.decode_binding == "dispatch" else self.decode_binding
        return (f"policy {self.name}: routing {self.routing}{ropts}, planner {self.planner}{opts}, eviction {self.eviction}, "
                f"decode binding {binding}")

    def meta(self) -> dict[str, Any]:
        """For ``report.json``'s ``meta.policy``."""
        return {"name": self.name, "routing": self.routing, "planner": self.planner, "planner_args": list(self.planner_args),
                "eviction": self.eviction, "decode_binding": self.decode_binding, "decode_routing": self.decode_routing,
                "router_args": list(self.router_args),
                "notes": list(self.notes)}


def live_policy(args: argparse.Namespace, *, planner_defaults: dict[str, Any] | None = None) -> LivePolicy:
    """The live mapping of ``args.policy`` with the overrides (see the module docstring).

    Args:
        planner_defaults: planner parameters a command sets unless ``--planner-opt`` does
            (the demo's shorter warm-up); used only when the planner is ``evolving``.

    Raises:
        UsageError: (a SystemExit, status 2) an unknown set, component, malformed ``--planner-opt`` or a ``--routing-opt``
            that is not a router policy option or not a valid value of it (with the reason).
    """
    from evolving_infra.cli import UsageError
    from services.planner.policy import PLANNERS
    from services.router.policy import policy_names

    try:
        ps = with_overrides(policy_set(args.policy), routing=args.routing, planner=args.planner, eviction=args.eviction,
                            decode_binding=args.decode_binding, decode_routing=getattr(args, "decode_routing", None))
        opts = parse_key_values(args.planner_opt or [], "--planner-opt")
        router_args = routing_option_args(parse_key_values(args.routing_opt or [], "--routing-opt"))
        check_planner_options(ps.planner, opts)
    except (PolicyError, ValueError) as e:
        raise UsageError(f"error: {e}") from None
    notes = []
    given = getattr(args, "split", None)
    if given is not None and (served := serving(ps, given)) is not ps:  # static:5P1D --split 3P1D serves static:3P1D
        notes.append(f"--split {served.split} overrides policy {ps.name}'s split: served and named {served.name}")
        ps = served
    if ps.routing not in policy_names():
        raise UsageError(f"error: routing policy {ps.routing!r} is not registered; known: {', '.join(policy_names())}")
    if ps.planner not in PLANNERS:
        raise UsageError(f"error: planner {ps.planner!r} is not known; known: {', '.join(PLANNERS)}")
    if ps.planner == "evolving" and planner_defaults:
        opts = {**planner_defaults, **opts}
    if ps.switch_mode not in ("decoupled", "none"):
        notes.append(f"switch mode {ps.switch_mode}: live workers switch in place keeping their KV (decoupled)")
    binding = "prefill-start" if ps.decode_binding == "prefill-start" else "dispatch"
    items = tuple(f"{k}={_fmt(v)}" for k, v in opts.items())
    return LivePolicy(name=ps.name, routing=ps.routing, planner=ps.planner, planner_args=items, eviction=ps.eviction,
                      decode_binding=binding, router_args=router_args, split=ps.split, notes=tuple(notes),
                      decode_routing=ps.decode_routing)


def _planner_params(planner: str) -> type | None:
    """The parameter dataclass of planner ``planner`` (``EvolvingParams``, ``DynamoParams``, ``ArrowParams``);
    None for a planner without one (``static``) or one not known here."""
    if planner == "evolving":
        from services.planner.evolving import EvolvingParams

        return EvolvingParams
    if planner in ("dynamo", "arrow"):
        from services.planner.baselines import ArrowParams, DynamoParams

        return DynamoParams if planner == "dynamo" else ArrowParams
    return None


def check_planner_options(planner: str, options: Mapping[str, Any]) -> None:
    """Check the types and values of ``--planner-opt`` items for ``planner`` against its parameter dataclass, as
    ``--routing-opt`` values are checked against the router's config: ``t_learn_s=abc`` ran into the planner's own
    checks as "'<' not supported between instances of 'str' and 'int'", and ``slo_guard=maybe`` (a str, truthy)
    ran the SLO guard on. The values themselves are left as given (an int for a float field stays an int).

    Args:
        planner: the planner's name (``evolving``, ``dynamo``, ``arrow``; others are not checked here).
        options: name → value as ``parse_key_values`` decoded it. Names the planner does not take are left to
            the planner's own error (``params_from``: the list of valid names; a sweep drops them per item).

    Raises:
        ValueError: ``--planner-opt KEY=VALUE: <reason> (planner NAME)``: a value of the wrong type (an int for a
            float field is fine; a bool, a str or a float for an int field is not) or one the dataclass refuses.
    """
    import dataclasses

    import msgspec

    cls = _planner_params(planner)
    if cls is None:
        return
    fields = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in options.items() if k in fields}
    if not given:  # nothing to check (the defaults are the planner's own; converting {} resolved the dataclass's
        return  # annotations, ~4 M instructions of every simulate)
    for key, value in given.items():  # each alone first, so the message names the item at fault
        try:
            msgspec.convert({key: value}, cls)
        except msgspec.ValidationError as e:
            reason = str(e).replace("`", "")
            if f"$.{key}" in reason:
                raise ValueError(f"--planner-opt {key}={_fmt(value)}: {reason} (planner {planner})") from None
    try:  # then together (checks across fields, e.g. min_slices <= slices)
        msgspec.convert(given, cls)
    except msgspec.ValidationError as e:
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in given.items())
        raise ValueError(f"--planner-opt {shown}: {str(e).replace('`', '')} (planner {planner})") from None


ROUTER_OWN_FLAGS = {"profile": "--profile", "block_size": "--block-size"}
"""Policy options the live cluster sets from its own flags (``--profile``, ``--block-size``) → that flag."""

UP_SETS_FOR_ITS_ROUTER = frozenset({
    "instance", "clock_origin", "port_file", "nats_creds", "metrics_port", "metrics_host", "log_format", "profile_clock",
    "model_names", "model_aliases", "listen_fd", "metrics_fd",
})
"""Router settings without a flag of ``up``'s own name that ``up`` gives its router on the command line (from its
other flags, or one per process; ``listen_fd``, ``metrics_fd``: the listening sockets it holds): an ``EI_*`` variable of the same
name would not reach it."""

UP_SETS_WITH_TORCH = frozenset({"max_context_tokens", "model_vocab_size"})
"""Router settings ``up`` gives its router on the command line only with ``--engine torch`` (from the model's
config); with the simulated engine the router reads them from the environment it inherits."""

NATS_CONNECTION_KEYS = frozenset({"nats_user", "nats_password", "nats_tls_ca", "nats_tls_cert", "nats_tls_key"})
"""Every service's NATS connection settings that ``up`` drops from its services' environment under its embedded
nats-server (``evolving_infra.cluster.NATS_CONNECTION_ENV``) and passes on with ``--nats-url``."""


def _not_a_policy_option(key: str, value: Any, known: Sequence[str]) -> str:
    """The reason ``--routing-opt key=value`` is refused when ``key`` is not a routing policy option: a newcomer
    reaching for the router's ``--shutdown-grace-s`` (which the README sends to ``EI_SHUTDOWN_GRACE_S``) was told
    only that it is not an option, with the list of those that are."""
    from evolving_infra.cli import build_parser
    from services.router.config import RouterConfig
    from shared.config import env_name, flag_name

    tail = f"routing policy options: {', '.join(known)}"
    if key not in RouterConfig.__struct_fields__:
        return f"--routing-opt {key}: not a routing policy option; known: {', '.join(known)}"
    sub = next(a for a in build_parser("up")._actions if isinstance(a, argparse._SubParsersAction))
    if flag_name(key) in {s for a in sub.choices["up"]._actions for s in a.option_strings}:
        return f"--routing-opt {key}: a router setting, not a routing policy option: set it with {flag_name(key)}; {tail}"
    if key in UP_SETS_FOR_ITS_ROUTER:
        return f"--routing-opt {key}: a router setting that up and demo set for their router themselves; {tail}"
    env = env_name(key)
    if key in NATS_CONNECTION_KEYS:
        shown = "..." if key == "nats_password" else _fmt(value)
        return (f"--routing-opt {key}: a NATS connection setting of every service, not a routing policy option: with "
                f"the embedded nats-server up and demo drop {env} from their services' environment (the cluster's own "
                f"credentials are used); for a server of your own, {env}={shown} evolving-infra up --nats-url URL "
                f"passes it on; {tail}")
    if key in UP_SETS_WITH_TORCH:
        return (f"--routing-opt {key}: a router setting ({flag_name(key)}), not a routing policy option: up and demo "
                f"set it for their router from the model with --engine torch; with the simulated engine the router "
                f"reads it from the environment it inherits, {env}={_fmt(value)} evolving-infra up; {tail}")
    return (f"--routing-opt {key}: a router setting ({flag_name(key)}), not a routing policy option: the router up and "
            f"demo start reads it from the environment it inherits, {env}={_fmt(value)} evolving-infra up; {tail}")


def resolve_routing_options(
    options: dict[str, Any],
    own: Mapping[str, str],
    not_an_option: Callable[[str, Any, Sequence[str]], str] | None = None,
) -> RouterConfig:
    """Check routing policy options (``--routing-opt K=V``) the way the router's config reads them; the one check
    behind ``up``/``demo`` (:func:`routing_option_args`) and ``simulate`` (``evolving_infra.sim.config``).

    Args:
        options: option name (a key of ``RouterConfig.policy_options``) → value (``parse_key_values``'s types).
        own: options the command sets from its own flags → that flag (refused here: it would override the
            command's value in the router alone).
        not_an_option: the reason for a name that is not a policy option, given ``(key, value, known)``;
            None: ``"not a routing policy option; known: ..."``.

    Returns:
        The router's config with ``options`` applied over its defaults (no environment read).

    Raises:
        ValueError: a name that is not a routing policy option, one of ``own``, or a value the router's config
            refuses (wrong type, out of range), with the reason.
    """
    from services.router.config import RouterConfig
    from shared.config import ConfigError, resolve_config

    if not options:  # the defaults (what resolve_config gives for no value; simulate's usual case, without
        return RouterConfig()  # resolving the config's ~80 annotations: ~45 M instructions, 0.5% of a 600-s run)
    known = sorted(set(RouterConfig().policy_options()) - set(own))
    for key in options:
        if key in own:
            raise ValueError(f"--routing-opt {key}: set it with {own[key]}")
        if key not in known:
            if not_an_option is not None:
                raise ValueError(not_an_option(key, options[key], known))
            raise ValueError(f"--routing-opt {key}: not a routing policy option; known: {', '.join(known)}")
    try:
        return resolve_config(RouterConfig, dict(options), env={})
    except ConfigError as e:
        raise ValueError(f"--routing-opt: {e}") from None


def routing_option_args(options: dict[str, Any]) -> tuple[str, ...]:
    """The router's command-line flags for routing policy options (``--routing-opt K=V``).

    Args:
        options: option name (a key of ``RouterConfig.policy_options``, ``-`` read as ``_``) →
            value (``parse_key_values``'s types), e.g. ``{"ttft_fetch_min_tokens": 64}``.

    Returns:
        ``("--ttft-fetch-min-tokens", "64", ...)``, in ``RouterConfig``'s field order, each value
        as the router's config read it (``1`` for a float option becomes ``1.0``).

    Raises:
        ValueError: a name that is not a routing policy option (or one the cluster sets from
            its own flag, :data:`ROUTER_OWN_FLAGS`), or a value the router's config refuses (wrong type, out of range).
    """
    from services.router.config import RouterConfig
    from shared.config import flag_name

    cfg = resolve_routing_options(options, ROUTER_OWN_FLAGS, _not_a_policy_option)
    return tuple(a for k in RouterConfig.__struct_fields__ if k in options for a in (flag_name(k), str(getattr(cfg, k))))


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    return str(v)
