"""up/demo --help's --engine listed sim and torch and not which one runs when it is left out (every other cluster
option of theirs names its default)."""

from __future__ import annotations

import pytest

from evolving_infra.cli import build_parser, main


@pytest.mark.parametrize("command", ["up", "demo"])
def test_engine_help_names_the_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    engine = text.rsplit("--engine {sim,torch}", 1)[1].split("--model MODEL_DIR", 1)[0]
    default = build_parser().parse_args([command]).engine
    assert f"{default} (profile-timed simulated GPU; the default)" in engine, engine
