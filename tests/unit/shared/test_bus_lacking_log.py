"""``Bus._check_subjects`` logs the error line ``STREAM LACKS SUBJECTS: ...`` once for a lack (each reconnect to a
server with the same lacking stream checks again: before, each logged it again, reviewer rr-sec), again only when
the lack changes (another stream came back), and a check told not to log (``auth stream``'s, which reports it
itself) does not count as logged. ``stream_lacking`` (``/readyz``) is set by every check alike. Sans-IO: the check
reads only the stream's info."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import structlog

from shared.bus import Bus
from shared.subjects import Subjects
from tests.unit.shared.test_bus_stale_check import _Client


def _info(subjects: list[str]) -> Any:
    """A stream's info (``StreamInfo``) as the check reads it: its subjects."""
    return SimpleNamespace(config=SimpleNamespace(subjects=subjects))


def _lines(logs: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in logs if e.get("log_level") == "error" and "STREAM LACKS SUBJECTS" in e["event"]]


def test_the_same_lack_is_logged_once_a_new_one_again():
    bus = Bus(_Client(), Subjects("p0"), service="router", instance="r")  # type: ignore[arg-type]
    old = _info(["ei.p0.work.>", "ei.p0.req.*.out"])  # lacks req.*.out.* and others
    other = _info(["ei.p0.req.*.out.*"])  # lacks others
    with structlog.testing.capture_logs() as logs:
        assert bus._check_subjects(old, log=False)  # auth stream's: it reports it itself
        assert bus.stream_lacking and _lines(logs) == []
        said = bus.stream_lacking
        assert bus._check_subjects(old, log=True)  # a service's first: logged
        assert bus._check_subjects(old, log=True)  # a reconnect to the same stream: not again
        assert bus._check_subjects(old, log=True)
        assert bus.stream_lacking == said and _lines(logs) == ["STREAM LACKS SUBJECTS: " + said]
        assert bus._check_subjects(other, log=True)  # another lack: said
        assert bus.stream_lacking != said and _lines(logs)[1:] == ["STREAM LACKS SUBJECTS: " + bus.stream_lacking]
        assert not bus._check_subjects(_info(["ei.p0.>"]), log=True)  # whole: stream_lacking stays (restart it)
        assert bus._check_subjects(old, log=True)  # the first lack back: it changed again, said again
        assert len(_lines(logs)) == 3 and bus.stream_lacking == said
