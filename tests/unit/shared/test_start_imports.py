"""What a service imports before it starts (``python -X importtime -c 'import services.X.__main__'``).

Every e2e test starts five service processes and a supervisor restarts a killed one, so each
import at start is paid again and again. ``shared.metrics`` loads uvicorn and Starlette (~0.1 s)
only to serve ``--metrics-port``, off by default (and off in ``LocalCluster``): the KV directory,
the planner and the workers start without them (the router serves HTTP and imports them itself).
"""

from __future__ import annotations

import subprocess
import sys

_CODE = """
import sys
import services.kvdirectory.__main__, services.planner.__main__, services.worker.__main__
loaded = sorted(m for m in ("uvicorn", "starlette") if m in sys.modules)
assert not loaded, f"imported at start: {loaded}"
from shared.metrics import metrics_response, make_registry
assert metrics_response(make_registry()).status_code == 200 and "starlette" in sys.modules
print("ok")
"""


def test_services_without_a_metrics_port_start_without_uvicorn_or_starlette():
    p = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), (p.stdout[-1000:], p.stderr[-2000:])
