"""The live planner loads SciPy at start-up, not in its first fit (``services/planner/fit.py``
imports it lazily for the simulator): the import's ~1 s of CPU inside the planning tick at the end
of the warm-up delayed that switch by ~1 s of wall time (41 simulated s in ``make demo``)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_planner_service_loads_scipy_optimize():
    code = "import sys, services.planner.service; assert 'scipy.optimize' in sys.modules"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_the_fit_module_alone_does_not():
    code = "import sys, services.planner.fit; assert 'scipy.optimize' not in sys.modules"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
