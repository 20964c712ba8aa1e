"""Mooncake transfer engine on CPU: optional import, ports, one endpoint per process.

``mooncake.engine`` is optional. Nothing in ``services.worker.kvpool`` imports
it at module load; :func:`load_mooncake` does, on first use, and raises
:class:`MooncakeUnavailable` naming ``scripts/install-mooncake.sh`` when it
cannot. What the install script sets up (``research/deps-probe.md`` §2):

* the wheel ``mooncake-transfer-engine-non-cuda==0.3.13.post1`` (never the
  CUDA wheel ``mooncake-transfer-engine``: same ``mooncake`` package);
* ``libibverbs.so.1``, its only missing system library: either system-wide
  (``apt-get install libibverbs1``) or unpacked without root into
  ``<venv>/sysroot`` (``apt-get download`` + ``dpkg -x``). In the second case
  :func:`load_mooncake` preloads libnl-3, libnl-route-3 and libibverbs from
  there with ``ctypes`` (``RTLD_GLOBAL``) before importing, so the dynamic
  loader resolves ``engine.so``'s dependency by soname and no
  ``LD_LIBRARY_PATH`` is needed. ``EI_MOONCAKE_SYSROOT`` overrides the folder.

Ports. With ``P2PHANDSHAKE`` metadata Mooncake 0.3.13 ignores the port in
``local_hostname``: it picks the RPC/handshake port and the TCP data port at
random in ``[MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]`` (default 15000–17000, the
RPC socket held from probe to listen). The range is read **once per process,
when ``mooncake.engine`` is imported**, and must lie within 1024–32767
(Mooncake rejects a range above 32767 and falls back to the default). So an
explicit range (:func:`set_port_range`, needs ≥ 2 ports: RPC + TCP data) must
be set before the first :func:`load_mooncake`. Both sockets bind to all
interfaces (``0.0.0.0`` / ``*``) whatever ``host`` is — deps-probe §2;
``MC_TCP_BIND_ADDRESS`` does not change it — so peers must only be addressed
on 127.0.0.1 in tests and the ports must be firewalled on shared hosts.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import random
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

INSTALL_SCRIPT = "scripts/install-mooncake.sh"
WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
PORT_MIN, PORT_MAX = 1024, 32767
"""Port range Mooncake 0.3.13 accepts for MC_MIN_RPC_PORT / MC_MAX_RPC_PORT."""

_PRELOAD = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
# Process-wide, like Mooncake's own configuration: one import, one port range.
_LOADED: dict[str, Any] = {"module": None, "error": None, "preloaded": [], "ports": None}


class MooncakeUnavailable(RuntimeError):
    """``mooncake.engine`` cannot be imported (wheel or libibverbs missing)."""


class TransferError(RuntimeError):
    """The transfer engine failed to initialise, register memory or move bytes."""


def sysroot_dirs() -> list[Path]:
    """Folders searched for an unpacked libibverbs: ``$EI_MOONCAKE_SYSROOT`` entries, then ``<venv>/sysroot``."""
    dirs = [Path(p) for p in os.environ.get("EI_MOONCAKE_SYSROOT", "").split(os.pathsep) if p]
    dirs.append(Path(sys.prefix) / "sysroot")
    return dirs


def _find_lib(name: str) -> Path | None:
    for root in sysroot_dirs():
        for sub in ("usr/lib", "lib", "usr/lib64", "lib64"):
            base = root / sub
            if not base.is_dir():
                continue
            direct = base / name
            if direct.exists():
                return direct
            for hit in sorted(base.glob(f"*/{name}")):
                return hit
    return None


def _preload_sysroot() -> list[str]:
    loaded: list[str] = []
    for name in _PRELOAD:
        path = _find_lib(name)
        if path is None:
            continue
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        loaded.append(str(path))
    return loaded


def set_port_range(lo: int, hi: int) -> None:
    """Make Mooncake pick its RPC and TCP data ports in ``[lo, hi]`` (this process).

    Must be called before the first :func:`load_mooncake` (Mooncake reads the
    range at import). Calling it again with the same range is a no-op.

    Raises:
        ValueError: if the range is outside 1024–32767 or has fewer than 2 ports.
        RuntimeError: if Mooncake is already imported with another range.
    """
    if not (PORT_MIN <= lo < hi <= PORT_MAX):
        raise ValueError(
            f"Mooncake port range [{lo}, {hi}] must satisfy {PORT_MIN} <= lo < hi <= {PORT_MAX} "
            "(two ports at least: RPC/handshake and TCP data)"
        )
    if _LOADED["module"] is not None:
        if _LOADED["ports"] != (lo, hi):
            raise RuntimeError(
                f"mooncake.engine is already imported with port range {_LOADED['ports']}; "
                "set the range before the first transfer engine is created"
            )
        return
    for key in ("MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT"):  # 0.3.13 reads both spellings
        os.environ[key] = str(lo)
    for key in ("MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT"):
        os.environ[key] = str(hi)
    _LOADED["ports"] = (lo, hi)


def _free(lo: int, width: int) -> bool:
    """Whether ports ``lo`` .. ``lo + width - 1`` can all be bound on ``0.0.0.0`` right now (each closed at once)."""
    socks: list[socket.socket] = []
    try:
        for port in range(lo, lo + width):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def pick_port_range(rng: random.Random | None = None, *, low: int = 20000, high: int = PORT_MAX, width: int = 2) -> tuple[int, int]:
    """``width`` (at least 2) adjacent ports in ``[low, high]`` that are free on all interfaces right now: ``(first, last)``;
    :func:`pick_port_ranges`' one range (the search ends: each aligned range probed at most once).

    Mooncake binds ``0.0.0.0``, so every port of the range is probed there. The kernel's
    ephemeral range (32768+) is out of reach (see module doc), so ports are
    taken below it; a port taken between this probe and Mooncake's
    bind makes ``initialize`` fail with a clear :class:`TransferError`.

    Raises:
        ValueError: ``width`` below 2 or wider than ``[low, high]``.
        TransferError: if no range of ``width`` free ports is found.
    """
    return pick_port_ranges(1, rng, low=low, high=high, width=width)[0]


def pick_port_ranges(
    count: int, rng: random.Random | None = None, *, low: int = 20000, high: int = PORT_MAX, width: int = 2
) -> list[tuple[int, int]]:
    """``count`` ranges of ``width`` adjacent ports in ``[low, high]``, free on all interfaces right now and sharing no
    port: ``[(first, last), ...]``, one per worker of a host (``up --kv-pool real``).

    The ranges are the ``(high - low + 1) // width`` aligned ones of ``[low, high]``, tried in order from a random one
    (wrapping around), so a second ``up`` on the host most likely starts elsewhere, and the search ends: at most every
    aligned range probed once (one range drawn at random again until the ranges did not overlap never ended past
    about 300 workers of 32 ports: ``[20000, 32767]`` holds 399).

    Raises:
        ValueError: ``count`` below 0, or ``width`` below 2 or wider than ``[low, high]``.
        TransferError: ``count`` ranges do not fit in ``[low, high]``, or fewer are free (says how many).
    """
    if width < 2 or high - low + 1 < width:
        raise ValueError(f"port range width {width}: at least 2, at most {high - low + 1} in [{low}, {high}]")
    if count < 0:
        raise ValueError(f"{count} port ranges: 0 or more")
    slots = (high - low + 1) // width
    if count > slots:
        raise TransferError(f"{count} ranges of {width} ports do not fit in [{low}, {high}] ({slots} do)")
    first = (rng or random.Random()).randrange(slots)
    out: list[tuple[int, int]] = []
    for k in range(slots):
        if len(out) == count:
            break
        lo = low + (first + k) % slots * width
        if _free(lo, width):
            out.append((lo, lo + width - 1))
    if len(out) < count:
        raise TransferError(f"only {len(out)} of {count} ranges of {width} free TCP ports found in [{low}, {high}]")
    return out


def load_mooncake() -> ModuleType:
    """Import and return ``mooncake.engine`` (cached per process).

    Sets ``MC_LOG_LEVEL=WARNING`` unless the environment says otherwise, and
    preloads libibverbs from a sysroot when the plain import misses it.

    Raises:
        MooncakeUnavailable: with the import error and the install command.
    """
    if _LOADED["module"] is not None:
        return _LOADED["module"]
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        mod = importlib.import_module("mooncake.engine")
    except ImportError as first:
        preloaded: list[str] = []
        if "libibverbs" in str(first) or "libnl" in str(first):
            try:
                preloaded = _preload_sysroot()
            except OSError as e:
                _LOADED["error"] = f"{first}; preloading from {sysroot_dirs()} failed: {e}"
                raise MooncakeUnavailable(_unavailable_msg(_LOADED["error"])) from e
        if not preloaded:
            _LOADED["error"] = str(first)
            raise MooncakeUnavailable(_unavailable_msg(str(first))) from first
        try:
            mod = importlib.import_module("mooncake.engine")
        except ImportError as second:
            _LOADED["error"] = f"{second} (after preloading {preloaded})"
            raise MooncakeUnavailable(_unavailable_msg(_LOADED["error"])) from second
        _LOADED["preloaded"] = preloaded
    _LOADED["module"] = mod
    if _LOADED["ports"] is None:
        lo, hi = os.environ.get("MC_MIN_RPC_PORT"), os.environ.get("MC_MAX_RPC_PORT")
        _LOADED["ports"] = (int(lo), int(hi)) if lo and hi else None
    return mod


def _unavailable_msg(err: str) -> str:
    return (
        f"real-bytes KV pool needs Mooncake's transfer engine, which does not import here ({err}). "
        f"Install it with: {INSTALL_SCRIPT} (pip {WHEEL} + libibverbs1; VENV=<venv> to pick the venv)"
    )


def mooncake_available() -> tuple[bool, str]:
    """``(True, "")`` if :func:`load_mooncake` succeeds, else ``(False, reason)``. Never raises."""
    try:
        load_mooncake()
    except MooncakeUnavailable as e:
        return False, str(e)
    return True, ""


def mooncake_status() -> str:
    """One line: the module path, whether CUDA is compiled in, preloaded libraries, port range."""
    mod = load_mooncake()
    return (
        f"mooncake.engine {getattr(mod, '__file__', '?')} SUPPORT_CUDA={getattr(mod, 'SUPPORT_CUDA', '?')} "
        f"preloaded={_LOADED['preloaded'] or 'none (system libibverbs)'} ports={_LOADED['ports'] or 'default 15000-17000'}"
    )


class MooncakeEndpoint:
    """One Mooncake ``TransferEngine`` of this process: P2PHANDSHAKE metadata, TCP by default.

    Args:
        host: address peers use to reach this process (the session id is
            ``host:rpc_port``); 127.0.0.1 for one machine.
        protocol: Mooncake transport, ``tcp`` on CPU machines (``rdma`` needs HCAs).

    Attributes:
        session: the session id peers pass as ``target`` (``"host:rpc_port"``).

    Raises:
        MooncakeUnavailable: Mooncake does not import.
        TransferError: ``initialize`` failed (e.g. no free port in the range).
    """

    def __init__(self, *, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        mod = load_mooncake()
        self._te = mod.TransferEngine()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise TransferError(
                f"TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}) returned {rc} "
                f"(port range {_LOADED['ports'] or 'default 15000-17000'})"
            )
        self.host = host
        self.protocol = protocol
        self.rpc_port = int(self._te.get_rpc_port())
        self.session = f"{host}:{self.rpc_port}"
        self._registered: dict[int, int] = {}

    def register(self, memory: np.ndarray) -> int:
        """Register a contiguous host array for remote access; returns its base address.

        The array must stay alive (and unmoved) until :meth:`unregister`.

        Raises:
            ValueError: if ``memory`` is not C-contiguous.
            TransferError: if Mooncake refuses the registration.
        """
        if not memory.flags.c_contiguous:
            raise ValueError("only C-contiguous arrays can be registered")
        addr, size = int(memory.ctypes.data), int(memory.nbytes)
        if addr in self._registered:
            return addr
        rc = self._te.register_memory(addr, size)
        if rc != 0:
            raise TransferError(f"register_memory({addr:#x}, {size}) returned {rc}")
        self._registered[addr] = size
        return addr

    def unregister(self, addr: int) -> None:
        """Unregister a region registered with :meth:`register` (unknown addresses are ignored)."""
        if self._registered.pop(addr, None) is not None:
            self._te.unregister_memory(addr)

    def read(self, peer_session: str, local_addrs: Sequence[int], remote_addrs: Sequence[int], lengths: Sequence[int]) -> int:
        """Pull ``lengths[i]`` bytes from ``remote_addrs[i]`` in the peer's registered
        memory into ``local_addrs[i]`` (registered here), as one batch; blocks
        until done and releases the GIL meanwhile (run it in a thread from asyncio).

        Returns Mooncake's status: 0 when every transfer of the batch
        succeeded, negative when any failed (the batch API does not say which).
        """
        if not local_addrs:
            return 0
        return int(self._te.batch_transfer_sync_read(peer_session, list(local_addrs), list(remote_addrs), list(lengths)))

    def read_one(self, peer_session: str, local_addr: int, remote_addr: int, length: int) -> int:
        """One synchronous read (0 = ok); used to find which blocks of a failed batch fail."""
        return int(self._te.transfer_sync_read(peer_session, local_addr, remote_addr, length))

    def close(self) -> None:
        """Unregister every region. The engine itself ends with the process (Mooncake has no shutdown call)."""
        for addr in list(self._registered):
            self.unregister(addr)
