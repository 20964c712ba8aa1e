"""``split set`` refusals: the planner's reply says whether the split itself was refused (the user's
error: ``split set`` exits 2, as every usage error) or only refused for now (the planner is starting:
exit 1, try again). Before, ``split set 5P1D`` on 4 nodes exited 1, as a runtime failure."""

from __future__ import annotations

import argparse
import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from shared import messages as m
from shared.split import SplitError, split_phases


class _Refusing:
    """What ``PlannerService._on_set`` touches, with a core whose ``set_split`` raises ``error``."""

    def __init__(self, error: Exception) -> None:
        def set_split(spec: str, now: float, reason: str) -> None:
            raise error

        self.core = SimpleNamespace(adopting=False, set_split=set_split)
        self.clock = SimpleNamespace(now=lambda: 0.0)
        self.counters = {"split.set.refused": 0}
        self.log = SimpleNamespace(warning=lambda *a, **k: None)


def _refusal(error: Exception) -> m.SplitSetReply:
    from services.planner.service import PlannerService

    return asyncio.run(PlannerService._on_set(_Refusing(error), m.SplitSetRequest(split="5P1D"), "split.set"))  # type: ignore[arg-type]


def test_the_planner_says_which_refusals_are_worth_a_retry() -> None:
    try:
        split_phases("5P1D", ["w0", "w1", "w2", "w3"])
    except SplitError as e:
        misfit = e
    reply = _refusal(misfit)
    assert (reply.ok, reply.retry) == (False, False) and "covers 6 nodes but the cluster has 4" in (reply.error or "")
    reply = _refusal(ValueError("the planner is starting: ...; try again in a few seconds"))
    assert (reply.ok, reply.retry) == (False, True)


def test_a_split_with_too_many_digits_is_the_users_error_not_a_retry() -> None:
    """``split set 999...9P1D`` (more digits than ``int`` takes, 4,300; the CLI's pattern lets any
    through): ``parse_split`` raised a plain ValueError, which the planner's reply took for a
    refusal for now (``retry``: exit 1, 'try again'). It is the split's own fault (exit 2)."""
    with pytest.raises(SplitError, match="4,300 digits"):
        split_phases("9" * 5000 + "P1D", ["w0", "w1"])
    try:
        split_phases("9" * 5000 + "P1D", ["w0", "w1"])
    except ValueError as e:
        reply = _refusal(e)
    assert (reply.ok, reply.retry) == (False, False)


class _Bus:
    def __init__(self, reply: m.SplitSetReply) -> None:
        self.reply = reply
        self.asked = 0
        self.timeouts: list[float] = []
        """Each try's ``timeout`` (s): how long the CLI would wait for it (and the planner may hold it)."""

    async def request(self, *a: Any, **k: Any) -> m.SplitSetReply:
        self.asked += 1
        self.timeouts.append(k["timeout"])
        return self.reply

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("retry, status", [(False, 2), (True, 1)])
def test_split_set_exits_2_on_a_refused_split_and_1_on_a_refusal_for_now(
    retry: bool, status: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    """A refusal of the split: exit 2 at the first answer. A refusal for now each time: asked again while the
    next try has the planner's hold and a margin (1.5 s) of ``--timeout`` (2 s here) left, then exit 1 saying so
    (before 46f3655: exit 1 at the first, with the refusal's text). Each try goes with at least 1.5 s to wait:
    before, the last went with what was left (down to 0.01 s), timed out at the CLI, and a starting planner
    applied it after the CLI had exited 1 (seen failing: a last timeout of ~0.05 s). Count-robust: tries come at
    ~0, 0.05, 0.15, 0.35 s (4), fewer on a stalled box, never 1 unless the first answer takes 0.45 s."""
    from evolving_infra import split_cli

    monkeypatch.setenv("EI_STATE_DIR", str(tmp_path))
    for var in ("EI_NATS_CREDS", "EI_NATS_USER", "EI_NATS_PASSWORD", "EI_NATS_AUTH"):
        monkeypatch.delenv(var, raising=False)
    reply = m.SplitSetReply(ok=False, error="split '5P1D' covers 6 nodes but the cluster has 4", retry=retry)

    bus = _Bus(reply)

    async def connect(*a: Any, **k: Any) -> _Bus:
        return bus

    monkeypatch.setattr(split_cli.Bus, "connect", connect)
    args = argparse.Namespace(split_command="set", split="5P1D", reason="operator", nats_url="nats://127.0.0.1:4222",
                              partition="p0", timeout=2.0, json=False, nats_creds="")
    t0 = time.monotonic()
    assert asyncio.run(split_cli._run(args)) == status
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    if not retry:
        assert bus.asked == 1
        assert err == "error: planner refused split '5P1D': split '5P1D' covers 6 nodes but the cluster has 4\n"
    else:
        assert bus.asked >= 2, bus.asked  # asked again (before 46f3655: once)
        assert min(bus.timeouts) >= m.ADOPTING_HOLD_S + split_cli.HELD_MARGIN_S, bus.timeouts  # none held past the end
        assert took < 2.0 - m.ADOPTING_HOLD_S, took  # ended at the last refusal, not at --timeout
        assert err == (f"error: the planner on partition 'p0' is starting: split '5P1D' refused for now {bus.asked} times "
                       f"in {bus.asked} tries within 2 s (not asked again with under 1.5 s of it left: a starting planner "
                       "holds a try up to 1 s, then may apply it); its last answer: split '5P1D' covers 6 nodes but the "
                       "cluster has 4; try again in a few seconds\n")


def test_split_set_help_lists_its_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    from evolving_infra.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser("split").parse_args(["split", "set", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 ok; 1 no planner answered within --timeout" in text and "or the planner refused for now" in text
    assert "2 the planner refused the split" in text and "answered within --timeout (asked again" in text


def test_split_get_help_does_not_promise_a_refusal_it_never_gives(capsys: pytest.CaptureFixture[str]) -> None:
    """``split get --help`` ended with set's statuses ('1 the planner refused for now'): get is never
    refused (a starting planner holds it until it knows the split): 1 only when no planner answered
    within --timeout (as ``split set``'s), 2 the user's (or the credentials') error."""
    from evolving_infra.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser("split").parse_args(["split", "get", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 ok; 1 no planner answered within --timeout" in text and "refused for now" not in text, text
    assert "; 2 a malformed --timeout" in text, text
