"""``report.metrics._pct`` is ``float(np.percentile(values, q))`` and ``report.metrics._mean`` is
``float(np.mean(values))`` bit for bit, without numpy (a ``simulate`` whose trace comes from the cache imports none)
nor ``np.percentile``'s import of ``numpy.ma``."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

from evolving_infra.report import metrics
from evolving_infra.report.metrics import _mean, _pct

QS = (0, 1, 5, 10, 25, 33.3, 50, 66.7, 75, 90, 95, 99, 99.9, 100)


@pytest.fixture(params=[True, False], ids=["numpy-loaded", "without-numpy"])
def numpy_loaded(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways of ``_pct`` and ``_mean``: on numpy arrays when numpy is imported already, else in Python."""
    monkeypatch.setattr(metrics, "_numpy_loaded", lambda: request.param)
    return request.param


def _numpy(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q))


def _samples(rng: random.Random) -> list[list[float]]:
    out: list[list[float]] = [[0.0], [1.5], [0.0, 0.0], [2.0, 1.0], [1e-300, 1e300], [5e-324, 0.0, 5e-324]]
    for _ in range(2000):
        n = rng.choice((1, 2, 3, 4, 5, 7, 10, 19, 20, 21, 100, 101, 999, 4000))
        kind = rng.randrange(6)
        if kind == 0:  # latencies: log-spread positive seconds
            v = [10 ** rng.uniform(-6, 3) for _ in range(n)]
        elif kind == 1:  # many exact ties and zeros (queue times)
            v = [rng.choice((0.0, 0.0, 0.0, 0.125, 1.0 / 3, 7.5)) for _ in range(n)]
        elif kind == 2:  # values a run computes: differences of sums of simulated times
            v = [abs(sum(rng.uniform(0, 2) for _ in range(3)) - rng.uniform(0, 3)) for _ in range(n)]
        elif kind == 3:  # integers (token counts) as floats
            v = [float(rng.randrange(0, 50_000)) for _ in range(n)]
        elif kind == 4:  # wide magnitudes
            v = [rng.uniform(0, 1) * 10 ** rng.randrange(-300, 300) for _ in range(n)]
        else:  # negatives, -0.0, infinities and NaN: numpy's own path
            v = [rng.choice((-1.0, -0.0, 0.0, 2.5, float("inf"), -float("inf"), float("nan"), rng.uniform(-5, 5)))
                 for _ in range(n)]
        out.append(v)
    return out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's own, on inf - inf
def test_pct_is_numpys_percentile_bit_for_bit_over_many_inputs(numpy_loaded: bool) -> None:
    rng = random.Random(20261206)
    checked = 0
    for values in _samples(rng):
        for q in (*QS, rng.uniform(0, 100)):
            want, got = _numpy(values, q), _pct(values, q)
            assert repr(got) == repr(want), (values[:10], len(values), q, got, want)  # repr tells -0.0 and nan apart
            checked += 1
    assert checked > 25_000
    assert _pct([], 50) is None


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("values", [[0.0, -0.0, 0.0], [-0.0], [1.0, float("nan")], [-2.0, 1.0]])
def test_pct_takes_numpys_path_for_nan_and_sign_bits(values, numpy_loaded: bool) -> None:
    for q in QS:
        assert repr(_pct(values, q)) == repr(_numpy(values, q))


def test_pct_refuses_a_percentile_outside_0_100_as_numpy_does() -> None:
    import numpy as np
    import pytest

    from evolving_infra.report.metrics import _pct

    for q in (-1, 101, float("nan")):
        with pytest.raises(ValueError):
            np.percentile([1.0, 2.0], q)
        with pytest.raises(ValueError, match="range"):
            _pct([1.0, 2.0], q)
    assert type(_pct([1.0, 2.0, 3.0], np.float64(50))) is float


def test_pct_leaves_numpy_ma_unimported() -> None:
    # (a simulate --no-plots report: with plots, matplotlib imports numpy.ma anyway)
    code = ("import sys; from evolving_infra.report.metrics import _pct; _pct([3.0, 1.0, 2.0], 95); "
            "print('numpy.ma' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's own, on inf - inf
def test_mean_is_numpys_mean_bit_for_bit_over_many_inputs(numpy_loaded: bool) -> None:
    # numpy's pairwise sum: one running sum below 8 values, eight up to 128, halves (multiples of 8) above
    rng = random.Random(20261207)
    samples = _samples(rng)
    for _ in range(600):
        n = rng.choice((6, 7, 8, 9, 15, 16, 17, 127, 128, 129, 130, 136, 255, 256, 257, 1000, 3981, 8191, 8192, 8193,
                        16_385, 20_000, rng.randrange(1, 300), rng.randrange(1, 30_000)))
        kind = rng.randrange(4)
        if kind == 0:
            v = [rng.random() for _ in range(n)]
        elif kind == 1:
            v = [rng.gauss(0, 1e3) for _ in range(n)]
        elif kind == 2:
            v = [rng.expovariate(1.0) * 10 ** rng.randrange(-5, 6) for _ in range(n)]
        else:
            v = [rng.randrange(0, 10**6) for _ in range(n)]  # ints, as token counts
        samples.append(v)
    for values in samples:
        want, got = float(np.mean(np.asarray(values, dtype=float))), _mean(values)
        assert repr(got) == repr(want), (values[:10], len(values), got, want)
    assert _mean([]) is None
    assert repr(_mean([-0.0])) == repr(float(np.mean(np.asarray([-0.0])))) == "0.0"


def test_pct_and_mean_leave_numpy_unimported() -> None:
    code = ("import sys; from evolving_infra.report.metrics import _mean, _pct; _pct([3.0, 1.0, 2.0], 95); "
            "_mean([1.0, 2.0]); print('numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
