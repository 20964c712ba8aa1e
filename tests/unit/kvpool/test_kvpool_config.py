"""Pool geometry, port ranges and the optional Mooncake import (no Mooncake needed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.worker.kvpool.config import DEFAULT_MAX_POOL_BYTES, KvPoolSettings, parse_port_range, pool_geometry
from services.worker.kvpool.transport import TransferError, pick_port_range, pick_port_ranges
from shared.profile import load_profile

REPO = Path(__file__).resolve().parents[3]


def test_geometry_of_the_tiny_profile_mirrors_its_l2():
    prof = load_profile("tiny")
    slots, sb = pool_geometry(prof)
    assert slots == prof.host_blocks == 256
    assert sb == prof.block_size * prof.kv_bytes_per_token == 4000  # smaller than the 64 KiB cap
    assert pool_geometry(prof, slot_bytes=1 << 16) == (256, 1 << 16)


def test_geometry_of_the_gb300_profile_needs_an_explicit_budget():
    prof = load_profile("gb300-glm52")
    with pytest.raises(ValueError, match="kv_pool_max_bytes"):
        pool_geometry(prof)  # 128,750 host blocks × 64 KiB ≈ 7.9 GiB > 1 GiB
    slots, sb = pool_geometry(prof, slot_bytes=4096)
    assert slots == prof.host_blocks and slots * sb <= DEFAULT_MAX_POOL_BYTES
    with pytest.raises(ValueError):
        pool_geometry(prof, slot_bytes=16)


def test_port_ranges():
    assert parse_port_range("") is None
    assert parse_port_range("21000-21001") == (21000, 21001)
    for bad in ("21000", "a-b", "21000-21000", "40000-40001", "1000-1001"):
        with pytest.raises(ValueError):
            parse_port_range(bad)
    lo, hi = pick_port_range()
    assert hi == lo + 1 and 20000 <= lo < 32767
    lo, hi = pick_port_range(width=32, low=32700)  # a worker's range under up --kv-pool real, its end at most PORT_MAX
    assert hi == lo + 31 and 32700 <= lo and hi <= 32767
    with pytest.raises(ValueError, match="width 1"):
        pick_port_range(width=1)


def test_port_ranges_for_a_host_are_free_disjoint_and_bounded():
    import random
    import socket

    got = pick_port_ranges(4, random.Random(7), width=32)
    assert len(got) == 4 and all(hi - lo == 31 and 20000 <= lo and hi <= 32767 for lo, hi in got)
    assert len({p for lo, hi in got for p in range(lo, hi + 1)}) == 4 * 32
    with socket.socket() as s:  # a taken port's range is skipped, whichever range the search starts from
        for port in range(29001, 29400, 4):
            try:
                s.bind(("0.0.0.0", port))
                break
            except OSError:
                continue
        for seed in range(4):
            assert pick_port_ranges(1, random.Random(seed), low=port - 1, high=port + 2) == [(port + 1, port + 2)]
    assert pick_port_ranges(0) == []
    with pytest.raises(TransferError, match="3 ranges of 2 ports do not fit in"):
        pick_port_ranges(3, low=30000, high=30004)
    with pytest.raises(ValueError, match="width 1"):
        pick_port_ranges(1, width=1)


def test_settings_default_to_off():
    s = KvPoolSettings()
    assert s.kv_pool == "off" and s.kv_pool_slot_bytes == 0 and s.kv_pool_lease_s == 5.0


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_package_imports_without_loading_mooncake():
    r = _run(
        """
        import sys
        import services.worker.kvpool as kp
        from services.worker.kvpool import HostKvBuffer
        HostKvBuffer(2, 64).put(1, 0.0)
        assert "mooncake" not in sys.modules and "mooncake.engine" not in sys.modules, sorted(sys.modules)
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_missing_mooncake_raises_a_clear_error_naming_the_install_script():
    # Hide the package the way a venv without the wheel would.
    r = _run(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "mooncake" or name.startswith("mooncake."):
                    raise ModuleNotFoundError(f"No module named {name!r}")
        sys.meta_path.insert(0, Block())
        from services.worker.kvpool.transport import MooncakeUnavailable, mooncake_available, MooncakeEndpoint
        ok, why = mooncake_available()
        assert not ok and "scripts/install-mooncake.sh" in why, why
        try:
            MooncakeEndpoint()
        except MooncakeUnavailable as e:
            print("raised:", e)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "raised:" in r.stdout and "install-mooncake.sh" in r.stdout
