"""simulate --help's --decode-routing said only 'decode binding rule' (beside --decode-binding, which is when the
decode node is chosen, not which) and neither it nor --switch-mode said its default; both now name each policy
set's, read here from the sets themselves."""

from __future__ import annotations

import pytest

from evolving_infra.cli import main
from evolving_infra.sim.policies import policy_set


def test_decode_routing_and_switch_mode_help_give_each_sets_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    routing = text.rsplit("--decode-routing {", 1)[1].split("--switch-mode", 1)[0]
    switch = text.rsplit("--switch-mode {", 1)[1].split("--switch-control-s", 1)[0]
    assert "not when: --decode-binding" in routing
    for name in ("evolving", "static", "dynamo", "arrow"):
        ps = policy_set(name)
        assert f"{ps.decode_routing} for" in routing and name in routing.split(f"{ps.decode_routing} for", 1)[1], name
        assert f"{ps.switch_mode} for {name}" in switch, (name, ps.switch_mode)
