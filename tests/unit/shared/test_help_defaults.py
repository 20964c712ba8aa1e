"""Every option of every ``evolving-infra`` command says its default in ``--help`` (session 43's newcomer walk:
``model init --arch``, ``split set --reason``, ``simulate --tile`` / ``--partitions`` / ``--max-agents`` /
``--max-pause`` and the policy flag ``--decode-binding`` said nothing of what they do when left out)."""

from __future__ import annotations

import argparse

import pytest

from evolving_infra.cli import build_parser


def _options(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, argparse.Action]]:
    out: list[tuple[str, argparse.Action]] = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub, sp in a.choices.items():
                out += _options(sp, f"{name} {sub}")
        elif a.option_strings and a.help not in (None, argparse.SUPPRESS):
            out.append((name, a))
    return out


OPTIONS = _options(build_parser(), "evolving-infra")


def _says_default(help_text: str) -> bool:
    return "default" in help_text.lower() or "= all" in help_text or "= none" in help_text or "= never" in help_text


def test_every_option_with_a_value_default_names_it():
    """An option that takes a value and has a default other than 'unset' (None, '', 0, []) says it."""
    missing = [
        f"{cmd} {a.option_strings[-1]} (default {a.default!r})"
        for cmd, a in OPTIONS
        if a.nargs != 0 and a.default not in (None, "", 0, [], argparse.SUPPRESS) and not _says_default(str(a.help))
    ]
    assert not missing, missing


@pytest.mark.parametrize("flag", ["--routing", "--planner", "--eviction", "--decode-binding"])
def test_every_policy_override_says_its_default_is_the_sets(flag):
    sets = ("evolving-infra up", "evolving-infra demo", "evolving-infra simulate")
    helps = [str(a.help) for cmd, a in OPTIONS if cmd in sets and flag in a.option_strings]
    assert len(helps) == 3
    assert all("default: the set's" in h for h in helps), helps


@pytest.mark.parametrize("flag", ["--max-agents", "--max-pause"])
def test_simulate_input_caps_say_what_no_cap_is(flag):
    (a,) = [a for cmd, a in OPTIONS if cmd == "evolving-infra simulate" and flag in a.option_strings]
    assert "default" in str(a.help)


@pytest.mark.parametrize("action", ["get", "set"])
def test_split_json_help_says_what_is_printed(action):
    """``split get --json`` said "print the command as JSON": it prints the planner's answer, whose
    ``decided_at`` is on the cluster clock (simulated seconds under ``--speedup``)."""
    (a,) = [a for cmd, a in OPTIONS if cmd == f"evolving-infra split {action}" and "--json" in a.option_strings]
    assert "decided_at" in str(a.help) and "cluster-clock seconds" in str(a.help)


def test_auth_stream_help_puts_each_failure_under_its_exit_status(capsys):
    """``auth stream`` to a server that is down, or with credentials it refuses, exits 1 (measured: 'no connection
    to nats://127.0.0.1:1 in 2 s', 'refused the credentials of launcher'); its help gave "2 ... or no server",
    which reads as the unreachable server (split, tap and replay exit 2 for it). It meant no URL given."""
    with pytest.raises(SystemExit):
        build_parser("auth").parse_args(["auth", "stream", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "1 when it cannot be made (no connection within --timeout, " in text
    assert "credentials the server refuses, JetStream off or not allowed)" in text
    assert "no server given (neither --nats-url nor EI_NATS_URL)" in text


def test_replay_and_simulate_say_the_same_of_cap():
    """replay's --cap said "open loop: admission cap (0 = none)" (a cap of what?); simulate's said "most agents
    running at once", which is what both do (ReplayCore admits an open-loop agent only below it)."""
    helps = {cmd: str(a.help) for cmd, a in OPTIONS if "--cap" in a.option_strings}
    assert set(helps) == {"evolving-infra replay", "evolving-infra simulate"}
    assert all("most agents running at once" in h and "0 = no cap" in h for h in helps.values()), helps
