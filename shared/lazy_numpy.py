"""numpy imported on first use: ``np`` for modules that a run may import without calling numpy.

numpy's import is ~65 ms of CPU (~230 M instructions, ~3.4% of a 600-s ``simulate`` at 512-token
blocks with its trace cache warm) and such a run calls it nowhere: its trace is read from the
cache's pack without numpy, its report's means and percentiles are computed in Python
(``evolving_infra.report.metrics``). Modules on that path write::

    from typing import TYPE_CHECKING

    if TYPE_CHECKING:
        import numpy as np
    else:
        from shared.lazy_numpy import np

and use ``np`` as before. The first attribute read (``np.asarray``) imports numpy and puts the module
itself in place of this object in the reading module's globals, so every later ``np.x`` there is a
plain module attribute read (no indirection after the first).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["np"]


class _LazyNumpy:
    """Stands for the ``numpy`` module until its first attribute read (module docstring).

    Raises:
        ImportError: numpy is not installed (at the first attribute read, not at import).
    """

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        import numpy

        g = sys._getframe(1).f_globals  # the module whose code read np.<name>: bind the real module there
        if g.get("np") is self:
            g["np"] = numpy
        return getattr(numpy, name)

    def __repr__(self) -> str:
        return "<numpy, imported on first use (shared.lazy_numpy)>"


np: Any = _LazyNumpy()
"""The lazily imported ``numpy`` (module docstring)."""
