"""``make test``'s two lanes (tests/conftest.py): the files of ``REST_LANE_LIVE_FILES`` run in ``rest``, every other
file under tests/e2e and tests/integration in ``live``, everything else in ``rest``; and every listed file exists
(a renamed or deleted one would leave its entry naming nothing, and the file back in the live lane unnoticed); the
files that bound wall time stay live; each entry's reason starts with the file's seconds."""

from __future__ import annotations

import re

from tests.conftest import LIVE_DIRS, REPO, REST_LANE_LIVE_FILES, _lane


def _live_dir_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for d in LIVE_DIRS for p in (REPO / d).rglob("test_*.py"))


def test_every_listed_file_exists_under_a_live_dir_and_says_why():
    assert REST_LANE_LIVE_FILES
    for path, why in REST_LANE_LIVE_FILES.items():
        assert path.startswith(LIVE_DIRS), path
        assert (REPO / path).is_file(), f"{path} (REST_LANE_LIVE_FILES) does not exist: renamed? update the list"
        assert why.strip(), path


def test_the_listed_files_run_in_rest_and_every_other_live_dir_file_in_live():
    files = _live_dir_files()
    assert len(files) > len(REST_LANE_LIVE_FILES) + 50  # the glob found the live dirs
    for path in files:
        want = "rest" if path in REST_LANE_LIVE_FILES else "live"
        assert _lane(f"{path}::test_x") == want, path
        assert _lane(f"{path}::TestX::test_y[a::b]") == want, path
    assert _lane("tests/unit/shared/test_net.py::test_x") == "rest"
    assert _lane("tests/property/test_x.py::test_y") == "rest"
    assert _lane("tests/deploy/test_x.py::test_y") == "rest"


# Files whose assertions bound wall time tightly (well under ~30 s) or race it: they need the live lane's CPU
# priority, and must not be moved to ``rest`` to even the lanes (tests/conftest.py).
TIMED = {
    "tests/e2e/test_fidelity.py": "compares the live cluster's latencies with the simulator's",
    "tests/e2e/test_faults.py": "fenced within 5 s, a silent KV view marked stale within 1.5 s of the threshold",
    "tests/e2e/test_up_liveness.py": "a SIGSTOPped service killed 8-25 s after, no healthy one blamed past 10 s",
    "tests/e2e/test_up_router_socket.py": "a connection made during a drain answered 503 within 5 s",
    "tests/e2e/test_up_routers_races.py": "seven streams within a 20-s grace; 12 answers within one ~9.5-s stream",
    "tests/e2e/test_up_signals.py": "SIGTERMed 6 s after its start, up must have its handler (failed at nice +5 "
                                    "beside two burners: killed by the signal, -15)",
    "tests/integration/test_router_drain_live.py": "a router's exit within 8-10 s of its signal",
}


def test_files_that_bound_wall_time_stay_in_the_live_lane():
    for path, why in TIMED.items():
        assert (REPO / path).is_file(), f"{path} does not exist: renamed? update TIMED"
        assert _lane(f"{path}::test_x") == "live", f"{path} runs in rest, but it needs the live lane: {why}"


def test_every_reason_starts_with_the_files_seconds():
    """The conftest docstring's lane sums are these seconds added up: each reason says its file's time first."""
    for path, why in REST_LANE_LIVE_FILES.items():
        assert re.match(r"\d+ s( \(\d+ s burned\))?: ", why), (path, why)
