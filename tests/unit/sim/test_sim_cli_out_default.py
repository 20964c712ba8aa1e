"""``simulate --out`` has a default as ``demo``, ``replay`` and ``fidelity`` have theirs (``COMMAND-out``
in the current folder): it alone required ``--out``."""

from __future__ import annotations

from pathlib import Path

import pytest

from evolving_infra.cli import build_parser, main

SAMPLE = Path(__file__).resolve().parents[3] / "evolving_infra" / "data" / "claude-code-sample.jsonl.gz"


def test_every_report_command_defaults_its_out_to_its_name_out(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("simulate", "demo", "replay", "fidelity"):
        argv = [command, "t.jsonl"] if command == "replay" else [command]
        assert build_parser(command).parse_args(argv).out == f"{command}-out", command
    with pytest.raises(SystemExit):
        build_parser("simulate").parse_args(["simulate", "--help"])
    assert "default simulate-out" in " ".join(capsys.readouterr().out.split())


def test_simulate_without_out_writes_simulate_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--trace", str(SAMPLE), "--duration", "5", "--no-plots"]) == 0
    assert "report: simulate-out/report.json" in capsys.readouterr().out
    assert (tmp_path / "simulate-out" / "report.json").is_file() and (tmp_path / "simulate-out" / "requests.jsonl").is_file()


def test_the_last_line_names_the_page_when_one_was_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """simulate, demo and replay ended with 'report: DIR/report.json' only; report.html, the page with the
    plots, went unnamed. It is named when written, not with --no-plots."""
    from evolving_infra.report.write import report_line

    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--trace", str(SAMPLE), "--duration", "5", "--out", "plotted"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "report: plotted/report.json  page: plotted/report.html"
    assert main(["simulate", "--trace", str(SAMPLE), "--duration", "5", "--no-plots", "--out", "bare"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "report: bare/report.json"
    assert report_line(Path("bare/report.json")) == "report: bare/report.json"
