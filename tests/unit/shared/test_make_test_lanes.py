"""``make test``'s two lanes (tests/conftest.py): the files of ``REST_LANE_LIVE_FILES`` run in ``rest``, every other
file under tests/e2e and tests/integration in ``live``, everything else in ``rest``; and every listed file exists
(a renamed or deleted one would leave its entry naming nothing, and the file back in the live lane unnoticed)."""

from __future__ import annotations

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
