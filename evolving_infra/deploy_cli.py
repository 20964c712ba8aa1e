"""``evolving-infra deploy-args SERVICE [up's flags]``: one service's flags for the deploy scripts.

Compose's entrypoint (``deploy/docker/entrypoint.sh``) and the Slurm batch script
(``deploy/slurm/evolving-infra.sbatch``) start each service themselves; they ask this command
which flags say the serving system (``--policy SET`` with its overrides), the engine and the
profile, so that they run what ``evolving-infra up`` runs for the same flags: the same
``launcher._spec`` reads them (policy vocabulary, split default, ``--engine torch``'s profile,
tokenizer, model name and context) and the same ``cluster.service_flags`` writes them.
Before, compose ran the services' defaults (planner static, LRU eviction, cache-aware routing)
and Slurm the same but ttft routing, whatever ``up`` runs (the evolving set).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import sys

from evolving_infra.cluster import SERVICES, service_flags, warms_up_collocated


def deploy_args(argv_up: list[str], service: str) -> tuple[list[str], str]:
    """``service``'s flags for ``up``'s flags ``argv_up`` (without ``up``), and the policy line ``up`` prints.

    Args:
        argv_up: ``up``'s flags, e.g. ``["--policy", "static:2P2D", "--nodes", "4"]``.
        service: one of ``cluster.SERVICES``, or ``env``: shell assignments (``EI_DEPLOY_SPLIT``,
            ``EI_DEPLOY_LAUNCH_SPLIT``, ``EI_DEPLOY_PROFILE``, ``EI_DEPLOY_BLOCK_SIZE``, ``EI_DEPLOY_POLICY``), one a
            line, quoted for ``sh``. ``EI_DEPLOY_LAUNCH_SPLIT`` is the split the workers' ``--phase`` come from:
            ``collocated`` while the evolving planner's warm-up serves every node ``both``
            (``cluster.launch_phases``, as ``up`` launches them), else ``EI_DEPLOY_SPLIT``.

    Returns:
        (lines to print, one argv item or assignment each; ``up``'s policy line with its notes).

    Raises:
        UsageError: (status 2) what ``up`` refuses for the same flags (an unknown set, a split that does not fit
            the nodes, a block size not the profile's, a bad model folder, a KV size, dtype or trace endpoint up
            refuses), or a value holding a newline; argparse's refusals (an unknown flag, a value not a number or
            not one of the choices) as its one error line, without the usage lines.
    """
    from evolving_infra.cli import UsageError, build_parser
    from evolving_infra.launcher import _spec

    err = io.StringIO()
    try:  # argparse's own refusal (a bad number or choice) as one line too: the scripts log only the last line
        with contextlib.redirect_stderr(err):
            args = build_parser("up").parse_args(["up", *argv_up])
    except SystemExit as e:
        if e.code == 0:
            raise
        raise UsageError(err.getvalue().strip().splitlines()[-1]) from None
    spec = _spec(args, one_host=False)  # each service in its own container or on its own host: EI_METRICS_PORT is fine
    pol = args.live_policy
    line = pol.describe() + "".join(f"\n  note: {n}" for n in pol.notes)
    if service == "env":
        launch = "collocated" if warms_up_collocated(spec.planner, spec.planner_args) else spec.split
        values = {"EI_DEPLOY_SPLIT": spec.split, "EI_DEPLOY_LAUNCH_SPLIT": launch, "EI_DEPLOY_PROFILE": spec.profile,
                  "EI_DEPLOY_BLOCK_SIZE": str(spec.block_size), "EI_DEPLOY_POLICY": pol.describe()}
        return [f"{k}={shlex.quote(v)}" for k, v in values.items()], line
    items = service_flags(spec, service)
    if bad := [a for a in items if "\n" in a]:
        raise UsageError(f"error: {bad[0]!r} holds a newline; deploy-args prints one flag a line")
    return items, line


def cmd_deploy_args(args: argparse.Namespace) -> int:
    """Print ``args.service``'s flags one a line on stdout, the policy line on stderr (the service's log; not for
    ``env``); with ``-h``/``--help`` among the flags, deploy-args' own help (argparse's REMAINDER hands them to
    up's parser, which printed up's help instead)."""
    if any(a in ("-h", "--help") for a in args.up_args):  # REMAINDER took it: up's parser printed up's help
        args.deploy_parser.print_help()
        return 0
    lines, policy = deploy_args(args.up_args, args.service)
    if args.service != "env":
        print(f"{args.service}: {policy}", file=sys.stderr)
    for item in lines:
        print(item)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``deploy-args`` to the CLI."""
    p = sub.add_parser(
        "deploy-args",
        help="one service's flags for --policy/--engine as `up` sets them (compose's entrypoint, the Slurm script)",
        description="Print, one a line, the flags that `evolving-infra up` would give SERVICE for the same flags: the "
        "policy set's part (--policy SET and its overrides: router --routing and --decode-binding, planner --planner, "
        "--planner-args and the split, workers --host-eviction), the KV directory's --routers (the one router, router, "
        "whose republish it waits for after a restart), the profile, block size, tokenizer, served name, the "
        "workers' KV sizes, request logging, trace export, the liveness time (--fence-after-s: router --fence-after-s, "
        "planner --silent-after-s) and, with --engine torch --model DIR, the model folder, "
        "dtype, context limit and vocabulary size. `env` prints EI_DEPLOY_SPLIT, "
        "EI_DEPLOY_PROFILE, EI_DEPLOY_BLOCK_SIZE and EI_DEPLOY_POLICY as sh assignments. The policy line goes to "
        "stderr (not for env). deploy/docker/entrypoint.sh and deploy/slurm/evolving-infra.sbatch start every service with these.",
        epilog="UP_FLAGS: any of `evolving-infra up --help`'s; those that pick the system matter here (--policy, "
        "--routing, --planner, --eviction, --decode-binding, --planner-opt, --routing-opt, --nodes, --split, "
        "--profile, --block-size, --engine, --model, --tokenizer, --served-model-name, --dtype, --gpu-kv-tokens, "
        "--host-kv-tokens, --log-requests, --otlp-traces-endpoint, --fence-after-s). Example: evolving-infra deploy-args planner "
        "--policy static:2P2D --nodes 4",
    )
    p.add_argument("service", choices=(*SERVICES, "env"), help="the service whose flags to print, or env")
    rest = p.add_argument("up_args", nargs=argparse.REMAINDER, metavar="UP_FLAGS", help="up's flags (none: up's defaults)")
    # argparse marks a REMAINDER positional required, so `deploy-args` alone said "required: service, UP_FLAGS";
    # none is fine (`deploy-args router`), and the parse is the same (REMAINDER takes an empty list)
    rest.required = False
    p.set_defaults(func=cmd_deploy_args, deploy_parser=p)
