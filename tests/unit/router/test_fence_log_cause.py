"""The router's 'node fenced out' warning names its cause: it said "no node.state within fence_after_s, or
restarted (its state sequence went back)" whichever it was, while the view knew (b0d2a76, 3cda2f1 give the
reason strings): ``cause`` is ``silent`` or ``restarted``, from :meth:`NodeLoadView.check_fences`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from services.router.config import RouterConfig
from services.router.nodes import NodeLoadView

from .helpers import state


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))


def test_the_fence_line_says_silent_or_restarted() -> None:
    from services.router.service import RouterService

    v = NodeLoadView(fence_after=3.0)
    v.apply_state(state("a", seq=40), 0.0)
    v.apply_state(state("b", seq=7), 0.0)
    v.apply_state(state("a", seq=1), 1.0)  # a new process under a's id, within the fence time
    (restarted,) = v.check_fences(1.1)
    v.apply_state(state("a", seq=2), 1.5)  # let back in
    (silent,) = v.check_fences(3.5)  # b: no state for 3.5 s > 3.0
    assert (restarted.node, restarted.cause, silent.node, silent.cause) == ("a", "restarted", "b", "silent")

    shell = SimpleNamespace(cfg=RouterConfig(fence_after_s=3.0), counters={"fenced": 0}, log=_Log(),
                            clock=SimpleNamespace(to_wall=lambda s: s))
    for f in (restarted, silent):
        RouterService._fence(shell, f)  # type: ignore[arg-type]
    (ev_r, kw_r), (ev_s, kw_s) = shell.log.lines
    assert (kw_r["node"], kw_r["cause"], kw_s["node"], kw_s["cause"]) == ("a", "restarted", "b", "silent")
    assert ev_r == "node fenced out: restarted (its state sequence went back)" and " or " not in ev_r
    assert ev_s == "node fenced out: no node.state within fence_after_s" and kw_s["silent_wall_s"] == 3.5
    assert shell.counters["fenced"] == 2
