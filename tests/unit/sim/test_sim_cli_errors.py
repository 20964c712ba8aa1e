"""``simulate`` input errors found while the run is set up are one ``error:`` line and exit
status 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from evolving_infra.cli import main

SAMPLE = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"


@pytest.mark.parametrize("extra", [[], ["--sweep", "policies", "dynamo,evolving"]], ids=["run", "sweep"])
def test_trace_arrivals_without_arrival_times_is_an_error_line(tmp_path: Path, capsys, extra: list[str]) -> None:
    """The shipped sample has agents without ``arrival_s``: ``--trace-arrivals`` cannot place them."""
    argv = ["simulate", "--trace", str(SAMPLE), "--trace-arrivals", "--duration", "5", "--no-plots", "--out", str(tmp_path / "o"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: arrival 'trace' needs arrival_s") and "Traceback" not in err
