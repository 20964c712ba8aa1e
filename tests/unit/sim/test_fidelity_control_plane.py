"""``evolving_infra.sim.fidelity.control_plane``: the live control plane measured from records."""

from __future__ import annotations

import pytest

from evolving_infra.report.records import RequestRecord
from evolving_infra.sim.fidelity import control_plane


def rec(i: int, prompt: int, ingress: float, engine: float, egress: float, **kw) -> RequestRecord:
    sent = 10.0 * i
    return RequestRecord(
        id=f"r{i}", agent="a", branch="b", sent_at=sent, prompt_tokens=prompt, ttft_s=ingress + engine + egress,
        node_arrived_at=sent + ingress, first_token_at=sent + ingress + engine, **kw,
    )


def test_ingress_is_fitted_against_the_prompt_and_egress_averaged():
    recs = [rec(i, p, 0.02 + 1e-6 * p, engine=0.3 * i, egress=0.01 + 0.002 * (i % 2)) for i, p in enumerate([1000, 5000, 20000, 80000])]
    cp = control_plane(recs)
    assert cp is not None and cp.requests == 4
    assert cp.ingress_s == pytest.approx(0.02) and cp.ingress_s_per_token == pytest.approx(1e-6)
    assert cp.egress_s == pytest.approx(0.011) and cp.ingress_mean_s == pytest.approx(0.02 + 1e-6 * 26500)


def test_the_client_first_token_leaves_out_the_admission_wait():
    recs = [rec(i, 100 * (i + 1), 0.05, engine=0.2, egress=0.01) for i in range(3)]
    waited = [RequestRecord(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "admission_wait_s": 5.0,
                               "ttft_s": r.ttft_s + 5.0}) for r in recs]
    assert control_plane(waited).egress_s == pytest.approx(0.01)  # type: ignore[union-attr]


def test_a_fit_without_growth_or_without_intercept_stays_non_negative():
    falling = [rec(i, p, 0.05 - 1e-7 * p, engine=0.1, egress=0.0) for i, p in enumerate([1000, 50000, 100000])]
    cp = control_plane(falling)
    assert cp is not None and cp.ingress_s_per_token == 0.0 and cp.ingress_s == pytest.approx(cp.ingress_mean_s)
    proportional = [rec(i, p, 2e-6 * p - 0.01 * (i == 0), engine=0.1, egress=0.0) for i, p in enumerate([10000, 50000, 100000])]
    cp = control_plane(proportional)
    assert cp is not None and cp.ingress_s == 0.0 and cp.ingress_s_per_token > 0


def test_records_without_the_node_times_are_not_measured():
    plain = [RequestRecord(id=f"r{i}", agent="a", branch="b", sent_at=0.0, ttft_s=0.5, prompt_tokens=10) for i in range(5)]
    assert control_plane(plain) is None
    failed = rec(1, 100, 0.05, engine=0.1, egress=0.01)
    failed.ok = False
    assert control_plane([rec(0, 100, 0.05, engine=0.1, egress=0.01), failed]) is None  # one measurable: no fit


@pytest.mark.timeout(60)  # --max-pause nan: the live replay never ended
@pytest.mark.parametrize("flag, value", [("--speedup", "0"), ("--speedup", "nan"), ("--max-pause", "nan"),
                                         ("--sessions", "0"), ("--concurrency", "0"), ("--nodes", "0"),
                                         ("--max-requests-per-branch", "-1")])
def test_fidelity_refuses_out_of_range_settings_before_starting(flag, value, tmp_path, capsys):
    """One 'error:' line naming the flag, exit 2, nothing started or written. --speedup 0 / nan started the
    live cluster, whose kvdirectory died with a config traceback (printed from its log, exit 1)."""
    from evolving_infra.cli import main

    out = tmp_path / "fid"
    assert main(["fidelity", "--out", str(out), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err and len(err.splitlines()) == 1, err
    assert not out.exists()
