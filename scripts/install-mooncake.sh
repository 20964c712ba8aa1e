#!/usr/bin/env bash
# Install Mooncake's transfer engine (CPU/TCP wheel) for the real-bytes host KV
# pool (services/worker/kvpool, issue 6 part 2) into the project venv.
#
#   scripts/install-mooncake.sh            # venv ./.venv (what `make install` creates)
#   VENV=/path/to/venv scripts/install-mooncake.sh
#
# Idempotent: every step checks first and says what it does. Steps:
#   1. refuse if the CUDA wheel `mooncake-transfer-engine` is installed (same
#      top-level `mooncake` package; the two conflict);
#   2. pip install mooncake-transfer-engine-non-cuda==0.3.13.post1;
#   3. make libibverbs.so.1 loadable (the wheel's only missing system library):
#      nothing to do if the system already has it (ldconfig); otherwise, without
#      root and without touching the system, `apt-get download` libibverbs1,
#      libnl-3-200 and libnl-route-3-200 and `dpkg -x` them into $VENV/sysroot.
#      services.worker.kvpool.transport preloads the libraries from there, so no
#      LD_LIBRARY_PATH is needed;
#   4. check that `mooncake.engine` imports through that loader.
# Exits non-zero with a message naming the failed step.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
WHEEL_NAME="mooncake-transfer-engine-non-cuda"
WHEEL_VERSION="0.3.13.post1"
SYSROOT="$VENV/sysroot"
DEBS=(libibverbs1 libnl-3-200 libnl-route-3-200)

log() { echo "[install-mooncake] $*"; }
die() { echo "[install-mooncake] ERROR: $*" >&2; exit 1; }

[ -x "$PY" ] || die "no Python at $PY: create the venv first ('make install') or set VENV=<venv dir>"

# 1. the CUDA wheel ships the same 'mooncake' package and does not import without CUDA.
if "$PY" -m pip show mooncake-transfer-engine >/dev/null 2>&1; then
    die "the CUDA wheel 'mooncake-transfer-engine' is installed in $VENV; it conflicts with $WHEEL_NAME. Remove it first: $PY -m pip uninstall -y mooncake-transfer-engine"
fi
log "step 1: no conflicting CUDA wheel (mooncake-transfer-engine) in $VENV"

# 2. the wheel
installed="$("$PY" -m pip show "$WHEEL_NAME" 2>/dev/null | sed -n 's/^Version: //p' || true)"
if [ "$installed" = "$WHEEL_VERSION" ]; then
    log "step 2: $WHEEL_NAME $WHEEL_VERSION already installed in $VENV"
else
    log "step 2: pip install $WHEEL_NAME==$WHEEL_VERSION into $VENV${installed:+ (replacing $installed)}"
    "$PY" -m pip install --quiet "$WHEEL_NAME==$WHEEL_VERSION" \
        || die "step 2: pip install $WHEEL_NAME==$WHEEL_VERSION failed (is the package index reachable?)"
fi

# 3. libibverbs.so.1
if command -v ldconfig >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    log "step 3: the system already provides libibverbs.so.1 (ldconfig); nothing to unpack"
elif compgen -G "$SYSROOT/usr/lib/*/libibverbs.so.1" >/dev/null || compgen -G "$SYSROOT/lib/*/libibverbs.so.1" >/dev/null; then
    log "step 3: libibverbs.so.1 already unpacked under $SYSROOT"
else
    command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1 \
        || die "step 3: libibverbs.so.1 is missing and this is not a Debian/Ubuntu system (no apt-get/dpkg). Install rdma-core's libibverbs (package libibverbs1 / libibverbs) with the system package manager, then rerun."
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    log "step 3: apt-get download ${DEBS[*]} (no root needed) into $tmp"
    if ! (cd "$tmp" && apt-get download -q "${DEBS[@]}" >/dev/null 2>&1); then
        if [ "$(id -u)" = "0" ]; then
            log "step 3: download failed; refreshing the package lists (apt-get update, root) and retrying"
            apt-get update -qq >/dev/null 2>&1 || die "step 3: apt-get update failed"
            (cd "$tmp" && apt-get download -q "${DEBS[@]}" >/dev/null 2>&1) \
                || die "step 3: apt-get download ${DEBS[*]} failed even after apt-get update"
        else
            die "step 3: apt-get download ${DEBS[*]} failed; the package lists may be empty. Run 'sudo apt-get update' (or 'sudo apt-get install -y libibverbs1') and rerun."
        fi
    fi
    mkdir -p "$SYSROOT"
    for deb in "$tmp"/*.deb; do
        log "step 3: dpkg -x $(basename "$deb") $SYSROOT"
        dpkg -x "$deb" "$SYSROOT" || die "step 3: dpkg -x $deb failed"
    done
fi

# 4. check the import the way the pool does it (sysroot preload included)
log "step 4: checking that mooncake.engine imports"
"$PY" - <<'EOF' || die "step 4: mooncake.engine does not import (see the error above)"
from services.worker.kvpool.transport import load_mooncake, mooncake_status
load_mooncake()
print("[install-mooncake] step 4:", mooncake_status())
EOF
log "done"
