"""The live planner loads SciPy (the fits' NNLS) in a thread from its start, not at import and not
in its first fit (``services/planner/fit.py`` imports it lazily for the simulator): the import's ~1 s
of CPU inside the planning tick at the end of the warm-up delayed that switch by ~1 s of wall time
(41 simulated s in ``make demo``, commit 83dec69), and at import it delayed every planner start by
that second (``import services.planner.__main__``: 2.1 → 1.2 s wall here, median of 5)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Runs in a fresh interpreter (this process has SciPy loaded by other tests). Starts the service on
# a shell holding what ``PlannerService.start`` touches; a meta-path spy notes which thread imports SciPy.
_START = textwrap.dedent(
    """
    import asyncio, sys, threading
    from types import SimpleNamespace

    import structlog

    import services.planner.__main__
    from services.planner.service import SCIPY_MODULE, PlannerService
    from shared.service import BackgroundTasks

    assert SCIPY_MODULE not in sys.modules, "importing the planner loaded SciPy"
    importers = []

    class Spy:  # notes the thread that imports SCIPY_MODULE, finds nothing itself
        def find_spec(self, name, path=None, target=None):
            if name == SCIPY_MODULE:
                importers.append(threading.get_ident())
            return None

    sys.meta_path.insert(0, Spy())

    class Bus:
        async def subscribe(self, *a, **k): pass
        async def serve(self, *a, **k): pass
        async def publish(self, *a, **k): pass

    async def nothing(*a, **k):
        pass

    async def idle():
        await asyncio.Event().wait()

    async def main():
        log = structlog.get_logger("test")
        shell = PlannerService.__new__(PlannerService)  # no profile, policy or registry: only start()'s needs
        shell.bus, shell.log, shell._bg = Bus(), log, BackgroundTasks(log, {})
        shell.core, shell.cfg = SimpleNamespace(adopting=True), SimpleNamespace(adopt_grace_s=3.0)
        shell._publish_models = nothing
        shell._announce_loop = shell._tick_loop = idle
        await shell.start()
        load = [t for t in shell._bg._all if t.get_name() == "planner-load-scipy"]
        assert len(load) == 1, [t.get_name() for t in shell._bg._all]
        await load[0]
        assert SCIPY_MODULE in sys.modules
        assert importers and threading.main_thread().ident not in importers, importers
        await shell._bg.stop()

    asyncio.run(main())
    print("ok")
    """
)


def test_the_planner_loads_scipy_in_a_thread_from_its_start_not_at_import():
    p = subprocess.run([sys.executable, "-c", _START], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), (p.stdout[-1000:], p.stderr[-2000:])


def test_the_fit_module_alone_does_not():
    code = "import sys, services.planner.fit; assert 'scipy.optimize' not in sys.modules"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
